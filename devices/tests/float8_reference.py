"""torchao's float8 tensorwise recipe, written independently in NumPy, and
torch's own float8_e4m3fn, against what the cpu device's abs_max,
quantize_f8 and dequantize_f8 wrote (devices/tests/float8_numpy.rs).

The NumPy encoder does not share the Rust one's bit trick: it lists every
finite e4m3fn value and picks the nearest by search, ties to the even code.
Usage: python float8_reference.py DIR COUNT
"""
import sys

import numpy as np
import torch

E4M3_MAX = 448.0
EPS = 1e-12  # torchao.float8.float8_utils.EPS


def e4m3_table():
    """Every non-negative finite e4m3fn value, indexed by its code 0..0x7e."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out, dtype=np.float64)


TABLE = e4m3_table()


def encode(v):
    """f32 values -> e4m3fn codes: saturate to +-448, nearest, ties to even code."""
    v = v.astype(np.float64)
    sign = np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    a = np.minimum(np.abs(v), E4M3_MAX)
    hi = np.searchsorted(TABLE, a, side="left").clip(0, len(TABLE) - 1)
    lo = (hi - 1).clip(0, None)
    d_lo, d_hi = a - TABLE[lo], TABLE[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(a == TABLE[hi], hi, np.where(pick_hi, hi, lo)).astype(np.uint8)
    code = np.where(np.isnan(v), 0x7F, code).astype(np.uint8)
    return code | sign


def decode(codes):
    mag = codes & 0x7F
    vals = np.where(mag == 0x7F, np.nan, TABLE[np.minimum(mag, 0x7E)])
    return np.where(codes & 0x80, -vals, vals).astype(np.float32)


def to_bf16_bits(x):
    """f32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def check(name, got, want):
    if not np.array_equal(got, want):
        i = int(np.flatnonzero(got != want)[0])
        sys.exit(f"{name}: element {i}: chorus {got[i]!r}, reference {want[i]!r}")


def main(d, count):
    for t in range(count):
        x = np.fromfile(f"{d}/x{t}.bin", dtype="<f4")
        amax = np.fromfile(f"{d}/amax{t}.bin", dtype="<f4")[0]
        q = np.fromfile(f"{d}/q{t}.bin", dtype=np.uint8)
        d32 = np.fromfile(f"{d}/d32_{t}.bin", dtype="<f4")
        d16 = np.fromfile(f"{d}/d16_{t}.bin", dtype="<u2")

        # NumPy: amax, scale in f64 rounded to f32, x*scale in f32, saturated cast.
        want_amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
        check(f"tensor {t} amax", np.array([amax]), np.array([want_amax]))
        scale = np.float32(E4M3_MAX / max(np.float64(want_amax), EPS))
        scaled = (x * scale).astype(np.float32)
        want_q = encode(scaled)
        check(f"tensor {t} codes (numpy)", q, want_q)
        deq = (decode(want_q) / scale).astype(np.float32)
        check(f"tensor {t} dequantized f32 (numpy)", d32.view(np.uint32), deq.view(np.uint32))
        check(f"tensor {t} dequantized bf16 (numpy)", d16, to_bf16_bits(deq))

        # torch: torchao's hp_tensor_and_scale_to_float8 and its dequantization.
        xt = torch.from_numpy(x.copy())
        amax_t = torch.linalg.vector_norm(xt, ord=float("inf"))
        scale_t = (E4M3_MAX / torch.clamp(amax_t.to(torch.float64), min=EPS)).to(torch.float32)
        check(f"tensor {t} scale (torch)", np.array([scale_t.item()], dtype=np.float32), np.array([scale]))
        f8 = (xt.to(torch.float32) * scale_t).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        check(f"tensor {t} codes (torch)", q, f8.view(torch.uint8).numpy())
        check(f"tensor {t} dequantized f32 (torch)", d32.view(np.uint32), (f8.to(torch.float32) / scale_t).numpy().view(np.uint32))
        bf = (f8.to(torch.bfloat16) / scale_t).view(torch.int16).numpy().view(np.uint16)
        check(f"tensor {t} dequantized bf16 (torch)", d16, bf)
    print(f"ok {count} tensors")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
