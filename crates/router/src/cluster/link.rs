//! The router's connection to one worker: its gRPC channel, its latest load report, and the
//! requests this router sent there that the reports do not show yet.
//!
//! A link is *placeable* only while its WatchLoad stream is alive and the worker is not
//! draining: the stream is the router's only view of the worker, so a worker it cannot see is a
//! worker it does not use. A stream that breaks, or stays silent past [`REPORT_SILENCE`], takes
//! the worker out of placement at once and forgets its cached blocks; the link reconnects in the
//! background and the worker's next snapshot restores them.
//!
//! A worker that speaks protocol 2 gets every request on a Session stream (see
//! [`super::session`]): one per shard, each on its shard's own connection and read on its shard
//! (see [`crate::shards`]), so a request's answers never change threads on their way to its
//! client. They are opened with the load stream, which is followed on shard 0: the link is up
//! only while all of them are, and any breaking takes it down and starts it over. An older
//! worker gets a Generate call per request.
//!
//! A worker that leaves (it deregistered to drain, or moved) gets no new request, but the
//! requests already on its session finish there: the link is *retired*, and its session closes
//! once they have (or after [`RETIRE_LIMIT`]). Closing it at once would cancel them on the
//! worker, and a draining worker's streams would all migrate instead of finishing.
//!
//! A worker that closes ends its load stream and its sessions together, once its last request
//! is done; each travels on its own connection, so one session's last answers may still be on
//! the wire when the load stream's end, or another session's, arrives. So a stream that *ended*
//! (not one that broke or went silent) lets the sessions run to their own ends, for at most
//! [`SESSION_GRACE`]: cutting them there would fail requests the worker had finished.

use std::{
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use bellows_common::{priority::Priority, telemetry, tls::TlsConnector};
use bellows_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use prometheus_client::metrics::gauge::Gauge;
use tokio::{
    sync::{mpsc, oneshot},
    task::{JoinError, JoinHandle},
};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::{
    Cluster, WorkerId,
    call::{WorkerCall, WorkerError},
    queue::{QueueTotals, Share},
    session::SessionChannel,
};
use crate::shards::Shards;

/// The largest message a worker may send: ModelInfo carries the whole tokenizer.json, which for
/// Gemma 3's 262,144-token vocabulary and its merges is far over tonic's default limit of 4 MiB.
const MAX_WORKER_MESSAGE: usize = 256 << 20;

/// Workers report at least every 250 ms; a stream silent this long is treated as broken.
pub const REPORT_SILENCE: Duration = Duration::from_secs(3);
/// How long a retired link's session may still carry its requests.
pub const RETIRE_LIMIT: Duration = Duration::from_secs(120);
/// How often a retiring link looks whether its requests are done.
const RETIRE_POLL: Duration = Duration::from_millis(50);
/// How long a session may outlive its worker's load stream that ended (see the module doc).
pub const SESSION_GRACE: Duration = Duration::from_secs(1);
/// How long a dead worker's reconnect attempts wait, at most.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// HTTP/2 flow-control windows: a session carries every request's answers on one stream, so
/// its window must hold many requests' worth in flight, not one's.
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;
/// Reports after its acceptance by which a request surely shows in the worker's own counts.
/// One report may already be in flight when the worker enqueues it; the next one includes it.
const REPORTS_UNTIL_REFLECTED: u64 = 2;

/// A worker's load as placement and admission see it: the worker's last report plus what this
/// router sent since that the report cannot show.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    pub waiting_requests: u32,
    pub waiting_tokens: u64,
    pub running: u32,
    pub max_running: u32,
    pub prefill_tokens_per_s: f64,
}

/// A request sent to the worker that its reports may not count yet.
#[derive(Debug)]
struct Pending {
    id: u64,
    prompt_tokens: u32,
    /// Reflected once a report with this sequence number arrives; `None` while the Generate
    /// call has not been accepted.
    reflected_at: Option<u64>,
}

