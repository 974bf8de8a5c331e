#!/usr/bin/env python3
"""Lists the import circles among each crate's files.

A file depends on another when it names an item the other defines: through
`use crate::…`, `use super::…`, `use self::…` (grouped trees included), an
inline path that starts with `crate::`, `super::` or a child module's name,
but not through a re-export (`pub use child::Item`: a facade names what
its children define, it does not use it). A name is followed through the `use` that brings it into a
module, so `use crate::Error` counts as a dependency on the file that
defines `Error`, not on the `lib.rs` re-exporting it. `mod child;` alone is
no dependency, and neither is code under `#[cfg(test)]` (a test may reach
anywhere). Files that depend on each other, directly or around a loop, form
a circle (a strongly connected component of more than one file).

    python3 ci/import_circles.py [CRATE_DIR ...]     (default: every workspace crate)

Prints each circle with the edges that close it, then `N circles`; exits 1
when there is any circle that is not listed in ALLOWED with its reason.
"""

import os
import re
import sys

# Circles that are a real mutual dependency, each with why (also said in a
# comment in the files). Keyed by the sorted tuple of the files.
ALLOWED = {
    ("devices/src/api.rs", "devices/src/checks.rs", "devices/src/view.rs"): "the backend traits take views of their "
    "buffers, a view is of a backend's buffer, and the traits' provided batch methods check every piece first",
    ("devices/src/cpu/device.rs", "devices/src/cpu/event.rs", "devices/src/cpu/stream.rs"): "the device makes its "
    "streams and events, and each holds its device",
    ("cli/src/launch.rs", "cli/src/launch/attempts.rs", "cli/src/launch/nodes.rs", "cli/src/launch/ranks.rs"): "one "
    "Job whose phases (its attempts among them) are written beside what they use: the job holds their types, and "
    "they extend it",
    ("devices/src/cuda/device.rs", "devices/src/cuda/event.rs", "devices/src/cuda/host.rs", "devices/src/cuda/memory.rs",
     "devices/src/cuda/stream.rs"): "the device makes its streams, events and buffers, each holds its device, and a "
    "host buffer is released in the order of the streams that used it",
    ("devices/src/hip/device.rs", "devices/src/hip/event.rs", "devices/src/hip/host.rs", "devices/src/hip/stream.rs"):
    "the device makes its streams, events and buffers, each holds its device, and a host buffer is released in the "
    "order of the streams that used it",
    ("plan/src/virt/device.rs", "plan/src/virt/stream.rs"): "the device makes its streams, and each holds its device",
    ("cli/src/plan.rs", "cli/src/train/args.rs"): "one job file serves both commands: train passes over a plan's own "
    "flags in it, and a plan over the run's",
    ("fsdp/candle/src/module.rs", "fsdp/candle/src/module/stage_op.rs"): "the model makes one op per stage, and each "
    "op runs on the model's shared state (a child module on its parent's state)",
}

ITEM = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|async\s+|const\s+|extern\s+\"[^\"]*\"\s+)*"
    r"(fn|struct|enum|trait|const|static|type|union|macro_rules!)\s+(?:mut\s+)?([A-Za-z_][A-Za-z0-9_]*)",
    re.M,
)
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", re.M)
INLINE_MOD = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*\{", re.M)
USE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)
PATH = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self|[a-z_][a-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def strip(text):
    """Source without comments, string and char literals (kept as blanks, lines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 20]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or re.match(r"'\\(x..|u\{[0-9a-fA-F]+\})'", text[i:i + 12]):
            m = re.match(r"'(\\x..|\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(text, open_brace):
    depth = 0
    for j in range(open_brace, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def drop_cfg_test(text):
    """The text without `#[cfg(test)]` items (a module block, a fn, an impl, or a `mod x;`)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]", text)
        if not m:
            return text
        rest = m.end()
        semi, brace = text.find(";", rest), text.find("{", rest)
        if brace < 0 or 0 <= semi < brace:
            end = semi + 1
        else:
            end = block_end(text, brace)
        text = text[:m.start()] + "\n" * text.count("\n", m.start(), end) + text[end:]


def use_tree(tree):
    """The (path, local name) pairs of a use tree: `a::{b, c::{d as e, self}}`
    -> [(a::b, b), (a::c::d, e), (a::c, c)]."""
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree.strip())
    tree = re.sub(r"\s+", " ", tree)
    if tree.startswith("::"):
        tree = tree[2:]

    def split_top(inner):
        items, depth, cur = [], 0, ""
        for ch in inner:
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        return items + [cur]

    def expand(prefix, t):
        if "{" not in t:
            path, _, alias = t.partition(" as ")
            parts = prefix + [p for p in path.split("::") if p]
            if parts and parts[-1] == "self":
                parts = parts[:-1]
            if not parts:
                return []
            return [(parts, alias or parts[-1])]
        head, inner = t.split("{", 1)
        inner = inner[: inner.rfind("}")]
        base = prefix + [p for p in head.split("::") if p]
        return [pair for it in split_top(inner) if it for pair in expand(base, it)]

    return expand([], tree)


class Module:
    def __init__(self, path, file):
        self.path = path  # ["crate", "a", "b"]
        self.file = file
        self.children = {}  # name -> Module
        self.items = set()
        self.imports = {}  # local name -> absolute path (list)
        self.refs = []  # (absolute path, local file) referenced from this module's code


