//! Stage 1 (router calibration: backbone frozen, routers only) and stage 2 (LoRA recovery:
//! LoRA + routers, routers optionally frozen) on the trainer core, and the calibration of the
//! `static_width` baseline (fixed groups chosen by mean activation norm). Outputs a routing
//! checkpoint folder: `routers.safetensors`, `lora.safetensors` (stage 2) and the routing
//! manifest `routing.json`.
use crate::corpus::Split;
use crate::pretrain::{lm_loss_logits, DataConfig};
use crate::recipe;
use crate::trainer::{StepContext, TrainConfig, TrainSummary, TrainTask, Trainer};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};
use wide_core::lora::{Lora, LoraConfig};
use wide_core::routing::{GateMode, RouterKind, Routing, RoutingConfig, RoutingRun, SparsityMeter, SparsityReport, Variant};
use wide_core::safetensors::{self as st, SafetensorsFile};
use wide_core::{parse_device, parse_dtype, ForwardOptions, LlamaModel, ModelConfig, Pretrained};

/// A stage 1 or stage 2 recipe.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CalibrationRecipe {
    pub name: String,
    /// The Hugging Face model folder whose routers are trained.
    pub model_dir: PathBuf,
    pub routing: RoutingConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub output: CalibrationOutput,
    /// Stage 2 only.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    /// Stage 2: the stage 1 folder to start from.
    #[serde(default)]
    pub stage1_dir: Option<PathBuf>,
    /// Stage 2: keep the stage 1 routers fixed.
    #[serde(default)]
    pub freeze_routers: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CalibrationOutput {
    pub dir: PathBuf,
}

impl CalibrationRecipe {
    pub fn load(path: &Path, overrides: &[String]) -> Result<(Self, toml::Table)> {
        let (r, t): (Self, _) = recipe::load(path, overrides)?;
        r.train.validate()?;
        Ok((r, t))
    }

    /// Loads a recipe for one cell of a comparison or sweep, whose overrides set one shared
    /// `routing.target_sparsity`: per-type targets of the shared recipe would override it, so
    /// they are dropped (from the recipe and from the effective table it records).
    pub fn load_shared_target(path: &Path, overrides: &[String]) -> Result<(Self, toml::Table)> {
        let (mut r, mut t) = Self::load(path, overrides)?;
        r.routing.attn_target = None;
        r.routing.ffn_target = None;
        if let Some(rt) = t.get_mut("routing").and_then(|v| v.as_table_mut()) {
            rt.remove("attn_target");
            rt.remove("ffn_target");
        }
        Ok((r, t))
    }
}

/// The routing manifest written next to router (and LoRA) weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoutingManifest {
    pub format: u32,
    pub stage: u32,
    pub routing: RoutingConfig,
    pub model: ModelConfig,
    pub lora: Option<LoraConfig>,
    pub calibration_tokens: u64,
    /// Deterministic skip rates, executed FLOPs fraction and loss on held-out text.
    pub heldout: Option<HeldOut>,
    pub provenance: serde_json::Value,
    pub recipe: toml::Table,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeldOut {
    pub split: String,
    pub tokens: u64,
    pub loss: f64,
    pub perplexity: f64,
    pub sparsity: SparsityReport,
}

/// The model, its routers and (stage 2) LoRA, ready to train or evaluate.
pub struct RoutedModel {
    pub pretrained: Pretrained,
    pub routing: Routing,
    pub router_vs: nn::VarStore,
    pub lora: Option<(Lora, nn::VarStore)>,
}

impl RoutedModel {
    /// Loads `model_dir` and creates fresh routers for `config`.
    pub fn new(model_dir: &Path, config: &RoutingConfig, device: Device, kind: Kind) -> Result<Self> {
        Self::from_pretrained(Pretrained::load(model_dir, device, kind)?, config)
    }

    /// Fresh routers for an already loaded (or randomly initialised) model, which is frozen.
    pub fn from_pretrained(pretrained: Pretrained, config: &RoutingConfig) -> Result<Self> {
        let (device, kind) = (pretrained.model.device, pretrained.model.kind);
        for (_, t) in pretrained.vs.variables() {
            let _ = t.set_requires_grad(false);
        }
        let router_vs = nn::VarStore::new(device);
        let routing = Routing::new(&router_vs.root(), &pretrained.model.config, config, kind)?;
        Ok(Self { pretrained, routing, router_vs, lora: None })
    }

    /// Loads a routing checkpoint folder (stage 1 or 2) onto `model_dir`.
    pub fn load(model_dir: &Path, routing_dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let manifest = read_manifest(routing_dir)?;
        let mut m = Self::new(model_dir, &manifest.routing, device, kind)?;
        check_model_matches(&manifest, &m.pretrained.model.config, routing_dir)?;
        m.load_routers(routing_dir)?;
        if let Some(lc) = &manifest.lora {
            m.attach_lora(lc)?;
            let f = SafetensorsFile::open(&routing_dir.join("lora.safetensors"))
                .with_context(|| format!("{} lists LoRA adapters but has no readable lora.safetensors", routing_dir.display()))?;
            Lora::load(&mut m.pretrained.model, &mut |n| f.read(n))?;
        }
        Ok(m)
    }

