//! Routed inference: the path that turns routing into wall-clock gains, for prefill and decode.
//!
//! [`Engine`] runs a [`LlamaModel`] (dense, or with the routers of any [`Variant`]) with
//! - fused projections: at construction q/k/v and gate/up weights are concatenated into one
//!   matrix each, and the model's own weights become views of them (no second copy);
//! - routers evaluated once per layer and sublayer; each decision becomes one routing layout
//!   shared by the ops that use it (Q + attention + O; gate/up + down);
//! - fused element-wise kernels (residual add + RMSNorm, RoPE + KV-cache write, SwiGLU + mask);
//! - the routed kernels of `wide-kernels` where the dispatch policy says they pay (decode-size
//!   GEMVs), dense cuBLAS elsewhere, with skipped outputs exactly zero either way;
//! - K/V written for every token (the cache is always complete);
//! - batched prefill of right-padded prompts (causal attention alone keeps padding out of every
//!   real token's view) and batched decode whose step needs no host value, so it can be
//!   captured in a CUDA graph ([`Decoder`]); greedy and sampled generation.
//!
//! The training path ([`LlamaModel::forward_routed`]) and this path compute the same function
//! for the same masks (tests compare them on CPU and GPU).
use crate::generate::{pick_tokens, Emitted, SamplingConfig};
use crate::model::{grouped_attention, LlamaModel};
use crate::rope::inverse_frequencies;
use crate::routing::{RouterKind, Routing, Variant};
use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, SeedableRng};
use std::cell::RefCell;
use std::collections::BTreeMap;
use tch::{Device, Kind, Tensor};
use wide_kernels::ops::dispatch::{choose, GemmPath, GemmShape, RoutedOp, GEMV_MAX_M, LARGE_M_MIN};
use wide_kernels::ops::fused::{self, QkvShape, RouterWeights};
use wide_kernels::ops::gemm::{choose_path, fold_rank_ok, gemm_k_fold_router, RouterFold};
use wide_kernels::{route_layout, routed_gemm, RouteLayout};

/// Whether a decode step's attention (routed or dense) takes the new token's RoPE and cache write
/// into its own launch (`attention_decode_step_rope`): `WIDE_DECODE_ROPE=0|1|routed` forces it
/// off / on / on for routed attention only; by default both.
fn decode_rope_fused(routed: bool) -> bool {
    let (dense, rt) = wide_kernels::ops::attention::decode_rope_knob().unwrap_or((true, true));
    if routed {
        rt
    } else {
        dense
    }
}

/// One layer's fused projection weights (the model's q/k/v and gate/up weights are views).
pub struct FusedLayer {
    /// `[q_heads * head_dim + 2 * kv_heads * head_dim, hidden]`.
    pub qkv: Tensor,
    pub qkv_bias: Option<Tensor>,
    /// `[2 * intermediate, hidden]`: gate rows, then up rows.
    pub gate_up: Tensor,
    pub gate_up_bias: Option<Tensor>,
}

/// Concatenates q/k/v and gate/up of every layer, then points the model's weights at views of
/// the fused matrices, so the old storage is freed (one layer's extra memory at a time) and the
/// training path keeps working on the same numbers. Refuses models with LoRA attached (merge
/// it first: [`crate::lora::Lora::merge`]).
pub fn fuse_projections(model: &LlamaModel) -> Result<Vec<FusedLayer>> {
    let _g = tch::no_grad_guard();
    let mut out = Vec::with_capacity(model.layers.len());
    for (i, l) in model.layers.iter().enumerate() {
        let a = &l.self_attn;
        let f = &l.mlp;
        for lin in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &f.gate_proj, &f.up_proj, &f.down_proj] {
            ensure!(lin.lora.is_none(), "layer {i} has a LoRA adapter attached: merge LoRA into the weights before building the inference engine");
        }
        let qkv = fuse(&[&a.q_proj.weight, &a.k_proj.weight, &a.v_proj.weight])?;
        let qkv_bias = match (&a.q_proj.bias, &a.k_proj.bias, &a.v_proj.bias) {
            (Some(q), Some(k), Some(v)) => Some(fuse(&[q, k, v])?),
            _ => None,
        };
        let gate_up = fuse(&[&f.gate_proj.weight, &f.up_proj.weight])?;
        let gate_up_bias = match (&f.gate_proj.bias, &f.up_proj.bias) {
            (Some(g), Some(u)) => Some(fuse(&[g, u])?),
            _ => None,
        };
        out.push(FusedLayer { qkv, qkv_bias, gate_up, gate_up_bias });
    }
    Ok(out)
}

/// One tensor holding `parts` back to back along dim 0; each part becomes a view of it (the
/// parts' old storage is freed once nothing else holds it). Parts that already are consecutive
/// row blocks of one storage (an earlier engine on the same model fused them) are returned as
/// that tensor without a copy, so several engines on one model share one set of fused weights.
fn fuse(parts: &[&Tensor]) -> Result<Tensor> {
    if let Some(fused) = already_fused(parts) {
        return Ok(fused);
    }
    let fused = Tensor::cat(parts, 0);
    let mut off = 0;
    for p in parts {
        let r = p.size()[0];
        let mut h = p.shallow_clone();
        h.set_data(&fused.narrow(0, off, r));
        off += r;
    }
    Ok(fused)
}

/// `parts` as one tensor over their shared storage when they are contiguous, of one dtype and
/// device and trailing shape, and each starts where the one before ends; `None` otherwise. Two
/// tensors that merely sit next to each other in memory (separate allocations of the caching
/// allocator) fail the view's bounds check against the first part's storage, so they are
/// copied as before.
fn already_fused(parts: &[&Tensor]) -> Option<Tensor> {
    let first = parts.first()?;
    let size = first.size();
    if size.is_empty() {
        return None;
    }
    let row: i64 = size[1..].iter().product();
    let elt = first.kind().elt_size_in_bytes() as i64;
    let mut rows = 0;
    for p in parts {
        let s = p.size();
        if s.len() != size.len() || !p.is_contiguous() || p.kind() != first.kind() || p.device() != first.device() || s[1..] != size[1..] {
            return None;
        }
        if p.data_ptr() as i64 != first.data_ptr() as i64 + rows * row * elt {
            return None;
        }
        rows += s[0];
    }
    let mut shape = size.clone();
    shape[0] = rows;
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len() - 1).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    first.f_as_strided(shape.as_slice(), strides.as_slice(), None).ok()
}

/// Per-op device times (ms) of a profiled run, summed by op name, and the host time (ms) each
/// op took to queue its work (what bounds a short prefill: the GPU cannot run ahead of it).
#[derive(Debug, Default, Clone)]
pub struct Profile {
    pub ms: BTreeMap<String, f64>,
    pub host_ms: BTreeMap<String, f64>,
    pub calls: BTreeMap<String, u64>,
}

/// Where the execute masks come from.
pub enum MaskSource {
    /// The model's routers (deterministic gates with the engine's offsets).
    Routers,
    /// Given masks `[B, T, groups]`, one per router call in the training path's call order
    /// (per layer: layer router, attention router, FFN router).
    Forced(Vec<Tensor>),
}

/// Skip counts per router kind: (skipped (token, group) pairs, valid tokens x groups).
#[derive(Debug, Default, Clone)]
pub struct SkipCounts {
    pub per_kind: BTreeMap<String, (f64, f64)>,
}

impl SkipCounts {
    pub fn rate(&self, kind: &str) -> Option<f64> {
        self.per_kind.get(kind).map(|(s, t)| if *t > 0.0 { s / t } else { 0.0 })
    }
}

/// How one forward handles routing.
struct RouteCtx<'a> {
    source: &'a mut MaskSource,
    cursor: usize,
    /// `[M]` bool, real tokens (padding runs no group).
    valid: Option<Tensor>,
    /// Device accumulators of skipped pairs and totals per kind (no host read inside a step).
    counts: Option<&'a mut BTreeMap<RouterKind, (Tensor, Tensor)>>,
    /// Fit per-layer offsets so each router skips this share of the valid tokens' groups.
    fit: Option<f64>,
    /// The next router's decision, computed by the norm launch that produced its input or by
    /// the projection before that norm (folded).
    gated: Option<Gated>,
    /// Whether the last decision `gate` returned came from a folded router.
    early: bool,
}

/// A router decision made ahead of its gate call.
struct Gated {
    kind: RouterKind,
    /// Always-on groups of the extended mask.
    extra: i64,
    mask: Tensor,
    ext: Option<Tensor>,
    /// Made by a router folded into the projection before the norm launch: the mask is written
    /// two launches before the projection that first reads it.
    early: bool,
}

/// An attention or FFN decision for the tokens of one forward.
struct Decision {
    /// `[M, groups]` bool.
    mask: Tensor,
    /// See [`Gated::early`].
    early: bool,
    /// Query heads (attention) or channels (FFN) per group.
    group: i64,
    /// Built on first use and shared by the ops of this decision.
    layout: std::cell::OnceCell<RouteLayout>,
}

/// A preallocated KV cache for the engine: per layer `[B, kv_heads, capacity, head_dim]`; row b
/// holds its tokens at slots 0..len_b (rows are right-padded, so each row's slots are its
/// positions).
pub struct EngineCache {
    pub keys: Vec<Tensor>,
    pub values: Vec<Tensor>,
    pub capacity: i64,
    pub batch: i64,
}

impl EngineCache {
    pub fn new(model: &LlamaModel, batch: i64, capacity: i64) -> Self {
        let c = &model.config;
        let shape = [batch, c.num_key_value_heads, capacity, c.head_dim];
        let n = c.num_hidden_layers as usize;
        let opts = (model.kind, model.device);
        Self {
            keys: (0..n).map(|_| Tensor::zeros(shape, opts)).collect(),
            values: (0..n).map(|_| Tensor::zeros(shape, opts)).collect(),
            capacity,
            batch,
        }
    }
}

