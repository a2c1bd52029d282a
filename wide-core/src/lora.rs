//! LoRA adapters on the backbone's projections: `y = x W^T + b + (alpha / r) B A dropout(x)`,
//! with Hugging Face/PEFT-style names (`...q_proj.lora_A.weight` `[r, in]`,
//! `...q_proj.lora_B.weight` `[out, r]`), and merging into the weights (`W += (alpha/r) B A`).
use crate::model::{LlamaModel, Linear};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tch::{nn, Kind, Tensor};

pub const ALL_TARGETS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    #[serde(default = "d_rank")]
    pub rank: i64,
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    #[serde(default = "d_dropout")]
    pub dropout: f64,
    #[serde(default = "d_targets")]
    pub targets: Vec<String>,
}
fn d_rank() -> i64 {
    16
}
fn d_alpha() -> f64 {
    32.0
}
fn d_dropout() -> f64 {
    0.1
}
fn d_targets() -> Vec<String> {
    ALL_TARGETS.iter().map(|s| s.to_string()).collect()
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self { rank: d_rank(), alpha: d_alpha(), dropout: d_dropout(), targets: d_targets() }
    }
}

impl LoraConfig {
    pub fn validate(&self) -> Result<()> {
        if self.rank <= 0 {
            bail!("lora.rank must be positive, got {}", self.rank);
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("lora.dropout must be in [0, 1), got {}", self.dropout);
        }
        for t in &self.targets {
            if !ALL_TARGETS.contains(&t.as_str()) {
                bail!("unknown LoRA target module {t:?}; choose from {ALL_TARGETS:?}");
            }
        }
        Ok(())
    }
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// One adapter. Dropout applies only while `training` is set.
#[derive(Debug)]
pub struct LoraAdapter {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
    pub dropout: f64,
    pub training: Arc<AtomicBool>,
}

impl LoraAdapter {
    /// `[.., in] -> [.., out]`: the low-rank update.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let train = self.training.load(Ordering::Relaxed);
        let x = if train && self.dropout > 0.0 { x.dropout(self.dropout, true) } else { x.shallow_clone() };
        x.linear::<Tensor>(&self.a, None).linear::<Tensor>(&self.b, None) * self.scale
    }
}

/// The adapters attached to a model.
pub struct Lora {
    pub config: LoraConfig,
    pub training: Arc<AtomicBool>,
    /// (module name, e.g. `model.layers.0.self_attn.q_proj`) in attachment order.
    pub modules: Vec<String>,
}

fn linears_mut(m: &mut LlamaModel) -> Vec<(String, &mut Linear)> {
    let mut v = vec![];
    for (i, l) in m.layers.iter_mut().enumerate() {
        let a = &mut l.self_attn;
        for (n, lin) in [("q_proj", &mut a.q_proj), ("k_proj", &mut a.k_proj), ("v_proj", &mut a.v_proj), ("o_proj", &mut a.o_proj)] {
            v.push((format!("model.layers.{i}.self_attn.{n}"), lin));
        }
        let f = &mut l.mlp;
        for (n, lin) in [("gate_proj", &mut f.gate_proj), ("up_proj", &mut f.up_proj), ("down_proj", &mut f.down_proj)] {
            v.push((format!("model.layers.{i}.mlp.{n}"), lin));
        }
    }
    v
}

impl Lora {
    /// Attaches fresh adapters (A Kaiming-uniform as PEFT initialises it, B zero, so the model
    /// is unchanged at first) to the target projections; parameters live under `root`.
    pub fn attach(model: &mut LlamaModel, root: &nn::Path, config: &LoraConfig) -> Result<Self> {
        config.validate()?;
        let training = Arc::new(AtomicBool::new(false));
        let mut modules = vec![];
        let kind = model.kind;
        let dev = model.device;
        for (name, lin) in linears_mut(model) {
            let short = name.rsplit('.').next().unwrap();
            if !config.targets.iter().any(|t| t == short) {
                continue;
            }
            if lin.lora.is_some() {
                bail!("{name} already has a LoRA adapter");
            }
            let (out, inp) = lin.weight.size2()?;
            let mut p = root.clone();
            for part in name.split('.') {
                p = &p / part;
            }
            let bound = 1.0 / (inp as f64).sqrt();
            let a = (&p / "lora_A").add("weight", Tensor::empty([config.rank, inp], (kind, dev)).uniform_(-bound, bound), true);
            let b = (&p / "lora_B").add("weight", Tensor::zeros([out, config.rank], (kind, dev)), true);
            lin.lora = Some(LoraAdapter { a, b, scale: config.scale(), dropout: config.dropout, training: training.clone() });
            modules.push(name);
        }
        Ok(Self { config: config.clone(), training, modules })
    }

