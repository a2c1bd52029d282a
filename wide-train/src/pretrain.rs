//! Stage 0: train a Llama-architecture testbed model from scratch on a corpus, and write it as
//! a Hugging Face folder (shards of at most 15 MiB, so folders travel in small files). The whole pipeline is cached step by step: corpus, tokenizer, token
//! files, then training (resumable).
use crate::bpe;
use crate::corpus::{self, CorpusManifest, Source, Split, SplitFractions};
use crate::dataset::{build_dataset, DatasetFiles};
use crate::recipe;
use crate::trainer::{evaluate, StepContext, TrainConfig, TrainSummary, TrainTask, Trainer};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};
use wide_core::checkpoint::{save_hf_folder, SaveOptions};
use wide_core::{parse_device, parse_dtype, Family, LlamaModel, ModelConfig, RandomWeights, RopeScaling};

/// The architecture of a model trained from scratch (`[model]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub max_position_embeddings: i64,
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
    #[serde(default = "d_std")]
    pub init_std: f64,
}
fn d_theta() -> f64 {
    10000.0
}
fn d_true() -> bool {
    true
}
fn d_std() -> f64 {
    0.02
}

/// Where the text and tokens come from (`[data]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `debian-docs` and/or paths of the user's text files or folders.
    #[serde(default = "d_sources")]
    pub sources: Vec<String>,
    pub corpus_dir: PathBuf,
    pub tokenizer: PathBuf,
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    pub token_cache: PathBuf,
    pub seq_len: usize,
    #[serde(default = "d_frac")]
    pub validation_fraction: f64,
    #[serde(default = "d_frac")]
    pub test_fraction: f64,
}
fn d_sources() -> Vec<String> {
    vec!["debian-docs".into()]
}
fn d_vocab() -> usize {
    8192
}
fn d_frac() -> f64 {
    0.02
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    pub dir: PathBuf,
    /// Stored dtype of the exported model: f32, bf16 or f16.
    #[serde(default = "d_f32")]
    pub dtype: String,
}
fn d_f32() -> String {
    "f32".into()
}

/// A stage 0 recipe.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PretrainRecipe {
    pub name: String,
    pub model: ModelShape,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub output: OutputConfig,
}

impl DataConfig {
    pub fn sources(&self) -> Result<Vec<Source>> {
        corpus::sources_from_names(&self.sources)
    }

    /// Corpus, tokenizer and token files, each built only if missing.
    pub fn prepare(&self) -> Result<DatasetFiles> {
        let manifest_ok = CorpusManifest::load(&self.corpus_dir).is_ok();
        if !manifest_ok {
            eprintln!("building corpus in {}", self.corpus_dir.display());
            let m = corpus::build_corpus(&self.sources()?, SplitFractions { validation: self.validation_fraction, test: self.test_fraction }, &self.corpus_dir)?;
            for (split, c) in &m.splits {
                eprintln!("  {split}: {} documents, {:.1} MB", c.documents, c.bytes as f64 / 1e6);
            }
        }
        if !self.tokenizer.exists() {
            eprintln!("training a byte-level BPE tokenizer ({} entries) into {}", self.vocab_size, self.tokenizer.display());
            let docs = corpus::read_split(&self.corpus_dir, Split::Train)?;
            if let Some(dir) = self.tokenizer.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            bpe::train_bpe(docs.iter().map(|d| d.text.as_str()), self.vocab_size, &self.tokenizer)?;
        }
        let manifest = CorpusManifest::load(&self.corpus_dir)?;
        for split in ["validation", "test"] {
            if manifest.splits.get(split).is_none_or(|c| c.documents == 0) {
                bail!(
                    "the corpus in {} has no {split} documents: raise data.{split}_fraction or add documents",
                    self.corpus_dir.display()
                );
            }
        }
        build_dataset(&self.corpus_dir, &self.tokenizer, self.seq_len, &self.token_cache)
    }
}

