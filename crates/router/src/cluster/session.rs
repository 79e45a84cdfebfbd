//! The router's half of a worker's Session stream: every request this router sends the worker,
//! multiplexed on one long-lived bidirectional gRPC stream.
//!
//! A request is a route (its id → the channel its answers go to) plus an Open frame; dropping
//! the [`SessionCall`] before its last answer sends a Cancel frame. The link's task reads the
//! stream ([`SessionChannel::demux`]) and never waits on a request: each route's channel is
//! unbounded, so a client that reads slowly holds only its own answers here (at most its
//! `max_tokens` worth) and never stalls the others on the stream. When the stream ends, every
//! route is dropped, so each open call sees its worker fail and the dispatcher retries or
//! migrates it; the worker, for its part, cancels everything that was on the stream.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use bellows_proto::worker::v1::{self as pb, session_request, session_response};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;

use super::call::{Reply, WorkerError};

/// What the demultiplexer hands one request.
type Route = mpsc::UnboundedSender<session_response::Kind>;

#[derive(Debug)]
pub struct SessionChannel {
    frames: mpsc::UnboundedSender<pb::SessionRequest>,
    /// `None` once the channel is closed: a request opened after that fails at once rather
    /// than waiting for answers nobody will route.
    routes: Mutex<Option<HashMap<u64, Route>>>,
    next_id: AtomicU64,
    /// Answers received and not yet taken by their requests (all sessions of this router).
    buffered: Gauge,
}

impl SessionChannel {
    /// A channel over a stream whose outgoing frames are read from the other end of `frames`.
    pub fn new(frames: mpsc::UnboundedSender<pb::SessionRequest>, buffered: Gauge) -> Arc<Self> {
        let routes = Mutex::new(Some(HashMap::new()));
        Arc::new(SessionChannel { frames, routes, next_id: AtomicU64::new(1), buffered })
    }

    /// Send a request and wait for the worker to accept it (or refuse it).
    pub async fn open(
        self: &Arc<Self>,
        request: pb::GenerateRequest,
        trace_context: HashMap<String, String>,
    ) -> Result<SessionCall, WorkerError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, answers) = mpsc::unbounded_channel();
        match self.routes.lock().expect("session routes lock").as_mut() {
            Some(routes) => routes.insert(id, tx),
            None => return Err(WorkerError::Failed("the worker's session is closed".into())),
        };
        let open = pb::SessionOpen { request: Some(request), trace_context };
        let mut call = SessionCall { id, answers, channel: self.clone(), done: false };
        if self.frames.send(pb::SessionRequest { id, kind: Some(session_request::Kind::Open(open)) }).is_err() {
            return Err(WorkerError::Failed("the worker's session is closed".into()));
        }
        match call.answer().await {
            Some(session_response::Kind::Accepted(_)) => Ok(call),
            Some(session_response::Kind::Error(e)) => {
                call.done = true;
                Err(WorkerError::from_session(&e))
            }
            Some(_) => Err(WorkerError::Failed("the worker answered before accepting".into())),
            None => Err(WorkerError::Failed("the worker's session ended".into())),
        }
    }

    /// Requests on the channel that have not had their last answer.
    pub fn in_flight(&self) -> usize {
        self.routes.lock().expect("session routes lock").as_ref().map_or(0, HashMap::len)
    }

    /// Route every frame of the worker's stream to its request until the stream ends: `Ok` if
    /// the worker ended it (it is closing), an error if it broke. Never waits on a request. The
    /// caller holds a [`Closing`] guard for as long as it reads.
    pub async fn demux(&self, stream: &mut tonic::Streaming<pb::SessionResponse>) -> anyhow::Result<()> {
        loop {
            match stream.message().await {
                Ok(Some(frame)) => self.route(frame),
                Ok(None) => return Ok(()),
                Err(status) => anyhow::bail!("session stream failed: {}", status.message()),
            }
        }
    }

    /// A guard that closes the channel when dropped, however its reader stops (the stream
    /// ended, the load stream broke first, the link was closed): every open call then fails
    /// instead of waiting for answers nobody will route.
    pub fn closing(self: &Arc<Self>) -> Closing {
        Closing(self.clone())
    }

    fn route(&self, frame: pb::SessionResponse) {
        let Some(kind) = frame.kind else { return };
        let last = matches!(kind, session_response::Kind::Finished(_) | session_response::Kind::Error(_));
        // Sent under the lock (an unbounded send never waits): no sender clone per message. A
        // request that went away meanwhile has sent its Cancel: its frame is dropped.
        let mut routes = self.routes.lock().expect("session routes lock");
        let Some(routes) = routes.as_mut() else { return };
        let sent = if last {
            routes.remove(&frame.id).is_some_and(|route| route.send(kind).is_ok())
        } else {
            routes.get(&frame.id).is_some_and(|route| route.send(kind).is_ok())
        };
        if sent {
            self.buffered.inc();
        }
    }

    fn cancel(&self, id: u64) {
        if let Some(routes) = self.routes.lock().expect("session routes lock").as_mut() {
            routes.remove(&id);
        }
        let cancel = pb::SessionRequest { id, kind: Some(session_request::Kind::Cancel(pb::SessionCancel {})) };
        let _ = self.frames.send(cancel);
    }
}

pub struct Closing(Arc<SessionChannel>);

impl Drop for Closing {
    fn drop(&mut self) {
        *self.0.routes.lock().expect("session routes lock") = None;
    }
}

/// One request on a session; dropping it before its last answer cancels it on the worker.
pub struct SessionCall {
    id: u64,
    answers: mpsc::UnboundedReceiver<session_response::Kind>,
    channel: Arc<SessionChannel>,
    done: bool,
}

impl SessionCall {
    async fn answer(&mut self) -> Option<session_response::Kind> {
        let answer = self.answers.recv().await;
        if answer.is_some() {
            self.channel.buffered.dec();
        }
        answer
    }

    /// The next Delta or the Finished message; `Ok(None)` if the session ended first.
    pub async fn next(&mut self) -> Result<Option<Reply>, WorkerError> {
        if self.done {
            return Ok(None);
        }
        loop {
            return match self.answer().await {
                Some(session_response::Kind::Delta(d)) => Ok(Some(Reply::Delta(d))),
                Some(session_response::Kind::Finished(f)) => {
                    self.done = true;
                    Ok(Some(Reply::Finished(f)))
                }
                Some(session_response::Kind::Error(e)) => {
                    self.done = true;
                    Err(WorkerError::from_session(&e))
                }
                Some(session_response::Kind::Accepted(_)) => continue,
                None => Ok(None),
            };
        }
    }
}

impl Drop for SessionCall {
    fn drop(&mut self) {
        // Answers still queued were counted as buffered.
        self.answers.close();
        while self.answers.try_recv().is_ok() {
            self.channel.buffered.dec();
        }
        if !self.done {
            self.channel.cancel(self.id);
        }
    }
}
