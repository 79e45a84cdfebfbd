//! What a Responses request gets back: the `response` object whole, or the semantic event
//! stream the SDK's `responses.stream()` accumulates (`response.created`, then per output item
//! `response.output_item.added`, its parts and deltas, `response.output_item.done`, then
//! `response.completed` with the whole output and usage), each event with its `sequence_number`.
//! Items are numbered in output order and parts within their item, as the SDK indexes them.
//!
//! A stored response is written once its output is complete, before the client is told it is
//! (`response.completed`, or the whole answer): a continuation sent right after finds it.

use std::convert::Infallible;

use axum::{
    Json,
    http::StatusCode,
    response::{
        IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
};
use futures_util::{Stream, StreamExt, stream};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{Turn, new_item_id, store::Stored};
use crate::{
    answer::{AnswerParser, ParsedCall, Piece},
    api::{
        error::ApiError,
        reply::{Reply, Timing},
        response::{self, ChoiceOut, UsageOut},
    },
    dispatch::ChoiceEvent,
};

fn usage(u: &UsageOut) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.completion_tokens_details.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The response object in a given state: `output` and `usage` once known.
fn object(reply: &Reply, turn: &Turn, status: &str, output: &[Value], u: Option<&UsageOut>) -> Value {
    let mut o = json!({
        "id": reply.id,
        "object": "response",
        "created_at": reply.created,
        "status": status,
        "model": reply.model,
        "output": output,
        "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "usage": u.map(usage),
        "service_tier": reply.priority.service_tier(),
    });
    let map = o.as_object_mut().expect("an object");
    map.extend(turn.echo.clone());
    if status == "completed" || status == "incomplete" {
        map.insert("completed_at".into(), json!(crate::api::unix_seconds()));
    }
    o
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text)]) };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// Thinking as a `reasoning` item: its text as `reasoning_text` content, as open-weight models'
/// is (OpenAI's own models give a `summary` instead, left empty here).
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([reasoning_part(text)]) };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

fn call_item(id: &str, call_id: &str, call: &ParsedCall, status: &str) -> Value {
    let arguments = if status == "in_progress" { "" } else { call.arguments.as_str() };
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": call.name, "arguments": arguments, "status": status})
}

/// Whether the answer ended by its length.
fn status_of(finish: &str) -> &'static str {
    if finish == "length" { "incomplete" } else { "completed" }
}

/// Store the finished response, if the request asked: a failed write is logged, never the
/// request's failure (the answer is whole without the store).
async fn store(reply: &Reply, turn: &Turn, response: &Value) {
    let Some(store) = turn.store.as_ref() else { return };
    let output = response["output"].as_array().cloned().unwrap_or_default();
    let mut context = turn.context.clone();
    context.extend(output);
    let stored = Stored { response: response.clone(), input_items: turn.input_items.clone(), context };
    if let Err(e) = store.put(&turn.tenant, &reply.id, stored).await {
        let _in_span = reply.span.enter();
        tracing::warn!(error = %e, "the response was not stored");
    }
}

/// The whole answer as one `response` object.
pub async fn whole(mut reply: Reply, turn: Turn, rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
    let (choices, u) = reply.collect(rx).await?;
    let choice = choices.first().expect("a Responses request has one choice");
    let output = output_items(choice);
    let response = object(&reply, &turn, status_of(choice.finish), &output, Some(&u));
    store(&reply, &turn, &response).await;
    Ok(Json(response).into_response())
}

fn output_items(choice: &ChoiceOut) -> Vec<Value> {
    let mut output = Vec::new();
    if !choice.reasoning.is_empty() {
        output.push(reasoning_item(&new_item_id("rs"), &choice.reasoning, "completed"));
    }
    if !choice.text.is_empty() || (choice.tool_calls.is_empty() && choice.reasoning.is_empty()) {
        output.push(message_item(&new_item_id("msg"), &choice.text, "completed"));
    }
    for call in &choice.tool_calls {
        output.push(call_item(&new_item_id("fc"), &new_item_id("call"), call, "completed"));
    }
    output
}