#[derive(Debug, Default)]
struct LinkState {
    /// The load stream is up and the worker is not draining.
    placeable: bool,
    report: pb::LoadReport,
    pending: Vec<Pending>,
    /// The prompt tokens of `pending`, summed.
    pending_tokens: u64,
    /// What this link last added to the cluster's queue totals.
    published: Share,
    /// From the worker's ModelInfo.
    context_length: u32,
    /// The worker's Session streams while the link is up, by shard, if it speaks protocol 2.
    sessions: Vec<Arc<SessionChannel>>,
    /// The worker's protocol version (ModelInfo).
    protocol_version: u32,
}

impl LinkState {
    /// What the link adds to the cluster's queue now: its worker's waiting work, while placeable.
    fn share(&self) -> Share {
        if !self.placeable {
            return Share::default();
        }
        Share::new(
            u64::from(self.report.waiting_requests) + self.pending.len() as u64,
            self.report.waiting_prompt_tokens + self.pending_tokens,
            self.report.prefill_tokens_per_s,
        )
    }

    /// Stop counting the pending requests `keep` rejects.
    fn retain_pending(&mut self, mut keep: impl FnMut(&Pending) -> bool) {
        let mut dropped = 0;
        self.pending.retain(|p| {
            let k = keep(p);
            if !k {
                dropped += u64::from(p.prompt_tokens);
            }
            k
        });
        self.pending_tokens -= dropped;
    }
}

pub struct WorkerLink {
    pub id: WorkerId,
    pub node_id: String,
    /// A hash of `node_id`, for placement that must agree across routers.
    pub stable_id: u64,
    pub address: String,
    /// On shard 0: ModelInfo, the load stream, and Generate calls to an older worker.
    client: WorkerClient<Channel>,
    connect: Connect,
    shards: Arc<Shards>,
    state: Mutex<LinkState>,
    queue: Arc<QueueTotals>,
    next_pending: AtomicU64,
    closed: AtomicBool,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for WorkerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerLink").field("id", &self.id).field("node_id", &self.node_id).finish()
    }
}

/// How to reach the worker: a connection belongs to the runtime it is made on, so each shard
/// makes its own.
#[derive(Clone)]
struct Connect {
    endpoint: Endpoint,
    tls: Option<TlsConnector>,
}

impl Connect {
    /// A client whose connection lives on the calling runtime. With TLS the connector does the
    /// handshake (certificates current at each connection): the URI's scheme stays http.
    fn client(&self) -> WorkerClient<Channel> {
        let channel = match &self.tls {
            Some(connector) => self.endpoint.connect_with_connector_lazy(connector.clone()),
            None => self.endpoint.connect_lazy(),
        };
        WorkerClient::new(channel).max_decoding_message_size(MAX_WORKER_MESSAGE)
    }
}

