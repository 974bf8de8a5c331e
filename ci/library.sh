#!/usr/bin/env bash
# The library crate `chorus` as its users meet it: its tests, its doctests
# and every example run (the README's "Use chorus as a library" and
# docs/library.md point to them), with the features each needs; the
# GPU backends' code type-checked (it runs where a GPU is, ci/gpu-check.sh).
# Called by ci/test.sh (ci/library.sh --after-workspace); runs alone from a
# clone too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

run() { printf '+ %s\n' "$*"; "$@"; }

# Unit and integration tests, the examples' own #[test]s, then the doctests:
# ci/test.sh's workspace step has run them (the workspace builds chorus with
# candle) and says so with --after-workspace; alone, this script runs them.
if [ "${1:-}" != --after-workspace ]; then
    run cargo test -p chorus --features candle --lib --tests --examples
    run cargo test -p chorus --features candle --doc
fi
# Every example run as a user runs it; each checks its own values and exits non-zero otherwise.
for example in collectives own_model same_main testing_your_code; do
    run cargo run -q -p chorus --features candle --example "$example"
done
# The same main on ucx: 4 processes under `chorus launch`, one rank each.
run cargo build -q -p chorus --features ucx,candle --examples
[ -x "$CARGO_TARGET_DIR/debug/chorus" ] || run cargo build -q -p chorus-cli
run "$CARGO_TARGET_DIR/debug/chorus" launch --nproc-per-node 4 -- "$CARGO_TARGET_DIR/debug/examples/collectives"
run "$CARGO_TARGET_DIR/debug/chorus" launch --nproc-per-node 2 -- "$CARGO_TARGET_DIR/debug/examples/same_main"
# The GPU backends' builds are run on a GPU elsewhere (ci/gpu-check.sh); here
# they are type-checked (nccl: clippy's --all-features build; rccl alone
# selects the rccl branch, checked here without a build: nothing runs it).
run cargo check -q -p chorus --features rccl --examples
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

# The rustdoc of the crate users read first, without a warning.
RUSTDOCFLAGS="-D warnings" run cargo doc -q -p chorus --features candle --no-deps
