//! Per-tenant limits: allowed models, the `max_tokens` cap, concurrent requests, and token
//! buckets for requests and tokens per minute.
//!
//! Each bucket holds one minute of its limit and refills continuously (600 requests/minute:
//! 600 at once, then one every 100 ms). Prompt tokens are taken when a request is admitted,
//! completion tokens as the stream reports them ([`Admission::charge_completion`]), so the
//! tenant's budget is seen spent within one report interval, not at the end of a long stream.
//! A running stream is never cut: when its tokens overdraw the bucket, the level goes negative
//! (a debt) and the tenant's next requests are refused (429, `Retry-After` = the time the refill
//! takes to pay the debt back) until it is repaid. So over any window the tenant gets at most
//! its limit plus what its streams already running produced past it (at most `max_concurrent`
//! × `max_tokens`). A request larger than the whole bucket is let through only when the bucket
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
//! leaving hand out no fresh budget. The `x-ratelimit-remaining-*` headers scale the local bucket
//! back up by the share: the tenant's whole limit, as if one bucket held it.
//!
//! Why not the governor crate: its GCRA cannot go into debt (completion tokens must be charged,
//! not asked for), cannot be read without taking from it (the headers go on every response),
//! and cannot change its rate without losing its state (a reload or a change of share must not
//! hand out a fresh minute). The bucket here is a few lines of integer arithmetic: levels are
//! kept in units of 1/(1000 × 60e9) token, so a refill over any number of nanoseconds is exact
//! for a whole limit (and within a thousandth of a token per minute for a share of one), and
//! the tests below check it to the token.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::http::{HeaderName, HeaderValue, StatusCode};

use super::config::Tenant;

const NANOS_PER_MINUTE: i128 = 60_000_000_000;
/// Rates are kept in thousandths of a token per minute, so a share (1/3 of 100) keeps its
/// fraction.
const MILLI: f64 = 1000.0;
const UNITS_PER_TOKEN: i128 = 1000 * NANOS_PER_MINUTE;
/// Retry-After for a concurrency refusal: a slot frees when some request ends, which the router
/// cannot foresee.
const CONCURRENCY_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Retry-After for a limit of 0 (the tenant is suspended): nothing will free.
const SUSPENDED_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Which limit refused a request.
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

/// Why a tenant's request is refused by its own limits; each maps to one status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// The tenant may not use this model (403).
    #[error("model {model:?} not allowed for this tenant")]
    ModelNotAllowed { model: String },
    /// `max_tokens` over the tenant's cap (400, param `max_tokens`).
    #[error("max_tokens {requested} over the tenant's cap of {allowed}")]
    MaxTokens { requested: u64, allowed: u64 },
    /// Over a rate or the concurrency cap (429 with Retry-After).
    #[error("{} limit reached", limit.as_str())]
    RateLimited { limit: RateLimit, configured: u64, retry_after: Duration },
}

impl LimitError {
    pub fn status(&self) -> StatusCode {
        match self {
            LimitError::ModelNotAllowed { .. } => StatusCode::FORBIDDEN,
            LimitError::MaxTokens { .. } => StatusCode::BAD_REQUEST,
            LimitError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// A bounded label for metrics and accounting.
    pub fn reason(&self) -> &'static str {
        match self {
            LimitError::ModelNotAllowed { .. } => "model_not_allowed",
            LimitError::MaxTokens { .. } => "max_tokens",
            LimitError::RateLimited { limit, .. } => limit.as_str(),
        }
    }

    /// OpenAI's error `type`: rate limits say which one.
    pub fn kind(&self) -> &'static str {
        match self {
            LimitError::ModelNotAllowed { .. } | LimitError::MaxTokens { .. } => "invalid_request_error",
            LimitError::RateLimited { limit, .. } => limit.as_str(),
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            LimitError::ModelNotAllowed { .. } => "model_not_allowed",
            LimitError::MaxTokens { .. } => "invalid_value",
            LimitError::RateLimited { .. } => "rate_limit_exceeded",
        }
    }

