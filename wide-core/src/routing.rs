//! WIDE routing: per-layer token routers, the straight-through Gumbel gate, the five variants
//! (`dense`, `wide`, `sublayer_skip`, `layer_skip`, `static_width`) on the backbone's one
//! forward path, sparsity accounting and the sparsity loss. Semantics: `shared/design/method.md`
//! of the project (routers read the un-normalised residual entering their sublayer; K/V are
//! always computed).
use crate::config::ModelConfig;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

/// Which units a router can skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    Dense,
    Wide,
    SublayerSkip,
    LayerSkip,
    StaticWidth,
}

impl Variant {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "dense" => Variant::Dense,
            "wide" => Variant::Wide,
            "sublayer_skip" => Variant::SublayerSkip,
            "layer_skip" => Variant::LayerSkip,
            "static_width" => Variant::StaticWidth,
            _ => bail!("unknown variant {s:?}: use dense, wide, sublayer_skip, layer_skip or static_width"),
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Variant::Dense => "dense",
            Variant::Wide => "wide",
            Variant::SublayerSkip => "sublayer_skip",
            Variant::LayerSkip => "layer_skip",
            Variant::StaticWidth => "static_width",
        }
    }
}

/// Which sublayers are routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SparseTarget {
    #[default]
    All,
    Attention,
    Ffn,
}

/// The kind of a router (what its groups are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum RouterKind {
    Attention,
    Ffn,
    Layer,
}

impl RouterKind {
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Attention => "attention",
            RouterKind::Ffn => "ffn",
            RouterKind::Layer => "layer",
        }
    }
    /// Name of the router module in checkpoints (`model.layers.N.<this>`).
    pub fn module(self) -> &'static str {
        match self {
            RouterKind::Attention => "router_attention",
            RouterKind::Ffn => "router_ffn",
            RouterKind::Layer => "router_layer",
        }
    }
}

/// Routing configuration (the `[routing]` table of a recipe and the routing manifest).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    pub variant: Variant,
    /// Query heads per attention group.
    #[serde(default = "d_attn_group")]
    pub attn_group_size: i64,
    /// Intermediate channels per FFN group.
    #[serde(default = "d_ffn_group")]
    pub ffn_group_size: i64,
    #[serde(default = "d_rank")]
    pub router_rank: i64,
    #[serde(default)]
    pub sparse_target: SparseTarget,
    /// One sparsity target shared by all router types (their average is driven to it).
    #[serde(default)]
    pub target_sparsity: Option<f64>,
    /// Per-type targets; when both are given each type is driven to its own.
    #[serde(default)]
    pub attn_target: Option<f64>,
    #[serde(default)]
    pub ffn_target: Option<f64>,
    #[serde(default = "d_lambda")]
    pub lambda: f64,
    #[serde(default = "d_tau_start")]
    pub tau_start: f64,
    #[serde(default = "d_tau_end")]
    pub tau_end: f64,
    /// Inference-time offsets added to `logit_skip - logit_execute` per router type.
    #[serde(default)]
    pub attn_logit_offset: f64,
    #[serde(default)]
    pub ffn_logit_offset: f64,
    #[serde(default)]
    pub layer_logit_offset: f64,
    /// After router training, search the inference offsets on training text so that the
    /// deterministic skip rate meets the target (the Gumbel-trained rate is a mean of
    /// probabilities; the deterministic one thresholds them).
    #[serde(default = "d_true")]
    pub calibrate_offsets: bool,
    /// Training sequences used for that search.
    #[serde(default = "d_offset_seqs")]
    pub offset_calibration_sequences: u64,
}
fn d_true() -> bool {
    true
}
fn d_offset_seqs() -> u64 {
    64
}
fn d_attn_group() -> i64 {
    1
}
fn d_ffn_group() -> i64 {
    128
}
fn d_rank() -> i64 {
    32
}
fn d_lambda() -> f64 {
    20.0
}
fn d_tau_start() -> f64 {
    5.0
}
fn d_tau_end() -> f64 {
    0.5
}

impl RoutingConfig {
    pub fn new(variant: Variant) -> Self {
        Self {
            variant,
            attn_group_size: d_attn_group(),
            ffn_group_size: d_ffn_group(),
            router_rank: d_rank(),
            sparse_target: SparseTarget::All,
            target_sparsity: None,
            attn_target: None,
            ffn_target: None,
            lambda: d_lambda(),
            tau_start: d_tau_start(),
            tau_end: d_tau_end(),
            attn_logit_offset: 0.0,
            ffn_logit_offset: 0.0,
            layer_logit_offset: 0.0,
            calibrate_offsets: true,
            offset_calibration_sequences: d_offset_seqs(),
        }
    }

