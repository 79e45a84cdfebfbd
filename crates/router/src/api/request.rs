//! Parsing and validating an OpenAI request body into a [`Job`]: everything the router checks
//! before it spends anything on a request.
//!
//! Validation is separate from routing so a bad request costs no tokenization, placement or
//! worker time, and so every rejection names its parameter. Unknown fields are ignored (clients
//! send vendor extensions); a known field of the wrong type or out of range is an error, never
//! silently coerced or clamped: a client that sends `temperature: 5` has a bug it must hear about.

use std::collections::HashMap;

use bellows_common::{
    chat_template::{ChatMessage, RESERVED_TEMPLATE_VARIABLES, TemplateKwargs},
    constraint::{Constraint, JsonBounds, SchemaError},
    priority::Priority,
    sampling_limits::{self as limits, Range},
};
use serde::Deserialize;
use serde_json::Value;

use super::{error::ApiError, strict_schema, tool_request};
use crate::{
    generation::{GenerationParams, Sampling, Structured},
    tools::Tools,
};

/// Which endpoint a body came to: OpenAI's chat and text completions, OpenAI's Responses
/// (`api::responses`) or Anthropic's Messages (`api::anthropic`), both of which the router runs
/// as a chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    Responses,
    Messages,
}

impl Endpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
        }
    }
}

/// Choices one request may ask for (`n` times the number of prompts).
pub const MAX_CHOICES: usize = 16;
/// Stop strings one request may give.
pub const MAX_STOP: usize = 16;

/// One prompt of a completions request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Chat(Vec<ChatMessage>),
    /// One or more prompts; each gets `n` choices.
    Prompts(Vec<Prompt>),
}

/// The most alternatives per token a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Compile a request's constraint as a worker would (milliseconds; bounded by the constraint
/// limits): a refusal names the field and, for a schema, the JSON pointer at fault.
pub fn check_structured(s: &Structured) -> Result<(), ApiError> {
    s.constraint.check_located().map_err(|SchemaError { message, pointer }| {
        let at = pointer.map(|p| format!(" (at JSON pointer '{p}' of the schema)")).unwrap_or_default();
        let what = match s.constraint {
            Constraint::JsonSchema(_) | Constraint::JsonObject => "schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "grammar",
        };
        ApiError::invalid(s.param, format!("Invalid {what} for '{}': {message}{at}", s.param))
    })
}

/// A valid request.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub endpoint: Endpoint,
    pub model: String,
    pub input: Input,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub params: GenerationParams,
    pub user: Option<String>,
    /// Chat only: the functions the model may call, and how.
    pub tools: Option<Tools>,
    /// The class it asked for (`service_tier` or `priority`); `None`: the tenant's default.
    pub priority: Option<Priority>,
    /// Chat only: extra variables for the chat template (vLLM's `chat_template_kwargs`).
    pub chat_template_kwargs: Option<TemplateKwargs>,
    /// vLLM's `cache_salt`: only requests with the same salt (and tenant) share prefix-cache
    /// blocks.
    pub cache_salt: Option<String>,
    /// Whether the JSON numbers of its constraint (and forced tool calls) get the default bounds.
    pub json_bounds: JsonBounds,
}

impl Job {
    /// The parameter a prompt-length error names. By endpoint, not by `input`: the input is
    /// moved out for tokenization before the prompt is checked against the model.
    pub fn prompt_param(&self) -> &'static str {
        match self.endpoint {
            Endpoint::ChatCompletions | Endpoint::Messages => "messages",
            Endpoint::Responses => "input",
            Endpoint::Completions => "prompt",
        }
    }
}

