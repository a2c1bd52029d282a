//! `wide compare`: one model, one sparsity, every variant calibrated with the same data, token
//! budget and recipe (or loaded when already calibrated), evaluated next to dense on the same
//! held-out text; a table (Markdown, CSV, JSON) and a chart. Optionally stage 2 for `dense`
//! and `wide` with the identical LoRA recipe.
use crate::report::{write_json, Provenance};
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use tch::Device;
use wide_core::routing::{RoutingConfig, Variant};
use wide_core::{parse_device, parse_dtype};
use wide_train::calibrate::{evaluate_routed, CalibrationRecipe, RoutedModel, RoutingManifest};
use wide_train::corpus::Split;

#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// The stage 1 recipe every variant shares (model, data, budget, optimizer).
    pub recipe: PathBuf,
    pub overrides: Vec<String>,
    pub sparsity: f64,
    pub variants: Vec<Variant>,
    pub out: PathBuf,
    /// A stage 2 recipe: when given, `dense` and `wide` also get the identical LoRA training.
    pub stage2: Option<PathBuf>,
    /// Held-out split for the evaluation.
    pub split: Split,
    /// Multiple-choice tasks (JSONL); default: cloze tasks built from the evaluation split.
    pub tasks: Option<PathBuf>,
    pub commit: String,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Row {
    pub variant: String,
    pub stage: u32,
    pub target_sparsity: f64,
    pub skip_attention: Option<f64>,
    pub skip_ffn: Option<f64>,
    pub skip_layer: Option<f64>,
    pub flops_fraction: f64,
    pub eval_loss: f64,
    pub perplexity: f64,
    pub delta_loss: f64,
    pub perplexity_ratio: f64,
    pub acc: Option<f64>,
    pub acc_norm: Option<f64>,
    pub delta_acc: Option<f64>,
    pub calibration_tokens: u64,
}

/// Calibrates (or loads, when its folder holds this run's finished calibration on this model:
/// `model` from [`crate::reuse::model_identity`]) one variant; returns its output folder.
fn calibrate_variant(cfg: &CompareConfig, variant: Variant, stage: u32, stage1: Option<&Path>, model: &serde_json::Value) -> Result<PathBuf> {
    let name = if stage == 2 { format!("{}-lora", variant.name()) } else { variant.name().to_string() };
    let dir = cfg.out.join(&name);
    let mut ov = cfg.overrides.clone();
    ov.push(format!("routing.variant=\"{}\"", variant.name()));
    ov.push(format!("routing.target_sparsity={}", cfg.sparsity));
    ov.push(format!("output.dir=\"{}\"", dir.display()));
    let path = if stage == 2 { cfg.stage2.as_ref().context("stage 2 needs a stage 2 recipe")? } else { &cfg.recipe };
    let prov = serde_json::json!({"commit": cfg.commit, "command": "wide compare"});
    crate::reuse::calibrate_or_load(path, &ov, stage, stage1, &dir, model, prov, &name)?;
    Ok(dir)
}

