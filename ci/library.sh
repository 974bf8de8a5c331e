#!/usr/bin/env bash
# The library crate `chorus` as its users meet it: its tests, its doctests
# and every example run (the README's "Use chorus as a library" and
# docs/library.md point to them), with the features each needs; the
# GPU backends' builds compiled (they run where a GPU is, ci/gpu-check.sh).
# Called by ci/test.sh; runs alone from a clone too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

run() { printf '+ %s\n' "$*"; "$@"; }

# Unit and integration tests, the examples' own #[test]s, then the doctests.
run cargo test -p chorus --features candle --lib --tests --examples
run cargo test -p chorus --features candle --doc
# Every example run as a user runs it; each checks its own values and exits non-zero otherwise.
for example in collectives own_model same_main testing_your_code; do
    run cargo run -q -p chorus --features candle --example "$example"
done
# The same main on ucx: 4 processes under `chorus launch`, one rank each.
run cargo build -q -p chorus --features ucx,candle --examples
run cargo build -q -p chorus-cli
run "$CARGO_TARGET_DIR/debug/chorus" launch --nproc-per-node 4 -- "$CARGO_TARGET_DIR/debug/examples/collectives"
run "$CARGO_TARGET_DIR/debug/chorus" launch --nproc-per-node 2 -- "$CARGO_TARGET_DIR/debug/examples/same_main"
# The GPU backends' builds (run on a GPU elsewhere: ci/gpu-check.sh).
run cargo build -q -p chorus --features nccl,candle --examples
run cargo build -q -p chorus --features rccl --examples
# The rustdoc of the crate users read first, without a warning.
RUSTDOCFLAGS="-D warnings" run cargo doc -q -p chorus --features candle --no-deps
