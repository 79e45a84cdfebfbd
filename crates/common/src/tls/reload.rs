//! Certificate files built into a configuration, and built again when they change.
//!
//! A generation is the files' bytes (hashed) and what they built. The reloader looks every
//! [`super::RELOAD_EVERY`]: a change that builds becomes current (for new connections; those open
//! keep what they were made with); a change that does not build (half written, a key that does
//! not match its certificate) is logged once, and the last good generation stays.

use std::{
    path::PathBuf,
    sync::{Arc, RwLock},
    time::Duration,
};

use xxhash_rust::xxh3::xxh3_64;

use super::{TlsError, read};

/// Builds a configuration from the files' bytes (in the order of `files`); errors name a file.
pub(super) type Build<T> = fn(&[PathBuf], &[Vec<u8>]) -> Result<T, TlsError>;

pub(super) struct Reloading<T> {
    files: Vec<PathBuf>,
    build: Build<T>,
    current: RwLock<Generation<T>>,
}

struct Generation<T> {
    value: Arc<T>,
    contents: u64,
}

impl<T: Send + Sync + 'static> Reloading<T> {
    pub(super) fn load(files: Vec<PathBuf>, build: Build<T>) -> Result<Arc<Self>, TlsError> {
        let bytes = read_all(&files)?;
        let value = Arc::new(build(&files, &bytes)?);
        let current = RwLock::new(Generation { value, contents: xxh3_64(&bytes.concat()) });
        Ok(Arc::new(Reloading { files, build, current }))
    }

    pub(super) fn get(&self) -> Arc<T> {
        self.current.read().expect("tls generation lock").value.clone()
    }

    pub(super) fn first_file(&self) -> &PathBuf {
        &self.files[0]
    }

    /// Look at the files every `every`; stops when the last holder of `self` is gone.
    pub(super) fn spawn_reloader(self: &Arc<Self>, every: Duration) {
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            let mut refused = None;
            loop {
                tick.tick().await;
                let Some(this) = this.upgrade() else { return };
                let bytes = match read_all(&this.files) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::debug!("TLS files unreadable for now: {e}");
                        continue;
                    }
                };
                let now = xxh3_64(&bytes.concat());
                if now == this.current.read().expect("tls generation lock").contents || refused == Some(now) {
                    continue;
                }
                match (this.build)(&this.files, &bytes) {
                    Ok(value) => {
                        *this.current.write().expect("tls generation lock") =
                            Generation { value: Arc::new(value), contents: now };
                        refused = None;
                        tracing::info!(file = %this.files[0].display(), "TLS certificates reloaded: new connections use them");
                    }
                    Err(e) => {
                        refused = Some(now);
                        tracing::warn!("TLS files changed but do not load; keeping the last good ones: {e}");
                    }
                }
            }
        });
    }
}

fn read_all(files: &[PathBuf]) -> Result<Vec<Vec<u8>>, TlsError> {
    files.iter().map(|f| read(f)).collect()
}
