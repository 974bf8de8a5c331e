//! The flight recorder: every communicator's last launches, dumped when
//! something goes wrong, so that a hang explains itself.
//!
//! Each [`Communicator`](crate::Communicator) keeps a ring of its last N
//! launches (N = [`RecorderOptions::entries`], on by default): the calls with
//! their sequence numbers, operations, dtypes, counts and bytes, reduce
//! operators, roots and peers; the communicator (its name, rank and size);
//! the launch's [`CallState`] and timestamps. It is written once, in the
//! backend-neutral layer: every backend's launches pass through
//! `Communicator::launch`, which records an event on the caller's stream
//! just before handing the calls to the backend and one just after. The
//! states are read from those events (see [`CallState`]), so they mean the
//! same on `sim`, `simnccl`, `ucx`, `nccl` and `rccl`: the device, not the
//! host, says when the stream reached a call and when it finished.
//!
//! One process-wide thread (`monitor.rs`) polls the events of unfinished
//! launches (every [`POLL_INTERVAL`]; a launch's started and finished times
//! are when it saw them) and writes the dumps:
//! - the first time a launch fails (a timeout, a mismatch, an abort, any
//!   backend error) or a communicator is aborted, every ring that shares
//!   that communicator's dump directory is written, one JSON file per rank
//!   ([`RankDump`], named by rank and host), once per directory;
//! - on SIGTERM, SIGINT or SIGUSR1 (when the process had left them at their
//!   default action), every ring is written again (`signals.rs`): the
//!   handler only notes the signal, a thread writes the dumps, waiting at
//!   most [`DUMP_WAIT`], then lets SIGTERM and SIGINT end the process as
//!   they would have. SIGUSR1 without a dump directory says that nothing
//!   was written; the process goes on.
//!
//! Every dump names its run: the run id (`TORCHELASTIC_RUN_ID`) and the
//! run's start, which `chorus launch` gives every rank ([`RUN_STARTED_VAR`]),
//! so `chorus trace` can tell two runs' dumps in one directory apart.
//!
//! Dumps go to [`RecorderOptions::dump_dir`] (`CHORUS_TRACE_DIR`); without
//! one the ring is kept (and readable through
//! [`Communicator::flight_record`](crate::Communicator::flight_record)) but
//! nothing is written. `chorus launch` gives its ranks a directory, and
//! `chorus trace DIR` reads every rank's dump and names the rank and call
//! that diverged.

mod dump;
mod monitor;
mod options;
mod signals;
pub use monitor::host_name;
pub use options::{RecorderOptions, DEFAULT_ENTRIES, DIR_VAR, ENTRIES_VAR, MAX_ENTRIES, POLL_INTERVAL, STARTS_VAR};
pub use signals::{answer_ending_signals, DUMP_WAIT};

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use chorus_devices::{Backend, Device, Event, Stream};

pub use dump::{
    CallRecord, CallState, CommRecord, EntryRecord, RankDump, FORMAT_VERSION, MAX_WORLD_SIZE, RUN_STARTED_VAR,
    SIGNAL_REASON,
};

use dump::epoch_us;

use crate::backend::{Call, Fingerprint, OpKind};
use crate::CommError;

/// One call of a launch, as the ring keeps it (converted to a
/// [`CallRecord`] only when dumped, so recording allocates little); taken
/// before the backend consumes the call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallMeta {
    seq: Option<u64>,
    fingerprint: Fingerprint,
}

impl CallMeta {
    pub(crate) fn of<B: Backend>(call: &Call<'_, B>) -> CallMeta {
        let p2p = matches!(call.fingerprint.op, OpKind::Send | OpKind::Recv);
        CallMeta { seq: (!p2p).then_some(call.seq), fingerprint: call.fingerprint }
    }

    fn record(&self) -> CallRecord {
        let f = &self.fingerprint;
        let p2p = matches!(f.op, OpKind::Send | OpKind::Recv);
        CallRecord {
            op: f.op.name().to_string(),
            seq: self.seq,
            dtype: f.dtype.name().to_string(),
            count: f.count as u64,
            bytes: (f.count as u64).saturating_mul(f.dtype.size() as u64),
            reduce: f.reduce.map(str::to_string),
            root: if p2p { None } else { f.root.map(|r| r as u64) },
            peer: if p2p { f.root.map(|r| r as u64) } else { None },
        }
    }
}