/// Stream the answer as the Responses events. As for chat, the HTTP status waits for the first
/// event: a request that fails before any output gets its error status, not a 200.
pub async fn stream(mut reply: Reply, turn: Turn, mut rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
    let mut timing = Timing { streamed: true, ..Timing::default() };
    let first = reply.first_output(&mut rx, &mut timing).await?;
    let parser = reply.answer.parser();
    let state = ResponseStream {
        reply,
        turn,
        rx,
        timing,
        pending: Some(first),
        parser,
        output: Vec::new(),
        reasoning: None,
        text: None,
        call: None,
        sequence: 0,
        announced: false,
        finished: false,
    };
    Ok((StatusCode::OK, Sse::new(events(state)).keep_alive(KeepAlive::default())).into_response())
}

struct ResponseStream {
    reply: Reply,
    turn: Turn,
    rx: mpsc::Receiver<ChoiceEvent>,
    timing: Timing,
    pending: Option<ChoiceEvent>,
    parser: AnswerParser,
    /// The finished output items so far.
    output: Vec<Value>,
    /// The reasoning item open now: its id and its text so far.
    reasoning: Option<(String, String)>,
    /// The message item open now: its id and its text so far.
    text: Option<(String, String)>,
    /// The function call item whose arguments are streaming.
    call: Option<OpenCall>,
    /// The next event's `sequence_number`.
    sequence: u64,
    announced: bool,
    finished: bool,
}

/// A `function_call` item being streamed: its item id, its call id, and the call so far.
struct OpenCall {
    id: String,
    call_id: String,
    call: ParsedCall,
}

/// What one step produced: events to send, and the finished response to store before the
/// last of them (`response.completed`) goes out.
struct Step {
    events: Vec<Sent>,
    finished: Option<Value>,
}

/// One event ready for the wire: its name and its data's JSON text.
struct Sent {
    name: &'static str,
    data: String,
}

/// `response.output_text.delta`, the per-token event: a struct, serialized straight to text
/// (no intermediate JSON tree on the hot path).
#[derive(serde::Serialize)]
struct TextDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    sequence_number: u64,
    output_index: usize,
    item_id: &'a str,
    content_index: u32,
    delta: &'a str,
    logprobs: [(); 0],
}

fn events(state: ResponseStream) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let event = match s.pending.take() {
            Some(e) => Some(e),
            None => s.rx.recv().await,
        };
        let step = s.step(event);
        if let Some(response) = &step.finished {
            store(&s.reply, &s.turn, response).await;
        }
        Some((step.events, s))
    })
    .flat_map(|batch| stream::iter(batch.into_iter().map(|e| Ok(Event::default().event(e.name).data(e.data)))))
}

impl ResponseStream {
    /// An event of `type` with the next sequence number.
    fn event(&mut self, kind: &'static str, mut data: Value) -> Sent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        Sent { name: kind, data: data.to_string() }
    }