    /// Routers of one layer: kind and number of groups.
    pub fn routers(&self, m: &ModelConfig) -> Vec<(RouterKind, i64)> {
        let attn = self.sparse_target != SparseTarget::Ffn;
        let ffn = self.sparse_target != SparseTarget::Attention;
        let mut v = vec![];
        match self.variant {
            Variant::Dense => {}
            Variant::Wide | Variant::StaticWidth => {
                if attn {
                    v.push((RouterKind::Attention, m.num_attention_heads / self.attn_group_size));
                }
                if ffn {
                    v.push((RouterKind::Ffn, m.intermediate_size / self.ffn_group_size));
                }
            }
            Variant::SublayerSkip => {
                if attn {
                    v.push((RouterKind::Attention, 1));
                }
                if ffn {
                    v.push((RouterKind::Ffn, 1));
                }
            }
            Variant::LayerSkip => v.push((RouterKind::Layer, 1)),
        }
        v
    }

    pub fn validate(&self, m: &ModelConfig) -> Result<()> {
        if matches!(self.variant, Variant::Wide | Variant::StaticWidth) {
            if self.attn_group_size <= 0 || m.num_attention_heads % self.attn_group_size != 0 {
                bail!(
                    "attention group size {} does not divide the {} attention heads; choose one of {:?}",
                    self.attn_group_size,
                    m.num_attention_heads,
                    m.attention_group_sizes()
                );
            }
            if self.ffn_group_size <= 0 || m.intermediate_size % self.ffn_group_size != 0 {
                bail!(
                    "FFN group size {} does not divide the intermediate size {}; choose one of {:?}",
                    self.ffn_group_size,
                    m.intermediate_size,
                    m.ffn_group_sizes()
                );
            }
        }
        if self.router_rank <= 0 {
            bail!("router rank must be positive, got {}", self.router_rank);
        }
        for (name, t) in [("target_sparsity", self.target_sparsity), ("attn_target", self.attn_target), ("ffn_target", self.ffn_target)] {
            if let Some(t) = t {
                if !(0.0..1.0).contains(&t) {
                    bail!("{name} must be in [0, 1), got {t}");
                }
            }
        }
        if self.variant != Variant::Dense && self.target_sparsity.is_none() && (self.attn_target.is_none() || self.ffn_target.is_none()) {
            if !(self.variant == Variant::LayerSkip && (self.attn_target.is_some() || self.ffn_target.is_some())) {
                bail!("set routing.target_sparsity, or both routing.attn_target and routing.ffn_target");
            }
        }
        if !(self.tau_start > 0.0 && self.tau_end > 0.0) {
            bail!("Gumbel temperatures must be positive");
        }
        Ok(())
    }

    /// Target of a router kind, for per-type targets.
    pub fn per_type_targets(&self) -> Option<(f64, f64)> {
        match (self.attn_target, self.ffn_target) {
            (Some(a), Some(f)) if self.variant != Variant::LayerSkip => Some((a, f)),
            _ => None,
        }
    }

    /// The shared target (per-type targets averaged when only those are given).
    pub fn shared_target(&self) -> f64 {
        self.target_sparsity.unwrap_or_else(|| match (self.attn_target, self.ffn_target) {
            (Some(a), Some(f)) => 0.5 * (a + f),
            (Some(a), None) => a,
            (None, Some(f)) => f,
            _ => 0.0,
        })
    }

    pub fn logit_offset(&self, kind: RouterKind) -> f64 {
        match kind {
            RouterKind::Attention => self.attn_logit_offset,
            RouterKind::Ffn => self.ffn_logit_offset,
            RouterKind::Layer => self.layer_logit_offset,
        }
    }

    /// Temperature at optimizer step `step` of `total`: linear from `tau_start` to `tau_end`.
    pub fn tau(&self, step: u64, total: u64) -> f64 {
        if total <= 1 {
            return self.tau_end;
        }
        let p = (step.min(total - 1)) as f64 / (total - 1) as f64;
        self.tau_start + (self.tau_end - self.tau_start) * p
    }
}

/// A token router: `Linear(hidden -> rank) -> Linear(rank -> 2 * groups)`, read as
/// `[.., groups, 2]` (execute, skip) logits.
#[derive(Debug)]
pub struct Router {
    pub kind: RouterKind,
    pub groups: i64,
    pub compressor_w: Tensor,
    pub compressor_b: Tensor,
    pub router_w: Tensor,
    pub router_b: Tensor,
}