/// The routed (or dense) inference engine over a model.
pub struct Engine<'m> {
    pub model: &'m LlamaModel,
    pub routing: Option<&'m Routing>,
    pub fused: Vec<FusedLayer>,
    /// Inference logit offsets per layer: (attention, FFN, layer); from the manifest's
    /// per-kind offsets, a search ([`Engine::search_offsets`]) or a per-layer fit.
    offsets: RefCell<Vec<[f64; 3]>>,
    /// Expected skip rate per kind (attention, FFN) for the dispatch policy, so that it need
    /// not read the masks back (no host synchronisation inside a step).
    pub sparsity_hint: [f64; 2],
    /// Per-op device times while profiling (synchronises around every op: measurement only).
    profile: RefCell<Option<Profile>>,
    inv_freq: Tensor,
    scale: f64,
    ones: RefCell<BTreeMap<i64, Tensor>>,
    /// Whether the dispatch ran the fused Q|K|V routed, per (tokens, skip-rate hint in 64ths,
    /// heads a group): a known "no" skips building the extended mask on later layers and prefills.
    qkv_routed: RefCell<BTreeMap<(i64, i64, i64), bool>>,
    /// Ops run twice (see [`Engine::set_repeat`]).
    repeat: RefCell<std::collections::BTreeSet<String>>,
    /// Per layer, the attention router's first layer times the previous layer's down weight
    /// and the FFN router's times this layer's O weight (`[rank, in_features]`): the router
    /// folded into the projection whose output its input adds ([`gemm_k_fold_router`]).
    folds: Vec<[Option<Tensor>; 2]>,
    /// f32 zeros `[rank + 1]` per router rank: the folded routers' partial sums and counter.
    fold_scratch: BTreeMap<i64, Tensor>,
    /// Router decisions made by folded routers so far (host count of launches issued).
    fold_calls: std::cell::Cell<u64>,
    /// Measurement only (`WIDE_STEP_READS`, see [`parse_step_reads`]): one-token projections
    /// replaced by a pure read of their weight bytes, this many blocks a multiprocessor.
    step_reads: Option<u32>,
    /// Measurement only (`WIDE_FIXED_MASKS`, see [`parse_fixed_masks`]): one-token decisions
    /// come from fixed masks made once, no router runs.
    fixed_masks: bool,
    /// Those masks per (layer, kind index, extra groups): `[1, groups]` and the extended mask.
    fixed: RefCell<BTreeMap<(usize, usize, i64), (Tensor, Option<Tensor>)>>,
}

/// Residual add + RMSNorm in the layers: with a delta (the projection just before) the residual
/// x is the output of an earlier norm, two or more launches old, so the kernel may load it before
/// waiting for that projection; without one (the first layer's input) x is the embedding, just
/// written.
fn plain_norm(x: &Tensor, delta: Option<&Tensor>, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    match delta {
        Some(_) => fused::add_rmsnorm_settled(x, delta, w, eps),
        None => fused::add_rmsnorm(x, delta, w, eps),
    }
}

/// Which routers one-token decode folds into the projection before them (the mask then exists
/// a launch earlier, and the next projection loads weights before its wait like a dense one):
/// `[attention (into the previous layer's down), FFN (into O)]`. By default the FFN router only:
/// on an H100 the attention router folded into down cost the decode step 0.02-0.03 ms more than
/// it saved Q|K|V (`wide-kernels/NOTES.md` v42). `WIDE_ROUTER_FOLD` (an A/B knob): `ffn` (the
/// default), `both` (or `1`), `attention`, `none` (or `0`: the routers run in the norm launch);
/// any other value is an error.
pub const DEFAULT_ROUTER_FOLDS: [bool; 2] = [false, true];

fn router_fold_kinds() -> Result<[bool; 2]> {
    parse_router_fold(std::env::var("WIDE_ROUTER_FOLD").ok().as_deref())
}

fn parse_router_fold(v: Option<&str>) -> Result<[bool; 2]> {
    Ok(match v.map(str::trim) {
        None | Some("") | Some("ffn") => DEFAULT_ROUTER_FOLDS,
        Some("1") | Some("both") => [true, true],
        Some("0") | Some("none") => [false, false],
        Some("attention") => [true, false],
        Some(o) => bail!("WIDE_ROUTER_FOLD={o} is not a fold setting: use ffn (the default), both (or 1), attention or none (or 0)"),
    })
}

/// `WIDE_STEP_READS=B` (measurement only, B = 1..8 blocks a multiprocessor; unset or 0 off): every
/// one-token projection (Q|K|V, O, gate+up, down) is replaced by a launch that only reads the
/// weight bytes it would read (all of them dense; at the engine's expected skip rate, the used
/// share of the routed ones, K|V whole) and writes zeros ([`wide_kernels::ops::attention::
/// step_read`]); the routers then run in the norm launches (the projection a router would be
/// folded into does not run, so the engine's folds go unused). The decode
/// step's time is then what the step takes with every projection at the speed of one pure-read
/// kernel on its bytes, everything else (norms, routers, attention, the LM head) as it is: dense
/// against routed at equal read speed, in one process. Not a bound: dense's own GEMVs beat that
/// kernel in the step (`wide-kernels/NOTES.md` v43; the bound is `wide bench e2e --kept-width`).
/// The outputs are not the model's (zeros from every projection).
fn parse_step_reads(v: Option<&str>) -> Result<Option<u32>> {
    match v.map(str::trim) {
        None | Some("") | Some("0") => Ok(None),
        Some(b) => match b.parse::<u32>() {
            Ok(n @ 1..=8) => Ok(Some(n)),
            _ => bail!("WIDE_STEP_READS={b} is not a block count: use 1 to 8 blocks a multiprocessor (a measurement that replaces the one-token projections by pure reads), or 0 / unset for the model"),
        },
    }
}

/// `WIDE_FIXED_MASKS=1` (measurement only; unset or 0 off): at one-token decode every attention
/// and FFN router's decision is a fixed mask made once per layer and router (the engine's
/// expected skip rate of that router kind, rounded to whole groups, a pseudo-random choice of
/// groups per layer, [`fixed_skip_pattern`]); no router runs, nothing is folded, and every mask
/// is settled (written long before the projections that read it). The decode step's time is
/// then what the routed kernels cost with routing itself free: between `wide` (the routers as
/// they run) and `--kept-width` (dense kernels on the kept width). The outputs are not the
/// model's (its routers are not consulted).
fn parse_fixed_masks(v: Option<&str>) -> Result<bool> {
    match wide_kernels::knobs::switch_from("WIDE_FIXED_MASKS", v) {
        Ok(b) => Ok(b.unwrap_or(false)),
        Err(_) => bail!("WIDE_FIXED_MASKS={} is not a switch: use 1 (one-token decisions from fixed masks, no router runs: a measurement) or 0 / unset for the routers", v.unwrap_or_default().trim()),
    }
}

/// The execute mask of [`parse_fixed_masks`]'s fixed decisions: `groups` entries, exactly
/// `round(skip * groups)` of them false, which ones a deterministic pseudo-random choice per
/// `seed` (layer and router kind), so that layers differ as routed layers do.
fn fixed_skip_pattern(groups: usize, skip: f64, seed: u64) -> Vec<bool> {
    let n_skip = ((skip.clamp(0.0, 1.0) * groups as f64).round() as usize).min(groups);
    let mut order: Vec<usize> = (0..groups).collect();
    // Fisher-Yates with a splitmix64 stream.
    let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(0x2545_f491_4f6c_dd1d);
    let mut next = || {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    };
    for i in (1..groups).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let mut on = vec![true; groups];
    for &g in &order[..n_skip] {
        on[g] = false;
    }
    on
}

/// `w1 w` for each router whose input adds a bias-free projection's output (see
/// [`Engine::folds`]): on CUDA in bf16/f16 (cuBLAS, fp32 accumulation, one rounding), where the
/// decode kernels can use them; none elsewhere.
fn router_folds(model: &LlamaModel, routing: Option<&Routing>, [fold_attn, fold_ffn]: [bool; 2]) -> Vec<[Option<Tensor>; 2]> {
    let n = model.layers.len();
    let mut out: Vec<[Option<Tensor>; 2]> = (0..n).map(|_| [None, None]).collect();
    let Some(r) = routing else { return out };
    let fast = matches!(model.device, Device::Cuda(_)) && matches!(model.kind, Kind::BFloat16 | Kind::Half);
    if !fast {
        return out;
    }
    let _g = tch::no_grad_guard();
    let fold = |rt: &crate::routing::Router, w: &Tensor| -> Option<Tensor> {
        (fold_rank_ok(rt.compressor_w.size()[0]) && rt.compressor_w.kind() == w.kind()).then(|| rt.compressor_w.matmul(w).contiguous())
    };
    for (i, l) in r.layers.iter().enumerate() {
        if let (Some(a), true) = (&l.attention, i > 0 && fold_attn) {
            let down = &model.layers[i - 1].mlp.down_proj;
            if down.bias.is_none() {
                out[i][0] = fold(a, &down.weight);
            }
        }
        if let (Some(f), true) = (&l.ffn, fold_ffn) {
            let o = &model.layers[i].self_attn.o_proj;
            if o.bias.is_none() {
                out[i][1] = fold(f, &o.weight);
            }
        }
    }
    out
}

/// The ops [`Engine::set_repeat`] can run twice: each recomputes its outputs from inputs it
/// does not change (the router decisions are made in `norm`, or in `o_proj` / `down` where a
/// router is folded into them, from inputs they do not change; the cache writes of `rope_kv`
/// write the same values again).
pub const REPEATABLE_OPS: [&str; 9] = ["embed", "norm", "qkv", "rope_kv", "attention", "o_proj", "gate_up", "down", "lm_head"];

fn kind_index(k: RouterKind) -> usize {
    match k {
        RouterKind::Attention => 0,
        RouterKind::Ffn => 1,
        RouterKind::Layer => 2,
    }
}

fn add_counts(c: &mut SkipCounts, dev: &BTreeMap<RouterKind, (Tensor, Tensor)>) {
    for (k, (s, t)) in dev {
        let e = c.per_kind.entry(k.name().to_string()).or_insert((0.0, 0.0));
        e.0 += s.double_value(&[]);
        e.1 += t.double_value(&[]);
    }
}

fn is_fast_dtype(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cuda(_)) && matches!(t.kind(), Kind::BFloat16 | Kind::Half)
}

/// Whether the fused Q|K|V of these tokens may run on the routed GEMV, the one consumer of the
/// attention mask extended with always-on K|V groups (the norm launch, the gate and the
/// attention decision must agree on it).
fn qkv_on_gemv(x: &Tensor) -> bool {
    x.size()[0] <= GEMV_MAX_M && is_fast_dtype(x)
}

/// Prefill sizes on CUDA, where `large_m_qkv_path` asks the dispatch about a routed Q|K|V.
fn qkv_large_m(x: &Tensor) -> bool {
    x.size()[0] >= LARGE_M_MIN && is_fast_dtype(x) && matches!(x.device(), Device::Cuda(_))
}

/// Whether the fused Q|K|V may run as one routed launch on the extended mask (on the GEMV or at
/// prefill sizes): the gate kernel then writes the extended mask beside the mask, saving the
/// concatenation's launches.
fn qkv_wants_ext(x: &Tensor) -> bool {
    qkv_on_gemv(x) || qkv_large_m(x)
}

