//! Data-parallel training on CPU, over loopback and without NCCL: `wide launch` with two
//! processes reproduces the single process's loss curve and routers; a run resumes with
//! another process count; a rank that dies or hangs stops the others with a clear message and
//! leaves the last checkpoint intact; bootstrap and launch mistakes are refused clearly.
mod common;

use common::{assert_clear_error, logged_losses as losses, root, wide};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

const RECIPE: &str = "configs/calibrate-testbed-tiny.toml";

/// `calibrate` arguments: 8 optimizer steps of 2 micro-batches of 8 sequences.
fn calibrate_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec!["calibrate".into(), "--config".into(), root().join(RECIPE).display().to_string()];
    let mut sets = common::tiny_model_and_data_overrides();
    sets.extend(
        ["train.tokens=16384", "train.micro_batch=8", "train.grad_accum=2", "train.log_every=1", "train.eval_every=4", "train.checkpoint_every=2", "routing.calibrate_offsets=false"]
            .iter()
            .map(|s| s.to_string()),
    );
    sets.push(format!("output.dir=\"{}\"", out.display()));
    sets.extend(extra.iter().map(|s| s.to_string()));
    for s in sets {
        args.push("--set".into());
        args.push(s);
    }
    args
}

fn single(out: &Path, envs: &[(&str, &str)], extra_args: &[&str]) -> Output {
    let mut c = wide();
    c.args(calibrate_args(out, &[])).args(extra_args);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn launched(n: usize, out: &Path, envs: &[(&str, &str)], extra: &[&str]) -> Output {
    let mut c = wide();
    c.args(["launch", "--nproc-per-node", &n.to_string(), "--grace-seconds", "5", "--"]).args(calibrate_args(out, extra));
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// A loopback port nobody listens on now (for processes started without `wide launch`).
fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn assert_same_curve(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), 8, "{a:?}");
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "{what}: step {}: {x} vs {y}", i + 1);
    }
}

/// The data folders are shared with the other tests: build them once, before any process
/// races for them.
fn prepare_data() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut c = wide();
        c.args(calibrate_args(&dir.path().join("prep"), &[])).arg("--set").arg("train.tokens=2048");
        ok(&c.output().unwrap());
    });
}

#[test]
fn two_processes_match_one_and_resume_with_another_process_count() {
    prepare_data();
    let dir = tempfile::tempdir().unwrap();
    let (one, two, split) = (dir.path().join("one"), dir.path().join("two"), dir.path().join("split"));
    ok(&single(&one, &[], &[]));
    let o = launched(2, &two, &[], &[]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("data-parallel over 2 processes: 1 micro-batches of 8 per process per step"));
    // Same global batch, same samples, same Gumbel noise: the same curve.
    assert_same_curve(&losses(&one), &losses(&two), 1e-5, "2 processes vs 1");
    let ra = wide_core::safetensors::SafetensorsFile::open(&one.join("routers.safetensors")).unwrap();
    let rb = wide_core::safetensors::SafetensorsFile::open(&two.join("routers.safetensors")).unwrap();
    for name in ra.tensors.keys() {
        let d = (ra.read(name).unwrap() - rb.read(name).unwrap()).abs().max().double_value(&[]);
        assert!(d <= 1e-5, "{name} differs by {d}");
    }
    // Stop a 2-process run after step 4 (as a signal would), resume it with 1 process.
    ok(&launched(2, &split, &[("WIDE_STOP_AFTER_STEP", "4")], &[]));
    assert_eq!(losses(&split).len(), 4);
    ok(&single(&split, &[], &["--resume"]));
    assert_same_curve(&losses(&one), &losses(&split), 1e-5, "2 processes then 1 vs 1");
    // Stage 2 (LoRA with dropout + routers) from the 2-process stage 1 files, on 1 and on 2
    // processes: LoRA gradients are reduced too and dropout is keyed by the global sample.
    let (r1, r2) = (dir.path().join("recover-one"), dir.path().join("recover-two"));
    let recover = |out: &Path| -> Vec<String> {
        let mut a = calibrate_args(out, &["train.tokens=16384"]);
        a[0] = "recover".into();
        a[2] = root().join("configs/recover-testbed-tiny.toml").display().to_string();
        a.extend(["--stage1".to_string(), two.display().to_string()]);
        a
    };
    ok(&wide().args(recover(&r1)).output().unwrap());
    let mut c = wide();
    c.args(["launch", "--nproc-per-node", "2", "--grace-seconds", "5", "--"]).args(recover(&r2));
    ok(&c.output().unwrap());
    assert_same_curve(&losses(&r1), &losses(&r2), 1e-5, "stage 2: 2 processes vs 1");
}