/// The calls of one launch: one inline (the common case, no allocation),
/// or a group's.
#[derive(Clone, Debug)]
pub(crate) enum CallMetas {
    One(CallMeta),
    Group(Box<[CallMeta]>),
}

impl CallMetas {
    pub(crate) fn of<B: Backend>(calls: &[Call<'_, B>]) -> CallMetas {
        match calls {
            [one] => CallMetas::One(CallMeta::of(one)),
            calls => CallMetas::Group(calls.iter().map(CallMeta::of).collect()),
        }
    }

    fn as_slice(&self) -> &[CallMeta] {
        match self {
            CallMetas::One(c) => std::slice::from_ref(c),
            CallMetas::Group(calls) => calls,
        }
    }

    /// The launch's description (`all_reduce #3`, `group of 4`).
    fn describe(&self) -> String {
        match self.as_slice() {
            [c] => match c.seq {
                Some(s) => format!("{} #{s}", c.fingerprint.op.name()),
                None => c.fingerprint.op.name().to_string(),
            },
            calls => format!("group of {}", calls.len()),
        }
    }
}

struct Slot<B: Backend> {
    id: u64,
    calls: CallMetas,
    state: CallState,
    enqueued: Instant,
    started: Option<Instant>,
    finished: Option<Instant>,
    error: Option<String>,
    start: Option<B::Event>,
    end: Option<B::Event>,
}

impl<B: Backend> Slot<B> {
    /// Reads the slot's events; returns the error when it has just failed.
    fn poll(&mut self, now: Instant) -> Option<String> {
        let fail = |slot: &mut Slot<B>, e: chorus_devices::DeviceError| {
            let error = CommError::from(e).to_string();
            slot.state = CallState::Failed;
            slot.finished = Some(now);
            slot.error = Some(error.clone());
            Some(error)
        };
        if self.state == CallState::Enqueued {
            match self.start.as_ref().map(Event::query) {
                Some(Ok(true)) => {
                    self.state = CallState::Started;
                    self.started = Some(now);
                }
                Some(Ok(false)) => return None,
                Some(Err(e)) => return fail(self, e),
                // No start event (it could not be made): only the end tells.
                None => {}
            }
        }
        if matches!(self.state, CallState::Enqueued | CallState::Started) {
            match self.end.as_ref().map(Event::query) {
                Some(Ok(true)) => {
                    self.state = CallState::Completed;
                    self.finished = Some(now);
                }
                Some(Ok(false)) | None => {}
                Some(Err(e)) => return fail(self, e),
            }
        }
        None
    }

    fn record(&self) -> EntryRecord {
        EntryRecord {
            id: self.id,
            calls: self.calls.as_slice().iter().map(CallMeta::record).collect(),
            state: self.state,
            enqueued_us: epoch_us(self.enqueued),
            started_us: self.started.map(epoch_us),
            finished_us: self.finished.map(epoch_us),
            error: self.error.clone(),
        }
    }

    fn op(&self) -> String {
        self.calls.describe()
    }
}

struct RingState<B: Backend> {
    slots: VecDeque<Slot<B>>,
    /// Every slot before this index is completed or failed: the monitor
    /// polls from here, so its time under the lock (which every launch
    /// takes) grows with the launches in flight, not with the ring.
    open_from: usize,
    /// Events of dropped slots, recorded again by later launches.
    spare: Vec<B::Event>,
    launches: u64,
    aborted: Option<String>,
    /// A reason to dump not yet taken by the monitor (an abort).
    trigger: Option<String>,
}

/// Who a ring belongs to: the communicator's name and place.
#[derive(Clone, Debug)]
pub(crate) struct RingInfo {
    pub(crate) id: String,
    /// Rank in the root communicator (the dump's file is per root rank).
    pub(crate) owner_rank: usize,
    pub(crate) world_size: usize,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) backend: &'static str,
    pub(crate) device: String,
}

/// One communicator's ring of launches.
pub(crate) struct Ring<B: Backend> {
    info: RingInfo,
    capacity: usize,
    dir: Option<PathBuf>,
    track_starts: bool,
    state: Mutex<RingState<B>>,
}

/// Spare events kept per ring (more are dropped).
const SPARE_EVENTS: usize = 64;

