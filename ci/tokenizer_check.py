"""transformers' view of chorus's tokenizers (cli/tests/tokenize.rs).

  ids TOKENIZER_JSON TEXT_FILE
      PreTrainedTokenizerFast(tokenizer_file=...): the ids of the text (as
      `tokenizer(text)` gives them) and their decoding.
  load DIR TEXT_FILE
      AutoTokenizer.from_pretrained(DIR) and
      AutoModelForCausalLM.from_pretrained(DIR): the tokenizer's class, ids,
      decoding and special tokens, the model's generation config and the
      shape of its logits on the ids.

Prints one JSON object on stdout.
"""

import json
import sys


def main():
    mode, path, text_file = sys.argv[1:4]
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    if mode == "ids":
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=path)
        ids = tok(text)["input_ids"]
        out = {"ids": ids, "decoded": tok.decode(ids, clean_up_tokenization_spaces=False)}
    elif mode == "load":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        gen = model.generation_config
        out = {
            "class": type(tok).__name__,
            # transformers 5 names the class TokenizersBackend; PreTrainedTokenizerFast is it.
            "fast": isinstance(tok, PreTrainedTokenizerFast),
            "ids": ids,
            "decoded": tok.decode(ids),
            "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.bos_token_id,
            "pad_token_id": tok.pad_token_id,
            "model_max_length": tok.model_max_length,
            "generation_eos_token_id": gen.eos_token_id,
            "generation_bos_token_id": gen.bos_token_id,
            "logits_shape": list(logits.shape),
        }
    else:
        sys.exit(f"unknown mode {mode!r}; see the docstring")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
