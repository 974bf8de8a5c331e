#!/usr/bin/env bash
# What fault tolerance costs, measured on this machine (issue 44's "how it
# is checked"): a benchmark that prints numbers, not a test (it is not in
# ci/test.sh, and it fails only when a run fails, never on a number).
#
#   1. Step time with saves: the same `chorus train` job (one seed, one
#      config, simulated ranks) three ways, with no save, with blocking
#      saves (--save-every K) and with asynchronous ones (--save-every K
#      --async-save), the three modes interleaved over --rounds rounds
#      (their order rotated each round) so that the machine's noise hits
#      all alike. Per mode: the median of rank 0's step times
#      (summary.json's step_times_s, which leave the saves out), the time
#      per step counting what the saves held the steps (summary.json's
#      saves[].blocked_s), their ratios to no save (goal for asynchronous
#      saves: <= 1.1) and the time each save held the step.
#   2. What a fault costs: `chorus launch --max-restarts 1` of a `chorus
#      train --resume auto --save-every K` job; once rank 0's progress.json
#      says --kill-at-step steps are done, one rank gets SIGKILL. Over UCX
#      (when the binary has it: `chorus info`) 2 processes, rank 1 killed;
#      else the sim backend's one process of 2 ranks, killed whole. Reports
#      the time from the kill to the first step of the next attempt (and to
#      its rank 0's process running, and to its checkpoint being loaded),
#      the step resumed from, the steps lost (goal: at most the save
#      interval), whether the job finished (goal: the kill to the first
#      step within 15 s plus the checkpoint's load).
#
# Prints the machine's facts, a table per measurement, and one JSON object
# per measurement (the lines starting with `{`). Works in a mktemp
# directory that it removes at exit; every run is bounded by --timeout.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: ci/fault-bench.sh [options]

Measures step time with no / blocking / asynchronous checkpoint saves, and
what a rank killed under `chorus launch --max-restarts 1` costs. Prints a
table and one JSON object per measurement (lines starting with `{`).

Options:
  --chorus PATH        the chorus binary (default: target/release/chorus,
                       else target/debug/chorus; UCX for part 2 needs
                       `cargo build --release -p chorus-cli --features ucx`)
  --only saves|restart run one part only (default: both)
  --rounds N           rounds of the three save modes (default 3)
  --steps N            steps of each save-mode run (default 24)
  --save-every K       save interval, both parts (default 4)
  --world-size N       ranks (default 2)
  --train-args "..."   the model's flags (default: "--model gpt --d-model
                       256 --layers 4 --seq-len 64 --batch 8 --seed 0")
  --restart-steps N    steps of the restarted job (default 4 x K)
  --kill-at-step N     kill once rank 0 has done N steps (default 2K - 1:
                       just before the second save, K - 1 steps lost)
  --restart-backend B  auto (ucx if the binary has it, else sim), ucx, sim
  --timeout S          bound on each run, seconds (default 300)
  -h, --help           this text

Environment: TMPDIR (where the runs write; at least 1 GiB free).
Not a test: it exits non-zero only when a run fails or an argument or
prerequisite is wrong, never because a number misses its goal.
EOF
}

die() {
    echo "fault-bench: $*" >&2
    exit 2
}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

target=${CARGO_TARGET_DIR:-target}
CHORUS=""
ONLY=all
ROUNDS=3
STEPS=24
SAVE_EVERY=4
WORLD=2
TRAIN_ARGS="--model gpt --d-model 256 --layers 4 --seq-len 64 --batch 8 --seed 0"
RESTART_STEPS=""
KILL_AT=""
RESTART_BACKEND=auto
TIMEOUT=300

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (--help)"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --chorus) need_value "$@"; CHORUS=$2; shift 2 ;;
        --only) need_value "$@"; ONLY=$2; shift 2 ;;
        --rounds) need_value "$@"; ROUNDS=$2; shift 2 ;;
        --steps) need_value "$@"; STEPS=$2; shift 2 ;;
        --save-every) need_value "$@"; SAVE_EVERY=$2; shift 2 ;;
        --world-size) need_value "$@"; WORLD=$2; shift 2 ;;
        --train-args) need_value "$@"; TRAIN_ARGS=$2; shift 2 ;;
        --restart-steps) need_value "$@"; RESTART_STEPS=$2; shift 2 ;;
        --kill-at-step) need_value "$@"; KILL_AT=$2; shift 2 ;;
        --restart-backend) need_value "$@"; RESTART_BACKEND=$2; shift 2 ;;
        --timeout) need_value "$@"; TIMEOUT=$2; shift 2 ;;
        *) die "unknown argument '$1' (--help)" ;;
    esac
done

