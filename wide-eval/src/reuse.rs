//! When `wide compare` and `wide sweep` may take a result they find in their output folder
//! instead of computing it again: only when it was made by the same effective recipe on the same
//! model. A folder that holds another recipe's calibration is an error (recalibrating there would
//! overwrite it); a cached evaluation of another recipe, split or model is computed again.
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use wide_train::calibrate::RoutingManifest;

/// What identifies a model folder's weights without reading them: name, size and modification
/// time of `config.json` and of every `*.safetensors` file. A model trained again in the same
/// folder (or replaced) changes it; moving the folder elsewhere does too (conservative).
pub fn model_identity(dir: &Path) -> Result<Value> {
    let mut files = vec![];
    for e in std::fs::read_dir(dir).with_context(|| format!("reading the model folder {}", dir.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "config.json" || name.ends_with(".safetensors") {
            let md = e.metadata()?;
            let modified = md.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs());
            files.push(json!([name, md.len(), modified]));
        }
    }
    files.sort_by_key(|f| f[0].as_str().unwrap_or_default().to_string());
    Ok(Value::Array(files))
}

/// Dotted names of the entries in which two recipe tables differ, ignoring `output.dir` (a
/// folder's own name may be written differently, relative or absolute).
pub fn table_diff(a: &toml::Table, b: &toml::Table) -> Vec<String> {
    fn walk(prefix: &str, a: Option<&toml::Value>, b: Option<&toml::Value>, out: &mut Vec<String>) {
        if prefix == "output.dir" {
            return;
        }
        match (a, b) {
            (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let name = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&name, x.get(k), y.get(k), out);
                }
            }
            (x, y) if x == y => {}
            _ => out.push(prefix.to_string()),
        }
    }
    let mut out = vec![];
    walk("", Some(&toml::Value::Table(a.clone())), Some(&toml::Value::Table(b.clone())), &mut out);
    out
}

