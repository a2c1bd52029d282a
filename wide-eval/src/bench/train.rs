//! `wide bench train`: stage 1 (router calibration) throughput on a random-weight model —
//! Llama-3.1-8B-shaped by default, bf16, one 4096-token sequence per micro-batch — with the
//! real training step (routed forward with Gumbel gates, LM + sparsity loss, backward through
//! the frozen backbone to the routers, AdamW), peak memory and model FLOPs utilisation.
use super::{device_label, peak_bytes, reset_peak, sync};
use crate::report::{write_json, Provenance};
use anyhow::Result;
use serde_json::json;
use std::path::PathBuf;
use tch::{nn, Device, Kind, Tensor};
use wide_core::routing::{RoutingConfig, Variant};
use wide_core::{presets, LlamaModel, Pretrained, RandomWeights};
use wide_train::calibrate::{RoutedModel, RoutingTask};
use wide_train::optim::{AdamW, AdamWConfig};
use wide_train::trainer::{StepContext, TrainTask};

#[derive(Debug, Clone)]
pub struct TrainBenchConfig {
    pub preset: String,
    pub device: Device,
    pub kind: Kind,
    pub variant: Variant,
    pub sparsity: f64,
    pub attn_group_size: i64,
    pub ffn_group_size: i64,
    pub seq_len: i64,
    pub micro_batch: i64,
    /// Recompute each layer in the backward pass (`train.activation_checkpointing`).
    pub activation_checkpointing: bool,
    pub warmup: usize,
    pub iters: usize,
    /// Measured bf16 matrix ceiling, TFLOP/s, for MFU.
    pub peak_tflops: f64,
    pub out: Option<PathBuf>,
    pub commit: String,
}