impl WorkerLink {
    /// A link to `address` (host:port) that maintains itself until [`WorkerLink::close`]. Runs
    /// on shard 0.
    pub(super) fn spawn(
        id: WorkerId,
        node_id: &str,
        address: &str,
        tls: Option<TlsConnector>,
        cluster: Weak<Cluster>,
        queue: Arc<QueueTotals>,
        shards: Arc<Shards>,
    ) -> anyhow::Result<Arc<Self>> {
        let endpoint = Endpoint::from_shared(format!("http://{address}"))?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW);
        let connect = Connect { endpoint, tls };
        let link = Arc::new(WorkerLink {
            id,
            node_id: node_id.to_string(),
            stable_id: xxhash_rust::xxh3::xxh3_64(node_id.as_bytes()),
            address: address.to_string(),
            client: connect.client(),
            connect,
            shards,
            state: Mutex::new(LinkState::default()),
            queue,
            next_pending: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            task: Mutex::new(None),
        });
        let task = tokio::spawn(maintain(Arc::downgrade(&link), cluster));
        *link.task.lock().expect("link task lock") = Some(task);
        Ok(link)
    }

    /// The worker left: no new request goes there, and the background task stops, once the
    /// requests on its session are done (see the module doc).
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let sessions = self.state.lock().expect("link state lock").sessions.clone();
        self.set_unplaceable();
        let Some(task) = self.task.lock().expect("link task lock").take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if in_flight(&sessions) > 0 => {
                runtime.spawn(retire(sessions, task));
            }
            _ => task.abort(),
        }
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// The RPC a request to this worker travels in: `Session` (protocol 2) or `Generate`.
    pub fn rpc_method(&self) -> &'static str {
        let protocol_version = self.state.lock().expect("link state lock").protocol_version;
        if speaks_session(protocol_version) { "Session" } else { "Generate" }
    }

    /// Send `request` to the worker, on the calling shard's session, and wait until it accepts
    /// it; `span` is the attempt's span, whose trace the worker continues.
    pub async fn open(&self, request: pb::GenerateRequest, span: &tracing::Span) -> Result<WorkerCall, WorkerError> {
        let (session, protocol_version) = {
            let s = self.state.lock().expect("link state lock");
            let shard = Shards::current();
            (s.sessions.get(shard).or(s.sessions.first()).cloned(), s.protocol_version)
        };
        if let Some(session) = session {
            return session.open(request, telemetry::inject_map(span)).await.map(WorkerCall::Session);
        }
        if speaks_session(protocol_version) {
            return Err(WorkerError::Failed("the worker's link is down".into()));
        }
        let mut request = tonic::Request::new(request);
        telemetry::inject(span, request.metadata_mut());
        let response = self.client.clone().generate(request).await.map_err(|s| WorkerError::from_status(&s))?;
        Ok(WorkerCall::Generate(response.into_inner()))
    }

    /// The worker's load, or `None` when it must not be given work.
    pub fn load(&self) -> Option<Load> {
        let s = self.state.lock().expect("link state lock");
        if !s.placeable {
            return None;
        }
        Some(Load {
            waiting_requests: s.report.waiting_requests + s.pending.len() as u32,
            waiting_tokens: s.report.waiting_prompt_tokens + s.pending_tokens,
            running: s.report.running_requests,
            max_running: s.report.max_running,
            prefill_tokens_per_s: s.report.prefill_tokens_per_s,
        })
    }

    /// What its worker last reported waiting in each class (requests, tokens), by
    /// [`Priority::index`]; `None` while not placeable. Reports only: the requests this router
    /// sent since are in [`WorkerLink::load`], not here.
    pub fn waiting_by_priority(&self) -> Option<[(u64, u64); 3]> {
        let s = self.state.lock().expect("link state lock");
        if !s.placeable {
            return None;
        }
        let mut by_class = [(0, 0); 3];
        for c in &s.report.waiting_by_priority {
            let class = Priority::from(c.priority());
            by_class[class.index()] = (u64::from(c.waiting_requests), c.waiting_prompt_tokens);
        }
        Some(by_class)
    }

    pub fn context_length(&self) -> u32 {
        self.state.lock().expect("link state lock").context_length
    }

    /// Count a request as waiting here until the worker's reports show it (or it starts).
    pub fn dispatch(self: &Arc<Self>, prompt_tokens: usize) -> Dispatched {
        let id = self.next_pending.fetch_add(1, Ordering::Relaxed);
        let prompt_tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        self.update(|s| {
            s.pending.push(Pending { id, prompt_tokens, reflected_at: None });
            s.pending_tokens += u64::from(prompt_tokens);
        });
        Dispatched { link: self.clone(), id }
    }

    fn apply_report(&self, report: pb::LoadReport, first: bool) {
        self.update(|s| {
            let seq = report.sequence;
            if first {
                // A new stream numbers its reports afresh.
                for p in s.pending.iter_mut().filter(|p| p.reflected_at.is_some()) {
                    p.reflected_at = Some(seq + REPORTS_UNTIL_REFLECTED);
                }
            } else {
                s.retain_pending(|p| p.reflected_at.is_none_or(|r| r > seq));
            }
            s.placeable = !report.draining && !self.is_closed();
            s.report = report;
        });
    }

    fn set_unplaceable(&self) {
        self.update(|s| {
            s.placeable = false;
            s.sessions.clear();
        });
    }

    /// Change the link's state and publish what that changes in the cluster's queue.
    fn update<T>(&self, f: impl FnOnce(&mut LinkState) -> T) -> T {
        let mut s = self.state.lock().expect("link state lock");
        let out = f(&mut s);
        let share = s.share();
        if share != s.published {
            self.queue.shift(s.published, share);
            s.published = share;
        }
        out
    }
}

