# What a build with the `candle-cuda` feature needs, made here and cached:
# 1. nvcc 13.0 from PyPI in a virtual environment at
#    ${CHORUS_CUDA_TOOLCHAIN:-$HOME/.cache/chorus/cuda-nvcc} (beside the
#    tests' venv of ci/python-env.sh, in the cache CI keeps; a venv of its
#    own because torch there pins its own CUDA wheels). Pinned to 13.0.x,
#    nvvm and crt too (nvcc's own requirement floats to the newest, whose
#    PTX ISA the H100 nodes' driver 580 refuses: 13.5 writes .version 9.5);
# 2. candle-core and candle-kernels 0.11.1 patched by the project's own
#    patches (ci/candle-cuda/*.patch, which say why each line changes) in a
#    copy of the locked crates under $CARGO_TARGET_DIR/candle-cuda/vendor
#    (`cargo vendor`; no third-party source is committed);
# 3. a cargo configuration file that builds from that copy (a source
#    replacement: Cargo.lock stays as committed) with nvcc, and compiles
#    candle's PTX for compute capability ${CUDA_COMPUTE_CAP:-90} (sm_90a,
#    the H100's).
#
#   source ci/candle-cuda.sh   # exports CHORUS_CANDLE_CUDA_CONFIG, the file
#   cargo build -p chorus-cli --features candle-cuda --config "$CHORUS_CANDLE_CUDA_CONFIG"
#   bash ci/candle-cuda.sh     # alone: prints the file's path
#
# Beside that file, patch.toml is for a user's own crate depending on chorus
# (any other crates too): it patches only candle-core and candle-kernels
# ([patch.crates-io]), so the user's lock file keeps everything else:
#   cargo build --features chorus/candle-cuda --config "$(dirname "$(bash PATH/TO/chorus/ci/candle-cuda.sh)")/patch.toml"
#
# Idempotent: a complete toolchain and copy (stamps of the pins, and of
# Cargo.lock and the patches) are reused in well under a second; anything
# else is made again beside the old and put in place by a rename, so no
# build ever sees half of one. Concurrent runs take turns on a lock (at most
# 30 minutes' wait). Fails, and fails the caller, when something cannot be
# made.

# shellcheck source=ci/venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"

chorus_candle_cuda() (
    set -euo pipefail
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local target="${CARGO_TARGET_DIR:-$repo/target}"
    local toolchain="${CHORUS_CUDA_TOOLCHAIN:-$HOME/.cache/chorus/cuda-nvcc}"
    local cap="${CUDA_COMPUTE_CAP:-90}"
    # The pins: what PyPI served on 2026-11-25. Change them here only.
    local pins=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85)
    local want
    want="$(printf '%s\n' "${pins[@]}")"
    local nvcc="$toolchain/lib/python3/site-packages/nvidia/cu13/bin/nvcc"

    # --- 1. the toolchain ---------------------------------------------------
    find_nvcc() {
        # pip installs under lib/pythonX.Y: the one nvcc there.
        local found
        found="$(ls -d "$toolchain"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n 1)"
        [ -n "$found" ] && nvcc="$found"
    }
    toolchain_complete() {
        [ -f "$toolchain/READY" ] && [ "$(cat "$toolchain/chorus-cuda.stamp" 2>/dev/null)" = "$want" ] &&
            find_nvcc && "$nvcc" --version 2>/dev/null | grep -q 'release 13\.0,'
    }
    mkdir -p "$target"
    chorus_venv_lock candle-cuda "$toolchain" || return 1
    if ! toolchain_complete; then
        if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
            echo "candle-cuda: python3 with the venv module is needed (python3-venv); install it" >&2
            return 1
        fi
        local started=$SECONDS
        echo "candle-cuda: installing nvcc into $toolchain (${pins[*]}; about 350 MB)" >&2
        chorus_venv_make candle-cuda "$toolchain" CHORUS_CUDA_TOOLCHAIN "$toolchain/chorus-cuda.stamp" "${pins[@]}" || return 1
        if ! find_nvcc; then
            echo "candle-cuda: the wheels installed no nvcc under $toolchain/lib/python3*/site-packages/nvidia/cu13/bin" >&2
            return 1
        fi
        if ! "$nvcc" --version | grep -q 'release 13\.0,'; then
            echo "candle-cuda: $nvcc is not release 13.0:" >&2
            "$nvcc" --version >&2 || true
            return 1
        fi
        touch "$toolchain/READY"
        echo "candle-cuda: nvcc ready in $((SECONDS - started)) s" >&2
    fi

    # --- 2. the patched copy of the locked crates ---------------------------
    local dir="$target/candle-cuda"
    local patches=("$repo/ci/candle-cuda/candle-core.patch" "$repo/ci/candle-cuda/candle-kernels.patch")
    local stamp
    stamp="$(cat "$repo/Cargo.lock" "${patches[@]}" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1) $nvcc $cap"
    mkdir -p "$dir"
    if [ "$(cat "$dir/vendor.stamp" 2>/dev/null)" != "$stamp" ] || [ ! -f "$dir/config.toml" ] || [ ! -f "$dir/patch.toml" ]; then
        local started=$SECONDS
        local fresh="$dir/vendor.new"
        # Ours (made by an earlier run that stopped): remove and make again.
        rm -rf "$fresh"
        (cd "$repo" && cargo vendor --locked --quiet "$fresh" >/dev/null)
        local crate patch
        for crate in candle-core candle-kernels; do
            patch="$repo/ci/candle-cuda/$crate.patch"
            if [ ! -f "$fresh/$crate/Cargo.toml" ]; then
                echo "candle-cuda: cargo vendor gave no $crate (is it in Cargo.lock at 0.11.1?)" >&2
                return 1
            fi
            if ! grep -q '^version = "0.11.1"$' "$fresh/$crate/Cargo.toml"; then
                echo "candle-cuda: $crate is not 0.11.1; ci/candle-cuda/$crate.patch is for 0.11.1" >&2
                return 1
            fi
            (cd "$fresh/$crate" && patch --quiet --forward -p1 <"$patch") || {
                echo "candle-cuda: $patch does not apply to $crate" >&2
                return 1
            }
            # cargo checks a directory source's files against this list; the
            # package's checksum (Cargo.lock's) stays, so the lock file is
            # the committed one.
            python3 - "$fresh/$crate/.cargo-checksum.json" <<'PY'