    pub fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed);
    }

    /// Adapter tensors with their checkpoint names.
    pub fn tensors(model: &mut LlamaModel) -> Vec<(String, Tensor)> {
        let mut v = vec![];
        for (name, lin) in linears_mut(model) {
            if let Some(l) = &lin.lora {
                v.push((format!("{name}.lora_A.weight"), l.a.shallow_clone()));
                v.push((format!("{name}.lora_B.weight"), l.b.shallow_clone()));
            }
        }
        v
    }

    /// Loads adapter tensors by name (shape-checked); a missing tensor is named in the error.
    pub fn load(model: &mut LlamaModel, get: &mut dyn FnMut(&str) -> Result<Tensor>) -> Result<()> {
        let _g = tch::no_grad_guard();
        for (name, t) in Lora::tensors(model) {
            let src = get(&name).map_err(|e| anyhow::anyhow!("LoRA checkpoint is missing {name}: {e:#}"))?;
            if src.size() != t.size() {
                bail!("LoRA tensor {name} has shape {:?} in the checkpoint, {:?} here", src.size(), t.size());
            }
            t.detach().copy_(&src.to_kind(t.kind()).to_device(t.device()));
        }
        Ok(())
    }

    /// Folds every adapter into its weight (`W += scale * B A`, computed in f32) and removes it.
    pub fn merge(model: &mut LlamaModel) {
        let _g = tch::no_grad_guard();
        for (_, lin) in linears_mut(model) {
            if let Some(l) = lin.lora.take() {
                let delta = l.b.to_kind(Kind::Float).matmul(&l.a.to_kind(Kind::Float)) * l.scale;
                let merged = (lin.weight.to_kind(Kind::Float) + delta).to_kind(lin.weight.kind());
                lin.weight.detach().copy_(&merged);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{presets, ForwardOptions, RandomWeights};
    use tch::Device;

    #[test]
    fn merged_lora_gives_the_same_logits_as_unmerged() {
        let _g = tch::no_grad_guard();
        tch::manual_seed(5);
        let cfg = presets::preset("tiny").unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let mut m = LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: 0.1 }, Kind::Float, false).unwrap();
        let ids = Tensor::randint(250, [2, 12], (Kind::Int64, Device::Cpu));
        // The reference is the model before any adapter is attached.
        let base = m.forward(&ids, ForwardOptions::default()).unwrap();
        let lvs = nn::VarStore::new(Device::Cpu);
        let lora = Lora::attach(&mut m, &lvs.root(), &LoraConfig::default()).unwrap();
        assert_eq!(lora.modules.len(), 7 * cfg.num_hidden_layers as usize);
        // B starts at zero: the adapters change nothing yet.
        assert!(base.allclose(&m.forward(&ids, ForwardOptions::default()).unwrap(), 0.0, 0.0, false));
        for (_, t) in Lora::tensors(&mut m) {
            t.detach().copy_(&(t.randn_like() * 0.05));
        }
        let unmerged = m.forward(&ids, ForwardOptions::default()).unwrap();
        assert!((&unmerged - &base).abs().max().double_value(&[]) > 1e-3, "adapters must matter");
        Lora::merge(&mut m);
        let merged = m.forward(&ids, ForwardOptions::default()).unwrap();
        let rel = ((&merged - &unmerged).norm() / unmerged.norm()).double_value(&[]);
        assert!(rel < 1e-5, "relative difference {rel}");
        assert!(Lora::tensors(&mut m).is_empty());
    }

    #[test]
    fn bad_lora_config_is_refused() {
        let mut c = LoraConfig::default();
        c.targets.push("lm_head".into());
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("unknown LoRA target module \"lm_head\""));
    }
}