    pub fn load_routers(&self, dir: &Path) -> Result<()> {
        let f = SafetensorsFile::open(&dir.join("routers.safetensors"))
            .with_context(|| format!("{} has no readable routers.safetensors (is it a stage 1 folder?)", dir.display()))?;
        self.routing.load_tensors(&mut |n| f.read(n))
    }

    pub fn attach_lora(&mut self, cfg: &LoraConfig) -> Result<()> {
        let vs = nn::VarStore::new(self.pretrained.model.device);
        let lora = Lora::attach(&mut self.pretrained.model, &vs.root(), cfg)?;
        self.lora = Some((lora, vs));
        Ok(())
    }

    pub fn model(&self) -> &LlamaModel {
        &self.pretrained.model
    }

    /// Routed forward of `inputs: [B, T]` with `mode`; returns logits and the run's stats.
    pub fn forward(&self, inputs: &Tensor, mode: GateMode, noise: Option<Vec<Tensor>>) -> Result<(Tensor, wide_core::routing::RoutingStats)> {
        let (b, t) = inputs.size2()?;
        let valid = Tensor::ones([b, t], (Kind::Float, inputs.device()));
        let mut run = RoutingRun::new(&self.routing, mode, valid);
        run.noise = noise;
        let logits = self.pretrained.model.forward_routed(inputs, ForwardOptions::default(), &mut run)?;
        Ok((logits, run.stats))
    }
}

/// The routing configuration of stage 2: stage 1's, whose router weights it loads, with the
/// stage 2 recipe's training settings (targets, `lambda`, temperatures, offset calibration),
/// since stage 2 trains the routers again (unless frozen) and the recipe is where a user sets
/// them. What the weights depend on (variant, routed sublayers, group sizes, rank) must be the
/// same in both, or the error says which differs; the inference offsets stay stage 1's (they
/// go with its weights; stage 2 calibrates them again when it trains the routers).
pub fn stage2_routing(stage1: &RoutingConfig, recipe: &RoutingConfig, dir: &Path) -> Result<RoutingConfig> {
    let (a, b) = (stage1, recipe);
    if (a.attn_group_size, a.ffn_group_size) != (b.attn_group_size, b.ffn_group_size) {
        bail!(
            "routers in {} use attention group size {} and FFN group size {}, the recipe asks for {} and {}",
            dir.display(),
            a.attn_group_size,
            a.ffn_group_size,
            b.attn_group_size,
            b.ffn_group_size
        );
    }
    let shape = |c: &RoutingConfig| {
        [
            ("variant", c.variant.name().to_string()),
            ("sparse_target", format!("{:?}", c.sparse_target).to_lowercase()),
            ("router_rank", c.router_rank.to_string()),
        ]
    };
    let differs: Vec<String> = shape(stage1).into_iter().zip(shape(recipe)).filter(|(a, b)| a.1 != b.1).map(|(a, b)| format!("routing.{} {} there, {} here", a.0, a.1, b.1)).collect();
    if !differs.is_empty() {
        bail!(
            "the stage 1 routers in {} do not fit the recipe's [routing] ({}): set these as stage 1 had them, or calibrate stage 1 again with the recipe's",
            dir.display(),
            differs.join("; ")
        );
    }
    let mut c = stage1.clone();
    c.target_sparsity = recipe.target_sparsity;
    c.attn_target = recipe.attn_target;
    c.ffn_target = recipe.ffn_target;
    c.lambda = recipe.lambda;
    c.tau_start = recipe.tau_start;
    c.tau_end = recipe.tau_end;
    c.calibrate_offsets = recipe.calibrate_offsets;
    c.offset_calibration_sequences = recipe.offset_calibration_sequences;
    Ok(c)
}

fn read_manifest(dir: &Path) -> Result<RoutingManifest> {
    let p = dir.join("routing.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("{} has no routing.json: run `wide calibrate` first (stage 1 files are missing)", dir.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a valid routing manifest", p.display()))
}

fn check_model_matches(m: &RoutingManifest, cfg: &ModelConfig, dir: &Path) -> Result<()> {
    let a = &m.model;
    if (a.hidden_size, a.intermediate_size, a.num_hidden_layers, a.num_attention_heads, a.vocab_size)
        != (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size)
    {
        bail!(
            "routers in {} were trained for another model (hidden {}, intermediate {}, {} layers, {} heads, vocab {}), not this one (hidden {}, intermediate {}, {} layers, {} heads, vocab {})",
            dir.display(),
            a.hidden_size,
            a.intermediate_size,
            a.num_hidden_layers,
            a.num_attention_heads,
            a.vocab_size,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.vocab_size
        );
    }
    Ok(())
}

/// Uniform noise for every router call of a forward, drawn per sample from a generator
/// seeded by (seed, global sample index): identical whatever the batch composition or the
/// number of processes.
pub fn routing_noise(routing: &Routing, model: &ModelConfig, sample_ids: &[u64], seq_len: i64, seed: u64, device: Device) -> Vec<Tensor> {
    let calls: Vec<i64> = (0..model.num_hidden_layers as usize)
        .flat_map(|i| {
            let l = &routing.layers[i];
            [&l.layer, &l.attention, &l.ffn].into_iter().flatten().map(|r| r.groups).collect::<Vec<_>>()
        })
        .collect();
    let per_sample: Vec<Vec<Tensor>> = sample_ids
        .iter()
        .map(|id| {
            tch::manual_seed((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id.wrapping_mul(0xBF58_476D_1CE4_E5B9)) as i64 & i64::MAX);
            calls.iter().map(|g| Tensor::rand([1, seq_len, *g, 2], (Kind::Float, device))).collect()
        })
        .collect();
    (0..calls.len()).map(|c| Tensor::cat(&per_sample.iter().map(|s| &s[c]).collect::<Vec<_>>(), 0)).collect()
}

