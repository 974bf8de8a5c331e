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
    # The builds started in the background, when a step failed before they were waited for.
    if [ -n "${background_builds:-}" ]; then
        pkill -P "$background_builds" 2>/dev/null || true
        kill "$background_builds" 2>/dev/null || true
    fi
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

# One target directory for clippy, the tests and every backend, so nothing is
# built twice that one build can serve; target/ci, because every build here
# takes its crates from ci/candle-cuda.sh's copy (below), and a build from
# crates.io (a plain `cargo build`) in the same directory would rebuild them.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/ci}"
# Not incremental: from a clean clone its caches are pure cost (time and
# gigabytes), and a rerun with nothing changed builds nothing either way.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# nextest runs one test more than there are cores: the tests spend about a
# third of their time waiting (deadlines, processes starting, fresh
# worlds). On 2 cores, 2 at a time kept 69 % of the machine busy and took
# 273 s; 3 took 233 s (4: 221 s).
export NEXTEST_TEST_THREADS="${NEXTEST_TEST_THREADS:-$(($(nproc) + 1))}"
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
# Every build below takes that configuration, not clippy's alone: under
# source replacement cargo keeps the crates' ids, so a crate built from the
# copy and from crates.io is one unit with two fingerprints, and builds with
# and without it in one directory rebuilt each other's crates. With it
# everywhere, clippy's check and the tests' build share the proc macros and
# the build scripts' runs (UCX's configure and make, 72 s).
cfg=(--config "$CHORUS_CANDLE_CUDA_CONFIG")

step "cargo clippy --workspace --all-targets --all-features -- -D warnings (candle-cuda: nvcc 13.0 from PyPI, candle patched)"
cargo clippy --workspace --all-targets --all-features "${cfg[@]}" -- -D warnings
# The library selects the most specific backend built (nccl, rccl, ucx,
# sim), so --all-features reads its nccl branch only: its rccl branch with
# every other feature as above (only the library is checked again).
rccl_branch="$(cargo metadata -q --no-deps --format-version 1 "${cfg[@]}" | python3 -c '
import json, sys
meta = json.load(sys.stdin)
every = ["%s/%s" % (p["name"], f) for p in meta["packages"] for f in p["features"]]
print(",".join(f for f in every if f not in ("chorus/nccl", "chorus/candle-cuda")))')"
cargo clippy --workspace --all-targets --features "$rccl_branch" "${cfg[@]}" -- -D warnings
step "every crate's rustdoc, every feature, without a warning"
RUSTDOCFLAGS="-D warnings" cargo doc -q --workspace --no-deps --all-features "${cfg[@]}"

# One build of the workspace with every backend (ucx, and the GPU backends'
# code that loads their libraries at run time) serves every test below, the
# library's examples and the namespace hosts' binary. The library stays on
# sim: the command line's backend features do not reach it (it selects its
# backend at build time), and `chorus/candle` builds its candle examples.
features=chorus-cli/ucx,chorus-cli/nccl,chorus-cli/rccl,chorus/candle
build=(--workspace --features "$features" "${cfg[@]}")

# nextest runs each test in a process of its own, NEXTEST_TEST_THREADS at
# a time; .config/nextest.toml gives the tests that time themselves the
# machine alone. The doctests are cargo test's (nextest does not run them): last, below.
step "every crate's tests with every backend built (cargo nextest run --workspace): the suite on sim and on ucx (2 and 4 ranks in one process, 2 fake hosts x 2 ranks through the hierarchical schedule, 4 processes under chorus launch), FSDP equal to sim, killed ranks, the flight recorder, restarts (--max-restarts, --nnodes MIN:MAX, --resume auto, asynchronous saves), the GPU kernels' source run on the host (c++)"
# --timings: cargo's report of what each crate's build took, in
# $CARGO_TARGET_DIR/cargo-timings/.
cargo nextest run "${build[@]}" --timings --no-fail-fast 2>&1 | tee "$logs/workspace.log"
slowest "$logs/workspace.log"
# This build's binary, for the NumPy comparison and the namespace hosts
# below (a later build with other features would put its own at target/debug/chorus).
cp "$CARGO_TARGET_DIR/debug/chorus" "$logs/chorus"

# A suite started by a script in the background has SIGINT ignored (and
# under nohup SIGHUP); a child inherits that, and chorus keeps an inherited
# ignore, so a test that interrupts its child must set the child's signals
# itself (cli/tests/common: default_signals). Checked here with libtest's
# runner, since nextest handles those signals and so resets them in the tests.
step "the signal tests with SIGINT and SIGHUP ignored, as under nohup or in a background job"
(
    trap '' INT HUP
    # The workspace step's build (other crates' integration binaries run none of these names).
    cargo test "${build[@]}" --no-fail-fast --test integration -- tokenize::interrupted_runs tokenize::sigusr1 \
        flight_recorder::sigterm flight_recorder::sigusr1 launch::sigterm launch::a_stop_signal
)