pub fn run(cfg: &TrainBenchConfig) -> Result<serde_json::Value> {
    super::check_counts(cfg.iters, None, &[("--seq-len", &[cfg.seq_len]), ("--micro-batch", &[cfg.micro_batch])])?;
    tch::manual_seed(0);
    let mc = presets::preset(&cfg.preset)?;
    let device = cfg.device;
    let vs = nn::VarStore::new(device);
    let model = tch::no_grad(|| LlamaModel::new(&vs.root(), &mc, &mut RandomWeights { std: 0.02 }, cfg.kind, false))?;
    let mut rc = RoutingConfig::new(cfg.variant);
    rc.attn_group_size = cfg.attn_group_size;
    rc.ffn_group_size = cfg.ffn_group_size;
    rc.target_sparsity = Some(cfg.sparsity);
    let routed = RoutedModel::from_pretrained(Pretrained { vs, model, tokenizer: None }, &rc)?;
    let mut task = RoutingTask::new(routed, 0, true);
    task.activation_checkpointing = cfg.activation_checkpointing;
    let params = task.parameters();
    let n_router: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();
    let dist = wide_train::dist::current();
    let world = dist.world;
    let param_tensors: Vec<Tensor> = params.iter().map(|(_, t)| t.shallow_clone()).collect();
    let mut opt = AdamW::new(params, AdamWConfig { lr: 2e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 });
    let total = (cfg.warmup + cfg.iters) as u64;
    // Over all processes of a data-parallel run.
    let tokens_per_step = (cfg.micro_batch * cfg.seq_len) as f64 * world as f64;
    if dist.is_main() { eprintln!(
        "{}: {:.2}B parameters frozen, {} router parameters trained; {} x {} tokens per step on {}",
        cfg.preset,
        mc.parameter_count() as f64 / 1e9,
        n_router,
        cfg.micro_batch,
        cfg.seq_len,
        device_label(device)
    ); }
    sync(device)?;
    reset_peak(device)?;
    let mut times = vec![];
    let mut comm_times = vec![];
    let mut losses = vec![];
    for step in 0..total {
        let batch = Tensor::randint(mc.vocab_size, [cfg.micro_batch, cfg.seq_len + 1], (Kind::Int64, device));
        let ids: Vec<u64> = (0..cfg.micro_batch as u64).map(|i| (step * world as u64 + dist.rank as u64) * cfg.micro_batch as u64 + i).collect();
        sync(device)?;
        let t0 = std::time::Instant::now();
        opt.zero_grad();
        let l = task.loss_backward(&batch, &StepContext { training: true, step, total_steps: total, sample_ids: ids }, 1.0 / world as f64)?;
        let mut comm = 0.0;
        if dist.is_distributed() {
            // Gradient all-reduce (NCCL), timed on its own.
            sync(device)?;
            let c0 = std::time::Instant::now();
            dist.all_reduce_grads(&param_tensors)?;
            sync(device)?;
            comm = c0.elapsed().as_secs_f64();
        }
        opt.clip_grad_norm(1.0);
        opt.step(2e-3);
        sync(device)?;
        let dt = t0.elapsed().as_secs_f64();
        if dist.is_main() {
            eprintln!("step {step}: {:.1} ms, {:.0} tokens/s, loss {l:.3}", dt * 1e3, tokens_per_step / dt);
        }
        if step as usize >= cfg.warmup {
            times.push(dt);
            comm_times.push(comm);
            losses.push(l);
        }
    }
    // The slowest rank sets the pace; the largest peak is what a GPU must hold.
    let mut peak_all = [peak_bytes(device)? as f64];
    dist.all_reduce_f64(&mut peak_all, wide_train::dist::Reduce::Max)?;
    let peak = peak_all[0] as u64;
    let mut secs_all = [super::median(&mut times)];
    dist.all_reduce_f64(&mut secs_all, wide_train::dist::Reduce::Max)?;
    let secs = secs_all[0];
    let comm_secs = super::median(&mut comm_times);
    let tps = tokens_per_step / secs;
    // Executed FLOPs per token (the masked training path runs every matrix product): forward
    // 2N and input-gradient backward 2N over the matmul parameters (everything but the input
    // embedding), plus causal attention (forward QK^T and PV; backward about twice that).
    // Model FLOPs: the recomputed forward of activation checkpointing is not counted.
    let n_matmul = (mc.parameter_count() - mc.vocab_size * mc.hidden_size) as f64;
    let attn_fwd = 4.0 * (mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim) as f64 * (cfg.seq_len as f64 / 2.0);
    let flops_per_token = 4.0 * n_matmul + 3.0 * attn_fwd;
    // Achieved over all processes; MFU against the ceiling of as many GPUs (one per process).
    let achieved = flops_per_token * tps / 1e12;
    let mfu = achieved / (cfg.peak_tflops * world as f64);
    let metrics = task.take_metrics();
    let result = json!({
        "benchmark": "train",
        "provenance": Provenance::new(&cfg.commit, &device_label(device)),
        "model": {"preset": cfg.preset, "parameters": mc.parameter_count(), "dtype": format!("{:?}", cfg.kind)},
        "routing": {"variant": cfg.variant.name(), "sparsity": cfg.sparsity, "attn_group_size": cfg.attn_group_size, "ffn_group_size": cfg.ffn_group_size, "router_parameters": n_router},
        "world_size": world,
        "allreduce_ms": comm_secs * 1e3,
        "settings": {"seq_len": cfg.seq_len, "micro_batch": cfg.micro_batch, "activation_checkpointing": cfg.activation_checkpointing, "warmup": cfg.warmup, "iters": cfg.iters},
        "ms_per_step": secs * 1e3,
        "tokens_per_s": tps,
        "peak_gib": peak as f64 / (1u64 << 30) as f64,
        "flops_per_token": flops_per_token,
        "achieved_tflops": achieved,
        "peak_tflops_reference": cfg.peak_tflops,
        "mfu": mfu,
        "losses": losses,
        "last_metrics": metrics.into_iter().collect::<std::collections::BTreeMap<_, _>>(),
    });
    dist.finish()?;
    if !dist.is_main() {
        return Ok(result);
    }
    println!("\nprocesses: {world} (gradient all-reduce {:.2} ms of the step)", comm_secs * 1e3);
    println!("\n| variant | sparsity | seq x batch | checkpointing | ms/step | tokens/s | peak GiB | TFLOP/s | MFU |");
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} x {} | {} | {:.1} | {:.0} | {:.1} | {:.0} | {:.1}% |",
        cfg.variant.name(),
        cfg.sparsity,
        cfg.seq_len,
        cfg.micro_batch,
        if cfg.activation_checkpointing { "on" } else { "off" },
        secs * 1e3,
        tps,
        result["peak_gib"].as_f64().unwrap_or(0.0),
        achieved,
        mfu * 100.0
    );
    if let Some(out) = &cfg.out {
        write_json(out, &result)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(result)
}
