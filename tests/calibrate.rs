//! Stage 1 and stage 2 on the committed testbed-tiny model (CPU): sparsity targets are met on
//! held-out text, trained routers beat untrained ones at the same sparsity, stage 2 resumes
//! from stage 1 files, and bad input is refused clearly.
mod common;

use common::{assert_clear_error, root, run_wide};
use std::path::Path;
use tch::{Device, Kind};
use wide_train::calibrate::{calibrate_offsets, evaluate_routed, RoutedModel, RoutingManifest};
use wide_train::corpus::Split;

const RECIPE: &str = "configs/calibrate-testbed-tiny.toml";


/// The committed model, the shared data folders, and this run's output folder.
fn data_overrides(tmp: &Path) -> Vec<String> {
    let mut v = common::tiny_model_and_data_overrides();
    v.push(format!("output.dir=\"{}\"", tmp.display()));
    v
}

fn calibrate(out: &Path, extra: &[&str]) -> std::process::Output {
    calibrate_with_env(out, extra, &[])
}

/// [`calibrate`] with environment variables set for the run.
fn calibrate_with_env(out: &Path, extra: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut args: Vec<String> = vec!["calibrate".into(), "--config".into(), root().join(RECIPE).display().to_string()];
    for o in data_overrides(out).into_iter().chain(extra.iter().map(|s| s.to_string())) {
        args.push("--set".into());
        args.push(o);
    }
    // The data folders are shared: serialise their first build.
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    common::wide().args(&args).envs(env.iter().copied()).output().expect("running the wide binary")
}

fn manifest(dir: &Path) -> RoutingManifest {
    serde_json::from_str(&std::fs::read_to_string(dir.join("routing.json")).unwrap()).unwrap()
}