#[test]
fn a_dead_rank_stops_the_others_and_the_last_checkpoint_survives() {
    prepare_data();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let t = Instant::now();
    let o = launched(2, &out, &[("WIDE_FAULT", "1:3:exit")], &[]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(t.elapsed() < Duration::from_secs(120), "took {:?}", t.elapsed());
    let last = stderr.lines().filter(|l| !l.trim().is_empty()).last().unwrap();
    assert!(last.starts_with("error: rank 1 exited with status 3; the other ranks were stopped"), "{stderr}");
    assert!(stderr.contains("error: rank 0: rank 1 stopped (its connection"), "{stderr}");
    // Steps 1 and 2 finished; the checkpoint of step 2 is complete.
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-0000002");
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("checkpoints/step-0000002/trainer_state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 2);
    assert!(wide_core::safetensors::SafetensorsFile::open(&out.join("checkpoints/step-0000002/trainable.safetensors")).is_ok());
}

#[test]
fn a_hung_rank_stops_the_others_within_the_timeout() {
    prepare_data();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let port = free_port();
    let t = Instant::now();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = wide();
            c.args(calibrate_args(&out, &[]))
                .env("WORLD_SIZE", "2")
                .env("RANK", rank.to_string())
                .env("MASTER_PORT", &port)
                .env("WIDE_DIST_TIMEOUT", "10")
                .env("WIDE_FAULT", "1:3:hang")
                .stderr(std::process::Stdio::piped())
                .stdout(std::process::Stdio::null());
            c.spawn().unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    assert!(t.elapsed() < Duration::from_secs(120), "took {:?}", t.elapsed());
    for (rank, o) in outs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {rank} succeeded: {stderr}");
        let last = stderr.lines().filter(|l| !l.trim().is_empty()).last().unwrap();
        assert!(last.starts_with(&format!("error: rank {rank}: ")), "{stderr}");
    }
    let r0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(r0.contains("no training progress for 10 s (WIDE_DIST_TIMEOUT)") || r0.contains("rank 1 stopped (its connection"), "{r0}");
}

#[test]
fn bootstrap_and_launch_mistakes_are_refused() {
    prepare_data();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    // Rank 0 alone: nobody joins within the bootstrap timeout.
    let port = free_port();
    let o = wide()
        .args(calibrate_args(&out, &[]))
        .env("WORLD_SIZE", "2")
        .env("RANK", "0")
        .env("MASTER_PORT", &port)
        .env("WIDE_DIST_BOOTSTRAP_TIMEOUT", "2")
        .output()
        .unwrap();
    assert_clear_error(&o, "rank 0 waited 2 s for the other ranks; missing: 1");
    let o = wide().args(calibrate_args(&out, &[])).env("WORLD_SIZE", "2").env("RANK", "2").output().unwrap();
    assert_clear_error(&o, "RANK 2 is not below WORLD_SIZE 2");
    let o = wide().args(["launch", "--nproc-per-node", "0", "--", "info", "x"]).output().unwrap();
    assert_clear_error(&o, "--nproc-per-node and --nnodes must be at least 1");
    // The global batch must split evenly over the processes.
    let o = launched(2, &out, &[], &["train.grad_accum=1"]);
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("train.grad_accum 1 (micro-batches per optimizer step over all processes) is not a multiple of the 2 processes"), "{stderr}");
    assert!(stderr.lines().last().unwrap().starts_with("error: rank "), "{stderr}");
}
