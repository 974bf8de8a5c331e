//! The user-facing communicator: validation once, then the backend.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use chorus_devices::{Backend, Buffer, Device, Stream, View};

use crate::backend::{Call, CallKind, Capabilities, CommBackend, Fingerprint, OpKind};
use crate::recorder::{self, CallMetas, CommRecord, RecorderOptions, Ring, RingInfo};
use crate::{CommError, ReduceOp, Result};

/// One rank's handle on a group of ranks that communicate.
///
/// # Contract
/// - Every call is **enqueued** on the caller's stream and returns at once;
///   it runs after the work enqueued on that stream before it, and work
///   enqueued after it runs after it. Order with other streams only through
///   events.
/// - **All ranks issue the same collectives in the same order**, with the
///   same dtype, count, root and reduce operator. Each call carries a
///   sequence number and a fingerprint; a backend that can check them (the
///   sim backend always does) fails the call on every rank with
///   [`CommError::Mismatch`] naming the differing calls, rather than hanging.
/// - Sizes and chunk order are NCCL's: the all-gather output is the ranks'
///   inputs in rank order; the reduce-scatter input is `size` equal chunks
///   and rank r keeps reduced chunk r; all-to-all sends chunk j to rank j.
/// - Arguments are validated here, before any backend sees the call: an
///   invalid call returns [`CommError::InvalidArgument`] and enqueues nothing.
///   Zero-length calls are valid (and still take part in the sequence).
/// - Failures while running (mismatch, timeout, abort) are asynchronous: they
///   fail the stream, and `CommError::from(stream.synchronize().unwrap_err())`
///   recovers them.
/// - Every launch is kept in the communicator's flight recorder (see
///   [`recorder`](crate::recorder)), on by default.
pub struct Communicator<C: CommBackend> {
    backend: C,
    seq: Mutex<u64>,
    recorder: Option<Arc<Ring<C::B>>>,
    splits: AtomicU64,
}

impl<C: CommBackend> std::fmt::Debug for Communicator<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator({} rank {}/{})", C::NAME, self.rank(), self.size())
    }
}

type V<'a, C> = View<'a, <C as CommBackend>::B>;
type S<C> = <<C as CommBackend>::B as Backend>::Stream;

impl<C: CommBackend> Communicator<C> {
    /// Wraps a backend endpoint, with the flight recorder the environment
    /// asks for ([`RecorderOptions::from_env`]).
    pub fn new(backend: C) -> Self {
        Communicator::with_recorder(backend, &RecorderOptions::from_env())
    }

    /// Wraps a backend endpoint, with a flight recorder per `options`; the
    /// communicator is named `root` in the dumps.
    pub fn with_recorder(backend: C, options: &RecorderOptions) -> Self {
        let info = RingInfo {
            id: "root".into(),
            owner_rank: backend.rank(),
            world_size: backend.size(),
            rank: backend.rank(),
            size: backend.size(),
            backend: C::NAME,
            device: backend.device().name(),
        };
        let recorder = Ring::start(info, options);
        Communicator { backend, seq: Mutex::new(0), recorder, splits: AtomicU64::new(0) }
    }

    /// The flight recorder's ring of this communicator as it stands now
    /// (the states read from the devices' events at this call); `None` when
    /// recording is off.
    pub fn flight_record(&self) -> Option<CommRecord> {
        self.recorder.as_deref().map(recorder::snapshot)
    }