# The tests #[ignore]d where a plain `cargo test` cannot know their
# prerequisites, which this script provides (the venv; vendor-libs.sh fails
# if it cannot): they run here, and fail if PyTorch or NCCL does not load
# after all. The same build, side by side.
step "against PyTorch (the venv's CHORUS_PYTHON): TCPStore both ways, torchrun's agent store, PyTorch ranks under chorus launch and FSDP on ucx under torchrun, Python and torch's DCP reader reading checkpoints, a Hugging Face Llama trained by chorus and by PyTorch (every step's loss, the final weights through from_pretrained), tokenizer ids, the output directory through AutoTokenizer and AutoModelForCausalLM, greedy generation token for token, the lr schedule against LambdaLR, the float8 casts against NumPy and torch, the planner's activation count against autograd, the fused ops against torch; the GPU backends loading without a GPU (NCCL, NVRTC; HIP from Debian's libamdhip64-5, hipRTC; RCCL absent; CUDA driver absent)"
ignored_tests=(
    'binary_id(chorus-collectives::integration) & test(/^tcpstore_torch::/)'
    'binary_id(chorus-collectives::integration) & test(=bootstrap_env::rust_ranks_join_torchruns_agent_store)'
    'binary_id(chorus-cli::integration) & test(=launch::pytorch_ranks_rendezvous_through_the_launchers_store)'
    'binary_id(chorus-cli::integration) & test(=ucx::fsdp_under_torchrun_equals_the_simulator)'
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
    # candle's backward as ci/candle-cuda.sh patches it (a first gradient kept as it comes).
    'binary_id(chorus-fsdp-candle) & test(=storage::tests::a_first_gradient_is_kept_as_it_comes_with_candle_patched)'
    # Loading the GPU backends' libraries without a GPU.
    'binary_id(chorus-devices) & test(cuda)'
    'binary_id(chorus-collectives::nccl_load) & not test(on_a_gpu)'
    'binary_id(chorus-devices::hip_load)'
    'binary_id(chorus-collectives::rccl_load)'
)
filter="$(printf '(%s) | ' "${ignored_tests[@]}")"
cargo nextest run "${build[@]}" --no-fail-fast --run-ignored only -E "${filter% | }" 2>&1 | tee "$logs/ignored.log"
slowest "$logs/ignored.log"
# The device suite on an AMD GPU is run where one is (/dev/kfd); elsewhere it is reported as not run.
if [ -e /dev/kfd ]; then
    cargo nextest run "${build[@]}" --run-ignored all -E 'binary_id(chorus-devices::device_hip)' --test-threads=1
else
    # Built above with the other tests.
    echo "NOT RUN: the device suite on the hip device (devices/tests/device_hip.rs): no AMD GPU here (/dev/kfd)" >&2
fi

step "chorus train against an independent NumPy implementation (init written by numpy.save)"
"$CHORUS_PYTHON" ci/train_vs_numpy.py "$logs/chorus" "$(mktemp -d)"

step "the library: its examples run as a user runs them (its tests ran above, its doctests run beside the namespace hosts), on sim and on ucx under chorus launch, a user crate with candle-cuda resolved"
bash ci/library.sh "${build[@]}"

# Two builds of their own, started here at the lowest priority while the
# namespace hosts below, which mostly wait, run:
# - the doctests, built and run there (cargo has no --no-run for them);
#   their results are printed after the hosts;
# - candle's CUDA device (candle-cuda; loading it without a GPU is a typed
#   error, never cudarc's panic): folded into the build above, candle-core
#   with CUDA would build every crate above it again; as the workspace's
#   build with the feature, but only its test target, it builds candle and
#   the crates under chorus-fsdp-candle again, nothing else (`-p` would
#   resolve features apart and build the chain again).
candle_cuda=(--workspace --features "$features,chorus-fsdp-candle/candle-cuda" "${cfg[@]}" --test candle_cuda_load)
(
    renice -n 19 "$BASHPID" >/dev/null || true  # lower priority if it can
    cargo test "${build[@]}" --doc
    cargo test "${candle_cuda[@]}" --no-run
) >"$logs/background-builds.log" 2>&1 &
background_builds=$!

step "several hosts made of network namespaces (2 hosts x 2 ranks, UCX, 1 Gbit/s links): the suite, FSDP and HSDP equal to sim, torchrun across hosts, checkpoints resumed on other topologies, dead, hung and partitioned hosts (during a collective and a save) ending the job within 10 s, a stalled rank named by chorus trace, hosts sharing a hostname (about 3 minutes)"
bash ci/multihost-test.sh "$logs/chorus"

step "restarts across namespace hosts (3 hosts x 2 ranks, UCX): host 2 killed during a save under --nnodes 2:3 --max-restarts 1, the others resume from the last complete checkpoint and end where a run of 2 hosts from it ends (about a minute)"
bash ci/multihost-restarts.sh "$logs/chorus"

step "the doctests (cargo test --doc), and candle's CUDA device without a GPU: loading is a typed error (candle-cuda); both built during the two steps above"
built=0
wait "$background_builds" || built=$?
background_builds=""
if [ "$built" != 0 ]; then
    cat "$logs/background-builds.log" >&2
    exit 1
fi
grep -E '^ *(Finished|Doc-tests)|^test |^test result' "$logs/background-builds.log"
cargo test "${candle_cuda[@]}"

step "all checks passed"
