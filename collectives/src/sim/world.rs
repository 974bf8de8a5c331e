//! The shared state of a simulated cluster: rendezvous slots, mailboxes, splits, abort.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use chorus_devices::cpu::RawRange;

use crate::backend::Fingerprint;
use crate::CommError;

/// What a fault does to the rank it is injected into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The call fails on that rank (a backend error), which aborts the world.
    Fail,
    /// The rank sleeps this long before arriving at the call.
    Stall(Duration),
}

/// A fault to inject: `rank`'s collective number `call` (0-based) misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The rank.
    pub rank: usize,
    /// The position in the communicator's collective sequence.
    pub call: u64,
    /// What happens.
    pub kind: FaultKind,
}

/// The abort state shared by a world and every communicator split from it:
/// one failing rank makes every rank of the job fail promptly.
#[derive(Debug, Default)]
pub(crate) struct AbortState {
    flag: AtomicBool,
    reason: Mutex<Option<CommError>>,
    worlds: Mutex<Vec<Weak<WorldShared>>>,
}

impl AbortState {
    pub(crate) fn error(&self) -> Option<CommError> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
        self.reason.lock().ok().and_then(|r| r.clone())
    }

    /// Records `reason` (the first one wins) and raises the flag, waking no
    /// one: for a caller that holds a world's lock, which calls
    /// [`AbortState::abort`] once it has released it.
    fn mark(&self, reason: CommError) {
        if let Ok(mut r) = self.reason.lock() {
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.flag.store(true, Ordering::Release);
    }

    /// Records `reason` (the first one wins) and wakes every waiter of every world.
    pub(crate) fn abort(&self, reason: CommError) {
        self.mark(reason);
        let worlds: Vec<_> =
            self.worlds.lock().map(|w| w.iter().filter_map(Weak::upgrade).collect()).unwrap_or_default();
        for w in worlds {
            // Take the lock so a waiter between its check and its wait is not missed.
            let _guard = w.state.lock();
            w.cv.notify_all();
        }
    }
}

pub(crate) struct Arrival {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) send: Option<RawRange>,
    pub(crate) recv: Option<RawRange>,
    pub(crate) scalar: f64,
}

enum SlotState {
    Gathering,
    Ready,
    Failed(CommError),
}

struct Slot {
    arrivals: Vec<Option<Arc<Arrival>>>,
    arrived: usize,
    finished: usize,
    state: SlotState,
}

/// A send posted to a mailbox, consumed by the matching recv.
pub(crate) struct Posted {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) data: RawRange,
    pub(crate) outcome: Mutex<Option<Result<(), CommError>>>,
}

/// The groups a split made: per color, the new world and its ranks' old ranks.
type SplitGroups = HashMap<u32, (Arc<WorldShared>, Vec<usize>)>;

struct SplitSlot {
    entries: Vec<Option<(Option<u32>, i64)>>,
    arrived: usize,
    taken: usize,
    result: Option<SplitGroups>,
}

#[derive(Default)]
pub(crate) struct WorldState {
    slots: HashMap<u64, Slot>,
    mailboxes: HashMap<(usize, usize), VecDeque<Arc<Posted>>>,
    splits: HashMap<u64, SplitSlot>,
    pub(crate) faults: Vec<Fault>,
}

/// One communicator's shared state (the world, or a group split from it).
pub(crate) struct WorldShared {
    pub(crate) size: usize,
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) abort: Arc<AbortState>,
    pub(crate) state: Mutex<WorldState>,
    pub(crate) cv: Condvar,
}

impl std::fmt::Debug for WorldShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimWorld({}, {} ranks)", self.name, self.size)
    }
}

fn poisoned() -> CommError {
    CommError::Backend { library: "sim", code: -1, message: "world state lock poisoned by a panic".into() }
}