    /// Writes this rank's flight-recorder dump now (every communicator of the
    /// rank with the same dump directory), saying `reason`; the file, or
    /// `None` when recording is off or there is no dump directory.
    pub fn dump_flight_record(&self, reason: &str) -> std::io::Result<Option<std::path::PathBuf>> {
        match self.recorder.as_deref() {
            Some(ring) => recorder::dump_now(ring, reason),
            None => Ok(None),
        }
    }
    /// This rank, in `0..size`.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.backend.size()
    }
    /// The device of this rank.
    pub fn device(&self) -> &<C::B as Backend>::Device {
        self.backend.device()
    }
    /// What the backend can do.
    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }
    /// The backend endpoint.
    pub fn backend(&self) -> &C {
        &self.backend
    }
    /// Unwraps the backend endpoint (to wrap it in another backend, say).
    pub fn into_backend(self) -> C {
        self.backend
    }

    fn launch(&self, calls: Vec<PendingCall<'_, C>>, stream: &S<C>) -> Result<()> {
        let op = if calls.len() == 1 { calls[0].kind.kind().name() } else { "group" };
        if !stream.device().is_same(self.device()) {
            return Err(CommError::invalid(
                op,
                format!("the stream is of {}, not of this rank's {}", stream.device().name(), self.device().name()),
            ));
        }
        if let [PendingCall { kind: CallKind::Send { peer, .. } | CallKind::Recv { peer, .. }, .. }] = calls.as_slice()
        {
            if *peer == self.rank() {
                return Err(CommError::invalid(op, "a send or recv with oneself outside a group can never complete"));
            }
        }
        let mut seq = self.seq.lock().map_err(|_| CommError::invalid("launch", "communicator lock poisoned"))?;
        let mut next = *seq;
        let calls: Vec<Call<'_, C::B>> = calls
            .into_iter()
            .map(|p| {
                let s = next;
                if p.kind.kind() != OpKind::Send && p.kind.kind() != OpKind::Recv {
                    next += 1;
                }
                Call { seq: s, fingerprint: p.fingerprint, kind: p.kind }
            })
            .collect();
        let Some(ring) = self.recorder.as_deref() else {
            self.backend.launch(calls, stream)?;
            *seq = next;
            return Ok(());
        };
        let metas = CallMetas::of(&calls);
        let start = ring.before_launch(stream);
        if let Err(e) = self.backend.launch(calls, stream) {
            // A backend error at issue is recorded (and dumped) like one
            // the stream reports later.
            ring.refused(metas, start, &e);
            return Err(e);
        }
        ring.launched(metas, start, stream);
        *seq = next;
        Ok(())
    }

    fn one(&self, kind: CallKind<'_, C::B>, stream: &S<C>) -> Result<()> {
        let call = validate::<C>(self.rank(), self.size(), self.device(), kind)?;
        self.launch(vec![call], stream)
    }

    /// `recv = op(send of every rank)`; `send` and `recv` have equal lengths
    /// and are the same range or disjoint.
    pub fn all_reduce(&self, send: V<'_, C>, recv: V<'_, C>, op: ReduceOp, stream: &S<C>) -> Result<()> {
        self.one(CallKind::AllReduce { send, recv, op }, stream)
    }
    /// In-place all-reduce of `buf`.
    pub fn all_reduce_in_place(&self, buf: V<'_, C>, op: ReduceOp, stream: &S<C>) -> Result<()> {
        self.all_reduce(buf, buf, op, stream)
    }
    /// `recv` (size × `send.len()`) = every rank's `send`, in rank order.
    pub fn all_gather(&self, send: V<'_, C>, recv: V<'_, C>, stream: &S<C>) -> Result<()> {
        self.one(CallKind::AllGather { send, recv }, stream)
    }
    /// In-place all-gather: this rank's input is chunk `rank` of `buf`.
    pub fn all_gather_in_place(&self, buf: V<'_, C>, stream: &S<C>) -> Result<()> {
        let send = buf.chunk(self.rank(), self.size()).map_err(|e| CommError::invalid("all_gather", e.to_string()))?;
        self.all_gather(send, buf, stream)
    }
    /// `recv` = chunk `rank` of `op(send of every rank)`; `send` is size × `recv.len()`.
    pub fn reduce_scatter(&self, send: V<'_, C>, recv: V<'_, C>, op: ReduceOp, stream: &S<C>) -> Result<()> {
        self.one(CallKind::ReduceScatter { send, recv, op }, stream)
    }
    /// In-place reduce-scatter: the result lands in chunk `rank` of `buf`.
    pub fn reduce_scatter_in_place(&self, buf: V<'_, C>, op: ReduceOp, stream: &S<C>) -> Result<()> {
        let recv =
            buf.chunk(self.rank(), self.size()).map_err(|e| CommError::invalid("reduce_scatter", e.to_string()))?;
        self.reduce_scatter(buf, recv, op, stream)
    }
    /// `recv` = `send` of `root` on every rank (`send` is read on the root only).
    pub fn broadcast(&self, send: V<'_, C>, recv: V<'_, C>, root: usize, stream: &S<C>) -> Result<()> {
        self.one(CallKind::Broadcast { send, recv, root }, stream)
    }
    /// In-place broadcast of `buf` from `root`.
    pub fn broadcast_in_place(&self, buf: V<'_, C>, root: usize, stream: &S<C>) -> Result<()> {
        self.broadcast(buf, buf, root, stream)
    }
    /// `recv` of `root` = `op(send of every rank)`; `recv` elsewhere is untouched.
    pub fn reduce(&self, send: V<'_, C>, recv: V<'_, C>, op: ReduceOp, root: usize, stream: &S<C>) -> Result<()> {
        self.one(CallKind::Reduce { send, recv, op, root }, stream)
    }
    /// In-place reduce of `buf` to `root`.
    pub fn reduce_in_place(&self, buf: V<'_, C>, op: ReduceOp, root: usize, stream: &S<C>) -> Result<()> {
        self.reduce(buf, buf, op, root, stream)
    }
    /// Chunk `j` of `send` goes to rank `j`, landing in chunk `rank` of its `recv`.
    pub fn all_to_all(&self, send: V<'_, C>, recv: V<'_, C>, stream: &S<C>) -> Result<()> {
        self.one(CallKind::AllToAll { send, recv }, stream)
    }
    /// Sends `buf` to `peer`, which must post a matching `recv`. Outside a
    /// group, a send blocks its stream until the peer receives.
    pub fn send(&self, buf: V<'_, C>, peer: usize, stream: &S<C>) -> Result<()> {
        self.one(CallKind::Send { buf, peer }, stream)
    }
    /// Receives into `buf` from `peer`.
    pub fn recv(&self, buf: V<'_, C>, peer: usize, stream: &S<C>) -> Result<()> {
        self.one(CallKind::Recv { buf, peer }, stream)
    }
    /// Every rank's stream reaches this point before any continues.
    pub fn barrier(&self, stream: &S<C>) -> Result<()> {
        self.one(CallKind::Barrier, stream)
    }

    /// Issues the calls that `build` adds as one group (NCCL's
    /// `ncclGroupStart`/`ncclGroupEnd`): they are validated as they are added,
    /// then enqueued together on `stream` and may progress concurrently, so
    /// paired sends and receives cannot deadlock. If `build` or any
    /// validation fails, nothing is enqueued.
    pub fn group<'a>(&self, stream: &S<C>, build: impl FnOnce(&mut Group<'a, C>) -> Result<()>) -> Result<()> {
        let mut g = Group { rank: self.rank(), size: self.size(), device: self.device().clone(), calls: Vec::new() };
        build(&mut g)?;
        if g.calls.is_empty() {
            return Ok(());
        }
        self.launch(g.calls, stream)
    }

    /// Splits into sub-communicators by `color` (ranks ordered by `key`, then
    /// rank); `None` takes no part and gets `None`. Every rank must call it.
    /// Its flight recorder is named after this one's (`root/split0:color1`).
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator<C>>> {
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        Ok(self.backend.split(color, key)?.map(|backend| {
            let recorder = self.recorder.as_ref().and_then(|r| {
                r.child(n, color.unwrap_or(u32::MAX), backend.rank(), backend.size(), backend.device().name())
            });
            Communicator { backend, seq: Mutex::new(0), recorder, splits: AtomicU64::new(0) }
        }))
    }

    /// Aborts the communicator; see [`CommBackend::abort`]. The flight
    /// recorder dumps (when it has a directory).
    pub fn abort(&self, reason: &str) {
        if let Some(ring) = &self.recorder {
            ring.aborted(reason);
        }
        self.backend.abort(reason)
    }

    /// The asynchronous error that made this communicator unusable, if any.
    pub fn async_error(&self) -> Option<CommError> {
        self.backend.async_error()
    }
}

