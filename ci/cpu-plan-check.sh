#!/usr/bin/env bash
# Issue 27's check against this machine: calibrate the cpu model now
# (plan/examples/calibrate_cpu.rs, microbenchmarks and a calibration
# transformer of another shape; `chorus bench` for the sim and memcpy), then
# `chorus plan --gpu cpu --cpu-rates` at 1 and 2 ranks for the job
# `chorus train --bench --model gpt` runs by default, then that bench itself
# (REPS runs, median), and print predicted, measured and the error, and one
# JSON line. The same for the Llama bench (`--model llama`), calibrated on
# Llama shapes (a rates file per model family).
#
#   ci/cpu-plan-check.sh [OUT_DIR]        (REPS=3 by default; PROFILE=dev)
#
# A benchmark: it prints numbers, it asserts nothing about them.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/cpu-plan-check}
reps=${REPS:-3}
profile=${PROFILE:-dev}
case "$reps" in '' | *[!0-9]* | 0) echo "REPS must be a positive integer" >&2; exit 2 ;; esac
mkdir -p "$out"

cargo build --profile "$profile" -p chorus-cli --bin chorus >&2
cargo build --profile "$profile" -p chorus-plan --example calibrate_cpu >&2
dir=target/$([ "$profile" = dev ] && echo debug || echo "$profile")
chorus=$dir/chorus

echo "# $(date -u +%FT%TZ) load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores, profile $profile" >&2
for model in gpt llama; do
  "$dir/examples/calibrate_cpu" --model "$model" > "$out/calibrate-$model.jsonl"
done
"$chorus" bench --backend sim --op all_gather --world-size 2 --min-bytes 1K --max-bytes 16M --json > "$out/sim.jsonl"

python3 - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/sim.jsonl") if l.startswith("{")]
small = [r["time_us"] * 1e-6 for r in rows if r["size_bytes"] <= 64 << 10]
big = [r for r in rows if r["size_bytes"] >= 4 << 20]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
load = open("/proc/loadavg").read().split()[:3]
import os, time
sim = dict(
    calibrated_on=f"{os.cpu_count()}-core {cpu}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {' '.join(load)}",
    cores=os.cpu_count(),
    sim_call_s=statistics.median(small),
    sim_busbw=statistics.median(r["busbw_gbps"] * 1e9 for r in big),
    host_copy_bytes_per_s=statistics.median(r["memcpy_gbps"] * 1e9 for r in big),
)
# One rates file per model family: candle's kernels differ between them.
for model in ("gpt", "llama"):
    cal = [json.loads(l) for l in open(f"{out}/calibrate-{model}.jsonl") if l.startswith("{")]
    rates = dict(cal[-1]["cpu_rates"], **sim)
    json.dump(rates, open(f"{out}/cpu-rates-{model}.json", "w"), indent=1)
    print(model, json.dumps(rates), file=sys.stderr)
EOF

# The job `chorus train --bench --model gpt|llama` runs by default: the
# job's defaults (cli/src/job), which plan and train share: 8 sequences of 32
# tokens per rank, the byte-level text's 29 tokens, f32, every group
# recomputed, AdamW, reshard after forward, one micro-batch. Written out so
# the log says what was planned.
job="--batch 8 --seq-len 32 --param-dtype f32 --recompute true --optimizer adamw --reshard-after-forward true"
for model in gpt llama; do
  for world in 1 2; do
    rm -rf "$out/plan-$model-$world"
    # shellcheck disable=SC2086
    "$chorus" plan --model "$model" --gpu cpu --gpus "$world" --cpu-rates "$out/cpu-rates-$model.json" $job \
      --out-dir "$out/plan-$model-$world" > /dev/null
    for rep in $(seq "$reps"); do
      "$chorus" train --bench --json --model "$model" --world-size "$world" > "$out/bench-$model-$world-$rep.json"
    done
  done
done

python3 - "$out" "$reps" <<'EOF'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
load = open("/proc/loadavg").read().split()[:3]
rows = []
print(f"{'bench':<8} {'ranks':>5} {'predicted ms':>13} {'measured ms (median)':>21} {'error':>8}   runs")
for model in ("gpt", "llama"):
    for world in (1, 2):
        plan = json.load(open(f"{out}/plan-{model}-{world}/plan.json"))
        runs = [json.load(open(f"{out}/bench-{model}-{world}-{r}.json"))["fsdp"]["median_step_time_s"] for r in range(1, reps + 1)]
        measured = statistics.median(runs)
        predicted = plan["step_time_s"]
        error = predicted / measured - 1
        rows.append(dict(model=model, world=world, predicted_s=predicted, measured_s=measured, runs_s=runs, error=error))
        print(f"{model:<8} {world:>5} {predicted * 1e3:>13.2f} {measured * 1e3:>21.2f} {error * 100:>+7.1f}%   " + ", ".join(f"{r * 1e3:.2f}" for r in runs))
print(json.dumps({"cpu_plan_check": rows, "load_average_end": load}))
EOF
