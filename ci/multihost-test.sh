#!/usr/bin/env bash
# chorus across hosts made of namespaces (ci/netns-cluster.sh): 2 hosts x 2
# ranks, one `chorus launch --nnodes 2` per host, the UCX backend (TCP between
# the hosts, shared memory inside one), each host its own hostname and IPC
# namespace, 1 Gbit/s links. Checks:
#   1. the whole conformance suite passes (about 45 s here);
#   2. FSDP (the MLP) and HSDP (the transformer, replicas across the hosts)
#      end with the simulator's parameters;
#   3. under torchrun --nnodes 2 (static rendezvous across the hosts), FSDP
#      ends with the simulator's parameters (skipped without PyTorch);
#   4. a transformer checkpoint saved on 2 hosts x 2 ranks resumes on 1 host
#      x 2 ranks and on 4 hosts x 1 rank, each equal to the simulator resumed
#      from the same checkpoint (4 x 1: to the uninterrupted run);
#   5. faults during a collective and during a checkpoint save: every process
#      of one host killed (SIGKILL) or stopped (SIGSTOP: a hung host), for
#      the host that runs the store and for the other, and one host's link
#      set down (a partition): the surviving launchers exit non-zero within
#      10 s, naming the failed node and its host; no process is left on any
#      host; after a save's fault the previous checkpoint is intact and
#      resumes;
#   6. one rank stalled (SIGSTOP): the others fail at their deadline
#      (CHORUS_UCX_TIMEOUT_S=5 here) and chorus trace, on either host's dump
#      directory (each launcher fetches the other's dumps), names the rank;
#   7. hosts sharing the machine's hostname and IPC namespace: no stalls.
# Prints the time each fault took to detect. About 4 minutes on 2 cores.
#
#   ci/multihost-test.sh [path/to/chorus]   (default: target/debug/chorus, built with --features ucx)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=ci/netns-cluster.sh
source ci/netns-cluster.sh

netns_chorus_binary "${1:-${CARGO_TARGET_DIR:-target}/debug/chorus}" "cargo build -p chorus-cli --features ucx"

