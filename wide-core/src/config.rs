//! Model configuration: a serde mirror of Hugging Face `config.json` for the Llama family,
//! converted into the validated internal [`ModelConfig`] the backbone is built from.
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// The architectures this project runs; they differ only in small details of attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Family {
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Llama 3 / 3.1 / 3.2 band-wise scaling of the inverse frequencies.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// Everything the backbone needs, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama/Qwen3 with `attention_bias`; never for Qwen2 and Mistral).
    pub o_bias: bool,
    /// Bias on gate/up/down (Llama with `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Per layer: `Some(w)` when the layer attends only to the last `w` positions.
    pub sliding_window: Vec<Option<i64>>,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
}

/// The subset of Hugging Face `config.json` we read. Unknown fields are ignored; fields whose
/// presence changes the math are checked explicitly in [`ModelConfig::from_hf`].
#[derive(Debug, Clone, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: i64,
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: i64,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
    sliding_window: Option<i64>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<i64>,
    layer_types: Option<Vec<String>>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    pad_token_id: Option<Value>,
    pretraining_tp: Option<i64>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> i64 {
    2048
}

/// Token ids in configs are a number, a list of numbers, or null.
pub(crate) fn ids_of(v: &Option<Value>) -> Vec<i64> {
    match v {
        Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_i64()).collect(),
        _ => vec![],
    }
}