impl PretrainRecipe {
    pub fn load(path: &Path, overrides: &[String]) -> Result<(Self, toml::Table)> {
        let (r, table): (Self, _) = recipe::load(path, overrides)?;
        r.validate()?;
        Ok((r, table))
    }

    pub fn validate(&self) -> Result<()> {
        // The model's shape, before any corpus or tokenizer is built (the vocabulary comes from
        // the tokenizer later: any positive size checks the rest).
        self.model_config(1, 0).context("the recipe's [model] table is invalid")?;
        if self.data.seq_len as i64 > self.model.max_position_embeddings {
            bail!(
                "data.seq_len {} is longer than the model's context (model.max_position_embeddings {})",
                self.data.seq_len,
                self.model.max_position_embeddings
            );
        }
        self.train.validate()
    }

    /// The model configuration for a tokenizer of `vocab_size` entries whose EOS id is `eos`.
    pub fn model_config(&self, vocab_size: i64, eos: i64) -> Result<ModelConfig> {
        let m = &self.model;
        let cfg = ModelConfig {
            family: Family::Llama,
            vocab_size,
            hidden_size: m.hidden_size,
            intermediate_size: m.intermediate_size,
            num_hidden_layers: m.num_hidden_layers,
            num_attention_heads: m.num_attention_heads,
            num_key_value_heads: m.num_key_value_heads,
            head_dim: m.head_dim,
            rms_norm_eps: 1e-5,
            rope_theta: m.rope_theta,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: m.max_position_embeddings,
            tie_word_embeddings: m.tie_word_embeddings,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: vec![None; m.num_hidden_layers.max(0) as usize],
            bos_token_id: None,
            eos_token_ids: vec![eos],
            pad_token_id: Some(eos),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Next-token cross-entropy of a causal LM over all positions of a packed batch.
pub fn lm_loss(model: &LlamaModel, batch: &Tensor) -> Result<Tensor> {
    let l = batch.size()[1] - 1;
    let inputs = batch.narrow(1, 0, l);
    let targets = batch.narrow(1, 1, l);
    let logits = model.forward(&inputs, Default::default())?;
    Ok(lm_loss_logits(&logits, &targets))
}

/// Mean cross-entropy of `logits: [B, T, V]` against `targets: [B, T]`, in f32.
pub fn lm_loss_logits(logits: &Tensor, targets: &Tensor) -> Tensor {
    let v = logits.size()[2];
    logits.to_kind(Kind::Float).view([-1, v]).cross_entropy_for_logits(&targets.reshape([-1]))
}

/// Stage 0 task: every parameter of the model trains.
pub struct PretrainTask {
    pub vs: nn::VarStore,
    pub model: LlamaModel,
}

impl TrainTask for PretrainTask {
    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<_> = self.vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
    fn loss(&mut self, batch: &Tensor, _ctx: &StepContext) -> Result<Tensor> {
        lm_loss(&self.model, batch)
    }
    fn fingerprint(&self) -> serde_json::Value {
        serde_json::to_value(&self.model.config).unwrap_or_default()
    }
    fn device(&self) -> Device {
        self.model.device
    }
}

/// What a stage 0 run reports (`summary.json` in the output folder).
#[derive(Debug, Clone, Serialize)]
pub struct PretrainReport {
    pub name: String,
    pub parameters: i64,
    pub device: String,
    pub dtype: String,
    pub train: TrainSummary,
    pub validation_loss: f64,
    pub validation_perplexity: f64,
    pub test_loss: f64,
    pub test_perplexity: f64,
    pub baselines: crate::baselines::NgramReport,
    pub corpus: CorpusManifest,
    pub model_dir: PathBuf,
}

/// Runs the whole stage 0 pipeline of `recipe`; `table` is the effective recipe to record.
/// Returns `None` when a signal stopped training (a checkpoint was written; `resume` goes on).
pub fn run(recipe: &PretrainRecipe, table: &toml::Table, resume: bool) -> Result<Option<PretrainReport>> {
    recipe.train.apply_determinism()?;
    let dist = crate::dist::init()?;
    // Rank 0 builds or checks the shared data folders; the others open them afterwards.
    let files = dist.main_first(|| recipe.data.prepare())?;
    let train = files.open(Split::Train)?;
    let val = files.open(Split::Validation)?;
    let test = files.open(Split::Test)?;
    let tok = wide_core::Tokenizer::from_file(&recipe.data.tokenizer)?;
    let eos = tok.token_id(bpe::EOS_TOKEN).context("tokenizer has no end-of-text token")?;
    let cfg = recipe.model_config(train.vocab_size as i64, eos)?;
    let device = dist.device(parse_device(&recipe.train.device)?)?;
    let kind = parse_dtype(&recipe.train.dtype, device)?;
    tch::manual_seed(recipe.train.seed as i64);
    let vs = nn::VarStore::new(device);
    let model = LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: recipe.model.init_std }, kind, true)?;
    let mut task = PretrainTask { vs, model };
    let out = &recipe.output.dir;
    if dist.is_main() { eprintln!(
        "{}: {} parameters on {device:?} ({kind:?}); {} training tokens, {} per step",
        recipe.name,
        cfg.parameter_count(),
        train.count,
        recipe.train.tokens_per_step(recipe.data.seq_len)
    ); }
    // The trainer writes the effective recipe once it has checked the output folder.
    let trainer = Trainer { cfg: recipe.train.clone(), seq_len: recipe.data.seq_len, out_dir: out.clone(), train: &train, val: Some(&val), effective_recipe: Some(table) };
    let summary = trainer.run(&mut task, resume)?;
    // Training is the distributed part; rank 0 evaluates and writes the model alone.
    dist.finish()?;
    if summary.interrupted || !dist.is_main() {
        return Ok(None);
    }
    let (vl, tl) = (
        evaluate(&mut task, &val, recipe.data.seq_len, recipe.train.micro_batch, 0)?,
        evaluate(&mut task, &test, recipe.data.seq_len, recipe.train.micro_batch, 0)?,
    );
    let baselines = crate::baselines::ngram_report(&train, &val, &test)?;
    let model_dir = out.join("model");
    let mut tensors: Vec<(String, Tensor)> = task.vs.variables().into_iter().map(|(n, t)| (n, t.detach())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let store = parse_dtype(&recipe.output.dtype, Device::Cpu)?;
    save_hf_folder(&model_dir, &cfg, &tensors, &SaveOptions { tokenizer: Some(&recipe.data.tokenizer), overwrite: true, dtype: Some(store), max_shard_bytes: 15 << 20 })?;
    let report = PretrainReport {
        name: recipe.name.clone(),
        parameters: cfg.parameter_count(),
        device: format!("{device:?}"),
        dtype: format!("{kind:?}"),
        train: summary,
        validation_loss: vl,
        validation_perplexity: vl.exp(),
        test_loss: tl,
        test_perplexity: tl.exp(),
        baselines,
        corpus: CorpusManifest::load(&recipe.data.corpus_dir)?,
        model_dir,
    };
    recipe::write_atomic(&out.join("summary.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
    Ok(Some(report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_model_shape_is_refused_when_the_recipe_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/testbed-tiny.toml");
        assert!(PretrainRecipe::load(&path, &[]).is_ok());
        for (o, want) in [
            ("model.num_key_value_heads=0", "num_key_value_heads (0) must be positive"),
            ("model.num_attention_heads=3", "must be a multiple of num_key_value_heads"),
            ("model.head_dim=15", "head_dim must be positive and even"),
        ] {
            let e = format!("{:#}", PretrainRecipe::load(&path, &[o.to_string()]).unwrap_err());
            assert!(e.contains("the recipe's [model] table is invalid") && e.contains(want), "{o}: {e}");
        }
    }
}