fn kaiming_uniform_linear(shape: &[i64], kind: Kind, device: Device) -> Tensor {
    // Kaiming-uniform with linear gain: U(-sqrt(3 / fan_in), sqrt(3 / fan_in)).
    let bound = (3.0 / shape[1] as f64).sqrt();
    Tensor::empty(shape, (kind, device)).uniform_(-bound, bound)
}

impl Router {
    pub fn new(p: &nn::Path, kind: RouterKind, hidden: i64, rank: i64, groups: i64, dtype: Kind) -> Self {
        let d = p.device();
        let c = p / "compressor";
        let r = p / "router";
        Self {
            kind,
            groups,
            compressor_w: c.add("weight", kaiming_uniform_linear(&[rank, hidden], dtype, d), true),
            compressor_b: c.add("bias", Tensor::zeros([rank], (dtype, d)), true),
            router_w: r.add("weight", kaiming_uniform_linear(&[2 * groups, rank], dtype, d), true),
            router_b: r.add("bias", Tensor::zeros([2 * groups], (dtype, d)), true),
        }
    }

    /// `x: [B, T, hidden]` (un-normalised residual) -> logits `[B, T, groups, 2]` in f32.
    pub fn logits(&self, x: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().unwrap();
        let h = x.linear(&self.compressor_w, Some(&self.compressor_b));
        h.linear(&self.router_w, Some(&self.router_b)).to_kind(Kind::Float).view([b, t, self.groups, 2])
    }

    pub fn tensors(&self, prefix: &str) -> Vec<(String, Tensor)> {
        vec![
            (format!("{prefix}.compressor.weight"), self.compressor_w.shallow_clone()),
            (format!("{prefix}.compressor.bias"), self.compressor_b.shallow_clone()),
            (format!("{prefix}.router.weight"), self.router_w.shallow_clone()),
            (format!("{prefix}.router.bias"), self.router_b.shallow_clone()),
        ]
    }
}

/// How gates decide.
#[derive(Debug)]
pub enum GateMode {
    /// Hard Gumbel-softmax at temperature `tau` with straight-through gradients. `noise` gives
    /// uniform(0,1) draws for a router's logits shape (keyed by sample, for reproducibility).
    Train { tau: f64 },
    /// Deterministic: execute iff `logit_skip - logit_execute + offset <= 0`.
    Inference,
    /// Given execute masks `[B, T, groups]`, one per router call in call order (tests, and
    /// comparing execution paths on identical masks).
    Forced(Vec<Tensor>),
}

/// Straight-through hard Gumbel-softmax: returns the execute mask `[.., groups]` (exactly 0/1
/// forward; gradient of the soft sample backward). `uniform` are U(0,1) draws like `logits`.
pub fn gumbel_gate(logits: &Tensor, uniform: &Tensor, tau: f64) -> Tensor {
    let eps = 1e-10;
    let gumbel = -((uniform + eps).log() * -1.0 + eps).log();
    let soft = ((logits + gumbel) / tau).softmax(-1, Kind::Float);
    let hard = soft.argmax(-1, true).eq(0).to_kind(Kind::Float);
    let soft_exec = soft.select(-1, 0).unsqueeze(-1);
    (hard - soft_exec.detach() + soft_exec).squeeze_dim(-1)
}

/// Deterministic gate with an offset: 1 where the group executes.
pub fn inference_gate(logits: &Tensor, offset: f64) -> Tensor {
    let diff = logits.select(-1, 1) - logits.select(-1, 0) + offset;
    diff.le(0.0).to_kind(Kind::Float)
}

/// Routers (or fixed masks) of one layer.
#[derive(Debug, Default)]
pub struct LayerRouters {
    pub attention: Option<Router>,
    pub ffn: Option<Router>,
    pub layer: Option<Router>,
    /// static_width: fixed execute masks `[groups]` (f32 0/1).
    pub static_attention: Option<Tensor>,
    pub static_ffn: Option<Tensor>,
}

/// All routers of a model, created under `model.layers.N.router_*`.
pub struct Routing {
    pub config: RoutingConfig,
    pub layers: Vec<LayerRouters>,
}

