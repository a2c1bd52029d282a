//! `wide export`: a trained model as files other runtimes load. One folder holds
//!
//! - the Hugging Face model with any LoRA merged into the weights (`W += alpha/r * B A`):
//!   `config.json`, `generation_config.json`, (sharded) `model.safetensors`, `tokenizer.json`;
//! - `wide_routing.safetensors` (router weights, or `static_width` masks, under their Hugging
//!   Face-style names `model.layers.N.router_ffn.compressor.weight`, ...) and
//!   `wide_routing.json` (variant, group sizes, rank, inference logit offsets, targets, achieved
//!   skip rates, and the commit and recipe of the runs that produced them);
//! - `peft/`: the LoRA adapters unmerged, in PEFT's format (`adapter_config.json`,
//!   `adapter_model.safetensors`);
//! - `pruned/` (`static_width`, on request): the physically smaller model as a standard
//!   checkpoint, FFN channels and query heads removed.
//!
//! Every input is checked (names, shapes, model, group sizes) before anything is written; the
//! folder is written under a temporary name next to the target and renamed into place when
//! complete, so a failure (a full disk, a crash) never leaves a folder at the target path.
use crate::calibrate::{HeldOut, RoutedModel, RoutingManifest};
use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};
use wide_core::checkpoint::{kind_name, place_folder, save_hf_folder, HfCheckpoint, SaveOptions};
use wide_core::lora::Lora;
use wide_core::routing::{Routing, RoutingConfig, Variant};
use wide_core::safetensors::{self as st, SafetensorsFile};
use wide_core::{LlamaModel, ModelConfig};

/// The routing manifest of an export.
pub const ROUTING_JSON: &str = "wide_routing.json";
/// Router weights (or `static_width` masks) of an export.
pub const ROUTING_TENSORS: &str = "wide_routing.safetensors";
/// Subfolder with the LoRA adapters in PEFT's format.
pub const PEFT_DIR: &str = "peft";
/// Subfolder with the physically pruned `static_width` model.
pub const PRUNED_DIR: &str = "pruned";
/// Prefix PEFT gives adapter tensor names of a causal LM.
const PEFT_PREFIX: &str = "base_model.model.";
/// Tokenizer files copied next to `tokenizer.json` when the model folder has them.
const TOKENIZER_EXTRAS: [&str; 2] = ["tokenizer_config.json", "special_tokens_map.json"];

/// How the pruned `static_width` model treats the attention heads its masks skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadPruning {
    /// Remove them (`num_attention_heads` shrinks; needs the same kept count in every layer).
    Prune,
    /// Keep every head and zero the skipped heads' `o_proj` input columns (same result).
    Zero,
}

impl HeadPruning {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "prune" => HeadPruning::Prune,
            "zero" => HeadPruning::Zero,
            _ => bail!("unknown --pruned-heads {s:?}: use prune or zero"),
        })
    }
}

/// What to export and where.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    pub model_dir: PathBuf,
    /// A stage 1 or stage 2 folder (`routers.safetensors`, `routing.json`).
    pub routers: PathBuf,
    /// A stage 2 folder whose LoRA adapters to use; default: those of `routers`, if any.
    pub lora: Option<PathBuf>,
    pub out: PathBuf,
    /// `static_width` only: also write the physically pruned model to `out/pruned`.
    pub pruned: bool,
    pub pruned_heads: HeadPruning,
    /// Stored dtype of the model weights (default: that of `model_dir`).
    pub dtype: Option<Kind>,
    pub max_shard_bytes: u64,
    /// `base_model_name_or_path` of the PEFT adapter (default: `model_dir` as given).
    pub base_model: Option<String>,
    /// Replace an existing export at `out` (only once the new one is complete).
    pub overwrite: bool,
    /// Commit, version and command line of this export.
    pub provenance: Value,
}

/// What an export wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    pub out: PathBuf,
    pub variant: String,
    pub routed_tensors: usize,
    pub lora_modules: usize,
    pub pruned: Option<PrunedShape>,
    pub bytes: u64,
}

/// The shape of the physically pruned `static_width` model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrunedShape {
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub intermediate_size: i64,
    pub heads: HeadPruning,
    /// Some KV heads are written more than once, because layers keep different numbers of
    /// query heads per KV group (exact, but more KV heads than the original model).
    pub kv_heads_duplicated: bool,
    pub parameters: i64,
    pub dense_parameters: i64,
}

/// A routing manifest and the folder it came from.
struct Stage {
    dir: PathBuf,
    manifest: RoutingManifest,
}

fn read_stage(dir: &Path, flag: &str) -> Result<Stage> {
    if !dir.is_dir() {
        bail!("{flag} {} is not a folder: give a stage 1 or stage 2 output folder (from `wide calibrate` or `wide recover`)", dir.display());
    }
    let p = dir.join("routing.json");
    let text = std::fs::read_to_string(&p).with_context(|| {
        format!("{flag} {} has no routing.json: give a stage 1 or stage 2 output folder (from `wide calibrate` or `wide recover`)", dir.display())
    })?;
    let manifest: RoutingManifest = serde_json::from_str(&text).with_context(|| format!("{} is not a valid routing manifest", p.display()))?;
    Ok(Stage { dir: dir.to_path_buf(), manifest })
}

