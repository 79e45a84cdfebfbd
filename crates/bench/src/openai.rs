//! The slice of the OpenAI API the stand-in workers speak: just enough of `/v1/completions` and
//! `/v1/chat/completions` (streaming and not, with usage) for a router to forward requests and
//! for the load generator to read timing and cache hits back.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            _ => None,
        }
    }
}

/// The fields of a request the stand-ins act on; everything else is ignored.
#[derive(Debug, Deserialize)]
pub struct Request {
    #[serde(default)]
    pub model: String,
    pub prompt: Option<Prompt>,
    #[serde(default)]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

impl Request {
    pub fn max_tokens(&self, default: u32) -> u32 {
        self.max_completion_tokens.or(self.max_tokens).unwrap_or(default).max(1)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Identity of one response: every chunk of a stream repeats it.
pub struct Reply<'a> {
    pub endpoint: Endpoint,
    pub id: &'a str,
    pub model: &'a str,
    pub created: u64,
}

impl Reply<'_> {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A whole (non-streamed) answer.
    pub fn whole(&self, text: &str, finish: &str, usage: Usage) -> Bytes {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        let body = json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_json(usage),
        });
        Bytes::from(body.to_string())
    }

    /// One SSE event carrying text and/or the finish reason.
    pub fn chunk(&self, text: &str, finish: Option<&str>) -> Bytes {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            Endpoint::Chat => {
                json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
            }
        };
        self.event(json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }))
    }

    /// The usage event that ends a stream when the client asked for `include_usage`.
    pub fn usage_chunk(&self, usage: Usage) -> Bytes {
        self.event(json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(usage),
        }))
    }

    fn event(&self, v: Value) -> Bytes {
        Bytes::from(format!("data: {v}\n\n"))
    }
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
