//! The Responses output items and the bodies of the events that stream them, as typed structs:
//! each is written straight to JSON text (no tree built per event), and an item's shape follows
//! from its type (a message has no arguments, a call no content parts).

use serde::Serialize;
use serde_json::Value;

use crate::answer::ParsedCall;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Status {
    InProgress,
    Completed,
}

/// One item of a response's `output`, in OpenAI's shape.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum Item {
    Message {
        id: String,
        status: Status,
        role: &'static str,
        content: Vec<Part>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: Status,
    },
    /// Thinking, its text as `reasoning_text` content, as open-weight models' is (OpenAI's own
    /// models give a `summary` instead, left empty here).
    Reasoning {
        id: String,
        summary: [(); 0],
        content: Vec<Part>,
        status: Status,
    },
}

/// A content part: `output_text` in a message, `reasoning_text` in a reasoning item.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum Part {
    OutputText { text: String, annotations: [(); 0], logprobs: [(); 0] },
    ReasoningText { text: String },
}

impl Part {
    pub fn output_text(text: &str) -> Part {
        Part::OutputText { text: text.to_string(), annotations: [], logprobs: [] }
    }

    pub fn reasoning_text(text: &str) -> Part {
        Part::ReasoningText { text: text.to_string() }
    }
}

impl Item {
    /// A message item: finished with its text, or open (no parts yet) when `text` is `None`.
    pub fn message(id: &str, text: Option<&str>) -> Item {
        let (status, content) = parts(text.map(Part::output_text));
        Item::Message { id: id.to_string(), status, role: "assistant", content }
    }

    /// A reasoning item, finished or open as for [`Item::message`].
    pub fn reasoning(id: &str, text: Option<&str>) -> Item {
        let (status, content) = parts(text.map(Part::reasoning_text));
        Item::Reasoning { id: id.to_string(), summary: [], content, status }
    }

    /// A call item: its arguments empty until it is `done`.
    pub fn call(id: &str, call_id: &str, call: &ParsedCall, done: bool) -> Item {
        let (arguments, status) =
            if done { (call.arguments.clone(), Status::Completed) } else { (String::new(), Status::InProgress) };
        Item::FunctionCall {
            id: id.to_string(),
            call_id: call_id.to_string(),
            name: call.name.clone(),
            arguments,
            status,
        }
    }

    pub fn is_call(&self) -> bool {
        matches!(self, Item::FunctionCall { .. })
    }

    /// The item as stored context for a continuation.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("an item serializes")
    }
}

fn parts(part: Option<Part>) -> (Status, Vec<Part>) {
    match part {
        Some(p) => (Status::Completed, vec![p]),
        None => (Status::InProgress, Vec::new()),
    }
}

/// One streamed event: its type and sequence number, then its body's fields.
#[derive(Serialize)]
pub(super) struct Event<B: Serialize> {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub sequence_number: u64,
    #[serde(flatten)]
    pub body: B,
}

/// `response.output_item.added` / `.done`.
#[derive(Serialize)]
pub(super) struct ItemEvent<'a> {
    pub output_index: usize,
    pub item: &'a Item,
}

/// `response.content_part.added` / `.done`.
#[derive(Serialize)]
pub(super) struct PartEvent<'a> {
    pub output_index: usize,
    pub item_id: &'a str,
    pub content_index: u32,
    pub part: &'a Part,
}

/// `response.output_text.done` / `response.reasoning_text.done`.
#[derive(Serialize)]
pub(super) struct TextDone<'a> {
    pub output_index: usize,
    pub item_id: &'a str,
    pub content_index: u32,
    pub text: &'a str,
    pub logprobs: [(); 0],
}

/// `response.function_call_arguments.done`.
#[derive(Serialize)]
pub(super) struct ArgumentsDone<'a> {
    pub output_index: usize,
    pub item_id: &'a str,
    pub name: &'a str,
    pub arguments: &'a str,
}

/// The per-token events (`response.output_text.delta`, `response.reasoning_text.delta`,
/// `response.function_call_arguments.delta`): flat, the hot path's one struct.
#[derive(Serialize)]
pub(super) struct Delta<'a> {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub sequence_number: u64,
    pub output_index: usize,
    pub item_id: &'a str,
    /// Text parts have an index; a call's arguments do not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_index: Option<u32>,
    pub delta: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<[(); 0]>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn items_have_openais_shapes_open_and_finished() {
        assert_eq!(
            Item::message("msg_1", Some("hi")).to_value(),
            json!({"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]})
        );
        assert_eq!(Item::message("msg_1", None).to_value()["content"], json!([]));
        assert_eq!(
            Item::reasoning("rs_1", Some("hmm")).to_value(),
            json!({"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                   "content": [{"type": "reasoning_text", "text": "hmm"}]})
        );
        let call = ParsedCall { name: "f".into(), arguments: "{\"a\":1}".into() };
        assert_eq!(
            Item::call("fc_1", "call_1", &call, false).to_value(),
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "",
                   "status": "in_progress"})
        );
        assert_eq!(Item::call("fc_1", "call_1", &call, true).to_value()["arguments"], "{\"a\":1}");
    }

    #[test]
    fn an_event_is_its_type_and_sequence_number_then_its_body() {
        let item = Item::message("msg_1", None);
        let e = Event {
            kind: "response.output_item.added",
            sequence_number: 3,
            body: ItemEvent { output_index: 1, item: &item },
        };
        let v: Value = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
        assert_eq!((v["type"].as_str(), v["sequence_number"].as_u64()), (Some("response.output_item.added"), Some(3)));
        assert_eq!((v["output_index"].as_u64(), v["item"]["id"].as_str()), (Some(1), Some("msg_1")));
        let d = Delta {
            kind: "response.function_call_arguments.delta",
            sequence_number: 4,
            output_index: 0,
            item_id: "fc_1",
            content_index: None,
            delta: "{",
            logprobs: None,
        };
        let v: Value = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert!(v.get("content_index").is_none() && v.get("logprobs").is_none(), "{v}");
    }
}