fn describe(c: &ModelConfig) -> String {
    format!(
        "{}: hidden {}, intermediate {}, {} layers, {}/{} heads of {}, vocab {}",
        c.family.model_type(),
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size
    )
}

/// Refuses a stage folder made for a model of another shape.
fn check_same_model(stage: &Stage, what: &str, model_dir: &Path, cfg: &ModelConfig) -> Result<()> {
    let a = &stage.manifest.model;
    let shape = |c: &ModelConfig| {
        (c.family, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    };
    if shape(a) != shape(cfg) {
        bail!(
            "{what} in {} were trained for another model ({}), not {} ({})",
            stage.dir.display(),
            describe(a),
            model_dir.display(),
            describe(cfg)
        );
    }
    Ok(())
}

/// Compares the tensors a file holds with the names and shapes expected; the error names the
/// first missing, mis-shaped or unexpected tensor.
fn check_tensor_set(file: &SafetensorsFile, expected: &[(String, Vec<i64>)], why: &str) -> Result<()> {
    let path = file.path.display();
    let missing: Vec<&String> = expected.iter().map(|(n, _)| n).filter(|n| !file.tensors.contains_key(*n)).collect();
    if let Some(first) = missing.first() {
        bail!("{path} lacks {} of the {} tensors expected (first: {first}): {why}", missing.len(), expected.len());
    }
    for (name, shape) in expected {
        let actual = &file.tensors[name].shape;
        if actual != shape {
            bail!("tensor {name} in {path} has shape {actual:?}, expected {shape:?}: {why}");
        }
    }
    let names: BTreeSet<&String> = expected.iter().map(|(n, _)| n).collect();
    if let Some(extra) = file.tensors.keys().find(|n| !names.contains(n)) {
        bail!("{path} holds tensor {extra}, which this routing configuration does not have: {why}");
    }
    Ok(())
}

fn shapes(v: &[(String, Tensor)]) -> Vec<(String, Vec<i64>)> {
    v.iter().map(|(n, t)| (n.clone(), t.size())).collect()
}

fn group_sizes(c: &RoutingConfig) -> String {
    format!("variant {}, attention group size {}, FFN group size {}", c.variant.name(), c.attn_group_size, c.ffn_group_size)
}

/// The routed model an export starts from: `model_dir` with the routers of `routers` and the
/// LoRA adapters of `lora` (or of `routers`), every tensor checked by name and shape.
pub struct ExportSources {
    pub model: RoutedModel,
    routers: Stage,
    lora: Option<Stage>,
    /// Dtype the checkpoint stores its weights in.
    pub stored_kind: Kind,
}

impl ExportSources {
    /// Loads and checks the sources onto the CPU in `kind` (`None`: the checkpoint's dtype).
    pub fn load(model_dir: &Path, routers: &Path, lora: Option<&Path>, kind: Option<Kind>) -> Result<Self> {
        let ckpt = HfCheckpoint::open(model_dir)?;
        let cfg = ckpt.config.clone();
        let stored_kind = ckpt.stored_kind().unwrap_or(Kind::Float);
        drop(ckpt);
        let routers = read_stage(routers, "--routers")?;
        check_same_model(&routers, "routers", model_dir, &cfg)?;
        let rc = &routers.manifest.routing;
        rc.validate(&cfg).with_context(|| format!("routing.json of {}", routers.dir.display()))?;
        let lora = match lora {
            Some(dir) => {
                let s = read_stage(dir, "--lora")?;
                if s.manifest.lora.is_none() {
                    bail!("--lora {} has no LoRA adapters (its routing.json lists none): give a stage 2 folder from `wide recover`", dir.display());
                }
                check_same_model(&s, "LoRA adapters", model_dir, &cfg)?;
                let lc = &s.manifest.routing;
                if (lc.variant, lc.attn_group_size, lc.ffn_group_size, lc.sparse_target) != (rc.variant, rc.attn_group_size, rc.ffn_group_size, rc.sparse_target) {
                    bail!(
                        "the LoRA adapters in {} were trained with routers of {}, but the routers in {} are {}: export adapters with routers of the kind they were trained with",
                        dir.display(),
                        group_sizes(lc),
                        routers.dir.display(),
                        group_sizes(rc)
                    );
                }
                Some(s)
            }
            None if routers.manifest.lora.is_some() => Some(Stage { dir: routers.dir.clone(), manifest: routers.manifest.clone() }),
            None => None,
        };

        // Names and shapes of every file, checked before the model is loaded.
        let expected = {
            let vs = nn::VarStore::new(Device::Cpu);
            let r = Routing::new(&vs.root(), &cfg, rc, Kind::Float)?;
            shapes(&r.tensors())
        };
        let rfile = SafetensorsFile::open(&routers.dir.join("routers.safetensors"))
            .with_context(|| format!("{} has no readable routers.safetensors (is it a stage 1 folder?)", routers.dir.display()))?;
        check_tensor_set(&rfile, &expected, &format!("the routers do not match their routing.json ({}) on this model", group_sizes(rc)))?;

        let kind = kind.unwrap_or(stored_kind);
        let mut model = RoutedModel::new(model_dir, rc, Device::Cpu, kind)?;
        model.routing.load_tensors(&mut |n| rfile.read(n))?;
        if let Some(s) = &lora {
            let lc = s.manifest.lora.clone().unwrap();
            model.attach_lora(&lc)?;
            let path = s.dir.join("lora.safetensors");
            let lfile = SafetensorsFile::open(&path)
                .with_context(|| format!("{} lists LoRA adapters but has no readable lora.safetensors", s.dir.display()))?;
            let want = shapes(&Lora::tensors(&mut model.pretrained.model));
            check_tensor_set(&lfile, &want, &format!("the LoRA file does not match its routing.json (rank {}, targets {:?})", lc.rank, lc.targets))?;
            Lora::load(&mut model.pretrained.model, &mut |n| lfile.read(n))?;
        }
        Ok(Self { model, routers, lora, stored_kind })
    }

    /// The LoRA adapters of the export (their folder's configuration), if any.
    pub fn lora_config(&self) -> Option<&wide_core::lora::LoraConfig> {
        self.lora.as_ref().and_then(|s| s.manifest.lora.as_ref())
    }
}

/// Runs an export; see the module documentation.
pub fn run(cfg: &ExportConfig) -> Result<ExportReport> {
    let _g = tch::no_grad_guard();
    check_out(&cfg.out, cfg.overwrite)?;
    let mut src = ExportSources::load(&cfg.model_dir, &cfg.routers, cfg.lora.as_deref(), cfg.dtype)?;
    let variant = src.model.routing.config.variant;
    if cfg.pruned && variant != Variant::StaticWidth {
        bail!(
            "--pruned writes a physically smaller model for static_width only: the routers of {} choose groups per token, so every weight is still needed",
            variant.name()
        );
    }
    let store_kind = cfg.dtype.unwrap_or(src.stored_kind);

    // Everything to write is built (and checked) in memory first.
    let adapters: Vec<(String, Tensor)> =
        Lora::tensors(&mut src.model.pretrained.model).into_iter().map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t.detach().to_kind(Kind::Float))).collect();
    Lora::merge(&mut src.model.pretrained.model);
    let model = &src.model.pretrained.model;
    let mut dense: Vec<(String, Tensor)> = src.model.pretrained.vs.variables().into_iter().collect();
    dense.sort_by(|a, b| a.0.cmp(&b.0));
    let routing_tensors: Vec<(String, Tensor)> = src.model.routing.tensors().into_iter().map(|(n, t)| (n, t.detach().to_kind(Kind::Float))).collect();
    let pruned = if cfg.pruned {
        let plan = plan_static_pruning(&model.config, &src.model.routing, cfg.pruned_heads)?;
        Some((plan.clone(), prune_tensors(model, &plan)?))
    } else {
        None
    };
    let manifest = routing_manifest(cfg, &src, store_kind, pruned.as_ref().map(|(p, _)| &p.shape))?;
    let tokenizer = cfg.model_dir.join("tokenizer.json");
    let tokenizer = tokenizer.exists().then_some(tokenizer);

    remove_stale_temporaries(&cfg.out)?;
    let tmp = st::tmp_path(&cfg.out);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing the stale temporary folder {}", tmp.display()))?;
    }
    let write = || -> Result<()> {
        let save = |dir: &Path, mc: &ModelConfig, tensors: &[(String, Tensor)]| -> Result<()> {
            let opts = SaveOptions { max_shard_bytes: cfg.max_shard_bytes, tokenizer: tokenizer.as_deref(), overwrite: false, dtype: Some(store_kind) };
            save_hf_folder(dir, mc, tensors, &opts)?;
            for f in TOKENIZER_EXTRAS {
                let p = cfg.model_dir.join(f);
                if p.exists() {
                    std::fs::copy(&p, dir.join(f)).with_context(|| format!("copying {}", p.display()))?;
                }
            }
            Ok(())
        };
        save(&tmp, &model.config, &dense)?;
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        meta.insert("wide".to_string(), ROUTING_JSON.to_string());
        st::write(&tmp.join(ROUTING_TENSORS), &routing_tensors, &meta)?;
        std::fs::write(tmp.join(ROUTING_JSON), serde_json::to_string_pretty(&manifest)?)?;
        if let Some(lc) = src.lora_config() {
            let dir = tmp.join(PEFT_DIR);
            std::fs::create_dir(&dir)?;
            st::write(&dir.join("adapter_model.safetensors"), &adapters, &meta)?;
            let base = cfg.base_model.clone().unwrap_or_else(|| cfg.model_dir.display().to_string());
            std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(&peft_config(lc, &base))?)?;
        }
        if let Some((plan, tensors)) = &pruned {
            save(&tmp.join(PRUNED_DIR), &plan.config, tensors)?;
        }
        verify_written(&tmp, &dense, &routing_tensors, &adapters, pruned.as_ref().map(|(_, t)| t.as_slice()))
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("exporting to {} failed (nothing was left there)", cfg.out.display())));
    }
    let bytes = folder_bytes(&tmp);
    place_folder(&tmp, &cfg.out)?;
    Ok(ExportReport {
        out: cfg.out.clone(),
        variant: variant.name().to_string(),
        routed_tensors: routing_tensors.len(),
        lora_modules: adapters.len() / 2,
        pruned: pruned.map(|(p, _)| p.shape),
        bytes,
    })
}

