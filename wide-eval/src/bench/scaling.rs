//! `wide bench scaling`: stage 1 training throughput on 1, 2, 4, ... GPUs of one machine. Runs
//! `wide bench train` once per process count (through `wide launch` above one), in separate
//! processes, and reports tokens/s, speedup and scaling efficiency against one GPU, the time
//! spent in the gradient all-reduce, and peak memory per GPU.
use crate::report::{write_json, Provenance};
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct ScalingConfig {
    /// Process (GPU) counts, e.g. [1, 2].
    pub nprocs: Vec<usize>,
    /// Arguments passed to every `wide bench train`.
    pub train_args: Vec<String>,
    pub out: Option<PathBuf>,
    pub commit: String,
}

pub fn run(cfg: &ScalingConfig) -> Result<serde_json::Value> {
    if cfg.nprocs.is_empty() {
        bail!("--nproc needs at least one process count, e.g. --nproc 1,2");
    }
    if cfg.train_args.iter().any(|a| a == "--out") {
        bail!("give --out to `wide bench scaling`, not to the bench train arguments");
    }
    let exe = std::env::current_exe().context("finding the wide executable")?;
    let dir = tempfile::tempdir()?;
    let mut runs = vec![];
    for &n in &cfg.nprocs {
        let out = dir.path().join(format!("train-{n}.json"));
        let mut c = std::process::Command::new(&exe);
        if n > 1 {
            c.args(["launch", "--nproc-per-node", &n.to_string(), "--"]);
        }
        c.args(["bench", "train"]).args(&cfg.train_args).arg("--out").arg(&out);
        eprintln!("== {n} GPU(s): {:?}", c.get_args().collect::<Vec<_>>());
        let status = c.status().with_context(|| format!("running bench train on {n} GPU(s)"))?;
        if !status.success() {
            bail!("bench train on {n} GPU(s) failed ({status}); its messages are above");
        }
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
        runs.push((n, r));
    }
    let base = runs.iter().find(|(n, _)| *n == 1).map(|(_, r)| r["tokens_per_s"].as_f64().unwrap_or(0.0));
    println!("\n| GPUs | ms/step | tokens/s | speedup | efficiency | all-reduce ms | peak GiB per GPU |");
    println!("|---|---|---|---|---|---|---|");
    let mut rows = vec![];
    for (n, r) in &runs {
        let tps = r["tokens_per_s"].as_f64().unwrap_or(0.0);
        let speedup = base.map(|b| tps / b);
        println!(
            "| {n} | {:.1} | {:.0} | {} | {} | {:.2} | {:.1} |",
            r["ms_per_step"].as_f64().unwrap_or(0.0),
            tps,
            speedup.map(|s| format!("{s:.2}x")).unwrap_or("-".into()),
            speedup.map(|s| format!("{:.1}%", 100.0 * s / *n as f64)).unwrap_or("-".into()),
            r["allreduce_ms"].as_f64().unwrap_or(0.0),
            r["peak_gib"].as_f64().unwrap_or(0.0)
        );
        rows.push(json!({"gpus": n, "tokens_per_s": tps, "speedup": speedup, "efficiency": speedup.map(|s| s / *n as f64), "ms_per_step": r["ms_per_step"], "allreduce_ms": r["allreduce_ms"], "peak_gib_per_gpu": r["peak_gib"], "run": r}));
    }
    let device = runs.first().and_then(|(_, r)| r["provenance"]["device"].as_str().map(String::from)).unwrap_or_default();
    let result = json!({
        "benchmark": "scaling",
        "provenance": Provenance::new(&cfg.commit, &device),
        "train_args": cfg.train_args,
        "runs": rows,
    });
    if let Some(out) = &cfg.out {
        write_json(out, &result)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(result)
}
