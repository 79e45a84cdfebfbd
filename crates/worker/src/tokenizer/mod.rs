//! The model's tokenizer: text <-> token ids, token bytes for streaming, and the chat template.
//!
//! The tokenizer must produce exactly the ids the model was trained on: a tokenizer that is
//! merely "close" (a prefix space, digits grouped differently) still yields fluent-looking but
//! measurably worse output, and no error anywhere. So the reference is llama.cpp on the same GGUF,
//! and `tests/tokenizer_matches_llama_cpp.rs` holds us to it token for token.
//!
//! Output text is built from [`ModelTokenizer::token_bytes`], one table shared by
//! [`ModelTokenizer::decode`] and the streaming [`Detokenizer`], so a streamed response and the
//! same ids decoded at once are byte-for-byte the same text.

mod detokenize;
mod gguf;
mod sentencepiece;

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use candle_core::quantized::gguf_file::Content;
use tokenizers::Tokenizer;
use tokenizers::decoders::DecoderWrapper;

pub use bellows_common::chat_template::ChatMessage;
use bellows_common::chat_template::ChatTemplate;
pub use detokenize::Detokenizer;

/// What a token contributes to output text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    /// A vocabulary entry: its bytes are its text decoded by the vocabulary's alphabet (byte-level
    /// or SentencePiece).
    Text,
    /// Matched verbatim in input, printed verbatim (GGUF type 4, a non-special added token).
    UserDefined,
    /// Control token (GGUF type 3 or 2, a special added token): matched in input, prints nothing.
    Special,
    /// Unused token: never produced by encoding, prints nothing.
    Hidden,
    /// A byte-fallback token (`<0x0A>`, GGUF type 6): SentencePiece writes characters outside its
    /// vocabulary as these; byte-level vocabularies never produce them.
    Byte,
}

impl TokenKind {
    /// The bytes a token of this kind prints, `decode` turning vocabulary text into bytes; byte
    /// tokens are their builder's to decode and print nothing here.
    fn prints(self, text: &str, decode: impl Fn(&str) -> Vec<u8>) -> Vec<u8> {
        match self {
            TokenKind::Text => decode(text),
            TokenKind::UserDefined => text.as_bytes().to_vec(),
            TokenKind::Special | TokenKind::Hidden | TokenKind::Byte => Vec::new(),
        }
    }
}

/// End-of-generation detection, as llama.cpp does it (llama-vocab.cpp in the llama.cpp vendored by
/// llama-cpp-python 0.3.36): besides the GGUF's eos/eot/eom ids, any token with one of these texts
/// ends generation, e.g. a ChatML model whose eos is `<|endoftext|>` still stops at `<|im_end|>`.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle pad / repo / file-separator tokens also end generation in llama.cpp: by
/// their GGUF key, or else by text (SmolLM2's `<reponame>` is one).
const FIM_STOPS: &[(&str, &[&str])] = &[
    ("tokenizer.ggml.fim_pad_token_id", &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    ("tokenizer.ggml.fim_rep_token_id", &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]),
];

/// Whether llama.cpp treats a token with this text as control even when the GGUF types it as
/// normal (it logs "control-looking token ... was not control-type").
fn is_control_looking(text: &str) -> bool {
    EOG_TEXTS.contains(&text) || FIM_STOPS.iter().any(|(_, texts)| texts.contains(&text))
}

/// A loaded tokenizer. Immutable after construction, `Send + Sync`: share it with `Arc`.
pub struct ModelTokenizer {
    inner: Tokenizer,
    /// `token_bytes(i)` is `bytes[offsets[i]..offsets[i + 1]]` (one allocation for the table).
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    /// The spelling of each token that prints nothing (control and unused tokens), for
    /// requests that keep them.
    specials: std::collections::HashMap<u32, Box<[u8]>>,
    bos: Option<u32>,
    eos_ids: Vec<u32>,
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.template.is_some())
            .finish()
    }
}

