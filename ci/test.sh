#!/usr/bin/env bash
# The whole test suite, as CI runs it (`.ci/run`) and as the README tells
# people to: formatting, clippy with every feature, then every crate's tests.
# Works from a fresh clone; installs only what is missing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# --- hook: vendor libraries ---------------------------------------------------
# GPU backends add ci/vendor-libs.sh to install NCCL/HIP libraries and export
# the variables that point to them. Nothing else in this script needs to change.
if [ -f ci/vendor-libs.sh ]; then source ci/vendor-libs.sh; fi
if [ -f ci/vendor-hip.sh ]; then source ci/vendor-hip.sh; fi
if [ -f ci/vendor-ucx.sh ]; then source ci/vendor-ucx.sh; fi
if [ -f ci/vendor-cxx.sh ]; then source ci/vendor-cxx.sh; fi
# ------------------------------------------------------------------------------

# The venv of the tests checked against PyTorch (numpy, torch, transformers,
# safetensors; about 5 GB and 2 minutes the first time, then cached): exports
# CHORUS_PYTHON. Those tests are #[ignore]d in a plain `cargo test` and run
# below with --ignored, so here they run, or fail.
source ci/python-env.sh

# One target directory for fmt, clippy and the tests, so nothing builds twice
# more than it must (clippy's check builds and the test builds still differ).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step() { printf '\n=== %s ===\n' "$*"; }

step "toolchain"
if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo is not installed; install Rust from https://rustup.rs" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    installed="$(rustup component list --installed 2>/dev/null || true)"
    for component in rustfmt clippy; do
        if ! grep -q "^${component}" <<<"$installed"; then
            rustup component add "$component"
        fi
    done
fi
cargo --version
rustc --version

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "no import circle among a crate's files without its reason (ci/import_circles.py)"
python3 ci/import_circles.py

# --all-features includes candle-cuda (candle's CUDA device): its build needs
# nvcc and candle patched at build time. ci/candle-cuda.sh installs nvcc 13.0
# from PyPI into ~/.cache/chorus (once; then reused in under a second) and a
# patched copy of the locked crates under the target directory, and exports
# the cargo configuration that builds from it (README, "candle on CUDA").
source ci/candle-cuda.sh
step "cargo clippy --workspace --all-targets --all-features -- -D warnings (candle-cuda: nvcc 13.0 from PyPI, candle patched)"
cargo clippy --workspace --all-targets --all-features --config "$CHORUS_CANDLE_CUDA_CONFIG" -- -D warnings

step "cargo test --workspace"
cargo test --workspace

step "ucx backend: unit tests, the suite with every rank in one process (2 and 4 ranks, and 2 fake hosts x 2 ranks through the hierarchical schedule), and one rank per process: the suite over 4 processes, FSDP equal to sim (chorus launch, and torchrun from the venv), killed rank, world-size disagreement, the flight recorder naming the culprit and every node's dumps gathered (about 3 minutes with UCX's build)"
cargo test -p chorus-collectives --features ucx --lib ucx
cargo test -p chorus-conformance --features ucx --test ucx --test ucx_hosts --test routed
cargo test -p chorus-cli --features ucx --test ucx
cargo test -p chorus-cli --features ucx --test flight_recorder
cargo test -p chorus-cli --features ucx --test ucx -- --ignored --exact fsdp_under_torchrun_equals_the_simulator

step "several hosts made of network namespaces (2 hosts x 2 ranks, UCX, 1 Gbit/s links): the suite, FSDP and HSDP equal to sim, torchrun across hosts, checkpoints resumed on other topologies, dead, hung and partitioned hosts (during a collective and a save) ending the job within 10 s, a stalled rank named by chorus trace, hosts sharing a hostname (about 3 minutes)"
cargo build -p chorus-cli --features ucx
bash ci/multihost-test.sh "$CARGO_TARGET_DIR/debug/chorus"

step "against PyTorch (the venv's CHORUS_PYTHON): TCPStore both ways, torchrun's agent store, PyTorch ranks under chorus launch, Python and torch's DCP reader reading checkpoints, a Hugging Face Llama trained by chorus and by PyTorch (every step's loss, the final weights through from_pretrained), tokenizer ids, the output directory through AutoTokenizer and AutoModelForCausalLM, greedy generation token for token, the lr schedule against LambdaLR"
cargo test -p chorus-collectives --test tcpstore_torch -- --ignored
cargo test -p chorus-collectives --test bootstrap_env -- --ignored --exact rust_ranks_join_torchruns_agent_store
cargo test -p chorus-cli --test launch -- --ignored --exact pytorch_ranks_rendezvous_through_the_launchers_store
cargo test -p chorus-train --test checkpoint -- --ignored
cargo test -p chorus-cli --test llama_torch -- --ignored
# The Llama trainer's text in and out, and its lr schedule, against transformers and torch.
cargo test -p chorus-cli --test tokenize -- --ignored
cargo test -p chorus-cli --test generate -- --ignored
cargo test -p chorus-cli --test lr_torch -- --ignored
# The float8 scaled casts (FSDP's float8 all-gather) against NumPy's recipe and torch's float8_e4m3fn.
cargo test -p chorus-devices --test float8_numpy -- --ignored
# The planner's activation count for a Llama layer against what PyTorch's autograd keeps.
cargo test -p chorus-plan --test saved_torch -- --ignored
# The fused ops (chorus-kernels, CPU) against SDPA, rms_norm, LlamaRMSNorm, RoPE, silu and cross_entropy, gradients too.
cargo test -p chorus-kernels --test ops_torch -- --ignored

step "chorus train against an independent NumPy implementation (init written by numpy.save)"
cargo build -p chorus-cli
"$CHORUS_PYTHON" ci/train_vs_numpy.py "$CARGO_TARGET_DIR/debug/chorus" "$(mktemp -d)"

step "GPU backends: loading without a GPU (NCCL, NVRTC, candle's CUDA device; CUDA driver absent)"
cargo test -p chorus-devices --features cuda --lib cuda -- --include-ignored
cargo test -p chorus-devices --features cuda --test cuda_load
# The loading tests are #[ignore]d where a plain `cargo test` cannot know
# their prerequisites; this script provides them (vendor-libs.sh fails if it
# cannot), so they run here, and fail if NCCL does not load after all.
cargo test -p chorus-collectives --features nccl --test nccl_load -- --include-ignored --skip on_a_gpu
# candle's CUDA device (candle-cuda, built through ci/candle-cuda.sh above): a typed error, never cudarc's panic.
cargo test -p chorus-fsdp-candle --features candle-cuda --config "$CHORUS_CANDLE_CUDA_CONFIG" --test candle_cuda_load

step "GPU backends: loading without a GPU (HIP from Debian's libamdhip64-5, hipRTC; RCCL absent); the shared kernel source run on the host (c++) against half and the cpu device"
cargo test -p chorus-devices --features rocm --test hip_load -- --include-ignored
cargo test -p chorus-devices --features rocm --test gpu_kernels_host
cargo test -p chorus-collectives --features rccl --test rccl_load -- --include-ignored
# The device suite on an AMD GPU is run where one is (/dev/kfd); elsewhere it is reported as not run.
if [ -e /dev/kfd ]; then
    cargo test -p chorus-devices --features rocm --test device_hip -- --include-ignored --test-threads=1
else
    cargo test -p chorus-devices --features rocm --test device_hip --no-run
    echo "NOT RUN: the device suite on the hip device (devices/tests/device_hip.rs): no AMD GPU here (/dev/kfd)" >&2
fi

step "all checks passed"
