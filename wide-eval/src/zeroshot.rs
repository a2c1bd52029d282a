//! Zero-shot multiple choice scored by log-likelihood, in the manner of lm-evaluation-harness,
//! and a builder of cloze tasks from held-out corpus text.
//!
//! Task files are JSONL, one task per line:
//! `{"context": "The capital of France is", "choices": [" Paris", " Rome"], "gold": 0}`.
//! `choices` are continuations of `context` (they usually start with a space); `gold` is the
//! index of the right one; other fields are ignored. Each choice is scored by the sum of the
//! log-probabilities of its tokens given the context. Whitespace at the end of the context is
//! moved to the front of the continuation; the context is tokenized alone and together with
//! the continuation, and the continuation's tokens are those after the context's. `acc` picks
//! the highest log-likelihood; `acc_norm` the highest log-likelihood per UTF-8 byte of the
//! choice. A context too long for the model loses tokens from its left; the report counts it.
use crate::perplexity::{eos_id, target_logprobs};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};
use wide_core::routing::{SparsityMeter, SparsityReport, Variant};
use wide_core::Tokenizer;
use wide_train::calibrate::RoutedModel;
use wide_train::corpus::Document;

/// One multiple-choice task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct McTask {
    pub context: String,
    pub choices: Vec<String>,
    pub gold: usize,
}

/// Parses one JSONL line; the error says what is wrong (the caller adds file and line).
pub fn parse_task(line: &str) -> Result<McTask> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| anyhow::anyhow!("not valid JSON ({e})"))?;
    let obj = v.as_object().context("expected a JSON object with \"context\", \"choices\" and \"gold\"")?;
    let context = match obj.get("context") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(_) => bail!("\"context\" must be a string"),
        None => bail!("missing \"context\" (a string)"),
    };
    let choices = match obj.get("choices") {
        Some(serde_json::Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, c) in a.iter().enumerate() {
                match c.as_str() {
                    Some("") => bail!("choice {i} is an empty string"),
                    Some(s) => out.push(s.to_string()),
                    None => bail!("choice {i} is not a string"),
                }
            }
            out
        }
        Some(_) => bail!("\"choices\" must be a list of strings"),
        None => bail!("missing \"choices\" (a list of strings)"),
    };
    if choices.is_empty() {
        bail!("\"choices\" is empty");
    }
    let gold = match obj.get("gold") {
        Some(g) => match g.as_u64() {
            Some(g) => g as usize,
            None => bail!("\"gold\" must be a non-negative integer index into \"choices\", got {g}"),
        },
        None => bail!("missing \"gold\" (the index of the right choice)"),
    };
    if gold >= choices.len() {
        bail!("\"gold\" is {gold} but there are only {} choices (indices 0 to {})", choices.len(), choices.len() - 1);
    }
    Ok(McTask { context, choices, gold })
}

