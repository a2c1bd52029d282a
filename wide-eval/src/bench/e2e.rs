//! `wide bench e2e`: end-to-end prefill and decode throughput of the inference engine, dense
//! against `wide` at several sparsities, on one model in one process, with peak GPU memory and
//! (with `--profile`) per-op device times next to their byte and FLOP floors.
//!
//! Routers: with `--routing DIR` the trained routers of that folder, their offsets searched per
//! router kind to hit each sparsity; otherwise random routers (Kaiming-uniform, as freshly
//! initialised) whose per-layer offsets (equivalently, skip biases) are fitted on a random
//! 2048-token prompt to skip the target share of groups.
use super::clock::ClockSampler;
use super::{device_label, median, peak_bytes, reset_peak, sync, time_runs};
use crate::report::{write_json, Provenance};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;
use tch::{nn, Device, Kind, Tensor};
use wide_core::infer::{Decoder, Engine, EngineCache, MaskSource, Profile, SkipCounts};
use wide_core::routing::{Routing, RoutingConfig, Variant};
use wide_core::{presets, LlamaModel, ModelConfig, Pretrained, RandomWeights};

#[derive(Debug, Clone)]
pub struct E2eBenchConfig {
    /// Built-in shape with random weights, unless `model_dir` is given.
    pub preset: String,
    pub model_dir: Option<PathBuf>,
    /// Trained routers (stage 1/2 folder) for `model_dir`.
    pub routing_dir: Option<PathBuf>,
    pub device: Device,
    pub kind: Kind,
    pub sparsities: Vec<f64>,
    pub attn_group_size: i64,
    pub ffn_group_size: i64,
    pub prefill_tokens: Vec<i64>,
    pub decode_batches: Vec<i64>,
    pub prompt_tokens: i64,
    pub new_tokens: i64,
    pub warmup: usize,
    pub iters: usize,
    pub cuda_graph: bool,
    pub profile: bool,
    /// Ops (see `wide_core::infer::REPEATABLE_OPS`) whose in-graph cost is measured by running
    /// each twice in the batch-1 decode step.
    pub repeat_ops: Vec<String>,
    /// After the rows, time the prefills of dense and every variant in turn (see
    /// [`interleaved_prefill`]).
    pub interleave: bool,
    /// With `interleave`: the device idle this long (after a sync) between two interleaved runs.
    pub interleave_gap_ms: u64,
    /// After the rows, measure dense on a model of only the width `wide` keeps at each sparsity
    /// (see [`kept_width_config`]): routing at no cost, on dense's kernels.
    pub kept_width: bool,
    pub out: Option<PathBuf>,
    pub commit: String,
    pub seed: i64,
}

