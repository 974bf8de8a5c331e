#!/usr/bin/env python3
"""The PyTorch side of the Llama check: `chorus train --model llama` against
`transformers`' LlamaForCausalLM trained with torch.optim.AdamW.

Run with the project's venv (ci/python-env.sh exports CHORUS_PYTHON):

    $CHORUS_PYTHON ci/llama_torch.py make OUT [--seed 0] [--tied] [--rows 64] [--seq-len 16]
    $CHORUS_PYTHON ci/llama_torch.py train MODEL_DIR DATA_NPY OUT --steps S --global-batch G
                                    [--lr 1e-3] [--weight-decay 0.01] [--max-grad-norm 1.0]
    $CHORUS_PYTHON ci/llama_torch.py compare CHORUS_MODEL_DIR TORCH_MODEL_DIR [--atol 1e-4]

`make` writes OUT/model/ (a small random GQA Llama, float32 safetensors) and
OUT/data.npy (int64 token ids, [rows, seq_len + 1]). `train` trains MODEL_DIR
on the global batch (step s takes rows (s*G + k) mod N, k < G) and writes
OUT/losses.json and OUT/model/. `compare` loads both directories with
from_pretrained and prints every tensor's largest difference as JSON; it
exits 1 on a loading problem or a difference above --atol.

Everything runs on the CPU in float32, deterministically. Outputs are staged
in a fresh directory beside their destination and renamed into place at the
end, so a failed run leaves nothing half-written; an existing output is
refused, never replaced.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # the callers read stdout and stderr

# The model `make` builds (the contract with the Rust test that calls this).
VOCAB = 96
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)
ROPE_THETA = 10000.0


class UsageError(Exception):
    """Bad arguments or paths: reported in one line, exit status 2."""


def deterministic(seed):
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def llama_config(tied):
    import inspect

    params = inspect.signature(LlamaConfig.__init__).parameters
    rope = (
        {"rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}}
        if "rope_parameters" in params
        else {"rope_theta": ROPE_THETA}  # transformers 4
    )
    return LlamaConfig(**CONFIG, **rope, tie_word_embeddings=tied, attn_implementation="eager")


def load(model_dir):
    """(model, loading info) of an HF directory, float32, eager attention."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"{model_dir}: not a model directory (no config.json)")
    model, info = LlamaForCausalLM.from_pretrained(
        model_dir, output_loading_info=True, dtype=torch.float32, attn_implementation="eager"
    )
    return model, info


def key_problems(info):
    """The loading info's non-empty lists, by name."""
    return {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs" and v} | (
        {"error_msgs": list(info["error_msgs"])} if info.get("error_msgs") else {}
    )


def publish(staging, names, out):
    """Moves `names` from `staging` into `out` (created), then removes `staging`."""
    os.makedirs(out, exist_ok=True)
    for name in names:
        os.rename(os.path.join(staging, name), os.path.join(out, name))
    os.rmdir(staging)


