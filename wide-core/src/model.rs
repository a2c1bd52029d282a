//! The Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3) in tch.
//!
//! One forward path serves training (no cache), scoring of padded batches, prefill and decode
//! (with a preallocated [`KvCache`]). Parameters live in a `VarStore` under their Hugging Face
//! names (`model.layers.N.self_attn.q_proj.weight`, ...).
use crate::checkpoint::WeightSource;
use crate::config::ModelConfig;
use crate::rope::{self, Rope};
use crate::routing::RoutingRun;
use anyhow::{bail, ensure, Result};
use std::collections::HashMap;
use tch::{nn, Device, Kind, Tensor};

/// A linear layer `y = x W^T + b` with `W: [out, in]`, optionally with a LoRA adapter.
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub lora: Option<crate::lora::LoraAdapter>,
}

impl Linear {
    fn load(p: &nn::Path, src: &mut dyn WeightSource, spec: &BuildSpec, out: i64, inp: i64, bias: bool) -> Result<Self> {
        let weight = spec.param(p, src, "weight", &[out, inp])?;
        let bias = if bias { Some(spec.param(p, src, "bias", &[out])?) } else { None };
        Ok(Self { weight, bias, lora: None })
    }
    /// `[.., in] -> [.., out]`
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let y = x.linear(&self.weight, self.bias.as_ref());
        match &self.lora {
            Some(l) => y + l.forward(x),
            None => y,
        }
    }
}

/// RMSNorm over the last dimension, computed in f32 like the reference implementation.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    fn load(p: &nn::Path, src: &mut dyn WeightSource, spec: &BuildSpec, dim: i64, eps: f64) -> Result<Self> {
        Ok(Self { weight: spec.param(p, src, "weight", &[dim])?, eps })
    }
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let h = x.to_kind(Kind::Float);
        let var = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let h = h * (var + self.eps).rsqrt();
        &self.weight * h.to_kind(kind)
    }
}

/// How parameters are created: dtype, device, trainability.
pub struct BuildSpec {
    pub kind: Kind,
    pub device: Device,
    pub trainable: bool,
}

impl BuildSpec {
    fn param(&self, p: &nn::Path, src: &mut dyn WeightSource, name: &str, shape: &[i64]) -> Result<Tensor> {
        let full = format!("{}.{name}", path_name(p));
        let t = src.get(&full, shape, self.kind, self.device)?;
        Ok(p.add(name, t, self.trainable))
    }
}

fn path_name(p: &nn::Path) -> String {
    p.components().collect::<Vec<_>>().join(".")
}

#[derive(Debug)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub window: Option<i64>,
}

#[derive(Debug)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    /// `[B, T, hidden] -> [B, T, hidden]`: `down(silu(gate(x)) * up(x))`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.down_proj.forward(&self.hidden(x))
    }
    /// The intermediate activation `silu(gate(x)) * up(x)`: `[B, T, intermediate]`.
    pub fn hidden(&self, x: &Tensor) -> Tensor {
        self.gate_proj.forward(x).silu() * self.up_proj.forward(x)
    }
}

#[derive(Debug)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
}

/// Preallocated key/value cache: per layer `[B, kv_heads, capacity, head_dim]`.
/// Slots are shared by the batch (left padding keeps rows aligned); `len` slots are filled.
pub struct KvCache {
    pub keys: Vec<Tensor>,
    pub values: Vec<Tensor>,
    pub len: i64,
    pub capacity: i64,
    pub batch: i64,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig, batch: i64, capacity: i64, kind: Kind, device: Device) -> Self {
        let shape = [batch, cfg.num_key_value_heads, capacity, cfg.head_dim];
        let n = cfg.num_hidden_layers as usize;
        Self {
            keys: (0..n).map(|_| Tensor::zeros(shape, (kind, device))).collect(),
            values: (0..n).map(|_| Tensor::zeros(shape, (kind, device))).collect(),
            len: 0,
            capacity,
            batch,
        }
    }
    pub fn reset(&mut self) {
        self.len = 0;
    }
}

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    All,
    /// Only the last position of each row (prefill for generation).
    Last,
}

/// Inputs beyond the token ids.
#[derive(Default)]
pub struct ForwardOptions<'a> {
    /// `[B, T]` positions for RoPE; default: cache length + 0..T.
    pub position_ids: Option<&'a Tensor>,
    /// `[B, past + T]`, nonzero where the key slot holds a real token (0 for padding).
    pub attention_mask: Option<&'a Tensor>,
    pub cache: Option<&'a mut KvCache>,
    pub logits: Option<Logits>,
}

