//! What router and worker must agree on. Each idea here has exactly one implementation, imported
//! by both sides, so they cannot drift apart: the prefix-hash chain, the etcd key schema, and
//! the chat-template rendering.
pub mod chat_template;
pub mod cluster;
pub mod constraint;
pub mod duration;
pub mod prefix_hash;
pub mod priority;
pub mod sampling_limits;
pub mod telemetry;
pub mod tls;
