"""Test oracle for stage 0 outputs: Python `tokenizers`, `transformers` and `tensorboard`
read what `wide pretrain` wrote.

Usage: python check_pretrained.py MODEL_DIR TB_DIR TEXTS_JSON OUT_DIR
Writes OUT_DIR/ids.json (token ids of each text by Python `tokenizers`),
OUT_DIR/logits.safetensors (f32 logits of the first text's ids by `transformers`) and
OUT_DIR/tb.json (every scalar of the TensorBoard event files: tag -> [[step, value], ...]).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main(model_dir, tb_dir, texts_json, out_dir):
    texts = json.load(open(texts_json))
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    json.dump(ids, open(os.path.join(out_dir, "ids.json"), "w"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[0]])).logits.float()
    save_file({"logits": logits.contiguous()}, os.path.join(out_dir, "logits.safetensors"))
    acc = EventAccumulator(tb_dir)
    acc.Reload()
    scalars = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    json.dump(scalars, open(os.path.join(out_dir, "tb.json"), "w"))


if __name__ == "__main__":
    main(*sys.argv[1:5])
