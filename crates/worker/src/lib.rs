//! A Bellows worker: a real (or simulated) model, a paged KV cache with prefix reuse, and a
//! chunked-prefill continuous batcher, driven through [`engine::EngineHandle`].

pub mod bench;
pub mod constraint;
pub mod engine;
pub mod kv_cache;
pub mod load;
pub mod model;
pub mod node;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod stats;
pub mod stop;
pub mod synth;
pub mod tokenizer;
pub mod vocab;
