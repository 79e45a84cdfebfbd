//! The node's lifecycle, and the admission gate that makes a graceful stop exact.
//!
//! A node moves one way only: `Loading → Serving → Draining → Closed`. Requests are admitted only
//! while `Serving`; every admitted request holds an [`InFlight`] guard until its stream ends.
//! Admission counts the request *before* it checks the phase, and draining sets the phase
//! *before* it reads the count, so a request racing a SIGTERM is either refused or waited for,
//! never admitted and then cut off when the process exits. `Closed` ends the streams that never
//! end on their own (WatchLoad), so the server can finish.

use std::{sync::Arc, time::Duration};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
};

use super::status::NodeError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// The model is loading: refuse with UNAVAILABLE, health NOT_SERVING.
    Loading,
    Serving,
    /// Refuse new work; in-flight requests run to their end (or the drain timeout).
    Draining,
    /// Every stream ends; the server stops.
    Closed,
}

pub struct Lifecycle {
    phase: watch::Sender<Phase>,
    in_flight: watch::Sender<usize>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle { phase: watch::Sender::new(Phase::Loading), in_flight: watch::Sender::new(0) }
    }
}

/// Held by an admitted request until its stream ends (or is dropped).
pub struct InFlight(Arc<Lifecycle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.send_modify(|n| *n -= 1);
    }
}

impl Lifecycle {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    pub fn watch(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Move forward to `to` (never back: a late "serving" cannot undo a drain).
    pub fn advance(&self, to: Phase) {
        self.phase.send_if_modified(|p| {
            let forward = to > *p;
            if forward {
                *p = to;
            }
            forward
        });
    }

    /// Admit one request, or say why not.
    pub fn admit(self: &Arc<Self>) -> Result<InFlight, NodeError> {
        // Count first, then look at the phase (see the module docs); the guard undoes the count
        // on refusal.
        self.in_flight.send_modify(|n| *n += 1);
        let guard = InFlight(self.clone());
        match self.phase() {
            Phase::Serving => Ok(guard),
            Phase::Loading => Err(NodeError::Loading),
            Phase::Draining | Phase::Closed => Err(NodeError::Draining),
        }
    }

    pub fn in_flight(&self) -> usize {
        *self.in_flight.borrow()
    }

    /// Wait until no request is in flight, at most `timeout`; returns how many still are.
    pub async fn wait_idle(&self, timeout: Duration) -> usize {
        let mut rx = self.in_flight.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|&n| n == 0)).await;
        self.in_flight()
    }

    /// Resolves once the node is closed (the server's shutdown signal).
    pub async fn closed(&self) {
        let mut rx = self.phase.subscribe();
        let _ = rx.wait_for(|&p| p == Phase::Closed).await;
    }
}

/// Where a node's stop requests come from: the process's own signals (`serve`), or the signals
/// a fleet's process received, handed to each of its nodes (`fleet`).
pub enum Stops {
    Signals(Signals),
    Fleet(watch::Receiver<Option<&'static str>>),
}

impl Stops {
    /// The next stop request; returns the signal's name.
    pub async fn next(&mut self) -> &'static str {
        match self {
            Stops::Signals(s) => s.next().await,
            Stops::Fleet(rx) => {
                // The fleet's process is going away when its sender is: stop too.
                let _ = rx.changed().await;
                rx.borrow_and_update().unwrap_or("SIGTERM")
            }
        }
    }
}

/// Listens for SIGTERM and SIGINT. Installed at start, so a signal while the model loads is
/// handled too rather than killing the process mid-write.
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    pub fn install() -> std::io::Result<Self> {
        Ok(Signals { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    /// The next SIGTERM or SIGINT; returns its name.
    pub async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_admitted_before_the_drain_is_waited_for_and_later_ones_are_refused() {
        let l = Lifecycle::new();
        assert!(matches!(l.admit(), Err(NodeError::Loading)));
        assert_eq!(l.in_flight(), 0, "a refusal leaves no count behind");
        l.advance(Phase::Serving);
        let guard = l.admit().expect("serving admits");
        l.advance(Phase::Draining);
        assert!(matches!(l.admit(), Err(NodeError::Draining)));
        assert_eq!(l.wait_idle(Duration::from_millis(20)).await, 1, "the admitted request is still running");
        drop(guard);
        assert_eq!(l.wait_idle(Duration::from_secs(5)).await, 0);
    }

    #[test]
    fn the_phase_never_moves_back() {
        let l = Lifecycle::new();
        l.advance(Phase::Draining);
        l.advance(Phase::Serving);
        assert_eq!(l.phase(), Phase::Draining);
    }
}
