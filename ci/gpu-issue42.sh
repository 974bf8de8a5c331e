#!/usr/bin/env bash
# Issue 42's device session as one command: everything built since the last
# GPU run, then chorus against PyTorch FSDP2 on the same GPU, within one
# lease's command limit (600 s). Run on the device machine from the tree
# ci/gpu-build.sh prepared (gpu-bin/ carried), e.g. through the device tool:
#
#   bash ci/gpu-issue42.sh [OUT_DIR]      # default: $OUT, else gpu-results-42
#
# Each part is bounded by `timeout` so that a hang costs its own share only;
# the results (every log, JSON line and summary) are packed into
# OUT_DIR/issue42.tgz whatever happened. Parts, in order of what they prove:
#   a  kernels devices-cuda   the fused ops on the GPU against the CPU, then timed against
#                             PyTorch; the device suite (clip_scale included)
#   b  conformance-nccl       the suite on NCCL at one rank: clipping on the device, the
#                             one-rank reduction, the gradient paths
#   c  side-by-side           the 1.1B and 110M Llamas, chorus and PyTorch FSDP2 from one init
#   d  side-by-side           the 1.1B without clipping and the 3B shape (SBS_SHAPES below)
# Exits 1 if any part failed or timed out.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out="${1:-${OUT:-gpu-results-42}}"
mkdir -p "$out"
# Another run's results are not replaced.
if [ -e "$out/issue42.tgz" ]; then
    echo "gpu-issue42: $out/issue42.tgz exists; give another directory" >&2
    exit 2
fi
work="$(mktemp -d /tmp/issue42.XXXXXX)"
failed=0
start=$SECONDS

# part NAME LIMIT_S GROUPS...: one gpu-check.sh call into $work/NAME.
part() {
    local name="$1" limit="$2"
    shift 2
    echo "== part $name (limit ${limit} s, at $((SECONDS - start)) s): $*"
    if ! timeout --kill-after=10 "$limit" bash ci/gpu-check.sh gpu-bin "$work/$name" "$@"; then
        echo "== part $name FAILED or timed out"
        failed=1
    fi
}

part a 150 kernels devices-cuda
part b 90 conformance-nccl
part c 180 side-by-side
SBS_SHAPES="1.1b:4:20:noclip 3b:2:12" part d 150 side-by-side

echo "== done in $((SECONDS - start)) s"
# What comes back: the summaries first (they name each failure), then everything.
for s in "$work"/*/summary.txt; do
    [ -e "$s" ] && { echo "--- $s"; cat "$s"; }
done
tar czf "$out/issue42.tgz" -C "$work" . && echo "results: $out/issue42.tgz"
exit "$failed"
