//! What a Messages request gets back, in Anthropic's shapes: a `message` object whole, or the
//! event sequence its SDK's stream helper accumulates (`message_start`, then per content block
//! `content_block_start`, its deltas and `content_block_stop`, then `message_delta` with the
//! stop reason and usage, then `message_stop`), each SSE event named by its `event:` line, which
//! is what the SDK dispatches on. Errors are `{"type": "error", "error": {"type", "message"}}`
//! with the status the OpenAI endpoints give the same failure.

use std::convert::Infallible;

use axum::{
    Json,
    body::Body,
    http::StatusCode,
    response::{
        IntoResponse, Response,
        sse::{Event, KeepAlive, Sse},
    },
};
use futures_util::{Stream, StreamExt, stream};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::{
    answer::{AnswerParser, ParsedCall, Piece},
    api::{
        error::ApiError,
        reply::{Reply, Timing},
        response::{self, ChoiceOut, UsageOut},
    },
    dispatch::ChoiceEvent,
};

/// An error as Anthropic's clients read it: the status (and Retry-After) the error always has,
/// the body in Anthropic's shape. That shape has no `param`, so the message names the field, in
/// Anthropic's terms: the tools are checked by the OpenAI checks, which name OpenAI's fields.
pub fn error_response(e: ApiError) -> Response {
    let kind = error_type(e.status());
    let message = match &e {
        ApiError::Unauthorized => "Incorrect or missing API key. Send it as 'x-api-key: <key>'.".to_string(),
        other => {
            let body = other.body().error;
            let message = match body.param {
                Some(param) if !body.message.contains(param.as_str()) => format!("{param}: {}", body.message),
                _ => body.message,
            };
            message.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
        }
    };
    let (parts, _) = e.into_response().into_parts();
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// Anthropic's `error.type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    }
}

/// Why generation stopped, in Anthropic's words: `stop_reason`, and `stop_sequence` (the
/// matched string, none unless that is the reason). `finish` is the OpenAI finish reason with
/// calls already folded in: calls that end the answer win over a stop string after them.
fn stop<'a>(finish: &str, stop_sequence: Option<&'a str>) -> (&'static str, Option<&'a str>) {
    match (finish, stop_sequence) {
        ("tool_calls", _) => ("tool_use", None),
        ("length", _) => ("max_tokens", None),
        (_, Some(s)) => ("stop_sequence", Some(s)),
        _ => ("end_turn", None),
    }
}

/// Anthropic counts cached input apart from `input_tokens` (OpenAI counts it within).
fn usage(u: &UsageOut) -> Value {
    let cached = u.prompt_tokens_details.cached_tokens;
    json!({
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    })
}

/// Thinking as Anthropic's block. Its `signature` is empty: this gateway does not sign thinking,
/// and thinking sent back in a later turn is left out of the prompt, as the templates do.
fn thinking_block(thinking: &str) -> Value {
    json!({"type": "thinking", "thinking": thinking, "signature": ""})
}

fn tool_use_block(call: &ParsedCall) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": input})
}

/// A fresh id for a call (`toolu_` and 24 hex digits, as Anthropic's look).
fn tool_use_id() -> String {
    format!("toolu_{:024x}", rand::random::<u128>() >> 32)
}

/// The whole answer as one `message` object.
pub async fn whole(mut reply: Reply, rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
    let (choices, usage) = reply.collect(rx).await?;
    let choice = choices.first().expect("a Messages request has one choice");
    Ok(Json(message(&reply, choice, &usage)).into_response())
}

fn message(reply: &Reply, choice: &ChoiceOut, u: &UsageOut) -> Value {
    let mut content = Vec::new();
    if !choice.reasoning.is_empty() {
        content.push(thinking_block(&choice.reasoning));
    }
    if !choice.text.is_empty() || (choice.tool_calls.is_empty() && choice.reasoning.is_empty()) {
        content.push(json!({"type": "text", "text": choice.text}));
    }
    content.extend(choice.tool_calls.iter().map(tool_use_block));
    let (reason, matched) = stop(choice.finish, choice.stop_sequence.as_deref());
    json!({
        "id": reply.id,
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": matched,
        "usage": usage(u),
    })
}