/// Reads a JSONL task file (blank lines are skipped), at most `limit` tasks.
pub fn read_tasks(path: &Path, limit: Option<usize>) -> Result<Vec<McTask>> {
    ensure!(limit != Some(0), "--limit must be at least 1");
    let f = std::fs::File::open(path).with_context(|| format!("cannot read task file {}", path.display()))?;
    let mut tasks = vec![];
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        if limit.is_some_and(|l| tasks.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("{} line {}: not UTF-8 text", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        tasks.push(parse_task(&line).with_context(|| format!("{} line {}", path.display(), i + 1))?);
    }
    ensure!(!tasks.is_empty(), "{} holds no tasks", path.display());
    Ok(tasks)
}

/// Writes tasks (or anything serialisable per line) as JSONL, atomically.
pub fn write_jsonl<T: Serialize>(path: &Path, items: &[T]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = wide_core::safetensors::tmp_path(path);
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    for it in items {
        serde_json::to_writer(&mut w, it)?;
        w.write_all(b"\n")?;
    }
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Token ids of one (context, continuation) request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedRequest {
    pub context: Vec<i64>,
    pub continuation: Vec<i64>,
}

/// Splits a request into context and continuation tokens: trailing whitespace of the context
/// joins the continuation; the continuation's tokens are those of `context + continuation`
/// after the context's own tokens. An empty context becomes the EOS token.
pub fn encode_request(tok: &Tokenizer, eos: i64, context: &str, continuation: &str) -> Result<EncodedRequest> {
    let kept = context.trim_end().len();
    let (ctx, cont) = (&context[..kept], format!("{}{continuation}", &context[kept..]));
    if ctx.is_empty() {
        return Ok(EncodedRequest { context: vec![eos], continuation: tok.encode(&cont, false)? });
    }
    let ctx_ids = tok.encode(ctx, false)?;
    let whole = tok.encode(&format!("{ctx}{cont}"), false)?;
    let continuation = if whole.len() > ctx_ids.len() {
        whole[ctx_ids.len()..].to_vec()
    } else {
        // The continuation merged into the context's last token: score it on its own.
        tok.encode(&cont, false)?
    };
    Ok(EncodedRequest { context: ctx_ids, continuation })
}

/// Settings of a task run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskConfig {
    /// Requests (one per choice) per forward.
    pub batch: usize,
    /// Longest model input; defaults to the model's context.
    pub max_len: Option<usize>,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self { batch: 16, max_len: None }
    }
}

/// The scores of one task.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ItemResult {
    pub gold: usize,
    /// Sum of continuation token log-probabilities, per choice.
    pub loglik: Vec<f64>,
    /// UTF-8 bytes of each choice as given.
    pub bytes: Vec<usize>,
    /// Continuation tokens of each choice.
    pub tokens: Vec<usize>,
    pub pred: usize,
    pub pred_norm: usize,
    /// Context tokens dropped from the left to fit the model (largest over the choices).
    pub truncated_tokens: usize,
}

impl ItemResult {
    /// Predictions from log-likelihoods: the first maximum, as `argmax` gives.
    pub fn new(gold: usize, loglik: Vec<f64>, bytes: Vec<usize>, tokens: Vec<usize>, truncated_tokens: usize) -> Self {
        let norm: Vec<f64> = loglik.iter().zip(&bytes).map(|(l, b)| l / (*b).max(1) as f64).collect();
        Self { gold, pred: argmax(&loglik), pred_norm: argmax(&norm), loglik, bytes, tokens, truncated_tokens }
    }
}

fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// Mean of 0/1 outcomes and its standard error (sample standard deviation / sqrt(n)).
pub fn mean_and_stderr(hits: impl Iterator<Item = bool>) -> (f64, f64) {
    let v: Vec<f64> = hits.map(|h| if h { 1.0 } else { 0.0 }).collect();
    let n = v.len() as f64;
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// Accuracy figures of a task run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskResult {
    pub tasks: usize,
    pub acc: f64,
    pub acc_stderr: f64,
    pub acc_norm: f64,
    pub acc_norm_stderr: f64,
    /// Chance level: mean of 1 / number of choices.
    pub chance: f64,
    /// Tasks whose context was cut from the left to fit the model.
    pub truncated_tasks: usize,
    pub max_len: usize,
    /// Forward rows (one per choice) and tokens they read.
    pub requests: usize,
    pub tokens: usize,
    /// Routed models: skip rates and executed FLOPs fraction over the scored inputs.
    pub sparsity: Option<SparsityReport>,
    pub seconds: f64,
    pub items: Vec<ItemResult>,
}

