//! Two GPUs against one with the same global batch (GPU machine with 2 GPUs, feature
//! `cuda-tests`): stage 1 and stage 2 on testbed-small give the same loss curve (per-step
//! |delta loss| <= 0.02, final loss within 0.5%), and the 2-GPU stage 1 checkpoint loads on one
//! GPU (stage 2 starts from it on 1 and on 2 GPUs).
//!
//! Needs `WIDE_TEST_DATA`: a folder with `corpus/manifest.json`, `tokenizer-8192.json` and
//! `tokens/` of testbed-small's data (a prefix of the training split is enough), and optionally
//! `WIDE_BIN` (the `wide` binary, when this test runs away from its build) and
//! `WIDE_TEST_OUT` (where the runs are kept).
#![cfg(feature = "cuda-tests")]
mod common;

use std::path::{Path, PathBuf};

fn wide_bin() -> PathBuf {
    std::env::var_os("WIDE_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_wide")))
}

fn data() -> PathBuf {
    PathBuf::from(std::env::var("WIDE_TEST_DATA").expect("set WIDE_TEST_DATA to testbed-small's data folder (corpus/, tokenizer-8192.json, tokens/)"))
}

fn run(nproc: usize, args: &[String]) {
    // Run from the checkout's root (the recipes' paths are relative to it).
    let mut c = std::process::Command::new(wide_bin());
    if nproc > 1 {
        c.args(["launch", "--nproc-per-node", &nproc.to_string(), "--"]);
    }
    c.args(args);
    let t = std::time::Instant::now();
    let o = c.output().unwrap();
    assert!(o.status.success(), "{:?} failed:\n{}", args, String::from_utf8_lossy(&o.stderr));
    eprintln!("{nproc} GPU(s): {} in {:.1} s", args[0], t.elapsed().as_secs_f64());
}

fn curve(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect()
}

/// Per-step and final agreement; returns (max |delta|, final relative difference).
fn compare(what: &str, one: &Path, two: &Path) -> (f64, f64) {
    let (a, b) = (curve(one), curve(two));
    assert!(a.len() >= 16, "{what}: only {} steps logged", a.len());
    assert_eq!(a.len(), b.len(), "{what}: step counts differ");
    let max = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let (fa, fb) = (a[a.len() - 1], b[b.len() - 1]);
    let rel = (fa - fb).abs() / fa.abs();
    eprintln!("{what}: {} steps, max per-step |delta loss| {max:.4}, final loss {fa:.4} (1 GPU) vs {fb:.4} (2 GPUs), {:.3}%", a.len(), 100.0 * rel);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 0.02, "{what}: step {}: loss {x} on 1 GPU, {y} on 2 GPUs", i + 1);
    }
    assert!(rel <= 0.005, "{what}: final loss {fa} on 1 GPU, {fb} on 2 GPUs");
    (max, rel)
}

#[test]
fn two_gpus_match_one_gpu_with_the_same_global_batch() {
    assert!(tch::Cuda::device_count() >= 2, "this test needs 2 GPUs");
    let keep = std::env::var_os("WIDE_TEST_OUT").map(PathBuf::from);
    let tmp = tempfile::tempdir().unwrap();
    let out = keep.unwrap_or_else(|| tmp.path().to_path_buf());
    let d = data();
    // 16 sequences of 1024 tokens per optimizer step: 2 micro-batches of 8 (one per GPU on 2).
    let sets = |extra: &[String]| -> Vec<String> {
        let mut v: Vec<String> = vec![
            format!("data.corpus_dir=\"{}\"", d.join("corpus").display()),
            format!("data.tokenizer=\"{}\"", d.join("tokenizer-8192.json").display()),
            format!("data.token_cache=\"{}\"", d.join("tokens").display()),
            "train.micro_batch=8".into(),
            "train.grad_accum=2".into(),
            "train.log_every=1".into(),
            "train.eval_every=100000".into(),
        ];
        v.extend(extra.iter().cloned());
        v.into_iter().flat_map(|s| ["--set".to_string(), s]).collect()
    };
    let stage1 = |dir: &Path| -> Vec<String> {
        let mut a = vec!["calibrate".to_string(), "--config".into(), "configs/calibrate-testbed-small.toml".into()];
        a.extend(sets(&["train.tokens=1048576".into(), format!("output.dir=\"{}\"", dir.display())]));
        a
    };
    let (s1a, s1b) = (out.join("s1-1gpu"), out.join("s1-2gpu"));
    run(1, &stage1(&s1a));
    run(2, &stage1(&s1b));
    compare("stage 1", &s1a, &s1b);
    // Stage 2 from the 2-GPU stage 1 files, on 1 and on 2 GPUs.
    let stage2 = |dir: &Path| -> Vec<String> {
        let mut a = vec!["recover".to_string(), "--config".into(), "configs/recover-testbed-small.toml".into(), "--stage1".into(), s1b.display().to_string()];
        a.extend(sets(&["train.tokens=524288".into(), format!("output.dir=\"{}\"", dir.display())]));
        a
    };
    let (s2a, s2b) = (out.join("s2-1gpu"), out.join("s2-2gpu"));
    run(1, &stage2(&s2a));
    run(2, &stage2(&s2b));
    compare("stage 2", &s2a, &s2b);
}