impl Routing {
    /// Fresh routers (Kaiming-uniform weights, zero biases) or, for `static_width`, all-active
    /// masks to be chosen by calibration.
    pub fn new(root: &nn::Path, model: &ModelConfig, config: &RoutingConfig, dtype: Kind) -> Result<Self> {
        config.validate(model)?;
        let mut layers = vec![];
        for i in 0..model.num_hidden_layers {
            let p = root / "model" / "layers" / i;
            let mut l = LayerRouters::default();
            for (kind, groups) in config.routers(model) {
                if config.variant == Variant::StaticWidth {
                    let m = Tensor::ones([groups], (Kind::Float, root.device()));
                    match kind {
                        RouterKind::Attention => l.static_attention = Some(m),
                        _ => l.static_ffn = Some(m),
                    }
                    continue;
                }
                let r = Router::new(&(&p / kind.module()), kind, model.hidden_size, config.router_rank, groups, dtype);
                match kind {
                    RouterKind::Attention => l.attention = Some(r),
                    RouterKind::Ffn => l.ffn = Some(r),
                    RouterKind::Layer => l.layer = Some(r),
                }
            }
            layers.push(l);
        }
        Ok(Self { config: config.clone(), layers })
    }

    /// Every router tensor (and static mask) with its checkpoint name.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![];
        for (i, l) in self.layers.iter().enumerate() {
            for r in [&l.attention, &l.ffn, &l.layer].into_iter().flatten() {
                v.extend(r.tensors(&format!("model.layers.{i}.{}", r.kind.module())));
            }
            if let Some(m) = &l.static_attention {
                v.push((format!("model.layers.{i}.static_attention.mask"), m.shallow_clone()));
            }
            if let Some(m) = &l.static_ffn {
                v.push((format!("model.layers.{i}.static_ffn.mask"), m.shallow_clone()));
            }
        }
        v
    }

    /// Loads tensors written by [`Routing::tensors`], checking names and shapes.
    pub fn load_tensors(&self, get: &mut dyn FnMut(&str) -> Result<Tensor>) -> Result<()> {
        let _g = tch::no_grad_guard();
        for (name, t) in self.tensors() {
            let src = get(&name).with_context(|| format!("router checkpoint lacks {name}: it was trained for another model, variant or group size"))?;
            if src.size() != t.size() {
                bail!(
                    "router tensor {name} has shape {:?} in the checkpoint but {:?} here: the routers were trained for another model or group size",
                    src.size(),
                    t.size()
                );
            }
            t.detach().copy_(&src.to_kind(t.kind()).to_device(t.device()));
        }
        Ok(())
    }
}

/// Skip counts of one router kind at one layer (padding excluded).
#[derive(Debug)]
pub struct RouterStat {
    pub layer: usize,
    pub kind: RouterKind,
    pub groups: i64,
    /// Differentiable (straight-through) skipped (token, group) pairs.
    pub skipped: Tensor,
    /// Valid tokens x groups.
    pub total: f64,
    /// Execute fraction per token: `[B, T]` (for FLOPs accounting).
    pub active_fraction: Tensor,
}

/// What one routed forward recorded.
#[derive(Debug, Default)]
pub struct RoutingStats {
    pub routers: Vec<RouterStat>,
}

impl RoutingStats {
    /// Skip rate per router kind, averaged over layers (differentiable, f32 scalar).
    pub fn skip_rate(&self, kind: RouterKind) -> Option<Tensor> {
        let rates: Vec<Tensor> = self.routers.iter().filter(|r| r.kind == kind).map(|r| &r.skipped / r.total.max(1.0)).collect();
        (!rates.is_empty()).then(|| Tensor::stack(&rates, 0).mean(Kind::Float))
    }

    pub fn kinds(&self) -> Vec<RouterKind> {
        let mut k: Vec<RouterKind> = self.routers.iter().map(|r| r.kind).collect();
        k.sort();
        k.dedup();
        k
    }

    /// `lambda * |target - rate|`: one shared target on the average over kinds, or one target
    /// per kind.
    pub fn sparsity_loss(&self, cfg: &RoutingConfig) -> Option<Tensor> {
        let kinds = self.kinds();
        if kinds.is_empty() {
            return None;
        }
        if let Some((a, f)) = cfg.per_type_targets() {
            let mut terms = vec![];
            for k in kinds {
                let t = if k == RouterKind::Attention { a } else { f };
                terms.push((self.skip_rate(k).unwrap() - t).abs());
            }
            return Some(Tensor::stack(&terms, 0).sum(Kind::Float) * cfg.lambda);
        }
        let avg = Tensor::stack(&kinds.iter().map(|k| self.skip_rate(*k).unwrap()).collect::<Vec<_>>(), 0).mean(Kind::Float);
        Some((avg - cfg.shared_target()).abs() * cfg.lambda)
    }
}