fn gib(b: i64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Loads the model (and, for a routing folder, its routing config and router tensors).
fn build_model(cfg: &E2eBenchConfig) -> Result<(LlamaModel, nn::VarStore, ModelConfig, String)> {
    match &cfg.model_dir {
        Some(dir) => {
            let p = Pretrained::load(dir, cfg.device, cfg.kind)?;
            let mc = p.model.config.clone();
            Ok((p.model, p.vs, mc, dir.display().to_string()))
        }
        None => {
            let mc = presets::preset(&cfg.preset)?;
            let vs = nn::VarStore::new(cfg.device);
            let model = LlamaModel::new(&vs.root(), &mc, &mut RandomWeights { std: 0.02 }, cfg.kind, false)?;
            Ok((model, vs, mc, cfg.preset.clone()))
        }
    }
}

/// The model `mc` with only the width a router skipping `s` of its groups keeps: query heads in
/// whole groups of `attn_group` heads and FFN channels in whole groups of `ffn_group`, each the
/// nearest count to (1 - s) of the groups (at least one); K/V heads, hidden size, layers and
/// vocabulary as they are. Run dense, it is what the routed model would cost if routing were
/// free and its projections ran on dense's kernels over the kept bytes: the ceiling of the
/// routed speedup for the engine's launches (`wide bench e2e --kept-width`).
pub fn kept_width_config(mc: &ModelConfig, s: f64, attn_group: i64, ffn_group: i64) -> Result<ModelConfig> {
    anyhow::ensure!((0.0..1.0).contains(&s), "--kept-width: sparsity {s} is outside [0, 1)");
    let kept = |n: i64, g: i64, what: &str| -> Result<i64> {
        anyhow::ensure!(g > 0 && n % g == 0, "--kept-width: {n} {what} are not whole groups of {g}");
        Ok((((1.0 - s) * (n / g) as f64).round() as i64).max(1) * g)
    };
    let mut k = mc.clone();
    k.num_attention_heads = kept(mc.num_attention_heads, attn_group, "query heads")?;
    k.intermediate_size = kept(mc.intermediate_size, ffn_group, "FFN channels")?;
    anyhow::ensure!(
        k.num_attention_heads % k.num_key_value_heads == 0,
        "--kept-width at sparsity {s} keeps {} of the {} query heads, which the {} K/V heads do not divide: choose a sparsity whose kept heads are a multiple of the K/V heads",
        k.num_attention_heads,
        mc.num_attention_heads,
        k.num_key_value_heads
    );
    k.validate()?;
    Ok(k)
}

fn routing_for(cfg: &E2eBenchConfig, mc: &ModelConfig, s: f64) -> Result<(Routing, nn::VarStore)> {
    let vs = nn::VarStore::new(cfg.device);
    let (rc, dir) = match &cfg.routing_dir {
        Some(dir) => {
            let text = std::fs::read_to_string(dir.join("routing.json")).with_context(|| format!("{} has no routing.json", dir.display()))?;
            let v: Value = serde_json::from_str(&text)?;
            let rc: RoutingConfig = serde_json::from_value(v["routing"].clone()).context("routing.json: the routing table")?;
            (rc, Some(dir))
        }
        None => {
            let mut rc = RoutingConfig::new(Variant::Wide);
            rc.attn_group_size = cfg.attn_group_size;
            rc.ffn_group_size = cfg.ffn_group_size;
            rc.target_sparsity = Some(s);
            (rc, None)
        }
    };
    let routing = Routing::new(&vs.root(), mc, &rc, cfg.kind)?;
    if let Some(dir) = dir {
        let f = wide_core::safetensors::SafetensorsFile::open(&dir.join("routers.safetensors"))?;
        routing.load_tensors(&mut |n| f.read(n))?;
    }
    Ok((routing, vs))
}

/// One engine's measurements.
fn measure(engine: &Engine, cfg: &E2eBenchConfig, vocab: i64, label: &str, clock: Option<&ClockSampler>) -> Result<Value> {
    let device = cfg.device;
    sync(device)?;
    let resident = allocated(device)?;
    eprintln!("{label:>10}: {:.3} GiB allocated before measuring", gib(resident));
    let mut prefill = vec![];
    for &t in &cfg.prefill_tokens {
        let ids = Tensor::randint(vocab, [1, t], (Kind::Int64, device));
        let cache = EngineCache::new(engine.model, 1, t);
        sync(device)?;
        reset_peak(device)?;
        let mut runs = time_runs(device, cfg.warmup, cfg.iters, || {
            let _ = engine.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, false)?;
            Ok(())
        })?;
        let (secs, host) = (median(&mut runs.secs), median(&mut runs.host_secs));
        let mhz = clock.and_then(|c| c.median_mhz(&runs.windows));
        let peak = peak_bytes(device)?;
        eprintln!(
            "{label:>10} prefill {t:>6}: {:>8.2} ms {:>9.0} tokens/s  peak {:.2} GiB  (host issue {:.2} ms){}",
            secs * 1e3,
            t as f64 / secs,
            gib(peak),
            host * 1e3,
            mhz_note(mhz)
        );
        prefill.push(json!({"tokens": t, "ms": secs * 1e3, "tokens_per_s": t as f64 / secs, "peak_gib": gib(peak), "host_issue_ms": host * 1e3, "sm_mhz": mhz}));
    }
    let mut decode = vec![];
    for &b in &cfg.decode_batches {
        sync(device)?;
        reset_peak(device)?;
        let (mut steps, mut totals, windows) = time_decode(engine, cfg, vocab, b)?;
        let peak = peak_bytes(device)?;
        let (step, total) = (median(&mut steps), median(&mut totals));
        let mhz = clock.and_then(|c| c.median_mhz(&windows));
        let n = (cfg.new_tokens - 1) as f64;
        let tps = b as f64 * n / step;
        eprintln!(
            "{label:>10} decode batch {b:>3}: {:>7.3} ms/step {:>9.1} tokens/s ({:.1} with prefill)  peak {:.2} GiB{}",
            step * 1e3 / n,
            tps,
            (b * cfg.new_tokens) as f64 / total,
            gib(peak),
            mhz_note(mhz)
        );
        decode.push(json!({"batch": b, "ms_per_step": step * 1e3 / n, "decode_tokens_per_s": tps,
            "generate_tokens_per_s": (b * cfg.new_tokens) as f64 / total, "peak_gib": gib(peak), "sm_mhz": mhz}));
    }
    // Achieved skip rates while decoding (batch 1, the graph accumulating on the device).
    let mut decode_skip = Value::Null;
    if engine.is_routed() {
        let prompt = vec![Vec::<i64>::try_from(Tensor::randint(vocab, [cfg.prompt_tokens], (Kind::Int64, Device::Cpu)))?];
        let (mut dec, _) = Decoder::new(engine, &prompt, cfg.prompt_tokens + cfg.new_tokens, true, true, None)?;
        if cfg.cuda_graph {
            dec.capture()?;
        }
        for _ in 0..cfg.new_tokens - 1 {
            let _ = dec.step()?;
        }
        decode_skip = skip_json(&dec.skip_counts());
    }
    // In-graph cost of single ops: each listed op runs twice in the captured batch-1 step.
    let mut repeat = serde_json::Map::new();
    if !cfg.repeat_ops.is_empty() {
        let (mut base, _, _) = time_decode(engine, cfg, vocab, 1)?;
        let n = (cfg.new_tokens - 1) as f64;
        let base_ms = median(&mut base) * 1e3 / n;
        repeat.insert("none".into(), json!(base_ms));
        for op in &cfg.repeat_ops {
            engine.set_repeat(std::slice::from_ref(op))?;
            let r = time_decode(engine, cfg, vocab, 1);
            engine.set_repeat(&[])?;
            let ms = median(&mut r?.0) * 1e3 / n;
            eprintln!("{label:>10} decode batch 1 with {op} twice: {ms:.3} ms/step ({:+.3} ms, {:+.1} us a call)", ms - base_ms, (ms - base_ms) * 1e3 / op_calls(engine, op));
            repeat.insert(op.clone(), json!(ms));
        }
    }
    let mut profile = Value::Null;
    if cfg.profile {
        profile = profile_ops(engine, cfg, vocab)?;
    }
    Ok(json!({"prefill": prefill, "decode": decode, "decode_skip": decode_skip, "profile": profile, "repeat_ops_ms_per_step": repeat, "allocated_before_gib": gib(resident)}))
}

