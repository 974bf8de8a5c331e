#!/usr/bin/env bash
# chorus across hosts made of namespaces (ci/netns-cluster.sh): 2 hosts x 2
# ranks, one `chorus launch --nnodes 2` per host, the UCX backend (TCP between
# the hosts, shared memory inside one), each host its own hostname and IPC
# namespace, 1 Gbit/s links. Checks:
#   1. the whole conformance suite passes (about 45 s here);
#   2. FSDP training across the hosts ends with the simulator's parameters;
#   3. faults during a collective: every process of one host killed
#      (SIGKILL), or stopped (SIGSTOP: a hung host), for the host that runs
#      the store and for the other, and one host's link set down (a
#      partition): the surviving launchers exit non-zero within 10 s, naming
#      the failure; no process is left on any host;
#   4. hosts sharing the machine's hostname and IPC namespace: no stalls.
# Prints the time each fault took to detect. About 1.7 minutes on 2 cores.
#
#   ci/multihost-test.sh [path/to/chorus]   (default: target/debug/chorus, built with --features ucx)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=ci/netns-cluster.sh
source ci/netns-cluster.sh

CHORUS=$(realpath "${1:-${CARGO_TARGET_DIR:-target}/debug/chorus}")
[[ -x "$CHORUS" ]] || netns_die "$CHORUS: no chorus binary (cargo build -p chorus --features ucx)"
"$CHORUS" conformance --backend ucx --list >/dev/null 2>&1 ||
    netns_die "$CHORUS was built without UCX (cargo build -p chorus --features ucx)"

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

