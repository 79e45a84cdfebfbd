//! Fair sharing at the cluster's cap: while the cluster has no room, requests wait in a short
//! queue per tenant, and as room frees they are let through by deficit round robin over their
//! tokens, weighted by each tenant's weight.
//!
//! First come, first served would hand a flooding tenant the cluster: its requests fill every
//! slot that frees, and a quiet tenant's request waits behind all of them. Here each tenant with
//! waiting requests gets a turn in a round, and a turn lets through requests worth up to
//! `quantum × weight` tokens (plus what its earlier turns left unused, the deficit). So a quiet
//! tenant's request waits for about one turn of each other waiting tenant, however many requests
//! they have queued, and over time each busy tenant gets a share of the tokens proportional to its
//! weight. A tenant that stops waiting loses its deficit: no credit is saved up while idle.
//!
//! Priority classes come first: each class has its own tenant queues, and a grant goes to a
//! class by smooth weighted round robin over the classes that have requests waiting and room
//! ([`CLASS_WEIGHTS`]: 16 interactive, 4 standard, 1 batch). So while interactive requests wait
//! they get 16 of every 21 turns, and batch, when every class is backlogged, still 1 in 21: a
//! class is never starved. A class may also be kept off the last slots (`reserve`): the room it
//! sees is the cluster's room less its reserve, which is how batch is refused (times out)
//! before the others under overload.
//!
//! The queues are short and bounded, and a request waits at most the timeout: past either it is
//! refused with 503 and Retry-After, as the global cap itself does. Where the capacity comes from
//! is the caller's: a closure returning the free slots ([`FairQueue::new`]), and
//! [`FairQueue::on_capacity`] when the router learns that slots freed. A granted [`Turn`] counts
//! as taken until it is dropped, so hold it until the request is in the cluster's own count (sent
//! to a worker): two requests granted in the same instant do not both take the last slot.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bellows_common::priority::Priority;
use tokio::sync::oneshot;

use super::config::Tenant;

/// Turns each class gets, relative to the others, while several have requests waiting.
pub const CLASS_WEIGHTS: [i64; 3] = [16, 4, 1];

#[derive(Debug, Clone, Copy)]
pub struct FairQueueConfig {
    /// Requests one tenant may have waiting on this router; more are refused at once.
    pub max_queued_per_tenant: usize,
    /// Longest wait for a turn; then the request is refused.
    pub timeout: Duration,
    /// Tokens a tenant of weight 1 may send per turn. Small: a turn then lets at most one
    /// request through, so a flooding tenant's cheap requests cannot go ten at a time ahead of
    /// a quiet tenant's one (measured: a 256-token quantum let a 20x tenant's 24-token requests
    /// pass in runs and tripled quiet tenants' TTFT). Rounds with no grant are skipped in one
    /// step, so a small quantum costs nothing with large requests.
    pub quantum_tokens: u64,
    /// Slots of the cluster's room each class (by [`Priority::index`]) leaves to more urgent
    /// ones: it is granted a turn only while the room exceeds its reserve.
    pub reserve: [usize; 3],
}

impl Default for FairQueueConfig {
    fn default() -> Self {
        FairQueueConfig {
            max_queued_per_tenant: 64,
            timeout: Duration::from_secs(10),
            quantum_tokens: 16,
            reserve: [0; 3],
        }
    }
}

/// Why a request got no turn (503 with Retry-After).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueRejection {
    /// The tenant already has `max_queued_per_tenant` requests waiting.
    #[error("tenant queue full")]
    Full { retry_after: Duration },
    /// No turn within the timeout.
    #[error("timed out in the tenant queue")]
    Timeout { retry_after: Duration },
}

impl QueueRejection {
    pub fn retry_after(&self) -> Duration {
        match self {
            QueueRejection::Full { retry_after } | QueueRejection::Timeout { retry_after } => *retry_after,
        }
    }
}

