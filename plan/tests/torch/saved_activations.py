"""The bytes PyTorch's autograd keeps for the backward of one Hugging Face
LlamaDecoderLayer (SDPA attention, bf16 or f32, on the CPU): every tensor a
`saved_tensors_hooks` pack hook sees, counted once per storage (the layer's
input included when an op keeps it), less the layer's parameters and the
rotary tables. Prints one JSON line.

    python saved_activations.py HIDDEN HEADS KV_HEADS INTERMEDIATE SEQ BATCH bf16|f32
"""
import json
import sys

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

hidden, heads, kv_heads, intermediate, seq, batch = (int(a) for a in sys.argv[1:7])
dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[sys.argv[7]]
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=intermediate, num_hidden_layers=1, vocab_size=128,
                  attn_implementation="sdpa")
layer = LlamaDecoderLayer(cfg, 0).to(dtype)
x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
positions = torch.arange(seq).unsqueeze(0)
cos, sin = LlamaRotaryEmbedding(cfg)(x, positions)
saved = {}


def pack(t):
    storage = t.untyped_storage()
    saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
    return t


with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
excluded |= {t.untyped_storage().data_ptr() for t in (cos, sin)}
print(json.dumps({"saved_bytes": sum(n for ptr, n in saved.items() if ptr not in excluded),
                  "torch": torch.__version__}))