# launch_on I LOG ARGS...: starts host I's launcher (2 ranks of `chorus ARGS`)
# in the background, its output in LOG; sets LAUNCHER[I] to its pid.
declare -a LAUNCHER
launch_on() {
    local i=$1 log=$2
    shift 2
    host_exec "$i" "$CHORUS" launch --nproc-per-node 2 --nnodes 2 --node-rank "$i" \
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

# Each host runs its own `chorus launch` and both must pass.
both_pass() {
    local what=$1
    shift
    launch_on 0 "$WORK/h0.log" "$@"
    launch_on 1 "$WORK/h1.log" "$@"
    local rc0=0 rc1=0
    wait_launcher 0 300 || rc0=$?
    wait_launcher 1 60 || rc1=$?
    if ((rc0 != 0 || rc1 != 0)); then
        tail -n 30 "$WORK/h0.log" "$WORK/h1.log" >&2
        fail "$what: the launchers exited $rc0 and $rc1"
    fi
}

cluster_up 2 1gbit 0

step "conformance over UCX across 2 hosts x 2 ranks (${SUITE_FILTER:-the whole suite})"
start=$EPOCHREALTIME
suite=(conformance --backend ucx --world-size 4)
[[ -z "$SUITE_FILTER" ]] || suite+=(--filter "$SUITE_FILTER")
both_pass conformance "${suite[@]}"
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
both_pass fsdp "${train[@]}" --init-dir "$WORK/sim/init" --backend ucx --out-dir "$WORK/ucx"
python3 - "$WORK/sim" "$WORK/ucx" <<'EOF' || fail "FSDP across hosts differs from the simulator"
# Every parameter file (.npy, float32) of the simulator's run equals the
# cross-host run's within 1e-6; plain Python, no NumPy.
import ast, os, struct, sys
def npy(path):
    b = open(path, "rb").read()
    assert b[:6] == b"\x93NUMPY", path
    n, start = (struct.unpack("<H", b[8:10])[0], 10) if b[6] == 1 else (struct.unpack("<I", b[8:12])[0], 12)
    header = ast.literal_eval(b[start:start + n].decode())
    assert header["descr"] == "<f4", (path, header)
    data = b[start + n:]
    return struct.unpack("<%df" % (len(data) // 4), data)
sim, ucx = sys.argv[1], sys.argv[2]
names = sorted(f for f in os.listdir(sim) if f.endswith(".npy"))
assert len(names) == 6, names
for name in names:
    a, b = npy(os.path.join(sim, name)), npy(os.path.join(ucx, name))
    assert len(a) == len(b), name
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= 1e-6, (name, worst)
print("multihost: FSDP: %d parameter files equal the simulator's within 1e-6" % len(names))
EOF
echo "multihost: FSDP took $(since "$start") s"

# fault VICTIM SIGNAL: both hosts in a long all_gather; every process of host
# VICTIM gets SIGNAL (PARTITION: its link is set down instead); the other
# launcher (for a partition: both) must exit non-zero within DETECT_LIMIT s.
fault() {
    local victim=$1 signal=$2 survivor=$((1 - $1))
    launch_on 0 "$WORK/f0.log" bench --backend ucx --world-size 4 --op all_gather --min-bytes 1M --max-bytes 1M \
        --iters 1000000 --warmup 0
    launch_on 1 "$WORK/f1.log" bench --backend ucx --world-size 4 --op all_gather --min-bytes 1M --max-bytes 1M \
        --iters 1000000 --warmup 0
    # Every rank running (4 processes named chorus besides the launchers) and a few collectives done.
    local tries=0
    until [[ $(host_pids 0 | wc -l) -ge 4 && $(host_pids 1 | wc -l) -ge 4 ]]; do
        ((tries++ < 200)) || fail "fault: the ranks did not start"
        sleep 0.05
    done
    sleep 3
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
    if [[ "$signal" == PARTITION ]]; then
        echo "multihost: fault: host $victim cut off: its launcher exited $rc_victim, both within $took s"
        grep -E 'chorus launch: failed' "$WORK/f$victim.log" | sed 's/^/    /'
        ((rc_victim != 0 && rc_victim != 124)) || fail "fault: the cut-off launcher exited $rc_victim"
    fi
    echo "multihost: fault: host $victim ${signal}: host $survivor's launcher exited $rc after $took s"
    grep -E 'chorus launch: failed|not been heard|lost the job|rank [0-9].*(error|aborted|timed out|reset)' \
        "$WORK/f$survivor.log" | head -n 6 | sed 's/^/    /'
    ((rc != 0 && rc != 124)) || { tail -n 20 "$WORK/f$survivor.log" >&2; fail "fault: the surviving launcher exited $rc"; }
    awk -v t="$took" -v l="$DETECT_LIMIT" 'BEGIN { exit !(t < l) }' ||
        fail "fault: host $victim $signal took $took s to end the job (limit $DETECT_LIMIT s)"
    grep -q 'chorus launch: failed' "$WORK/f$survivor.log" || fail "fault: no failure summary"
    # A killed peer resets the connections: a surviving rank reports the typed error before it is stopped.
    if [[ "$signal" == KILL ]]; then
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
    [[ -z "$(host_pids "$victim")" ]] || fail "fault: left on host $victim after SIGKILL"
}

step "faults during a collective (limit: $DETECT_LIMIT s from the fault to the surviving launcher's exit)"
fault 1 KILL
fault 1 STOP
fault 0 KILL
fault 0 STOP
fault 1 PARTITION

step "hosts sharing the machine's hostname and IPC namespace: no 100 ms stalls (UCX's shared memory across network namespaces)"
cluster_down
cluster_up 2 none 1
both_pass "shared host" bench --backend ucx --world-size 4 --op all_reduce --min-bytes 256K --max-bytes 8M --iters 3 --warmup 1
grep -q 'the ranks get UCX_TLS=^sm' "$WORK/h0.log" || fail "shared host: the launcher did not notice the shared IPC namespace"
grep -E '^\[rank 0\] +[0-9]+ ' "$WORK/h0.log" | sed 's/^/    /'
# A stalled call takes 600 ms and more (six ring steps, each woken by a 100 ms poll); unstalled ones take 2-30 ms here.
worst=$(grep -E '^\[rank 0\] +[0-9]+ ' "$WORK/h0.log" | awk '{ if ($8 > w) w = $8 } END { print w + 0 }')
awk -v w="$worst" 'BEGIN { exit !(w < 300000) }' || fail "shared host: an all_reduce took $worst us (a stall)"
echo "multihost: shared host: slowest all_reduce $worst us"

step "all multihost checks passed"
