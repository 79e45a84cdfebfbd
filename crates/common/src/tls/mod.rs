//! TLS inside and at the edge of the cluster: mutual TLS between routers and workers
//! ([`cluster`]), TLS on the router's HTTP listener ([`http`]), and TLS plus credentials to etcd.
//! Both processes read the same flags through these types, so they cannot disagree on what a
//! setting means. Without the flags every link is plaintext, as on a laptop (`scripts/run.sh`);
//! each process says so at start.
//!
//! Certificate files are re-read when they change (`reload.rs`): each new connection uses the set
//! current when it is made, and connections already open keep theirs, so a rotation drops no
//! stream. etcd's TLS and password files are re-read at each (re)connection to etcd
//! ([`EtcdOptions`]): a renewed client certificate is used from the next connection on.
//!
//! etcd's password auth hands out a token at login, and a simple token dies after
//! `--auth-token-ttl` (300 s by default) without a request that uses it. Routers and workers
//! keep one client per connection for as long as it works and mostly talk over streams (watch,
//! lease keep-alive), which etcd does not check the token on, so the token of a long-lived
//! client is usually dead by the time it makes its next plain call: the worker's lease revoke
//! at shutdown, say. etcd-client logs in again and retries such a call once only when asked to
//! (`with_auto_token_refresh`), so [`EtcdAuthArgs`] asks whenever a user is given.
//!
//! A wrong password, a missing user or a role that may not read the cluster's keys is a
//! configuration error no retry mends: [`EtcdOptions::check_access`] makes it one at start
//! ([`EtcdAccessError`]), and [`EtcdAccessError::of`] tells it apart from an unreachable etcd
//! later on, so that the retry loops can say so at error level.

pub mod cluster;
pub mod http;
mod reload;

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use etcd_client::{ConnectOptions, TlsOptions};
use futures_util::{Stream, StreamExt};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Identity};

pub use cluster::{ClusterTls, TlsConnector};
pub use http::HttpTls;

/// How often certificate files are looked at for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);
/// Longest a client may take over its TLS handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

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

/// `--http-tls-cert`, `--http-tls-key`: TLS on the router's own HTTP listener, both or none.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct HttpTlsArgs {
    /// PEM certificate chain the router's HTTP listener presents (for clusters without an
    /// ingress that terminates TLS), with --http-tls-key.
    // Field names are clap's ids: distinct from `TlsArgs`' so both can be flattened together.
    #[arg(long = "http-tls-cert", env = "BELLOWS_HTTP_TLS_CERT")]
    pub http_cert: Option<PathBuf>,
    #[arg(long = "http-tls-key", env = "BELLOWS_HTTP_TLS_KEY")]
    pub http_key: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{given} needs {missing} too")]
    Incomplete { given: &'static str, missing: &'static str },
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    /// A worker's name that cannot be a certificate's name (not a DNS name or an IP address).
    #[error("{peer:?} cannot name a TLS peer: {message}")]
    PeerName { peer: String, message: String },
}

impl EtcdAuthArgs {
    /// The etcd client's options: TLS and credentials as given (none: plaintext, no auth).
    fn connect_options(&self) -> Result<ConnectOptions, TlsError> {
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
                // See the module docs: a token that etcd dropped is renewed, not fatal.
                options = options.with_user(user, password).with_auto_token_refresh(true);
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

    /// The options, checked now (a bad set is an error at start) and re-read at each connection.
    pub fn options(&self) -> Result<EtcdOptions, TlsError> {
        let first = self.connect_options()?;
        Ok(EtcdOptions(Arc::new(EtcdFiles {
            args: self.clone(),
            last_good: Mutex::new(first),
            warned: AtomicBool::new(false),
        })))
    }
}

/// etcd's connection options, read from their files each time a client connects, so that a
/// renewed client certificate or a changed password (a rotated Secret) is used from the next
/// connection on without a restart. A set that does not load (half written) is logged once and
/// the last good one is used.
#[derive(Clone)]
pub struct EtcdOptions(Arc<EtcdFiles>);

/// The files, never what they hold (a password).
impl std::fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("EtcdOptions").field(&self.0.args).finish()
    }
}

struct EtcdFiles {
    args: EtcdAuthArgs,
    last_good: Mutex<ConnectOptions>,
    warned: AtomicBool,
}

impl EtcdOptions {
    /// The options for a connection made now.
    pub fn current(&self) -> ConnectOptions {
        let files = &self.0;
        match files.args.connect_options() {
            Ok(options) => {
                files.warned.store(false, Ordering::Relaxed);
                *files.last_good.lock().expect("etcd options lock") = options.clone();
                options
            }
            Err(e) => {
                if !files.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!("etcd's TLS or password files do not load ({e}): connecting with the last good set");
                }
                files.last_good.lock().expect("etcd options lock").clone()
            }
        }
    }
}

/// etcd answered and refuses this process: its credentials, or their absence, are wrong.
#[derive(Debug, thiserror::Error)]
pub enum EtcdAccessError {
    #[error("etcd authentication failed for user {user:?} ({message}): check --etcd-user and --etcd-password-file")]
    LoginRefused { user: String, message: String },
    #[error(
        "etcd has authentication disabled but --etcd-user {user:?} is given ({message}): drop --etcd-user and --etcd-password-file, or enable etcd's auth"
    )]
    AuthNotEnabled { user: String, message: String },
    #[error("etcd requires authentication ({message}): give --etcd-user and --etcd-password-file")]
    LoginRequired { message: String },
    #[error("etcd denies user {user:?} access to {prefix} ({message}): grant its role readwrite on the prefix")]
    PermissionDenied { user: String, prefix: String, message: String },
}

