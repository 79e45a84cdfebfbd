//! One request on one worker, whichever way the worker speaks: a Session stream shared with
//! every other request to it (protocol 2), or a Generate call of its own (protocol 1).
//!
//! Both give the dispatcher the same thing: the call opens once the worker accepted the
//! request, then yields Deltas and one Finished; any refusal or failure is a [`WorkerError`],
//! decided here from the worker's status code alone. Dropping a call cancels the request.

use std::time::Duration;

use bellows_proto::worker::v1::{self as pb, generate_response};
use tonic::Code;

use super::session::SessionCall;

/// How a worker refused or failed a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkerError {
    /// The request itself is at fault (a worker refuses it anywhere): the client is told.
    #[error("{0}")]
    Rejected(String),
    /// The worker's queue is full.
    #[error("the worker's queue is full")]
    Busy { retry_after: Duration },
    /// The worker did not accept the request in time.
    #[error("the worker did not answer in time")]
    Timeout,
    /// The worker is unreachable, went away, or failed.
    #[error("{0}")]
    Failed(String),
}

impl WorkerError {
    /// What a worker's status code means for the request (see the proto's Generate).
    pub fn from_code(code: Code, message: &str, retry_after_ms: Option<u64>) -> Self {
        match code {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                WorkerError::Rejected(message.to_string())
            }
            Code::ResourceExhausted => {
                WorkerError::Busy { retry_after: retry_after_ms.map_or(Duration::from_secs(1), Duration::from_millis) }
            }
            Code::DeadlineExceeded => WorkerError::Timeout,
            _ => WorkerError::Failed(format!("{code:?}: {message}")),
        }
    }

    pub fn from_status(status: &tonic::Status) -> Self {
        let retry_after_ms =
            status.metadata().get("retry-after-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        Self::from_code(status.code(), status.message(), retry_after_ms)
    }

    pub fn from_session(e: &pb::SessionError) -> Self {
        Self::from_code(Code::from(e.code), &e.message, e.retry_after_ms)
    }
}

/// A worker's answer to an accepted request.
#[derive(Debug)]
pub enum Reply {
    Delta(pb::Delta),
    Finished(pb::Finished),
}

/// An accepted request on a worker.
pub enum WorkerCall {
    Session(SessionCall),
    Generate(tonic::Streaming<pb::GenerateResponse>),
}

impl WorkerCall {
    /// The next Delta or the Finished message; `Ok(None)` if the worker's stream ended first.
    pub async fn next(&mut self) -> Result<Option<Reply>, WorkerError> {
        match self {
            WorkerCall::Session(call) => call.next().await,
            WorkerCall::Generate(stream) => loop {
                let message = stream.message().await.map_err(|s| WorkerError::from_status(&s))?;
                return Ok(match message {
                    None => None,
                    Some(pb::GenerateResponse { kind: Some(generate_response::Kind::Delta(d)) }) => {
                        Some(Reply::Delta(d))
                    }
                    Some(pb::GenerateResponse { kind: Some(generate_response::Kind::Finished(f)) }) => {
                        Some(Reply::Finished(f))
                    }
                    Some(pb::GenerateResponse { kind: None }) => continue,
                });
            },
        }
    }
}