/// A routed variant's routers and fitted offsets, kept for [`interleaved_prefill`].
struct Kept {
    label: String,
    sparsity: f64,
    routing: Routing,
    _vs: nn::VarStore,
    offsets: Vec<[f64; 3]>,
}

/// Prefill times of dense and every kept variant on the same prompt, timed in turn: after
/// `warmup` rounds, `iters` rounds each run every engine once, the order rotated by one each
/// round. A full-FLOP prefill runs at the board's power limit and where the clock settles moves
/// over seconds, so the rows above, which time each variant's prefills together, can put dense
/// and a variant under different clocks; here every engine sees the same spread of states. The
/// engines share the model's fused weights (no copy); one KV cache serves all of them.
///
/// On a GPU a clock probe (`wide_kernels::ops::probe`, 200 us, outside the timed window) runs
/// in the stream just before and just after every run: the SM clock a run started and ended at,
/// which NVML's ~100 ms refresh cannot resolve. Each run's predecessor is recorded, and with
/// `interleave_gap_ms` the device idles that long between runs.
fn interleaved_prefill(model: &LlamaModel, kept: &[Kept], cfg: &E2eBenchConfig, vocab: i64, clock: Option<&ClockSampler>) -> Result<Value> {
    let device = cfg.device;
    let mut engines = vec![("dense".to_string(), 0.0, Engine::new(model, None)?)];
    for k in kept {
        let e = Engine::new(model, Some(&k.routing))?;
        e.set_offsets_per_layer(&k.offsets)?;
        engines.push((k.label.clone(), k.sparsity, e));
    }
    let n = engines.len();
    let gap = std::time::Duration::from_millis(cfg.interleave_gap_ms);
    let mut out = vec![];
    for &t in &cfg.prefill_tokens {
        let ids = Tensor::randint(vocab, [1, t], (Kind::Int64, device));
        let cache = EngineCache::new(model, 1, t);
        let probe = match device {
            Device::Cuda(_) => Some(wide_kernels::ops::probe::ClockProbe::new(device, 2 * n * cfg.iters, 200)?),
            _ => None,
        };
        let run = |i: usize| -> Result<()> {
            let _ = engines[i].2.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, false)?;
            Ok(())
        };
        let phase = std::time::Instant::now();
        for _ in 0..cfg.warmup {
            for i in 0..n {
                run(i)?;
            }
        }
        let mut times = vec![Vec::with_capacity(cfg.iters); n];
        let mut windows = vec![Vec::with_capacity(cfg.iters); n];
        let mut slots = vec![Vec::with_capacity(cfg.iters); n];
        let mut after: Vec<Vec<Option<usize>>> = vec![Vec::with_capacity(cfg.iters); n];
        let mut prev = (cfg.warmup > 0).then_some(n - 1);
        for round in 0..cfg.iters {
            for j in 0..n {
                let i = (round + j) % n;
                let slot = 2 * (round * n + j);
                if let Some(p) = &probe {
                    p.record(slot)?;
                }
                // One timed run, bracketed by syncs like every other figure here (the first
                // sync also waits for the start probe).
                let r = time_runs(device, 0, 1, || run(i))?;
                if let Some(p) = &probe {
                    p.record(slot + 1)?;
                }
                times[i].push(r.secs[0] * 1e3);
                windows[i].push(r.windows[0]);
                slots[i].push(slot);
                after[i].push(prev);
                prev = Some(i);
                if !gap.is_zero() {
                    sync(device)?;
                    std::thread::sleep(gap);
                }
            }
        }
        sync(device)?;
        let probed = match &probe {
            Some(p) => p.mhz()?,
            None => vec![],
        };
        let dense_ms = median(&mut times[0].clone());
        let label_of = |p: &Option<usize>| p.map(|k| engines[k].0.clone());
        let variants: Vec<Value> = engines
            .iter()
            .enumerate()
            .map(|(i, (label, s, _))| {
                let (runs, win) = (&times[i], &windows[i]);
                let ms = median(&mut runs.clone());
                let mhz = clock.and_then(|c| c.median_mhz(win));
                let runs_mhz: Vec<Option<f64>> = win.iter().map(|w| clock.and_then(|c| c.median_mhz(std::slice::from_ref(w)))).collect();
                let ms_since = |i: std::time::Instant| (i - phase).as_secs_f64() * 1e3;
                let runs_window: Vec<[f64; 2]> = win.iter().map(|&(a, b)| [ms_since(a), ms_since(b)]).collect();
                let probe_mhz: Vec<[Option<f64>; 2]> = slots[i].iter().map(|&s| [probed.get(s).copied().flatten(), probed.get(s + 1).copied().flatten()]).collect();
                let runs_after: Vec<Option<String>> = after[i].iter().map(label_of).collect();
                // Median time and start clock by the run before (the warm-up's last for the first).
                let by_pred: Vec<Value> = (0..n)
                    .filter_map(|k| {
                        let idx: Vec<usize> = (0..runs.len()).filter(|&r| after[i][r] == Some(k)).collect();
                        (!idx.is_empty()).then(|| {
                            let mut ms: Vec<f64> = idx.iter().map(|&r| runs[r]).collect();
                            let mut start: Vec<f64> = idx.iter().filter_map(|&r| probe_mhz[r][0]).collect();
                            json!({"after": engines[k].0, "runs": idx.len(), "ms": median(&mut ms),
                                   "start_mhz": (!start.is_empty()).then(|| median(&mut start))})
                        })
                    })
                    .collect();
                let mut starts: Vec<f64> = probe_mhz.iter().filter_map(|p| p[0]).collect();
                let mut ends: Vec<f64> = probe_mhz.iter().filter_map(|p| p[1]).collect();
                let (start_mhz, end_mhz) = ((!starts.is_empty()).then(|| median(&mut starts)), (!ends.is_empty()).then(|| median(&mut ends)));
                let probe_note = match (start_mhz, end_mhz) {
                    (Some(a), Some(b)) => format!("  probe {a:.0} -> {b:.0} MHz"),
                    _ => String::new(),
                };
                eprintln!("{label:>10} prefill {t:>6} interleaved: {ms:>8.2} ms ({:.2}x dense){}{probe_note}", dense_ms / ms, mhz_note(mhz));
                for p in &by_pred {
                    eprintln!("{:>10}   after {:>10}: {:>8.2} ms over {} runs", "", p["after"].as_str().unwrap_or(""), p["ms"].as_f64().unwrap_or(f64::NAN), p["runs"]);
                }
                json!({"variant": label, "sparsity": s, "ms": ms, "tokens_per_s": t as f64 * 1e3 / ms, "x_dense": dense_ms / ms, "runs_ms": runs,
                       "sm_mhz": mhz, "runs_sm_mhz": runs_mhz, "runs_window_ms": runs_window,
                       "probe_start_mhz": start_mhz, "probe_end_mhz": end_mhz, "runs_probe_mhz": probe_mhz,
                       "runs_after": runs_after, "by_predecessor": by_pred})
            })
            .collect();
        // Every clock sample of this length's rounds (ms since its first warm-up run, MHz), to
        // read a run's clock along its length against the windows above.
        let trace: Vec<[f64; 2]> = clock.map(|c| c.trace(phase, std::time::Instant::now())).unwrap_or_default().into_iter().map(|(ms, m)| [(ms * 10.0).round() / 10.0, m as f64]).collect();
        out.push(json!({"tokens": t, "variants": variants, "clock_trace_ms_mhz": trace}));
    }
    Ok(json!({"warmup_rounds": cfg.warmup, "rounds": cfg.iters, "gap_ms": cfg.interleave_gap_ms,
              "order": "each round runs every engine once, the order rotated by one each round", "rows": out}))
}

