#!/usr/bin/env python3
"""Measures, through PyTorch on one GPU, the rates that stand in for chorus's
own kernels in a kernel-rates file (docs/plan-costs.md, "Kernel rates")
until a measurement of chorus's kernels replaces them: cuBLAS bf16 GEMMs
of a range of sizes (the library chorus's matmuls call), PyTorch's flash
attention (SDPA's FlashAttention-2 kernels, causal, grouped-query) forward
and backward, the bandwidth of a device-to-device copy and of an
element-wise add, and the shortest kernel's time in a stream.

    python3 plan/kernel-rates/torch_proxies.py > device-rates.json

Prints one JSON object: what was measured (`measured`), and the `kernels`
table of a rates file made from it (`kernels`: the GEMM points less the
shortest kernel's time, which the file adds back per launch; attention at
the 1.1B Llama's shape; each fused memory-bound kernel at the copy's
bandwidth, which such a kernel can reach but not pass). The host constants
and the runtime memory come from other runs (docs/plan-costs.md). Each time is the median of 21 timed repetitions
after warm-up, by CUDA events; the small kernels are timed inside a CUDA
graph, so what the host takes to launch them does not count.
"""
import importlib.util
import json
import os
import statistics
import sys

import torch

_bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ci", "kernels_torch_bench.py")
_spec = importlib.util.spec_from_file_location("kernels_torch_bench", _bench)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
timed = _module.timed

dev = torch.device("cuda")
BF16 = torch.bfloat16


def median_ms(fn, reps=21, inner=1):
    """Median milliseconds of `fn` per call (`inner` calls per timed sample),
    by the timer of ci/kernels_torch_bench.py (CUDA events, median of `reps`)."""
    for _ in range(2):
        fn()
    return timed(lambda: [fn() for _ in range(inner)], reps) / inner


