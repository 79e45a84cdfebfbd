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
