//! What a choice is generated with, and what comes back of it, in the router's own terms: the
//! protocol parsers fill these in and the renderers read them, and none of them sees the
//! worker's proto (its conversions are all in [`crate::wire`]). A protocol added, or a field
//! added to the proto, changes one side of that module, not every parser and renderer.

use std::collections::HashMap;

use bellows_common::constraint::Constraint;

/// How tokens are drawn. `None` leaves the worker's default (temperature 1, no nucleus, no
/// penalties); the parsers have checked each value's range.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id to bias, within the model's vocabulary (checked once the model is known).
    pub logit_bias: HashMap<u32, f32>,
    /// Absent: random.
    pub seed: Option<u64>,
}

/// How each choice is generated: what the worker receives besides the prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationParams {
    pub sampling: Sampling,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Control tokens the model generates are written out in its text (vLLM's
    /// `skip_special_tokens: false`; and for a tool-call syntax that starts with one).
    pub keep_special_tokens: bool,
    /// What the output must match (structured outputs); `None` = free text.
    pub structured: Option<Structured>,
    /// Report each token's logprob with this many alternatives; `None` = no logprobs.
    pub top_logprobs: Option<u32>,
}

/// A request's constraint and the field it came in, which its errors name.
#[derive(Debug, Clone, PartialEq)]
pub struct Structured {
    pub constraint: Constraint,
    /// `response_format`, `guided_json`, `guided_regex`, `guided_grammar` or `tool_choice`.
    pub param: &'static str,
}

/// Why a choice's generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of sequence, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context window.
    Length,
}

/// One choice's token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens read from the prefix cache.
    pub cached_prompt_tokens: u32,
}

/// A generated token's log-probability under the model, and the most likely tokens at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The token's bytes (empty for a control token).
    pub token: Vec<u8>,
    /// Most likely first.
    pub top: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub token: Vec<u8>,
}
