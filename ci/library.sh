#!/usr/bin/env bash
# The library crate `chorus` as its users meet it: every example run (the
# README's "Use chorus as a library" and docs/library.md point to them) on
# sim, and on ucx as 4 processes under `chorus launch`; a user's crate with
# candle-cuda resolved with candle patched; alone, the library's rustdoc
# without a warning. Its tests, doctests, clippy over its GPU branches
# and every crate's rustdoc are ci/test.sh's (the workspace's tests, the
# doctests beside the namespace hosts, the clippy and rustdoc steps).
#
#   bash ci/library.sh [CARGO_ARGS...]
#
# CARGO_ARGS select the build the examples come from; ci/test.sh passes its
# workspace build's (`--workspace --features ... --config ...`), so the
# examples are that build's and nothing is built again but the library with
# `ucx`. Alone the default is `--workspace --features chorus/candle`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

run() { printf '+ %s\n' "$*"; "$@"; }

build=("$@")
[ "${#build[@]}" -gt 0 ] || build=(--workspace --features chorus/candle)
examples="$CARGO_TARGET_DIR/debug/examples"

# `cargo test --no-run` builds the examples as binaries (test = true ones
# too) in the test profile, the units the tests use: with ci/test.sh's
# arguments this finds them built. The last build of an example is the one
# under debug/examples.
run cargo test -q --no-run "${build[@]}"
# Every example run as a user runs it (`cargo run -p chorus --features candle
# --example NAME`); each checks its own values and exits non-zero otherwise.
# testing_your_code is run as its users run it, `cargo test --example
# testing_your_code`: its tests are the workspace's (cargo builds an example
# with `test = true` as a test only).
for example in collectives own_model same_main; do
    run "$examples/$example"
done
if [ "$#" = 0 ]; then
    run cargo test -q "${build[@]}" --example testing_your_code
fi

# The same main on ucx: the library with `ucx` (only the library and its
# examples are built again: no other crate depends on it), 4 processes under
# `chorus launch` of the workspace's build, one rank each.
[ -x "$CARGO_TARGET_DIR/debug/chorus" ] || { echo "no $CARGO_TARGET_DIR/debug/chorus: build the workspace first" >&2; exit 1; }
# A second --features adds to the first: the same resolution plus the library's `ucx`.
run cargo test -q --no-run "${build[@]}" --features chorus/ucx
run "$CARGO_TARGET_DIR/debug/chorus" launch --nproc-per-node 4 -- "$examples/collectives"
run "$CARGO_TARGET_DIR/debug/chorus" launch --nproc-per-node 2 -- "$examples/same_main"
# Back to the build's own examples (nothing is compiled: both builds' units are kept).
run cargo test -q --no-run "${build[@]}"

# A user's own crate with candle on the GPU (docs/library.md, "The GPU in your
# crate"): with ci/candle-cuda.sh's patch.toml, it resolves with a dependency
# outside chorus's lock, candle from the patched copy and cudarc in chorus's
# one loading mode (its whole build, ~12 minutes cold, is measured in the doc).
cfg="$(bash ci/candle-cuda.sh)"
user="$(mktemp -d)"
trap 'rm -rf "$user"' EXIT
mkdir -p "$user/src"
cat >"$user/Cargo.toml" <<EOF
[package]
name = "my-trainer"
version = "0.1.0"
edition = "2021"

[dependencies]
chorus = { path = "$PWD/chorus", features = ["candle"] }
oorandom = "=11.1.5"

[workspace]
EOF
cp chorus/examples/same_main.rs "$user/src/main.rs"
tree() { (cd "$user" && cargo tree -q --features chorus/candle-cuda --config "$(dirname "$cfg")/patch.toml" "$@"); }
tree -i candle-core | head -n 1 | grep -q "candle-cuda/vendor/candle-core" ||
    { echo "a user's crate does not take the patched candle-core" >&2; exit 1; }
features="$(tree -e features -i cudarc)"
grep -q 'cudarc feature "dynamic-loading"' <<<"$features" && ! grep -q '"dynamic-linking"' <<<"$features" ||
    { echo "a user's crate builds cudarc in another loading mode:" >&2; echo "$features" >&2; exit 1; }
echo "a user's crate with candle-cuda and its own dependencies resolves with candle patched"

# The rustdoc of the crate users read first, without a warning (ci/test.sh
# builds every crate's, with every feature, after clippy).
if [ "$#" = 0 ]; then
    RUSTDOCFLAGS="-D warnings" run cargo doc -q -p chorus --features candle --no-deps
fi
