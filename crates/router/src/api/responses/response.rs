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
    http::{StatusCode, header},
    response::{
        IntoResponse, Response,
        sse::{self, KeepAlive, Sse},
    },
};
use futures_util::{Stream, StreamExt, stream};
use serde::Serialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::{
    Turn,
    items::{ArgumentsDone, Delta, Event, Item, ItemEvent, Part, PartEvent, TextDone},
    new_item_id,
    request::Echo,
    store::Stored,
};
use crate::{
    answer::{AnswerParser, ParsedCall, Piece},
    api::{
        error::ApiError,
        reply::{Reply, Timing},
        response::{self, ChoiceOut, UsageOut},
    },
    dispatch::ChoiceEvent,
};

#[derive(Serialize)]
struct UsageJson {
    input_tokens: u32,
    input_tokens_details: CachedTokens,
    output_tokens: u32,
    output_tokens_details: ReasoningTokens,
    total_tokens: u32,
}

#[derive(Serialize)]
struct CachedTokens {
    cached_tokens: u32,
}

#[derive(Serialize)]
struct ReasoningTokens {
    reasoning_tokens: u32,
}

fn usage(u: &UsageOut) -> UsageJson {
    UsageJson {
        input_tokens: u.prompt_tokens,
        input_tokens_details: CachedTokens { cached_tokens: u.prompt_tokens_details.cached_tokens },
        output_tokens: u.completion_tokens,
        output_tokens_details: ReasoningTokens { reasoning_tokens: u.completion_tokens_details.reasoning_tokens },
        total_tokens: u.prompt_tokens + u.completion_tokens,
    }
}

/// The response object in a given state: `output` and `usage` once known. Typed, and written
/// straight to text: the request's echoed fields are borrowed, not copied into a JSON tree.
#[derive(Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'a str,
    model: &'a str,
    output: &'a [Item],
    error: Option<ErrorOut<'a>>,
    incomplete_details: Option<Incomplete>,
    usage: Option<UsageJson>,
    service_tier: &'static str,
    #[serde(flatten)]
    echo: &'a Echo,
    #[serde(skip_serializing_if = "Option::is_none")]
    completed_at: Option<u64>,
}

#[derive(Serialize)]
struct ErrorOut<'a> {
    code: &'static str,
    message: &'a str,
}

#[derive(Serialize)]
struct Incomplete {
    reason: &'static str,
}

fn object<'a>(
    reply: &'a Reply,
    turn: &'a Turn,
    status: &'a str,
    output: &'a [Item],
    u: Option<&UsageOut>,
) -> ResponseObject<'a> {
    let ended = status == "completed" || status == "incomplete";
    ResponseObject {
        id: &reply.id,
        object: "response",
        created_at: reply.created,
        status,
        model: &reply.model,
        output,
        error: None,
        incomplete_details: (status == "incomplete").then_some(Incomplete { reason: "max_output_tokens" }),
        usage: u.map(usage),
        service_tier: reply.priority.service_tier(),
        echo: &turn.echo,
        completed_at: ended.then(crate::api::unix_seconds),
    }
}

/// The body of an event that carries the response object (`response.created`, `.completed`).
#[derive(Serialize)]
struct ObjectEvent<'a> {
    response: &'a ResponseObject<'a>,
}

/// Whether the answer ended by its length.
fn status_of(finish: &str) -> &'static str {
    if finish == "length" { "incomplete" } else { "completed" }
}

/// What storing `response` writes, when the request is stored.
fn to_store(turn: &Turn, response: &ResponseObject<'_>) -> Option<Stored> {
    turn.store.as_ref()?;
    let mut context = turn.context.clone();
    context.extend(response.output.iter().map(Item::to_value));
    let response = serde_json::to_value(response).expect("a response serializes");
    Some(Stored { response, input_items: turn.input_items.clone(), context })
}

