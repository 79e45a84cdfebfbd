//! Our tokenizer against llama.cpp on the default model's GGUF, Gemma 3's, DeepSeek-R1-Distill-
//! Qwen's, Llama 3's and Llama 2 / Mistral's, and against the test lines llama.cpp ships with its
//! own vocabularies.
//!
//! A tokenizer that is only nearly right (a prefix space, digits grouped differently) makes no
//! error anywhere: the model just sees prompts it was not trained on. llama.cpp is the reference
//! for GGUF models, so `tests/fixtures/tokenizer_reference.json` holds the ids it gives for tricky
//! lines (written by `scripts/reference/llama_cpp_tokenize.py`), and these tests hold us to them.
//!
//! The model file is required, not optional: without it these tests fail and say how to get it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use bellows_worker::tokenizer::{ChatMessage, Detokenizer, ModelTokenizer};
use candle_core::quantized::gguf_file::Content;
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    model: String,
    n_vocab: usize,
    bos_id: u32,
    eos_id: u32,
    eog_ids: Vec<u32>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    has_special: bool,
    ids: Vec<u32>,
    ids_add_special: Vec<u32>,
    detokenized: String,
}

/// A GGUF and the fixture llama.cpp wrote for it.
struct Model {
    reference: Reference,
    tokenizer: ModelTokenizer,
    /// A SentencePiece vocabulary that prepends a space to the text (Llama 2, Mistral; not Gemma).
    space_prefix: bool,
}

/// The default model (SmolLM2, byte-level BPE), Gemma 3 (SentencePiece), DeepSeek-R1-Distill-
/// Qwen-7B (Qwen's 152k byte-level vocabulary, which Qwen2.5 and Qwen3 share, under the
/// `deepseek-r1-qwen` pre-tokenizer), Llama 3 (128k byte-level, digits in threes) and Llama 2 /
/// Mistral 7B (32k SentencePiece with a space prefix and BOS): each vocabulary kind and
/// pre-tokenizer the loader builds.
fn models() -> &'static [Model] {
    static M: OnceLock<Vec<Model>> = OnceLock::new();
    M.get_or_init(|| {
        [
            (bellows_worker::load::default_model_path(), include_str!("fixtures/tokenizer_reference.json")),
            (
                bellows_worker::load::cached_model_path(GEMMA3_FILE),
                include_str!("fixtures/tokenizer_reference_gemma3.json"),
            ),
            (
                bellows_worker::load::cached_model_path(QWEN_VOCAB_FILE),
                include_str!("fixtures/tokenizer_reference_qwen.json"),
            ),
            (llama_cpp_vocab("llama-bpe"), include_str!("fixtures/tokenizer_reference_llama3.json")),
            (llama_cpp_vocab("llama-spm"), include_str!("fixtures/tokenizer_reference_llama_spm.json")),
        ]
        .into_iter()
        .map(|(path, fixture)| {
            let reference: Reference = serde_json::from_str(fixture).expect("parsing a llama.cpp reference fixture");
            let name = path.file_name().unwrap().to_string_lossy();
            assert_eq!(
                name,
                reference.model,
                "the reference fixture was made for another model: regenerate it with \
                 scripts/reference/llama_cpp_tokenize.py --model {}",
                path.display()
            );
            let content = gguf(&path);
            let tokenizer = ModelTokenizer::from_gguf(&content).expect("building the tokenizer from the GGUF");
            let meta = |key: &str| content.metadata.get(key);
            let space_prefix =
                meta("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).is_some_and(|m| m == "llama")
                    && meta("tokenizer.ggml.add_space_prefix").is_none_or(|v| v.to_bool().unwrap_or(true));
            Model { reference, tokenizer, space_prefix }
        })
        .collect()
    })
}

const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// The head of the file (all its metadata): `scripts/fetch-model.sh qwen-vocab`.
const QWEN_VOCAB_FILE: &str = "DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.head.gguf";

/// One of the vocabulary-only GGUFs in llama.cpp's sources: `scripts/fetch-model.sh llama-cpp-vocabs`.
fn llama_cpp_vocab(name: &str) -> PathBuf {
    bellows_worker::load::cached_model_path(&format!("llama-cpp-0.3.36-vocabs/ggml-vocab-{name}.gguf"))
}

fn gguf(path: &Path) -> Content {
    let mut file = std::fs::File::open(path).unwrap_or_else(|e| {
        panic!("cannot open the model GGUF {} ({e}): run scripts/fetch-model.sh --all", path.display())
    });
    Content::read(&mut file).expect("reading GGUF metadata")
}

