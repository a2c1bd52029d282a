//! `wide bench dense`: prefill and decode throughput of the dense backbone with random
//! weights (Llama-3.1-8B shape by default), and peak GPU memory of each phase.
use super::{device_label, peak_bytes, reset_peak, sync, time_median};
use crate::report::{write_json, Provenance};
use anyhow::Result;
use serde_json::json;
use std::path::PathBuf;
use tch::{nn, Device, Kind, Tensor};
use wide_core::decode::StaticDecoder;
use wide_core::{presets, ForwardOptions, LlamaModel, Logits, RandomWeights};

#[derive(Debug, Clone)]
pub struct DenseBenchConfig {
    pub preset: String,
    pub device: Device,
    pub kind: Kind,
    pub prefill_tokens: Vec<i64>,
    pub decode_batches: Vec<i64>,
    pub prompt_tokens: i64,
    pub new_tokens: i64,
    pub warmup: usize,
    pub iters: usize,
    pub cuda_graph: bool,
    pub out: Option<PathBuf>,
    pub commit: String,
    pub seed: i64,
}

pub fn run(cfg: &DenseBenchConfig) -> Result<serde_json::Value> {
    super::check_counts(cfg.iters, Some(cfg.new_tokens), &[("--prefill-tokens", &cfg.prefill_tokens), ("--decode-batches", &cfg.decode_batches), ("--prompt-tokens", &[cfg.prompt_tokens])])?;
    let _g = tch::no_grad_guard();
    tch::manual_seed(cfg.seed);
    let mc = presets::preset(&cfg.preset)?;
    let device = cfg.device;
    let vs = nn::VarStore::new(device);
    let t0 = std::time::Instant::now();
    let model = LlamaModel::new(&vs.root(), &mc, &mut RandomWeights { std: 0.02 }, cfg.kind, false)?;
    sync(device)?;
    eprintln!(
        "built {} ({:.2}B parameters, {:?}) on {} in {:.1}s",
        cfg.preset,
        mc.parameter_count() as f64 / 1e9,
        cfg.kind,
        device_label(device),
        t0.elapsed().as_secs_f64()
    );
    let weights_bytes = peak_bytes(device)?;
    let mut prefill = vec![];
    for &t in &cfg.prefill_tokens {
        let ids = Tensor::randint(mc.vocab_size, [1, t], (Kind::Int64, device));
        reset_peak(device)?;
        let secs = time_median(device, cfg.warmup, cfg.iters, || {
            let _ = model.forward(&ids, ForwardOptions { logits: Some(Logits::Last), ..Default::default() })?;
            Ok(())
        })?;
        let peak = peak_bytes(device)?;
        let tps = t as f64 / secs;
        eprintln!("prefill {t:>6} tokens: {:>8.2} ms  {:>10.0} tokens/s  peak {:.2} GiB", secs * 1e3, tps, gib(peak));
        prefill.push(json!({"tokens": t, "ms": secs * 1e3, "tokens_per_s": tps, "peak_gib": gib(peak)}));
    }
    let mut decode = vec![];
    for &b in &cfg.decode_batches {
        let ids = Tensor::randint(mc.vocab_size, [b, cfg.prompt_tokens], (Kind::Int64, device));
        let capacity = cfg.prompt_tokens + cfg.new_tokens;
        reset_peak(device)?;
        // Each repetition: prefill (first new token) + new_tokens - 1 decode steps.
        let mut step_secs = vec![];
        let mut total_secs = vec![];
        for rep in 0..cfg.warmup + cfg.iters {
            sync(device)?;
            let start = std::time::Instant::now();
            let mut dec = StaticDecoder::new(&model, &ids, capacity, cfg.cuda_graph)?;
            sync(device)?;
            let after_prefill = std::time::Instant::now();
            for _ in 0..cfg.new_tokens - 1 {
                dec.step()?;
            }
            sync(device)?;
            if rep >= cfg.warmup {
                step_secs.push(after_prefill.elapsed().as_secs_f64());
                total_secs.push(start.elapsed().as_secs_f64());
            }
        }
        let peak = peak_bytes(device)?;
        let step = super::median(&mut step_secs);
        let total = super::median(&mut total_secs);
        let decode_tps = (b * (cfg.new_tokens - 1)) as f64 / step;
        let gen_tps = (b * cfg.new_tokens) as f64 / total;
        eprintln!(
            "decode batch {b:>3}: {:>8.3} ms/step  {:>9.1} tokens/s (steps)  {:>9.1} tokens/s (with prefill and graph capture)  peak {:.2} GiB",
            step * 1e3 / (cfg.new_tokens - 1) as f64,
            decode_tps,
            gen_tps,
            gib(peak)
        );
        decode.push(json!({
            "batch": b, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens,
            "ms_per_step": step * 1e3 / (cfg.new_tokens - 1) as f64,
            "decode_tokens_per_s": decode_tps, "generate_tokens_per_s": gen_tps, "peak_gib": gib(peak),
        }));
    }
    let prov = Provenance::new(&cfg.commit, &device_label(device));
    let result = json!({
        "benchmark": "dense",
        "provenance": prov,
        "model": {"preset": cfg.preset, "parameters": mc.parameter_count(), "dtype": format!("{:?}", cfg.kind), "weights_gib": gib(weights_bytes)},
        "settings": {"warmup": cfg.warmup, "iters": cfg.iters, "cuda_graph": cfg.cuda_graph, "eos_ignored": true,
                      "decode_tokens_per_s": "batch x (new_tokens - 1) / time of the decode steps after prefill",
                      "generate_tokens_per_s": "batch x new_tokens / time of prefill + graph capture + decode steps"},
        "prefill": prefill,
        "decode": decode,
    });
    print_table(&result);
    if let Some(out) = &cfg.out {
        write_json(out, &result)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(result)
}

fn gib(b: i64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn print_table(r: &serde_json::Value) {
    println!("\n| phase | shape | ms | tokens/s | peak GiB |");
    println!("|---|---|---|---|---|");
    for p in r["prefill"].as_array().into_iter().flatten() {
        println!("| prefill | 1 x {} | {:.2} | {:.0} | {:.2} |", p["tokens"], p["ms"].as_f64().unwrap_or(0.0), p["tokens_per_s"].as_f64().unwrap_or(0.0), p["peak_gib"].as_f64().unwrap_or(0.0));
    }
    for d in r["decode"].as_array().into_iter().flatten() {
        println!(
            "| decode | batch {} ({}+{}) | {:.3}/step | {:.1} (with prefill: {:.1}) | {:.2} |",
            d["batch"],
            d["prompt_tokens"],
            d["new_tokens"],
            d["ms_per_step"].as_f64().unwrap_or(0.0),
            d["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            d["generate_tokens_per_s"].as_f64().unwrap_or(0.0),
            d["peak_gib"].as_f64().unwrap_or(0.0)
        );
    }
}
