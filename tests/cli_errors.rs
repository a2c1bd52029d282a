//! Bad input gets one clear error line and a non-zero exit.
mod common;

use common::{assert_clear_error, run_wide};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use wide_core::safetensors::{write, SafetensorsFile};

fn tiny_model(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    let out = run_wide(&["new-model", "--preset", "tiny", "--out", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// Rewrites `model.safetensors` of `dir` through `edit` (name, tensor) -> kept tensors.
fn edit_weights(dir: &Path, edit: impl Fn(Vec<(String, tch::Tensor)>) -> Vec<(String, tch::Tensor)>) {
    let p = dir.join("model.safetensors");
    let f = SafetensorsFile::open(&p).unwrap();
    let all: Vec<_> = f.tensors.keys().map(|n| (n.clone(), f.read(n).unwrap())).collect();
    drop(f);
    write(&p, &edit(all), &BTreeMap::new()).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn missing_folder_and_missing_config() {
    let root = tempfile::tempdir().unwrap();
    assert_clear_error(&run_wide(&["info", s(&root.path().join("nope"))]), "does not exist");
    let empty = root.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_clear_error(&run_wide(&["info", s(&empty)]), "has no config.json");
}

#[test]
fn unsupported_architecture_is_named() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let out = run_wide(&["info", s(&dir)]);
    assert_clear_error(&out, "unsupported architecture");
    assert_clear_error(&out, "gpt_neox");
}

#[test]
fn missing_tensor_is_named() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    edit_weights(&dir, |all| all.into_iter().filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight").collect());
    assert_clear_error(&run_wide(&["info", s(&dir), "--load"]), "missing tensor model.layers.1.mlp.up_proj.weight");
    assert_clear_error(&run_wide(&["generate", s(&dir), "--prompt", "hi"]), "missing tensor model.layers.1.mlp.up_proj.weight");
}

#[test]
fn wrong_shape_names_tensor_expected_and_actual() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    edit_weights(&dir, |all| {
        all.into_iter()
            .map(|(n, t)| if n == "model.layers.0.self_attn.k_proj.weight" { (n, t.narrow(0, 0, 32)) } else { (n, t) })
            .collect()
    });
    let out = run_wide(&["info", s(&dir), "--load"]);
    assert_clear_error(&out, "tensor model.layers.0.self_attn.k_proj.weight");
    assert_clear_error(&out, "has shape [32, 128], expected [64, 128]");
}

#[test]
fn truncated_safetensors_is_reported() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    assert_clear_error(&run_wide(&["info", s(&dir)]), "truncated");
}

#[test]
fn pickle_checkpoints_are_refused_not_unpickled() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    // Not a real pickle: wide must refuse by name, without opening it.
    std::fs::write(dir.join("pytorch_model.bin"), b"\x80\x04not-read").unwrap();
    let out = run_wide(&["info", s(&dir)]);
    assert_clear_error(&out, "pickle checkpoint (pytorch_model.bin)");
    assert_clear_error(&out, "save_pretrained(OUT, safe_serialization=True)");
}

#[test]
fn prompt_longer_than_context() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    let long = "word ".repeat(120); // 600 byte tokens + BOS > 512 positions
    assert_clear_error(&run_wide(&["generate", s(&dir), "--prompt", &long, "--device", "cpu"]), "exceeds the model's context of 512 positions");
}

#[test]
fn bad_flags() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    assert_clear_error(&run_wide(&["generate", s(&dir), "--prompt", "x", "--device", "tpu"]), "unknown device");
    assert_clear_error(&run_wide(&["generate", s(&dir), "--prompt", "x", "--top-p", "0"]), "--top-p");
    assert_clear_error(&run_wide(&["generate", s(&dir), "--prompt", "x", "--device", "cpu", "--max-new-tokens", "0"]), "--max-new-tokens must be at least 1");
    let out = run_wide(&["new-model", "--preset", "tiny", "--out", s(&dir)]);
    assert_clear_error(&out, "already exists");
}

#[test]
fn generate_streams_text_and_is_reproducible() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    let args = ["generate", s(&dir), "--prompt", "Hello", "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "4", "--device", "cpu"];
    let a = run_wide(&args);
    let b = run_wide(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout, "same seed, same text");
    assert!(String::from_utf8_lossy(&a.stdout).starts_with("Hello"));
    assert!(String::from_utf8_lossy(&a.stderr).contains("new tokens"));
}

#[test]
fn version_names_the_commit() {
    let out = run_wide(&["--version"]);
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(v.contains("commit "), "{v}");
}

#[test]
fn bench_kernels_names_a_bad_l2_mode() {
    // Checked before anything needs the GPU.
    let out = run_wide(&["bench", "kernels", "--ops", "attn_prefill", "--l2", "cold,lukewarm", "--device", "cpu"]);
    assert_clear_error(&out, "--l2 takes cold, cold-clean or warm, got lukewarm");
}

#[test]
fn bench_kernels_names_a_bad_mask_pattern() {
    let out = run_wide(&["bench", "kernels", "--ops", "up", "--mask-pattern", "striped", "--device", "cpu"]);
    assert_clear_error(&out, "unknown mask pattern `striped`: use random, prefix, random-even or prefix-uneven");
}

#[test]
fn bench_e2e_names_an_op_it_cannot_repeat() {
    // Checked before the model is built.
    let out = run_wide(&["bench", "e2e", "--device", "cpu", "--repeat-ops", "qkv,router"]);
    assert_clear_error(&out, "unknown op `router` for --repeat-ops: use embed, norm, qkv");
}

#[test]
fn kernels_precompile_names_a_bad_architecture_or_family() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("k");
    assert_clear_error(&run_wide(&["kernels", "precompile", "--arch", "hopper", "--out", s(&out)]), "unknown GPU architecture `hopper`: use sm_XY");
    assert_clear_error(&run_wide(&["kernels", "precompile", "--only", "infer,gemm", "--out", s(&out)]), "unknown kernel family `gemm`: choose from");
    assert!(!out.exists(), "nothing is written when the arguments are wrong");
}

#[test]
fn bench_counts_that_cannot_be_timed_are_refused() {
    assert_clear_error(&run_wide(&["bench", "dense", "--preset", "tiny", "--device", "cpu", "--iters", "0"]), "--iters must be at least 1");
    assert_clear_error(&run_wide(&["bench", "e2e", "--device", "cpu", "--new-tokens", "1"]), "--new-tokens must be at least 2");
    assert_clear_error(&run_wide(&["bench", "dense", "--preset", "tiny", "--device", "cpu", "--decode-batches", "1,0"]), "--decode-batches takes positive values, got 0");
    assert_clear_error(&run_wide(&["bench", "kernels", "--ops", "up", "--device", "cpu", "--m", "0"]), "--m takes positive values, got 0");
}

#[test]
fn the_binary_runs_without_the_setup_environment() {
    // Its run path names the libtorch it was built against (build.rs), so a user can run
    // `target/release/wide` from a plain shell.
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m");
    let out = common::wide().env_remove("LD_LIBRARY_PATH").args(["new-model", "--preset", "tiny", "--out", s(&dir)]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = common::wide().env_remove("LD_LIBRARY_PATH").args(["info", s(&dir)]).output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("parameters"), "{}", String::from_utf8_lossy(&out.stderr));
}
