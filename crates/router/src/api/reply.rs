//! One request's answer as it is assembled, whatever protocol renders it: the tenant's charges
//! and the latency histograms follow each choice's events, the span gets the usage and finish
//! reasons, and a whole answer's choices are collected here ([`Reply::collect`]) for each
//! protocol to render. A renderer never charges or observes on its own, so every protocol
//! accounts for a request exactly as chat does.

use std::time::Instant;

use bellows_common::{priority::Priority, telemetry};
use tokio::sync::mpsc;
use tracing::Span;

use super::{
    error::ApiError,
    request::Endpoint,
    response::{self, ChoiceOut, UsageOut},
};
use crate::{
    answer::{AnswerShape, Gathered},
    dispatch::ChoiceEvent,
    metrics::Latencies,
    tenants::{Admission as LimitAdmission, ModelUsage, Turn},
};

/// The answer being assembled from the choices' events.
pub(super) struct Reply {
    pub(super) endpoint: Endpoint,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    /// The class it ran in, echoed as OpenAI's `service_tier`.
    pub(super) priority: Priority,
    pub(super) n: u32,
    pub(super) choices: usize,
    /// The first prompt's tokens (protocols that announce the input size before any output).
    pub(super) prompt_tokens: u32,
    /// The client asked for logprobs.
    pub(super) logprobs: bool,
    /// How each choice's text is read: thinking split off, tool calls parsed out.
    pub(super) answer: AnswerShape,
    /// The request's span: it ends when the reply does (for a stream, when the stream does).
    pub(super) span: Span,
    pub(super) trace_text: bool,
    pub(super) arrived: Instant,
    pub(super) latencies: Latencies,
    pub(super) accounting: Accounting,
}

/// What a request holds while it runs: its tenant's concurrency slot and token charges, its
/// usage counters, and its fair-share turn under the global cap (given back once it started).
/// Without fair sharing, its place under the cap is an admission ticket that travels with the
/// first choice instead (see [`crate::dispatch::Choice::ticket`]).
pub(super) struct Accounting {
    pub(super) limits: LimitAdmission,
    pub(super) usage: ModelUsage,
    pub(super) turn: Option<Turn>,
}

/// Token delivery times, for the latency histograms.
#[derive(Default)]
pub(super) struct Timing {
    /// The client reads tokens as they arrive, so the gaps between them are inter-token latency.
    /// A whole answer's tokens come in batches (see `delta_interval_ms`): only its first counts,
    /// less the time the worker held it.
    pub(super) streamed: bool,
    /// A worker has accepted the request (its queue time is observed).
    pub(super) started: bool,
    /// When the latest text arrived.
    pub(super) last: Option<Instant>,
}

impl Reply {
    /// Account one event: tokens charged to the tenant as they stream, latencies observed.
    pub(super) fn observe(&mut self, event: &ChoiceEvent, timing: &mut Timing) {
        let now = Instant::now();
        match event {
            ChoiceEvent::Started { .. } => {
                // A worker has it now, and counts it: give back what held its place.
                self.accounting.turn = None;
                if !timing.started {
                    timing.started = true;
                    self.latencies.queue_time.observe((now - self.arrived).as_secs_f64());
                }
            }
            ChoiceEvent::Text { tokens, first_token_held, .. } => {
                self.accounting.limits.charge_completion(u64::from(*tokens));
                self.accounting.usage.completion(u64::from(*tokens));
                match timing.last {
                    None => {
                        let ttft = (now - self.arrived).saturating_sub(*first_token_held);
                        self.latencies.time_to_first_token.observe(ttft.as_secs_f64())
                    }
                    Some(last) if timing.streamed => {
                        self.latencies.inter_token_latency.observe((now - last).as_secs_f64())
                    }
                    Some(_) => {}
                }
                timing.last = Some(now);
            }
            ChoiceEvent::Done { usage, index, .. } => {
                if index % self.n == 0 {
                    self.accounting.usage.cached(u64::from(usage.cached_prompt_tokens));
                }
            }
            ChoiceEvent::Failed { .. } => {}
        }
    }