/// The finished calibration in `dir` if it was made by `table` (stage `stage`) on the model of
/// identity `model`; `None` if `dir` holds no finished calibration. An error if it holds one of
/// another recipe, stage or model: the message names what differs.
pub fn finished_calibration(dir: &Path, table: &toml::Table, stage: u32, model: &Value) -> Result<Option<RoutingManifest>> {
    let path = dir.join("routing.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let m: RoutingManifest = serde_json::from_str(&text).with_context(|| format!("{} is not a routing manifest; remove the folder or use another --out", path.display()))?;
    let mut differs = table_diff(&m.recipe, table);
    if m.stage != stage {
        differs.push(format!("stage ({} there, {stage} here)", m.stage));
    }
    // Manifests written before the model's identity was recorded carry none: taken as matching.
    if m.provenance.get("model").is_some_and(|v| v != model) {
        differs.push("the model's weights (trained again or replaced since)".into());
    }
    if !differs.is_empty() {
        bail!(
            "{} holds a calibration of another run (differs in: {}); use a new --out or remove that folder to calibrate again",
            dir.display(),
            differs.join(", ")
        );
    }
    Ok(Some(m))
}

/// Calibrates the recipe at `path` (with `overrides`, which must set `output.dir` to `dir`;
/// stage 2 starts from the stage 1 folder `stage1`) into `dir`, or loads the finished
/// calibration there when it is this run's ([`finished_calibration`]; another run's is an
/// error). `label` names it in progress lines; `provenance` is recorded with the model's identity.
pub fn calibrate_or_load(path: &Path, overrides: &[String], stage: u32, stage1: Option<&Path>, dir: &Path, model: &Value, provenance: Value, label: &str) -> Result<()> {
    use wide_train::calibrate::{self, CalibrationRecipe};
    let (mut recipe, table) = CalibrationRecipe::load_shared_target(path, overrides)?;
    if stage == 2 {
        let s1 = stage1.context("stage 2 needs its stage 1 folder")?;
        if !s1.join("routing.json").exists() {
            bail!("stage 1 of {label} ({}) has no result", s1.display());
        }
        recipe.stage1_dir = Some(s1.to_path_buf());
        recipe.lora.get_or_insert_with(Default::default);
    }
    if finished_calibration(dir, &table, stage, model)?.is_some() {
        eprintln!("== {label}: already calibrated in {}, loading", dir.display());
        return Ok(());
    }
    let tokens = recipe.train.tokens.div_ceil(recipe.data.seq_len as u64) * recipe.data.seq_len as u64;
    eprintln!("== {label}: stage {stage}, {tokens} calibration tokens");
    let resume = wide_train::trainer::latest_checkpoint(dir).is_some();
    let mut provenance = provenance;
    if let Some(o) = provenance.as_object_mut() {
        o.insert("model".into(), model.clone());
    }
    match calibrate::run(&recipe, &table, resume, provenance)? {
        Some(_) => Ok(()),
        None => bail!("calibration of {label} was interrupted; rerun the same command to continue"),
    }
}

/// A cached evaluation result: the JSON at `path` if it records exactly `key` (recipe, split,
/// model: whatever the value depends on), else `compute()`'s value, written there with `key`.
pub fn cached_value(path: &Path, key: &Value, what: &str, compute: impl FnOnce() -> Result<Value>) -> Result<Value> {
    if let Some(v) = std::fs::read_to_string(path).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()).filter(|v| v.get("key") == Some(key)) {
        if let Some(x) = v.get(what) {
            return Ok(x.clone());
        }
    }
    let x = compute()?;
    crate::report::write_json(path, &json!({"key": key, what: x}))?;
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(s: &str) -> toml::Table {
        s.parse().unwrap()
    }

    #[test]
    fn tables_differ_by_dotted_key_except_the_output_folder() {
        let a = table("model_dir = \"m\"\n[routing]\nffn_group_size = 32\n[output]\ndir = \"a\"\n");
        let b = table("model_dir = \"m\"\n[routing]\nffn_group_size = 64\nrank = 8\n[output]\ndir = \"b\"\n");
        assert_eq!(table_diff(&a, &b), vec!["routing.ffn_group_size", "routing.rank"]);
        assert!(table_diff(&a, &a).is_empty());
        assert!(table_diff(&a, &table("model_dir = \"m\"\n[routing]\nffn_group_size = 32\n[output]\ndir = \"elsewhere\"\n")).is_empty());
    }

    #[test]
    fn model_identity_changes_when_weights_are_rewritten() {
        let dir = std::env::temp_dir().join(format!("wide-reuse-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join("model.safetensors"), [0u8; 8]).unwrap();
        std::fs::write(dir.join("notes.txt"), "ignored").unwrap();
        let a = model_identity(&dir).unwrap();
        assert_eq!(a.as_array().unwrap().len(), 2);
        assert_eq!(a, model_identity(&dir).unwrap());
        std::fs::write(dir.join("model.safetensors"), [0u8; 16]).unwrap();
        assert_ne!(a, model_identity(&dir).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        assert!(model_identity(&dir).unwrap_err().to_string().contains("reading the model folder"));
    }

    #[test]
    fn cached_values_are_taken_only_under_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dense.json");
        let calls = std::cell::Cell::new(0);
        let f = || {
            calls.set(calls.get() + 1);
            Ok(json!({"loss": calls.get()}))
        };
        assert_eq!(cached_value(&p, &json!({"split": "test"}), "dense", f).unwrap(), json!({"loss": 1}));
        assert_eq!(cached_value(&p, &json!({"split": "test"}), "dense", f).unwrap(), json!({"loss": 1}));
        assert_eq!(cached_value(&p, &json!({"split": "validation"}), "dense", f).unwrap(), json!({"loss": 2}));
        assert_eq!(calls.get(), 2);
    }
}