/// The body of both endpoints as sent; fields of the other endpoint are ignored.
#[derive(Debug, Deserialize)]
struct RawRequest {
    model: String,
    messages: Option<Vec<RawMessage>>,
    prompt: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
    stop: Option<Value>,
    seed: Option<i64>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<HashMap<String, f32>>,
    user: Option<String>,
    logprobs: Option<Value>,
    top_logprobs: Option<i64>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<u32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    response_format: Option<Value>,
    service_tier: Option<String>,
    // vLLM extensions, handy for benchmarks.
    priority: Option<i64>,
    ignore_eos: Option<bool>,
    stop_token_ids: Option<Vec<u32>>,
    skip_special_tokens: Option<bool>,
    // vLLM's structured-output extensions (docs/structured-outputs.md).
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_grammar: Option<String>,
    guided_choice: Option<Vec<String>>,
    chat_template_kwargs: Option<TemplateKwargs>,
    cache_salt: Option<String>,
    // Bellows' own: `false` lifts the default bounds on JSON numbers (docs/structured-outputs.md).
    bounded_json: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawMessage {
    role: String,
    content: Option<Value>,
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// Parse and validate a body. Model-dependent checks (token ids within the vocabulary, context
/// length) come later, once the model is known.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Job, ApiError> {
    validate(endpoint, deserialize(body)?)
}

/// A body as `T`: the plain parse is the fast path; a body it refuses is parsed again, tracking
/// the path, for the error's `param` (and taken if that parse accepts it: trailing bytes after
/// the object are tolerated, as they always were).
pub(super) fn deserialize<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    match serde_json::from_slice::<T>(body) {
        Ok(raw) => Ok(raw),
        Err(_) => parse_tracking_path(body),
    }
}

fn parse_tracking_path<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::InvalidRequest {
                message: format!("The body of the request is not valid JSON: {inner}"),
                param: None,
            }
        } else if path == "." {
            ApiError::InvalidRequest { message: format!("Invalid request: {inner}"), param: None }
        } else {
            ApiError::InvalidRequest {
                message: format!("Invalid type or value for '{path}': {inner}"),
                param: Some(path),
            }
        }
    })
}

fn validate(endpoint: Endpoint, mut raw: RawRequest) -> Result<Job, ApiError> {
    if raw.model.is_empty() {
        return Err(ApiError::invalid("model", "'model' must not be empty"));
    }
    let input = input(endpoint, raw.messages.take(), raw.prompt.take())?;
    unsupported(raw.echo == Some(true), "echo", "'echo' is not supported")?;
    unsupported(raw.suffix.as_deref().is_some_and(|s| !s.is_empty()), "suffix", "'suffix' is not supported")?;
    let top_logprobs = top_logprobs(endpoint, raw.logprobs.take(), raw.top_logprobs)?;
    let tools = tools(&input, raw.tools.take(), raw.tool_choice.take(), raw.parallel_tool_calls)?;
    let chat_template_kwargs = chat_template_kwargs(&input, raw.chat_template_kwargs.take())?;
    let json_bounds = if raw.bounded_json == Some(false) { JsonBounds::Unbounded } else { JsonBounds::Bounded };
    let structured = structured(
        json_bounds,
        raw.response_format.take(),
        raw.guided_json.take(),
        raw.guided_regex.take(),
        raw.guided_grammar.take(),
        raw.guided_choice.take(),
    )?;
    if let (Some(s), Some(_)) = (&structured, tools.as_ref().filter(|t| t.active())) {
        return Err(ApiError::invalid(s.param, format!("'{}' cannot be combined with tools", s.param)));
    }
    let n = choices(&input, raw.n, raw.best_of)?;
    let max_tokens = max_tokens(raw.max_completion_tokens, raw.max_tokens)?;
    let sampling = sampling(&mut raw)?;
    let stop = stop(raw.stop.take())?;
    let priority = priority(raw.service_tier.as_deref(), raw.priority)?;
    let cache_salt = cache_salt(raw.cache_salt.take())?;
    Ok(Job {
        endpoint,
        model: raw.model,
        input,
        n,
        stream: raw.stream.unwrap_or(false),
        include_usage: raw.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        params: GenerationParams {
            sampling,
            max_tokens,
            stop,
            stop_token_ids: raw.stop_token_ids.unwrap_or_default(),
            ignore_eos: raw.ignore_eos.unwrap_or(false),
            keep_special_tokens: !raw.skip_special_tokens.unwrap_or(true),
            structured,
            top_logprobs,
        },
        user: raw.user,
        tools,
        priority,
        chat_template_kwargs,
        cache_salt,
        json_bounds,
    })
}

