//! `wide` against Hugging Face `transformers`: logits of a left-padded batch with explicit
//! positions, and greedy continuations with the KV cache, for every supported family.
mod common;

use std::path::Path;
use tch::{nn, Device, Kind};
use wide_core::generate::SamplingConfig;
use wide_core::safetensors::SafetensorsFile;
use wide_core::{ForwardOptions, HfCheckpoint, LlamaModel};

const FAMILIES: [&str; 5] = ["llama3", "llama_tied", "mistral", "qwen2", "qwen3"];

fn load(dir: &Path) -> LlamaModel {
    let mut ckpt = HfCheckpoint::open(dir).unwrap();
    let cfg = ckpt.config.clone();
    let vs = nn::VarStore::new(Device::Cpu);
    LlamaModel::new(&vs.root(), &cfg, &mut ckpt, Kind::Float, false).unwrap()
}

#[test]
fn families_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    common::run_oracle("hf_families.py", &[dir.path()]);
    let _g = tch::no_grad_guard();
    let mut report = vec![];
    for name in FAMILIES {
        let model = load(&dir.path().join(name));
        let o = SafetensorsFile::open(&dir.path().join(format!("{name}.oracle.safetensors"))).unwrap();
        let get = |n: &str| o.read(n).unwrap();

        // Logits of the padded batch, compared at real (non-pad) positions.
        let mask = get("attention_mask");
        let logits = model
            .forward(
                &get("input_ids"),
                ForwardOptions { position_ids: Some(&get("position_ids")), attention_mask: Some(&mask), ..Default::default() },
            )
            .unwrap();
        let real = mask.ne(0).unsqueeze(-1);
        let diff = (logits - get("logits")).abs().masked_fill(&real.logical_not(), 0.0);
        let max_abs = diff.max().double_value(&[]);
        assert!(max_abs <= 1e-4, "{name}: logits differ from transformers by {max_abs:e} (max-abs)");

        // Greedy continuations with the KV cache.
        let ids = get("gen_input_ids");
        let gmask = get("gen_attention_mask");
        let want = get("gen_tokens");
        let margins = get("gen_margins");
        let (b, n) = want.size2().unwrap();
        let prompts: Vec<Vec<i64>> = (0..b)
            .map(|r| {
                let row = Vec::<i64>::try_from(ids.get(r)).unwrap();
                let m = Vec::<i64>::try_from(gmask.get(r)).unwrap();
                row.into_iter().zip(m).filter(|(_, m)| *m != 0).map(|(t, _)| t).collect()
            })
            .collect();
        let cfg = SamplingConfig { max_new_tokens: n as usize, stop_at_eos: false, ..Default::default() };
        let got = model.generate(&prompts, &cfg, |_, _| Ok(())).unwrap();
        let (mut qualified, mut total) = (0, 0);
        for r in 0..b {
            let want_r = Vec::<i64>::try_from(want.get(r)).unwrap();
            let marg_r = Vec::<f32>::try_from(margins.get(r)).unwrap();
            let mut diverged = false;
            for s in 0..n as usize {
                total += 1;
                if diverged || marg_r[s] <= 1e-3 {
                    // After a near-tie the two continuations may legitimately differ.
                    diverged |= got.tokens[r as usize][s] != want_r[s];
                    continue;
                }
                qualified += 1;
                assert_eq!(
                    got.tokens[r as usize][s], want_r[s],
                    "{name}: row {r} step {s} differs (margin {}): wide {:?} vs transformers {:?}",
                    marg_r[s], got.tokens[r as usize], want_r
                );
            }
        }
        assert!(qualified * 10 >= total * 9, "{name}: only {qualified} of {total} greedy steps had a top-2 margin above 1e-3");
        report.push(format!("{name}: max-abs {max_abs:.2e}, {qualified}/{total} greedy steps compared"));
    }
    eprintln!("{}", report.join("\n"));
}
