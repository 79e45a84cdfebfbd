//! [`Tenants`]: the tenants file in force, swapped whole when the file changes.
//!
//! The file is polled, not watched: a Kubernetes Secret volume updates by swapping a symlink
//! (`..data`), which inotify on the file itself does not see, while re-reading it every second
//! and comparing a hash of its content sees any kind of change, for the price of reading a few
//! kilobytes. A new file that does not parse or check out is logged once and ignored: the old
//! tenants stay in force, so a bad edit never opens or closes the gateway. Each tenant's limits
//! state is kept by name and survives a reload that keeps the tenant.

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use anyhow::Context;

use super::{
    auth::{AdminKey, AuthError, bearer_key, find_tenant},
    config::{ConfigError, Tenant, TenantsConfig, parse, sha256},
    limits::Limits,
};

/// How often the reloader reads the file.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

pub struct Tenants {
    /// `None`: auth is off, every caller is the anonymous tenant.
    source: Option<PathBuf>,
    config: RwLock<Arc<TenantsConfig>>,
    /// Hash of the content last read, good or bad: each version is parsed (and logged) once.
    seen: Mutex<[u8; 32]>,
    anonymous: Arc<Tenant>,
    limits: Limits,
    admin: Option<AdminKey>,
}

impl Tenants {
    /// Auth off: no tenants file. Every caller is [`Tenant::anonymous`], with no limits.
    pub fn disabled() -> Self {
        Tenants {
            source: None,
            config: RwLock::default(),
            seen: Mutex::new([0; 32]),
            anonymous: Tenant::anonymous(),
            limits: Limits::new(),
            admin: None,
        }
    }

    /// Auth on, tenants from `path`. Fails when the file cannot be read or is invalid: at start
    /// there is no old file to keep.
    pub fn from_file(path: impl Into<PathBuf>) -> anyhow::Result<Self> {
        let path = path.into();
        let content = std::fs::read(&path).with_context(|| format!("reading the tenants file {}", path.display()))?;
        let config = parse_bytes(&content).with_context(|| format!("in {}", path.display()))?;
        Ok(Tenants {
            source: Some(path),
            config: RwLock::new(Arc::new(config)),
            seen: Mutex::new(sha256(&content)),
            ..Tenants::disabled()
        })
    }

    /// The admin key for the usage endpoint (`None`: the endpoint is off).
    pub fn with_admin_key(mut self, admin: Option<AdminKey>) -> Self {
        self.admin = admin;
        self
    }

    /// Whether requests need a key.
    pub fn auth_enabled(&self) -> bool {
        self.source.is_some()
    }

    /// The tenants in force.
    pub fn config(&self) -> Arc<TenantsConfig> {
        self.config.read().expect("tenants lock").clone()
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The tenant whose key is in this `Authorization` header value. With auth off, always the
    /// anonymous tenant (a key sent anyway is ignored).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Arc<Tenant>, AuthError> {
        if !self.auth_enabled() {
            return Ok(self.anonymous.clone());
        }
        let key = bearer_key(authorization).ok_or(AuthError)?;
        let config = self.config();
        let index = find_tenant(&config, key).ok_or(AuthError)?;
        Ok(config.tenants[index].clone())
    }

    /// Whether this `Authorization` header value carries the admin key; always false when no
    /// admin key is set. Constant time in the key.
    pub fn check_admin(&self, authorization: Option<&str>) -> bool {
        self.admin.as_ref().is_some_and(|a| a.check(authorization))
    }

    pub fn admin_enabled(&self) -> bool {
        self.admin.is_some()
    }

    /// Take `content` as the tenants file, if it changed: `Ok(true)` when it replaced the
    /// tenants in force, `Ok(false)` when it is the content seen last, an error (once per
    /// content) when it is invalid, the tenants in force staying.
    pub fn apply(&self, content: &[u8]) -> Result<bool, ConfigError> {
        let hash = sha256(content);
        {
            let mut seen = self.seen.lock().expect("tenants lock");
            if *seen == hash {
                return Ok(false);
            }
            *seen = hash;
        }
        let config = parse_bytes(content)?;
        self.limits.retain(|name| config.tenant(name).is_some());
        *self.config.write().expect("tenants lock") = Arc::new(config);
        Ok(true)
    }

    /// Read the file again and [`apply`](Self::apply) it (`Ok(false)` with auth off).
    pub fn reload(&self) -> anyhow::Result<bool> {
        let Some(path) = &self.source else { return Ok(false) };
        let content = std::fs::read(path).with_context(|| format!("reading the tenants file {}", path.display()))?;
        self.apply(&content).with_context(|| format!("in {}", path.display()))
    }