impl TaskResult {
    pub fn from_items(items: Vec<ItemResult>, max_len: usize, requests: usize, tokens: usize, sparsity: Option<SparsityReport>, seconds: f64) -> Self {
        let (acc, acc_stderr) = mean_and_stderr(items.iter().map(|i| i.pred == i.gold));
        let (acc_norm, acc_norm_stderr) = mean_and_stderr(items.iter().map(|i| i.pred_norm == i.gold));
        let chance = items.iter().map(|i| 1.0 / i.loglik.len() as f64).sum::<f64>() / items.len().max(1) as f64;
        Self {
            tasks: items.len(),
            acc,
            acc_stderr,
            acc_norm,
            acc_norm_stderr,
            chance,
            truncated_tasks: items.iter().filter(|i| i.truncated_tokens > 0).count(),
            max_len,
            requests,
            tokens,
            sparsity,
            seconds,
            items,
        }
    }
}

struct Request {
    task: usize,
    choice: usize,
    /// Model input and targets (the full sequence shifted by one), after left truncation.
    ids: Vec<i64>,
    n_cont: usize,
    truncated: usize,
}

/// Scores `tasks` with `m`: every choice's log-likelihood, `acc` and `acc_norm`.
pub fn evaluate_tasks(m: &RoutedModel, tok: &Tokenizer, tasks: &[McTask], cfg: &TaskConfig) -> Result<TaskResult> {
    let t0 = std::time::Instant::now();
    ensure!(!tasks.is_empty(), "no tasks to evaluate");
    ensure!(cfg.batch >= 1, "--batch must be at least 1");
    let ctx = m.model().config.max_position_embeddings as usize;
    let max_len = cfg.max_len.unwrap_or(ctx);
    ensure!(max_len >= 1 && max_len <= ctx, "the longest input ({max_len}) must be between 1 and the model's context ({ctx})");
    let eos = eos_id(m)?;
    let mut reqs = vec![];
    for (ti, t) in tasks.iter().enumerate() {
        ensure!(t.gold < t.choices.len(), "task {ti}: gold {} is out of range for {} choices", t.gold, t.choices.len());
        for (ci, c) in t.choices.iter().enumerate() {
            let e = encode_request(tok, eos, &t.context, c)?;
            let n_cont = e.continuation.len();
            ensure!(n_cont >= 1, "task {ti}, choice {ci}: the continuation has no tokens");
            ensure!(n_cont <= max_len, "task {ti}, choice {ci}: the continuation alone has {n_cont} tokens, more than the model reads at once ({max_len})");
            let mut full = e.context;
            full.extend(e.continuation);
            // The model reads all but the last token; keep the last max_len + 1.
            let truncated = full.len().saturating_sub(max_len + 1);
            reqs.push(Request { task: ti, choice: ci, ids: full[truncated..].to_vec(), n_cont, truncated });
        }
    }
    // Longest first, so that each batch pads little.
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(reqs[i].ids.len()));
    let routed = m.routing.config.variant != Variant::Dense;
    let mut meter = SparsityMeter::default();
    let mut loglik: Vec<Vec<f64>> = tasks.iter().map(|t| vec![0.0; t.choices.len()]).collect();
    let mut n_tokens: Vec<Vec<usize>> = tasks.iter().map(|t| vec![0; t.choices.len()]).collect();
    let mut truncated = vec![0usize; tasks.len()];
    let mut tokens_read = 0;
    for chunk in order.chunks(cfg.batch) {
        let t = chunk.iter().map(|&i| reqs[i].ids.len() - 1).max().unwrap_or(0);
        let b = chunk.len();
        let mut inputs = vec![0i64; b * t];
        let mut targets = vec![0i64; b * t];
        let mut valid = vec![0f32; b * t];
        let mut scored = vec![0f64; b * t];
        for (r, &i) in chunk.iter().enumerate() {
            let q = &reqs[i];
            let len = q.ids.len() - 1;
            for j in 0..len {
                inputs[r * t + j] = q.ids[j];
                targets[r * t + j] = q.ids[j + 1];
                valid[r * t + j] = 1.0;
                if j >= len - q.n_cont {
                    scored[r * t + j] = 1.0;
                }
            }
            tokens_read += len;
        }
        let shape = [b as i64, t as i64];
        let scored = Tensor::from_slice(&scored).view(shape);
        let lp = target_logprobs(
            m,
            &Tensor::from_slice(&inputs).view(shape),
            &Tensor::from_slice(&targets).view(shape),
            &Tensor::from_slice(&valid).view(shape),
            &scored,
            routed.then_some(&mut meter),
        )?;
        let sums = Vec::<f64>::try_from((lp.to_kind(Kind::Double) * scored).sum_dim_intlist(1, false, Kind::Double))?;
        for (r, &i) in chunk.iter().enumerate() {
            let q = &reqs[i];
            loglik[q.task][q.choice] = sums[r];
            n_tokens[q.task][q.choice] = q.n_cont;
            truncated[q.task] = truncated[q.task].max(q.truncated);
        }
    }
    let items = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| ItemResult::new(t.gold, loglik[i].clone(), t.choices.iter().map(|c| c.len()).collect(), n_tokens[i].clone(), truncated[i]))
        .collect();
    Ok(TaskResult::from_items(items, max_len, reqs.len(), tokens_read, routed.then(|| meter.report()), t0.elapsed().as_secs_f64()))
}