/// Up to this many tokens the norm launch also runs the router and its gate (one launch instead
/// of the norm, cuBLAS's first layer and the gate kernel); `WIDE_ROUTER_FUSE_MAX_M=N` moves the
/// bound (a measurement knob). Above it the per-token router blocks would each read all of W1.
fn router_fuse_max_m() -> i64 {
    static V: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *V.get_or_init(|| wide_kernels::knobs::int("WIDE_ROUTER_FUSE_MAX_M", 0..=i64::MAX, "tokens").unwrap_or(64))
}

/// Up to this many tokens, dense projections run on the project's GEMV kernels (every group on)
/// rather than cuBLAS: with programmatic dependent launch they overlap the launch before them.
const DENSE_GEMV_MAX_M: i64 = 1;

/// Whether dense projections of `m` tokens take the GEMV kernels: `WIDE_DENSE_GEMV=0` never,
/// `=1` up to `GEMV_MAX_M` tokens, unset up to `DENSE_GEMV_MAX_M` (read once).
fn dense_gemv_enabled(m: i64) -> bool {
    static V: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    match *V.get_or_init(|| wide_kernels::knobs::switch("WIDE_DENSE_GEMV")) {
        Some(false) => false,
        Some(true) => m <= GEMV_MAX_M,
        None => m <= DENSE_GEMV_MAX_M,
    }
}

impl<'m> Engine<'m> {
    /// Fuses the model's projections and prepares the engine; `routing` = None (or the
    /// `dense` variant) runs dense. On CUDA the folded routers (`W1 W` of each folded router and the
    /// O / down weight before it, see [`gemm_k_fold_router`]) are computed here, so the routers'
    /// and projections' weights must not change while the engine is in use (offsets may).
    pub fn new(model: &'m LlamaModel, routing: Option<&'m Routing>) -> Result<Self> {
        Self::with_router_folds(model, routing, router_fold_kinds()?)
    }

    /// [`Engine::new`] with the routers folded at one-token decode chosen here
    /// (`[attention, FFN]`, see [`DEFAULT_ROUTER_FOLDS`]) instead of by `WIDE_ROUTER_FOLD`.
    pub fn with_router_folds(model: &'m LlamaModel, routing: Option<&'m Routing>, folds: [bool; 2]) -> Result<Self> {
        let fused = fuse_projections(model)?;
        let c = &model.config;
        let routing = routing.filter(|r| r.config.variant != Variant::Dense);
        if let Some(r) = routing {
            ensure!(r.layers.len() == model.layers.len(), "routing has {} layers, the model {}", r.layers.len(), model.layers.len());
        }
        let per_kind = routing.map(|r| [r.config.attn_logit_offset, r.config.ffn_logit_offset, r.config.layer_logit_offset]).unwrap_or([0.0; 3]);
        let target = routing.map(|r| r.config.shared_target()).unwrap_or(0.0);
        let (ta, tf) = routing.and_then(|r| r.config.per_type_targets()).unwrap_or((target, target));
        let inv_freq = Tensor::from_slice(&inverse_frequencies(c)).to_device(model.device);
        let step_reads = parse_step_reads(std::env::var("WIDE_STEP_READS").ok().as_deref())?;
        let fixed_masks = parse_fixed_masks(std::env::var("WIDE_FIXED_MASKS").ok().as_deref())?;
        let folds = router_folds(model, routing, folds);
        let fold_scratch = folds.iter().flatten().flatten().map(|f| f.size()[0]).map(|r| (r, Tensor::zeros([r + 1], (Kind::Float, model.device)))).collect();
        Ok(Self {
            model,
            routing,
            fused,
            offsets: RefCell::new(vec![per_kind; c.num_hidden_layers as usize]),
            sparsity_hint: [ta, tf],
            profile: RefCell::new(None),
            inv_freq,
            scale: 1.0 / (c.head_dim as f64).sqrt(),
            ones: RefCell::new(BTreeMap::new()),
            qkv_routed: RefCell::new(BTreeMap::new()),
            repeat: RefCell::new(Default::default()),
            folds,
            fold_scratch,
            fold_calls: Default::default(),
            step_reads,
            fixed_masks,
            fixed: Default::default(),
        })
    }

    /// Measurement only: replaces every one-token projection by a pure read of its weight bytes
    /// (`blocks_per_sm` blocks a multiprocessor, 1 to 8; None restores the model), as
    /// `WIDE_STEP_READS` does at construction (the README's `WIDE_STEP_READS`). Only the decode step of
    /// one sequence changes; its projections then output zeros.
    pub fn set_step_reads(&mut self, blocks_per_sm: Option<u32>) -> Result<()> {
        ensure!(blocks_per_sm.is_none_or(|b| (1..=8).contains(&b)), "step reads take 1 to 8 blocks a multiprocessor, not {blocks_per_sm:?}");
        self.step_reads = blocks_per_sm;
        Ok(())
    }

    /// Measurement only: one-token decisions from fixed masks, no router running (true), or the
    /// routers (false), as `WIDE_FIXED_MASKS` does at construction (the README's `WIDE_FIXED_MASKS`).
    pub fn set_fixed_masks(&mut self, on: bool) {
        self.fixed_masks = on;
    }

    /// Whether this forward's decisions come from [`parse_fixed_masks`]'s fixed masks.
    fn fixed_applies(&self, mt: i64, rc: &RouteCtx) -> bool {
        self.fixed_masks && mt == 1 && rc.fit.is_none() && rc.valid.is_none() && matches!(rc.source, MaskSource::Routers)
    }

    /// The fixed decision of router `kind` of layer `i` (`groups` groups, `extra` always-on
    /// groups in the extended mask), made on its first call and reused. The extended mask is
    /// cached too rather than built by [`Engine::gate`]'s shared tail: a concatenation there
    /// would be a launch just before Q|K|V, so the mask would not be settled as claimed.
    fn fixed_mask(&self, i: usize, kind: RouterKind, groups: i64, extra: i64) -> (Tensor, Option<Tensor>) {
        let k = kind_index(kind);
        let mut cache = self.fixed.borrow_mut();
        let (m, e) = cache.entry((i, k, extra)).or_insert_with(|| {
            let on = fixed_skip_pattern(groups as usize, self.sparsity_hint[k], ((i as u64) << 2) | k as u64);
            let mask = Tensor::from_slice(&on).view([1, groups]).to_device(self.model.device);
            let ext = (extra > 0).then(|| Tensor::cat(&[&mask, &Tensor::ones([1, extra], (Kind::Bool, self.model.device))], 1));
            (mask, ext)
        });
        (m.shallow_clone(), e.as_ref().map(|e| e.shallow_clone()))
    }

    pub fn is_routed(&self) -> bool {
        self.routing.is_some()
    }

    /// Router decisions made so far by routers folded into the projection before them
    /// (one-token decode on CUDA; see [`gemm_k_fold_router`]).
    pub fn folded_router_calls(&self) -> u64 {
        self.fold_calls.get()
    }

    /// One logit offset per router kind in every layer (the manifest's form).
    pub fn set_offsets(&self, attention: f64, ffn: f64, layer: f64) {
        for o in self.offsets.borrow_mut().iter_mut() {
            *o = [attention, ffn, layer];
        }
    }

    /// Sets every layer's offsets (attention, FFN, layer), e.g. from [`Engine::offsets`] of an
    /// earlier engine on the same routers.
    pub fn set_offsets_per_layer(&self, offsets: &[[f64; 3]]) -> Result<()> {
        let mut o = self.offsets.borrow_mut();
        ensure!(offsets.len() == o.len(), "{} offsets given for {} layers", offsets.len(), o.len());
        o.copy_from_slice(offsets);
        Ok(())
    }

    /// The offsets per layer: (attention, FFN, layer).
    pub fn offsets(&self) -> Vec<[f64; 3]> {
        self.offsets.borrow().clone()
    }

    /// Starts recording per-op device times (every op is then timed alone: slow).
    pub fn start_profile(&self) {
        *self.profile.borrow_mut() = Some(Profile::default());
    }

    /// Runs each op named in `ops` twice wherever it occurs (measurement only: the second run
    /// recomputes the same outputs, so a step's results do not change, and the step's extra time
    /// is that op's cost inside the captured step). Names: see [`REPEATABLE_OPS`].
    pub fn set_repeat(&self, ops: &[String]) -> Result<()> {
        for o in ops {
            ensure!(REPEATABLE_OPS.contains(&o.as_str()), "unknown op `{o}` to repeat: use one of {}", REPEATABLE_OPS.join(", "));
        }
        *self.repeat.borrow_mut() = ops.iter().cloned().collect();
        Ok(())
    }

    /// Stops recording and returns the per-op times.
    pub fn take_profile(&self) -> Profile {
        self.profile.borrow_mut().take().unwrap_or_default()
    }

    fn timed<T>(&self, name: &str, mut f: impl FnMut() -> Result<T>) -> Result<T> {
        if self.profile.borrow().is_none() {
            if self.repeat.borrow().contains(name) {
                let _ = f()?;
            }
            return f();
        }
        let (ms, host_ms);
        let out;
        if let Device::Cuda(d) = self.model.device {
            // A device spin first, so the host queues the op before the GPU reaches it and the
            // events time device work alone. It must outlast the op's host issue time (up to
            // ~0.1 ms for a routed prefill op on the H200 machine), else the GPU idles inside
            // the timed region and the op's device time reads as its host time.
            wide_kernels::ops::gpu_spin(d, 250)?;
            let timer = wide_kernels::GpuTimer::new(d)?;
            timer.start()?;
            let t = std::time::Instant::now();
            out = f()?;
            host_ms = t.elapsed().as_secs_f64() * 1e3;
            ms = timer.stop_ms()?;
        } else {
            let t = std::time::Instant::now();
            out = f()?;
            ms = t.elapsed().as_secs_f64() * 1e3;
            host_ms = ms;
        }
        if let Some(p) = self.profile.borrow_mut().as_mut() {
            *p.ms.entry(name.to_string()).or_default() += ms;
            *p.host_ms.entry(name.to_string()).or_default() += host_ms;
            *p.calls.entry(name.to_string()).or_default() += 1;
        }
        Ok(out)
    }

    /// The prefill's device inputs from the host lengths, made before any of its work is queued
    /// (the one host-to-device copy waits for the stream): the valid-token mask `[B * T]`, the
    /// positions `[B * T]` and each row's last real token's flat index `[B]`.
    fn prefill_inputs(&self, b: i64, t: i64, lengths: &[i64]) -> (Tensor, Tensor, Tensor) {
        let dev = self.model.device;
        let len_t = Tensor::from_slice(lengths).to_device(dev);
        let tpos = Tensor::arange(t, (Kind::Int64, dev));
        let valid = tpos.unsqueeze(0).lt_tensor(&len_t.unsqueeze(1)).view([b * t]);
        let pos = tpos.unsqueeze(0).expand([b, t], false).reshape([b * t]).to_kind(Kind::Int);
        let last = Tensor::arange(b, (Kind::Int64, dev)) * t + len_t - 1;
        (valid, pos, last)
    }

