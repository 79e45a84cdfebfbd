//! SentencePiece vocabularies (GGUF `tokenizer.ggml.model = llama`: Gemma, Llama 2, Mistral) as a
//! `tokenizers` BPE.
//!
//! llama.cpp tokenizes these by merging, again and again, the adjacent pair of pieces whose
//! concatenation is the highest-scoring vocabulary entry. A BPE whose merges are every
//! (left, right) split of each piece, ranked by that piece's score, makes the same choices (it is
//! how Hugging Face converts SentencePiece models to `tokenizer.json`), and it is a
//! `tokenizers::Tokenizer` that a router can load from ModelInfo. Spaces are written `▁`; a
//! character outside the vocabulary falls back to its UTF-8 bytes as `<0xXX>` tokens. Checked
//! token for token against llama.cpp on Gemma 3 (`tests/tokenizer_matches_llama_cpp.rs`).

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::Tokenizer;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Sequence as NormalizerSequence};

use super::TokenKind;

/// How SentencePiece writes a space inside a piece.
const SPACE: char = '▁';

/// Every split of a normal piece into two vocabulary entries, the highest-scoring pieces first:
/// a BPE with these merges, in this order, merges as llama.cpp's SentencePiece tokenizer does.
fn merges_by_score(tokens: &[&str], scores: &[f32], kinds: &[TokenKind]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut ranked: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if kinds[id] != TokenKind::Text {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if ids.contains_key(left) && ids.contains_key(right) {
                ranked.push((scores[id], id, left.len(), left, right));
            }
        }
    }
    // Higher score first; equal scores by piece id, then (splits of one piece) by the left part's length.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked.into_iter().map(|(_, _, _, l, r)| (l.to_owned(), r.to_owned())).collect()
}

fn scores(content: &Content, n_tokens: usize) -> Result<Vec<f32>> {
    let key = "tokenizer.ggml.scores";
    let Some(Value::Array(items)) = content.metadata.get(key) else {
        bail!("GGUF has no {key}: a SentencePiece vocabulary needs its piece scores");
    };
    if items.len() != n_tokens {
        bail!("GGUF `{key}` has {} entries but there are {n_tokens} tokens", items.len());
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| v.to_f32().with_context(|| format!("GGUF `{key}`[{i}] is not a float")))
        .collect()
}

/// The BPE, normalizer and decoder for a SentencePiece vocabulary (added tokens are the caller's).
pub(super) fn tokenizer(content: &Content, tokens: &[&str], kinds: &[TokenKind]) -> Result<Tokenizer> {
    let scores = scores(content, tokens.len())?;
    let merges = merges_by_score(tokens, &scores, kinds);
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .build()
        .map_err(|e| anyhow::anyhow!("building BPE from the SentencePiece vocabulary: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);

    let escape: NormalizerWrapper =
        Replace::new(" ", SPACE.to_string()).map_err(|e| anyhow::anyhow!("space normalizer: {e}"))?.into();
    // Like llama.cpp, a space goes before every run of text that starts the input or follows a
    // control token, when the vocabulary asks for it (Llama 2, Mistral; not Gemma).
    let add_space_prefix = super::gguf::get_bool(content, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE.to_string()).into(), escape]).into()
    } else {
        escape
    };
    tokenizer.with_normalizer(Some(normalizer)).map_err(|e| anyhow::anyhow!("setting the normalizer: {e}"))?;
    let unescape: DecoderWrapper =
        Replace::new(SPACE.to_string(), " ").map_err(|e| anyhow::anyhow!("space decoder: {e}"))?.into();
    tokenizer.with_decoder(Some(DecoderSequence::new(vec![unescape, ByteFallback::new().into(), Fuse::new().into()])));
    Ok(tokenizer)
}

/// The bytes a piece prints: its text with `▁` as a space.
pub(super) fn piece_bytes(piece: &str) -> Vec<u8> {
    piece.replace(SPACE, " ").into_bytes()
}

/// The byte a byte-fallback token (`<0x0A>`) stands for.
pub(super) fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_is_reached_by_each_of_its_splits_and_better_pieces_merge_first() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        let kinds = [TokenKind::Text; 6];
        let merges = merges_by_score(&tokens, &[0.0, 0.0, 0.0, -2.0, -1.0, -3.0], &kinds);
        let pairs: Vec<(&str, &str)> = merges.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        assert_eq!(pairs, [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]);
    }

    #[test]
    fn only_normal_pieces_are_merge_targets() {
        let tokens = ["<", "s", ">", "<s", "<s>"];
        let kinds = [TokenKind::Text, TokenKind::Text, TokenKind::Text, TokenKind::Text, TokenKind::Special];
        let merges = merges_by_score(&tokens, &[0.0, 0.0, 0.0, -1.0, 10.0], &kinds);
        assert_eq!(merges, [("<".to_string(), "s".to_string())]);
    }

    #[test]
    fn pieces_print_spaces_and_byte_tokens_print_their_byte() {
        assert_eq!(piece_bytes("▁hello▁world"), b" hello world");
        assert_eq!(fallback_byte("<0x0A>"), Some(b'\n'));
        assert_eq!(fallback_byte("<0xff>"), Some(0xff));
        assert_eq!(fallback_byte("<0x0>"), None);
        assert_eq!(fallback_byte("0x41"), None);
    }
}
