//! Many tenants on one gateway: API keys, per-tenant limits, fair sharing under load, and usage
//! accounting (issue 7).
//!
//! The invariants, and what holds each:
//! - **No tenant sees another's data.** A tenant with `isolate_prefix_cache` gets a salt
//!   ([`Tenant::cache_salt`]) mixed into its prefix-cache block hashes, so its cached blocks can
//!   be neither hit nor timed by anyone else, and it hits no one else's. The salt follows from the
//!   tenant's name alone: the same on every router and after every reload or restart, so the
//!   tenant keeps its own cache hits. The router applies it; no client can choose it.
//! - **No tenant spends another's quota.** A key maps to exactly one tenant (the file refuses a
//!   hash listed twice), compared in constant time ([`auth`]), and every bucket, counter and
//!   concurrency slot is the tenant's own, kept by name ([`limits`]).
//! - **No tenant starves another's traffic.** Limits cap what each may take; at the cluster's cap,
//!   a per-tenant queue and deficit round robin by tokens hand out the capacity that frees in
//!   proportion to the tenants' weights, not in arrival order ([`fair_queue`]).
//!
//! With no tenants file auth is off: every caller is the [`Tenant::anonymous`] tenant, with no
//! limits and no isolation, which is what a local cluster wants.
//!
//! The request path, in order (the API maps each error to one status; put the rate-limit state
//! of [`Limits::quotas`] on every response of an authenticated tenant, errors included):
//! 1. [`Tenants::authenticate`] with the `Authorization` header: 401 ([`AuthError`]).
//! 2. [`Limits::admit`] with the model, the prompt's token count and the client's `max_tokens`:
//!    403 (model), 400 (`max_tokens`), 429 (concurrency, requests, tokens) ([`LimitError`]). Keep
//!    the [`Admission`] for the request's whole life; send [`Admission::max_tokens`] to the worker.
//! 3. When the cluster is at its cap: [`FairQueue::wait_turn`]: 503 ([`QueueRejection`]); on a
//!    refusal here or from the cluster, [`Admission::refund`]. Hold the [`Turn`] until the
//!    request is dispatched.
//! 4. As the stream reports tokens: [`Admission::charge_completion`] and
//!    [`ModelUsage::completion`].
//! 5. Count everything in [`Usage`]: admitted requests ([`ModelUsage::request`]) and refusals
//!    ([`Usage::refused`], by each error's `reason()`).

pub mod accounting;
pub mod auth;
mod bucket;
pub mod config;
pub mod fair_queue;
pub mod limits;
pub mod reload;

pub use accounting::{ModelUsage, Usage};
pub use auth::{AdminKey, AuthError, bearer_key};
pub use config::{ConfigError, Tenant, TenantsConfig};
pub use fair_queue::{FairQueue, FairQueueConfig, QueueRejection, Turn};
pub use limits::{Admission, LimitError, Limits, Quota, RateLimit};
pub use reload::{RELOAD_INTERVAL, Tenants};