    /// Prefill of right-padded prompts `ids: [B, T]` with `lengths[b]` real tokens each, into
    /// `cache` (slots 0..T). Returns logits `[B, vocab]` at each row's last real token, or
    /// `[B, T, vocab]` with `all_logits`. Padding tokens run no routed group; their K/V slots
    /// are overwritten by the first decode steps and never attended to before.
    pub fn prefill(&self, ids: &Tensor, lengths: &[i64], cache: &EngineCache, masks: &mut MaskSource, counts: Option<&mut SkipCounts>, all_logits: bool) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let (b, t) = ids.size2()?;
        ensure!(lengths.len() as i64 == b, "prefill: {} lengths for a batch of {b}", lengths.len());
        ensure!(lengths.iter().all(|&l| l >= 1 && l <= t), "prefill: every length must be in 1..={t}, got {lengths:?}");
        ensure!(cache.batch == b && t <= cache.capacity, "prefill: cache for batch {} and {} slots cannot take [{b}, {t}]", cache.batch, cache.capacity);
        let dev = self.model.device;
        let (valid, pos, last) = self.prefill_inputs(b, t, lengths);
        let mut dev_counts = BTreeMap::new();
        let want_counts = counts.is_some();
        // Without padding every token is valid: no per-router AND with the valid rows.
        let valid = (!lengths.iter().all(|&l| l == t)).then_some(valid);
        let mut rc = RouteCtx { source: masks, cursor: 0, valid, counts: want_counts.then_some(&mut dev_counts), fit: None, gated: None, early: false };
        let hn = self.forward_tokens(&ids.to_device(dev), (b, t), &pos, None, cache, &mut rc)?;
        if let Some(c) = counts {
            add_counts(c, &dev_counts);
        }
        if all_logits {
            return Ok(self.timed("lm_head", || Ok(hn.linear::<Tensor>(&self.model.lm_head, None)))?.view([b, t, -1]));
        }
        let rows = hn.index_select(0, &last);
        self.timed("lm_head", || Ok(rows.linear::<Tensor>(&self.model.lm_head, None)))
    }

    /// Sets every router's offset, layer by layer during one prefill of `ids`, so that on these
    /// tokens each router skips `target` of its (valid token, group) pairs: the inference-time
    /// bias that gives a requested sparsity without retraining (random-weight routers differ in
    /// scale from layer to layer, so this fit is per layer).
    pub fn fit_offsets_per_layer(&mut self, ids: &Tensor, lengths: &[i64], target: f64) -> Result<SkipCounts> {
        ensure!((0.0..1.0).contains(&target), "sparsity must be in [0, 1), got {target}");
        let _g = tch::no_grad_guard();
        let (b, t) = ids.size2()?;
        let cache = EngineCache::new(self.model, b, t);
        let (valid, pos, _) = self.prefill_inputs(b, t, lengths);
        let mut src = MaskSource::Routers;
        let mut dev_counts = BTreeMap::new();
        let mut rc = RouteCtx { source: &mut src, cursor: 0, valid: Some(valid), counts: Some(&mut dev_counts), fit: Some(target), gated: None, early: false };
        let _ = self.forward_tokens(&ids.to_device(self.model.device), (b, t), &pos, None, &cache, &mut rc)?;
        let mut c = SkipCounts::default();
        add_counts(&mut c, &dev_counts);
        self.sparsity_hint = [target, target];
        Ok(c)
    }

    /// Searches one logit offset per router kind (the same in every layer, as the routing
    /// manifest stores them) so that a prefill of `ids` skips `target` of the groups of each
    /// router kind: bisection on the prompt itself, no training. Returns the achieved rates.
    pub fn search_offsets(&mut self, ids: &Tensor, lengths: &[i64], target: f64) -> Result<SkipCounts> {
        ensure!((0.0..1.0).contains(&target), "sparsity must be in [0, 1), got {target}");
        let Some(r) = self.routing else { bail!("--sparsity needs a routed model (a routing folder with trained routers)") };
        let kinds: Vec<RouterKind> = r.config.routers(&self.model.config).into_iter().map(|(k, _)| k).collect();
        ensure!(r.config.variant != Variant::StaticWidth && !kinds.is_empty(), "the {} variant has no routers whose offset could be searched", r.config.variant.name());
        let (b, t) = ids.size2()?;
        let cache = EngineCache::new(self.model, b, t);
        let mut lo = [-64.0f64; 3];
        let mut hi = [64.0f64; 3];
        let mut last = SkipCounts::default();
        for _ in 0..26 {
            let mid: Vec<f64> = (0..3).map(|k| 0.5 * (lo[k] + hi[k])).collect();
            self.set_offsets(mid[0], mid[1], mid[2]);
            let mut c = SkipCounts::default();
            let _ = self.prefill(ids, lengths, &cache, &mut MaskSource::Routers, Some(&mut c), false)?;
            for k in &kinds {
                let i = kind_index(*k);
                // A larger offset skips more.
                if c.rate(k.name()).unwrap_or(0.0) > target {
                    hi[i] = mid[i];
                } else {
                    lo[i] = mid[i];
                }
            }
            last = c;
        }
        self.sparsity_hint = [target, target];
        Ok(last)
    }

    /// The layers over `M = B * T` tokens (row-major `[B, T]`), positions `pos: [M]` i32. With
    /// `lengths` (decode, T = 1) attention reads the cache up to each row's length; otherwise
    /// it is causal over these T tokens (prefill from an empty cache). Returns the final-norm
    /// hidden states `[M, hidden]`.
    fn forward_tokens(&self, ids: &Tensor, (b, t): (i64, i64), pos: &Tensor, lengths: Option<&Tensor>, cache: &EngineCache, rc: &mut RouteCtx) -> Result<Tensor> {
        let m = self.model;
        let c = &m.config;
        let eps = c.rms_norm_eps;
        let mut x = self.timed("embed", || Ok(Tensor::embedding(&m.embed_tokens, &ids.reshape([b * t]), -1, false, false)))?;
        let mut delta: Option<Tensor> = None;
        let shape = QkvShape { batch: b, tokens: t, q_heads: c.num_attention_heads, kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
        for (i, layer) in m.layers.iter().enumerate() {
            let (xr, hn) = self.timed("norm", || self.norm_and_router(i, RouterKind::Attention, &x, delta.as_ref(), &layer.input_layernorm.weight, rc))?;
            x = xr;
            let (attn_d, q_ext, layer_mask) = self.timed("router", || self.attention_decision(i, &x, rc))?;
            let mut qkv = self.timed("qkv", || self.project_qkv(i, &hn, attn_d.as_ref(), q_ext.as_ref()))?;
            if let (Some(qn), Some(kn)) = (&layer.self_attn.q_norm, &layer.self_attn.k_norm) {
                let (nh, nkv, hd) = (shape.q_heads, shape.kv_heads, shape.head_dim);
                let v = qkv.view([b * t, nh + 2 * nkv, hd]);
                let q = qn.forward(&v.narrow(1, 0, nh));
                let k = kn.forward(&v.narrow(1, nh, nkv));
                qkv = Tensor::cat(&[&q, &k, &v.narrow(1, nh + nkv, nkv)], 1).view([b * t, -1]);
            }
            // SDPA's output follows q's layout: token-major q makes its [B, T, H * D] free. The
            // routed prefill kernels take q head-major (they would copy it); below the length
            // from which they may run, routed attention is SDPA + the zero pass too.
            let head_major = self.routed_prefill_attention(i, t, attn_d.as_ref(), &qkv) && wide_kernels::ops::attention::prefill_routed_possible(t);
            let token_major = lengths.is_none() && !head_major;
            let attn = match lengths {
                // A decode step on the kernel: RoPE and the cache write inside the attention launch.
                Some(len) if decode_rope_fused(attn_d.is_some()) && self.decode_kernel_ok(i, &qkv, cache) => self.timed("attention", || self.attention_decode_rope(i, &qkv, b, len, cache, attn_d.as_ref()))?,
                _ => {
                    let q = self.timed("rope_kv", || fused::rope_qkv_cache_settled(&qkv, pos, &self.inv_freq, &shape, &cache.keys[i], &cache.values[i], token_major))?;
                    self.timed("attention", || self.attention(i, &q, (b, t), lengths, cache, attn_d.as_ref()))?
                }
            };
            let next = (i, RouterKind::Ffn, &x);
            let o = self.timed("o_proj", || self.project_k(&attn, &layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias.as_ref(), attn_d.as_ref(), c.head_dim, 0, Some(next), rc))?;
            let (xr, h2) = self.timed("norm", || self.norm_and_router(i, RouterKind::Ffn, &x, Some(&o), &layer.post_attention_layernorm.weight, rc))?;
            x = xr;
            let mut layer_mask = layer_mask;
            let ffn_d = self.timed("router", || self.ffn_decision(i, &x, rc, layer_mask.take()))?;
            let hid = self.timed("gate_up", || self.project_gate_up(i, &h2, ffn_d.as_ref()))?;
            let next = (i + 1 < m.layers.len()).then_some((i + 1, RouterKind::Attention, &x));
            let down = self.timed("down", || self.project_k(&hid, &layer.mlp.down_proj.weight, layer.mlp.down_proj.bias.as_ref(), ffn_d.as_ref(), 1, 1, next, rc))?;
            delta = Some(down);
        }
        let (_, hn) = self.timed("norm", || plain_norm(&x, delta.as_ref(), &m.norm.weight, eps))?;
        Ok(hn)
    }

    /// Residual add + RMSNorm; for a few tokens whose next router (`kind`, of layer `i`) runs,
    /// the same launch also runs that router and its gate (the decision is left in `rc.gated`).
    fn norm_and_router(&self, i: usize, kind: RouterKind, x: &Tensor, delta: Option<&Tensor>, w: &Tensor, rc: &mut RouteCtx) -> Result<(Tensor, Tensor)> {
        let eps = self.model.config.rms_norm_eps;
        let layer = self.routing.map(|r| &r.layers[i]);
        let router = match kind {
            RouterKind::Attention => layer.and_then(|l| l.attention.as_ref()),
            RouterKind::Ffn => layer.and_then(|l| l.ffn.as_ref()),
            RouterKind::Layer => None,
        };
        let mt = x.size()[0];
        // The projection before this norm already ran this router (folded into it).
        let folded = rc.gated.as_ref().is_some_and(|g| g.kind == kind);
        let fuse = !folded && !self.fixed_applies(mt, rc) && rc.fit.is_none() && matches!(rc.source, MaskSource::Routers) && mt <= router_fuse_max_m() && is_fast_dtype(x);
        match router.filter(|_| fuse) {
            Some(r) => {
                // The extra always-on groups the attention gate will ask for (see attention_decision:
                // only where the fused Q|K|V runs on the routed GEMV).
                let extra = match kind {
                    RouterKind::Attention if rc.valid.is_none() && qkv_on_gemv(x) => self.q_extra(self.model.config.num_attention_heads / r.groups),
                    _ => 0,
                };
                let off = self.offsets.borrow()[i][kind_index(kind)];
                let w2 = RouterWeights { w1: &r.compressor_w, b1: &r.compressor_b, w2: &r.router_w, b2: &r.router_b };
                let g = fused::add_rmsnorm_router_gate(x, delta, w, eps, &w2, off, extra)?;
                rc.gated = Some(Gated { kind, extra, mask: g.mask, ext: g.ext, early: false });
                Ok((g.res, g.norm))
            }
            None => plain_norm(x, delta, w, eps),
        }
    }

    /// One router's execute mask `[M, groups]` (bool) for tokens `x: [M, hidden]`, and the
    /// extended mask with `extra` always-on groups (when the caller wants one).
    fn gate(&self, i: usize, kind: RouterKind, r: &crate::routing::Router, x: &Tensor, rc: &mut RouteCtx, extra: i64) -> Result<(Tensor, Option<Tensor>)> {
        let mt = x.size()[0];
        rc.early = false;
        if kind != RouterKind::Layer && self.fixed_applies(mt, rc) {
            let (mask, ext) = self.fixed_mask(i, kind, r.groups, extra);
            rc.early = true;
            self.count(kind, &mask, rc);
            return Ok((mask, ext));
        }
        let (mut mask, mut ext) = match rc.source {
            MaskSource::Forced(v) => {
                ensure!(rc.cursor < v.len(), "forced masks: only {} given, the forward needs more", v.len());
                let mk = v[rc.cursor].to_device(x.device()).reshape([mt, -1]).gt(0.5);
                rc.cursor += 1;
                ensure!(mk.size()[1] == r.groups, "forced mask {} has {} groups, router {} of layer {i} has {}", rc.cursor - 1, mk.size()[1], kind.name(), r.groups);
                (mk, None)
            }
            MaskSource::Routers => {
                let k = kind_index(kind);
                let w = RouterWeights { w1: &r.compressor_w, b1: &r.compressor_b, w2: &r.router_w, b2: &r.router_b };
                if let Some(target) = rc.fit {
                    let logits = x.linear(&r.compressor_w, Some(&r.compressor_b)).linear(&r.router_w, Some(&r.router_b)).to_kind(Kind::Float).view([mt, -1, 2]);
                    let diff = logits.select(-1, 1) - logits.select(-1, 0);
                    let sel = match &rc.valid {
                        Some(v) => diff.index_select(0, &v.nonzero().view([-1])),
                        None => diff,
                    };
                    let sorted = Vec::<f32>::try_from(sel.reshape([-1]).sort(0, false).0.to_device(Device::Cpu))?;
                    let n = sorted.len();
                    let skip = ((target * n as f64).round() as usize).min(n);
                    // Skip iff diff + offset > 0: put the threshold between the kept and the
                    // skipped values.
                    let off = if skip == 0 {
                        -(sorted[n - 1] as f64) - 1.0
                    } else if skip == n {
                        -(sorted[0] as f64) + 1.0
                    } else {
                        -0.5 * (sorted[n - skip - 1] as f64 + sorted[n - skip] as f64)
                    };
                    self.offsets.borrow_mut()[i][k] = off;
                }
                let off = self.offsets.borrow()[i][k];
                let extra = if rc.valid.is_none() { extra } else { 0 };
                // The norm launch ran this router and gate (not the layer router's).
                match rc.gated.take_if(|g| g.kind == kind && g.extra == extra) {
                    Some(g) => {
                        rc.early = g.early;
                        (g.mask, g.ext)
                    }
                    None => fused::router_gate(x, &w, off, extra)?,
                }
            }
        };
        if let Some(v) = &rc.valid {
            mask = mask.logical_and(&v.unsqueeze(1));
        }
        if extra > 0 && ext.is_none() {
            ext = Some(Tensor::cat(&[&mask, &Tensor::ones([mt, extra], (Kind::Bool, x.device()))], 1));
        }
        self.count(kind, &mask, rc);
        Ok((mask, ext))
    }

    fn count(&self, kind: RouterKind, mask: &Tensor, rc: &mut RouteCtx) {
        let Some(c) = rc.counts.as_mut() else { return };
        let g = mask.size()[1] as f64;
        let on = mask.sum(Kind::Float);
        let (skipped, total) = match &rc.valid {
            Some(v) => {
                let n = v.sum(Kind::Float);
                (&n * g - on, n * g)
            }
            None => {
                let n = Tensor::full([], mask.size()[0] as f64 * g, (Kind::Float, mask.device()));
                (&n - on, n)
            }
        };
        let dev = mask.device();
        let e = c.entry(kind).or_insert_with(|| (Tensor::zeros([], (Kind::Float, dev)), Tensor::zeros([], (Kind::Float, dev))));
        let _ = e.0.g_add_(&skipped);
        let _ = e.1.g_add_(&total);
    }

    fn static_mask(&self, kind: RouterKind, s: &Tensor, mt: i64, rc: &mut RouteCtx) -> Tensor {
        let g = s.size()[0];
        let mut m = s.gt(0.5).view([1, g]).expand([mt, g], false).contiguous();
        if let Some(v) = &rc.valid {
            m = m.logical_and(&v.unsqueeze(1));
        }
        self.count(kind, &m, rc);
        m
    }

    /// The attention decision of layer `i` (and the layer router's mask, for layer_skip).
    fn attention_decision(&self, i: usize, x: &Tensor, rc: &mut RouteCtx) -> Result<(Option<Decision>, Option<Tensor>, Option<Tensor>)> {
        let Some(r) = self.routing else { return Ok((None, None, None)) };
        let l = &r.layers[i];
        let c = &self.model.config;
        let nh = c.num_attention_heads;
        let mt = x.size()[0];
        let mut layer_mask = None;
        if let Some(lr) = &l.layer {
            layer_mask = Some(self.gate(i, RouterKind::Layer, lr, x, rc, 0)?.0);
        }
        let (mask, ext, early) = if let Some(ar) = &l.attention {
            let gh = nh / ar.groups;
            let extra = self.q_extra(gh);
            let want_ext = extra > 0 && qkv_wants_ext(x);
            let (mask, ext) = self.gate(i, RouterKind::Attention, ar, x, rc, if want_ext { extra } else { 0 })?;
            (mask, ext, rc.early)
        } else if let Some(s) = &l.static_attention {
            (self.static_mask(RouterKind::Attention, s, mt, rc), None, false)
        } else if let Some(lm) = &layer_mask {
            (lm.shallow_clone(), None, false)
        } else {
            return Ok((None, None, layer_mask));
        };
        let group = nh / mask.size()[1];
        let ext = match ext {
            Some(e) => Some(e),
            None if self.q_extra(group) > 0 && qkv_wants_ext(x) => {
                Some(Tensor::cat(&[&mask, &Tensor::ones([mt, self.q_extra(group)], (Kind::Bool, x.device()))], 1))
            }
            None => None,
        };
        Ok((Some(Decision { mask, early, group, layout: Default::default() }), ext, layer_mask))
    }

    /// Always-on groups appended to the attention mask so that one routed launch covers the
    /// fused Q|K|V projection (K and V rows form whole groups of Q's group width), or 0.
    fn q_extra(&self, group_heads: i64) -> i64 {
        let kv2 = 2 * self.model.config.num_key_value_heads;
        if group_heads > 0 && kv2 % group_heads == 0 {
            kv2 / group_heads
        } else {
            0
        }
    }

    fn ffn_decision(&self, i: usize, x: &Tensor, rc: &mut RouteCtx, layer_mask: Option<Tensor>) -> Result<Option<Decision>> {
        let Some(r) = self.routing else { return Ok(None) };
        let l = &r.layers[i];
        let inter = self.model.config.intermediate_size;
        let mt = x.size()[0];
        let (mask, early) = if let Some(fr) = &l.ffn {
            (self.gate(i, RouterKind::Ffn, fr, x, rc, 0)?.0, rc.early)
        } else if let Some(s) = &l.static_ffn {
            (self.static_mask(RouterKind::Ffn, s, mt, rc), false)
        } else if let Some(lm) = layer_mask {
            (lm, false)
        } else {
            return Ok(None);
        };
        let group = inter / mask.size()[1];
        Ok(Some(Decision { mask, early, group, layout: Default::default() }))
    }

    /// The small-M routed kernel (the GEMV, or the mma kernel for 2-16 tokens) the dispatch
    /// policy picks for this shape at the expected skip rate; None where it picks dense.
    fn small_m_path(&self, x: &Tensor, op: RoutedOp, n: i64, k: i64, group: i64, sparsity: f64) -> Option<GemmPath> {
        if !is_fast_dtype(x) || wide_kernels::ops::dispatch::env_override() == Some("dense") {
            return None;
        }
        let m = x.size()[0];
        if m > GEMV_MAX_M {
            return None;
        }
        match choose(&GemmShape { op, m, n, k, group }, sparsity, None) {
            p @ (GemmPath::Gemv | GemmPath::GemvMma) => Some(p),
            _ => None,
        }
    }

    /// At prefill sizes (at least `LARGE_M_MIN` tokens; decode batches keep cuBLAS), the routed
    /// kernel (Hopper wgmma or an mma.sync tile) the dispatch picks for the fused gate+up
    /// (`choose_path`: `WIDE_ROUTED`, else the autotuner's measurement against dense); None when
    /// it picks dense, since the engine's own dense path (one fused gate|up GEMM + the SwiGLU
    /// pass) is the faster fallback.
    fn large_m_routed_path(&self, h: &Tensor, g: &Tensor, u: &Tensor, d: &Decision) -> Result<Option<GemmPath>> {
        if h.size()[0] < LARGE_M_MIN || !is_fast_dtype(h) || !matches!(h.device(), Device::Cuda(_)) {
            return Ok(None);
        }
        Ok(match choose_path(RoutedOp::MnSwiglu, h, g, Some(u), self.layout(d, 1)?, d.group)? {
            p @ (GemmPath::Wgmma | GemmPath::Tiled(_)) => Some(p),
            _ => None,
        })
    }

    /// At prefill sizes, the fused Q|K|V projection as one routed launch (Q rows of skipped head
    /// groups not computed, the K|V groups always on) where the dispatch measures it faster than
    /// cuBLAS on the whole width; None otherwise (and where K|V are not whole groups of Q's width).
    fn large_m_qkv_path(&self, h: &Tensor, w: &Tensor, d: &Decision, ext: Option<&Tensor>) -> Result<Option<(RouteLayout, i64, GemmPath)>> {
        let (mt, extra) = (h.size()[0], self.q_extra(d.group));
        if !qkv_large_m(h) || extra == 0 {
            return Ok(None);
        }
        let key = (mt, (self.sparsity_hint[0] * 64.0).round() as i64, d.group);
        if self.qkv_routed.borrow().get(&key) == Some(&false) {
            return Ok(None);
        }
        let ng = d.mask.size()[1];
        let ext = match ext {
            Some(e) if e.size() == [mt, ng + extra] => e.shallow_clone(),
            _ => Tensor::cat(&[&d.mask, &Tensor::ones([mt, extra], (Kind::Bool, h.device()))], 1),
        };
        let sp = self.sparsity_hint[0] * ng as f64 / (ng + extra) as f64;
        let lay = route_layout(&ext)?.with_sparsity_hint(sp).with_always_on_from(ng)?;
        let group = d.group * self.model.config.head_dim;
        let path = match choose_path(RoutedOp::Mn, h, w, None, &lay, group)? {
            p @ (GemmPath::Wgmma | GemmPath::Tiled(_)) => Some((lay, group, p)),
            _ => None,
        };
        self.qkv_routed.borrow_mut().insert(key, path.is_some());
        Ok(path)
    }

    fn layout<'d>(&self, d: &'d Decision, kind: usize) -> Result<&'d RouteLayout> {
        if d.layout.get().is_none() {
            // The decision's mask comes from the gate, at least two launches before the gemm_k that
            // reads it (gate+up sits between the FFN gate and down; Q, RoPE and attention
            // between the attention gate and O), unless it still needs a copy here.
            let lay = route_layout(&d.mask)?.with_sparsity_hint(self.sparsity_hint[kind]);
            let lay = match (d.early, d.mask.is_contiguous()) {
                (true, true) => lay.with_early_mask(),
                (false, true) => lay.with_settled_mask(),
                (_, false) => lay,
            };
            let _ = d.layout.set(lay);
        }
        Ok(d.layout.get().unwrap())
    }

    /// With `WIDE_STEP_READS` and one token on CUDA (see [`parse_step_reads`]): a launch that reads
    /// the first `rows` rows of `w` (and, with `w2 = Some((u, r))`, the first `r` rows of `u`) and
    /// returns zeros `[1, n]`, in place of the projection whose weights they are; None otherwise.
    fn step_read(&self, x: &Tensor, w: &Tensor, rows: i64, w2: Option<(&Tensor, i64)>, n: i64) -> Result<Option<Tensor>> {
        let Some(bps) = self.step_reads else { return Ok(None) };
        if x.size()[0] != 1 || !x.device().is_cuda() {
            return Ok(None);
        }
        let row_bytes = |t: &Tensor| t.size()[1] * t.kind().elt_size_in_bytes() as i64;
        let (b, b_bytes) = w2.map_or((w, 0), |(u, r)| (u, r * row_bytes(u)));
        Ok(Some(wide_kernels::ops::attention::step_read(w, rows * row_bytes(w), b, b_bytes, (1, n), bps)?))
    }

    /// The rows of `n` a routed projection reads at the expected skip rate of `kind` (all of them
    /// dense), for [`Engine::step_read`].
    fn rows_read(&self, n: i64, d: Option<&Decision>, kind: usize) -> i64 {
        match d {
            Some(_) => ((1.0 - self.sparsity_hint[kind]) * n as f64).round() as i64,
            None => n,
        }
    }

    /// `[M, hidden] -> [M, (HQ + 2 HKV) D]`; with a routed GEMV, Q rows of skipped head groups
    /// are not read (their values are never used: attention zeroes those heads).
    fn project_qkv(&self, i: usize, h: &Tensor, d: Option<&Decision>, ext: Option<&Tensor>) -> Result<Tensor> {
        let f = &self.fused[i];
        let n = f.qkv.size()[0];
        let q_rows = self.model.config.num_attention_heads * self.model.config.head_dim;
        if let Some(y) = self.step_read(h, &f.qkv, self.rows_read(q_rows, d, 0) + n - q_rows, None, n)? {
            return Ok(y);
        }
        if let (Some(d), Some(ext), None) = (d, ext, &f.qkv_bias) {
            let hd = self.model.config.head_dim;
            let (n, k) = (f.qkv.size()[0], f.qkv.size()[1]);
            let ng = ext.size()[1];
            let sp = self.sparsity_hint[0] * d.mask.size()[1] as f64 / ng as f64;
            if let Some(path) = self.small_m_path(h, RoutedOp::Mn, n, k, d.group * hd, sp) {
                // The trailing K|V groups of the extended mask are always on.
                let lay = route_layout(ext)?.with_sparsity_hint(sp).with_always_on_from(d.mask.size()[1])?;
                let lay = if d.early && ext.is_contiguous() { lay.with_early_mask() } else { lay };
                return Ok(routed_gemm(RoutedOp::Mn, h, &f.qkv, None, &lay, d.group * hd, Some(path))?.0);
            }
        }
        if let (Some(d), None) = (d, &f.qkv_bias) {
            if let Some((lay, group, path)) = self.large_m_qkv_path(h, &f.qkv, d, ext)? {
                return Ok(routed_gemm(RoutedOp::Mn, h, &f.qkv, None, &lay, group, Some(path))?.0);
            }
        }
        if f.qkv_bias.is_none() {
            if let Some(y) = self.dense_gemv(RoutedOp::Mn, h, &f.qkv, None)? {
                return Ok(y);
            }
        }
        Ok(h.linear(&f.qkv, f.qkv_bias.as_ref()))
    }

    /// A dense decode-size projection on the GEMV kernels (one group of the whole width, on
    /// for every token; see `dense_gemv_enabled`); None where cuBLAS runs it.
    fn dense_gemv(&self, op: RoutedOp, x: &Tensor, w: &Tensor, w2: Option<&Tensor>) -> Result<Option<Tensor>> {
        let m = x.size()[0];
        let group = if op.reduces_over_groups() { w.size()[1] } else { w.size()[0] };
        if !dense_gemv_enabled(m) || !is_fast_dtype(x) || w.size()[1] % 8 != 0 || group % 8 != 0 {
            return Ok(None);
        }
        // The ones mask is written once, before any step: settled for the gemm_k GEMV.
        let lay = route_layout(&self.ones_mask(m, x.device()))?.with_settled_mask().with_always_on_from(0)?;
        Ok(Some(routed_gemm(op, x, w, w2, &lay, group, Some(GemmPath::Gemv))?.0))
    }

    /// A reduction-width projection (O: `unit` = head_dim, kind 0; down: unit 1, kind 1) on an
    /// input that is already zero at skipped groups: the routed GEMV where it pays, else cuBLAS.
    /// `next` = (layer, kind, residual) of the router whose input is `residual` + this output:
    /// for one token on the GEMV that router runs in the same launch (its decision goes to
    /// `rc.gated`, where the norm launch after this one would have put it).
    #[allow(clippy::too_many_arguments)]
    fn project_k(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, d: Option<&Decision>, unit: i64, kind: usize, next: Option<(usize, RouterKind, &Tensor)>, rc: &mut RouteCtx) -> Result<Tensor> {
        if let Some(y) = self.step_read(x, w, self.rows_read(w.size()[0], d, kind), None, w.size()[0])? {
            return Ok(y);
        }
        if let (Some(d), None) = (d, bias) {
            let (n, k) = (w.size()[0], w.size()[1]);
            if let Some(path) = self.small_m_path(x, RoutedOp::KPremasked, n, k, d.group * unit, self.sparsity_hint[kind]) {
                let lay = self.layout(d, kind)?;
                if let (GemmPath::Gemv, Some((li, rk, xres))) = (path, next) {
                    if let Some(out) = self.folded_router(x, w, lay, d.group * unit, li, rk, xres, rc)? {
                        return Ok(out);
                    }
                }
                return Ok(routed_gemm(RoutedOp::KPremasked, x, w, None, lay, d.group * unit, Some(path))?.0);
            }
        }
        if bias.is_none() {
            if let Some(y) = self.dense_gemv(RoutedOp::KPremasked, x, w, None)? {
                return Ok(y);
            }
        }
        Ok(x.linear(w, bias))
    }

    /// The gemm_k GEMV of one token with router `kind` of layer `li` folded in, where the engine
    /// has its fold and the decision comes from the routers as they stand (no offset fit, no
    /// padding); None otherwise.
    #[allow(clippy::too_many_arguments)]
    fn folded_router(&self, x: &Tensor, w: &Tensor, lay: &RouteLayout, group: i64, li: usize, kind: RouterKind, xres: &Tensor, rc: &mut RouteCtx) -> Result<Option<Tensor>> {
        let ki = kind_index(kind);
        let (Some(fold), Some(r)) = (self.folds[li].get(ki).and_then(|f| f.as_ref()), self.routing) else { return Ok(None) };
        if x.size()[0] != 1 || rc.fit.is_some() || rc.valid.is_some() || !matches!(rc.source, MaskSource::Routers) || self.fixed_applies(1, rc) {
            return Ok(None);
        }
        let router = match kind {
            RouterKind::Attention => r.layers[li].attention.as_ref(),
            _ => r.layers[li].ffn.as_ref(),
        };
        let Some(router) = router else { return Ok(None) };
        let Some(scratch) = self.fold_scratch.get(&router.compressor_w.size()[0]) else { return Ok(None) };
        // The attention gate's extended mask, as norm_and_router would ask for it.
        let extra = match kind {
            RouterKind::Attention if qkv_on_gemv(xres) => self.q_extra(self.model.config.num_attention_heads / router.groups),
            _ => 0,
        };
        let f = RouterFold {
            xres,
            w1: &router.compressor_w,
            b1: &router.compressor_b,
            fold,
            w2: &router.router_w,
            b2: &router.router_b,
            offset: self.offsets.borrow()[li][ki],
            extra,
            scratch,
        };
        let (out, mask, ext) = gemm_k_fold_router(x, w, lay, group, &f)?;
        self.fold_calls.set(self.fold_calls.get() + 1);
        rc.gated = Some(Gated { kind, extra, mask, ext, early: true });
        Ok(Some(out))
    }

    /// `[M, hidden] -> [M, intermediate]`: `silu(gate) * up`, zero at skipped channel groups.
    fn project_gate_up(&self, i: usize, h: &Tensor, d: Option<&Decision>) -> Result<Tensor> {
        let f = &self.fused[i];
        let inter = self.model.config.intermediate_size;
        let rows = self.rows_read(inter, d, 1);
        if let Some(y) = self.step_read(h, &f.gate_up.narrow(0, 0, inter), rows, Some((&f.gate_up.narrow(0, inter, inter), rows)), inter)? {
            return Ok(y);
        }
        if let (Some(d), None) = (d, &f.gate_up_bias) {
            let (g, u) = (f.gate_up.narrow(0, 0, inter), f.gate_up.narrow(0, inter, inter));
            if let Some(path) = self.small_m_path(h, RoutedOp::MnSwiglu, inter, f.gate_up.size()[1], d.group, self.sparsity_hint[1]) {
                let lay = self.layout(d, 1)?;
                return Ok(routed_gemm(RoutedOp::MnSwiglu, h, &g, Some(&u), lay, d.group, Some(path))?.0);
            }
            if let Some(path) = self.large_m_routed_path(h, &g, &u, d)? {
                let lay = self.layout(d, 1)?;
                return Ok(routed_gemm(RoutedOp::MnSwiglu, h, &g, Some(&u), lay, d.group, Some(path))?.0);
            }
        }
        if d.is_none() && f.gate_up_bias.is_none() {
            let (g, u) = (f.gate_up.narrow(0, 0, inter), f.gate_up.narrow(0, inter, inter));
            if let Some(y) = self.dense_gemv(RoutedOp::MnSwiglu, h, &g, Some(&u))? {
                return Ok(y);
            }
        }
        let gu = h.linear(&f.gate_up, f.gate_up_bias.as_ref());
        fused::swiglu(&gu, d.map(|d| &d.mask), d.map(|d| d.group).unwrap_or(1))
    }

    /// Attention outputs `[M, HQ * D]` with skipped head groups exactly zero.
    fn attention(&self, i: usize, q: &Tensor, (b, t): (i64, i64), lengths: Option<&Tensor>, cache: &EngineCache, d: Option<&Decision>) -> Result<Tensor> {
        let c = &self.model.config;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let window = self.model.layers[i].self_attn.window;
        let (kc, vc) = (&cache.keys[i], &cache.values[i]);
        let out = match lengths {
            None => {
                let (k, v) = (kc.narrow(2, 0, t), vc.narrow(2, 0, t));
                if let (Some(d), true) = (d, self.routed_prefill_attention(i, t, d, q)) {
                    // Routed prefill attention: its dispatch runs the gathered-query kernel where
                    // it is faster, else SDPA and a pass zeroing the skipped rows; either way
                    // those rows are already exactly 0.
                    let mask = d.mask.reshape([b, t, nh / d.group]);
                    let o = wide_kernels::attention_prefill_with(q, &k, &v, None, &mask, d.group, self.scale, Some(self.sparsity_hint[0]))?;
                    return Ok(o.transpose(1, 2).reshape([b * t, nh * hd]));
                }
                let o = match window.filter(|w| *w < t) {
                    None => Tensor::scaled_dot_product_attention(q, &k, &v, None::<Tensor>, 0.0, true, self.scale, nkv != nh),
                    Some(w) => {
                        let qs = Tensor::arange(t, (Kind::Int64, q.device())).view([t, 1]);
                        let ks = Tensor::arange(t, (Kind::Int64, q.device())).view([1, t]);
                        let mask = ks.le_tensor(&qs).logical_and(&(&qs - &ks).lt(w)).view([1, 1, t, t]).expand([b, 1, t, t], false);
                        grouped_attention(q, &k, &v, &mask, nkv)
                    }
                };
                o.transpose(1, 2).reshape([b * t, nh * hd])
            }
            Some(len) => {
                if self.decode_kernel_ok(i, q, cache) {
                    let (mask, gh) = self.decode_mask(b, d, q.device());
                    // In the step, RoPE and the cache write (the launch just before) wrote only q and the
                    // newest rows; the mask and lengths are older.
                    let o = wide_kernels::attention_decode_step(&q.view([b, nh, hd]), kc, vc, len, &mask, gh, self.scale)?;
                    return Ok(o.view([b, nh * hd]));
                }
                let cap = cache.capacity;
                let slot = Tensor::arange(cap, (Kind::Int64, q.device())).view([1, cap]);
                let l = len.to_kind(Kind::Int64).view([b, 1]);
                let mut mask = slot.lt_tensor(&l);
                if let Some(w) = window {
                    mask = mask.logical_and(&slot.ge_tensor(&(&l - w)));
                }
                grouped_attention(q, kc, vc, &mask.view([b, 1, 1, cap]), nkv).reshape([b, nh * hd])
            }
        };
        Ok(match d {
            Some(d) => {
                let m = out.size()[0];
                let off = d.mask.logical_not().unsqueeze(-1);
                out.view([m, nh / d.group, d.group * hd]).masked_fill(&off, 0.0).view([m, nh * hd])
            }
            None => out,
        })
    }

    /// Whether a decode step's attention runs the decode kernel: bf16/f16, no sliding window
    /// shorter than the cache, head_dim 64 (up to 8 query heads a KV head) or 128 (up to 4).
    fn decode_kernel_ok(&self, i: usize, x: &Tensor, cache: &EngineCache) -> bool {
        let c = &self.model.config;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        is_fast_dtype(x) && self.model.layers[i].self_attn.window.is_none_or(|w| w >= cache.capacity) && matches!((hd, nh / nkv), (64, 1 | 2 | 4 | 8) | (128, 1 | 2 | 4))
    }

    /// The decode kernel's head-group mask and group size: the routed decision's, or every head
    /// on in one group.
    fn decode_mask(&self, b: i64, d: Option<&Decision>, dev: Device) -> (Tensor, i64) {
        match d {
            Some(d) => (d.mask.shallow_clone(), d.group),
            None => (self.ones_mask(b, dev), self.model.config.num_attention_heads),
        }
    }

    /// A decode step's attention with the new token's RoPE and cache write in the same launch
    /// (`attention_decode_step_rope`): qkv `[B, (HQ + 2 HKV) D]` straight from the projection.
    fn attention_decode_rope(&self, i: usize, qkv: &Tensor, b: i64, len: &Tensor, cache: &EngineCache, d: Option<&Decision>) -> Result<Tensor> {
        let c = &self.model.config;
        let (mask, gh) = self.decode_mask(b, d, qkv.device());
        let o = wide_kernels::attention_decode_step_rope(qkv, &self.inv_freq, &cache.keys[i], &cache.values[i], len, &mask, gh, self.scale)?;
        Ok(o.view([b, c.num_attention_heads * c.head_dim]))
    }

    /// Whether a prefill's attention goes to `attention_prefill_with` (routed, head-major q)
    /// rather than SDPA: a routed decision, no sliding window shorter than the `t` tokens, bf16/f16.
    fn routed_prefill_attention(&self, i: usize, t: i64, d: Option<&Decision>, x: &Tensor) -> bool {
        d.is_some() && self.model.layers[i].self_attn.window.is_none_or(|w| w >= t) && is_fast_dtype(x)
    }

    fn ones_mask(&self, b: i64, dev: Device) -> Tensor {
        self.ones.borrow_mut().entry(b).or_insert_with(|| Tensor::ones([b, 1], (Kind::Bool, dev))).shallow_clone()
    }
}

