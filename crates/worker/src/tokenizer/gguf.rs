//! Building a `tokenizers::Tokenizer` from GGUF metadata (`tokenizer.ggml.*`).
//!
//! Why not candle's `TokenizerFromGguf`: it maps every unknown `tokenizer.ggml.pre` to a GPT-2
//! `ByteLevel` with a prefix space, which is wrong for SmolLM2 (`pre=smollm`): it neither splits
//! digits one by one nor leaves a leading word without its space, so most prompts tokenize to ids
//! the model never saw in training (1 of 11 test lines matched llama.cpp). Here every supported
//! `pre` is spelled out to match the model's own `tokenizer.json` (and llama.cpp, checked by
//! `tests/tokenizer_matches_llama_cpp.rs`), and any other `pre` is an error rather than a silent
//! approximation.

use anyhow::{Context, Result, bail};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::{TokenKind, sentencepiece};

/// Qwen2's pre-tokenizer split (from its `tokenizer.json`): single digits, letters with at most
/// one leading non-letter, punctuation runs with trailing newlines.
pub(super) const QWEN2_SPLIT_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split: as Qwen2's but digits in groups of up to three.
pub(super) const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values this module reproduces exactly.
const SUPPORTED_PRE: &[&str] = &["smollm", "qwen2", "deepseek-r1-qwen", "llama-bpe", "llama3", "gpt-2", "gpt2"];

/// GGUF token types (llama.cpp's `llama_token_type`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_UNUSED: i64 = 5;
const TYPE_BYTE: i64 = 6;

pub(super) fn get<'a>(content: &'a Content, key: &str) -> Option<&'a Value> {
    content.metadata.get(key)
}

/// A non-negative integer of any GGUF integer type.
fn as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::I8(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::I64(x) => Some(x),
        _ => as_u64(v).and_then(|x| i64::try_from(x).ok()),
    }
}

pub(super) fn get_str<'a>(content: &'a Content, key: &str) -> Result<Option<&'a str>> {
    match get(content, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => bail!("GGUF key `{key}` should be a string, found {:?}", v.value_type()),
    }
}

pub(super) fn get_bool(content: &Content, key: &str) -> Result<Option<bool>> {
    match get(content, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => bail!("GGUF key `{key}` should be a bool, found {:?}", v.value_type()),
    }
}

/// A token id; llama.cpp writes -1 (or leaves the key out) for "none".
pub(super) fn get_token_id(content: &Content, key: &str) -> Result<Option<u32>> {
    let Some(v) = get(content, key) else {
        return Ok(None);
    };
    match as_i64(v) {
        Some(x) if x < 0 => Ok(None),
        Some(x) => Ok(Some(u32::try_from(x).with_context(|| format!("GGUF key `{key}` = {x} is not a token id"))?)),
        None => bail!("GGUF key `{key}` should be an integer, found {:?}", v.value_type()),
    }
}

fn get_str_array<'a>(content: &'a Content, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(v) = get(content, key) else {
        return Ok(None);
    };
    let Value::Array(items) = v else {
        bail!("GGUF key `{key}` should be an array, found {:?}", v.value_type());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(s) => Ok(s.as_str()),
            other => bail!("GGUF key `{key}`[{i}] should be a string, found {:?}", other.value_type()),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The vocabulary strings (`tokenizer.ggml.tokens`), if the GGUF has them.
pub(super) fn tokens(content: &Content) -> Result<Option<Vec<&str>>> {
    get_str_array(content, "tokenizer.ggml.tokens")
}

/// How each token contributes to output text, from `tokenizer.ggml.token_type`; all `Text` when
/// the key is absent.
fn token_kinds(content: &Content, n_tokens: usize) -> Result<Vec<TokenKind>> {
    let key = "tokenizer.ggml.token_type";
    let Some(v) = get(content, key) else {
        return Ok(vec![TokenKind::Text; n_tokens]);
    };
    let Value::Array(items) = v else {
        bail!("GGUF key `{key}` should be an array, found {:?}", v.value_type());
    };
    if items.len() != n_tokens {
        bail!("GGUF `{key}` has {} entries but there are {n_tokens} tokens", items.len());
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let t = as_i64(item).with_context(|| format!("GGUF `{key}`[{i}] is not an integer"))?;
            Ok(match t {
                // Like llama.cpp: control and unknown tokens are matched in text with
                // `special=true` and print nothing; unused and byte tokens print nothing either.
                TYPE_CONTROL | TYPE_UNKNOWN => TokenKind::Special,
                TYPE_UNUSED => TokenKind::Hidden,
                TYPE_BYTE => TokenKind::Byte,
                TYPE_USER_DEFINED => TokenKind::UserDefined,
                _ => TokenKind::Text,
            })
        })
        .collect()
}