impl<B: Backend> Ring<B> {
    /// A ring per `options`, followed by the recorder's thread; `None` when
    /// recording is off.
    pub(crate) fn start(info: RingInfo, options: &RecorderOptions) -> Option<Arc<Ring<B>>> {
        if options.entries == 0 {
            return None;
        }
        let capacity = options.entries.min(MAX_ENTRIES);
        let ring = Arc::new(Ring {
            info,
            capacity,
            dir: options.dump_dir.clone(),
            track_starts: options.track_starts,
            state: Mutex::new(RingState {
                slots: VecDeque::with_capacity(capacity.min(DEFAULT_ENTRIES)),
                open_from: 0,
                spare: Vec::new(),
                launches: 0,
                aborted: None,
                trigger: None,
            }),
        });
        let watched: Arc<dyn monitor::Watched> = ring.clone();
        // The dump signals are answered once a ring has a dump directory
        // (SIGUSR1 either way: without one, by saying that nothing was
        // written), and only while the recorder's thread runs: without it
        // nobody would answer them, and they keep their default actions.
        if monitor::register(Arc::downgrade(&watched)) {
            signals::install(ring.dir.is_some());
        }
        Some(ring)
    }

    /// A ring for a communicator split from this one (`n`-th split, `color`).
    pub(crate) fn child(&self, n: u64, color: u32, rank: usize, size: usize, device: String) -> Option<Arc<Ring<B>>> {
        let info =
            RingInfo { id: format!("{}/split{n}:color{color}", self.info.id), rank, size, device, ..self.info.clone() };
        let options =
            RecorderOptions { entries: self.capacity, dump_dir: self.dir.clone(), track_starts: self.track_starts };
        Ring::start(info, &options)
    }

    /// An event recorded on `stream` now: a spare one (from a launch that
    /// left the ring) when there is one, else a new one.
    fn event(spare: &mut Vec<B::Event>, stream: &B::Stream) -> Option<B::Event> {
        let event = match spare.pop() {
            Some(e) => e,
            None => stream.device().create_event().ok()?,
        };
        stream.record(&event).ok()?;
        Some(event)
    }

    /// Records the event that tells when `stream` reaches the launch; call
    /// just before handing the calls to the backend.
    pub(crate) fn before_launch(&self, stream: &B::Stream) -> Option<B::Event> {
        if !self.track_starts {
            return None;
        }
        let mut s = self.state.lock().ok()?;
        Self::event(&mut s.spare, stream)
    }

    /// Records a launch the backend accepted, with the event that tells
    /// when it has finished. One lock, one clock read, no allocation once
    /// the ring is full (the end event is recorded under the lock: an event
    /// record is itself a few atomic operations on the cpu device, one
    /// `cuEventRecord` on a GPU).
    pub(crate) fn launched(&self, calls: CallMetas, start: Option<B::Event>, stream: &B::Stream) {
        let Ok(mut s) = self.state.lock() else { return };
        let s = &mut *s;
        let evicted = self.make_room(s);
        let mut spare = evicted.into_iter().flatten();
        let end = match spare.next() {
            Some(e) => stream.record(&e).ok().map(|()| e),
            None => Self::event(&mut s.spare, stream),
        };
        for e in spare {
            if s.spare.len() < SPARE_EVENTS {
                s.spare.push(e);
            }
        }
        Self::push(s, calls, CallState::Enqueued, None, start, end);
    }

    /// Records a launch the backend refused at issue (the error went back
    /// to the caller, nothing was enqueued) as failed; like any backend
    /// error, it makes the monitor dump.
    pub(crate) fn refused(&self, calls: CallMetas, start: Option<B::Event>, error: &CommError) {
        let error = error.to_string();
        let op = calls.describe();
        let Ok(mut s) = self.state.lock() else { return };
        let s = &mut *s;
        for e in self.make_room(s).into_iter().flatten() {
            if s.spare.len() < SPARE_EVENTS {
                s.spare.push(e);
            }
        }
        Self::push(s, calls, CallState::Failed, Some(error.clone()), start, None);
        s.trigger.get_or_insert_with(|| format!("{op} of communicator {} failed at issue: {error}", self.info.id));
    }

    /// Drops the oldest launch when the ring is full; its events, for reuse.
    fn make_room(&self, s: &mut RingState<B>) -> [Option<B::Event>; 2] {
        if s.slots.len() < self.capacity {
            return [None, None];
        }
        match s.slots.pop_front() {
            Some(old) => {
                s.open_from = s.open_from.saturating_sub(1);
                [old.end, old.start]
            }
            None => [None, None],
        }
    }

