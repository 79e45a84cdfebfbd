//! Test certificates made at run time: a CA, and certificates it signs, written as PEM files
//! for the processes' `--tls-*` and `--etcd-*` flags. Nothing is checked in.

use std::path::PathBuf;

use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair};
use tempfile::TempDir;
use tonic::transport::{self, ClientTlsConfig, Identity};

/// A certificate authority and the directory its files live in.
pub struct Pki {
    dir: TempDir,
    ca: Certificate,
    key: KeyPair,
    name: String,
}

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    /// A fresh CA named `name` (two `Pki`s never trust each other).
    pub fn new(name: &str) -> Pki {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca = params.self_signed(&key).unwrap();
        let pki = Pki { dir: TempDir::new().unwrap(), ca, key, name: name.to_string() };
        std::fs::write(pki.ca_path(), pki.ca.pem()).unwrap();
        pki
    }

    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join(format!("{}-ca.pem", self.name))
    }

    /// A certificate for `names` (DNS names or IP addresses), signed by this CA; `file` names
    /// its files.
    pub fn issue(&self, file: &str, names: &[&str]) -> Issued {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.key).unwrap();
        let issued = Issued {
            cert: self.dir.path().join(format!("{file}.pem")),
            key: self.dir.path().join(format!("{file}-key.pem")),
        };
        std::fs::write(&issued.cert, cert.pem()).unwrap();
        std::fs::write(&issued.key, key.serialize_pem()).unwrap();
        issued
    }

    /// Flags for a process of this cluster: `--tls-ca`, `--tls-cert`, `--tls-key`.
    pub fn flags(&self, issued: &Issued) -> Vec<String> {
        let path = |p: &PathBuf| p.to_string_lossy().into_owned();
        vec![
            "--tls-ca".into(),
            path(&self.ca_path()),
            "--tls-cert".into(),
            path(&issued.cert),
            "--tls-key".into(),
            path(&issued.key),
        ]
    }

    /// A client of a server named `peer` that trusts this CA, presenting `identity` if given.
    pub fn client(&self, peer: &str, identity: Option<&Issued>) -> ClientTlsConfig {
        let mut tls =
            ClientTlsConfig::new().ca_certificate(transport::Certificate::from_pem(self.ca.pem())).domain_name(peer);
        if let Some(i) = identity {
            tls = tls.identity(Identity::from_pem(std::fs::read(&i.cert).unwrap(), std::fs::read(&i.key).unwrap()));
        }
        tls
    }
}