/// Calls collected for one group; see [`Communicator::group`].
pub struct Group<'a, C: CommBackend> {
    rank: usize,
    size: usize,
    device: <C::B as Backend>::Device,
    calls: Vec<PendingCall<'a, C>>,
}

struct PendingCall<'a, C: CommBackend> {
    fingerprint: Fingerprint,
    kind: CallKind<'a, C::B>,
}

impl<'a, C: CommBackend> Group<'a, C> {
    fn add(&mut self, kind: CallKind<'a, C::B>) -> Result<()> {
        self.calls.push(validate::<C>(self.rank, self.size, &self.device, kind)?);
        Ok(())
    }
    /// Adds an all-reduce.
    pub fn all_reduce(&mut self, send: V<'a, C>, recv: V<'a, C>, op: ReduceOp) -> Result<()> {
        self.add(CallKind::AllReduce { send, recv, op })
    }
    /// Adds an all-gather.
    pub fn all_gather(&mut self, send: V<'a, C>, recv: V<'a, C>) -> Result<()> {
        self.add(CallKind::AllGather { send, recv })
    }
    /// Adds a reduce-scatter.
    pub fn reduce_scatter(&mut self, send: V<'a, C>, recv: V<'a, C>, op: ReduceOp) -> Result<()> {
        self.add(CallKind::ReduceScatter { send, recv, op })
    }
    /// Adds a broadcast.
    pub fn broadcast(&mut self, send: V<'a, C>, recv: V<'a, C>, root: usize) -> Result<()> {
        self.add(CallKind::Broadcast { send, recv, root })
    }
    /// Adds a reduce.
    pub fn reduce(&mut self, send: V<'a, C>, recv: V<'a, C>, op: ReduceOp, root: usize) -> Result<()> {
        self.add(CallKind::Reduce { send, recv, op, root })
    }
    /// Adds an all-to-all.
    pub fn all_to_all(&mut self, send: V<'a, C>, recv: V<'a, C>) -> Result<()> {
        self.add(CallKind::AllToAll { send, recv })
    }
    /// Adds a send.
    pub fn send(&mut self, buf: V<'a, C>, peer: usize) -> Result<()> {
        self.add(CallKind::Send { buf, peer })
    }
    /// Adds a receive.
    pub fn recv(&mut self, buf: V<'a, C>, peer: usize) -> Result<()> {
        self.add(CallKind::Recv { buf, peer })
    }
}

