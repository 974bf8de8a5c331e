#!/usr/bin/env bash
# The whole test suite, as CI runs it (`.ci/run`) and as the README tells
# people to: formatting, clippy with every feature, then every crate's tests.
# Works from a fresh clone; installs only what is missing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Each step's time is printed when the next starts, and all of them in a
# table at the end (also when a step fails), so a slow step shows at once.
STEP_NAMES=()
STEP_TIMES=()
STEP_NAME=""
STEP_START=$SECONDS
step_close() {
    if [ -n "$STEP_NAME" ]; then
        local took=$((SECONDS - STEP_START))
        STEP_NAMES+=("$STEP_NAME")
        STEP_TIMES+=("$took")
        printf -- '--- %d s: %.80s\n' "$took" "$STEP_NAME"
    fi
    STEP_NAME=""
}
step() {
    step_close
    STEP_NAME="$*"
    STEP_START=$SECONDS
    printf '\n=== %s ===\n' "$*"
}
summary() {
    local rc=$? failed="$STEP_NAME" i
    step_close
    printf '\n=== time of each step (%s cores,%s) ===\n' "$(nproc)" "$(uptime | sed 's/.*\(load average\)/ \1/')"
    for i in "${!STEP_NAMES[@]}"; do
        printf '%6d s  %.90s\n' "${STEP_TIMES[$i]}" "${STEP_NAMES[$i]}"
    done
    printf '%6d s  in all (%d min %d s)\n' "$SECONDS" $((SECONDS / 60)) $((SECONDS % 60))
    if [ "$rc" != 0 ]; then echo "FAILED (exit $rc) in: $failed" >&2; fi
    if [ -n "${logs:-}" ]; then rm -rf "$logs"; fi
}
trap summary EXIT
printf 'ci/test.sh: %s cores, started %s,%s\n' "$(nproc)" "$(date -u '+%F %T UTC')" "$(uptime | sed 's/.*\(load average\)/ \1/')"

step "set-up: vendor libraries (NCCL, NVRTC, HIP, UCX's and the host kernels' compilers)"

# --- hook: vendor libraries ---------------------------------------------------
# GPU backends add ci/vendor-libs.sh to install NCCL/HIP libraries and export
# the variables that point to them. Nothing else in this script needs to change.
if [ -f ci/vendor-libs.sh ]; then source ci/vendor-libs.sh; fi
if [ -f ci/vendor-hip.sh ]; then source ci/vendor-hip.sh; fi
if [ -f ci/vendor-ucx.sh ]; then source ci/vendor-ucx.sh; fi
if [ -f ci/vendor-cxx.sh ]; then source ci/vendor-cxx.sh; fi
# ------------------------------------------------------------------------------

step "set-up: the PyTorch venv (ci/python-env.sh)"
# The venv of the tests checked against PyTorch (numpy, torch, transformers,
# safetensors; about 5 GB and 2 minutes the first time, then cached): exports
# CHORUS_PYTHON. Those tests are #[ignore]d in a plain `cargo test` and run
# below with --ignored, so here they run, or fail.
source ci/python-env.sh

# One target directory for fmt, clippy and the tests, so nothing builds twice
# more than it must (clippy's check builds and the test builds still differ).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step "toolchain and cargo-nextest"
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
# cargo-nextest runs the tests of every binary side by side (cargo test runs
# one binary at a time, so one slow test holds up the rest) and times each
# test. Built from crates.io once (the only registry reached) into
# ~/.cargo/bin, then reused; its own target directory, not ours.
NEXTEST_VERSION=0.9.151
if ! cargo nextest --version 2>/dev/null | grep -q "^cargo-nextest $NEXTEST_VERSION "; then
    echo "installing cargo-nextest $NEXTEST_VERSION (a few minutes, once)"
    env -u CARGO_TARGET_DIR cargo install --locked --quiet cargo-nextest --version "=$NEXTEST_VERSION" \
        --no-default-features --features default-no-update
fi
cargo nextest --version | head -n 1

# The slowest tests of a nextest log, so the next slow test is seen.
slowest() {
    echo "the slowest tests of this step:"
    sed -nE 's/^ +(PASS|FAIL|SLOW|TIMEOUT|LEAK[A-Z-]*) +\[ *([0-9.]+)s\] +(\( *[0-9]+\/[0-9]+\) +)?/\2 s  \1  /p' "$1" |
        sort -rn | head -n 12 || true
}
logs="$(mktemp -d)"

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "no import circle among a crate's files without its reason (ci/import_circles.py)"
python3 ci/import_circles.py