impl ModelTokenizer {
    /// From GGUF metadata (tokenizer.ggml.* keys + tokenizer.chat_template); errors clearly for
    /// unsupported tokenizer models/pre-tokenizers.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let built = gguf::build(content)?;
        let tokens = built.tokens;
        Self::assemble(built.tokenizer, built.table, content, |id| tokens.get(id as usize).cloned())
    }

    /// A tokenizer.json file overrides the GGUF's vocabulary/merges/pre-tokenizer; bos/eos/template
    /// still from GGUF metadata.
    ///
    /// Only byte-level BPE files (a `ByteLevel` decoder) are accepted. When the GGUF has a
    /// vocabulary, the file must agree with it on the BOS/EOS ids, which catches a tokenizer.json
    /// from another model. The file's post-processor, truncation and padding are replaced: BOS
    /// follows the GGUF's add_bos_token, and nothing is cut or padded.
    pub fn from_tokenizer_json(path: &Path, content: &Content) -> Result<Self> {
        let mut inner = Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("reading tokenizer file {}: {e}", path.display()))?;
        if !has_byte_level_decoder(inner.get_decoder()) {
            bail!("{}: only byte-level BPE tokenizers (decoder ByteLevel) are supported", path.display());
        }
        // Serving never truncates or pads behind the scheduler's back.
        inner.with_truncation(None).map_err(|e| anyhow::anyhow!("disabling truncation: {e}"))?;
        inner.with_padding(None);

        let added = inner.get_added_tokens_decoder();
        let vocab = inner.get_vocab(true);
        let n = vocab.values().copied().max().map_or(0, |m| m as usize + 1);
        let mut table = vec![Vec::new(); n];
        let mut texts: Vec<Option<String>> = vec![None; n];
        for (text, &id) in &vocab {
            let bytes = match added.get(&id) {
                Some(tok) if tok.special => Vec::new(),
                Some(tok) => tok.content.as_bytes().to_vec(),
                None => byte_level_decode(text),
            };
            table[id as usize] = bytes;
            texts[id as usize] = Some(text.clone());
        }

        if let Some(gguf_tokens) = gguf::tokens(content)? {
            for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
                if let Some(id) = gguf::get_token_id(content, key)? {
                    let in_gguf = gguf_tokens.get(id as usize).copied();
                    let in_json = texts.get(id as usize).cloned().flatten();
                    if in_gguf != in_json.as_deref() {
                        bail!(
                            "{} does not match the GGUF vocabulary: {key} = {id} is {in_json:?} there \
                             but {in_gguf:?} in the GGUF",
                            path.display()
                        );
                    }
                }
            }
        }
        Self::assemble(inner, table, content, |id| texts.get(id as usize).cloned().flatten())
    }

    /// Shared tail of both constructors: special ids, BOS post-processor, chat template.
    fn assemble(
        mut inner: Tokenizer,
        table: Vec<Vec<u8>>,
        content: &Content,
        token_text: impl Fn(u32) -> Option<String>,
    ) -> Result<Self> {
        let n = table.len();
        let id = |key: &str| -> Result<Option<u32>> {
            match gguf::get_token_id(content, key)? {
                Some(id) if id as usize >= n => {
                    bail!("GGUF {key} = {id} is outside the vocabulary ({n} tokens)")
                }
                other => Ok(other),
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        // The GGUF's eos first (callers may treat it as "the" eos), then the rest ascending.
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        let mut others: Vec<u32> = Vec::new();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            others.extend(id(key)?);
        }
        let text_of: Vec<Option<String>> = (0..n as u32).map(&token_text).collect();
        let ids_with_text = |texts: &[&str]| -> Vec<u32> {
            (0..n as u32).filter(|&i| text_of[i as usize].as_deref().is_some_and(|t| texts.contains(&t))).collect()
        };
        for (key, texts) in FIM_STOPS {
            match id(key)? {
                Some(fim) => others.push(fim),
                None => others.extend(ids_with_text(texts)),
            }
        }
        others.extend(ids_with_text(EOG_TEXTS));
        others.sort_unstable();
        others.dedup();
        others.retain(|i| !eos_ids.contains(i));
        eos_ids.extend(others);

        let add_bos = match gguf::get_bool(content, "tokenizer.ggml.add_bos_token")? {
            Some(said) => said,
            None => gguf::adds_bos_by_default(content)?,
        };
        let add_eos = gguf::get_bool(content, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let with_text = |id: Option<u32>| -> Result<Option<(u32, String)>> {
            id.map(|id| token_text(id).map(|t| (id, t)).with_context(|| format!("token id {id} has no text")))
                .transpose()
        };
        let bos_pp = if add_bos {
            Some(with_text(bos)?.context("GGUF sets add_bos_token but has no bos_token_id")?)
        } else {
            None
        };
        let eos_pp = if add_eos {
            Some(with_text(eos)?.context("GGUF sets add_eos_token but has no eos_token_id")?)
        } else {
            None
        };
        gguf::set_bos_eos_post_processor(&mut inner, bos_pp, eos_pp)?;

        let source = match gguf::get_str(content, "tokenizer.chat_template")? {
            Some(source) => Some(source),
            None => family_chat_template(content)?,
        };
        let template = match source {
            Some(source) => Some(
                ChatTemplate::new(source, bos.and_then(&token_text).as_deref(), eos.and_then(&token_text).as_deref())
                    .context("compiling the GGUF's tokenizer.chat_template")?,
            ),
            None => None,
        };

        // Byte tokens (`<0x0A>`) print their byte, never their spelling.
        let is_byte = |t: &str| t.len() == 6 && t.starts_with("<0x") && t.ends_with('>');
        let specials = (0..n)
            .filter(|&i| table[i].is_empty())
            .filter_map(|i| Some((i as u32, text_of[i].as_deref().filter(|t| !t.is_empty() && !is_byte(t))?)))
            .map(|(i, t)| (i, t.as_bytes().into()))
            .collect();
        let mut bytes = Vec::with_capacity(table.iter().map(Vec::len).sum());
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u32);
        for t in &table {
            bytes.extend_from_slice(t);
            offsets.push(u32::try_from(bytes.len()).context("token table over 4 GiB")?);
        }
        Ok(Self { inner, bytes, offsets, specials, bos, eos_ids, template })
    }

    /// Control tokens in the text (e.g. "<|im_start|>") become their ids; `add_special_tokens`
    /// adds BOS only when the GGUF says tokenizer.ggml.add_bos_token=true.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode_fast(text, add_special_tokens).map_err(|e| anyhow::anyhow!("tokenizing failed: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, skipping special/control tokens. Invalid UTF-8 (a cut-off character)
    /// becomes U+FFFD, exactly as streaming the same ids through a [`Detokenizer`] would.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// Number of token ids, i.e. one more than the largest id.
    pub fn vocab_size(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Raw bytes a token contributes to output text; empty for control/special tokens and for ids
    /// outside the vocabulary (a model's padded logit rows).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        if i + 1 >= self.offsets.len() {
            return &[];
        }
        &self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    /// The spelling of a token that prints nothing (`[TOOL_CALLS]`, `<|im_start|>`); empty for
    /// any other token.
    pub fn special_text(&self, id: u32) -> &[u8] {
        self.specials.get(&id).map_or(&[], |t| t)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids that end generation: tokenizer.ggml.eos_token_id first, then (ascending) the eot/eom
    /// ids and what llama.cpp also stops at: tokens whose text is a known end-of-turn marker
    /// (`<|im_end|>`, `<|endoftext|>`, ...) and fill-in-the-middle pad/repo/file-separator tokens.
    /// No duplicates. For SmolLM2: `[2, 0, 4]` (`<|im_end|>`, `<|endoftext|>`, `<reponame>`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Full tokenizer.json (for a router that has no model files). Its post-processor adds BOS
    /// exactly when [`ModelTokenizer::encode`] does.
    pub fn tokenizer_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(|e| anyhow::anyhow!("serializing tokenizer.json: {e}"))
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.template.as_ref().map(ChatTemplate::source)
    }

    /// Renders the conversation with the model's chat template, as Hugging Face's
    /// `apply_chat_template(messages, add_generation_prompt=..., tokenize=False)` would.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.template
            .as_ref()
            .context("the model has no chat template (no tokenizer.chat_template in its GGUF)")?
            .render(messages, add_generation_prompt)
            .map_err(Into::into)
    }
}

