//! Perplexity of a dense or routed model on a corpus split or a text file.
//!
//! The text becomes one token stream (a corpus split: each document tokenized on its own and
//! followed by EOS, the way the testbed models were trained; a text file: tokenized whole).
//! The stream is read in windows of `seq_len` tokens whose starts are `stride` apart. Each
//! window scores only the tokens that no earlier window scored, so with `stride < seq_len`
//! every scored token sees at least `seq_len - stride` tokens of context (the usual strided
//! perplexity); with `stride == seq_len` the windows are disjoint and the first token of each
//! window, having no context inside it, is not scored. Windows are batched; the last, shorter
//! window is right-padded and padding is excluded from the loss and from the skip statistics.
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};
use wide_core::routing::{GateMode, RoutingConfig, RoutingRun, SparsityMeter, SparsityReport, Variant};
use wide_core::{Logits, Tokenizer};
use wide_train::calibrate::RoutedModel;
use wide_train::corpus::{read_split, Split};

/// Loads a model folder for evaluation: dense, or with the routers (and LoRA) of a stage 1 /
/// stage 2 routing folder. Gates run in inference (deterministic) mode.
pub fn load_model(model_dir: &Path, routing_dir: Option<&Path>, device: Device, kind: Kind) -> Result<RoutedModel> {
    let m = match routing_dir {
        Some(r) => RoutedModel::load(model_dir, r, device, kind)?,
        None => RoutedModel::new(model_dir, &RoutingConfig::new(Variant::Dense), device, kind)?,
    };
    if let Some((l, _)) = &m.lora {
        l.set_training(false);
    }
    Ok(m)
}

/// The tokenizer a model folder ships (`tokenizer.json`), which evaluation needs.
pub fn model_tokenizer<'a>(m: &'a RoutedModel, model_dir: &Path) -> Result<&'a Tokenizer> {
    m.pretrained
        .tokenizer
        .as_ref()
        .with_context(|| format!("{} has no tokenizer.json, which evaluation needs to tokenize text", model_dir.display()))
}

/// The model's EOS id: the first of `config.json`'s `eos_token_id`.
pub fn eos_id(m: &RoutedModel) -> Result<i64> {
    m.model().config.eos_token_ids.first().copied().context("the model's config.json names no eos_token_id, which joins documents and stands in for an empty context")
}

/// Where evaluation text comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextSource {
    /// One split of a corpus folder (`wide corpus`): documents joined with EOS.
    Corpus { dir: PathBuf, split: Split },
    /// A UTF-8 text file, tokenized whole.
    File(PathBuf),
}

impl TextSource {
    pub fn describe(&self) -> String {
        match self {
            TextSource::Corpus { dir, split } => format!("{} ({} split)", dir.display(), split.name()),
            TextSource::File(p) => p.display().to_string(),
        }
    }
}

/// The token stream of `src` under `tok` (no BOS; EOS after every corpus document).
pub fn source_tokens(tok: &Tokenizer, eos: i64, src: &TextSource) -> Result<Vec<i64>> {
    let ids = match src {
        TextSource::Corpus { dir, split } => {
            let docs = read_split(dir, *split)?;
            ensure!(!docs.is_empty(), "the {} split of {} has no documents", split.name(), dir.display());
            let mut ids = vec![];
            for d in &docs {
                ids.extend(tok.encode(&d.text, false)?);
                ids.push(eos);
            }
            ids
        }
        TextSource::File(p) => {
            let bytes = std::fs::read(p).with_context(|| format!("cannot read text file {}", p.display()))?;
            let text = String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("{} is not UTF-8 text (invalid byte at offset {})", p.display(), e.utf8_error().valid_up_to()))?;
            tok.encode(&text, false)?
        }
    };
    ensure!(ids.len() >= 2, "{} has {} token(s); perplexity needs at least 2", src.describe(), ids.len());
    Ok(ids)
}

/// One evaluation window over the token stream: tokens `[begin, end)` are read, and the
/// tokens `[score_from, end)` are scored (each predicted from the tokens before it in the
/// window). `begin < score_from < end` always holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub begin: usize,
    pub end: usize,
    pub score_from: usize,
}

impl Window {
    pub fn len(&self) -> usize {
        self.end - self.begin
    }
    pub fn is_empty(&self) -> bool {
        self.end == self.begin
    }
    pub fn scored(&self) -> usize {
        self.end - self.score_from
    }
}

