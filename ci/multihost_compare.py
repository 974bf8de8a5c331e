#!/usr/bin/env python3
"""Compares the tensors two training runs wrote: every `.npy` (float32) and
`.safetensors` (F32/F16/BF16) file of directory A against the file of the
same name in B, element by element, within a tolerance. Plain Python (no
NumPy): the namespace hosts' checks run before any venv exists.

    ci/multihost_compare.py A B [--tol 1e-6] [--files N]

Prints one line per file and exits non-zero on any difference above the
tolerance, a missing file, or (with --files) another number of files.
"""
import argparse
import ast
import json
import os
import struct
import sys


def npy(path):
    b = open(path, "rb").read()
    if b[:6] != b"\x93NUMPY":
        raise ValueError(f"{path}: not a .npy file")
    n, start = (struct.unpack("<H", b[8:10])[0], 10) if b[6] == 1 else (struct.unpack("<I", b[8:12])[0], 12)
    header = ast.literal_eval(b[start:start + n].decode())
    if header["descr"] != "<f4":
        raise ValueError(f"{path}: dtype {header['descr']}, expected <f4")
    data = b[start + n:]
    return {"": struct.unpack("<%df" % (len(data) // 4), data)}


def floats(dtype, raw):
    if dtype == "F32":
        return struct.unpack("<%df" % (len(raw) // 4), raw)
    if dtype == "F16":
        return struct.unpack("<%de" % (len(raw) // 2), raw)
    if dtype == "BF16":
        # bf16 is the upper half of an f32.
        halves = struct.unpack("<%dH" % (len(raw) // 2), raw)
        return struct.unpack("<%df" % len(halves), struct.pack("<%dI" % len(halves), *(h << 16 for h in halves)))
    raise ValueError(f"dtype {dtype} is not compared")


def safetensors(path):
    b = open(path, "rb").read()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8:8 + n])
    body = b[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        out[name] = floats(t["dtype"], body[lo:hi])
    return out


def tensors(path):
    return npy(path) if path.endswith(".npy") else safetensors(path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--files", type=int)
    args = p.parse_args()
    names = sorted(f for f in os.listdir(args.a) if f.endswith((".npy", ".safetensors")))
    if args.files is not None and len(names) != args.files:
        sys.exit(f"{args.a}: {len(names)} tensor files, expected {args.files}: {names}")
    if not names:
        sys.exit(f"{args.a}: no .npy or .safetensors files")
    worst_all = 0.0
    for name in names:
        other = os.path.join(args.b, name)
        if not os.path.exists(other):
            sys.exit(f"{other}: missing")
        a, b = tensors(os.path.join(args.a, name)), tensors(other)
        if sorted(a) != sorted(b):
            sys.exit(f"{name}: the tensors differ: {sorted(a)} vs {sorted(b)}")
        worst = 0.0
        for key in a:
            if len(a[key]) != len(b[key]):
                sys.exit(f"{name} {key}: {len(a[key])} vs {len(b[key])} elements")
            for x, y in zip(a[key], b[key]):
                d = abs(x - y)
                if not d <= args.tol:  # NaN is a difference too
                    sys.exit(f"{name} {key}: {x} vs {y} (difference {d} > {args.tol})")
                worst = max(worst, d)
        worst_all = max(worst_all, worst)
    print(f"{len(names)} tensor files of {args.a} equal {args.b}'s within {args.tol} (largest difference {worst_all:.3g})")


if __name__ == "__main__":
    main()
