//! Mutual TLS between routers and workers.
//!
//! One CA signs every certificate. A worker serves only clients whose certificate chains to it (a
//! router); a router links only to workers whose certificate does *and* names the worker as it
//! registered: its node id, or the host of the address it registered (so one certificate for
//! `*.<headless service>` serves a whole StatefulSet). A process that can write to etcd but holds
//! no certificate for either name is never sent a request.

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
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme,
    client::{
        WebPkiServerVerifier,
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    },
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
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
    client: ClientParts,
}

/// What a router's client configuration is made of; each link makes its own, checking the names
/// its worker registered ([`AnyOfNames`]).
struct ClientParts {
    provider: Arc<CryptoProvider>,
    webpki: Arc<WebPkiServerVerifier>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl ClientParts {
    fn config(&self, names: &[ServerName<'static>]) -> Result<ClientConfig, rustls::Error> {
        let verifier = Arc::new(AnyOfNames { webpki: self.webpki.clone(), names: names.to_vec() });
        let mut config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        // gRPC is HTTP/2, and says so in the handshake.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// The CA's verdict on a worker's certificate, which passes if it names any of `names`.
#[derive(Debug)]
struct AnyOfNames {
    webpki: Arc<WebPkiServerVerifier>,
    names: Vec<ServerName<'static>>,
}

impl ServerCertVerifier for AnyOfNames {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _sent_as_sni: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let mut mismatch = rustls::Error::InvalidCertificate(CertificateError::NotValidForName);
        for name in &self.names {
            match self.webpki.verify_server_cert(end_entity, intermediates, name, ocsp_response, now) {
                Err(
                    e @ rustls::Error::InvalidCertificate(
                        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
                    ),
                ) => mismatch = e,
                verdict => return verdict,
            }
        }
        Err(mismatch)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
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
    server.alpn_protocols = vec![b"h2".to_vec()];
    let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| invalid(ca_file, e))?;
    let client = ClientParts { provider, webpki, chain, key };
    // A key that does not sign for its certificate fails here, at load, not at the first link.
    client.config(&[]).map_err(|e| invalid(cert_file, e))?;
    Ok(Configs { server: Arc::new(server), client })
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

    /// A router's connector to a worker whose certificate must chain to the CA and name one of
    /// `names` (the first is sent as SNI). A name that cannot be a certificate's (not a DNS name
    /// or an IP address) is left out; none left is an error.
    pub fn connector(&self, names: &[&str]) -> Result<TlsConnector, TlsError> {
        let valid: Vec<_> = names.iter().filter_map(|n| ServerName::try_from(n.to_string()).ok()).collect();
        if valid.is_empty() {
            let message = "neither a DNS name nor an IP address".to_string();
            return Err(TlsError::PeerName { peer: names.join(" or "), message });
        }
        Ok(TlsConnector { tls: self.clone(), names: valid.into() })
    }
}

/// Connects a router's channel to one worker over TLS, with the certificates current at each
/// (re)connection (a tower `Service<Uri>` for tonic's `connect_with_connector_lazy`).
#[derive(Clone)]
pub struct TlsConnector {
    tls: ClusterTls,
    names: Arc<[ServerName<'static>]>,
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
        let config = self.tls.0.get().client.config(&self.names).map_err(std::io::Error::other);
        let peer = self.names[0].clone();
        Box::pin(async move {
            let config = Arc::new(config?);
            let host = uri.host().unwrap_or_default().trim_matches(['[', ']']).to_string();
            let tcp = TcpStream::connect((host.as_str(), uri.port_u16().unwrap_or(443))).await?;
            // Deltas are small writes (see the worker's own TCP_NODELAY).
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config).connect(peer, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