impl Drop for WorkerLink {
    /// A link going away withdraws what it added to the queue.
    fn drop(&mut self) {
        let s = self.state.get_mut().expect("link state lock");
        self.queue.shift(s.published, Share::default());
    }
}

/// A request counted in its worker's [`Load`] until the worker's reports show it. Dropping it
/// (first token, failure, cancel) stops counting it.
pub struct Dispatched {
    link: Arc<WorkerLink>,
    id: u64,
}

impl Dispatched {
    /// The worker accepted the request (its stream opened): the next reports will count it.
    pub fn accepted(&self) {
        let mut s = self.link.state.lock().expect("link state lock");
        let at = s.report.sequence + REPORTS_UNTIL_REFLECTED;
        if let Some(p) = s.pending.iter_mut().find(|p| p.id == self.id) {
            p.reflected_at = Some(at);
        }
    }
}

impl Drop for Dispatched {
    fn drop(&mut self) {
        let id = self.id;
        self.link.update(|s| s.retain_pending(|p| p.id != id));
    }
}

/// Requests on `sessions` that have not had their last answer.
fn in_flight(sessions: &[Arc<SessionChannel>]) -> usize {
    sessions.iter().map(|s| s.in_flight()).sum()
}

/// Let a retired link's sessions carry their requests to their end, then stop its task.
async fn retire(sessions: Vec<Arc<SessionChannel>>, task: JoinHandle<()>) {
    let deadline = tokio::time::Instant::now() + RETIRE_LIMIT;
    while in_flight(&sessions) > 0 && !task.is_finished() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(RETIRE_POLL).await;
    }
    task.abort();
}

/// Keep the link alive: fetch ModelInfo, join the model's pool, follow WatchLoad; on any
/// failure stop placing there, back off, and start over (not once the link is closed).
async fn maintain(link: Weak<WorkerLink>, cluster: Weak<Cluster>) {
    let mut backoff = Duration::from_millis(50);
    let mut failures = 0u32;
    loop {
        let (Some(l), Some(c)) = (link.upgrade(), cluster.upgrade()) else { return };
        if l.is_closed() {
            return;
        }
        let mut was_up = false;
        let outcome = follow(&l, &c, &mut backoff, &mut was_up).await;
        l.set_unplaceable();
        c.forget_blocks(&l);
        failures = if was_up { 1 } else { failures + 1 };
        if let Err(e) = &outcome
            && failed_tls(e)
        {
            // Not a worker this router trusts: it never gets a request. Said once.
            c.count_tls_failure();
            if failures == 1 {
                tracing::warn!(worker = %l.node_id, address = %l.address, "worker failed TLS verification: {e:#}");
            }
        } else if let Err(e) = outcome {
            // A link that was up going down is news; a worker still starting (loading its
            // model) is retried quietly after the first message.
            if was_up {
                tracing::warn!(worker = %l.node_id, address = %l.address, "worker link down: {e:#}");
            } else if failures == 1 {
                tracing::info!(worker = %l.node_id, address = %l.address, "waiting for the worker: {e:#}");
            } else {
                tracing::debug!(worker = %l.node_id, address = %l.address, "worker still unavailable: {e:#}");
            }
        }
        drop((l, c));
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Whether `e` is a TLS failure (a certificate refused, by either side), anywhere in its chain.
fn failed_tls(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.downcast_ref::<rustls::Error>().is_some()
            || cause
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
    })
}

/// Whether a worker of this protocol version takes requests on a Session stream.
fn speaks_session(protocol_version: u32) -> bool {
    protocol_version >= bellows_proto::SESSION_PROTOCOL
}

