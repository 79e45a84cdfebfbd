//! Thread per core: the router runs one single-threaded tokio runtime per thread (a *shard*),
//! and a request lives on one shard from its HTTP connection to its worker's Session stream.
//!
//! Why: on one multi-threaded runtime a request's steps (its HTTP connection, its dispatch, the
//! worker session's reader, the gRPC connection) wake each other across threads, and each such
//! wake-up of a parked thread is a futex call and a cache miss: about a fifth of the router's CPU
//! per request on 2 cores (docs/BENCHMARKS.md, "Router: thread per core"). So, as in Envoy's
//! threading model, each shard serves the HTTP connections handed to it by the acceptor on
//! shard 0 and sends their requests on its own Session stream to each worker (see
//! [`crate::cluster::link`]); within a shard every wake-up stays on its thread.
//!
//! Which shard gets a connection: the first one that is less than half busy, else the least
//! busy (each shard's busy share is its runtime's busy time over the last 100 ms). Spreading a
//! light load over every shard would make each thread sleep and wake for every request (two
//! half-busy threads switch context about twice as often as one busy one); filling shards in
//! order keeps a light load on few threads and a heavy one on all. Keep-alive connections would
//! otherwise stay where a burst put them, so a shard over 85% busy while another is under half
//! sheds a quarter of its connections: their next response says `Connection: close`, and the
//! client's reconnection lands on a calmer shard (HTTP/1 only; an HTTP/2 connection stays).
//!
//! What all shards share (the cluster view and placement, tenants, admission, metrics) is
//! behind locks and atomics, as on a multi-threaded runtime. Everything that is not a request
//! (discovery, load streams, reloaders) runs on shard 0.
//!
//! The cost: no work stealing. A shard busy with a long synchronous step holds up its own
//! connections, so such steps (tokenization, schema compilation) run on the tokenizer threads.

use std::{
    cell::Cell,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    extract::Request,
    http::{HeaderValue, Version, header::CONNECTION},
    response::Response,
};
use futures_util::future::{BoxFuture, Either};
use prometheus_client::metrics::counter::Counter;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    runtime::Handle,
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

/// How often the acceptor measures how busy each shard is.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// A shard less busy than this takes new connections before any shard after it.
const FILL_BELOW: f64 = 0.5;
/// A shard busier than this sheds connections while another is under [`FILL_BELOW`].
const SHED_ABOVE: f64 = 0.85;
/// The share of its connections a shard over [`SHED_ABOVE`] sheds per sample.
const SHED_ONE_IN: usize = 4;

thread_local! {
    /// The shard this thread runs; 0 on threads that run none.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// The runtimes requests run on; the first is the one that started them.
#[derive(Debug)]
pub struct Shards {
    handles: Vec<Handle>,
    loads: Loads,
    /// Dropping them stops the shards' threads (shard 0 is its caller's).
    _stop: Vec<oneshot::Sender<()>>,
}

/// What the acceptor knows of each shard and asks of it, by shard.
type Loads = Arc<[ShardLoad]>;

#[derive(Debug, Default)]
struct ShardLoad {
    /// HTTP connections the shard serves now.
    open: AtomicUsize,
    /// How many of them should close after their current response.
    shed: AtomicUsize,
    /// Its busy share over the last sample, in thousandths (written by the acceptor only).
    busy_permille: AtomicU32,
}

impl ShardLoad {
    fn busy(&self) -> f64 {
        f64::from(self.busy_permille.load(Relaxed)) / 1000.0
    }

    /// Takes one connection off the shed count; false when there is none to shed.
    fn take_shed(&self) -> bool {
        self.shed.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok()
    }
}

impl Shards {
    /// `count` shards (at least one): the current runtime is shard 0, and each other shard is
    /// a thread of its own running a single-threaded runtime until the `Shards` are dropped.
    pub fn start(count: usize) -> io::Result<Arc<Self>> {
        let mut handles = vec![Handle::current()];
        let mut stop = Vec::new();
        for index in 1..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            handles.push(runtime.handle().clone());
            let (tx, rx) = oneshot::channel::<()>();
            stop.push(tx);
            std::thread::Builder::new().name(format!("bellows-shard-{index}")).spawn(move || {
                CURRENT.set(index);
                let _ = runtime.block_on(rx);
            })?;
        }
        let loads = handles.iter().map(|_| ShardLoad::default()).collect();
        Ok(Arc::new(Shards { handles, loads, _stop: stop }))
    }

    /// One shard: the current runtime (tests, and tools that embed the router's cluster view).
    /// Panics outside a tokio runtime.
    pub fn single() -> Arc<Self> {
        Arc::new(Shards {
            handles: vec![Handle::current()],
            loads: Arc::new([ShardLoad::default()]),
            _stop: Vec::new(),
        })
    }

    /// The shard the calling thread runs (0 off the shards' threads).
    pub fn current() -> usize {
        CURRENT.get()
    }

    /// How many shards there are (at least one).
    pub fn count(&self) -> usize {
        self.handles.len()
    }

    pub fn handle(&self, shard: usize) -> &Handle {
        &self.handles[shard]
    }

    /// The busy share of `shard` over the acceptor's last sample (0 before the first).
    pub fn busy(&self, shard: usize) -> f64 {
        self.loads[shard].busy()
    }

    /// The HTTP connections `shard` serves now.
    pub fn connections(&self, shard: usize) -> usize {
        self.loads[shard].open.load(Relaxed)
    }

    /// Accept on `listener` (on the current runtime, shard 0) and hand each connection, with
    /// TCP_NODELAY set, to a shard chosen by load: one [`ShardListener`] per shard, and the
    /// acceptor's task (aborting it closes the listener).
    pub fn distribute(&self, listener: TcpListener) -> io::Result<(Vec<ShardListener>, JoinHandle<()>)> {
        let local = listener.local_addr()?;
        let (senders, listeners): (Vec<_>, Vec<_>) = (0..self.count())
            .map(|_| {
                let (tx, rx) = mpsc::unbounded_channel();
                (tx, ShardListener { incoming: rx, local })
            })
            .unzip();
        let acceptor =
            Acceptor { listener, shards: senders, meter: BusyMeter::new(&self.handles), loads: self.loads.clone() };
        Ok((listeners, tokio::spawn(acceptor.run())))
    }

    /// `app` with connection shedding: a response on a shard asked to shed a connection says
    /// `Connection: close` (see the module doc), counted in `shed`.
    pub fn shedding(&self, app: axum::Router, shed: Counter) -> axum::Router {
        app.layer(ShedLayer { loads: self.loads.clone(), shed })
    }
}

