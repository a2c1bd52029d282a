//! `wide eval` against Hugging Face `transformers` on testbed-tiny (f32, CPU): strided and
//! disjoint-window perplexity and every choice's log-likelihood agree to 1e-4 relative; routed
//! perplexity does not depend on padding; the dense model's accuracy on the built cloze tasks
//! lands between 40% and 85%; bad task files give one clear error line.
mod common;

use common::{assert_clear_error, run_wide};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tch::{Device, Kind};
use wide_core::routing::{RoutingConfig, Variant};
use wide_eval::perplexity::{perplexity, PerplexityConfig};
use wide_eval::zeroshot::{build_cloze, write_jsonl, ClozeConfig};
use wide_train::calibrate::RoutedModel;
use wide_train::corpus::Document;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tiny() -> PathBuf {
    root().join("testbed/testbed-tiny")
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn wide_ok(args: &[&str]) {
    let o = run_wide(args);
    assert!(o.status.success(), "wide {args:?} failed:\n{}", String::from_utf8_lossy(&o.stderr));
}

fn assert_rel(what: &str, got: f64, want: f64) {
    let rel = (got - want).abs() / want.abs().max(1e-12);
    assert!(rel <= 1e-4, "{what}: wide {got} vs transformers {want} (relative difference {rel:e})");
}

/// This repository's README: real prose with markup and non-ASCII characters.
fn text() -> PathBuf {
    root().join("README.md")
}

/// The text both sides evaluate: the README's first 9,000 characters (about 2,500 tokens).
fn sample_text(dir: &Path) -> PathBuf {
    let p = dir.join("sample.txt");
    let s: String = std::fs::read_to_string(text()).unwrap().chars().take(9000).collect();
    std::fs::write(&p, s).unwrap();
    p
}

/// Cloze tasks cut from the README plus hand-written edge cases: trailing whitespace in the
/// context, an empty context, a continuation without a leading space, non-ASCII choices and a
/// context longer than the model's 256-token context.
fn tasks(dir: &Path) -> PathBuf {
    let readme = std::fs::read_to_string(text()).unwrap();
    let doc = Document { source: "test".into(), name: "README.md".into(), text: readme.clone() };
    let cfg = ClozeConfig { tasks: 12, context_words: 40, continuation_words: 3, distractors: 3, seed: 3 };
    let mut lines: Vec<Value> = build_cloze(&[doc], &cfg).unwrap().into_iter().map(|t| serde_json::to_value(t).unwrap()).collect();
    let long: String = readme.chars().take(3000).collect();
    for (context, choices, gold) in [
        ("The kernel documentation says that the driver ", vec!["module", "is loaded at boot", "of the"], 1),
        ("", vec![" Linux", "Debian packages"], 0),
        ("Usage:\n", vec!["  wide info", "the"], 0),
        ("The configur", vec!["ation file", "ed value"], 0),
        ("Unicode text such as", vec![" naïve café → ×2", " plain words here"], 1),
        (long.as_str(), vec![" the model", " weights and", " end"], 2),
    ] {
        lines.push(serde_json::json!({"context": context, "choices": choices, "gold": gold}));
    }
    let p = dir.join("tasks.jsonl");
    write_jsonl(&p, &lines).unwrap();
    p
}

#[test]
fn perplexity_and_choice_logliks_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tasks = tasks(d);
    let txt = sample_text(d);
    let oracle = d.join("oracle.json");
    common::run_oracle("hf_eval.py", &[tiny().as_path(), &txt, &tasks, &oracle, Path::new("128"), Path::new("50,128")]);
    let o = read_json(&oracle);

    for (i, stride) in ["50", "128"].iter().enumerate() {
        let out = d.join(format!("ppl-{stride}.json"));
        let model = tiny();
        wide_ok(&["eval", "ppl", model.to_str().unwrap(), "--text", txt.to_str().unwrap(), "--seq-len", "128", "--stride", stride, "--batch", "3", "--device", "cpu", "--dtype", "f32", "--json", out.to_str().unwrap()]);
        let w = read_json(&out);
        let want = &o["ppl"][i];
        assert_eq!(w["scored_tokens"], want["scored_tokens"], "stride {stride}");
        assert_eq!(w["tokens"], want["tokens"], "stride {stride}");
        assert_rel(&format!("loss, stride {stride}"), w["loss"].as_f64().unwrap(), want["loss"].as_f64().unwrap());
        assert_rel(&format!("perplexity, stride {stride}"), w["perplexity"].as_f64().unwrap(), want["perplexity"].as_f64().unwrap());
        assert!(w["sparsity"].is_null(), "a dense model reports no sparsity");
        assert!(w["commit"].is_string());
    }
    // Overlapping windows score every token but the first; disjoint ones miss each window's first.
    let n = o["ppl"][0]["tokens"].as_u64().unwrap();
    assert!(n > 2000, "the sample gives {n} tokens");
    assert_eq!(o["ppl"][0]["scored_tokens"].as_u64().unwrap(), n - 1);
    assert_eq!(o["ppl"][1]["scored_tokens"].as_u64().unwrap(), n - n.div_ceil(128));

    let out = d.join("tasks-report.json");
    wide_ok(&["eval", "tasks", tiny().to_str().unwrap(), "--tasks", tasks.to_str().unwrap(), "--batch", "5", "--device", "cpu", "--dtype", "f32", "--json", out.to_str().unwrap()]);
    let w = read_json(&out);
    let items = w["items"].as_array().unwrap();
    let want = o["tasks"].as_array().unwrap();
    assert_eq!(items.len(), want.len());
    assert_eq!(items.len(), 18);
    let (mut hits, mut hits_norm) = (0, 0);
    for (t, (got, want)) in items.iter().zip(want).enumerate() {
        assert_eq!(got["tokens"], want["tokens"], "task {t}: continuation token counts");
        assert_eq!(got["truncated_tokens"], want["truncated_tokens"], "task {t}: truncation");
        let gl: Vec<f64> = got["loglik"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let wl: Vec<f64> = want["loglik"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(gl.len(), wl.len());
        for (c, (g, w)) in gl.iter().zip(&wl).enumerate() {
            assert_rel(&format!("task {t} choice {c} log-likelihood"), *g, *w);
        }
        // acc and acc_norm from the oracle's numbers.
        let bytes: Vec<f64> = got["bytes"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let argmax = |v: &[f64]| v.iter().enumerate().fold(0, |b, (i, x)| if *x > v[b] { i } else { b });
        let norm: Vec<f64> = wl.iter().zip(&bytes).map(|(l, b)| l / b).collect();
        let gold = got["gold"].as_u64().unwrap() as usize;
        hits += (argmax(&wl) == gold) as usize;
        hits_norm += (argmax(&norm) == gold) as usize;
    }
    assert!((w["acc"].as_f64().unwrap() - hits as f64 / 18.0).abs() < 1e-12);
    assert!((w["acc_norm"].as_f64().unwrap() - hits_norm as f64 / 18.0).abs() < 1e-12);
    // Only the long context was cut.
    assert_eq!(w["truncated_tasks"], 1);
    assert!(items[17]["truncated_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn routed_perplexity_and_skip_rates_do_not_depend_on_padding() {
    let _g = tch::no_grad_guard();
    tch::manual_seed(7);
    let mut rc = RoutingConfig::new(Variant::Wide);
    rc.target_sparsity = Some(0.5);
    rc.ffn_group_size = 32;
    let m = RoutedModel::new(&tiny(), &rc, Device::Cpu, Kind::Float).unwrap();
    let tok = m.pretrained.tokenizer.as_ref().unwrap();
    let all = tok.encode(&std::fs::read_to_string(text()).unwrap(), false).unwrap();
    let ids = &all[..1000];
    let sample = tok.decode(ids, false).unwrap();
    // 1000 tokens in windows of 96 every 80: the last window is short, so batches of 4 pad it.
    let one = perplexity(&m, ids, &PerplexityConfig { seq_len: 96, stride: 80, batch: 1 }).unwrap();
    let four = perplexity(&m, ids, &PerplexityConfig { seq_len: 96, stride: 80, batch: 4 }).unwrap();
    assert_eq!(one.scored_tokens, 999);
    assert_eq!(four.scored_tokens, 999);
    assert!((one.loss - four.loss).abs() < 1e-5, "{} vs {}", one.loss, four.loss);
    let (s1, s4) = (one.sparsity.unwrap(), four.sparsity.unwrap());
    for kind in ["attention", "ffn"] {
        let (a, b) = (s1.skip_rate[kind], s4.skip_rate[kind]);
        assert!(a > 0.05 && a < 0.95, "{kind} skip rate {a}: fresh routers skip some groups");
        assert!((a - b).abs() < 1e-9, "{kind}: skip rate {a} unpadded vs {b} padded");
    }
    assert!((s1.flops_fraction - s4.flops_fraction).abs() < 1e-9);
    assert!(s1.flops_fraction < 0.95 && s1.flops_fraction > 0.05, "{}", s1.flops_fraction);

    // The same routers through the CLI with --routing: skip rates and FLOPs in the report.
    let dir = tempfile::tempdir().unwrap();
    let routing = dir.path().join("routing");
    let mut m = m;
    wide_train::calibrate::save_routing_dir(&mut m, &routing, 1, 0, None, serde_json::json!({}), Default::default()).unwrap();
    let txt = dir.path().join("t.txt");
    std::fs::write(&txt, sample).unwrap();
    let out = dir.path().join("ppl.json");
    wide_ok(&["eval", "ppl", tiny().to_str().unwrap(), "--routing", routing.to_str().unwrap(), "--text", txt.to_str().unwrap(), "--seq-len", "96", "--stride", "80", "--batch", "4", "--device", "cpu", "--dtype", "f32", "--json", out.to_str().unwrap()]);
    let w = read_json(&out);
    assert_eq!(w["variant"], "wide");
    let sp = &w["sparsity"];
    assert!(sp["skip_rate"]["attention"].as_f64().unwrap() > 0.05 && sp["skip_rate"]["ffn"].as_f64().unwrap() > 0.05, "{sp}");
    assert!(sp["flops_fraction"].as_f64().unwrap() < 0.95);
}

/// The corpus the testbed models were trained on (its test split is held out): the one the
/// calibration tests build, built here when it is missing.
fn corpus() -> PathBuf {
    let dir = root().join("target/test-data/corpus");
    if wide_train::corpus::CorpusManifest::load(&dir).is_err() {
        wide_ok(&["corpus", "--out", dir.to_str().unwrap()]);
    }
    dir
}

#[test]
fn dense_tiny_accuracy_on_built_cloze_tasks_is_between_40_and_85_percent() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = dir.path().join("cloze.jsonl");
    let corpus = corpus();
    // The defaults, fewer tasks so that it runs in seconds.
    wide_ok(&["eval", "build-cloze", "--corpus", corpus.to_str().unwrap(), "--split", "test", "--out", tasks.to_str().unwrap(), "--n", "200"]);
    let again = dir.path().join("again.jsonl");
    wide_ok(&["eval", "build-cloze", "--corpus", corpus.to_str().unwrap(), "--split", "test", "--out", again.to_str().unwrap(), "--n", "200"]);
    assert_eq!(std::fs::read(&tasks).unwrap(), std::fs::read(&again).unwrap(), "the builder is deterministic");
    let out = dir.path().join("acc.json");
    wide_ok(&["eval", "tasks", tiny().to_str().unwrap(), "--tasks", tasks.to_str().unwrap(), "--device", "cpu", "--dtype", "f32", "--json", out.to_str().unwrap()]);
    let w = read_json(&out);
    let acc = w["acc"].as_f64().unwrap();
    eprintln!("testbed-tiny on 200 cloze tasks: acc {acc:.3}, acc_norm {:.3}, chance {:.3}", w["acc_norm"].as_f64().unwrap(), w["chance"].as_f64().unwrap());
    assert_eq!(w["tasks"], 200);
    assert!((0.40..=0.85).contains(&acc), "dense testbed-tiny accuracy {acc} is outside [0.40, 0.85]");
}

#[test]
fn bad_task_files_and_text_requests_give_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.jsonl");
    std::fs::write(&p, "{\"context\": \"a\", \"choices\": [\" b\", \" c\"], \"gold\": 1}\n{\"context\": \"a\", \"choices\": [\" b\", \" c\"], \"gold\": 2}\n").unwrap();
    let tiny = tiny();
    let m = tiny.to_str().unwrap();
    let o = run_wide(&["eval", "tasks", m, "--tasks", p.to_str().unwrap(), "--device", "cpu"]);
    assert_clear_error(&o, "bad.jsonl line 2: \"gold\" is 2 but there are only 2 choices");
    std::fs::write(&p, "{\"context\": \"a\", \"choices\": [], \"gold\": 0}\n").unwrap();
    assert_clear_error(&run_wide(&["eval", "tasks", m, "--tasks", p.to_str().unwrap(), "--device", "cpu"]), "bad.jsonl line 1: \"choices\" is empty");
    std::fs::write(&p, "{\"context\": \"a\", \"choices\": [\" b\"], \"gold\": 0}\nnot json\n").unwrap();
    assert_clear_error(&run_wide(&["eval", "tasks", m, "--tasks", p.to_str().unwrap(), "--device", "cpu"]), "bad.jsonl line 2: not valid JSON");
    let readme = text();
    let t = readme.to_str().unwrap();
    assert_clear_error(&run_wide(&["eval", "ppl", m, "--device", "cpu"]), "--corpus DIR (with --split) or --text FILE");
    assert_clear_error(&run_wide(&["eval", "ppl", m, "--text", t, "--seq-len", "512", "--device", "cpu"]), "--seq-len 512 is longer than the model's context of 256 tokens");
    assert_clear_error(&run_wide(&["eval", "ppl", m, "--text", t, "--seq-len", "64", "--stride", "65", "--device", "cpu"]), "--stride must be between 1 and --seq-len (64)");
    assert_clear_error(&run_wide(&["eval", "ppl", m, "--corpus", dir.path().to_str().unwrap(), "--device", "cpu"]), "a corpus folder?");
}