/// Store the finished response, if the request asked: a failed write is logged, never the
/// request's failure (the answer is whole without the store).
async fn store(reply: &Reply, turn: &Turn, stored: Option<Stored>) {
    let (Some(store), Some(stored)) = (turn.store.as_ref(), stored) else { return };
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
    let body = serde_json::to_string(&response).expect("a response serializes");
    store(&reply, &turn, to_store(&turn, &response)).await;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

fn output_items(choice: &ChoiceOut) -> Vec<Item> {
    let mut output = Vec::new();
    if !choice.reasoning.is_empty() {
        output.push(Item::reasoning(&new_item_id("rs"), Some(&choice.reasoning)));
    }
    if !choice.text.is_empty() || (choice.tool_calls.is_empty() && choice.reasoning.is_empty()) {
        output.push(Item::message(&new_item_id("msg"), Some(&choice.text)));
    }
    for call in &choice.tool_calls {
        output.push(Item::call(&new_item_id("fc"), &new_item_id("call"), call, true));
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
    output: Vec<Item>,
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
    finished: Option<Stored>,
}

/// One event ready for the wire: its name and its data's JSON text.
struct Sent {
    name: &'static str,
    data: String,
}

fn events(state: ResponseStream) -> impl Stream<Item = Result<sse::Event, Infallible>> {
    stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let event = match s.pending.take() {
            Some(e) => Some(e),
            None => s.rx.recv().await,
        };
        let step = s.step(event);
        if step.finished.is_some() {
            store(&s.reply, &s.turn, step.finished).await;
        }
        Some((step.events, s))
    })
    .flat_map(|batch| stream::iter(batch.into_iter().map(|e| Ok(sse::Event::default().event(e.name).data(e.data)))))
}

impl ResponseStream {
    /// An event of `kind` with the next sequence number.
    fn event<B: Serialize>(&mut self, kind: &'static str, body: B) -> Sent {
        let data = serde_json::to_string(&Event { kind, sequence_number: self.sequence, body });
        self.sequence += 1;
        Sent { name: kind, data: data.expect("events serialize") }
    }

    /// A delta event of `kind` for the item at `output_index`.
    fn delta(&mut self, kind: &'static str, output_index: usize, item_id: &str, text_part: bool, delta: &str) -> Sent {
        let event = Delta {
            kind,
            sequence_number: self.sequence,
            output_index,
            item_id,
            content_index: text_part.then_some(0),
            delta,
            logprobs: (kind == "response.output_text.delta").then_some([]),
        };
        self.sequence += 1;
        Sent { name: kind, data: serde_json::to_string(&event).expect("events serialize") }
    }

