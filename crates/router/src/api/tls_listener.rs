//! The HTTP listener over TLS (`--http-tls-cert`, `--http-tls-key`): a shard's connections are
//! handed to axum once their handshake is done; handshakes run side by side, so a slow or
//! silent client holds up no other.

use std::{net::SocketAddr, pin::Pin};

use axum::serve::Listener;
use bellows_common::tls::HttpTls;
use futures_util::{Stream, StreamExt, stream};
use tokio_rustls::server::TlsStream;

use crate::shards::{ShardListener, ShardStream};

type Accepted = Pin<Box<dyn Stream<Item = (TlsStream<ShardStream>, SocketAddr)> + Send>>;

pub struct TlsListener {
    accepted: Accepted,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(listener: ShardListener, tls: &HttpTls) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let incoming = stream::unfold(listener, |mut l| async move { Some((Ok(l.accept().await), l)) });
        Ok(TlsListener { accepted: Box::pin(tls.accept(incoming)), local })
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<ShardStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.next().await {
            Some(conn) => conn,
            // The accepting task ended (it never does while the listener lives): accept nothing.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