/// Windows of at most `seq_len` tokens starting every `stride` tokens over a stream of
/// `n_tokens`, each scoring only what earlier windows did not; the last window ends at the end
/// of the stream. Windows that would score nothing are left out.
pub fn windows(n_tokens: usize, seq_len: usize, stride: usize) -> Result<Vec<Window>> {
    ensure!(seq_len >= 2, "the window length (--seq-len) must be at least 2 tokens, got {seq_len}");
    ensure!(stride >= 1 && stride <= seq_len, "--stride must be between 1 and --seq-len ({seq_len}), got {stride}: a larger stride would skip tokens");
    let mut out = vec![];
    let (mut begin, mut prev_end) = (0usize, 0usize);
    while begin < n_tokens {
        let end = (begin + seq_len).min(n_tokens);
        let score_from = prev_end.max(begin + 1);
        if score_from < end {
            out.push(Window { begin, end, score_from });
        }
        prev_end = end;
        if end == n_tokens {
            break;
        }
        begin += stride;
    }
    Ok(out)
}

/// A right-padded batch of windows: model inputs, targets, the valid-input mask and the
/// scored-target mask, all `[B, T]` with `T` the longest window's length minus one.
pub struct WindowBatch {
    pub inputs: Tensor,
    pub targets: Tensor,
    /// f32, 1 where the input position holds a real token.
    pub valid: Tensor,
    /// f32, 1 where the target at that position counts in the loss.
    pub scored: Tensor,
}

/// Builds the batch for `ws` over `tokens`, padding with `pad` (any valid id: padded positions
/// follow every real one, so causal attention keeps them out of real positions' outputs, and
/// both masks exclude them).
pub fn window_batch(tokens: &[i64], ws: &[Window], pad: i64) -> WindowBatch {
    let t = ws.iter().map(|w| w.len() - 1).max().unwrap_or(0);
    let b = ws.len();
    let mut inputs = vec![pad; b * t];
    let mut targets = vec![pad; b * t];
    let mut valid = vec![0f32; b * t];
    let mut scored = vec![0f32; b * t];
    for (r, w) in ws.iter().enumerate() {
        for j in 0..w.len() - 1 {
            let i = r * t + j;
            inputs[i] = tokens[w.begin + j];
            targets[i] = tokens[w.begin + j + 1];
            valid[i] = 1.0;
            if w.begin + j + 1 >= w.score_from {
                scored[i] = 1.0;
            }
        }
    }
    let shape = [b as i64, t as i64];
    WindowBatch {
        inputs: Tensor::from_slice(&inputs).view(shape),
        targets: Tensor::from_slice(&targets).view(shape),
        valid: Tensor::from_slice(&valid).view(shape),
        scored: Tensor::from_slice(&scored).view(shape),
    }
}

/// Rows of LM-head logits computed at once (bounds memory for large vocabularies).
const LOGIT_ROWS: i64 = 2048;

/// Log-probability of each target given the inputs up to and including its position:
/// `inputs, targets: [B, T]` i64, `valid: [B, T]` f32 (1 = real token; padding must follow
/// every real token of its row), `scored: [B, T]` (nonzero where the log-probability is
/// wanted) -> `[B, T]` f32 on the CPU, 0 where not scored. The LM head runs only at scored
/// positions. Routed models gate deterministically; their skip statistics over valid tokens
/// go to `meter`.
pub fn target_logprobs(m: &RoutedModel, inputs: &Tensor, targets: &Tensor, valid: &Tensor, scored: &Tensor, meter: Option<&mut SparsityMeter>) -> Result<Tensor> {
    let _g = tch::no_grad_guard();
    let model = m.model();
    let dev = model.device;
    let (b, t) = inputs.size2()?;
    for (name, x) in [("targets", targets), ("the valid-token mask", valid), ("the scored mask", scored)] {
        ensure!(x.size() == [b, t], "{name} must be [{b}, {t}] like the inputs, got {:?}", x.size());
    }
    ensure!(t <= model.config.max_position_embeddings, "{t} input tokens exceed the model's context of {}", model.config.max_position_embeddings);
    let valid_d = valid.to_device(dev).to_kind(Kind::Float);
    let mut run = RoutingRun::new(&m.routing, GateMode::Inference, valid_d.shallow_clone());
    // Right padding under causal attention cannot reach real positions, so no padding mask is
    // needed (and the fast causal attention path stays in use).
    let hidden = model.forward_hidden(&inputs.to_device(dev), None, None, None, Some(&mut run))?;
    if let Some(meter) = meter {
        meter.add(&model.config, m.routing.config.variant, &run.stats, &valid_d);
    }
    let idx = scored.to_device(dev).ne(0).reshape([-1]).nonzero().squeeze_dim(-1);
    let n = idx.size()[0];
    let out = Tensor::zeros([b * t], (Kind::Float, dev));
    if n == 0 {
        return Ok(out.view([b, t]).to_device(Device::Cpu));
    }
    let h = hidden.reshape([b * t, -1]).index_select(0, &idx);
    let tg = targets.to_device(dev).reshape([-1]).index_select(0, &idx);
    let mut parts = vec![];
    let mut s = 0;
    while s < n {
        let len = LOGIT_ROWS.min(n - s);
        let logits = model.logits(&h.narrow(0, s, len), Logits::All).to_kind(Kind::Float);
        let picked = logits.gather(-1, &tg.narrow(0, s, len).unsqueeze(-1), false).squeeze_dim(-1);
        parts.push(picked - logits.logsumexp([-1i64].as_slice(), false));
        s += len;
    }
    let lp = out.index_copy(0, &idx, &Tensor::cat(&parts, 0));
    Ok(lp.view([b, t]).to_device(Device::Cpu))
}