/// An existing `out` is refused unless `overwrite`, and even then only when it is an earlier
/// export (or empty), so that a mistyped path never replaces an unrelated folder.
fn check_out(out: &Path, overwrite: bool) -> Result<()> {
    if !out.exists() {
        return Ok(());
    }
    if !overwrite {
        bail!("output folder {} already exists; choose another path or pass --overwrite to replace it", out.display());
    }
    let empty = out.is_dir() && std::fs::read_dir(out)?.next().is_none();
    if !(out.is_dir() && (empty || out.join(ROUTING_JSON).exists())) {
        bail!("{} exists and is not a wide export (it has no {ROUTING_JSON}); --overwrite replaces only earlier exports", out.display());
    }
    Ok(())
}

/// Removes temporary folders that exports to `out` killed mid-way left next to it
/// (`.NAME.tmp-PID`, and `..NAME.tmp-PID.tmp-PID` of the model writer) when that process is gone.
fn remove_stale_temporaries(out: &Path) -> Result<()> {
    let (Some(parent), Some(name)) = (out.parent(), out.file_name()) else { return Ok(()) };
    let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
    let Ok(entries) = std::fs::read_dir(parent) else { return Ok(()) };
    let stem = format!("{}.tmp-", name.to_string_lossy());
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = n.trim_start_matches('.').strip_prefix(&stem) else { continue };
        if !n.starts_with('.') {
            continue;
        }
        let pids: Vec<&str> = rest.split(".tmp-").collect();
        if pids.len() > 2 || pids.iter().any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        if pids.iter().all(|p| !Path::new("/proc").join(p).exists()) {
            let p = e.path();
            let r = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            r.with_context(|| format!("removing {}, left by an interrupted export", p.display()))?;
        }
    }
    Ok(())
}


