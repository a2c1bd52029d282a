//! TOML recipes: typed sections, every field overridable from the command line with
//! `--set section.field=value`, and the effective recipe written next to the outputs.
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use std::path::Path;

/// Reads a TOML file and applies `key.path=value` overrides (values parsed as TOML, falling
/// back to a string), then deserialises into `T` (unknown fields are errors).
pub fn load<T: DeserializeOwned>(path: &Path, overrides: &[String]) -> Result<(T, toml::Table)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read recipe {}", path.display()))?;
    let mut table: toml::Table = text.parse().with_context(|| format!("{} is not valid TOML", path.display()))?;
    for o in overrides {
        apply_override(&mut table, o)?;
    }
    let value: T = toml::Value::Table(table.clone())
        .try_into()
        .with_context(|| format!("recipe {} (with overrides {overrides:?}) is invalid", path.display()))?;
    Ok((value, table))
}

pub fn apply_override(table: &mut toml::Table, o: &str) -> Result<()> {
    let Some((key, raw)) = o.split_once('=') else {
        bail!("override {o:?} must look like section.field=value");
    };
    let value: toml::Value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let parts: Vec<&str> = key.trim().split('.').collect();
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        cur = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .with_context(|| format!("override {o:?}: {p} is not a table"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// Writes the effective recipe (after overrides) as `recipe.effective.toml` in `dir`, through a
/// temporary file (an interrupted write leaves the previous one).
pub fn write_effective(dir: &Path, table: &toml::Table) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    write_atomic(&dir.join("recipe.effective.toml"), toml::to_string_pretty(table)?.as_bytes())
}

/// Writes `path` through a temporary file next to it and a rename: readers see the old
/// content or the new, never a part.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let tmp = wide_core::safetensors::tmp_path(path);
    std::fs::write(&tmp, contents).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_values_and_create_tables() {
        let mut t: toml::Table = "[train]\nlr = 1.0\n".parse().unwrap();
        apply_override(&mut t, "train.lr=0.5").unwrap();
        apply_override(&mut t, "train.device=cuda").unwrap();
        apply_override(&mut t, "data.sources=[\"a\", \"b\"]").unwrap();
        assert_eq!(t["train"]["lr"].as_float(), Some(0.5));
        assert_eq!(t["train"]["device"].as_str(), Some("cuda"));
        assert_eq!(t["data"]["sources"].as_array().unwrap().len(), 2);
        assert!(apply_override(&mut t, "nonsense").is_err());
    }
}