impl EtcdAccessError {
    /// `e` as a refusal that no retry mends, for `user` (`None`: no credentials) on `prefix`;
    /// `None` for anything else (etcd unreachable, a timeout, an expired token).
    pub fn of(e: &etcd_client::Error, user: Option<&str>, prefix: &str) -> Option<EtcdAccessError> {
        let etcd_client::Error::GRpcStatus(status) = e else { return None };
        let message = status.message().to_string();
        let user = user.map(str::to_string);
        // etcd's words (its `rpctypes` errors) are all there is: the gRPC codes are shared with
        // other failures (InvalidArgument, FailedPrecondition).
        match (message.as_str(), user) {
            (m, Some(user)) if m.contains("authentication failed") => Some(Self::LoginRefused { user, message }),
            (m, Some(user)) if m.contains("authentication is not enabled") => {
                Some(Self::AuthNotEnabled { user, message })
            }
            (m, None) if m.contains("user name is empty") || m.contains("authentication failed") => {
                Some(Self::LoginRequired { message })
            }
            (m, user) if m.contains("permission denied") => {
                Some(Self::PermissionDenied { user: user.unwrap_or_default(), prefix: prefix.to_string(), message })
            }
            _ => None,
        }
    }
}

impl EtcdOptions {
    /// The user these options log in as, if any.
    pub fn user(&self) -> Option<&str> {
        self.0.args.etcd_user.as_deref()
    }

    /// Log in to etcd and read `prefix` once, so that refused credentials stop the process at
    /// start with [`EtcdAccessError`] rather than being retried forever. An etcd that does not
    /// answer (down, or slower than `limit`) is no error: the process serves without it and its
    /// retry loops connect later.
    pub async fn check_access(
        &self,
        endpoints: &[String],
        prefix: &str,
        limit: Duration,
    ) -> Result<(), EtcdAccessError> {
        let options = self.current().with_connect_timeout(limit).with_timeout(limit);
        let attempt = async {
            let mut client = etcd_client::Client::connect(endpoints, Some(options)).await?;
            let only_count = etcd_client::GetOptions::new().with_prefix().with_count_only();
            client.get(prefix, Some(only_count)).await.map(drop)
        };
        match tokio::time::timeout(limit, attempt).await {
            Ok(Err(e)) => match EtcdAccessError::of(&e, self.user(), prefix) {
                Some(refused) => Err(refused),
                None => {
                    tracing::warn!("etcd does not answer yet ({e}); serving on and connecting later");
                    Ok(())
                }
            },
            Ok(Ok(())) => Ok(()),
            Err(_) => {
                tracing::warn!("etcd does not answer within {limit:?}; serving on and connecting later");
                Ok(())
            }
        }
    }
}

/// TLS over each connection `incoming` yields (with whatever rides along, e.g. its address), with
/// the configuration `config` gives when it arrives. Handshakes run side by side (a slow client
/// holds up no other) and fail alone; accepting stops when the stream returned is dropped.
fn accept_tls<I, S, A>(
    config: impl Fn() -> Arc<ServerConfig> + Send + 'static,
    incoming: I,
) -> impl Stream<Item = (tokio_rustls::server::TlsStream<S>, A)>
where
    I: Stream<Item = std::io::Result<(S, A)>> + Send + 'static,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    A: Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        tokio::pin!(incoming);
        loop {
            let conn = tokio::select! {
                c = incoming.next() => c,
                _ = tx.closed() => return,
            };
            let (conn, along) = match conn {
                None => return,
                Some(Ok(conn)) => conn,
                Some(Err(e)) => {
                    // Out of file descriptors, say: do not spin on it.
                    tracing::debug!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_LIMIT, acceptor.accept(conn)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send((stream, along)).await;
                    }
                    Ok(Err(e)) => tracing::debug!("TLS handshake refused: {e}"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
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

    #[test]
    fn etcd_files_are_read_again_at_each_connection_and_a_broken_set_keeps_the_last_good_one() {
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "first-secret\n").unwrap();
        let args = EtcdAuthArgs {
            etcd_user: Some("bellows".into()),
            etcd_password_file: Some(password.clone()),
            ..Default::default()
        };
        let options = args.options().unwrap();
        assert!(format!("{:?}", options.current()).contains("first-secret"));
        // A token etcd has dropped is renewed by logging in again (module docs).
        assert!(format!("{:?}", options.current()).contains("refresh_expired_token: true"));
        assert!(
            format!("{:?}", EtcdAuthArgs::default().connect_options().unwrap())
                .contains("refresh_expired_token: false")
        );
        std::fs::write(&password, "rotated-secret\n").unwrap();
        assert!(format!("{:?}", options.current()).contains("rotated-secret"), "the rotated file was not read");
        std::fs::remove_file(&password).unwrap();
        assert!(format!("{:?}", options.current()).contains("rotated-secret"), "the last good set was not kept");
    }
}
