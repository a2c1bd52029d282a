//! AdamW with decoupled weight decay, written in tch ops so that its state can be saved and
//! restored exactly, and kept in f32 whatever the parameter dtype: bf16 parameters get an f32
//! master copy that the update is applied to. Plus the learning-rate schedule.
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Kind, Tensor};
use wide_core::safetensors::{self, SafetensorsFile};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    pub lr: f64,
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.999
}
fn d_eps() -> f64 {
    1e-8
}

struct Slot {
    name: String,
    param: Tensor,
    /// f32 copy the update is applied to, when the parameter itself is not f32.
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    decay: bool,
}

pub struct AdamW {
    pub cfg: AdamWConfig,
    slots: Vec<Slot>,
    pub step: u64,
}

impl AdamW {
    /// `params`: named trainable tensors (requires_grad). Weight decay applies to matrices
    /// only, not to norms and biases.
    pub fn new(params: Vec<(String, Tensor)>, cfg: AdamWConfig) -> Self {
        let _g = tch::no_grad_guard();
        let slots = params
            .into_iter()
            .map(|(name, param)| {
                let master = (param.kind() != Kind::Float).then(|| param.detach().to_kind(Kind::Float));
                let zeros = || Tensor::zeros(param.size(), (Kind::Float, param.device()));
                Slot { decay: param.dim() >= 2, exp_avg: zeros(), exp_avg_sq: zeros(), master, name, param }
            })
            .collect();
        Self { cfg, slots, step: 0 }
    }

    pub fn zero_grad(&mut self) {
        for s in &mut self.slots {
            s.param.zero_grad();
        }
    }

    /// Global L2 norm of all gradients (f32).
    pub fn grad_norm(&self) -> f64 {
        let _g = tch::no_grad_guard();
        let sq: Vec<Tensor> = self
            .slots
            .iter()
            .filter_map(|s| {
                let g = s.param.grad();
                g.defined().then(|| g.to_kind(Kind::Float).pow_tensor_scalar(2).sum(Kind::Float))
            })
            .collect();
        if sq.is_empty() {
            return 0.0;
        }
        Tensor::stack(&sq, 0).sum(Kind::Float).sqrt().double_value(&[])
    }

    /// Scales every gradient so that their global norm is at most `max_norm`; returns the
    /// norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let norm = self.grad_norm();
        if max_norm > 0.0 && norm > max_norm && norm.is_finite() {
            let _g = tch::no_grad_guard();
            let scale = max_norm / (norm + 1e-6);
            for s in &self.slots {
                let mut g = s.param.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(scale);
                }
            }
        }
        norm
    }

    /// One update at learning rate `lr`.
    pub fn step(&mut self, lr: f64) {
        let _g = tch::no_grad_guard();
        self.step += 1;
        let AdamWConfig { beta1, beta2, eps, weight_decay, .. } = self.cfg;
        let bc1 = 1.0 - beta1.powi(self.step as i32);
        let bc2 = 1.0 - beta2.powi(self.step as i32);
        for s in &mut self.slots {
            let g = s.param.grad();
            if !g.defined() {
                continue;
            }
            let g = g.to_kind(Kind::Float);
            let _ = s.exp_avg.g_mul_scalar_(beta1).g_add_(&(&g * (1.0 - beta1)));
            let _ = s.exp_avg_sq.g_mul_scalar_(beta2).g_add_(&(&g * &g * (1.0 - beta2)));
            let denom = (&s.exp_avg_sq / bc2).sqrt() + eps;
            let update = &s.exp_avg / bc1 / denom;
            let target = s.master.as_ref().unwrap_or(&s.param);
            let mut t = target.shallow_clone();
            if s.decay && weight_decay > 0.0 {
                let _ = t.g_mul_scalar_(1.0 - lr * weight_decay);
            }
            let _ = t.g_sub_(&(update * lr));
            if let Some(m) = &s.master {
                s.param.shallow_clone().copy_(&m.to_kind(s.param.kind()));
            }
        }
    }

    /// Saves moments and master weights (f32) to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut t = vec![];
        for s in &self.slots {
            t.push((format!("{}.exp_avg", s.name), s.exp_avg.shallow_clone()));
            t.push((format!("{}.exp_avg_sq", s.name), s.exp_avg_sq.shallow_clone()));
            if let Some(m) = &s.master {
                t.push((format!("{}.master", s.name), m.shallow_clone()));
            }
        }
        let mut meta = BTreeMap::new();
        meta.insert("step".to_string(), self.step.to_string());
        safetensors::write(path, &t, &meta)
    }

    /// Restores state written by [`AdamW::save`] for the same parameters.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let _g = tch::no_grad_guard();
        let f = SafetensorsFile::open(path)?;
        for s in &mut self.slots {
            for (suffix, dst) in [("exp_avg", &mut s.exp_avg), ("exp_avg_sq", &mut s.exp_avg_sq)] {
                let name = format!("{}.{suffix}", s.name);
                let t = f.read(&name).with_context(|| format!("optimizer state {} does not match this model", path.display()))?;
                if t.size() != dst.size() {
                    bail!("optimizer state {name} has shape {:?}, the parameter {:?}: the checkpoint is from another configuration", t.size(), dst.size());
                }
                dst.copy_(&t);
            }
            if let Some(m) = &mut s.master {
                m.copy_(&f.read(&format!("{}.master", s.name))?);
                s.param.shallow_clone().copy_(&m.to_kind(s.param.kind()));
            }
        }
        self.step = f.metadata.get("step").and_then(|s| s.parse().ok()).context("optimizer state has no step")?;
        Ok(())
    }
}

