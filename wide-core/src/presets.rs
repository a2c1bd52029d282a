//! Built-in model shapes: random-weight models for the demo, tests and benchmarks.
use crate::config::{Family, ModelConfig, RopeScaling};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// Names accepted by [`preset`].
pub const PRESETS: [&str; 2] = ["tiny", "llama-3.1-8b"];

/// A model shape by name. `tiny` is a 2-layer GQA model with a byte-level vocabulary; the
/// `llama-3.1-8b` shape is that of Llama 3.1 8B (for random-weight benchmarks).
pub fn preset(name: &str) -> Result<ModelConfig> {
    let llama = |vocab, hidden, inter, layers, heads, kv, head_dim, ctx, theta, scaling, tie| ModelConfig {
        family: Family::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim,
        rms_norm_eps: 1e-5,
        rope_theta: theta,
        rope_scaling: scaling,
        max_position_embeddings: ctx,
        tie_word_embeddings: tie,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        sliding_window: vec![None; layers as usize],
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
    };
    Ok(match name {
        "tiny" => {
            let mut c = llama(BYTE_VOCAB, 128, 384, 2, 4, 2, 32, 512, 10000.0, RopeScaling::Default, true);
            c.bos_token_id = Some(BOS_ID);
            c.eos_token_ids = vec![EOS_ID];
            c
        }
        "llama-3.1-8b" => {
            let mut c = llama(
                128256,
                4096,
                14336,
                32,
                32,
                8,
                128,
                131072,
                500000.0,
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0,
                },
                false,
            );
            c.bos_token_id = Some(128000);
            c.eos_token_ids = vec![128001, 128008, 128009];
            c
        }
        other => bail!("unknown model preset {other:?}; known presets: {}", PRESETS.join(", ")),
    })
}

/// 256 byte tokens plus BOS and EOS.
pub const BYTE_VOCAB: i64 = 258;
pub const BOS_ID: i64 = 256;
pub const EOS_ID: i64 = 257;

/// A byte-level tokenizer (every byte one token, no merges) with `<s>` and `</s>`.
pub fn byte_level_tokenizer() -> Result<Tokenizer> {
    let mut chars: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    chars.sort_by_key(|c| *c as u32);
    let vocab: Vocab = chars.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, vec![]).build().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.add_special_tokens(&[AddedToken::from("<s>", true), AddedToken::from("</s>", true)]);
    let t = Tokenizer::from_inner(tok);
    debug_assert_eq!(t.token_id("<s>"), Some(BOS_ID));
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_roundtrips_utf8() {
        let t = byte_level_tokenizer().unwrap();
        assert_eq!(t.token_id("<s>"), Some(BOS_ID));
        assert_eq!(t.token_id("</s>"), Some(EOS_ID));
        let text = "Grüße, world — ok";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(ids.len(), text.len());
        assert_eq!(t.decode(&ids, true).unwrap(), text);
    }

    #[test]
    fn presets_are_valid() {
        for p in PRESETS {
            preset(p).unwrap().validate().unwrap();
        }
        assert!(preset("nope").is_err());
    }
}
