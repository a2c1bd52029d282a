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
        let on = self.deterministic || std::env::var("WIDE_DETERMINISTIC").is_ok_and(|v| v == "1");
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

/// A training run writing into `out_dir`: `checkpoints/`, `tb/`, `metrics.jsonl`.
pub struct Trainer<'a> {
    pub cfg: TrainConfig,
    pub seq_len: usize,
    pub out_dir: PathBuf,
    pub train: &'a TokenFile,
    pub val: Option<&'a TokenFile>,
}

const LATEST: &str = "latest";

pub fn latest_checkpoint(out_dir: &Path) -> Option<PathBuf> {
    let name = std::fs::read_to_string(out_dir.join("checkpoints").join(LATEST)).ok()?;
    let p = out_dir.join("checkpoints").join(name.trim());
    p.join("trainer_state.json").exists().then_some(p)
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
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::rename(&tmp, &dir)?;
        let latest_tmp = root.join(".latest.tmp");
        std::fs::write(&latest_tmp, &name)?;
        std::fs::rename(&latest_tmp, root.join(LATEST))?;
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
            last_loss: None,
            last_val_loss: None,
            elapsed_seconds: 0.0,
        };
        let metrics_path = self.out_dir.join("metrics.jsonl");
        match (resume, latest_checkpoint(&self.out_dir)) {
            (true, Some(dir)) => {
                state = self.restore(task, &mut opt, &dir)?;
                state.train_config = cfg.clone();
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
        let stop_after: Option<u64> = std::env::var("WIDE_STOP_AFTER_STEP").ok().and_then(|v| v.trim().parse().ok());
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
                bail!(
                    "the loss became {loss} at step {}; stopping. The last good checkpoint is {} (lower train.lr or check the data)",
                    state.step,
                    if checkpoint.as_os_str().is_empty() { "none yet".to_string() } else { checkpoint.display().to_string() }
                );
            }
            dist.all_reduce_grads(&params)?;
            let grad_norm = opt.clip_grad_norm(cfg.grad_clip);
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
            }
        }
        pb.finish_and_clear();
        if let Some(tb) = tb.as_mut() {
            tb.flush();
        }
        state.elapsed_seconds = elapsed_before + started.elapsed().as_secs_f64();
        if interrupted {
            checkpoint = self.checkpoint(task, &opt, &state)?;
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
