//! Parsing an Anthropic Messages body (`POST /v1/messages`) into the router's [`Job`], checked
//! as strictly as an OpenAI body: every refusal names its field in Anthropic's own terms
//! (`messages[1].content[0]`, `tools[0].input_schema`), before anything is spent.
//!
//! The conversation becomes the chat the model's template renders: `system` first, each
//! `tool_use` block an assistant tool call, each `tool_result` block a tool turn answering it.
//! What the router cannot honour is refused, never dropped: images and documents, a final
//! assistant turn (a prefill). `thinking` switches a template's thinking on or off.

use std::collections::HashSet;

use bellows_common::{
    chat_template::{ChatMessage, TemplateKwargs},
    constraint::{Constraint, JsonBounds},
    priority::Priority,
    sampling_limits as limits,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{
    api::{
        error::ApiError,
        request::{Endpoint, Input, Job, MAX_STOP, deserialize, in_range},
        tool_request,
    },
    generation::{GenerationParams, Sampling, Structured},
    tools::ToolChoice,
};

#[derive(Debug, Deserialize)]
struct RawMessages {
    model: String,
    max_tokens: Option<u32>,
    messages: Vec<RawMessage>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    metadata: Option<Metadata>,
    thinking: Option<Value>,
    service_tier: Option<String>,
    output_config: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct RawMessage {
    role: String,
    content: Value,
}

#[derive(Debug, Deserialize)]
struct Metadata {
    user_id: Option<String>,
}

/// What the body is for: a generation (`max_tokens` required, as Anthropic's) or a count of
/// its input tokens (`/v1/messages/count_tokens`, which takes no `max_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Generate,
    CountTokens,
}

/// Parse and validate a Messages body.
pub fn parse(body: &[u8], purpose: Purpose) -> Result<Job, ApiError> {
    validate(deserialize(body)?, purpose)
}

fn validate(raw: RawMessages, purpose: Purpose) -> Result<Job, ApiError> {
    if raw.model.is_empty() {
        return Err(ApiError::invalid("model", "model: must not be empty"));
    }
    let max_tokens = match (raw.max_tokens, purpose) {
        (Some(0), _) => return Err(ApiError::invalid("max_tokens", "max_tokens: must be at least 1")),
        (None, Purpose::Generate) => return Err(ApiError::invalid("max_tokens", "max_tokens: Field required")),
        (m, _) => m,
    };
    let chat_template_kwargs = thinking(raw.thinking.as_ref(), max_tokens)?;
    let mut messages = system(raw.system)?;
    messages.extend(conversation(raw.messages)?);
    let tools = tools(raw.tools, raw.tool_choice)?;
    let structured = output_format(raw.output_config)?;
    if let (Some(s), Some(_)) = (&structured, tools.as_ref().filter(|t| t.active())) {
        return Err(ApiError::invalid(s.param, "output_config.format: cannot be combined with tools"));
    }
    let sampling = Sampling {
        temperature: in_range(raw.temperature, "temperature", limits::ANTHROPIC_TEMPERATURE)?,
        top_p: in_range(raw.top_p, "top_p", limits::TOP_P)?,
        top_k: raw.top_k.filter(|&k| k > 0),
        ..Default::default()
    };
    Ok(Job {
        endpoint: Endpoint::Messages,
        model: raw.model,
        input: Input::Chat(messages),
        n: 1,
        stream: raw.stream.unwrap_or(false),
        include_usage: false,
        params: GenerationParams {
            sampling,
            max_tokens,
            stop: stop_sequences(raw.stop_sequences)?,
            structured,
            ..Default::default()
        },
        user: raw.metadata.and_then(|m| m.user_id),
        tools,
        priority: service_tier(raw.service_tier.as_deref())?,
        chat_template_kwargs,
        cache_salt: None,
        json_bounds: JsonBounds::Bounded,
    })
}

/// `thinking`: whether a model whose template can think or not (Qwen3's `enable_thinking`)
/// thinks. A model that always thinks (DeepSeek-R1) does regardless, and one that never does
/// ignores it. `budget_tokens` is checked as Anthropic checks it, but not enforced: the answer
/// and the thinking share `max_tokens`.
fn thinking(raw: Option<&Value>, max_tokens: Option<u32>) -> Result<Option<TemplateKwargs>, ApiError> {
    let Some(raw) = raw else { return Ok(None) };
    let on = match raw.get("type").and_then(Value::as_str) {
        Some("disabled") => false,
        Some("adaptive") => true,
        Some("enabled") => {
            let budget = raw.get("budget_tokens").and_then(Value::as_u64).ok_or_else(|| {
                ApiError::invalid("thinking.budget_tokens", "thinking.budget_tokens: Field required (an integer)")
            })?;
            if budget < 1024 {
                return Err(ApiError::invalid(
                    "thinking.budget_tokens",
                    "thinking.budget_tokens: must be at least 1024",
                ));
            }
            if max_tokens.is_some_and(|m| budget >= u64::from(m)) {
                return Err(ApiError::invalid(
                    "thinking.budget_tokens",
                    "thinking.budget_tokens: must be less than max_tokens",
                ));
            }
            true
        }
        _ => {
            return Err(ApiError::invalid(
                "thinking.type",
                "thinking.type: must be one of 'enabled', 'disabled' or 'adaptive'",
            ));
        }
    };
    Ok(Some(TemplateKwargs::from_iter([("enable_thinking".to_string(), Value::Bool(on))])))
}

/// `system`: a string or a list of text blocks, the conversation's first turn.
fn system(system: Option<Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let text = match system {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => s,
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("system[{j}]"),
                            "system: only text blocks are supported",
                        ));
                    }
                }
            }
            text
        }
        Some(_) => return Err(ApiError::invalid("system", "system: must be a string or a list of text blocks")),
    };
    Ok(vec![ChatMessage::new("system".into(), text)])
}