impl ModelConfig {
    /// Reads `config.json` from a Hugging Face model folder.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!("cannot read {}: a Hugging Face model folder needs a config.json", path.display())
        })?;
        Self::from_hf_json(&text).with_context(|| format!("invalid model config {}", path.display()))
    }

    pub fn from_hf_json(text: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(text).context("config.json is not a valid Llama-family config")?;
        Self::from_hf(hf)
    }

    fn from_hf(hf: HfConfig) -> Result<Self> {
        let mt = hf.model_type.clone().unwrap_or_default();
        let family = match mt.as_str() {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            other => bail!(
                "unsupported architecture: model_type {:?} (architectures {:?}); supported are llama (Llama 2/3/3.1/3.2), mistral, qwen2 and qwen3",
                other,
                hf.architectures
            ),
        };
        if let Some(act) = &hf.hidden_act {
            if act != "silu" {
                bail!("unsupported hidden_act {act:?}: the Llama-family MLP here is SwiGLU (silu)");
            }
        }
        if hf.pretraining_tp.unwrap_or(1) != 1 {
            bail!("pretraining_tp != 1 is not supported");
        }
        let n_heads = hf.num_attention_heads;
        let n_kv = hf.num_key_value_heads.unwrap_or(n_heads);
        if n_heads <= 0 || n_kv <= 0 || n_heads % n_kv != 0 {
            bail!("num_attention_heads ({n_heads}) must be a positive multiple of num_key_value_heads ({n_kv})");
        }
        let head_dim = match hf.head_dim {
            Some(d) => d,
            None => {
                if hf.hidden_size % n_heads != 0 {
                    bail!("hidden_size ({}) is not divisible by num_attention_heads ({n_heads}) and no head_dim is given", hf.hidden_size);
                }
                hf.hidden_size / n_heads
            }
        };
        if head_dim % 2 != 0 {
            bail!("head_dim ({head_dim}) must be even for RoPE");
        }
        // transformers 5 writes `rope_parameters` (with rope_theta inside); older checkpoints
        // write `rope_scaling` and a top-level `rope_theta`.
        let rope_params = hf.rope_parameters.clone().or(hf.rope_scaling.clone());
        let mut rope_theta = hf.rope_theta.unwrap_or(10000.0);
        let mut rope_scaling = RopeScaling::Default;
        if let Some(Value::Object(p)) = &rope_params {
            if let Some(t) = p.get("rope_theta").and_then(|v| v.as_f64()) {
                rope_theta = t;
            }
            let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
            let num = |k: &str| -> Result<f64> {
                p.get(k).and_then(|v| v.as_f64()).with_context(|| format!("rope scaling of type {kind:?} needs a numeric {k:?}"))
            };
            rope_scaling = match kind {
                "default" => RopeScaling::Default,
                "llama3" => RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                },
                other => bail!("unsupported rope scaling type {other:?}: supported are default and llama3"),
            };
        }
        let n_layers = hf.num_hidden_layers;
        let sliding_window = sliding_layers(family, &hf, n_layers)?;
        let tie = hf.tie_word_embeddings.unwrap_or(false);
        let cfg = ModelConfig {
            family,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: n_layers,
            num_attention_heads: n_heads,
            num_key_value_heads: n_kv,
            head_dim,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: tie,
            // As transformers builds them: Llama and Qwen3 put `attention_bias` on q/k/v and o_proj,
            // Qwen2 always has q/k/v bias and never an o_proj bias, Mistral has none.
            qkv_bias: match family {
                Family::Llama | Family::Qwen3 => hf.attention_bias,
                Family::Qwen2 => true,
                Family::Mistral => false,
            },
            o_bias: matches!(family, Family::Llama | Family::Qwen3) && hf.attention_bias,
            mlp_bias: family == Family::Llama && hf.mlp_bias,
            qk_norm: family == Family::Qwen3,
            sliding_window,
            bos_token_id: ids_of(&hf.bos_token_id).first().copied(),
            eos_token_ids: ids_of(&hf.eos_token_id),
            pad_token_id: ids_of(&hf.pad_token_id).first().copied(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v <= 0 {
                bail!("{name} must be positive, got {v}");
            }
        }
        // Checked before the divisibility test below, which would otherwise divide by zero.
        if self.num_attention_heads <= 0 || self.num_key_value_heads <= 0 {
            bail!(
                "num_attention_heads ({}) and num_key_value_heads ({}) must be positive",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        // RoPE rotates pairs of dimensions.
        if self.head_dim <= 0 || self.head_dim % 2 != 0 {
            bail!("head_dim must be positive and even (RoPE rotates pairs of dimensions), got {}", self.head_dim);
        }
        if self.sliding_window.len() != self.num_hidden_layers as usize {
            bail!("sliding window list has {} entries for {} layers", self.sliding_window.len(), self.num_hidden_layers);
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn gqa_group(&self) -> i64 {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Number of parameters (embeddings counted once when tied).
    pub fn parameter_count(&self) -> i64 {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let i = self.intermediate_size;
        let mut layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.o_bias {
            layer += h;
        }
        if self.mlp_bias {
            layer += 2 * i + h;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        let emb = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        emb + head + self.num_hidden_layers * layer + h
    }

    /// Attention group sizes (query heads per routed group) that divide the head count.
    pub fn attention_group_sizes(&self) -> Vec<i64> {
        divisors(self.num_attention_heads)
    }

    /// FFN group sizes (channels per routed group) that divide the intermediate size; only
    /// multiples of 8 (or the whole dimension) are listed, since finer groups defeat the kernels.
    pub fn ffn_group_sizes(&self) -> Vec<i64> {
        divisors(self.intermediate_size).into_iter().filter(|g| g % 8 == 0 || *g == self.intermediate_size).collect()
    }

    /// The Hugging Face `config.json` for this model (transformers 5 layout).
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let mut rope = serde_json::Map::new();
        rope.insert("rope_theta".into(), self.rope_theta.into());
        match &self.rope_scaling {
            RopeScaling::Default => {
                rope.insert("rope_type".into(), "default".into());
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                rope.insert("rope_type".into(), "llama3".into());
                rope.insert("factor".into(), (*factor).into());
                rope.insert("low_freq_factor".into(), (*low_freq_factor).into());
                rope.insert("high_freq_factor".into(), (*high_freq_factor).into());
                rope.insert("original_max_position_embeddings".into(), (*original_max_position_embeddings).into());
            }
        }
        let eos: Value = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => (*one).into(),
            many => many.to_vec().into(),
        };
        let mut v = serde_json::json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": Value::Object(rope),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "use_cache": true,
        });
        let o = v.as_object_mut().unwrap();
        match self.family {
            Family::Llama => {
                o.insert("attention_bias".into(), self.qkv_bias.into());
                o.insert("mlp_bias".into(), self.mlp_bias.into());
            }
            Family::Qwen3 => {
                o.insert("attention_bias".into(), self.qkv_bias.into());
            }
            _ => {}
        }
        let window = self.sliding_window.iter().flatten().next().copied();
        match self.family {
            Family::Mistral => {
                o.insert("sliding_window".into(), window.into());
            }
            Family::Qwen2 | Family::Qwen3 => {
                o.insert("sliding_window".into(), window.into());
                o.insert("use_sliding_window".into(), window.is_some().into());
                let types: Vec<&str> = self
                    .sliding_window
                    .iter()
                    .map(|w| if w.is_some() { "sliding_attention" } else { "full_attention" })
                    .collect();
                o.insert("layer_types".into(), serde_json::json!(types));
                let first = self.sliding_window.iter().position(|w| w.is_some()).unwrap_or(self.sliding_window.len());
                o.insert("max_window_layers".into(), (first as i64).into());
            }
            Family::Llama => {}
        }
        v
    }
}

fn sliding_layers(family: Family, hf: &HfConfig, n_layers: i64) -> Result<Vec<Option<i64>>> {
    let n = n_layers.max(0) as usize;
    let window = hf.sliding_window;
    if let Some(w) = window {
        if w <= 0 {
            bail!("sliding_window must be positive, got {w}");
        }
    }
    let enabled = match family {
        Family::Llama => {
            return Ok(vec![None; n]);
        }
        Family::Mistral => window.is_some(),
        Family::Qwen2 | Family::Qwen3 => hf.use_sliding_window.unwrap_or(false) && window.is_some(),
    };
    if let Some(types) = &hf.layer_types {
        if types.len() != n {
            bail!("layer_types has {} entries but num_hidden_layers is {n}", types.len());
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" if enabled || family == Family::Mistral => {
                    window.map(Some).context("layer_types asks for sliding_attention but sliding_window is null")
                }
                "sliding_attention" => Ok(None),
                other => bail!("unsupported layer type {other:?} in layer_types"),
            })
            .collect();
    }
    if !enabled {
        return Ok(vec![None; n]);
    }
    let from = match family {
        Family::Mistral => 0,
        _ => hf.max_window_layers.unwrap_or(0).max(0) as usize,
    };
    Ok((0..n).map(|i| if i >= from { window } else { None }).collect())
}