fn default_model() -> &'static Model {
    &models()[0]
}

fn gemma3() -> &'static Model {
    &models()[1]
}

fn deepseek_qwen() -> &'static Model {
    &models()[2]
}

#[test]
fn encode_matches_llama_cpp_on_every_reference_line() {
    let mut mismatches = Vec::new();
    for Model { reference, tokenizer: tok, .. } in models() {
        for case in &reference.cases {
            let ours = tok.encode(&case.text, false).unwrap();
            if ours != case.ids {
                mismatches.push(format!(
                    "{}: {:?}\n  llama.cpp: {:?}\n  ours:      {:?}",
                    reference.model, case.text, case.ids, ours
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} lines tokenize differently from llama.cpp:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn llama_cpps_own_test_lines_encode_to_the_ids_it_expects_for_each_pre_tokenizer() {
    // llama.cpp's sources carry, for each vocabulary it supports, test lines and the ids its
    // CI holds it to (test-tokenizer-0: no BOS, no special-token parsing needed): the original
    // tokenizers' answers, on lines chosen to break pre-tokenizers.
    let mut mismatches = Vec::new();
    for name in ["llama-bpe", "llama-spm", "qwen2", "gpt-2"] {
        let path = llama_cpp_vocab(name);
        let tok = ModelTokenizer::from_gguf(&gguf(&path)).expect("building the tokenizer from the GGUF");
        let read =
            |ext: &str| std::fs::read_to_string(path.with_extension(ext)).expect("reading llama.cpp's test lines");
        let inp = read("gguf.inp");
        let out = read("gguf.out");
        let lines: Vec<&str> =
            inp.strip_suffix("\n__ggml_vocab_test__\n").unwrap().split("\n__ggml_vocab_test__\n").collect();
        let expected: Vec<&str> = out.strip_suffix('\n').unwrap().split('\n').collect();
        assert_eq!(lines.len(), expected.len(), "{name}: one expected line per test line");
        assert!(lines.len() > 40, "{name}: llama.cpp's test lines are all read");
        for (line, want) in lines.iter().zip(expected) {
            let want: Vec<u32> = want.split_whitespace().map(|id| id.parse().unwrap()).collect();
            let ours = tok.encode(line, false).unwrap();
            if ours != want {
                mismatches.push(format!("{name}: {line:?}\n  llama.cpp: {want:?}\n  ours:      {ours:?}"));
            }
        }
    }
    assert!(mismatches.is_empty(), "{} lines differ:\n{}", mismatches.len(), mismatches.join("\n"));
}

#[test]
fn add_special_tokens_adds_bos_exactly_when_llama_cpp_does() {
    for Model { reference, tokenizer: tok, .. } in models() {
        for case in &reference.cases {
            assert_eq!(
                tok.encode(&case.text, true).unwrap(),
                case.ids_add_special,
                "{}: {:?}",
                reference.model,
                case.text
            );
        }
    }
}

#[test]
fn decode_of_encode_is_the_original_text_after_the_vocabularys_space_prefix() {
    for Model { reference, tokenizer: tok, space_prefix } in models() {
        for case in reference.cases.iter().filter(|c| !c.has_special) {
            let text = if *space_prefix { format!(" {}", case.text) } else { case.text.clone() };
            assert_eq!(tok.decode(&tok.encode(&case.text, false).unwrap()), text, "{}", reference.model);
        }
    }
}

#[test]
fn decode_matches_llama_cpp_detokenize_which_drops_control_tokens() {
    for Model { reference, tokenizer: tok, .. } in models() {
        for case in &reference.cases {
            assert_eq!(tok.decode(&case.ids), case.detokenized, "{}: {:?}", reference.model, case.text);
        }
    }
}

#[test]
fn streaming_token_bytes_through_the_detokenizer_equals_decode() {
    for Model { reference, tokenizer: tok, .. } in models() {
        for case in &reference.cases {
            let mut d = Detokenizer::new();
            let mut streamed = String::new();
            for &id in &case.ids {
                let piece = d.push(tok.token_bytes(id));
                assert!(!piece.contains('\u{FFFD}'), "{:?}: streamed a replacement char", case.text);
                streamed.push_str(&piece);
            }
            streamed.push_str(&d.finish());
            assert_eq!(streamed, tok.decode(&case.ids), "{}: {:?}", reference.model, case.text);
        }
    }
}

#[test]
fn special_ids_and_vocab_size_match_llama_cpp() {
    for Model { reference: r, tokenizer: tok, .. } in models() {
        assert_eq!(tok.vocab_size(), r.n_vocab);
        assert_eq!(tok.bos_id(), Some(r.bos_id));
        assert_eq!(tok.eos_ids()[0], r.eos_id, "the GGUF's eos comes first");
        let mut ours = tok.eos_ids().to_vec();
        ours.sort_unstable();
        let mut theirs = r.eog_ids.clone();
        theirs.sort_unstable();
        assert_eq!(ours, theirs, "{}: end-of-generation ids differ from llama.cpp's", r.model);
        assert!(tok.token_bytes(r.eos_id).is_empty(), "{}: eos would print text", r.model);
    }
    // The default model's end-of-generation tokens are all control tokens: none prints. (Gemma's
    // `</s>` is user-defined, so it prints, as in llama.cpp.)
    let tok = &default_model().tokenizer;
    for &id in tok.eos_ids() {
        assert!(tok.token_bytes(id).is_empty(), "eos id {id} would print text");
    }
}

#[test]
fn tokenizer_json_for_a_router_encodes_like_the_worker() {
    for Model { reference, tokenizer: tok, .. } in models() {
        let json = tok.tokenizer_json().unwrap();
        let router: tokenizers::Tokenizer = json.parse().unwrap();
        for case in &reference.cases {
            for add_special in [false, true] {
                let theirs = router.encode(case.text.as_str(), add_special).unwrap();
                assert_eq!(theirs.get_ids(), tok.encode(&case.text, add_special).unwrap(), "{:?}", case.text);
            }
        }
    }
}

#[test]
fn smollm2_chat_template_from_the_gguf_renders_chatml() {
    let tok = &default_model().tokenizer;
    assert!(tok.chat_template().is_some_and(|t| t.contains("<|im_start|>")));
    let user = ChatMessage::new("user".into(), "What is 2+2?".into());
    let system = ChatMessage::new("system".into(), "Be brief.".into());

    let prompt = tok.apply_chat_template(std::slice::from_ref(&user), true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let prompt = tok.apply_chat_template(&[system, user], false).unwrap();
    assert_eq!(prompt, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n");

    // The rendered markers become control tokens, not text.
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|>");
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 2);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
}

#[test]
fn gemma3_without_a_template_in_its_gguf_renders_gemma_turns() {
    let tok = &gemma3().tokenizer;
    let messages = [
        ChatMessage::new("system".into(), "Be brief.".into()),
        ChatMessage::new("user".into(), " What is 2+2? ".into()),
        ChatMessage::new("assistant".into(), "4".into()),
        ChatMessage::new("user".into(), "And 3+3?".into()),
    ];
    let prompt = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        prompt,
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n\
         <start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n"
    );
    // One BOS (the template's), and the turn markers are control tokens.
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
    assert_eq!(ids[..2], [2, 105], "<bos><start_of_turn>");
    assert!(tok.eos_ids().contains(&106), "<end_of_turn> ends generation");
    let two_users = [messages[1].clone(), messages[1].clone()];
    let err = tok.apply_chat_template(&two_users, true).unwrap_err().to_string();
    assert!(err.contains("alternate"), "{err}");
}

#[test]
fn deepseek_r1_chat_template_from_the_gguf_renders_its_turns_and_drops_past_reasoning() {
    let tok = &deepseek_qwen().tokenizer;
    let messages = [
        ChatMessage::new("system".into(), "Be brief.".into()),
        ChatMessage::new("user".into(), "What is 2+2?".into()),
        ChatMessage::new("assistant".into(), "<think>Two and two.</think>4".into()),
        ChatMessage::new("user".into(), "And 3+3?".into()),
    ];
    let prompt = tok.apply_chat_template(&messages, true).unwrap();
    // As Hugging Face's jinja2 renders the template (namespace, `is none`, str.split): the system
    // text after BOS, a past answer without its reasoning.
    assert_eq!(
        prompt,
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>\
         <｜User｜>And 3+3?<｜Assistant｜>"
    );
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids[0], 151646, "<｜begin▁of▁sentence｜> is one control token");
    assert_eq!(ids.iter().filter(|&&id| id == 151646).count(), 1, "one BOS: the template's");
    assert!(tok.eos_ids().contains(&151643), "<｜end▁of▁sentence｜> ends generation");
}
