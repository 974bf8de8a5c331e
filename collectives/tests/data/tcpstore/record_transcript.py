#!/usr/bin/env python3
"""Records the bytes a real PyTorch TCPStore client and server exchange.

A torch TCPStore server (libuv backend) listens on a free loopback port; a
small proxy in this script sits between it and a torch TCPStore client and
logs every byte in each direction. Consecutive bytes in one direction are
merged into one segment, so a segment is "what one side sent before the other
answered". The client runs a fixed sequence of operations, the same sequence
chorus's transcript tests replay (collectives/tests/tcpstore_transcript.rs).

Usage:  python3 record_transcript.py ops   > store_ops.txt
        python3 record_transcript.py extras > server_extras.txt

`ops` covers the operations of chorus's Store trait (and append); `extras`
the server-only ones (queues, barrier) that chorus's server answers for
PyTorch clients but chorus's client never sends.
"""

import datetime
import multiprocessing
import select
import socket
import sys

import torch
import torch.distributed as dist


class Proxy:
    """Forwards one connection to `target_port` and logs both directions.

    The proxy runs in a child process: some TCPStore methods (queue_len, for
    one) keep Python's GIL while they block, which would freeze a proxy
    thread of the same process.
    """

    def __init__(self, target_port):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        # Labels go down a pipe whose send is synchronous, so a label is in
        # the pipe before its operation's first byte is on the wire.
        self.labels, child_labels = multiprocessing.Pipe()
        self.result, child_result = multiprocessing.Pipe()
        self.process = multiprocessing.Process(
            target=self.run, args=(child_labels, child_result), daemon=True
        )
        self.process.start()

    def mark(self, label):
        self.labels.send(label)

    def segments(self):
        self.labels.send(None)
        return self.result.recv()

    def run(self, labels, result):
        segments = []  # [direction, bytearray, [labels]]
        pending = []

        def record(direction, data):
            if direction == "C":
                while labels.poll():
                    pending.append(labels.recv())
            if segments and segments[-1][0] == direction:
                segments[-1][1].extend(data)
            else:
                segments.append([direction, bytearray(data), []])
            if direction == "C":
                segments[-1][2].extend(pending)
                pending.clear()

        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target_port))
        peers = {client: (server, "C"), server: (client, "S")}
        while peers:
            ready, _, _ = select.select(list(peers), [], [], 0.05)
            for sock in ready:
                data = sock.recv(65536)
                other, direction = peers[sock]
                if not data:
                    peers.clear()
                    break
                record(direction, data)
                other.sendall(data)
        client.close()
        server.close()
        while True:
            label = labels.recv()
            if label is None:
                break
        result.send([(d, bytes(b), l) for d, b, l in segments])


def run_ops(store, p):
    p.mark("set key0 = value0")
    store.set("key0", b"value0")
    p.mark("get key0")
    assert store.get("key0") == b"value0"
    p.mark("add counter 5")
    assert store.add("counter", 5) == 5
    p.mark("add counter -2")
    assert store.add("counter", -2) == 3
    p.mark("compare_set cas '' -> first (missing key, empty expected: sets)")
    assert store.compare_set("cas", b"", b"first") == b"first"
    p.mark("compare_set cas wrong -> second (mismatch: returns current)")
    assert store.compare_set("cas", b"wrong", b"second") == b"first"
    p.mark("compare_set cas first -> second (match: sets)")
    assert store.compare_set("cas", b"first", b"second") == b"second"
    p.mark("compare_set missing x -> y (missing key: returns expected)")
    assert store.compare_set("missing", b"x", b"y") == b"x"
    p.mark("check key0 counter")
    assert store.check(["key0", "counter"]) is True
    p.mark("check key0 nope")
    assert store.check(["key0", "nope"]) is False
    p.mark("wait key0 counter")
    store.wait(["key0", "counter"])
    p.mark("wait never 200ms (times out: cancel_wait)")
    try:
        store.wait(["never"], datetime.timedelta(milliseconds=200))
        raise AssertionError("wait on a missing key returned")
    except dist.DistStoreError:
        pass
    p.mark("multi_set m1 m2")
    store.multi_set(["m1", "m2"], [b"a", b"bb"])
    p.mark("multi_get m1 m2")
    assert store.multi_get(["m1", "m2"]) == [b"a", b"bb"]
    p.mark("num_keys")
    assert store.num_keys() == 5, store.num_keys()
    p.mark("delete_key key0")
    assert store.delete_key("key0") is True
    p.mark("delete_key key0 again")
    assert store.delete_key("key0") is False
    p.mark("num_keys")
    assert store.num_keys() == 4
    p.mark("set big (3000 bytes, past the client's 1440-byte flush watermark)")
    big = bytes((i * 7) % 256 for i in range(3000))
    store.set("big", big)
    p.mark("get big")
    assert store.get("big") == big
    p.mark("set binary with zeros")
    store.set("bin", b"\x00\x01\x00\xff")
    p.mark("get binary")
    assert store.get("bin") == b"\x00\x01\x00\xff"
    p.mark("append log ab")
    store.append("log", b"ab")
    p.mark("append log cd")
    store.append("log", b"cd")
    p.mark("get log")
    assert store.get("log") == b"abcd"


def run_extras(store, p):
    p.mark("queue_push q one")
    store.queue_push("q", b"one")
    p.mark("queue_push q two")
    store.queue_push("q", b"two")
    p.mark("queue_len q")
    assert store.queue_len("q") == 2
    p.mark("queue_pop q (non-blocking)")
    assert store.queue_pop("q", block=False) == b"one"
    p.mark("check q (a non-empty queue counts as present)")
    assert store.check(["q"]) is True
    p.mark("queue_pop q (blocking: waits first)")
    assert store.queue_pop("q", block=True) == b"two"
    p.mark("queue_len q")
    assert store.queue_len("q") == 0
    p.mark("barrier b world 1")
    store.barrier("b", 1, datetime.timedelta(seconds=5))
    p.mark("get b (the barrier's counter)")
    assert store.get("b") == b"1"


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "ops"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proxy = Proxy(server.port)
    proxy.mark("connect: validate, then ping (nonce = the client's pid)")
    client = dist.TCPStore(
        "127.0.0.1",
        proxy.port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    {"ops": run_ops, "extras": run_extras}[which](client, proxy)
    del client
    segments = proxy.segments()
    proxy.process.join(timeout=5)
    print(f"# PyTorch TCPStore wire transcript ({which}), recorded by record_transcript.py")
    print(f"# torch {torch.__version__}: torch client -> proxy -> torch server (libuv backend)")
    print("# C = client to server, S = server to client; hex bytes of one segment per line")
    for direction, data, labels in segments:
        for label in labels:
            print(f"# op: {label}")
        print(f"{direction} {data.hex()}")


if __name__ == "__main__":
    main()