    fn step(&mut self, event: Option<ChoiceEvent>) -> Step {
        let mut out = Vec::with_capacity(4);
        let mut finished = None;
        if !self.announced {
            self.announced = true;
            // One response object, serialized once, for both events that carry it.
            let created = object(&self.reply, &self.turn, "in_progress", &[], None).to_string();
            for kind in ["response.created", "response.in_progress"] {
                let data = format!(r#"{{"type":"{kind}","sequence_number":{},"response":{created}}}"#, self.sequence);
                self.sequence += 1;
                out.push(Sent { name: kind, data });
            }
        }
        if let Some(e) = &event {
            self.reply.observe(e, &mut self.timing);
        }
        match event {
            Some(ChoiceEvent::Started { .. }) => {}
            Some(ChoiceEvent::Text { text, tokens, .. }) => {
                let pieces = self.parser.push(&text, tokens);
                self.send_pieces(pieces, &mut out);
            }
            Some(ChoiceEvent::Done { finish, usage: u, .. }) => {
                let pieces = self.parser.finish();
                self.send_pieces(pieces, &mut out);
                self.close_reasoning(&mut out);
                let made_calls = self.output.iter().any(|i| i["type"] == "function_call");
                if self.output.is_empty() {
                    self.open_text(&mut out);
                }
                self.close_text(&mut out);
                let finish = response::finish_with_calls(response::finish_reason(finish), made_calls);
                let mut total = UsageOut::default();
                total.add(&u, true);
                total.add_reasoning(self.parser.reasoning_tokens());
                self.reply.record(&total, &[finish], None);
                self.reply.finished();
                let response = object(&self.reply, &self.turn, status_of(finish), &self.output, Some(&total));
                let kind = if status_of(finish) == "incomplete" { "response.incomplete" } else { "response.completed" };
                let e = self.event(kind, json!({"response": response}));
                out.push(e);
                finished = Some(response);
                self.finished = true;
            }
            Some(ChoiceEvent::Failed { error, .. }) => self.fail(ApiError::from(error), &mut out),
            None => self.fail(ApiError::WorkerFailed("the stream ended without finishing".into()), &mut out),
        }
        Step { events: out, finished }
    }

    /// Thinking goes into a reasoning item, text into the open message item (each opened as
    /// needed); a call closes both and is a `function_call` item of its own, its arguments in
    /// deltas as they stream (one for a call parsed whole).
    fn send_pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<Sent>) {
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => self.reasoning_delta(&text, out),
                Piece::Content(text) if text.is_empty() => {}
                Piece::Content(text) => {
                    self.close_reasoning(out);
                    let index = self.open_text(out);
                    let (id, so_far) = self.text.as_mut().expect("an open message");
                    so_far.push_str(&text);
                    let kind = "response.output_text.delta";
                    let delta = TextDelta {
                        kind,
                        sequence_number: self.sequence,
                        output_index: index,
                        item_id: id,
                        content_index: 0,
                        delta: &text,
                        logprobs: [],
                    };
                    let data = serde_json::to_string(&delta).expect("a delta serializes");
                    self.sequence += 1;
                    out.push(Sent { name: kind, data });
                }
                Piece::Call(call) => {
                    self.start_call(call.name, out);
                    self.call_arguments(&call.arguments, out);
                    self.end_call(out);
                }
                Piece::CallStarted { name } => self.start_call(name, out),
                Piece::Arguments(fragment) => self.call_arguments(&fragment, out),
                Piece::CallEnded => self.end_call(out),
            }
        }
    }

    /// A `function_call` item opens: it closes the message item, if one is open.
    fn start_call(&mut self, name: String, out: &mut Vec<Sent>) {
        self.close_reasoning(out);
        self.close_text(out);
        let call = OpenCall {
            id: new_item_id("fc"),
            call_id: new_item_id("call"),
            call: ParsedCall { name, arguments: String::new() },
        };
        let item = call_item(&call.id, &call.call_id, &call.call, "in_progress");
        let e = self.event("response.output_item.added", json!({"output_index": self.output.len(), "item": item}));
        out.push(e);
        self.call = Some(call);
    }

    fn call_arguments(&mut self, fragment: &str, out: &mut Vec<Sent>) {
        let index = self.output.len();
        let call = self.call.as_mut().expect("arguments follow their call's start");
        call.call.arguments.push_str(fragment);
        let delta = json!({"output_index": index, "item_id": call.id, "delta": fragment});
        let e = self.event("response.function_call_arguments.delta", delta);
        out.push(e);
    }

    fn end_call(&mut self, out: &mut Vec<Sent>) {
        let Some(OpenCall { id, call_id, call }) = self.call.take() else { return };
        let index = self.output.len();
        let done = json!({"output_index": index, "item_id": id, "name": call.name, "arguments": call.arguments});
        let e = self.event("response.function_call_arguments.done", done);
        out.push(e);
        let item = call_item(&id, &call_id, &call, "completed");
        let e = self.event("response.output_item.done", json!({"output_index": index, "item": item}));
        out.push(e);
        self.output.push(item);
    }

    /// The next of the thinking, into the open reasoning item (opened, and any message item
    /// closed, if none is).
    fn reasoning_delta(&mut self, text: &str, out: &mut Vec<Sent>) {
        let index = self.output.len();
        if self.reasoning.is_none() {
            self.close_text(out);
            let id = new_item_id("rs");
            let item = reasoning_item(&id, "", "in_progress");
            let e = self.event("response.output_item.added", json!({"output_index": index, "item": item}));
            out.push(e);
            let part = json!({"output_index": index, "item_id": id, "content_index": 0, "part": reasoning_part("")});
            let e = self.event("response.content_part.added", part);
            out.push(e);
            self.reasoning = Some((id, String::new()));
        }
        let (id, so_far) = self.reasoning.as_mut().expect("an open reasoning item");
        so_far.push_str(text);
        let delta = json!({"output_index": index, "item_id": id, "content_index": 0, "delta": text});
        let e = self.event("response.reasoning_text.delta", delta);
        out.push(e);
    }

    fn close_reasoning(&mut self, out: &mut Vec<Sent>) {
        let Some((id, text)) = self.reasoning.take() else { return };
        let index = self.output.len();
        let done = json!({"output_index": index, "item_id": id, "content_index": 0, "text": text});
        let e = self.event("response.reasoning_text.done", done);
        out.push(e);
        let part = json!({"output_index": index, "item_id": id, "content_index": 0, "part": reasoning_part(&text)});
        let e = self.event("response.content_part.done", part);
        out.push(e);
        let item = reasoning_item(&id, &text, "completed");
        let e = self.event("response.output_item.done", json!({"output_index": index, "item": item}));
        out.push(e);
        self.output.push(item);
    }

    /// The open message item's output index, opening one (its item and its text part) if none is.
    fn open_text(&mut self, out: &mut Vec<Sent>) -> usize {
        let index = self.output.len();
        if self.text.is_some() {
            return index;
        }
        let id = new_item_id("msg");
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": message_item(&id, "", "in_progress")}),
        );
        out.push(e);
        let part = json!({"output_index": index, "item_id": id, "content_index": 0, "part": text_part("")});
        let e = self.event("response.content_part.added", part);
        out.push(e);
        self.text = Some((id, String::new()));
        index
    }

    fn close_text(&mut self, out: &mut Vec<Sent>) {
        let Some((id, text)) = self.text.take() else { return };
        let index = self.output.len();
        let done = json!({"output_index": index, "item_id": id, "content_index": 0, "text": text, "logprobs": []});
        let e = self.event("response.output_text.done", done);
        out.push(e);
        let part = json!({"output_index": index, "item_id": id, "content_index": 0, "part": text_part(&text)});
        let e = self.event("response.content_part.done", part);
        out.push(e);
        let item = message_item(&id, &text, "completed");
        let e = self.event("response.output_item.done", json!({"output_index": index, "item": item}));
        out.push(e);
        self.output.push(item);
    }

    /// A failure after the 200: an `error` event, then `response.failed` with the error.
    fn fail(&mut self, e: ApiError, out: &mut Vec<Sent>) {
        self.reply.span.record("otel.status_code", "ERROR");
        let body = e.body().error;
        let code = body.code.unwrap_or_else(|| "server_error".into());
        let e = self.event("error", json!({"code": code, "message": body.message, "param": body.param}));
        out.push(e);
        let mut failed = object(&self.reply, &self.turn, "failed", &self.output, None);
        failed["error"] = json!({"code": "server_error", "message": body.message});
        let e = self.event("response.failed", json!({"response": failed}));
        out.push(e);
        self.finished = true;
    }
}
