//! Parsing an OpenAI Responses body (`POST /v1/responses`) into the router's [`Job`] and the
//! [`Parsed`] state its answer is rendered and stored with. Every refusal names its field in the
//! Responses API's own terms (`input[2].call_id`, `text.format`, `tools[0].parameters`).
//!
//! The conversation becomes the chat the model's template renders: `instructions` first (this
//! request's only: they are never carried over from a previous response), then the stored
//! context of `previous_response_id` (every item: messages, function calls and their outputs,
//! so a continuation never loses a call), then this request's input items.

use std::{collections::HashSet, sync::LazyLock};

use bellows_common::{
    chat_template::{ChatMessage, TemplateKwargs},
    constraint::JsonBounds,
    sampling_limits as limits,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::store::Stored;
use crate::{
    api::{
        error::ApiError,
        request::{self, Endpoint, Input, Job, deserialize, in_range},
        tool_request,
    },
    generation::{GenerationParams, Sampling, Structured},
};

#[derive(Debug, Deserialize)]
pub(super) struct RawResponses {
    model: String,
    input: Option<Value>,
    instructions: Option<String>,
    pub(super) previous_response_id: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<Value>,
    max_output_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    reasoning: Option<Value>,
    metadata: Option<Map<String, Value>>,
    store: Option<bool>,
    stream: Option<bool>,
    user: Option<String>,
    service_tier: Option<String>,
    truncation: Option<String>,
    background: Option<bool>,
    conversation: Option<Value>,
    prompt: Option<Value>,
}

/// What a Responses answer needs beyond the chat pipeline's: what to echo in the response
/// object, whether and what to store.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Parsed {
    /// `store` (default true, as OpenAI's).
    pub store: bool,
    /// This request's input items, each with an id (what `/input_items` lists).
    pub input_items: Vec<Value>,
    /// The previous response's context, then this request's input items: what this response's
    /// output is appended to for the next continuation.
    pub context: Vec<Value>,
    /// The request's fields the response object echoes.
    pub echo: Echo,
}

/// The request's fields the response object echoes, as OpenAI's does: typed, so a response is
/// written straight from them (no JSON tree built and copied for each answer).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct Echo {
    pub instructions: Option<String>,
    pub metadata: Map<String, Value>,
    pub temperature: f32,
    pub top_p: f32,
    pub max_output_tokens: Option<u32>,
    pub parallel_tool_calls: bool,
    #[serde(serialize_with = "or_auto")]
    pub tool_choice: Option<Value>,
    pub tools: Vec<Value>,
    #[serde(serialize_with = "or_text_format")]
    pub text: Option<Value>,
    #[serde(serialize_with = "or_no_reasoning")]
    pub reasoning: Option<Value>,
    pub previous_response_id: Option<String>,
    pub store: bool,
    pub truncation: &'static str,
    pub user: Option<String>,
}

fn or_default<S: serde::Serializer>(v: &Option<Value>, default: &Value, s: S) -> Result<S::Ok, S::Error> {
    v.as_ref().unwrap_or(default).serialize(s)
}

fn or_auto<S: serde::Serializer>(v: &Option<Value>, s: S) -> Result<S::Ok, S::Error> {
    static AUTO: LazyLock<Value> = LazyLock::new(|| json!("auto"));
    or_default(v, &AUTO, s)
}

fn or_text_format<S: serde::Serializer>(v: &Option<Value>, s: S) -> Result<S::Ok, S::Error> {
    static TEXT: LazyLock<Value> = LazyLock::new(|| json!({"format": {"type": "text"}}));
    or_default(v, &TEXT, s)
}

fn or_no_reasoning<S: serde::Serializer>(v: &Option<Value>, s: S) -> Result<S::Ok, S::Error> {
    static NONE: LazyLock<Value> = LazyLock::new(|| json!({"effort": null, "summary": null}));
    or_default(v, &NONE, s)
}

/// Metadata one response may carry (OpenAI's limits).
const MAX_METADATA: usize = 16;

/// The body, before its previous response is looked up (`previous_response_id`, which the
/// caller reads from the store for the tenant).
pub(super) fn deserialize_body(body: &[u8]) -> Result<RawResponses, ApiError> {
    deserialize(body)
}