/// Stage 1 / stage 2 training task.
pub struct RoutingTask {
    pub m: RoutedModel,
    pub seed: u64,
    pub train_routers: bool,
    /// Recompute each layer in the backward pass instead of keeping its activations
    /// (`train.activation_checkpointing`).
    pub activation_checkpointing: bool,
    metrics: BTreeMap<String, (f64, usize)>,
}

impl TrainTask for RoutingTask {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![];
        if self.train_routers {
            v.extend(self.m.routing.tensors().into_iter().filter(|(_, t)| t.requires_grad()));
        }
        if let Some((_, vs)) = &self.m.lora {
            let mut l: Vec<_> = vs.variables().into_iter().collect();
            l.sort_by(|a, b| a.0.cmp(&b.0));
            v.extend(l);
        }
        v
    }

    fn loss(&mut self, batch: &Tensor, ctx: &StepContext) -> Result<Tensor> {
        let l = batch.size()[1] - 1;
        let inputs = batch.narrow(1, 0, l);
        let targets = batch.narrow(1, 1, l);
        let cfg = self.m.routing.config.clone();
        let (mode, noise) = if ctx.training {
            let tau = cfg.tau(ctx.step, ctx.total_steps);
            self.add_metric("tau", tau);
            (GateMode::Train { tau }, Some(routing_noise(&self.m.routing, &self.m.model().config, &ctx.sample_ids, l, self.seed, batch.device())))
        } else {
            (GateMode::Inference, None)
        };
        if let Some((lora, _)) = &self.m.lora {
            lora.set_training(ctx.training);
            if ctx.training && lora.config.dropout > 0.0 {
                // Dropout keyed by the global sample index, whatever the process count: seeded
                // after the gate noise, whose per-sample seeding would otherwise decide it.
                self.seed_layer(ctx, 0);
            }
        }
        let (logits, stats) = self.m.forward(&inputs, mode, noise)?;
        let ce = lm_loss_logits(&logits, &targets);
        self.add_metric("lm_loss", ce.double_value(&[]));
        for k in stats.kinds() {
            let r = stats.skip_rate(k).unwrap().double_value(&[]);
            self.add_metric(&format!("skip_rate_{}", k.name()), r);
        }
        if ctx.training && self.train_routers {
            if let Some(sl) = stats.sparsity_loss(&cfg) {
                self.add_metric("sparsity_loss", sl.double_value(&[]));
                return Ok(ce + sl);
            }
        }
        Ok(ce)
    }

    fn loss_backward(&mut self, batch: &Tensor, ctx: &StepContext, scale: f64) -> Result<f64> {
        if self.activation_checkpointing && ctx.training {
            return self.loss_backward_checkpointed(batch, ctx, scale);
        }
        crate::trainer::backward_scaled(self.loss(batch, ctx)?, scale)
    }

    fn take_metrics(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.metrics).into_iter().map(|(k, (s, n))| (k, s / n as f64)).collect()
    }

    fn fingerprint(&self) -> serde_json::Value {
        serde_json::json!({"model": self.m.model().config, "routing": self.m.routing.config, "lora": self.m.lora.as_ref().map(|l| &l.0.config)})
    }

    fn device(&self) -> Device {
        self.m.model().device
    }
}

impl RoutingTask {
    pub fn new(m: RoutedModel, seed: u64, train_routers: bool) -> Self {
        Self { m, seed, train_routers, activation_checkpointing: false, metrics: BTreeMap::new() }
    }

    /// Seeds the global generator for layer `layer` of this step (LoRA dropout), so that the
    /// checkpointed forward and its recomputation draw the same dropout masks.
    fn seed_layer(&self, ctx: &StepContext, layer: usize) {
        let first = ctx.sample_ids.first().copied().unwrap_or(0);
        let key = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ first.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (layer as u64 + 1).wrapping_mul(0x94D0_49BB_1331_11EB);
        tch::manual_seed((key & i64::MAX as u64) as i64);
    }

