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

use std::path::{Path, PathBuf};

use etcd_client::{ConnectOptions, TlsOptions};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

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
}

/// The cluster's CA and this process's identity, loaded.
#[derive(Clone, Debug)]
pub struct ClusterTls {
    ca: Certificate,
    identity: Identity,
}

impl TlsArgs {
    /// `None` when no flag is given (plaintext links).
    pub fn load(&self) -> Result<Option<ClusterTls>, TlsError> {
        let (ca, cert, key) = match (&self.ca, &self.cert, &self.key) {
            (None, None, None) => return Ok(None),
            (Some(ca), Some(cert), Some(key)) => (ca, cert, key),
            (None, ..) => return Err(TlsError::Incomplete { given: "--tls-cert/--tls-key", missing: "--tls-ca" }),
            (_, None, _) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-cert" }),
            (_, _, None) => return Err(TlsError::Incomplete { given: "--tls-ca", missing: "--tls-key" }),
        };
        Ok(Some(ClusterTls {
            ca: Certificate::from_pem(read(ca)?),
            identity: Identity::from_pem(read(cert)?, read(key)?),
        }))
    }
}

impl ClusterTls {
    /// A worker's server: its own certificate, and only clients the CA signed.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).client_ca_root(self.ca.clone())
    }

    /// A router's link to the worker that registered as `peer` (its certificate must name it).
    pub fn client(&self, peer: &str) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(self.ca.clone()).identity(self.identity.clone()).domain_name(peer)
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