/// The longest `cache_salt` taken, in bytes (vLLM suggests 43 characters: 256 random bits).
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// A request's prefix-cache salt: a non-empty string of at most [`MAX_CACHE_SALT_BYTES`].
fn cache_salt(salt: Option<String>) -> Result<Option<String>, ApiError> {
    const PARAM: &str = "cache_salt";
    match salt {
        Some(s) if s.is_empty() => Err(ApiError::invalid(PARAM, "'cache_salt' must not be empty")),
        Some(s) if s.len() > MAX_CACHE_SALT_BYTES => Err(ApiError::invalid(
            PARAM,
            format!("'cache_salt' is {} bytes; at most {MAX_CACHE_SALT_BYTES} are taken", s.len()),
        )),
        salt => Ok(salt),
    }
}

/// Extra chat-template variables: for chat only, and never one the renderer sets itself.
pub(super) fn chat_template_kwargs(
    input: &Input,
    kwargs: Option<TemplateKwargs>,
) -> Result<Option<TemplateKwargs>, ApiError> {
    const PARAM: &str = "chat_template_kwargs";
    let Some(kwargs) = kwargs else { return Ok(None) };
    unsupported(matches!(input, Input::Prompts(_)), PARAM, "'chat_template_kwargs' is for /v1/chat/completions")?;
    if let Some(name) = kwargs.keys().find(|k| RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str())) {
        return Err(ApiError::invalid(PARAM, format!("'chat_template_kwargs' may not set '{name}'")));
    }
    Ok(Some(kwargs))
}

/// The class a request names: OpenAI's `service_tier` or vLLM's `priority` (both, only if
/// they agree).
pub(super) fn priority(service_tier: Option<&str>, vllm: Option<i64>) -> Result<Option<Priority>, ApiError> {
    let tier = service_tier
        .map(Priority::from_service_tier)
        .transpose()
        .map_err(|_| {
            ApiError::invalid("service_tier", "'service_tier' must be one of 'auto', 'default', 'priority' or 'flex'")
        })?
        .flatten();
    match (tier, vllm.map(Priority::from_vllm)) {
        (Some(a), Some(b)) if a != b => Err(ApiError::invalid(
            "priority",
            format!("'priority' names the {b} class but 'service_tier' names {a}: send one of them"),
        )),
        (tier, vllm) => Ok(tier.or(vllm)),
    }
}

/// The endpoint's own input: `messages` for chat, `prompt` for completions.
fn input(endpoint: Endpoint, messages: Option<Vec<RawMessage>>, prompt: Option<Value>) -> Result<Input, ApiError> {
    Ok(match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => {
            let messages = messages.ok_or_else(|| ApiError::invalid("messages", "'messages' is required"))?;
            Input::Chat(chat_messages(messages)?)
        }
        Endpoint::Completions => {
            let prompt = prompt.ok_or_else(|| ApiError::invalid("prompt", "'prompt' is required"))?;
            Input::Prompts(prompts(prompt)?)
        }
    })
}

/// Tools are for chat, where the history's tool turns must answer earlier calls; a
/// completions request that sends tools is refused, not ignored.
fn tools(
    input: &Input,
    tools: Option<Vec<Value>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    match input {
        Input::Chat(messages) => {
            let tools = tool_request::parse(tools, choice, parallel)?;
            tool_request::check_tool_turns(messages)?;
            Ok(tools)
        }
        Input::Prompts(_) => {
            unsupported(tools.is_some_and(|t| !t.is_empty()), "tools", "tools are for /v1/chat/completions")?;
            Ok(None)
        }
    }
}

/// `n`, within [`MAX_CHOICES`] over all prompts; `best_of` only as `n`.
fn choices(input: &Input, n: Option<u32>, best_of: Option<u32>) -> Result<u32, ApiError> {
    let n = n.unwrap_or(1);
    let prompts = match input {
        Input::Chat(_) => 1,
        Input::Prompts(p) => p.len(),
    };
    if n == 0 || n as usize * prompts > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!("'n' must be at least 1, and n times the number of prompts at most {MAX_CHOICES}"),
        ));
    }
    if let Some(best_of) = best_of {
        unsupported(best_of != n, "best_of", "'best_of' other than n is not supported")?;
    }
    Ok(n)
}