    /// Activation-checkpointed training step: a forward without autograd that keeps only each
    /// layer's input, the loss, then from the last layer to the first one layer recomputed
    /// with autograd and back-propagated with the gradient of its output plus the sparsity
    /// loss's coefficient on that layer's skip counts. Gradients equal the plain step's (the
    /// same gate noise is replayed per layer) when LoRA dropout is 0; with dropout each layer's
    /// masks are seeded per layer here and once per step in the plain forward, so the two
    /// draw different (each reproducible) masks.
    fn loss_backward_checkpointed(&mut self, batch: &Tensor, ctx: &StepContext, scale: f64) -> Result<f64> {
        let l = batch.size()[1] - 1;
        let inputs = batch.narrow(1, 0, l);
        let targets = batch.narrow(1, 1, l);
        let cfg = self.m.routing.config.clone();
        if let Some((lora, _)) = &self.m.lora {
            lora.set_training(true);
        }
        let tau = cfg.tau(ctx.step, ctx.total_steps);
        self.add_metric("tau", tau);
        let noise = routing_noise(&self.m.routing, &self.m.model().config, &ctx.sample_ids, l, self.seed, batch.device());
        let model = self.m.model();
        let (b, t) = inputs.size2()?;
        let valid = Tensor::ones([b, t], (Kind::Float, inputs.device()));
        let (x0, stack) = model.begin_layers(&inputs)?;
        let mut metrics: Vec<(String, f64)> = vec![];
        let n = model.layers.len();
        let run_layer = |i: usize, x: &Tensor| {
            let mut run = RoutingRun::new(&self.m.routing, GateMode::Train { tau }, valid.shallow_clone());
            run.noise = Some(noise.iter().map(|u| u.shallow_clone()).collect());
            run.seek_layer(i);
            self.seed_layer(ctx, i);
            let y = model.run_layer(i, x, &stack, Some(&mut run));
            (y, run.stats.routers)
        };
        // Forward without autograd: keep each layer's input.
        let mut layer_inputs = Vec::with_capacity(n);
        let mut stats = wide_core::routing::RoutingStats::default();
        let mut x = x0.detach();
        tch::no_grad(|| {
            for i in 0..n {
                let (y, st) = run_layer(i, &x);
                stats.routers.extend(st);
                layer_inputs.push(std::mem::replace(&mut x, y));
            }
        });
        let last = x.detach().set_requires_grad(true);
        let ce = lm_loss_logits(&model.logits(&model.norm.forward(&last), wide_core::Logits::All), &targets);
        let ce_value = ce.double_value(&[]);
        metrics.push(("lm_loss".to_string(), ce_value));
        for k in stats.kinds() {
            let r = stats.skip_rate(k).unwrap().double_value(&[]);
            metrics.push((format!("skip_rate_{}", k.name()), r));
        }
        // The sparsity loss on stand-ins for the skip counts: its gradient with respect to each
        // router's count is the coefficient that count gets in the layer-wise backward.
        let mut coefficients = vec![0.0; stats.routers.len()];
        let mut total = ce_value;
        if self.train_routers {
            let leaves: Vec<Tensor> = stats.routers.iter().map(|r| r.skipped.detach().set_requires_grad(true)).collect();
            let proxy = wide_core::routing::RoutingStats {
                routers: stats
                    .routers
                    .iter()
                    .zip(&leaves)
                    .map(|(r, leaf)| wide_core::routing::RouterStat { layer: r.layer, kind: r.kind, groups: r.groups, skipped: leaf.shallow_clone(), total: r.total, active_fraction: r.active_fraction.shallow_clone() })
                    .collect(),
            };
            if let Some(sl) = proxy.sparsity_loss(&cfg) {
                let v = sl.double_value(&[]);
                metrics.push(("sparsity_loss".to_string(), v));
                total += v;
                if v.is_finite() {
                    sl.backward();
                    for (c, leaf) in coefficients.iter_mut().zip(&leaves) {
                        let g = leaf.grad();
                        if g.defined() {
                            *c = g.double_value(&[]) * scale;
                        }
                    }
                }
            }
        }
        if !total.is_finite() {
            for (k, v) in metrics {
                self.add_metric(&k, v);
            }
            return Ok(total);
        }
        (ce * scale).f_backward()?;
        let mut grad = last.grad();
        for i in (0..n).rev() {
            let xi = layer_inputs[i].detach().set_requires_grad(i > 0);
            let (y, st) = run_layer(i, &xi);
            let mut objective = (y * &grad).sum(Kind::Float);
            let first = stats.routers.iter().position(|r| r.layer == i).unwrap_or(0);
            for (k, r) in st.iter().enumerate() {
                let c = coefficients.get(first + k).copied().unwrap_or(0.0);
                if c != 0.0 && r.skipped.requires_grad() {
                    objective = objective + &r.skipped * c;
                }
            }
            if objective.requires_grad() {
                objective.f_backward()?;
            }
            if i > 0 {
                grad = xi.grad();
                if !grad.defined() {
                    grad = xi.zeros_like();
                }
            }
            layer_inputs[i] = Tensor::new();
        }
        for (k, v) in metrics {
            self.add_metric(&k, v);
        }
        Ok(total)
    }

    fn add_metric(&mut self, k: &str, v: f64) {
        let e = self.metrics.entry(k.to_string()).or_insert((0.0, 0));
        e.0 += v;
        e.1 += 1;
    }
}

