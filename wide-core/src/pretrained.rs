//! Loading a Hugging Face folder into a ready model, with device and dtype chosen by flags.
use crate::checkpoint::HfCheckpoint;
use crate::model::LlamaModel;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use std::path::Path;
use tch::{nn, Device, Kind};

/// A loaded model, the variable store that owns its parameters, and its tokenizer.
pub struct Pretrained {
    pub vs: nn::VarStore,
    pub model: LlamaModel,
    pub tokenizer: Option<Tokenizer>,
}

/// `auto` (first GPU if any, else CPU), `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    Ok(match s {
        "auto" => Device::cuda_if_available(),
        "cpu" => Device::Cpu,
        "cuda" | "gpu" => Device::Cuda(0),
        _ => match s.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => Device::Cuda(n),
            None => bail!("unknown device {s:?}: use auto, cpu, cuda or cuda:N"),
        },
    })
    .and_then(|d| {
        if let Device::Cuda(n) = d {
            let count = tch::Cuda::device_count() as usize;
            if n >= count {
                bail!("device cuda:{n} requested but this machine has {count} CUDA device(s)");
            }
        }
        Ok(d)
    })
}

/// `auto` (bf16 on GPU, f32 on CPU), `f32`, `bf16` or `f16`.
pub fn parse_dtype(s: &str, device: Device) -> Result<Kind> {
    Ok(match s {
        "auto" => {
            if device.is_cuda() {
                Kind::BFloat16
            } else {
                Kind::Float
            }
        }
        "f32" | "float32" => Kind::Float,
        "bf16" | "bfloat16" => Kind::BFloat16,
        "f16" | "float16" => Kind::Half,
        _ => bail!("unknown dtype {s:?}: use auto, f32, bf16 or f16"),
    })
}

impl Pretrained {
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let mut ckpt = HfCheckpoint::open(dir)?;
        let config = ckpt.config.clone();
        let vs = nn::VarStore::new(device);
        let model = LlamaModel::new(&vs.root(), &config, &mut ckpt, kind, false)?;
        let tokenizer = match ckpt.tokenizer_path() {
            Some(p) => Some(Tokenizer::from_file(&p)?),
            None => None,
        };
        Ok(Self { vs, model, tokenizer })
    }
}