    fn step(&mut self, event: Option<ChoiceEvent>) -> Step {
        let mut out = Vec::with_capacity(4);
        let mut finished = None;
        if !self.announced {
            self.announced = true;
            // One response object, serialized once, for both events that carry it.
            let created = object(&self.reply, &self.turn, "in_progress", &[], None);
            let created = serde_json::to_string(&created).expect("a response serializes");
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
                let pieces = self.parser.push(text, tokens);
                self.send_pieces(pieces, &mut out);
            }
            Some(ChoiceEvent::Done { finish, usage: u, .. }) => {
                let pieces = self.parser.finish();
                self.send_pieces(pieces, &mut out);
                self.close_reasoning(&mut out);
                let made_calls = self.output.iter().any(Item::is_call);
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
                let kind = if status_of(finish) == "incomplete" { "response.incomplete" } else { "response.completed" };
                let response = object(&self.reply, &self.turn, status_of(finish), &self.output, Some(&total));
                finished = to_store(&self.turn, &response);
                let data = serde_json::to_string(&Event {
                    kind,
                    sequence_number: self.sequence,
                    body: ObjectEvent { response: &response },
                });
                self.sequence += 1;
                out.push(Sent { name: kind, data: data.expect("events serialize") });
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
                    let (id, so_far) = self.text.take().expect("an open message");
                    out.push(self.delta("response.output_text.delta", index, &id, true, &text));
                    self.text = Some((id, so_far + &text));
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
        let item = Item::call(&call.id, &call.call_id, &call.call, false);
        let e = self.event("response.output_item.added", ItemEvent { output_index: self.output.len(), item: &item });
        out.push(e);
        self.call = Some(call);
    }

    fn call_arguments(&mut self, fragment: &str, out: &mut Vec<Sent>) {
        let index = self.output.len();
        let mut call = self.call.take().expect("arguments follow their call's start");
        call.call.arguments.push_str(fragment);
        out.push(self.delta("response.function_call_arguments.delta", index, &call.id, false, fragment));
        self.call = Some(call);
    }

    fn end_call(&mut self, out: &mut Vec<Sent>) {
        let Some(OpenCall { id, call_id, call }) = self.call.take() else { return };
        let index = self.output.len();
        let done = ArgumentsDone { output_index: index, item_id: &id, name: &call.name, arguments: &call.arguments };
        let e = self.event("response.function_call_arguments.done", done);
        out.push(e);
        let item = Item::call(&id, &call_id, &call, true);
        let e = self.event("response.output_item.done", ItemEvent { output_index: index, item: &item });
        out.push(e);
        self.output.push(item);
    }

    /// The next of the thinking, into the open reasoning item (opened, and any message item
    /// closed, if none is).
    fn reasoning_delta(&mut self, text: &str, out: &mut Vec<Sent>) {
        let index = self.output.len();
        let (id, so_far) = match self.reasoning.take() {
            Some(open) => open,
            None => {
                self.close_text(out);
                let id = new_item_id("rs");
                self.open_item(&Item::reasoning(&id, None), &Part::reasoning_text(""), out);
                (id, String::new())
            }
        };
        out.push(self.delta("response.reasoning_text.delta", index, &id, true, text));
        self.reasoning = Some((id, so_far + text));
    }

    fn close_reasoning(&mut self, out: &mut Vec<Sent>) {
        let Some((id, text)) = self.reasoning.take() else { return };
        let item = Item::reasoning(&id, Some(&text));
        self.close_item(item, "response.reasoning_text.done", &id, &text, &Part::reasoning_text(&text), out);
    }

    /// The open message item's output index, opening one (its item and its text part) if none is.
    fn open_text(&mut self, out: &mut Vec<Sent>) -> usize {
        let index = self.output.len();
        if self.text.is_none() {
            let id = new_item_id("msg");
            self.open_item(&Item::message(&id, None), &Part::output_text(""), out);
            self.text = Some((id, String::new()));
        }
        index
    }

    fn close_text(&mut self, out: &mut Vec<Sent>) {
        let Some((id, text)) = self.text.take() else { return };
        let item = Item::message(&id, Some(&text));
        self.close_item(item, "response.output_text.done", &id, &text, &Part::output_text(&text), out);
    }

    /// An item with one text part opens: the item, then its empty part.
    fn open_item(&mut self, item: &Item, part: &Part, out: &mut Vec<Sent>) {
        let index = self.output.len();
        let item_id = match item {
            Item::Message { id, .. } | Item::Reasoning { id, .. } | Item::FunctionCall { id, .. } => id.as_str(),
        };
        let e = self.event("response.output_item.added", ItemEvent { output_index: index, item });
        out.push(e);
        let e = self
            .event("response.content_part.added", PartEvent { output_index: index, item_id, content_index: 0, part });
        out.push(e);
    }

    /// An item with one text part closes: its text done, its part done, the item done.
    fn close_item(&mut self, item: Item, done: &'static str, id: &str, text: &str, part: &Part, out: &mut Vec<Sent>) {
        let index = self.output.len();
        let e = self.event(done, TextDone { output_index: index, item_id: id, content_index: 0, text, logprobs: [] });
        out.push(e);
        let e = self.event(
            "response.content_part.done",
            PartEvent { output_index: index, item_id: id, content_index: 0, part },
        );
        out.push(e);
        let e = self.event("response.output_item.done", ItemEvent { output_index: index, item: &item });
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
        failed.error = Some(ErrorOut { code: "server_error", message: &body.message });
        let data = serde_json::to_string(&Event {
            kind: "response.failed",
            sequence_number: self.sequence,
            body: ObjectEvent { response: &failed },
        });
        self.sequence += 1;
        out.push(Sent { name: "response.failed", data: data.expect("events serialize") });
        self.finished = true;
    }
}
