//! Every way the node refuses or fails a call, and the one place each becomes a gRPC status.
//!
//! The router decides what to do from the code alone (retry elsewhere, back off, give up), so
//! each cause maps to exactly one code and the mapping lives nowhere else:
//! - INVALID_ARGUMENT: the request itself is wrong; retrying it anywhere fails the same way.
//! - RESOURCE_EXHAUSTED: this node's queue is full; metadata `retry-after` says when to retry.
//! - UNAVAILABLE: this node cannot serve now (loading, draining, shutting down); another can.
//! - INTERNAL: the model failed while running the request.

use tonic::{Code, Status, metadata::MetadataValue};

use crate::request::SubmitError;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The request could not be turned into an engine request (a malformed field).
    #[error("{0}")]
    Malformed(String),
    #[error("the model is still loading")]
    Loading,
    #[error("the worker is draining: it accepts no new requests")]
    Draining,
    #[error("the model failed: {0}")]
    ModelFailed(String),
}

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        let code = match &e {
            NodeError::Submit(s) => match s {
                SubmitError::EmptyPrompt
                | SubmitError::ContextExceeded { .. }
                | SubmitError::TokenOutOfVocabulary { .. }
                | SubmitError::ZeroMaxTokens
                | SubmitError::InvalidParameter { .. }
                | SubmitError::InvalidConstraint(_) => Code::InvalidArgument,
                SubmitError::QueueFull { .. } => Code::ResourceExhausted,
                SubmitError::ShuttingDown => Code::Unavailable,
            },
            NodeError::Malformed(_) => Code::InvalidArgument,
            NodeError::Loading | NodeError::Draining => Code::Unavailable,
            NodeError::ModelFailed(_) => Code::Internal,
        };
        let mut status = Status::new(code, e.to_string());
        if let NodeError::Submit(SubmitError::QueueFull { retry_after, .. }) = &e {
            // Whole seconds, as HTTP's Retry-After; milliseconds for a router that wants them.
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            let md = status.metadata_mut();
            md.insert("retry-after", MetadataValue::from(secs));
            md.insert("retry-after-ms", MetadataValue::from(retry_after.as_millis() as u64));
        }
        status
    }
}

/// A refusal or failure as a Session frame carries it: the same code, message and retry hint a
/// Generate call's status has.
pub fn session_error(status: &Status) -> bellows_proto::worker::v1::SessionError {
    let retry_after_ms =
        status.metadata().get("retry-after-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    bellows_proto::worker::v1::SessionError {
        code: status.code() as i32,
        message: status.message().to_string(),
        retry_after_ms,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_full_queue_says_when_to_come_back() {
        let s = Status::from(NodeError::Submit(SubmitError::QueueFull {
            cap: 4,
            retry_after: Duration::from_millis(1200),
        }));
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.metadata().get("retry-after").unwrap(), "2");
        assert_eq!(s.metadata().get("retry-after-ms").unwrap(), "1200");
    }

    #[test]
    fn a_session_refusal_carries_what_the_status_does() {
        let s = Status::from(NodeError::Submit(SubmitError::QueueFull {
            cap: 4,
            retry_after: Duration::from_millis(1200),
        }));
        let e = session_error(&s);
        assert_eq!(e.code, Code::ResourceExhausted as i32);
        assert_eq!(e.retry_after_ms, Some(1200));
        assert_eq!(e.message, s.message());
    }

    #[test]
    fn the_reason_of_an_invalid_request_reaches_the_caller() {
        let s = Status::from(NodeError::Submit(SubmitError::ZeroMaxTokens));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "max_tokens must be at least 1");
    }
}