    /// Poll the file every `every` (normally [`RELOAD_INTERVAL`]) and take in changes, logging
    /// each outcome once. Ends when the `Tenants` is dropped. `None` with auth off.
    pub fn spawn_reloader(self: &Arc<Self>, every: Duration) -> Option<tokio::task::JoinHandle<()>> {
        let path = self.source.clone()?;
        let tenants = Arc::downgrade(self);
        Some(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut read_error: Option<String> = None;
            loop {
                ticker.tick().await;
                let Some(tenants) = tenants.upgrade() else { return };
                match tokio::fs::read(&path).await {
                    Ok(content) => {
                        read_error = None;
                        match tenants.apply(&content) {
                            Ok(true) => tracing::info!(
                                file = %path.display(),
                                tenants = tenants.config().tenants.len(),
                                "tenants file reloaded"
                            ),
                            Ok(false) => {}
                            Err(e) => tracing::error!(
                                file = %path.display(),
                                "tenants file changed but is invalid; the previous tenants stay in force: {e}"
                            ),
                        }
                    }
                    // A Secret update can remove the file for an instant; say so only once.
                    Err(e) => {
                        let e = e.to_string();
                        if read_error.as_ref() != Some(&e) {
                            tracing::warn!(file = %path.display(), "cannot read the tenants file; the previous tenants stay in force: {e}");
                            read_error = Some(e);
                        }
                    }
                }
            }
        }))
    }
}

