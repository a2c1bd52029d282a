//! `wide export` end to end on the committed testbed-tiny (CPU): stage 1 routers and stage 2
//! LoRA exported, then run by something no one here wrote. Python `transformers` loads the
//! merged folder and reproduces `wide`'s dense logits; python/wide_torch.py on top of it
//! reproduces `wide`'s skip masks and routed logits; the physically pruned `static_width` model
//! loaded by `transformers` matches `wide`'s `static_width` logits; the PEFT adapter recomputes
//! the merged weights. Bad input (routers or LoRA of another model or group size, missing LoRA
//! tensors, an existing output folder, a disk that fills up midway) is refused clearly and
//! leaves nothing at the target path.
mod common;

use common::{assert_clear_error, root, run_wide};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Kind, Tensor};
use wide_core::routing::{GateMode, RoutingRun};
use wide_core::safetensors::{self as st, SafetensorsFile};
use wide_core::ForwardOptions;
use wide_train::export::ExportSources;

/// Stage folders shared by the tests of this file.
struct Stages {
    _dir: tempfile::TempDir,
    /// Stage 1 `wide` routers.
    s1: PathBuf,
    /// Stage 2 (LoRA) on top of `s1`.
    s2: PathBuf,
    /// Stage 1 `static_width` masks.
    sw: PathBuf,
}

fn tiny() -> PathBuf {
    root().join("testbed/testbed-tiny")
}

fn wide_ok(args: &[String]) -> std::process::Output {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run_wide(&refs);
    assert!(o.status.success(), "wide {args:?} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    o
}

/// A stage run on testbed-tiny with a small corpus of its own (the kernel's development-process
/// documents, 10% held out), so that the held-out evaluation of each stage takes seconds.
fn stage_args(cmd: &str, recipe: &str, data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec![cmd.to_string(), "--config".into(), root().join(recipe).display().to_string()];
    let mut ov = vec![
        format!("model_dir=\"{}\"", tiny().display()),
        format!("data.sources=[\"{}/process\"]", wide_train::corpus::LINUX_DOC),
        format!("data.corpus_dir=\"{}\"", data.join("corpus").display()),
        format!("data.tokenizer=\"{}\"", data.join("tokenizer.json").display()),
        format!("data.token_cache=\"{}\"", data.join("tokens").display()),
        "data.validation_fraction=0.1".to_string(),
        format!("output.dir=\"{}\"", out.display()),
    ];
    ov.extend(extra.iter().map(|s| s.to_string()));
    for o in ov {
        args.push("--set".into());
        args.push(o);
    }
    args
}

/// Small but real stage runs: routers and LoRA change from their initial values, and the
/// stage 1 inference offsets are calibrated so that the masks are mixed. Stage 2 uses a large
/// learning rate so that the merged LoRA visibly changes the weights (its own offsets are not
/// needed: the export takes the stage 1 routers).
fn stages() -> &'static Stages {
    static S: OnceLock<Stages> = OnceLock::new();
    S.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let (s1, s2, sw) = (dir.path().join("s1"), dir.path().join("s2"), dir.path().join("sw"));
        let t0 = std::time::Instant::now();
        let cal = "configs/calibrate-testbed-tiny.toml";
        wide_ok(&stage_args("calibrate", cal, &data, &s1, &["train.tokens=8192", "routing.offset_calibration_sequences=16"]));
        let mut a = stage_args("recover", "configs/recover-testbed-tiny.toml", &data, &s2, &["train.tokens=8192", "train.lr=1e-2", "routing.calibrate_offsets=false"]);
        a.extend(["--stage1".to_string(), s1.display().to_string()]);
        wide_ok(&a);
        wide_ok(&stage_args("calibrate", cal, &data, &sw, &["train.tokens=8192", "routing.variant=\"static_width\""]));
        eprintln!("stage folders built in {:.1}s", t0.elapsed().as_secs_f64());
        Stages { _dir: dir, s1, s2, sw }
    })
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// A left-padded batch of real prompts: `input_ids`, `attention_mask`, `position_ids` [B, T].
fn prompts(path: &Path) -> (Tensor, Tensor, Tensor) {
    let tok = wide_core::Tokenizer::from_file(&tiny().join("tokenizer.json")).unwrap();
    let texts = [
        "The kernel loads the driver when the device appears on the bus, and the module registers its interrupt handler.",
        "Python lists are mutable sequences.",
        "To build the documentation, run make htmldocs in the top-level source directory; the output goes to Documentation/output.",
        "Memory barriers order loads and stores.",
        "def main():\n    print('hello')",
    ];
    let rows: Vec<Vec<i64>> = texts.iter().map(|t| tok.encode(t, false).unwrap()).collect();
    let t = rows.iter().map(Vec::len).max().unwrap();
    let (mut ids, mut mask, mut pos) = (vec![], vec![], vec![]);
    for r in &rows {
        let pad = t - r.len();
        ids.extend(std::iter::repeat_n(0i64, pad).chain(r.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1, r.len())));
        pos.extend(std::iter::repeat_n(0i64, pad).chain(0..r.len() as i64));
    }
    let shape = [rows.len() as i64, t as i64];
    let (ids, mask, pos) = (Tensor::from_slice(&ids).view(shape), Tensor::from_slice(&mask).view(shape), Tensor::from_slice(&pos).view(shape));
    st::write(path, &[("input_ids".into(), ids.shallow_clone()), ("attention_mask".into(), mask.shallow_clone()), ("position_ids".into(), pos.shallow_clone())], &Default::default()).unwrap();
    (ids, mask, pos)
}

