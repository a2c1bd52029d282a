//! Byte-level BPE tokenizers trained on a corpus with the `tokenizers` crate, saved as a
//! standard `tokenizer.json` that Python `tokenizers` and `transformers` load.
use anyhow::{anyhow, bail, Result};
use std::path::Path;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerImpl};
use wide_core::Tokenizer;

/// The end-of-text token placed between documents; id 0 in tokenizers trained here.
pub const EOS_TOKEN: &str = "<|endoftext|>";

/// Trains a byte-level BPE with `vocab_size` entries (256 byte symbols, the EOS token and the
/// learned merges) on `texts` and writes it to `out` (through a temporary file).
pub fn train_bpe<'a>(texts: impl Iterator<Item = &'a str> + Send, vocab_size: usize, out: &Path) -> Result<Tokenizer> {
    if vocab_size < 300 {
        bail!("vocabulary size {vocab_size} is too small for a byte-level BPE (at least 300: 256 bytes, EOS and some merges)");
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .special_tokens(vec![AddedToken::from(EOS_TOKEN, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel> = TokenizerImpl::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    tok.train(&mut trainer, texts).map_err(|e| anyhow!("training the BPE tokenizer failed: {e}"))?;
    let tok: tokenizers::Tokenizer = tok.into();
    let t = Tokenizer::from_inner(tok);
    if t.token_id(EOS_TOKEN) != Some(0) {
        bail!("internal error: {EOS_TOKEN} did not get id 0");
    }
    let tmp = wide_core::safetensors::tmp_path(out);
    t.save(&tmp)?;
    std::fs::rename(&tmp, out)?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trains_merges_and_roundtrips() {
        let dir = tempfile::tempdir().unwrap();
        let text = "the kernel schedules the thread; the thread runs the kernel code. ".repeat(50);
        let docs = vec![text.as_str(); 20];
        let t = train_bpe(docs.into_iter(), 400, &dir.path().join("tokenizer.json")).unwrap();
        assert!(t.vocab_size() > 257 && t.vocab_size() <= 400, "{}", t.vocab_size());
        let s = "the kernel runs ünïcode";
        let ids = t.encode(s, true).unwrap();
        assert!(ids.len() < s.len(), "merges should shorten the text");
        assert_eq!(t.decode(&ids, false).unwrap(), s);
        assert!(format!("{:#}", train_bpe(std::iter::once("x"), 10, &dir.path().join("t2.json")).err().unwrap()).contains("too small"));
    }
}