/// The right to send one request to the cluster. Counts against the free slots until dropped.
#[derive(Debug)]
pub struct Turn {
    granted: Arc<AtomicUsize>,
    /// How long the request waited for it (zero when it did not queue).
    pub waited: Duration,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.granted.fetch_sub(1, Ordering::AcqRel);
    }
}

type Capacity = Box<dyn Fn() -> usize + Send + Sync>;

pub struct FairQueue {
    config: FairQueueConfig,
    capacity: Capacity,
    /// Turns granted and not yet dropped.
    granted: Arc<AtomicUsize>,
    next_id: AtomicU64,
    scheduler: Mutex<Classes<Waiter>>,
}

struct Waiter {
    tx: oneshot::Sender<Turn>,
    since: Instant,
}

impl FairQueue {
    /// `capacity`: how many more requests the cluster can take now (for the global cap: its
    /// `--max-waiting` minus the requests waiting). Called outside the queue's lock.
    pub fn new(config: FairQueueConfig, capacity: impl Fn() -> usize + Send + Sync + 'static) -> Self {
        FairQueue {
            config,
            capacity: Box::new(capacity),
            granted: Arc::default(),
            next_id: AtomicU64::new(0),
            scheduler: Mutex::new(Classes::new(config.quantum_tokens)),
        }
    }

    pub fn config(&self) -> FairQueueConfig {
        self.config
    }

    /// Wait for a turn to send a request of `class` and `cost_tokens` (its prompt, or prompt +
    /// max_tokens) for `tenant`. At once when the cluster has room for the class and nobody
    /// waits; otherwise queued, in the tenant's FIFO of its class, until
    /// [`on_capacity`](Self::on_capacity) grants it a turn by class and fair share. Refused when
    /// the tenant's queue is full or the timeout passes. Dropping the future takes the request
    /// out of the queue.
    pub async fn wait_turn(&self, tenant: &Tenant, class: Priority, cost_tokens: u64) -> Result<Turn, QueueRejection> {
        let free = (self.capacity)();
        let rx = {
            let mut s = self.scheduler.lock().expect("fair queue lock");
            let room = free.saturating_sub(self.granted.load(Ordering::Acquire));
            if s.is_empty() && room > self.config.reserve[class.index()] {
                return Ok(self.grant(Duration::ZERO));
            }
            if s.queued(&tenant.name) >= self.config.max_queued_per_tenant {
                return Err(QueueRejection::Full { retry_after: self.retry_after() });
            }
            let (tx, rx) = oneshot::channel();
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            s.push(class, &tenant.name, tenant.weight, id, cost_tokens, Waiter { tx, since: Instant::now() });
            // Others wait while there is room: the room is theirs and ours by class and share.
            if room > 0 {
                self.dispatch(&mut s, room);
            }
            Dequeue { queue: self, class, tenant: &tenant.name, id, rx }
        };
        rx.wait(self.config.timeout).await
    }

    /// The cluster has room for `slots` more requests (not counting turns granted and not yet
    /// dropped, which are taken off): grant that many turns by fair share.
    pub fn on_capacity(&self, slots: usize) {
        let mut s = self.scheduler.lock().expect("fair queue lock");
        let room = slots.saturating_sub(self.granted.load(Ordering::Acquire));
        if room > 0 {
            self.dispatch(&mut s, room);
        }
    }

    /// [`on_capacity`](Self::on_capacity) with the capacity closure's count: call it whenever
    /// room may have freed (a load report, a request's end), or on a short ticker.
    pub fn pump(&self) {
        if !self.scheduler.lock().expect("fair queue lock").is_empty() {
            self.on_capacity((self.capacity)());
        }
    }

    /// Requests waiting, all tenants.
    pub fn queued(&self) -> usize {
        self.scheduler.lock().expect("fair queue lock").len()
    }

    fn dispatch(&self, s: &mut Classes<Waiter>, room: usize) {
        s.dispatch(room, &self.config.reserve, |w| {
            let turn = self.grant(w.since.elapsed());
            // A receiver dropped in the same instant: its turn comes back (dropped), no slot used.
            w.tx.send(turn).is_ok()
        });
    }

