//! The inference engine (`wide_core::infer`) against the training path on CPU (f32, the tch
//! reference ops): same logits for the same masks in every variant, right-padded batched
//! prefill, batched decode against full forwards, the offset search, and `wide generate` with
//! routers and `--sparsity`.
mod common;

use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};
use wide_core::infer::{Decoder, Engine, EngineCache, MaskSource, SkipCounts};
use wide_core::routing::{GateMode, Routing, RoutingConfig, RoutingRun, Variant};
use wide_core::{ForwardOptions, Logits, Pretrained};

fn tiny() -> Pretrained {
    Pretrained::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("testbed/testbed-tiny"), Device::Cpu, Kind::Float).unwrap()
}

fn routing(p: &Pretrained, variant: Variant, vs: &nn::VarStore) -> Routing {
    let mut c = RoutingConfig::new(variant);
    c.attn_group_size = 1;
    c.ffn_group_size = 64;
    c.target_sparsity = Some(0.5);
    let r = Routing::new(&vs.root(), &p.model.config, &c, Kind::Float).unwrap();
    let _g = tch::no_grad_guard();
    for l in &r.layers {
        for m in [&l.static_attention, &l.static_ffn].into_iter().flatten() {
            m.shallow_clone().copy_(&Tensor::rand(m.size(), (Kind::Float, Device::Cpu)).lt(0.5).to_kind(Kind::Float));
        }
        // Random biases so that routers neither run nor skip everything.
        for rt in [&l.attention, &l.ffn, &l.layer].into_iter().flatten() {
            rt.router_b.shallow_clone().copy_(&(Tensor::randn(rt.router_b.size(), (Kind::Float, Device::Cpu)) * 0.5));
        }
    }
    r
}

/// Random masks `[B, T, groups]`, one per router call in the training path's order.
fn forced(r: &Routing, b: i64, t: i64) -> Vec<Tensor> {
    let mut v = vec![];
    for l in &r.layers {
        for rt in [&l.layer, &l.attention, &l.ffn].into_iter().flatten() {
            v.push(Tensor::rand([b, t, rt.groups], (Kind::Float, Device::Cpu)).lt(0.5).to_kind(Kind::Float));
        }
    }
    v
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn engine_matches_training_path_for_the_same_masks_in_every_variant() {
    let _g = tch::no_grad_guard();
    tch::manual_seed(11);
    let p = tiny();
    let (b, t) = (2, 13);
    let ids = Tensor::randint(p.model.config.vocab_size, [b, t], (Kind::Int64, Device::Cpu));
    for variant in [Variant::Dense, Variant::Wide, Variant::SublayerSkip, Variant::LayerSkip, Variant::StaticWidth] {
        let vs = nn::VarStore::new(Device::Cpu);
        let r = routing(&p, variant, &vs);
        let masks = forced(&r, b, t);
        let mut run = RoutingRun::new(&r, GateMode::Forced(masks.iter().map(|m| m.shallow_clone()).collect()), Tensor::ones([b, t], (Kind::Float, Device::Cpu)));
        let want = p.model.forward_routed(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }, &mut run).unwrap();
        let engine = Engine::new(&p.model, Some(&r)).unwrap();
        let cache = EngineCache::new(&p.model, b, t);
        let got = engine.prefill(&ids, &[t, t], &cache, &mut MaskSource::Forced(masks), None, true).unwrap();
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{}: max |engine - training path| = {d}", variant.name());
    }
}

#[test]
fn right_padded_prefill_equals_each_row_alone() {
    let _g = tch::no_grad_guard();
    tch::manual_seed(12);
    let p = tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let r = routing(&p, Variant::Wide, &vs);
    let lengths = [9i64, 4, 7];
    let t = 9;
    let ids = Tensor::randint(p.model.config.vocab_size, [3, t], (Kind::Int64, Device::Cpu));
    let masks = forced(&r, 3, t);
    let engine = Engine::new(&p.model, Some(&r)).unwrap();
    let cache = EngineCache::new(&p.model, 3, t);
    let mut counts = SkipCounts::default();
    let batch = engine.prefill(&ids, &lengths, &cache, &mut MaskSource::Forced(masks.iter().map(|m| m.shallow_clone()).collect()), Some(&mut counts), true).unwrap();
    for (row, &len) in lengths.iter().enumerate() {
        let row_ids = ids.narrow(0, row as i64, 1).narrow(1, 0, len);
        let row_masks: Vec<Tensor> = masks.iter().map(|m| m.narrow(0, row as i64, 1).narrow(1, 0, len)).collect();
        let mut run = RoutingRun::new(&r, GateMode::Forced(row_masks), Tensor::ones([1, len], (Kind::Float, Device::Cpu)));
        let want = p.model.forward_routed(&row_ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }, &mut run).unwrap();
        let d = max_diff(&batch.narrow(0, row as i64, 1).narrow(1, 0, len), &want);
        assert!(d < 1e-4, "row {row}: {d}");
    }
    // Skip rates count real tokens only.
    let valid = lengths.iter().sum::<i64>() as f64;
    let (_, total) = counts.per_kind["attention"];
    assert_eq!(total, valid * 4.0 * p.model.config.num_hidden_layers as f64);
}