/// `max_completion_tokens` is the newer name; when both are given it wins.
fn max_tokens(max_completion_tokens: Option<u32>, max_tokens: Option<u32>) -> Result<Option<u32>, ApiError> {
    let (max_tokens, param) = match (max_completion_tokens, max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    if max_tokens == Some(0) {
        return Err(ApiError::invalid(param, format!("'{param}' must be at least 1")));
    }
    Ok(max_tokens)
}

fn sampling(raw: &mut RawRequest) -> Result<Sampling, ApiError> {
    Ok(Sampling {
        temperature: in_range(raw.temperature, "temperature", limits::TEMPERATURE)?,
        top_p: in_range(raw.top_p, "top_p", limits::TOP_P)?,
        // -1 means off, as in vLLM.
        top_k: match raw.top_k {
            None | Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(k as u32),
            Some(_) => return Err(ApiError::invalid("top_k", "'top_k' must be -1 (off), 0 (off) or positive")),
        },
        min_p: in_range(raw.min_p, "min_p", limits::MIN_P)?,
        repetition_penalty: in_range(raw.repetition_penalty, "repetition_penalty", limits::REPETITION_PENALTY)?,
        presence_penalty: in_range(raw.presence_penalty, "presence_penalty", limits::PRESENCE_PENALTY)?,
        frequency_penalty: in_range(raw.frequency_penalty, "frequency_penalty", limits::FREQUENCY_PENALTY)?,
        logit_bias: logit_bias(raw.logit_bias.take().unwrap_or_default())?,
        seed: raw.seed.map(|s| s as u64),
    })
}

/// `stop`: a string or an array of at most [`MAX_STOP`] non-empty strings.
fn stop(stop: Option<Value>) -> Result<Vec<String>, ApiError> {
    let not_strings = || ApiError::invalid("stop", "'stop' must be a string or an array of strings");
    let stop = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(not_strings()),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(not_strings()),
    };
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", format!("'stop' takes at most {MAX_STOP} non-empty strings")));
    }
    Ok(stop)
}

/// Chat: `logprobs: true` with `top_logprobs` alternatives (0 unless given; given without
/// `logprobs`, an error). Completions: `logprobs: k`, the legacy form. Both at most 20.
fn top_logprobs(endpoint: Endpoint, logprobs: Option<Value>, top: Option<i64>) -> Result<Option<u32>, ApiError> {
    let range = |param: &str, k: i64| {
        if (0..=MAX_TOP_LOGPROBS).contains(&k) {
            Ok(k as u32)
        } else {
            Err(ApiError::invalid(param, format!("'{param}' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}")))
        }
    };
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => {
            let on = match logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(_) => return Err(ApiError::invalid("logprobs", "'logprobs' must be a boolean")),
            };
            match (on, top) {
                (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "'top_logprobs' requires 'logprobs': true")),
                (false, None) => Ok(None),
                (true, top) => range("top_logprobs", top.unwrap_or(0)).map(Some),
            }
        }
        Endpoint::Completions => match logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(k) => range("logprobs", k).map(Some),
                None => Err(ApiError::invalid("logprobs", "'logprobs' must be an integer")),
            },
            Some(_) => Err(ApiError::invalid("logprobs", "'logprobs' must be an integer")),
        },
    }
}

/// The one constraint a request may carry: OpenAI's `response_format` or one of vLLM's
/// `guided_*` fields. Only the shape is checked here; [`check_structured`] compiles it.
fn structured(
    bounds: JsonBounds,
    response_format: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_grammar: Option<String>,
    guided_choice: Option<Vec<String>>,
) -> Result<Option<Structured>, ApiError> {
    let mut given = Vec::new();
    if let Some(f) = response_format
        && let Some(c) = response_format_constraint(f, bounds)?
    {
        given.push(Structured { constraint: c, param: "response_format" });
    }
    if let Some(schema) = guided_json {
        let schema = match schema {
            // vLLM accepts the schema as JSON text too.
            Value::String(text) => serde_json::from_str(&text)
                .map_err(|e| ApiError::invalid("guided_json", format!("'guided_json' is not valid JSON: {e}")))?,
            Value::Object(_) => schema,
            _ => return Err(ApiError::invalid("guided_json", "'guided_json' must be a JSON Schema object")),
        };
        given.push(Structured { constraint: Constraint::json_schema(schema, bounds), param: "guided_json" });
    }
    if let Some(rx) = guided_regex {
        given.push(Structured { constraint: Constraint::Regex(rx), param: "guided_regex" });
    }
    if let Some(lark) = guided_grammar {
        given.push(Structured { constraint: Constraint::Lark(lark), param: "guided_grammar" });
    }
    if let Some(choices) = guided_choice {
        given.push(Structured { constraint: choice_constraint(&choices)?, param: "guided_choice" });
    }
    if given.len() > 1 {
        let names: Vec<&str> = given.iter().map(|s| s.param).collect();
        return Err(ApiError::invalid(
            given[1].param,
            format!("give at most one constraint, got {}", names.join(", ")),
        ));
    }
    Ok(given.pop())
}

