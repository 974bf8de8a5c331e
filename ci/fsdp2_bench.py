"""PyTorch FSDP2's step time on the model `chorus train --bench` measures, for
side-by-side numbers on one GPU (docs/benchmarks.md).

The model is chorus's reference MLP: Linear layers with ReLU between them, a
mean-squared-error loss, SGD (lr 0.05), each Linear its own FSDP param group
(`fully_shard`) and the root one more, reshard after forward. A step is
forward, backward, optimizer step and the loss read back to the host (chorus
reads it back too), timed by the host clock; the median over the timed steps
is reported.

    $CHORUS_PYTHON ci/fsdp2_bench.py --layers 64 --width 64 --batch 8
    $CHORUS_PYTHON ci/fsdp2_bench.py --layers 4 --width 256 --batch 32 --json

($CHORUS_PYTHON: the venv's python, from `source ci/python-env.sh`.)

One process, world size 1 (NCCL), so it needs no launcher.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)

    mods = []
    for i in range(a.layers):
        mods.append(torch.nn.Linear(a.width, a.width))
        if i + 1 < a.layers:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods).to(dev)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(a.batch, a.width, device=dev)
    y = torch.randn(a.batch, a.width, device=dev)

    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[a.warmup:])
    row = {
        "framework": "pytorch-fsdp2",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(dev),
        "layers": a.layers,
        "width": a.width,
        "batch": a.batch,
        "world_size": 1,
        "median_step_time_s": med,
    }
    if a.json:
        print(json.dumps(row))
    else:
        print(f"pytorch fsdp2 {a.layers} x Linear({a.width}), batch {a.batch}: {med * 1e3:.3f} ms/step (median of {a.steps})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
