//! Per-tenant limits: allowed models, the `max_tokens` cap, concurrent requests, and token
//! buckets for requests and tokens per minute.
//!
//! Each bucket holds one minute of its limit and refills continuously (600 requests/minute:
//! 600 at once, then one every 100 ms). Prompt tokens are taken when a request is admitted,
//! completion tokens as the stream reports them ([`Admission::charge_completion`]), so the
//! tenant's budget is seen spent within one report interval, not at the end of a long stream.
//! A running stream is never cut: when its tokens overdraw the bucket, the level goes negative
//! (a debt) and the tenant's next requests are refused (rate limited, retry after the time the
//! refill takes to pay the debt back) until it is repaid. So over any window the tenant gets at
//! most its limit plus what its streams already running produced past it (at most
//! `max_concurrent` × `max_tokens`). A request larger than the whole bucket is let through only when the bucket
//! is full, and leaves it in debt: it costs a full minute (or more) of budget, but a tenant is
//! never locked out by one big prompt.
//!
//! Several routers share no state: [`Limits::set_share`] gives each its share (1 / the number of
//! live routers) of every tenant's rates, and of its concurrency cap (rounded up, so a cap of 1
//! stays usable). With requests spread evenly by the load balancer, each router's buckets empty
//! in step, and the sum over routers is the tenant's limit; the error is the imbalance of that
//! spread (a tenant whose requests all land on one router gets only that router's share), plus,
//! for each router that starts, one full bucket of its share (a new router starts with full
//! buckets). A change of share keeps what each bucket has spent, scaled, so routers joining or
//! leaving hand out no fresh budget. [`Limits::quotas`] scales the local bucket back up by the
//! share: the tenant's whole limit, as if one bucket held it.
//!
//! The buckets themselves are in `bucket`; how a refusal or a quota reaches a client
//! (status, body, headers) is the API's business, not this module's.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bellows_common::priority::Priority;

use super::{
    bucket::{Bucket, SUSPENDED_RETRY_AFTER},
    config::Tenant,
};

/// The wait reported for a concurrency refusal: a slot frees when some request ends, which the
/// router cannot foresee.
const CONCURRENCY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Which limit: the one that refused a request, or the one a [`Quota`] is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateLimit {
    Requests,
    Tokens,
    Concurrency,
}

impl RateLimit {
    pub fn as_str(self) -> &'static str {
        match self {
            RateLimit::Requests => "requests",
            RateLimit::Tokens => "tokens",
            RateLimit::Concurrency => "concurrency",
        }
    }
}

/// Why a tenant's request is refused by its own limits (the API maps each to one status).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// The tenant may not use this model.
    #[error("model {model:?} not allowed for this tenant")]
    ModelNotAllowed { model: String },
    /// `max_tokens` over the tenant's cap.
    #[error("max_tokens {requested} over the tenant's cap of {allowed}")]
    MaxTokens { requested: u64, allowed: u64 },
    /// The request named a priority class the tenant may not use.
    #[error("priority class {class} not allowed for this tenant")]
    PriorityNotAllowed { class: Priority },
    /// Over a rate or the concurrency cap; may retry after `retry_after`.
    #[error("{} limit reached", limit.as_str())]
    RateLimited { limit: RateLimit, configured: u64, retry_after: Duration },
}

impl LimitError {
    /// A bounded label for metrics and accounting.
    pub fn reason(&self) -> &'static str {
        match self {
            LimitError::ModelNotAllowed { .. } => "model_not_allowed",
            LimitError::MaxTokens { .. } => "max_tokens",
            LimitError::PriorityNotAllowed { .. } => "priority_not_allowed",
            LimitError::RateLimited { limit, .. } => limit.as_str(),
        }
    }

    /// How long to wait before trying again; `None` when waiting will not help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LimitError::RateLimited { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}