/// vLLM's `guided_choice`: the answer is exactly one of the strings, as a regex of their
/// alternation with every metacharacter escaped (a choice `a+b` means those three characters).
fn choice_constraint(choices: &[String]) -> Result<Constraint, ApiError> {
    if choices.is_empty() {
        return Err(ApiError::invalid("guided_choice", "'guided_choice' must list at least one string"));
    }
    let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
    Ok(Constraint::Regex(format!("({})", alternatives.join("|"))))
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `{name, schema, strict, description}` (an absent schema allows any JSON value).
pub(super) fn response_format_constraint(f: Value, bounds: JsonBounds) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: &str| ApiError::invalid("response_format", m.to_string());
    let Value::Object(f) = f else { return Err(bad("'response_format' must be an object")) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::json_object(bounds))),
        Some("json_schema") => {
            let Some(Value::Object(js)) = f.get("json_schema") else {
                return Err(bad("'response_format.json_schema' is required for type 'json_schema'"));
            };
            match js.get("name") {
                Some(Value::String(n))
                    if (1..=64).contains(&n.len())
                        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => {}
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "'response_format.json_schema.name' must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
                    ));
                }
            }
            if js.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return Err(bad("'response_format.json_schema.strict' must be a boolean"));
            }
            if js.get("strict") == Some(&Value::Bool(true))
                && let Some(schema) = js.get("schema")
                && let Err(e) = strict_schema::check(schema)
            {
                return Err(bad(&format!("'response_format.json_schema.schema' is marked strict, but {e}")));
            }
            match js.get("schema") {
                None | Some(Value::Null) => {
                    Ok(Some(Constraint::json_schema(Value::Object(Default::default()), bounds)))
                }
                Some(s @ Value::Object(_)) => Ok(Some(Constraint::json_schema(s.clone(), bounds))),
                Some(_) => Err(bad("'response_format.json_schema.schema' must be a JSON Schema object")),
            }
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("unknown response_format type {other:?} (expected text, json_object or json_schema)"),
        )),
        None => Err(ApiError::invalid("response_format.type", "'response_format.type' is required")),
    }
}

fn unsupported(bad: bool, param: &str, message: &str) -> Result<(), ApiError> {
    if bad { Err(ApiError::invalid(param, message)) } else { Ok(()) }
}

/// `x` within the parameter's range (shared with the worker). NaN is never in range.
pub(super) fn in_range(x: Option<f32>, param: &str, range: Range) -> Result<Option<f32>, ApiError> {
    match x {
        Some(v) if !range.contains(v) => {
            Err(ApiError::invalid(param, format!("'{param}' must be in {range}, got {v}")))
        }
        other => Ok(other),
    }
}

fn logit_bias(raw: HashMap<String, f32>) -> Result<HashMap<u32, f32>, ApiError> {
    raw.into_iter()
        .map(|(k, v)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::invalid("logit_bias", format!("'logit_bias' keys must be token ids, got {k:?}"))
            })?;
            if !limits::LOGIT_BIAS.contains(v) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' values must be in {}, got {v}", limits::LOGIT_BIAS),
                ));
            }
            Ok((id, v))
        })
        .collect()
}

pub(super) fn chat_messages(raw: Vec<RawMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if raw.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' must contain at least one message"));
    }
    raw.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let param = || format!("messages[{i}]");
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" | "tool" => m.role,
                // OpenAI's newer name for the system role.
                "developer" => "system".to_string(),
                other => {
                    return Err(ApiError::invalid(
                        format!("{}.role", param()),
                        format!("unknown role {other:?} (expected system, developer, user, assistant or tool)"),
                    ));
                }
            };
            let content = match m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s,
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("{}.content", param()),
                                    "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                ));
                            }
                        }
                    }
                    text
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("{}.content", param()),
                        "'content' must be a string or an array of content parts",
                    ));
                }
            };
            let tool_calls = match role.as_str() {
                "assistant" => tool_request::history_calls(i, m.tool_calls)?,
                _ => Vec::new(),
            };
            Ok(ChatMessage { role, content, tool_calls, tool_call_id: m.tool_call_id })
        })
        .collect()
}

