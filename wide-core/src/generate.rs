//! Batched generation: left-padded prefill into a preallocated KV cache, then one token per
//! step, greedy or sampled (temperature, top-p) with a seeded generator.
use crate::model::{ForwardOptions, KvCache, LlamaModel, Logits};
use anyhow::{bail, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone)]
pub struct SamplingConfig {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling threshold in (0, 1]; 1 disables it.
    pub top_p: f64,
    pub seed: u64,
    /// Stop a row at an EOS token (from generation_config.json).
    pub stop_at_eos: bool,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self { max_new_tokens: 64, temperature: 0.0, top_p: 1.0, seed: 0, stop_at_eos: true }
    }
}

/// Generated ids per prompt, and timing of the two phases.
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<Vec<i64>>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub decode_steps: usize,
}

/// Left-pads `prompts` into `[B, T]` ids, a `[B, T]` 0/1 mask and `[B, T]` positions
/// (0 at each row's first real token; padding rows hold 0).
pub fn left_pad(prompts: &[Vec<i64>], pad_id: i64) -> (Tensor, Tensor, Tensor) {
    let t = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(prompts.len() * t);
    let mut mask = Vec::with_capacity(prompts.len() * t);
    let mut pos = Vec::with_capacity(prompts.len() * t);
    for p in prompts {
        let pad = t - p.len();
        ids.extend(std::iter::repeat_n(pad_id, pad).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1, p.len())));
        pos.extend(std::iter::repeat_n(0i64, pad).chain(0..p.len() as i64));
    }
    let shape = [prompts.len() as i64, t as i64];
    (Tensor::from_slice(&ids).view(shape), Tensor::from_slice(&mask).view(shape), Tensor::from_slice(&pos).view(shape))
}

/// Picks the next token of each row from logits `[B, vocab]`.
/// The tokens each row of a generation has produced: rows stop at an end-of-sequence token
/// (when `stop_at_eos`) or at `max_new_tokens`.
pub(crate) struct Emitted {
    pub tokens: Vec<Vec<i64>>,
    done: Vec<bool>,
}

impl Emitted {
    pub fn new(rows: usize) -> Self {
        Self { tokens: vec![vec![]; rows], done: vec![false; rows] }
    }

    /// Appends `next[r]` to every row still running and streams it through `on_token`; returns
    /// true when every row has stopped.
    pub fn push(&mut self, next: &[i64], eos: &[i64], cfg: &SamplingConfig, on_token: &mut impl FnMut(usize, i64) -> Result<()>) -> Result<bool> {
        for (r, &tok) in next.iter().enumerate() {
            if self.done[r] {
                continue;
            }
            self.tokens[r].push(tok);
            on_token(r, tok)?;
            if (cfg.stop_at_eos && eos.contains(&tok)) || self.tokens[r].len() >= cfg.max_new_tokens {
                self.done[r] = true;
            }
        }
        Ok(self.done.iter().all(|d| *d))
    }
}

pub fn pick_tokens(logits: &Tensor, cfg: &SamplingConfig, rng: &mut StdRng) -> Result<Vec<i64>> {
    if cfg.temperature <= 0.0 {
        return Ok(Vec::<i64>::try_from(logits.argmax(-1, false).to_device(Device::Cpu))?);
    }
    let probs = (logits.to_kind(Kind::Float) / cfg.temperature).softmax(-1, Kind::Float).to_device(Device::Cpu);
    let (b, v) = probs.size2()?;
    let flat = Vec::<f32>::try_from(probs.view([-1]))?;
    let mut out = Vec::with_capacity(b as usize);
    for row in flat.chunks(v as usize) {
        out.push(sample_top_p(row, cfg.top_p, rng));
    }
    Ok(out)
}

/// Samples from `probs` restricted to the smallest set of tokens whose mass reaches `top_p`.
pub fn sample_top_p(probs: &[f32], top_p: f64, rng: &mut StdRng) -> i64 {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap_or(std::cmp::Ordering::Equal));
    let mut kept = Vec::new();
    let mut mass = 0.0f64;
    for &i in &order {
        kept.push(i);
        mass += probs[i] as f64;
        if mass >= top_p {
            break;
        }
    }
    let r = rng.random::<f64>() * mass;
    let mut acc = 0.0;
    for &i in &kept {
        acc += probs[i] as f64;
        if acc >= r {
            return i as i64;
        }
    }
    *kept.last().unwrap() as i64
}