/// " at N MHz" for a console line, where the SM clock was sampled.
fn mhz_note(mhz: Option<f64>) -> String {
    mhz.map(|m| format!("  SM clock {m:.0} MHz")).unwrap_or_default()
}

fn print_interleaved(v: &Value) {
    let Some(rows) = v["rows"].as_array() else { return };
    println!("\nprefill, interleaved ({} rounds, rotating order):\n", v["rounds"]);
    println!("| variant | tokens | ms | tokens/s | x dense | SM MHz at start / end (probe) |");
    println!("|---|---|---|---|---|---|");
    let mhz = |v: &Value| v.as_f64().map(|m| format!("{m:.0}")).unwrap_or_else(|| "-".into());
    for row in rows {
        for x in row["variants"].as_array().into_iter().flatten() {
            println!(
                "| {} | {} | {:.2} | {:.0} | {:.2}x | {} / {} |",
                x["variant"].as_str().unwrap_or(""),
                row["tokens"],
                x["ms"].as_f64().unwrap_or(0.0),
                x["tokens_per_s"].as_f64().unwrap_or(0.0),
                x["x_dense"].as_f64().unwrap_or(0.0),
                mhz(&x["probe_start_mhz"]),
                mhz(&x["probe_end_mhz"])
            );
        }
    }
}