/// Scores a JSONL task file with `m`, using the tokenizer the model folder ships.
pub fn evaluate_task_file(m: &RoutedModel, tasks: &Path, limit: Option<usize>, cfg: &TaskConfig) -> Result<TaskResult> {
    let tok = m.pretrained.tokenizer.as_ref().context("the model has no tokenizer.json, which multiple-choice scoring needs")?;
    let t = read_tasks(tasks, limit)?;
    evaluate_tasks(m, tok, &t, cfg)
}

/// A task result with what was evaluated.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskReport {
    pub model_dir: PathBuf,
    pub routing_dir: Option<PathBuf>,
    pub variant: String,
    pub tasks_file: PathBuf,
    pub device: String,
    pub dtype: String,
    #[serde(flatten)]
    pub result: TaskResult,
}

// ---------------------------------------------------------------------------------------------
// Cloze tasks from held-out text.

/// How cloze tasks are cut from documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClozeConfig {
    /// Number of tasks.
    pub tasks: usize,
    /// Words of context before the gap.
    pub context_words: usize,
    /// Words in every choice.
    pub continuation_words: usize,
    /// Wrong choices per task (taken from the same document).
    pub distractors: usize,
    pub seed: u64,
}

impl Default for ClozeConfig {
    /// 500 tasks of 32 context words, 2-word choices, 3 choices (chance 1/3): measured on the
    /// Debian-docs test split, dense testbed-tiny scores about 0.48 and testbed-small about 0.75
    /// (README); 4 choices put testbed-tiny barely above 0.40, 6-word choices near chance.
    fn default() -> Self {
        Self { tasks: 500, context_words: 32, continuation_words: 2, distractors: 2, seed: 0 }
    }
}

/// A cloze task as written: the task fields plus where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClozeTask {
    pub context: String,
    pub choices: Vec<String>,
    pub gold: usize,
    /// Document name.
    pub doc: String,
    /// Index of the first context word in the document.
    pub word: usize,
}

/// SplitMix64: a small, fully specified generator, so the same seed gives the same tasks on
/// every platform and version.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        ((self.next() as u128 * n as u128) >> 64) as usize
    }
}

