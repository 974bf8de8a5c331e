#!/usr/bin/env python3
"""Compares two `chorus train --model mlp` output directories: every
`layers.*.npy` parameter and every step's loss, within a tolerance.

    python3 ci/compare_train.py A B [--tol 1e-5]

Standard library only (the .npy reader below handles the little-endian f32/f64
C-order arrays chorus writes), so it runs on a GPU node or a bare machine.
Exits 1 if anything differs by more than the tolerance or a file is missing.
"""
import ast
import glob
import json
import os
import struct
import sys


def read_npy(path):
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        major = f.read(2)[0]
        (hlen,) = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))
        header = ast.literal_eval(f.read(hlen).decode("latin-1"))
        code = {"<f4": "f", "<f8": "d"}.get(header["descr"])
        if code is None or header.get("fortran_order"):
            raise ValueError(f"{path}: unsupported array {header}")
        n = 1
        for d in header["shape"]:
            n *= d
        data = f.read()
        if len(data) != n * struct.calcsize(code):
            raise ValueError(f"{path}: {len(data)} data bytes for shape {header['shape']}")
        return header["shape"], struct.unpack(f"<{n}{code}", data)


def main():
    args = sys.argv[1:]
    tol = 1e-5
    if "--tol" in args:
        i = args.index("--tol")
        tol = float(args[i + 1])
        del args[i : i + 2]
    a, b = args
    files = sorted(glob.glob(os.path.join(a, "layers.*.npy")))
    if not files:
        print(f"no layers.*.npy in {a}")
        return 1
    worst = 0.0
    for fa in files:
        fb = os.path.join(b, os.path.basename(fa))
        sa, xa = read_npy(fa)
        sb, xb = read_npy(fb)
        if sa != sb:
            print(f"{os.path.basename(fa)}: shape {sa} vs {sb}")
            return 1
        worst = max([worst] + [abs(p - q) for p, q in zip(xa, xb)])
    la = json.load(open(os.path.join(a, "summary.json")))["losses"]
    lb = json.load(open(os.path.join(b, "summary.json")))["losses"]
    if len(la) != len(lb) or not la:
        print(f"losses: {len(la)} steps vs {len(lb)}")
        return 1
    dl = max(abs(p - q) for p, q in zip(la, lb))
    print(
        f"{len(files)} parameters, {len(la)} steps: largest parameter difference {worst:.3e}, "
        f"largest loss difference {dl:.3e} (tolerance {tol:g})"
    )
    return 0 if worst <= tol and dl <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