/// Runs the comparison; returns the rows (dense first).
pub fn run(cfg: &CompareConfig) -> Result<Vec<Row>> {
    wide_core::routing::check_sparsity(cfg.sparsity)?;
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    let (base, _) = CalibrationRecipe::load(&cfg.recipe, &cfg.overrides)?;
    // Every variant must be valid before any is trained.
    let model_cfg = wide_core::HfCheckpoint::open(&base.model_dir)?.config;
    for v in &cfg.variants {
        let mut rc: RoutingConfig = base.routing.clone();
        rc.variant = *v;
        rc.target_sparsity = Some(cfg.sparsity);
        rc.validate(&model_cfg).with_context(|| format!("variant {}", v.name()))?;
    }
    let device = parse_device(&base.train.device)?;
    let kind = parse_dtype(&base.train.dtype, device)?;
    let seq_len = base.data.seq_len;
    let model = crate::reuse::model_identity(&base.model_dir)?;
    let mut dirs: Vec<(Variant, u32, PathBuf)> = vec![];
    let dense_dir = calibrate_variant(cfg, Variant::Dense, 1, None, &model)?;
    dirs.push((Variant::Dense, 1, dense_dir.clone()));
    for v in &cfg.variants {
        if *v != Variant::Dense {
            dirs.push((*v, 1, calibrate_variant(cfg, *v, 1, None, &model)?));
        }
    }
    if cfg.stage2.is_some() {
        for v in [Variant::Dense, Variant::Wide] {
            let s1 = dirs.iter().find(|d| d.0 == v && d.1 == 1).map(|d| d.2.clone());
            let Some(s1) = s1 else { continue };
            dirs.push((v, 2, calibrate_variant(cfg, v, 2, Some(&s1), &model)?));
        }
    }
    // Evaluation on the held-out split, every variant on the same sequences.
    let files = base.data.prepare()?;
    let eval_file = files.open(cfg.split)?;
    // Zero-shot tasks: the user's file, or cloze tasks cut from the same held-out split.
    let tasks = match &cfg.tasks {
        Some(t) => t.clone(),
        None => {
            // Named by the split's content hash: a corpus built again gets its own tasks.
            let corpus = wide_train::corpus::CorpusManifest::load(&base.data.corpus_dir)?;
            let sha = corpus.split_sha256.get(cfg.split.name()).map(|h| h.chars().take(12).collect::<String>()).unwrap_or_default();
            let p = cfg.out.join(format!("cloze-{}-{sha}.jsonl", cfg.split.name()));
            if !p.exists() {
                let docs = wide_train::corpus::read_split(&base.data.corpus_dir, cfg.split)?;
                let t = crate::zeroshot::build_cloze(&docs, &crate::zeroshot::ClozeConfig::default())?;
                crate::zeroshot::write_jsonl(&p, &t)?;
                eprintln!("== built {} cloze tasks from the {} split: {}", t.len(), cfg.split.name(), p.display());
            }
            p
        }
    };
    let mut rows = vec![];
    for (v, stage, dir) in &dirs {
        let m = RoutedModel::load(&base.model_dir, dir, device, kind)?;
        let h = evaluate_routed(&m, &eval_file, seq_len, base.train.micro_batch, 0)?;
        let manifest: RoutingManifest = serde_json::from_str(&std::fs::read_to_string(dir.join("routing.json"))?)?;
        let r = crate::zeroshot::evaluate_task_file(&m, &tasks, None, &crate::zeroshot::TaskConfig::default())?;
        let (acc, acc_norm) = (Some(r.acc), Some(r.acc_norm));
        let get = |k: &str| h.sparsity.skip_rate.get(k).copied();
        rows.push(Row {
            variant: v.name().to_string(),
            stage: *stage,
            target_sparsity: if *v == Variant::Dense { 0.0 } else { cfg.sparsity },
            skip_attention: get("attention"),
            skip_ffn: get("ffn"),
            skip_layer: get("layer"),
            flops_fraction: h.sparsity.flops_fraction,
            eval_loss: h.loss,
            perplexity: h.perplexity,
            delta_loss: 0.0,
            perplexity_ratio: 1.0,
            acc,
            acc_norm,
            delta_acc: None,
            calibration_tokens: manifest.calibration_tokens,
        });
        eprintln!("   {} (stage {stage}): loss {:.4}, FLOPs {:.3}", v.name(), h.loss, h.sparsity.flops_fraction);
    }
    // Relative to dense of the same stage (stage 2 rows against dense + the same LoRA).
    let dense_of = |stage: u32, rows: &[Row]| rows.iter().find(|r| r.variant == "dense" && r.stage == stage).map(|r| (r.eval_loss, r.acc));
    let refs: Vec<Option<(f64, Option<f64>)>> = rows.iter().map(|r| dense_of(r.stage, &rows)).collect();
    for (r, d) in rows.iter_mut().zip(refs) {
        if let Some((loss, acc)) = d {
            r.delta_loss = r.eval_loss - loss;
            r.perplexity_ratio = (r.eval_loss - loss).exp();
            r.delta_acc = match (r.acc, acc) {
                (Some(a), Some(b)) => Some(a - b),
                _ => None,
            };
        }
    }
    write_outputs(cfg, &base, &rows, device)?;
    Ok(rows)
}

fn fmt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into())
}

/// Rewrites compare.md, compare.csv and compare.png from a compare.json (e.g. one made on a
/// machine without fonts) into `out`.
pub fn replot(json: &Path, out: &Path) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).with_context(|| format!("cannot read {}", json.display()))?)?;
    let rows: Vec<Row> = serde_json::from_value(v["rows"].clone()).context("compare.json has no rows")?;
    let cfg = CompareConfig {
        recipe: PathBuf::from(v["recipe"].as_str().unwrap_or("")),
        overrides: vec![],
        sparsity: v["sparsity"].as_f64().unwrap_or(0.0),
        variants: vec![],
        out: out.to_path_buf(),
        stage2: None,
        split: Split::parse(v["split"].as_str().unwrap_or("test"))?,
        tasks: None,
        commit: v["provenance"]["commit"].as_str().unwrap_or("").to_string(),
    };
    std::fs::create_dir_all(out)?;
    let model = v["model_dir"].as_str().unwrap_or("").to_string();
    write_tables(&cfg, &model, &rows, None)
}

