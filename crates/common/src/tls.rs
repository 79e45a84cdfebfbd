//! TLS inside the cluster: mutual TLS between routers and workers, and TLS plus credentials to
//! etcd. Both sides read the same flags through these types, so they cannot disagree on what a
//! setting means.
//!
//! Router <-> worker: one CA signs every certificate. A worker serves only to clients whose
//! certificate chains to it (a router); a router links only to workers whose certificate does
//! *and* names the worker as it registered (its node id as a DNS name), so a process that can
//! write to etcd but holds no certificate for that name is never sent a request. Without the
//! flags the links are plaintext, as on a laptop (`scripts/run.sh`); each process says so at
//! start.
//!
//! The certificate files are re-read when they change (a Secret's rotation): each new
//! connection uses the set current when it is made, and connections already open keep theirs, so
//! a rotation drops no stream. etcd's TLS settings are read at start only.

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, RwLock},
    task::{Context, Poll},
    time::Duration,
};

use etcd_client::{ConnectOptions, TlsOptions};
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
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Identity, Uri};
use xxhash_rust::xxh3::xxh3_64;

/// `--tls-ca`, `--tls-cert`, `--tls-key`: all three or none.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// PEM CA certificate that signs the cluster's router and worker certificates. With
    /// --tls-cert and --tls-key, links between routers and workers use mutual TLS.
    #[arg(long = "tls-ca", env = "BELLOWS_TLS_CA")]
    pub ca: Option<PathBuf>,
    /// PEM certificate of this process (a worker's names its node id; a router's is a client
    /// certificate).
    #[arg(long = "tls-cert", env = "BELLOWS_TLS_CERT")]
    pub cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long = "tls-key", env = "BELLOWS_TLS_KEY")]
    pub key: Option<PathBuf>,
}

/// etcd over TLS and with etcd's own user/password auth.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EtcdAuthArgs {
    /// PEM CA certificate that signs etcd's server certificate (use https:// endpoints).
    #[arg(long, env = "BELLOWS_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate for etcd's client-certificate auth, with --etcd-key.
    #[arg(long, env = "BELLOWS_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    #[arg(long, env = "BELLOWS_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd's auth), with --etcd-password-file.
    #[arg(long, env = "BELLOWS_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (a mounted Secret; never a flag's value).
    #[arg(long, env = "BELLOWS_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{given} needs {missing} too")]
    Incomplete { given: &'static str, missing: &'static str },
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// How often the certificate files are looked at for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);
/// Longest a client may take over its TLS handshake with a worker.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// The cluster's CA and this process's certificate, as TLS configurations for both ends of a
/// router-worker link; re-read when the files change ([`ClusterTls::spawn_reloader`]).
#[derive(Clone)]
pub struct ClusterTls {
    files: Arc<Files>,
    current: Arc<RwLock<Loaded>>,
}

#[derive(Debug)]
struct Files {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// One generation of the certificates, built into both configurations.
struct Loaded {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    /// A hash of the three files' bytes: a change is a new generation.
    contents: u64,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").field("files", &self.files).finish()
    }
}

impl TlsArgs {
    /// `None` when no flag is given (plaintext links).
    pub fn load(&self) -> Result<Option<ClusterTls>, TlsError> {
        let files = match (&self.ca, &self.cert, &self.key) {
            (None, None, None) => return Ok(None),
            (Some(ca), Some(cert), Some(key)) => Files { ca: ca.clone(), cert: cert.clone(), key: key.clone() },
            (None, ..) => return Err(TlsError::Incomplete { given: "--tls-cert/--tls-key", missing: "--tls-ca" }),
            (_, None, _) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-cert" }),
            (_, _, None) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-key" }),
        };
        let loaded = Loaded::build(&files, files.read()?)?;
        Ok(Some(ClusterTls { files: Arc::new(files), current: Arc::new(RwLock::new(loaded)) }))
    }
}

impl Files {
    fn read(&self) -> Result<[Vec<u8>; 3], TlsError> {
        Ok([read(&self.ca)?, read(&self.cert)?, read(&self.key)?])
    }
}

impl Loaded {
    fn build(files: &Files, [ca, cert, key]: [Vec<u8>; 3]) -> Result<Loaded, TlsError> {
        let contents = xxh3_64(&[ca.as_slice(), &cert, &key].concat());
        let invalid = |path: &Path| {
            let path = path.to_path_buf();
            move |e: &dyn std::fmt::Display| TlsError::Invalid { path: path.clone(), message: e.to_string() }
        };
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&ca) {
            let c = c.map_err(|e| invalid(&files.ca)(&e))?;
            roots.add(c).map_err(|e| invalid(&files.ca)(&e))?;
        }
        if roots.is_empty() {
            return Err(invalid(&files.ca)(&"no certificate in the file"));
        }
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&cert).collect::<Result<_, _>>().map_err(|e| invalid(&files.cert)(&e))?;
        let key = PrivateKeyDer::from_pem_slice(&key).map_err(|e| invalid(&files.key)(&e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| invalid(&files.ca)(&e))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_client_cert_verifier(verifier).with_single_cert(chain.clone(), key.clone_key()))
            .map_err(|e| invalid(&files.cert)(&e))?;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_root_certificates(roots).with_client_auth_cert(chain, key))
            .map_err(|e| invalid(&files.cert)(&e))?;
        // gRPC is HTTP/2, and says so in the handshake.
        server.alpn_protocols = vec![b"h2".to_vec()];
        client.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Loaded { server: Arc::new(server), client: Arc::new(client), contents })
    }
}