/// Gemma's turn format (Gemma 3's own template, for text content): the system message opens the
/// first user turn, the assistant is `model`, roles alternate.
const GEMMA_CHAT_TEMPLATE: &str = "{{ bos_token }}\
{%- if messages[0]['role'] == 'system' -%}\
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}\
{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}\
{%- for message in loop_messages -%}\
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}\
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}\
{{- message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

/// A template for a GGUF that carries none, by its architecture: Gemma 3 files converted from the
/// base model have no `tokenizer.chat_template`, yet the family has one documented format (and
/// the tokens for it). Other families without a template serve only `/v1/completions`.
fn family_chat_template(content: &Content) -> Result<Option<&'static str>> {
    Ok(match gguf::get_str(content, "general.architecture")? {
        Some("gemma3") => Some(GEMMA_CHAT_TEMPLATE),
        _ => None,
    })
}

/// GPT-2's `bytes_to_unicode`: byte `b` is written as character `alphabet[b]` in byte-level
/// vocabularies (printable Latin-1 stays itself, the rest moves to U+0100 and up).
fn byte_level_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
            next += 1;
            c
        };
    }
    table
}

/// The bytes a byte-level vocabulary entry stands for. A string with a character outside the
/// alphabet is taken as raw text, as the `tokenizers` ByteLevel decoder does.
fn byte_level_decode(token: &str) -> Vec<u8> {
    static INVERSE: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    let inverse =
        INVERSE.get_or_init(|| byte_level_alphabet().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect());
    token
        .chars()
        .map(|c| inverse.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

fn has_byte_level_decoder(decoder: Option<&DecoderWrapper>) -> bool {
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(seq)) => seq.get_decoders().iter().any(|d| has_byte_level_decoder(Some(d))),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::gguf::tests::tiny_gguf;
    use super::*;

    #[test]
    fn model_tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<ModelTokenizer>();
        assert_send_sync::<std::sync::Arc<ModelTokenizer>>();
    }

    #[test]
    fn byte_level_alphabet_is_a_bijection_matching_gpt2() {
        let a = byte_level_alphabet();
        let distinct: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'\t' as usize], 'ĉ');
        assert_eq!(a[b'a' as usize], 'a');
        assert_eq!(a[0xAD], 'Ń'); // the soft hyphen is the last byte moved out of Latin-1
        for b in 0..=255u8 {
            assert_eq!(byte_level_decode(&a[b as usize].to_string()), vec![b]);
        }
    }

    #[test]
    fn token_bytes_invert_the_byte_level_alphabet_and_hide_control_tokens() {
        let t = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        assert_eq!(t.token_bytes(1), b""); // <|im_start|>
        assert_eq!(t.token_bytes(3), b"<tool>"); // user-defined: printed verbatim
        for b in 0..=255u8 {
            assert_eq!(t.token_bytes(4 + b as u32), [b]);
        }
        assert_eq!(t.token_bytes(t.vocab_size() as u32), b"");
        assert_eq!(t.token_bytes(u32::MAX), b"");
    }

    #[test]
    fn a_control_token_keeps_its_spelling_for_requests_that_write_it_out() {
        let t = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        assert_eq!(t.special_text(1), b"<|im_start|>");
        assert_eq!(t.special_text(3), b"", "a user-defined token prints itself already");
        assert_eq!(t.special_text(4 + b'a' as u32), b"", "so does text");
        assert_eq!(t.special_text(u32::MAX), b"");
    }

    #[test]
    fn control_tokens_in_text_encode_to_their_ids_and_decode_to_nothing() {
        let t = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        let ids = t.encode("<|im_start|>hello world<|im_end|>", false).unwrap();
        let hello = t.encode("hello", false).unwrap();
        let world = t.encode(" world", false).unwrap();
        assert_eq!(hello.len(), 1, "merges should make `hello` one token");
        assert_eq!(world.len(), 1, "merges should make ` world` one token");
        assert_eq!(ids, [1, hello[0], world[0], 2]);
        assert_eq!(t.decode(&ids), "hello world");
    }

    #[test]
    fn user_defined_tokens_are_matched_verbatim_and_printed() {
        let t = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        let ids = t.encode("a<tool>b", false).unwrap();
        assert!(ids.contains(&3), "{ids:?}");
        assert_eq!(t.decode(&ids), "a<tool>b");
    }

    #[test]
    fn bos_is_added_only_when_the_gguf_asks_for_it() {
        let without = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        assert_eq!(without.encode("hello", true).unwrap(), without.encode("hello", false).unwrap());
        let with = ModelTokenizer::from_gguf(&tiny_gguf("smollm", true)).unwrap();
        let plain = with.encode("hello", false).unwrap();
        let mut expected = vec![1];
        expected.extend(&plain);
        assert_eq!(with.encode("hello", true).unwrap(), expected);
        assert_eq!(with.bos_id(), Some(1));
    }

    #[test]
    fn eos_ids_include_end_of_turn_tokens_without_duplicates() {
        let mut c = tiny_gguf("smollm", false);
        c.metadata.insert("tokenizer.ggml.eot_token_id".into(), candle_core::quantized::gguf_file::Value::U32(2));
        let t = ModelTokenizer::from_gguf(&c).unwrap();
        // eos (2, <|im_end|>) first; <|endoftext|> (0) by its text, as llama.cpp does.
        assert_eq!(t.eos_ids(), [2, 0]);
    }

    #[test]
    fn control_looking_normal_tokens_become_control_and_stop_generation_like_llama_cpp() {
        use candle_core::quantized::gguf_file::Value;
        let mut c = tiny_gguf("smollm", false);
        let Some(Value::Array(tokens)) = c.metadata.get_mut("tokenizer.ggml.tokens") else { unreachable!() };
        tokens[3] = Value::String("<|file_sep|>".into());
        let Some(Value::Array(types)) = c.metadata.get_mut("tokenizer.ggml.token_type") else { unreachable!() };
        types[3] = Value::I32(1); // mistyped as normal in the GGUF
        let t = ModelTokenizer::from_gguf(&c).unwrap();
        assert_eq!(t.token_bytes(3), b"");
        assert_eq!(t.encode("a<|file_sep|>", false).unwrap().last(), Some(&3));
        assert_eq!(t.eos_ids(), [2, 0, 3]);
    }

    #[test]
    fn out_of_range_special_id_is_an_error() {
        let mut c = tiny_gguf("smollm", false);
        c.metadata
            .insert("tokenizer.ggml.bos_token_id".into(), candle_core::quantized::gguf_file::Value::U32(1_000_000));
        let err = ModelTokenizer::from_gguf(&c).err().unwrap().to_string();
        assert!(err.contains("outside the vocabulary"), "{err}");
    }

    #[test]
    fn tokenizer_json_round_trips_through_a_file_and_encodes_identically() {
        for add_bos in [false, true] {
            let c = tiny_gguf("smollm", add_bos);
            let t = ModelTokenizer::from_gguf(&c).unwrap();
            let json = t.tokenizer_json().unwrap();
            let dir = std::env::temp_dir().join(format!("bellows-tok-{}-{add_bos}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("tokenizer.json");
            std::fs::write(&path, &json).unwrap();
            let from_file = ModelTokenizer::from_tokenizer_json(&path, &c).unwrap();
            // A router loading the JSON with plain `tokenizers` gets the same ids, BOS included.
            let plain: Tokenizer = json.parse().map_err(|e| anyhow::anyhow!("{e}")).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            for text in ["hello world 12", "<|im_start|>user\nhi<|im_end|>", "a<tool>b ✓"] {
                for special in [false, true] {
                    let ids = t.encode(text, special).unwrap();
                    assert_eq!(from_file.encode(text, special).unwrap(), ids);
                    assert_eq!(plain.encode(text, special).unwrap().get_ids(), ids.as_slice());
                }
            }
            assert_eq!(from_file.vocab_size(), t.vocab_size());
            assert_eq!(from_file.eos_ids(), t.eos_ids());
            for id in 0..t.vocab_size() as u32 {
                assert_eq!(from_file.token_bytes(id), t.token_bytes(id), "id {id}");
            }
        }
    }

    #[test]
    fn tokenizer_json_from_another_model_is_rejected() {
        let c = tiny_gguf("smollm", false);
        let json = ModelTokenizer::from_gguf(&c).unwrap().tokenizer_json().unwrap();
        let mut other = tiny_gguf("smollm", false);
        let candle_core::quantized::gguf_file::Value::Array(tokens) =
            other.metadata.get_mut("tokenizer.ggml.tokens").unwrap()
        else {
            unreachable!()
        };
        tokens[2] = candle_core::quantized::gguf_file::Value::String("</s>".into());
        let path = std::env::temp_dir().join(format!("bellows-tok-mismatch-{}.json", std::process::id()));
        std::fs::write(&path, json).unwrap();
        let err = ModelTokenizer::from_tokenizer_json(&path, &other).err().unwrap().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(err.contains("does not match the GGUF vocabulary"), "{err}");
    }

    #[test]
    fn decode_equals_streaming_the_same_token_bytes() {
        let t = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        let text = "héllo 🦀 world<|im_end|>";
        let ids = t.encode(text, false).unwrap();
        let mut d = Detokenizer::new();
        let mut streamed: String = ids.iter().map(|&id| d.push(t.token_bytes(id))).collect();
        streamed.push_str(&d.finish());
        assert_eq!(streamed, t.decode(&ids));
        assert_eq!(streamed, "héllo 🦀 world");
    }

    #[test]
    fn chat_template_uses_gguf_bos_and_eos_texts() {
        let t = ModelTokenizer::from_gguf(&tiny_gguf("smollm", false)).unwrap();
        let msgs = [ChatMessage::new("user".into(), "Hi".into())];
        assert_eq!(
            t.apply_chat_template(&msgs, true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(t.chat_template().unwrap().contains("add_generation_prompt"));
    }
}