fn folder_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            n += if p.is_dir() { folder_bytes(&p) } else { e.metadata().map(|m| m.len()).unwrap_or(0) };
        }
    }
    n
}

/// Re-opens what was written and checks every tensor's name and shape.
fn verify_written(dir: &Path, dense: &[(String, Tensor)], routing: &[(String, Tensor)], adapters: &[(String, Tensor)], pruned: Option<&[(String, Tensor)]>) -> Result<()> {
    let check_model = |d: &Path, tensors: &[(String, Tensor)]| -> Result<()> {
        let ck = HfCheckpoint::open(d)?;
        let mut want = shapes(tensors);
        want.sort();
        let mut got: Vec<String> = ck.tensor_names().cloned().collect();
        got.sort();
        ensure!(got == want.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), "{} does not hold the tensors written", d.display());
        Ok(())
    };
    check_model(dir, dense)?;
    let f = SafetensorsFile::open(&dir.join(ROUTING_TENSORS))?;
    check_tensor_set(&f, &shapes(routing), "written incompletely")?;
    if !adapters.is_empty() {
        let f = SafetensorsFile::open(&dir.join(PEFT_DIR).join("adapter_model.safetensors"))?;
        check_tensor_set(&f, &shapes(adapters), "written incompletely")?;
    }
    if let Some(t) = pruned {
        check_model(&dir.join(PRUNED_DIR), t)?;
    }
    Ok(())
}

/// PEFT's `adapter_config.json` for the adapters.
pub fn peft_config(lc: &wide_core::lora::LoraConfig, base_model: &str) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lc.rank,
        "lora_alpha": lc.alpha,
        "lora_dropout": lc.dropout,
        "target_modules": lc.targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "revision": null,
    })
}

fn heldout_json(h: &Option<HeldOut>) -> Value {
    match h {
        Some(h) => json!({
            "split": h.split,
            "tokens": h.tokens,
            "loss": h.loss,
            "perplexity": h.perplexity,
            "skip_rate": h.sparsity.skip_rate,
            "skip_rate_per_layer": h.sparsity.per_layer,
            "flops_fraction": h.sparsity.flops_fraction,
            "flops_fraction_per_layer": h.sparsity.flops_fraction_per_layer,
        }),
        None => Value::Null,
    }
}

fn stage_json(s: &Stage) -> Value {
    let m = &s.manifest;
    json!({
        "dir": s.dir.display().to_string(),
        "stage": m.stage,
        "calibration_tokens": m.calibration_tokens,
        "commit": m.provenance.get("commit"),
        "provenance": m.provenance,
        "recipe": serde_json::to_value(&m.recipe).unwrap_or(Value::Null),
        "heldout": heldout_json(&m.heldout),
    })
}

