#!/usr/bin/env python3
"""Judges the candle-CUDA checks of ci/gpu-check.sh (standard library only).

    python3 ci/gpu_judge.py bench LOG          # `train --bench --json`: FSDP vs plain candle-CUDA
    python3 ci/gpu_judge.py mfu SUMMARY GPUS   # the 110M Llama's bf16 run: tokens/s and MFU
    python3 ci/gpu_judge.py losses SUMMARY TORCH_LOSSES ATOL [NAME]   # chorus's losses against PyTorch's
                                                                     # (or NAME's: another run's summary.json)
    python3 ci/gpu_judge.py offload-memory PLAIN_SUMMARY OFFLOAD_SUMMARY   # host space used, device peak lower
    python3 ci/gpu_judge.py plan PLAN_JSON SUMMARY GPU_MEMORY   # chorus plan's prediction against the run:
                    # step within 25 %, FSDP peak equal, GPU memory within 10 % of nvidia-smi's peak
                    # (GPU_MEMORY: gpu-check.sh's samples of the run); plan/tests/judge/plan_judge.py perturbs them

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


# The tolerances for the planner against a measured run (issue 34).
PLAN_STEP_TOLERANCE = 0.25
PLAN_MEMORY_TOLERANCE = 0.10


def gpu_memory_peak_bytes(samples):
    """nvidia-smi's largest `memory.used` (MiB, one number a line per GPU and sample) in `samples`."""
    values = [int(v) for v in open(samples).read().split() if v.isdigit()]
    if not values:
        raise ValueError(f"no nvidia-smi samples in {samples}")
    return max(values) * 2**20


def plan(plan_json, summary, gpu_memory):
    """chorus plan's prediction against the run it predicted, three judges:
    the step within 25 % of the measured median step; the FSDP peak equal to
    the measured one (both count the same buffers exactly); the GPU memory
    it expects nvidia-smi to show within 10 % of nvidia-smi's peak during
    the run (`gpu_memory`: gpu-check.sh's samples, MiB a line). A plan that
    says the run does not fit fails, as does a missing or unreadable input."""
    try:
        with open(plan_json) as f:
            p = json.load(f)
        with open(summary) as f:
            s = json.load(f)
        measured = median_step(s)
        fsdp_run = max(s["peak_memory_bytes"])
        smi = gpu_memory_peak_bytes(gpu_memory)
        predicted, fits = p["step_time_s"], p["fits"]
        fsdp_plan, used = p["fsdp_peak_memory_bytes"], p["gpu_memory_used_bytes_estimate"]
    except (OSError, KeyError, ValueError, TypeError, IndexError) as e:
        print(f"no plan, run or nvidia-smi samples to compare ({e!r}): see their logs")
        return 1
    where = f"chorus plan on {p.get('gpus')} x {p.get('gpu')} ({p.get('kernels')} kernels)"
    if fits is False or predicted is None or used is None:
        print(f"{where}: the plan says the run does not fit ({used} B), yet it ran: FAILED")
        return 1
    step_err = predicted / measured - 1
    mem_err = used / smi - 1
    ok = {
        "step": abs(step_err) <= PLAN_STEP_TOLERANCE,
        "fsdp": fsdp_plan == fsdp_run,
        "memory": abs(mem_err) <= PLAN_MEMORY_TOLERANCE,
    }
    verdict = lambda k: "ok" if ok[k] else "FAILED"
    print(
        f"{where}: step {predicted * 1e3:.2f} ms predicted, {measured * 1e3:.2f} ms measured (median), "
        f"error {step_err * 100:+.1f} % (limit {PLAN_STEP_TOLERANCE * 100:.0f} %): {verdict('step')}; "
        f"FSDP peak {fsdp_plan:,} B predicted, {fsdp_run:,} B measured: {verdict('fsdp')} (must be equal); "
        f"GPU memory {used / 2**20:,.0f} MiB predicted, nvidia-smi's peak {smi / 2**20:,.0f} MiB, "
        f"error {mem_err * 100:+.1f} % (limit {PLAN_MEMORY_TOLERANCE * 100:.0f} %): {verdict('memory')}"
    )
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    sys.exit({"bench": bench, "mfu": mfu, "losses": losses, "offload-memory": offload_memory, "plan": plan}[what](*args))