/// Times `warmup + iters` batch-`b` generations (prefill, graph capture, then `new_tokens - 1`
/// steps); returns the measured iterations' step-loop and total seconds, and the step loops'
/// time windows.
#[allow(clippy::type_complexity)]
fn time_decode(engine: &Engine, cfg: &E2eBenchConfig, vocab: i64, b: i64) -> Result<(Vec<f64>, Vec<f64>, Vec<(std::time::Instant, std::time::Instant)>)> {
    let device = cfg.device;
    let prompts: Vec<Vec<i64>> = (0..b).map(|_| Vec::<i64>::try_from(Tensor::randint(vocab, [cfg.prompt_tokens], (Kind::Int64, Device::Cpu))).unwrap()).collect();
    let capacity = cfg.prompt_tokens + cfg.new_tokens;
    let (mut steps, mut totals, mut windows) = (vec![], vec![], vec![]);
    for rep in 0..cfg.warmup + cfg.iters {
        sync(device)?;
        let start = std::time::Instant::now();
        let (mut dec, _) = Decoder::new(engine, &prompts, capacity, true, false, None)?;
        if cfg.cuda_graph {
            dec.capture()?;
        }
        sync(device)?;
        let after = std::time::Instant::now();
        for _ in 0..cfg.new_tokens - 1 {
            let _ = dec.step()?;
        }
        sync(device)?;
        if rep >= cfg.warmup {
            steps.push(after.elapsed().as_secs_f64());
            totals.push(start.elapsed().as_secs_f64());
            windows.push((after, std::time::Instant::now()));
        }
    }
    Ok((steps, totals, windows))
}

/// Calls of `op` in one decode step (to express a step's extra time per call).
fn op_calls(engine: &Engine, op: &str) -> f64 {
    let layers = engine.model.config.num_hidden_layers as f64;
    match op {
        "embed" | "lm_head" => 1.0,
        "norm" => 2.0 * layers + 1.0,
        _ => layers,
    }
}

fn allocated(device: Device) -> Result<i64> {
    Ok(match device {
        Device::Cuda(d) => wide_kernels::MemoryStats::read(d)?.allocated_current,
        _ => 0,
    })
}

fn skip_json(c: &SkipCounts) -> Value {
    Value::Object(c.per_kind.keys().map(|k| (k.clone(), json!(c.rate(k).unwrap_or(0.0)))).collect())
}

