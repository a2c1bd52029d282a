"""Test oracle: Hugging Face `transformers` builds small random models of each supported
family, saves them with `save_pretrained`, and records reference outputs for `wide` to match.

Usage: python hf_families.py OUT_DIR

For each family it writes OUT_DIR/<name>/ (a model folder) and OUT_DIR/<name>.oracle.safetensors:
  input_ids, attention_mask, position_ids  [B, T]  a left-padded batch with explicit positions
  logits                                   [B, T, V] f32 logits of that batch (eager attention)
  gen_input_ids, gen_attention_mask        [B, P]  left-padded prompts for greedy generation
  gen_tokens, gen_margins                  [B, N]  greedy continuation (KV cache) and the
                                                   top-1 minus top-2 raw logit at every step
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

NEW_TOKENS = 16
COMMON = dict(vocab_size=320, num_hidden_layers=2, intermediate_size=384, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              initializer_range=0.05)

FAMILIES = {
    # Llama 3.1-style: GQA, untied, llama3 RoPE scaling with a small original context so that
    # all three frequency bands occur at head_dim 64.
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Llama 2 / 3.2-style: multi-head attention, tied embeddings, plain RoPE.
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        tie_word_embeddings=True)),
    # Mistral: GQA with a sliding window shorter than the test sequences.
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        sliding_window=8, tie_word_embeddings=False)),
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, head_dim from the config (heads x head_dim != hidden).
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False)),
}


def left_pad(rows, pad_id=0):
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = torch.tensor(r)
        mask[i, t - len(r):] = 1
    return ids, mask


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for seed, (name, (cfg_cls, model_cls, extra)) in enumerate(sorted(FAMILIES.items())):
        torch.manual_seed(1000 + seed)
        cfg = cfg_cls(**COMMON, **extra)
        model = model_cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        # Random biases and norm weights, so that bias and norm handling is really tested.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias") or "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(os.path.join(out_dir, name), safe_serialization=True)
        g = torch.Generator().manual_seed(seed)
        rows = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 13, 6)]
        ids, mask = left_pad(rows)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 4)]
        gids, gmask = left_pad(prompts)
        with torch.no_grad():
            out = model.generate(input_ids=gids, attention_mask=gmask, do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                 use_cache=True)
        step_logits = torch.stack(out.logits, dim=1).float()  # [B, N, V]
        top2 = step_logits.topk(2, dim=-1).values
        save_file({
            "input_ids": ids, "attention_mask": mask, "position_ids": pos, "logits": logits.contiguous(),
            "gen_input_ids": gids, "gen_attention_mask": gmask,
            "gen_tokens": out.sequences[:, gids.shape[1]:].contiguous(),
            "gen_margins": (top2[..., 0] - top2[..., 1]).contiguous(),
        }, os.path.join(out_dir, f"{name}.oracle.safetensors"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