/// Deterministic evaluation of a routed model on a token split: loss, skip rates per router
/// kind and layer, executed FLOPs fraction.
pub fn evaluate_routed(m: &RoutedModel, file: &crate::dataset::TokenFile, seq_len: usize, batch: usize, max_batches: usize) -> Result<HeldOut> {
    let _g = tch::no_grad_guard();
    if let Some((l, _)) = &m.lora {
        l.set_training(false);
    }
    let n = file.num_sequences(seq_len);
    if n == 0 {
        bail!("{} is shorter than one sequence of {seq_len} tokens", file.path.display());
    }
    let mut meter = SparsityMeter::default();
    let (mut sum, mut count) = (0.0, 0u64);
    let mut i = 0u64;
    let device = m.model().device;
    while i < n && (max_batches == 0 || count < (max_batches * batch) as u64) {
        let idx: Vec<u64> = (i..(i + batch as u64).min(n)).collect();
        let b = file.batch(&idx, seq_len).to_device(device);
        let inputs = b.narrow(1, 0, seq_len as i64);
        let targets = b.narrow(1, 1, seq_len as i64);
        let (logits, stats) = m.forward(&inputs, GateMode::Inference, None)?;
        sum += lm_loss_logits(&logits, &targets).double_value(&[]) * idx.len() as f64;
        meter.add(&m.model().config, m.routing.config.variant, &stats, &Tensor::ones(inputs.size(), (Kind::Float, device)));
        count += idx.len() as u64;
        i += batch as u64;
    }
    let loss = sum / count as f64;
    Ok(HeldOut { split: String::new(), tokens: count * seq_len as u64, loss, perplexity: loss.exp(), sparsity: meter.report() })
}

/// Chooses the `static_width` groups of every layer: the groups with the largest mean
/// activation norm over `batches` calibration batches are kept, `1 - target` of each type.
pub fn calibrate_static_width(m: &RoutedModel, file: &crate::dataset::TokenFile, seq_len: usize, batch: usize, sequences: u64, seed: u64) -> Result<()> {
    let _g = tch::no_grad_guard();
    let cfg = &m.routing.config;
    let model = m.model();
    let mc = &model.config;
    let n = file.num_sequences(seq_len);
    if n == 0 {
        bail!("the training split {} holds {} tokens, fewer than one sequence of {seq_len}: static_width needs calibration text to choose its groups", file.path.display(), file.count);
    }
    if sequences == 0 {
        bail!("static_width needs at least one calibration sequence to choose its groups: raise train.tokens");
    }
    let mut order = crate::dataset::SampleOrder::new(n, seed);
    let device = model.device;
    let mut obs = wide_core::routing::ActivationObserver::new(mc, cfg);
    let mut pos = 0u64;
    while pos < sequences {
        let idx: Vec<u64> = (pos..(pos + batch as u64).min(sequences)).map(|p| order.at(p)).collect();
        let b = file.batch(&idx, seq_len).to_device(device);
        let inputs = b.narrow(1, 0, seq_len as i64);
        let valid = Tensor::ones(inputs.size(), (Kind::Float, device));
        let mut run = RoutingRun::new(&m.routing, GateMode::Inference, valid);
        run.observer = Some(obs);
        let _ = model.forward_routed(&inputs, ForwardOptions::default(), &mut run)?;
        obs = run.observer.take().unwrap();
        pos += idx.len() as u64;
    }
    let (ta, tf) = cfg.per_type_targets().unwrap_or((cfg.shared_target(), cfg.shared_target()));
    for (i, l) in m.routing.layers.iter().enumerate() {
        for (mask, scores, target) in [(&l.static_attention, &obs.heads[i], ta), (&l.static_ffn, &obs.channels[i], tf)] {
            let Some(mask) = mask else { continue };
            let g = mask.size()[0];
            let keep = ((1.0 - target) * g as f64).round().max(1.0) as i64;
            let top = scores.topk(keep, 0, true, false).1;
            let new = Tensor::zeros([g], (Kind::Float, Device::Cpu)).index_fill(0, &top, 1.0);
            mask.detach().copy_(&new.to_device(mask.device()));
        }
    }
    Ok(())
}

/// What `wide calibrate` / `wide recover` report.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationReport {
    pub name: String,
    pub stage: u32,
    pub variant: String,
    pub train: Option<TrainSummary>,
    pub heldout: HeldOut,
    pub output_dir: PathBuf,
}