    /// Wait for a stream's first output, observing the acceptances before it: the HTTP status
    /// waits for it, so a request that fails before any output gets its error status, not a
    /// 200 with an error inside.
    pub(super) async fn first_output(
        &mut self,
        rx: &mut mpsc::Receiver<ChoiceEvent>,
        timing: &mut Timing,
    ) -> Result<ChoiceEvent, ApiError> {
        loop {
            match rx.recv().await {
                Some(ChoiceEvent::Failed { error, .. }) => return Err(error.into()),
                Some(event @ ChoiceEvent::Started { .. }) => self.observe(&event, timing),
                Some(event) => return Ok(event),
                None => return Err(ApiError::WorkerFailed("the request produced nothing".into())),
            }
        }
    }

    pub(super) fn finished(&self) {
        let took = self.arrived.elapsed();
        self.latencies.request_duration.observe(took.as_secs_f64());
        // One line per request, in its span: the span's fields (tenant, usage, trace_id) go with it.
        let _in_span = self.span.enter();
        tracing::info!(request_id = %self.id, model = %self.model, total_ms = took.as_millis() as u64, "request finished");
    }
}

impl Reply {
    /// The usage and finish reasons on the request's span.
    pub(super) fn record(&self, usage: &UsageOut, finish: &[&str], text: Option<&str>) {
        self.span.record("gen_ai.usage.input_tokens", usage.prompt_tokens);
        self.span.record("gen_ai.usage.output_tokens", usage.completion_tokens);
        self.span.record("gen_ai.usage.cached_input_tokens", usage.prompt_tokens_details.cached_tokens);
        self.span.record("gen_ai.response.finish_reasons", finish.join(","));
        if self.trace_text
            && let Some(text) = text
        {
            telemetry::set_attribute(&self.span, "bellows.completion", text.to_string());
        }
    }
}

impl Reply {
    /// Every choice's whole text, finish and logprobs, read as `Reply::answer` says (thinking
    /// apart, calls parsed out), and the usage summed over the choices. The first failed choice
    /// fails it.
    pub(super) async fn collect(
        &mut self,
        mut rx: mpsc::Receiver<ChoiceEvent>,
    ) -> Result<(Vec<ChoiceOut>, UsageOut), ApiError> {
        let logprobs = self.logprobs.then(Vec::new);
        let mut parsers: Vec<_> = (0..self.choices).map(|_| self.answer.parser()).collect();
        let mut gathered = vec![Gathered::default(); self.choices];
        let mut texts: Vec<ChoiceOut> = (0..self.choices)
            .map(|_| ChoiceOut {
                text: String::new(),
                reasoning: String::new(),
                finish: "stop",
                logprobs: logprobs.clone(),
                tool_calls: Vec::new(),
                stop_sequence: None,
            })
            .collect();
        let mut usage = UsageOut::default();
        let mut open = self.choices;
        let mut timing = Timing::default();
        while open > 0 {
            let event = rx.recv().await;
            if let Some(e) = &event {
                self.observe(e, &mut timing);
            }
            match event {
                Some(ChoiceEvent::Started { .. }) => {}
                Some(ChoiceEvent::Text { index, text, tokens, logprobs, .. }) => {
                    let i = index as usize;
                    gathered[i].add(parsers[i].push(text, tokens));
                    if let Some(l) = &mut texts[i].logprobs {
                        l.extend(logprobs);
                    }
                }
                Some(ChoiceEvent::Done { index, finish, stop_sequence, usage: u }) => {
                    let i = index as usize;
                    gathered[i].add(parsers[i].finish());
                    texts[i].finish = response::finish_reason(finish);
                    texts[i].stop_sequence = stop_sequence;
                    usage.add(&u, index % self.n == 0);
                    usage.add_reasoning(parsers[i].reasoning_tokens());
                    open -= 1;
                }
                Some(ChoiceEvent::Failed { error, .. }) => return Err(error.into()),
                None => return Err(ApiError::WorkerFailed("a choice ended without an answer".into())),
            }
        }
        for (c, g) in texts.iter_mut().zip(gathered) {
            (c.text, c.reasoning, c.tool_calls) = (g.content, g.reasoning, g.calls);
            c.finish = response::finish_with_calls(c.finish, !c.tool_calls.is_empty());
        }
        let finishes: Vec<&str> = texts.iter().map(|c| c.finish).collect();
        let all_text = texts.iter().map(|c| c.text.as_str()).collect::<Vec<_>>().join("\n");
        self.record(&usage, &finishes, Some(&all_text));
        self.finished();
        Ok((texts, usage))
    }
}