/// Stream the answer as Anthropic's events. As for chat, the HTTP status waits for the first
/// event: a request that fails before any output gets its error status, not a 200.
pub async fn stream(mut reply: Reply, mut rx: mpsc::Receiver<ChoiceEvent>) -> Result<Response, ApiError> {
    let mut timing = Timing { streamed: true, ..Timing::default() };
    let first = reply.first_output(&mut rx, &mut timing).await?;
    let parser = reply.answer.parser();
    let state = MessageStream {
        reply,
        rx,
        timing,
        pending: Some(first),
        parser,
        thinking_block: None,
        text_block: None,
        call_block: None,
        blocks: 0,
        made_calls: false,
        announced: false,
        finished: false,
    };
    Ok((StatusCode::OK, Sse::new(events(state)).keep_alive(KeepAlive::default())).into_response())
}

struct MessageStream {
    reply: Reply,
    rx: mpsc::Receiver<ChoiceEvent>,
    timing: Timing,
    pending: Option<ChoiceEvent>,
    /// Reads thinking and calls out of the text as it comes.
    parser: AnswerParser,
    /// The index of the thinking block open now (thinking arrives into it until the answer).
    thinking_block: Option<u32>,
    /// The index of the text block open now (text arrives into it until a call or the end).
    text_block: Option<u32>,
    /// The index of the `tool_use` block whose arguments are streaming.
    call_block: Option<u32>,
    /// Content blocks started so far: the next one's index.
    blocks: u32,
    made_calls: bool,
    /// `message_start` was sent.
    announced: bool,
    finished: bool,
}

/// One SSE event: its name (the `event:` line, equal to the data's `type`) and its data.
type Named = (&'static str, Value);

fn events(state: MessageStream) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let event = match s.pending.take() {
            Some(e) => Some(e),
            None => s.rx.recv().await,
        };
        let out = s.step(event);
        Some((out, s))
    })
    .flat_map(|batch| {
        stream::iter(batch.into_iter().map(|(name, data)| Ok(Event::default().event(name).data(data.to_string()))))
    })
}

impl MessageStream {
    fn step(&mut self, event: Option<ChoiceEvent>) -> Vec<Named> {
        let mut out = Vec::with_capacity(3);
        if !self.announced {
            self.announced = true;
            out.push(self.message_start());
            out.push(("ping", json!({"type": "ping"})));
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
            Some(ChoiceEvent::Done { finish, stop_sequence, usage: u, .. }) => {
                let pieces = self.parser.finish();
                self.send_pieces(pieces, &mut out);
                self.close_thinking(&mut out);
                self.close_text(&mut out);
                let finish = response::finish_with_calls(response::finish_reason(finish), self.made_calls);
                let mut total = UsageOut::default();
                total.add(&u, true);
                let (reason, matched) = stop(finish, stop_sequence.as_deref());
                self.reply.record(&total, &[reason], None);
                self.reply.finished();
                let delta = json!({"stop_reason": reason, "stop_sequence": matched});
                out.push(("message_delta", json!({"type": "message_delta", "delta": delta, "usage": usage(&total)})));
                out.push(("message_stop", json!({"type": "message_stop"})));
                self.finished = true;
            }
            Some(ChoiceEvent::Failed { error, .. }) => self.fail(ApiError::from(error), &mut out),
            None => self.fail(ApiError::WorkerFailed("the stream ended without finishing".into()), &mut out),
        }
        out
    }

    fn message_start(&self) -> Named {
        let usage = json!({"input_tokens": self.reply.prompt_tokens, "output_tokens": 0});
        let message = json!({
            "id": self.reply.id,
            "type": "message",
            "role": "assistant",
            "model": self.reply.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": usage,
        });
        ("message_start", json!({"type": "message_start", "message": message}))
    }

