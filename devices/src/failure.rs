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
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, Weak};

    use super::{poisoned, FailureHandle};
    use crate::DeviceError;

    /// How many waited-on streams a stream remembers; older ones are dropped
    /// first (their failures are then no longer propagated).
    const MAX_UPSTREAM: usize = 256;

    /// Streams of this process that have ever failed. While none has, no
    /// stream can inherit a failure and the search through waits is skipped:
    /// the common case costs one atomic load.
    static FAILED_STREAMS: AtomicUsize = AtomicUsize::new(0);

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
                    _ => {
                        if f.is_none() {
                            FAILED_STREAMS.fetch_add(1, Ordering::AcqRel);
                        }
                        *f = Some((at, e))
                    }
                }
            }
        }

        /// This stream's own failure if it applies to work up to `upto`.
        fn own_failure_upto(&self, upto: u64) -> Option<DeviceError> {
            let f = self.failure.lock().ok()?;
            f.as_ref().filter(|(p, _)| *p <= upto).map(|(_, e)| e.clone())
        }

        /// This stream's own failure, whatever its position.
        pub(crate) fn own_failure(&self) -> Option<DeviceError> {
            self.failure.lock().ok().and_then(|f| f.as_ref().map(|(_, e)| e.clone()))
        }

        /// The failure that affects work up to position `upto`: this stream's
        /// own, or (as `Poisoned`) one of a stream it waited for before `upto`,
        /// directly or through other streams' waits.
        pub(crate) fn failure_at(&self, upto: u64) -> Option<DeviceError> {
            self.search_failure(upto).0
        }

        /// [`failure_at`](Self::failure_at) and how many waits it followed.
        ///
        /// The waits form a graph with cycles (FSDP's streams wait on one
        /// another every step), and a stream keeps up to [`MAX_UPSTREAM`]
        /// of them, so following every path is exponential: on an H100 a host
        /// function doing so stalled FSDP's streams for minutes (2026-11-25).
        /// A stream's waits up to a position include those up to any smaller
        /// one, so each stream is searched once per larger bound, and each wait
        /// followed at most once: linear in the waits held.
        pub(super) fn search_failure(&self, upto: u64) -> (Option<DeviceError>, usize) {
            if let Some(e) = self.own_failure_upto(upto) {
                return (Some(e), 0);
            }
            if FAILED_STREAMS.load(Ordering::Acquire) == 0 {
                return (None, 0);
            }
            // The largest bound each stream's waits were followed to.
            let mut searched: HashMap<*const StreamState, u64> = HashMap::new();
            searched.insert(self as *const StreamState, upto);
            let mut todo: Vec<(Arc<StreamState>, u64)> = Vec::new();
            let mut followed = 0;
            self.push_waits(upto, None, &mut todo, &mut followed);
            while let Some((s, bound)) = todo.pop() {
                if let Some(e) = s.own_failure_upto(bound) {
                    return (Some(poisoned(&e)), followed);
                }
                let before = searched.get(&Arc::as_ptr(&s)).copied();
                if before.is_some_and(|b| b >= bound) {
                    continue;
                }
                searched.insert(Arc::as_ptr(&s), bound);
                s.push_waits(bound, before, &mut todo, &mut followed);
            }
            (None, followed)
        }

        /// Pushes the streams this one waited for at positions in `(after, upto]`.
        fn push_waits(
            &self,
            upto: u64,
            after: Option<u64>,
            todo: &mut Vec<(Arc<StreamState>, u64)>,
            followed: &mut usize,
        ) {
            if let Ok(u) = self.upstream.lock() {
                for (w, their, at) in u.iter() {
                    if *at <= upto && after.is_none_or(|a| *at > a) {
                        if let Some(s) = w.upgrade() {
                            *followed += 1;
                            todo.push((s, *their));
                        }
                    }
                }
            }
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

        /// Whether work enqueued on this stream from now on starts after
        /// `other`'s operations up to `position` have finished: a host wait
        /// saw them finish, or this stream itself waited for a record of
        /// `other` made after them. What a stream-ordered free asks before
        /// making its owner wait for a user (`memory.rs`). Only direct waits
        /// are followed, so it may answer `false` where a chain of waits
        /// orders the two; never `true` where nothing does.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub(crate) fn follows(&self, other: &Arc<StreamState>, position: u64) -> bool {
            if other.synced_upto.load(Ordering::Acquire) >= position {
                return true;
            }
            let Ok(u) = self.upstream.lock() else { return false };
            u.iter().any(|(w, their, _)| *their > position && std::ptr::eq(w.as_ptr(), Arc::as_ptr(other)))
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

#[cfg(all(test, any(feature = "cuda", feature = "rocm")))]
mod tests {
    use std::sync::Arc;

    use super::gpu::StreamState;
    use crate::DeviceError;

    /// FSDP's four streams, each waiting on every other one at every step:
    /// the wait graph of the H100 run that stalled (every path of it is
    /// astronomically many; the waits held are 4 · 3 · steps at most).
    fn fsdp_like(steps: u64) -> Vec<Arc<StreamState>> {
        let streams: Vec<_> = (0..4).map(|i| StreamState::new(format!("s{i}"))).collect();
        for _ in 0..steps {
            for (i, s) in streams.iter().enumerate() {
                for (j, t) in streams.iter().enumerate() {
                    if i != j {
                        let theirs = t.advance();
                        let ours = s.advance();
                        s.add_upstream(t, theirs, ours);
                    }
                }
            }
        }
        streams
    }

    #[test]
    fn a_dense_wait_graph_is_searched_once_per_wait() {
        let streams = fsdp_like(100);
        let held: usize = 4 * 3 * 100;
        // Another stream's failure (not this one) forces the full search.
        let unrelated = StreamState::new("unrelated".into());
        unrelated.fail(1, DeviceError::invalid("test", "unrelated"));
        let (found, followed) = streams[0].search_failure(streams[0].position());
        assert!(found.is_none());
        assert!(followed <= held, "followed {followed} waits, {held} held");
    }

    #[test]
    fn a_failure_reaches_through_a_long_chain_of_waits() {
        // A chain longer than the old depth limit of 16.
        let chain: Vec<_> = (0..40).map(|i| StreamState::new(format!("c{i}"))).collect();
        let first = chain[0].advance();
        chain[0].fail(first, DeviceError::invalid("test", "the first"));
        for k in 1..chain.len() {
            let theirs = chain[k - 1].position();
            let ours = chain[k].advance();
            chain[k].add_upstream(&chain[k - 1], theirs, ours);
        }
        let last = chain.last().unwrap();
        match last.failure_at(last.position()) {
            Some(DeviceError::Poisoned { cause }) => assert!(cause.to_string().contains("the first")),
            other => panic!("expected Poisoned, got {other:?}"),
        }
        // Work before the wait is not affected.
        assert!(last.failure_at(0).is_none());
    }

    #[test]
    fn a_stream_follows_what_it_waited_for_and_what_a_host_wait_saw_finish() {
        let (owner, user) = (StreamState::new("owner".into()), StreamState::new("user".into()));
        let used = user.advance();
        assert!(!owner.follows(&user, used), "nothing orders them yet");
        // A record on `user` before the use, waited for: not enough.
        let ours = owner.advance();
        owner.add_upstream(&user, used - 1, ours);
        assert!(!owner.follows(&user, used));
        // A record after the use, waited for: the owner follows it.
        let record = user.advance();
        let ours = owner.advance();
        owner.add_upstream(&user, record, ours);
        assert!(owner.follows(&user, used));
        assert!(!owner.follows(&user, record), "the record itself is not before the wait's record");
        // A later use is not covered until a host wait sees it finish.
        let later = user.advance();
        assert!(!owner.follows(&user, later));
        user.mark_synced(later);
        assert!(owner.follows(&user, later));
    }

    #[test]
    fn a_failure_after_the_waited_position_does_not_propagate() {
        let streams = fsdp_like(3);
        let (a, b) = (&streams[0], &streams[1]);
        // b fails at a position later than any a waited for.
        let later = b.advance();
        b.fail(later, DeviceError::invalid("test", "late"));
        assert!(a.failure_at(a.position()).is_none());
        // a waits for it now: from that wait on, a is poisoned.
        let ours = a.advance();
        a.add_upstream(b, later, ours);
        assert!(a.failure_at(ours - 1).is_none());
        assert!(matches!(a.failure_at(ours), Some(DeviceError::Poisoned { .. })));
    }
}
