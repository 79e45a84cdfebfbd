//! The shared store: PostgreSQL, so that any router replica reads and continues a response
//! that another replica stored.
//!
//! Every call has a deadline (`--responses-store-timeout`): a database that is down or hung
//! costs a request at most that long, and only a request that reads the store fails for it
//! (writes that fail are logged: `super::response`). The schema is this crate's `migrations/`,
//! applied at start under an advisory lock, so replicas that start together apply it once.
//! Until it is applied (the database was down at start) every call is unavailable and the
//! router keeps trying in the background: a router never refuses to start for its store.
//!
//! Expiry is exact: reads and deletes see only rows whose `expires_at` is ahead. The size bound
//! is kept by a sweep (`--responses-sweep-interval`) that drops expired rows, then the oldest
//! past the bound, so between sweeps the table may exceed the bound by what was written since.

use std::{
    future::Future,
    path::PathBuf,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use super::store::{ResponseStore, StoreError, Stored};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// The advisory lock replicas take to apply the schema one at a time ("bellows" in ASCII).
const MIGRATION_LOCK: i64 = 0x62_65_6c_6c_6f_77_73;

/// Connections one router keeps to the database at most.
const POOL_SIZE: usize = 16;

/// Where the store is and how it is bounded.
#[derive(Debug, Clone)]
pub struct PgConfig {
    /// `postgres://user@host:port/database` (a password in the URL works, a file is better).
    pub url: String,
    pub password_file: Option<PathBuf>,
    pub ttl: Duration,
    pub max_bytes: usize,
    /// The deadline of each call, connecting included.
    pub timeout: Duration,
    pub sweep_every: Duration,
}

/// Why the store could not be set up: a bad URL or an unreadable password file, refused at
/// start (an unreachable database is not one of these: see the module docs).
#[derive(Debug, thiserror::Error)]
pub enum PgSetupError {
    #[error("--responses-store-url is not a PostgreSQL URL: {0}")]
    Url(tokio_postgres::Error),
    #[error("cannot read --responses-store-password-file {path}: {source}")]
    PasswordFile { path: PathBuf, source: std::io::Error },
    #[error("cannot build the connection pool: {0}")]
    Pool(#[from] deadpool_postgres::BuildError),
}

pub struct PgStore {
    pool: Pool,
    /// Whether the schema is applied (calls before it would only fail on a missing table).
    ready: AtomicBool,
    ttl: Duration,
    max_bytes: usize,
    timeout: Duration,
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

impl PgStore {
    /// A store on `config`'s database, applying the schema and then sweeping in the background.
    pub fn start(config: &PgConfig) -> Result<Arc<PgStore>, PgSetupError> {
        let store = Arc::new(PgStore::new(config)?);
        tokio::spawn(store.clone().maintain(config.sweep_every));
        Ok(store)
    }

    fn new(config: &PgConfig) -> Result<PgStore, PgSetupError> {
        let mut pg = tokio_postgres::Config::from_str(&config.url).map_err(PgSetupError::Url)?;
        if let Some(path) = &config.password_file {
            let password =
                std::fs::read(path).map_err(|source| PgSetupError::PasswordFile { path: path.clone(), source })?;
            pg.password(password.strip_suffix(b"\n").unwrap_or(&password));
        }
        pg.application_name("bellows-router").connect_timeout(config.timeout);
        let manager = Manager::from_config(pg, NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.timeout))
            .create_timeout(Some(config.timeout))
            .recycle_timeout(Some(config.timeout))
            .build()?;
        Ok(PgStore {
            pool,
            ready: AtomicBool::new(false),
            ttl: config.ttl,
            max_bytes: config.max_bytes,
            timeout: config.timeout,
        })
    }

    /// Apply the schema (retrying until the database answers), then sweep on `every`.
    async fn maintain(self: Arc<Self>, every: Duration) {
        let mut backoff = Duration::from_millis(200);
        while let Err(e) = self.within(self.migrate()).await {
            tracing::warn!(error = %e, "the response store's schema is not applied yet; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
        self.ready.store(true, Ordering::Release);
        tracing::info!("the response store (PostgreSQL) is ready");
        // The first sweep one interval from now, not at once: a replica that starts sweeps no
        // sooner than one that has run for a while.
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            match self.sweep().await {
                Ok(0) => {}
                Ok(dropped) => tracing::debug!(dropped, "swept the response store"),
                Err(e) => tracing::warn!(error = %e, "could not sweep the response store"),
            }
        }
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut client = self.pool.get().await.map_err(unavailable)?;
        client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]).await.map_err(unavailable)?;
        let applied = embedded::migrations::runner().run_async(&mut **client).await;
        client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]).await.map_err(unavailable)?;
        applied.map(drop).map_err(unavailable)
    }

    /// `call`, or unavailable once the deadline passes.
    async fn within<T>(&self, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let late = || unavailable(format!("no answer within {:?}", self.timeout));
        tokio::time::timeout(self.timeout, call).await.unwrap_or_else(|_| Err(late()))
    }

    async fn client(&self) -> Result<Object, StoreError> {
        if !self.ready.load(Ordering::Acquire) {
            return Err(unavailable("its schema is not applied yet (is the database up?)"));
        }
        self.pool.get().await.map_err(unavailable)
    }

    /// Drop expired rows, then the oldest past the size bound; how many went.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        self.within(async {
            let client = self.client().await?;
            let expired = client
                .execute("DELETE FROM bellows_responses WHERE expires_at <= now()", &[])
                .await
                .map_err(unavailable)?;
            let oldest = client
                .execute(
                    "DELETE FROM bellows_responses r USING (
                         SELECT tenant, id, (sum(bytes) OVER (ORDER BY created_at DESC, tenant, id))::BIGINT AS newer
                         FROM bellows_responses
                     ) w
                     WHERE w.newer > $1 AND r.tenant = w.tenant AND r.id = w.id",
                    &[&(self.max_bytes as i64)],
                )
                .await
                .map_err(unavailable)?;
            Ok(expired + oldest)
        })
        .await
    }

    /// The bytes the table holds now (what the sweep bounds).
    pub async fn bytes(&self) -> Result<u64, StoreError> {
        self.within(async {
            let row = self
                .client()
                .await?
                .query_one("SELECT COALESCE(sum(bytes), 0)::BIGINT FROM bellows_responses", &[])
                .await
                .map_err(unavailable)?;
            Ok(row.get::<_, i64>(0) as u64)
        })
        .await
    }
}

