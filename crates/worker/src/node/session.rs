//! The Session RPC: every request one router sends this worker, on one long-lived stream.
//!
//! Each request is the same [`GenerateStream`] a Generate call returns, so cancellation keeps
//! its one place: dropping that stream. The session owns its requests' streams: a Cancel frame
//! drops one, and the session ending (the router closed its side, died, or the connection broke;
//! tonic then drops this stream) drops them all, which frees their KV blocks on the scheduler's
//! next tick. A router that dies therefore frees its work here at once, not at `max_tokens`.
//!
//! One request never holds up another: request streams are polled only when woken (a
//! [`SelectAll`]), a request that is still being opened (a grammar compiling) does not stop the
//! session from reading frames or sending others' tokens, and the router reads the session
//! without pause (it buffers per request), so HTTP/2 flow control on the one stream never waits
//! on one slow client.

use std::{
    collections::{HashMap, HashSet},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bellows_common::telemetry;
use bellows_proto::worker::v1::{self as pb, generate_response, session_request, session_response};
use futures_util::{
    FutureExt, StreamExt,
    future::BoxFuture,
    stream::{AbortHandle, BoxStream, FuturesUnordered, SelectAll, abortable},
};
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use super::{
    grpc::{GenerateStream, WorkerService, request_span},
    metrics::OpenSession,
    status::session_error,
};

type Opening = BoxFuture<'static, (u64, Result<GenerateStream, Status>)>;
type Answers = BoxStream<'static, (u64, Result<pb::GenerateResponse, Status>)>;

/// A Session call's response stream (see the module docs).
pub struct SessionStream {
    service: WorkerService,
    inbound: Streaming<pb::SessionRequest>,
    /// Requests being admitted and submitted.
    opening: FuturesUnordered<Opening>,
    /// Accepted requests' answers, tagged with their ids.
    running: SelectAll<Answers>,
    /// Every live id: opening (`None`), or accepted with the handle that drops its stream from
    /// `running` (a Cancel frame).
    live: HashMap<u64, Option<AbortHandle>>,
    /// Ids cancelled while still opening: dropped as soon as they open.
    cancelled: HashSet<u64>,
    /// Resolves when the node closes: the session ends so the server can stop.
    closed: BoxFuture<'static, ()>,
    refused: Arc<dyn Fn(tonic::Code) + Send + Sync>,
    /// Kept for as long as the stream lives (a count of open sessions).
    held: Option<OpenSession>,
}

impl SessionStream {
    pub(super) fn new(
        service: WorkerService,
        inbound: Streaming<pb::SessionRequest>,
        closed: BoxFuture<'static, ()>,
        refused: Arc<dyn Fn(tonic::Code) + Send + Sync>,
    ) -> Self {
        SessionStream {
            service,
            inbound,
            opening: FuturesUnordered::new(),
            running: SelectAll::new(),
            live: HashMap::new(),
            cancelled: HashSet::new(),
            closed,
            refused,
            held: None,
        }
    }

    /// Keep `held` until the session ends.
    pub fn held_with(mut self, held: OpenSession) -> Self {
        self.held = Some(held);
        self
    }

    /// Act on one frame from the router; an answer to send at once, if any.
    fn take_frame(&mut self, frame: pb::SessionRequest) -> Option<pb::SessionResponse> {
        let id = frame.id;
        match frame.kind {
            Some(session_request::Kind::Open(open)) => {
                let Some(request) = open.request else {
                    return Some(self.refuse(id, Status::invalid_argument("an open frame without a request")));
                };
                if self.live.contains_key(&id) {
                    return Some(self.refuse(id, Status::invalid_argument(format!("request id {id} is in use"))));
                }
                self.live.insert(id, None);
                let span = request_span(self.service.node_id(), &request, "Session");
                telemetry::continue_trace_from_map(&span, &open.trace_context);
                let service = self.service.clone();
                self.opening.push(async move { (id, service.open(request, span).await) }.boxed());
                None
            }
            Some(session_request::Kind::Cancel(_)) => {
                match self.live.remove(&id) {
                    Some(Some(handle)) => handle.abort(),
                    Some(None) => {
                        self.cancelled.insert(id);
                    }
                    None => {} // already over
                }
                None
            }
            None => None,
        }
    }

    /// A request that opened (or failed to).
    fn opened(&mut self, id: u64, opened: Result<GenerateStream, Status>) -> Option<pb::SessionResponse> {
        if self.cancelled.remove(&id) {
            return None; // dropping the stream cancels it
        }
        match opened {
            Err(status) => {
                self.live.remove(&id);
                Some(self.refuse(id, status))
            }
            Ok(stream) => {
                let (stream, handle) = abortable(stream);
                self.live.insert(id, Some(handle));
                self.running.push(stream.map(move |answer| (id, answer)).boxed());
                Some(answer(id, session_response::Kind::Accepted(pb::SessionAccepted {})))
            }
        }
    }

    fn refuse(&self, id: u64, status: Status) -> pb::SessionResponse {
        (self.refused)(status.code());
        answer(id, session_response::Kind::Error(session_error(&status)))
    }

    /// One of a request's answers as a frame; its last one forgets the request.
    fn relay(&mut self, id: u64, message: Result<pb::GenerateResponse, Status>) -> Option<pb::SessionResponse> {
        let kind = match message {
            Ok(pb::GenerateResponse { kind: Some(generate_response::Kind::Delta(d)) }) => {
                session_response::Kind::Delta(d)
            }
            Ok(pb::GenerateResponse { kind: Some(generate_response::Kind::Finished(f)) }) => {
                self.live.remove(&id);
                session_response::Kind::Finished(f)
            }
            Ok(pb::GenerateResponse { kind: None }) => return None,
            Err(status) => {
                self.live.remove(&id);
                session_response::Kind::Error(session_error(&status))
            }
        };
        Some(answer(id, kind))
    }
}

fn answer(id: u64, kind: session_response::Kind) -> pb::SessionResponse {
    pb::SessionResponse { id, kind: Some(kind) }
}

impl Stream for SessionStream {
    type Item = Result<pb::SessionResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.closed.poll_unpin(cx).is_ready() {
            return Poll::Ready(None);
        }
        // Frames first: a cancel frees KV as early as possible.
        loop {
            match this.inbound.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(out) = this.take_frame(frame) {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                // The router is gone: ending the session drops (cancels) everything on it.
                Poll::Ready(Some(Err(_)) | None) => return Poll::Ready(None),
                Poll::Pending => break,
            }
        }
        while let Poll::Ready(Some((id, opened))) = this.opening.poll_next_unpin(cx) {
            if let Some(out) = this.opened(id, opened) {
                return Poll::Ready(Some(Ok(out)));
            }
        }
        while let Poll::Ready(Some((id, message))) = this.running.poll_next_unpin(cx) {
            if let Some(out) = this.relay(id, message) {
                return Poll::Ready(Some(Ok(out)));
            }
        }
        Poll::Pending
    }
}