impl LlamaModel {
    /// Fails when the longest prompt plus `max_new_tokens` exceeds the model's context.
    pub fn check_context(&self, prompts: &[Vec<i64>], max_new_tokens: usize) -> Result<()> {
        // The prefill always yields one token, so 0 would still emit one.
        anyhow::ensure!(max_new_tokens >= 1, "--max-new-tokens must be at least 1, got 0");
        let ctx = self.config.max_position_embeddings as usize;
        let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        if longest + max_new_tokens > ctx {
            bail!(
                "prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model's context of {ctx} positions (max_position_embeddings); shorten the prompt or lower --max-new-tokens"
            );
        }
        Ok(())
    }

    /// Generates up to `cfg.max_new_tokens` tokens for each prompt. `on_token(row, id)` is
    /// called for every new token as it is produced (for streaming).
    pub fn generate(
        &self,
        prompts: &[Vec<i64>],
        cfg: &SamplingConfig,
        mut on_token: impl FnMut(usize, i64) -> Result<()>,
    ) -> Result<Generation> {
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            bail!("every prompt needs at least one token");
        }
        self.check_context(prompts, cfg.max_new_tokens)?;
        let _guard = tch::no_grad_guard();
        let b = prompts.len();
        let pad_id = self.config.pad_token_id.or(self.config.eos_token_ids.first().copied()).unwrap_or(0);
        let (ids, mask, pos) = left_pad(prompts, pad_id);
        let t = ids.size()[1];
        let capacity = t + cfg.max_new_tokens as i64;
        let mut cache = KvCache::new(&self.config, b as i64, capacity, self.kind, self.device);
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        let dev = self.device;
        let full_mask = Tensor::zeros([b as i64, capacity], (Kind::Int64, dev));
        full_mask.narrow(1, 0, t).copy_(&mask);
        let start = std::time::Instant::now();
        let logits = self.forward(
            &ids.to_device(dev),
            ForwardOptions {
                position_ids: Some(&pos.to_device(dev)),
                attention_mask: Some(&full_mask.narrow(1, 0, t)),
                cache: Some(&mut cache),
                logits: Some(Logits::Last),
            },
        )?;
        let mut next = pick_tokens(&logits.squeeze_dim(1), cfg, &mut rng)?;
        let prefill_seconds = start.elapsed().as_secs_f64();
        let start = std::time::Instant::now();
        let mut out = Emitted::new(b);
        let mut positions: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
        let mut steps = 0;
        while !out.push(&next, &self.config.eos_token_ids, cfg, &mut on_token)? {
            let slot = cache.len;
            let _ = full_mask.narrow(1, slot, 1).fill_(1);
            let step_ids = Tensor::from_slice(&next).view([b as i64, 1]).to_device(dev);
            let step_pos = Tensor::from_slice(&positions).view([b as i64, 1]).to_device(dev);
            let logits = self.forward(
                &step_ids,
                ForwardOptions {
                    position_ids: Some(&step_pos),
                    attention_mask: Some(&full_mask.narrow(1, 0, slot + 1)),
                    cache: Some(&mut cache),
                    logits: Some(Logits::Last),
                },
            )?;
            next = pick_tokens(&logits.squeeze_dim(1), cfg, &mut rng)?;
            for p in positions.iter_mut() {
                *p += 1;
            }
            steps += 1;
        }
        Ok(Generation { tokens: out.tokens, prefill_seconds, decode_seconds: start.elapsed().as_secs_f64(), decode_steps: steps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_pad_aligns_rows_at_the_right() {
        let (ids, mask, pos) = left_pad(&[vec![5, 6, 7], vec![9]], 0);
        assert_eq!(Vec::<i64>::try_from(ids.view([-1])).unwrap(), vec![5, 6, 7, 0, 0, 9]);
        assert_eq!(Vec::<i64>::try_from(mask.view([-1])).unwrap(), vec![1, 1, 1, 0, 0, 1]);
        assert_eq!(Vec::<i64>::try_from(pos.view([-1])).unwrap(), vec![0, 1, 2, 0, 0, 0]);
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let probs = [0.6f32, 0.3, 0.05, 0.05];
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..200 {
            let t = sample_top_p(&probs, 0.85, &mut rng);
            assert!(t == 0 || t == 1, "{t}");
        }
        // top_p = 1 reaches every token eventually.
        let seen: std::collections::HashSet<i64> = (0..2000).map(|_| sample_top_p(&probs, 1.0, &mut rng)).collect();
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn sampling_is_reproducible_by_seed() {
        let logits = Tensor::randn([3, 50], (Kind::Float, Device::Cpu));
        let cfg = SamplingConfig { temperature: 0.8, top_p: 0.9, ..Default::default() };
        let a = pick_tokens(&logits, &cfg, &mut StdRng::seed_from_u64(7)).unwrap();
        let b = pick_tokens(&logits, &cfg, &mut StdRng::seed_from_u64(7)).unwrap();
        assert_eq!(a, b);
    }
}