    /// Thinking goes into a thinking block, text into the open text block (each opened as
    /// needed, and the other closed); a call closes both and is a `tool_use` block of its own,
    /// its arguments in `input_json_delta`s as they stream (one for a call parsed whole).
    fn send_pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<Named>) {
        for piece in pieces {
            match piece {
                Piece::Reasoning(thinking) => {
                    let index = self.open_thinking(out);
                    let delta = json!({"type": "thinking_delta", "thinking": thinking});
                    out.push((
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": delta}),
                    ));
                }
                Piece::Content(text) if text.is_empty() => {}
                Piece::Content(text) => {
                    self.close_thinking(out);
                    let index = self.open_text(out);
                    let delta = json!({"type": "text_delta", "text": text});
                    out.push((
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": delta}),
                    ));
                }
                Piece::Call(call) => {
                    self.start_call(&call.name, out);
                    self.call_arguments(&call.arguments, out);
                    self.end_call(out);
                }
                Piece::CallStarted { name } => self.start_call(&name, out),
                Piece::Arguments(fragment) => self.call_arguments(&fragment, out),
                Piece::CallEnded => self.end_call(out),
            }
        }
    }

    fn start_call(&mut self, name: &str, out: &mut Vec<Named>) {
        self.close_thinking(out);
        self.close_text(out);
        let index = self.next_block();
        self.call_block = Some(index);
        let block = json!({"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}});
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        self.made_calls = true;
    }

    fn call_arguments(&mut self, fragment: &str, out: &mut Vec<Named>) {
        let index = self.call_block.expect("arguments follow their call's start");
        let delta = json!({"type": "input_json_delta", "partial_json": fragment});
        out.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta})));
    }

    fn end_call(&mut self, out: &mut Vec<Named>) {
        if let Some(index) = self.call_block.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
    }

    fn next_block(&mut self) -> u32 {
        self.blocks += 1;
        self.blocks - 1
    }

    fn open_thinking(&mut self, out: &mut Vec<Named>) -> u32 {
        if let Some(index) = self.thinking_block {
            return index;
        }
        self.close_text(out);
        let index = self.next_block();
        self.thinking_block = Some(index);
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": thinking_block("")}),
        ));
        index
    }

    /// A thinking block ends with its signature, as Anthropic's do (empty: see `thinking_block`).
    fn close_thinking(&mut self, out: &mut Vec<Named>) {
        if let Some(index) = self.thinking_block.take() {
            let delta = json!({"type": "signature_delta", "signature": ""});
            out.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta})));
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
    }

    fn open_text(&mut self, out: &mut Vec<Named>) -> u32 {
        if let Some(index) = self.text_block {
            return index;
        }
        let index = self.next_block();
        self.text_block = Some(index);
        let block = json!({"type": "text", "text": ""});
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn close_text(&mut self, out: &mut Vec<Named>) {
        if let Some(index) = self.text_block.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
    }

    /// A failure after the 200: Anthropic's `error` event, which the SDK raises as an error.
    fn fail(&mut self, e: ApiError, out: &mut Vec<Named>) {
        self.reply.span.record("otel.status_code", "ERROR");
        let kind = error_type(e.status());
        out.push(("error", json!({"type": "error", "error": {"type": kind, "message": e.body().error.message}})));
        self.finished = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(e: ApiError) -> (StatusCode, Value) {
        let r = error_response(e);
        let status = r.status();
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn an_error_names_its_field_in_anthropics_terms_in_anthropics_shape() {
        let e = ApiError::invalid("tools[1].function.parameters", "Invalid schema for function \"f\"");
        let (status, body) = body_of(e).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["message"], "tools[1].input_schema: Invalid schema for function \"f\"");
        let (_, body) = body_of(ApiError::invalid("top_p", "top_p: must be at most 1")).await;
        assert_eq!(body["error"]["message"], "top_p: must be at most 1", "a message that names its field is kept");
        let (status, body) = body_of(ApiError::Unauthorized).await;
        assert_eq!((status, &body["error"]["type"]), (StatusCode::UNAUTHORIZED, &json!("authentication_error")));
    }

    #[test]
    fn a_stop_string_is_the_reason_only_when_nothing_else_ended_the_answer() {
        assert_eq!(stop("stop", Some("END")), ("stop_sequence", Some("END")));
        assert_eq!(stop("stop", None), ("end_turn", None));
        assert_eq!(stop("tool_calls", Some("END")), ("tool_use", None));
        assert_eq!(stop("length", None), ("max_tokens", None));
    }
}