/// Max-abs difference over real (non-padding) positions of `[B, T, ..]` tensors.
fn max_abs_real(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let mut real = mask.ne(0);
    while real.dim() < a.dim() {
        real = real.unsqueeze(-1);
    }
    (a - b).abs().masked_fill(&real.logical_not(), 0.0).max().double_value(&[])
}

fn export(args: &[&str]) -> std::process::Output {
    let mut v = vec!["export"];
    v.extend(args);
    run_wide(&v)
}

#[test]
fn exported_model_runs_in_transformers_and_wide_torch_like_in_wide() {
    let s = stages();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let exp = d.join("exp");
    let t0 = std::time::Instant::now();
    let o = export(&[tiny().to_str().unwrap(), "--routers", s.s1.to_str().unwrap(), "--lora", s.s2.to_str().unwrap(), "--out", exp.to_str().unwrap(), "--shard-size", "2MB"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let sw = d.join("sw");
    let o = export(&[tiny().to_str().unwrap(), "--routers", s.sw.to_str().unwrap(), "--out", sw.to_str().unwrap(), "--pruned"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    eprintln!("{}", String::from_utf8_lossy(&o.stdout));
    eprintln!("two exports in {:.1}s", t0.elapsed().as_secs_f64());

    // The files.
    for f in ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json", "wide_routing.json", "wide_routing.safetensors", "peft/adapter_config.json", "peft/adapter_model.safetensors"] {
        assert!(exp.join(f).exists(), "missing {f}");
    }
    let shards = read_json(&exp.join("model.safetensors.index.json"))["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap().to_string()).collect::<std::collections::BTreeSet<_>>();
    assert!(shards.len() >= 3, "2 MB shards of a 6 MB model: {shards:?}");
    let m = read_json(&exp.join("wide_routing.json"));
    let s1m = read_json(&s.s1.join("routing.json"));
    assert_eq!(m["variant"], "wide");
    assert_eq!((m["attn_group_size"].as_i64(), m["ffn_group_size"].as_i64(), m["router_rank"].as_i64()), (Some(1), Some(32), Some(32)));
    assert_eq!(m["routers"]["ffn"]["groups"], 16);
    assert_eq!(m["logit_offsets"]["ffn"], s1m["routing"]["ffn_logit_offset"]);
    assert_eq!(m["targets"]["target_sparsity"], 0.5);
    assert_eq!(m["achieved"]["heldout"]["skip_rate"], s1m["heldout"]["sparsity"]["skip_rate"]);
    assert_eq!(m["sources"]["routers"]["commit"], s1m["provenance"]["commit"]);
    assert_eq!(m["sources"]["routers"]["recipe"]["routing"]["variant"], "wide");
    assert!(m["sources"]["lora"]["recipe"]["lora"]["rank"].as_i64() == Some(16));
    assert_eq!(m["lora"]["rank"], 16);
    assert!(m["export"]["provenance"]["commit"].is_string());
    let swm = read_json(&sw.join("wide_routing.json"));
    assert_eq!(swm["variant"], "static_width");
    assert_eq!(swm["static_groups"][0]["attention"].as_array().unwrap().len(), 2);
    let pc = read_json(&sw.join("pruned/config.json"));
    assert_eq!((pc["num_attention_heads"].as_i64(), pc["intermediate_size"].as_i64()), (Some(2), Some(256)));
    assert_eq!(swm["pruned"]["shape"]["intermediate_size"], 256);

    // wide's own outputs on a batch of prompts.
    let (ids, mask, pos) = prompts(&d.join("inputs.safetensors"));
    let _g = tch::no_grad_guard();
    let src = ExportSources::load(&tiny(), &s.s1, Some(&s.s2), Some(Kind::Float)).unwrap();
    let model = src.model.model();
    let opts = || ForwardOptions { position_ids: Some(&pos), attention_mask: Some(&mask), ..Default::default() };
    let dense = model.forward(&ids, opts()).unwrap();
    let valid = mask.to_kind(Kind::Float);
    let mut run = RoutingRun::new(&src.model.routing, GateMode::Inference, valid.shallow_clone());
    run.gates = Some(vec![]);
    let routed = model.forward_routed(&ids, opts(), &mut run).unwrap();
    let gates = run.gates.take().unwrap();
    let wide_rates: Vec<(String, f64)> = run.stats.kinds().iter().map(|k| (k.name().to_string(), run.stats.skip_rate(*k).unwrap().double_value(&[]))).collect();
    let swsrc = ExportSources::load(&tiny(), &s.sw, None, Some(Kind::Float)).unwrap();
    let mut srun = RoutingRun::new(&swsrc.model.routing, GateMode::Inference, valid.shallow_clone());
    let static_logits = swsrc.model.model().forward_routed(&ids, opts(), &mut srun).unwrap();

    // The same through transformers and wide_torch.
    let t1 = std::time::Instant::now();
    let out = d.join("oracle");
    std::fs::create_dir(&out).unwrap();
    common::run_oracle("check_export.py", &[&exp, &sw, &tiny(), &d.join("inputs.safetensors"), &out]);
    eprintln!("python oracle in {:.1}s", t1.elapsed().as_secs_f64());
    let o = SafetensorsFile::open(&out.join("oracle.safetensors")).unwrap();
    let get = |n: &str| o.read(n).unwrap();
    let checks = read_json(&out.join("checks.json"));

    let dense_diff = max_abs_real(&dense, &get("dense_logits"), &mask);
    assert!(dense_diff <= 1e-4, "dense logits: transformers on the merged folder vs wide differ by {dense_diff:e}");
    assert!(max_abs_real(&get("disabled_logits"), &get("dense_logits"), &mask) <= 1e-6, "wide_torch disabled must be the dense model");

    // Skip masks: equal wherever wide's margin exceeds 1e-4.
    let calls: Vec<(i64, String)> = checks["gates"].as_array().unwrap().iter().map(|g| (g[0].as_i64().unwrap(), g[1].as_str().unwrap().to_string())).collect();
    assert_eq!(calls, gates.iter().map(|g| (g.layer as i64, g.kind.name().to_string())).collect::<Vec<_>>(), "router calls in the same order");
    let (mut compared, mut total, mut skipped) = (0i64, 0i64, 0i64);
    let mut row_ok = vec![true; ids.size()[0] as usize];
    for (n, g) in gates.iter().enumerate() {
        let ours = g.execute.ne(0);
        let theirs = get(&format!("gate_{n}_execute")).ne(0);
        let margin = g.margin.as_ref().unwrap();
        let real = mask.ne(0).unsqueeze(-1).expand_as(&ours);
        let decided = margin.abs().gt(1e-4).logical_and(&real);
        let differ = ours.logical_xor(&theirs).logical_and(&real);
        let bad = differ.logical_and(&decided).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(bad, 0, "gate {n} (layer {}, {}): {bad} decisions with margin > 1e-4 differ", g.layer, g.kind.name());
        let margin_diff = max_abs_real(margin, &get(&format!("gate_{n}_margin")), &mask);
        assert!(margin_diff <= 1e-4, "gate {n}: margins differ by {margin_diff:e}");
        for (r, ok) in row_ok.iter_mut().enumerate() {
            *ok &= differ.get(r as i64).sum(Kind::Int64).int64_value(&[]) == 0;
        }
        compared += decided.sum(Kind::Int64).int64_value(&[]);
        total += real.sum(Kind::Int64).int64_value(&[]);
        skipped += ours.logical_not().logical_and(&real).sum(Kind::Int64).int64_value(&[]);
    }
    assert!(compared * 100 >= total * 99, "only {compared} of {total} gate decisions had a margin above 1e-4");
    assert!(skipped * 5 > total && skipped * 5 < total * 4, "masks should be mixed: {skipped} of {total} skipped");
    for (kind, rate) in &wide_rates {
        let theirs = checks["skip_rates"][kind].as_f64().unwrap();
        assert!((theirs - rate).abs() <= 1e-3, "{kind} skip rate: wide {rate}, wide_torch {theirs}");
    }

    // Routed logits, in every row whose masks agree everywhere (all rows, unless a near-tie
    // went the other way).
    let rows: Vec<i64> = (0..row_ok.len() as i64).filter(|r| row_ok[*r as usize]).collect();
    assert!(rows.len() * 2 > row_ok.len(), "too few rows with identical masks: {row_ok:?}");
    let idx = Tensor::from_slice(&rows);
    let routed_diff = max_abs_real(&routed.index_select(0, &idx), &get("routed_logits").index_select(0, &idx), &mask.index_select(0, &idx));
    assert!(routed_diff <= 1e-4, "routed logits: wide_torch vs wide differ by {routed_diff:e}");
    assert!(max_abs_real(&routed, &dense, &mask) > 1e-2, "routing must change the logits");

    // static_width: the masks through wide_torch, and the physically pruned model.
    let static_diff = max_abs_real(&static_logits, &get("static_logits"), &mask);
    assert!(static_diff <= 1e-4, "static_width logits: wide_torch vs wide differ by {static_diff:e}");
    let pruned_diff = max_abs_real(&static_logits, &get("pruned_logits"), &mask);
    assert!(pruned_diff <= 1e-4, "static_width logits: the pruned model in transformers vs wide differ by {pruned_diff:e}");
    assert!(checks["pruned_parameters"].as_i64().unwrap() < checks["static_parameters"].as_i64().unwrap());
    assert!(checks["attach_to_pruned"].as_str().unwrap().contains("were exported for a model with"), "{}", checks["attach_to_pruned"]);

    // The PEFT adapter recomputes the merged weights, and the LoRA matters.
    let p = &checks["peft"];
    assert_eq!(p["tensors"], 2 * 7 * 4);
    assert!(p["merge_max_abs"].as_f64().unwrap() <= 1e-6, "W_merged - (W + alpha/r B A): {}", p["merge_max_abs"]);
    assert!(p["lora_delta_max_abs"].as_f64().unwrap() > 1e-3, "the LoRA update is too small to test: {}", p["lora_delta_max_abs"]);

    // wide_torch as a script.
    let sample = d.join("sample.txt");
    std::fs::write(&sample, std::fs::read_to_string(root().join("README.md")).unwrap().chars().take(3000).collect::<String>()).unwrap();
    let script = root().join("python/wide_torch.py");
    let o = std::process::Command::new(common::python()).arg(&script).arg(&exp).arg("--text").arg(&sample).arg("--max-tokens").arg("300").output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && stdout.contains("routed  loss") && stdout.contains("ffn"), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    eprintln!(
        "dense max-abs {dense_diff:.2e}; {compared}/{total} gate decisions compared, {} of {} rows; routed max-abs {routed_diff:.2e}; static_width {static_diff:.2e}, pruned {pruned_diff:.2e}; merge {:.2e}\n{stdout}",
        rows.len(),
        row_ok.len(),
        p["merge_max_abs"].as_f64().unwrap()
    );
}

/// No folder at `out`, and nothing named after it next to it (temporary folders included)
/// that looks like a complete export.
fn assert_nothing_left(out: &Path) {
    assert!(!out.exists(), "{} must not exist", out.display());
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    for e in std::fs::read_dir(out.parent().unwrap()).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if e.file_name().to_string_lossy().contains(&name) {
            assert!(!(p.join("config.json").exists() && p.join("wide_routing.json").exists()), "{} looks like a complete export", p.display());
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
}

fn set_json(p: &Path, path: &[&str], v: Value) {
    let mut j = read_json(p);
    let mut at = &mut j;
    for k in &path[..path.len() - 1] {
        at = &mut at[*k];
    }
    at[path[path.len() - 1]] = v;
    std::fs::write(p, serde_json::to_string_pretty(&j).unwrap()).unwrap();
}

#[test]
fn bad_input_is_refused_and_leaves_nothing_behind() {
    let s = stages();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("out");
    let o = out.to_str().unwrap();
    let (tiny, s1, s2) = (tiny(), s.s1.to_str().unwrap().to_string(), s.s2.to_str().unwrap().to_string());
    let tiny = tiny.to_str().unwrap();

    // Routers of another model.
    let small = root().join("testbed/testbed-small");
    assert_clear_error(&export(&[small.to_str().unwrap(), "--routers", &s1, "--out", o]), "were trained for another model");
    assert_nothing_left(&out);
    // Routers whose file does not match their group size.
    let g = d.join("s1-g64");
    copy_dir(&s.s1, &g);
    set_json(&g.join("routing.json"), &["routing", "ffn_group_size"], 64.into());
    assert_clear_error(&export(&[tiny, "--routers", g.to_str().unwrap(), "--out", o]), "has shape [32, 32], expected [16, 32]: the routers do not match their routing.json (variant wide, attention group size 1, FFN group size 64)");
    // LoRA trained with routers of another group size.
    let g2 = d.join("s2-g64");
    copy_dir(&s.s2, &g2);
    set_json(&g2.join("routing.json"), &["routing", "ffn_group_size"], 64.into());
    assert_clear_error(&export(&[tiny, "--routers", &s1, "--lora", g2.to_str().unwrap(), "--out", o]), "were trained with routers of variant wide, attention group size 1, FFN group size 64");
    // Missing LoRA tensors.
    let m = d.join("s2-missing");
    copy_dir(&s.s2, &m);
    let f = SafetensorsFile::open(&s.s2.join("lora.safetensors")).unwrap();
    let keep: Vec<(String, Tensor)> = f.tensors.keys().filter(|n| *n != "model.layers.3.mlp.down_proj.lora_B.weight").map(|n| (n.clone(), f.read(n).unwrap())).collect();
    st::write(&m.join("lora.safetensors"), &keep, &Default::default()).unwrap();
    assert_clear_error(&export(&[tiny, "--routers", &s1, "--lora", m.to_str().unwrap(), "--out", o]), "lacks 1 of the 56 tensors expected (first: model.layers.3.mlp.down_proj.lora_B.weight)");
    // A stage 1 folder as --lora; --pruned of per-token routers; a folder that is no stage.
    assert_clear_error(&export(&[tiny, "--routers", &s1, "--lora", &s1, "--out", o]), "has no LoRA adapters");
    assert_clear_error(&export(&[tiny, "--routers", &s1, "--out", o, "--pruned"]), "static_width only");
    assert_clear_error(&export(&[tiny, "--routers", tiny, "--out", o]), "has no routing.json");
    assert_nothing_left(&out);

    // An existing output folder.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    assert_clear_error(&export(&[tiny, "--routers", &s2, "--out", o]), "already exists; choose another path or pass --overwrite");
    assert_clear_error(&export(&[tiny, "--routers", &s2, "--out", o, "--overwrite"]), "is not a wide export");
    assert!(out.join("notes.txt").exists());
    std::fs::remove_dir_all(&out).unwrap();
    let ok = export(&[tiny, "--routers", &s2, "--out", o]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    std::fs::write(out.join("marker"), "old").unwrap();
    let ok = export(&[tiny, "--routers", &s2, "--out", o, "--overwrite"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(!out.join("marker").exists() && out.join("wide_routing.json").exists(), "--overwrite replaces the earlier export");

    // A disk that fills up midway: files may not grow past 2 MB (RLIMIT_FSIZE), the 6 MB
    // weights fail half-way. With SIGXFSZ ignored the write fails with EFBIG: one error line,
    // the temporary folder removed. With the default action the process is killed mid-write.
    let full = d.join("full");
    let limited = |ignore_signal: bool| {
        let trap = if ignore_signal { "trap '' XFSZ; " } else { "" };
        std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("ulimit -f 2048; {trap}exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_wide"))
            .args(["export", tiny, "--routers", &s2, "--out", full.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let e = limited(true);
    assert_clear_error(&e, "File too large");
    assert_clear_error(&e, "nothing was left there");
    assert_nothing_left(&full);
    let leftovers: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.contains("full")).collect();
    assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
    let killed = limited(false);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(killed.status.signal(), Some(25), "expected death by SIGXFSZ: {:?} {}", killed.status, String::from_utf8_lossy(&killed.stderr));
    assert_nothing_left(&full);
    // The next export cleans up what the killed one left, and succeeds.
    let ok = export(&[tiny, "--routers", &s2, "--out", full.to_str().unwrap()]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let names: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.contains("full")).collect();
    assert_eq!(names, vec!["full".to_string()], "stale temporary folders must be removed");
}
