//! What one process's ranks share (the world and every communicator split
//! from it): the progress thread, the job-wide error, and what became of
//! the other ranks — which connections ended, which ranks said they were
//! leaving, and how this rank leaves.
//!
//! A rank leaves in one of two ways, told to every other rank by a control
//! message sent before its endpoints close:
//! - **failed**: its job had an error (sent when it happened), or its
//!   communicator was dropped while its thread panicked: the failure
//!   notice makes every rank's pending and later calls fail at once;
//! - **left**: anything else (its owner's code finished, or returned an
//!   error the communicator never saw). Its calls are complete, so a rank
//!   still in its own last call needs nothing more from it; but a request
//!   to or from it that is still pending [`LEFT_GRACE`] after the notice
//!   will never end, and fails its call (and so the job) instead of
//!   waiting out the deadline.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config::UcxConfig;
use super::engine::Engine;
use super::region::Region;
use super::wire;
use crate::bootstrap::Store;
use crate::CommError;

/// The state one process's ranks share: the progress thread and the
/// job-wide abort (the world and every communicator split from it).
pub(crate) struct Job {
    pub(super) engine: Engine,
    pub(super) world_rank: usize,
    pub(super) world_size: usize,
    pub(super) store: Arc<dyn Store>,
    pub(super) config: UcxConfig,
    pub(super) timeout: Duration,
    pub(super) abort: Arc<AbortState>,
    /// What became of the other ranks' connections (see [`Peers`]).
    pub(super) peers: Arc<Peers>,
    /// The host key of each world rank (exchanged at `init`).
    pub(super) hosts: Vec<String>,
}

/// How long a rank waits for its control messages to leave.
const CONTROL_SEND_WAIT: Duration = Duration::from_secs(1);

/// How long after a connection to a rank ends its notice that it is leaving
/// may still arrive: it has left that rank before the endpoints close, but
/// may travel on another of the pair's connections than the one that ends
/// first. Short, as it delays the failure of every call waiting for a rank
/// that died (a launcher that notices first stops the ranks before they
/// can say why they failed).
pub(crate) const LEAVE_GRACE: Duration = Duration::from_millis(50);

/// How long a request to or from a rank that has left may still be pending
/// (counted from the notice, or from the start of the wait when that is
/// later) before it fails its call: what the rank sent before it left
/// arrives ahead of its notice, on the same endpoint, so a request still
/// pending well after it waits for what will never come.
pub(crate) const LEFT_GRACE: Duration = Duration::from_secs(2);

/// The other ranks' connections: which ended, and which ranks said they
/// were leaving. A rank that leaves sends the notice to every rank before
/// it closes its endpoints (`Job`'s drop); to UCX its closing looks like a
/// failure, and the ranks still in their own last call, needing nothing
/// more from it, must not fail. A connection that ends without a notice
/// within [`LEAVE_GRACE`] fails the job.
#[derive(Default)]
pub(crate) struct Peers {
    any_failed: AtomicBool,
    any_left: AtomicBool,
    state: Mutex<PeersState>,
}

#[derive(Default)]
struct PeersState {
    failed: Vec<(usize, ucx_rs::sys::ucs_status_t, Instant)>,
    left: Vec<(usize, Instant)>,
}

impl Peers {
    /// The connection to world rank `r` ended with `status`.
    pub(crate) fn failed(&self, r: usize, status: ucx_rs::sys::ucs_status_t) {
        if let Ok(mut s) = self.state.lock() {
            if !s.failed.iter().any(|(f, ..)| *f == r) {
                s.failed.push((r, status, Instant::now()));
            }
        }
        self.any_failed.store(true, Ordering::Release);
    }

    /// World rank `r` said it is leaving.
    pub(crate) fn left(&self, r: usize) {
        if let Ok(mut s) = self.state.lock() {
            if !s.left.iter().any(|(l, _)| *l == r) {
                s.left.push((r, Instant::now()));
            }
        }
        self.any_left.store(true, Ordering::Release);
    }

    /// When world rank `r` said it was leaving, if it did.
    pub(crate) fn left_at(&self, r: usize) -> Option<Instant> {
        if !self.any_left.load(Ordering::Acquire) {
            return None;
        }
        let s = self.state.lock().ok()?;
        s.left.iter().find(|(l, _)| *l == r).map(|(_, at)| *at)
    }

