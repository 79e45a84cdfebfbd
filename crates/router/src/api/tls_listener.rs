//! The HTTP listener over TLS (`--http-tls-cert`, `--http-tls-key`): connections are accepted,
//! set to TCP_NODELAY like the plaintext ones, and handed to axum once their handshake is done;
//! handshakes run side by side, so a slow or silent client holds up no other.

use std::{net::SocketAddr, pin::Pin};

use bellows_common::tls::HttpTls;
use futures_util::{Stream, StreamExt, stream};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

type Accepted = Pin<Box<dyn Stream<Item = (TlsStream<TcpStream>, SocketAddr)> + Send>>;

pub struct TlsListener {
    accepted: Accepted,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(listener: TcpListener, tls: &HttpTls) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let incoming = stream::unfold(listener, |l| async move {
            let accepted = l.accept().await.inspect(|(tcp, _)| {
                let _ = tcp.set_nodelay(true);
            });
            Some((accepted, l))
        });
        Ok(TlsListener { accepted: Box::pin(tls.accept(incoming)), local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
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
