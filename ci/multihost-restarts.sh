#!/usr/bin/env bash
# Issue 44 on hosts made of namespaces (ci/netns-cluster.sh): 3 hosts x 2
# ranks, UCX, 1 Gbit/s links, each host its own hostname and IPC namespace;
# every host runs `chorus launch --nnodes 2:3 --max-restarts 1` of a
# transformer that `chorus train --resume auto` continues. While a
# checkpoint is being written, every process of host 2 is killed (SIGKILL:
# a dead host). Checks:
#   1. the two other launchers restart the job on 2 hosts x 2 ranks, which
#      resume from a complete checkpoint (the one being written, where every
#      rank had written its shards before the kill and rank 0 completed it,
#      or else the one before: a half-written one is never read) and
#      finish: both exit 0;
#   2. the summary names host 2 as what failed, the step resumed from, and
#      the work lost;
#   3. the final weights equal, bit for bit, those of a run on 2 hosts x 2
#      ranks never interrupted that resumes from the same checkpoint.
# Prints the time from the fault to the end of the job and the summary's
# account of the restart. Every wait is bounded. A few minutes on 2 cores.
#
#   ci/multihost-restarts.sh [path/to/chorus]   (default: target/debug/chorus, built with --features ucx)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=ci/netns-cluster.sh
source ci/netns-cluster.sh

netns_chorus_binary "${1:-${CARGO_TARGET_DIR:-target}/debug/chorus}" "cargo build -p chorus-cli --features ucx"

WORK=$(mktemp -d /tmp/chorus-restarts.XXXXXX)
cleanup() {
    cluster_down
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

PORT=29500
step() { printf '\n=== multihost restarts: %s ===\n' "$*"; }
fail() {
    echo "multihost restarts: FAILED: $*" >&2
    exit 1
}
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'; }

# The job: a small transformer; a global batch of 12 is 2 rows per rank on
# 6 ranks and 3 on 4. Each rank takes the launcher's world size.
JOB=(train --model gpt --layers 2 --d-model 128 --heads 4 --seq-len 32 --global-batch 12 --backend ucx
    --steps 40 --save-every 4)

# launch_on I LOG NNODES EXTRA...: host I's launcher of the job (2 ranks),
# its output in LOG; sets LAUNCHER[I].
declare -a LAUNCHER
launch_on() {
    local i=$1 log=$2 nnodes=$3
    shift 3
    host_exec "$i" env CHORUS_TRACE_DIR="${log%.log}.trace" \
        "$CHORUS" launch --nproc-per-node 2 --nnodes "$nnodes" --node-rank "$i" \
        --master-addr "$(host_addr 0)" --master-port "$PORT" --timeout 60 --grace 2 --run-id restarts \
        --max-restarts 1 -- sh -c 'exec "$0" "$@" --world-size "$WORLD_SIZE"' "$CHORUS" "${JOB[@]}" "$@" \
        >"$log" 2>&1 &
    LAUNCHER[i]=$!
}

# wait_launcher I LIMIT: waits at most LIMIT seconds for host I's launcher; its exit status (124: still running).
wait_launcher() {
    local pid=${LAUNCHER[$1]} limit=$2 start=$EPOCHREALTIME
    while kill -0 "$pid" 2>/dev/null; do
        if awk -v s="$(since "$start")" -v l="$limit" 'BEGIN { exit !(s > l) }'; then
            kill -KILL "$pid" 2>/dev/null || true
            return 124
        fi
        sleep 0.05
    done
    local rc=0
    wait "$pid" || rc=$?
    return "$rc"
}

cluster_up 3 1gbit 0

step "host 2 killed during a save: the job resumes on 2 hosts x 2 ranks from the last complete checkpoint"
OUT=$WORK/out CK=$WORK/ck
for i in 0 1 2; do
    launch_on "$i" "$WORK/h$i.log" 2:3 --out-dir "$OUT" --checkpoint-dir "$CK" --resume auto
done
# A first checkpoint complete, then the next save under way.
waited=$EPOCHREALTIME
until [[ -f "$CK/latest" ]] && compgen -G "$CK/.tmp-step-*" >/dev/null; do
    awk -v s="$(since "$waited")" 'BEGIN { exit !(s > 180) }' &&
        { tail -n 20 "$WORK/h0.log" >&2; fail "no save under way after 180 s"; }
    sleep 0.005
done
saving=$(compgen -G "$CK/.tmp-step-*" | head -n 1)
t0=$EPOCHREALTIME
host_signal 2 KILL
rc0=0 rc1=0
wait_launcher 0 300 || rc0=$?
wait_launcher 1 300 || rc1=$?
took=$(since "$t0")
if ((rc0 != 0 || rc1 != 0)); then
    tail -n 40 "$WORK/h0.log" "$WORK/h1.log" >&2
    fail "the launchers of hosts 0 and 1 exited $rc0 and $rc1"
fi
echo "multihost restarts: killed host 2 while writing ${saving##*/}; hosts 0 and 1 finished $took s later"
grep -E 'restarting|continues without|attempt [0-9]:' "$WORK/h0.log" | sed 's/^/    /'
[[ -z "$(host_pids 2)" ]] || fail "processes left on host 2: $(host_pids 2)"
from=$(python3 - "$OUT/summary.json" "$(host_ns 2)" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
r = s["restart"]
assert s["config"]["world_size"] == 4, s["config"]["world_size"]
failure = r["earlier_attempts"][0]["failure"]
assert "node 2 on host " + sys.argv[2] in failure, failure
p = r["previous_attempt"]
print(f"multihost restarts: resumed from step {r['resumed_from']['step']} on 4 ranks; lost {p['lost_steps']} "
      f"step(s), {p['lost_seconds']:.2f} s; {p['seconds_from_its_last_step_to_this_start']:.2f} s from the last "
      f"step to the restart; what failed: {failure}", file=sys.stderr)
print(r["resumed_from"]["step"])
EOF
) || fail "the summary does not tell the restart"
[[ -f "$CK/step-$(printf %08d "$from")/chorus_checkpoint.json" ]] || fail "step $from is not a complete checkpoint"

step "the same checkpoint resumed on 2 hosts x 2 ranks, never interrupted: the same weights"
for i in 0 1; do
    launch_on "$i" "$WORK/r$i.log" 2 --out-dir "$WORK/ref" --checkpoint-dir "$WORK/ref-ck" \
        --resume "$CK/step-$(printf %08d "$from")"
done
for i in 0 1; do
    rc=0
    wait_launcher "$i" 300 || rc=$?
    ((rc == 0)) || { tail -n 30 "$WORK/r$i.log" >&2; fail "the reference run's host $i exited $rc"; }
done
cmp -s "$OUT/model.safetensors" "$WORK/ref/model.safetensors" ||
    fail "the restarted job's weights differ from the uninterrupted run's from step $from"
echo "multihost restarts: the restarted job's model.safetensors equals the reference's, byte for byte"
echo "multihost restarts: passed"