#[test]
fn batched_decode_matches_full_forwards_of_each_row() {
    let _g = tch::no_grad_guard();
    tch::manual_seed(13);
    let p = tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let r = routing(&p, Variant::Wide, &vs);
    let engine = Engine::new(&p.model, Some(&r)).unwrap();
    let v = p.model.config.vocab_size;
    let prompts: Vec<Vec<i64>> = [6i64, 3].iter().map(|&n| Vec::<i64>::try_from(Tensor::randint(v, [n], (Kind::Int64, Device::Cpu))).unwrap()).collect();
    let steps = 5;
    let (mut dec, first) = Decoder::new(&engine, &prompts, 6 + steps + 1, true, true, None).unwrap();
    let mut seqs: Vec<Vec<i64>> = prompts.clone();
    let mut logits = vec![first];
    for _ in 0..steps {
        let next = Vec::<i64>::try_from(logits.last().unwrap().argmax(-1, false)).unwrap();
        for (s, n) in seqs.iter_mut().zip(&next) {
            s.push(*n);
        }
        dec.set_tokens(&next).unwrap();
        logits.push(dec.step().unwrap().copy());
    }
    for (row, s) in seqs.iter().enumerate() {
        let ids = Tensor::from_slice(s).view([1, -1]);
        let n = s.len() as i64;
        let mut run = RoutingRun::new(&r, GateMode::Inference, Tensor::ones([1, n], (Kind::Float, Device::Cpu)));
        let full = p.model.forward_routed(&ids, ForwardOptions { logits: Some(Logits::All), ..Default::default() }, &mut run).unwrap();
        for (k, l) in logits.iter().enumerate() {
            let pos = prompts[row].len() as i64 - 1 + k as i64;
            let d = max_diff(&l.get(row as i64), &full.get(0).get(pos));
            assert!(d < 1e-4, "row {row} step {k}: {d}");
        }
    }
    let c = dec.skip_counts();
    assert_eq!(c.per_kind["ffn"].1, (steps * 2 * 8 * p.model.config.num_hidden_layers) as f64, "decode counts: steps x rows x groups x layers");
}

