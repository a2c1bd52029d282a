"""wide_torch: run a model exported by `wide export` with its routers, in plain PyTorch.

`wide export` writes a Hugging Face folder (LoRA already merged) plus the routers in
`wide_routing.safetensors` and their configuration in `wide_routing.json`. This module attaches
those routers to the `transformers` model loaded from the folder (Llama, Mistral, Qwen2, Qwen3)
with forward hooks, so that its forward is the routed forward of `wide`:

    import torch
    from transformers import AutoModelForCausalLM
    import wide_torch

    model = AutoModelForCausalLM.from_pretrained("export", dtype=torch.float32).eval()
    routing = wide_torch.attach(model, "export")
    logits = model(input_ids, attention_mask=attention_mask).logits   # routed
    print(routing.skip_rates(attention_mask))    # {"attention": 0.49, "ffn": 0.50}
    with routing.disabled():
        dense_logits = model(input_ids, attention_mask=attention_mask).logits
    routing.remove()                             # the plain model again

Semantics (those of `wide`, see `wide_routing.json` of an export):

- A router is `Linear(hidden -> rank) -> Linear(rank -> 2 x groups)`; its output, viewed as
  `[batch, seq, groups, 2]`, holds the (execute, skip) logits of each group. Attention and layer
  routers read the un-normalised residual stream entering the layer (the input of
  `input_layernorm`), FFN routers the residual stream after attention (the input of
  `post_attention_layernorm`).
- Gates are deterministic: a group executes iff `logit_skip - logit_execute + offset <= 0`, with
  the per-router-type inference offset of the manifest (`set_offset` changes it).
- `wide` and `static_width`: a query-head group's attention output is zeroed before `o_proj`;
  an FFN channel group's `silu(gate(x)) * up(x)` is zeroed before `down_proj`. Q, K and V are
  always computed (the KV cache stays complete). `static_width` uses fixed masks.
- `sublayer_skip`: the whole attention output (after `o_proj`) or MLP output (after
  `down_proj`) of a token is zeroed. `layer_skip`: the token's whole layer update is dropped
  (`x + m * (layer(x) - x)`); K/V of the layer are still computed.

The gates of the latest forward are kept in `routing.gates` (one entry per router call, in call
order, each with a boolean `execute` mask `[batch, seq, groups]` and the float `margin`
`logit_execute - logit_skip - offset`, which is >= 0 exactly where the group executes).

Run as a script to compare the dense and routed perplexity of an export on a text file:

    python wide_torch.py EXPORT_DIR --text FILE [--seq-len 128] [--max-tokens 20000]

Needs only `torch` and `transformers` (and `safetensors`, which `transformers` installs).
"""
import argparse
import contextlib
import json
import math
import os
import sys

import torch
from safetensors.torch import load_file
from torch import nn

__all__ = ["Router", "WideRouting", "attach", "load_routing"]

KINDS = ("attention", "ffn", "layer")
MODULES = {"attention": "router_attention", "ffn": "router_ffn", "layer": "router_layer"}
ROUTING_JSON = "wide_routing.json"
ROUTING_TENSORS = "wide_routing.safetensors"


class Router(nn.Module):
    """`Linear(hidden -> rank) -> Linear(rank -> 2 * groups)`: `[B, T, hidden]` -> (execute, skip)
    logits `[B, T, groups, 2]` in float32."""

    def __init__(self, hidden, rank, groups):
        super().__init__()
        self.groups = groups
        self.compressor = nn.Linear(hidden, rank)
        self.router = nn.Linear(rank, 2 * groups)

    def forward(self, x):
        b, t, _ = x.shape
        return self.router(self.compressor(x)).float().view(b, t, self.groups, 2)


class _LayerRouters(nn.Module):
    """The routers (`router_attention`, `router_ffn`, `router_layer`) or fixed `static_width`
    masks (`static_attention`, `static_ffn`) of one decoder layer; absent ones are not set."""


