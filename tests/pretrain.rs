//! Stage 0 end to end on a small real corpus (part of the Linux kernel documentation that the
//! set-up installs): the pipeline, its outputs read back by Python tokenizers / transformers /
//! tensorboard, resume after SIGTERM, the NaN stop, and bad input.
mod common;

use common::{assert_clear_error, run_wide};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tch::{nn, Device, Kind, Tensor};
use wide_core::safetensors::SafetensorsFile;
use wide_core::{ForwardOptions, HfCheckpoint, LlamaModel, Tokenizer};

const DOCS: &str = "/usr/share/doc/linux-doc-6.1/Documentation/process";

fn recipe(dir: &Path, steps: u64, extra: &str) -> PathBuf {
    assert!(Path::new(DOCS).exists(), "{DOCS} is missing: run scripts/setup.sh (it installs linux-doc-6.1)");
    let text = format!(
        r#"name = "pretrain-test"
[model]
hidden_size = 64
intermediate_size = 256
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
max_position_embeddings = 64
[data]
sources = ["{DOCS}"]
corpus_dir = "{d}/corpus"
tokenizer = "{d}/tokenizer.json"
vocab_size = 512
token_cache = "{d}/tokens"
seq_len = 64
validation_fraction = 0.15
test_fraction = 0.15
[train]
micro_batch = 8
tokens = {tokens}
lr = 3e-3
warmup_frac = 0.0
log_every = 1
eval_every = 10
eval_batches = 2
checkpoint_every = 1000
device = "cpu"
dtype = "f32"
seed = 3
[output]
dir = "{d}/run"
{extra}"#,
        d = dir.display(),
        tokens = steps * 8 * 64
    );
    let p = dir.join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v["loss"].as_f64()?))
        })
        .collect()
}

#[test]
fn pretrain_outputs_load_in_transformers_tokenizers_and_tensorboard() {
    let dir = tempfile::tempdir().unwrap();
    let r = recipe(dir.path(), 40, "");
    let out = run_wide(&["pretrain", "--config", r.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = dir.path().join("run");
    for f in ["summary.json", "recipe.effective.toml", "metrics.jsonl", "loss_curve.png", "model/config.json", "model/tokenizer.json"] {
        assert!(run.join(f).exists(), "missing {f}");
    }
    let l = losses(&run.join("metrics.jsonl"));
    assert_eq!(l.len(), 40);
    assert!(l[39].1 < l[0].1 - 0.5, "loss did not fall: {} -> {}", l[0].1, l[39].1);

    // Python reads the tokenizer, the model and the TensorBoard scalars.
    let model_dir = run.join("model");
    let texts = vec![
        "The kernel development process is described in this document.".to_string(),
        "Patches should be sent to the maintainers: see MAINTAINERS, ünïcode too.".to_string(),
    ];
    let texts_path = dir.path().join("texts.json");
    std::fs::write(&texts_path, serde_json::to_string(&texts).unwrap()).unwrap();
    let oracle = dir.path().join("oracle");
    std::fs::create_dir(&oracle).unwrap();
    common::run_oracle("check_pretrained.py", &[&model_dir, &run.join("tb"), &texts_path, &oracle]);

    let tok = Tokenizer::from_file(&model_dir.join("tokenizer.json")).unwrap();
    let py_ids: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(oracle.join("ids.json")).unwrap()).unwrap();
    for (t, want) in texts.iter().zip(&py_ids) {
        assert_eq!(&tok.encode(t, false).unwrap(), want, "token ids differ from Python tokenizers for {t:?}");
    }

    let mut ckpt = HfCheckpoint::open(&model_dir).unwrap();
    let cfg = ckpt.config.clone();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = LlamaModel::new(&vs.root(), &cfg, &mut ckpt, Kind::Float, false).unwrap();
    let ids = Tensor::from_slice(&py_ids[0]).view([1, -1]);
    let ours = tch::no_grad(|| model.forward(&ids, ForwardOptions::default()).unwrap());
    let theirs = SafetensorsFile::open(&oracle.join("logits.safetensors")).unwrap().read("logits").unwrap();
    let err = (ours - theirs).abs().max().double_value(&[]);
    assert!(err <= 1e-4, "logits differ from transformers by {err}");

    let tb: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(oracle.join("tb.json")).unwrap()).unwrap();
    let tb_loss = tb["train/loss"].as_array().expect("train/loss scalars in TensorBoard");
    assert_eq!(tb_loss.len(), l.len());
    for (e, (step, loss)) in tb_loss.iter().zip(&l) {
        assert_eq!(e[0].as_u64().unwrap(), *step);
        assert!((e[1].as_f64().unwrap() - loss).abs() < 1e-5 * loss.abs().max(1.0));
    }
    assert!(tb["val/loss"].as_array().is_some_and(|v| v.len() == 4), "{}", tb["val/loss"]);
    for tag in ["train/lr", "train/grad_norm", "train/tokens_per_second"] {
        assert!(tb[tag].as_array().is_some_and(|v| !v.is_empty()), "no {tag}");
    }
}

