//! The JSON shapes the API answers with (OpenAI's), and usage accounting across choices.

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::request::Endpoint;
use crate::generation::{Finish, TokenLogprobs, Usage};
use crate::tools::{self, ParsedCall};

pub fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        Finish::Stop => "stop",
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct UsageOut {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct CompletionTokensDetails {
    /// Tokens the model spent thinking (within `completion_tokens`).
    pub reasoning_tokens: u32,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl UsageOut {
    /// Add one choice's usage. Choices of the same prompt share its prompt tokens, which are
    /// counted once (for the first choice of each prompt), as OpenAI counts them.
    pub fn add(&mut self, usage: &Usage, first_choice_of_its_prompt: bool) {
        if first_choice_of_its_prompt {
            self.prompt_tokens += usage.prompt_tokens;
            self.prompt_tokens_details.cached_tokens += usage.cached_prompt_tokens;
        }
        self.completion_tokens += usage.completion_tokens;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
    }

    /// Add one choice's thinking tokens (already counted in its completion tokens).
    pub fn add_reasoning(&mut self, tokens: u32) {
        self.completion_tokens_details.reasoning_tokens += tokens;
    }
}

/// What every response and chunk starts with.
#[derive(Debug, Clone, Serialize)]
pub struct Header<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    /// The request's class as OpenAI names it (docs/priority.md).
    pub service_tier: &'static str,
}

#[derive(Serialize)]
struct Chunk<'a, C: Serialize> {
    #[serde(flatten)]
    header: &'a Header<'a>,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageOut>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    logprobs: Option<Value>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Value>>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<Value>,
    finish_reason: Option<&'static str>,
}

/// One streamed chunk for choice `index`: `role` opens a chat choice, `text` continues it (with
/// its tokens' `logprobs`, from [`logprobs`]), `finish` closes it.
pub fn chunk(
    endpoint: Endpoint,
    header: &Header<'_>,
    index: u32,
    role: bool,
    text: Option<&str>,
    logprobs: Option<Value>,
    finish: Option<&'static str>,
) -> String {
    let json = match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => {
            let delta = ChatDelta {
                role: role.then_some("assistant"),
                content: text,
                reasoning_content: None,
                tool_calls: None,
            };
            let choice = ChatChunkChoice { index, delta, logprobs, finish_reason: finish };
            serde_json::to_string(&Chunk { header, choices: [choice], usage: None })
        }
        Endpoint::Completions => {
            let choice = TextChoice { index, text: text.unwrap_or(""), logprobs, finish_reason: finish };
            serde_json::to_string(&Chunk { header, choices: [choice], usage: None })
        }
    };
    json.expect("chunks serialize")
}

/// A chat chunk carrying complete tool calls of choice `index`, numbered from `first` within
/// the choice (OpenAI's `delta.tool_calls[{index, id, type, function: {name, arguments}}]`).
pub fn tool_calls_chunk(header: &Header<'_>, index: u32, first: usize, calls: &[ParsedCall]) -> String {
    let tool_calls = calls.iter().enumerate().map(|(k, c)| tools::call_json(c, Some(first + k))).collect();
    let delta = ChatDelta { role: None, content: None, reasoning_content: None, tool_calls: Some(tool_calls) };
    let choice = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None };
    serde_json::to_string(&Chunk { header, choices: [choice], usage: None }).expect("chunks serialize")
}

/// The next fragment of call `call`'s arguments (OpenAI's shape: the index alone identifies
/// the call, its id and name came with its first chunk).
pub fn tool_arguments_chunk(header: &Header<'_>, index: u32, call: usize, fragment: &str) -> String {
    let tool_calls = vec![json!({"index": call, "function": {"arguments": fragment}})];
    let delta = ChatDelta { role: None, content: None, reasoning_content: None, tool_calls: Some(tool_calls) };
    let choice = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None };
    serde_json::to_string(&Chunk { header, choices: [choice], usage: None }).expect("chunks serialize")
}