    pub fn param(&self) -> Option<&'static str> {
        match self {
            LimitError::ModelNotAllowed { .. } => Some("model"),
            LimitError::MaxTokens { .. } => Some("max_tokens"),
            LimitError::RateLimited { .. } => None,
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LimitError::RateLimited { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    pub fn message(&self) -> String {
        match self {
            LimitError::ModelNotAllowed { model } => format!("This API key may not use the model `{model}`."),
            LimitError::MaxTokens { requested, allowed } => {
                format!("max_tokens is {requested}, but this API key allows at most {allowed}.")
            }
            LimitError::RateLimited { limit, configured, retry_after } => {
                let what = match limit {
                    RateLimit::Requests => "requests per minute",
                    RateLimit::Tokens => "tokens per minute",
                    RateLimit::Concurrency => "concurrent requests",
                };
                format!(
                    "Rate limit reached for {what} (limit: {configured}). Please try again in {}.",
                    format_duration(*retry_after)
                )
            }
        }
    }
}

/// A continuous token bucket holding one minute of `limit × share`, in fixed point.
#[derive(Debug, Clone)]
struct Bucket {
    /// Per minute, for all routers together (the file's number).
    limit: u64,
    share: f64,
    /// Units per nanosecond (= thousandths of a token per minute).
    rate: i128,
    capacity: i128,
    /// Below zero: a debt.
    level: i128,
    at: Instant,
}

impl Bucket {
    fn new(limit: u64, share: f64, now: Instant) -> Self {
        let rate = rate_of(limit, share);
        let capacity = rate * NANOS_PER_MINUTE;
        Bucket { limit, share, rate, capacity, level: capacity, at: now }
    }

    fn advance(&mut self, now: Instant) {
        if now > self.at {
            let dt = i128::try_from(now.duration_since(self.at).as_nanos()).unwrap_or(i128::MAX);
            self.level = self.level.saturating_add(dt.saturating_mul(self.rate)).min(self.capacity);
            self.at = now;
        }
    }

    /// New limits (a reload) or a new share (routers joined or left), keeping what was spent:
    /// the amount used in the last minute stays used, scaled to the new share.
    fn reconfigure(&mut self, limit: u64, share: f64, now: Instant) {
        if limit == self.limit && share == self.share {
            return;
        }
        self.advance(now);
        let used = (self.capacity - self.level) as f64 * (share / self.share);
        self.rate = rate_of(limit, share);
        self.capacity = self.rate * NANOS_PER_MINUTE;
        self.level = (self.capacity - used.round() as i128).min(self.capacity);
        self.limit = limit;
        self.share = share;
    }

    /// What taking `n` needs in the bucket: `n`, or a full bucket when `n` is more than it holds.
    fn need(&self, n: u64) -> i128 {
        (i128::from(n) * UNITS_PER_TOKEN).min(self.capacity)
    }

    /// `None` when `n` can be taken now, else how long until it can.
    fn wait(&self, n: u64) -> Option<Duration> {
        if self.rate == 0 {
            return Some(SUSPENDED_RETRY_AFTER);
        }
        let missing = self.need(n) - self.level;
        (missing > 0).then(|| nanos(ceil_div(missing, self.rate)))
    }

    fn take(&mut self, n: u64) {
        self.level = self.level.saturating_sub(i128::from(n) * UNITS_PER_TOKEN);
    }

    fn give_back(&mut self, n: u64) {
        self.level = self.level.saturating_add(i128::from(n) * UNITS_PER_TOKEN).min(self.capacity);
    }

    /// Whole tokens left, scaled to the whole limit (all routers), at most the limit.
    fn remaining_overall(&self) -> u64 {
        if self.level <= 0 {
            return 0;
        }
        let local = self.level as f64 / UNITS_PER_TOKEN as f64;
        ((local / self.share).floor() as u64).min(self.limit)
    }

    fn until_full(&self) -> Duration {
        if self.rate == 0 { Duration::ZERO } else { nanos(ceil_div(self.capacity - self.level, self.rate)) }
    }
}

fn rate_of(limit: u64, share: f64) -> i128 {
    if limit == 0 { 0 } else { ((limit as f64 * share * MILLI).round() as i128).max(1) }
}

fn ceil_div(a: i128, b: i128) -> i128 {
    (a + b - 1).div_euclid(b)
}

fn nanos(n: i128) -> Duration {
    Duration::from_nanos(u64::try_from(n.max(0)).unwrap_or(u64::MAX))
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*` (Go's format, to the millisecond):
/// `0s`, `120ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000);
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if frac == 0 {
        out.push_str(&format!("{s}s"));
    } else {
        out.push_str(format!("{s}.{frac:03}").trim_end_matches('0'));
        out.push('s');
    }
    out
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
    /// `max_tokens` the client asked for (`None`: it did not say). Checks, in order: the model
    /// (403), `max_tokens` (400), concurrency, requests per minute, then tokens per minute (429),
    /// and takes one request and the prompt tokens from the buckets.
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

    /// The `x-ratelimit-*` headers for `tenant` now, for every response (errors too): limit,
    /// remaining and reset for each of requests and tokens per minute that the tenant has.
    pub fn headers(&self, tenant: &Tenant) -> Vec<(HeaderName, HeaderValue)> {
        self.headers_at(tenant, Instant::now())
    }

    fn headers_at(&self, tenant: &Tenant, now: Instant) -> Vec<(HeaderName, HeaderValue)> {
        if tenant.requests_per_minute.is_none() && tenant.tokens_per_minute.is_none() {
            return Vec::new();
        }
        // A copy, brought up to now: reading must not change the state (admit and charge do).
        let state = self.states.read().expect("limits lock").get(&tenant.name).cloned();
        let mut buckets = state.map(|s| s.buckets.lock().expect("buckets lock").clone()).unwrap_or_default();
        buckets.sync(tenant, self.share(), now);
        let mut out = Vec::with_capacity(6);
        for (bucket, kind) in [(&buckets.requests, "requests"), (&buckets.tokens, "tokens")] {
            if let Some(b) = bucket {
                let mut push = |what: &str, value: String| {
                    if let (Ok(name), Ok(value)) =
                        (HeaderName::try_from(format!("x-ratelimit-{what}-{kind}")), HeaderValue::try_from(value))
                    {
                        out.push((name, value));
                    }
                };
                push("limit", b.limit.to_string());
                push("remaining", b.remaining_overall().to_string());
                push("reset", format_duration(b.until_full()));
            }
        }
        out
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

    fn header(headers: &[(HeaderName, HeaderValue)], name: &str) -> Option<String> {
        headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.to_str().unwrap().to_string())
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
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
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
        assert_eq!(e.kind(), "tokens");
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
            assert_eq!(header(&limits.headers_at(&t, t0), "x-ratelimit-remaining-tokens").unwrap(), left.to_string());
        }
        // The budget is spent: a new request is refused while the stream goes on past it.
        assert!(limits.admit_at(&t, "m", 1, None, t0).is_err());
        a.charge_completion_at(300, t0); // 300 over: a debt
        assert_eq!(header(&limits.headers_at(&t, t0), "x-ratelimit-remaining-tokens").unwrap(), "0");
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
        let h = limits.headers_at(&t, t0);
        assert_eq!(header(&h, "x-ratelimit-remaining-requests").unwrap(), "1");
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
        let h = limits.headers_at(&t, t0);
        assert_eq!(header(&h, "x-ratelimit-remaining-requests").unwrap(), "1");
        assert_eq!(header(&h, "x-ratelimit-remaining-tokens").unwrap(), "100");
        assert!(limits.admit_at(&t, "m", 80, None, t0).is_ok());
    }

