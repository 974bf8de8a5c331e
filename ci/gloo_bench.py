"""PyTorch gloo reference for docs/benchmarks.md: busbw of all_gather,
reduce_scatter and all_reduce (f32, sum) at 16 and 64 MiB on WORLD ranks of
this host, with nccl-tests' size conventions and bus factors (size = the
largest buffer a rank holds; median of the timed iterations, each timed
from a barrier to the slowest rank's end).

    $CHORUS_PYTHON ci/gloo_bench.py [world=4] [iters=10]

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set; several hosts with
--nnodes) it joins torchrun's job instead of spawning ranks, runs the sizes
in $CHORUS_GLOO_SIZES (bytes, comma-separated; default both) and rank 0
prints the rows (ci/multihost-bench.sh).

($CHORUS_PYTHON: the venv's python, from `source ci/python-env.sh`.)
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world, iters, port, out, sizes=(16 << 20, 64 << 20)):
    # port None: torchrun's environment says where the job's store is.
    if port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for op in ["all_gather", "reduce_scatter", "all_reduce"]:
        for size in sizes:
            count = size // 4
            count -= count % world
            chunk = count // world
            if op == "all_gather":
                send, recv = torch.ones(chunk), torch.empty(count)
                run = lambda: dist.all_gather_into_tensor(recv, send)
                factor = (world - 1) / world
            elif op == "reduce_scatter":
                send, recv = torch.ones(count), torch.empty(chunk)
                run = lambda: dist.reduce_scatter_tensor(recv, send)
                factor = (world - 1) / world
            else:
                buf = torch.ones(count)
                run = lambda: dist.all_reduce(buf)
                factor = 2 * (world - 1) / world
            try:
                times = []
                for i in range(iters + 2):
                    dist.barrier()
                    t = time.perf_counter()
                    run()
                    dt = torch.tensor([time.perf_counter() - t])
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if i >= 2:
                        times.append(dt.item())
                times.sort()
                med = times[len(times) // 2]
                rows.append(f"{op:15s} {count * 4:>10d} {med * 1e6:>12.1f} us  busbw {count * 4 / med / 1e9 * factor:6.2f} GB/s")
            except RuntimeError as e:
                rows.append(f"{op:15s} {count * 4:>10d} unsupported by gloo here: {str(e).splitlines()[0]}")
    if rank == 0 and out is None:
        print(f"# PyTorch {torch.__version__} gloo, {world} ranks, f32 sum")
        print("\n".join(rows), flush=True)
    elif rank == 0:
        out.put("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__" and "TORCHELASTIC_RUN_ID" in os.environ:
    env_sizes = os.environ.get("CHORUS_GLOO_SIZES")
    sizes = [int(v) for v in env_sizes.split(",")] if env_sizes else [16 << 20, 64 << 20]
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), iters, None, None, sizes)
elif __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(rank_main, args=(world, iters, port, q), nprocs=world, join=True)
    print(f"# PyTorch {torch.__version__} gloo, {world} ranks, f32 sum")
    print(q.get())