/// A chat chunk carrying the next of choice `index`'s thinking, as `delta.reasoning_content`
/// (DeepSeek's name, which SGLang and most clients read).
pub fn reasoning_chunk(header: &Header<'_>, index: u32, text: &str) -> String {
    let delta = ChatDelta { role: None, content: None, reasoning_content: Some(text), tool_calls: None };
    let choice = ChatChunkChoice { index, delta, logprobs: None, finish_reason: None };
    serde_json::to_string(&Chunk { header, choices: [choice], usage: None }).expect("chunks serialize")
}

/// The last chunk when the client asked for `stream_options.include_usage`: no choices.
pub fn usage_chunk(header: &Header<'_>, usage: UsageOut) -> String {
    serde_json::to_string(&Chunk { header, choices: [(); 0], usage: Some(usage) }).expect("chunks serialize")
}

/// Tokens' logprobs in the endpoint's shape. Chat: `{content: [{token, logprob, bytes,
/// top_logprobs}], refusal}`. Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`,
/// where `offset` is the character offset of the first token's text in the choice, advanced
/// past these tokens (a stream keeps one per choice).
pub fn logprobs(endpoint: Endpoint, entries: &[TokenLogprobs], offset: &mut u32) -> Value {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => {
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let top: Vec<Value> = e
                        .top
                        .iter()
                        .map(|t| json!({"token": text(&t.token), "logprob": t.logprob, "bytes": t.token}))
                        .collect();
                    json!({"token": text(&e.token), "logprob": e.logprob, "bytes": e.token, "top_logprobs": top})
                })
                .collect();
            json!({"content": content, "refusal": null})
        }
        Endpoint::Completions => {
            let tokens: Vec<String> = entries.iter().map(|e| text(&e.token)).collect();
            let mut text_offset = Vec::with_capacity(tokens.len());
            for t in &tokens {
                text_offset.push(*offset);
                *offset += t.chars().count() as u32;
            }
            let top: Vec<Map<String, Value>> =
                entries.iter().map(|e| e.top.iter().map(|t| (text(&t.token), json!(t.logprob))).collect()).collect();
            let token_logprobs: Vec<f32> = entries.iter().map(|e| e.logprob).collect();
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
        }
    }
}

/// One choice of a whole answer.
pub struct ChoiceOut {
    pub text: String,
    /// The model's thinking, apart from `text` (empty for a model that does not think).
    pub reasoning: String,
    pub finish: &'static str,
    /// The choice's logprobs entries, when the request asked for them.
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// Calls parsed out of the text (which then holds only the rest).
    pub tool_calls: Vec<ParsedCall>,
    /// The stop string that ended the choice, when one did.
    pub stop_sequence: Option<String>,
}

