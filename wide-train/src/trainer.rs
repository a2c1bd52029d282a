//! The trainer core shared by every stage: micro-batches with gradient accumulation, AdamW with
//! warm-up + cosine, clipping, NaN/inf stop, periodic evaluation, atomic checkpoints with the
//! data position, resume, SIGTERM/SIGINT checkpoint-and-exit, TensorBoard scalars, a JSONL
//! metrics log and a progress bar.
use crate::dataset::{SampleOrder, TokenFile};
use crate::optim::{AdamW, AdamWConfig, WarmupCosine};
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tch::{Device, Tensor};
use wide_core::safetensors::{self, SafetensorsFile};

/// Where a loss is computed: training or evaluation, the optimizer step, and the global
/// indices of the samples in the batch (random numbers are keyed by these, not by process).
#[derive(Debug, Clone)]
pub struct StepContext {
    pub training: bool,
    pub step: u64,
    pub total_steps: u64,
    pub sample_ids: Vec<u64>,
}

/// What a stage trains: its trainable tensors and its loss on a batch of token sequences.
pub trait TrainTask {
    /// Named trainable parameters (they require grad).
    fn parameters(&self) -> Vec<(String, Tensor)>;
    /// Mean loss of `batch: [b, L + 1]` token ids (inputs `[.., :L]`, targets `[.., 1:]`).
    fn loss(&mut self, batch: &Tensor, ctx: &StepContext) -> Result<Tensor>;
    /// Computes the loss of `batch` and back-propagates `scale * loss` into the parameters'
    /// gradients; returns the (unscaled) loss. When the loss is not finite nothing is
    /// back-propagated. The default runs [`TrainTask::loss`] and one backward pass; a task
    /// may instead recompute activations in pieces (activation checkpointing).
    fn loss_backward(&mut self, batch: &Tensor, ctx: &StepContext, scale: f64) -> Result<f64> {
        backward_scaled(self.loss(batch, ctx)?, scale)
    }
    /// Extra scalars gathered since the last call (logged with the loss), e.g. skip rates.
    fn take_metrics(&mut self) -> Vec<(String, f64)> {
        vec![]
    }
    /// Identity of the model configuration: a resume from a checkpoint of another
    /// configuration is refused.
    fn fingerprint(&self) -> serde_json::Value;
    fn device(&self) -> Device;
}

/// Back-propagates `scale * loss` unless the loss is not finite; returns the loss.
pub fn backward_scaled(loss: Tensor, scale: f64) -> Result<f64> {
    let l = loss.double_value(&[]);
    if l.is_finite() {
        (loss * scale).f_backward()?;
    }
    Ok(l)
}

/// Loop settings (the `[train]` table of a recipe).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    #[serde(default = "one")]
    pub grad_accum: usize,
    /// Training length in tokens (rounded up to whole optimizer steps).
    pub tokens: u64,
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    #[serde(default = "d_warmup")]
    pub warmup_frac: f64,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    #[serde(default = "d_clip")]
    pub grad_clip: f64,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "d_log")]
    pub log_every: u64,
    #[serde(default = "d_eval")]
    pub eval_every: u64,
    #[serde(default = "d_eval_batches")]
    pub eval_batches: usize,
    #[serde(default = "d_ckpt")]
    pub checkpoint_every: u64,
    #[serde(default = "d_auto")]
    pub device: String,
    #[serde(default = "d_auto")]
    pub dtype: String,
    /// Keep only each layer's input during the forward and recompute one layer at a time in
    /// the backward pass (less activation memory for one extra forward), where the stage
    /// supports it (router calibration and LoRA recovery).
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// Deterministic GPU kernels where libtorch has them (runs repeat bit for bit; attention's
    /// backward is slower). Also `WIDE_DETERMINISTIC=1`.
    #[serde(default)]
    pub deterministic: bool,
}