#[test]
fn fixed_masks_replace_the_routers_at_one_token_decode() {
    // WIDE_FIXED_MASKS's engine setting: every one-token decision is the fixed mask (exactly the
    // expected skip rate in whole groups), whatever the routers say; prefill still routes.
    let _g = tch::no_grad_guard();
    tch::manual_seed(17);
    let p = tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let r = routing(&p, Variant::Wide, &vs);
    let v = p.model.config.vocab_size;
    let prompt = vec![Vec::<i64>::try_from(Tensor::randint(v, [5], (Kind::Int64, Device::Cpu))).unwrap()];
    let steps = 4;
    // Routers that would skip every group (set after the prefill, undone after the steps).
    let saved: Vec<Tensor> = r.layers.iter().flat_map(|l| [&l.attention, &l.ffn]).flatten().map(|rt| rt.router_b.copy()).collect();
    let skip_all = |on: bool| {
        let routers = r.layers.iter().flat_map(|l| [&l.attention, &l.ffn]).flatten();
        for (rt, b0) in routers.zip(&saved) {
            let b = rt.router_b.view([-1, 2]);
            if on {
                let _ = b.select(1, 0).shallow_clone().fill_(-100.0);
                let _ = b.select(1, 1).shallow_clone().fill_(100.0);
            } else {
                rt.router_b.shallow_clone().copy_(b0);
            }
        }
    };
    let decode = |engine: &Engine, skip_all_while_decoding: bool| -> (Vec<Tensor>, SkipCounts) {
        let (mut dec, first) = Decoder::new(engine, &prompt, 5 + steps + 1, true, true, None).unwrap();
        skip_all(skip_all_while_decoding);
        let mut out = vec![first];
        for _ in 0..steps {
            let next = Vec::<i64>::try_from(out.last().unwrap().argmax(-1, false)).unwrap();
            dec.set_tokens(&next).unwrap();
            out.push(dec.step().unwrap().copy());
        }
        skip_all(false);
        (out, dec.skip_counts())
    };
    let mut engine = Engine::new(&p.model, Some(&r)).unwrap();
    let (routed, _) = decode(&engine, false);
    engine.set_fixed_masks(true);
    let (fixed, counts) = decode(&engine, false);
    let layers = p.model.config.num_hidden_layers as f64;
    let heads = p.model.config.num_attention_heads as f64;
    for (kind, groups) in [("attention", heads), ("ffn", 8.0)] {
        let (skipped, total) = counts.per_kind[kind];
        assert_eq!(total, steps as f64 * groups * layers, "{kind}: decode counts");
        assert_eq!(skipped, steps as f64 * (0.5 * groups).round() * layers, "{kind}: exactly the expected skip rate");
    }
    assert!(max_diff(&routed[0], &fixed[0]) < 1e-6, "the prefill is routed either way");
    assert!((1..=steps as usize).any(|k| max_diff(&routed[k], &fixed[k]) > 1e-3), "the routers' own decisions should differ from the fixed ones somewhere");
    // The routers are not consulted while decoding: routers that skip everything change nothing.
    let (again, _) = decode(&engine, true);
    for k in 0..=steps as usize {
        assert!(max_diff(&fixed[k], &again[k]) < 1e-6, "step {k}: the fixed masks' decode depends on the routers");
    }
    // And they are, without fixed masks.
    engine.set_fixed_masks(false);
    let (skipping, _) = decode(&engine, true);
    assert!((1..=steps as usize).any(|k| max_diff(&routed[k], &skipping[k]) > 1e-3), "routers that skip everything should change the decode");
}

#[test]
fn offset_search_hits_the_requested_sparsity() {
    let _g = tch::no_grad_guard();
    tch::manual_seed(14);
    let p = tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let r = routing(&p, Variant::Wide, &vs);
    let mut engine = Engine::new(&p.model, Some(&r)).unwrap();
    let ids = Tensor::randint(p.model.config.vocab_size, [2, 32], (Kind::Int64, Device::Cpu));
    for target in [0.3, 0.7] {
        let got = engine.search_offsets(&ids, &[32, 32], target).unwrap();
        for k in ["attention", "ffn"] {
            let rate = got.rate(k).unwrap();
            assert!((rate - target).abs() < 0.03, "{k}: {rate} for {target}");
        }
        // Per layer fit: every layer's routers at the target on the same tokens.
        let got = engine.fit_offsets_per_layer(&ids, &[32, 32], target).unwrap();
        assert!((got.rate("ffn").unwrap() - target).abs() < 0.01, "{:?}", got.per_kind);
    }
}

fn write_routing_dir(dir: &Path) -> PathBuf {
    let p = tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let r = routing(&p, Variant::Wide, &vs);
    let out = dir.join("routing");
    std::fs::create_dir_all(&out).unwrap();
    let tensors: Vec<(String, Tensor)> = r.tensors();
    wide_core::safetensors::write(&out.join("routers.safetensors"), &tensors, &Default::default()).unwrap();
    let manifest = serde_json::json!({"format": 1, "stage": 1, "routing": r.config, "model": p.model.config, "lora": null,
        "calibration_tokens": 0, "heldout": null, "provenance": null, "recipe": {}});
    std::fs::write(out.join("routing.json"), serde_json::to_string_pretty(&manifest).unwrap()).unwrap();
    out
}