/// Runs stage 1 (no `stage1_dir`) or stage 2 (with it) of a recipe.
pub fn run(recipe: &CalibrationRecipe, table: &toml::Table, resume: bool, provenance: serde_json::Value) -> Result<Option<CalibrationReport>> {
    let stage = if recipe.stage1_dir.is_some() { 2 } else { 1 };
    if stage == 2 && recipe.lora.is_none() {
        bail!("stage 2 needs a [lora] table in the recipe");
    }
    // The data must be tokenized with the model's own tokenizer: use it where the recipe's
    // tokenizer file does not exist yet.
    recipe.train.apply_determinism()?;
    let dist = crate::dist::init()?;
    let tok_model = recipe.model_dir.join("tokenizer.json");
    if dist.is_main() && !recipe.data.tokenizer.exists() && tok_model.exists() {
        if let Some(dir) = recipe.data.tokenizer.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::copy(&tok_model, &recipe.data.tokenizer).with_context(|| format!("copying {}", tok_model.display()))?;
    }
    // Stage 2's routing: checked against stage 1 before any data work.
    let stage2 = match &recipe.stage1_dir {
        Some(dir) => {
            let man = read_manifest(dir)?;
            let c = stage2_routing(&man.routing, &recipe.routing, dir)?;
            c.validate(&man.model)?;
            Some(c)
        }
        None => None,
    };
    // Rank 0 builds or checks the shared data folders; the others open them afterwards.
    let files = dist.main_first(|| recipe.data.prepare())?;
    let train = files.open(Split::Train)?;
    let val = files.open(Split::Validation)?;
    let device = dist.device(parse_device(&recipe.train.device)?)?;
    let kind = parse_dtype(&recipe.train.dtype, device)?;
    tch::manual_seed(recipe.train.seed as i64);
    let mut m = match (&recipe.stage1_dir, stage2) {
        (Some(dir), Some(config)) => {
            let mut m = RoutedModel::load(&recipe.model_dir, dir, device, kind)?;
            m.routing.config = config;
            m
        }
        _ => RoutedModel::new(&recipe.model_dir, &recipe.routing, device, kind)?,
    };
    if tok_model.exists() && crate::dataset::sha256_file(&tok_model)? != crate::dataset::sha256_file(&recipe.data.tokenizer)? {
        bail!(
            "data.tokenizer {} is not the model's tokenizer ({}): the token ids would not match the model",
            recipe.data.tokenizer.display(),
            tok_model.display()
        );
    }
    if (train.vocab_size as i64) > m.model().config.vocab_size {
        bail!("the token files have a vocabulary of {}, larger than the model's {}", train.vocab_size, m.model().config.vocab_size);
    }
    let seq_len = recipe.data.seq_len;
    if seq_len as i64 > m.model().config.max_position_embeddings {
        bail!("data.seq_len {seq_len} is longer than the model's context ({})", m.model().config.max_position_embeddings);
    }
    let out = &recipe.output.dir;
    let seqs = recipe.train.tokens.div_ceil(seq_len as u64);
    let mut summary = None;
    let trains_routers = m.routing.config.variant != Variant::StaticWidth && m.routing.config.variant != Variant::Dense && !recipe.freeze_routers;
    if !(trains_routers || stage == 2) {
        // Nothing to train: rank 0 alone chooses static groups and writes the files.
        dist.finish()?;
        if !dist.is_main() {
            return Ok(None);
        }
    }
    if m.routing.config.variant == Variant::StaticWidth {
        if stage == 1 {
            eprintln!("choosing static_width groups from {} calibration tokens", seqs * seq_len as u64);
            calibrate_static_width(&m, &train, seq_len, recipe.train.micro_batch, seqs, recipe.train.seed)?;
        }
    }
    if stage == 2 {
        m.attach_lora(recipe.lora.as_ref().unwrap())?;
    }
    if !trains_routers {
        for (_, t) in m.routing.tensors() {
            let _ = t.set_requires_grad(false);
        }
    }
    if trains_routers || stage == 2 {
        let mut task = RoutingTask::new(m, recipe.train.seed, trains_routers);
        task.activation_checkpointing = recipe.train.activation_checkpointing;
        // The trainer writes the effective recipe once it has checked the output folder.
        let trainer = Trainer { cfg: recipe.train.clone(), seq_len, out_dir: out.clone(), train: &train, val: Some(&val), effective_recipe: Some(table) };
        let s = trainer.run(&mut task, resume)?;
        // Training is the distributed part; rank 0 evaluates and writes the files alone.
        dist.finish()?;
        if s.interrupted || !dist.is_main() {
            return Ok(None);
        }
        summary = Some(s);
        m = task.m;
    } else {
        // Rank 0 alone is here (see above).
        recipe::write_effective(out, table)?;
    }
    if trains_routers && m.routing.config.calibrate_offsets {
        let n = m.routing.config.offset_calibration_sequences.min(train.num_sequences(seq_len)).max(1);
        let idx: Vec<u64> = (0..n).collect();
        let inputs = train.batch(&idx, seq_len).narrow(1, 0, seq_len as i64).to_device(device);
        let found = calibrate_offsets(&mut m, &inputs)?;
        eprintln!("inference logit offsets calibrated on {n} training sequences: {found:?}");
    }
    let mut heldout = evaluate_routed(&m, &val, seq_len, recipe.train.micro_batch, 0)?;
    heldout.split = "validation".into();
    let report = CalibrationReport { name: recipe.name.clone(), stage, variant: m.routing.config.variant.name().into(), train: summary, heldout: heldout.clone(), output_dir: out.clone() };
    // `routing.json` marks a finished folder: a previous one goes before anything is replaced,
    // and the new one is written last (by save_routing_dir).
    remove_routing_marker(out)?;
    recipe::write_atomic(&out.join("summary.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
    save_routing_dir(&mut m, out, stage, seqs * seq_len as u64, Some(heldout), provenance, table.clone())?;
    Ok(Some(report))
}

/// Removes `dir/routing.json` (the mark of a finished routing folder) if there is one.
fn remove_routing_marker(dir: &Path) -> Result<()> {
    let p = dir.join("routing.json");
    match std::fs::remove_file(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).with_context(|| format!("removing {}", p.display())),
        _ => Ok(()),
    }
}

/// Writes `routers.safetensors`, `lora.safetensors` (when adapters exist) and `routing.json`
/// into `dir`, each through a temporary file. `routing.json` marks the folder finished: a
/// previous one is removed first and the new one written last, so that a folder stopped half
/// way never pairs a manifest with weights it does not describe.
pub fn save_routing_dir(m: &mut RoutedModel, dir: &Path, stage: u32, tokens: u64, heldout: Option<HeldOut>, provenance: serde_json::Value, recipe: toml::Table) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    remove_routing_marker(dir)?;
    let routers: Vec<(String, Tensor)> = m.routing.tensors().into_iter().map(|(n, t)| (n, t.detach())).collect();
    st::write(&dir.join("routers.safetensors"), &routers, &Default::default())?;
    let lora_cfg = m.lora.as_ref().map(|l| l.0.config.clone());
    if lora_cfg.is_some() {
        let t: Vec<(String, Tensor)> = Lora::tensors(&mut m.pretrained.model).into_iter().map(|(n, t)| (n, t.detach())).collect();
        st::write(&dir.join("lora.safetensors"), &t, &Default::default())?;
    }
    let manifest = RoutingManifest {
        format: 1,
        stage,
        routing: m.routing.config.clone(),
        model: m.model().config.clone(),
        lora: lora_cfg,
        calibration_tokens: tokens,
        heldout,
        provenance,
        recipe,
    };
    crate::recipe::write_atomic(&dir.join("routing.json"), serde_json::to_string_pretty(&manifest)?.as_bytes())
}