impl TrainConfig {
    /// Applies `deterministic` (or `WIDE_DETERMINISTIC=1`) to this process; call before any GPU
    /// work.
    pub fn apply_determinism(&self) -> Result<()> {
        let on = self.deterministic || wide_kernels::knobs::switch("WIDE_DETERMINISTIC") == Some(true);
        if on {
            if std::env::var_os("CUBLAS_WORKSPACE_CONFIG").is_none() {
                std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8");
            }
            // Without CUDA in this libtorch there is nothing to switch.
            let _ = wide_kernels::shim::set_deterministic(true);
        }
        Ok(())
    }
}
fn one() -> usize {
    1
}
fn d_warmup() -> f64 {
    0.05
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.95
}
fn d_eps() -> f64 {
    1e-8
}
fn d_clip() -> f64 {
    1.0
}
fn d_log() -> u64 {
    10
}
fn d_eval() -> u64 {
    200
}
fn d_eval_batches() -> usize {
    16
}
fn d_ckpt() -> u64 {
    500
}
fn d_auto() -> String {
    "auto".into()
}

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        if self.micro_batch == 0 || self.grad_accum == 0 {
            bail!("train.micro_batch and train.grad_accum must be at least 1");
        }
        if !(self.lr > 0.0) || self.min_lr < 0.0 || self.min_lr > self.lr {
            bail!("need 0 <= train.min_lr <= train.lr and train.lr > 0 (got lr {}, min_lr {})", self.lr, self.min_lr);
        }
        if !(0.0..1.0).contains(&self.warmup_frac) {
            bail!("train.warmup_frac must be in [0, 1), got {}", self.warmup_frac);
        }
        // Intervals in optimizer steps (the loop takes `step % every`; there is no "never").
        for (name, every) in [("log_every", self.log_every), ("eval_every", self.eval_every), ("checkpoint_every", self.checkpoint_every)] {
            if every == 0 {
                bail!("train.{name} must be at least 1 (a number of optimizer steps), got 0");
            }
        }
        // AdamW's bias correction divides by 1 - beta^t.
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                bail!("train.{name} must be in [0, 1), got {beta}");
            }
        }
        Ok(())
    }
    pub fn tokens_per_step(&self, seq_len: usize) -> u64 {
        (self.micro_batch * self.grad_accum * seq_len) as u64
    }
    pub fn total_steps(&self, seq_len: usize) -> u64 {
        self.tokens.div_ceil(self.tokens_per_step(seq_len)).max(1)
    }
}

/// Trainer state saved with every checkpoint. `samples` is the global data position (samples
/// consumed), which stays meaningful when the number of processes changes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u64,
    pub samples: u64,
    pub tokens: u64,
    pub seq_len: usize,
    pub fingerprint: serde_json::Value,
    pub train_config: TrainConfig,
    /// Training sequences in the data (the sample order is a permutation of them); absent in
    /// checkpoints written before it was recorded.
    #[serde(default)]
    pub train_sequences: Option<u64>,
    pub last_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    pub elapsed_seconds: f64,
}

/// Result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    pub steps: u64,
    pub tokens: u64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub final_train_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    pub interrupted: bool,
    pub checkpoint: PathBuf,
}

/// Mean loss over the first `max_batches` batches of `file` in order (no shuffling).
pub fn evaluate(task: &mut dyn TrainTask, file: &TokenFile, seq_len: usize, batch: usize, max_batches: usize) -> Result<f64> {
    let (sum, count) = evaluate_shard(task, file, seq_len, batch, max_batches, 0, 1)?;
    Ok(sum / count as f64)
}

/// [`evaluate`]'s batches `rank, rank + world, ...`: (sum of sequence losses, sequences).
fn evaluate_shard(task: &mut dyn TrainTask, file: &TokenFile, seq_len: usize, batch: usize, max_batches: usize, rank: usize, world: usize) -> Result<(f64, usize)> {
    let _g = tch::no_grad_guard();
    let n = file.num_sequences(seq_len);
    if n == 0 {
        bail!("{} holds {} tokens, fewer than one sequence of {seq_len}", file.path.display(), file.count);
    }
    let (mut sum, mut count) = (0.0, 0usize);
    let mut i = 0u64;
    let mut k = 0usize;
    while i < n && (max_batches == 0 || k < max_batches) {
        if k % world == rank {
            let idx: Vec<u64> = (i..(i + batch as u64).min(n)).collect();
            let b = file.batch(&idx, seq_len).to_device(task.device());
            let ctx = StepContext { training: false, step: 0, total_steps: 0, sample_ids: idx.clone() };
            let l = task.loss(&b, &ctx)?.double_value(&[]);
            sum += l * idx.len() as f64;
            count += idx.len();
        }
        i += batch as u64;
        k += 1;
    }
    Ok((sum, count))
}

/// [`evaluate`] split over the ranks of a distributed run (the same mean on every rank).
pub fn evaluate_distributed(task: &mut dyn TrainTask, file: &TokenFile, seq_len: usize, batch: usize, max_batches: usize) -> Result<f64> {
    let d = crate::dist::current();
    let (sum, count) = evaluate_shard(task, file, seq_len, batch, max_batches, d.rank, d.world)?;
    let mut v = [sum, count as f64];
    d.all_reduce_f64(&mut v, crate::dist::Reduce::Sum)?;
    Ok(v[0] / v[1])
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "unknown panic".into())
}

