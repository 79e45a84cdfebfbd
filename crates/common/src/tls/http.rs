//! TLS on the router's own HTTP listener, for clusters without an ingress that terminates it:
//! the server's certificate only (clients authenticate with their API keys), HTTP/2 or
//! HTTP/1.1 by ALPN, reloaded on change like the cluster's certificates.

use std::{path::PathBuf, sync::Arc, time::Duration};

use futures_util::Stream;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};

use super::{
    HttpTlsArgs, TlsError, accept_tls,
    cluster::{certificates, invalid, private_key},
    reload::Reloading,
};

#[derive(Clone)]
pub struct HttpTls(Arc<Reloading<ServerConfig>>);

impl std::fmt::Debug for HttpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HttpTls").field(self.0.first_file()).finish()
    }
}

impl HttpTlsArgs {
    /// `None` when neither flag is given (plaintext HTTP).
    pub fn load(&self) -> Result<Option<HttpTls>, TlsError> {
        match (&self.http_cert, &self.http_key) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(HttpTls(Reloading::load(vec![cert.clone(), key.clone()], build)?))),
            (Some(_), None) => Err(TlsError::Incomplete { given: "--http-tls-cert", missing: "--http-tls-key" }),
            (None, Some(_)) => Err(TlsError::Incomplete { given: "--http-tls-key", missing: "--http-tls-cert" }),
        }
    }
}

fn build(files: &[PathBuf], bytes: &[Vec<u8>]) -> Result<ServerConfig, TlsError> {
    let chain = certificates(&files[0], &bytes[0])?;
    let key = private_key(&files[1], &bytes[1])?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
        .map_err(|e| invalid(&files[0], e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

impl HttpTls {
    pub fn spawn_reloader(&self, every: Duration) {
        self.0.spawn_reloader(every);
    }

    /// TLS over each accepted connection (and its address), with the certificate current then.
    pub fn accept<I, S, A>(
        &self,
        incoming: I,
    ) -> impl Stream<Item = (tokio_rustls::server::TlsStream<S>, A)> + use<I, S, A>
    where
        I: Stream<Item = std::io::Result<(S, A)>> + Send + 'static,
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        A: Send + 'static,
    {
        let tls = self.0.clone();
        accept_tls(move || tls.get(), incoming)
    }
}
