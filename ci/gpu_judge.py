#!/usr/bin/env python3
"""Judges the candle-CUDA checks of ci/gpu-check.sh (standard library only).

    python3 ci/gpu_judge.py bench LOG          # `train --bench --json`: FSDP vs plain candle-CUDA
    python3 ci/gpu_judge.py mfu SUMMARY GPUS   # the 110M Llama's bf16 run: tokens/s and MFU
    python3 ci/gpu_judge.py losses SUMMARY TORCH_LOSSES ATOL [NAME]   # chorus's losses against PyTorch's
                                                                     # (or NAME's: another run's summary.json)
    python3 ci/gpu_judge.py offload-memory PLAIN_SUMMARY OFFLOAD_SUMMARY   # host space used, device peak lower
    python3 ci/gpu_judge.py plan PLAN_JSON SUMMARY   # chorus plan's prediction against the run: step
                                                      # time (reported), FSDP peak (must be equal)

A file, not a here-document: gpu-check.sh's `run` starts its command in the
background, whose standard input is /dev/null, so a script fed on stdin ran
nothing and passed.
"""
import json
import sys


def bench(log):
    rows = []
    with open(log) as f:
        for line in f:
            if line.startswith("{"):
                rows.append(json.loads(line))
    if not rows:
        print(f"no JSON row in {log} (the bench failed: see its log)")
        return 1
    r = rows[-1]
    d = r["max_loss_difference"]
    fsdp = r["fsdp"]["median_step_time_s"] * 1e3
    plain = r["plain"]["median_step_time_s"] * 1e3
    print(
        f"{r['what']}: largest loss difference {d:.3e} (limit 1e-4); step time FSDP {fsdp:.2f} ms "
        f"vs plain {plain:.2f} ms: ratio {r['ratio']:.3f} (goal <= 1.1)"
    )
    return 0 if d == d and d <= 1e-4 else 1


def median_step(s):
    """A summary's median step time, leaving out the first three (warm-up) when there are more."""
    times = s["step_times_s"][3:] or s["step_times_s"]
    return sorted(times)[len(times) // 2]


def mfu(summary, gpus):
    try:
        with open(summary) as f:
            s = json.load(f)
    except OSError as e:
        print(f"no summary of the bf16 run ({e}): the run failed, see its log")
        return 1
    gpus = int(gpus)
    t = median_step(s)
    # The shape of gpu-check.sh's llama_110m with --batch 8.
    V, H, L, I, T, B = 16000, 768, 12, 2048, 256, 8
    params = 2 * V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H
    tokens = B * gpus * T
    flops = 6 * params * tokens + 12 * L * H * T * tokens  # the matmuls, and attention's scores and mix
    print(
        f"110M Llama bf16 ({params} parameters), {gpus} GPU(s), {tokens} tokens/step: median step "
        f"{t * 1e3:.1f} ms, {tokens / t:,.0f} tokens/s, MFU {flops / t / (989e12 * gpus) * 100:.1f}% of "
        f"989 TFLOP/s per GPU; peak chorus device memory per rank {max(s['peak_memory_bytes']) / 2**20:.0f} MiB"
    )
    return 0


def losses(summary, torch_losses, atol, name="PyTorch"):
    try:
        with open(summary) as f:
            ours = json.load(f)["losses"]
        with open(torch_losses) as f:
            theirs = json.load(f)["losses"]
    except (OSError, KeyError, ValueError) as e:
        print(f"cannot read the losses ({e}): a run failed, see its log")
        return 1
    atol = float(atol)
    if len(ours) != len(theirs) or not ours:
        print(f"{len(ours)} chorus losses against {len(theirs)} {name} losses")
        return 1
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    print(
        f"{len(ours)} steps: largest loss difference chorus vs {name} {worst:.3e} (limit {atol:g}); "
        f"loss {ours[0]:.4f} -> {ours[-1]:.4f} ({name} {theirs[0]:.4f} -> {theirs[-1]:.4f})"
    )
    return 0 if worst == worst and worst <= atol and ours[-1] < ours[0] else 1


def offload_memory(plain_summary, offload_summary):
    """--offload moves the sharded state to the host: every rank's host peak
    is above zero (none without offload) and its device peak is lower."""
    try:
        with open(plain_summary) as f:
            plain = json.load(f)
        with open(offload_summary) as f:
            off = json.load(f)
        dev = (plain["peak_memory_bytes"], off["peak_memory_bytes"])
        host = (plain["peak_host_memory_bytes"], off["peak_host_memory_bytes"])
    except (OSError, KeyError, ValueError) as e:
        print(f"cannot read the memory figures ({e}): a run failed, see its log")
        return 1
    b = lambda xs: ", ".join(f"{x:,}" for x in xs)
    print(
        f"device peak per rank {b(dev[0])} B without offload, {b(dev[1])} B with; "
        f"host peak {b(host[0])} B without, {b(host[1])} B with"
    )
    ok = len(dev[0]) == len(dev[1]) > 0 and all(h > 0 for h in host[1]) and all(h == 0 for h in host[0])
    return 0 if ok and all(b < a for a, b in zip(*dev)) else 1


def plan(plan_json, summary):
    try:
        with open(plan_json) as f:
            p = json.load(f)
        with open(summary) as f:
            s = json.load(f)
    except OSError as e:
        print(f"no plan or no run to compare ({e}): see their logs")
        return 1
    measured = median_step(s)
    predicted = p["step_time_s"]
    want, got = p["fsdp_peak_memory_bytes"], max(s["peak_memory_bytes"])
    print(
        f"chorus plan on {p['gpus']} x {p['gpu']}: step {predicted * 1e3:.2f} ms predicted, "
        f"{measured * 1e3:.2f} ms measured (median), error {(predicted / measured - 1) * 100:+.1f} %; "
        f"FSDP peak {want:,} B predicted, {got:,} B measured ({'equal' if want == got else 'DIFFERENT'})"
    )
    return 0 if want == got else 1


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    sys.exit({"bench": bench, "mfu": mfu, "losses": losses, "offload-memory": offload_memory, "plan": plan}[what](*args))
