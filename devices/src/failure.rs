//! Sticky stream failures that only the host can see, written once.
//!
//! A GPU reports a device fault through the driver, but some failures exist
//! only on the host: a collective aborted by its watchdog, a host function
//! that could not copy. Each GPU stream keeps a [`StreamState`]: how many
//! operations it has enqueued, the first failure and the position it applies
//! from, and the streams it waited on (so an event recorded after a wait on
//! a failed stream reports the failure, as on the cpu device).
//!
//! The state holds no driver handle and its locks are never held across a
//! wait, so host functions may consult it (they must not call the driver;
//! see [`crate::host_fn`]) and dropping it never calls the driver.

use std::fmt;
use std::sync::Arc;

use crate::DeviceError;

/// Fails a stream from a given operation on, from any thread, without keeping
/// the stream alive: what a collective's watchdog holds.
#[derive(Clone)]
pub struct FailureHandle {
    name: String,
    fail: Arc<dyn Fn(u64, DeviceError) + Send + Sync>,
}

impl fmt::Debug for FailureHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FailureHandle({})", self.name)
    }
}

impl FailureHandle {
    pub(crate) fn new(name: String, fail: Arc<dyn Fn(u64, DeviceError) + Send + Sync>) -> FailureHandle {
        FailureHandle { name, fail }
    }

    /// Fails the operation at `position` (as returned when it was enqueued)
    /// with `error`: it and every later operation report the error (later
    /// ones as `Poisoned`) and later work is skipped. The first failure sticks.
    pub fn fail(&self, position: u64, error: DeviceError) {
        (self.fail)(position, error)
    }

    /// The stream's name.
    pub fn stream_name(&self) -> &str {
        &self.name
    }
}

/// The error a wait on work enqueued after a failure reports.
pub(crate) fn poisoned(e: &DeviceError) -> DeviceError {
    match e {
        DeviceError::Poisoned { .. } => e.clone(),
        other => DeviceError::Poisoned { cause: Box::new(other.clone()) },
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) use gpu::{LastRecord, StreamState};

#[cfg(any(feature = "cuda", feature = "rocm"))]
mod gpu {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, Weak};

    use super::{poisoned, FailureHandle};
    use crate::DeviceError;

    /// How many waited-on streams a stream remembers; older ones are dropped
    /// first (their failures are then no longer propagated).
    const MAX_UPSTREAM: usize = 256;
    /// How deep failure propagation follows chains of waits.
    const MAX_DEPTH: usize = 16;

    /// One GPU stream's host-side progress and failure.
    #[derive(Debug)]
    pub(crate) struct StreamState {
        pub(crate) name: String,
        /// Operations enqueued so far (the next one's position is this + 1).
        position: AtomicU64,
        /// Everything up to here completed without error, as a host wait saw.
        synced_upto: AtomicU64,
        /// The first failure and the position it applies from.
        failure: Mutex<Option<(u64, DeviceError)>>,
        /// (stream waited on, its position at the record, our position at the wait).
        upstream: Mutex<Vec<(Weak<StreamState>, u64, u64)>>,
    }

    impl StreamState {
        pub(crate) fn new(name: String) -> Arc<StreamState> {
            Arc::new(StreamState {
                name,
                position: AtomicU64::new(0),
                synced_upto: AtomicU64::new(0),
                failure: Mutex::new(None),
                upstream: Mutex::new(Vec::new()),
            })
        }

        pub(crate) fn position(&self) -> u64 {
            self.position.load(Ordering::Acquire)
        }

        /// Counts one enqueued operation and returns its position.
        pub(crate) fn advance(&self) -> u64 {
            self.position.fetch_add(1, Ordering::AcqRel) + 1
        }

        /// Fails the operation at `at` and everything after it; an earlier failure sticks.
        pub(crate) fn fail(&self, at: u64, e: DeviceError) {
            if let Ok(mut f) = self.failure.lock() {
                match &*f {
                    Some((p, _)) if *p <= at => {}
                    _ => *f = Some((at, e)),
                }
            }
        }

        /// This stream's own failure, whatever its position.
        pub(crate) fn own_failure(&self) -> Option<DeviceError> {
            self.failure.lock().ok().and_then(|f| f.as_ref().map(|(_, e)| e.clone()))
        }

        /// The failure that affects work up to position `upto`: this stream's
        /// own, or (as `Poisoned`) one of a stream it waited for before `upto`.
        pub(crate) fn failure_at(&self, upto: u64) -> Option<DeviceError> {
            self.failure_depth(upto, 0)
        }

        fn failure_depth(&self, upto: u64, depth: usize) -> Option<DeviceError> {
            if let Some((p, e)) = self.failure.lock().ok().and_then(|f| f.clone()) {
                if p <= upto {
                    return Some(e);
                }
            }
            if depth >= MAX_DEPTH {
                return None;
            }
            let entries: Vec<_> = match self.upstream.lock() {
                Ok(u) => u.iter().filter(|(_, _, at)| *at <= upto).cloned().collect(),
                Err(_) => Vec::new(),
            };
            entries.into_iter().find_map(|(w, their, _)| {
                let s = w.upgrade()?;
                s.failure_depth(their, depth + 1).map(|e| poisoned(&e))
            })
        }

        /// Records that operation `ours` of this stream waited for `stream` up to `their`.
        pub(crate) fn add_upstream(&self, stream: &Arc<StreamState>, their: u64, ours: u64) {
            if let Ok(mut u) = self.upstream.lock() {
                // Entries whose work a host wait saw complete cannot fail any more.
                u.retain(|(w, q, _)| w.upgrade().is_some_and(|s| *q > s.synced_upto.load(Ordering::Acquire)));
                if u.len() >= MAX_UPSTREAM {
                    u.remove(0);
                }
                u.push((Arc::downgrade(stream), their, ours));
            }
        }

        /// A host wait saw everything up to `upto` complete without error.
        pub(crate) fn mark_synced(&self, upto: u64) {
            self.synced_upto.fetch_max(upto, Ordering::AcqRel);
        }

        pub(crate) fn failure_handle(self: &Arc<StreamState>) -> FailureHandle {
            let state = self.clone();
            FailureHandle::new(self.name.clone(), Arc::new(move |at, e| state.fail(at, e)))
        }
    }

    /// Where an event was last recorded: the recording stream (held weakly,
    /// so an event does not keep a dropped stream's state) and the record's
    /// position on it. What an event's waits and queries check for failures.
    #[derive(Debug, Default)]
    pub(crate) struct LastRecord(Mutex<Option<(Weak<StreamState>, u64)>>);

    impl LastRecord {
        /// The event was just recorded at `position` of `stream`.
        pub(crate) fn set(&self, stream: &Arc<StreamState>, position: u64) {
            if let Ok(mut r) = self.0.lock() {
                *r = Some((Arc::downgrade(stream), position));
            }
        }

        /// The stream and position of the latest record, if the stream lives.
        pub(crate) fn get(&self) -> Option<(Arc<StreamState>, u64)> {
            let r = self.0.lock().ok()?;
            let (w, pos) = r.as_ref()?;
            Some((w.upgrade()?, *pos))
        }
    }
}