WORK=$(mktemp -d /tmp/chorus-multihost.XXXXXX)
cleanup() {
    cluster_down
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# The whole suite unless CHORUS_MULTIHOST_FILTER names a part (`--filter`'s syntax).
SUITE_FILTER=${CHORUS_MULTIHOST_FILTER:-}
# A survivor must end within this many seconds of the fault.
DETECT_LIMIT=10
PORT=29500

step() { printf '\n=== multihost: %s ===\n' "$*"; }
fail() {
    echo "multihost: FAILED: $*" >&2
    exit 1
}
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'; }

# The job's shape: NNODES hosts (0..NNODES-1) of NPROC ranks each.
NNODES=2
NPROC=2

# launch_on I LOG ARGS...: starts host I's launcher (NPROC ranks of `chorus
# ARGS`) in the background, its output in LOG, its ranks' flight-recorder
# dumps in LOG's name with .trace; sets LAUNCHER[I] to its pid. Extra
# variables for the ranks: RANK_ENV (NAME=VALUE ...).
declare -a LAUNCHER
RANK_ENV=()
launch_on() {
    local i=$1 log=$2
    shift 2
    host_exec "$i" env CHORUS_TRACE_DIR="${log%.log}.trace" "${RANK_ENV[@]}" \
        "$CHORUS" launch --nproc-per-node "$NPROC" --nnodes "$NNODES" --node-rank "$i" \
        --master-addr "$(host_addr 0)" --master-port "$PORT" --timeout 60 --grace 2 --run-id multihost \
        -- "$CHORUS" "$@" >"$log" 2>&1 &
    LAUNCHER[i]=$!
}

# wait_launcher I LIMIT: waits at most LIMIT seconds for host I's launcher; its exit status (124: still running).
wait_launcher() {
    local pid=${LAUNCHER[$1]} limit=$2 start=$EPOCHREALTIME
    while kill -0 "$pid" 2>/dev/null; do
        if awk -v s="$(since "$start")" -v l="$limit" 'BEGIN { exit !(s > l) }'; then
            return 124
        fi
        sleep 0.05
    done
    local rc=0
    wait "$pid" || rc=$?
    return "$rc"
}

# all_pass WHAT ARGS...: each host of the job runs its own `chorus launch`
# of `chorus ARGS`, and every one must pass.
all_pass() {
    local what=$1 i rc bad=""
    shift
    for ((i = 0; i < NNODES; i++)); do
        launch_on "$i" "$WORK/h$i.log" "$@"
    done
    for ((i = 0; i < NNODES; i++)); do
        rc=0
        wait_launcher "$i" 300 || rc=$?
        ((rc == 0)) || bad+=" host $i: $rc"
    done
    if [[ -n "$bad" ]]; then
        for ((i = 0; i < NNODES; i++)); do tail -n 30 "$WORK/h$i.log" >&2; done
        fail "$what: the launchers exited:$bad"
    fi
}

# host_name I: host I's host name (its UTS namespace's; the fault cases run on hosts with their own).
host_name() { host_ns "$1"; }

# same A B [ARGS]: the tensors B wrote equal A's (ci/multihost_compare.py).
same() { python3 ci/multihost_compare.py "$@" | sed 's/^/multihost: /' || fail "$2 differs from $1"; }

# The transformer of the HSDP and checkpoint checks: small, a few steps.
GPT=(train --model gpt --layers 2 --d-model 32 --heads 2 --seq-len 16 --batch 2)
sim_run() {
    local log=$1
    shift
    "$CHORUS" "$@" --backend sim >"$log" 2>&1 || { tail -n 20 "$log" >&2; fail "the simulator's run ($*)"; }
}

cluster_up 2 1gbit 0

step "conformance over UCX across 2 hosts x 2 ranks (${SUITE_FILTER:-the whole suite})"
start=$EPOCHREALTIME
suite=(conformance --backend ucx --world-size 4)
[[ -z "$SUITE_FILTER" ]] || suite+=(--filter "$SUITE_FILTER")
all_pass conformance "${suite[@]}"
summary=$(grep -E '^\[rank 0\] [0-9]+ passed, ' "$WORK/h0.log" | tail -n 1)
[[ "$summary" == *" 0 failed"* ]] || fail "conformance: no clean summary: ${summary:-none}"
passed=${summary#\[rank 0\] }
passed=${passed%% *}
min_cases=$([[ -z "$SUITE_FILTER" ]] && echo 2000 || echo 1)
((passed >= min_cases)) || fail "conformance: only $passed cases ran: $summary"
echo "multihost: conformance: $summary ($(since "$start") s)"

step "FSDP across the hosts equals the simulator"
start=$EPOCHREALTIME
train=(train --model mlp --world-size 4 --steps 6 --optimizer adamw)
"$CHORUS" "${train[@]}" --dims 24,80,48,6 --backend sim --out-dir "$WORK/sim" >"$WORK/sim.log" 2>&1 ||
    { cat "$WORK/sim.log" >&2; fail "the simulator's training"; }
all_pass fsdp "${train[@]}" --init-dir "$WORK/sim/init" --backend ucx --out-dir "$WORK/ucx"
same "$WORK/sim" "$WORK/ucx" --files 6
echo "multihost: FSDP took $(since "$start") s"

step "HSDP across the hosts (shard groups inside a host, replicas across the hosts) equals the simulator"
start=$EPOCHREALTIME
sim_run "$WORK/hsdp-sim.log" "${GPT[@]}" --world-size 4 --hsdp 2 --steps 4 --out-dir "$WORK/hsdp-sim"
all_pass hsdp "${GPT[@]}" --world-size 4 --hsdp 2 --steps 4 --backend ucx --out-dir "$WORK/hsdp-ucx"
same "$WORK/hsdp-sim" "$WORK/hsdp-ucx" --files 1
echo "multihost: HSDP took $(since "$start") s"

step "torchrun --nnodes 2 across the hosts: FSDP equals the simulator"
if [[ -z "${CHORUS_PYTHON:-}" ]] || ! "$CHORUS_PYTHON" -c 'import torch.distributed.run' 2>/dev/null; then
    echo "multihost: SKIPPED: torchrun across hosts (no PyTorch: source ci/python-env.sh, which sets CHORUS_PYTHON)"
else
    start=$EPOCHREALTIME
    for i in 0 1; do
        host_exec "$i" env CHORUS_TRACE_DIR="$WORK/torchrun.trace" "$CHORUS_PYTHON" -m torch.distributed.run \
            --nnodes 2 --node-rank "$i" --nproc-per-node 2 --master-addr "$(host_addr 0)" --master-port "$PORT" \
            --no-python "$CHORUS" "${train[@]}" --init-dir "$WORK/sim/init" --backend ucx --out-dir "$WORK/torchrun" \
            >"$WORK/torchrun$i.log" 2>&1 &
        LAUNCHER[i]=$!
    done
    rc0=0 rc1=0
    wait_launcher 0 300 || rc0=$?
    wait_launcher 1 60 || rc1=$?
    if ((rc0 != 0 || rc1 != 0)); then
        tail -n 30 "$WORK/torchrun0.log" "$WORK/torchrun1.log" >&2
        fail "torchrun across hosts: exited $rc0 and $rc1"
    fi
    same "$WORK/sim" "$WORK/torchrun" --files 6
    echo "multihost: torchrun took $(since "$start") s"
fi

step "a checkpoint saved on 2 hosts x 2 ranks resumes on 1 host x 2 ranks"
start=$EPOCHREALTIME
CKPT=$WORK/ckpt
sim_run "$WORK/u8.log" "${GPT[@]}" --world-size 4 --steps 8 --out-dir "$WORK/uninterrupted"
all_pass "save on 2x2" "${GPT[@]}" --world-size 4 --steps 4 --save-every 2 --backend ucx --out-dir "$WORK/first4" \
    --checkpoint-dir "$CKPT"
[[ "$(cat "$CKPT/latest")" == step-00000004 ]] || fail "save on 2x2: latest is $(cat "$CKPT/latest")"
sim_run "$WORK/r2.log" "${GPT[@]}" --world-size 2 --steps 8 --resume "$CKPT" --out-dir "$WORK/resumed2-sim" \
    --checkpoint-dir "$WORK/resumed2-sim-ckpt"
NNODES=1
all_pass "resume on 1x2" "${GPT[@]}" --world-size 2 --steps 8 --resume "$CKPT" --backend ucx \
    --out-dir "$WORK/resumed2" --checkpoint-dir "$WORK/resumed2-ckpt"
NNODES=2
same "$WORK/resumed2-sim" "$WORK/resumed2" --files 1
echo "multihost: checkpoint across topologies (2x2 -> 1x2) took $(since "$start") s"

# The transformer of the faults during a save: large enough (3.2M
# parameters, 37 MB per checkpoint) that a save takes a while.
BIG=(train --model gpt --layers 4 --d-model 256 --heads 4 --seq-len 32 --batch 2 --world-size 4)
FAULTS=0
declare -a DETECTED

# fault VICTIM SIGNAL WHEN: both hosts busy; every process of host VICTIM
# gets SIGNAL (PARTITION: its link is set down instead) WHEN is
# `collective` (in a long run of all_gathers) or `save` (while a checkpoint
# is being written: a .tmp-step-* directory exists). The other launcher
# (for a partition: both) must exit non-zero within DETECT_LIMIT s, naming
# the failure; no process may be left; after a save, `latest` must name a
# complete checkpoint that resumes.
fault() {
    local victim=$1 signal=$2 when=$3 survivor=$((1 - $1))
    FAULTS=$((FAULTS + 1))
    local ck=$WORK/fault$FAULTS-ckpt
    local job
    if [[ "$when" == save ]]; then
        job=("${BIG[@]}" --steps 100000 --save-every 1 --keep-last 2 --backend ucx --out-dir "$WORK/fault$FAULTS-out"
            --checkpoint-dir "$ck")
    else
        job=(bench --backend ucx --world-size 4 --op all_gather --min-bytes 1M --max-bytes 1M --iters 1000000 --warmup 0)
    fi
    launch_on 0 "$WORK/f0.log" "${job[@]}"
    launch_on 1 "$WORK/f1.log" "${job[@]}"
    # Every rank running (4 processes named chorus besides the launchers) and a few collectives done.
    local tries=0
    until [[ $(host_pids 0 | wc -l) -ge 4 && $(host_pids 1 | wc -l) -ge 4 ]]; do
        ((tries++ < 200)) || fail "fault: the ranks did not start"
        sleep 0.05
    done
    if [[ "$when" == save ]]; then
        # A first checkpoint complete, then the next save under way.
        local waited=$EPOCHREALTIME
        until [[ -f "$ck/latest" ]] && compgen -G "$ck/.tmp-step-*" >/dev/null; do
            awk -v s="$(since "$waited")" 'BEGIN { exit !(s > 120) }' &&
                { tail -n 20 "$WORK/f0.log" >&2; fail "fault: no save under way after 120 s"; }
            sleep 0.005
        done
    else
        sleep 3
    fi
    local t0=$EPOCHREALTIME rc=0 rc_victim=0
    if [[ "$signal" == PARTITION ]]; then
        host_link "$victim" down
        wait_launcher "$survivor" 30 || rc=$?
        wait_launcher "$victim" 30 || rc_victim=$?
        host_link "$victim" up
    else
        host_signal "$victim" "$signal"
        wait_launcher "$survivor" 30 || rc=$?
    fi
    local took
    took=$(since "$t0")
    local name="host $victim ${signal} during a $when"
    DETECTED+=("$(printf '%-36s %6s s' "$name" "$took")")
    if [[ "$signal" == PARTITION ]]; then
        echo "multihost: fault: host $victim cut off during a $when: its launcher exited $rc_victim, both within $took s"
        grep -E 'chorus launch: failed' "$WORK/f$victim.log" | sed 's/^/    /'
        ((rc_victim != 0 && rc_victim != 124)) || fail "fault: the cut-off launcher exited $rc_victim"
    fi
    echo "multihost: fault: $name: host $survivor's launcher exited $rc after $took s"
    grep -E 'chorus launch: failed|not been heard|lost the job|rank [0-9].*(error|aborted|timed out|reset)' \
        "$WORK/f$survivor.log" | head -n 6 | sed 's/^/    /'
    ((rc != 0 && rc != 124)) || { tail -n 20 "$WORK/f$survivor.log" >&2; fail "fault: the surviving launcher exited $rc"; }
    awk -v t="$took" -v l="$DETECT_LIMIT" 'BEGIN { exit !(t < l) }' ||
        fail "fault: $name took $took s to end the job (limit $DETECT_LIMIT s)"
    grep -q 'chorus launch: failed' "$WORK/f$survivor.log" || fail "fault: no failure summary"
    # The summary names the lost node and its host (the launchers publish their hostnames).
    grep -q "node $victim on host $(host_name "$victim")" "$WORK/f$survivor.log" ||
        { grep 'chorus launch' "$WORK/f$survivor.log" >&2; fail "fault: the survivor does not name node $victim on host $(host_name "$victim")"; }
    # A killed peer resets the connections: a surviving rank reports the typed error before it is stopped.
    if [[ "$signal" == KILL && "$when" == collective ]]; then
        grep -qE '^\[rank [0-9]+\] error: .*(communicator aborted|timed out)' "$WORK/f$survivor.log" ||
            fail "fault: no surviving rank reported a typed error"
    fi
    # The survivor left nothing behind.
    tries=0
    until [[ -z "$(host_pids "$survivor")" ]]; do
        ((tries++ < 100)) || fail "fault: left on host $survivor: $(host_pids "$survivor" | xargs ps -o pid,args -p)"
        sleep 0.05
    done
    # The victim's processes are ended by the test (a stopped host is killed).
    host_signal "$victim" KILL
    wait_launcher "$victim" 10 || true
    # Killed ranks are reaped by init a moment after their launcher.
    tries=0
    until [[ -z "$(host_pids "$victim")" ]]; do
        ((tries++ < 100)) || fail "fault: left on host $victim after SIGKILL: $(host_pids "$victim" | xargs ps -o pid,stat,args -p)"
        sleep 0.05
    done
    if [[ "$when" == save ]]; then
        # The checkpoint `latest` names is whole: it resumes (on sim) for one more step.
        local latest step
        latest=$(cat "$ck/latest") || fail "fault: $ck/latest is gone"
        step=$((10#${latest#step-}))
        sim_run "$WORK/fault$FAULTS-resume.log" "${BIG[@]}" --steps $((step + 1)) --resume "$ck" \
            --out-dir "$WORK/fault$FAULTS-resumed" --checkpoint-dir "$WORK/fault$FAULTS-resumed-ckpt"
        echo "multihost: fault: the previous checkpoint ($latest) is intact: resumed to step $((step + 1))"
    fi
}

step "faults during a collective (limit: $DETECT_LIMIT s from the fault to the surviving launcher's exit)"
fault 1 KILL collective
fault 1 STOP collective
fault 0 KILL collective
fault 0 STOP collective
fault 1 PARTITION collective

step "faults during a checkpoint save (limit: $DETECT_LIMIT s; the previous checkpoint must stay whole)"
fault 1 KILL save
fault 0 KILL save
fault 1 STOP save
fault 0 STOP save
fault 1 PARTITION save

step "a stalled rank (SIGSTOP of rank 3 alone): the others fail at their deadline; chorus trace names it"
RANK_ENV=(CHORUS_UCX_TIMEOUT_S=5)
stall=("${GPT[@]}" --world-size 4 --steps 100000 --save-every 5 --keep-last 1 --backend ucx --out-dir "$WORK/stall-out"
    --checkpoint-dir "$WORK/stall-ckpt")
launch_on 0 "$WORK/s0.log" "${stall[@]}"
launch_on 1 "$WORK/s1.log" "${stall[@]}"
RANK_ENV=()
# Training under way: a first checkpoint written (the start-up's barriers are behind every rank).
start=$EPOCHREALTIME
until [[ -f "$WORK/stall-ckpt/latest" ]]; do
    awk -v s="$(since "$start")" 'BEGIN { exit !(s > 120) }' && { tail -n 20 "$WORK/s0.log" >&2; fail "stalled rank: no checkpoint after 120 s"; }
    sleep 0.05
done
# Rank 3 is host 1's second rank: the process whose environment says RANK=3.
stalled=""
for pid in $(host_pids 1); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'RANK=3'; then stalled=$pid; fi
done
[[ -n "$stalled" ]] || fail "stalled rank: no process with RANK=3 on host 1"
t0=$EPOCHREALTIME
kill -STOP "$stalled"
rc0=0 rc1=0
wait_launcher 0 30 || rc0=$?
wait_launcher 1 30 || rc1=$?
took=$(since "$t0")
DETECTED+=("$(printf '%-36s %6s s' "rank 3 SIGSTOP (deadline 5 s)" "$took")")
kill -KILL "$stalled" 2>/dev/null || true
echo "multihost: stalled rank: the launchers exited $rc0 and $rc1 after $took s"
grep -E '^\[rank [0-9]+\] error' "$WORK/s0.log" "$WORK/s1.log" | head -n 4 | sed 's/^/    /' || true
((rc0 != 0 && rc0 != 124 && rc1 != 0 && rc1 != 124)) || fail "stalled rank: the launchers exited $rc0 and $rc1"
grep -qE '^\[rank [0-2]\] error: .*timed out' "$WORK/s0.log" "$WORK/s1.log" ||
    fail "stalled rank: no other rank reported a timeout"
awk -v t="$took" 'BEGIN { exit !(t < 15) }' || fail "stalled rank: $took s to end the job (deadline 5 s)"
for i in 0 1; do
    [[ -z "$(host_pids "$i")" ]] || fail "stalled rank: left on host $i"
    trace=$("$CHORUS" trace "$WORK/s$i.trace") || fail "stalled rank: chorus trace $WORK/s$i.trace failed: $trace"
    grep -qE 'NO DUMP from rank 3 |NEVER REACHED: rank 3 |STALLED: rank 3 ' <<<"$trace" ||
        { echo "$trace" >&2; fail "stalled rank: chorus trace on host $i's dumps does not name rank 3"; }
    echo "multihost: stalled rank: chorus trace on host $i's directory: $(grep -E 'NO DUMP|NEVER REACHED|STALLED' <<<"$trace" | head -n 1)"
done

step "the checkpoint of 2 hosts x 2 ranks resumes on 4 hosts x 1 rank, equal to the uninterrupted run"
cluster_down
cluster_up 4 1gbit 0
start=$EPOCHREALTIME
NNODES=4 NPROC=1
all_pass "resume on 4x1" "${GPT[@]}" --world-size 4 --steps 8 --resume "$CKPT" --backend ucx \
    --out-dir "$WORK/resumed4" --checkpoint-dir "$WORK/resumed4-ckpt"
NNODES=2 NPROC=2
same "$WORK/uninterrupted" "$WORK/resumed4" --files 1
echo "multihost: checkpoint across topologies (2x2 -> 4x1) took $(since "$start") s"

step "time to detect (from the fault to the surviving launcher's exit)"
printf 'multihost:   %s\n' "${DETECTED[@]}"

step "hosts sharing the machine's hostname and IPC namespace: no 100 ms stalls (UCX's shared memory across network namespaces)"
cluster_down
cluster_up 2 none 1
all_pass "shared host" bench --backend ucx --world-size 4 --op all_reduce --min-bytes 256K --max-bytes 8M --iters 3 --warmup 1
grep -q 'the ranks get UCX_TLS=^sm' "$WORK/h0.log" || fail "shared host: the launcher did not notice the shared IPC namespace"
grep -E '^\[rank 0\] +[0-9]+ ' "$WORK/h0.log" | sed 's/^/    /'
# A stalled call takes 600 ms and more (six ring steps, each woken by a 100 ms poll); unstalled ones take 2-30 ms here.
worst=$(grep -E '^\[rank 0\] +[0-9]+ ' "$WORK/h0.log" | awk '{ if ($8 > w) w = $8 } END { print w + 0 }')
awk -v w="$worst" 'BEGIN { exit !(w < 300000) }' || fail "shared host: an all_reduce took $worst us (a stall)"
echo "multihost: shared host: slowest all_reduce $worst us"

step "all multihost checks passed"