class WideRouting(nn.Module):
    """The routers of an export and the hooks that make a `transformers` model route.

    Build it with :func:`load_routing` (or :func:`attach`, which also attaches it)."""

    def __init__(self, manifest, tensors):
        super().__init__()
        self.manifest = manifest
        self.variant = manifest["variant"]
        m = manifest["model"]
        self.num_layers = m["num_hidden_layers"]
        self.num_heads = m["num_attention_heads"]
        self.head_dim = m["head_dim"]
        self.intermediate_size = m["intermediate_size"]
        self.offsets = {k: float(v) for k, v in manifest["logit_offsets"].items()}
        self.layers = nn.ModuleList()
        routers = manifest["routers"]
        expected = set()
        for i in range(self.num_layers):
            lr = _LayerRouters()
            for kind, spec in routers.items():
                groups = spec["groups"]
                if self.variant == "static_width":
                    name = f"model.layers.{i}.static_{kind}.mask"
                    expected.add(name)
                    mask = _take(tensors, name, (groups,))
                    lr.register_buffer(f"static_{kind}", mask.float() > 0.5)
                    continue
                prefix = f"model.layers.{i}.{spec['module']}"
                rank = manifest["router_rank"]
                r = Router(m["hidden_size"], rank, groups)
                shapes = {"compressor.weight": (rank, m["hidden_size"]), "compressor.bias": (rank,),
                          "router.weight": (2 * groups, rank), "router.bias": (2 * groups,)}
                state = {}
                for suffix, shape in shapes.items():
                    expected.add(f"{prefix}.{suffix}")
                    state[suffix] = _take(tensors, f"{prefix}.{suffix}", shape).float()
                r.load_state_dict(state)
                setattr(lr, spec["module"], r)
            self.layers.append(lr)
        extra = sorted(set(tensors) - expected)
        if extra:
            raise ValueError(f"{ROUTING_TENSORS} holds tensors its manifest does not describe, e.g. {extra[0]}")
        self.enabled = True
        self.gates = []
        self._handles = []
        self._state = {}

    # -- configuration ------------------------------------------------------------------------

    def set_offset(self, kind, value):
        """Sets the inference logit offset of a router type ("attention", "ffn" or "layer");
        larger offsets skip more."""
        if kind not in KINDS:
            raise ValueError(f"unknown router type {kind!r}: use one of {KINDS}")
        self.offsets[kind] = float(value)

    @contextlib.contextmanager
    def disabled(self):
        """Within the block, the model runs dense (the hooks pass everything through)."""
        before = self.enabled
        self.enabled = False
        try:
            yield self
        finally:
            self.enabled = before

    # -- gates --------------------------------------------------------------------------------

    def _gate(self, layer, kind, x):
        """Execute mask `[B, T, groups]` (bool) of router `kind` of `layer` on `x: [B, T, hidden]`."""
        lr = self.layers[layer]
        static = getattr(lr, f"static_{kind}", None) if kind != "layer" else None
        if static is not None:
            b, t, _ = x.shape
            execute = static.to(x.device).view(1, 1, -1).expand(b, t, -1)
            margin = None
        else:
            router = getattr(lr, MODULES[kind], None)
            if router is None:
                return None
            logits = router(x.to(router.compressor.weight.dtype))
            margin = logits[..., 0] - logits[..., 1] - self.offsets[kind]
            execute = margin >= 0
        self.gates.append({"layer": layer, "kind": kind, "execute": execute, "margin": margin})
        return execute

    def skip_rates(self, attention_mask=None):
        """Skip rate per router type of the latest forward: skipped (token, group) pairs over
        valid tokens x groups, padding (`attention_mask == 0`) excluded, averaged over layers."""
        rates = {}
        for g in self.gates:
            e = g["execute"].float()
            valid = torch.ones(e.shape[:2], device=e.device) if attention_mask is None else attention_mask.to(e.device).float()
            skipped = ((1 - e) * valid.unsqueeze(-1)).sum()
            total = valid.sum() * e.shape[-1]
            rates.setdefault(g["kind"], []).append((skipped / total.clamp(min=1)).item())
        return {k: sum(v) / len(v) for k, v in rates.items()}

    # -- hooks --------------------------------------------------------------------------------

    def attach(self, model):
        """Registers the hooks on `model` (a `transformers` causal LM or its base model) and
        moves the routers to its device and dtype. Returns `self`."""
        if self._handles:
            raise RuntimeError("these routers are already attached; call remove() first")
        layers = _decoder_layers(model)
        cfg = model.config
        want = self.manifest["model"]
        got = {"num_hidden_layers": len(layers), "hidden_size": cfg.hidden_size,
               "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads}
        for k, v in got.items():
            if v != want[k]:
                raise ValueError(f"these routers were exported for a model with {k} = {want[k]}, this model has {v}")
        p = next(model.parameters())
        self.to(device=p.device, dtype=p.dtype)
        for i, layer in enumerate(layers):
            h = self._handles
            h.append(layer.input_layernorm.register_forward_pre_hook(self._enter_layer(i)))
            h.append(layer.self_attn.o_proj.register_forward_pre_hook(self._mask_heads(i)))
            h.append(layer.self_attn.o_proj.register_forward_hook(self._mask_output(i, "attention_out")))
            h.append(layer.post_attention_layernorm.register_forward_pre_hook(self._enter_ffn(i)))
            h.append(layer.mlp.down_proj.register_forward_pre_hook(self._mask_channels(i)))
            h.append(layer.mlp.down_proj.register_forward_hook(self._mask_output(i, "ffn_out")))
            h.append(layer.register_forward_hook(self._leave_layer(i)))
        return self

    def remove(self):
        """Removes the hooks: the model is the plain dense model again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._state = {}

    def _enter_layer(self, i):
        def hook(_module, args):
            if i == 0:
                self.gates = []
            if not self.enabled:
                self._state[i] = {}
                return None
            x = args[0]
            s = {"x": x}
            m = self._gate(i, "layer", x)
            if m is not None:
                s["layer"] = m
            m = self._gate(i, "attention", x)
            if m is not None:
                if self.variant == "sublayer_skip":
                    s["attention_out"] = m
                else:
                    s["heads"] = m.repeat_interleave(self.num_heads // m.shape[-1], dim=-1)
            self._state[i] = s
            return None
        return hook

    def _enter_ffn(self, i):
        def hook(_module, args):
            s = self._state.get(i, {})
            if not self.enabled:
                return None
            m = self._gate(i, "ffn", args[0])
            if m is not None:
                if self.variant == "sublayer_skip":
                    s["ffn_out"] = m
                else:
                    s["channels"] = m.repeat_interleave(self.intermediate_size // m.shape[-1], dim=-1)
            return None
        return hook

    def _mask_heads(self, i):
        def hook(_module, args):
            m = self._state.get(i, {}).get("heads")
            if m is None:
                return None
            a = args[0]
            b, t, _ = a.shape
            a = (a.view(b, t, self.num_heads, self.head_dim) * m.unsqueeze(-1).to(a.dtype)).view(b, t, -1)
            return (a,) + tuple(args[1:])
        return hook

    def _mask_channels(self, i):
        def hook(_module, args):
            m = self._state.get(i, {}).get("channels")
            if m is None:
                return None
            return (args[0] * m.to(args[0].dtype),) + tuple(args[1:])
        return hook

    def _mask_output(self, i, key):
        def hook(_module, _args, out):
            m = self._state.get(i, {}).get(key)
            if m is None:
                return None
            return out * m.to(out.dtype)
        return hook

    def _leave_layer(self, i):
        def hook(_module, _args, out):
            s = self._state.pop(i, {})
            m = s.get("layer")
            if m is None:
                return None
            x = s["x"]
            h = out[0] if isinstance(out, tuple) else out
            h = x + m.to(h.dtype) * (h - x)
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
        return hook


def _take(tensors, name, shape):
    if name not in tensors:
        raise ValueError(f"{ROUTING_TENSORS} lacks {name}: the file does not match its manifest")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)} in {ROUTING_TENSORS}, expected {tuple(shape)}")
    return t


def _decoder_layers(model):
    for obj in (getattr(model, "model", None), model):
        layers = getattr(obj, "layers", None)
        if layers is not None:
            return layers
    raise ValueError("cannot find the decoder layers (model.model.layers) of this model")


def load_routing(export_dir):
    """Reads `wide_routing.json` and `wide_routing.safetensors` of an export folder."""
    with open(os.path.join(export_dir, ROUTING_JSON), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != "wide-routing":
        raise ValueError(f"{ROUTING_JSON} in {export_dir} is not a wide routing manifest")
    return WideRouting(manifest, load_file(os.path.join(export_dir, ROUTING_TENSORS)))


def attach(model, export_dir):
    """Loads the routers of an export folder and attaches them to `model`; returns them."""
    return load_routing(export_dir).attach(model)


def _perplexity(model, ids, seq_len, routing=None):
    """Mean next-token loss over disjoint windows of `seq_len` tokens, and the skip rates."""
    total, count, rates = 0.0, 0, {}
    for start in range(0, len(ids) - 1, seq_len):
        window = torch.tensor([ids[start:start + seq_len + 1]])
        if window.shape[1] < 2:
            break
        with torch.no_grad():
            logits = model(input_ids=window[:, :-1]).logits.float()
        loss = nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum")
        n = window.shape[1] - 1
        total, count = total + loss.item(), count + n
        if routing is not None and routing.enabled:
            for k, v in routing.skip_rates().items():
                rates[k] = rates.get(k, 0.0) + v * n
    return total / count, {k: v / count for k, v in rates.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Dense and routed perplexity of a `wide export` folder on a text file.")
    ap.add_argument("export_dir")
    ap.add_argument("--text", required=True, help="a UTF-8 text file")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=20000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    if args.seq_len < 1 or args.max_tokens < 1:
        ap.error("--seq-len and --max-tokens must be at least 1")
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    for need in ("config.json", "tokenizer.json", ROUTING_JSON):
        if not os.path.exists(os.path.join(args.export_dir, need)):
            raise ValueError(f"{args.export_dir} has no {need}: pass a folder written by `wide export`")
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(args.export_dir, "tokenizer.json"))
    with open(args.text, encoding="utf-8") as f:
        ids = tok(f.read(), add_special_tokens=False)["input_ids"][: args.max_tokens + 1]
    if len(ids) < 2:
        raise ValueError(f"{args.text} holds {len(ids)} token(s); perplexity needs at least 2")
    model = AutoModelForCausalLM.from_pretrained(args.export_dir, dtype=getattr(torch, args.dtype)).eval()
    routing = attach(model, args.export_dir)
    with routing.disabled():
        dense, _ = _perplexity(model, ids, args.seq_len)
    routed, rates = _perplexity(model, ids, args.seq_len, routing)
    print(f"tokens {len(ids) - 1}  variant {routing.variant}")
    print(f"dense   loss {dense:.4f}  perplexity {math.exp(dense):.2f}")
    skips = "  ".join(f"{k} {v:.3f}" for k, v in sorted(rates.items()))
    print(f"routed  loss {routed:.4f}  perplexity {math.exp(routed):.2f}  skip rates {skips}")


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as e:
        # One line saying what is wrong (a missing file, a bad export folder), not a traceback.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
