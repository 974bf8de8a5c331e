//! One call being run by one rank ([`Exec`]): its requests, the waits that
//! fail it on an error, the job's abort, a peer that is gone or a deadline,
//! and its hello.
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

use super::engine::{Engine, CANCEL_GRACE};
use super::job::{left_error, LEFT_GRACE};
use super::member::Core;
use super::region::{Region, Scratch};
use super::result;
use super::wire::{tag, Kind};
use super::worker::Completion;
use crate::backend::OpKind;
use crate::{CommError, ReduceOp, Result};

/// How long a waiter sleeps between checks of the job's abort flag.
const SLICE: Duration = Duration::from_millis(10);

/// Segment of the pipelined broadcast chain.
pub(super) const SEGMENT: usize = 1 << 20;

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
pub(super) struct Req<'a> {
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
    pub(super) core: &'a Core,
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

pub(super) fn missing(what: &str) -> CommError {
    CommError::invalid("ucx", format!("the call has no {what} buffer"))
}

impl<'a> Exec<'a> {
    pub(crate) fn new(core: &'a Core, seq: u64, op: &'static str) -> Exec<'a> {
        Exec { core, seq, op, hello: std::cell::RefCell::new(None) }
    }

    pub(crate) fn core(&self) -> &'a Core {
        self.core
    }

    pub(super) fn n(&self) -> usize {
        self.core.size
    }
    pub(super) fn me(&self) -> usize {
        self.core.rank
    }

    fn req(&self, done: Arc<Completion>, peer: usize, expect: Option<usize>) -> Req<'a> {
        let grace = CANCEL_GRACE.min(self.core.job.timeout);
        Req { done, peer, expect, engine: &self.core.job.engine, grace }
    }

    pub(super) fn send(&self, peer: usize, kind: Kind, region: Region) -> Result<Req<'a>> {
        let world_peer = self.core.world_rank(peer)?;
        let t = tag(kind, self.core.id, self.seq, self.core.world_rank(self.me())?);
        Ok(self.req(self.core.job.engine.send(world_peer, t, region)?, peer, None))
    }

    pub(super) fn recv(&self, peer: usize, kind: Kind, region: Region) -> Result<Req<'a>> {
        let t = tag(kind, self.core.id, self.seq, self.core.world_rank(peer)?);
        let expect = Some(region.len());
        Ok(self.req(self.core.job.engine.recv(t, u64::MAX, region)?, peer, expect))
    }

    /// A receive whose length may be shorter than the region (a small message).
    pub(super) fn recv_upto(&self, peer: usize, kind: Kind, region: Region) -> Result<Req<'a>> {
        let mut r = self.recv(peer, kind, region)?;
        r.expect = None;
        Ok(r)
    }

    /// One ring step: `out` to `to` and `into` from `from`, each in
    /// segments of at most [`SEGMENT`] bytes posted at once (one message
    /// when empty). Whole chunks as single messages leave a rate-limited
    /// link idle part of the time (32 MiB messages over TCP at 1 Gbit/s
    /// took 1.5x the link time; 1 MiB segments keep it busy).
    pub(super) fn step(&self, to: usize, out: Region, from: usize, into: Region) -> Result<Vec<Req<'a>>> {
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
    pub(super) fn wait(&self, reqs: Vec<Req<'a>>) -> Result<Vec<usize>> {
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
        let started = Instant::now();
        let mut deadline = started + timeout;
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
                    if let Some(e) = self.waits_for_the_gone(&reqs[next..], started) {
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

    /// The error of a request among `pending` that waits for a rank that
    /// left the job at least [`LEFT_GRACE`] ago, and since `since` (the
    /// start of the wait): it would never end (see `job.rs`).
    fn waits_for_the_gone(&self, pending: &[Req<'a>], since: Instant) -> Option<CommError> {
        let job = &self.core.job;
        pending.iter().filter(|r| r.done.outcome().is_none()).find_map(|r| {
            let w = self.core.world_rank(r.peer).ok()?;
            let at = job.peers.left_at(w)?;
            (at.max(since).elapsed() >= LEFT_GRACE).then(|| {
                left_error(
                    w,
                    &format!("{} #{} on world rank {} still waited for it", self.op, self.seq, job.world_rank),
                )
            })
        })
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
            let slot = Region::scratch(&h.inbox, i * HELLO_BYTES, lens[i].min(HELLO_BYTES))?;
            // SAFETY: the receive into the slot has completed (waited for above).
            let bytes = unsafe { slot.as_slice() };
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::MemStore;
    use crate::ucx::engine::{ControlTag, Engine};
    use crate::ucx::job::{AbortState, Job, LEAVE_GRACE, LEFT_GRACE};
    use crate::ucx::{wire, UcxConfig};

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

    /// A rank that left: a receive from it still pending [`LEFT_GRACE`]
    /// after the wait began fails the call, naming it, long before the deadline.
    #[test]
    fn a_receive_from_a_rank_that_left_fails_after_the_grace() {
        let core = lonely_rank();
        core.job.peers.left(1);
        let x = Exec::new(&core, 4, "test");
        let inbox = Scratch::new(8);
        let started = Instant::now();
        let recv = x.recv(1, Kind::Data, Region::scratch(&inbox, 0, 8).unwrap()).unwrap();
        let e = x.wait(vec![recv]).unwrap_err();
        let waited = started.elapsed();
        assert!(e.to_string().contains("world rank 1 left the job"), "{e}");
        assert!(e.to_string().contains("test #4 on world rank 0 still waited for it"), "{e}");
        assert!(waited >= LEFT_GRACE, "failed after {waited:?}, within the grace");
        assert!(waited < LEFT_GRACE + Duration::from_secs(3), "{waited:?} (deadline 20 s)");
    }
}