/// `finish_reason` of a choice that made calls and stopped by itself: `tool_calls`.
pub fn finish_with_calls(finish: &'static str, made_calls: bool) -> &'static str {
    if made_calls && finish == "stop" { "tool_calls" } else { finish }
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: Message<'a>,
    logprobs: Option<Value>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    /// Null when the answer is only tool calls, as OpenAI's is.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Value>>,
}

/// A whole (non-streamed) response.
pub fn completion(endpoint: Endpoint, header: &Header<'_>, choices: &[ChoiceOut], usage: UsageOut) -> String {
    let lp = |c: &ChoiceOut| c.logprobs.as_ref().map(|e| logprobs(endpoint, e, &mut 0));
    let json = match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => {
            let choices: Vec<_> = choices
                .iter()
                .enumerate()
                .map(|(i, c)| ChatChoice {
                    index: i as u32,
                    message: Message {
                        role: "assistant",
                        content: (!c.text.is_empty() || c.tool_calls.is_empty()).then_some(c.text.as_str()),
                        reasoning_content: (!c.reasoning.is_empty()).then_some(c.reasoning.as_str()),
                        tool_calls: (!c.tool_calls.is_empty())
                            .then(|| c.tool_calls.iter().map(|t| tools::call_json(t, None)).collect()),
                    },
                    logprobs: lp(c),
                    finish_reason: c.finish,
                })
                .collect();
            serde_json::to_string(&Chunk { header, choices, usage: Some(usage) })
        }
        Endpoint::Completions => {
            let choices: Vec<_> = choices
                .iter()
                .enumerate()
                .map(|(i, c)| TextChoice {
                    index: i as u32,
                    text: &c.text,
                    logprobs: lp(c),
                    finish_reason: Some(c.finish),
                })
                .collect();
            serde_json::to_string(&Chunk { header, choices, usage: Some(usage) })
        }
    };
    json.expect("responses serialize")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::TopLogprob;

    #[test]
    fn prompt_tokens_are_counted_once_per_prompt_not_per_choice() {
        let mut u = UsageOut::default();
        let one = Usage { prompt_tokens: 10, completion_tokens: 3, cached_prompt_tokens: 8 };
        u.add(&one, true);
        u.add(&one, false);
        assert_eq!(u.prompt_tokens, 10);
        assert_eq!(u.prompt_tokens_details.cached_tokens, 8);
        assert_eq!(u.completion_tokens, 6);
        assert_eq!(u.total_tokens, 16);
    }

    #[test]
    fn chat_chunks_have_openais_shape() {
        let h = Header {
            id: "chatcmpl-1",
            object: "chat.completion.chunk",
            created: 7,
            model: "m",
            service_tier: "default",
        };
        let v: serde_json::Value =
            serde_json::from_str(&chunk(Endpoint::ChatCompletions, &h, 0, true, Some(""), None, None)).unwrap();
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v["choices"][0]["finish_reason"], serde_json::Value::Null);
        assert_eq!(v["object"], "chat.completion.chunk");
        let v: serde_json::Value =
            serde_json::from_str(&chunk(Endpoint::ChatCompletions, &h, 1, false, None, None, Some("length"))).unwrap();
        assert_eq!(v["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(v["choices"][0]["index"], 1);
        let v: serde_json::Value = serde_json::from_str(&usage_chunk(&h, UsageOut::default())).unwrap();
        assert_eq!(v["choices"], serde_json::json!([]));
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }

    fn entries() -> Vec<TokenLogprobs> {
        let top = |id: u32, lp: f32, t: &str| TopLogprob { token_id: id, logprob: lp, token: t.as_bytes().to_vec() };
        vec![
            TokenLogprobs { logprob: -0.5, token: b"He".to_vec(), top: vec![top(1, -0.5, "He"), top(2, -1.5, "She")] },
            TokenLogprobs { logprob: -0.25, token: "llé".as_bytes().to_vec(), top: vec![top(3, -0.25, "llé")] },
        ]
    }

    #[test]
    fn chat_logprobs_carry_token_bytes_and_alternatives_in_order() {
        let v = logprobs(Endpoint::ChatCompletions, &entries(), &mut 0);
        let c = &v["content"];
        assert_eq!(c[0]["token"], "He");
        assert_eq!(c[0]["logprob"], -0.5);
        assert_eq!(c[1]["bytes"], serde_json::json!([108, 108, 195, 169]));
        assert_eq!(
            c[0]["top_logprobs"][1],
            serde_json::json!({"token": "She", "logprob": -1.5, "bytes": [83, 104, 101]})
        );
        assert_eq!(v["refusal"], Value::Null);
    }

    #[test]
    fn completion_logprobs_offsets_run_on_across_chunks_in_characters() {
        let mut offset = 0;
        let first = logprobs(Endpoint::Completions, &entries(), &mut offset);
        assert_eq!(first["tokens"], serde_json::json!(["He", "llé"]));
        assert_eq!(first["token_logprobs"], serde_json::json!([-0.5, -0.25]));
        assert_eq!(first["top_logprobs"][0], serde_json::json!({"He": -0.5, "She": -1.5}));
        assert_eq!(first["text_offset"], serde_json::json!([0, 2]));
        let next = logprobs(Endpoint::Completions, &entries()[..1], &mut offset);
        assert_eq!(next["text_offset"], serde_json::json!([5]), "\"He\" + \"llé\" is five characters");
    }
}