/// Execute masks per token for one layer, in the shapes the forward path applies them.
pub(crate) struct LayerMasks {
    /// `[B, T, heads]` execute mask per query head (wide, static_width).
    pub heads: Option<Tensor>,
    /// `[B, T, 1]` whole-attention mask (sublayer_skip).
    pub attention_out: Option<Tensor>,
    /// `[B, T, intermediate]` per channel (wide, static_width).
    pub channels: Option<Tensor>,
    /// `[B, T, 1]` whole-FFN mask (sublayer_skip).
    pub ffn_out: Option<Tensor>,
    /// `[B, T, 1]` whole-layer mask (layer_skip).
    pub layer: Option<Tensor>,
}

/// Accumulates the mean activation norm of every attention head group (per-head output norm
/// before `o_proj`) and FFN channel group (|silu(gate) * up| before `down_proj`) per layer:
/// the importance that `static_width` keeps the largest groups by.
pub struct ActivationObserver {
    /// Per layer: `[groups]` summed scores (CPU f64).
    pub heads: Vec<Tensor>,
    pub channels: Vec<Tensor>,
    attn_groups: i64,
    ffn_groups: i64,
}

impl ActivationObserver {
    pub fn new(m: &ModelConfig, c: &RoutingConfig) -> Self {
        let n = m.num_hidden_layers as usize;
        let ag = m.num_attention_heads / c.attn_group_size.max(1);
        let fg = m.intermediate_size / c.ffn_group_size.max(1);
        Self {
            heads: (0..n).map(|_| Tensor::zeros([ag], (Kind::Double, Device::Cpu))).collect(),
            channels: (0..n).map(|_| Tensor::zeros([fg], (Kind::Double, Device::Cpu))).collect(),
            attn_groups: ag,
            ffn_groups: fg,
        }
    }
    /// `attn: [B, T, heads, head_dim]`.
    pub(crate) fn observe_heads(&mut self, layer: usize, attn: &Tensor) {
        let (b, t, h, _) = attn.size4().unwrap();
        let norms = attn.to_kind(Kind::Float).norm_scalaropt_dim(2.0, [-1], false).view([b * t, self.attn_groups, h / self.attn_groups]);
        let s = norms.mean_dim([0i64, 2].as_slice(), false, Kind::Float).to_device(Device::Cpu).to_kind(Kind::Double);
        self.heads[layer] += s;
    }
    /// `hidden: [B, T, intermediate]`.
    pub(crate) fn observe_channels(&mut self, layer: usize, hidden: &Tensor) {
        let (b, t, i) = hidden.size3().unwrap();
        let a = hidden.to_kind(Kind::Float).abs().view([b * t, self.ffn_groups, i / self.ffn_groups]);
        let s = a.mean_dim([0i64, 2].as_slice(), false, Kind::Float).to_device(Device::Cpu).to_kind(Kind::Double);
        self.channels[layer] += s;
    }
}

/// Per-forward routing context: the routers, the gate mode, valid tokens and collected stats.
pub struct RoutingRun<'a> {
    pub routing: &'a Routing,
    pub mode: GateMode,
    /// `[B, T]` f32, 1 for real tokens.
    pub valid: Tensor,
    /// U(0,1) draws per router call, in call order (training); drawn from the global
    /// generator when absent.
    pub noise: Option<Vec<Tensor>>,
    pub stats: RoutingStats,
    /// Activation statistics for `static_width` calibration.
    pub observer: Option<ActivationObserver>,
    /// Every gate decision of the forward, in call order, when `Some` (exports and tests compare
    /// decisions with other implementations).
    pub gates: Option<Vec<GateRecord>>,
    noise_cursor: usize,
    /// Number of valid tokens (the sum of `valid`), read once at the first router call: reading
    /// it moves a value from the device to the host, which waits for the device, so it is not
    /// done again at every call. `valid` is not replaced during a run.
    valid_tokens: Option<f64>,
}

/// One router call's decision, kept in [`RoutingRun::gates`].
#[derive(Debug)]
pub struct GateRecord {
    pub layer: usize,
    pub kind: RouterKind,
    /// `[B, T, groups]`: 1 where the group executes.
    pub execute: Tensor,
    /// `[B, T, groups]`: `logit_execute - logit_skip - offset` (the group executes iff >= 0), for
    /// deterministic gates; `None` for fixed `static_width` masks and training or forced gates.
    pub margin: Option<Tensor>,
}

impl<'a> RoutingRun<'a> {
    pub fn new(routing: &'a Routing, mode: GateMode, valid: Tensor) -> Self {
        Self { routing, mode, valid, noise: None, stats: RoutingStats::default(), observer: None, gates: None, noise_cursor: 0, valid_tokens: None }
    }

