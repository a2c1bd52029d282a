"""Test oracle: Hugging Face `transformers` computes strided perplexity and multiple-choice
log-likelihoods of a model folder, for `wide eval` to match.

Usage: python hf_eval.py MODEL_DIR TEXT_FILE TASKS_JSONL OUT_JSON SEQ_LEN STRIDE[,STRIDE...]

Perplexity (one result per stride): the text is tokenized whole (no special tokens); windows of
SEQ_LEN tokens start every STRIDE tokens; each window's labels are masked (-100) except for the
tokens after the previous window's end, and the model's own shifted cross-entropy gives the
loss of the rest. Multiple choice: for each (context, choice), whitespace at the end of the
context moves to the front of the choice; the choice's tokens are those of context + choice
after the context's tokens (an empty context is the EOS token; a continuation that adds no
tokens to the context's is encoded alone); the sequence keeps its last
context + 1 tokens; the log-likelihood is the sum of the choice tokens' log-probabilities from
one unbatched forward each. Everything in float32 on the CPU.
"""
import json
import os
import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main():
    model_dir, text_file, tasks_file, out_file, seq_len, strides = sys.argv[1:7]
    seq_len = int(seq_len)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    ctx_len = model.config.max_position_embeddings

    def enc(s):
        return tok.encode(s, add_special_tokens=False).ids

    with open(text_file, encoding="utf-8") as f:
        ids = torch.tensor([enc(f.read())])
    n = ids.shape[1]
    ppl = []
    for stride in (int(s) for s in strides.split(",")):
        nll, count, prev_end = 0.0, 0, 0
        for begin in range(0, n, stride):
            end = min(begin + seq_len, n)
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            labels = input_ids.clone()
            labels[:, :-trg_len] = -100
            scored = int((labels[:, 1:] != -100).sum())
            if scored > 0:
                with torch.no_grad():
                    loss = model(input_ids, labels=labels).loss
                nll += float(loss) * scored
                count += scored
            prev_end = end
            if end == n:
                break
        ppl.append({"stride": stride, "seq_len": seq_len, "tokens": n, "scored_tokens": count,
                    "loss": nll / count, "perplexity": float(torch.tensor(nll / count).exp())})

    tasks = []
    with open(tasks_file, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            lls, ntok, cut = [], [], 0
            for choice in t["choices"]:
                context = t["context"]
                stripped = context.rstrip()
                ctx, cont = stripped, context[len(stripped):] + choice
                if ctx == "":
                    ctx_ids, cont_ids = [eos], enc(cont)
                else:
                    ctx_ids = enc(ctx)
                    cont_ids = enc(ctx + cont)[len(ctx_ids):]
                    if not cont_ids:
                        # The continuation merged into the context's last token.
                        cont_ids = enc(cont)
                full = ctx_ids + cont_ids
                cut = max(cut, max(0, len(full) - (ctx_len + 1)))
                full = full[-(ctx_len + 1):]
                with torch.no_grad():
                    logits = model(torch.tensor([full[:-1]])).logits[0].float()
                logp = logits.log_softmax(-1)[-len(cont_ids):]
                target = torch.tensor(full[-len(cont_ids):])
                lls.append(float(logp.gather(-1, target[:, None]).sum()))
                ntok.append(len(cont_ids))
            tasks.append({"loglik": lls, "tokens": ntok, "truncated_tokens": cut})
    with open(out_file, "w") as f:
        json.dump({"ppl": ppl, "tasks": tasks}, f)


if __name__ == "__main__":
    main()