/// Per-op device times: the largest prefill and one batch-1 decode step (eager, each op
/// timed alone between CUDA events after a device spin), and the prefill ops' host issue times.
fn profile_ops(engine: &Engine, cfg: &E2eBenchConfig, vocab: i64) -> Result<Value> {
    let device = cfg.device;
    let t = *cfg.prefill_tokens.iter().max().unwrap_or(&2048);
    let ids = Tensor::randint(vocab, [1, t], (Kind::Int64, device));
    let cache = EngineCache::new(engine.model, 1, t);
    let _ = engine.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, false)?;
    sync(device)?;
    let pre = with_profile(engine, || {
        let _ = engine.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, false)?;
        Ok(())
    })?;
    let prompt = vec![Vec::<i64>::try_from(Tensor::randint(vocab, [cfg.prompt_tokens], (Kind::Int64, Device::Cpu)))?];
    let steps = 16;
    let (mut dec, _) = Decoder::new(engine, &prompt, cfg.prompt_tokens + 4 + steps + 1, true, false, None)?;
    for _ in 0..4 {
        let _ = dec.step()?;
    }
    let dec_prof = with_profile(engine, || {
        for _ in 0..steps {
            let _ = dec.step()?;
        }
        Ok(())
    })?;
    let per_step: serde_json::Map<String, Value> = dec_prof.ms.iter().map(|(k, v)| (k.clone(), json!(v / steps as f64))).collect();
    Ok(json!({"prefill_tokens": t, "prefill_ms": pre.ms, "prefill_host_ms": pre.host_ms, "decode_batch1_ms_per_step": per_step}))
}

fn with_profile(engine: &Engine, f: impl FnOnce() -> Result<()>) -> Result<Profile> {
    engine.start_profile();
    let r = f();
    let prof = engine.take_profile();
    r?;
    Ok(prof)
}

/// Byte and FLOP floors of one layer's ops (for the RESULTS table), per token count `m`, at
/// skip rate `s` (0 = dense), from the model's shapes.
fn floors(mc: &ModelConfig, elt: f64, m: i64, s: f64, ctx: f64) -> Value {
    let (h, i) = (mc.hidden_size as f64, mc.intermediate_size as f64);
    let q = (mc.num_attention_heads * mc.head_dim) as f64;
    let kv = (mc.num_key_value_heads * mc.head_dim) as f64;
    let a = 1.0 - s;
    let m = m as f64;
    // Weight bytes read at decode (M = 1: only used rows), FLOPs at prefill.
    json!({
        "qkv": {"weight_bytes": elt * h * (a * q + 2.0 * kv), "flops": 2.0 * m * h * (a * q + 2.0 * kv)},
        "o_proj": {"weight_bytes": elt * h * a * q, "flops": 2.0 * m * h * a * q},
        "gate_up": {"weight_bytes": elt * 2.0 * h * a * i, "flops": 4.0 * m * h * a * i},
        "down": {"weight_bytes": elt * h * a * i, "flops": 2.0 * m * h * a * i},
        "attention": {"flops": 4.0 * m * a * q * ctx},
    })
}

/// Per-layer floors of this run's shapes: decode at the mean context of its steps, prefill at
/// its longest prompt (mean causal context half of it), dense and at 0.5, in the run's dtype.
fn floors_json(mc: &ModelConfig, cfg: &E2eBenchConfig) -> Value {
    let elt = cfg.kind.elt_size_in_bytes() as f64;
    let decode_ctx = cfg.prompt_tokens as f64 + cfg.new_tokens as f64 / 2.0;
    let mut v = serde_json::Map::new();
    v.insert("decode_dense".into(), floors(mc, elt, 1, 0.0, decode_ctx));
    v.insert("decode_s0.5".into(), floors(mc, elt, 1, 0.5, decode_ctx));
    if let Some(&t) = cfg.prefill_tokens.iter().max() {
        v.insert(format!("prefill{t}_dense"), floors(mc, elt, t, 0.0, t as f64 / 2.0));
        v.insert(format!("prefill{t}_s0.5"), floors(mc, elt, t, 0.5, t as f64 / 2.0));
    }
    Value::Object(v)
}