    /// Positions the run at the first router call of layer `i` (its noise draws or forced
    /// masks), so that one layer can be run again exactly as in the full forward.
    pub fn seek_layer(&mut self, i: usize) {
        self.noise_cursor = self.routing.layers[..i].iter().map(|l| [&l.layer, &l.attention, &l.ffn].iter().filter(|r| r.is_some()).count()).sum();
    }

    /// Gate of router `r` on input `x: [B, T, hidden]` -> execute mask `[B, T, groups]`.
    pub(crate) fn gate(&mut self, layer: usize, r: &Router, x: &Tensor) -> Tensor {
        let logits = r.logits(x);
        let mask = match &self.mode {
            GateMode::Train { tau } => {
                let tau = *tau;
                let u = match &self.noise {
                    Some(n) => {
                        let u = n[self.noise_cursor].shallow_clone();
                        self.noise_cursor += 1;
                        u
                    }
                    None => logits.rand_like(),
                };
                gumbel_gate(&logits, &u, tau)
            }
            GateMode::Inference => inference_gate(&logits, self.routing.config.logit_offset(r.kind)),
            GateMode::Forced(masks) => {
                let m = masks[self.noise_cursor].shallow_clone();
                self.noise_cursor += 1;
                m
            }
        };
        self.record(layer, r.kind, r.groups, &mask);
        if let (Some(g), GateMode::Inference) = (self.gates.as_mut(), &self.mode) {
            let offset = self.routing.config.logit_offset(r.kind);
            if let Some(last) = g.last_mut() {
                last.margin = Some((logits.select(-1, 0) - logits.select(-1, 1) - offset).detach());
            }
        }
        mask
    }

    pub(crate) fn record(&mut self, layer: usize, kind: RouterKind, groups: i64, mask: &Tensor) {
        let valid = self.valid.unsqueeze(-1);
        let skipped = ((mask.ones_like() - mask) * &valid).sum(Kind::Float);
        let valid_tokens = *self.valid_tokens.get_or_insert_with(|| self.valid.sum(Kind::Float).double_value(&[]));
        let total = valid_tokens * groups as f64;
        let active_fraction = mask.mean_dim(-1, false, Kind::Float);
        self.stats.routers.push(RouterStat { layer, kind, groups, skipped, total, active_fraction });
        if let Some(g) = self.gates.as_mut() {
            g.push(GateRecord { layer, kind, execute: mask.detach(), margin: None });
        }
    }

    /// Masks for layer `i` whose attention router sees `x_attn` (the residual entering the
    /// layer). The FFN router is evaluated later through [`RoutingRun::ffn_mask`].
    pub(crate) fn layer_masks_pre(&mut self, i: usize, x: &Tensor, heads: i64) -> LayerMasks {
        let l = &self.routing.layers[i];
        let cfg = &self.routing.config;
        let (b, t, _) = x.size3().unwrap();
        let mut m = LayerMasks { heads: None, attention_out: None, channels: None, ffn_out: None, layer: None };
        if let Some(r) = &l.layer {
            m.layer = Some(self.gate(i, r, x));
        }
        if let Some(r) = &l.attention {
            let g = self.gate(i, r, x);
            if r.groups == 1 && cfg.variant == Variant::SublayerSkip {
                m.attention_out = Some(g);
            } else {
                m.heads = Some(g.repeat_interleave_self_int(heads / r.groups, Some(-1), None));
            }
        }
        if let Some(s) = &l.static_attention {
            let g = s.view([1, 1, -1]).expand([b, t, s.size()[0]], false);
            self.record(i, RouterKind::Attention, s.size()[0], &g);
            m.heads = Some(g.repeat_interleave_self_int(heads / s.size()[0], Some(-1), None));
        }
        m
    }

    /// FFN masks of layer `i`, router input `x` = residual after attention.
    pub(crate) fn ffn_masks(&mut self, i: usize, x: &Tensor, channels: i64, m: &mut LayerMasks) {
        let l = &self.routing.layers[i];
        let cfg = &self.routing.config;
        let (b, t, _) = x.size3().unwrap();
        if let Some(r) = &l.ffn {
            let g = self.gate(i, r, x);
            if r.groups == 1 && cfg.variant == Variant::SublayerSkip {
                m.ffn_out = Some(g);
            } else {
                m.channels = Some(g.repeat_interleave_self_int(channels / r.groups, Some(-1), None));
            }
        }
        if let Some(s) = &l.static_ffn {
            let g = s.view([1, 1, -1]).expand([b, t, s.size()[0]], false);
            self.record(i, RouterKind::Ffn, s.size()[0], &g);
            m.channels = Some(g.repeat_interleave_self_int(channels / s.size()[0], Some(-1), None));
        }
    }
}