import json, sys
path = sys.argv[1]
with open(path) as f:
    sums = json.load(f)
sums["files"] = {}
with open(path, "w") as f:
    json.dump(sums, f)
PY
        done
        rm -rf "$dir/vendor.old"
        if [ -e "$dir/vendor" ]; then mv "$dir/vendor" "$dir/vendor.old"; fi
        mv "$fresh" "$dir/vendor"
        rm -rf "$dir/vendor.old"
        cat >"$dir/config.toml.new" <<EOF
# Made by ci/candle-cuda.sh: the locked crates from a copy with candle
# patched (ci/candle-cuda/*.patch), and the kernels compiled by pip's nvcc.
[source.crates-io]
replace-with = "chorus-candle-cuda"

[source.chorus-candle-cuda]
directory = "$dir/vendor"

[env]
NVCC = "$nvcc"
CUDA_COMPUTE_CAP = "$cap"
EOF
        mv "$dir/config.toml.new" "$dir/config.toml"
        # For a user's crate, which depends on crates outside chorus's lock: only
        # candle's two patched crates replaced, everything else from crates.io.
        cat >"$dir/patch.toml.new" <<EOF
# Made by ci/candle-cuda.sh: for a crate that depends on chorus with the
# candle-cuda feature (docs/library.md, "The GPU in your crate"): candle's
# two crates patched (ci/candle-cuda/*.patch), the kernels compiled by pip's nvcc.
[patch.crates-io]
candle-core = { path = "$dir/vendor/candle-core" }
candle-kernels = { path = "$dir/vendor/candle-kernels" }

[env]
NVCC = "$nvcc"
CUDA_COMPUTE_CAP = "$cap"
EOF
        mv "$dir/patch.toml.new" "$dir/patch.toml"
        printf '%s\n' "$stamp" >"$dir/vendor.stamp"
        echo "candle-cuda: patched crates in $dir/vendor in $((SECONDS - started)) s" >&2
    fi
    printf '%s\n' "$dir/config.toml"
)

# Sourced: fail the caller's step; run alone: print the value, or exit 1.
chorus_venv_export candle-cuda CHORUS_CANDLE_CUDA_CONFIG "the candle-CUDA build's toolchain and crates" chorus_candle_cuda || return 1 2>/dev/null || exit 1