/// Validate a body, continuing `previous` when it names one.
pub(super) fn parse(raw: RawResponses, previous: Option<Stored>) -> Result<(Job, Parsed), ApiError> {
    refuse_unsupported(&raw)?;
    if raw.model.is_empty() {
        return Err(ApiError::invalid("model", "'model' must not be empty"));
    }
    if raw.max_output_tokens == Some(0) {
        return Err(ApiError::invalid("max_output_tokens", "'max_output_tokens' must be at least 1"));
    }
    let metadata = metadata(raw.metadata)?;
    let input_items = input_items(raw.input)?;
    let mut context = previous.map(|p| p.context).unwrap_or_default();
    let history = context.len();
    context.extend(input_items.iter().cloned());
    let mut messages = Vec::new();
    if let Some(i) = &raw.instructions {
        messages.push(ChatMessage::new("system".into(), i.clone()));
    }
    messages.extend(conversation(&context, history)?);
    let tools_echo = raw.tools.clone().unwrap_or_default();
    let choice_echo = raw.tool_choice.clone();
    let tools = tools(raw.tools, raw.tool_choice, raw.parallel_tool_calls)?;
    let structured = text_format(raw.text.as_ref())?;
    if structured.is_some() && tools.as_ref().is_some_and(|t| t.active()) {
        return Err(ApiError::invalid("text.format", "'text.format' cannot be combined with tools"));
    }
    let sampling = Sampling {
        temperature: in_range(raw.temperature, "temperature", limits::TEMPERATURE)?,
        top_p: in_range(raw.top_p, "top_p", limits::TOP_P)?,
        ..Default::default()
    };
    let chat_template_kwargs = reasoning(raw.reasoning.as_ref())?;
    let echo = Echo {
        instructions: raw.instructions,
        metadata,
        temperature: raw.temperature.unwrap_or(1.0),
        top_p: raw.top_p.unwrap_or(1.0),
        max_output_tokens: raw.max_output_tokens,
        parallel_tool_calls: raw.parallel_tool_calls.unwrap_or(true),
        tool_choice: choice_echo,
        tools: tools_echo,
        text: raw.text,
        reasoning: raw.reasoning,
        previous_response_id: raw.previous_response_id,
        store: raw.store.unwrap_or(true),
        truncation: "disabled",
        user: raw.user.clone(),
    };
    let job = Job {
        endpoint: Endpoint::Responses,
        model: raw.model,
        input: Input::Chat(messages),
        n: 1,
        stream: raw.stream.unwrap_or(false),
        include_usage: false,
        params: GenerationParams { sampling, max_tokens: raw.max_output_tokens, structured, ..Default::default() },
        user: raw.user,
        tools,
        priority: request::priority(raw.service_tier.as_deref(), None)?,
        chat_template_kwargs,
        cache_salt: None,
        json_bounds: JsonBounds::Bounded,
    };
    let turn = Parsed { store: echo.store, input_items, context, echo };
    Ok((job, turn))
}

/// Fields of the API this gateway does not serve: refused, never ignored.
fn refuse_unsupported(raw: &RawResponses) -> Result<(), ApiError> {
    if raw.background == Some(true) {
        return Err(ApiError::invalid("background", "'background' responses are not supported"));
    }
    if raw.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(ApiError::invalid("conversation", "'conversation' is not supported; use previous_response_id"));
    }
    if raw.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(ApiError::invalid("prompt", "stored prompt templates ('prompt') are not supported"));
    }
    match raw.truncation.as_deref() {
        None | Some("disabled") => Ok(()),
        Some(_) => Err(ApiError::invalid(
            "truncation",
            "only 'truncation': 'disabled' is supported (a conversation over the context window is a 400)",
        )),
    }
}

fn metadata(raw: Option<Map<String, Value>>) -> Result<Map<String, Value>, ApiError> {
    let raw = raw.unwrap_or_default();
    let fits = |k: &String, v: &Value| k.len() <= 64 && v.as_str().is_some_and(|s| s.len() <= 512);
    if raw.len() > MAX_METADATA || !raw.iter().all(|(k, v)| fits(k, v)) {
        return Err(ApiError::invalid(
            "metadata",
            format!(
                "'metadata' takes at most {MAX_METADATA} pairs of keys up to 64 characters and string values up to 512"
            ),
        ));
    }
    Ok(raw)
}