/// Runs `f`, turning a libtorch panic into an error (out-of-memory gets the one-line advice).
fn guarded<T>(cfg: &TrainConfig, seq_len: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // libtorch errors arrive as panics from tch; keep the default hook from printing them (the
    // caller prints one line).
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    match r {
        Ok(r) => r,
        Err(p) => {
            let msg = panic_message(p);
            if msg.contains("out of memory") {
                bail!(
                    "GPU out of memory with train.micro_batch {} x data.seq_len {seq_len}: lower train.micro_batch (and raise train.grad_accum to keep the batch) or data.seq_len",
                    cfg.micro_batch
                );
            }
            Err(anyhow!("libtorch error: {}", msg.lines().next().unwrap_or("")))
        }
    }
}

/// A training run writing into `out_dir`: `checkpoints/`, `tb/`, `metrics.jsonl`, and
/// `recipe.effective.toml` when `effective_recipe` is given.
pub struct Trainer<'a> {
    pub cfg: TrainConfig,
    pub seq_len: usize,
    pub out_dir: PathBuf,
    pub train: &'a TokenFile,
    pub val: Option<&'a TokenFile>,
    /// The effective recipe, written by rank 0 only once the output folder has been checked
    /// (a new run into a folder without a run, or an accepted resume), so that a refused run
    /// never overwrites the recipe of the run already there.
    pub effective_recipe: Option<&'a toml::Table>,
}

const LATEST: &str = "latest";

/// Where a checkpoint folder is moved while a new one of the same step replaces it.
fn aside_path(dir: &Path) -> PathBuf {
    dir.with_file_name(format!(".{}.old", dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()))
}

pub fn latest_checkpoint(out_dir: &Path) -> Option<PathBuf> {
    let name = std::fs::read_to_string(out_dir.join("checkpoints").join(LATEST)).ok()?;
    let p = out_dir.join("checkpoints").join(name.trim());
    if p.join("trainer_state.json").exists() {
        return Some(p);
    }
    // Stopped while the folder was being replaced: the old one is complete.
    let aside = aside_path(&p);
    aside.join("trainer_state.json").exists().then_some(aside)
}

/// The settings a resumed run must share with its checkpoint: they fix the data order, the
/// batches, the training length and the optimizer's schedule and update, so a change would
/// silently give a run that neither recipe describes. Returns one line per difference.
fn resume_differences(saved: &TrainConfig, saved_sequences: Option<u64>, now: &TrainConfig, sequences: u64) -> Vec<String> {
    // Debug formatting of f64 round-trips, so equal strings are equal values.
    let fields = [
        ("seed", format!("{:?}", saved.seed), format!("{:?}", now.seed)),
        ("micro_batch", format!("{:?}", saved.micro_batch), format!("{:?}", now.micro_batch)),
        ("grad_accum", format!("{:?}", saved.grad_accum), format!("{:?}", now.grad_accum)),
        ("tokens", format!("{:?}", saved.tokens), format!("{:?}", now.tokens)),
        ("lr", format!("{:?}", saved.lr), format!("{:?}", now.lr)),
        ("min_lr", format!("{:?}", saved.min_lr), format!("{:?}", now.min_lr)),
        ("warmup_frac", format!("{:?}", saved.warmup_frac), format!("{:?}", now.warmup_frac)),
        ("weight_decay", format!("{:?}", saved.weight_decay), format!("{:?}", now.weight_decay)),
        ("beta1", format!("{:?}", saved.beta1), format!("{:?}", now.beta1)),
        ("beta2", format!("{:?}", saved.beta2), format!("{:?}", now.beta2)),
    ];
    let mut d: Vec<String> = fields.into_iter().filter(|(_, a, b)| a != b).map(|(n, a, b)| format!("train.{n} {a} there, {b} here")).collect();
    if let Some(s) = saved_sequences.filter(|s| *s != sequences) {
        d.push(format!("{s} training sequences there, {sequences} here (the training data changed)"));
    }
    d
}

/// The error of a step whose loss or gradient norm is not finite: nothing of it was applied.
fn not_finite(what: &str, value: f64, step: u64, checkpoint: &Path) -> anyhow::Error {
    anyhow!(
        "the {what} became {value} at step {step}; stopping. The last good checkpoint is {} (lower train.lr or check the data)",
        if checkpoint.as_os_str().is_empty() { "none yet".to_string() } else { checkpoint.display().to_string() }
    )
}

