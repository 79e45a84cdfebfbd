//! Mutual TLS between routers and workers.
//!
//! One CA signs every certificate. A worker serves only clients whose certificate chains to it (a
//! router); a router links only to workers whose certificate does *and* names the worker as it
//! registered (its node id as a DNS name), so a process that can write to etcd but holds no
//! certificate for that name is never sent a request.

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures_util::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject},
    server::WebPkiClientVerifier,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tonic::transport::Uri;

use super::{TlsArgs, TlsError, accept_tls, reload::Reloading};

/// The cluster's CA and this process's certificate, as TLS configurations for both ends of a
/// router-worker link; re-read when the files change ([`ClusterTls::spawn_reloader`]).
#[derive(Clone)]
pub struct ClusterTls(Arc<Reloading<Configs>>);

/// Both ends' configurations, from one generation of the files.
struct Configs {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ClusterTls").field(self.0.first_file()).finish()
    }
}

impl TlsArgs {
    /// `None` when no flag is given (plaintext links).
    pub fn load(&self) -> Result<Option<ClusterTls>, TlsError> {
        let files = match (&self.ca, &self.cert, &self.key) {
            (None, None, None) => return Ok(None),
            (Some(ca), Some(cert), Some(key)) => vec![ca.clone(), cert.clone(), key.clone()],
            (None, ..) => return Err(TlsError::Incomplete { given: "--tls-cert/--tls-key", missing: "--tls-ca" }),
            (_, None, _) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-cert" }),
            (_, _, None) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-key" }),
        };
        Ok(Some(ClusterTls(Reloading::load(files, build)?)))
    }
}

pub(super) fn invalid(path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid { path: path.to_path_buf(), message: e.to_string() }
}

/// The PEM certificates of a file (a chain, or a CA bundle).
pub(super) fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>().map_err(|e| invalid(path, e))?;
    if certs.is_empty() {
        return Err(invalid(path, "no certificate in the file"));
    }
    Ok(certs)
}

pub(super) fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| invalid(path, e))
}

/// Files: the CA, this process's certificate, its key.
fn build(files: &[PathBuf], bytes: &[Vec<u8>]) -> Result<Configs, TlsError> {
    let (ca_file, cert_file) = (&files[0], &files[1]);
    let mut roots = RootCertStore::empty();
    for c in certificates(ca_file, &bytes[0])? {
        roots.add(c).map_err(|e| invalid(ca_file, e))?;
    }
    let chain = certificates(cert_file, &bytes[1])?;
    let key = private_key(&files[2], &bytes[2])?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = Arc::new(roots);
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| invalid(ca_file, e))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_client_cert_verifier(verifier).with_single_cert(chain.clone(), key.clone_key()))
        .map_err(|e| invalid(cert_file, e))?;
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_root_certificates(roots).with_client_auth_cert(chain, key))
        .map_err(|e| invalid(cert_file, e))?;
    // gRPC is HTTP/2, and says so in the handshake.
    server.alpn_protocols = vec![b"h2".to_vec()];
    client.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Configs { server: Arc::new(server), client: Arc::new(client) })
}

impl ClusterTls {
    /// Take changed files every `every` (see the `tls` module docs).
    pub fn spawn_reloader(&self, every: Duration) {
        self.0.spawn_reloader(every);
    }

    /// A worker's connections: TLS over each accepted one, with the certificates current when
    /// it arrived; handshakes run side by side and fail alone.
    pub fn accept<I, S>(
        &self,
        incoming: I,
    ) -> impl Stream<Item = std::io::Result<tokio_rustls::server::TlsStream<S>>> + use<I, S>
    where
        I: Stream<Item = std::io::Result<S>> + Send + 'static,
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let tls = self.0.clone();
        accept_tls(move || tls.get().server.clone(), incoming.map(|c| c.map(|s| (s, ())))).map(|(s, ())| Ok(s))
    }

    /// A router's connector to the worker that registered as `peer`: its certificate must chain
    /// to the CA and name `peer`.
    pub fn connector(&self, peer: &str) -> Result<TlsConnector, TlsError> {
        let name = ServerName::try_from(peer.to_string())
            .map_err(|e| TlsError::PeerName { peer: peer.to_string(), message: e.to_string() })?;
        Ok(TlsConnector { tls: self.clone(), peer: name })
    }
}

/// Connects a router's channel to one worker over TLS, with the certificates current at each
/// (re)connection (a tower `Service<Uri>` for tonic's `connect_with_connector_lazy`).
#[derive(Clone)]
pub struct TlsConnector {
    tls: ClusterTls,
    peer: ServerName<'static>,
}

type Connecting =
    Pin<Box<dyn Future<Output = std::io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>> + Send>>;

impl tower_service::Service<Uri> for TlsConnector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (config, peer) = (self.tls.0.get().client.clone(), self.peer.clone());
        Box::pin(async move {
            let host = uri.host().unwrap_or_default().trim_matches(['[', ']']).to_string();
            let tcp = TcpStream::connect((host.as_str(), uri.port_u16().unwrap_or(443))).await?;
            // Deltas are small writes (see the worker's own TCP_NODELAY).
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config).connect(peer, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
