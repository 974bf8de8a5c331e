#!/usr/bin/env python3
"""The transformers side of the generation check: greedy `generate` on a
Hugging Face Llama directory, against `chorus generate`.

Run with the project's venv (ci/python-env.sh exports CHORUS_PYTHON):

    $CHORUS_PYTHON ci/generate_torch.py MODEL_DIR --prompt TEXT --max-new-tokens N

Tokenizes TEXT with `PreTrainedTokenizerFast(tokenizer_file=MODEL_DIR/tokenizer.json)`,
runs
`AutoModelForCausalLM.from_pretrained(MODEL_DIR).generate(ids,
do_sample=False, max_new_tokens=N)` on the CPU, and prints one JSON object:
`prompt_ids`, `ids` (the new tokens) and `text` (them decoded, special
tokens skipped), the fields `chorus generate --json` prints.
"""

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # the caller reads stdout


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    a = p.parse_args(argv)
    if not os.path.isdir(a.model_dir):
        print(f"generate_torch.py: {a.model_dir} is not a directory", file=sys.stderr)
        return 2
    if a.max_new_tokens < 1:
        print("generate_torch.py: --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    # The tokenizer file itself: AutoTokenizer would pick a class from config.json's model_type, which may
    # rewrite the pipeline (a Llama tokenizer's own normalizer), where chorus reads tokenizer.json as it is.
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.model_dir, "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(a.model_dir)
    model.eval()
    ids = tok(a.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=a.max_new_tokens,
        )
    new = out[0, ids.shape[1] :].tolist()
    print(
        json.dumps(
            {
                "prompt_ids": ids[0].tolist(),
                "ids": new,
                "text": tok.decode(new, skip_special_tokens=True),
                "dtype": str(model.dtype).removeprefix("torch."),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
