#!/usr/bin/env bash
# The collectives across hosts made of namespaces (ci/netns-cluster.sh): 2
# hosts x 2 ranks, one `chorus launch --nnodes 2 --node-rank i` per host, the
# UCX backend, links limited with tc tbf to 1 and 10 Gbit/s. For all_reduce,
# all_gather and reduce_scatter of 64 MiB (f32; the largest buffer a rank
# holds, nccl-tests' convention): the flat ring (CHORUS_UCX_FLAT=1) against
# the hierarchical schedule (collectives/src/ucx/hierarchy.rs), the
# link-bound lower bound of the best schedule, and PyTorch gloo under
# `torchrun --nnodes 2` on the same namespaces (SKIPPED without the venv of
# ci/python-env.sh). Prints a table and one JSON object per row.
#
# The bound, with S = 64 MiB, H = 2 hosts and a link rate R per direction
# (tbf on both ends of each host's veth): bytes that must cross a host's link
# / R, counting payload only (TCP/IP and Ethernet headers add ~4 %):
#   all_reduce      every host must send 2(H-1)/H * S  (S at H = 2)
#   all_gather      every host must receive the other hosts' inputs, (H-1)/H * S
#   reduce_scatter  every host must receive one partial of its ranks' outputs
#                   from each other host, (H-1)/H * S
#
#   ci/multihost-bench.sh [path/to/chorus]
#     default: target/release/chorus, else target/debug/chorus (--features ucx)
#   CHORUS_BENCH_ITERS (5), CHORUS_BENCH_RATES ("1gbit 10gbit")
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=ci/netns-cluster.sh
source ci/netns-cluster.sh

target=${CARGO_TARGET_DIR:-target}
default_bin=$target/release/chorus
[[ -x "$default_bin" ]] || default_bin=$target/debug/chorus
netns_chorus_binary "${1:-$default_bin}" "cargo build --release -p chorus-cli --features ucx"
ITERS=${CHORUS_BENCH_ITERS:-5}
RATES=${CHORUS_BENCH_RATES:-"1gbit 10gbit"}
SIZE=$((64 << 20))

PYTHON=""
if [[ -f "${CHORUS_VENV:-$HOME/.cache/chorus/venv}/READY" ]]; then
    # shellcheck source=ci/python-env.sh
    source ci/python-env.sh >/dev/null
    PYTHON=${CHORUS_PYTHON:-}
fi

# One cluster on this machine at a time (the namespaces' names collide).
exec 9>/tmp/chorus-netns.lock
flock 9

