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
use wide_train::calibrate::{evaluate_routed, CalibrationRecipe, RoutedModel};
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
    /// The split it was evaluated on (absent in results of earlier versions: evaluated again).
    #[serde(default)]
    pub split: Option<String>,
    pub eval_loss: Option<f64>,
    /// Against dense of the same stage: the model itself at stage 1, dense + the same LoRA
    /// training at stage 2.
    pub delta_loss: Option<f64>,
    pub skip_attention: Option<f64>,
    pub skip_ffn: Option<f64>,
    pub flops_fraction: Option<f64>,
    pub error: Option<String>,
}

fn cell_dir(cfg: &SweepConfig, a: i64, f: i64, s: f64, stage: u32) -> PathBuf {
    cfg.out.join(format!("a{a}-f{f}-s{s}{}", if stage == 2 { "-lora" } else { "" }))
}

/// The recipe overrides of one run of the sweep: the sweep's own, then these, then its folder.
fn overrides(cfg: &SweepConfig, extra: &[String], dir: &Path) -> Vec<String> {
    let mut ov = cfg.overrides.clone();
    ov.extend(extra.iter().cloned());
    ov.push(format!("output.dir=\"{}\"", dir.display()));
    ov
}

/// Evaluation of the model calibrated in `dir` on the sweep's split: (loss, perplexity, skip
/// rates, FLOPs fraction).
fn evaluate(cfg: &SweepConfig, recipe_path: &Path, ov: &[String], dir: &Path) -> Result<wide_train::calibrate::HeldOut> {
    let (recipe, _) = CalibrationRecipe::load_shared_target(recipe_path, ov)?;
    let device = parse_device(&recipe.train.device)?;
    let kind = parse_dtype(&recipe.train.dtype, device)?;
    let m = RoutedModel::load(&recipe.model_dir, dir, device, kind)?;
    let files = recipe.data.prepare()?;
    evaluate_routed(&m, &files.open(Split::parse(&cfg.split)?)?, recipe.data.seq_len, recipe.train.micro_batch, 0)
}

/// One cell's recipe file, its overrides and its folder.
fn cell_recipe(cfg: &SweepConfig, a: i64, f: i64, s: f64, stage: u32) -> Result<(&Path, Vec<String>, PathBuf)> {
    let dir = cell_dir(cfg, a, f, s, stage);
    let ov = overrides(
        cfg,
        &["routing.variant=\"wide\"".to_string(), format!("routing.attn_group_size={a}"), format!("routing.ffn_group_size={f}"), format!("routing.target_sparsity={s}")],
        &dir,
    );
    Ok((recipe_path(cfg, stage)?, ov, dir))
}

/// The recipe a stage's runs take.
fn recipe_path(cfg: &SweepConfig, stage: u32) -> Result<&Path> {
    Ok(if stage == 2 { cfg.stage2_recipe.as_deref().context("stages include 2 but no stage2_recipe is given")? } else { &cfg.recipe })
}

fn run_cell(cfg: &SweepConfig, a: i64, f: i64, s: f64, stage: u32, dense_loss: f64, model: &serde_json::Value, commit: &str) -> Result<Cell> {
    let (path, ov, dir) = cell_recipe(cfg, a, f, s, stage)?;
    let label = format!("cell a{a} f{f} s{s} stage {stage}");
    let s1 = cell_dir(cfg, a, f, s, 1);
    crate::reuse::calibrate_or_load(path, &ov, stage, (stage == 2).then_some(s1.as_path()), &dir, model, serde_json::json!({"commit": commit, "command": "wide sweep"}), &label)?;
    let h = evaluate(cfg, path, &ov, &dir)?;
    Ok(Cell {
        attn_group_size: a,
        ffn_group_size: f,
        sparsity: s,
        stage,
        split: Some(cfg.split.clone()),
        eval_loss: Some(h.loss),
        delta_loss: Some(h.loss - dense_loss),
        skip_attention: h.sparsity.skip_rate.get("attention").copied(),
        skip_ffn: h.sparsity.skip_rate.get("ffn").copied(),
        flops_fraction: Some(h.sparsity.flops_fraction),
        error: None,
    })
}

/// The dense reference of a stage: stage 1 the model itself, stage 2 dense plus the identical
/// LoRA training (as `wide compare` does), so that a stage 2 cell's Δ compares equal budgets.
/// Cached in `dense.json` / `dense-lora.json` under the recipe, split and model they depend on.
fn dense_loss(cfg: &SweepConfig, stage: u32, model: &serde_json::Value, commit: &str) -> Result<f64> {
    let path = recipe_path(cfg, stage)?;
    let name = if stage == 2 { "dense-lora" } else { "dense" };
    let dir = cfg.out.join(name);
    let ov = overrides(cfg, &["routing.variant=\"dense\"".to_string()], &dir);
    let (_, table) = CalibrationRecipe::load_shared_target(path, &ov)?;
    let key = serde_json::json!({"recipe": table, "split": cfg.split, "model": model, "stage": stage});
    let v = crate::reuse::cached_value(&cfg.out.join(format!("{name}.json")), &key, "eval_loss", || {
        if stage == 2 {
            let s1 = cfg.out.join("dense");
            let ov1 = overrides(cfg, &["routing.variant=\"dense\"".to_string()], &s1);
            let prov = serde_json::json!({"commit": commit, "command": "wide sweep"});
            crate::reuse::calibrate_or_load(&cfg.recipe, &ov1, 1, None, &s1, model, prov.clone(), "dense")?;
            crate::reuse::calibrate_or_load(path, &ov, 2, Some(&s1), &dir, model, prov, name)?;
            Ok(serde_json::json!(evaluate(cfg, path, &ov, &dir)?.loss))
        } else {
            let (recipe, _) = CalibrationRecipe::load(&cfg.recipe, &cfg.overrides)?;
            let device = parse_device(&recipe.train.device)?;
            let kind = parse_dtype(&recipe.train.dtype, device)?;
            let mut rc = recipe.routing.clone();
            rc.variant = Variant::Dense;
            let m = RoutedModel::new(&recipe.model_dir, &rc, device, kind)?;
            let files = recipe.data.prepare()?;
            let h = evaluate_routed(&m, &files.open(Split::parse(&cfg.split)?)?, recipe.data.seq_len, recipe.train.micro_batch, 0)?;
            Ok(serde_json::json!(h.loss))
        }
    })?;
    v.as_f64().with_context(|| format!("{name}.json holds no eval loss"))
}