/// One life of the link: ModelInfo, the pool, the sessions (protocol 2), then the load stream
/// and the sessions' answers until any ends.
async fn follow(
    link: &Arc<WorkerLink>,
    cluster: &Arc<Cluster>,
    backoff: &mut Duration,
    was_up: &mut bool,
) -> anyhow::Result<()> {
    let mut client = link.client.clone();
    let info = client.model_info(pb::ModelInfoRequest {}).await?.into_inner();
    {
        let mut s = link.state.lock().expect("link state lock");
        s.context_length = info.context_length;
        s.protocol_version = info.protocol_version;
    }
    let pool = cluster.attach(link, &info)?;
    let sessions = if speaks_session(info.protocol_version) {
        let buffered = &cluster.metrics.session_buffered;
        Some(ShardSessions::open(&link.shards, &link.connect, buffered).await?)
    } else {
        None
    };
    let stream = client.watch_load(pb::WatchLoadRequest {}).await?.into_inner();
    let Some(mut sessions) = sessions else {
        return watch_load(link, cluster, &pool, stream, backoff, was_up).await;
    };
    link.state.lock().expect("link state lock").sessions = sessions.channels.clone();
    tokio::select! {
        r = watch_load(link, cluster, &pool, stream, backoff, was_up) => {
            if r.as_ref().is_err_and(|e| e.is::<LoadStreamEnded>()) {
                link.set_unplaceable();
                let _ = tokio::time::timeout(SESSION_GRACE, sessions.all_ended()).await;
            }
            r
        }
        r = sessions.first_ended() => {
            if r.as_ref().is_err_and(|e| e.is::<SessionEnded>()) {
                link.set_unplaceable();
                let _ = tokio::time::timeout(SESSION_GRACE, sessions.all_ended()).await;
            }
            r
        }
    }
}

/// The worker ended a session: it is closing (see the module doc).
#[derive(Debug, thiserror::Error)]
#[error("session stream ended")]
struct SessionEnded;

/// A link's Session streams, one per shard, each read by a task on its shard. Dropping this
/// stops the readers, which closes the channels (each reader holds its [`Closing`] guard).
///
/// [`Closing`]: super::session::Closing
struct ShardSessions {
    channels: Vec<Arc<SessionChannel>>,
    readers: Vec<JoinHandle<anyhow::Result<()>>>,
}

impl ShardSessions {
    /// Open a session on every shard, each over a connection of that shard's own.
    async fn open(shards: &Shards, connect: &Connect, buffered: &Gauge) -> anyhow::Result<Self> {
        let mut sessions = ShardSessions { channels: Vec::new(), readers: Vec::new() };
        let mut opened = Vec::new();
        for shard in 0..shards.count() {
            let (tx, rx) = oneshot::channel();
            let (connect, buffered) = (connect.clone(), buffered.clone());
            sessions.readers.push(shards.handle(shard).spawn(async move {
                let mut client = connect.client();
                let (frames, outgoing) = mpsc::unbounded_channel();
                let mut answers = client.session(UnboundedReceiverStream::new(outgoing)).await?.into_inner();
                let channel = SessionChannel::new(frames, buffered);
                let _closing = channel.closing();
                let _ = tx.send(channel.clone());
                channel.demux(&mut answers).await
            }));
            opened.push(rx);
        }
        for (rx, reader) in opened.into_iter().zip(&mut sessions.readers) {
            match rx.await {
                Ok(channel) => sessions.channels.push(channel),
                // The reader ended before its session opened: why.
                Err(_) => return Err(ended(reader.await)),
            }
        }
        Ok(sessions)
    }

    /// Why the first reader to end did.
    async fn first_ended(&mut self) -> anyhow::Result<()> {
        let (first, _, _) = futures_util::future::select_all(self.readers.iter_mut()).await;
        Err(ended(first))
    }

    /// Until every reader has ended (one already awaited is not awaited again).
    async fn all_ended(&mut self) {
        futures_util::future::join_all(self.readers.iter_mut().filter(|r| !r.is_finished())).await;
    }
}

impl Drop for ShardSessions {
    fn drop(&mut self) {
        for reader in &self.readers {
            reader.abort();
        }
    }
}

/// A session reader's end as the link's error.
fn ended(reader: Result<anyhow::Result<()>, JoinError>) -> anyhow::Error {
    match reader {
        Ok(Err(e)) => e,
        Ok(Ok(())) => SessionEnded.into(),
        Err(e) => anyhow::anyhow!("session reader stopped: {e}"),
    }
}

/// The worker ended its load stream: it is closing (see the module doc).
#[derive(Debug, thiserror::Error)]
#[error("load stream ended")]
struct LoadStreamEnded;