/// Window and batch settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerplexityConfig {
    /// Tokens per window (at most the model's context).
    pub seq_len: usize,
    /// Distance between window starts (`seq_len` = disjoint windows).
    pub stride: usize,
    /// Windows per forward.
    pub batch: usize,
}

impl PerplexityConfig {
    /// `seq_len` defaults to the model's context, capped at 2048; `stride` to `seq_len`.
    pub fn resolve(m: &RoutedModel, seq_len: Option<usize>, stride: Option<usize>, batch: usize) -> Result<Self> {
        let ctx = m.model().config.max_position_embeddings as usize;
        let seq_len = seq_len.unwrap_or(ctx.min(2048));
        if seq_len > ctx {
            bail!("--seq-len {seq_len} is longer than the model's context of {ctx} tokens");
        }
        ensure!(batch >= 1, "--batch must be at least 1");
        Ok(Self { seq_len, stride: stride.unwrap_or(seq_len), batch })
    }
}

/// What a perplexity run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PerplexityResult {
    pub seq_len: usize,
    pub stride: usize,
    pub batch: usize,
    /// Tokens in the stream.
    pub tokens: usize,
    pub windows: usize,
    /// Tokens whose log-probability entered the loss.
    pub scored_tokens: usize,
    /// Mean negative log-likelihood per scored token (nats).
    pub loss: f64,
    pub perplexity: f64,
    /// Routed models: deterministic skip rates per router kind and the executed fraction of the
    /// dense FLOPs on this text (padding excluded). `None` for a dense model.
    pub sparsity: Option<SparsityReport>,
    pub seconds: f64,
}

