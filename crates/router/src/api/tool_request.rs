//! The tool fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`, and the
//! `tool_calls` / `tool_call_id` of earlier turns), checked before anything is spent: each error
//! names the field, down to the tool or message index.

use std::collections::HashSet;

use bellows_common::{
    chat_template::ChatMessage,
    constraint::{Constraint, SchemaError},
};
use serde_json::{Value, json};

use super::error::ApiError;
use crate::tools::{ToolChoice, ToolSpec, Tools};

/// Functions one request may declare.
pub const MAX_TOOLS: usize = 128;

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools`, `tool_choice` and `parallel_tool_calls` as one value; `None` without tools.
pub fn parse(
    raw: Option<Vec<Value>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let raw = raw.unwrap_or_default();
    if raw.len() > MAX_TOOLS {
        return Err(ApiError::invalid("tools", format!("'tools' takes at most {MAX_TOOLS} functions")));
    }
    let mut specs = Vec::with_capacity(raw.len());
    let mut names = HashSet::new();
    for (i, t) in raw.iter().enumerate() {
        let spec = spec(i, t)?;
        if !names.insert(spec.name.clone()) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("duplicate function name {:?}", spec.name),
            ));
        }
        specs.push(spec);
    }
    let choice = tool_choice(choice, &specs)?;
    if specs.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tools { specs, choice, parallel: parallel.unwrap_or(true) }))
}

fn spec(i: usize, t: &Value) -> Result<ToolSpec, ApiError> {
    let at = |field: &str| format!("tools[{i}]{field}");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(at(".type"), "only tools of type 'function' are supported"));
    }
    let Some(f) = t.get("function").filter(|f| f.is_object()) else {
        return Err(ApiError::invalid(at(".function"), "a function tool needs a 'function' object"));
    };
    let name = match f.get("name").and_then(Value::as_str) {
        Some(n) if valid_name(n) => n.to_string(),
        _ => {
            return Err(ApiError::invalid(
                at(".function.name"),
                "a function name is 1-64 characters of a-z, A-Z, 0-9, _ or -",
            ));
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return Err(ApiError::invalid(at(".function.description"), "'description' must be a string")),
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid(at(".function.parameters"), "'parameters' must be a JSON Schema object"));
        }
    };
    if f.get("strict") == Some(&Value::Bool(true))
        && let Err(e) = super::strict_schema::check(&parameters)
    {
        return Err(ApiError::invalid(at(".function.parameters"), format!("the function is marked strict, but {e}")));
    }
    Ok(ToolSpec { name, description, parameters })
}

fn tool_choice(choice: Option<Value>, specs: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::invalid("tool_choice", m);
    let choice = match choice {
        None | Some(Value::Null) => return Ok(if specs.is_empty() { ToolChoice::None } else { ToolChoice::Auto }),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "unknown tool_choice {other:?} (expected none, auto, required or a function)"
                )));
            }
        },
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) if specs.iter().any(|s| s.name == n) => ToolChoice::Named(n.to_string()),
                (Some("function"), Some(n)) => {
                    return Err(bad(format!("tool_choice names {n:?}, which is not in 'tools'")));
                }
                _ => {
                    return Err(bad(
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}".into()
                    ));
                }
            }
        }
        Some(_) => return Err(bad("'tool_choice' must be a string or an object".into())),
    };
    if specs.is_empty() && choice != ToolChoice::None {
        return Err(bad("'tool_choice' needs 'tools'".into()));
    }
    Ok(choice)
}

/// An assistant turn's `tool_calls`, checked, with `function.arguments` (JSON text in OpenAI's
/// API) parsed into the object chat templates expect.
pub fn history_calls(i: usize, raw: Option<Vec<Value>>) -> Result<Vec<Value>, ApiError> {
    let raw = raw.unwrap_or_default();
    raw.into_iter()
        .enumerate()
        .map(|(k, c)| {
            let at = format!("messages[{i}].tool_calls[{k}]");
            let f = &c["function"];
            let (Some(id), Some(name)) = (c["id"].as_str(), f["name"].as_str()) else {
                return Err(ApiError::invalid(at, "a tool call needs an 'id' and a 'function' with a 'name'"));
            };
            let arguments = match &f["arguments"] {
                Value::String(s) => serde_json::from_str::<Value>(s)
                    .map_err(|e| ApiError::invalid(format!("{at}.function.arguments"), format!("not JSON: {e}")))?,
                Value::Null => json!({}),
                other => other.clone(),
            };
            Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
        })
        .collect()
}

/// Every `tool` turn answers a call an earlier assistant turn made.
pub fn check_tool_turns(messages: &[ChatMessage]) -> Result<(), ApiError> {
    let mut calls: HashSet<&str> = HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        calls.extend(m.tool_calls.iter().filter_map(|c| c["id"].as_str()));
        if m.role == "tool" {
            match m.tool_call_id.as_deref() {
                Some(id) if calls.contains(id) => {}
                Some(id) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_call_id"),
                        format!("no earlier assistant message made a tool call with id {id:?}"),
                    ));
                }
                None => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_call_id"),
                        "a tool message needs 'tool_call_id'",
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Compile each function's parameters schema as a worker would (milliseconds each: run it off
/// the async threads); a refusal names the tool and the pointer at fault.
pub fn check_parameters(tools: &Tools) -> Result<(), ApiError> {
    for (i, t) in tools.specs.iter().enumerate() {
        Constraint::JsonSchema(t.parameters.clone()).check_located().map_err(|SchemaError { message, pointer }| {
            let at = pointer.map(|p| format!(" (at JSON pointer '{p}')")).unwrap_or_default();
            ApiError::invalid(
                format!("tools[{i}].function.parameters"),
                format!("Invalid schema for function {:?}: {message}{at}", t.name),
            )
        })?;
    }
    Ok(())
}
