//! Thread per core: the router runs one single-threaded tokio runtime per thread (a *shard*),
//! and a request lives on one shard from its HTTP connection to its worker's Session stream.
//!
//! Why: on one multi-threaded runtime a request's steps (its HTTP connection, its dispatch, the
//! worker session's reader, the gRPC connection) wake each other across threads, and each such
//! wake-up of a parked thread is a futex call and a cache miss: about a fifth of the router's CPU
//! per request on 2 cores (docs/BENCHMARKS.md, "Router: thread per core"). So, as in Envoy's
//! threading model, each shard serves the HTTP connections handed to it (round robin, by the
//! acceptor on shard 0) and sends their requests on its own Session stream to each worker
//! (see [`crate::cluster::link`]); within a shard every wake-up stays on its thread.
//!
//! What all shards share (the cluster view and placement, tenants, admission, metrics) is
//! behind locks and atomics, as on a multi-threaded runtime. Everything that is not a request
//! (discovery, load streams, reloaders) runs on shard 0.
//!
//! The cost: no work stealing. A shard busy with a long synchronous step holds up its own
//! connections, so such steps (tokenization, schema compilation) run on the tokenizer threads.

use std::{cell::Cell, io, net::SocketAddr, sync::Arc};

use tokio::{
    net::{TcpListener, TcpStream},
    runtime::Handle,
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

thread_local! {
    /// The shard this thread runs; 0 on threads that run none.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// The runtimes requests run on; the first is the one that started them.
#[derive(Debug)]
pub struct Shards {
    handles: Vec<Handle>,
    /// Dropping them stops the shards' threads (shard 0 is its caller's).
    _stop: Vec<oneshot::Sender<()>>,
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
        Ok(Arc::new(Shards { handles, _stop: stop }))
    }

    /// One shard: the current runtime (tests, and tools that embed the router's cluster view).
    /// Panics outside a tokio runtime.
    pub fn single() -> Arc<Self> {
        Arc::new(Shards { handles: vec![Handle::current()], _stop: Vec::new() })
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

    /// Accept on `listener` (on the current runtime, shard 0) and hand each connection, with
    /// TCP_NODELAY set, to the shards in turn: one [`ShardListener`] per shard, and the
    /// acceptor's task (aborting it closes the listener).
    pub fn distribute(&self, listener: TcpListener) -> io::Result<(Vec<ShardListener>, JoinHandle<()>)> {
        let local = listener.local_addr()?;
        let (senders, listeners): (Vec<_>, Vec<_>) = (0..self.count())
            .map(|_| {
                let (tx, rx) = mpsc::unbounded_channel();
                (tx, ShardListener { incoming: rx, local })
            })
            .unzip();
        Ok((listeners, tokio::spawn(accept_in_turn(listener, senders))))
    }
}

/// Streamed tokens are small writes: without TCP_NODELAY each waits for the client's delayed
/// ACK (40 ms on Linux). A connection is moved to its shard as a std socket, which the shard
/// registers with its own reactor.
async fn accept_in_turn(
    mut listener: TcpListener,
    shards: Vec<mpsc::UnboundedSender<(std::net::TcpStream, SocketAddr)>>,
) {
    for shard in (0..shards.len()).cycle() {
        // axum's accept waits out errors such as too many open files.
        let (tcp, addr) = axum::serve::Listener::accept(&mut listener).await;
        let _ = tcp.set_nodelay(true);
        let Ok(std) = tcp.into_std() else { continue };
        if shards[shard].send((std, addr)).is_err() {
            return;
        }
    }
}

/// The connections one shard serves, as axum's listener.
pub struct ShardListener {
    incoming: mpsc::UnboundedReceiver<(std::net::TcpStream, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for ShardListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Some((std, addr)) = self.incoming.recv().await else {
                // The acceptor stopped (the process is ending): accept nothing more.
                return std::future::pending().await;
            };
            // Fails only if this runtime has no reactor; the connection is then dropped.
            if let Ok(tcp) = TcpStream::from_std(std) {
                return (tcp, addr);
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_are_handed_to_every_shard_in_turn_and_served_on_its_thread() {
        let shards = Shards::start(3).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (listeners, _acceptor) = shards.distribute(listener).unwrap();
        let mut served = Vec::new();
        for (index, mut shard) in listeners.into_iter().enumerate() {
            let (tx, rx) = oneshot::channel();
            shards.handle(index).spawn(async move {
                let (tcp, _) = axum::serve::Listener::accept(&mut shard).await;
                let _ = tx.send((Shards::current(), tcp.nodelay().unwrap()));
            });
            served.push(rx);
        }
        let _clients: Vec<_> = futures_util::future::join_all((0..3).map(|_| TcpStream::connect(addr))).await;
        for (index, rx) in served.into_iter().enumerate() {
            assert_eq!(rx.await.unwrap(), (index, true), "shard {index}");
        }
    }
}