/// Adds `Connection: close` to the response of a request whose shard has a connection to shed;
/// any other request goes through untouched (no allocation, one atomic read).
#[derive(Clone)]
struct ShedLayer {
    loads: Loads,
    shed: Counter,
}

impl<S> tower_layer::Layer<S> for ShedLayer {
    type Service = Shed<S>;

    fn layer(&self, inner: S) -> Shed<S> {
        Shed { inner, loads: self.loads.clone(), shed: self.shed.clone() }
    }
}

#[derive(Clone)]
struct Shed<S> {
    inner: S,
    loads: Loads,
    shed: Counter,
}

impl<S> tower_service::Service<Request> for Shed<S>
where
    S: tower_service::Service<Request, Response = Response>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<S::Future, BoxFuture<'static, Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // HTTP/2 has no `Connection` header (hyper would drop it): its connections stay.
        let http1 = request.version() <= Version::HTTP_11;
        let answer = self.inner.call(request);
        if !(http1 && self.loads.get(Shards::current()).is_some_and(ShardLoad::take_shed)) {
            return Either::Left(answer);
        }
        self.shed.inc();
        Either::Right(Box::pin(async move {
            let mut response = answer.await?;
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            Ok(response)
        }))
    }
}

/// The shards' busy time, read from their runtimes, turned into shares of each sample.
struct BusyMeter {
    handles: Vec<Handle>,
    busy: Vec<Duration>,
    at: Instant,
}

impl BusyMeter {
    fn new(handles: &[Handle]) -> Self {
        BusyMeter { handles: handles.to_vec(), busy: handles.iter().map(busy_time).collect(), at: Instant::now() }
    }

    /// Each shard's busy share since the last call, written to `loads` and returned.
    fn sample(&mut self, loads: &[ShardLoad]) -> Vec<f64> {
        let now = Instant::now();
        let wall = now.duration_since(self.at).as_secs_f64().max(1e-6);
        self.at = now;
        let shares = self.handles.iter().zip(&mut self.busy).zip(loads).map(|((handle, last), load)| {
            let busy = busy_time(handle);
            let share = (busy.saturating_sub(*last).as_secs_f64() / wall).min(1.0);
            *last = busy;
            load.busy_permille.store((share * 1000.0).round() as u32, Relaxed);
            share
        });
        shares.collect()
    }
}

/// A shard's runtime has one worker: its thread.
fn busy_time(handle: &Handle) -> Duration {
    handle.metrics().worker_total_busy_duration(0)
}