#[test]
fn per_router_targets_are_met_and_trained_routers_beat_untrained_ones() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s1");
    let o = calibrate(&out, &["routing.attn_target=0.5", "routing.ffn_target=0.5"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = manifest(&out);
    let h = m.heldout.as_ref().unwrap();
    for kind in ["attention", "ffn"] {
        let r = h.sparsity.skip_rate[kind];
        assert!((r - 0.5).abs() <= 0.03, "{kind}: held-out skip rate {r}, target 0.5");
    }
    assert!(h.sparsity.flops_fraction < 0.8 && h.sparsity.flops_fraction > 0.4, "{}", h.sparsity.flops_fraction);
    assert_eq!(m.calibration_tokens, 400_000u64.div_ceil(128) * 128);

    // Untrained (initial) routers brought to the same sparsity by the same offset search.
    let _g = tch::no_grad_guard();
    tch::manual_seed(0);
    let mut fresh = RoutedModel::new(&root().join("testbed/testbed-tiny"), &m.routing, Device::Cpu, Kind::Float).unwrap();
    fresh.routing.config.attn_logit_offset = 0.0;
    fresh.routing.config.ffn_logit_offset = 0.0;
    let data = root().join("target/test-data/tokens");
    let key = std::fs::read_dir(&data).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with("-L128")).unwrap();
    let files = wide_train::dataset::DatasetFiles { dir: key, seq_len: 128 };
    let train = files.open(Split::Train).unwrap();
    let val = files.open(Split::Validation).unwrap();
    let idx: Vec<u64> = (0..64).collect();
    let inputs = train.batch(&idx, 128).narrow(1, 0, 128);
    calibrate_offsets(&mut fresh, &inputs).unwrap();
    let base = evaluate_routed(&fresh, &val, 128, 16, 0).unwrap();
    for kind in ["attention", "ffn"] {
        assert!((base.sparsity.skip_rate[kind] - 0.5).abs() <= 0.05, "untrained routers at {:?}", base.sparsity.skip_rate);
    }
    assert!(h.loss < base.loss, "trained routers (loss {}) must beat untrained ones (loss {}) at the same sparsity", h.loss, base.loss);
    eprintln!("held-out loss: trained {:.4}, untrained {:.4}; skip rates {:?}", h.loss, base.loss, h.sparsity.skip_rate);

    // Stage 2 resumes from the stage 1 files.
    let s2 = dir.path().join("s2");
    let mut args: Vec<String> = vec!["recover".into(), "--config".into(), root().join("configs/recover-testbed-tiny.toml").display().to_string(), "--stage1".into(), out.display().to_string()];
    for o in data_overrides(&s2).into_iter().chain(["train.tokens=40000".to_string()]) {
        args.push("--set".into());
        args.push(o);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run_wide(&refs);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m2 = manifest(&s2);
    assert_eq!(m2.stage, 2);
    assert!(m2.lora.is_some() && s2.join("lora.safetensors").exists());
    let loaded = RoutedModel::load(&root().join("testbed/testbed-tiny"), &s2, Device::Cpu, Kind::Float).unwrap();
    assert!(loaded.lora.is_some());

    // Stage 2 refuses routers of another group size, and missing stage 1 files.
    let mut bad = refs.clone();
    bad.extend(["--set", "routing.ffn_group_size=64"]);
    assert_clear_error(&run_wide(&bad), "use attention group size 1 and FFN group size 32");
    let mut missing: Vec<&str> = refs.clone();
    let pos = missing.iter().position(|a| *a == "--stage1").unwrap();
    let nowhere = dir.path().join("nowhere");
    let nowhere = nowhere.to_str().unwrap();
    missing[pos + 1] = nowhere;
    assert_clear_error(&run_wide(&missing), "has no routing.json: run `wide calibrate` first");
}

#[test]
fn a_shared_target_is_met_on_average() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s1");
    let o = calibrate(&out, &["routing.sparse_target=\"all\"", "train.tokens=200000"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let h = manifest(&out).heldout.unwrap();
    let avg = (h.sparsity.skip_rate["attention"] + h.sparsity.skip_rate["ffn"]) / 2.0;
    assert!((avg - 0.5).abs() <= 0.03, "average held-out skip rate {avg}");
}

#[test]
fn bad_routing_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    assert_clear_error(&calibrate(&out, &["routing.ffn_group_size=100"]), "FFN group size 100 does not divide the intermediate size 512");
    assert_clear_error(&calibrate(&out, &["routing.attn_group_size=3"]), "attention group size 3 does not divide the 4 attention heads");
    assert_clear_error(&calibrate(&out, &["routing.target_sparsity=1.2"]), "target_sparsity must be in [0, 1), got 1.2");
    assert_clear_error(&calibrate(&out, &["routing.variant=\"deep\""]), "unknown variant");
    // Routers trained for one model do not load onto another.
    let small = root().join("testbed/testbed-small");
    let s1 = dir.path().join("s1");
    // A mistyped environment knob is named once and ignored: the run trains to its end.
    let o = calibrate_with_env(&s1, &["train.tokens=4096"], &[("WIDE_STOP_AFTER_STEP", "three")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let warning = "warning: WIDE_STOP_AFTER_STEP takes an integer of at least 0 (optimizer steps), got 'three'; ignored, the default is kept";
    assert_eq!(err.matches(warning).count(), 1, "{err}");
    let e = RoutedModel::load(&small, &s1, Device::Cpu, Kind::Float).err().expect("must refuse");
    assert!(format!("{e:#}").contains("were trained for another model"), "{e:#}");
}

#[test]
fn activation_checkpointing_trains_the_same_routers() {
    let dir = tempfile::tempdir().unwrap();
    let (plain, ckpt) = (dir.path().join("plain"), dir.path().join("ckpt"));
    let common = ["train.tokens=16384", "train.log_every=1", "train.eval_every=1000", "routing.calibrate_offsets=false"];
    let o = calibrate(&plain, &common);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut with = common.to_vec();
    with.push("train.activation_checkpointing=true");
    let o = calibrate(&ckpt, &with);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (a, b) = (common::logged_losses(&plain), common::logged_losses(&ckpt));
    assert_eq!(a.len(), 8, "{a:?}");
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-3, "step {}: loss {x} without checkpointing, {y} with", i + 1);
    }
    // The routers they wrote agree.
    let ra = wide_core::safetensors::SafetensorsFile::open(&plain.join("routers.safetensors")).unwrap();
    let rb = wide_core::safetensors::SafetensorsFile::open(&ckpt.join("routers.safetensors")).unwrap();
    assert!(!ra.tensors.is_empty());
    for name in ra.tensors.keys() {
        let (x, y) = (ra.read(name).unwrap(), rb.read(name).unwrap());
        let d = (&x - &y).abs().max().double_value(&[]);
        assert!(d <= 1e-3 * (1.0 + x.abs().max().double_value(&[])), "{name} differs by {d}");
    }
}