#[test]
fn generate_cli_runs_routed_with_a_searched_sparsity_and_dense() {
    let tmp = tempfile::tempdir().unwrap();
    let routing = write_routing_dir(tmp.path());
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("testbed/testbed-tiny");
    let (m, rd) = (model.to_str().unwrap(), routing.to_str().unwrap());
    let base = ["generate", m, "--prompt", "The kernel", "--prompt", "A longer prompt for the batch", "--max-new-tokens", "6", "--device", "cpu", "--ignore-eos"];
    let out = common::run_wide(&[&base[..], &["--routing", rd, "--sparsity", "0.5"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("offsets for sparsity 0.5") && err.contains("skip rates: prefill attention"), "{err}");
    let dense = common::run_wide(&[&base[..], &["--routing", rd, "--dense"]].concat());
    assert!(dense.status.success(), "{}", String::from_utf8_lossy(&dense.stderr));
    assert!(!String::from_utf8_lossy(&dense.stderr).contains("skip rates"));
    // Sampled generation through the engine, reproducible by seed.
    let s1 = common::run_wide(&[&base[..], &["--routing", rd, "--temperature", "0.8", "--seed", "3"]].concat());
    let s2 = common::run_wide(&[&base[..], &["--routing", rd, "--temperature", "0.8", "--seed", "3"]].concat());
    assert!(s1.status.success());
    assert_eq!(s1.stdout, s2.stdout);
    let bad = common::run_wide(&[&base[..], &["--sparsity", "0.5"]].concat());
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--sparsity needs --routing"));
}

/// The trained testbed-small routers committed under `testbed/testbed-small-wide` (stage 1 of
/// `configs/calibrate-testbed-small.toml`, the end-to-end benchmark's second row) load with
/// their model and route a generation at about their calibrated skip rates.
#[test]
fn committed_testbed_small_routers_route_a_generation() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (m, rd) = (root.join("testbed/testbed-small"), root.join("testbed/testbed-small-wide"));
    let out = common::run_wide(&[
        "generate",
        m.to_str().unwrap(),
        "--routing",
        rd.to_str().unwrap(),
        "--prompt",
        "The package manager installs the files of a package and runs its scripts",
        "--max-new-tokens",
        "16",
        "--device",
        "cpu",
        "--ignore-eos",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line = err.lines().find(|l| l.contains("skip rates: prefill")).unwrap_or_else(|| panic!("no skip rates in: {err}"));
    // Every rate printed lies well inside (0, 1): the routers skip some groups and run others.
    let rates: Vec<f64> = line.split_whitespace().filter_map(|w| w.trim_end_matches([',', ';']).parse::<f64>().ok()).collect();
    assert!(rates.len() >= 2 && rates.iter().all(|r| (0.2..0.8).contains(r)), "{line}");
}

/// A second engine on the same model shares the first one's fused weights (no copy of
/// Q|K|V or gate|up) and computes the same logits.
#[test]
fn engines_on_one_model_share_the_fused_weights() {
    let _g = tch::no_grad_guard();
    tch::manual_seed(5);
    let p = tiny();
    let vs = nn::VarStore::new(Device::Cpu);
    let r = routing(&p, Variant::Wide, &vs);
    let (b, t) = (1, 11);
    let ids = Tensor::randint(p.model.config.vocab_size, [b, t], (Kind::Int64, Device::Cpu));
    let first = Engine::new(&p.model, Some(&r)).unwrap();
    let cache = EngineCache::new(&p.model, b, t);
    let want = first.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, true).unwrap();
    let ptrs = |m: &wide_core::LlamaModel| -> Vec<usize> {
        m.layers.iter().flat_map(|l| [l.self_attn.q_proj.weight.data_ptr() as usize, l.self_attn.v_proj.weight.data_ptr() as usize, l.mlp.up_proj.weight.data_ptr() as usize]).collect()
    };
    let before = ptrs(&p.model);
    let dense = Engine::new(&p.model, None).unwrap();
    let second = Engine::new(&p.model, Some(&r)).unwrap();
    second.set_offsets_per_layer(&first.offsets()).unwrap();
    assert_eq!(ptrs(&p.model), before, "a later engine moved the model's weights (a copy of the fused tensors)");
    let got = second.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, true).unwrap();
    assert!(max_diff(&got, &want) == 0.0, "second engine's logits differ by {}", max_diff(&got, &want));
    let d = dense.prefill(&ids, &[t], &cache, &mut MaskSource::Routers, None, true).unwrap();
    assert!(max_diff(&d, &want) > 0.0, "dense and routed logits should differ");
    assert!(second.set_offsets_per_layer(&[[0.0; 3]]).is_err());
}

/// `wide bench e2e --interleave` on CPU: the prefills of dense and each variant timed in turn,
/// every variant once a round, recorded beside the ordinary rows.
#[test]
fn bench_e2e_interleave_times_every_variant_each_round() {
    let tmp = tempfile::tempdir().unwrap();
    let out_path = tmp.path().join("e2e.json");
    let args = ["bench", "e2e", "--preset", "tiny", "--device", "cpu", "--dtype", "f32", "--sparsity", "0.3,0.5", "--prefill-tokens", "16,40", "--decode-batches", "1", "--prompt-tokens", "8", "--new-tokens", "3", "--warmup", "1", "--iters", "4"];
    let out = common::run_wide(&[&args[..], &["--interleave", "--out", out_path.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let il = &v["prefill_interleaved"];
    assert_eq!(il["rounds"], 4);
    let rows = il["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["tokens"].as_i64().unwrap()).collect::<Vec<_>>(), vec![16, 40]);
    for row in rows {
        let vars = row["variants"].as_array().unwrap();
        let names: Vec<&str> = vars.iter().map(|x| x["variant"].as_str().unwrap()).collect();
        assert_eq!(names, vec!["dense", "wide 0.3", "wide 0.5"]);
        assert_eq!(vars[0]["x_dense"].as_f64().unwrap(), 1.0);
        for x in vars {
            let runs = x["runs_ms"].as_array().unwrap();
            assert_eq!(runs.len(), 4, "{x}");
            assert!(runs.iter().all(|r| r.as_f64().unwrap() > 0.0), "{x}");
            // No clock probe on CPU; every run names the run before it.
            assert!(x["probe_start_mhz"].is_null() && x["runs_probe_mhz"].as_array().unwrap().iter().all(|p| p[0].is_null()), "{x}");
            assert_eq!(x["runs_after"].as_array().unwrap().len(), 4, "{x}");
            let by = x["by_predecessor"].as_array().unwrap();
            assert_eq!(by.iter().map(|b| b["runs"].as_u64().unwrap()).sum::<u64>(), 4, "{x}");
        }
        // The first timed run follows the warm-up's last (the last engine), then the rotation:
        // engines 0 1 2 | 1 2 0 | 2 0 1 | 0 1 2 in the four rounds.
        let after = |k: usize| vars[k]["runs_after"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect::<Vec<_>>();
        assert_eq!(after(0), vec!["wide 0.5", "wide 0.5", "wide 0.5", "wide 0.3"]);
        assert_eq!(after(1), vec!["dense", "wide 0.5", "dense", "dense"]);
    }
    assert_eq!(il["gap_ms"], 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("prefill, interleaved (4 rounds"));
    // A gap between runs is recorded; without --interleave it is refused.
    let gap = common::run_wide(&[&args[..], &["--interleave", "--interleave-gap-ms", "5", "--out", out_path.to_str().unwrap()]].concat());
    assert!(gap.status.success(), "{}", String::from_utf8_lossy(&gap.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    assert_eq!(v["prefill_interleaved"]["gap_ms"], 5);
    let bad = common::run_wide(&[&args[..], &["--interleave-gap-ms", "5"]].concat());
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("add --interleave"), "{}", String::from_utf8_lossy(&bad.stderr));
    // Without the flag the field is null and nothing extra is timed.
    let plain = common::run_wide(&[&args[..], &["--out", out_path.to_str().unwrap()]].concat());
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    assert!(v["prefill_interleaved"].is_null());
    assert!(v["rows"].as_array().unwrap().iter().all(|r| r["variant"] != "kept-width"));
    // --kept-width: one more dense row a sparsity, on a model of the kept width (tiny: 4 query
    // heads in one group of 4, 384 FFN channels in 3 groups of 128 -> 2 kept at 0.3 and 0.5).
    let kw = common::run_wide(&[&args[..], &["--kept-width", "--attn-group-size", "4", "--out", out_path.to_str().unwrap()]].concat());
    assert!(kw.status.success(), "{}", String::from_utf8_lossy(&kw.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let rows: Vec<&serde_json::Value> = v["rows"].as_array().unwrap().iter().filter(|r| r["variant"] == "kept-width").collect();
    assert_eq!(rows.iter().map(|r| r["sparsity"].as_f64().unwrap()).collect::<Vec<_>>(), vec![0.3, 0.5]);
    for r in rows {
        assert_eq!((r["shape"]["num_attention_heads"].as_i64(), r["shape"]["intermediate_size"].as_i64()), (Some(4), Some(256)), "{r}");
        let d = &r["results"]["decode"][0];
        assert!(d["ms_per_step"].as_f64().unwrap() > 0.0 && r["results"]["prefill"].as_array().unwrap().len() == 2, "{r}");
    }
    assert!(String::from_utf8_lossy(&kw.stdout).contains("| kept-width | 0.5 | decode |"));
}