/// Apply the worker's load reports and KV events until the stream fails or goes silent.
async fn watch_load(
    link: &Arc<WorkerLink>,
    cluster: &Cluster,
    pool: &super::ModelPool,
    mut stream: tonic::Streaming<pb::WatchLoadResponse>,
    backoff: &mut Duration,
    was_up: &mut bool,
) -> anyhow::Result<()> {
    let mut first = true;
    loop {
        let msg = match tokio::time::timeout(REPORT_SILENCE, stream.message()).await {
            Err(_) => anyhow::bail!("no load report for {REPORT_SILENCE:?}"),
            Ok(Err(status)) => anyhow::bail!("load stream failed: {}", status.message()),
            Ok(Ok(None)) => return Err(LoadStreamEnded.into()),
            Ok(Ok(Some(msg))) => msg,
        };
        // Most reports carry no cache change: they need not take the index from placement. A
        // retired link's worker is out of the pool: its blocks are no use to placement.
        if (msg.kv_snapshot.is_some() || !msg.kv_events.is_empty()) && !link.is_closed() {
            let share = cluster.index_share();
            let trimmed = pool.index.lock().expect("prefix index lock").apply(link.id, &msg, share);
            cluster.metrics.prefix_index_trimmed.inc_by(trimmed as u64);
            let snapshot = msg.kv_snapshot.as_ref().map_or(0, |s| s.block_hashes.len());
            cluster.metrics.kv_events.inc_by((msg.kv_events.len() + snapshot) as u64);
        }
        if let Some(report) = msg.load {
            link.apply_report(report, first);
            if first {
                tracing::info!(worker = %link.node_id, address = %link.address, model = %pool.name, "worker link up");
                *backoff = Duration::from_millis(50);
                *was_up = true;
                first = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::QueueView;

    fn link(id: u64, queue: &Arc<QueueTotals>) -> Arc<WorkerLink> {
        // No cluster: the link's task ends at once, leaving its state to the test.
        let shards = Shards::single();
        WorkerLink::spawn(WorkerId(id), &format!("w{id}"), "127.0.0.1:9", None, Weak::new(), queue.clone(), shards)
            .unwrap()
    }

    fn report(sequence: u64, waiting_requests: u32, waiting_prompt_tokens: u64) -> pb::LoadReport {
        pb::LoadReport {
            sequence,
            waiting_requests,
            waiting_prompt_tokens,
            prefill_tokens_per_s: 1.5,
            ..Default::default()
        }
    }

    /// What summing every link's load, as admission once did per request, would give.
    fn summed(links: &[&Arc<WorkerLink>]) -> QueueView {
        let mut q = QueueView::default();
        for load in links.iter().filter_map(|l| l.load()) {
            q.waiting_requests += u64::from(load.waiting_requests);
            q.waiting_tokens += load.waiting_tokens;
            q.prefill_tokens_per_s += load.prefill_tokens_per_s;
        }
        q
    }

    #[tokio::test]
    async fn the_queue_totals_follow_every_links_load_through_reports_dispatches_and_departures() {
        let queue = Arc::new(QueueTotals::default());
        let (a, b) = (link(1, &queue), link(2, &queue));
        a.apply_report(report(1, 3, 300), true);
        b.apply_report(report(1, 1, 50), true);
        assert_eq!(queue.view(), summed(&[&a, &b]));
        assert_eq!(queue.view().waiting_requests, 4);

        let sent = a.dispatch(120);
        sent.accepted();
        let other = b.dispatch(7);
        assert_eq!(queue.view(), summed(&[&a, &b]));
        assert_eq!(queue.view().waiting_tokens, 477);
        // The worker's reports now count the accepted request: it is not counted twice.
        a.apply_report(report(2 + REPORTS_UNTIL_REFLECTED, 4, 420), false);
        assert_eq!(queue.view(), summed(&[&a, &b]));
        assert_eq!(queue.view().waiting_requests, 6);
        drop((sent, other));
        assert_eq!(queue.view(), summed(&[&a, &b]));

        // A link that goes down adds nothing, and one dropped withdraws what it added.
        b.set_unplaceable();
        assert_eq!(queue.view(), summed(&[&a]));
        drop(a);
        assert_eq!(queue.view(), QueueView::default());
        drop(b);
        assert_eq!(queue.view(), QueueView::default());
    }
}