    #[test]
    fn a_model_outside_the_tenants_list_is_forbidden_before_any_limit() {
        let limits = Limits::new();
        let t = tenant(|t| {
            t.models = Some(vec!["a".into()]);
            t.requests_per_minute = Some(0);
        });
        let e = limits.try_admit("b", &t, 0).unwrap_err();
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        assert_eq!(e.param(), Some("model"));
        assert!(e.message().contains("`b`"));
        assert_eq!(limits.try_admit("a", &t, 0).unwrap_err().status(), StatusCode::TOO_MANY_REQUESTS);
    }

    #[test]
    fn max_tokens_over_the_cap_is_a_400_naming_it_and_absent_max_tokens_gets_the_cap() {
        let limits = Limits::new();
        let t = tenant(|t| t.max_tokens = Some(256));
        let e = limits.admit_at(&t, "m", 0, Some(257), Instant::now()).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param(), Some("max_tokens"));
        assert!(e.message().contains("256") && e.message().contains("257"), "{}", e.message());
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
    fn headers_follow_openais_names_and_format() {
        let limits = Limits::new();
        let t = tenant(|t| {
            t.requests_per_minute = Some(60);
            t.tokens_per_minute = Some(6000);
        });
        let t0 = Instant::now();
        let h = limits.headers_at(&t, t0);
        assert_eq!(header(&h, "x-ratelimit-limit-requests").unwrap(), "60");
        assert_eq!(header(&h, "x-ratelimit-remaining-requests").unwrap(), "60");
        assert_eq!(header(&h, "x-ratelimit-reset-requests").unwrap(), "0s");
        let _a = limits.admit_at(&t, "m", 600, None, t0).unwrap();
        let h = limits.headers_at(&t, t0);
        assert_eq!(h.len(), 6);
        assert_eq!(header(&h, "x-ratelimit-remaining-requests").unwrap(), "59");
        assert_eq!(header(&h, "x-ratelimit-reset-requests").unwrap(), "1s");
        assert_eq!(header(&h, "x-ratelimit-limit-tokens").unwrap(), "6000");
        assert_eq!(header(&h, "x-ratelimit-remaining-tokens").unwrap(), "5400");
        assert_eq!(header(&h, "x-ratelimit-reset-tokens").unwrap(), "6s");
        // Reading the headers does not spend anything.
        assert_eq!(header(&limits.headers_at(&t, t0), "x-ratelimit-remaining-requests").unwrap(), "59");
        // No limits, no headers.
        assert!(limits.headers(&Tenant::anonymous()).is_empty());
    }

    #[test]
    fn durations_are_written_like_openais() {
        let cases = [
            (0, "0s"),
            (1, "1ms"),
            (120, "120ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (59_211, "59.211s"),
            (360_000, "6m0s"),
            (61_050, "1m1.05s"),
            (3_723_000, "1h2m3s"),
        ];
        for (millis, text) in cases {
            assert_eq!(format_duration(ms(millis)), text);
        }
        assert_eq!(format_duration(Duration::from_nanos(1)), "1ms", "rounded up, never to 0s");
    }

    #[test]
    fn a_share_scales_every_limit_and_the_headers_scale_back() {
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
        let h = limits.headers_at(&t, t0);
        assert_eq!(header(&h, "x-ratelimit-limit-requests").unwrap(), "100");
        assert_eq!(header(&h, "x-ratelimit-remaining-requests").unwrap(), "0");
        // 25 per minute here: one every 2.4 s, so 4 of the whole limit's.
        let h = limits.headers_at(&t, t0 + ms(2400));
        assert_eq!(header(&h, "x-ratelimit-remaining-requests").unwrap(), "4");
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