/// Byte ranges of the whitespace-separated words of `text`.
fn word_spans(text: &str) -> Vec<(usize, usize)> {
    let mut out = vec![];
    let mut start = None;
    for (i, c) in text.char_indices() {
        match (c.is_whitespace(), start) {
            (true, Some(s)) => {
                out.push((s, i));
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((s, text.len()));
    }
    out
}

/// A choice: `" " + words joined by single spaces`.
fn span_text(text: &str, words: &[(usize, usize)], from: usize, n: usize) -> String {
    let mut s = String::new();
    for &(a, b) in &words[from..from + n] {
        s.push(' ');
        s.push_str(&text[a..b]);
    }
    s
}

/// A plain prose word: lowercase letters, optionally followed by one `.`, `,`, `;` or `:`.
/// Choices made only of such words keep identifiers, numbers, markup and names (whose
/// likelihood varies wildly and says little about the context) out of the comparison.
fn plain_word(w: &str) -> bool {
    let core = w.strip_suffix(['.', ',', ';', ':']).unwrap_or(w);
    !core.is_empty() && core.chars().all(|c| c.is_alphabetic() && c.is_lowercase())
}

fn plain_words(text: &str, words: &[(usize, usize)]) -> bool {
    words.iter().all(|&(a, b)| plain_word(&text[a..b]))
}

/// Letters make up at least half of the non-space characters (skips tables, rulers, code
/// dumps, where a continuation could not be told from a distractor by anyone).
fn mostly_letters(s: &str) -> bool {
    let (mut letters, mut all) = (0, 0);
    for c in s.chars().filter(|c| !c.is_whitespace()) {
        all += 1;
        if c.is_alphabetic() {
            letters += 1;
        }
    }
    all > 0 && 2 * letters >= all
}

/// Distractor byte lengths must be within this factor of the true continuation's.
const LENGTH_RATIO: f64 = 1.25;

/// Builds cloze tasks from `docs`: the context is `context_words` words of a document (its
/// original text, at least half letters), the right choice the next `continuation_words`
/// words, and each distractor a span of as many words, of similar byte length (within 1.25x),
/// from elsewhere in the same document (not overlapping the context, the right choice, the
/// words right after it, or each other). Choices consist of plain lowercase words and are
/// written as `" " + words joined by single spaces`. The right choice sits at a random index.
/// Deterministic in the seed and the documents.
pub fn build_cloze(docs: &[Document], cfg: &ClozeConfig) -> Result<Vec<ClozeTask>> {
    let (n, m, k) = (cfg.context_words, cfg.continuation_words, cfg.distractors);
    ensure!(n >= 1 && m >= 1, "cloze tasks need at least one context word and one continuation word");
    ensure!(k >= 1, "cloze tasks need at least one distractor");
    ensure!(cfg.tasks >= 1, "ask for at least one cloze task");
    let words: Vec<Vec<(usize, usize)>> = docs.iter().map(|d| word_spans(&d.text)).collect();
    // A document must hold the context, the answer, a gap after it and k distractor spans,
    // with some room to choose.
    let need = n + 2 * m + 2 * k * m;
    let eligible: Vec<usize> = (0..docs.len()).filter(|&i| words[i].len() >= need).collect();
    ensure!(!eligible.is_empty(), "no document has the {need} words a cloze task of {n} + {m} words with {k} distractors needs");
    // Documents are drawn in proportion to their task positions, so every position of the
    // eligible text is equally likely.
    let positions: Vec<usize> = eligible.iter().map(|&i| words[i].len() - n - m + 1).collect();
    let total: usize = positions.iter().sum();
    let mut rng = SplitMix64(cfg.seed ^ 0x5EED_C102_E000_0000);
    let mut used = std::collections::HashSet::new();
    let mut out = vec![];
    let max_attempts = 50 * cfg.tasks + 1000;
    for _ in 0..max_attempts {
        if out.len() == cfg.tasks {
            break;
        }
        let mut r = rng.below(total);
        let mut di = 0;
        while r >= positions[di] {
            r -= positions[di];
            di += 1;
        }
        let (d, p) = (eligible[di], r);
        if !used.insert((d, p)) {
            continue;
        }
        let text = &docs[d].text;
        let w = &words[d];
        let context = text[w[p].0..w[p + n - 1].1].to_string();
        let answer = span_text(text, w, p + n, m);
        if !plain_words(text, &w[p + n..p + n + m]) || !mostly_letters(&context) {
            continue;
        }
        // Distractor starts: spans [s, s+m) clear of [p, p + n + 2m).
        let blocked = |s: usize| s + m > p && s < p + n + 2 * m;
        let mut starts: Vec<usize> = (0..=w.len() - m).filter(|&s| !blocked(s)).collect();
        let alen = answer.len() as f64;
        let mut picked: Vec<(usize, String)> = vec![];
        // Visit the candidates in a seeded random order (partial Fisher-Yates).
        let mut i = 0;
        while picked.len() < k && i < starts.len() {
            let j = i + rng.below(starts.len() - i);
            starts.swap(i, j);
            let s = starts[i];
            i += 1;
            if picked.iter().any(|(q, _)| s + m > *q && s < q + m) {
                continue;
            }
            let t = span_text(text, w, s, m);
            let ratio = t.len() as f64 / alen;
            if !(1.0 / LENGTH_RATIO..=LENGTH_RATIO).contains(&ratio) || !plain_words(text, &w[s..s + m]) || t == answer || picked.iter().any(|(_, x)| *x == t) {
                continue;
            }
            picked.push((s, t));
        }
        if picked.len() < k {
            continue;
        }
        let gold = rng.below(k + 1);
        let mut choices: Vec<String> = picked.into_iter().map(|(_, t)| t).collect();
        choices.insert(gold, answer);
        out.push(ClozeTask { context, choices, gold, doc: docs[d].name.clone(), word: p });
    }
    ensure!(
        out.len() == cfg.tasks,
        "could only build {} of {} cloze tasks from {} eligible documents: use fewer tasks, shorter spans or a larger split",
        out.len(),
        cfg.tasks,
        eligible.len()
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch folder removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let p = std::env::temp_dir().join(format!("wide-eval-test-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn parser_accepts_tasks_and_ignores_extra_fields() {
        let t = parse_task(r#"{"context": "a b", "choices": [" c", " d"], "gold": 1, "id": "x7"}"#).unwrap();
        assert_eq!(t, McTask { context: "a b".into(), choices: vec![" c".into(), " d".into()], gold: 1 });
    }

    #[test]
    fn parser_errors_say_what_is_wrong() {
        let cases = [
            ("{\"context\": \"a\", \"choices\": [\" b\"], \"gold\": 0", "not valid JSON"),
            ("[1, 2]", "expected a JSON object"),
            (r#"{"choices": [" b"], "gold": 0}"#, "missing \"context\""),
            (r#"{"context": 3, "choices": [" b"], "gold": 0}"#, "\"context\" must be a string"),
            (r#"{"context": "a", "gold": 0}"#, "missing \"choices\""),
            (r#"{"context": "a", "choices": " b", "gold": 0}"#, "\"choices\" must be a list"),
            (r#"{"context": "a", "choices": [], "gold": 0}"#, "\"choices\" is empty"),
            (r#"{"context": "a", "choices": [" b", 4], "gold": 0}"#, "choice 1 is not a string"),
            (r#"{"context": "a", "choices": [" b", ""], "gold": 0}"#, "choice 1 is an empty string"),
            (r#"{"context": "a", "choices": [" b"]}"#, "missing \"gold\""),
            (r#"{"context": "a", "choices": [" b"], "gold": -1}"#, "non-negative integer"),
            (r#"{"context": "a", "choices": [" b"], "gold": "0"}"#, "non-negative integer"),
            (r#"{"context": "a", "choices": [" b", " c"], "gold": 2}"#, "\"gold\" is 2 but there are only 2 choices"),
        ];
        for (line, want) in cases {
            let e = format!("{:#}", parse_task(line).unwrap_err());
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn file_errors_name_file_and_line() {
        let dir = TempDir::new("tasks");
        let p = dir.0.join("t.jsonl");
        std::fs::write(&p, "{\"context\": \"a\", \"choices\": [\" b\"], \"gold\": 0}\n\n{\"context\": \"a\", \"choices\": [\" b\"], \"gold\": 3}\n").unwrap();
        let e = format!("{:#}", read_tasks(&p, None).unwrap_err());
        assert!(e.contains("t.jsonl line 3") && e.contains("\"gold\" is 3 but there are only 1 choices"), "{e}");
        // The limit stops before the bad line.
        assert_eq!(read_tasks(&p, Some(1)).unwrap().len(), 1);
        assert!(format!("{:#}", read_tasks(&p, Some(0)).unwrap_err()).contains("--limit must be at least 1"));
        std::fs::write(&p, "\n").unwrap();
        assert!(format!("{:#}", read_tasks(&p, None).unwrap_err()).contains("holds no tasks"));
        assert!(format!("{:#}", read_tasks(&dir.0.join("none.jsonl"), None).unwrap_err()).contains("cannot read task file"));
    }

    #[test]
    fn acc_and_acc_norm_arithmetic() {
        // Choice 0 is longer: higher total log-likelihood loses to choice 1 per byte.
        let a = ItemResult::new(1, vec![-10.0, -6.0], vec![20, 4], vec![5, 2], 0);
        assert_eq!((a.pred, a.pred_norm), (1, 0));
        let b = ItemResult::new(0, vec![-3.0, -4.0, -3.0], vec![3, 8, 6], vec![1, 1, 1], 0);
        // Ties go to the first maximum; per byte: -1, -0.5, -0.5.
        assert_eq!((b.pred, b.pred_norm), (0, 1));
        // Per byte -0.4 against -3: only acc_norm gets this one.
        let c = ItemResult::new(0, vec![-4.0, -3.0], vec![10, 1], vec![3, 1], 4);
        assert_eq!((c.pred, c.pred_norm), (1, 0));
        let r = TaskResult::from_items(vec![a, b, c], 256, 7, 100, None, 0.0);
        assert!((r.acc - 2.0 / 3.0).abs() < 1e-12, "{}", r.acc);
        assert!((r.acc_norm - 1.0 / 3.0).abs() < 1e-12, "{}", r.acc_norm);
        // Sample std of (1, 1, 0) is sqrt(1/3); stderr sqrt(1/3)/sqrt(3) = 1/3.
        assert!((r.acc_stderr - 1.0 / 3.0).abs() < 1e-12, "{}", r.acc_stderr);
        assert!((r.chance - (0.5 + 1.0 / 3.0 + 0.5) / 3.0).abs() < 1e-12);
        assert_eq!(r.truncated_tasks, 1);
    }

    fn doc(name: &str, text: String) -> Document {
        Document { source: "test".into(), name: name.into(), text }
    }

    /// A word made of letters that names its document and index: `docBwordACD`.
    fn tag(d: usize, i: usize) -> String {
        let l = |x: usize| (b'a' + x as u8) as char;
        format!("doc{}word{}{}{}", l(d), l(i / 676), l(i / 26 % 26), l(i % 26))
    }

    fn untag(w: &str) -> (usize, usize) {
        let b = w.as_bytes();
        assert!(w.starts_with("doc") && &w[4..8] == "word", "{w}");
        let v = |k: usize| (b[k] - b'a') as usize;
        (v(3), v(8) * 676 + v(9) * 26 + v(10))
    }

    /// Documents whose words say which document they are from.
    fn docs() -> Vec<Document> {
        (0..4)
            .map(|d| {
                let words: Vec<String> = (0..60 + 30 * d).map(|i| tag(d, i)).collect();
                doc(&format!("doc{d}"), words.join(if d % 2 == 0 { " " } else { "\n" }))
            })
            .collect()
    }

    #[test]
    fn cloze_distractors_come_from_the_same_document_and_do_not_overlap() {
        let cfg = ClozeConfig { tasks: 40, context_words: 10, continuation_words: 3, distractors: 3, seed: 5 };
        let docs = docs();
        let tasks = build_cloze(&docs, &cfg).unwrap();
        assert_eq!(tasks.len(), 40);
        let index = untag;
        let mut golds = [0usize; 4];
        for t in &tasks {
            assert_eq!(t.choices.len(), 4);
            golds[t.gold] += 1;
            let ctx: Vec<&str> = t.context.split_whitespace().collect();
            assert_eq!(ctx.len(), 10);
            let (d, first) = index(ctx[0]);
            assert_eq!(format!("doc{d}"), t.doc);
            assert_eq!(first, t.word);
            // The original text of the document, newlines included.
            assert!(docs[d].text.contains(&t.context));
            let starts: Vec<usize> = t
                .choices
                .iter()
                .map(|c| {
                    assert!(c.starts_with(' ') && !c.starts_with("  "));
                    let ws: Vec<&str> = c.split(' ').skip(1).collect();
                    assert_eq!(ws.len(), 3);
                    let (cd, s) = index(ws[0]);
                    assert_eq!(cd, d, "a distractor from another document: {t:?}");
                    for (k, w) in ws.iter().enumerate() {
                        assert_eq!(index(w), (d, s + k), "choices are consecutive words");
                    }
                    s
                })
                .collect();
            assert_eq!(starts[t.gold], t.word + 10, "the right choice continues the context");
            for (i, &s) in starts.iter().enumerate() {
                if i != t.gold {
                    assert!(s + 3 <= t.word || s >= t.word + 10 + 6, "distractor overlaps the context or the answer: {t:?}");
                }
                for &o in &starts[i + 1..] {
                    assert!(s + 3 <= o || o + 3 <= s, "choices overlap: {t:?}");
                }
            }
        }
        // The right choice's index is spread over the positions.
        assert!(golds.iter().all(|&g| g >= 4), "{golds:?}");
    }

    #[test]
    fn cloze_is_deterministic_by_seed() {
        let docs = docs();
        let cfg = ClozeConfig { tasks: 20, context_words: 8, continuation_words: 2, distractors: 2, seed: 1 };
        let a = build_cloze(&docs, &cfg).unwrap();
        assert_eq!(a, build_cloze(&docs, &cfg).unwrap());
        let b = build_cloze(&docs, &ClozeConfig { seed: 2, ..cfg }).unwrap();
        assert_ne!(a, b);
        // Written tasks read back as tasks of the harness format.
        let dir = TempDir::new("cloze");
        let p = dir.0.join("cloze.jsonl");
        write_jsonl(&p, &a).unwrap();
        let back = read_tasks(&p, None).unwrap();
        assert_eq!(back.len(), 20);
        assert_eq!(back[3], McTask { context: a[3].context.clone(), choices: a[3].choices.clone(), gold: a[3].gold });
    }

    #[test]
    fn cloze_refuses_impossible_requests() {
        let short = vec![doc("a", "one two three".into())];
        let e = format!("{:#}", build_cloze(&short, &ClozeConfig::default()).unwrap_err());
        assert!(e.contains("no document has the"), "{e}");
        let docs = docs();
        let e = format!("{:#}", build_cloze(&docs, &ClozeConfig { tasks: 100_000, context_words: 8, continuation_words: 2, distractors: 2, seed: 0 }).unwrap_err());
        assert!(e.contains("could only build"), "{e}");
    }

    #[test]
    fn distractor_lengths_are_similar() {
        // Words of very different lengths: distractors must stay within the length ratio.
        let words: Vec<String> = (0..400).map(|i| "x".repeat(1 + (i * 7919) % 13)).collect();
        let docs = vec![doc("v", words.join(" "))];
        let tasks = build_cloze(&docs, &ClozeConfig { tasks: 30, context_words: 5, continuation_words: 4, distractors: 3, seed: 9 }).unwrap();
        for t in tasks {
            let a = t.choices[t.gold].len() as f64;
            for c in &t.choices {
                let r = c.len() as f64 / a;
                assert!((1.0 / LENGTH_RATIO..=LENGTH_RATIO).contains(&r), "{t:?}");
            }
        }
    }
}