# --all-features includes candle-cuda (candle's CUDA device): its build needs
# nvcc and candle patched at build time. ci/candle-cuda.sh installs nvcc 13.0
# from PyPI into ~/.cache/chorus (once; then reused in under a second) and a
# patched copy of the locked crates under the target directory, and exports
# the cargo configuration that builds from it (README, "candle on CUDA").
step "set-up: nvcc and candle patched for candle-cuda (ci/candle-cuda.sh)"
source ci/candle-cuda.sh
# The builds with that configuration get a target directory of their own:
# under source replacement cargo keeps the crates' ids, so a crate built
# from the patched copy and the same crate from crates.io are one unit
# with two fingerprints, and in one directory each build rebuilt what the
# other had built (a second run of this script rebuilt 150-190 crates in
# clippy's, the workspace's and candle-cuda's steps).
candle_cuda_target="$CARGO_TARGET_DIR/with-candle-cuda"
step "cargo clippy --workspace --all-targets --all-features -- -D warnings (candle-cuda: nvcc 13.0 from PyPI, candle patched)"
CARGO_TARGET_DIR="$candle_cuda_target" cargo clippy --workspace --all-targets --all-features \
    --config "$CHORUS_CANDLE_CUDA_CONFIG" -- -D warnings

# nextest runs each test in a process of its own, two at a time on two
# cores; .config/nextest.toml gives the tests that time themselves the
# machine alone. Doctests are cargo test's (nextest does not run them).
step "every crate's tests (cargo nextest run --workspace) and doctests (cargo test --doc)"
cargo nextest run --workspace --no-fail-fast 2>&1 | tee "$logs/workspace.log"
slowest "$logs/workspace.log"
# The binary this build made, for the NumPy comparison below (a later build
# with other features puts its own at target/debug/chorus).
cp "$CARGO_TARGET_DIR/debug/chorus" "$logs/chorus"
cargo test --workspace --doc

step "the library: its examples run as a user runs them (its tests and doctests ran in the workspace step), on sim and on ucx under chorus launch, the rccl branch type-checked, a user crate with candle-cuda resolved, its rustdoc"
if [ -f ci/library.sh ]; then
    bash ci/library.sh --after-workspace
else
    echo "NOT RUN: ci/library.sh missing" >&2
    exit 1
fi

# A suite started by a script in the background has SIGINT ignored (and
# under nohup SIGHUP); a child inherits that, and chorus keeps an inherited
# ignore, so a test that interrupts its child must set the child's signals
# itself (cli/tests/common: default_signals). Checked here with libtest's
# runner, since nextest handles those signals and so resets them in the tests.
step "the signal tests with SIGINT and SIGHUP ignored, as under nohup or in a background job"
(
    trap '' INT HUP
    # --workspace, not -p chorus-cli: the workspace step's feature resolution, so nothing is built
    # again (other crates' integration binaries run none of these names).
    cargo test --workspace --no-fail-fast --test integration -- tokenize::interrupted_runs tokenize::sigusr1 \
        flight_recorder::sigterm flight_recorder::sigusr1 launch::sigterm launch::a_stop_signal
)

# The tests against PyTorch are #[ignore]d where there is no venv; they share
# the workspace's build and run side by side.
step "against PyTorch (the venv's CHORUS_PYTHON): TCPStore both ways, torchrun's agent store, PyTorch ranks under chorus launch, Python and torch's DCP reader reading checkpoints, a Hugging Face Llama trained by chorus and by PyTorch (every step's loss, the final weights through from_pretrained), tokenizer ids, the output directory through AutoTokenizer and AutoModelForCausalLM, greedy generation token for token, the lr schedule against LambdaLR, the float8 casts against NumPy and torch, the planner's activation count against autograd, the fused ops against torch"
torch_tests=(
    'binary_id(chorus-collectives::integration) & test(/^tcpstore_torch::/)'
    'binary_id(chorus-collectives::integration) & test(=bootstrap_env::rust_ranks_join_torchruns_agent_store)'
    'binary_id(chorus-cli::integration) & test(=launch::pytorch_ranks_rendezvous_through_the_launchers_store)'
    'binary_id(chorus-train::integration) & test(/^checkpoint::/)'
    'binary_id(chorus-cli::integration) & test(/^llama_torch::/)'
    # The Llama trainer's text in and out, and its lr schedule, against transformers and torch.
    'binary_id(chorus-cli::integration) & test(/^tokenize::/)'
    'binary_id(chorus-cli::integration) & test(/^generate::/)'
    'binary_id(chorus-cli::integration) & test(/^lr_torch::/)'
    # The float8 scaled casts (FSDP's float8 all-gather) against NumPy's recipe and torch's float8_e4m3fn.
    'binary_id(chorus-devices::integration) & test(/^float8_numpy::/)'
    # The planner's activation count for a Llama layer against what PyTorch's autograd keeps.
    'binary_id(chorus-plan::integration) & test(/^saved_torch::/)'
    # The fused ops (chorus-kernels, CPU) against SDPA, rms_norm, LlamaRMSNorm, RoPE, silu and cross_entropy, gradients too.
    'binary_id(chorus-kernels::integration) & test(/^ops_torch::/)'
)
filter="$(printf '(%s) | ' "${torch_tests[@]}")"
cargo nextest run --workspace --no-fail-fast --run-ignored only -E "${filter% | }" 2>&1 | tee "$logs/torch.log"
slowest "$logs/torch.log"

step "chorus train against an independent NumPy implementation (init written by numpy.save)"
"$CHORUS_PYTHON" ci/train_vs_numpy.py "$logs/chorus" "$(mktemp -d)"