positive() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a whole number >= 1, not '$2'"; }
positive --rounds "$ROUNDS"
positive --steps "$STEPS"
positive --save-every "$SAVE_EVERY"
positive --world-size "$WORLD"
positive --timeout "$TIMEOUT"
RESTART_STEPS=${RESTART_STEPS:-$((4 * SAVE_EVERY))}
KILL_AT=${KILL_AT:-$((2 * SAVE_EVERY - 1))}
positive --restart-steps "$RESTART_STEPS"
positive --kill-at-step "$KILL_AT"
case $ONLY in all | saves | restart) ;; *) die "--only takes saves or restart, not '$ONLY'" ;; esac
case $RESTART_BACKEND in auto | ucx | sim) ;; *) die "--restart-backend takes auto, ucx or sim, not '$RESTART_BACKEND'" ;; esac
((STEPS >= SAVE_EVERY)) || die "--steps $STEPS saves nothing before the run's end with --save-every $SAVE_EVERY"
((KILL_AT > SAVE_EVERY)) || die "--kill-at-step $KILL_AT comes before the first save (--save-every $SAVE_EVERY): nothing to resume from"
((KILL_AT < RESTART_STEPS)) || die "--kill-at-step $KILL_AT must come before the job's end (--restart-steps $RESTART_STEPS)"
read -r -a TRAIN <<<"$TRAIN_ARGS"

for tool in python3 timeout nproc date df; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is missing"
done
if [[ -z $CHORUS ]]; then
    CHORUS=$target/release/chorus
    [[ -x $CHORUS ]] || CHORUS=$target/debug/chorus
fi
[[ -x $CHORUS && -f $CHORUS ]] || die "no chorus binary at '$CHORUS': build one (cargo build --release -p chorus-cli --features ucx) or give --chorus PATH"
CHORUS=$(cd "$(dirname "$CHORUS")" && pwd)/$(basename "$CHORUS")
timeout 60 "$CHORUS" train --help 2>/dev/null | grep -q -- '--async-save' ||
    die "$CHORUS has no 'chorus train --async-save': a binary older than issue 44's saves"
HAS_UCX=no
if timeout 60 "$CHORUS" info 2>/dev/null | awk '$1 == "ucx" && $3 == "available" { found = 1 } END { exit !found }'; then
    HAS_UCX=yes
fi
if [[ $RESTART_BACKEND == auto ]]; then
    RESTART_BACKEND=sim
    [[ $HAS_UCX == yes ]] && RESTART_BACKEND=ucx
fi
if [[ $RESTART_BACKEND == ucx && $HAS_UCX != yes && $ONLY != saves ]]; then
    die "--restart-backend ucx: $CHORUS has no usable ucx backend (chorus info); build with --features ucx"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/chorus-fault-bench.XXXXXX")
CHILD=""
cleanup() {
    if [[ -n $CHILD ]]; then kill -TERM "$CHILD" 2>/dev/null || true; wait "$CHILD" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

free_kib=$(df -Pk "$WORK" | awk 'NR == 2 { print $4 }')
((free_kib >= 1048576)) || die "$(dirname "$WORK") has $((free_kib / 1024)) MiB free; the runs need 1 GiB"

# bounded SECONDS LOG CMD...: CMD with its output in LOG, killed after SECONDS
# (SIGTERM, SIGKILL 10 s later); run in the background so that a signal to
# this script stops it (the trap's cleanup).
bounded() {
    local limit=$1 log=$2 rc=0
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 &
    CHILD=$!
    wait "$CHILD" || rc=$?
    CHILD=""
    return "$rc"
}
failed() {
    local log=$1
    shift
    echo "fault-bench: FAILED: $*; the end of its log:" >&2
    if [[ -f $log ]]; then tail -n 25 "$log" >&2; fi
    exit 1
}

# --- the machine -----------------------------------------------------------------
cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo 2>/dev/null || true)
commit=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [[ $commit != unknown ]] && ! git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null; then commit="$commit (tree modified)"; fi
bin_time=$(date -u -r "$CHORUS" '+%F %T UTC')
# The last commit that changed what the binary is built from (not docs, ci or tests).
commit_time=$(TZ=UTC git -C "$ROOT" log -1 --format=%cd --date=format-local:'%F %T UTC' -- . \
    ':!docs/*' ':!ci/*' ':!*/tests/*' ':!*.md' 2>/dev/null || true)
