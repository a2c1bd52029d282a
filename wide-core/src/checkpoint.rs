//! Hugging Face model folders: `config.json`, `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, `generation_config.json`, `tokenizer.json`.
//!
//! Weights come through a [`WeightSource`]: a checkpoint folder read tensor by tensor, or
//! seeded random weights for benchmarks and testbeds. Folders are written atomically.
use crate::config::{ids_of, ModelConfig};
use crate::safetensors::{self, SafetensorsFile};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Supplies the model's parameters by their Hugging Face names.
pub trait WeightSource {
    /// The tensor `name`, which must have shape `shape`, converted to `kind` on `device`.
    fn get(&mut self, name: &str, shape: &[i64], kind: Kind, device: Device) -> Result<Tensor>;
}

/// An opened Hugging Face model folder.
pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// The raw `config.json`, kept so that re-saving preserves fields we do not model.
    pub config_json: Value,
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
}

const PICKLE_NAMES: [&str; 4] = ["pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth"];

fn pickle_message(dir: &Path, found: &str) -> String {
    format!(
        "{} holds only a pickle checkpoint ({found}); wide never unpickles files (they can run arbitrary code). \
         Convert it to safetensors once, in Python: \
         `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)`",
        dir.display()
    )
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model folder {} does not exist or is not a directory", dir.display());
        }
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            bail!("{} has no config.json: point wide at a Hugging Face model folder", dir.display());
        }
        let text = std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
        let config_json: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", config_path.display()))?;
        let mut config = ModelConfig::from_hf_json(&text).with_context(|| format!("in {}", config_path.display()))?;
        // generation_config.json's EOS ids are the ones generation stops at.
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let g: Value = serde_json::from_str(&std::fs::read_to_string(&gen_path)?)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?;
            let eos = ids_of(&g.get("eos_token_id").cloned());
            if !eos.is_empty() {
                config.eos_token_ids = eos;
            }
            if let Some(b) = ids_of(&g.get("bos_token_id").cloned()).first() {
                config.bos_token_id = Some(*b);
            }
            if let Some(p) = ids_of(&g.get("pad_token_id").cloned()).first() {
                config.pad_token_id = Some(*p);
            }
        }
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let shard_names: Vec<String> = if index_path.exists() {
            let idx: Value = serde_json::from_str(&std::fs::read_to_string(&index_path)?)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = idx["weight_map"]
                .as_object()
                .with_context(|| format!("{} has no weight_map", index_path.display()))?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
            names.sort();
            names.dedup();
            names
        } else if single.exists() {
            vec!["model.safetensors".to_string()]
        } else {
            for p in PICKLE_NAMES {
                if dir.join(p).exists() {
                    bail!(pickle_message(dir, p));
                }
            }
            let mut any = vec![];
            for e in std::fs::read_dir(dir)? {
                let name = e?.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    any.push(name);
                } else if name.ends_with(".bin") || name.ends_with(".pt") || name.ends_with(".pth") {
                    bail!(pickle_message(dir, &name));
                }
            }
            if any.len() != 1 {
                bail!(
                    "{} has neither model.safetensors nor model.safetensors.index.json (found {:?})",
                    dir.display(),
                    any
                );
            }
            any
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for name in shard_names {
            let p = dir.join(&name);
            if !p.exists() {
                bail!("checkpoint shard {} listed in the index is missing", p.display());
            }
            let f = SafetensorsFile::open(&p)?;
            for t in f.tensors.keys() {
                index.insert(t.clone(), files.len());
            }
            files.push(f);
        }
        Ok(Self { dir: dir.to_path_buf(), config, config_json, files, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    /// Total bytes of tensor data in the checkpoint.
    pub fn data_bytes(&self) -> u64 {
        self.files.iter().flat_map(|f| f.tensors.values()).map(|e| e.end - e.start).sum()
    }

    /// The checkpoint's own dtype (that of its first floating-point tensor).
    pub fn stored_kind(&self) -> Option<Kind> {
        self.files.iter().flat_map(|f| f.tensors.values()).map(|e| e.kind).find(|k| is_float_kind(*k))
    }

    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        p.exists().then_some(p)
    }
}

impl WeightSource for HfCheckpoint {
    fn get(&mut self, name: &str, shape: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
        let Some(&i) = self.index.get(name) else {
            bail!("checkpoint {} is missing tensor {name}", self.dir.display());
        };
        let f = &self.files[i];
        let actual = &f.tensors[name].shape;
        if actual.as_slice() != shape {
            bail!(
                "tensor {name} in {} has shape {actual:?}, expected {shape:?} from config.json",
                f.path.display()
            );
        }
        let t = f.read(name)?;
        Ok(if t.kind() == kind && device == Device::Cpu { t } else { t.to_device(device).to_kind(kind) })
    }
}