fn divisors(n: i64) -> Vec<i64> {
    (1..=n).filter(|d| n % d == 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA31: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":128256,
        "hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
        "num_key_value_heads":8,"rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":131072,
        "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
        "original_max_position_embeddings":8192,"rope_type":"llama3"},"tie_word_embeddings":false,
        "bos_token_id":128000,"eos_token_id":[128001,128008,128009],"hidden_act":"silu"}"#;

    #[test]
    fn llama31_parses_with_legacy_rope_scaling() {
        let c = ModelConfig::from_hf_json(LLAMA31).unwrap();
        assert_eq!(c.family, Family::Llama);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.parameter_count(), 8_030_261_248);
        assert_eq!(c.attention_group_sizes(), vec![1, 2, 4, 8, 16, 32]);
        assert!(c.ffn_group_sizes().contains(&128));
        assert!(!c.ffn_group_sizes().contains(&7));
    }

    #[test]
    fn roundtrip_through_hf_json() {
        let c = ModelConfig::from_hf_json(LLAMA31).unwrap();
        let back = ModelConfig::from_hf_json(&c.to_hf_json("bfloat16").to_string()).unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let e = ModelConfig::from_hf_json(&LLAMA31.replace("\"llama\"", "\"gpt2\"")).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("unsupported architecture") && msg.contains("gpt2"), "{msg}");
    }

    #[test]
    fn mistral_sliding_window_applies_to_every_layer() {
        let j = r#"{"model_type":"mistral","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":3,"num_attention_heads":2,"num_key_value_heads":1,"sliding_window":4}"#;
        let c = ModelConfig::from_hf_json(j).unwrap();
        assert_eq!(c.sliding_window, vec![Some(4); 3]);
    }

    #[test]
    fn qwen2_without_use_sliding_window_is_full_attention() {
        let j = r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"sliding_window":4,
            "use_sliding_window":false}"#;
        let c = ModelConfig::from_hf_json(j).unwrap();
        assert_eq!(c.sliding_window, vec![None, None]);
        assert!(c.qkv_bias);
    }

    #[test]
    fn attention_bias_follows_each_family_like_transformers() {
        let j = |mt: &str| {
            format!(
                r#"{{"model_type":"{mt}","vocab_size":10,"hidden_size":8,"intermediate_size":16,
                "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"attention_bias":true}}"#
            )
        };
        let bias = |mt: &str| {
            let c = ModelConfig::from_hf_json(&j(mt)).unwrap();
            (c.qkv_bias, c.o_bias)
        };
        assert_eq!(bias("llama"), (true, true));
        assert_eq!(bias("qwen3"), (true, true));
        assert_eq!(bias("qwen2"), (true, false));
        assert_eq!(bias("mistral"), (false, false));
        let c = ModelConfig::from_hf_json(&j("qwen3")).unwrap();
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json("float32").to_string()).unwrap(), c);
    }

    #[test]
    fn validate_refuses_zero_heads_and_odd_head_dim() {
        let c = ModelConfig::from_hf_json(LLAMA31).unwrap();
        for (edit, want) in [
            (&(|c: &mut ModelConfig| c.num_key_value_heads = 0) as &dyn Fn(&mut ModelConfig), "must be positive"),
            (&|c: &mut ModelConfig| c.num_attention_heads = 0, "must be positive"),
            (&|c: &mut ModelConfig| c.num_attention_heads = 12, "multiple of num_key_value_heads"),
            (&|c: &mut ModelConfig| c.head_dim = 0, "head_dim must be positive and even"),
            (&|c: &mut ModelConfig| c.head_dim = 127, "head_dim must be positive and even"),
        ] {
            let mut bad = c.clone();
            edit(&mut bad);
            let e = format!("{:#}", bad.validate().unwrap_err());
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn bad_head_counts_are_refused() {
        let j = r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":3,"num_key_value_heads":2}"#;
        assert!(format!("{:#}", ModelConfig::from_hf_json(j).unwrap_err()).contains("multiple of num_key_value_heads"));
    }
}