    fn grant(&self, waited: Duration) -> Turn {
        self.granted.fetch_add(1, Ordering::AcqRel);
        Turn { granted: self.granted.clone(), waited }
    }

    fn retry_after(&self) -> Duration {
        self.config.timeout.max(Duration::from_secs(1))
    }
}

/// A queued request; dropping it (timeout, or the client went away) takes it out of the queue.
struct Dequeue<'a> {
    queue: &'a FairQueue,
    class: Priority,
    tenant: &'a str,
    id: u64,
    rx: oneshot::Receiver<Turn>,
}

impl Dequeue<'_> {
    async fn wait(mut self, timeout: Duration) -> Result<Turn, QueueRejection> {
        let timed_out = QueueRejection::Timeout { retry_after: self.queue.retry_after() };
        match tokio::time::timeout(timeout, &mut self.rx).await {
            Ok(Ok(turn)) => Ok(turn),
            Ok(Err(_)) => Err(timed_out),
            Err(_) => {
                // Out of the queue first; if it was no longer there, a turn was just granted.
                let still_queued = self.remove();
                match self.rx.try_recv() {
                    Ok(turn) if !still_queued => Ok(turn),
                    _ => Err(timed_out),
                }
            }
        }
    }

    fn remove(&self) -> bool {
        self.queue.scheduler.lock().expect("fair queue lock").remove(self.class, self.tenant, self.id)
    }
}

impl Drop for Dequeue<'_> {
    fn drop(&mut self) {
        self.remove();
    }
}

/// One tenant scheduler per class, and the classes' weighted round robin (see the module docs);
/// pure, so the tests drive it directly.
struct Classes<T> {
    classes: [Scheduler<T>; 3],
    /// Smooth weighted round robin: each pick adds every eligible class's weight to its credit
    /// and takes the class with the most, which then pays the eligible weights' sum. Kept across
    /// dispatches (most grant one slot), and bounded: each pick adds and takes the same sum.
    credit: [i64; 3],
}

impl<T> Classes<T> {
    fn new(quantum_tokens: u64) -> Self {
        Classes { classes: std::array::from_fn(|_| Scheduler::new(quantum_tokens)), credit: [0; 3] }
    }

    fn is_empty(&self) -> bool {
        self.classes.iter().all(Scheduler::is_empty)
    }

    fn len(&self) -> usize {
        self.classes.iter().map(Scheduler::len).sum()
    }

    fn queued(&self, tenant: &str) -> usize {
        self.classes.iter().map(|c| c.queued(tenant)).sum()
    }

    fn push(&mut self, class: Priority, tenant: &str, weight: f64, id: u64, cost: u64, item: T) {
        self.classes[class.index()].push(tenant, weight, id, cost, item);
    }

    fn remove(&mut self, class: Priority, tenant: &str, id: u64) -> bool {
        self.classes[class.index()].remove(tenant, id)
    }

    /// Grant up to `room` items: a class is eligible while it has items and the grants so far
    /// leave more than its reserve.
    fn dispatch(&mut self, room: usize, reserve: &[usize; 3], mut grant: impl FnMut(T) -> bool) {
        let mut granted = 0;
        loop {
            let eligible: [bool; 3] =
                std::array::from_fn(|c| !self.classes[c].is_empty() && room > granted + reserve[c]);
            let classes = || (0..3).filter(|&c| eligible[c]);
            if !eligible.contains(&true) {
                break;
            }
            for c in classes() {
                self.credit[c] += CLASS_WEIGHTS[c];
            }
            let pick = classes().max_by_key(|&c| (self.credit[c], std::cmp::Reverse(c))).expect("a class is eligible");
            let total: i64 = classes().map(|c| CLASS_WEIGHTS[c]).sum();
            self.credit[pick] -= total;
            self.classes[pick].dispatch(1, |item| {
                let took = grant(item);
                granted += usize::from(took);
                took
            });
        }
    }
}