/// Summary numbers of a routed evaluation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SparsityReport {
    /// Skip rate per router kind, averaged over layers.
    pub skip_rate: std::collections::BTreeMap<String, f64>,
    /// Per layer and kind.
    pub per_layer: Vec<std::collections::BTreeMap<String, f64>>,
    /// Executed fraction of the dense model's FLOPs (LM head included), and per layer.
    pub flops_fraction: f64,
    pub flops_fraction_per_layer: Vec<f64>,
}

/// FLOPs per token of each part of one layer at context length `ctx` (multiply-adds x 2).
pub struct LayerFlops {
    pub q: f64,
    pub kv: f64,
    pub o: f64,
    pub attn: f64,
    pub ffn: f64,
}

impl LayerFlops {
    pub fn new(m: &ModelConfig, ctx: f64) -> Self {
        let h = m.hidden_size as f64;
        let qd = (m.num_attention_heads * m.head_dim) as f64;
        let kvd = (m.num_key_value_heads * m.head_dim) as f64;
        Self { q: 2.0 * h * qd, kv: 4.0 * h * kvd, o: 2.0 * qd * h, attn: 4.0 * qd * ctx, ffn: 6.0 * h * m.intermediate_size as f64 }
    }
    pub fn dense(&self) -> f64 {
        self.q + self.kv + self.o + self.attn + self.ffn
    }
}

/// Accumulates deterministic skip statistics over many batches.
#[derive(Debug, Default, Clone)]
pub struct SparsityMeter {
    /// (layer, kind) -> (skipped, total)
    counts: std::collections::BTreeMap<(usize, RouterKind), (f64, f64)>,
    /// Executed and dense FLOPs per layer, and LM-head FLOPs.
    exec: Vec<f64>,
    dense: Vec<f64>,
    head: f64,
}

impl SparsityMeter {
    /// Adds one forward's stats; `valid: [B, T]` real tokens, used for causal context lengths.
    pub fn add(&mut self, m: &ModelConfig, variant: Variant, stats: &RoutingStats, valid: &Tensor) {
        let n_layers = m.num_hidden_layers as usize;
        if self.exec.is_empty() {
            self.exec = vec![0.0; n_layers];
            self.dense = vec![0.0; n_layers];
        }
        for r in &stats.routers {
            let e = self.counts.entry((r.layer, r.kind)).or_insert((0.0, 0.0));
            e.0 += r.skipped.double_value(&[]);
            e.1 += r.total;
        }
        // Token-level FLOPs with each token's causal context (its position + 1).
        let valid = valid.to_device(Device::Cpu).to_kind(Kind::Float);
        let ctx = valid.cumsum(1, Kind::Float);
        let n_valid = valid.sum(Kind::Float).double_value(&[]);
        let mean_ctx = if n_valid > 0.0 { (&ctx * &valid).sum(Kind::Float).double_value(&[]) / n_valid } else { 0.0 };
        let f = LayerFlops::new(m, mean_ctx);
        self.head += n_valid * 2.0 * (m.hidden_size * m.vocab_size) as f64;
        for l in 0..n_layers {
            let active = |kind: RouterKind| -> Option<f64> {
                stats.routers.iter().find(|r| r.layer == l && r.kind == kind).map(|r| {
                    let a = (&r.active_fraction.to_device(Device::Cpu) * &valid).sum(Kind::Float).double_value(&[]);
                    if n_valid > 0.0 { a / n_valid } else { 1.0 }
                })
            };
            let attn_a = active(RouterKind::Attention).unwrap_or(1.0);
            let ffn_a = active(RouterKind::Ffn).unwrap_or(1.0);
            let layer_a = active(RouterKind::Layer).unwrap_or(1.0);
            let exec = match variant {
                Variant::LayerSkip => f.kv + layer_a * (f.q + f.o + f.attn + f.ffn),
                _ => f.kv + attn_a * (f.q + f.o + f.attn) + ffn_a * f.ffn,
            };
            self.exec[l] += n_valid * exec;
            self.dense[l] += n_valid * f.dense();
        }
    }