fn prompts(raw: Value) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of strings, an array of token ids, or an array of arrays of token ids",
        )
    };
    let token = |v: &Value| v.as_u64().and_then(|t| u32::try_from(t).ok());
    let tokens = |items: &[Value]| items.iter().map(token).collect::<Option<Vec<u32>>>();
    let out = match raw {
        Value::String(s) => vec![Prompt::Text(s)],
        Value::Array(items) if items.is_empty() => return Err(ApiError::invalid("prompt", "'prompt' is empty")),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(Prompt::Text(s)),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![Prompt::Tokens(tokens(&items).ok_or_else(bad)?)],
            Value::Array(_) => items
                .iter()
                .map(|v| v.as_array().and_then(|a| tokens(a)).map(Prompt::Tokens).ok_or_else(bad))
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    if out.iter().any(|p| matches!(p, Prompt::Tokens(t) if t.is_empty())) {
        return Err(ApiError::invalid("prompt", "a token-id prompt must not be empty"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Job, ApiError> {
        parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("not an invalid-request error: {other:?}"),
        }
    }

    #[test]
    fn guided_choice_matches_exactly_its_strings_with_every_metacharacter_escaped() {
        let with = |choices: &str| {
            chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"guided_choice":{choices}}}"#))
        };
        let s = with(r#"["a+b", "c.d (e)", "yes"]"#).unwrap().params.structured.expect("a constraint");
        assert_eq!(s.param, "guided_choice");
        assert_eq!(s.constraint, Constraint::Regex(r"(a\+b|c\.d \(e\)|yes)".into()));
        check_structured(&s).expect("the alternation compiles");
        assert_eq!(param_of(with("[]").unwrap_err()).as_deref(), Some("guided_choice"));
        assert_eq!(param_of(with(r#""yes""#).unwrap_err()).as_deref(), Some("guided_choice"));
    }

    #[test]
    fn chat_template_kwargs_are_for_chat_and_never_shadow_the_renderers_variables() {
        let with =
            |extra: &str| chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#));
        let kwargs =
            with(r#","chat_template_kwargs":{"enable_thinking":false}"#).unwrap().chat_template_kwargs.unwrap();
        assert_eq!(kwargs["enable_thinking"], Value::Bool(false));
        for bad in [r#","chat_template_kwargs":{"messages":[]}"#, r#","chat_template_kwargs":true"#] {
            assert_eq!(param_of(with(bad).unwrap_err()).as_deref(), Some("chat_template_kwargs"), "{bad}");
        }
        let completion = parse(Endpoint::Completions, br#"{"model":"m","prompt":"x","chat_template_kwargs":{}}"#);
        assert_eq!(param_of(completion.unwrap_err()).as_deref(), Some("chat_template_kwargs"));
    }

    #[test]
    fn a_cache_salt_is_a_short_non_empty_string_on_either_endpoint() {
        let with = |salt: &str| {
            parse(Endpoint::Completions, format!(r#"{{"model":"m","prompt":"x","cache_salt":{salt}}}"#).as_bytes())
        };
        assert_eq!(with(r#""abc""#).unwrap().cache_salt.as_deref(), Some("abc"));
        let long = format!(r#""{}""#, "s".repeat(MAX_CACHE_SALT_BYTES + 1));
        for bad in [r#""""#, "7", long.as_str()] {
            assert_eq!(param_of(with(bad).unwrap_err()).as_deref(), Some("cache_salt"), "{bad}");
        }
        let chat = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"s"}"#).unwrap();
        assert_eq!(chat.cache_salt.as_deref(), Some("s"));
    }

    #[test]
    fn a_minimal_chat_request_takes_the_defaults() {
        let job = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(job.n, 1);
        assert!(!job.stream);
        assert_eq!(job.params.max_tokens, None);
        assert_eq!(job.params.sampling, Sampling::default());
        assert_eq!(job.input, Input::Chat(vec![ChatMessage::new("user".into(), "hi".into())]));
    }

    #[test]
    fn a_class_is_named_by_service_tier_or_vllm_priority_and_a_conflict_is_refused() {
        let with =
            |extra: &str| chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#));
        assert_eq!(with("").unwrap().priority, None);
        assert_eq!(with(r#","service_tier":"auto""#).unwrap().priority, None);
        assert_eq!(with(r#","service_tier":"priority""#).unwrap().priority, Some(Priority::Interactive));
        assert_eq!(with(r#","service_tier":"flex""#).unwrap().priority, Some(Priority::Batch));
        assert_eq!(with(r#","priority":-1"#).unwrap().priority, Some(Priority::Interactive));
        assert_eq!(with(r#","priority":10,"service_tier":"flex""#).unwrap().priority, Some(Priority::Batch));
        assert_eq!(param_of(with(r#","service_tier":"scale""#).unwrap_err()), Some("service_tier".into()));
        assert_eq!(param_of(with(r#","priority":-1,"service_tier":"flex""#).unwrap_err()), Some("priority".into()));
        assert_eq!(param_of(with(r#","priority":"high""#).unwrap_err()), Some("priority".into()));
    }

    #[test]
    fn unknown_fields_are_ignored_but_wrong_types_name_their_parameter() {
        assert!(chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"frobnicate":1}"#).is_ok());
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#).unwrap_err();
        assert_eq!(param_of(e), Some("temperature".into()));
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-5}"#).unwrap_err();
        assert_eq!(param_of(e), Some("max_tokens".into()));
    }

    #[test]
    fn out_of_range_sampling_parameters_are_refused_not_clamped() {
        for (field, value) in [
            ("temperature", "2.5"),
            ("top_p", "0"),
            ("min_p", "1.5"),
            ("presence_penalty", "-3"),
            ("frequency_penalty", "9"),
            ("repetition_penalty", "0"),
            ("top_k", "-2"),
            ("n", "0"),
            ("max_tokens", "0"),
        ] {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"{field}":{value}}}"#);
            let e = chat(&body).unwrap_err();
            assert_eq!(param_of(e), Some(field.to_string()), "{field}={value}");
        }
    }

    #[test]
    fn malformed_json_is_a_400_without_a_parameter() {
        let e = chat(r#"{"model":"m","messages":[{"role""#).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(param_of(e), None);
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let job = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":7}"#,
        )
        .unwrap();
        assert_eq!(job.params.max_tokens, Some(7));
    }

    #[test]
    fn completions_take_every_prompt_shape() {
        let p = |body: &str| parse(Endpoint::Completions, body.as_bytes()).map(|j| j.input);
        assert_eq!(p(r#"{"model":"m","prompt":"a"}"#).unwrap(), Input::Prompts(vec![Prompt::Text("a".into())]));
        assert_eq!(
            p(r#"{"model":"m","prompt":["a","b"]}"#).unwrap(),
            Input::Prompts(vec![Prompt::Text("a".into()), Prompt::Text("b".into())])
        );
        assert_eq!(p(r#"{"model":"m","prompt":[1,2]}"#).unwrap(), Input::Prompts(vec![Prompt::Tokens(vec![1, 2])]));
        assert_eq!(
            p(r#"{"model":"m","prompt":[[1],[2,3]]}"#).unwrap(),
            Input::Prompts(vec![Prompt::Tokens(vec![1]), Prompt::Tokens(vec![2, 3])])
        );
        assert!(p(r#"{"model":"m","prompt":[1,"a"]}"#).is_err());
        assert!(p(r#"{"model":"m","prompt":{}}"#).is_err());
        assert!(p(r#"{"model":"m"}"#).is_err());
    }

    #[test]
    fn text_content_parts_are_joined_and_images_refused() {
        let job = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#)
            .unwrap();
        assert_eq!(job.input, Input::Chat(vec![ChatMessage::new("user".into(), "ab".into())]));
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#)
            .unwrap_err();
        assert_eq!(param_of(e), Some("messages[0].content".into()));
    }

    #[test]
    fn logit_bias_keys_must_be_token_ids() {
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"abc":1}}"#).unwrap_err();
        assert_eq!(param_of(e), Some("logit_bias".into()));
        let job = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"42":-100}}"#).unwrap();
        assert_eq!(job.params.sampling.logit_bias.get(&42), Some(&-100.0));
    }
}
