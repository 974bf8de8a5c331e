#!/usr/bin/env python3
"""A PyTorch TCPStore client against a chorus-hosted server (port in argv).

Reads what chorus's client set, runs every operation PyTorch's client has
(the server-only ones included: append, queues, list_keys, barrier), and
leaves `from_torch` for chorus to read. Exits non-zero on any mismatch.
"""

import datetime
import sys

import torch.distributed as dist

port = int(sys.argv[1])
s = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
assert s.get("from_chorus") == b"hello from chorus", s.get("from_chorus")
s.set("k", b"v")
assert s.get("k") == b"v"
assert s.add("n", 3) == 3 and s.add("n", 4) == 7
assert s.compare_set("c", b"", b"x") == b"x"
assert s.compare_set("c", b"y", b"z") == b"x"
assert s.check(["k", "n"]) and not s.check(["k", "absent"])
s.wait(["k"], datetime.timedelta(seconds=5))
try:
    s.wait(["absent"], datetime.timedelta(milliseconds=100))
    raise AssertionError("wait on an absent key returned")
except dist.DistStoreError:
    pass
s.multi_set(["m1", "m2"], [b"1", b"2"])
assert s.multi_get(["m1", "m2"]) == [b"1", b"2"]
assert s.delete_key("m1") and not s.delete_key("m1")
s.append("log", b"a")
s.append("log", b"b")
assert s.get("log") == b"ab"
s.queue_push("q", b"first")
assert s.queue_len("q") == 1
assert s.queue_pop("q") == b"first"
s.barrier("bar", 1, datetime.timedelta(seconds=5))
keys = set(s.list_keys())
assert {"k", "n", "c", "m2", "log", "from_chorus"} <= keys, keys
count = s.num_keys()
assert count >= 7, count
s.set("from_torch", b"hello from torch")
print("torch client: ok")