#[test]
fn sigterm_checkpoints_and_resume_continues_the_same_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    // Reference: one uninterrupted run.
    let ref_dir = dir.path().join("ref");
    std::fs::create_dir(&ref_dir).unwrap();
    let r = recipe(&ref_dir, 120, "");
    let out = run_wide(&["pretrain", "--config", r.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = losses(&ref_dir.join("run/metrics.jsonl"));

    // Same recipe, stopped by SIGTERM part-way, then resumed.
    let int_dir = dir.path().join("int");
    std::fs::create_dir(&int_dir).unwrap();
    let r = recipe(&int_dir, 120, "");
    let child = common::wide().args(["pretrain", "--config", r.to_str().unwrap()]).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let metrics = int_dir.join("run/metrics.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&metrics).map(|s| s.lines().count()).unwrap_or(0) < 20 {
        assert!(t0.elapsed() < Duration::from_secs(120), "training did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let kill = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a pre-empted run exits cleanly: {stderr}");
    assert!(stderr.contains("stopped by signal at step"), "{stderr}");
    let stopped_at = losses(&metrics).len();
    assert!(stopped_at < 120, "the signal came too late to test resume");
    assert!(!int_dir.join("run/model").exists(), "an interrupted run must not look finished");

    let out = run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--resume"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = losses(&metrics);
    assert_eq!(got.len(), want.len());
    for ((s1, a), (s2, b)) in got.iter().zip(&want) {
        assert_eq!(s1, s2);
        assert!((a - b).abs() <= 1e-4, "step {s1}: resumed loss {a} vs uninterrupted {b} (stopped at {stopped_at})");
    }

    // Starting again over a finished run is refused; resuming with another model is refused.
    assert_clear_error(&run_wide(&["pretrain", "--config", r.to_str().unwrap()]), "already holds a training run");
    let out = run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--resume", "--set", "model.intermediate_size=128"]);
    assert_clear_error(&out, "was made with another model configuration");
}

#[test]
fn nan_loss_stops_and_keeps_the_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let r = recipe(dir.path(), 50, "");
    let out = run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--set", "train.lr=1e30", "--set", "train.checkpoint_every=1", "--set", "train.grad_clip=0"]);
    // The loss or, before it, the gradient norm turns non-finite; either stops the run before
    // the update.
    assert_clear_error(&out, "; stopping. The last good checkpoint is");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("the loss became") || stderr.contains("the gradient norm became"), "{stderr}");
    let latest = std::fs::read_to_string(dir.path().join("run/checkpoints/latest")).unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("run/checkpoints").join(latest.trim()).join("trainer_state.json")).unwrap()).unwrap();
    assert!(state["last_loss"].as_f64().unwrap().is_finite());
    assert!(!dir.path().join("run/model").exists());
}

#[test]
fn bad_pretrain_input_gives_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let r = recipe(dir.path(), 5, "");
    assert_clear_error(
        &run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--set", "data.seq_len=100"]),
        "data.seq_len 100 is longer than the model's context",
    );
    assert_clear_error(&run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--set", "train.bogus=1"]), "unknown field `bogus`");
    let missing = dir.path().join("nothing-here");
    assert_clear_error(
        &run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--set", &format!("data.sources=[\"{}\"]", missing.display())]),
        "does not exist",
    );
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::os::unix::fs::symlink(dir.path().join("gone.txt"), broken.join("a.txt")).unwrap();
    assert_clear_error(
        &run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--set", &format!("data.sources=[\"{}\"]", broken.display()), "--set", &format!("data.corpus_dir=\"{}/c2\"", dir.path().display())]),
        "cannot read",
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("a.txt"), "tiny").unwrap();
    assert_clear_error(
        &run_wide(&["pretrain", "--config", r.to_str().unwrap(), "--set", &format!("data.sources=[\"{}\"]", empty.display()), "--set", &format!("data.corpus_dir=\"{}/c3\"", dir.path().display())]),
        "the corpus is empty",
    );
    assert_clear_error(&run_wide(&["pretrain", "--config", dir.path().join("nope.toml").to_str().unwrap()]), "cannot read recipe");
}