/// The turns as chat messages: a user turn's `tool_result` blocks become tool turns (before its
/// text), an assistant turn's `tool_use` blocks its tool calls.
fn conversation(raw: Vec<RawMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if raw.is_empty() {
        return Err(ApiError::invalid("messages", "messages: at least one message is required"));
    }
    if raw.last().is_some_and(|m| m.role == "assistant") {
        return Err(ApiError::invalid(
            format!("messages[{}]", raw.len() - 1),
            format!(
                "messages[{}]: a final assistant turn (a prefill) is not supported yet; end with a user turn",
                raw.len() - 1
            ),
        ));
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut calls = HashSet::new();
    for (i, m) in raw.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "user" | "assistant" => m.role,
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("messages[{i}].role: unknown role {other:?} (expected user or assistant)"),
                ));
            }
        };
        let blocks = match m.content {
            Value::String(text) => vec![json!({"type": "text", "text": text})],
            Value::Array(blocks) => blocks,
            _ => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].content"),
                    format!("messages[{i}].content: must be a string or a list of content blocks"),
                ));
            }
        };
        turn(i, role, blocks, &mut calls, &mut out)?;
    }
    Ok(out)
}

/// One turn's blocks, appended to `out`; `calls` holds the ids of the `tool_use` blocks so far,
/// which each `tool_result` must answer.
fn turn(
    i: usize,
    role: String,
    blocks: Vec<Value>,
    calls: &mut HashSet<String>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let mut message = ChatMessage::new(role, String::new());
    let mut results = 0;
    for (j, block) in blocks.into_iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        let kind = block.get("type").and_then(Value::as_str).unwrap_or_default().to_string();
        match (kind.as_str(), message.role.as_str()) {
            ("text", _) => match block.get("text").and_then(Value::as_str) {
                Some(t) => message.content.push_str(t),
                None => return Err(ApiError::invalid(at.clone(), format!("{at}: a text block needs 'text'"))),
            },
            ("tool_use", "assistant") => {
                let call = tool_use(&at, &block)?;
                calls.insert(call["id"].as_str().unwrap_or_default().to_string());
                message.tool_calls.push(call);
            }
            ("tool_result", "user") => {
                out.push(tool_result(&at, &block, calls)?);
                results += 1;
            }
            // Thinking this gateway produced no signature for: the template has no place for it.
            ("thinking" | "redacted_thinking", "assistant") => {}
            ("image" | "document", _) => {
                return Err(ApiError::invalid(
                    at.clone(),
                    format!("{at}: {kind} blocks are not supported (this model reads text only)"),
                ));
            }
            ("tool_use" | "tool_result" | "thinking" | "redacted_thinking", role) => {
                return Err(ApiError::invalid(at.clone(), format!("{at}: a {kind} block cannot be in a {role} turn")));
            }
            (other, _) => {
                return Err(ApiError::invalid(at.clone(), format!("{at}: unknown content block type {other:?}")));
            }
        }
    }
    // A user turn of tool results alone is those tool turns, with no empty user turn after.
    if !message.content.is_empty() || !message.tool_calls.is_empty() || results == 0 {
        out.push(message);
    }
    Ok(())
}

/// An assistant's `tool_use` block as the OpenAI-shaped call chat templates take.
fn tool_use(at: &str, block: &Value) -> Result<Value, ApiError> {
    let (Some(id), Some(name)) = (block["id"].as_str(), block["name"].as_str()) else {
        return Err(ApiError::invalid(at, format!("{at}: a tool_use block needs 'id' and 'name'")));
    };
    let input = match &block["input"] {
        Value::Object(_) => block["input"].clone(),
        Value::Null => json!({}),
        _ => return Err(ApiError::invalid(format!("{at}.input"), format!("{at}.input: must be an object"))),
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}))
}

