//! Helpers shared by the end-to-end tests.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `wide` binary cargo built for these tests.
pub fn wide() -> Command {
    Command::new(env!("CARGO_BIN_EXE_wide"))
}

/// Runs `wide` with `args`, returning its output.
pub fn run_wide(args: &[&str]) -> Output {
    wide().args(args).output().expect("running the wide binary")
}

/// The Python interpreter of the project's environment. Oracle tests fail (never skip) when it
/// or `transformers` is missing: `scripts/setup.sh` installs both.
pub fn python() -> PathBuf {
    let candidates = [std::env::var("WIDE_VENV").ok().map(|v| PathBuf::from(v).join("bin/python")), Some("python3".into())];
    for c in candidates.into_iter().flatten() {
        let ok = Command::new(&c)
            .args(["-c", "import torch, transformers, safetensors"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return c;
        }
    }
    panic!("Python with torch, transformers and safetensors is required for the oracle tests: run scripts/setup.sh and use its environment (eval \"$(scripts/setup.sh --print-env)\")");
}

/// Runs a Python script from `tests/oracle/` with `args`; panics with its output on failure.
pub fn run_oracle(script: &str, args: &[&Path]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle").join(script);
    let out = Command::new(python()).arg(&path).args(args).output().expect("running python");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts that a command failed with one clear error line containing `needle`: exactly one
/// `error: ` line, and it is the last thing on stderr (progress lines may come before it).
pub fn assert_clear_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let errors: Vec<&&str> = lines.iter().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "expected one error line, got:\n{stderr}");
    assert!(lines.last().is_some_and(|l| l.starts_with("error: ")), "the error must be the last line:\n{stderr}");
    assert!(errors[0].contains(needle), "error line does not mention {needle:?}: {stderr}");
}

/// The training loss of every logged step of a run, from its `metrics.jsonl`.
pub fn logged_losses(run_dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect()
}

/// The checkout's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `--set` overrides that point a testbed-tiny calibration recipe at the committed model and
/// at data folders shared by the tests under `target/test-data` (built on first use).
pub fn tiny_model_and_data_overrides() -> Vec<String> {
    let data = root().join("target/test-data");
    vec![
        format!("model_dir=\"{}\"", root().join("testbed/testbed-tiny").display()),
        format!("data.corpus_dir=\"{}\"", data.join("corpus").display()),
        format!("data.tokenizer=\"{}\"", data.join("tokenizer-tiny.json").display()),
        format!("data.token_cache=\"{}\"", data.join("tokens").display()),
    ]
}

/// CUDA device 0 for a GPU test, held by the calling test until its thread ends. A CUDA graph
/// capture registers libtorch's CUDA generator and caching allocator process-wide, so another
/// test's `rand` or allocation during a capture fails or invalidates it: the GPU tests of one
/// binary run one at a time (each takes the device with its first call).
pub fn exclusive_gpu() -> tch::Device {
    use std::cell::RefCell;
    use std::sync::{Mutex, MutexGuard};
    static GPU: Mutex<()> = Mutex::new(());
    thread_local! {
        static HELD: RefCell<Option<MutexGuard<'static, ()>>> = const { RefCell::new(None) };
    }
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.is_none() {
            // A failed test poisons the lock; the next one still runs.
            *h = Some(GPU.lock().unwrap_or_else(|e| e.into_inner()));
        }
    });
    assert!(tch::Cuda::is_available(), "cuda-tests need a CUDA device (libtorch sees none)");
    tch::Device::Cuda(0)
}