def graphed_ms(fn, count):
    """Median milliseconds of one of `count` calls of `fn` replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(count):
            fn()
    return median_ms(g.replay) / count


def gemm_points():
    # (M, K, N) of the 110M Llama (2,048 tokens, hidden 768, SwiGLU 2048,
    # vocab 16000) and the 1.1B (4,096 tokens, hidden 2048, GQA k/v 512,
    # SwiGLU 8192, vocab 32000): forward, input-gradient and
    # weight-gradient shapes; a tiny one (the 4-layer test Llama) and 8192³.
    shapes = [
        (64, 32, 32), (64, 32, 64), (512, 256, 256),
        (2048, 768, 768), (2048, 768, 2048), (2048, 2048, 768), (768, 2048, 768), (768, 2048, 2048),
        (2048, 768, 16000), (16000, 2048, 768),
        (4096, 2048, 512), (4096, 2048, 2048), (2048, 4096, 2048), (4096, 2048, 8192), (4096, 8192, 2048),
        (2048, 4096, 8192), (4096, 2048, 32000), (32000, 4096, 2048), (8192, 8192, 8192),
    ]
    points = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=dev, dtype=BF16)
        b = torch.randn(k, n, device=dev, dtype=BF16)
        c = torch.empty(m, n, device=dev, dtype=BF16)
        flops = 2.0 * m * k * n
        count = max(1, min(50, int(2e12 / flops)))
        ms = graphed_ms(lambda: torch.matmul(a, b, out=c), count)
        points.append({"m": m, "k": k, "n": n, "gflop": flops / 1e9, "us": ms * 1e3, "tflop_per_s": flops / (ms * 1e-3) / 1e12})
    return points


def attention(b, hq, hkv, t, d):
    """SDPA flash attention (causal, grouped-query through enable_gqa): TFLOP/s on the causal FLOPs done."""
    q = torch.randn(b, hq, t, d, device=dev, dtype=BF16, requires_grad=True)
    k = torch.randn(b, hkv, t, d, device=dev, dtype=BF16, requires_grad=True)
    v = torch.randn(b, hkv, t, d, device=dev, dtype=BF16, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = True
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError:
            # No grouped heads in this flash kernel: the same FLOPs on repeated keys and values.
            gqa = False
            k = k.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            v = v.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
        fwd = median_ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=gqa), inner=5)
        out = sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        go = torch.randn_like(out)

        def both():
            o = sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
            torch.autograd.grad(o, (q, k, v), go)

        total = median_ms(both, inner=5)
    done = 4.0 * b * hq * t * t * d / 2  # forward FLOPs of the causal half
    bwd = max(total - fwd, 1e-6)
    return {
        "shape": [b, hq, hkv, t, d],
        "grouped_heads_in_kernel": gqa,
        "forward_us": fwd * 1e3,
        "backward_us": bwd * 1e3,
        "forward_tflop_per_s": done / (fwd * 1e-3) / 1e12,
        "backward_tflop_per_s": 2.5 * done / (bwd * 1e-3) / 1e12,
    }


def bandwidth():
    n = 256 << 20  # 256 Mi bf16 elements: 512 MiB per tensor
    x = torch.randn(n, device=dev, dtype=BF16)
    y = torch.randn(n, device=dev, dtype=BF16)
    z = torch.empty_like(x)
    copy_ms = median_ms(lambda: z.copy_(x))
    add_ms = median_ms(lambda: torch.add(x, y, out=z))
    one = torch.zeros(1, device=dev)
    floor_ms = graphed_ms(lambda: one.add_(1.0), 1000)
    return {
        "copy_gb_per_s": 2 * 2 * n / (copy_ms * 1e-3) / 1e9,
        "add_gb_per_s": 3 * 2 * n / (add_ms * 1e-3) / 1e9,
        "kernel_floor_us": floor_ms * 1e3,
    }


def kernels(m):
    """The `kernels` table of a rates file from the measurements `m`."""
    bw = m["bandwidth"]
    floor, copy, add = bw["kernel_floor_us"], bw["copy_gb_per_s"], bw["add_gb_per_s"]
    by_size = {}
    for p in m["gemm"]:
        busy = max(p["us"] - floor, 0.1 * p["us"])
        by_size.setdefault(round(p["gflop"], 6), []).append(p["gflop"] * 1e9 / (busy * 1e-6) / 1e12)
    points = [[g, statistics.mean(r)] for g, r in sorted(by_size.items())]
    src = f"PyTorch {m['torch']} on {m['gpu']}, CUDA {m['cuda']} (plan/kernel-rates/torch_proxies.py)"
    att = m["attention"][1]
    fused = {
        "gb_per_s": copy,
        "launch_us": floor,
        "source": f"proxy: one memory-bound kernel at a device-to-device copy's bandwidth, {src}",
    }
    table = {
        "gemm": {
            "tflop_per_s": points,
            "gb_per_s": copy,
            "launch_us": floor,
            "source": f"cuBLAS bf16 matmuls through torch.matmul in a CUDA graph, less the shortest kernel's time, {src}",
        },
        "attention": {
            "tflop_per_s": att["forward_tflop_per_s"],
            "gb_per_s": copy,
            "launch_us": floor,
            "source": f"proxy: SDPA's flash attention (FlashAttention-2), causal, shape {att['shape']}, {src}",
        },
        "attention_backward": {
            "tflop_per_s": att["backward_tflop_per_s"],
            "gb_per_s": copy,
            "launch_us": floor,
            "source": f"proxy: SDPA's flash attention backward (2.5 x the forward's FLOPs), shape {att['shape']}, {src}",
        },
        "elementwise": {"gb_per_s": add, "launch_us": floor, "source": f"torch.add of two bf16 tensors of 512 MiB, {src}"},
        "copy": {"gb_per_s": copy, "launch_us": floor, "source": f"a 512 MiB device-to-device copy, {src}"},
    }
    for op in ["rms_norm", "rope", "swiglu", "cross_entropy"]:
        table[op] = dict(fused)
        table[op + "_backward"] = dict(fused)
    return table


def main():
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    m = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bandwidth": bandwidth(),
        "gemm": gemm_points(),
        "attention": [attention(8, 12, 12, 256, 64), attention(4, 32, 8, 1024, 64), attention(2, 32, 8, 8192, 128)],
    }
    json.dump({"measured": m, "kernels": kernels(m)}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