/// One per-minute limit of a tenant as it stands now, for the client to see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// [`RateLimit::Requests`] or [`RateLimit::Tokens`].
    pub limit: RateLimit,
    /// Per minute, for all routers together (the file's number).
    pub configured: u64,
    /// What is left of it now, scaled to all routers; 0 while in debt.
    pub remaining: u64,
    /// How long until the bucket is full again.
    pub reset: Duration,
}

#[derive(Debug, Clone, Default)]
struct Buckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Buckets {
    /// Follow the tenant's current limits and this router's share.
    fn sync(&mut self, tenant: &Tenant, share: f64, now: Instant) {
        let follow = |bucket: &mut Option<Bucket>, limit: Option<u64>| match (bucket.as_mut(), limit) {
            (Some(b), Some(limit)) => b.reconfigure(limit, share, now),
            (None, Some(limit)) => *bucket = Some(Bucket::new(limit, share, now)),
            (_, None) => *bucket = None,
        };
        follow(&mut self.requests, tenant.requests_per_minute);
        follow(&mut self.tokens, tenant.tokens_per_minute);
        if let Some(b) = self.requests.as_mut() {
            b.advance(now);
        }
        if let Some(b) = self.tokens.as_mut() {
            b.advance(now);
        }
    }
}

/// One tenant's state on this router. Kept by name, so it outlives a reload that keeps the
/// tenant (and any `Arc<Tenant>` of the old file).
#[derive(Debug, Default)]
struct TenantState {
    in_flight: AtomicU64,
    buckets: Mutex<Buckets>,
}

/// Every tenant's limits on this router.
#[derive(Debug)]
pub struct Limits {
    /// This router's share of every limit, as f64 bits.
    share: AtomicU64,
    states: RwLock<HashMap<String, Arc<TenantState>>>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { share: AtomicU64::new(1.0f64.to_bits()), states: RwLock::default() }
    }
}

impl Limits {
    pub fn new() -> Self {
        Self::default()
    }

    /// This router's share of every tenant's limits: 1 / the number of live routers, in (0, 1]
    /// (anything else counts as 1: a router that cannot count its peers enforces whole limits).
    /// Cheap (one store): each bucket rescales, keeping what was spent, the next time its tenant
    /// is seen.
    pub fn set_share(&self, share: f64) {
        let share = if share > 0.0 && share <= 1.0 { share.max(1e-6) } else { 1.0 };
        self.share.store(share.to_bits(), Ordering::Relaxed);
    }

    pub fn share(&self) -> f64 {
        f64::from_bits(self.share.load(Ordering::Relaxed))
    }

    /// Drop the state of tenants that no longer exist (after a reload). Admissions still
    /// running for them keep theirs until they end.
    pub fn retain(&self, exists: impl Fn(&str) -> bool) {
        self.states.write().expect("limits lock").retain(|name, _| exists(name));
    }

    fn state(&self, name: &str) -> Arc<TenantState> {
        if let Some(s) = self.states.read().expect("limits lock").get(name) {
            return s.clone();
        }
        self.states.write().expect("limits lock").entry(name.to_string()).or_default().clone()
    }

    /// Admit a request of `tenant` for `model`, with `prompt_tokens` already counted and the
    /// `max_tokens` the client asked for (`None`: it did not say). Checks, in order: the model,
    /// `max_tokens`, concurrency, requests per minute, then tokens per minute, and takes one
    /// request and the prompt tokens from the buckets.
    pub fn admit(
        &self,
        tenant: &Tenant,
        model: &str,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
    ) -> Result<Admission, LimitError> {
        self.admit_at(tenant, model, prompt_tokens, max_tokens, Instant::now())
    }