/// Where the next connection goes: the first shard under [`FILL_BELOW`], else the least busy.
fn pick(busy: &[f64]) -> usize {
    if let Some(first) = busy.iter().position(|&b| b < FILL_BELOW) {
        return first;
    }
    (0..busy.len()).min_by(|&a, &b| busy[a].total_cmp(&busy[b])).unwrap_or(0)
}

/// How many connections each shard should shed: a share of a shard's connections while it is
/// over [`SHED_ABOVE`] and another shard is under [`FILL_BELOW`], else none.
fn to_shed(busy: &[f64], open: &[usize]) -> Vec<usize> {
    let calm = busy.iter().any(|&b| b < FILL_BELOW);
    busy.iter()
        .zip(open)
        .map(|(&b, &n)| if calm && b > SHED_ABOVE && n > 1 { n.div_ceil(SHED_ONE_IN) } else { 0 })
        .collect()
}

struct Acceptor {
    listener: TcpListener,
    shards: Vec<mpsc::UnboundedSender<Accepted>>,
    meter: BusyMeter,
    loads: Loads,
}

/// A connection on its way to a shard, counted there until it closes.
type Accepted = (std::net::TcpStream, SocketAddr, OpenConnection);

impl Acceptor {
    /// Streamed tokens are small writes: without TCP_NODELAY each waits for the client's
    /// delayed ACK (40 ms on Linux). A connection is moved to its shard as a std socket, which
    /// the shard registers with its own reactor.
    async fn run(mut self) {
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // axum's accept waits out errors such as too many open files.
                (tcp, addr) = axum::serve::Listener::accept(&mut self.listener) => {
                    if !self.hand_over(tcp, addr) {
                        return;
                    }
                }
                _ = tick.tick() => self.rebalance(),
            }
        }
    }

    /// False once the shards are gone.
    fn hand_over(&self, tcp: TcpStream, addr: SocketAddr) -> bool {
        let _ = tcp.set_nodelay(true);
        let Ok(std) = tcp.into_std() else { return true };
        let busy: Vec<f64> = self.loads.iter().map(ShardLoad::busy).collect();
        let shard = pick(&busy);
        let open = OpenConnection::new(self.loads.clone(), shard);
        self.shards[shard].send((std, addr, open)).is_ok()
    }

    /// One sample: each shard's busy share, and how many connections it sheds until the next.
    fn rebalance(&mut self) {
        let busy = self.meter.sample(&self.loads);
        let open: Vec<usize> = self.loads.iter().map(|l| l.open.load(Relaxed)).collect();
        for (load, shed) in self.loads.iter().zip(to_shed(&busy, &open)) {
            load.shed.store(shed, Relaxed);
        }
    }
}

/// Counts a connection in its shard's `open` while it lives.
#[derive(Debug)]
struct OpenConnection {
    loads: Loads,
    shard: usize,
}

impl OpenConnection {
    fn new(loads: Loads, shard: usize) -> Self {
        loads[shard].open.fetch_add(1, Relaxed);
        OpenConnection { loads, shard }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.loads[self.shard].open.fetch_sub(1, Relaxed);
    }
}

/// The connections one shard serves, as axum's listener.
pub struct ShardListener {
    incoming: mpsc::UnboundedReceiver<Accepted>,
    local: SocketAddr,
}

