//! The router <-> worker gRPC contract, generated from `proto/bellows/worker/v1/worker.proto`.
//!
//! Its own crate so a router can depend on the contract without the worker's engine (candle,
//! tokenizers) and both sides always compile the same file.

/// Package `bellows.worker.v1`: the `Worker` service (client and server) and its messages.
pub mod worker {
    pub mod v1 {
        tonic::include_proto!("bellows.worker.v1");
    }
}

use bellows_common::priority::Priority;

impl From<Priority> for worker::v1::Priority {
    fn from(p: Priority) -> Self {
        match p {
            Priority::Interactive => Self::Interactive,
            Priority::Standard => Self::Standard,
            Priority::Batch => Self::Batch,
        }
    }
}

impl From<worker::v1::Priority> for Priority {
    fn from(p: worker::v1::Priority) -> Self {
        match p {
            worker::v1::Priority::Interactive => Priority::Interactive,
            worker::v1::Priority::Standard => Priority::Standard,
            worker::v1::Priority::Batch => Priority::Batch,
        }
    }
}

/// The newest router <-> worker protocol this build speaks, advertised in
/// `ModelInfoResponse.protocol_version`: 1 = Generate only; 2 = Session (one multiplexed stream
/// per router) as well.
pub const PROTOCOL_VERSION: u32 = 2;

/// The first protocol version with the Session RPC.
pub const SESSION_PROTOCOL: u32 = 2;
