#!/usr/bin/env python3
"""PyTorch's reference for examples/rendezvous_bench.rs: N ranks (threads,
each with its own torch.distributed.TCPStore client connection) connect to
a TCPStore server on loopback, set their key, and wait for all N keys.

Usage: python3 rendezvous_torch.py [--ranks 64] [--reps 10] [--chorus-port P]
(--chorus-port: use a server already listening there, e.g. chorus's).
"""

import argparse
import datetime
import json
import statistics
import threading
import time

import torch.distributed as dist


def rendezvous(ranks, rep, port):
    start = threading.Barrier(ranks + 1)
    done = [0.0] * ranks
    errors = []

    def rank(r):
        try:
            start.wait()
            s = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
            s.set(f"rep{rep}/rank{r}", str(r))
            s.wait([f"rep{rep}/rank{i}" for i in range(ranks)])
            done[r] = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(done) - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--chorus-port", type=int, default=None)
    a = p.parse_args()
    times = []
    for rep in range(a.reps):
        server = None
        port = a.chorus_port
        if port is None:
            server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            port = server.port
        times.append(rendezvous(a.ranks, rep, port))
        print(f"rep {rep}: {a.ranks} ranks rendezvoused in {times[-1] * 1e3:.2f} ms")
        del server
    med = statistics.median(times)
    server_kind = "chorus" if a.chorus_port else "torch"
    print(f"median {med * 1e3:.2f} ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})")
    print(json.dumps({"bench": "rendezvous", "client": "torch", "server": server_kind, "ranks": a.ranks, "reps": a.reps, "median_s": round(med, 6), "min_s": round(min(times), 6), "max_s": round(max(times), 6)}))


if __name__ == "__main__":
    main()