fn write_outputs(cfg: &CompareConfig, base: &CalibrationRecipe, rows: &[Row], device: Device) -> Result<()> {
    write_tables(cfg, &base.model_dir.display().to_string(), rows, Some(device))
}

fn write_tables(cfg: &CompareConfig, model_dir: &str, rows: &[Row], device: Option<Device>) -> Result<()> {
    let mut md = String::new();
    md.push_str(&format!(
        "Model `{}`, sparsity {}, {} calibration tokens per variant (recipe `{}`), evaluated on the {} split.\n\n",
        model_dir,
        cfg.sparsity,
        rows.first().map(|r| r.calibration_tokens).unwrap_or(0),
        cfg.recipe.display(),
        cfg.split.name()
    ));
    md.push_str("| variant | stage | target | skip attn | skip ffn | skip layer | FLOPs frac | eval loss | ppl | Δloss vs dense | ppl ratio | acc | acc_norm | Δacc |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let mut csv = String::from("variant,stage,target_sparsity,skip_attention,skip_ffn,skip_layer,flops_fraction,eval_loss,perplexity,delta_loss,perplexity_ratio,acc,acc_norm,delta_acc,calibration_tokens\n");
    let c = |v: Option<f64>| v.map(|x| x.to_string()).unwrap_or_default();
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.3} | {:.4} | {:.2} | {:+.4} | {:.3} | {} | {} | {} |\n",
            r.variant,
            r.stage,
            r.target_sparsity,
            fmt(r.skip_attention),
            fmt(r.skip_ffn),
            fmt(r.skip_layer),
            r.flops_fraction,
            r.eval_loss,
            r.perplexity,
            r.delta_loss,
            r.perplexity_ratio,
            fmt(r.acc),
            fmt(r.acc_norm),
            r.delta_acc.map(|x| format!("{x:+.3}")).unwrap_or_else(|| "-".into())
        ));
        csv.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            r.variant,
            r.stage,
            r.target_sparsity,
            c(r.skip_attention),
            c(r.skip_ffn),
            c(r.skip_layer),
            r.flops_fraction,
            r.eval_loss,
            r.perplexity,
            r.delta_loss,
            r.perplexity_ratio,
            c(r.acc),
            c(r.acc_norm),
            c(r.delta_acc),
            r.calibration_tokens
        ));
    }
    let delta = |v: &str| rows.iter().find(|r| r.variant == v && r.stage == 1).map(|r| r.delta_loss);
    if let (Some(w), Some(l)) = (delta("wide"), delta("layer_skip")) {
        md.push_str(&format!(
            "\nStage 1: Δ(wide) = {w:.4}, Δ(layer_skip) = {l:.4}: Δ(wide) / Δ(layer_skip) = {:.3} (goal <= 0.45).\n",
            if l.abs() > 0.0 { w / l } else { f64::NAN }
        ));
    }
    let d2 = |v: &str| rows.iter().find(|r| r.variant == v && r.stage == 2).map(|r| r.delta_loss);
    if let (Some(w1), Some(w2)) = (delta("wide"), d2("wide")) {
        md.push_str(&format!("Stage 2: Δ(wide + LoRA vs dense + LoRA) = {w2:.4} against Δ(wide) = {w1:.4} after stage 1: cut by {:.1}% (goal >= 30%).\n", 100.0 * (1.0 - w2 / w1)));
    }
    crate::report::write_text(&cfg.out.join("compare.md"), &md)?;
    crate::report::write_text(&cfg.out.join("compare.csv"), &csv)?;
    if let Some(device) = device {
        write_json(
            &cfg.out.join("compare.json"),
            &serde_json::json!({"provenance": Provenance::new(&cfg.commit, &crate::bench::device_label(device)), "model_dir": model_dir, "sparsity": cfg.sparsity, "recipe": cfg.recipe, "split": cfg.split.name(), "rows": rows}),
        )?;
    }
    let bars: Vec<(String, f64)> = rows
        .iter()
        .filter(|r| r.variant != "dense")
        .map(|r| (format!("{}{} {:.2}", r.variant, if r.stage == 2 { "+LoRA" } else { "" }, r.flops_fraction), r.delta_loss))
        .collect();
    if !bars.is_empty() {
        crate::plots::bar_chart(
            &cfg.out.join("compare.png"),
            &format!("eval loss above dense at sparsity {} (label: variant, FLOPs fraction)", cfg.sparsity),
            "Δ eval loss (nats/token)",
            &bars,
        )?;
    }
    println!("{md}");
    println!("chart: {}", cfg.out.join("compare.png").display());
    Ok(())
}