    fn admit_at(
        &self,
        tenant: &Tenant,
        model: &str,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        now: Instant,
    ) -> Result<Admission, LimitError> {
        if !tenant.allows_model(model) {
            return Err(LimitError::ModelNotAllowed { model: model.to_string() });
        }
        let max_tokens = match (max_tokens, tenant.max_tokens) {
            (Some(requested), Some(allowed)) if requested > allowed => {
                return Err(LimitError::MaxTokens { requested, allowed });
            }
            (Some(requested), _) => Some(requested),
            (None, allowed) => allowed,
        };
        if tenant.requests_per_minute.is_none() && tenant.tokens_per_minute.is_none() && tenant.max_concurrent.is_none()
        {
            return Ok(Admission { state: None, max_tokens, prompt_tokens });
        }
        let share = self.share();
        let state = self.state(&tenant.name);
        let previous = state.in_flight.fetch_add(1, Ordering::AcqRel);
        // From here on, dropping `admission` gives the slot back.
        let admission = Admission { state: Some(state.clone()), max_tokens, prompt_tokens };
        if let Some(max) = tenant.max_concurrent {
            // This router's share, rounded up: a limit of 1 over three routers stays usable.
            let cap = if max == 0 { 0 } else { ((max as f64 * share).ceil() as u64).max(1) };
            if previous >= cap {
                let retry_after = if max == 0 { SUSPENDED_RETRY_AFTER } else { CONCURRENCY_RETRY_AFTER };
                return Err(LimitError::RateLimited { limit: RateLimit::Concurrency, configured: max, retry_after });
            }
        }
        let mut buckets = state.buckets.lock().expect("buckets lock");
        buckets.sync(tenant, share, now);
        let requests_wait = buckets.requests.as_ref().and_then(|b| b.wait(1));
        let tokens_wait = buckets.tokens.as_ref().and_then(|b| b.wait(prompt_tokens));
        if requests_wait.is_some() || tokens_wait.is_some() {
            let (limit, configured) = match requests_wait {
                Some(_) => (RateLimit::Requests, tenant.requests_per_minute),
                None => (RateLimit::Tokens, tenant.tokens_per_minute),
            };
            let retry_after = requests_wait.max(tokens_wait).unwrap_or_default();
            return Err(LimitError::RateLimited { limit, configured: configured.unwrap_or(0), retry_after });
        }
        if let Some(b) = buckets.requests.as_mut() {
            b.take(1);
        }
        if let Some(b) = buckets.tokens.as_mut() {
            b.take(prompt_tokens);
        }
        drop(buckets);
        Ok(admission)
    }

    /// Each per-minute limit `tenant` has (requests, then tokens), as it stands now. Reading
    /// takes nothing, so every response may carry it (errors too).
    pub fn quotas(&self, tenant: &Tenant) -> Vec<Quota> {
        self.quotas_at(tenant, Instant::now())
    }

    fn quotas_at(&self, tenant: &Tenant, now: Instant) -> Vec<Quota> {
        if tenant.requests_per_minute.is_none() && tenant.tokens_per_minute.is_none() {
            return Vec::new();
        }
        // A copy, brought up to now: reading must not change the state (admit and charge do).
        let state = self.states.read().expect("limits lock").get(&tenant.name).cloned();
        let mut buckets = state.map(|s| s.buckets.lock().expect("buckets lock").clone()).unwrap_or_default();
        buckets.sync(tenant, self.share(), now);
        [(RateLimit::Requests, &buckets.requests), (RateLimit::Tokens, &buckets.tokens)]
            .into_iter()
            .filter_map(|(limit, bucket)| {
                let b = bucket.as_ref()?;
                Some(Quota { limit, configured: b.limit, remaining: b.remaining_overall(), reset: b.until_full() })
            })
            .collect()
    }
}

/// An admitted request. Holds its tenant's concurrency slot until dropped: keep it for the
/// whole life of the request, stream included.
#[derive(Debug)]
pub struct Admission {
    state: Option<Arc<TenantState>>,
    max_tokens: Option<u64>,
    prompt_tokens: u64,
}