    /// Adds a launch to the ring (which has room).
    fn push(
        s: &mut RingState<B>,
        calls: CallMetas,
        state: CallState,
        error: Option<String>,
        start: Option<B::Event>,
        end: Option<B::Event>,
    ) {
        let now = Instant::now();
        let finished = (state == CallState::Failed).then_some(now);
        let slot = Slot { id: s.launches, calls, state, enqueued: now, started: None, finished, error, start, end };
        s.launches += 1;
        s.slots.push_back(slot);
    }

    /// Notes that the communicator was aborted; the monitor dumps.
    pub(crate) fn aborted(&self, reason: &str) {
        if let Ok(mut s) = self.state.lock() {
            if s.aborted.is_none() {
                s.aborted = Some(reason.to_string());
                s.trigger = Some(format!("abort of communicator {}: {reason}", self.info.id));
            }
        }
    }
}

impl<B: Backend> monitor::Watched for Ring<B> {
    fn poll(&self) -> Option<String> {
        let now = Instant::now();
        let Ok(mut s) = self.state.lock() else { return None };
        let s = &mut *s;
        let mut reason = s.trigger.take();
        let from = s.open_from.min(s.slots.len());
        for slot in s.slots.range_mut(from..).filter(|s| matches!(s.state, CallState::Enqueued | CallState::Started)) {
            if let Some(error) = slot.poll(now) {
                reason.get_or_insert_with(|| format!("{} of communicator {} failed: {error}", slot.op(), self.info.id));
            }
        }
        let open = |slot: &Slot<B>| matches!(slot.state, CallState::Enqueued | CallState::Started);
        s.open_from = from + s.slots.range(from..).take_while(|slot| !open(slot)).count();
        reason
    }

    fn record(&self) -> CommRecord {
        let (entries, launches, aborted) = match self.state.lock() {
            Ok(s) => (s.slots.iter().map(Slot::record).collect(), s.launches, s.aborted.clone()),
            Err(_) => (Vec::new(), 0, Some("the ring's lock was poisoned".into())),
        };
        CommRecord {
            id: self.info.id.clone(),
            rank: self.info.rank as u64,
            size: self.info.size as u64,
            backend: self.info.backend.to_string(),
            device: self.info.device.clone(),
            capacity: self.capacity as u64,
            tracks_starts: self.track_starts,
            launches,
            aborted,
            entries,
        }
    }

    fn dir(&self) -> Option<&std::path::Path> {
        self.dir.as_deref()
    }

    fn owner(&self) -> (usize, usize) {
        (self.info.owner_rank, self.info.world_size)
    }

    fn requeue(&self, reason: String) {
        if let Ok(mut s) = self.state.lock() {
            s.trigger.get_or_insert(reason);
        }
    }
}

impl<B: Backend> Drop for Ring<B> {
    fn drop(&mut self) {
        use monitor::Watched;
        let last = self.dir.clone().map(|dir| {
            let trigger = self.poll();
            let record = self.record();
            monitor::Retired { dir, owner: self.owner(), record, trigger }
        });
        // The address the monitor's `Weak` points at (the ring inside its Arc).
        monitor::retire(self as *const Self as *const (), last);
    }
}

/// Answers SIGUSR1 from now on, as it is once a communicator exists (every
/// ring dumped, or a line saying nothing was written; the process goes on),
/// so that one sent while a program prepares its communicators (reading or
/// tokenizing data) does not end it by SIGUSR1's default action.
pub fn answer_signals() {
    signals::install(false)
}

/// Writes now the dumps that failures seen so far call for (what the
/// recorder's thread does at its next poll, and at process exit): for a
/// program that is about to end on an error it has just seen.
pub fn flush() {
    monitor::flush()
}

/// Polls `ring` and returns its record now (states as of this call).
pub(crate) fn snapshot<B: Backend>(ring: &Ring<B>) -> CommRecord {
    use monitor::Watched;
    // A failure seen here first is still dumped by the monitor.
    monitor::poll_aside(ring);
    ring.record()
}

/// Writes the dump of `ring`'s rank now (every ring of that rank with the
/// same dump directory); the file, or `None` without a directory.
pub(crate) fn dump_now<B: Backend>(ring: &Ring<B>, reason: &str) -> std::io::Result<Option<PathBuf>> {
    let Some(dir) = ring.dir.clone() else { return Ok(None) };
    monitor::write_rank(&dir, ring.info.owner_rank, reason).map(Some)
}

#[cfg(test)]
mod tests;