commit_time=${commit_time:-unknown}
profile=unknown
case $CHORUS in */release/*) profile=release ;; */debug/*) profile=debug ;; esac
load=$(cut -d' ' -f1-3 /proc/loadavg)
now=$(date -u '+%F %T UTC')
echo "fault-bench: $now"
echo "  machine: $(nproc) CPUs, ${cpu:-unknown CPU}, $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
echo "  load average (1, 5, 15 min) at the start: $load"
echo "  tree: $commit (its code last changed $commit_time)"
echo "  binary: $CHORUS ($profile, built $bin_time, ucx: $HAS_UCX)"
[[ $commit_time == unknown || ! $bin_time < $commit_time ]] ||
    echo "  note: the binary is older than the tree's last change to its code; rebuild to measure the tree as it is"
python3 - "$now" "$(nproc)" "$cpu" "$load" "$commit" "$commit_time" "$CHORUS" "$profile" "$bin_time" "$HAS_UCX" <<'EOF'
import json, sys
k = ["date_utc", "nproc", "cpu", "loadavg_start", "commit", "code_changed", "binary", "profile", "binary_built", "ucx"]
row = dict(zip(k, sys.argv[1:]))
row["nproc"] = int(row["nproc"])
print(json.dumps({"bench": "machine", **row}))
EOF

# --- 1. step time with no / blocking / asynchronous saves --------------------------
if [[ $ONLY != restart ]]; then
    echo
    echo "1. $ROUNDS rounds x {no save, --save-every $SAVE_EVERY, --save-every $SAVE_EVERY --async-save}:" \
        "chorus train --backend sim --world-size $WORLD --steps $STEPS $TRAIN_ARGS"
    modes=(nosave blocking async)
    for ((r = 1; r <= ROUNDS; r++)); do
        line="   round $r:"
        for ((i = 0; i < 3; i++)); do
            mode=${modes[$(((i + r - 1) % 3))]}
            dir=$WORK/saves/$mode-$r
            mkdir -p "$dir"
            extra=()
            case $mode in
                blocking) extra=(--save-every "$SAVE_EVERY" --checkpoint-dir "$dir/ck") ;;
                async) extra=(--save-every "$SAVE_EVERY" --async-save --checkpoint-dir "$dir/ck") ;;
            esac
            t0=$(date +%s.%N)
            bounded "$TIMEOUT" "$dir/log" "$CHORUS" train --backend sim --world-size "$WORLD" --steps "$STEPS" \
                "${TRAIN[@]}" "${extra[@]}" --out-dir "$dir/out" ||
                failed "$dir/log" "the $mode run of round $r (exit $?; a run is stopped after --timeout $TIMEOUT s)"
            t1=$(date +%s.%N)
            python3 -c 'import sys; print(float(sys.argv[2]) - float(sys.argv[1]))' "$t0" "$t1" >"$dir/wall_s"
            # The checkpoints are not needed past the run (the summary says what each save cost).
            rm -rf "$dir/ck" "$dir/out/model.safetensors"
            line="$line $mode $(printf '%.1f' "$(cat "$dir/wall_s")") s"
        done
        echo "$line"
    done
    python3 ci/fault_bench.py saves "$WORK/saves" 1.1
fi

# --- 2. a rank killed under chorus launch --max-restarts 1 -------------------------
if [[ $ONLY != saves ]]; then
    dir=$WORK/restart
    mkdir -p "$dir"
    if [[ $RESTART_BACKEND == ucx ]]; then
        nproc_per_node=$WORLD
        victim=$((WORLD - 1))
    else
        # Both simulated ranks are threads of one process: the launcher's only rank.
        nproc_per_node=1
        victim=0
    fi
    # The victim rank of the first attempt leaves its pid (that of `chorus train`, which it execs).
    wrapper="if [ \"\$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"\$RANK\" = $victim ]; then \
echo \$\$ > '$dir/victim.pid.tmp' && mv '$dir/victim.pid.tmp' '$dir/victim.pid'; fi; exec \"\$@\""
    echo
    echo "2. chorus launch --nproc-per-node $nproc_per_node --max-restarts 1 -- chorus train --backend $RESTART_BACKEND" \
        "--world-size $WORLD --steps $RESTART_STEPS $TRAIN_ARGS --save-every $SAVE_EVERY --resume auto;" \
        "rank $victim killed once step $KILL_AT is done"
    bounded $((TIMEOUT + 30)) "$dir/bench.log" python3 ci/fault_bench.py restart \
        --ck "$dir/ck" --out "$dir/out" --pid-file "$dir/victim.pid" --at-step "$KILL_AT" \
        --timeout "$TIMEOUT" --log "$dir/launch.log" --backend "$RESTART_BACKEND" --goal 15 -- \
        "$CHORUS" launch --nproc-per-node "$nproc_per_node" --max-restarts 1 -- \
        sh -c "$wrapper" sh "$CHORUS" train --backend "$RESTART_BACKEND" --world-size "$WORLD" \
        --steps "$RESTART_STEPS" "${TRAIN[@]}" --save-every "$SAVE_EVERY" --resume auto \
        --out-dir "$dir/out" --checkpoint-dir "$dir/ck" || {
        cat "$dir/bench.log" >&2
        failed "$dir/launch.log" "the restart measurement"
    }
    cat "$dir/bench.log"
fi

load=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load average at the end: $load"
printf '{"bench": "machine_end", "date_utc": "%s", "loadavg_end": "%s"}\n' "$(date -u '+%F %T UTC')" "$load"
