//! Rotary position embeddings, with Llama 3 frequency scaling.
use crate::config::{ModelConfig, RopeScaling};
use tch::{Device, Kind, Tensor};

/// Inverse frequencies `[head_dim / 2]` in f32, exactly as Hugging Face computes them.
pub fn inverse_frequencies(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim as usize;
    let base: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1.0f32 / (cfg.rope_theta as f32).powf(i as f32 / d as f32))
        .collect();
    match &cfg.rope_scaling {
        RopeScaling::Default => base,
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let (factor, low, high, old) =
                (*factor as f32, *low_freq_factor as f32, *high_freq_factor as f32, *original_max_position_embeddings as f32);
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    // Long wavelengths are slowed by `factor`, short ones kept, the band between
                    // interpolated smoothly.
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                    if medium {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}

/// Precomputed inverse frequencies on the model's device.
#[derive(Debug)]
pub struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    pub fn new(cfg: &ModelConfig, device: Device) -> Self {
        Self { inv_freq: Tensor::from_slice(&inverse_frequencies(cfg)).to_device(device) }
    }

    /// `cos, sin` of shape `[B, 1, T, head_dim]` for positions `[B, T]`, computed in f32 and
    /// cast to `kind`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * self.inv_freq.view([1, 1, -1]);
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }
}

/// Applies the rotation to `x: [B, heads, T, head_dim]`.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let rotated = Tensor::cat(&[&(-&x2), &x1], 3);
    x * cos + rotated * sin
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn llama3_scaling_touches_all_three_bands() {
        let j = r#"{"model_type":"llama","vocab_size":10,"hidden_size":256,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"head_dim":128,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192}}"#;
        let c = ModelConfig::from_hf_json(j).unwrap();
        let scaled = inverse_frequencies(&c);
        let mut plain = c.clone();
        plain.rope_scaling = RopeScaling::Default;
        let base = inverse_frequencies(&plain);
        let (mut same, mut div, mut mid) = (0, 0, 0);
        for (s, b) in scaled.iter().zip(&base) {
            if s == b {
                same += 1
            } else if (s * 8.0 - b).abs() <= 1e-6 * b.abs() {
                div += 1
            } else {
                mid += 1
            }
        }
        assert!(same > 0 && div > 0 && mid > 0, "{same} {div} {mid}");
    }

    #[test]
    fn rotation_preserves_norm() {
        let x = Tensor::randn([2, 3, 5, 8], (Kind::Float, Device::Cpu));
        let pos = Tensor::arange(5, (Kind::Int64, Device::Cpu)).unsqueeze(0).repeat([2, 1]);
        let j = r#"{"model_type":"llama","vocab_size":10,"hidden_size":24,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":3,"head_dim":8}"#;
        let r = Rope::new(&ModelConfig::from_hf_json(j).unwrap(), Device::Cpu);
        let (c, s) = r.cos_sin(&pos, Kind::Float);
        let y = apply(&x, &c, &s);
        let diff = (y.norm() - x.norm()).abs().double_value(&[]);
        assert!(diff < 1e-4, "{diff}");
    }
}