    /// The end of world rank `r`'s connection as an error, notice or not:
    /// for a request to or from `r` that failed (the call needed it).
    fn error_of(&self, r: usize) -> Option<CommError> {
        if !self.any_failed.load(Ordering::Acquire) && !self.any_left.load(Ordering::Acquire) {
            return None;
        }
        let s = self.state.lock().ok()?;
        if s.left.iter().any(|(l, _)| *l == r) {
            return Some(left_error(r, "a call that still needed it"));
        }
        let (r, status, _) = s.failed.iter().find(|(f, ..)| *f == r)?;
        Some(connection_failed(*r, *status))
    }

    /// A connection that ended at least [`LEAVE_GRACE`] ago without its
    /// rank's notice, as the job's error.
    fn unexplained(&self) -> Option<CommError> {
        if !self.any_failed.load(Ordering::Acquire) {
            return None;
        }
        let s = self.state.lock().ok()?;
        let (r, status, _) =
            s.failed.iter().find(|(r, _, at)| at.elapsed() >= LEAVE_GRACE && !s.left.iter().any(|(l, _)| l == r))?;
        Some(connection_failed(*r, *status))
    }
}

fn connection_failed(r: usize, status: ucx_rs::sys::ucs_status_t) -> CommError {
    CommError::Aborted { reason: format!("the connection to world rank {r} failed: {}", ucx_rs::status_string(status)) }
}

/// The error of `what`, which waits for world rank `r` after it left.
pub(crate) fn left_error(r: usize, what: &str) -> CommError {
    CommError::Aborted {
        reason: format!(
            "world rank {r} left the job (its program ended, or dropped its communicator, without reporting a \
             failure) while {what}"
        ),
    }
}

#[derive(Default)]
pub(crate) struct AbortState {
    flag: AtomicBool,
    error: Mutex<Option<CommError>>,
}

impl AbortState {
    /// Records `e` (the first wins); whether it was the first.
    pub(crate) fn set(&self, e: CommError) -> bool {
        let Ok(mut slot) = self.error.lock() else { return false };
        if slot.is_some() {
            return false;
        }
        *slot = Some(e);
        self.flag.store(true, Ordering::Release);
        true
    }
    fn get(&self) -> Option<CommError> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().ok().and_then(|e| e.clone())
    }
}

impl Job {
    /// The job's error: a failure reported by a rank, an abort, or a
    /// connection that ended without its rank's notice (then the job's).
    pub(crate) fn abort_error(&self) -> Option<CommError> {
        if let Some(e) = self.abort.get() {
            return Some(e);
        }
        self.abort.set(self.peers.unexplained()?);
        self.abort.get()
    }

    /// Why a request to or from world rank `r` failed, when its connection
    /// ended or the rank left.
    pub(crate) fn connection_error(&self, r: usize) -> Option<CommError> {
        self.peers.error_of(r)
    }

    /// Fails the job with `e` here and on every other rank (once: a later
    /// failure is not sent). Waits up to a second for the messages to leave.
    pub(crate) fn fail(&self, e: CommError) {
        if !self.abort.set(e.clone()) {
            return;
        }
        self.send_control(&wire::encode_failure(self.world_rank, &e));
    }

    /// Fails the job (here and on every rank) because this rank's owner
    /// failed outside the communicator: its thread is panicking.
    pub(crate) fn fail_if_panicking(&self) {
        if std::thread::panicking() {
            self.fail(CommError::Aborted {
                reason: format!("world rank {} failed outside the communicator (it panicked)", self.world_rank),
            });
        }
    }

    /// Sends a control message to every other rank; waits up to a second for them to leave.
    fn send_control(&self, msg: &[u8]) {
        let (ctag, _) = wire::control_match();
        let tag = ctag | (self.world_rank as u64 & 0xffff);
        let sent: Vec<_> = (0..self.world_size)
            .filter(|r| *r != self.world_rank)
            .filter_map(|r| self.engine.send(r, tag, Region::bytes(msg.to_vec())).ok())
            .collect();
        let deadline = Instant::now() + CONTROL_SEND_WAIT;
        for c in sent {
            while c.outcome().is_none() && Instant::now() < deadline {
                c.wait_for(Duration::from_millis(10));
            }
        }
    }
}

impl Drop for Job {
    /// Tells every other rank how this one leaves, before the engine closes
    /// the endpoints (so the connections' end is not taken for a failure):
    /// nothing more when the job already failed (the failure was sent), the
    /// failure when the last communicator goes while its thread panics,
    /// and otherwise that it is leaving (see the module doc). Waits up to a
    /// second for the notices to leave, as [`Job::fail`] does.
    fn drop(&mut self) {
        if self.abort.get().is_some() {
            return;
        }
        self.fail_if_panicking();
        if self.abort.get().is_some() {
            return;
        }
        self.send_control(&wire::encode_leaving(self.world_rank));
    }
}