WORK=$(mktemp -d /tmp/chorus-mhbench.XXXXXX)
cleanup() {
    cluster_down
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

PORT=29600
ROWS=$WORK/rows.jsonl

# run_both LOG0 LOG1 COMMAND...: COMMAND on both hosts ({i} = node rank), waits, fails if either fails.
run_both() {
    local log0=$1 log1=$2
    shift 2
    local pids=() i
    for i in 0 1; do
        local log=$log0
        ((i == 1)) && log=$log1
        host_exec "$i" env "${@//\{i\}/$i}" >"$log" 2>&1 &
        pids+=($!)
    done
    local rc=0
    for i in 0 1; do wait "${pids[i]}" || rc=$?; done
    if ((rc != 0)); then
        tail -n 20 "$log0" "$log1" >&2
        return 1
    fi
}

for rate in $RATES; do
    cluster_up 2 "$rate" 0
    for op in all_reduce all_gather reduce_scatter; do
        for schedule in flat hierarchical; do
            PORT=$((PORT + 1))
            flat=$([[ $schedule == flat ]] && echo 1 || echo 0)
            run_both "$WORK/h0.log" "$WORK/h1.log" CHORUS_UCX_FLAT=$flat \
                "$CHORUS" launch --nproc-per-node 2 --nnodes 2 --node-rank "{i}" \
                --master-addr "$(host_addr 0)" --master-port "$PORT" --timeout 300 --run-id "mhbench$PORT" \
                -- "$CHORUS" bench --backend ucx --world-size 4 --op "$op" --min-bytes 64M --max-bytes 64M \
                --iters "$ITERS" --warmup 2 --json ||
                netns_die "$op ($schedule) at $rate failed"
            time_us=$(grep -o '"time_us":[0-9.e+-]*' "$WORK/h0.log" | tail -n 1 | cut -d: -f2)
            [[ -n "$time_us" ]] || { cat "$WORK/h0.log" >&2; netns_die "$op ($schedule): no time in the output"; }
            # The bench checks every rank's result: a wrong element fails the run.
            wrong=$(grep -o '"wrong":[0-9]*' "$WORK/h0.log" | tail -n 1 | cut -d: -f2)
            [[ "$wrong" == 0 ]] || netns_die "$op ($schedule) at $rate: ${wrong:-unknown} wrong elements"
            echo "{\"rate\":\"$rate\",\"op\":\"$op\",\"impl\":\"chorus-$schedule\",\"time_us\":$time_us}" >>"$ROWS"
        done
    done
    if [[ -n "$PYTHON" ]]; then
        PORT=$((PORT + 1))
        if run_both "$WORK/g0.log" "$WORK/g1.log" GLOO_SOCKET_IFNAME=eth0 CHORUS_GLOO_SIZES=$SIZE OMP_NUM_THREADS=1 \
            "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank "{i}" \
            --master-addr "$(host_addr 0)" --master-port "$PORT" "$PWD/ci/gloo_bench.py" "$ITERS"; then
            # Rows: "op bytes time us ...".
            awk -v rate="$rate" '$3 ~ /^[0-9.]+$/ && $4 == "us" {
                printf "{\"rate\":\"%s\",\"op\":\"%s\",\"impl\":\"gloo\",\"time_us\":%s}\n", rate, $1, $3 }' \
                "$WORK/g0.log" >>"$ROWS"
        else
            echo "multihost-bench: gloo at $rate FAILED (log above)" >&2
        fi
    fi
    cluster_down
done

# The table: each op's times against its bound, and the bound's ratio.
python3 - "$ROWS" "$SIZE" "$([[ -n "$PYTHON" ]] && echo 1 || echo 0)" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
size, have_gloo, hosts = int(sys.argv[2]), sys.argv[3] == "1", 2
def rate_bps(r):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if r.endswith(u):
            return float(r[: -len(u)]) * f
    raise ValueError(r)
share = {"all_reduce": 2 * (hosts - 1) / hosts, "all_gather": (hosts - 1) / hosts, "reduce_scatter": (hosts - 1) / hosts}
print(f"# 2 hosts x 2 ranks, {size >> 20} MiB f32; bound = bytes across a host's link / rate (payload only)")
print(f"{'rate':>7} {'op':15} {'bound ms':>9} {'flat ms':>9} {'hier ms':>9} {'gloo ms':>9} {'flat/bnd':>8} {'hier/bnd':>8}")
out = []
for rate in dict.fromkeys(r["rate"] for r in rows):
    for op in share:
        t = {r["impl"]: r["time_us"] / 1e3 for r in rows if r["rate"] == rate and r["op"] == op}
        bound = share[op] * size * 8 / rate_bps(rate) * 1e3
        flat, hier, gloo = t.get("chorus-flat"), t.get("chorus-hierarchical"), t.get("gloo")
        fmt = lambda v: f"{v:9.1f}" if v is not None else ("  SKIPPED" if not have_gloo else "   failed")
        print(f"{rate:>7} {op:15} {bound:9.1f} {fmt(flat)} {fmt(hier)} {fmt(gloo)} "
              f"{flat / bound:8.2f} {hier / bound:8.2f}")
        out.append({"rate": rate, "op": op, "bytes": size, "bound_ms": round(bound, 2), "flat_ms": flat,
                    "hierarchical_ms": hier, "gloo_ms": gloo, "hierarchical_over_bound": round(hier / bound, 3)})
for o in out:
    print(json.dumps(o))
EOF