/// The split before BPE for `pre`, and whether a whole-word vocabulary hit wins over merges.
/// No normalizer for any of them: llama.cpp applies none to byte-level vocabularies (Qwen2's
/// tokenizer.json asks for NFC, llama.cpp ignores it, and its tokens are what a GGUF is held to),
/// so a decomposed accent stays two tokens here as there.
fn pre_tokenizer(pre: &str) -> Result<(PreTokenizerWrapper, bool)> {
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(SplitPattern::Regex(regex.to_owned()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| anyhow::anyhow!("bad pre-tokenizer regex: {e}"))?
            .into())
    };
    Ok(match pre {
        // SmolLM2's tokenizer.json: digits one by one, then GPT-2's regex, no prefix space.
        "smollm" => {
            (Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into(), false)
        }
        // DeepSeek-R1's Qwen distills keep Qwen2's splitting (llama.cpp maps both to one type).
        "qwen2" | "deepseek-r1-qwen" => {
            (Sequence::new(vec![split(QWEN2_SPLIT_REGEX)?, ByteLevel::new(false, false, false).into()]).into(), false)
        }
        // Llama 3's tokenizer.json sets ignore_merges (a whole-word vocab hit wins over merges),
        // and so does llama.cpp for this pre.
        "llama-bpe" | "llama3" => {
            (Sequence::new(vec![split(LLAMA3_SPLIT_REGEX)?, ByteLevel::new(false, true, false).into()]).into(), true)
        }
        "gpt-2" | "gpt2" => (ByteLevel::new(false, true, true).into(), false),
        other => bail!(
            "unsupported GGUF pre-tokenizer tokenizer.ggml.pre = `{other}` (supported: {}); \
             pass the model's tokenizer.json instead",
            SUPPORTED_PRE.join(", ")
        ),
    })
}

/// Whether a GGUF that does not say (no `tokenizer.ggml.add_bos_token`) gets BOS, as llama.cpp
/// decides: yes for SentencePiece vocabularies and for Llama 3's byte-level one, no for other
/// byte-level ones. Llama 3 without its BOS reads as a document cut mid-way.
pub(super) fn adds_bos_by_default(content: &Content) -> Result<bool> {
    let model = get_str(content, "tokenizer.ggml.model")?;
    let pre = get_str(content, "tokenizer.ggml.pre")?;
    Ok(model == Some("llama") || matches!(pre, Some("llama-bpe" | "llama3")))
}

/// Sets (or clears) the post-processor that adds BOS/EOS when `add_special_tokens` is true, so
/// that our `encode` and a router loading the serialized tokenizer (`Tokenizer::to_string`)
/// agree on BOS.
pub(super) fn set_bos_eos_post_processor(
    tokenizer: &mut Tokenizer,
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
) -> Result<()> {
    if bos.is_none() && eos.is_none() {
        tokenizer.with_post_processor(None::<TemplateProcessing>);
        return Ok(());
    }
    // Template pieces are split on ' ' and ':', so the special tokens get neutral names here.
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    if let Some((id, text)) = bos {
        specials.push(SpecialToken::new("BOS".into(), vec![id], vec![text]).map_err(anyhow::Error::msg)?);
        single.push("BOS");
    }
    single.push("$A");
    if let Some((id, text)) = eos {
        specials.push(SpecialToken::new("EOS".into(), vec![id], vec![text]).map_err(anyhow::Error::msg)?);
        single.push("EOS");
    }
    for piece in &single {
        pair.push(piece.to_string());
    }
    for piece in &single {
        pair.push(if *piece == "$A" { "$B:1".to_string() } else { format!("{piece}:1") });
    }
    let processor = TemplateProcessing::builder()
        .try_single(single.join(" "))
        .map_err(anyhow::Error::msg)?
        .try_pair(pair.join(" "))
        .map_err(anyhow::Error::msg)?
        .special_tokens(specials)
        .build()
        .map_err(|e| anyhow::anyhow!("building BOS/EOS post-processor: {e}"))?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}