/// A user's `tool_result` block as a tool turn answering its call.
fn tool_result(at: &str, block: &Value, calls: &HashSet<String>) -> Result<ChatMessage, ApiError> {
    let Some(id) = block["tool_use_id"].as_str() else {
        return Err(ApiError::invalid(at, format!("{at}: a tool_result block needs 'tool_use_id'")));
    };
    if !calls.contains(id) {
        return Err(ApiError::invalid(
            format!("{at}.tool_use_id"),
            format!("{at}.tool_use_id: no earlier tool_use block has the id {id:?}"),
        ));
    }
    let content = match &block["content"] {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{at}.content"),
                            format!("{at}.content: only text blocks are supported in a tool result"),
                        ));
                    }
                }
            }
            text
        }
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                format!("{at}.content: must be a string or blocks"),
            ));
        }
    };
    Ok(ChatMessage { role: "tool".into(), content, tool_calls: Vec::new(), tool_call_id: Some(id.into()) })
}

/// `tools` (`{name, description, input_schema}`) and `tool_choice` (`auto`, `any`, `tool`,
/// `none`, each with `disable_parallel_tool_use`), checked as the OpenAI fields are.
fn tools(raw: Option<Vec<Value>>, choice: Option<Value>) -> Result<Option<crate::tools::Tools>, ApiError> {
    let raw = raw.unwrap_or_default();
    let openai: Vec<Value> = raw
        .iter()
        .map(|t| {
            let mut function = json!({"name": t.get("name").cloned().unwrap_or(Value::Null)});
            if let Some(d) = t.get("description") {
                function["description"] = d.clone();
            }
            if let Some(s) = t.get("input_schema") {
                function["parameters"] = s.clone();
            }
            if let Some(strict) = t.get("strict") {
                function["strict"] = strict.clone();
            }
            json!({"type": "function", "function": function})
        })
        .collect();
    let (choice, parallel) = tool_choice(choice)?;
    let named = match &choice {
        Some(ToolChoice::Named(n)) => Some(json!({"type": "function", "function": {"name": n}})),
        _ => None,
    };
    let openai_choice = match &choice {
        None => None,
        Some(ToolChoice::None) => Some(json!("none")),
        Some(ToolChoice::Auto) => Some(json!("auto")),
        Some(ToolChoice::Required) => Some(json!("required")),
        Some(ToolChoice::Named(_)) => named,
    };
    tool_request::parse(Some(openai), openai_choice, Some(parallel))
}

fn tool_choice(choice: Option<Value>) -> Result<(Option<ToolChoice>, bool), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else { return Ok((None, true)) };
    let parallel = !choice.get("disable_parallel_tool_use").and_then(Value::as_bool).unwrap_or(false);
    let kind = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match choice.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err(ApiError::invalid("tool_choice.name", "tool_choice.name: Field required")),
        },
        _ => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                "tool_choice.type: must be one of 'auto', 'any', 'tool' or 'none'",
            ));
        }
    };
    Ok((Some(kind), parallel))
}

/// `stop_sequences`: at most [`MAX_STOP`] non-empty strings.
fn stop_sequences(stop: Option<Vec<String>>) -> Result<Vec<String>, ApiError> {
    let stop = stop.unwrap_or_default();
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop_sequences",
            format!("stop_sequences: at most {MAX_STOP} non-empty strings are taken"),
        ));
    }
    Ok(stop)
}

/// Anthropic's `service_tier`: `auto` (the tenant's default) or `standard_only`.
fn service_tier(tier: Option<&str>) -> Result<Option<Priority>, ApiError> {
    match tier {
        None | Some("auto") => Ok(None),
        Some("standard_only") => Ok(Some(Priority::Standard)),
        Some(other) => Err(ApiError::invalid(
            "service_tier",
            format!("service_tier: unknown tier {other:?} (expected 'auto' or 'standard_only')"),
        )),
    }
}