fn check_len(op: &'static str, what: &str, expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(CommError::invalid(op, format!("{what} has {found} elements, expected {expected}")));
    }
    Ok(())
}

fn check_rank(op: &'static str, what: &str, r: usize, size: usize) -> Result<()> {
    if r >= size {
        return Err(CommError::invalid(op, format!("{what} {r} is out of range for {size} ranks")));
    }
    Ok(())
}

/// Same range, or disjoint: the only aliasing NCCL defines.
fn check_alias<B: Backend>(op: &'static str, a: &View<'_, B>, b: &View<'_, B>, in_place: &View<'_, B>) -> Result<()> {
    if a.overlaps(b) && !a.same_range(in_place) {
        return Err(CommError::invalid(
            op,
            format!("send {a:?} and recv {b:?} overlap but are not the in-place layout ({in_place:?})"),
        ));
    }
    Ok(())
}

fn validate<'a, C: CommBackend>(
    rank: usize,
    size: usize,
    device: &<C::B as Backend>::Device,
    kind: CallKind<'a, C::B>,
) -> Result<PendingCall<'a, C>> {
    let op = kind.kind().name();
    for v in kind.views() {
        if !v.buffer().device().is_same(device) {
            return Err(CommError::invalid(
                op,
                format!("a buffer of {} was passed to a communicator on {}", v.buffer().device().name(), device.name()),
            ));
        }
    }
    let fp = |dtype, count, root, reduce: Option<ReduceOp>| Fingerprint {
        op: kind.kind(),
        dtype,
        count,
        root,
        reduce: reduce.map(|r| r.name()),
    };
    let same_dtype = |a: &View<'_, C::B>, b: &View<'_, C::B>| {
        if a.dtype() != b.dtype() {
            return Err(CommError::invalid(op, format!("send is {} but recv is {}", a.dtype(), b.dtype())));
        }
        Ok(())
    };
    let check_reduce = |r: &ReduceOp, dtype: chorus_devices::DType| match r {
        _ if !dtype.is_reducible() => Err(CommError::invalid(
            op,
            format!("{dtype} buffers are only moved, never reduced (no arithmetic on float8)"),
        )),
        ReduceOp::PreMulSum(s) if !s.is_finite() => Err(CommError::invalid(op, format!("scalar {s} is not finite"))),
        _ => Ok(()),
    };
    let fingerprint = match &kind {
        CallKind::AllReduce { send, recv, op: r } => {
            same_dtype(send, recv)?;
            check_reduce(r, send.dtype())?;
            check_len(op, "recv", send.len(), recv.len())?;
            check_alias(op, send, recv, recv)?;
            fp(send.dtype(), send.len(), None, Some(*r))
        }
        CallKind::AllGather { send, recv } => {
            same_dtype(send, recv)?;
            let total = send.len().checked_mul(size).ok_or_else(|| CommError::invalid(op, "size overflows"))?;
            check_len(op, "recv (size × send)", total, recv.len())?;
            if send.overlaps(recv) {
                let own = recv.chunk(rank, size).map_err(|e| CommError::invalid(op, e.to_string()))?;
                check_alias(op, send, recv, &own)?;
            }
            fp(send.dtype(), send.len(), None, None)
        }
        CallKind::ReduceScatter { send, recv, op: r } => {
            same_dtype(send, recv)?;
            check_reduce(r, send.dtype())?;
            let total = recv.len().checked_mul(size).ok_or_else(|| CommError::invalid(op, "size overflows"))?;
            check_len(op, "send (size × recv)", total, send.len())?;
            if send.overlaps(recv) {
                let own = send.chunk(rank, size).map_err(|e| CommError::invalid(op, e.to_string()))?;
                if !recv.same_range(&own) {
                    return Err(CommError::invalid(op, "recv overlaps send but is not chunk `rank` of it"));
                }
            }
            fp(send.dtype(), recv.len(), None, Some(*r))
        }
        CallKind::Broadcast { send, recv, root } => {
            same_dtype(send, recv)?;
            check_rank(op, "root", *root, size)?;
            check_len(op, "recv", send.len(), recv.len())?;
            check_alias(op, send, recv, recv)?;
            fp(send.dtype(), send.len(), Some(*root), None)
        }
        CallKind::Reduce { send, recv, op: r, root } => {
            same_dtype(send, recv)?;
            check_reduce(r, send.dtype())?;
            check_rank(op, "root", *root, size)?;
            check_len(op, "recv", send.len(), recv.len())?;
            check_alias(op, send, recv, recv)?;
            fp(send.dtype(), send.len(), Some(*root), Some(*r))
        }
        CallKind::AllToAll { send, recv } => {
            same_dtype(send, recv)?;
            check_len(op, "recv", send.len(), recv.len())?;
            if send.len() % size != 0 {
                return Err(CommError::invalid(op, format!("{} elements do not split into {size} chunks", send.len())));
            }
            if send.overlaps(recv) {
                return Err(CommError::invalid(op, "send and recv must not overlap"));
            }
            fp(send.dtype(), send.len(), None, None)
        }
        CallKind::Send { buf, peer } | CallKind::Recv { buf, peer } => {
            check_rank(op, "peer", *peer, size)?;
            fp(buf.dtype(), buf.len(), Some(*peer), None)
        }
        CallKind::Barrier => fp(chorus_devices::DType::U8, 0, None, None),
    };
    Ok(PendingCall { fingerprint, kind })
}