impl WorldShared {
    pub(crate) fn new(size: usize, name: String, timeout: Duration, abort: Arc<AbortState>) -> Arc<WorldShared> {
        let w = Arc::new(WorldShared {
            size,
            name,
            timeout,
            abort: abort.clone(),
            state: Mutex::new(WorldState::default()),
            cv: Condvar::new(),
        });
        if let Ok(mut list) = abort.worlds.lock() {
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&w));
        }
        w
    }

    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, WorldState>, CommError> {
        self.state.lock().map_err(|_| poisoned())
    }

    /// Waits on the world's condition variable until `done` says so, the
    /// world is aborted, or `deadline` passes (`Ok(None)`).
    fn wait_until<'g, T>(
        &self,
        mut guard: MutexGuard<'g, WorldState>,
        deadline: Instant,
        mut done: impl FnMut(&mut WorldState) -> Option<T>,
    ) -> Result<(MutexGuard<'g, WorldState>, Option<T>), CommError> {
        loop {
            // Abort first: a failed world fails its waiters even if their
            // condition also happens to hold.
            if let Some(e) = self.abort.error() {
                return Err(e);
            }
            if let Some(v) = done(&mut guard) {
                return Ok((guard, Some(v)));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok((guard, None));
            }
            guard = self.cv.wait_timeout(guard, deadline - now).map_err(|_| poisoned())?.0;
        }
    }

    /// Rendezvous of collective `seq`: returns every rank's arrival once all
    /// have arrived with matching fingerprints.
    pub(crate) fn arrive(&self, seq: u64, rank: usize, arrival: Arrival) -> Result<Vec<Arc<Arrival>>, CommError> {
        if let Some(e) = self.abort.error() {
            return Err(e);
        }
        let n = self.size;
        let op = arrival.fingerprint.op.name();
        let mut st = self.lock()?;
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            arrivals: vec![None; n],
            arrived: 0,
            finished: 0,
            state: SlotState::Gathering,
        });
        slot.arrivals[rank] = Some(Arc::new(arrival));
        slot.arrived += 1;
        if slot.arrived == n {
            slot.state = match mismatch(&slot.arrivals) {
                Some(details) => SlotState::Failed(CommError::Mismatch { seq, details }),
                None => SlotState::Ready,
            };
            self.cv.notify_all();
        }
        let deadline = Instant::now() + self.timeout;
        let (mut st, outcome) = self.wait_until(st, deadline, |st| match st.slots.get(&seq).map(|s| &s.state) {
            Some(SlotState::Gathering) => None,
            Some(SlotState::Ready) => Some(Ok(())),
            Some(SlotState::Failed(e)) => Some(Err(e.clone())),
            None => Some(Err(CommError::invalid("collective", "rendezvous slot vanished"))),
        })?;
        match outcome {
            Some(Ok(())) => {
                let slot = st.slots.get(&seq).ok_or_else(|| CommError::invalid("collective", "slot vanished"))?;
                Ok(slot.arrivals.iter().flatten().cloned().collect())
            }
            Some(Err(e)) => {
                drop(st);
                self.abort.abort(e.clone());
                Err(e)
            }
            None => {
                let missing = st
                    .slots
                    .get(&seq)
                    .map(|s| (0..n).filter(|r| s.arrivals[*r].is_none()).collect())
                    .unwrap_or_default();
                let e = CommError::Timeout { op: op.to_string(), seq, waited: self.timeout, missing };
                // Raise the flag before the slot goes, under the lock: a peer
                // that wakes to find the slot gone must see the timeout, not
                // a vanished slot.
                self.abort.mark(e.clone());
                st.slots.remove(&seq);
                drop(st);
                self.abort.abort(e.clone());
                Err(e)
            }
        }
    }

    /// Exit of collective `seq`: returns when every rank has finished its
    /// part, so no rank reuses a buffer another is still reading or writing.
    pub(crate) fn depart(&self, seq: u64) -> Result<(), CommError> {
        let n = self.size;
        let mut st = self.lock()?;
        if let Some(slot) = st.slots.get_mut(&seq) {
            slot.finished += 1;
            if slot.finished == n {
                st.slots.remove(&seq);
                self.cv.notify_all();
                return Ok(());
            }
        }
        let deadline = Instant::now() + self.timeout;
        let (_st, done) = self.wait_until(st, deadline, |st| (!st.slots.contains_key(&seq)).then_some(()))?;
        match done {
            Some(()) => Ok(()),
            None => {
                let e = CommError::Timeout { op: "collective exit".into(), seq, waited: self.timeout, missing: vec![] };
                self.abort.abort(e.clone());
                Err(e)
            }
        }
    }

    /// Posts a send from `src` to `dst`.
    pub(crate) fn post(&self, src: usize, dst: usize, posted: Arc<Posted>) -> Result<(), CommError> {
        let mut st = self.lock()?;
        st.mailboxes.entry((src, dst)).or_default().push_back(posted);
        self.cv.notify_all();
        Ok(())
    }

    /// Waits until a posted send has been received.
    pub(crate) fn wait_consumed(&self, posted: &Posted, peer: usize) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        let st = self.lock()?;
        let (_st, outcome) = self.wait_until(st, deadline, |_| posted.outcome.lock().ok().and_then(|o| o.clone()))?;
        match outcome {
            Some(r) => r,
            None => {
                let e = CommError::Timeout { op: "send".into(), seq: 0, waited: self.timeout, missing: vec![peer] };
                self.abort.abort(e.clone());
                Err(e)
            }
        }
    }

    /// Takes the next send from `src` to `dst`, waiting for it.
    pub(crate) fn take(&self, src: usize, dst: usize) -> Result<Arc<Posted>, CommError> {
        let deadline = Instant::now() + self.timeout;
        let st = self.lock()?;
        let (_st, taken) =
            self.wait_until(st, deadline, |st| st.mailboxes.get_mut(&(src, dst)).and_then(|q| q.pop_front()))?;
        taken.ok_or_else(|| {
            let e = CommError::Timeout { op: "recv".into(), seq: 0, waited: self.timeout, missing: vec![src] };
            self.abort.abort(e.clone());
            e
        })
    }

    /// Marks a taken send as received (or failed) and wakes its sender.
    pub(crate) fn settle(&self, posted: &Posted, outcome: Result<(), CommError>) {
        if let Ok(mut o) = posted.outcome.lock() {
            *o = Some(outcome);
        }
        let _guard = self.state.lock();
        self.cv.notify_all();
    }

    /// Split rendezvous number `seq`: every rank contributes `(color, key)`;
    /// returns the new world and this rank's index in it.
    /// With `own_abort`, each new world gets its own abort state (an NCCL
    /// split child aborts independently of its parent); otherwise it shares
    /// this world's (the sim backend's world-wide abort).
    pub(crate) fn split(
        &self,
        seq: u64,
        rank: usize,
        color: Option<u32>,
        key: i64,
        own_abort: bool,
    ) -> Result<Option<(Arc<WorldShared>, usize)>, CommError> {
        if let Some(e) = self.abort.error() {
            return Err(e);
        }
        let n = self.size;
        let mut st = self.lock()?;
        let slot = st.splits.entry(seq).or_insert_with(|| SplitSlot {
            entries: vec![None; n],
            arrived: 0,
            taken: 0,
            result: None,
        });
        slot.entries[rank] = Some((color, key));
        slot.arrived += 1;
        if slot.arrived == n {
            let mut groups: HashMap<u32, Vec<(i64, usize)>> = HashMap::new();
            for (r, e) in slot.entries.iter().enumerate() {
                if let Some((Some(c), k)) = e {
                    groups.entry(*c).or_default().push((*k, r));
                }
            }
            let mut result = HashMap::new();
            for (c, mut members) in groups {
                members.sort();
                let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
                let name = format!("{}/split{seq}.color{c}", self.name);
                let abort = if own_abort { Arc::new(AbortState::default()) } else { self.abort.clone() };
                result.insert(c, (WorldShared::new(ranks.len(), name, self.timeout, abort), ranks));
            }
            slot.result = Some(result);
            self.cv.notify_all();
        }
        let deadline = Instant::now() + self.timeout;
        let (mut st, ready) =
            self.wait_until(st, deadline, |st| st.splits.get(&seq).and_then(|s| s.result.as_ref()).map(|_| ()))?;
        if ready.is_none() {
            let missing =
                st.splits.get(&seq).map(|s| (0..n).filter(|r| s.entries[*r].is_none()).collect()).unwrap_or_default();
            let e = CommError::Timeout { op: "split".into(), seq, waited: self.timeout, missing };
            drop(st);
            self.abort.abort(e.clone());
            return Err(e);
        }
        let slot = st.splits.get_mut(&seq).ok_or_else(|| CommError::invalid("split", "slot vanished"))?;
        let mine = color.and_then(|c| {
            slot.result.as_ref().and_then(|m| m.get(&c)).map(|(w, ranks)| {
                let idx = ranks.iter().position(|r| *r == rank).unwrap_or(0);
                (w.clone(), idx)
            })
        });
        slot.taken += 1;
        if slot.taken == n {
            st.splits.remove(&seq);
        }
        Ok(mine)
    }
}

/// Describes the disagreement among arrivals, if any: each distinct call with its ranks.
fn mismatch(arrivals: &[Option<Arc<Arrival>>]) -> Option<String> {
    let first = arrivals.iter().flatten().next()?.fingerprint;
    if arrivals.iter().flatten().all(|a| a.fingerprint == first) {
        return None;
    }
    let mut groups: Vec<(Fingerprint, Vec<usize>)> = Vec::new();
    for (r, a) in arrivals.iter().enumerate() {
        let Some(a) = a else { continue };
        match groups.iter_mut().find(|(f, _)| *f == a.fingerprint) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((a.fingerprint, vec![r])),
        }
    }
    let parts: Vec<String> = groups.iter().map(|(f, ranks)| format!("ranks {ranks:?} called {f}")).collect();
    Some(parts.join("; "))
}