/// Searches inference logit offsets so that deterministic skip rates on `inputs` reach the
/// recipe's targets: with per-type targets each router kind gets its own offset; with a shared
/// target one offset moves every kind and their average is matched. Bisection (the skip rate
/// grows with the offset). Returns the offsets found.
pub fn calibrate_offsets(m: &mut RoutedModel, inputs: &Tensor) -> Result<BTreeMap<RouterKind, f64>> {
    let _g = tch::no_grad_guard();
    let (_, stats) = m.forward(inputs, GateMode::Inference, None)?;
    let kinds = stats.kinds();
    let cfg = m.routing.config.clone();
    let groups: Vec<(Vec<RouterKind>, f64)> = match cfg.per_type_targets() {
        Some((a, f)) => kinds.iter().map(|k| (vec![*k], if *k == RouterKind::Attention { a } else { f })).collect(),
        None => vec![(kinds.clone(), cfg.shared_target())],
    };
    for (ks, target) in groups {
        let (mut lo, mut hi) = (-30.0f64, 30.0f64);
        for _ in 0..32 {
            let mid = 0.5 * (lo + hi);
            for k in &ks {
                set_offset(&mut m.routing.config, *k, mid);
            }
            let (_, stats) = m.forward(inputs, GateMode::Inference, None)?;
            let rate = ks.iter().map(|k| stats.skip_rate(*k).map(|r| r.double_value(&[])).unwrap_or(0.0)).sum::<f64>() / ks.len() as f64;
            if rate < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let best = 0.5 * (lo + hi);
        for k in &ks {
            set_offset(&mut m.routing.config, *k, best);
        }
    }
    Ok(kinds.iter().map(|k| (*k, m.routing.config.logit_offset(*k))).collect())
}

pub fn set_offset(c: &mut RoutingConfig, kind: RouterKind, v: f64) {
    match kind {
        RouterKind::Attention => c.attn_logit_offset = v,
        RouterKind::Ffn => c.ffn_logit_offset = v,
        RouterKind::Layer => c.layer_logit_offset = v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wide_core::{presets, RandomWeights};

    fn task(variant: Variant, per_type: bool, lora: bool) -> RoutingTask {
        tch::manual_seed(7);
        let mc = presets::preset("tiny").unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = LlamaModel::new(&vs.root(), &mc, &mut RandomWeights { std: 0.1 }, Kind::Float, false).unwrap();
        let mut rc = RoutingConfig::new(variant);
        rc.attn_group_size = 2;
        rc.ffn_group_size = 64;
        if per_type {
            rc.attn_target = Some(0.3);
            rc.ffn_target = Some(0.6);
        } else {
            rc.target_sparsity = Some(0.5);
        }
        let mut m = RoutedModel::from_pretrained(Pretrained { vs, model, tokenizer: None }, &rc).unwrap();
        if lora {
            m.attach_lora(&LoraConfig { dropout: 0.0, ..LoraConfig::default() }).unwrap();
            // Non-zero B so that LoRA changes the output and A gets gradients too.
            for (_, mut t) in m.lora.as_ref().unwrap().1.variables() {
                tch::no_grad(|| {
                    let _ = t.f_add_(&(t.randn_like() * 0.05)).unwrap();
                });
            }
        }
        RoutingTask::new(m, 3, true)
    }

    fn grads(task: &mut RoutingTask, checkpointed: bool) -> (f64, Vec<(String, Tensor)>) {
        task.activation_checkpointing = checkpointed;
        let params = task.parameters();
        for (_, p) in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        tch::manual_seed(11);
        let batch = Tensor::randint(200, [2, 17], (Kind::Int64, Device::Cpu));
        let ctx = StepContext { training: true, step: 3, total_steps: 10, sample_ids: vec![5, 9] };
        let loss = task.loss_backward(&batch, &ctx, 0.5).unwrap();
        (loss, params.into_iter().map(|(n, p)| (n, p.grad().copy())).collect())
    }

    #[test]
    fn stage2_takes_the_recipes_training_settings_on_stage1_routers_of_the_same_shape() {
        let mut s1 = RoutingConfig::new(Variant::Wide);
        s1.target_sparsity = Some(0.5);
        s1.ffn_logit_offset = 1.5;
        let mut r = RoutingConfig::new(Variant::Wide);
        (r.attn_target, r.ffn_target, r.lambda, r.tau_start, r.tau_end) = (Some(0.3), Some(0.6), 5.0, 2.0, 0.1);
        (r.calibrate_offsets, r.offset_calibration_sequences) = (false, 8);
        let c = stage2_routing(&s1, &r, Path::new("s1")).unwrap();
        assert_eq!((c.target_sparsity, c.per_type_targets(), c.lambda, c.tau_start, c.tau_end), (None, Some((0.3, 0.6)), 5.0, 2.0, 0.1));
        assert_eq!((c.calibrate_offsets, c.offset_calibration_sequences), (false, 8));
        assert_eq!(c.ffn_logit_offset, 1.5, "the offsets go with stage 1's weights");
        // What the weights depend on must match.
        let bad = |edit: &dyn Fn(&mut RoutingConfig)| {
            let mut b = r.clone();
            edit(&mut b);
            format!("{:#}", stage2_routing(&s1, &b, Path::new("s1")).unwrap_err())
        };
        let e = bad(&|b| b.router_rank = 16);
        assert!(e.contains("the stage 1 routers in s1 do not fit") && e.contains("routing.router_rank 32 there, 16 here"), "{e}");
        let e = bad(&|b| (b.variant, b.sparse_target) = (Variant::SublayerSkip, wide_core::routing::SparseTarget::Ffn));
        assert!(e.contains("routing.variant wide there, sublayer_skip here; routing.sparse_target all there, ffn here"), "{e}");
        assert!(bad(&|b| b.ffn_group_size = 64).contains("use attention group size 1 and FFN group size 128, the recipe asks for 1 and 64"));
    }

    #[test]
    fn static_width_without_calibration_text_is_an_error() {
        let _rng = crate::rng_lock();
        let m = task(Variant::StaticWidth, false, false).m;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("short.tokens");
        crate::dataset::write_tokens(&p, &[1, 2, 3, 4, 5], crate::dataset::IdDtype::U16, 256, 0, 1).unwrap();
        let short = crate::dataset::TokenFile::open(&p).unwrap();
        let e = format!("{:#}", calibrate_static_width(&m, &short, 8, 2, 4, 0).unwrap_err());
        assert!(e.contains("holds 5 tokens, fewer than one sequence of 8"), "{e}");
        let p = dir.path().join("long.tokens");
        crate::dataset::write_tokens(&p, &(0..100).collect::<Vec<u32>>(), crate::dataset::IdDtype::U16, 256, 0, 1).unwrap();
        let long = crate::dataset::TokenFile::open(&p).unwrap();
        let e = format!("{:#}", calibrate_static_width(&m, &long, 8, 2, 0, 0).unwrap_err());
        assert!(e.contains("raise train.tokens"), "{e}");
        calibrate_static_width(&m, &long, 8, 2, 4, 0).unwrap();
    }

    #[test]
    fn a_routing_folder_whose_save_fails_is_not_marked_finished() {
        let _rng = crate::rng_lock();
        let mut m = task(Variant::Wide, false, false).m;
        let dir = tempfile::tempdir().unwrap();
        let save = |m: &mut RoutedModel| save_routing_dir(m, dir.path(), 1, 0, None, serde_json::json!({}), Default::default());
        save(&mut m).unwrap();
        assert!(dir.path().join("routing.json").exists());
        // The router file cannot be replaced: the old manifest must not stay as if finished.
        std::fs::remove_file(dir.path().join("routers.safetensors")).unwrap();
        std::fs::create_dir_all(dir.path().join("routers.safetensors/x")).unwrap();
        assert!(save(&mut m).is_err());
        assert!(!dir.path().join("routing.json").exists());
        std::fs::remove_dir_all(dir.path().join("routers.safetensors")).unwrap();
        save(&mut m).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, vec!["routers.safetensors", "routing.json"]);
    }

    /// The checkpointed step back-propagates the same router (and LoRA) gradients as the plain
    /// one, sparsity loss included, for every routed variant.
    #[test]
    fn checkpointed_gradients_equal_plain() {
        let _rng = crate::rng_lock(); // the global generator, one test at a time
        for (variant, per_type, lora) in [
            (Variant::Wide, false, false),
            (Variant::Wide, true, false),
            (Variant::SublayerSkip, false, false),
            (Variant::LayerSkip, false, false),
            (Variant::Wide, false, true),
        ] {
            let mut t = task(variant, per_type, lora);
            let (l0, g0) = grads(&mut t, false);
            let (l1, g1) = grads(&mut t, true);
            assert!((l0 - l1).abs() < 1e-5 * l0.abs().max(1.0), "{variant:?}: loss {l0} vs {l1}");
            assert!(!g0.is_empty());
            let mut nonzero = 0;
            for ((n, a), (_, b)) in g0.iter().zip(&g1) {
                assert!(a.defined() && b.defined(), "{variant:?}: {n} has no gradient");
                let scale = a.abs().max().double_value(&[]).max(1e-12);
                let diff = (a - b).abs().max().double_value(&[]);
                assert!(diff <= 1e-4 * scale, "{variant:?} per_type={per_type} lora={lora}: {n} differs by {diff} (max |grad| {scale})");
                if scale > 1e-9 {
                    nonzero += 1;
                }
            }
            assert!(nonzero * 2 >= g0.len(), "{variant:?}: most gradients are zero ({nonzero} of {})", g0.len());
        }
    }
}