impl ClusterTls {
    fn server_config(&self) -> Arc<ServerConfig> {
        self.current.read().expect("tls lock").server.clone()
    }

    fn client_config(&self) -> Arc<ClientConfig> {
        self.current.read().expect("tls lock").client.clone()
    }

    /// Look at the files every `every` and take a changed set that loads; a set that does not
    /// (half written, a key that does not match) is logged once and the last good one stays.
    /// Stops when the last clone of `self` is dropped.
    pub fn spawn_reloader(&self, every: Duration) {
        let (files, current) = (self.files.clone(), Arc::downgrade(&self.current));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            let mut refused = None;
            loop {
                tick.tick().await;
                let Some(current) = current.upgrade() else { return };
                let bytes = match files.read() {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::debug!("TLS files unreadable for now: {e}");
                        continue;
                    }
                };
                let seen = current.read().expect("tls lock").contents;
                let now = xxh3_64(&bytes.concat());
                if now == seen || refused == Some(now) {
                    continue;
                }
                match Loaded::build(&files, bytes) {
                    Ok(loaded) => {
                        *current.write().expect("tls lock") = loaded;
                        refused = None;
                        tracing::info!(cert = %files.cert.display(), "TLS certificates reloaded: new connections use them");
                    }
                    Err(e) => {
                        refused = Some(now);
                        tracing::warn!("TLS files changed but do not load; keeping the last good ones: {e}");
                    }
                }
            }
        });
    }

    /// A worker's connections: TLS over each accepted one, with the certificates current when it
    /// arrived. Handshakes run side by side (a slow client holds up no other) and fail alone;
    /// accepting stops when the server drops the stream.
    pub fn accept<I, S>(
        &self,
        incoming: I,
    ) -> impl Stream<Item = std::io::Result<tokio_rustls::server::TlsStream<S>>> + use<I, S>
    where
        I: Stream<Item = std::io::Result<S>> + Send + 'static,
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let tls = self.clone();
        tokio::spawn(async move {
            tokio::pin!(incoming);
            loop {
                let conn = tokio::select! {
                    c = incoming.next() => c,
                    _ = tx.closed() => return,
                };
                let conn = match conn {
                    None => return,
                    Some(Ok(conn)) => conn,
                    Some(Err(e)) => {
                        // Out of file descriptors, say: do not spin on it.
                        tracing::debug!("accepting a connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_LIMIT, acceptor.accept(conn)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send(Ok(stream)).await;
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake refused: {e}"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }

    /// A router's connector to the worker that registered as `peer`: its certificate must chain
    /// to the CA and name `peer`.
    pub fn connector(&self, peer: &str) -> Result<TlsConnector, TlsError> {
        let name = ServerName::try_from(peer.to_string())
            .map_err(|e| TlsError::Invalid { path: PathBuf::from(peer), message: e.to_string() })?;
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
        let (config, peer) = (self.tls.client_config(), self.peer.clone());
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

impl EtcdAuthArgs {
    /// The etcd client's options: TLS and credentials as given (none: plaintext, no auth).
    pub fn connect_options(&self) -> Result<ConnectOptions, TlsError> {
        let mut options = ConnectOptions::new();
        let mut tls = None::<TlsOptions>;
        if let Some(ca) = &self.etcd_ca {
            tls = Some(TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?)));
        }
        match (&self.etcd_cert, &self.etcd_key) {
            (Some(cert), Some(key)) => {
                let identity = Identity::from_pem(read(cert)?, read(key)?);
                tls = Some(tls.unwrap_or_default().identity(identity));
            }
            (None, None) => {}
            (Some(_), None) => return Err(TlsError::Incomplete { given: "--etcd-cert", missing: "--etcd-key" }),
            (None, Some(_)) => return Err(TlsError::Incomplete { given: "--etcd-key", missing: "--etcd-cert" }),
        }
        if let Some(tls) = tls {
            options = options.with_tls(tls);
        }
        match (&self.etcd_user, &self.etcd_password_file) {
            (Some(user), Some(file)) => {
                let password = String::from_utf8_lossy(&read(file)?).trim_end_matches(['\r', '\n']).to_string();
                options = options.with_user(user, password);
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(TlsError::Incomplete { given: "--etcd-user", missing: "--etcd-password-file" });
            }
            (None, Some(_)) => {
                return Err(TlsError::Incomplete { given: "--etcd-password-file", missing: "--etcd-user" });
            }
        }
        Ok(options)
    }

    /// Whether the etcd link is encrypted (for the start-up line).
    pub fn encrypted(&self) -> bool {
        self.etcd_ca.is_some() || self.etcd_cert.is_some()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_flags_go_together_and_name_what_is_missing() {
        assert!(TlsArgs::default().load().unwrap().is_none());
        let partial = TlsArgs { ca: Some("/ca.pem".into()), ..Default::default() };
        let e = partial.load().unwrap_err().to_string();
        assert!(e.contains("--tls-cert"), "{e}");
        let unreadable = TlsArgs {
            ca: Some("/nonexistent/ca.pem".into()),
            cert: Some("/nonexistent/c.pem".into()),
            key: Some("/nonexistent/k.pem".into()),
        };
        assert!(unreadable.load().unwrap_err().to_string().contains("/nonexistent/ca.pem"));
        let user_only = EtcdAuthArgs { etcd_user: Some("root".into()), ..Default::default() };
        assert!(user_only.connect_options().unwrap_err().to_string().contains("--etcd-password-file"));
        assert!(EtcdAuthArgs::default().connect_options().is_ok());
    }
}
