//! The collectives as sequences of tagged sends and receives, run by one
//! rank on its stream's executor thread.
//!
//! - **Small** calls (every rank's buffer at most [`UcxConfig::small_bytes`](super::UcxConfig))
//!   take one round of direct messages: all-reduce sends every rank's vector
//!   to every other rank, reduce-scatter sends chunk `j` to rank `j`,
//!   all-gather and broadcast send the input to every rank, reduce sends to
//!   the root; the receiver reduces **in rank order** 0..n−1 — the sim
//!   backend's order, so the results are bitwise the sim's.
//! - **Large** calls take the bandwidth-optimal ring: reduce-scatter in
//!   n−1 steps (chunk `j` is reduced starting at rank j+1 and going round
//!   to rank j, each rank adding its own input), all-gather in n−1 steps,
//!   all-reduce as both (chunks of `count/n`), reduce as the ring
//!   reduce-scatter and a gather to the root; broadcast is a pipelined chain
//!   from the root in segments. The ring's order is fixed, so every rank
//!   gets bitwise the same result, run after run, but float results can
//!   differ from the rank-order ones in the last bits.
//! - all-to-all is pairwise (round `k` sends to `rank + k` and receives
//!   from `rank − k`); a barrier is a dissemination barrier (⌈log2 n⌉
//!   rounds of empty messages).
//!
//! Every collective carries a **hello**: each rank sends the call's
//! sequence number and fingerprint to every other rank, posted with the
//! call's first data messages (no round trip of its own), and its first
//! wait checks every other rank's before it looks at any data. A rank that
//! sees a difference fails with `Mismatch` naming both calls (before a
//! differently sized message can be mistaken for data), and reports it to
//! every rank of the job; as every rank sees every call, all find it
//! themselves, none completes the call. Data may have moved by then; a
//! failed call's outputs are unspecified anyway. Worlds over
//! [`ALL_PAIRS_HELLO`] ranks check round the ring, before any data moves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_devices::cpu::RawRange;
use chorus_devices::DType;

use super::engine::{Completion, Engine, Region, Scratch, CANCEL_GRACE};
use super::hierarchy::{self, Ring};
use super::wire::{tag, Kind};
use super::{result, Core};
use crate::arith::{combine, finish, partial_op, share, start, with_element};
use crate::backend::OpKind;
use crate::{CommError, ReduceOp, Result};

/// How long a waiter sleeps between checks of the job's abort flag.
const SLICE: Duration = Duration::from_millis(10);

/// Segment of the pipelined broadcast chain.
const SEGMENT: usize = 1 << 20;

/// A call with its buffers resolved to raw memory.
pub(crate) struct Prepared {
    pub(crate) seq: u64,
    pub(crate) fingerprint: String,
    pub(crate) op: OpKind,
    pub(crate) dtype: DType,
    /// Elements per rank (the fingerprint's count).
    pub(crate) count: usize,
    pub(crate) reduce: ReduceOp,
    /// Root of broadcast/reduce, peer of send/recv (communicator ranks).
    pub(crate) root: usize,
    pub(crate) send: Option<RawRange>,
    pub(crate) recv: Option<RawRange>,
    /// The position of a send or receive among this pair's.
    pub(crate) p2p_no: u64,
}

/// One request in flight, and what it was for (for error messages).
/// Dropped before it has ended (a call that fails, or returns early through
/// `?` with requests still posted), it is cancelled and waited for, within
/// [`CANCEL_GRACE`]: a call never returns while UCX may still write into
/// (or read from) its buffers.
struct Req<'a> {
    done: Arc<Completion>,
    peer: usize,
    /// A receive: the bytes it must get.
    expect: Option<usize>,
    engine: &'a Engine,
    /// How long a cancel is waited for.
    grace: Duration,
}

impl Drop for Req<'_> {
    fn drop(&mut self) {
        if self.done.outcome().is_none() {
            self.engine.cancel_and_wait(&self.done, self.grace);
        }
    }
}

/// One call being run by one rank.
pub(crate) struct Exec<'a> {
    core: &'a Core,
    seq: u64,
    op: &'static str,
    /// The call's hello, posted and not yet checked (the first wait checks it).
    hello: std::cell::RefCell<Option<Hello<'a>>>,
}

/// A posted hello: this rank's fingerprint on its way to its peers, and
/// the receives of theirs.
struct Hello<'a> {
    /// The receive from each peer (in `peers`' order), then the sends.
    reqs: Vec<Req<'a>>,
    /// The ranks heard from; slot `i` of `inbox` is `peers[i]`'s.
    peers: Vec<usize>,
    inbox: Arc<Scratch>,
    mine: String,
}

/// Worlds up to this size exchange hellos between every pair of ranks,
/// posted with the data (one round, 2(n−1) small messages per rank): every
/// rank sees every other rank's call, so every rank finds a mismatch
/// itself, even one whose own part of the call needs nothing from the odd
/// rank. Larger worlds send one hello round the ring and wait for it
/// before any data moves (a round trip, cheaper there than 2(n−1)
/// messages): a rank that sees a difference then withholds its data, so
/// nobody completes the call before the report reaches it.
const ALL_PAIRS_HELLO: usize = 16;

/// Largest hello (a fingerprint is far shorter).
const HELLO_BYTES: usize = 512;

