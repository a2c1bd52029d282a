//! `wide eval ...`: perplexity, multiple-choice task files and the cloze task builder, each
//! printing a short table and optionally writing its JSON report.
use crate::perplexity::{evaluate_perplexity, load_model, TextSource};
use crate::zeroshot::{build_cloze, evaluate_task_file, write_jsonl, ClozeConfig, TaskConfig, TaskReport};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde::Serialize;
use std::path::{Path, PathBuf};
use wide_core::checkpoint::kind_name;
use wide_core::routing::SparsityReport;
use wide_core::{parse_device, parse_dtype};
use wide_train::corpus::{read_split, Split};

#[derive(Subcommand, Debug)]
pub enum EvalCommand {
    /// Perplexity on a corpus split or a text file (dense or routed).
    ///
    /// Windows of --seq-len tokens every --stride tokens, each scoring only tokens no earlier
    /// window scored; routed models also report skip rates and the executed FLOPs fraction on
    /// that text.
    Ppl {
        /// Hugging Face model folder.
        model_dir: PathBuf,
        /// Stage 1 / stage 2 routing folder (routers, LoRA, routing.json); dense without it.
        #[arg(long)]
        routing: Option<PathBuf>,
        /// Corpus folder (`wide corpus`); its --split is read.
        #[arg(long)]
        corpus: Option<PathBuf>,
        /// train, validation or test.
        #[arg(long, default_value = "test")]
        split: String,
        /// A UTF-8 text file instead of a corpus split.
        #[arg(long)]
        text: Option<PathBuf>,
        /// Tokens per window (default: the model's context, at most 2048).
        #[arg(long)]
        seq_len: Option<usize>,
        /// Tokens between window starts (default: --seq-len, disjoint windows); a smaller stride
        /// gives every scored token at least seq_len - stride tokens of context.
        #[arg(long)]
        stride: Option<usize>,
        /// Windows per forward.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// auto, cpu, cuda or cuda:N.
        #[arg(long, default_value = "auto")]
        device: String,
        /// auto (bf16 on GPU, f32 on CPU), f32, bf16 or f16.
        #[arg(long, default_value = "auto")]
        dtype: String,
        /// Write the report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Zero-shot multiple choice from a JSONL task file: acc and acc_norm.
    ///
    /// One {"context", "choices", "gold"} object per line; every choice is scored by its
    /// log-likelihood given the context; acc_norm divides it by the choice's UTF-8 bytes.
    Tasks {
        /// Hugging Face model folder.
        model_dir: PathBuf,
        /// Stage 1 / stage 2 routing folder; dense without it.
        #[arg(long)]
        routing: Option<PathBuf>,
        /// The JSONL task file.
        #[arg(long)]
        tasks: PathBuf,
        /// Score only the first N tasks.
        #[arg(long)]
        limit: Option<usize>,
        /// Choices scored per forward.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Longest model input in tokens (default: the model's context); longer contexts lose
        /// tokens from the left.
        #[arg(long)]
        max_length: Option<usize>,
        #[arg(long, default_value = "auto")]
        device: String,
        #[arg(long, default_value = "auto")]
        dtype: String,
        /// Write the report (with every choice's log-likelihood) as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Build cloze tasks (JSONL) from held-out corpus text.
    ///
    /// A passage of --context-words words, the next --continuation-words words as the right
    /// choice, and --distractors spans of as many words from elsewhere in the same document.
    BuildCloze {
        /// Corpus folder (`wide corpus`).
        #[arg(long)]
        corpus: PathBuf,
        /// validation or test (held-out text).
        #[arg(long, default_value = "test")]
        split: String,
        /// Output JSONL task file.
        #[arg(long)]
        out: PathBuf,
        /// Number of tasks.
        #[arg(long, default_value_t = ClozeConfig::default().tasks)]
        n: usize,
        #[arg(long, default_value_t = ClozeConfig::default().seed)]
        seed: u64,
        #[arg(long, default_value_t = ClozeConfig::default().context_words)]
        context_words: usize,
        #[arg(long, default_value_t = ClozeConfig::default().continuation_words)]
        continuation_words: usize,
        #[arg(long, default_value_t = ClozeConfig::default().distractors)]
        distractors: usize,
    },
}

/// Runs one `wide eval` command; `commit` is recorded in the JSON reports.
pub fn run(cmd: EvalCommand, commit: &str) -> Result<()> {
    match cmd {
        EvalCommand::Ppl { model_dir, routing, corpus, split, text, seq_len, stride, batch, device, dtype, json } => {
            let source = match (corpus, text) {
                (Some(dir), None) => TextSource::Corpus { dir, split: Split::parse(&split)? },
                (None, Some(p)) => TextSource::File(p),
                (Some(_), Some(_)) => bail!("give either --corpus DIR (with --split) or --text FILE, not both"),
                (None, None) => bail!("say what text to evaluate: --corpus DIR (with --split) or --text FILE"),
            };
            let device = parse_device(&device)?;
            let kind = parse_dtype(&dtype, device)?;
            let r = evaluate_perplexity(&model_dir, routing.as_deref(), &source, seq_len, stride, batch, device, kind)?;
            let p = &r.result;
            println!("model        {} ({}{})", r.model_dir.display(), r.variant, routing_label(&r.routing_dir));
            println!("text         {}", source.describe());
            println!("windows      {} of {} tokens, stride {}, batch {} ({}, {})", p.windows, p.seq_len, p.stride, p.batch, r.device, r.dtype);
            println!("tokens       {} scored of {}", p.scored_tokens, p.tokens);
            println!("loss         {:.4}", p.loss);
            println!("perplexity   {:.3}", p.perplexity);
            print_sparsity(&p.sparsity);
            println!("time         {:.1} s", p.seconds);
            write_report(json.as_deref(), &r, commit)
        }
        EvalCommand::Tasks { model_dir, routing, tasks, limit, batch, max_length, device, dtype, json } => {
            let device = parse_device(&device)?;
            let kind = parse_dtype(&dtype, device)?;
            let m = load_model(&model_dir, routing.as_deref(), device, kind)?;
            let result = evaluate_task_file(&m, &tasks, limit, &TaskConfig { batch, max_len: max_length })?;
            let r = TaskReport {
                model_dir: model_dir.clone(),
                routing_dir: routing.clone(),
                variant: m.routing.config.variant.name().to_string(),
                tasks_file: tasks.clone(),
                device: format!("{device:?}"),
                dtype: kind_name(kind).to_string(),
                result,
            };
            let t = &r.result;
            println!("model        {} ({}{})", model_dir.display(), r.variant, routing_label(&routing));
            println!("tasks        {} ({} tasks, {} choices scored; chance {:.3})", tasks.display(), t.tasks, t.requests, t.chance);
            println!("acc          {:.4} ± {:.4}", t.acc, t.acc_stderr);
            println!("acc_norm     {:.4} ± {:.4}", t.acc_norm, t.acc_norm_stderr);
            if t.truncated_tasks > 0 {
                println!("truncated    {} task(s): context cut from the left to fit {} tokens", t.truncated_tasks, t.max_len);
            }
            print_sparsity(&t.sparsity);
            println!("time         {:.1} s", t.seconds);
            write_report(json.as_deref(), &r, commit)
        }
        EvalCommand::BuildCloze { corpus, split, out, n, seed, context_words, continuation_words, distractors } => {
            let split = Split::parse(&split)?;
            if split == Split::Train {
                eprintln!("warning: building cloze tasks from the training split: models have seen this text");
            }
            let docs = read_split(&corpus, split)?;
            let cfg = ClozeConfig { tasks: n, context_words, continuation_words, distractors, seed };
            let tasks = build_cloze(&docs, &cfg).with_context(|| format!("{} split of {}", split.name(), corpus.display()))?;
            write_jsonl(&out, &tasks)?;
            println!(
                "wrote {} cloze tasks ({} context words, {} continuation words, {} choices, seed {}) from the {} split of {} to {}",
                tasks.len(),
                context_words,
                continuation_words,
                distractors + 1,
                seed,
                split.name(),
                corpus.display(),
                out.display()
            );
            Ok(())
        }
    }
}

fn routing_label(r: &Option<PathBuf>) -> String {
    r.as_ref().map(|p| format!(", routing {}", p.display())).unwrap_or_default()
}

fn print_sparsity(s: &Option<SparsityReport>) {
    if let Some(s) = s {
        let rates: Vec<String> = s.skip_rate.iter().map(|(k, v)| format!("{k} {v:.3}")).collect();
        println!("skip rates   {}", if rates.is_empty() { "none".to_string() } else { rates.join(", ") });
        println!("FLOPs        {:.3} of dense", s.flops_fraction);
    }
}

/// Writes `report` plus the commit and command line as pretty JSON.
fn write_report<T: Serialize>(path: Option<&Path>, report: &T, commit: &str) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let mut v = serde_json::to_value(report)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("commit".into(), commit.into());
        o.insert("command".into(), std::env::args().collect::<Vec<_>>().join(" ").into());
    }
    crate::report::write_json(path, &v)?;
    eprintln!("report: {}", path.display());
    Ok(())
}