/// Where the queries of one forward sit and which key slots they may see.
pub(crate) struct AttnContext {
    /// `[B, 1, T, D]` rotary tables.
    cos: Tensor,
    sin: Tensor,
    /// Cache slot of each query `[T]` (used to write K/V), when a cache is used.
    slots: Option<Tensor>,
    /// Number of key slots visible (cache prefix or T).
    kv_len: i64,
    /// Boolean masks `[B, 1, T, kv_len]` (true = attend), keyed by sliding window; `None` when
    /// plain causal attention applies to every query (no padding, no past, no short window).
    masks: HashMap<Option<i64>, Tensor>,
    causal_fast: bool,
}

/// The attention context shared by the layers of a layer-by-layer forward.
pub struct LayerStack {
    ctx: AttnContext,
}

/// A Llama-family causal language model.
pub struct LlamaModel {
    pub config: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `[vocab, hidden]`; the embedding matrix itself when embeddings are tied.
    pub lm_head: Tensor,
    pub rope: Rope,
    pub kind: Kind,
    pub device: Device,
}

impl LlamaModel {
    /// Builds the model under `root` (names follow Hugging Face's), taking each parameter from
    /// `src`. Parameters are not trainable unless `trainable`.
    pub fn new(root: &nn::Path, cfg: &ModelConfig, src: &mut dyn WeightSource, kind: Kind, trainable: bool) -> Result<Self> {
        cfg.validate()?;
        let device = root.device();
        let spec = BuildSpec { kind, device, trainable };
        let h = cfg.hidden_size;
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let m = root / "model";
        let embed_tokens = spec.param(&(&m / "embed_tokens"), src, "weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers as usize);
        for i in 0..cfg.num_hidden_layers {
            let l = &m / "layers" / i;
            let a = &l / "self_attn";
            let self_attn = Attention {
                q_proj: Linear::load(&(&a / "q_proj"), src, &spec, nh * hd, h, cfg.qkv_bias)?,
                k_proj: Linear::load(&(&a / "k_proj"), src, &spec, nkv * hd, h, cfg.qkv_bias)?,
                v_proj: Linear::load(&(&a / "v_proj"), src, &spec, nkv * hd, h, cfg.qkv_bias)?,
                o_proj: Linear::load(&(&a / "o_proj"), src, &spec, h, nh * hd, cfg.o_bias)?,
                q_norm: if cfg.qk_norm { Some(RmsNorm::load(&(&a / "q_norm"), src, &spec, hd, cfg.rms_norm_eps)?) } else { None },
                k_norm: if cfg.qk_norm { Some(RmsNorm::load(&(&a / "k_norm"), src, &spec, hd, cfg.rms_norm_eps)?) } else { None },
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                window: cfg.sliding_window[i as usize],
            };
            let f = &l / "mlp";
            let i_sz = cfg.intermediate_size;
            let mlp = Mlp {
                gate_proj: Linear::load(&(&f / "gate_proj"), src, &spec, i_sz, h, cfg.mlp_bias)?,
                up_proj: Linear::load(&(&f / "up_proj"), src, &spec, i_sz, h, cfg.mlp_bias)?,
                down_proj: Linear::load(&(&f / "down_proj"), src, &spec, h, i_sz, cfg.mlp_bias)?,
            };
            layers.push(DecoderLayer {
                input_layernorm: RmsNorm::load(&(&l / "input_layernorm"), src, &spec, h, cfg.rms_norm_eps)?,
                self_attn,
                post_attention_layernorm: RmsNorm::load(&(&l / "post_attention_layernorm"), src, &spec, h, cfg.rms_norm_eps)?,
                mlp,
            });
        }
        let norm = RmsNorm::load(&(&m / "norm"), src, &spec, h, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            spec.param(&(root / "lm_head"), src, "weight", &[cfg.vocab_size, h])?
        };
        Ok(Self { config: cfg.clone(), embed_tokens, layers, norm, lm_head, rope: Rope::new(cfg, device), kind, device })
    }

    /// Token ids `[B, T]` -> logits `[B, T, vocab]` (or `[B, 1, vocab]` with [`Logits::Last`]),
    /// in the model's dtype. With a cache, K/V of the new tokens are written at slots
    /// `cache.len..cache.len + T` and `cache.len` advances.
    pub fn forward(&self, input_ids: &Tensor, opts: ForwardOptions) -> Result<Tensor> {
        let hidden = self.forward_hidden(input_ids, opts.position_ids, opts.attention_mask, opts.cache, None)?;
        Ok(self.logits(&hidden, opts.logits.unwrap_or(Logits::All)))
    }

    /// [`LlamaModel::forward`] with routing: the run's routers (or fixed masks) decide per token
    /// which head groups / channel groups / sublayers / layers execute, and the run records
    /// skip statistics. The same code path as the dense forward.
    pub fn forward_routed(&self, input_ids: &Tensor, opts: ForwardOptions, run: &mut RoutingRun) -> Result<Tensor> {
        let hidden = self.forward_hidden(input_ids, opts.position_ids, opts.attention_mask, opts.cache, Some(run))?;
        Ok(self.logits(&hidden, opts.logits.unwrap_or(Logits::All)))
    }

    /// Final hidden states `[B, T, hidden]` (after the last norm).
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        position_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        mut cache: Option<&mut KvCache>,
        mut routing: Option<&mut RoutingRun>,
    ) -> Result<Tensor> {
        let size = input_ids.size();
        ensure!(size.len() == 2, "input_ids must be [batch, seq], got {size:?}");
        let (b, t) = (size[0], size[1]);
        let past = cache.as_ref().map(|c| c.len).unwrap_or(0);
        if let Some(c) = cache.as_ref() {
            ensure!(c.batch == b, "KV cache was allocated for batch {}, got batch {b}", c.batch);
            if past + t > c.capacity {
                bail!("KV cache holds {} positions; {past} used + {t} new do not fit", c.capacity);
            }
        }
        let default_pos;
        let positions = match position_ids {
            Some(p) => {
                ensure!(p.size() == [b, t], "position_ids must be [{b}, {t}], got {:?}", p.size());
                p
            }
            None => {
                default_pos = Tensor::arange_start(past, past + t, (Kind::Int64, self.device)).unsqueeze(0).expand([b, t], false);
                &default_pos
            }
        };
        if let Some(m) = attention_mask {
            ensure!(m.size() == [b, past + t], "attention_mask must be [{b}, {}] (past + new tokens), got {:?}", past + t, m.size());
        }
        let ctx = self.attn_context(b, t, past, positions, attention_mask, cache.is_some())?;
        let mut x = Tensor::embedding(&self.embed_tokens, &input_ids.to_device(self.device), -1, false, false);
        if let Some(r) = routing.as_deref() {
            ensure!(r.routing.layers.len() == self.layers.len(), "routing has {} layers, the model {}", r.routing.layers.len(), self.layers.len());
            ensure!(r.valid.size() == [b, t], "routing valid-token mask must be [{b}, {t}], got {:?}", r.valid.size());
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = cache.as_deref_mut().map(|c| (&c.keys[i], &c.values[i]));
            x = self.layer_forward(layer, &x, &ctx, kv, routing.as_deref_mut().map(|r| (r, i)));
        }
        if let Some(c) = cache {
            c.len += t;
        }
        Ok(self.norm.forward(&x))
    }