/// Seeded random weights: N(0, std) for matrices, ones for norm weights, zeros for biases.
/// Generated directly on the target device (an 8B model appears in seconds on a GPU).
pub struct RandomWeights {
    pub std: f64,
}

impl WeightSource for RandomWeights {
    fn get(&mut self, name: &str, shape: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
        Ok(if name.ends_with("norm.weight") {
            Tensor::ones(shape, (kind, device))
        } else if name.ends_with(".bias") {
            Tensor::zeros(shape, (kind, device))
        } else {
            let mut t = Tensor::empty(shape, (kind, device));
            let _ = t.f_normal_(0.0, self.std)?;
            t
        })
    }
}

/// Options for writing a model folder.
pub struct SaveOptions<'a> {
    /// Shards are cut at this many bytes of tensor data (Hugging Face uses 5 GB).
    pub max_shard_bytes: u64,
    pub tokenizer: Option<&'a Path>,
    /// Replace an existing folder (the old one is removed only after the new one is complete).
    pub overwrite: bool,
    /// Stored dtype of floating-point tensors (`None`: as they are).
    pub dtype: Option<Kind>,
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        Self { max_shard_bytes: 5_000_000_000, tokenizer: None, overwrite: false, dtype: None }
    }
}

/// Is `kind` a floating-point dtype?
pub fn is_float_kind(kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Writes a Hugging Face folder: config, generation config, (sharded) safetensors with an index
/// when sharded, and the tokenizer. Everything goes to a temporary sibling folder first and is
/// renamed into place when complete, so a crash never leaves a half-written model behind.
pub fn save_hf_folder(dir: &Path, config: &ModelConfig, tensors: &[(String, Tensor)], opts: &SaveOptions) -> Result<()> {
    if dir.exists() && !opts.overwrite {
        bail!("output folder {} already exists; choose another path or pass --overwrite", dir.display());
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = safetensors::tmp_path(dir);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = write_folder_contents(&tmp, config, tensors, opts);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("writing model folder {}", dir.display())));
    }
    place_folder(&tmp, dir)
}

/// Renames the finished folder `tmp` to `out`. A folder already at `out` is moved aside first
/// and removed only once the new one is in place (moved back if that rename fails), so an
/// interrupted replacement never loses both.
pub fn place_folder(tmp: &Path, out: &Path) -> Result<()> {
    if out.exists() {
        let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "folder".into());
        let old = out.with_file_name(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(out, &old).with_context(|| format!("moving the old {} aside", out.display()))?;
        if let Err(e) = std::fs::rename(tmp, out) {
            let _ = std::fs::rename(&old, out);
            return Err(e).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()));
        }
        std::fs::remove_dir_all(&old).with_context(|| format!("removing the old {}", old.display()))?;
    } else {
        std::fs::rename(tmp, out).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    }
    Ok(())
}

fn write_folder_contents(dir: &Path, config: &ModelConfig, tensors: &[(String, Tensor)], opts: &SaveOptions) -> Result<()> {
    let store_kind = opts.dtype.or_else(|| tensors.iter().map(|(_, t)| t.kind()).find(|k| is_float_kind(*k)));
    let cast = |t: &Tensor| match opts.dtype {
        Some(k) if t.is_floating_point() && t.kind() != k => t.to_kind(k),
        _ => t.shallow_clone(),
    };
    // Cut shards by stored size.
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![vec![]];
    let mut size = 0u64;
    for (name, t) in tensors {
        let t = cast(t);
        let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        if size > 0 && size + bytes > opts.max_shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        size += bytes;
        shards.last_mut().unwrap().push((name.clone(), t));
    }
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
        safetensors::write(&dir.join(&file), shard, &meta)?;
        for (name, t) in shard {
            weight_map.insert(name.clone(), file.clone().into());
            total += (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        }
    }
    if n > 1 {
        let idx = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&idx)?)?;
    }
    let dtype = kind_name(store_kind.unwrap_or(Kind::Float));
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config.to_hf_json(dtype))?)?;
    let eos: Value = match config.eos_token_ids.as_slice() {
        [] => Value::Null,
        [one] => (*one).into(),
        many => many.to_vec().into(),
    };
    let gen = serde_json::json!({"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": config.pad_token_id});
    std::fs::write(dir.join("generation_config.json"), serde_json::to_string_pretty(&gen)?)?;
    if let Some(tok) = opts.tokenizer {
        std::fs::copy(tok, dir.join("tokenizer.json")).with_context(|| format!("copying {}", tok.display()))?;
    }
    Ok(())
}