/// Batched decoding over an [`Engine`]: a prefill, then steps of one token per row whose body
/// reads no host value (positions, lengths and, for greedy decoding, the next tokens advance
/// on the device), optionally captured once in a CUDA graph and replayed.
pub struct Decoder<'e, 'm> {
    engine: &'e Engine<'m>,
    pub cache: EngineCache,
    /// `[B]` i64: the token each row feeds next (greedy steps overwrite it with the argmax).
    pub tokens: Tensor,
    /// `[B]` i32: the slot (position) of that token; `lengths = pos + 1`.
    pos: Tensor,
    lengths: Tensor,
    host_lengths: Vec<i64>,
    greedy: bool,
    graph: Option<wide_kernels::CudaGraph>,
    /// The graph's logits `[B, vocab]` (overwritten by each replay).
    logits: Option<Tensor>,
    counts: Option<BTreeMap<RouterKind, (Tensor, Tensor)>>,
}

impl<'e, 'm> Decoder<'e, 'm> {
    /// Prefills `prompts` (right-padded into one batch) into a cache of `capacity` slots.
    /// Returns the decoder and the last-token logits `[B, vocab]`; set the first tokens with
    /// [`Decoder::set_tokens`] (or `greedy_first`), then call [`Decoder::step`].
    /// `stats` accumulates skip counts of the decode steps on the device.
    pub fn new(engine: &'e Engine<'m>, prompts: &[Vec<i64>], capacity: i64, greedy: bool, stats: bool, prefill_counts: Option<&mut SkipCounts>) -> Result<(Self, Tensor)> {
        let _g = tch::no_grad_guard();
        ensure!(!prompts.is_empty() && prompts.iter().all(|p| !p.is_empty()), "every prompt needs at least one token");
        let model = engine.model;
        let dev = model.device;
        let b = prompts.len() as i64;
        let lengths: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
        let t = *lengths.iter().max().unwrap();
        ensure!(t < capacity, "cache capacity {capacity} leaves no room after a {t}-token prompt");
        let pad = model.config.pad_token_id.or(model.config.eos_token_ids.first().copied()).unwrap_or(0);
        let mut ids = Vec::with_capacity((b * t) as usize);
        for p in prompts {
            ids.extend(p.iter().copied().chain(std::iter::repeat_n(pad, t as usize - p.len())));
        }
        let ids = Tensor::from_slice(&ids).view([b, t]).to_device(dev);
        let cache = EngineCache::new(model, b, capacity);
        let logits = engine.prefill(&ids, &lengths, &cache, &mut MaskSource::Routers, prefill_counts, false)?;
        let pos = Tensor::from_slice(&lengths.iter().map(|&l| l as i32).collect::<Vec<_>>()).to_device(dev);
        let len1 = &pos + 1;
        let tokens = logits.argmax(-1, false);
        let counts = stats.then(|| {
            let z = || Tensor::zeros([], (Kind::Float, dev));
            let mut m = BTreeMap::new();
            if let Some(r) = engine.routing {
                for (k, _) in r.config.routers(&model.config) {
                    m.insert(k, (z(), z()));
                }
            }
            m
        });
        Ok((Self { engine, cache, tokens, pos, lengths: len1, host_lengths: lengths, greedy, graph: None, logits: None, counts }, logits))
    }