fn parse_bytes(content: &[u8]) -> Result<TenantsConfig, ConfigError> {
    let text = std::str::from_utf8(content).map_err(|e| ConfigError::Syntax(format!("not UTF-8: {e}")))?;
    parse(text)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::tenants::config::tests::key_hash;

    fn file(entries: &[(&str, &str, &str)]) -> String {
        let mut text = String::from("tenants:\n");
        for (name, key, extra) in entries {
            text.push_str(&format!("- name: {name}\n  key_sha256: [{}]\n{extra}", key_hash(key)));
        }
        text
    }

    /// A directory laid out like a Kubernetes Secret volume: `tenants.yaml -> ..data/tenants.yaml`,
    /// `..data -> ..<version>`, updated by swapping the `..data` link.
    struct SecretDir {
        root: PathBuf,
        version: u32,
    }

    impl SecretDir {
        fn new(content: &str) -> Self {
            let root = std::env::temp_dir().join(format!("bellows-tenants-{:016x}", rand::random::<u64>()));
            std::fs::create_dir_all(&root).unwrap();
            let mut dir = SecretDir { root, version: 0 };
            dir.update(content);
            std::os::unix::fs::symlink("..data/tenants.yaml", dir.path()).unwrap();
            dir
        }

        fn path(&self) -> PathBuf {
            self.root.join("tenants.yaml")
        }

        fn update(&mut self, content: &str) {
            self.version += 1;
            let version = format!("..v{}", self.version);
            std::fs::create_dir(self.root.join(&version)).unwrap();
            std::fs::write(self.root.join(&version).join("tenants.yaml"), content).unwrap();
            let tmp = self.root.join("..data_tmp");
            std::os::unix::fs::symlink(&version, &tmp).unwrap();
            std::fs::rename(&tmp, self.root.join("..data")).unwrap();
        }
    }

    impl Drop for SecretDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    fn with_auth_off_everyone_is_the_anonymous_tenant() {
        let tenants = Tenants::disabled();
        for header in [None, Some("Bearer whatever"), Some("garbage")] {
            let t = tenants.authenticate(header).unwrap();
            assert_eq!(t.name, "anonymous");
            assert!(t.cache_salt().is_none() && t.requests_per_minute.is_none());
        }
        assert!(!tenants.check_admin(Some("Bearer x")));
    }

    #[test]
    fn with_auth_on_a_key_finds_its_tenant_and_every_failure_is_the_same_error() {
        let dir = SecretDir::new(&file(&[("a", "key-a", ""), ("b", "key-b", "")]));
        let tenants = Tenants::from_file(dir.path()).unwrap();
        assert_eq!(tenants.authenticate(Some("Bearer key-a")).unwrap().name, "a");
        assert_eq!(tenants.authenticate(Some("Bearer key-b")).unwrap().name, "b");
        for header in [None, Some(""), Some("Bearer"), Some("Basic key-a"), Some("Bearer key-c"), Some("key-a")] {
            assert_eq!(tenants.authenticate(header).unwrap_err(), AuthError, "{header:?}");
        }
    }

    #[test]
    fn an_invalid_file_at_start_is_an_error_naming_it() {
        let dir = SecretDir::new("tenants:\n- name: a\n  key: plain\n");
        let e = format!("{:#}", Tenants::from_file(dir.path()).err().unwrap());
        assert!(e.contains("tenants.yaml") && e.contains("`key`"), "{e}");
    }

    #[test]
    fn a_reload_swaps_tenants_and_an_invalid_file_keeps_the_old_ones() {
        let mut dir = SecretDir::new(&file(&[("a", "key-a", "")]));
        let tenants = Tenants::from_file(dir.path()).unwrap();
        assert!(!tenants.reload().unwrap(), "unchanged content is not reloaded");

        dir.update(&file(&[("a", "key-a2", ""), ("b", "key-b", "")]));
        assert!(tenants.reload().unwrap());
        assert!(tenants.authenticate(Some("Bearer key-a")).is_err(), "a rotated key stops working");
        assert_eq!(tenants.authenticate(Some("Bearer key-a2")).unwrap().name, "a");
        assert_eq!(tenants.authenticate(Some("Bearer key-b")).unwrap().name, "b");

        dir.update("tenants:\n- name: b\n  key_sha256: [not-a-hash]\n");
        let e = format!("{:#}", tenants.reload().unwrap_err());
        assert!(e.contains("key_sha256"), "{e}");
        assert!(!tenants.reload().unwrap(), "the same bad content is reported once");
        assert_eq!(tenants.authenticate(Some("Bearer key-b")).unwrap().name, "b", "old tenants stay");
    }

    #[test]
    fn a_tenants_spent_limits_survive_a_reload_that_keeps_it() {
        let mut dir = SecretDir::new(&file(&[("a", "key-a", "  requests_per_minute: 1\n"), ("b", "key-b", "")]));
        let tenants = Tenants::from_file(dir.path()).unwrap();
        let a = tenants.authenticate(Some("Bearer key-a")).unwrap();
        assert!(tenants.limits().admit(&a, "m", 0, None).is_ok());
        assert!(tenants.limits().admit(&a, "m", 0, None).is_err());
        // Same tenant, another weight: its bucket is still empty.
        dir.update(&file(&[("a", "key-a", "  requests_per_minute: 1\n  weight: 2\n"), ("b", "key-b", "")]));
        assert!(tenants.reload().unwrap());
        let a = tenants.authenticate(Some("Bearer key-a")).unwrap();
        assert_eq!(a.weight, 2.0);
        assert!(tenants.limits().admit(&a, "m", 0, None).is_err());
        // Removed and brought back: a new tenant, with a new bucket.
        dir.update(&file(&[("b", "key-b", "")]));
        assert!(tenants.reload().unwrap());
        dir.update(&file(&[("a", "key-a", "  requests_per_minute: 1\n"), ("b", "key-b", "")]));
        assert!(tenants.reload().unwrap());
        let a = tenants.authenticate(Some("Bearer key-a")).unwrap();
        assert!(tenants.limits().admit(&a, "m", 0, None).is_ok());
    }

    #[tokio::test]
    async fn the_reloader_sees_a_secret_update_within_a_poll() {
        let mut dir = SecretDir::new(&file(&[("a", "key-a", "")]));
        let tenants = Arc::new(Tenants::from_file(dir.path()).unwrap());
        let task = tenants.spawn_reloader(Duration::from_millis(10)).unwrap();
        dir.update(&file(&[("b", "key-b", "")]));
        let started = Instant::now();
        while tenants.authenticate(Some("Bearer key-b")).is_err() {
            assert!(started.elapsed() < Duration::from_secs(2), "no reload seen");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(tenants.authenticate(Some("Bearer key-a")).is_err());
        // It ends with the tenants it follows.
        drop(tenants);
        tokio::time::timeout(Duration::from_secs(1), task).await.unwrap().unwrap();
    }

    #[test]
    fn the_admin_key_is_checked_only_when_set() {
        let admin = AdminKey::from_sha256_hex(&key_hash("root")).unwrap();
        let tenants = Tenants::disabled().with_admin_key(Some(admin));
        assert!(tenants.check_admin(Some("Bearer root")));
        assert!(!tenants.check_admin(Some("Bearer key-a")));
        assert!(!Tenants::disabled().check_admin(Some("Bearer root")));
    }
}