/// Deficit round robin over per-tenant FIFOs; pure, so the tests drive it directly.
struct Scheduler<T> {
    quantum: f64,
    queues: HashMap<String, TenantQueue<T>>,
    /// Tenants with something queued, in round order; the front one has the turn.
    active: VecDeque<String>,
}

struct TenantQueue<T> {
    weight: f64,
    deficit: f64,
    /// Its turn has begun (its quantum was added) and was cut short by a lack of room.
    in_turn: bool,
    items: VecDeque<(u64, u64, T)>,
}

impl<T> Scheduler<T> {
    fn new(quantum_tokens: u64) -> Self {
        Scheduler { quantum: quantum_tokens.max(1) as f64, queues: HashMap::new(), active: VecDeque::new() }
    }

    fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    fn len(&self) -> usize {
        self.queues.values().map(|q| q.items.len()).sum()
    }

    fn queued(&self, tenant: &str) -> usize {
        self.queues.get(tenant).map_or(0, |q| q.items.len())
    }

    fn push(&mut self, tenant: &str, weight: f64, id: u64, cost: u64, item: T) {
        let q = self.queues.entry(tenant.to_string()).or_insert_with(|| {
            self.active.push_back(tenant.to_string());
            TenantQueue { weight, deficit: 0.0, in_turn: false, items: VecDeque::new() }
        });
        q.weight = weight;
        q.items.push_back((id, cost.max(1), item));
    }

    /// Take a waiting item out; `false` when it was not there (granted already).
    fn remove(&mut self, tenant: &str, id: u64) -> bool {
        let Some(q) = self.queues.get_mut(tenant) else { return false };
        let Some(at) = q.items.iter().position(|(i, _, _)| *i == id) else { return false };
        q.items.remove(at);
        if q.items.is_empty() {
            self.queues.remove(tenant);
            self.active.retain(|t| t != tenant);
        }
        true
    }

    /// Grant up to `slots` items, in DRR order. `grant` says whether the item took its slot.
    fn dispatch(&mut self, mut slots: usize, mut grant: impl FnMut(T) -> bool) {
        // Visits in a row that let nothing through: after a whole round of them, skip ahead.
        let mut idle = 0;
        while slots > 0 {
            let Some(name) = self.active.front().cloned() else { break };
            if idle >= self.active.len() {
                self.skip_rounds();
                idle = 0;
            }
            let q = self.queues.get_mut(&name).expect("active tenant has a queue");
            if !q.in_turn {
                q.deficit += self.quantum * q.weight;
                q.in_turn = true;
            }
            let mut served = false;
            while slots > 0 && q.items.front().is_some_and(|(_, cost, _)| *cost as f64 <= q.deficit) {
                let (_, cost, item) = q.items.pop_front().expect("front checked");
                if grant(item) {
                    q.deficit -= cost as f64;
                    slots -= 1;
                    served = true;
                }
            }
            let head_fits = q.items.front().is_some_and(|(_, cost, _)| *cost as f64 <= q.deficit);
            if q.items.is_empty() {
                self.queues.remove(&name);
                self.active.pop_front();
            } else if !head_fits {
                q.in_turn = false;
                self.active.rotate_left(1);
            }
            // else: out of slots mid-turn; the turn goes on at the next grant.
            idle = if served { 0 } else { idle + 1 };
        }
    }