/// `input`: a string (one user message) or a list of items, each given an id if it has none.
fn input_items(raw: Option<Value>) -> Result<Vec<Value>, ApiError> {
    let items = match raw {
        None | Some(Value::Null) => return Err(ApiError::invalid("input", "'input' is required")),
        Some(Value::String(text)) => vec![json!({"type": "message", "role": "user", "content": text})],
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(_) => return Err(ApiError::invalid("input", "'input' must be a string or a non-empty list of items")),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            let Some(o) = item.as_object_mut() else {
                return Err(ApiError::invalid(format!("input[{i}]"), format!("input[{i}]: an item is an object")));
            };
            if !o.contains_key("type") && o.contains_key("role") {
                o.insert("type".into(), json!("message"));
            }
            let prefix = match o.get("type").and_then(Value::as_str) {
                Some("message") => "msg",
                Some("function_call") => "fc",
                Some("function_call_output") => "fco",
                Some("reasoning") => "rs",
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!("input[{i}].type"),
                        format!(
                            "input[{i}].type: unknown item type {other:?} (expected message, function_call, function_call_output or reasoning)"
                        ),
                    ));
                }
                None => return Err(ApiError::invalid(format!("input[{i}].type"), format!("input[{i}].type is required"))),
            };
            if !o.get("id").is_some_and(Value::is_string) {
                o.insert("id".into(), json!(super::new_item_id(prefix)));
            }
            // Stored as the API lists them: a message's text as a part.
            if prefix == "msg"
                && let Some(Value::String(text)) = o.get("content")
            {
                let kind = if o.get("role").and_then(Value::as_str) == Some("assistant") { "output_text" } else { "input_text" };
                let parts = json!([{"type": kind, "text": text}]);
                o.insert("content".into(), parts);
            }
            Ok(item)
        })
        .collect()
}

/// The context's items as chat turns. Items from `from` on are this request's own, named
/// `input[i]` in errors; earlier ones were checked when they were stored.
fn conversation(items: &[Value], from: usize) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out: Vec<ChatMessage> = Vec::new();
    let mut calls = HashSet::new();
    for (k, item) in items.iter().enumerate() {
        let at = format!("input[{}]", k.saturating_sub(from));
        match item["type"].as_str().unwrap_or_default() {
            "message" => out.push(message(&at, item)?),
            "function_call" => {
                let call = function_call(&at, item)?;
                calls.insert(call["id"].as_str().unwrap_or_default().to_string());
                // Calls made together are one assistant turn, after any text it wrote.
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => m.tool_calls.push(call),
                    _ => {
                        let mut m = ChatMessage::new("assistant".into(), String::new());
                        m.tool_calls.push(call);
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let Some(id) = item["call_id"].as_str() else {
                    return Err(ApiError::invalid(format!("{at}.call_id"), format!("{at}.call_id is required")));
                };
                if !calls.contains(id) {
                    return Err(ApiError::invalid(
                        format!("{at}.call_id"),
                        format!("{at}.call_id: no earlier function_call has the call_id {id:?}"),
                    ));
                }
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => text_of(&format!("{at}.output"), parts)?,
                    _ => {
                        return Err(ApiError::invalid(format!("{at}.output"), format!("{at}.output must be a string")));
                    }
                };
                out.push(ChatMessage {
                    role: "tool".into(),
                    content: output,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(id.into()),
                });
            }
            // Reasoning this gateway did not produce has no place in the template.
            _ => {}
        }
    }
    Ok(out)
}

fn message(at: &str, item: &Value) -> Result<ChatMessage, ApiError> {
    let role = match item["role"].as_str() {
        Some(r @ ("user" | "assistant" | "system")) => r.to_string(),
        Some("developer") => "system".to_string(),
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("{at}.role must be user, assistant, system or developer"),
            ));
        }
    };
    let content = match &item["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => text_of(&format!("{at}.content"), parts)?,
        _ => return Err(ApiError::invalid(format!("{at}.content"), format!("{at}.content must be a string or parts"))),
    };
    Ok(ChatMessage::new(role, content))
}

