//! Tool calling: the request's function tools, how they reach the prompt, the grammar that forces
//! a call, and the parser that takes calls back out of the answer.
//!
//! All of it runs at the router: the worker only ever sees a prompt and, for `required` or a
//! named function, a grammar. So a call survives a mid-stream migration like any text, and every
//! model family is handled in one place.

pub mod parser;
pub mod prompt;

use bellows_common::constraint::{Constraint, JsonBounds, NESTABLE_START, embedded_schema};
use serde_json::{Value, json};

pub use parser::{Family, ParsedCall, ToolCallParser};

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema for the arguments object.
    pub parameters: Value,
}

/// A fresh id for a call the model made (`call_` and 24 hex digits, as OpenAI's look).
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

/// A call as OpenAI returns it: `{id, type: "function", function: {name, arguments}}`, with
/// `index` when it is part of a streamed delta.
pub fn call_json(call: &ParsedCall, index: Option<usize>) -> Value {
    let mut v =
        json!({"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}});
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// How calls are read out of one request's answers: the model family's format, whether more
/// than one call is kept, and the functions the request declared (a bare JSON object naming one
/// of them is a call too, as small models write them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallParsing {
    pub family: Family,
    pub parallel: bool,
    pub names: std::sync::Arc<Vec<String>>,
}

impl CallParsing {
    pub fn of(family: Family, tools: &Tools) -> Self {
        let names = tools.specs.iter().map(|s| s.name.clone()).collect();
        CallParsing { family, parallel: tools.parallel, names: std::sync::Arc::new(names) }
    }

    pub fn parser(&self) -> ToolCallParser {
        ToolCallParser::new(self.family, self.parallel, self.names.clone())
    }
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The tools are not shown to the model and nothing is parsed.
    None,
    /// The model decides; calls are parsed out of its answer.
    Auto,
    /// The answer is one or more calls, enforced by a grammar.
    Required,
    /// The answer is a call of this function, enforced by a grammar.
    Named(String),
}

/// A request's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

impl Tools {
    /// The model sees the tools and its answer is parsed for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The tools in OpenAI's JSON shape, as chat templates take them.
    pub fn as_json(&self) -> Vec<Value> {
        self.specs
            .iter()
            .map(|t| {
                let mut function = json!({"name": t.name, "parameters": t.parameters});
                if let Some(d) = &t.description {
                    function["description"] = json!(d);
                }
                json!({"type": "function", "function": function})
            })
            .collect()
    }

    /// For `required` or a named function: a grammar whose every sentence is a well-formed call
    /// (or several, when parallel) in the family's syntax, with arguments matching the function's
    /// schema, its numbers bounded as `bounds` says. `None` for `auto` and `none`.
    pub fn constraint(&self, family: Family, bounds: JsonBounds) -> Option<Constraint> {
        let allowed: Vec<&ToolSpec> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.specs.iter().collect(),
            ToolChoice::Named(name) => self.specs.iter().filter(|t| &t.name == name).collect(),
        };
        let args_key = if family == Family::Llama3Json { "parameters" } else { "arguments" };
        let one_of: Vec<Value> = allowed
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, args_key: t.parameters},
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = json!({"anyOf": one_of});
        let grammar = match family {
            Family::Hermes => {
                let more = if self.parallel { " (\"\\n\" call)*" } else { "" };
                let call = embedded_schema(call, bounds);
                format!("answer: call{more}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {call}")
            }
            Family::Llama3Json => {
                let more = if self.parallel { " (\"; \" body)*" } else { "" };
                format!("answer: body{more}\nbody: %json {}", embedded_schema(call, bounds))
            }
            Family::Mistral => {
                let max = if self.parallel { json!(null) } else { json!(1) };
                let mut array = json!({"type": "array", "items": call, "minItems": 1});
                if !max.is_null() {
                    array["maxItems"] = max;
                }
                format!("answer: \"[TOOL_CALLS]\" calls\ncalls: %json {}", embedded_schema(array, bounds))
            }
        };
        // Nestable: a thinking model thinks before the call (Constraint::after_thinking).
        Some(Constraint::Lark(format!("{NESTABLE_START}{grammar}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: ToolChoice, parallel: bool) -> Tools {
        let spec = |name: &str| ToolSpec {
            name: name.into(),
            description: Some("d".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        };
        Tools { specs: vec![spec("weather"), spec("time")], choice, parallel }
    }

    #[test]
    fn forced_grammars_compile_for_every_family_and_auto_has_none() {
        for family in [Family::Hermes, Family::Llama3Json, Family::Mistral] {
            for choice in [ToolChoice::Required, ToolChoice::Named("time".into())] {
                for parallel in [true, false] {
                    let c = tools(choice.clone(), parallel)
                        .constraint(family, JsonBounds::Bounded)
                        .expect("a forced grammar");
                    assert_eq!(c.check(), Ok(()), "{family:?} {choice:?} parallel={parallel}: {c:?}");
                }
            }
            assert_eq!(tools(ToolChoice::Auto, true).constraint(family, JsonBounds::Bounded), None);
        }
    }

    #[test]
    fn a_named_choice_admits_only_that_function() {
        let Some(Constraint::Lark(g)) =
            tools(ToolChoice::Named("time".into()), true).constraint(Family::Hermes, JsonBounds::Bounded)
        else {
            panic!("a Lark grammar")
        };
        assert!(g.contains("\"time\"") && !g.contains("\"weather\""), "{g}");
    }
}
