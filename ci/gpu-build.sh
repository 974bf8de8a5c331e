#!/usr/bin/env bash
# Builds, here, everything ci/gpu-check.sh runs on a GPU node (which has no
# Rust toolchain): the chorus binary with the GPU features and the test
# binaries of the GPU paths, copied into one folder to carry to the node.
#
#   bash ci/gpu-build.sh [OUT_DIR]      # default: gpu-bin/ (ignored by git)
#
# Then, on the node, from the checkout with that folder beside it:
#   bash ci/gpu-check.sh [OUT_DIR] [RESULTS_DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out="${1:-gpu-bin}"
# candle-cuda: the candle models on candle's CUDA device (nvcc from PyPI and
# candle patched at build time by ci/candle-cuda.sh; its kernels are PTX for
# sm_90a, the H100's, unless CUDA_COMPUTE_CAP says otherwise).
features="cuda,nccl,rocm,rccl,candle-cuda"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$out"
source ci/candle-cuda.sh
config=(--config "$CHORUS_CANDLE_CUDA_CONFIG")

# Debug info is stripped: with it the binaries are ~200 MB, more than a device
# lease carries (64 MiB); symbols stay, so backtraces still name functions.
cargo build --release -p chorus-cli --features "$features" "${config[@]}"
strip --strip-debug -o "$out/chorus" "$CARGO_TARGET_DIR/release/chorus"
# chorus's fused ops timed against cuBLAS and (ci/kernels_torch_bench.py) PyTorch on the node.
cargo build --release -p chorus-kernels --features cuda --example kernel_bench "${config[@]}"
strip --strip-debug -o "$out/kernel_bench" "$CARGO_TARGET_DIR/release/examples/kernel_bench"

# FSDP's host-path bench (gpu-check.sh fsdp-host).
cargo build --release -p chorus-fsdp --features nccl --example host_path
strip --strip-debug -o "$out/host_path" "$CARGO_TARGET_DIR/release/examples/host_path"

# The test binaries that prove the GPU paths, by their names in `cargo test`.
copy_tests() {
    # $1: package, $2: features, $3...: test target names
    local package="$1" feats="$2"
    shift 2
    local json log
    # cargo's progress and errors go to a log shown on failure: under set -e a
    # failed build in $(...) would otherwise end this script without a word.
    log="$(mktemp)"
    if ! json="$(cargo test --release -p "$package" --features "$feats" "${config[@]}" --no-run --message-format=json 2>"$log")"; then
        cat "$log" >&2
        printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-message":
        print(m["message"].get("rendered", ""), file=sys.stderr)
'
        echo "gpu-build: building the tests of $package ($feats) failed" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
    for name in "$@"; do
        local path
        path="$(printf '%s\n' "$json" | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and t.get("name") == name and m.get("executable"):
        print(m["executable"])
' "$name" | tail -n 1)"
        if [ -z "$path" ]; then
            echo "gpu-build: no test binary named $name in $package" >&2
            exit 1
        fi
        strip --strip-debug -o "$out/test-$package-$name" "$path"
    done
}
copy_tests chorus-devices cuda device_cuda cuda_load host_fn
copy_tests chorus-kernels cuda ops_cuda
copy_tests chorus-devices rocm device_hip hip_load
copy_tests chorus-collectives nccl nccl_load
copy_tests chorus-collectives rccl rccl_load
echo "gpu-build: binaries in $out/:"
ls -l "$out"
# A device lease carries at most 64 MiB: say so here, not on the node.
total="$(du -cb "$out"/* | tail -n 1 | cut -f1)"
echo "gpu-build: $((total / 1048576)) MiB in all"
if [ "$total" -gt $((64 * 1048576)) ]; then
    # Stripped binaries compress about 4x; ci/gpu-check.sh unpacks NAME.xz
    # into NAME on the node before its first check.
    echo "gpu-build: over 64 MiB; compressing each binary to NAME.xz"
    for f in "$out"/*; do
        case "$f" in *.xz) continue ;; esac
        python3 -c 'import lzma, shutil, sys
with open(sys.argv[1], "rb") as src, lzma.open(sys.argv[1] + ".xz.partial", "wb", preset=6) as dst:
    shutil.copyfileobj(src, dst)' "$f"
        mv "$f.xz.partial" "$f.xz"
        rm "$f"
    done
    ls -l "$out"
    total="$(du -cb "$out"/* | tail -n 1 | cut -f1)"
    echo "gpu-build: $((total / 1048576)) MiB in all, compressed"
    if [ "$total" -gt $((64 * 1048576)) ]; then
        echo "gpu-build: more than a device lease carries (64 MiB), even compressed" >&2
        exit 1
    fi
fi