    /// Starts a layer-by-layer forward of `input_ids: [B, T]` (no cache, no padding, default
    /// positions), the form activation checkpointing needs: returns the embeddings (the first
    /// layer's input) and the attention context every layer shares. Apply the layers with
    /// [`LlamaModel::run_layer`] and the final norm with `self.norm`; the result is the same as
    /// [`LlamaModel::forward_hidden`]'s.
    pub fn begin_layers(&self, input_ids: &Tensor) -> Result<(Tensor, LayerStack)> {
        let (b, t) = input_ids.size2().map_err(|_| anyhow::anyhow!("input_ids must be [batch, seq], got {:?}", input_ids.size()))?;
        let positions = Tensor::arange(t, (Kind::Int64, self.device)).unsqueeze(0).expand([b, t], false);
        let ctx = self.attn_context(b, t, 0, &positions, None, false)?;
        let x = Tensor::embedding(&self.embed_tokens, &input_ids.to_device(self.device), -1, false, false);
        Ok((x, LayerStack { ctx }))
    }

    /// Decoder layer `i` on its input `x: [B, T, hidden]` (see [`LlamaModel::begin_layers`]).
    /// With routing, the run's router calls must be positioned at layer `i`
    /// ([`RoutingRun::seek_layer`]).
    pub fn run_layer(&self, i: usize, x: &Tensor, stack: &LayerStack, routing: Option<&mut RoutingRun>) -> Tensor {
        self.layer_forward(&self.layers[i], x, &stack.ctx, None, routing.map(|r| (r, i)))
    }