impl Admission {
    /// The `max_tokens` to send to the worker: the client's, or the tenant's cap when the
    /// client gave none (`None`: neither did).
    pub fn max_tokens(&self) -> Option<u64> {
        self.max_tokens
    }

    /// Charge completion tokens produced since the last call, as the stream reports them. Never
    /// refuses: past the budget the tenant owes the difference (see the module docs).
    pub fn charge_completion(&self, tokens: u64) {
        self.charge_completion_at(tokens, Instant::now());
    }

    fn charge_completion_at(&self, tokens: u64, now: Instant) {
        if let Some(state) = &self.state
            && let Some(b) = state.buckets.lock().expect("buckets lock").tokens.as_mut()
        {
            b.advance(now);
            b.take(tokens);
        }
    }

    /// The request never reached a worker (the fair queue or the cluster refused it): give its
    /// request and prompt tokens back. The slot is given back as for any drop.
    pub fn refund(self) {
        if let Some(state) = &self.state {
            let mut buckets = state.buckets.lock().expect("buckets lock");
            if let Some(b) = buckets.requests.as_mut() {
                b.give_back(1);
            }
            if let Some(b) = buckets.tokens.as_mut() {
                b.give_back(self.prompt_tokens);
            }
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(state) = &self.state {
            state.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(f: impl FnOnce(&mut Tenant)) -> Tenant {
        let mut t = (*Tenant::anonymous()).clone();
        t.name = "t".into();
        f(&mut t);
        t
    }

    /// What is left of `limit` for `t` at `now`, as the quotas report it.
    fn remaining(limits: &Limits, t: &Tenant, limit: RateLimit, now: Instant) -> Option<u64> {
        limits.quotas_at(t, now).iter().find(|q| q.limit == limit).map(|q| q.remaining)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn requests_per_minute_hold_to_the_request_and_refill_continuously() {
        let limits = Limits::new();
        let t = tenant(|t| t.requests_per_minute = Some(600));
        let t0 = Instant::now();
        let mut held = Vec::new();
        for i in 0..600 {
            held.push(limits.admit_at(&t, "m", 0, None, t0).unwrap_or_else(|e| panic!("request {i}: {e}")));
        }
        let e = limits.admit_at(&t, "m", 0, None, t0).unwrap_err();
        assert_eq!(e, LimitError::RateLimited { limit: RateLimit::Requests, configured: 600, retry_after: ms(100) });
        // One request every 100 ms, exactly.
        assert!(limits.admit_at(&t, "m", 0, None, t0 + ms(99)).is_err());
        assert!(limits.admit_at(&t, "m", 0, None, t0 + ms(100)).is_ok());
        assert!(limits.admit_at(&t, "m", 0, None, t0 + ms(100)).is_err());
        let ok = (0..100).filter(|_| limits.admit_at(&t, "m", 0, None, t0 + ms(1100)).is_ok()).count();
        assert_eq!(ok, 10);
    }

    #[test]
    fn prompt_tokens_are_charged_at_admission_and_refused_past_the_budget() {
        let limits = Limits::new();
        let t = tenant(|t| t.tokens_per_minute = Some(1000));
        let t0 = Instant::now();
        let _a = limits.admit_at(&t, "m", 700, None, t0).unwrap();
        let e = limits.admit_at(&t, "m", 301, None, t0).unwrap_err();
        // 1 token missing at 1000/minute: 60 ms.
        assert_eq!(e, LimitError::RateLimited { limit: RateLimit::Tokens, configured: 1000, retry_after: ms(60) });
        let _b = limits.admit_at(&t, "m", 300, None, t0).unwrap();
        assert!(limits.admit_at(&t, "m", 1, None, t0).is_err());
    }

    #[test]
    fn completion_tokens_are_charged_as_they_stream_and_an_overdraft_is_a_debt_not_a_cut() {
        let limits = Limits::new();
        let t = tenant(|t| t.tokens_per_minute = Some(600));
        let t0 = Instant::now();
        let a = limits.admit_at(&t, "m", 100, None, t0).unwrap();
        // A long stream reports 100 tokens at a time; each report is seen at once.
        for i in 1..=5 {
            a.charge_completion_at(100, t0);
            let left = 500 - 100 * i;
            assert_eq!(remaining(&limits, &t, RateLimit::Tokens, t0), Some(left));
        }
        // The budget is spent: a new request is refused while the stream goes on past it.
        assert!(limits.admit_at(&t, "m", 1, None, t0).is_err());
        a.charge_completion_at(300, t0); // 300 over: a debt
        assert_eq!(remaining(&limits, &t, RateLimit::Tokens, t0), Some(0));
        // The debt (300) plus the next prompt (10) must refill first: 310 tokens at 10/s = 31 s.
        let e = limits.admit_at(&t, "m", 10, None, t0).unwrap_err();
        assert_eq!(e.retry_after(), Some(Duration::from_secs(31)));
        assert!(limits.admit_at(&t, "m", 10, None, t0 + Duration::from_secs(31)).is_ok());
    }

    #[test]
    fn a_prompt_larger_than_the_bucket_passes_only_on_a_full_bucket_and_leaves_a_debt() {
        let limits = Limits::new();
        let t = tenant(|t| t.tokens_per_minute = Some(100));
        let t0 = Instant::now();
        assert!(limits.admit_at(&t, "m", 250, None, t0).is_ok());
        // 150 of debt plus a full bucket (needed again for another oversized prompt): 2.5 minutes.
        let e = limits.admit_at(&t, "m", 250, None, t0).unwrap_err();
        assert_eq!(e.retry_after(), Some(Duration::from_secs(150)));
    }

    #[test]
    fn the_concurrency_cap_holds_and_a_dropped_admission_frees_its_slot() {
        let limits = Limits::new();
        let t = tenant(|t| t.max_concurrent = Some(2));
        let a = limits.try_admit("x", &t, 0);
        let b = limits.try_admit("x", &t, 0);
        let e = limits.try_admit("x", &t, 0).unwrap_err();
        assert_eq!(e.retry_after(), Some(CONCURRENCY_RETRY_AFTER));
        assert_eq!(e.reason(), "concurrency");
        drop(a);
        let _c = limits.try_admit("x", &t, 0).unwrap();
        drop(b);
    }

    impl Limits {
        /// Shorthand for the tests: admit with a prompt, no max_tokens, now.
        fn try_admit(&self, model: &str, t: &Tenant, prompt: u64) -> Result<Admission, LimitError> {
            self.admit_at(t, model, prompt, None, Instant::now())
        }
    }

    #[test]
    fn a_refused_request_spends_nothing() {
        let limits = Limits::new();
        let t = tenant(|t| {
            t.requests_per_minute = Some(2);
            t.tokens_per_minute = Some(100);
            t.max_concurrent = Some(5);
        });
        let t0 = Instant::now();
        // Refused for tokens: the request it would have used is still there, and so is the slot.
        assert!(limits.admit_at(&t, "m", 101, None, t0).is_ok(), "full bucket admits one oversized prompt");
        let e = limits.admit_at(&t, "m", 1, None, t0).unwrap_err();
        assert_eq!(e.reason(), "tokens");
        assert_eq!(remaining(&limits, &t, RateLimit::Requests, t0), Some(1));
        assert_eq!(limits.states.read().unwrap()["t"].in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_refund_gives_back_the_request_and_its_prompt() {
        let limits = Limits::new();
        let t = tenant(|t| {
            t.requests_per_minute = Some(1);
            t.tokens_per_minute = Some(100);
        });
        let t0 = Instant::now();
        limits.admit_at(&t, "m", 80, None, t0).unwrap().refund();
        assert_eq!(remaining(&limits, &t, RateLimit::Requests, t0), Some(1));
        assert_eq!(remaining(&limits, &t, RateLimit::Tokens, t0), Some(100));
        assert!(limits.admit_at(&t, "m", 80, None, t0).is_ok());
    }

    #[test]
    fn a_model_outside_the_tenants_list_is_forbidden_before_any_limit() {
        let limits = Limits::new();
        let t = tenant(|t| {
            t.models = Some(vec!["a".into()]);
            t.requests_per_minute = Some(0);
        });
        assert_eq!(limits.try_admit("b", &t, 0).unwrap_err(), LimitError::ModelNotAllowed { model: "b".into() });
        let e = limits.try_admit("a", &t, 0).unwrap_err();
        assert!(matches!(e, LimitError::RateLimited { limit: RateLimit::Requests, .. }), "{e:?}");
    }

    #[test]
    fn max_tokens_over_the_cap_is_refused_with_both_numbers_and_absent_max_tokens_gets_the_cap() {
        let limits = Limits::new();
        let t = tenant(|t| t.max_tokens = Some(256));
        let e = limits.admit_at(&t, "m", 0, Some(257), Instant::now()).unwrap_err();
        assert_eq!(e, LimitError::MaxTokens { requested: 257, allowed: 256 });
        assert_eq!(limits.admit_at(&t, "m", 0, Some(256), Instant::now()).unwrap().max_tokens(), Some(256));
        assert_eq!(limits.admit_at(&t, "m", 0, Some(3), Instant::now()).unwrap().max_tokens(), Some(3));
        assert_eq!(limits.admit_at(&t, "m", 0, None, Instant::now()).unwrap().max_tokens(), Some(256));
        let open = tenant(|_| {});
        assert_eq!(limits.admit_at(&open, "m", 0, None, Instant::now()).unwrap().max_tokens(), None);
    }

    #[test]
    fn a_zero_limit_suspends_the_tenant() {
        let limits = Limits::new();
        for t in [
            tenant(|t| t.requests_per_minute = Some(0)),
            tenant(|t| t.tokens_per_minute = Some(0)),
            tenant(|t| t.max_concurrent = Some(0)),
        ] {
            let e = limits.try_admit("m", &t, 0).unwrap_err();
            assert_eq!(e.retry_after(), Some(SUSPENDED_RETRY_AFTER), "{t:?}");
        }
    }

    #[test]
    fn quotas_give_the_limit_what_is_left_and_the_time_to_full_and_reading_spends_nothing() {
        let limits = Limits::new();
        let t = tenant(|t| {
            t.requests_per_minute = Some(60);
            t.tokens_per_minute = Some(6000);
        });
        let t0 = Instant::now();
        let quota = |limit, configured, remaining, reset| Quota { limit, configured, remaining, reset };
        let full = vec![
            quota(RateLimit::Requests, 60, 60, Duration::ZERO),
            quota(RateLimit::Tokens, 6000, 6000, Duration::ZERO),
        ];
        assert_eq!(limits.quotas_at(&t, t0), full);
        let _a = limits.admit_at(&t, "m", 600, None, t0).unwrap();
        let spent = vec![
            quota(RateLimit::Requests, 60, 59, Duration::from_secs(1)),
            quota(RateLimit::Tokens, 6000, 5400, Duration::from_secs(6)),
        ];
        assert_eq!(limits.quotas_at(&t, t0), spent);
        assert_eq!(limits.quotas_at(&t, t0), spent, "reading spent nothing");
        // No limits, no quotas.
        assert!(limits.quotas(&Tenant::anonymous()).is_empty());
    }

    #[test]
    fn a_share_scales_every_limit_and_the_quotas_scale_back() {
        let limits = Limits::new();
        limits.set_share(0.25);
        let t = tenant(|t| {
            t.requests_per_minute = Some(100);
            t.max_concurrent = Some(6);
        });
        let t0 = Instant::now();
        let admitted: Vec<_> = (0..100).filter_map(|_| limits.admit_at(&t, "m", 0, None, t0).ok()).collect();
        // 25 requests of the minute's 100, but only ceil(6/4) = 2 at once.
        assert_eq!(admitted.len(), 2);
        drop(admitted);
        let ok = (0..100).filter(|_| limits.admit_at(&t, "m", 0, None, t0).is_ok()).count();
        assert_eq!(ok, 23);
        let q = limits.quotas_at(&t, t0);
        assert_eq!((q[0].limit, q[0].configured, q[0].remaining), (RateLimit::Requests, 100, 0));
        // 25 per minute here: one every 2.4 s, so 4 of the whole limit's.
        assert_eq!(remaining(&limits, &t, RateLimit::Requests, t0 + ms(2400)), Some(4));
    }

    #[test]
    fn a_share_out_of_range_counts_as_one() {
        let limits = Limits::new();
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 2.0] {
            limits.set_share(0.5);
            limits.set_share(bad);
            assert_eq!(limits.share(), 1.0, "{bad}");
        }
    }

    #[test]
    fn a_change_of_share_keeps_what_was_spent() {
        let limits = Limits::new();
        let t = tenant(|t| t.requests_per_minute = Some(120));
        let t0 = Instant::now();
        let ok = (0..200).filter(|_| limits.admit_at(&t, "m", 0, None, t0).is_ok()).count();
        assert_eq!(ok, 120);
        // A second router joined: half the limit here, and the bucket is still empty, not refilled.
        limits.set_share(0.5);
        assert!(limits.admit_at(&t, "m", 0, None, t0).is_err());
        // Back to one router after 30 s: 30 s at 60/min refilled 30 of this router's 60, that is
        // half its bucket; scaled back up that is 60 of 120.
        limits.set_share(1.0);
        let ok = (0..200).filter(|_| limits.admit_at(&t, "m", 0, None, t0 + Duration::from_secs(30)).is_ok()).count();
        assert_eq!(ok, 30 + 30, "half spent stays half spent");
    }

    #[test]
    fn a_reload_that_changes_a_limit_keeps_what_was_spent_in_the_last_minute() {
        let limits = Limits::new();
        let t0 = Instant::now();
        let before = tenant(|t| t.requests_per_minute = Some(10));
        assert_eq!((0..20).filter(|_| limits.admit_at(&before, "m", 0, None, t0).is_ok()).count(), 10);
        let raised = tenant(|t| t.requests_per_minute = Some(15));
        assert_eq!((0..20).filter(|_| limits.admit_at(&raised, "m", 0, None, t0).is_ok()).count(), 5);
        let lowered = tenant(|t| t.requests_per_minute = Some(5));
        // 15 spent of 5: in debt, refused until the refill covers it.
        let e = limits.admit_at(&lowered, "m", 0, None, t0).unwrap_err();
        assert_eq!(e.retry_after(), Some(Duration::from_secs(132)));
    }

    #[test]
    fn a_removed_tenants_state_goes_and_an_admission_outlives_it() {
        let limits = Limits::new();
        let t = tenant(|t| t.max_concurrent = Some(1));
        let a = limits.try_admit("m", &t, 0).unwrap();
        limits.retain(|name| name != "t");
        assert!(limits.states.read().unwrap().is_empty());
        drop(a);
        let _b = limits.try_admit("m", &t, 0).unwrap();
    }

    #[test]
    fn tenants_do_not_share_buckets() {
        let limits = Limits::new();
        let a = tenant(|t| t.requests_per_minute = Some(1));
        let b = tenant(|t| {
            t.name = "b".into();
            t.requests_per_minute = Some(1);
        });
        assert!(limits.try_admit("m", &a, 0).is_ok());
        assert!(limits.try_admit("m", &a, 0).is_err());
        assert!(limits.try_admit("m", &b, 0).is_ok());
    }
}
