//! `wide sweep`: a grid over attention group size x FFN group size x sparsity (and stage 1 /
//! stage 2) of the `wide` variant, from a TOML file. Resumable: a cell with a result is
//! skipped; a failing cell is recorded and the rest go on. Writes a table (Markdown, CSV,
//! JSON) and one heatmap PNG per sparsity and stage.
use crate::report::{write_json, Provenance};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use wide_core::routing::Variant;
use wide_core::{parse_device, parse_dtype};
use wide_train::calibrate::{self, evaluate_routed, CalibrationRecipe, RoutedModel};
use wide_train::corpus::Split;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    pub name: String,
    /// The stage 1 recipe shared by every cell.
    pub recipe: PathBuf,
    /// Stage 2 recipe, used when `stages` contains 2.
    #[serde(default)]
    pub stage2_recipe: Option<PathBuf>,
    pub out: PathBuf,
    pub attn_group_sizes: Vec<i64>,
    pub ffn_group_sizes: Vec<i64>,
    pub sparsities: Vec<f64>,
    #[serde(default = "d_stages")]
    pub stages: Vec<u32>,
    #[serde(default = "d_split")]
    pub split: String,
    /// Extra `section.field=value` overrides for the recipes.
    #[serde(default)]
    pub overrides: Vec<String>,
}
fn d_stages() -> Vec<u32> {
    vec![1]
}
fn d_split() -> String {
    "test".into()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub attn_group_size: i64,
    pub ffn_group_size: i64,
    pub sparsity: f64,
    pub stage: u32,
    pub eval_loss: Option<f64>,
    pub delta_loss: Option<f64>,
    pub skip_attention: Option<f64>,
    pub skip_ffn: Option<f64>,
    pub flops_fraction: Option<f64>,
    pub error: Option<String>,
}

fn cell_dir(cfg: &SweepConfig, a: i64, f: i64, s: f64, stage: u32) -> PathBuf {
    cfg.out.join(format!("a{a}-f{f}-s{s}{}", if stage == 2 { "-lora" } else { "" }))
}

fn run_cell(cfg: &SweepConfig, a: i64, f: i64, s: f64, stage: u32, dense_loss: f64, commit: &str) -> Result<Cell> {
    let dir = cell_dir(cfg, a, f, s, stage);
    let mut ov = cfg.overrides.clone();
    ov.extend([
        "routing.variant=\"wide\"".to_string(),
        format!("routing.attn_group_size={a}"),
        format!("routing.ffn_group_size={f}"),
        format!("routing.target_sparsity={s}"),
        format!("output.dir=\"{}\"", dir.display()),
    ]);
    let path = if stage == 2 { cfg.stage2_recipe.as_ref().context("stages include 2 but no stage2_recipe is given")? } else { &cfg.recipe };
    let (mut recipe, table) = CalibrationRecipe::load_shared_target(path, &ov)?;
    if stage == 2 {
        let s1 = cell_dir(cfg, a, f, s, 1);
        if !s1.join("routing.json").exists() {
            bail!("stage 1 of this cell ({}) has no result", s1.display());
        }
        recipe.stage1_dir = Some(s1);
        recipe.lora.get_or_insert_with(Default::default);
    }
    let resume = wide_train::trainer::latest_checkpoint(&dir).is_some();
    if calibrate::run(&recipe, &table, resume, serde_json::json!({"commit": commit, "command": "wide sweep"}))?.is_none() {
        bail!("interrupted");
    }
    let device = parse_device(&recipe.train.device)?;
    let kind = parse_dtype(&recipe.train.dtype, device)?;
    let m = RoutedModel::load(&recipe.model_dir, &dir, device, kind)?;
    let files = recipe.data.prepare()?;
    let h = evaluate_routed(&m, &files.open(Split::parse(&cfg.split)?)?, recipe.data.seq_len, recipe.train.micro_batch, 0)?;
    Ok(Cell {
        attn_group_size: a,
        ffn_group_size: f,
        sparsity: s,
        stage,
        eval_loss: Some(h.loss),
        delta_loss: Some(h.loss - dense_loss),
        skip_attention: h.sparsity.skip_rate.get("attention").copied(),
        skip_ffn: h.sparsity.skip_rate.get("ffn").copied(),
        flops_fraction: Some(h.sparsity.flops_fraction),
        error: None,
    })
}