/// Linear warm-up to `lr`, then cosine decay to `min_lr` at `total` steps.
#[derive(Debug, Clone, Copy)]
pub struct WarmupCosine {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub total: u64,
}

impl WarmupCosine {
    /// Learning rate of optimizer step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if self.warmup > 0 && step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let p = ((step - self.warmup.min(step)) as f64 / span as f64).min(1.0);
        self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * p).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn matches_the_adamw_formula_on_one_parameter() {
        let p = Tensor::from_slice(&[1.0f32, -2.0]).view([1, 2]).set_requires_grad(true);
        let cfg = AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.5 };
        let mut opt = AdamW::new(vec![("w".into(), p.shallow_clone())], cfg);
        let loss = (&p * &p).sum(Kind::Float);
        loss.backward();
        opt.step(0.1);
        // step 1: m = 0.1 g, v = 0.01 g^2, mhat/sqrt(vhat) = sign(g); p <- p(1 - lr wd) - lr sign(g)
        let want = [1.0 * (1.0 - 0.05) - 0.1, -2.0 * (1.0 - 0.05) + 0.1];
        let got = Vec::<f32>::try_from(p.detach().view([-1])).unwrap();
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn bf16_parameters_keep_an_f32_master_and_state_roundtrips() {
        let _rng = crate::rng_lock(); // the global generator, one test at a time
        let dir = tempfile::tempdir().unwrap();
        let p = Tensor::randn([4, 4], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
        let cfg = AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let mut opt = AdamW::new(vec![("w".into(), p.shallow_clone())], cfg.clone());
        for _ in 0..3 {
            opt.zero_grad();
            (&p * 3.0).sum(Kind::Float).backward();
            opt.step(1e-3);
        }
        opt.save(&dir.path().join("opt.safetensors")).unwrap();
        let q = p.detach().copy().set_requires_grad(true);
        let mut opt2 = AdamW::new(vec![("w".into(), q.shallow_clone())], cfg);
        opt2.load(&dir.path().join("opt.safetensors")).unwrap();
        assert_eq!(opt2.step, 3);
        assert!(opt2.slots[0].master.as_ref().unwrap().equal(opt.slots[0].master.as_ref().unwrap()));
        assert!(opt2.slots[0].exp_avg_sq.equal(&opt.slots[0].exp_avg_sq));
    }

    #[test]
    fn clipping_caps_the_global_norm() {
        let p = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut opt = AdamW::new(vec![("w".into(), p.shallow_clone())], AdamWConfig { lr: 1.0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 });
        (&p * Tensor::from_slice(&[3.0f32, 4.0, 0.0])).sum(Kind::Float).backward();
        assert!((opt.clip_grad_norm(1.0) - 5.0).abs() < 1e-5);
        assert!((opt.grad_norm() - 1.0).abs() < 1e-4);
    }

    #[test]
    fn schedule_hits_its_end_points() {
        let _rng = crate::rng_lock(); // the global generator, one test at a time
        let s = WarmupCosine { lr: 1.0, min_lr: 0.1, warmup: 10, total: 110 };
        assert!((s.at(0) - 0.1).abs() < 1e-12);
        assert!((s.at(9) - 1.0).abs() < 1e-12);
        assert!((s.at(10) - 1.0).abs() < 1e-12);
        assert!((s.at(60) - 0.55).abs() < 1e-9);
        assert!((s.at(110) - 0.1).abs() < 1e-12);
        assert!((s.at(500) - 0.1).abs() < 1e-12);
    }
}