def parse_crate(crate_dir):
    src = os.path.join(crate_dir, "src")
    root_file = next((os.path.join(src, f) for f in ("lib.rs", "main.rs") if os.path.exists(os.path.join(src, f))), None)
    if root_file is None:
        return None
    modules = {}
    exported = {}

    def load(path, file, dir_for_children, text=None):
        mod = Module(path, file)
        modules[tuple(path)] = mod
        if text is None:
            with open(file, encoding="utf-8") as f:
                text = drop_cfg_test(strip(f.read()))
        # Inline modules: their text is theirs, not the file's module's.
        own = text
        for m in list(INLINE_MOD.finditer(text)):
            start = m.end() - 1
            end = block_end(text, start)
            child = load(path + [m.group(1)], file, os.path.join(dir_for_children, m.group(1)), text[start + 1:end - 1])
            mod.children[m.group(1)] = child
            own = own.replace(text[m.start():end], "\n" * text.count("\n", m.start(), end), 1)
        for m in MOD_DECL.finditer(own):
            name = m.group(1)
            pre = own[max(0, m.start() - 200):m.start()]
            pm = re.search(r'#\[path\s*=\s*""\]\s*$', pre)
            candidates = [os.path.join(dir_for_children, name + ".rs"), os.path.join(dir_for_children, name, "mod.rs")]
            child_file = next((c for c in candidates if os.path.exists(c)), None)
            if child_file is None:
                continue
            child_dir = os.path.join(dir_for_children, name)
            mod.children[name] = load(path + [name], child_file, child_dir)
        mod.items = {m.group(2) for m in ITEM.finditer(own)}
        mod.text = own
        # `#[macro_export]` puts a macro at the crate's root, whatever file defines it.
        for m in re.finditer(r"#\[macro_export\]\s*macro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)", own):
            exported[m.group(1)] = mod
        return mod

    root_dir = os.path.dirname(root_file)
    load(["crate"], root_file, root_dir)
    modules[("crate",)].exported = exported
    return modules


def absolute(mod_path, parts):
    """`parts` (a path as written in module `mod_path`) made absolute, or None for another crate's."""
    if not parts:
        return None
    p = list(mod_path)
    i = 0
    if parts[0] == "crate":
        p, i = ["crate"], 1
    elif parts[0] in ("super", "self"):
        while i < len(parts) and parts[i] in ("super", "self"):
            if parts[i] == "super":
                p = p[:-1]
            i += 1
    else:
        return None
    return p + parts[i:]


def collect(modules):
    for mod in modules.values():
        for m in USE.finditer(mod.text):
            reexport = m.group(0).lstrip().startswith("pub")
            for parts, local in use_tree(m.group(1)):
                if parts[0] in mod.children:
                    absp = mod.path + parts
                else:
                    absp = absolute(mod.path, parts)
                if absp is None:
                    continue
                if parts[-1] == "*":
                    if not reexport:
                        mod.refs.append(absp[:-1])
                    continue
                mod.imports[local] = absp
                if not reexport:
                    mod.refs.append(absp)
        for m in PATH.finditer(USE.sub("", mod.text)):
            parts = m.group(1).split("::")
            if parts[0] in ("crate", "super", "self"):
                absp = absolute(mod.path, parts)
            elif parts[0] in mod.children:
                absp = mod.path + parts
            elif parts[0] in mod.imports and tuple(mod.imports[parts[0]]) in modules:
                absp = mod.imports[parts[0]] + parts[1:]
            else:
                continue
            if absp:
                mod.refs.append(absp)


def resolve(modules, absp, seen=None):
    """The module whose file defines what `absp` names (following `use`s), or None."""
    seen = seen or set()
    if tuple(absp) in seen:
        return None
    seen.add(tuple(absp))
    mod = modules.get(("crate",))
    i = 1
    while i < len(absp) and absp[i] in mod.children:
        mod = mod.children[absp[i]]
        i += 1
    if i == len(absp):
        return mod
    name = absp[i]
    if name in mod.items:
        return mod
    if i == 1 and name in modules[("crate",)].exported:
        return modules[("crate",)].exported[name]
    if name in mod.imports:
        target = mod.imports[name] + absp[i + 1:]
        if target[0] == "crate":
            return resolve(modules, target, seen) or mod
    return mod


def circles(crate_dir):
    modules = parse_crate(crate_dir)
    if modules is None:
        return [], {}
    collect(modules)
    edges = {}
    for mod in modules.values():
        for ref in mod.refs:
            target = resolve(modules, ref)
            if target is not None and target.file != mod.file:
                edges.setdefault(mod.file, {}).setdefault(target.file, "::".join(ref))
    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
    files = sorted({m.file for m in modules.values()})

    def visit(v):
        work = [(v, iter(sorted(edges.get(v, {}))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                    advanced = True
                    break
                elif w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))

    for f in files:
        if f not in index:
            visit(f)
    return sccs, edges


def workspace_crates(root):
    with open(os.path.join(root, "Cargo.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"members\s*=\s*\[([^\]]*)\]", text)
    return [os.path.join(root, p.strip().strip('"')) for p in m.group(1).split(",") if p.strip()]


def main(argv):
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    crates = argv or workspace_crates(root)
    total, unexplained = 0, 0
    for crate in crates:
        sccs, edges = circles(crate)
        for comp in sccs:
            total += 1
            rel = tuple(os.path.relpath(f, root) for f in comp)
            why = ALLOWED.get(tuple(sorted(rel)))
            if why is None:
                unexplained += 1
            print(f"circle of {len(comp)} files{' (allowed: ' + why + ')' if why else ''}:")
            inside = set(comp)
            for a in comp:
                for b, via in sorted(edges.get(a, {}).items()):
                    if b in inside:
                        print(f"  {os.path.relpath(a, root)} -> {os.path.relpath(b, root)}  ({via})")
    print(f"{total} circles, {unexplained} without a reason")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