pub fn run(cfg: &SweepConfig, commit: &str) -> Result<Vec<Cell>> {
    if cfg.attn_group_sizes.is_empty() || cfg.ffn_group_sizes.is_empty() || cfg.sparsities.is_empty() {
        bail!("the sweep grid is empty: give attn_group_sizes, ffn_group_sizes and sparsities");
    }
    for s in &cfg.sparsities {
        wide_core::routing::check_sparsity(*s)?;
    }
    Split::parse(&cfg.split)?;
    if cfg.stages.iter().any(|&st| st != 1 && st != 2) {
        bail!("stages {:?}: a sweep runs stage 1 and/or 2", cfg.stages);
    }
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    let (base, _) = CalibrationRecipe::load(&cfg.recipe, &cfg.overrides)?;
    let model = crate::reuse::model_identity(&base.model_dir)?;
    let mut cells = vec![];
    let mut dense = std::collections::BTreeMap::new();
    for &stage in &cfg.stages {
        let dense_loss = dense_loss(cfg, stage, &model, commit)?;
        dense.insert(stage, dense_loss);
        for &s in &cfg.sparsities {
            for &a in &cfg.attn_group_sizes {
                for &f in &cfg.ffn_group_sizes {
                    let result_path = cell_dir(cfg, a, f, s, stage).join("cell.json");
                    // A finished cell of this split is taken as it is (its Δ against this run's
                    // dense reference); its calibration is checked against this run's recipe first.
                    let previous = std::fs::read_to_string(&result_path).ok().and_then(|t| serde_json::from_str::<Cell>(&t).ok()).filter(|c| c.error.is_none() && c.split.as_deref() == Some(cfg.split.as_str()));
                    if let Some(mut c) = previous {
                        let (path, ov, dir) = cell_recipe(cfg, a, f, s, stage)?;
                        let (_, table) = CalibrationRecipe::load_shared_target(path, &ov)?;
                        if crate::reuse::finished_calibration(&dir, &table, stage, &model)?.is_some() {
                            eprintln!("== cell a{a} f{f} s{s} stage {stage}: done before, skipped");
                            c.delta_loss = c.eval_loss.map(|l| l - dense_loss);
                            cells.push(c);
                            continue;
                        }
                    }
                    eprintln!("== cell a{a} f{f} s{s} stage {stage}");
                    let c = match run_cell(cfg, a, f, s, stage, dense_loss, &model, commit) {
                        Ok(c) => c,
                        Err(e) => {
                            eprintln!("   cell failed: {e:#}");
                            Cell { attn_group_size: a, ffn_group_size: f, sparsity: s, stage, split: Some(cfg.split.clone()), eval_loss: None, delta_loss: None, skip_attention: None, skip_ffn: None, flops_fraction: None, error: Some(format!("{e:#}")) }
                        }
                    };
                    write_json(&result_path, &serde_json::to_value(&c)?)?;
                    cells.push(c);
                }
            }
        }
    }
    write_outputs(cfg, &cells, &dense, commit, true)?;
    Ok(cells)
}

/// `dense`: the reference eval loss of each stage run (1: dense; 2: dense + the same LoRA).
fn write_outputs(cfg: &SweepConfig, cells: &[Cell], dense: &std::collections::BTreeMap<u32, f64>, commit: &str, json: bool) -> Result<()> {
    let f = |v: Option<f64>| v.map(|x| format!("{x:.4}")).unwrap_or_else(|| "-".into());
    let refs: Vec<String> = dense.iter().map(|(st, l)| format!("{} {l:.4}", if *st == 2 { "dense + LoRA (stage 2 reference)" } else { "dense" })).collect();
    let mut md = format!("Sweep `{}` of `wide` on the {} split; eval loss of {}.\n\n", cfg.name, cfg.split, refs.join(", "));
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
    crate::report::write_text(&cfg.out.join("sweep.md"), &md)?;
    crate::report::write_text(&cfg.out.join("sweep.csv"), &csv)?;
    if json {
        write_json(
            &cfg.out.join("sweep.json"),
            &serde_json::json!({"provenance": Provenance::new(commit, ""), "config": cfg, "dense_eval_loss": dense.get(&1), "dense_lora_eval_loss": dense.get(&2), "cells": cells}),
        )?;
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
                let against = if stage == 2 { "dense + LoRA" } else { "dense" };
                crate::plots::heatmap(&png, &format!("Δ eval loss vs {against}, sparsity {s}, stage {stage}"), "FFN group size (channels)", "attention group size (heads)", &cols, &rows, &values)?;
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
    let dense = [(1, "dense_eval_loss"), (2, "dense_lora_eval_loss")].into_iter().filter_map(|(st, k)| v[k].as_f64().map(|l| (st, l))).collect();
    write_outputs(&cfg, &cells, &dense, &commit, false)
}

/// Reads a sweep TOML (with `--set` overrides).
pub fn load(path: &Path, overrides: &[String]) -> Result<SweepConfig> {
    Ok(wide_train::recipe::load::<SweepConfig>(path, overrides)?.0)
}
