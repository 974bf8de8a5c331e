#!/usr/bin/env python3
"""Hosts a PyTorch TCPStore server for chorus's client.

Prints the port, then waits (bounded) for chorus to set `chorus_done`,
checks the keys chorus left, and exits 0.
"""

import datetime
import sys

import torch.distributed as dist

s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
s.set("from_torch", b"hello from torch")
print(s.port, flush=True)
s.wait(["chorus_done"], datetime.timedelta(seconds=120))
assert s.get("from_chorus") == b"hello from chorus", s.get("from_chorus")
assert s.get("chorus_counter") == b"42", s.get("chorus_counter")
print("torch server: ok", flush=True)
