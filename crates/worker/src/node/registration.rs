//! Membership: the node's key in etcd, alive exactly as long as the node can serve.
//!
//! The key (`/bellows/<cluster>/workers/<node-id>`, a [`WorkerRecord`]) hangs on a lease the
//! node keeps alive, so a node that dies or is cut off disappears by itself after the TTL. The
//! node does not depend on etcd to serve: when etcd is unreachable it keeps serving and retries
//! in the background, and every (re-)registration takes a *fresh* lease and rewrites the key. So
//! the one recovery path covers an etcd restart, a lost connection and an expired lease alike,
//! and a key can never be left on a lease that nobody keeps alive.
//!
//! Deregistration revokes the lease: routers watching the prefix see the key go at once, not a
//! TTL later. With etcd's password auth the client's token has usually expired by then (the
//! keep-alive stream does not use it); the client logs in again for the revoke (see
//! `bellows_common::tls`).
//!
//! Credentials etcd refuses are checked at start (the node exits); refused later (a rotated
//! password etcd does not know yet), they are logged at error level and retried, the password
//! file being read again at each attempt.

use std::time::Duration;

use bellows_common::cluster::WorkerRecord;
use bellows_common::tls::{EtcdAccessError, EtcdOptions};
use etcd_client::{Client, PutOptions};
use tokio::{sync::oneshot, task::JoinHandle, time::timeout};

/// The longest one etcd call may take before the node treats etcd as unreachable.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Retry delays after a failure: doubling from the first to the last.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    pub endpoints: Vec<String>,
    /// TLS and credentials for etcd, read again at each connection.
    pub options: EtcdOptions,
    pub key: String,
    pub record: WorkerRecord,
    pub ttl: Duration,
}

/// The background registration; [`Registration::deregister`] ends it.
pub struct Registration {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Registration {
    pub fn spawn(cfg: RegistrationConfig) -> Self {
        let (stop, stopped) = oneshot::channel();
        Registration { stop, task: tokio::spawn(run(cfg, stopped)) }
    }

    /// Revoke the lease (deleting the key) and stop; gives up after a few seconds when etcd is
    /// unreachable (the lease then expires on its own).
    pub async fn deregister(self) {
        let _ = self.stop.send(());
        if timeout(CALL_TIMEOUT * 2, self.task).await.is_err() {
            tracing::warn!("deregistration timed out; the registration expires with its lease");
        }
    }
}

/// The lease a registration hangs on, and the client that took it.
struct Held {
    client: Client,
    lease: i64,
}

async fn run(cfg: RegistrationConfig, mut stop: oneshot::Receiver<()>) {
    let ttl_secs = cfg.ttl.as_secs_f64().ceil().max(1.0) as i64;
    let value = cfg.record.to_json();
    let mut held: Option<Held> = None;
    let mut backoff = BACKOFF.0;
    let mut failures = 0u32;
    let mut was_refused = false;
    loop {
        let outcome = tokio::select! {
            _ = &mut stop => break,
            e = session(&cfg, ttl_secs, &value, &mut held, &mut failures) => e,
        };
        // A session only returns on failure; `failures` is 0 if it had registered.
        let refused = outcome.downcast_ref().and_then(|e| EtcdAccessError::of(e, cfg.options.user(), &cfg.key));
        if let Some(refused) = refused {
            // Not left to the debug lines below: nothing but a fixed credential ends it.
            if failures == 0 || !was_refused {
                tracing::error!(key = %cfg.key, "etcd refuses this node, retrying: {refused}");
            }
            was_refused = true;
            backoff = (backoff * 2).min(BACKOFF.1);
        } else {
            if failures == 0 {
                tracing::warn!(error = %outcome, key = %cfg.key, "etcd registration failed; serving on and retrying");
                backoff = BACKOFF.0;
            } else {
                tracing::debug!(error = %outcome, "etcd still unreachable");
                backoff = (backoff * 2).min(BACKOFF.1);
            }
            was_refused = false;
        }
        failures += 1;
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
    if let Some(Held { mut client, lease }) = held {
        match timeout(CALL_TIMEOUT, client.lease_revoke(lease)).await {
            Ok(Ok(_)) => tracing::info!(key = %cfg.key, "deregistered"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "revoking the lease failed; the key expires with it")
            }
            Err(_) => tracing::warn!("revoking the lease timed out; the key expires with it"),
        }
    }
}

/// Register with a fresh lease and keep it alive; returns (with the error) only when that fails.
async fn session(
    cfg: &RegistrationConfig,
    ttl_secs: i64,
    value: &str,
    held: &mut Option<Held>,
    failures: &mut u32,
) -> anyhow::Error {
    match register_and_keep_alive(cfg, ttl_secs, value, held, failures).await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

async fn register_and_keep_alive(
    cfg: &RegistrationConfig,
    ttl_secs: i64,
    value: &str,
    held: &mut Option<Held>,
    failures: &mut u32,
) -> anyhow::Result<std::convert::Infallible> {
    // A fresh client each time: after a failure the old connection may be dead for good.
    let opts = cfg.options.current().with_connect_timeout(CALL_TIMEOUT).with_timeout(CALL_TIMEOUT);
    let mut client = timeout(CALL_TIMEOUT, Client::connect(&cfg.endpoints, Some(opts))).await??;
    let lease = timeout(CALL_TIMEOUT, client.lease_grant(ttl_secs, None)).await??.id();
    timeout(CALL_TIMEOUT, client.put(cfg.key.as_str(), value, Some(PutOptions::new().with_lease(lease)))).await??;
    // The key now hangs on the new lease; the old one (if etcd still has it) holds nothing.
    if let Some(mut old) = held.replace(Held { client: client.clone(), lease }) {
        let _ = timeout(CALL_TIMEOUT, old.client.lease_revoke(old.lease)).await;
    }
    tracing::info!(key = %cfg.key, lease, ttl_s = ttl_secs, address = %cfg.record.address, "registered in etcd");
    *failures = 0;

    let (mut keeper, mut responses) = timeout(CALL_TIMEOUT, client.lease_keep_alive(lease)).await??;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(ttl_secs as f64 / 3.0));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        timeout(CALL_TIMEOUT, keeper.keep_alive()).await??;
        let reply = timeout(CALL_TIMEOUT, responses.message())
            .await??
            .ok_or_else(|| anyhow::anyhow!("etcd closed the keep-alive stream"))?;
        if reply.ttl() <= 0 {
            anyhow::bail!("lease {lease} expired");
        }
    }
}
