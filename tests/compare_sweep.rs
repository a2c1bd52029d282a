//! `wide compare` and `wide sweep` end to end on the committed testbed-tiny (CPU, tiny budgets):
//! outputs, dense-relative columns, resumability, and a failing sweep cell that does not stop
//! the rest.
mod common;

use common::{root, run_wide};
use std::path::Path;


/// The committed model, the shared data folders, and a tiny calibration budget.
fn data_overrides() -> Vec<String> {
    let mut v = common::tiny_model_and_data_overrides();
    v.push("train.tokens=4096".to_string());
    v
}

/// The data folders under target/test-data are shared: the tests here run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn set_args(ov: &[String]) -> Vec<String> {
    ov.iter().flat_map(|o| ["--set".to_string(), o.clone()]).collect()
}

#[test]
fn compare_writes_tables_relative_to_dense_and_reuses_calibrations() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cmp");
    let mut args = vec![
        "compare".to_string(),
        "--config".into(),
        root().join("configs/calibrate-testbed-tiny.toml").display().to_string(),
        "--variants".into(),
        "wide,layer_skip".into(),
        "--out".into(),
        out.display().to_string(),
        "--split".into(),
        "validation".into(),
    ];
    args.extend(set_args(&data_overrides()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run_wide(&refs);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in ["compare.md", "compare.csv", "compare.json", "compare.png"] {
        assert!(out.join(f).exists(), "missing {f}");
    }
    let cloze: Vec<_> = std::fs::read_dir(&out).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("cloze-validation-") && n.ends_with(".jsonl")).collect();
    assert_eq!(cloze.len(), 1, "one cloze task file named by the split's hash: {cloze:?}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("compare.json")).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["variant"].as_str().unwrap()).collect::<Vec<_>>(), vec!["dense", "wide", "layer_skip"]);
    assert_eq!(rows[0]["delta_loss"].as_f64().unwrap(), 0.0);
    let dense_loss = rows[0]["eval_loss"].as_f64().unwrap();
    for r in rows {
        assert_eq!(r["calibration_tokens"].as_u64().unwrap(), 4096);
        assert!((r["delta_loss"].as_f64().unwrap() - (r["eval_loss"].as_f64().unwrap() - dense_loss)).abs() < 1e-12);
        let acc = r["acc"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc));
    }
    assert!(rows[2]["skip_layer"].as_f64().is_some() && rows[1]["skip_attention"].as_f64().is_some());
    // A second run loads every calibrated variant instead of training it again.
    let o = run_wide(&refs);
    assert!(o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(stderr.matches("already calibrated").count(), 3, "{stderr}");
    // The same folder with another recipe: refused, naming what differs; nothing is retrained
    // over the finished calibrations.
    let manifest = std::fs::read(out.join("wide/routing.json")).unwrap();
    let mut other = args.clone();
    other.extend(["--set".to_string(), "routing.router_rank=8".to_string()]);
    let refs: Vec<&str> = other.iter().map(String::as_str).collect();
    let o = run_wide(&refs);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("holds a calibration of another run (differs in: routing.router_rank)"), "{stderr}");
    assert_eq!(std::fs::read(out.join("wide/routing.json")).unwrap(), manifest);
}

#[test]
fn sweep_records_a_failing_cell_goes_on_and_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let ov: Vec<String> = data_overrides().iter().map(|o| format!("\"{}\"", o.replace('"', "\\\""))).collect();
    let cfg = format!(
        "name = \"t\"\nrecipe = \"{}\"\nstage2_recipe = \"{}\"\nout = \"{}\"\nattn_group_sizes = [2]\nffn_group_sizes = [100, 128]\nsparsities = [0.5]\nstages = [1, 2]\nsplit = \"validation\"\noverrides = [{}]\n",
        root().join("configs/calibrate-testbed-tiny.toml").display(),
        root().join("configs/recover-testbed-tiny.toml").display(),
        out.display(),
        ov.join(", ")
    );
    let cfg_path = dir.path().join("sweep.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let run = || run_wide(&["sweep", "--config", cfg_path.to_str().unwrap(), "--set", "stages=[1]"]);
    let o = run();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cells = |p: &Path| -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p.join("sweep.json")).unwrap()).unwrap();
        v["cells"].as_array().unwrap().clone()
    };
    let c = cells(&out);
    assert_eq!(c.len(), 2);
    assert!(c[0]["error"].as_str().unwrap().contains("FFN group size 100 does not divide"), "{}", c[0]);
    assert!(c[1]["error"].is_null() && c[1]["delta_loss"].as_f64().is_some());
    assert!(out.join("heatmap-s0.5-stage1.png").exists());
    // Run again with stage 2 added: the finished stage 1 cell is skipped, its stage 2 runs.
    let o = run_wide(&["sweep", "--config", cfg_path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("done before, skipped"), "{stderr}");
    let c = cells(&out);
    assert_eq!(c.len(), 4);
    let s2 = c.iter().find(|x| x["stage"] == 2 && x["ffn_group_size"] == 128).unwrap();
    assert!(s2["error"].is_null() && s2["eval_loss"].as_f64().is_some(), "{s2}");
    // Stage 2 cells are measured against dense + the same LoRA training, not plain dense.
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap()).unwrap();
    let (d1, d2) = (v["dense_eval_loss"].as_f64().unwrap(), v["dense_lora_eval_loss"].as_f64().unwrap());
    assert_ne!(d1, d2);
    assert!((s2["delta_loss"].as_f64().unwrap() - (s2["eval_loss"].as_f64().unwrap() - d2)).abs() < 1e-12, "{s2}");
    assert!(out.join("dense-lora/routing.json").exists());
}