# ucx, cuda, nccl, rocm and rccl only add optional dependencies, so one
# build with all of them serves every backend's tests below (each had a
# build of its own before: five more builds of the crates).
backends=(-p chorus-devices -p chorus-collectives -p chorus-conformance -p chorus-cli
    --features chorus-cli/ucx,chorus-cli/nccl,chorus-cli/rccl
    --lib --test integration --test cuda_load --test gpu_kernels_host --test nccl_load --test hip_load --test rccl_load
    --test device_hip)
step "ucx backend: unit tests, the suite with every rank in one process (2 and 4 ranks, and 2 fake hosts x 2 ranks through the hierarchical schedule), and one rank per process: the suite over 4 processes, FSDP equal to sim (chorus launch, and torchrun from the venv), killed rank, world-size disagreement, the flight recorder naming the culprit and every node's dumps gathered, restarts (--max-restarts, --nnodes MIN:MAX, --resume auto, asynchronous saves); GPU backends: loading without a GPU (NCCL, NVRTC; HIP from Debian's libamdhip64-5, hipRTC; RCCL absent; CUDA driver absent), the shared kernel source run on the host (c++) against half and the cpu device"
backend_tests=(
    'binary_id(chorus-collectives) & test(ucx)'
    'binary_id(chorus-conformance::integration) & test(/^(ucx|ucx_hosts|routed)::/)'
    'binary_id(chorus-cli::integration) & test(/^(ucx|flight_recorder)::/)'
    # Restarts under chorus launch: a killed rank, an elastic job losing a host, a rank killed during an asynchronous save.
    'binary_id(chorus-cli::integration) & test(/^launch_restarts::/)'
    'binary_id(chorus-devices::cuda_load)'
    'binary_id(chorus-devices::gpu_kernels_host)'
)
filter="$(printf '(%s) | ' "${backend_tests[@]}")"
cargo nextest run "${backends[@]}" --no-fail-fast -E "${filter% | }" 2>&1 | tee "$logs/backends.log"
slowest "$logs/backends.log"
# This build's binary has UCX: the namespace hosts below run it.
cp "$CARGO_TARGET_DIR/debug/chorus" "$logs/chorus-ucx"
# The loading tests are #[ignore]d where a plain `cargo test` cannot know
# their prerequisites; this script provides them (vendor-libs.sh fails if it
# cannot), so they run here, and fail if NCCL does not load after all.
backend_ignored=(
    'binary_id(chorus-cli::integration) & test(=ucx::fsdp_under_torchrun_equals_the_simulator)'
    'binary_id(chorus-devices) & test(cuda)'
    'binary_id(chorus-collectives::nccl_load) & not test(on_a_gpu)'
    'binary_id(chorus-devices::hip_load)'
    'binary_id(chorus-collectives::rccl_load)'
)
filter="$(printf '(%s) | ' "${backend_ignored[@]}")"
cargo nextest run "${backends[@]}" --no-fail-fast --run-ignored all -E "${filter% | }" 2>&1 | tee "$logs/backends-ignored.log"
slowest "$logs/backends-ignored.log"
# The device suite on an AMD GPU is run where one is (/dev/kfd); elsewhere it is reported as not run.
if [ -e /dev/kfd ]; then
    cargo nextest run "${backends[@]}" --run-ignored all -E 'binary_id(chorus-devices::device_hip)' --test-threads=1
else
    # Built above with the other backends' tests.
    echo "NOT RUN: the device suite on the hip device (devices/tests/device_hip.rs): no AMD GPU here (/dev/kfd)" >&2
fi

# candle's CUDA device (candle-cuda, built through ci/candle-cuda.sh above): a typed error, never cudarc's panic.
# Its own build: ci/candle-cuda.sh's configuration replaces crates.io with a patched copy, so every
# crate built with it is another unit; folded into the build above, the whole chain was built again
# from the copy (tried 2026-11-29: about 11 minutes under nice beside a benchmark, against 3.5 for
# this step and 3 for the build above).
step "candle's CUDA device without a GPU: loading is a typed error (candle-cuda)"
CARGO_TARGET_DIR="$candle_cuda_target" cargo test -p chorus-fsdp-candle --features candle-cuda \
    --config "$CHORUS_CANDLE_CUDA_CONFIG" --test candle_cuda_load

step "several hosts made of network namespaces (2 hosts x 2 ranks, UCX, 1 Gbit/s links): the suite, FSDP and HSDP equal to sim, torchrun across hosts, checkpoints resumed on other topologies, dead, hung and partitioned hosts (during a collective and a save) ending the job within 10 s, a stalled rank named by chorus trace, hosts sharing a hostname (about 3 minutes)"
bash ci/multihost-test.sh "$logs/chorus-ucx"

step "restarts across namespace hosts (3 hosts x 2 ranks, UCX): host 2 killed during a save under --nnodes 2:3 --max-restarts 1, the others resume from the last complete checkpoint and end where a run of 2 hosts from it ends (about a minute)"
bash ci/multihost-restarts.sh "$logs/chorus-ucx"

step "all checks passed"