pub fn run(cfg: &E2eBenchConfig) -> Result<Value> {
    super::check_counts(cfg.iters, Some(cfg.new_tokens), &[("--prefill-tokens", &cfg.prefill_tokens), ("--decode-batches", &cfg.decode_batches), ("--prompt-tokens", &[cfg.prompt_tokens])])?;
    let _g = tch::no_grad_guard();
    for op in &cfg.repeat_ops {
        anyhow::ensure!(wide_core::infer::REPEATABLE_OPS.contains(&op.as_str()), "unknown op `{op}` for --repeat-ops: use {}", wide_core::infer::REPEATABLE_OPS.join(", "));
    }
    tch::manual_seed(cfg.seed);
    let t0 = std::time::Instant::now();
    let (model, _vs, mc, label) = build_model(cfg)?;
    sync(cfg.device)?;
    eprintln!("built {label} ({:.3}B parameters, {:?}) on {} in {:.1}s", mc.parameter_count() as f64 / 1e9, cfg.kind, device_label(cfg.device), t0.elapsed().as_secs_f64());
    let vocab = mc.vocab_size;
    let mut rows = vec![];
    // The routed variants kept for the interleaved prefills (with --interleave).
    let mut kept: Vec<Kept> = vec![];
    // The routing each row ran (from the routers' own manifest with --routing).
    let mut routing_used: Option<(String, i64, i64)> = None;
    // The SM clock every 2 ms (NVML; absent on CPU), each timed run's median in the JSON.
    let clock = match cfg.device {
        Device::Cuda(d) => ClockSampler::start(d, std::time::Duration::from_millis(2)),
        _ => None,
    };
    let clock = clock.as_ref();
    let dense = Engine::new(&model, None)?;
    let d = measure(&dense, cfg, vocab, "dense", clock)?;
    rows.push(json!({"variant": "dense", "sparsity": 0.0, "results": d}));
    drop(dense);
    for &s in &cfg.sparsities {
        let (routing, _rvs) = routing_for(cfg, &mc, s)?;
        let mut engine = Engine::new(&model, Some(&routing))?;
        let fit_t = 2048.min(mc.max_position_embeddings);
        let ids = Tensor::randint(vocab, [1, fit_t], (Kind::Int64, cfg.device));
        let achieved = if cfg.routing_dir.is_some() { engine.search_offsets(&ids, &[fit_t], s)? } else { engine.fit_offsets_per_layer(&ids, &[fit_t], s)? };
        let rc = &routing.config;
        routing_used = Some((rc.variant.name().to_string(), rc.attn_group_size, rc.ffn_group_size));
        let label = format!("{} {s}", rc.variant.name());
        eprintln!("{label}: prefill skip rates on the fitting prompt {:?}", achieved.per_kind.keys().map(|k| format!("{k} {:.3}", achieved.rate(k).unwrap_or(0.0))).collect::<Vec<_>>());
        let r = measure(&engine, cfg, vocab, &label, clock)?;
        let offsets = engine.offsets();
        rows.push(json!({"variant": routing.config.variant.name(), "sparsity": s, "fit_skip": skip_json(&achieved), "results": r,
            "offsets_per_layer": offsets}));
        drop(engine);
        if cfg.interleave {
            kept.push(Kept { label, sparsity: s, routing, _vs: _rvs, offsets });
        }
    }
    let interleaved = if cfg.interleave { interleaved_prefill(&model, &kept, cfg, vocab, clock)? } else { Value::Null };
    if cfg.kept_width {
        let (ag, fg) = routing_used.as_ref().map_or((cfg.attn_group_size, cfg.ffn_group_size), |r| (r.1, r.2));
        for &s in &cfg.sparsities {
            let kc = kept_width_config(&mc, s, ag, fg)?;
            let kvs = nn::VarStore::new(cfg.device);
            let km = LlamaModel::new(&kvs.root(), &kc, &mut RandomWeights { std: 0.02 }, cfg.kind, false)?;
            let label = format!("kept-width {s}");
            eprintln!("{label}: dense, {} query heads, {} FFN channels (random weights; the full model stays resident)", kc.num_attention_heads, kc.intermediate_size);
            let engine = Engine::new(&km, None)?;
            let r = measure(&engine, cfg, vocab, &label, clock)?;
            rows.push(json!({"variant": "kept-width", "sparsity": s, "results": r,
                "shape": {"num_attention_heads": kc.num_attention_heads, "num_key_value_heads": kc.num_key_value_heads, "intermediate_size": kc.intermediate_size},
                "note": "dense, only the width wide keeps at this sparsity: routing at no cost on dense's kernels; peak memory includes the full model"}));
        }
    }
    let prov = Provenance::new(&cfg.commit, &device_label(cfg.device));
    let result = json!({
        "benchmark": "e2e",
        "provenance": prov,
        "model": {"name": label, "parameters": mc.parameter_count(), "dtype": format!("{:?}", cfg.kind)},
        "routing": {"routers": if cfg.routing_dir.is_some() { "trained (offsets searched per router kind)" } else { "random weights, per-layer offsets fitted on a random 2048-token prompt" },
                    "variant": routing_used.as_ref().map(|r| r.0.clone()),
                    "attn_group_size": routing_used.as_ref().map_or(cfg.attn_group_size, |r| r.1), "ffn_group_size": routing_used.as_ref().map_or(cfg.ffn_group_size, |r| r.2),
                    "routing_dir": cfg.routing_dir.as_ref().map(|p| p.display().to_string())},
        "settings": {"sm_clock": if clock.is_some() { "NVML, sampled every 2 ms; each figure's sm_mhz is the median over its timed runs" } else { "not sampled (no NVML)" },
                     "warmup": cfg.warmup, "iters": cfg.iters, "cuda_graph": cfg.cuda_graph, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens, "eos_ignored": true,
                     "decode_tokens_per_s": "batch x (new_tokens - 1) / time of the decode steps after prefill and graph capture"},
        "floors_per_layer": floors_json(&mc, cfg),
        "rows": rows,
        "prefill_interleaved": interleaved,
        // The large-M paths each M bucket took in this process (the prefills' routed products).
        "autotune": super::autotune_json(),
    });
    print_table(&result);
    print_interleaved(&result["prefill_interleaved"]);
    if let Some(out) = &cfg.out {
        write_json(out, &result)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(result)
}

fn print_table(r: &Value) {
    let rows = r["rows"].as_array().cloned().unwrap_or_default();
    let base = &rows[0]["results"];
    println!("\n| variant | sparsity | phase | shape | ms | tokens/s | x dense | peak GiB |");
    println!("|---|---|---|---|---|---|---|---|");
    for row in &rows {
        let res = &row["results"];
        for (k, p) in res["prefill"].as_array().into_iter().flatten().enumerate() {
            let x = p["tokens_per_s"].as_f64().unwrap_or(0.0) / base["prefill"][k]["tokens_per_s"].as_f64().unwrap_or(1.0);
            println!("| {} | {} | prefill | 1 x {} | {:.2} | {:.0} | {:.2}x | {:.2} |", row["variant"].as_str().unwrap_or(""), row["sparsity"], p["tokens"], p["ms"].as_f64().unwrap_or(0.0), p["tokens_per_s"].as_f64().unwrap_or(0.0), x, p["peak_gib"].as_f64().unwrap_or(0.0));
        }
        for (k, d) in res["decode"].as_array().into_iter().flatten().enumerate() {
            let x = d["decode_tokens_per_s"].as_f64().unwrap_or(0.0) / base["decode"][k]["decode_tokens_per_s"].as_f64().unwrap_or(1.0);
            println!("| {} | {} | decode | batch {} | {:.3}/step | {:.1} | {:.2}x | {:.2} |", row["variant"].as_str().unwrap_or(""), row["sparsity"], d["batch"], d["ms_per_step"].as_f64().unwrap_or(0.0), d["decode_tokens_per_s"].as_f64().unwrap_or(0.0), x, d["peak_gib"].as_f64().unwrap_or(0.0));
        }
    }
    for row in &rows {
        if !row["results"]["profile"].is_null() {
            println!("profile {} {}: {}", row["variant"], row["sparsity"], row["results"]["profile"]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_width_keeps_whole_groups_and_names_what_does_not_fit() {
        let mc = presets::preset("llama-3.1-8b").unwrap();
        let k = kept_width_config(&mc, 0.5, 4, 128).unwrap();
        assert_eq!((k.num_attention_heads, k.num_key_value_heads, k.intermediate_size), (16, 8, 7168));
        assert_eq!((k.hidden_size, k.head_dim, k.num_hidden_layers, k.vocab_size), (mc.hidden_size, mc.head_dim, mc.num_hidden_layers, mc.vocab_size));
        // 0.3: 5.6 of 8 head groups -> 6 (24 heads), 78.4 of 112 FFN groups -> 78.
        let k = kept_width_config(&mc, 0.3, 4, 128).unwrap();
        assert_eq!((k.num_attention_heads, k.intermediate_size), (24, 78 * 128));
        let k = kept_width_config(&mc, 0.7, 4, 128).unwrap();
        assert_eq!((k.num_attention_heads, k.intermediate_size), (8, 34 * 128));
        // At least one group is kept.
        let k = kept_width_config(&mc, 0.99, 8, 128).unwrap();
        assert_eq!((k.num_attention_heads, k.intermediate_size), (8, 128));
        // 0.4: 5 of 8 groups = 20 heads over 8 K/V heads.
        let e = kept_width_config(&mc, 0.4, 4, 128).unwrap_err().to_string();
        assert!(e.contains("keeps 20 of the 32 query heads") && e.contains("8 K/V heads"), "{e}");
        let e = kept_width_config(&mc, 0.5, 4, 100).unwrap_err().to_string();
        assert!(e.contains("14336 FFN channels are not whole groups of 100"), "{e}");
    }
}