    /// One decode step with fixed shapes and no host values, so it can be captured in a CUDA
    /// graph: `tokens, positions: [B, 1]`, `slot: [1]` (the cache slot the new K/V go to),
    /// `key_valid: [B, capacity]` bool (slots holding real tokens, the new one included).
    /// Attends over the whole cache capacity under the mask. Returns logits `[B, vocab]`.
    pub fn decode_static(&self, tokens: &Tensor, positions: &Tensor, slot: &Tensor, key_valid: &Tensor, cache: &KvCache) -> Tensor {
        let b = tokens.size()[0];
        let cap = cache.capacity;
        let (cos, sin) = self.rope.cos_sin(positions, self.kind);
        let k_slot = Tensor::arange(cap, (Kind::Int64, self.device)).view([1, 1, 1, cap]);
        let q_slot = slot.view([1, 1, 1, 1]);
        let base = key_valid.view([b, 1, 1, cap]).logical_and(&k_slot.le_tensor(&q_slot));
        let mut masks = HashMap::new();
        for w in self.config.sliding_window.iter().copied() {
            masks.entry(w).or_insert_with(|| match w {
                Some(w) => base.logical_and(&(&q_slot - &k_slot).lt(w)),
                None => base.shallow_clone(),
            });
        }
        let ctx = AttnContext { cos, sin, slots: Some(slot.shallow_clone()), kv_len: cap, masks, causal_fast: false };
        let mut x = Tensor::embedding(&self.embed_tokens, tokens, -1, false, false);
        for (i, layer) in self.layers.iter().enumerate() {
            x = self.layer_forward(layer, &x, &ctx, Some((&cache.keys[i], &cache.values[i])), None);
        }
        self.logits(&self.norm.forward(&x), Logits::Last).squeeze_dim(1)
    }

    /// `[B, T, hidden]` -> logits.
    pub fn logits(&self, hidden: &Tensor, which: Logits) -> Tensor {
        let h = match which {
            Logits::All => hidden.shallow_clone(),
            Logits::Last => hidden.narrow(1, hidden.size()[1] - 1, 1),
        };
        h.linear::<Tensor>(&self.lm_head, None)
    }

    fn attn_context(&self, b: i64, t: i64, past: i64, positions: &Tensor, mask: Option<&Tensor>, cached: bool) -> Result<AttnContext> {
        let (cos, sin) = self.rope.cos_sin(&positions.to_device(self.device), self.kind);
        let kv_len = past + t;
        let slots = cached.then(|| Tensor::arange_start(past, kv_len, (Kind::Int64, self.device)));
        let windows: Vec<Option<i64>> = {
            let mut w: Vec<_> = self.config.sliding_window.clone();
            w.sort();
            w.dedup();
            w
        };
        let short_window = windows.iter().flatten().any(|w| *w < kv_len);
        let causal_fast = mask.is_none() && past == 0 && !short_window;
        let mut masks = HashMap::new();
        if !causal_fast {
            let q_slot = Tensor::arange_start(past, kv_len, (Kind::Int64, self.device)).view([t, 1]);
            let k_slot = Tensor::arange(kv_len, (Kind::Int64, self.device)).view([1, kv_len]);
            let causal = k_slot.le_tensor(&q_slot);
            let valid = match mask {
                Some(m) => m.to_device(self.device).ne(0).view([b, 1, 1, kv_len]),
                None => Tensor::ones([b, 1, 1, kv_len], (Kind::Bool, self.device)),
            };
            // A query may always see its own slot, so no row is empty (padding rows would
            // otherwise turn to NaN and poison later layers through their values).
            let diagonal = k_slot.eq_tensor(&q_slot);
            for w in windows {
                let mut allowed = causal.logical_and(&valid);
                if let Some(w) = w {
                    allowed = allowed.logical_and(&(&q_slot - &k_slot).lt(w));
                }
                masks.insert(w, allowed.logical_or(&diagonal));
            }
        }
        Ok(AttnContext { cos, sin, slots, kv_len, masks, causal_fast })
    }