def staged(out, names, write):
    """Runs `write(staging)` and publishes `names` into `out`; a failure
    leaves `out` as it was (the staging directory is removed)."""
    for name in names:
        if os.path.lexists(os.path.join(out, name)):
            raise UsageError(f"{os.path.join(out, name)}: already exists; choose a new output directory")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"{out}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"{parent}: no such directory")
    staging = tempfile.mkdtemp(prefix=".llama_torch-", dir=parent)
    try:
        write(staging)
        publish(staging, names, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def cmd_make(a):
    if a.rows < 1 or a.seq_len < 1:
        raise UsageError("--rows and --seq-len must be at least 1")
    if a.seq_len > CONFIG["max_position_embeddings"]:
        raise UsageError(f"--seq-len {a.seq_len} exceeds max_position_embeddings {CONFIG['max_position_embeddings']}")

    def write(staging):
        deterministic(a.seed)
        model = LlamaForCausalLM(llama_config(a.tied)).to(torch.float32)
        model.save_pretrained(os.path.join(staging, "model"))
        data = np.random.default_rng(a.seed).integers(0, VOCAB, size=(a.rows, a.seq_len + 1), dtype=np.int64)
        np.save(os.path.join(staging, "data.npy"), data)

    staged(a.out, ["model", "data.npy"], write)


def load_data(path):
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file")
    data = np.load(path, allow_pickle=False)
    if data.dtype != np.int64 or data.ndim != 2 or data.shape[0] < 1 or data.shape[1] < 2:
        raise UsageError(f"{path}: want int64 [rows, seq_len + 1 >= 2], found {data.dtype} {list(data.shape)}")
    if data.min() < 0 or data.max() >= VOCAB:
        raise UsageError(f"{path}: token ids must lie in [0, {VOCAB})")
    return torch.from_numpy(data)


def cmd_train(a):
    if a.steps < 1 or a.global_batch < 1:
        raise UsageError("--steps and --global-batch must be at least 1")
    if not (a.lr > 0 and math.isfinite(a.lr)) or not (a.weight_decay >= 0 and math.isfinite(a.weight_decay)):
        raise UsageError("--lr must be positive and --weight-decay non-negative (finite)")
    if not math.isfinite(a.max_grad_norm):
        raise UsageError("--max-grad-norm must be finite")
    data = load_data(a.data)
    deterministic(0)
    model, info = load(a.model_dir)
    if key_problems(info):
        raise UsageError(f"{a.model_dir}: does not load cleanly: {key_problems(info)}")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
    n = data.shape[0]
    losses = []
    for s in range(a.steps):
        rows = data[[(s * a.global_batch + k) % n for k in range(a.global_batch)]]
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        losses.append(loss.item())
        loss.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        opt.step()
        opt.zero_grad()

    def write(staging):
        model.save_pretrained(os.path.join(staging, "model"))
        with open(os.path.join(staging, "losses.json"), "w") as f:
            json.dump({"losses": losses}, f)

    staged(a.out, ["model", "losses.json"], write)
    print(json.dumps({"losses": losses}))


def cmd_compare(a):
    if not (a.atol >= 0 and math.isfinite(a.atol)):
        raise UsageError("--atol must be a non-negative number")
    chorus, chorus_info = load(a.chorus_model_dir)
    torch_model, torch_info = load(a.torch_model_dir)
    problems = {}
    if key_problems(chorus_info):
        problems["chorus"] = key_problems(chorus_info)
    if key_problems(torch_info):
        problems["torch"] = key_problems(torch_info)
    ours, theirs = chorus.state_dict(), torch_model.state_dict()
    if set(ours) != set(theirs):
        problems["keys"] = {
            "only_chorus": sorted(set(ours) - set(theirs)),
            "only_torch": sorted(set(theirs) - set(ours)),
        }
    per_tensor = {}
    for name in sorted(set(ours) & set(theirs)):
        x, y = ours[name], theirs[name]
        if x.shape != y.shape:
            problems.setdefault("shapes", {})[name] = [list(x.shape), list(y.shape)]
            continue
        per_tensor[name] = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
    worst = max(per_tensor.values(), default=0.0)
    report = {"max_abs_diff": worst, "per_tensor": per_tensor}
    if problems:
        report["problems"] = problems
    print(json.dumps(report, indent=1))
    # NaN compares false: count it as a difference.
    if problems or not all(d <= a.atol for d in per_tensor.values()):
        return 1
    return 0


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="a random small Llama and token data")
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tied", action="store_true", help="tie the head to the embedding")
    m.add_argument("--rows", type=int, default=64)
    m.add_argument("--seq-len", type=int, default=16)
    t = sub.add_parser("train", help="train a model directory in PyTorch")
    t.add_argument("model_dir")
    t.add_argument("data")
    t.add_argument("out")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--global-batch", type=int, required=True)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--max-grad-norm", type=float, default=1.0)
    c = sub.add_parser("compare", help="compare two model directories tensor by tensor")
    c.add_argument("chorus_model_dir")
    c.add_argument("torch_model_dir")
    c.add_argument("--atol", type=float, default=1e-4)
    a = p.parse_args(argv)
    try:
        if a.command == "make":
            cmd_make(a)
        elif a.command == "train":
            cmd_train(a)
        else:
            return cmd_compare(a)
    except UsageError as e:
        print(f"llama_torch.py {a.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