    /// Feeds these tokens next (`[B]`), e.g. sampled ones.
    pub fn set_tokens(&mut self, tokens: &[i64]) -> Result<()> {
        ensure!(tokens.len() as i64 == self.cache.batch, "set_tokens: {} tokens for a batch of {}", tokens.len(), self.cache.batch);
        self.tokens.copy_(&Tensor::from_slice(tokens).to_device(self.tokens.device()));
        Ok(())
    }

    fn step_body(&mut self) -> Result<Tensor> {
        let e = self.engine;
        let b = self.cache.batch;
        let mut src = MaskSource::Routers;
        let mut rc = RouteCtx { source: &mut src, cursor: 0, valid: None, counts: self.counts.as_mut(), fit: None, gated: None, early: false };
        let hn = e.forward_tokens(&self.tokens.view([b, 1]), (b, 1), &self.pos, Some(&self.lengths), &self.cache, &mut rc)?;
        let logits = e.timed("lm_head", || Ok(hn.linear::<Tensor>(&e.model.lm_head, None)))?;
        if self.greedy {
            self.tokens.copy_(&logits.argmax(-1, false));
        }
        let _ = self.pos.g_add_scalar_(1);
        let _ = self.lengths.g_add_scalar_(1);
        Ok(logits)
    }

    /// Captures the step in a CUDA graph (after one warm-up step whose effects are undone).
    pub fn capture(&mut self) -> Result<()> {
        let Device::Cuda(d) = self.engine.model.device else { return Ok(()) };
        let _g = tch::no_grad_guard();
        let saved = (self.tokens.copy(), self.pos.copy(), self.lengths.copy());
        let _ = self.step_body()?;
        self.tokens.copy_(&saved.0);
        self.pos.copy_(&saved.1);
        self.lengths.copy_(&saved.2);
        if let Some(c) = &mut self.counts {
            for (s, t) in c.values_mut() {
                let _ = s.zero_();
                let _ = t.zero_();
            }
        }
        let mut g = wide_kernels::CudaGraph::new(d)?;
        let logits = {
            let this = &mut *self;
            g.capture(|| this.step_body())?
        };
        self.logits = Some(logits);
        self.graph = Some(g);
        Ok(())
    }