    /// One decoder layer. With routing, execute masks act where method.md puts them: per query
    /// head before `o_proj`, per intermediate channel before `down_proj`, on a whole sublayer's
    /// output, or on the whole layer's update; K/V are always computed.
    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        ctx: &AttnContext,
        kv: Option<(&Tensor, &Tensor)>,
        routing: Option<(&mut RoutingRun, usize)>,
    ) -> Tensor {
        let a = &layer.self_attn;
        let (b, t, _) = x.size3().unwrap();
        let (mut run, i) = match routing {
            Some((r, i)) => (Some(r), i),
            None => (None, 0),
        };
        let mut masks = run.as_deref_mut().map(|r| r.layer_masks_pre(i, x, a.num_heads));
        let h = layer.input_layernorm.forward(x);
        let mut attn = self.attention(a, &h, ctx, kv);
        if let Some(obs) = run.as_deref_mut().and_then(|r| r.observer.as_mut()) {
            obs.observe_heads(i, &attn.view([b, t, a.num_heads, a.head_dim]));
        }
        if let Some(hm) = masks.as_ref().and_then(|m| m.heads.as_ref()) {
            attn = (attn.view([b, t, a.num_heads, a.head_dim]) * hm.unsqueeze(-1).to_kind(attn.kind())).view([b, t, a.num_heads * a.head_dim]);
        }
        let mut attn_out = a.o_proj.forward(&attn);
        if let Some(m) = masks.as_ref().and_then(|m| m.attention_out.as_ref()) {
            attn_out = attn_out * m.to_kind(x.kind());
        }
        let x1 = x + attn_out;
        if let (Some(r), Some(m)) = (run.as_deref_mut(), masks.as_mut()) {
            r.ffn_masks(i, &x1, layer.mlp.gate_proj.weight.size()[0], m);
        }
        let h2 = layer.post_attention_layernorm.forward(&x1);
        let mut hidden = layer.mlp.hidden(&h2);
        if let Some(obs) = run.as_deref_mut().and_then(|r| r.observer.as_mut()) {
            obs.observe_channels(i, &hidden);
        }
        if let Some(cm) = masks.as_ref().and_then(|m| m.channels.as_ref()) {
            hidden = hidden * cm.to_kind(x.kind());
        }
        let mut ffn_out = layer.mlp.down_proj.forward(&hidden);
        if let Some(m) = masks.as_ref().and_then(|m| m.ffn_out.as_ref()) {
            ffn_out = ffn_out * m.to_kind(x.kind());
        }
        let x2 = &x1 + ffn_out;
        match masks.as_ref().and_then(|m| m.layer.as_ref()) {
            // Skipping the layer keeps the residual exactly (x + 0 * update).
            Some(lm) => x + lm.to_kind(x.kind()) * (x2 - x),
            None => x2,
        }
    }

    /// Attention outputs before `o_proj`: `[B, T, heads * head_dim]`.
    fn attention(&self, a: &Attention, x: &Tensor, ctx: &AttnContext, kv: Option<(&Tensor, &Tensor)>) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (nh, nkv, hd) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let mut q = a.q_proj.forward(x).view([b, t, nh, hd]);
        let mut k = a.k_proj.forward(x).view([b, t, nkv, hd]);
        let v = a.v_proj.forward(x).view([b, t, nkv, hd]).transpose(1, 2);
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            q = qn.forward(&q);
            k = kn.forward(&k);
        }
        let q = rope::apply(&q.transpose(1, 2), &ctx.cos, &ctx.sin);
        let k = rope::apply(&k.transpose(1, 2), &ctx.cos, &ctx.sin);
        let (keys, values) = match (kv, &ctx.slots) {
            (Some((kc, vc)), Some(slots)) => {
                let _ = kc.shallow_clone().index_copy_(2, slots, &k);
                let _ = vc.shallow_clone().index_copy_(2, slots, &v);
                (kc.narrow(2, 0, ctx.kv_len), vc.narrow(2, 0, ctx.kv_len))
            }
            _ => (k, v),
        };
        let out = if ctx.causal_fast {
            Tensor::scaled_dot_product_attention(&q, &keys, &values, None::<Tensor>, 0.0, true, None, nkv != nh)
        } else {
            let mask = &ctx.masks[&a.window];
            grouped_attention(&q, &keys, &values, mask, nkv)
        };
        out.transpose(1, 2).reshape([b, t, nh * hd])
    }
}

/// Masked attention with grouped K/V, without materialising repeated K/V: the query heads
/// that share a KV head are folded into the query-length dimension.
/// `q: [B, H, T, D]`, `k, v: [B, KV, S, D]`, `mask: [B, 1, T, S]` -> `[B, H, T, D]`.
pub fn grouped_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, nkv: i64) -> Tensor {
    let (b, h, t, d) = q.size4().unwrap();
    let g = h / nkv;
    let s = k.size()[2];
    if g == 1 {
        return Tensor::scaled_dot_product_attention(q, k, v, Some(mask), 0.0, false, None, false);
    }
    let qf = q.reshape([b, nkv, g * t, d]);
    let mf = if t == 1 { mask.shallow_clone() } else { mask.unsqueeze(2).expand([b, 1, g, t, s], false).reshape([b, 1, g * t, s]) };
    Tensor::scaled_dot_product_attention(&qf, k, v, Some(&mf), 0.0, false, None, false).reshape([b, h, t, d])
}