impl Trainer<'_> {
    /// Rank 0 writes the checkpoint; the others learn its path.
    fn checkpoint(&self, task: &dyn TrainTask, opt: &AdamW, state: &TrainerState) -> Result<PathBuf> {
        crate::dist::progress();
        let dir = if crate::dist::current().is_main() {
            self.save_checkpoint(task, opt, state)?
        } else {
            self.out_dir.join("checkpoints").join(format!("step-{:07}", state.step))
        };
        crate::dist::progress();
        Ok(dir)
    }

    fn save_checkpoint(&self, task: &dyn TrainTask, opt: &AdamW, state: &TrainerState) -> Result<PathBuf> {
        let root = self.out_dir.join("checkpoints");
        std::fs::create_dir_all(&root)?;
        let name = format!("step-{:07}", state.step);
        let dir = root.join(&name);
        let tmp = safetensors::tmp_path(&dir);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir_all(&tmp)?;
        let params: Vec<(String, Tensor)> = task.parameters().into_iter().map(|(n, t)| (n, t.detach())).collect();
        safetensors::write(&tmp.join("trainable.safetensors"), &params, &Default::default())?;
        opt.save(&tmp.join("optimizer.safetensors"))?;
        std::fs::write(tmp.join("trainer_state.json"), serde_json::to_string_pretty(state)?)?;
        // A folder of this step already there (left by a run stopped before it moved `latest`
        // on) is moved aside, and removed only once the new one is in place and named.
        let aside = aside_path(&dir);
        if aside.exists() {
            std::fs::remove_dir_all(&aside)?;
        }
        let replaced = dir.exists();
        if replaced {
            std::fs::rename(&dir, &aside)?;
        }
        std::fs::rename(&tmp, &dir)?;
        let latest_tmp = root.join(".latest.tmp");
        std::fs::write(&latest_tmp, &name)?;
        std::fs::rename(&latest_tmp, root.join(LATEST))?;
        if replaced {
            std::fs::remove_dir_all(&aside)?;
        }
        // Keep the newest two checkpoints.
        let mut all: Vec<_> = std::fs::read_dir(&root)?.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("step-")).collect();
        all.sort();
        for old in all.iter().rev().skip(2) {
            let _ = std::fs::remove_dir_all(root.join(old));
        }
        Ok(dir)
    }

    fn restore(&self, task: &mut dyn TrainTask, opt: &mut AdamW, dir: &Path) -> Result<TrainerState> {
        let state: TrainerState = serde_json::from_str(&std::fs::read_to_string(dir.join("trainer_state.json"))?)
            .with_context(|| format!("{} has a corrupt trainer_state.json", dir.display()))?;
        if state.fingerprint != task.fingerprint() {
            bail!(
                "checkpoint {} was made with another model configuration ({}), not this one ({}); resume with the recipe that made it, or start a new run in another output folder",
                dir.display(),
                state.fingerprint,
                task.fingerprint()
            );
        }
        if state.seq_len != self.seq_len {
            bail!("checkpoint {} trained with seq_len {}, this run uses {}", dir.display(), state.seq_len, self.seq_len);
        }
        let differs = resume_differences(&state.train_config, state.train_sequences, &self.cfg, self.train.num_sequences(self.seq_len));
        if !differs.is_empty() {
            bail!(
                "checkpoint {} was trained with other settings ({}); resume with the settings that made it, or start a new run in another output folder",
                dir.display(),
                differs.join("; ")
            );
        }
        let f = SafetensorsFile::open(&dir.join("trainable.safetensors"))?;
        let _g = tch::no_grad_guard();
        for (name, p) in task.parameters() {
            let t = f.read(&name).with_context(|| format!("checkpoint {} lacks {name}", dir.display()))?;
            if t.size() != p.size() {
                bail!("checkpoint tensor {name} has shape {:?}, the model {:?}", t.size(), p.size());
            }
            p.detach().copy_(&t);
        }
        opt.load(&dir.join("optimizer.safetensors"))?;
        Ok(state)
    }

    /// Trains to the configured number of tokens (resuming from the latest checkpoint when
    /// `resume`), evaluating and checkpointing along the way.
    pub fn run(&self, task: &mut dyn TrainTask, resume: bool) -> Result<TrainSummary> {
        self.cfg.validate()?;
        let cfg = &self.cfg;
        let seq_len = self.seq_len;
        let dist = crate::dist::current();
        let main = dist.is_main();
        if cfg.grad_accum % dist.world != 0 {
            bail!(
                "train.grad_accum {} (micro-batches per optimizer step over all processes) is not a multiple of the {} processes: make it a multiple so that every process runs the same number",
                cfg.grad_accum,
                dist.world
            );
        }
        let n_seq = self.train.num_sequences(seq_len);
        if n_seq == 0 {
            bail!("the training split has {} tokens, fewer than one sequence of {seq_len}", self.train.count);
        }
        if main {
            std::fs::create_dir_all(&self.out_dir).with_context(|| format!("creating {}", self.out_dir.display()))?;
        }
        let total_steps = cfg.total_steps(seq_len);
        let sched = WarmupCosine { lr: cfg.lr, min_lr: cfg.min_lr, warmup: (cfg.warmup_frac * total_steps as f64).round() as u64, total: total_steps };
        let opt_cfg = AdamWConfig { lr: cfg.lr, beta1: cfg.beta1, beta2: cfg.beta2, eps: cfg.eps, weight_decay: cfg.weight_decay };
        let mut opt = AdamW::new(task.parameters(), opt_cfg);
        let mut state = TrainerState {
            step: 0,
            samples: 0,
            tokens: 0,
            seq_len,
            fingerprint: task.fingerprint(),
            train_config: cfg.clone(),
            train_sequences: Some(n_seq),
            last_loss: None,
            last_val_loss: None,
            elapsed_seconds: 0.0,
        };
        let metrics_path = self.out_dir.join("metrics.jsonl");
        // The step of the newest checkpoint on disk (an interrupt right after it writes none).
        let mut saved_step = None;
        match (resume, latest_checkpoint(&self.out_dir)) {
            (true, Some(dir)) => {
                state = self.restore(task, &mut opt, &dir)?;
                // The settings that matter are equal (checked); the others (logging, device,
                // dtype, ...) are this run's.
                state.train_config = cfg.clone();
                state.train_sequences = Some(n_seq);
                saved_step = Some(state.step);
                if main {
                    eprintln!("resumed from {} at step {} ({} samples seen)", dir.display(), state.step, state.samples);
                    truncate_metrics(&metrics_path, state.step)?;
                }
            }
            (true, None) => bail!("--resume: {} has no checkpoint to resume from", self.out_dir.display()),
            (false, Some(dir)) => bail!(
                "{} already holds a training run (checkpoint {}); pass --resume to continue it, or choose another output folder",
                self.out_dir.display(),
                dir.display()
            ),
            (false, None) => {
                if main {
                    let _ = std::fs::remove_file(&metrics_path);
                }
            }
        }
        if main {
            if let Some(t) = self.effective_recipe {
                crate::recipe::write_effective(&self.out_dir, t)?;
            }
        }
        // Every rank starts from rank 0's parameters (and has checked the output folder before
        // rank 0 writes into it).
        let params: Vec<Tensor> = task.parameters().into_iter().map(|(_, t)| t).collect();
        if dist.is_distributed() {
            dist.broadcast_from_main(&params)?;
            if main {
                eprintln!("data-parallel over {} processes: {} micro-batches of {} per process per step", dist.world, cfg.grad_accum / dist.world, cfg.micro_batch);
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            signal_hook::flag::register(sig, Arc::clone(&stop)).context("installing signal handlers")?;
        }
        let mut tb = main.then(|| tensorboard_rs::summary_writer::SummaryWriter::new(self.out_dir.join("tb")));
        let mut metrics = if main { Some(std::fs::OpenOptions::new().create(true).append(true).open(&metrics_path)?) } else { None };
        let mut order = SampleOrder::new(n_seq, cfg.seed);
        let device = task.device();
        let pb = crate::progress::bar(total_steps, "train");
        if !main {
            pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        pb.set_position(state.step);
        let started = std::time::Instant::now();
        let elapsed_before = state.elapsed_seconds;
        let tokens_at_start = state.tokens;
        let mut window = (std::time::Instant::now(), state.tokens);
        let mut checkpoint = latest_checkpoint(&self.out_dir).unwrap_or_default();
        let mut interrupted = false;
        let tokens_per_step = cfg.tokens_per_step(seq_len);
        let stop_after: Option<u64> = wide_kernels::knobs::int("WIDE_STOP_AFTER_STEP", 0..=i64::MAX, "optimizer steps").map(|s| s as u64);
        while state.step < total_steps {
            crate::dist::progress();
            crate::dist::inject_fault(state.step);
            let stop_now = stop.load(Ordering::SeqCst) || stop_after.is_some_and(|s| state.step >= s);
            if dist.any(stop_now)? {
                interrupted = true;
                break;
            }
            let lr = sched.at(state.step);
            // This process's share of the step: micro-batch k of grad_accum goes to rank
            // k % world; the union over ranks is the single-process step.
            let shard = crate::dist::shard_positions(state.samples, cfg.micro_batch, cfg.grad_accum, dist.rank, dist.world);
            let local_loss = guarded(cfg, seq_len, || {
                opt.zero_grad();
                let mut total = 0.0;
                for positions in shard {
                    let idx: Vec<u64> = positions.iter().map(|p| order.at(*p)).collect();
                    let batch = self.train.batch(&idx, seq_len).to_device(device);
                    let ctx = StepContext { training: true, step: state.step, total_steps, sample_ids: positions };
                    let l = task.loss_backward(&batch, &ctx, 1.0 / cfg.grad_accum as f64)?;
                    total += l / cfg.grad_accum as f64;
                    if !l.is_finite() {
                        // The reduced loss below is then not finite on every rank, which stops
                        // them all at the same step.
                        break;
                    }
                }
                Ok(total)
            })?;
            state.samples += (cfg.micro_batch * cfg.grad_accum) as u64;
            let mut reduced = [local_loss];
            dist.all_reduce_f64(&mut reduced, crate::dist::Reduce::Sum)?;
            let loss = reduced[0];
            if !loss.is_finite() {
                return Err(not_finite("loss", loss, state.step, &checkpoint));
            }
            dist.all_reduce_grads(&params)?;
            let grad_norm = opt.clip_grad_norm(cfg.grad_clip);
            // A finite loss can still have an infinite or NaN gradient; the update would write
            // it into the weights and Adam's moments. The reduced gradients, hence the norm, are
            // the same on every rank: they all stop here.
            if !grad_norm.is_finite() {
                return Err(not_finite("gradient norm", grad_norm, state.step, &checkpoint));
            }
            opt.step(lr);
            state.step += 1;
            state.tokens += tokens_per_step;
            state.last_loss = Some(loss);
            pb.set_position(state.step);
            if state.step % cfg.log_every == 0 || state.step == total_steps {
                let dt = window.0.elapsed().as_secs_f64();
                let tps = (state.tokens - window.1) as f64 / dt.max(1e-9);
                window = (std::time::Instant::now(), state.tokens);
                pb.set_message(format!("loss {loss:.4} lr {lr:.2e} {tps:.0} tok/s"));
                if pb.is_hidden() && main {
                    eprintln!("step {}/{total_steps} loss {loss:.4} lr {lr:.2e} grad-norm {grad_norm:.3} {tps:.0} tokens/s", state.step);
                }
                let s = state.step as usize;
                let task_metrics = dist.mean_metrics(task.take_metrics())?;
                if let (Some(tb), Some(metrics)) = (tb.as_mut(), metrics.as_mut()) {
                    tb.add_scalar("train/loss", loss as f32, s);
                    tb.add_scalar("train/lr", lr as f32, s);
                    tb.add_scalar("train/grad_norm", grad_norm as f32, s);
                    tb.add_scalar("train/tokens_per_second", tps as f32, s);
                    let mut line = serde_json::json!({"step": state.step, "tokens": state.tokens, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_second": tps});
                    for (k, v) in task_metrics {
                        tb.add_scalar(&format!("train/{k}"), v as f32, s);
                        line[k] = v.into();
                    }
                    writeln!(metrics, "{line}")?;
                }
            }
            let last = state.step == total_steps;
            if let Some(val) = self.val {
                if state.step % cfg.eval_every == 0 || last {
                    let _ = task.take_metrics();
                    let vl = guarded(cfg, seq_len, || evaluate_distributed(task, val, seq_len, cfg.micro_batch, cfg.eval_batches))?;
                    let _ = task.take_metrics();
                    state.last_val_loss = Some(vl);
                    if let (Some(tb), Some(metrics)) = (tb.as_mut(), metrics.as_mut()) {
                        tb.add_scalar("val/loss", vl as f32, state.step as usize);
                        writeln!(metrics, "{}", serde_json::json!({"step": state.step, "tokens": state.tokens, "val_loss": vl}))?;
                    }
                    if pb.is_hidden() && main {
                        eprintln!("step {} validation loss {vl:.4} (perplexity {:.2})", state.step, vl.exp());
                    }
                }
            }
            if state.step % cfg.checkpoint_every == 0 || last {
                state.elapsed_seconds = elapsed_before + started.elapsed().as_secs_f64();
                checkpoint = self.checkpoint(task, &opt, &state)?;
                saved_step = Some(state.step);
            }
        }
        pb.finish_and_clear();
        if let Some(tb) = tb.as_mut() {
            tb.flush();
        }
        state.elapsed_seconds = elapsed_before + started.elapsed().as_secs_f64();
        if interrupted {
            if saved_step != Some(state.step) {
                checkpoint = self.checkpoint(task, &opt, &state)?;
            }
            if main {
                eprintln!("stopped by signal at step {}; checkpoint {} written; rerun with --resume to continue", state.step, checkpoint.display());
            }
        }
        let secs = started.elapsed().as_secs_f64();
        Ok(TrainSummary {
            steps: state.step,
            tokens: state.tokens,
            seconds: state.elapsed_seconds,
            tokens_per_second: (state.tokens - tokens_at_start) as f64 / secs.max(1e-9),
            final_train_loss: state.last_loss,
            final_val_loss: state.last_val_loss,
            interrupted,
            checkpoint,
        })
    }
}

/// Drops metrics lines past `step` (a resumed run rewrites them).
fn truncate_metrics(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["step"].as_u64()).is_some_and(|s| s <= step))
        .collect();
    std::fs::write(path, kept.join("\n") + if kept.is_empty() { "" } else { "\n" })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{write_tokens, IdDtype};
    use std::cell::Cell;

    /// One trained vector pulled towards the batch's mean token id; with `sqrt` the loss is
    /// `sum(sqrt(w))` at `w = 0`: finite, with an infinite gradient. Counts `parameters()` calls
    /// (one per checkpoint written, after the two of the start).
    struct Toy {
        w: Tensor,
        sqrt: bool,
        calls: Cell<usize>,
    }

    impl Toy {
        fn new(sqrt: bool) -> Self {
            Self { w: Tensor::zeros([4], (tch::Kind::Float, Device::Cpu)).set_requires_grad(true), sqrt, calls: Cell::new(0) }
        }
    }

    impl TrainTask for Toy {
        fn parameters(&self) -> Vec<(String, Tensor)> {
            self.calls.set(self.calls.get() + 1);
            vec![("w".into(), self.w.shallow_clone())]
        }
        fn loss(&mut self, batch: &Tensor, _ctx: &StepContext) -> Result<Tensor> {
            if self.sqrt {
                return Ok(self.w.sqrt().sum(tch::Kind::Float));
            }
            let target = batch.to_kind(tch::Kind::Float).mean(tch::Kind::Float) / 50.0;
            Ok((&self.w - target).square().sum(tch::Kind::Float))
        }
        fn fingerprint(&self) -> serde_json::Value {
            serde_json::json!({"toy": 4})
        }
        fn device(&self) -> Device {
            Device::Cpu
        }
    }

    /// 4 steps of 2 sequences of 8 tokens; `extra` (TOML) overrides.
    fn cfg(extra: &str) -> TrainConfig {
        let mut t: toml::Table = "micro_batch = 2\ntokens = 64\nlr = 0.1\nlog_every = 1\neval_every = 1\ncheckpoint_every = 2".parse().unwrap();
        t.extend(extra.parse::<toml::Table>().unwrap());
        toml::Value::Table(t).try_into().unwrap()
    }

    fn tokens(dir: &Path, n: u32) -> TokenFile {
        let p = dir.join(format!("t{n}.tokens"));
        write_tokens(&p, &(0..n).map(|i| i % 50).collect::<Vec<_>>(), IdDtype::U16, 50, 0, 1).unwrap();
        TokenFile::open(&p).unwrap()
    }

    fn run(out: &Path, cfg: TrainConfig, train: &TokenFile, task: &mut Toy, resume: bool, recipe: Option<&toml::Table>) -> Result<TrainSummary> {
        Trainer { cfg, seq_len: 8, out_dir: out.to_path_buf(), train, val: None, effective_recipe: recipe }.run(task, resume)
    }

    /// `WIDE_STOP_AFTER_STEP` is read from the environment of the process: one test at a time.
    fn env_lock() -> std::sync::MutexGuard<'static, ()> {
        static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
        L.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn zero_intervals_and_betas_outside_0_1_are_refused() {
        for (extra, want) in [
            ("log_every = 0", "train.log_every must be at least 1"),
            ("eval_every = 0", "train.eval_every must be at least 1"),
            ("checkpoint_every = 0", "train.checkpoint_every must be at least 1"),
            ("beta1 = 1.0", "train.beta1 must be in [0, 1), got 1"),
            ("beta2 = -0.5", "train.beta2 must be in [0, 1), got -0.5"),
        ] {
            let c: TrainConfig = toml::from_str(&format!("micro_batch = 2\ntokens = 64\nlr = 0.1\n{extra}")).unwrap();
            let e = format!("{:#}", c.validate().unwrap_err());
            assert!(e.contains(want), "{extra}: {e}");
        }
        assert!(cfg("").validate().is_ok());
    }

    #[test]
    fn resume_refuses_other_settings_and_a_refused_run_keeps_the_recipe() {
        let _l = env_lock();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let train = tokens(dir.path(), 200);
        let first: toml::Table = "name = \"first\"".parse().unwrap();
        let second: toml::Table = "name = \"second\"".parse().unwrap();
        run(&out, cfg(""), &train, &mut Toy::new(false), false, Some(&first)).unwrap();
        let recipe = || std::fs::read_to_string(out.join("recipe.effective.toml")).unwrap();
        assert!(recipe().contains("first"));
        // A new run over it is refused before anything is written.
        let e = format!("{:#}", run(&out, cfg(""), &train, &mut Toy::new(false), false, Some(&second)).unwrap_err());
        assert!(e.contains("already holds a training run"), "{e}");
        assert!(recipe().contains("first"));
        // Settings that change the run are refused, all of them named.
        let e = format!("{:#}", run(&out, cfg("lr = 0.2\nseed = 3\nbeta2 = 0.9"), &train, &mut Toy::new(false), true, Some(&second)).unwrap_err());
        assert!(e.contains("was trained with other settings") && e.contains("start a new run in another output folder"), "{e}");
        assert!(e.contains("train.lr 0.1 there, 0.2 here") && e.contains("train.seed 0 there, 3 here") && e.contains("train.beta2 0.95 there, 0.9 here"), "{e}");
        assert!(recipe().contains("first"));
        let e = format!("{:#}", run(&out, cfg(""), &tokens(dir.path(), 400), &mut Toy::new(false), true, None).unwrap_err());
        assert!(e.contains("24 training sequences there, 49 here"), "{e}");
        // Logging and the like may change.
        run(&out, cfg("log_every = 5\ndevice = \"cpu\""), &train, &mut Toy::new(false), true, Some(&second)).unwrap();
        assert!(recipe().contains("second"));
    }

    #[test]
    fn a_non_finite_gradient_stops_before_the_update() {
        let _l = env_lock();
        let dir = tempfile::tempdir().unwrap();
        let train = tokens(dir.path(), 200);
        let mut toy = Toy::new(true);
        let e = format!("{:#}", run(&dir.path().join("run"), cfg(""), &train, &mut toy, false, None).unwrap_err());
        assert!(e.contains("the gradient norm became inf at step 0; stopping. The last good checkpoint is none yet"), "{e}");
        assert_eq!(Vec::<f32>::try_from(&toy.w.detach()).unwrap(), vec![0.0; 4], "the weights must not be updated");
    }

    #[test]
    fn an_interrupt_right_after_a_checkpoint_writes_it_once() {
        let _l = env_lock();
        let dir = tempfile::tempdir().unwrap();
        let train = tokens(dir.path(), 200);
        std::env::set_var("WIDE_STOP_AFTER_STEP", "2");
        // Stopped at step 2 just after its scheduled checkpoint, and (for comparison) with none
        // scheduled there: one checkpoint each.
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let mut ta = Toy::new(false);
        let sa = run(&a, cfg(""), &train, &mut ta, false, None);
        let mut tb = Toy::new(false);
        let sb = run(&b, cfg("checkpoint_every = 3"), &train, &mut tb, false, None);
        // Resumed and stopped again at once: nothing is written.
        let state = a.join("checkpoints/step-0000002/trainer_state.json");
        let before = std::fs::read_to_string(&state).unwrap();
        let sr = run(&a, cfg(""), &train, &mut Toy::new(false), true, None);
        std::env::remove_var("WIDE_STOP_AFTER_STEP");
        assert!(sa.unwrap().interrupted && sb.unwrap().interrupted && sr.unwrap().interrupted);
        assert_eq!(ta.calls.get(), tb.calls.get(), "the interrupted run wrote its step-2 checkpoint twice");
        assert_eq!(std::fs::read_to_string(&state).unwrap(), before);
        // Finish; then pretend a stop came before `latest` moved from step 2 to step 4: step 4 is
        // written again, replacing the folder there.
        run(&a, cfg(""), &train, &mut Toy::new(false), true, None).unwrap();
        let root = a.join("checkpoints");
        std::fs::write(root.join(LATEST), "step-0000002").unwrap();
        run(&a, cfg(""), &train, &mut Toy::new(false), true, None).unwrap();
        assert_eq!(latest_checkpoint(&a).unwrap(), root.join("step-0000004"));
        let mut names: Vec<String> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, vec!["latest", "step-0000002", "step-0000004"]);
        // A stop between moving the old folder aside and putting the new one in place.
        std::fs::rename(root.join("step-0000004"), root.join(".step-0000004.old")).unwrap();
        assert_eq!(latest_checkpoint(&a).unwrap(), root.join(".step-0000004.old"));
    }
}