/// The parts of a GGUF tokenizer that [`super::ModelTokenizer`] keeps.
pub(super) struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    pub tokens: Vec<String>,
    /// The bytes each token prints.
    pub table: Vec<Vec<u8>>,
}

/// A byte-level BPE (`gpt2`) or a SentencePiece (`llama`) vocabulary, with its control and
/// user-defined tokens matched verbatim in text.
pub(super) fn build(content: &Content) -> Result<GgufTokenizer> {
    let model = get_str(content, "tokenizer.ggml.model")?
        .context("GGUF has no tokenizer (key tokenizer.ggml.model is missing)")?;
    let tokens = tokens(content)?.context("GGUF has no tokenizer.ggml.tokens")?;
    let mut kinds = token_kinds(content, tokens.len())?;
    for (text, kind) in tokens.iter().zip(kinds.iter_mut()) {
        if *kind == TokenKind::Text && super::is_control_looking(text) {
            *kind = TokenKind::Special;
        }
    }
    let (mut tokenizer, table) = match model {
        "gpt2" => {
            let table = tokens.iter().zip(&kinds).map(|(t, k)| k.prints(t, super::byte_level_decode)).collect();
            (byte_level(content, &tokens)?, table)
        }
        "llama" => {
            let table = tokens
                .iter()
                .zip(&kinds)
                .map(|(t, k)| match k {
                    TokenKind::Byte => sentencepiece::fallback_byte(t).into_iter().collect(),
                    _ => k.prints(t, sentencepiece::piece_bytes),
                })
                .collect();
            (sentencepiece::tokenizer(content, &tokens, &kinds)?, table)
        }
        other => bail!(
            "unsupported GGUF tokenizer model tokenizer.ggml.model = `{other}` (supported: `gpt2`, \
             byte-level BPE; `llama`, SentencePiece); pass the model's tokenizer.json instead"
        ),
    };
    add_verbatim_tokens(&mut tokenizer, &tokens, &kinds)?;
    Ok(GgufTokenizer { tokenizer, tokens: tokens.into_iter().map(str::to_owned).collect(), table })
}

