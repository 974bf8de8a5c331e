//! The launches a communicator has in flight, as the watchdog follows them:
//! each is recorded between two events on its stream; its deadline starts
//! when the stream reaches it, and an expired deadline or an asynchronous
//! error of the communicator aborts it (see [`super::watchdog`]).

use std::sync::{Arc, TryLockError};
use std::time::Instant;

use chorus_devices::{Backend, Device, Event, ForeignBackend, Stream};

use super::shared::{op_failed, Pending, Shared};
use super::sys::ncclComm_t;
use super::watchdog::{self, Watched};
use super::VendorLib;
use crate::{CommError, Result};

impl<L: VendorLib> Shared<L> {
    /// Follows a launch issued at `position` on `stream` after `start` was
    /// recorded there: records its end event and hands the communicator to
    /// the watchdog if it is not following it already.
    pub(super) fn watch_launch(
        self: &Arc<Self>,
        stream: &<L::B as Backend>::Stream,
        start: <L::B as Backend>::Event,
        position: u64,
        op: &'static str,
        seq: u64,
    ) -> Result<()> {
        let end = self.take_event()?;
        stream.record(&end).map_err(CommError::Device)?;
        let failure = L::B::failure_handle(stream);
        let register = {
            let mut p = self.pending.lock().map_err(|_| CommError::invalid(op, "lock poisoned"))?;
            p.launches.push(Pending { start, end, reached: None, failure, position, op, seq });
            !std::mem::replace(&mut p.watched, true)
        };
        if register {
            let watched: Arc<dyn Watched> = self.clone();
            watchdog::watch(&watched);
        }
        Ok(())
    }
}

impl<L: VendorLib> Shared<L> {
    /// An abort decided by the watchdog: the part that never blocks (the
    /// pending launches' streams fail with `reason`) runs here; the release
    /// of the handle, which waits for its lock and for the library, runs on
    /// a thread of its own, so a communicator whose lock is held (a blocking
    /// call in progress, a stuck `ncclCommAbort`) leaves every other one
    /// watched.
    fn abort_from_watchdog(self: Arc<Self>, reason: CommError) {
        self.begin_abort(reason);
        let releasing = self.clone();
        let spawned =
            std::thread::Builder::new().name("chorus-comm-abort".into()).spawn(move || releasing.release_aborted());
        if let Err(e) = spawned {
            // The handle is released by the drop instead (finalize fails on
            // an aborted communicator, and the drop aborts it then).
            let message = format!("the thread that aborts the communicator could not start: {e}");
            L::B::park(
                &self.device,
                op_failed("ncclCommAbort", &self.device.name(), CommError::invalid("abort", message)),
            );
        }
    }
}

impl<L: VendorLib> Watched for Shared<L> {
    fn poll(self: Arc<Self>) -> bool {
        let mut expired = None;
        let mut done = Vec::new();
        let still_pending = {
            // Never wait: a launch being registered or an abort taking the
            // list holds it for a moment; look again at the next poll.
            let mut p = match self.pending.try_lock() {
                Ok(p) => p,
                Err(TryLockError::WouldBlock) => return true,
                Err(TryLockError::Poisoned(_)) => return false,
            };
            let now = Instant::now();
            let timeout = self.config.timeout;
            let mut i = 0;
            while i < p.launches.len() {
                let l = &mut p.launches[i];
                // The end event first: a finished launch needs no other
                // query. A failed query means the stream failed at or before
                // the launch: reported there already, nothing left to watch.
                let mut finished = l.end.query().unwrap_or(true);
                if !finished && l.reached.is_none() {
                    match l.start.query() {
                        Ok(true) => l.reached = Some(now),
                        Ok(false) => {}
                        Err(_) => finished = true,
                    }
                }
                if finished {
                    let l = p.launches.swap_remove(i);
                    done.push(l);
                    continue;
                }
                if l.reached.is_some_and(|t| now.duration_since(t) >= timeout) && expired.is_none() {
                    expired =
                        Some(CommError::Timeout { op: l.op.to_string(), seq: l.seq, waited: timeout, missing: vec![] });
                }
                i += 1;
            }
            if p.launches.is_empty() {
                p.watched = false;
            }
            !p.launches.is_empty()
        };
        self.give_events(done.into_iter().flat_map(|l| [l.start, l.end]));
        if let Some(e) = expired {
            // The pending launches (the expired one first) report the timeout.
            self.abort_from_watchdog(e);
            return false;
        }
        if still_pending {
            // An asynchronous error (a peer that died, a network failure);
            // a handle in use is looked at in the next poll.
            let async_error = match self.handle.try_lock() {
                // SAFETY: the live handle under its lock.
                Ok(h) if !h.released => unsafe { self.lib.async_error(h.raw as ncclComm_t) }.err(),
                _ => None,
            };
            if let Some(e) = async_error {
                self.abort_from_watchdog(e);
                return false;
            }
        }
        still_pending
    }
}