/// `wide_routing.json`: everything another runtime needs to route like `wide`.
fn routing_manifest(cfg: &ExportConfig, src: &ExportSources, store_kind: Kind, pruned: Option<&PrunedShape>) -> Result<Value> {
    let rc = &src.model.routing.config;
    let mc = &src.model.model().config;
    let mut routers = serde_json::Map::new();
    for (kind, groups) in rc.routers(mc) {
        let (unit, size, input, acts) = match kind {
            wide_core::routing::RouterKind::Attention => (
                "query heads",
                if groups == 1 { mc.num_attention_heads } else { rc.attn_group_size },
                "residual stream entering the layer (input of input_layernorm)",
                if rc.variant == Variant::SublayerSkip { "whole attention output (after o_proj)" } else { "per-head attention output, before o_proj" },
            ),
            wide_core::routing::RouterKind::Ffn => (
                "intermediate channels",
                if groups == 1 { mc.intermediate_size } else { rc.ffn_group_size },
                "residual stream after attention (input of post_attention_layernorm)",
                if rc.variant == Variant::SublayerSkip { "whole MLP output (after down_proj)" } else { "silu(gate) * up, before down_proj" },
            ),
            wide_core::routing::RouterKind::Layer => (
                "layer",
                1,
                "residual stream entering the layer (input of input_layernorm)",
                "the layer's whole update of the residual stream",
            ),
        };
        routers.insert(
            kind.name().into(),
            json!({
                "module": kind.module(),
                "groups": groups,
                "group_unit": unit,
                "group_size": size,
                "logit_offset": rc.logit_offset(kind),
                "input": input,
                "mask_applies_to": acts,
            }),
        );
    }
    let static_groups: Value = if rc.variant == Variant::StaticWidth {
        let kept = |m: &Option<Tensor>| -> Value {
            m.as_ref().map(|m| json!(Vec::<f32>::try_from(m.to_kind(Kind::Float)).unwrap_or_default().iter().enumerate().filter(|(_, v)| **v > 0.5).map(|(i, _)| i).collect::<Vec<_>>())).unwrap_or(Value::Null)
        };
        Value::Array(src.model.routing.layers.iter().map(|l| json!({"attention": kept(&l.static_attention), "ffn": kept(&l.static_ffn)})).collect())
    } else {
        Value::Null
    };
    let lora = src.lora_config().map(|lc| {
        json!({"rank": lc.rank, "alpha": lc.alpha, "dropout": lc.dropout, "targets": lc.targets, "scale": lc.scale(),
               "merged_into_weights": true, "peft_folder": PEFT_DIR})
    });
    let same_dir = src.lora.as_ref().is_none_or(|l| l.dir == src.routers.dir);
    Ok(json!({
        "format": "wide-routing",
        "format_version": 1,
        "variant": rc.variant.name(),
        "model": {
            "architecture": mc.family.architecture(),
            "model_type": mc.family.model_type(),
            "hidden_size": mc.hidden_size,
            "intermediate_size": mc.intermediate_size,
            "num_hidden_layers": mc.num_hidden_layers,
            "num_attention_heads": mc.num_attention_heads,
            "num_key_value_heads": mc.num_key_value_heads,
            "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size,
            "dtype": kind_name(store_kind),
        },
        "attn_group_size": rc.attn_group_size,
        "ffn_group_size": rc.ffn_group_size,
        "router_rank": rc.router_rank,
        "sparse_target": rc.sparse_target,
        "router_shape": "Linear(hidden -> rank, bias) then Linear(rank -> 2 x groups, bias); output viewed as [batch, seq, groups, 2] = (execute, skip) logits",
        "gate": "deterministic: a group executes iff logit_skip - logit_execute + logit_offset <= 0; K and V are always computed",
        "routers": routers,
        "logit_offsets": {"attention": rc.attn_logit_offset, "ffn": rc.ffn_logit_offset, "layer": rc.layer_logit_offset},
        "static_groups": static_groups,
        "targets": {"target_sparsity": rc.target_sparsity, "attn_target": rc.attn_target, "ffn_target": rc.ffn_target, "lambda": rc.lambda},
        "achieved": {
            "measured_in": src.routers.dir.display().to_string(),
            "with_exported_lora": same_dir,
            "heldout": heldout_json(&src.routers.manifest.heldout),
        },
        "tensor_names": "model.layers.{i}.{module}.compressor.weight [rank, hidden], .compressor.bias [rank], .router.weight [2 x groups, rank], .router.bias [2 x groups]; static_width: model.layers.{i}.static_attention.mask / static_ffn.mask [groups] (1 = execute)",
        "lora": lora,
        "pruned": pruned.map(|p| json!({"folder": PRUNED_DIR, "shape": p})),
        "sources": {"routers": stage_json(&src.routers), "lora": src.lora.as_ref().map(stage_json)},
        "export": {
            "model_dir": cfg.model_dir.display().to_string(),
            "dtype": kind_name(store_kind),
            "provenance": cfg.provenance,
        },
    }))
}

/// Which rows and columns the pruned model keeps, per layer.
#[derive(Debug, Clone)]
pub struct PrunePlan {
    pub config: ModelConfig,
    pub shape: PrunedShape,
    /// Per layer: kept query heads (ascending).
    pub heads: Vec<Vec<i64>>,
    /// Per layer: the original KV head behind each KV head of the pruned model.
    pub kv_heads: Vec<Vec<i64>>,
    /// Per layer: query heads whose `o_proj` columns are zeroed ([`HeadPruning::Zero`]).
    pub zeroed_heads: Vec<Vec<i64>>,
    /// Per layer: kept intermediate channels (ascending).
    pub channels: Vec<Vec<i64>>,
}

