"""Test oracle for `wide export`: plain `transformers` (and the repository's python/wide_torch.py)
run what `wide export` wrote, for `wide`'s own outputs to be compared with.

Usage: python check_export.py EXPORT_DIR STATIC_EXPORT_DIR BASE_MODEL_DIR INPUTS OUT_DIR

EXPORT_DIR: an export with routers and LoRA; STATIC_EXPORT_DIR: a static_width export with a
`pruned/` model; BASE_MODEL_DIR: the model before LoRA; INPUTS: safetensors with a left-padded
batch (input_ids, attention_mask, position_ids). Writes OUT_DIR/oracle.safetensors:
  dense_logits        [B, T, V]  the merged folder loaded by transformers (f32, eager attention)
  routed_logits       [B, T, V]  the same model with wide_torch's routers attached
  disabled_logits     [B, T, V]  routers attached but disabled (must equal dense_logits)
  gate_N_execute/_margin [B, T, G]  wide_torch's N-th gate decision and its margin
  static_logits       [B, T, V]  STATIC_EXPORT_DIR with its static_width masks via wide_torch
  pruned_logits       [B, T, V]  STATIC_EXPORT_DIR/pruned, plain transformers
and OUT_DIR/checks.json: the gates' (layer, kind) in call order, the PEFT adapter check (names,
shapes, adapter_config.json, W_merged - (W_base + alpha/r B A) max-abs, size of the LoRA
update) and the skip rates wide_torch measured.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import wide_torch  # noqa: E402


def load(d):
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()


def weights(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


def peft_check(export_dir, base_dir):
    cfg = json.load(open(os.path.join(export_dir, "peft", "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none", cfg
    adapters = load_file(os.path.join(export_dir, "peft", "adapter_model.safetensors"))
    merged, base = weights(export_dir), weights(base_dir)
    scale = cfg["lora_alpha"] / cfg["r"]
    n_layers = json.load(open(os.path.join(base_dir, "config.json")))["num_hidden_layers"]
    expected = set()
    max_err, max_delta = 0.0, 0.0
    for i in range(n_layers):
        for t in cfg["target_modules"]:
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            module = f"model.layers.{i}.{part}.{t}"
            a_name = f"base_model.model.{module}.lora_A.weight"
            b_name = f"base_model.model.{module}.lora_B.weight"
            expected |= {a_name, b_name}
            a, b = adapters[a_name], adapters[b_name]
            w0 = base[f"{module}.weight"]
            assert a.shape == (cfg["r"], w0.shape[1]) and b.shape == (w0.shape[0], cfg["r"]), (module, a.shape, b.shape, w0.shape)
            delta = scale * (b.double() @ a.double())
            err = (merged[f"{module}.weight"].double() - (w0.double() + delta)).abs().max().item()
            max_err, max_delta = max(max_err, err), max(max_delta, delta.abs().max().item())
    assert set(adapters) == expected, sorted(set(adapters) ^ expected)[:5]
    return {"tensors": len(adapters), "r": cfg["r"], "lora_alpha": cfg["lora_alpha"],
            "target_modules": cfg["target_modules"], "merge_max_abs": max_err, "lora_delta_max_abs": max_delta}


def main(export_dir, static_dir, base_dir, inputs, out_dir):
    x = load_file(inputs)
    args = dict(input_ids=x["input_ids"], attention_mask=x["attention_mask"], position_ids=x["position_ids"])
    out, checks = {}, {}
    with torch.no_grad():
        model = load(export_dir)
        out["dense_logits"] = model(**args).logits.float()
        routing = wide_torch.attach(model, export_dir)
        out["routed_logits"] = model(**args).logits.float()
        checks["gates"] = [[g["layer"], g["kind"]] for g in routing.gates]
        for n, g in enumerate(routing.gates):
            out[f"gate_{n}_execute"] = g["execute"].to(torch.uint8)
            out[f"gate_{n}_margin"] = g["margin"].float()
        checks["skip_rates"] = routing.skip_rates(x["attention_mask"])
        with routing.disabled():
            out["disabled_logits"] = model(**args).logits.float()
        routing.remove()

        static = load(static_dir)
        sr = wide_torch.attach(static, static_dir)
        out["static_logits"] = static(**args).logits.float()
        checks["static_skip_rates"] = sr.skip_rates(x["attention_mask"])
        pruned = load(os.path.join(static_dir, "pruned"))
        out["pruned_logits"] = pruned(**args).logits.float()
        checks["pruned_parameters"] = sum(p.numel() for p in pruned.parameters())
        checks["static_parameters"] = sum(p.numel() for p in static.parameters())
        try:
            wide_torch.attach(pruned, static_dir)
            checks["attach_to_pruned"] = "accepted"
        except ValueError as e:
            checks["attach_to_pruned"] = str(e)
    checks["peft"] = peft_check(export_dir, base_dir)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "oracle.safetensors"))
    json.dump(checks, open(os.path.join(out_dir, "checks.json"), "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:6])
