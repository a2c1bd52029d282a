//! `tokenizer.json` through the `tokenizers` crate.
use anyhow::{anyhow, Context, Result};
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            anyhow::bail!("tokenizer file {} does not exist", path.display());
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        Ok(Self { inner })
    }

    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`, with the tokenizer's special tokens (e.g. BOS) when it adds them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner.decode(&ids, skip_special_tokens).map_err(|e| anyhow!("detokenizing failed: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(|i| i as i64)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(|e| anyhow!("saving tokenizer: {e}")).with_context(|| path.display().to_string())
    }
}

/// Streams decoded text as tokens arrive: decodes the whole continuation each time and emits
/// the new suffix, so multi-byte characters split across tokens come out whole.
pub struct TextStream {
    ids: Vec<i64>,
    emitted: usize,
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

impl TextStream {
    pub fn new() -> Self {
        Self { ids: vec![], emitted: 0 }
    }
    /// Adds a token; returns the text that became final.
    pub fn push(&mut self, tok: &Tokenizer, id: i64) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids, true)?;
        // Hold back an incomplete UTF-8 sequence (shown as U+FFFD) until the next token.
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = text.len();
        Ok(new)
    }
}