pub fn run(cfg: &SweepConfig, commit: &str) -> Result<Vec<Cell>> {
    if cfg.attn_group_sizes.is_empty() || cfg.ffn_group_sizes.is_empty() || cfg.sparsities.is_empty() {
        bail!("the sweep grid is empty: give attn_group_sizes, ffn_group_sizes and sparsities");
    }
    for s in &cfg.sparsities {
        wide_core::routing::check_sparsity(*s)?;
    }
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    // Dense reference on the same split (cached).
    let dense_path = cfg.out.join("dense.json");
    let dense_loss = match std::fs::read_to_string(&dense_path).ok().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()).and_then(|v| v["eval_loss"].as_f64()) {
        Some(l) => l,
        None => {
            let (recipe, _) = CalibrationRecipe::load(&cfg.recipe, &cfg.overrides)?;
            let device = parse_device(&recipe.train.device)?;
            let kind = parse_dtype(&recipe.train.dtype, device)?;
            let mut rc = recipe.routing.clone();
            rc.variant = Variant::Dense;
            let m = RoutedModel::new(&recipe.model_dir, &rc, device, kind)?;
            let files = recipe.data.prepare()?;
            let h = evaluate_routed(&m, &files.open(Split::parse(&cfg.split)?)?, recipe.data.seq_len, recipe.train.micro_batch, 0)?;
            write_json(&dense_path, &serde_json::json!({"eval_loss": h.loss, "perplexity": h.perplexity}))?;
            h.loss
        }
    };
    let mut cells = vec![];
    for &stage in &cfg.stages {
        for &s in &cfg.sparsities {
            for &a in &cfg.attn_group_sizes {
                for &f in &cfg.ffn_group_sizes {
                    let result_path = cell_dir(cfg, a, f, s, stage).join("cell.json");
                    if let Some(c) = std::fs::read_to_string(&result_path).ok().and_then(|t| serde_json::from_str::<Cell>(&t).ok()).filter(|c| c.error.is_none()) {
                        eprintln!("== cell a{a} f{f} s{s} stage {stage}: done before, skipped");
                        cells.push(c);
                        continue;
                    }
                    eprintln!("== cell a{a} f{f} s{s} stage {stage}");
                    let c = match run_cell(cfg, a, f, s, stage, dense_loss, commit) {
                        Ok(c) => c,
                        Err(e) => {
                            eprintln!("   cell failed: {e:#}");
                            Cell { attn_group_size: a, ffn_group_size: f, sparsity: s, stage, eval_loss: None, delta_loss: None, skip_attention: None, skip_ffn: None, flops_fraction: None, error: Some(format!("{e:#}")) }
                        }
                    };
                    if let Some(dir) = result_path.parent() {
                        std::fs::create_dir_all(dir)?;
                        write_json(&result_path, &serde_json::to_value(&c)?)?;
                    }
                    cells.push(c);
                }
            }
        }
    }
    write_outputs(cfg, &cells, dense_loss, commit, true)?;
    Ok(cells)
}

fn write_outputs(cfg: &SweepConfig, cells: &[Cell], dense_loss: f64, commit: &str, json: bool) -> Result<()> {
    let f = |v: Option<f64>| v.map(|x| format!("{x:.4}")).unwrap_or_else(|| "-".into());
    let mut md = format!("Sweep `{}` of `wide`: dense eval loss {dense_loss:.4} on the {} split.\n\n", cfg.name, cfg.split);
    md.push_str("| stage | sparsity | attn group | FFN group | eval loss | Δloss | skip attn | skip ffn | FLOPs frac | error |\n|---|---|---|---|---|---|---|---|---|---|\n");
    let mut csv = String::from("stage,sparsity,attn_group_size,ffn_group_size,eval_loss,delta_loss,skip_attention,skip_ffn,flops_fraction,error\n");
    for c in cells {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            c.stage,
            c.sparsity,
            c.attn_group_size,
            c.ffn_group_size,
            f(c.eval_loss),
            f(c.delta_loss),
            f(c.skip_attention),
            f(c.skip_ffn),
            f(c.flops_fraction),
            c.error.as_deref().unwrap_or("")
        ));
        let o = |v: Option<f64>| v.map(|x| x.to_string()).unwrap_or_default();
        csv.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},\"{}\"\n",
            c.stage,
            c.sparsity,
            c.attn_group_size,
            c.ffn_group_size,
            o(c.eval_loss),
            o(c.delta_loss),
            o(c.skip_attention),
            o(c.skip_ffn),
            o(c.flops_fraction),
            c.error.as_deref().unwrap_or("").replace('"', "'")
        ));
    }
    std::fs::write(cfg.out.join("sweep.md"), &md)?;
    std::fs::write(cfg.out.join("sweep.csv"), &csv)?;
    if json {
        write_json(&cfg.out.join("sweep.json"), &serde_json::json!({"provenance": Provenance::new(commit, ""), "config": cfg, "dense_eval_loss": dense_loss, "cells": cells}))?;
    }
    for &stage in &cfg.stages {
        for &s in &cfg.sparsities {
            let cols: Vec<String> = cfg.ffn_group_sizes.iter().map(|g| g.to_string()).collect();
            let rows: Vec<String> = cfg.attn_group_sizes.iter().map(|g| g.to_string()).collect();
            let values: Vec<Vec<Option<f64>>> = cfg
                .attn_group_sizes
                .iter()
                .map(|a| {
                    cfg.ffn_group_sizes
                        .iter()
                        .map(|fg| cells.iter().find(|c| c.stage == stage && c.sparsity == s && c.attn_group_size == *a && c.ffn_group_size == *fg).and_then(|c| c.delta_loss))
                        .collect()
                })
                .collect();
            let png = cfg.out.join(format!("heatmap-s{s}-stage{stage}.png"));
            if values.iter().flatten().any(|v| v.is_some()) {
                crate::plots::heatmap(&png, &format!("Δ eval loss vs dense, sparsity {s}, stage {stage}"), "FFN group size (channels)", "attention group size (heads)", &cols, &rows, &values)?;
                println!("heatmap: {}", png.display());
            }
        }
    }
    println!("{md}");
    Ok(())
}

/// Rewrites the sweep table and heatmaps from a sweep.json into `out`.
pub fn replot(json: &Path, out: &Path) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).with_context(|| format!("cannot read {}", json.display()))?)?;
    let mut cfg: SweepConfig = serde_json::from_value(v["config"].clone()).context("sweep.json has no config")?;
    let cells: Vec<Cell> = serde_json::from_value(v["cells"].clone()).context("sweep.json has no cells")?;
    cfg.out = out.to_path_buf();
    std::fs::create_dir_all(out)?;
    let commit = v["provenance"]["commit"].as_str().unwrap_or("").to_string();
    write_outputs(&cfg, &cells, v["dense_eval_loss"].as_f64().unwrap_or(f64::NAN), &commit, false)
}

/// Reads a sweep TOML (with `--set` overrides).
pub fn load(path: &Path, overrides: &[String]) -> Result<SweepConfig> {
    Ok(wide_train::recipe::load::<SweepConfig>(path, overrides)?.0)
}