impl axum::serve::Listener for ShardListener {
    type Io = ShardStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Some((std, addr, open)) = self.incoming.recv().await else {
                // The acceptor stopped (the process is ending): accept nothing more.
                return std::future::pending().await;
            };
            // Fails only if this runtime has no reactor; the connection is then dropped.
            if let Ok(tcp) = TcpStream::from_std(std) {
                return (ShardStream { tcp, _open: open }, addr);
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// A shard's HTTP connection: its socket, counted in the shard's open connections until dropped.
#[derive(Debug)]
pub struct ShardStream {
    tcp: TcpStream,
    _open: OpenConnection,
}

impl ShardStream {
    #[cfg(test)]
    fn nodelay(&self) -> io::Result<bool> {
        self.tcp.nodelay()
    }
}

impl AsyncRead for ShardStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for ShardStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn a_light_load_fills_the_first_calm_shard_before_any_after_it() {
        assert_eq!(pick(&[0.0, 0.0, 0.0]), 0);
        assert_eq!(pick(&[0.49, 0.0, 0.0]), 0);
        assert_eq!(pick(&[0.5, 0.3, 0.0]), 1);
        assert_eq!(pick(&[0.9, 0.7, 0.2]), 2);
    }

    #[test]
    fn when_every_shard_is_busy_the_least_busy_takes_the_connection() {
        assert_eq!(pick(&[0.9, 0.6, 0.8]), 1);
        assert_eq!(pick(&[1.0]), 0);
    }

    #[test]
    fn a_saturated_shard_sheds_a_quarter_of_its_connections_only_while_another_is_calm() {
        assert_eq!(to_shed(&[0.95, 0.1], &[64, 0]), [16, 0]);
        assert_eq!(to_shed(&[0.95, 0.1], &[3, 0]), [1, 0]);
        // Nowhere calmer to go: keep them.
        assert_eq!(to_shed(&[0.95, 0.6], &[64, 10]), [0, 0]);
        // Busy but not saturated, or one connection that would saturate any shard.
        assert_eq!(to_shed(&[0.8, 0.1], &[64, 0]), [0, 0]);
        assert_eq!(to_shed(&[1.0, 0.1], &[1, 0]), [0, 0]);
    }

    #[tokio::test]
    async fn idle_shards_hand_every_connection_to_the_first_with_nodelay() {
        let shards = Shards::start(3).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mut listeners, _acceptor) = shards.distribute(listener).unwrap();
        let _clients: Vec<_> = futures_util::future::join_all((0..3).map(|_| TcpStream::connect(addr))).await;
        // Counted as the acceptor hands them over: a connection sent elsewhere fails here
        // instead of leaving the accepts below waiting.
        within(async {
            while (0..3).map(|s| shards.connections(s)).sum::<usize>() < 3 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert_eq!(shards.loads[0].open.load(Relaxed), 3);
        let mut served = Vec::new();
        for _ in 0..3 {
            let (tcp, _) = axum::serve::Listener::accept(&mut listeners[0]).await;
            assert!(tcp.nodelay().unwrap());
            served.push(tcp);
        }
        assert_eq!(shards.loads[0].open.load(Relaxed), 3);
        drop(served);
        assert_eq!(shards.loads[0].open.load(Relaxed), 0, "a closed connection is no longer counted");
    }

    /// `future`'s output; a broken behaviour fails the test here instead of hanging it.
    async fn within<T>(future: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), future).await.expect("not within 10 s")
    }

    /// Serves, on every shard, the index of the shard that answered.
    fn serve_shard_index(shards: &Shards, listeners: Vec<ShardListener>, shed: &Counter) {
        let index = axum::Router::new().route("/", axum::routing::get(|| async { Shards::current().to_string() }));
        let app = shards.shedding(index, shed.clone());
        for (shard, listener) in listeners.into_iter().enumerate() {
            shards.handle(shard).spawn(axum::serve(listener, app.clone()).into_future());
        }
    }

    /// One keep-alive GET on `tcp`: the response's lower-cased head and its body.
    async fn get(tcp: &mut TcpStream) -> (String, String) {
        tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            let n = tcp.read(&mut buf).await.unwrap();
            assert!(n > 0, "connection closed before a whole response");
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen).to_lowercase();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head.lines().find_map(|l| l.strip_prefix("content-length: ")).unwrap();
                if body.len() == length.trim().parse::<usize>().unwrap() {
                    return (head.to_string(), body.to_string());
                }
            }
        }
    }

    #[tokio::test]
    async fn a_saturated_shard_closes_connections_whose_clients_reconnect_to_a_calm_one() {
        let shards = Shards::start(2).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (listeners, _acceptor) = shards.distribute(listener).unwrap();
        let shed = Counter::default();
        serve_shard_index(&shards, listeners, &shed);
        let mut first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        let (head, body) = get(&mut first).await;
        assert_eq!(body, "0");
        assert!(!head.contains("connection: close"), "{head}");
        assert_eq!(get(&mut second).await.1, "0");

        // Shard 0 (this test's runtime) becomes saturated.
        let hogging = Arc::new(AtomicBool::new(true));
        let hog = hogging.clone();
        tokio::spawn(async move {
            while hog.load(Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
                tokio::task::yield_now().await;
            }
        });
        within(async {
            while shards.loads[0].shed.load(Relaxed) == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(shards.busy(0) > SHED_ABOVE && shards.busy(1) < FILL_BELOW);
        let (head, body) = get(&mut first).await;
        assert_eq!(body, "0");
        assert!(head.contains("connection: close"), "{head}");
        assert_eq!(within(first.read(&mut [0u8; 1])).await.unwrap(), 0, "the server closed it after the response");
        assert_eq!(shed.get(), 1);
        let mut again = TcpStream::connect(addr).await.unwrap();
        assert_eq!(get(&mut again).await.1, "1", "the new connection is served by the calm shard");
        hogging.store(false, Relaxed);
    }
}