/// The text of content parts (`input_text`, `output_text`); any other part is refused.
fn text_of(at: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        match (p["type"].as_str(), p["text"].as_str()) {
            (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
            (kind, _) => {
                return Err(ApiError::invalid(
                    format!("{at}[{j}]"),
                    format!("{at}[{j}]: {} parts are not supported (text only)", kind.unwrap_or("untyped")),
                ));
            }
        }
    }
    Ok(text)
}

/// A `function_call` item as the OpenAI-shaped call chat templates take.
fn function_call(at: &str, item: &Value) -> Result<Value, ApiError> {
    let (Some(id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str()) else {
        return Err(ApiError::invalid(at, format!("{at}: a function_call needs 'call_id' and 'name'")));
    };
    let arguments = match &item["arguments"] {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| ApiError::invalid(format!("{at}.arguments"), format!("{at}.arguments is not JSON: {e}")))?,
        Value::Null => json!({}),
        _ => return Err(ApiError::invalid(format!("{at}.arguments"), format!("{at}.arguments must be JSON text"))),
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

/// Function tools (flat: `{type, name, description, parameters, strict}`) and `tool_choice`
/// (`{type: "function", name}` when named), checked by the chat checks.
fn tools(
    raw: Option<Vec<Value>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<crate::tools::Tools>, ApiError> {
    let nested: Vec<Value> = raw
        .unwrap_or_default()
        .into_iter()
        .map(|mut t| {
            if t["type"] != "function" {
                return t;
            }
            let mut function = json!({"name": t["name"].take()});
            for key in ["description", "parameters", "strict"] {
                if let Some(v) = t.get_mut(key).map(Value::take) {
                    function[key] = v;
                }
            }
            json!({"type": "function", "function": function})
        })
        .collect();
    let choice = match choice {
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            Some(json!({"type": "function", "function": {"name": o.get("name").cloned().unwrap_or(Value::Null)}}))
        }
        other => other,
    };
    tool_request::parse(Some(nested), choice, parallel)
}

/// `text.format`: `text`, `json_object`, or `json_schema` with `name`, `schema` and `strict`
/// beside `type` (chat nests them under `json_schema`).
fn text_format(text: Option<&Value>) -> Result<Option<Structured>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else { return Ok(None) };
    let mut chat = json!({"type": format.get("type").cloned().unwrap_or(Value::Null)});
    if format["type"] == "json_schema" {
        let mut js = Map::new();
        for key in ["name", "schema", "strict", "description"] {
            if let Some(v) = format.get(key) {
                js.insert(key.into(), v.clone());
            }
        }
        chat["json_schema"] = Value::Object(js);
    }
    let constraint = request::response_format_constraint(chat, JsonBounds::Bounded).map_err(|e| match e {
        ApiError::InvalidRequest { message, .. } => ApiError::invalid(
            "text.format",
            message.replace("response_format.json_schema", "text.format").replace("response_format", "text.format"),
        ),
        other => other,
    })?;
    Ok(constraint.map(|c| Structured { constraint: c, param: "text.format" }))
}

/// `reasoning.effort`: `none` turns a template's thinking off (Qwen3's `enable_thinking`), any
/// other effort on; a model that always thinks (DeepSeek-R1) does regardless. The effort is not
/// a budget here: thinking and answer share `max_output_tokens`.
fn reasoning(raw: Option<&Value>) -> Result<Option<TemplateKwargs>, ApiError> {
    let Some(effort) = raw.and_then(|r| r.get("effort")).filter(|e| !e.is_null()) else { return Ok(None) };
    let on = match effort.as_str() {
        Some("none") => false,
        Some("minimal" | "low" | "medium" | "high" | "xhigh") => true,
        _ => {
            return Err(ApiError::invalid(
                "reasoning.effort",
                format!("reasoning.effort: {effort} is not one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh'"),
            ));
        }
    };
    Ok(Some(TemplateKwargs::from_iter([("enable_thinking".to_string(), Value::Bool(on))])))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(body: Value, previous: Option<Stored>) -> Result<(Job, Parsed), ApiError> {
        parse(deserialize_body(body.to_string().as_bytes())?, previous)
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("not an invalid request: {other:?}"),
        }
    }

    fn chat(job: &Job) -> &[ChatMessage] {
        match &job.input {
            Input::Chat(m) => m,
            Input::Prompts(_) => panic!("a chat"),
        }
    }

    #[test]
    fn a_string_input_is_one_user_turn_after_the_instructions() {
        let (job, turn) = parse_json(json!({"model": "m", "input": "hi", "instructions": "be brief"}), None).unwrap();
        let m = chat(&job);
        assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("system", "be brief"));
        assert_eq!((m[1].role.as_str(), m[1].content.as_str()), ("user", "hi"));
        assert!(turn.store, "store defaults to true");
        assert!(turn.input_items[0]["id"].as_str().unwrap().starts_with("msg_"));
    }

    #[test]
    fn a_continuation_keeps_the_stored_calls_and_drops_the_old_instructions() {
        let previous = Stored {
            response: json!({}),
            input_items: vec![],
            context: vec![
                json!({"type": "message", "role": "user", "content": "weather?"}),
                json!({"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{\"c\": \"P\"}"}),
            ],
        };
        let body =
            json!({"model": "m", "input": [{"type": "function_call_output", "call_id": "call_1", "output": "21"}]});
        let (job, turn) = parse_json(body, Some(previous)).unwrap();
        let m = chat(&job);
        assert_eq!(m.len(), 3, "no system turn: instructions are not carried over");
        assert_eq!(m[1].tool_calls[0]["function"]["arguments"], json!({"c": "P"}));
        assert_eq!((m[2].role.as_str(), m[2].tool_call_id.as_deref()), ("tool", Some("call_1")));
        assert_eq!(turn.context.len(), 3);
        assert_eq!(turn.input_items.len(), 1);
    }

    #[test]
    fn reasoning_effort_none_turns_thinking_off_and_an_unknown_effort_is_refused() {
        let kwargs = |reasoning: Value| {
            parse_json(json!({"model": "m", "input": "hi", "reasoning": reasoning}), None)
                .map(|(job, _)| job.chat_template_kwargs)
                .map_err(param_of)
        };
        assert_eq!(kwargs(json!({"effort": "none"})).unwrap().unwrap()["enable_thinking"], json!(false));
        assert_eq!(kwargs(json!({"effort": "high"})).unwrap().unwrap()["enable_thinking"], json!(true));
        assert_eq!(kwargs(json!({"summary": "auto"})), Ok(None), "no effort: the template decides");
        assert_eq!(kwargs(json!({"effort": "max"})), Err(Some("reasoning.effort".into())));
    }

    #[test]
    fn bad_items_and_fields_are_refused_naming_them() {
        let cases = [
            (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}),
                "input[0].call_id",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0]",
            ),
            (json!({"input": [{"role": "robot", "content": "x"}]}), "input[0].role"),
            (json!({"input": []}), "input"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}}),
                "text.format",
            ),
            (json!({"input": "x", "tools": [{"type": "web_search"}]}), "tools[0].type"),
            (json!({"input": "x", "metadata": {"k": 5}}), "metadata"),
            (json!({"input": "x", "max_output_tokens": 0}), "max_output_tokens"),
            (json!({"input": "x", "temperature": 3}), "temperature"),
        ];
        for (mut body, param) in cases {
            body["model"] = json!("m");
            let e = parse_json(body.clone(), None).unwrap_err();
            assert_eq!(param_of(e).as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn flat_function_tools_and_a_named_choice_map_onto_the_chat_checks() {
        let body = json!({
            "model": "m", "input": "x",
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object", "properties": {}, "additionalProperties": false}, "strict": true}],
            "tool_choice": {"type": "function", "name": "w"},
            "parallel_tool_calls": false,
        });
        let (job, _) = parse_json(body, None).unwrap();
        let tools = job.tools.unwrap();
        assert_eq!(tools.choice, crate::tools::ToolChoice::Named("w".into()));
        assert!(!tools.parallel);
        let open = json!({"model": "m", "input": "x",
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": true}]});
        let e = parse_json(open, None).unwrap_err();
        assert_eq!(param_of(e).as_deref(), Some("tools[0].function.parameters"), "strict reaches the chat checks");
    }
}
