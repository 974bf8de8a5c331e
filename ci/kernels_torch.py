"""PyTorch's and transformers' own versions of chorus-kernels' fused ops,
forward and backward, for kernels/tests/ops_torch.rs.

    kernels_torch.py DIR

reads DIR/cases.json (a list of cases: name, op, mode, and the op's
parameters) and DIR/inputs.safetensors (each case's inputs as
"<case>.<input>", in the dtype chorus computed in, and the output's
gradient as "<case>.dy"), runs each op with autograd, and writes
DIR/torch.safetensors: "<case>.y" and "<case>.d<input>" for every input
with a gradient (and "<case>.cos"/"<case>.sin", transformers' RoPE tables,
for rope), all float32 (a bf16 result widens exactly).

Modes: "native" computes in the inputs' dtype, as a PyTorch user would
(bf16 SDPA, transformers' bf16 LlamaRMSNorm and rotary tables); "upcast"
computes in float32 from the inputs widened (the float32 reference of the
same rounded inputs), the gradients taken at the widened leaves.

The ops are the ones the issue names: scaled_dot_product_attention
(layout [batch, heads, seq, dim], enable_gqa; is_causal where the keys are
as many as the queries, else an explicit mask, since is_causal aligns the
mask to the top left), rms_norm (torch.nn.functional's, or transformers'
LlamaRMSNorm), silu(g) * u, cross_entropy(reduction="none"), and RoPE as
transformers' LlamaRotaryEmbedding and apply_rotary_pos_emb.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def rms_norm(case, x, w):
    d = x.shape[-1]
    if case["impl"] == "functional":
        return F.rms_norm(x, (d,), w, eps=case["eps"])
    # transformers' module, with w as its weight (the leaf whose gradient is read).
    norm = LlamaRMSNorm(d, eps=case["eps"])
    del norm.weight
    norm.weight = w
    return norm(x)


def rope(case, x):
    _, t, h, d = x.shape
    config = LlamaConfig(
        hidden_size=h * d,
        num_attention_heads=h,
        head_dim=d,
        rope_parameters={"rope_type": "default", "rope_theta": case["theta"]},
        max_position_embeddings=case["start"] + t,
    )
    positions = torch.arange(case["start"], case["start"] + t)[None]
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)  # [1, t, d] in x's dtype
    # Our layout is [b, t, h, d]: the tables broadcast over the heads at dim 2.
    y, _ = apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=2)
    return y, {"cos": cos[0], "sin": sin[0]}


def attention(case, q, k, v):
    t, s = q.shape[1], k.shape[1]
    q, k, v = (a.transpose(1, 2) for a in (q, k, v))
    if s == t:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case["scale"], enable_gqa=True)
    else:
        # Query i sits at position s - t + i and sees the keys up to it.
        i = torch.arange(t)[:, None]
        j = torch.arange(s)[None, :]
        mask = j <= i + (s - t)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case["scale"], enable_gqa=True)
    return o.transpose(1, 2)


def swiglu(case, g, u):
    return F.silu(g) * u


def cross_entropy(case, logits, targets):
    return F.cross_entropy(logits, targets.long(), reduction="none")


OPS = {
    "rms_norm": (rms_norm, ["x", "w"]),
    "rope": (rope, ["x"]),
    "attention": (attention, ["q", "k", "v"]),
    "swiglu": (swiglu, ["g", "u"]),
    "cross_entropy": (cross_entropy, ["logits", "targets"]),
}


def run(case, inputs):
    fn, names = OPS[case["op"]]
    leaves, args = {}, []
    for n in names:
        t = inputs[f"{case['name']}.{n}"]
        if t.is_floating_point():
            if case["mode"] == "upcast":
                t = t.float()
            t = t.clone().requires_grad_(True)
            leaves[n] = t
        args.append(t)
    out = fn(case, *args)
    y, extra = out if isinstance(out, tuple) else (out, {})
    dy = inputs[f"{case['name']}.dy"].to(y.dtype)
    y.backward(dy)
    result = {"y": y.detach()}
    result.update({f"d{n}": leaf.grad for n, leaf in leaves.items()})
    result.update(extra)
    return {f"{case['name']}.{k}": v.detach().float().contiguous() for k, v in result.items()}


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: kernels_torch.py DIR")
    work = Path(sys.argv[1])
    cases = json.loads((work / "cases.json").read_text())
    inputs = load_file(str(work / "inputs.safetensors"))
    out = {}
    for case in cases:
        out.update(run(case, inputs))
    save_file(out, str(work / "torch.safetensors"))
    print(f"torch {torch.__version__}: {len(cases)} cases, {len(out)} tensors")


if __name__ == "__main__":
    main()
