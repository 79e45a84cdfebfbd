//! The JSON shapes the API answers with (OpenAI's), and usage accounting across choices.

use bellows_proto::worker::v1 as pb;
use serde::Serialize;

use super::request::Endpoint;

pub fn finish_reason(f: pb::FinishReason) -> &'static str {
    match f {
        pb::FinishReason::Length => "length",
        _ => "stop",
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct UsageOut {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl UsageOut {
    /// Add one choice's usage. Choices of the same prompt share its prompt tokens, which are
    /// counted once (for the first choice of each prompt), as OpenAI counts them.
    pub fn add(&mut self, usage: &pb::Usage, first_choice_of_its_prompt: bool) {
        if first_choice_of_its_prompt {
            self.prompt_tokens += usage.prompt_tokens;
            self.prompt_tokens_details.cached_tokens += usage.cached_prompt_tokens;
        }
        self.completion_tokens += usage.completion_tokens;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
    }
}

/// What every response and chunk starts with.
#[derive(Debug, Clone, Serialize)]
pub struct Header<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
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
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

/// One streamed chunk for choice `index`: `role` opens a chat choice, `text` continues it,
/// `finish` closes it.
pub fn chunk(
    endpoint: Endpoint,
    header: &Header<'_>,
    index: u32,
    role: bool,
    text: Option<&str>,
    finish: Option<&'static str>,
) -> String {
    let json = match endpoint {
        Endpoint::ChatCompletions => {
            let delta = ChatDelta { role: role.then_some("assistant"), content: text };
            let choice = ChatChunkChoice { index, delta, logprobs: None, finish_reason: finish };
            serde_json::to_string(&Chunk { header, choices: [choice], usage: None })
        }
        Endpoint::Completions => {
            let choice = TextChoice { index, text: text.unwrap_or(""), logprobs: None, finish_reason: finish };
            serde_json::to_string(&Chunk { header, choices: [choice], usage: None })
        }
    };
    json.expect("chunks serialize")
}

/// The last chunk when the client asked for `stream_options.include_usage`: no choices.
pub fn usage_chunk(header: &Header<'_>, usage: UsageOut) -> String {
    serde_json::to_string(&Chunk { header, choices: [(); 0], usage: Some(usage) }).expect("chunks serialize")
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: Message<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

/// A whole (non-streamed) response; `choices` holds each choice's text and finish reason.
pub fn completion(
    endpoint: Endpoint,
    header: &Header<'_>,
    choices: &[(String, &'static str)],
    usage: UsageOut,
) -> String {
    let json = match endpoint {
        Endpoint::ChatCompletions => {
            let choices: Vec<_> = choices
                .iter()
                .enumerate()
                .map(|(i, (text, finish))| ChatChoice {
                    index: i as u32,
                    message: Message { role: "assistant", content: text },
                    logprobs: None,
                    finish_reason: finish,
                })
                .collect();
            serde_json::to_string(&Chunk { header, choices, usage: Some(usage) })
        }
        Endpoint::Completions => {
            let choices: Vec<_> = choices
                .iter()
                .enumerate()
                .map(|(i, (text, finish))| TextChoice {
                    index: i as u32,
                    text,
                    logprobs: None,
                    finish_reason: Some(finish),
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

    #[test]
    fn prompt_tokens_are_counted_once_per_prompt_not_per_choice() {
        let mut u = UsageOut::default();
        let one = pb::Usage { prompt_tokens: 10, completion_tokens: 3, cached_prompt_tokens: 8 };
        u.add(&one, true);
        u.add(&one, false);
        assert_eq!(u.prompt_tokens, 10);
        assert_eq!(u.prompt_tokens_details.cached_tokens, 8);
        assert_eq!(u.completion_tokens, 6);
        assert_eq!(u.total_tokens, 16);
    }

    #[test]
    fn chat_chunks_have_openais_shape() {
        let h = Header { id: "chatcmpl-1", object: "chat.completion.chunk", created: 7, model: "m" };
        let v: serde_json::Value =
            serde_json::from_str(&chunk(Endpoint::ChatCompletions, &h, 0, true, Some(""), None)).unwrap();
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v["choices"][0]["finish_reason"], serde_json::Value::Null);
        assert_eq!(v["object"], "chat.completion.chunk");
        let v: serde_json::Value =
            serde_json::from_str(&chunk(Endpoint::ChatCompletions, &h, 1, false, None, Some("length"))).unwrap();
        assert_eq!(v["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(v["choices"][0]["index"], 1);
        let v: serde_json::Value = serde_json::from_str(&usage_chunk(&h, UsageOut::default())).unwrap();
        assert_eq!(v["choices"], serde_json::json!([]));
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }
}
