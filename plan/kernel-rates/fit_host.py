#!/usr/bin/env python3
"""Fits the host section and the runtime memory of a kernel-rates file to
`ci/gpu-check.sh candle-cuda`'s runs of the two small models on one GPU
(standard library only; docs/plan-costs.md, "Kernel rates"):

    python3 plan/kernel-rates/fit_host.py CHORUS RATES.json RESULTS_DIR GPU_KIND [KERNELS] > fitted.json

CHORUS is a chorus binary (its `plan`), RATES.json a rates file whose
`kernels` are measured (torch_proxies.py, or a measurement of chorus's
own kernels), RESULTS_DIR gpu-check's results (`candle-cuda-llama-4l.log`,
`candle-cuda-gpt.log` and their `.gpu-memory` samples), GPU_KIND
`chorus plan --gpu`'s name of that GPU, KERNELS what the benches' binary
runs: `chorus` (the default: chorus train on chorus's fused ops, since
5f10843) or `candle` (the composed ops before; the shipped files were
fitted so, on 35639ce's binary).

The two models are so small that their steps are the host's work alone:

- FSDP's host time per step (the bench's `host_overhead_per_group_per_step_s`
  times its groups) is, in the planner's run of the same job, `N_hook ·
  fsdp_hook_us + N_op · fsdp_op_us + N_coll · collective_us`, with the
  counts read off plans priced at 1 µs per operation of one kind.
  `collective_us` is fixed (8.25 µs: chorus's `all_reduce` enqueue on an
  H100, docs/hardware.md, 2026-11-25); the Llama's and the transformer's
  times give the other two (a negative one is set to 0 and the other
  refitted on the Llama). A batched copy's pieces and an optimizer's
  launches cost what an FSDP operation costs.
- `model_op_us` is then the value at which the plan of the 4-layer
  Llama's job takes its measured median step (bisection).
- `runtime_bytes` is nvidia-smi's peak during the Llama's bench less the
  plan's peak memory (its tensors are a few MiB).

Neither the 110M nor the 1.1B Llama is used: they are the checks.
"""
import json
import os
import subprocess
import sys
import tempfile

COLLECTIVE_US = 8.25

LLAMA_4L = "--model llama --layers 4 --heads 4 --kv-heads 2 --hidden 32 --intermediate 64 --vocab 29 --seq-len 16 --batch 4"
# (The transformer's vocabulary is always the byte-level text's 29: the job refuses --vocab for it.)
GPT = "--model gpt --d-model 64 --layers 2 --heads 4 --d-ff 256 --seq-len 32 --batch 8"
# chorus train's defaults of those benches: f32, every group recomputed, AdamW.
COMMON = "--gpus 1 --param-dtype f32 --recompute full --optimizer adamw"
KERNELS = "chorus"


def bench(path):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    if not rows:
        sys.exit(f"no JSON row in {path}")
    f = rows[-1]["fsdp"]
    return f["median_step_time_s"], f["host_overhead_per_group_per_step_s"] * f["groups"]


def nvidia_smi_peak_bytes(path):
    values = [int(v) for v in open(path).read().split() if v.isdigit()]
    if not values:
        sys.exit(f"no nvidia-smi samples in {path}")
    return max(values) << 20


def plan(chorus, rates, gpu, job, host):
    """chorus plan of `job` priced with `rates` and the host constants `host`: plan.json."""
    r = dict(rates, host=dict(rates["host"], **host))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rates.json")
        with open(path, "w") as f:
            json.dump(r, f)
        out = os.path.join(d, "plan")
        cmd = [chorus, "plan", *job.split(), *COMMON.split(), "--kernels", KERNELS, "--gpu", gpu]
        cmd += ["--kernel-rates", path, "--out-dir", out]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}{p.stderr}")
        with open(os.path.join(out, "plan.json")) as f:
            return json.load(f)


ZERO = {k: 0.0 for k in ["model_op_us", "fsdp_hook_us", "fsdp_op_us", "copy_piece_us", "optimizer_launch_us", "collective_us"]}


def counts(chorus, rates, gpu, job):
    """Hooks, FSDP operations (pieces included) and collectives the job's measured step issues."""
    n = lambda host: plan(chorus, rates, gpu, job, dict(ZERO, **host))["host_issue_s"] * 1e6
    return n({"fsdp_hook_us": 1.0}), n({"fsdp_op_us": 1.0, "copy_piece_us": 1.0}), n({"collective_us": 1.0})


def main():
    global KERNELS
    if len(sys.argv) not in (5, 6) or sys.argv[5:] not in ([], ["chorus"], ["candle"]):
        sys.exit(__doc__)
    chorus, rates_path, results, gpu = sys.argv[1:5]
    KERNELS = (sys.argv[5:] or [KERNELS])[0]
    rates = json.load(open(rates_path))
    step_l, fsdp_l = bench(os.path.join(results, "candle-cuda-llama-4l.log"))
    _, fsdp_g = bench(os.path.join(results, "candle-cuda-gpt.log"))
    (hl, ol, cl), (hg, og, cg) = counts(chorus, rates, gpu, LLAMA_4L), counts(chorus, rates, gpu, GPT)
    tl, tg = fsdp_l * 1e6 - cl * COLLECTIVE_US, fsdp_g * 1e6 - cg * COLLECTIVE_US
    det = hl * og - ol * hg
    hook, op = ((tl * og - ol * tg) / det, (hl * tg - tl * hg) / det) if det else (-1.0, -1.0)
    if hook < 0 or op < 0:
        hook, op = (0.0, tl / ol) if hook < 0 else (tl / hl, 0.0)
    host = {
        "fsdp_hook_us": hook,
        "fsdp_op_us": op,
        "copy_piece_us": op,
        "optimizer_launch_us": op,
        "collective_us": COLLECTIVE_US,
    }
    lo, hi = 0.0, 1000.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if plan(chorus, rates, gpu, LLAMA_4L, dict(host, model_op_us=mid))["step_time_s"] < step_l:
            lo = mid
        else:
            hi = mid
    host["model_op_us"] = (lo + hi) / 2
    peak = plan(chorus, rates, gpu, LLAMA_4L, dict(host, model_op_us=host["model_op_us"]))["peak_memory_bytes"]
    smi = nvidia_smi_peak_bytes(os.path.join(results, "candle-cuda-llama-4l.gpu-memory"))
    host = {k: round(v, 3) for k, v in host.items()}
    host["source"] = (
        f"fitted by plan/kernel-rates/fit_host.py ({KERNELS} kernels) to gpu-check's 4-layer Llama and transformer benches "
        f"({results}): FSDP host {fsdp_l * 1e3:.3f} and {fsdp_g * 1e3:.3f} ms per step over "
        f"{hl:.0f}/{ol:.0f}/{cl:.0f} and {hg:.0f}/{og:.0f}/{cg:.0f} hooks/operations/collectives; "
        f"the Llama's median step {step_l * 1e3:.2f} ms; collective_us fixed at chorus's all_reduce enqueue "
        f"(docs/hardware.md, H100, 2026-11-25)"
    )
    rates["host"] = host
    rates["runtime_bytes"] = max(0, smi - peak)
    json.dump(rates, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