fn missing(what: &str) -> CommError {
    CommError::invalid("ucx", format!("the call has no {what} buffer"))
}

/// Elements as typed slices of raw memory.
///
/// # Safety
/// `ptr` is valid and aligned for `len` elements of `T`, and nothing else
/// accesses them while the slice lives.
unsafe fn slice_mut<'s, T>(ptr: *mut u8, len: usize) -> &'s mut [T] {
    // SAFETY: per the caller.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) }
}

/// # Safety
/// As [`slice_mut`], with readers only.
unsafe fn slice<'s, T>(ptr: *const u8, len: usize) -> &'s [T] {
    // SAFETY: per the caller.
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

fn scalar_of(op: ReduceOp) -> f64 {
    match op {
        ReduceOp::PreMulSum(s) => s,
        _ => 1.0,
    }
}

/// `acc = own contribution` (`x`, scaled for a pre-multiplied sum).
fn start_raw(dtype: DType, acc: *mut u8, x: *const u8, len: usize, op: ReduceOp) {
    // SAFETY: callers pass disjoint, live, aligned ranges of `len` elements.
    with_element!(dtype, T => unsafe { start::<T>(slice_mut(acc, len), slice(x, len), op, scalar_of(op)) });
}

/// `acc = acc ⊕ x` where `x` is this rank's own input.
fn combine_own(dtype: DType, acc: *mut u8, x: *const u8, len: usize, op: ReduceOp) {
    // SAFETY: as in `start_raw`.
    with_element!(dtype, T => unsafe { combine::<T>(slice_mut(acc, len), slice(x, len), op, scalar_of(op)) });
}

/// `acc = acc ⊕ partial` where `partial` is already scaled.
fn combine_partial(dtype: DType, acc: *mut u8, partial: *const u8, len: usize, op: ReduceOp) {
    // SAFETY: as in `start_raw`.
    with_element!(dtype, T => unsafe { combine::<T>(slice_mut(acc, len), slice(partial, len), partial_op(op), 1.0) });
}

fn finish_raw(dtype: DType, acc: *mut u8, len: usize, op: ReduceOp, n: usize) {
    // SAFETY: as in `start_raw`.
    with_element!(dtype, T => unsafe { finish::<T>(slice_mut(acc, len), op, n) });
}

pub(crate) fn copy_raw(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes == 0 || std::ptr::eq(src, dst) {
        return;
    }
    // SAFETY: callers pass live ranges of `bytes` that are equal or disjoint.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) }
}

impl<'a> Exec<'a> {
    pub(crate) fn new(core: &'a Core, seq: u64, op: &'static str) -> Exec<'a> {
        Exec { core, seq, op, hello: std::cell::RefCell::new(None) }
    }

    pub(crate) fn core(&self) -> &'a Core {
        self.core
    }

    fn n(&self) -> usize {
        self.core.size
    }
    fn me(&self) -> usize {
        self.core.rank
    }

    fn req(&self, done: Arc<Completion>, peer: usize, expect: Option<usize>) -> Req<'a> {
        let grace = CANCEL_GRACE.min(self.core.job.timeout);
        Req { done, peer, expect, engine: &self.core.job.engine, grace }
    }

    fn send(&self, peer: usize, kind: Kind, region: Region) -> Result<Req<'a>> {
        let world_peer = self.core.world_rank(peer)?;
        let t = tag(kind, self.core.id, self.seq, self.core.world_rank(self.me())?);
        Ok(self.req(self.core.job.engine.send(world_peer, t, region)?, peer, None))
    }

    fn recv(&self, peer: usize, kind: Kind, region: Region) -> Result<Req<'a>> {
        let t = tag(kind, self.core.id, self.seq, self.core.world_rank(peer)?);
        let expect = Some(region.len());
        Ok(self.req(self.core.job.engine.recv(t, u64::MAX, region)?, peer, expect))
    }

    /// A receive whose length may be shorter than the region (a small message).
    fn recv_upto(&self, peer: usize, kind: Kind, region: Region) -> Result<Req<'a>> {
        let mut r = self.recv(peer, kind, region)?;
        r.expect = None;
        Ok(r)
    }

    /// One ring step: `out` to `to` and `into` from `from`, each in
    /// segments of at most [`SEGMENT`] bytes posted at once (one message
    /// when empty). Whole chunks as single messages leave a rate-limited
    /// link idle part of the time (32 MiB messages over TCP at 1 Gbit/s
    /// took 1.5x the link time; 1 MiB segments keep it busy).
    fn step(&self, to: usize, out: Region, from: usize, into: Region) -> Result<Vec<Req<'a>>> {
        let mut reqs = Vec::new();
        let parts =
            |len: usize| (0..len.div_ceil(SEGMENT).max(1)).map(move |i| (i * SEGMENT, SEGMENT.min(len - i * SEGMENT)));
        for (off, len) in parts(into.len()) {
            reqs.push(self.recv(from, Kind::Data, into.part(off, len)?)?);
        }
        for (off, len) in parts(out.len()) {
            reqs.push(self.send(to, Kind::Data, out.part(off, len)?)?);
        }
        Ok(reqs)
    }

    /// Waits for every request. A request that ends in error, the job's
    /// abort, or no request ending for a whole deadline fails the call; the
    /// requests still pending are then cancelled, and waited for as they
    /// are dropped (see [`Req`]).
    fn wait(&self, reqs: Vec<Req<'a>>) -> Result<Vec<usize>> {
        // The hello first: a mismatch is reported as one, whatever the data did.
        if let Err(e) = self.check_hello() {
            for r in &reqs {
                self.core.job.engine.cancel(&r.done);
            }
            return Err(e);
        }
        self.wait_reqs(reqs)
    }

    fn wait_reqs(&self, mut reqs: Vec<Req<'a>>) -> Result<Vec<usize>> {
        let mut lens = vec![0; reqs.len()];
        // The requests end in the order they are waited for: the next one's index.
        let mut next = 0;
        let timeout = self.core.job.timeout;
        let mut deadline = Instant::now() + timeout;
        // Every pending request is cancelled at once; dropping them waits for each.
        let fail = |reqs: &mut Vec<Req<'a>>, e: CommError| {
            for r in reqs.iter() {
                self.core.job.engine.cancel(&r.done);
            }
            reqs.clear();
            Err(e)
        };
        while next < reqs.len() {
            let i = next;
            match reqs[i].done.wait_for(SLICE) {
                Some(Ok(len)) => {
                    if let Some(expect) = reqs[i].expect {
                        if len != expect {
                            let e = CommError::Mismatch {
                                seq: self.seq,
                                details: format!(
                                    "{} #{}: rank {} sent {len} bytes where rank {} expected {expect}",
                                    self.op,
                                    self.seq,
                                    reqs[i].peer,
                                    self.me()
                                ),
                            };
                            return fail(&mut reqs, e);
                        }
                    }
                    lens[i] = len;
                    next += 1;
                    deadline = Instant::now() + timeout;
                }
                Some(Err(status)) => {
                    let peer = self.core.world_rank(reqs[i].peer).ok();
                    let ended = || peer.and_then(|w| self.core.job.connection_error(w));
                    let e = self.core.job.abort_error().or_else(ended).unwrap_or_else(|| {
                        if status == ucx_rs::sys::ucs_status_t_UCS_ERR_MESSAGE_TRUNCATED {
                            CommError::Mismatch {
                                seq: self.seq,
                                details: format!(
                                    "{} #{}: rank {} sent more bytes than rank {} expected",
                                    self.op,
                                    self.seq,
                                    reqs[i].peer,
                                    self.me()
                                ),
                            }
                        } else {
                            result::error(status, &format!("{} #{} with rank {}", self.op, self.seq, reqs[i].peer))
                        }
                    });
                    return fail(&mut reqs, e);
                }
                None => {
                    if let Some(e) = self.core.job.abort_error() {
                        return fail(&mut reqs, e);
                    }
                    if Instant::now() >= deadline {
                        let e = CommError::Timeout {
                            op: format!("{} (rank {} waiting for rank {})", self.op, self.me(), reqs[i].peer),
                            seq: self.seq,
                            waited: timeout,
                            missing: vec![],
                        };
                        return fail(&mut reqs, e);
                    }
                }
            }
        }
        Ok(lens)
    }

    /// Posts the call's hello: this rank's sequence number and fingerprint
    /// to its peers (every rank, or the next one in worlds over
    /// [`ALL_PAIRS_HELLO`]), and the receives of theirs. In small worlds the
    /// first [`wait`](Exec::wait) (or [`check_hello`](Exec::check_hello))
    /// compares them; in larger ones this does, before any data is posted.
    pub(crate) fn post_hello(&self, fingerprint: &str) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        if n == 1 {
            return Ok(());
        }
        let all_pairs = n <= ALL_PAIRS_HELLO;
        let (to, from): (Vec<usize>, Vec<usize>) = if all_pairs {
            ((1..n).map(|k| (me + k) % n).collect(), (1..n).map(|k| (me + n - k) % n).collect())
        } else {
            (vec![(me + 1) % n], vec![(me + n - 1) % n])
        };
        let mine = format!("#{} {fingerprint}", self.seq);
        let inbox = self.core.scratch(from.len() * HELLO_BYTES);
        let mut reqs = Vec::with_capacity(to.len() + from.len());
        for (i, peer) in from.iter().enumerate() {
            reqs.push(self.recv_upto(*peer, Kind::Hello, Region::scratch(&inbox, i * HELLO_BYTES, HELLO_BYTES)?)?);
        }
        // One copy of the fingerprint for every send.
        let message = Region::bytes(mine.clone().into_bytes());
        for peer in &to {
            reqs.push(self.send(*peer, Kind::Hello, message.clone())?);
        }
        *self.hello.borrow_mut() = Some(Hello { reqs, peers: from, inbox, mine });
        if all_pairs {
            Ok(())
        } else {
            self.check_hello()
        }
    }

    /// Waits for the posted hello (if any is unchecked) and compares every
    /// peer's call with this one's.
    pub(crate) fn check_hello(&self) -> Result<()> {
        let Some(h) = self.hello.borrow_mut().take() else { return Ok(()) };
        let lens = self.wait_reqs(h.reqs)?;
        let mut odd = None;
        for (i, peer) in h.peers.iter().enumerate() {
            // SAFETY: the receive has completed; nothing else writes its slot.
            let bytes = unsafe { slice::<u8>(h.inbox.ptr().add(i * HELLO_BYTES), lens[i].min(HELLO_BYTES)) };
            if bytes != h.mine.as_bytes() {
                odd = Some((*peer, String::from_utf8_lossy(bytes).into_owned()));
                break;
            }
        }
        self.core.give_back(h.inbox);
        match odd {
            None => Ok(()),
            Some((peer, theirs)) => Err(CommError::Mismatch {
                seq: self.seq,
                details: format!("rank {peer} called {theirs}; rank {} called {}", self.me(), h.mine),
            }),
        }
    }

    fn small(&self, bytes: usize) -> bool {
        bytes <= self.core.job.config.small_bytes
    }

    pub(crate) fn run(&self, c: &Prepared) -> Result<()> {
        self.post_hello(&c.fingerprint)?;
        self.run_algorithm(c)?;
        // A call whose algorithm never waited still checks its hello.
        self.check_hello()
    }

    fn run_algorithm(&self, c: &Prepared) -> Result<()> {
        let es = c.dtype.size();
        match c.op {
            OpKind::AllReduce => {
                let (send, recv) =
                    (c.send.as_ref().ok_or_else(|| missing("send"))?, c.recv.as_ref().ok_or_else(|| missing("recv"))?);
                if self.small(c.count * es) {
                    self.all_reduce_direct(c, send, recv)
                } else if let Some(lay) = &self.core.layout {
                    hierarchy::all_reduce(self, lay, c, send, recv)
                } else {
                    self.all_reduce_ring(c, send, recv)
                }
            }
            OpKind::ReduceScatter => {
                let (send, recv) =
                    (c.send.as_ref().ok_or_else(|| missing("send"))?, c.recv.as_ref().ok_or_else(|| missing("recv"))?);
                let chunks: Vec<(usize, usize)> = (0..self.n()).map(|j| (j * c.count, (j + 1) * c.count)).collect();
                if self.small(c.count * self.n() * es) {
                    self.reduce_scatter_direct(c, send, recv)
                } else if let Some(lay) = &self.core.layout {
                    hierarchy::reduce_scatter(self, lay, c, send, recv)
                } else {
                    let out = self.core.scratch(c.count * es);
                    let ring = Ring::all(self.n(), self.me());
                    self.ring_reduce_scatter(c, &ring, c.reduce, Some(self.n()), send, &chunks, &out)?;
                    copy_raw(out.ptr(), recv.ptr(), c.count * es);
                    self.core.give_back(out);
                    Ok(())
                }
            }
            OpKind::AllGather => {
                let (send, recv) =
                    (c.send.as_ref().ok_or_else(|| missing("send"))?, c.recv.as_ref().ok_or_else(|| missing("recv"))?);
                let chunks: Vec<(usize, usize)> = (0..self.n()).map(|j| (j * c.count, (j + 1) * c.count)).collect();
                let own = chunks[self.me()];
                copy_raw(send.ptr(), Region::user(recv, own.0 * es, (own.1 - own.0) * es)?.ptr(), (own.1 - own.0) * es);
                if self.small(c.count * self.n() * es) {
                    self.all_gather_direct(c, recv, &chunks)
                } else if let Some(lay) = &self.core.layout {
                    hierarchy::all_gather(self, lay, c, recv)
                } else {
                    self.ring_all_gather(c, &Ring::all(self.n(), self.me()), recv, &chunks)
                }
            }
            OpKind::Broadcast => {
                let recv = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
                if self.me() == c.root {
                    let send = c.send.as_ref().ok_or_else(|| missing("send"))?;
                    copy_raw(send.ptr(), recv.ptr(), c.count * es);
                }
                if self.small(c.count * es) {
                    self.broadcast_direct(c, recv)
                } else {
                    self.broadcast_chain(c, recv)
                }
            }
            OpKind::Reduce => {
                let send = c.send.as_ref().ok_or_else(|| missing("send"))?;
                if self.small(c.count * es) {
                    self.reduce_direct(c, send)
                } else {
                    self.reduce_ring(c, send)
                }
            }
            OpKind::AllToAll => {
                let (send, recv) =
                    (c.send.as_ref().ok_or_else(|| missing("send"))?, c.recv.as_ref().ok_or_else(|| missing("recv"))?);
                self.all_to_all_pairwise(c, send, recv)
            }
            OpKind::Barrier => self.barrier(),
            OpKind::Send | OpKind::Recv => Err(CommError::invalid("ucx", "a send or receive run as a collective")),
        }
    }

    /// This rank's contribution, scaled for a pre-multiplied sum, in scratch.
    fn own_contribution(&self, c: &Prepared, send: &RawRange, offset: usize, len: usize) -> Arc<Scratch> {
        let es = c.dtype.size();
        let s = self.core.scratch(len * es);
        // SAFETY (inside): offset + len is within the validated send buffer.
        start_raw(c.dtype, s.ptr(), unsafe { send.ptr().add(offset * es) }, len, c.reduce);
        s
    }

    /// Every rank's (scaled) vector to every rank; each reduces in rank order.
    fn all_reduce_direct(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me, es, len) = (self.n(), self.me(), c.dtype.size(), c.count);
        let bytes = len * es;
        let own = self.own_contribution(c, send, 0, len);
        let slots = self.core.scratch(n * bytes);
        let mut reqs = Vec::new();
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            reqs.push(self.recv(from, Kind::Data, Region::scratch(&slots, from * bytes, bytes)?)?);
            reqs.push(self.send(to, Kind::Data, Region::scratch(&own, 0, bytes)?)?);
        }
        self.wait(reqs)?;
        self.reduce_slots(c, own, 0, slots, bytes, recv.ptr())
    }

    /// Puts this rank's scaled vector (`bytes` from `own_offset` of `own`)
    /// into its slot of `slots`, where the other ranks' have arrived,
    /// reduces every rank's slot in rank order into `out`, and returns both
    /// scratches to the pool.
    fn reduce_slots(
        &self,
        c: &Prepared,
        own: Arc<Scratch>,
        own_offset: usize,
        slots: Arc<Scratch>,
        bytes: usize,
        out: *mut u8,
    ) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        copy_raw(
            Region::scratch(&own, own_offset, bytes)?.ptr(),
            Region::scratch(&slots, me * bytes, bytes)?.ptr(),
            bytes,
        );
        let len = bytes / c.dtype.size().max(1);
        let acc = slots.ptr();
        for j in 1..n {
            // SAFETY: slot j is inside the scratch (n × bytes).
            combine_partial(c.dtype, acc, unsafe { slots.ptr().add(j * bytes) }, len, c.reduce);
        }
        finish_raw(c.dtype, acc, len, c.reduce, n);
        copy_raw(acc, out, bytes);
        self.core.give_back(own);
        self.core.give_back(slots);
        Ok(())
    }

    /// Chunk `j` (scaled) to rank `j`; each reduces its chunk in rank order.
    fn reduce_scatter_direct(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me, es, len) = (self.n(), self.me(), c.dtype.size(), c.count);
        let bytes = len * es;
        let own = self.own_contribution(c, send, 0, n * len);
        let slots = self.core.scratch(n * bytes);
        let mut reqs = Vec::new();
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            reqs.push(self.recv(from, Kind::Data, Region::scratch(&slots, from * bytes, bytes)?)?);
            reqs.push(self.send(to, Kind::Data, Region::scratch(&own, to * bytes, bytes)?)?);
        }
        self.wait(reqs)?;
        self.reduce_slots(c, own, me * bytes, slots, bytes, recv.ptr())
    }

    /// The reduce-scatter over `ring` of `chunks` (element ranges of the
    /// input, one per ring position): the chunk of this rank's position,
    /// combined with `op` (`c.reduce` for own inputs, its partial operator
    /// for inputs that are partial results already), lands in `out`,
    /// finished (`Avg` divided) over `finish` ranks when given.
    #[allow(clippy::too_many_arguments)] // the ring, its operator and its finish are what the schedules vary
    pub(crate) fn ring_reduce_scatter(
        &self,
        c: &Prepared,
        ring: &Ring,
        op: ReduceOp,
        finish: Option<usize>,
        send: &RawRange,
        chunks: &[(usize, usize)],
        out: &Arc<Scratch>,
    ) -> Result<()> {
        let (n, me, es) = (ring.len(), ring.pos, c.dtype.size());
        let (next, prev) = (ring.next(), ring.prev());
        let len_of = |j: usize| chunks[j].1 - chunks[j].0;
        let own_ptr = |j: usize| unsafe { send.ptr().add(chunks[j].0 * es) } as *const u8;
        if n == 1 {
            start_raw(c.dtype, out.ptr(), own_ptr(0), len_of(0), op);
            if let Some(total) = finish {
                finish_raw(c.dtype, out.ptr(), len_of(0), c.reduce, total);
            }
            return Ok(());
        }
        let cmax = chunks.iter().map(|(lo, hi)| hi - lo).max().unwrap_or(0) * es;
        let bufs = [self.core.scratch(cmax), self.core.scratch(cmax)];
        // Step 0 sends this rank's own chunk `me − 1` (scaled: from scratch).
        let first = (me + n - 1) % n;
        let mut outgoing = if matches!(op, ReduceOp::PreMulSum(_)) {
            let s = self.own_contribution(c, send, chunks[first].0, len_of(first));
            Region::scratch(&s, 0, len_of(first) * es)?
        } else {
            Region::user(send, chunks[first].0 * es, len_of(first) * es)?
        };
        for k in 0..n - 1 {
            let incoming = (me + 2 * n - 2 - k) % n;
            let buf = &bufs[k % 2];
            let bytes = len_of(incoming) * es;
            self.wait(self.step(next, outgoing, prev, Region::scratch(buf, 0, bytes)?)?)?;
            combine_own(c.dtype, buf.ptr(), own_ptr(incoming), len_of(incoming), op);
            outgoing = Region::scratch(buf, 0, bytes)?;
        }
        let last = &bufs[(n - 2) % 2];
        if let Some(total) = finish {
            finish_raw(c.dtype, last.ptr(), len_of(me), c.reduce, total);
        }
        copy_raw(last.ptr(), out.ptr(), len_of(me) * es);
        drop(outgoing);
        let [a, b] = bufs;
        self.core.give_back(a);
        self.core.give_back(b);
        Ok(())
    }

    /// The ring reduce-scatter over `ring` of chunks of `len` elements whose
    /// own contributions are made by `own(j)` (chunk `j`, unscaled: `op`
    /// is a partial operator) when first needed: the first before the ring
    /// starts, each later one while the step before it is in flight, so
    /// making them (a reduction inside the host) overlaps the transfers.
    /// The result, finished over `finish` ranks when given, goes to `out`;
    /// the reductions are those of [`Exec::ring_reduce_scatter`], in its order.
    #[allow(clippy::too_many_arguments)] // as ring_reduce_scatter, with a producer for its input
    pub(crate) fn ring_reduce_scatter_produced(
        &self,
        c: &Prepared,
        ring: &Ring,
        op: ReduceOp,
        finish: Option<usize>,
        len: usize,
        own: &mut dyn FnMut(usize) -> Result<Arc<Scratch>>,
        out: &Arc<Scratch>,
    ) -> Result<()> {
        let (n, me, bytes) = (ring.len(), ring.pos, len * c.dtype.size());
        let first = own((me + n - 1) % n)?;
        let bufs = [self.core.scratch(bytes), self.core.scratch(bytes)];
        let mut outgoing = Region::scratch(&first, 0, bytes)?;
        for k in 0..n - 1 {
            let incoming = (me + 2 * n - 2 - k) % n;
            let buf = &bufs[k % 2];
            let reqs = self.step(ring.next(), outgoing, ring.prev(), Region::scratch(buf, 0, bytes)?)?;
            // On an error the step's requests are cancelled as they are dropped.
            let mine = own(incoming)?;
            self.wait(reqs)?;
            combine_own(c.dtype, buf.ptr(), mine.ptr(), len, op);
            self.core.give_back(mine);
            outgoing = Region::scratch(buf, 0, bytes)?;
        }
        let last = &bufs[(n.max(2) - 2) % 2];
        if n == 1 {
            copy_raw(first.ptr(), last.ptr(), bytes);
        }
        if let Some(total) = finish {
            finish_raw(c.dtype, last.ptr(), len, c.reduce, total);
        }
        copy_raw(last.ptr(), out.ptr(), bytes);
        drop(outgoing);
        let [a, b] = bufs;
        self.core.give_back(a);
        self.core.give_back(b);
        self.core.give_back(first);
        Ok(())
    }

    /// The all-gather over `ring` in place over `chunks` of `recv`, one per
    /// ring position (the chunk of this rank's position already there).
    pub(crate) fn ring_all_gather(
        &self,
        c: &Prepared,
        ring: &Ring,
        recv: &RawRange,
        chunks: &[(usize, usize)],
    ) -> Result<()> {
        let (n, me, es) = (ring.len(), ring.pos, c.dtype.size());
        let (next, prev) = (ring.next(), ring.prev());
        let region = |j: usize| Region::user(recv, chunks[j].0 * es, (chunks[j].1 - chunks[j].0) * es);
        for k in 0..n.saturating_sub(1) {
            let (out, inc) = ((me + n - k) % n, (me + 2 * n - k - 1) % n);
            self.wait(self.step(next, region(out)?, prev, region(inc)?)?)?;
        }
        Ok(())
    }

    fn all_gather_direct(&self, c: &Prepared, recv: &RawRange, chunks: &[(usize, usize)]) -> Result<()> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let region = |j: usize| Region::user(recv, chunks[j].0 * es, (chunks[j].1 - chunks[j].0) * es);
        let mut reqs = Vec::new();
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            reqs.push(self.recv(from, Kind::Data, region(from)?)?);
            reqs.push(self.send(to, Kind::Data, region(me)?)?);
        }
        self.wait(reqs).map(|_| ())
    }

    fn all_reduce_ring(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let chunks: Vec<(usize, usize)> = (0..n).map(|j| share(c.count, n, j)).collect();
        let out = self.core.scratch((chunks[me].1 - chunks[me].0) * es);
        let ring = Ring::all(n, me);
        self.ring_reduce_scatter(c, &ring, c.reduce, Some(n), send, &chunks, &out)?;
        // Every input chunk has been read (all steps waited): the in-place output can be written.
        copy_raw(out.ptr(), Region::user(recv, chunks[me].0 * es, 0)?.ptr(), (chunks[me].1 - chunks[me].0) * es);
        self.core.give_back(out);
        self.ring_all_gather(c, &ring, recv, &chunks)
    }

    fn broadcast_direct(&self, c: &Prepared, recv: &RawRange) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let bytes = c.count * c.dtype.size();
        let reqs = if me == c.root {
            (1..n)
                .map(|k| self.send((me + k) % n, Kind::Data, Region::user(recv, 0, bytes)?))
                .collect::<Result<Vec<_>>>()?
        } else {
            vec![self.recv(c.root, Kind::Data, Region::user(recv, 0, bytes)?)?]
        };
        self.wait(reqs).map(|_| ())
    }

    /// A chain from the root (root → root+1 → …), pipelined in segments:
    /// each rank forwards a segment as soon as it has it.
    fn broadcast_chain(&self, c: &Prepared, recv: &RawRange) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let bytes = c.count * c.dtype.size();
        let pos = (me + n - c.root) % n;
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let segments: Vec<(usize, usize)> =
            (0..bytes.div_ceil(SEGMENT)).map(|i| (i * SEGMENT, ((i + 1) * SEGMENT).min(bytes))).collect();
        let forward = pos + 1 < n;
        if pos == 0 {
            let reqs = segments
                .iter()
                .map(|(lo, hi)| self.send(next, Kind::Data, Region::user(recv, *lo, hi - lo)?))
                .collect::<Result<Vec<_>>>()?;
            return self.wait(reqs).map(|_| ());
        }
        let incoming = segments
            .iter()
            .map(|(lo, hi)| self.recv(prev, Kind::Data, Region::user(recv, *lo, hi - lo)?))
            .collect::<Result<Vec<_>>>()?;
        let mut sends = Vec::new();
        for (r, (lo, hi)) in incoming.into_iter().zip(&segments) {
            self.wait(vec![r])?;
            if forward {
                sends.push(self.send(next, Kind::Data, Region::user(recv, *lo, hi - lo)?)?);
            }
        }
        self.wait(sends).map(|_| ())
    }

    fn reduce_direct(&self, c: &Prepared, send: &RawRange) -> Result<()> {
        let (n, me, es, len) = (self.n(), self.me(), c.dtype.size(), c.count);
        let bytes = len * es;
        let own = self.own_contribution(c, send, 0, len);
        if me != c.root {
            self.wait(vec![self.send(c.root, Kind::Data, Region::scratch(&own, 0, bytes)?)?])?;
            self.core.give_back(own);
            return Ok(());
        }
        let recv = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
        let slots = self.core.scratch(n * bytes);
        let reqs = (0..n)
            .filter(|j| *j != me)
            .map(|j| self.recv(j, Kind::Data, Region::scratch(&slots, j * bytes, bytes)?))
            .collect::<Result<Vec<_>>>()?;
        self.wait(reqs)?;
        self.reduce_slots(c, own, 0, slots, bytes, recv.ptr())
    }

    /// The ring reduce-scatter, then every rank sends its reduced chunk to the root.
    fn reduce_ring(&self, c: &Prepared, send: &RawRange) -> Result<()> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let chunks: Vec<(usize, usize)> = (0..n).map(|j| share(c.count, n, j)).collect();
        let mine = (chunks[me].1 - chunks[me].0) * es;
        let out = self.core.scratch(mine);
        self.ring_reduce_scatter(c, &Ring::all(n, me), c.reduce, Some(n), send, &chunks, &out)?;
        if me != c.root {
            self.wait(vec![self.send(c.root, Kind::Data, Region::scratch(&out, 0, mine)?)?])?;
            self.core.give_back(out);
            return Ok(());
        }
        let recv = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
        let reqs = (0..n)
            .filter(|j| *j != me)
            .map(|j| self.recv(j, Kind::Data, Region::user(recv, chunks[j].0 * es, (chunks[j].1 - chunks[j].0) * es)?))
            .collect::<Result<Vec<_>>>()?;
        self.wait(reqs)?;
        copy_raw(out.ptr(), Region::user(recv, chunks[me].0 * es, 0)?.ptr(), mine);
        self.core.give_back(out);
        Ok(())
    }

    fn all_to_all_pairwise(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let bytes = c.count / n * c.dtype.size();
        copy_raw(Region::user(send, me * bytes, bytes)?.ptr(), Region::user(recv, me * bytes, bytes)?.ptr(), bytes);
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            let reqs = vec![
                self.recv(from, Kind::Data, Region::user(recv, from * bytes, bytes)?)?,
                self.send(to, Kind::Data, Region::user(send, to * bytes, bytes)?)?,
            ];
            self.wait(reqs)?;
        }
        Ok(())
    }

    /// Dissemination: round `k` sends to `rank + 2^k` and hears from `rank − 2^k`.
    fn barrier(&self) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let mut d = 1;
        while d < n {
            let reqs = vec![
                self.recv((me + n - d) % n, Kind::Data, Region::bytes(Vec::new()))?,
                self.send((me + d) % n, Kind::Data, Region::bytes(Vec::new()))?,
            ];
            self.wait(reqs)?;
            d *= 2;
        }
        Ok(())
    }
}