    /// One step: every row consumes its token; returns the logits `[B, vocab]` (the graph's
    /// output buffer when captured: valid until the next step).
    pub fn step(&mut self) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let longest = self.host_lengths.iter().max().copied().unwrap_or(0);
        ensure!(longest < self.cache.capacity, "decoder cache is full ({} slots)", self.cache.capacity);
        let out = match &self.graph {
            Some(g) => {
                g.replay()?;
                self.logits.as_ref().context("captured graph has no logits")?.shallow_clone()
            }
            None => self.step_body()?,
        };
        for l in &mut self.host_lengths {
            *l += 1;
        }
        Ok(out)
    }

    /// Skip counts of the decode steps so far (a device read).
    pub fn skip_counts(&self) -> SkipCounts {
        let mut c = SkipCounts::default();
        if let Some(d) = &self.counts {
            add_counts(&mut c, d);
        }
        c
    }
}

impl Drop for Decoder<'_, '_> {
    fn drop(&mut self) {
        // The graph's output lives in the graph's memory pool: free it before the graph.
        self.logits = None;
        self.graph = None;
    }
}

/// What [`Engine::generate`] returns.
#[derive(Debug, Clone)]
pub struct EngineGeneration {
    pub tokens: Vec<Vec<i64>>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub decode_steps: usize,
    /// The decode steps ran as one CUDA graph (its capture is part of `decode_seconds`).
    pub graph_captured: bool,
    pub prefill_skip: SkipCounts,
    pub decode_skip: SkipCounts,
}