/// A byte-level BPE from `tokenizer.ggml.merges`, split first as its `pre` says.
fn byte_level(content: &Content, tokens: &[&str]) -> Result<Tokenizer> {
    let pre = get_str(content, "tokenizer.ggml.pre")?.context(
        "GGUF has no tokenizer.ggml.pre: cannot tell how to split text before BPE; \
         pass the model's tokenizer.json instead",
    )?;
    let (pre_tokenizer, ignore_merges) = pre_tokenizer(pre)?;
    let merges = get_str_array(content, "tokenizer.ggml.merges")?
        .context("GGUF has no tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .with_context(|| format!("tokenizer.ggml.merges[{i}] = {m:?} is not `a b`"))
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| anyhow::anyhow!("building BPE from GGUF vocabulary: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
    Ok(tokenizer)
}

fn add_verbatim_tokens(tokenizer: &mut Tokenizer, tokens: &[&str], kinds: &[TokenKind]) -> Result<()> {
    // Control tokens are matched verbatim anywhere in the text ("<|im_start|>" -> its id) and are
    // skipped by decode(skip_special_tokens); user-defined tokens are matched verbatim but printed.
    let mut specials = Vec::new();
    let mut user_defined = Vec::new();
    for (text, kind) in tokens.iter().zip(kinds) {
        if text.is_empty() {
            continue;
        }
        match kind {
            TokenKind::Special => specials.push(AddedToken::from(text.to_string(), true)),
            TokenKind::UserDefined => user_defined.push(AddedToken::from(text.to_string(), false).normalized(false)),
            TokenKind::Text | TokenKind::Hidden | TokenKind::Byte => {}
        }
    }
    tokenizer.add_special_tokens(specials).map_err(|e| anyhow::anyhow!("adding control tokens: {e}"))?;
    tokenizer.add_tokens(user_defined).map_err(|e| anyhow::anyhow!("adding user-defined tokens: {e}"))?;
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::VersionedMagic;
    use std::collections::HashMap;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// A synthetic GGUF: 3 control tokens, one user-defined token, the 256 byte-level symbols and
    /// a few merges, with the given `pre`.
    pub(in crate::tokenizer) fn tiny_gguf(pre: &str, add_bos: bool) -> Content {
        let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<|im_end|>".into()];
        let mut types: Vec<Value> = vec![Value::I32(3); 3];
        tokens.push("<tool>".into());
        types.push(Value::I32(4));
        for c in super::super::byte_level_alphabet() {
            tokens.push(c.to_string());
            types.push(Value::I32(1));
        }
        let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"];
        for m in merges {
            let (a, b) = m.split_once(' ').unwrap();
            tokens.push(format!("{a}{b}"));
            types.push(Value::I32(1));
        }
        let mut md = HashMap::new();
        let s = |x: &str| Value::String(x.into());
        md.insert("tokenizer.ggml.model".into(), s("gpt2"));
        md.insert("tokenizer.ggml.pre".into(), s(pre));
        md.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens.iter().map(|t| s(t)).collect()));
        md.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
        md.insert("tokenizer.ggml.merges".into(), Value::Array(merges.iter().map(|m| s(m)).collect()));
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos));
        md.insert(
            "tokenizer.chat_template".into(),
            s("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
               {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
        );
        Content { magic: VersionedMagic::GgufV3, metadata: md, tensor_infos: HashMap::new(), tensor_data_offset: 0 }
    }

    fn splits(pre: &str, input: &str) -> Vec<String> {
        let (pt, _) = pre_tokenizer(pre).unwrap();
        let mut pts = PreTokenizedString::from(input);
        pt.pre_tokenize(&mut pts).unwrap();
        pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect()
    }

    #[test]
    fn smollm_splits_digits_one_by_one_and_adds_no_prefix_space() {
        assert_eq!(splits("smollm", "hello 123"), ["hello", "Ġ", "1", "2", "3"]);
        assert_eq!(splits("smollm", " x=42"), ["Ġx", "=", "4", "2"]);
    }

    #[test]
    fn qwen2_splits_single_digits_and_case_insensitive_contractions() {
        assert_eq!(
            splits("qwen2", "Hello'Ve world 123\n\n  foo"),
            ["Hello", "'Ve", "Ġworld", "Ġ", "1", "2", "3", "ĊĊ", "Ġ", "Ġfoo"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        assert_eq!(splits("llama-bpe", "x 12345"), ["x", "Ġ", "123", "45"]);
    }

    #[test]
    fn unsupported_tokenizer_model_is_a_clear_error() {
        let mut c = tiny_gguf("smollm", false);
        c.metadata.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
        let err = build(&c).err().unwrap().to_string();
        assert!(err.contains("`bert`") && err.contains("`gpt2`") && err.contains("`llama`"), "{err}");
    }

    #[test]
    fn unknown_pre_tokenizer_is_a_clear_error_not_an_approximation() {
        let err = build(&tiny_gguf("deepseek-coder", false)).err().unwrap().to_string();
        assert!(err.contains("`deepseek-coder`") && err.contains("smollm"), "{err}");
        let mut c = tiny_gguf("smollm", false);
        c.metadata.remove("tokenizer.ggml.pre");
        assert!(build(&c).is_err());
    }

    #[test]
    fn negative_token_id_means_absent() {
        let mut c = tiny_gguf("smollm", false);
        c.metadata.insert("tokenizer.ggml.eot_token_id".into(), Value::I32(-1));
        assert_eq!(get_token_id(&c, "tokenizer.ggml.eot_token_id").unwrap(), None);
        assert_eq!(get_token_id(&c, "tokenizer.ggml.bos_token_id").unwrap(), Some(1));
    }
}