    /// A whole round let nothing through (every head costs more than its deficit): add at once
    /// the quanta of the rounds that would pass until the first head fits, but for the last one,
    /// which the next visit adds. The outcome is the same as visiting round by round.
    fn skip_rounds(&mut self) {
        let rounds = self
            .queues
            .values()
            .filter_map(|q| {
                let (_, cost, _) = q.items.front()?;
                Some(((*cost as f64 - q.deficit) / (self.quantum * q.weight)).ceil())
            })
            .fold(f64::INFINITY, f64::min);
        if rounds.is_finite() && rounds > 1.0 {
            for q in self.queues.values_mut() {
                q.deficit += (rounds - 1.0) * self.quantum * q.weight;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    fn tenant(name: &str, weight: f64) -> Tenant {
        Tenant { name: name.into(), weight, ..(*Tenant::anonymous()).clone() }
    }

    /// Grant `n` slots one at a time; the tenants the grants went to, in order.
    fn grants(s: &mut Scheduler<&'static str>, n: usize) -> Vec<&'static str> {
        let mut out = Vec::new();
        for _ in 0..n {
            s.dispatch(1, |t| {
                out.push(t);
                true
            });
        }
        out
    }

    #[test]
    fn a_quiet_tenant_is_served_within_one_turn_of_a_flooding_one() {
        let mut s = Scheduler::new(100);
        for i in 0..1000 {
            s.push("flood", 1.0, i, 100, "flood");
        }
        // The flood is already being served when the quiet tenant arrives.
        assert_eq!(grants(&mut s, 3), ["flood"; 3]);
        s.push("quiet", 1.0, 5000, 100, "quiet");
        let order = grants(&mut s, 3);
        let at = order.iter().position(|t| *t == "quiet").expect("quiet tenant served");
        assert!(at <= 1, "quiet tenant waited {at} grants behind 997 queued requests: {order:?}");
    }

    #[test]
    fn a_quiet_tenant_among_many_flooding_ones_waits_about_one_turn_each() {
        let mut s = Scheduler::new(256);
        let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
        for (i, name) in names.iter().enumerate() {
            for k in 0..100 {
                s.push(name, 1.0, (i * 1000 + k) as u64, 200, *name);
            }
        }
        grants(&mut s, 50);
        s.push("quiet", 1.0, 99_999, 200, "quiet");
        let order = grants(&mut s, 30);
        let at = order.iter().position(|t| *t == "quiet").expect("quiet tenant served");
        // One turn of each of the nine others at most (a turn of 256 tokens lets one 200-token
        // request through, two when a deficit carried over).
        assert!(at <= 2 * names.len(), "quiet tenant waited {at} grants: {order:?}");
    }

    #[test]
    fn token_shares_follow_weights_with_mixed_request_sizes() {
        // Sizes from 30 to 2000 tokens; both tenants always have requests waiting.
        let size = |i: u64| 30 + (i * 7919) % 1971;
        let weight = |t: &str| if t == "heavy" { 3.0 } else { 1.0 };
        let mut s = Scheduler::<(&str, u64)>::new(256);
        let mut id = 0u64;
        for name in ["light", "heavy"] {
            for _ in 0..10 {
                id += 1;
                s.push(name, weight(name), id, size(id), (name, size(id)));
            }
        }
        let mut granted = HashMap::<&str, u64>::new();
        for _ in 0..4000 {
            let mut served = None;
            s.dispatch(1, |item| {
                served = Some(item);
                true
            });
            let (t, cost) = served.expect("always backlogged");
            *granted.entry(t).or_default() += cost;
            id += 1;
            s.push(t, weight(t), id, size(id), (t, size(id)));
        }
        let share = granted["heavy"] as f64 / (granted["heavy"] + granted["light"]) as f64;
        assert!((share - 0.75).abs() < 0.02, "heavy got {share:.3} of the tokens, its weight says 0.75");
    }

    #[test]
    fn a_request_much_larger_than_the_quantum_still_goes_through_in_one_dispatch() {
        let mut s = Scheduler::new(1);
        s.push("a", 0.01, 1, 100_000, "a");
        s.push("b", 1.0, 2, 50_000, "b");
        // Rounds are skipped rather than visited: b needs 50 000, a needs 10 000 000 rounds.
        assert_eq!(grants(&mut s, 2), ["b", "a"]);
        assert!(s.is_empty());
    }

    #[test]
    fn an_idle_tenant_saves_up_no_credit() {
        let mut s = Scheduler::new(100);
        s.push("a", 1.0, 1, 10, "a");
        assert_eq!(grants(&mut s, 1), ["a"]);
        // a's queue emptied with 90 left: gone, so it cannot burst past b later.
        for i in 0..10 {
            s.push("b", 1.0, 10 + i, 100, "b");
        }
        for i in 0..10 {
            s.push("a", 1.0, 100 + i, 100, "a");
        }
        assert_eq!(grants(&mut s, 4), ["b", "a", "b", "a"]);
    }

    /// Grant `n` slots one at a time over the classes; the items granted, in order.
    fn class_grants(c: &mut Classes<&'static str>, n: usize, reserve: [usize; 3]) -> Vec<&'static str> {
        let mut out = Vec::new();
        for _ in 0..n {
            c.dispatch(1 + reserve.iter().max().unwrap(), &reserve, |t| {
                out.push(t);
                true
            });
        }
        out
    }

    #[test]
    fn waiting_interactive_requests_get_sixteen_turns_in_twenty_one_and_batch_still_one() {
        let mut c = Classes::new(16);
        for i in 0..200 {
            c.push(Priority::Batch, "b", 1.0, i, 10, "batch");
            c.push(Priority::Standard, "s", 1.0, 1000 + i, 10, "standard");
            c.push(Priority::Interactive, "i", 1.0, 2000 + i, 10, "interactive");
        }
        let order = class_grants(&mut c, 210, [0; 3]);
        let count = |class: &str| order.iter().filter(|t| **t == class).count();
        assert_eq!((count("interactive"), count("standard"), count("batch")), (160, 40, 10));
        // Spread, not in runs: batch is served within every 21 turns.
        let batch_at: Vec<usize> = order.iter().enumerate().filter(|(_, t)| **t == "batch").map(|(i, _)| i).collect();
        assert!(batch_at.windows(2).all(|w| w[1] - w[0] <= 21), "batch turns at {batch_at:?}");
    }

    #[test]
    fn an_interactive_arrival_is_granted_next_ahead_of_a_batch_backlog() {
        let mut c = Classes::new(16);
        for i in 0..100 {
            c.push(Priority::Batch, "flood", 1.0, i, 10, "batch");
        }
        assert_eq!(class_grants(&mut c, 5, [0; 3]), ["batch"; 5]);
        c.push(Priority::Interactive, "quiet", 1.0, 500, 10, "interactive");
        assert_eq!(class_grants(&mut c, 1, [0; 3]), ["interactive"]);
    }

    #[test]
    fn a_class_is_not_granted_the_room_it_must_leave_to_more_urgent_ones() {
        let mut c = Classes::new(16);
        c.push(Priority::Batch, "b", 1.0, 1, 10, "batch");
        let mut got = Vec::new();
        c.dispatch(2, &[0, 0, 2], |t| {
            got.push(t);
            true
        });
        assert!(got.is_empty(), "two slots of room, both reserved for the other classes");
        c.dispatch(3, &[0, 0, 2], |t| {
            got.push(t);
            true
        });
        assert_eq!(got, ["batch"]);
    }

    #[test]
    fn removing_a_waiter_keeps_the_others_in_order() {
        let mut s = Scheduler::new(100);
        s.push("a", 1.0, 1, 10, "a1");
        s.push("a", 1.0, 2, 10, "a2");
        assert!(s.remove("a", 1));
        assert!(!s.remove("a", 1));
        assert!(s.remove("a", 2));
        assert!(s.is_empty() && s.queues.is_empty());
    }

    fn queue(config: FairQueueConfig, free: Arc<AtomicUsize>) -> Arc<FairQueue> {
        Arc::new(FairQueue::new(config, move || free.load(Ordering::SeqCst)))
    }

    async fn until_queued(q: &FairQueue, n: usize) {
        for _ in 0..1000 {
            if q.queued() == n {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("{} queued, expected {n}", q.queued());
    }

    #[tokio::test]
    async fn a_turn_is_immediate_when_there_is_room_and_nobody_waits() {
        let q = queue(FairQueueConfig::default(), Arc::new(AtomicUsize::new(1)));
        let turn = q.wait_turn(&tenant("a", 1.0), Priority::Standard, 10).await.unwrap();
        assert_eq!(turn.waited, Duration::ZERO);
    }

    #[tokio::test]
    async fn a_granted_turn_holds_its_slot_until_dropped() {
        let free = Arc::new(AtomicUsize::new(1));
        let q = queue(FairQueueConfig::default(), free.clone());
        let first = q.wait_turn(&tenant("a", 1.0), Priority::Standard, 10).await.unwrap();
        let second = tokio::spawn({
            let q = q.clone();
            async move { q.wait_turn(&tenant("b", 1.0), Priority::Standard, 10).await }
        });
        until_queued(&q, 1).await;
        q.pump();
        tokio::task::yield_now().await;
        assert_eq!(q.queued(), 1, "the only slot is held by the first turn");
        drop(first);
        q.pump();
        assert!(second.await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn at_the_cap_turns_go_by_fair_share_not_arrival() {
        let q = queue(FairQueueConfig { quantum_tokens: 100, ..Default::default() }, Arc::new(AtomicUsize::new(0)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let spawn = |name: &'static str| {
            let (q, order) = (q.clone(), order.clone());
            tokio::spawn(async move {
                let turn = q.wait_turn(&tenant(name, 1.0), Priority::Standard, 100).await.unwrap();
                order.lock().unwrap().push(name);
                drop(turn);
            })
        };
        let mut tasks: Vec<_> = (0..20).map(|_| spawn("flood")).collect();
        until_queued(&q, 20).await;
        tasks.push(spawn("quiet"));
        until_queued(&q, 21).await;
        // One slot at a time: each grant waits for the previous turn to be dropped.
        for _ in 0..10_000 {
            if order.lock().unwrap().len() == 21 {
                break;
            }
            q.on_capacity(1);
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap();
        let at = order.iter().position(|t| *t == "quiet").unwrap();
        assert!(at <= 1, "the quiet tenant came {at}th behind 20 earlier requests: {order:?}");
    }

    #[tokio::test]
    async fn a_full_tenant_queue_refuses_at_once_and_others_still_queue() {
        let config = FairQueueConfig { max_queued_per_tenant: 2, ..Default::default() };
        let q = queue(config, Arc::new(AtomicUsize::new(0)));
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                tokio::spawn(async move { q.wait_turn(&tenant("a", 1.0), Priority::Standard, 1).await })
            })
            .collect();
        until_queued(&q, 2).await;
        let e = q.wait_turn(&tenant("a", 1.0), Priority::Standard, 1).await.unwrap_err();
        assert!(matches!(e, QueueRejection::Full { .. }));
        assert!(e.retry_after() >= Duration::from_secs(1));
        let other = tokio::spawn({
            let q = q.clone();
            async move { q.wait_turn(&tenant("b", 1.0), Priority::Standard, 1).await }
        });
        until_queued(&q, 3).await;
        q.on_capacity(3);
        for w in waiting {
            assert!(w.await.unwrap().is_ok());
        }
        assert!(other.await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn a_request_past_the_timeout_is_refused_and_leaves_the_queue() {
        let config = FairQueueConfig { timeout: Duration::from_millis(50), ..Default::default() };
        let q = queue(config, Arc::new(AtomicUsize::new(0)));
        let started = Instant::now();
        let e = q.wait_turn(&tenant("a", 1.0), Priority::Standard, 1).await.unwrap_err();
        assert!(matches!(e, QueueRejection::Timeout { .. }), "{e:?}");
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(q.queued(), 0);
    }

    #[tokio::test]
    async fn a_request_whose_client_left_leaves_the_queue() {
        let q = queue(FairQueueConfig::default(), Arc::new(AtomicUsize::new(0)));
        let waiting = tokio::spawn({
            let q = q.clone();
            async move { q.wait_turn(&tenant("a", 1.0), Priority::Standard, 1).await }
        });
        until_queued(&q, 1).await;
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(q.queued(), 0);
        // And its slot is not lost: the next request takes it.
        let next = tokio::spawn({
            let q = q.clone();
            async move { q.wait_turn(&tenant("b", 1.0), Priority::Standard, 1).await }
        });
        until_queued(&q, 1).await;
        q.on_capacity(1);
        assert!(next.await.unwrap().is_ok());
    }
}
