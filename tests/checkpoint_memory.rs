//! Loading a sharded checkpoint needs about its own size in host memory: tensors are read one
//! at a time straight into their final storage, never through a second full copy.
mod common;

use tch::{nn, Device, Kind};
use wide_core::checkpoint::{save_hf_folder, SaveOptions};
use wide_core::{presets, LlamaModel, RandomWeights};

#[test]
fn two_gigabyte_sharded_checkpoint_loads_within_its_own_size() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("synthetic-2gb");
    // ~2.0 GB of f32 weights: 8 layers of a 2048-wide GQA model with a 32k vocabulary.
    let mut cfg = presets::preset("tiny").unwrap();
    cfg.vocab_size = 32000;
    cfg.hidden_size = 2048;
    cfg.intermediate_size = 5632;
    cfg.num_hidden_layers = 8;
    cfg.num_attention_heads = 16;
    cfg.num_key_value_heads = 4;
    cfg.head_dim = 128;
    cfg.tie_word_embeddings = false;
    cfg.sliding_window = vec![None; 8];
    {
        let vs = nn::VarStore::new(Device::Cpu);
        LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: 0.02 }, Kind::Float, false).unwrap();
        let mut tensors: Vec<_> = vs.variables().into_iter().collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        save_hf_folder(&model_dir, &cfg, &tensors, &SaveOptions { max_shard_bytes: 400_000_000, ..Default::default() }).unwrap();
    }
    let shards = std::fs::read_dir(&model_dir).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".safetensors")).count();
    assert!(shards >= 5, "expected a sharded checkpoint, got {shards} file(s)");
    let out = common::run_wide(&["info", model_dir.to_str().unwrap(), "--load", "--json", "--device", "cpu", "--dtype", "f32"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let size = v["checkpoint_bytes"].as_f64().unwrap();
    let peak = v["load"]["peak_rss_bytes"].as_f64().unwrap();
    assert!(size > 1.9e9 && size < 2.2e9, "synthetic checkpoint is {size} bytes");
    assert_eq!(v["load"]["parameters_loaded"].as_i64().unwrap(), cfg.parameter_count());
    let limit = 1.1 * size + 300e6;
    eprintln!("checkpoint {:.0} MB in {shards} shards; peak RSS while loading {:.0} MB (limit {:.0} MB)", size / 1e6, peak / 1e6, limit / 1e6);
    assert!(peak <= limit, "peak RSS {:.0} MB exceeds 1.1 x {:.0} MB + 300 MB", peak / 1e6, size / 1e6);
}