    pub fn report(&self) -> SparsityReport {
        let mut by_kind: std::collections::BTreeMap<RouterKind, Vec<f64>> = Default::default();
        let n_layers = self.exec.len();
        let mut per_layer = vec![std::collections::BTreeMap::new(); n_layers];
        for ((l, k), (s, t)) in &self.counts {
            let rate = if *t > 0.0 { s / t } else { 0.0 };
            by_kind.entry(*k).or_default().push(rate);
            if *l < n_layers {
                per_layer[*l].insert(k.name().to_string(), rate);
            }
        }
        let skip_rate = by_kind.into_iter().map(|(k, v)| (k.name().to_string(), v.iter().sum::<f64>() / v.len() as f64)).collect();
        let exec: f64 = self.exec.iter().sum::<f64>() + self.head;
        let dense: f64 = self.dense.iter().sum::<f64>() + self.head;
        SparsityReport {
            skip_rate,
            per_layer,
            flops_fraction: if dense > 0.0 { exec / dense } else { 1.0 },
            flops_fraction_per_layer: self.exec.iter().zip(&self.dense).map(|(e, d)| if *d > 0.0 { e / d } else { 1.0 }).collect(),
        }
    }
}

/// Checks a sparsity value given on the command line.
pub fn check_sparsity(s: f64) -> Result<f64> {
    ensure!((0.0..1.0).contains(&s), "sparsity must be in [0, 1), got {s}");
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_gate_is_binary_forward_and_soft_backward() {
        let mut logits = Tensor::randn([4, 7, 3, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let u = Tensor::rand([4, 7, 3, 2], (Kind::Float, Device::Cpu));
        let tau = 0.7;
        let g = gumbel_gate(&logits, &u, tau);
        let vals = Vec::<f32>::try_from(g.detach().view([-1])).unwrap();
        assert!(vals.iter().all(|v| *v == 0.0 || *v == 1.0), "{vals:?}");
        let w = Tensor::randn([4, 7, 3], (Kind::Float, Device::Cpu));
        (&g * &w).sum(Kind::Float).backward();
        let grad_hard = logits.grad().copy();
        logits.zero_grad();
        // The soft relaxation's gradient.
        let eps = 1e-10;
        let gumbel = -((&u + eps).log() * -1.0 + eps).log();
        let soft = ((&logits + gumbel) / tau).softmax(-1, Kind::Float).select(-1, 0);
        (&soft * &w).sum(Kind::Float).backward();
        let diff = (grad_hard - logits.grad()).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
    }

    #[test]
    fn inference_gate_is_deterministic_and_offset_shifts_it() {
        let logits = Tensor::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 0.5, 0.5]).view([1, 1, 3, 2]);
        let a = inference_gate(&logits, 0.0);
        assert_eq!(Vec::<f32>::try_from(a.view([-1])).unwrap(), vec![1.0, 0.0, 1.0]);
        assert!(a.equal(&inference_gate(&logits, 0.0)));
        // A positive offset favours skipping: the tie (0.5, 0.5) now skips.
        assert_eq!(Vec::<f32>::try_from(inference_gate(&logits, 0.1).view([-1])).unwrap(), vec![1.0, 0.0, 0.0]);
        assert_eq!(Vec::<f32>::try_from(inference_gate(&logits, -1.5).view([-1])).unwrap(), vec![1.0, 1.0, 1.0]);
    }

    #[test]
    fn temperature_schedule_hits_its_end_points() {
        let c = RoutingConfig::new(Variant::Wide);
        assert_eq!(c.tau(0, 100), 5.0);
        assert!((c.tau(99, 100) - 0.5).abs() < 1e-12);
        assert!((c.tau(50, 101) - 2.75).abs() < 1e-12);
        assert_eq!(c.tau(500, 100), 0.5);
    }

    #[test]
    fn group_sizes_must_divide() {
        let m = crate::presets::preset("llama-3.1-8b").unwrap();
        let mut c = RoutingConfig::new(Variant::Wide);
        c.target_sparsity = Some(0.5);
        c.ffn_group_size = 100;
        let e = format!("{:#}", c.validate(&m).unwrap_err());
        assert!(e.contains("FFN group size 100 does not divide the intermediate size 14336"), "{e}");
        c.ffn_group_size = 128;
        c.attn_group_size = 3;
        assert!(format!("{:#}", c.validate(&m).unwrap_err()).contains("attention group size 3 does not divide the 32"));
        c.attn_group_size = 4;
        c.target_sparsity = Some(1.0);
        assert!(format!("{:#}", c.validate(&m).unwrap_err()).contains("must be in [0, 1)"));
        c.target_sparsity = Some(0.5);
        c.validate(&m).unwrap();
        assert_eq!(c.routers(&m), vec![(RouterKind::Attention, 8), (RouterKind::Ffn, 112)]);
    }
}