impl<'m> Engine<'m> {
    /// Generates for each prompt (greedy or sampled, see [`SamplingConfig`]); `on_token(row,
    /// id)` streams tokens. Greedy decoding on a GPU with `use_graph` replays one CUDA graph a
    /// step; the host reads the new tokens after each step (for EOS and streaming).
    pub fn generate(&self, prompts: &[Vec<i64>], cfg: &SamplingConfig, use_graph: bool, mut on_token: impl FnMut(usize, i64) -> Result<()>) -> Result<EngineGeneration> {
        self.model.check_context(prompts, cfg.max_new_tokens)?;
        let b = prompts.len();
        let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0) as i64;
        let capacity = longest + cfg.max_new_tokens as i64;
        let greedy = cfg.temperature <= 0.0;
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        let start = std::time::Instant::now();
        let mut prefill_skip = SkipCounts::default();
        let (mut dec, logits) = Decoder::new(self, prompts, capacity, greedy, self.is_routed(), Some(&mut prefill_skip))?;
        let mut next = pick_tokens(&logits, cfg, &mut rng)?;
        let prefill_seconds = start.elapsed().as_secs_f64();
        let start = std::time::Instant::now();
        let mut out = Emitted::new(b);
        let mut steps = 0;
        let mut captured = false;
        while !out.push(&next, &self.model.config.eos_token_ids, cfg, &mut on_token)? {
            // A greedy step already left its argmax in the decoder's token buffer on the device.
            if !greedy || steps == 0 {
                dec.set_tokens(&next)?;
            }
            if use_graph && !captured {
                dec.capture()?;
                captured = true;
            }
            let logits = dec.step()?;
            next = if greedy { Vec::<i64>::try_from(dec.tokens.to_device(Device::Cpu))? } else { pick_tokens(&logits, cfg, &mut rng)? };
            steps += 1;
        }
        Ok(EngineGeneration {
            tokens: out.tokens,
            prefill_seconds,
            decode_seconds: start.elapsed().as_secs_f64(),
            decode_steps: steps,
            graph_captured: dec.graph.is_some(),
            prefill_skip,
            decode_skip: dec.skip_counts(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_reads_setting_is_a_block_count_or_off() {
        for off in [None, Some(""), Some("0"), Some(" 0 ")] {
            assert_eq!(parse_step_reads(off).unwrap(), None, "{off:?}");
        }
        assert_eq!(parse_step_reads(Some("1")).unwrap(), Some(1));
        assert_eq!(parse_step_reads(Some("8")).unwrap(), Some(8));
        for bad in ["9", "-1", "two", "1.5"] {
            let e = parse_step_reads(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(&format!("WIDE_STEP_READS={bad}")) && e.contains("1 to 8"), "{e}");
        }
    }

    #[test]
    fn fixed_masks_setting_is_a_switch() {
        for off in [None, Some(""), Some("0")] {
            assert!(!parse_fixed_masks(off).unwrap(), "{off:?}");
        }
        assert!(parse_fixed_masks(Some(" 1")).unwrap());
        let e = parse_fixed_masks(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("WIDE_FIXED_MASKS=yes") && e.contains("use 1"), "{e}");
    }

    #[test]
    fn fixed_skip_pattern_skips_exactly_the_rounded_share_and_differs_by_seed() {
        for (groups, skip, want) in [(8, 0.5, 4), (112, 0.5, 56), (112, 0.3, 34), (8, 0.0, 0), (8, 1.0, 8), (32, 0.7, 22)] {
            let on = fixed_skip_pattern(groups, skip, 3);
            assert_eq!(on.len(), groups);
            assert_eq!(on.iter().filter(|b| !**b).count(), want, "{groups} groups at {skip}");
            assert_eq!(on, fixed_skip_pattern(groups, skip, 3), "deterministic");
        }
        let layers: std::collections::BTreeSet<Vec<bool>> = (0..32).map(|l| fixed_skip_pattern(112, 0.5, l << 2 | 1)).collect();
        assert!(layers.len() > 30, "layers should get different groups ({} distinct of 32)", layers.len());
    }

    #[test]
    fn router_fold_setting_parses_or_names_the_choices() {
        assert_eq!(parse_router_fold(None).unwrap(), [false, true]);
        assert_eq!(parse_router_fold(Some(" ")).unwrap(), [false, true]);
        assert_eq!(parse_router_fold(Some("ffn")).unwrap(), [false, true]);
        for both in ["1", "both"] {
            assert_eq!(parse_router_fold(Some(both)).unwrap(), [true, true]);
        }
        for none in ["0", "none"] {
            assert_eq!(parse_router_fold(Some(none)).unwrap(), [false, false]);
        }
        assert_eq!(parse_router_fold(Some(" attention")).unwrap(), [true, false]);
        let e = parse_router_fold(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("WIDE_ROUTER_FOLD=yes") && e.contains("attention or none"), "{e}");
    }

    #[test]
    fn fuse_reuses_parts_that_are_already_one_tensor() {
        let base = Tensor::arange(4 * 6 * 3, (Kind::Float, Device::Cpu)).reshape([24, 3]);
        let (a, b, c) = (base.narrow(0, 0, 4), base.narrow(0, 4, 12), base.narrow(0, 16, 8));
        let f = already_fused(&[&a, &b, &c]).expect("consecutive row blocks of one tensor");
        assert_eq!(f.size(), vec![24, 3]);
        assert_eq!(f.data_ptr(), base.data_ptr());
        assert!(f.equal(&base));
        // A prefix of the storage is fine; out of order, a gap, or a transposed part is not.
        assert_eq!(already_fused(&[&a, &b]).map(|t| t.size()), Some(vec![16, 3]));
        assert!(already_fused(&[&b, &a]).is_none());
        assert!(already_fused(&[&a, &c]).is_none());
        let t = base.narrow(0, 0, 3).t_();
        assert!(already_fused(&[&t]).is_none());
        // A part of another rank right after the first is not a row block of it.
        let flat = base.narrow(0, 4, 1).view([3]);
        assert!(already_fused(&[&a, &flat]).is_none());
        let scalar = base.get(4).get(0);
        assert!(already_fused(&[&a, &scalar]).is_none());
        // Separate tensors are copied by `fuse` and then are views of the copy.
        let (x, y) = (Tensor::ones([2, 3], (Kind::Float, Device::Cpu)), Tensor::zeros([5, 3], (Kind::Float, Device::Cpu)));
        assert!(already_fused(&[&x, &y]).is_none());
        let fused = fuse(&[&x, &y]).unwrap();
        assert_eq!(x.data_ptr(), fused.data_ptr());
        assert_eq!(fused.size(), vec![7, 3]);
        // A second fuse of the same parts shares the first one's storage.
        let again = fuse(&[&x, &y]).unwrap();
        assert_eq!(again.data_ptr(), fused.data_ptr());
        assert!(again.equal(&fused));
    }

    #[test]
    fn a_view_past_its_storage_is_refused() {
        // What keeps two allocations that merely sit next to each other apart: the view over
        // the first part's storage fails torch's bounds check, and `already_fused` says `None`.
        let big = Tensor::zeros([8, 4], (Kind::Float, Device::Cpu));
        let own = big.narrow(0, 0, 4).copy();
        assert!(own.f_as_strided([8, 4], [4, 1], None).is_err());
        assert!(big.narrow(0, 0, 4).f_as_strided([8, 4], [4, 1], None).is_ok());
    }
}