#[async_trait::async_trait]
impl ResponseStore for PgStore {
    async fn put(&self, tenant: &str, id: &str, stored: Stored) -> Result<(), StoreError> {
        let text = serde_json::to_string(&stored).map_err(unavailable)?;
        if text.len() > self.max_bytes {
            return Err(StoreError::TooLarge { bytes: text.len(), max: self.max_bytes });
        }
        self.within(async {
            let client = self.client().await?;
            let insert = client
                .prepare_cached(
                    "INSERT INTO bellows_responses (tenant, id, stored, bytes, expires_at)
                     VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5))
                     ON CONFLICT (tenant, id) DO UPDATE SET stored = EXCLUDED.stored,
                         bytes = EXCLUDED.bytes, created_at = now(), expires_at = EXCLUDED.expires_at",
                )
                .await
                .map_err(unavailable)?;
            let args: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                [&tenant, &id, &text, &(text.len() as i64), &self.ttl.as_secs_f64()];
            client.execute(&insert, &args).await.map(drop).map_err(unavailable)
        })
        .await
    }

    async fn get(&self, tenant: &str, id: &str) -> Result<Option<Stored>, StoreError> {
        self.within(async {
            let client = self.client().await?;
            let select = client
                .prepare_cached(
                    "SELECT stored FROM bellows_responses WHERE tenant = $1 AND id = $2 AND expires_at > now()",
                )
                .await
                .map_err(unavailable)?;
            let Some(row) = client.query_opt(&select, &[&tenant, &id]).await.map_err(unavailable)? else {
                return Ok(None);
            };
            serde_json::from_str(row.get::<_, &str>(0)).map(Some).map_err(unavailable)
        })
        .await
    }

    async fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        self.within(async {
            let client = self.client().await?;
            let delete = client
                .prepare_cached("DELETE FROM bellows_responses WHERE tenant = $1 AND id = $2 AND expires_at > now()")
                .await
                .map_err(unavailable)?;
            Ok(client.execute(&delete, &[&tenant, &id]).await.map_err(unavailable)? > 0)
        })
        .await
    }
}