/// A send's header as the receiver compares it.
fn p2p_header(c: &Prepared) -> String {
    format!("{} x {}", c.count, c.dtype)
}

/// A send of a group, posted before the group's other calls: its header
/// and data are on their way; [`finish_send`] waits for the receiver's answer.
pub(crate) struct PostedSend<'a> {
    reqs: Vec<Req<'a>>,
    ack: Arc<Scratch>,
    seq: u64,
    peer: usize,
}

pub(crate) fn post_send<'a>(core: &'a Core, c: &Prepared) -> Result<PostedSend<'a>> {
    let x = Exec::new(core, c.p2p_no, "send");
    let data = c.send.as_ref().ok_or_else(|| missing("send"))?;
    let ack = Scratch::new(1024);
    let reqs = vec![
        x.send(c.root, Kind::P2pHeader, Region::bytes(p2p_header(c).into_bytes()))?,
        x.send(c.root, Kind::P2pData, Region::user(data, 0, data.bytes())?)?,
        x.recv_upto(c.root, Kind::P2pAck, Region::scratch(&ack, 0, 1024)?)?,
    ];
    Ok(PostedSend { reqs, ack, seq: c.p2p_no, peer: c.root })
}

pub(crate) fn finish_send(core: &Core, p: PostedSend<'_>) -> Result<()> {
    let x = Exec::new(core, p.seq, "send");
    let lens = x.wait(p.reqs)?;
    // SAFETY: the ack receive has completed.
    let answer = String::from_utf8_lossy(unsafe { slice::<u8>(p.ack.ptr(), lens[2].min(1024)) }).into_owned();
    if answer == "ok" {
        Ok(())
    } else {
        Err(CommError::Mismatch { seq: 0, details: format!("{answer} (send #{} to rank {})", p.seq, p.peer) })
    }
}

