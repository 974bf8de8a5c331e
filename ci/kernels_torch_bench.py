#!/usr/bin/env python3
"""PyTorch's ops at the shapes of kernels/examples/kernel_bench.rs (one Llama
layer, bf16), timed with CUDA events on the same GPU in the same session:
what a user would get from PyTorch instead of chorus's fused ops. The
backward of each op is timed as (forward + backward) - forward through
autograd; attention is SDPA (`is_causal`, `enable_gqa`, PyTorch's choice of
backend: flash or cuDNN); RoPE is transformers' `apply_rotary_pos_emb`
(composed ops, as eager transformers runs it); cross-entropy upcasts the
logits to f32 as transformers' loss does. Prints a table and JSON lines.

    python3 ci/kernels_torch_bench.py [--batch 4] [--seq 1024] [--hidden 2048] [--heads 32]
        [--kv-heads 8] [--intermediate 8192] [--vocab 32000] [--iters 20]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def report(bench, ms, rate_name, rate):
    print(f"{bench:<40} {ms:>9.4f} ms  {rate:>9.1f} {rate_name}")
    print(json.dumps({"bench": bench, "ms": ms, rate_name.replace("/", "_per_").lower(): rate}))


def fwd_bwd(name, make, iters, moved_fwd, moved_bwd, rate="GB/s", flops=None):
    """Times make() (a tensor with grad) and make().backward(ones)."""
    out = make()
    grad = torch.ones_like(out)

    def forward():
        with torch.no_grad():
            make()

    def both():
        make().backward(grad)

    f = timed(forward, iters)
    b = max(timed(both, iters) - f, 1e-6)
    if rate == "GB/s":
        report(f"torch {name}", f, rate, moved_fwd / f / 1e6)
        report(f"torch {name}_backward", b, rate, moved_bwd / b / 1e6)
    else:
        report(f"torch {name}", f, rate, flops / f / 1e9)
        report(f"torch {name}_backward", b, rate, 2.5 * flops / b / 1e9)


def main():
    p = argparse.ArgumentParser()
    for flag, default in [("batch", 4), ("seq", 1024), ("hidden", 2048), ("heads", 32), ("kv-heads", 8),
                          ("intermediate", 8192), ("vocab", 32000), ("iters", 20)]:
        p.add_argument(f"--{flag}", type=int, default=default)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("kernels_torch_bench: no CUDA device", file=sys.stderr)
        sys.exit(1)
    dev, bf = "cuda", torch.bfloat16
    m, h, hd = a.batch * a.seq, a.hidden, a.hidden // a.heads
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}: batch {a.batch} seq {a.seq} hidden {h} "
          f"heads {a.heads}/{a.kv_heads} head_dim {hd} intermediate {a.intermediate} vocab {a.vocab}, bf16")
    by = lambda n: 2.0 * n

    x = torch.randn(m, h, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(h, device=dev, dtype=bf, requires_grad=True)
    fwd_bwd("rms_norm", lambda: F.rms_norm(x, (h,), w, 1e-5), a.iters, by(2 * m * h), by(5 * m * h))

    q = torch.randn(a.batch, a.seq, a.heads, hd, device=dev, dtype=bf, requires_grad=True)
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    ang = torch.arange(a.seq, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(bf)[None, :, None, :], emb.sin().to(bf)[None, :, None, :]

    def rope():
        x1, x2 = q[..., : hd // 2], q[..., hd // 2:]
        return q * cos + torch.cat([-x2, x1], dim=-1) * sin

    fwd_bwd("rope", rope, a.iters, by(2 * m * h), by(2 * m * h))

    g = torch.randn(m, a.intermediate, device=dev, dtype=bf, requires_grad=True)
    u = torch.randn(m, a.intermediate, device=dev, dtype=bf, requires_grad=True)
    fwd_bwd("swiglu", lambda: F.silu(g) * u, a.iters, by(3 * m * a.intermediate), by(5 * m * a.intermediate))

    qa = torch.randn(a.batch, a.heads, a.seq, hd, device=dev, dtype=bf, requires_grad=True)
    ka = torch.randn(a.batch, a.kv_heads, a.seq, hd, device=dev, dtype=bf, requires_grad=True)
    va = torch.randn(a.batch, a.kv_heads, a.seq, hd, device=dev, dtype=bf, requires_grad=True)
    flops = 2.0 * a.batch * a.heads * a.seq * a.seq * hd
    fwd_bwd("attention", lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True),
            a.iters, 0, 0, rate="TFLOP/s", flops=flops)

    logits = torch.randn(m, a.vocab, device=dev, dtype=bf, requires_grad=True)
    targets = torch.randint(0, a.vocab, (m,), device=dev)
    ce_out = lambda: F.cross_entropy(logits.float(), targets)
    fwd_bwd("cross_entropy", ce_out, a.iters, by(m * a.vocab), by(2 * m * a.vocab))

    kv = a.kv_heads * hd
    for name, n_out, k_in in [("q_proj", h, h), ("kv_proj", kv, h), ("o_proj", h, h),
                              ("gate_up_proj", a.intermediate, h), ("down_proj", h, a.intermediate),
                              ("lm_head", a.vocab, h)]:
        xx = torch.randn(m, k_in, device=dev, dtype=bf)
        ww = torch.randn(n_out, k_in, device=dev, dtype=bf)
        dy = torch.randn(m, n_out, device=dev, dtype=bf)
        fl = 2.0 * m * n_out * k_in
        for label, fn in [("x·wT", lambda: xx @ ww.t()), ("dy·w", lambda: dy @ ww), ("dyT·x", lambda: dy.t() @ xx)]:
            ms = timed(fn, a.iters)
            report(f"torch matmul {name} {label}", ms, "TFLOP/s", fl / ms / 1e9)


if __name__ == "__main__":
    main()