/// Perplexity of `m` over the token stream `tokens`.
pub fn perplexity(m: &RoutedModel, tokens: &[i64], cfg: &PerplexityConfig) -> Result<PerplexityResult> {
    let t0 = std::time::Instant::now();
    let ctx = m.model().config.max_position_embeddings as usize;
    ensure!(cfg.seq_len <= ctx, "windows of {} tokens do not fit the model's context of {ctx}", cfg.seq_len);
    ensure!(cfg.batch >= 1, "the batch must hold at least one window");
    ensure!(tokens.len() >= 2, "perplexity needs at least 2 tokens, got {}", tokens.len());
    let ws = windows(tokens.len(), cfg.seq_len, cfg.stride)?;
    let mut meter = SparsityMeter::default();
    let routed = m.routing.config.variant != Variant::Dense;
    let (mut nll, mut scored) = (0f64, 0usize);
    for chunk in ws.chunks(cfg.batch) {
        let b = window_batch(tokens, chunk, 0);
        let lp = target_logprobs(m, &b.inputs, &b.targets, &b.valid, &b.scored, routed.then_some(&mut meter))?;
        nll -= (lp.to_kind(Kind::Double) * b.scored.to_kind(Kind::Double)).sum(Kind::Double).double_value(&[]);
        scored += chunk.iter().map(Window::scored).sum::<usize>();
    }
    let loss = nll / scored as f64;
    Ok(PerplexityResult {
        seq_len: cfg.seq_len,
        stride: cfg.stride,
        batch: cfg.batch,
        tokens: tokens.len(),
        windows: ws.len(),
        scored_tokens: scored,
        loss,
        perplexity: loss.exp(),
        sparsity: routed.then(|| meter.report()),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// A perplexity result with what was evaluated.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PerplexityReport {
    pub model_dir: PathBuf,
    pub routing_dir: Option<PathBuf>,
    pub variant: String,
    pub text: TextSource,
    pub device: String,
    pub dtype: String,
    #[serde(flatten)]
    pub result: PerplexityResult,
}

/// Loads the model (and routing folder), tokenizes `text` with the model's tokenizer and
/// measures perplexity. `seq_len` defaults to the model's context (at most 2048), `stride`
/// to `seq_len`.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_perplexity(
    model_dir: &Path,
    routing_dir: Option<&Path>,
    text: &TextSource,
    seq_len: Option<usize>,
    stride: Option<usize>,
    batch: usize,
    device: Device,
    kind: Kind,
) -> Result<PerplexityReport> {
    let m = load_model(model_dir, routing_dir, device, kind)?;
    let cfg = PerplexityConfig::resolve(&m, seq_len, stride, batch)?;
    let tok = model_tokenizer(&m, model_dir)?;
    let tokens = source_tokens(tok, eos_id(&m)?, text)?;
    let result = perplexity(&m, &tokens, &cfg)?;
    Ok(PerplexityReport {
        model_dir: model_dir.to_path_buf(),
        routing_dir: routing_dir.map(Path::to_path_buf),
        variant: m.routing.config.variant.name().to_string(),
        text: text.clone(),
        device: format!("{device:?}"),
        dtype: wide_core::checkpoint::kind_name(kind).to_string(),
        result,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored_positions(n: usize, ws: &[Window]) -> Vec<usize> {
        let mut count = vec![0usize; n];
        for w in ws {
            for c in &mut count[w.score_from..w.end] {
                *c += 1;
            }
        }
        count
    }

    #[test]
    fn strided_windows_score_every_token_but_the_first_exactly_once() {
        for (n, l, s) in [(1000, 128, 64), (1000, 128, 1), (257, 128, 100), (129, 128, 127), (50, 128, 32)] {
            let ws = windows(n, l, s).unwrap();
            let c = scored_positions(n, &ws);
            assert_eq!(c[0], 0);
            assert!(c[1..].iter().all(|&x| x == 1), "n {n} L {l} S {s}: {ws:?}");
            assert_eq!(ws.iter().map(Window::scored).sum::<usize>(), n - 1);
            for w in &ws {
                assert!(w.len() <= l && w.begin < w.score_from && w.score_from < w.end);
                // Every scored token after the first window has at least L - S tokens of context.
                if w.begin > 0 {
                    assert!(w.score_from - w.begin >= l - s, "{w:?}");
                }
            }
            assert_eq!(ws.last().unwrap().end, n);
        }
    }

    #[test]
    fn disjoint_windows_skip_each_windows_first_token() {
        let ws = windows(1000, 100, 100).unwrap();
        assert_eq!(ws.len(), 10);
        assert_eq!(ws[3], Window { begin: 300, end: 400, score_from: 301 });
        assert_eq!(ws.iter().map(Window::scored).sum::<usize>(), 990);
        // A last window of one token scores nothing and is dropped.
        let ws = windows(1001, 100, 100).unwrap();
        assert_eq!(ws.len(), 10);
        let ws = windows(1002, 100, 100).unwrap();
        assert_eq!(ws.last().unwrap(), &Window { begin: 1000, end: 1002, score_from: 1001 });
    }

    #[test]
    fn bad_window_settings_are_refused() {
        assert!(format!("{:#}", windows(100, 10, 11).unwrap_err()).contains("--stride must be between 1 and --seq-len (10)"));
        assert!(format!("{:#}", windows(100, 10, 0).unwrap_err()).contains("--stride"));
        assert!(format!("{:#}", windows(100, 1, 1).unwrap_err()).contains("at least 2"));
    }

    #[test]
    fn padded_batch_masks_padding_and_already_scored_tokens() {
        let tokens: Vec<i64> = (10..30).collect();
        let ws = windows(tokens.len(), 8, 6).unwrap();
        // [0,8) [6,14) [12,20): the last window is full; take a stream that ends short.
        assert_eq!(ws.len(), 3);
        let ws = windows(17, 8, 6).unwrap();
        assert_eq!(ws[2], Window { begin: 12, end: 17, score_from: 14 });
        let b = window_batch(&tokens, &ws, 0);
        assert_eq!(b.inputs.size(), [3, 7]);
        let row = |t: &Tensor, r: i64| Vec::<f32>::try_from(t.get(r).to_kind(Kind::Float)).unwrap();
        assert_eq!(row(&b.inputs, 2), vec![22.0, 23.0, 24.0, 25.0, 0.0, 0.0, 0.0]);
        assert_eq!(row(&b.targets, 2), vec![23.0, 24.0, 25.0, 26.0, 0.0, 0.0, 0.0]);
        assert_eq!(row(&b.valid, 2), vec![1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        // Targets 14..17 of the last window are new; 13 was scored by the window before.
        assert_eq!(row(&b.scored, 2), vec![0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        assert_eq!(row(&b.scored, 1), vec![0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(row(&b.scored, 0), vec![1.0; 7]);
        let total: f64 = b.scored.sum(Kind::Double).double_value(&[]);
        assert_eq!(total as usize, 16);
    }
}