pub(crate) fn receive(core: &Core, c: &Prepared) -> Result<()> {
    let x = Exec::new(core, c.p2p_no, "recv");
    let buf = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
    let header = Scratch::new(256);
    let lens = x.wait(vec![x.recv_upto(c.root, Kind::P2pHeader, Region::scratch(&header, 0, 256)?)?])?;
    // SAFETY: the header receive has completed.
    let theirs = String::from_utf8_lossy(unsafe { slice::<u8>(header.ptr(), lens[0].min(256)) }).into_owned();
    let mine = p2p_header(c);
    if theirs != mine {
        let details = format!("rank {} sent {theirs} to rank {}, which posted a recv of {mine}", c.root, core.rank);
        x.wait(vec![x.send(c.root, Kind::P2pAck, Region::bytes(details.clone().into_bytes()))?])?;
        return Err(CommError::Mismatch { seq: 0, details });
    }
    x.wait(vec![x.recv(c.root, Kind::P2pData, Region::user(buf, 0, buf.bytes())?)?])?;
    x.wait(vec![x.send(c.root, Kind::P2pAck, Region::bytes(b"ok".to_vec()))?]).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::MemStore;
    use crate::ucx::engine::{ControlTag, Engine};
    use crate::ucx::{wire, AbortState, Job, UcxConfig, LEAVE_GRACE};

    /// Rank 0 of two, with a worker of its own and no endpoint: a send to
    /// rank 1 fails at once, the way a call fails mid-receive.
    fn lonely_rank() -> Core {
        let (tag, mask) = wire::control_match();
        let engine = Engine::start("test", ControlTag { tag, mask }, Arc::new(|_| {}), Duration::ZERO).unwrap();
        let timeout = Duration::from_secs(20);
        let job = Arc::new(Job {
            engine,
            world_rank: 0,
            world_size: 2,
            store: Arc::new(MemStore::new()),
            config: UcxConfig { timeout, ..UcxConfig::default() },
            timeout,
            abort: Arc::new(AbortState::default()),
            peers: Arc::default(),
            hosts: vec![],
        });
        Core::new(job, 0, 0, vec![0, 1])
    }

    #[test]
    fn a_failed_call_returns_only_once_its_receive_has_ended() {
        let core = lonely_rank();
        // Cancels reach UCX 300 ms late: a call that does not wait for them returns first.
        core.job.engine.delay_cancels(Duration::from_millis(300));
        let x = Exec::new(&core, 1, "test");
        let inbox = Scratch::new(64);
        let recv = x.recv(1, Kind::Data, Region::scratch(&inbox, 0, 64).unwrap()).unwrap();
        let received = recv.done.clone();
        let send = x.send(1, Kind::Data, Region::bytes(vec![1; 8])).unwrap();
        let e = x.wait(vec![send, recv]).unwrap_err();
        assert!(matches!(e, CommError::Backend { .. }), "{e}");
        assert_eq!(
            received.outcome(),
            Some(Err(ucx_rs::sys::ucs_status_t_UCS_ERR_CANCELED)),
            "the call returned while its receive could still write into its buffer"
        );
    }

    #[test]
    fn a_request_dropped_before_it_ended_is_cancelled_and_waited_for() {
        let core = lonely_rank();
        core.job.engine.delay_cancels(Duration::from_millis(300));
        let x = Exec::new(&core, 2, "test");
        let inbox = Scratch::new(64);
        // What an early return (`?`) does to the receives a call has posted.
        let recv = x.recv(1, Kind::Data, Region::scratch(&inbox, 0, 64).unwrap()).unwrap();
        let received = recv.done.clone();
        drop(recv);
        assert_eq!(received.outcome(), Some(Err(ucx_rs::sys::ucs_status_t_UCS_ERR_CANCELED)));
    }

    #[test]
    fn a_lost_connection_fails_the_job_unless_the_peer_said_it_was_leaving() {
        use ucx_rs::sys::ucs_status_t_UCS_ERR_CONNECTION_RESET as RESET;
        // A peer that finished and closed its endpoints: its notice may come
        // before or just after the connection's end; neither fails the job.
        let core = lonely_rank();
        core.job.peers.left(1);
        core.job.peers.failed(1, RESET);
        let core2 = lonely_rank();
        core2.job.peers.failed(1, RESET);
        std::thread::sleep(LEAVE_GRACE / 4);
        core2.job.peers.left(1);
        std::thread::sleep(LEAVE_GRACE * 2);
        assert!(core.job.abort_error().is_none(), "{:?}", core.job.abort_error());
        assert!(core2.job.abort_error().is_none(), "{:?}", core2.job.abort_error());
        // A peer that died: a call waiting for it fails soon after the grace, not at its deadline.
        let core = lonely_rank();
        core.job.peers.failed(1, RESET);
        let started = Instant::now();
        let x = Exec::new(&core, 3, "test");
        let inbox = Scratch::new(8);
        let recv = x.recv(1, Kind::Data, Region::scratch(&inbox, 0, 8).unwrap()).unwrap();
        let e = x.wait(vec![recv]).unwrap_err();
        assert!(e.to_string().contains("the connection to world rank 1 failed"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?} (deadline 20 s)", started.elapsed());
    }
}