/// Structured outputs: `output_config.format` as `{type: "json_schema", schema}`.
fn output_format(config: Option<Value>) -> Result<Option<Structured>, ApiError> {
    const PARAM: &str = "output_config.format";
    let Some(format) = config.as_ref().and_then(|c| c.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match (format.get("type").and_then(Value::as_str), format.get("schema")) {
        (Some("json_schema"), Some(schema @ Value::Object(_))) => Ok(Some(Structured {
            constraint: Constraint::json_schema(schema.clone(), JsonBounds::Bounded),
            param: PARAM,
        })),
        _ => Err(ApiError::invalid(
            PARAM,
            "output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(body: Value) -> Result<Job, ApiError> {
        parse(body.to_string().as_bytes(), Purpose::Generate)
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("not an invalid-request error: {other:?}"),
        }
    }

    fn base() -> Value {
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
    }

    #[test]
    fn max_tokens_is_required_to_generate_but_not_to_count() {
        let mut body = base();
        body.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(param_of(parse_json(body.clone()).unwrap_err()).as_deref(), Some("max_tokens"));
        let counted = parse(body.to_string().as_bytes(), Purpose::CountTokens).unwrap();
        assert_eq!(counted.params.max_tokens, None);
    }

    #[test]
    fn system_tool_use_and_tool_result_become_the_chat_a_template_renders() {
        let body = json!({
            "model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "And so?"}]},
            ],
        });
        let Input::Chat(m) = parse_json(body).unwrap().input else { panic!("a chat") };
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(m[2].tool_calls[0]["function"], json!({"name": "weather", "arguments": {"city": "Paris"}}));
        assert_eq!((m[3].tool_call_id.as_deref(), m[3].content.as_str()), (Some("toolu_1"), "18C"));
        assert_eq!(m[4].content, "And so?");
    }

    #[test]
    fn images_prefills_and_unanswered_tool_results_are_refused_naming_the_field() {
        let with = |messages: Value| {
            let mut b = base();
            b["messages"] = messages;
            parse_json(b).map(drop).map_err(param_of)
        };
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]);
        assert_eq!(with(image), Err(Some("messages[0].content[0]".into())));
        let prefill = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]);
        assert_eq!(with(prefill), Err(Some("messages[1]".into())));
        let orphan =
            json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]);
        assert_eq!(with(orphan), Err(Some("messages[0].content[0].tool_use_id".into())));
        let unknown = json!([{"role": "user", "content": [{"type": "video"}]}]);
        assert_eq!(with(unknown), Err(Some("messages[0].content[0]".into())));
    }

    #[test]
    fn thinking_turns_the_templates_switch_and_its_budget_is_checked_as_anthropic_checks_it() {
        let with = |thinking: Value| {
            let mut b = base();
            b["max_tokens"] = json!(4096);
            b["thinking"] = thinking;
            parse_json(b).map(|j| j.chat_template_kwargs).map_err(param_of)
        };
        let on = with(json!({"type": "enabled", "budget_tokens": 2048})).unwrap().unwrap();
        assert_eq!(on["enable_thinking"], json!(true));
        let off = with(json!({"type": "disabled"})).unwrap().unwrap();
        assert_eq!(off["enable_thinking"], json!(false));
        assert_eq!(with(json!({"type": "enabled", "budget_tokens": 100})), Err(Some("thinking.budget_tokens".into())));
        assert_eq!(with(json!({"type": "enabled", "budget_tokens": 5000})), Err(Some("thinking.budget_tokens".into())));
        assert_eq!(with(json!({"type": "enabled"})), Err(Some("thinking.budget_tokens".into())));
        assert_eq!(with(json!({"type": "loud"})), Err(Some("thinking.type".into())));
    }

    #[test]
    fn tools_and_tool_choice_map_onto_the_openai_checks() {
        let with = |tools: Value, choice: Value| {
            let mut b = base();
            b["tools"] = tools;
            b["tool_choice"] = choice;
            parse_json(b)
        };
        let weather = json!([{"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
        let tools =
            with(weather.clone(), json!({"type": "any", "disable_parallel_tool_use": true})).unwrap().tools.unwrap();
        assert_eq!((tools.choice, tools.parallel), (ToolChoice::Required, false));
        let named = with(weather.clone(), json!({"type": "tool", "name": "weather"})).unwrap().tools.unwrap();
        assert_eq!(named.choice, ToolChoice::Named("weather".into()));
        let missing = with(weather, json!({"type": "tool", "name": "other"})).unwrap_err();
        assert_eq!(param_of(missing).as_deref(), Some("tool_choice"));
        let bad_name = with(json!([{"name": "has space", "input_schema": {}}]), Value::Null).unwrap_err();
        assert_eq!(param_of(bad_name).as_deref(), Some("tools[0].function.name"), "renamed by error_response");
    }

    #[test]
    fn sampling_is_checked_in_anthropics_ranges() {
        for (field, value) in [("temperature", json!(1.5)), ("top_p", json!(0)), ("stop_sequences", json!([""]))] {
            let mut b = base();
            b[field] = value;
            assert_eq!(param_of(parse_json(b).unwrap_err()).as_deref(), Some(field));
        }
        let mut b = base();
        b["metadata"] = json!({"user_id": "u-1"});
        b["top_k"] = json!(5);
        let job = parse_json(b).unwrap();
        assert_eq!((job.user.as_deref(), job.params.sampling.top_k), (Some("u-1"), Some(5)));
    }
}