/// Units (heads or channels) of the groups a `static_width` mask keeps.
fn kept_units(mask: &Tensor, units: i64) -> Vec<i64> {
    let m = Vec::<f32>::try_from(mask.to_kind(Kind::Float).to_device(Device::Cpu)).unwrap_or_default();
    let per = units / m.len().max(1) as i64;
    m.iter().enumerate().filter(|(_, v)| **v > 0.5).flat_map(|(g, _)| (g as i64 * per)..((g as i64 + 1) * per)).collect()
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Plans the physically pruned form of a `static_width` model. FFN channels: Llama-family
/// configs have one `intermediate_size`, so every layer must keep as many channels (which
/// `static_width` calibration does: the same share per layer). Query heads
/// ([`HeadPruning::Prune`]): one `num_attention_heads` for every layer likewise, and query head
/// `j` reads KV head `j / (heads / kv_heads)`; a layer's kept heads are listed in order and each
/// run of `r` heads of one original KV group gets a copy of that KV head, with `r` the largest
/// number dividing every layer's kept count per KV group, so the grouping is valid in every
/// layer (exact; when layers keep different counts per group some KV heads are written twice).
pub fn plan_static_pruning(cfg: &ModelConfig, routing: &Routing, heads: HeadPruning) -> Result<PrunePlan> {
    ensure!(routing.config.variant == Variant::StaticWidth, "only static_width masks can be pruned physically");
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let n = cfg.num_hidden_layers as usize;
    let all_heads: Vec<i64> = (0..nh).collect();
    let mut kept_heads = vec![];
    let mut channels = vec![];
    for l in &routing.layers {
        kept_heads.push(l.static_attention.as_ref().map(|m| kept_units(m, nh)).unwrap_or_else(|| all_heads.clone()));
        channels.push(l.static_ffn.as_ref().map(|m| kept_units(m, cfg.intermediate_size)).unwrap_or_else(|| (0..cfg.intermediate_size).collect()));
    }
    let equal = |v: &Vec<Vec<i64>>, what: &str, field: &str, hint: &str| -> Result<i64> {
        let first = v[0].len();
        if let Some((i, c)) = v.iter().enumerate().find(|(_, c)| c.len() != first) {
            bail!(
                "static_width keeps {first} {what} in layer 0 but {} in layer {i}: a Llama-family config has one {field} for every layer, so this model cannot be written physically pruned{hint}",
                c.len()
            );
        }
        ensure!(first > 0, "static_width keeps no {what} in layer 0; nothing to export");
        Ok(first as i64)
    };
    let intermediate = equal(&channels, "FFN channels", "intermediate_size", "")?;
    let g = nh / nkv;
    let (heads_kept, kv_heads, zeroed, new_nh, new_nkv) = match heads {
        HeadPruning::Zero => {
            let zeroed = kept_heads.iter().map(|k| all_heads.iter().copied().filter(|h| !k.contains(h)).collect()).collect();
            (vec![all_heads.clone(); n], vec![(0..nkv).collect::<Vec<_>>(); n], zeroed, nh, nkv)
        }
        HeadPruning::Prune => {
            let new_nh = equal(&kept_heads, "query heads", "num_attention_heads", " (--pruned-heads zero keeps every head and zeroes the skipped heads' o_proj columns instead)")?;
            let counts: Vec<Vec<i64>> = kept_heads.iter().map(|k| (0..nkv).map(|j| k.iter().filter(|h| **h / g == j).count() as i64).collect()).collect();
            let r = counts.iter().flatten().filter(|c| **c > 0).fold(0, |a, c| gcd(a, *c));
            let kv: Vec<Vec<i64>> = counts.iter().map(|c| c.iter().enumerate().flat_map(|(j, c)| std::iter::repeat_n(j as i64, (c / r) as usize)).collect()).collect();
            (kept_heads.clone(), kv, vec![vec![]; n], new_nh, new_nh / r)
        }
    };
    let mut config = cfg.clone();
    config.num_attention_heads = new_nh;
    config.num_key_value_heads = new_nkv;
    config.intermediate_size = intermediate;
    config.validate()?;
    let shape = PrunedShape {
        num_attention_heads: new_nh,
        num_key_value_heads: new_nkv,
        intermediate_size: intermediate,
        heads,
        kv_heads_duplicated: kv_heads.iter().any(|k| {
            let mut s = k.clone();
            s.dedup();
            s.len() != k.len()
        }),
        parameters: config.parameter_count(),
        dense_parameters: cfg.parameter_count(),
    };
    Ok(PrunePlan { config, shape, heads: heads_kept, kv_heads, zeroed_heads: zeroed, channels })
}

/// Row indices of whole heads: `[h * head_dim, (h + 1) * head_dim)` for each `h`.
fn head_rows(heads: &[i64], head_dim: i64) -> Tensor {
    let v: Vec<i64> = heads.iter().flat_map(|h| (h * head_dim)..((h + 1) * head_dim)).collect();
    Tensor::from_slice(&v)
}

/// The pruned model's tensors (Hugging Face names), cut from `model`'s weights by `plan`.
pub fn prune_tensors(model: &LlamaModel, plan: &PrunePlan) -> Result<Vec<(String, Tensor)>> {
    let hd = model.config.head_dim;
    let mut out = vec![("model.embed_tokens.weight".to_string(), model.embed_tokens.shallow_clone()), ("model.norm.weight".to_string(), model.norm.weight.shallow_clone())];
    if !model.config.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), model.lm_head.shallow_clone()));
    }
    for (i, l) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let (a, f) = (&l.self_attn, &l.mlp);
        let q = head_rows(&plan.heads[i], hd);
        let kv = head_rows(&plan.kv_heads[i], hd);
        let ch = Tensor::from_slice(&plan.channels[i]);
        let mut push = |name: &str, t: Tensor| out.push((format!("{p}.{name}"), t));
        push("input_layernorm.weight", l.input_layernorm.weight.shallow_clone());
        push("post_attention_layernorm.weight", l.post_attention_layernorm.weight.shallow_clone());
        for (name, lin, rows) in [("q_proj", &a.q_proj, &q), ("k_proj", &a.k_proj, &kv), ("v_proj", &a.v_proj, &kv)] {
            ensure!(lin.lora.is_none(), "merge LoRA before pruning");
            push(&format!("self_attn.{name}.weight"), lin.weight.index_select(0, rows));
            if let Some(b) = &lin.bias {
                push(&format!("self_attn.{name}.bias"), b.index_select(0, rows));
            }
        }
        let mut o = a.o_proj.weight.index_select(1, &q);
        if !plan.zeroed_heads[i].is_empty() {
            o = o.index_fill(1, &head_rows(&plan.zeroed_heads[i], hd), 0.0);
        }
        push("self_attn.o_proj.weight", o);
        if let Some(b) = &a.o_proj.bias {
            push("self_attn.o_proj.bias", b.shallow_clone());
        }
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            push("self_attn.q_norm.weight", qn.weight.shallow_clone());
            push("self_attn.k_norm.weight", kn.weight.shallow_clone());
        }
        for (name, lin) in [("gate_proj", &f.gate_proj), ("up_proj", &f.up_proj)] {
            push(&format!("mlp.{name}.weight"), lin.weight.index_select(0, &ch));
            if let Some(b) = &lin.bias {
                push(&format!("mlp.{name}.bias"), b.index_select(0, &ch));
            }
        }
        push("mlp.down_proj.weight", f.down_proj.weight.index_select(1, &ch));
        if let Some(b) = &f.down_proj.bias {
            push("mlp.down_proj.bias", b.shallow_clone());
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// `5GB`, `500MB`, `2MiB`, `1000000` -> bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| anyhow::anyhow!("bad size {s:?}: use bytes or a number with KB, MB, GB (or KiB, MiB, GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("bad size {s:?}: use bytes or a number with KB, MB, GB (or KiB, MiB, GiB)"),
    };
    let b = (v * mult).round();
    ensure!(b >= 1.0, "size {s:?} must be positive");
    Ok(b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use wide_core::routing::{GateMode, RoutingRun};
    use wide_core::{presets, ForwardOptions, Pretrained, RandomWeights};

    fn tiny() -> (ModelConfig, nn::VarStore, LlamaModel) {
        let mut cfg = presets::preset("tiny").unwrap();
        // Biases everywhere, so that pruning them is tested too.
        cfg.qkv_bias = true;
        cfg.o_bias = true;
        cfg.mlp_bias = true;
        cfg.num_attention_heads = 8;
        cfg.num_key_value_heads = 4;
        cfg.head_dim = 16;
        let vs = nn::VarStore::new(Device::Cpu);
        let m = LlamaModel::new(&vs.root(), &cfg, &mut RandomWeights { std: 0.1 }, Kind::Float, false).unwrap();
        (cfg, vs, m)
    }

    fn static_routing(cfg: &ModelConfig, attn: &[&[f32]], ffn: &[&[f32]], attn_group: i64) -> Routing {
        let mut rc = RoutingConfig::new(Variant::StaticWidth);
        rc.target_sparsity = Some(0.5);
        rc.attn_group_size = attn_group;
        rc.ffn_group_size = cfg.intermediate_size / ffn[0].len() as i64;
        let vs = nn::VarStore::new(Device::Cpu);
        let r = Routing::new(&vs.root(), cfg, &rc, Kind::Float).unwrap();
        for (i, l) in r.layers.iter().enumerate() {
            l.static_attention.as_ref().unwrap().detach().copy_(&Tensor::from_slice(attn[i]));
            l.static_ffn.as_ref().unwrap().detach().copy_(&Tensor::from_slice(ffn[i]));
        }
        r
    }

    /// Logits of the static_width model (masks on the dense weights) and of the pruned model
    /// written and read back as a Hugging Face folder.
    fn masked_and_pruned(cfg: &ModelConfig, model: &LlamaModel, routing: &Routing, heads: HeadPruning) -> (Tensor, Tensor, PrunePlan) {
        let _g = tch::no_grad_guard();
        let ids = Tensor::randint(250, [2, 11], (Kind::Int64, Device::Cpu));
        let mut run = RoutingRun::new(routing, GateMode::Inference, Tensor::ones([2, 11], (Kind::Float, Device::Cpu)));
        let masked = model.forward_routed(&ids, ForwardOptions::default(), &mut run).unwrap();
        let plan = plan_static_pruning(cfg, routing, heads).unwrap();
        let tensors = prune_tensors(model, &plan).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m");
        save_hf_folder(&p, &plan.config, &tensors, &SaveOptions::default()).unwrap();
        let pruned = Pretrained::load(&p, Device::Cpu, Kind::Float).unwrap();
        let logits = pruned.model.forward(&ids, ForwardOptions::default()).unwrap();
        (masked, logits, plan)
    }

    fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn pruned_model_equals_masked_model_with_regrouped_kv_heads() {
        let _rng = crate::rng_lock(); // the global generator, one test at a time
        tch::manual_seed(3);
        let (cfg, _vs, model) = tiny();
        // 8 heads over 4 KV heads (2 each), attention groups of 2 heads. Layer 0 keeps both
        // heads of KV groups 0 and 2; layer 1 keeps both heads of KV groups 1 and 3: r = 2.
        let r = static_routing(&cfg, &[&[1., 0., 1., 0.], &[0., 1., 0., 1.]], &[&[1., 0., 0., 1.], &[0., 1., 1., 0.]], 2);
        let (masked, pruned, plan) = masked_and_pruned(&cfg, &model, &r, HeadPruning::Prune);
        assert_eq!((plan.config.num_attention_heads, plan.config.num_key_value_heads, plan.config.intermediate_size), (4, 2, 192));
        assert_eq!(plan.kv_heads, vec![vec![0, 2], vec![1, 3]]);
        assert!(!plan.shape.kv_heads_duplicated);
        assert!(plan.shape.parameters < plan.shape.dense_parameters);
        let d = max_abs(&masked, &pruned);
        assert!(d < 1e-5, "pruned vs masked: {d}");
    }

    #[test]
    fn uneven_heads_per_kv_group_duplicate_kv_heads_and_stay_exact() {
        let _rng = crate::rng_lock(); // the global generator, one test at a time
        tch::manual_seed(4);
        let (cfg, _vs, model) = tiny();
        // Attention groups of 1 head. Layer 0 keeps heads 0, 1 (both of KV group 0) and 4, 5;
        // layer 1 keeps 0, 2, 4, 6 (one per KV group): r = 1, so layer 0 duplicates KV heads.
        let a0: &[f32] = &[1., 1., 0., 0., 1., 1., 0., 0.];
        let a1: &[f32] = &[1., 0., 1., 0., 1., 0., 1., 0.];
        let r = static_routing(&cfg, &[a0, a1], &[&[1., 1., 0., 0., 1., 0.], &[0., 1., 1., 0., 0., 1.]], 1);
        let (masked, pruned, plan) = masked_and_pruned(&cfg, &model, &r, HeadPruning::Prune);
        assert_eq!((plan.config.num_attention_heads, plan.config.num_key_value_heads), (4, 4));
        assert_eq!(plan.kv_heads[0], vec![0, 0, 2, 2]);
        assert!(plan.shape.kv_heads_duplicated);
        let d = max_abs(&masked, &pruned);
        assert!(d < 1e-5, "pruned vs masked: {d}");
    }

    #[test]
    fn different_head_counts_per_layer_need_zeroed_heads() {
        let _rng = crate::rng_lock(); // the global generator, one test at a time
        tch::manual_seed(5);
        let (cfg, _vs, model) = tiny();
        let r = static_routing(&cfg, &[&[1., 1., 1., 0.], &[1., 0., 0., 0.]], &[&[1., 1., 0.], &[0., 1., 1.]], 2);
        let e = format!("{:#}", plan_static_pruning(&cfg, &r, HeadPruning::Prune).unwrap_err());
        assert!(e.contains("keeps 6 query heads in layer 0 but 2 in layer 1") && e.contains("--pruned-heads zero"), "{e}");
        let (masked, pruned, plan) = masked_and_pruned(&cfg, &model, &r, HeadPruning::Zero);
        assert_eq!((plan.config.num_attention_heads, plan.config.intermediate_size), (8, 256));
        let d = max_abs(&masked, &pruned);
        assert!(d < 1e-5, "zeroed heads vs masked: {d}");
        let r = static_routing(&cfg, &[&[1., 1., 1., 1.], &[1., 1., 1., 1.]], &[&[1., 1., 0.], &[0., 0., 1.]], 2);
        let e = format!("{:#}", plan_static_pruning(&cfg, &r, HeadPruning::Zero).unwrap_err());
        assert!(e.contains("keeps 256 FFN channels in layer 0 but 128 in layer 1") && e.contains("one intermediate_size"), "{e}");
    }

    #[test]
    fn peft_config_and_sizes() {
        let c = peft_config(&wide_core::lora::LoraConfig::default(), "base");
        assert_eq!(c["peft_type"], "LORA");
        assert_eq!(c["r"], 16);
        assert_eq!(c["lora_alpha"], 32.0);
        assert_eq!(c["target_modules"].as_array().unwrap().len(), 7);
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 * 1024 * 1024);
        assert_eq!(parse_size("1500").unwrap(), 1500);
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(HeadPruning::parse("zero").unwrap(), HeadPruning::Zero);
        assert!(HeadPruning::parse("half").is_err());
    }
}
