//! The virtual communicator: collectives that take modelled time and move nothing.
//!
//! Each collective is a rendezvous of the communicator's ranks keyed by
//! (communicator, sequence number). The host of each rank blocks in
//! `launch` until every rank has arrived; the collective starts at the
//! latest of the ranks' stream clocks, lasts
//! [`CostModel::collective_seconds`](crate::cost::CostModel::collective_seconds),
//! and every rank's stream moves to its end. It never hangs: ranks that call
//! different things at one position, or a rank that ends (or fails) while
//! others wait for it, make every waiting and later call fail at once with
//! an error naming the first divergence ([`Divergence`]); a deadline is the
//! backstop.
//!
//! A symmetric world ([`VirtWorld::symmetric`]) runs some ranks only; every
//! other rank mirrors them: it issues the same collectives and reaches
//! each when the running ranks of its communicator do, so a collective
//! completes once those have arrived (its time still that of all its
//! ranks), and a split learns how a mirrored rank splits from a
//! [`SplitRule`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chorus_collectives::backend::{Call, CallKind, Fingerprint};
use chorus_collectives::{Capabilities, CommBackend, CommError, OpKind};

use super::{Virt, VirtDevice, VirtStream};
use crate::cost::{CollectiveShape, Issuer};

/// One collective as a rank issued it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CollectiveRecord {
    /// The communicator (`root`, `root/split0:color1`: the flight recorder's names).
    pub group: String,
    /// Position in the communicator's sequence.
    pub seq: u64,
    /// The operation (`all_gather`).
    pub op: String,
    /// Element type.
    pub dtype: String,
    /// Elements as the fingerprint counts them (per rank for all-gather, the
    /// receive count for reduce-scatter).
    pub count: u64,
    /// Bytes of `count` elements (what the flight recorder reports).
    pub bytes: u64,
}

impl CollectiveRecord {
    fn of(group: &str, seq: u64, fp: &Fingerprint) -> CollectiveRecord {
        CollectiveRecord {
            group: group.to_string(),
            seq,
            op: fp.op.name().to_string(),
            dtype: fp.dtype.name().to_string(),
            count: fp.count as u64,
            bytes: (fp.count as u64).saturating_mul(fp.dtype.size() as u64),
        }
    }

    /// `all_gather(1024 x bf16)`.
    pub fn signature(&self) -> String {
        format!("{}({} x {})", self.op, self.count, self.dtype)
    }
}

/// The first place where ranks stopped issuing the same collectives.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Divergence {
    /// The communicator.
    pub group: String,
    /// The call's position in that communicator's sequence.
    pub seq: u64,
    /// The rank (global) whose call differs from the first arrival's, or that ended.
    pub rank: usize,
    /// What that rank called (`None`: it ended its run without this call).
    pub called: Option<String>,
    /// The rank it is compared with.
    pub other_rank: usize,
    /// What that rank called.
    pub other_called: Option<String>,
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let call = |c: &Option<String>| c.clone().unwrap_or_else(|| "nothing (its run ended)".into());
        write!(
            f,
            "communicator {} call #{}: rank {} called {}, rank {} called {}",
            self.group,
            self.seq,
            self.rank,
            call(&self.called),
            self.other_rank,
            call(&self.other_called)
        )
    }
}

impl Divergence {
    fn error(&self) -> CommError {
        CommError::Mismatch { seq: self.seq, details: self.to_string() }
    }
}

struct Slot {
    /// The communicator's global ranks.
    ranks: Arc<Vec<usize>>,
    /// Per member: whether it has arrived.
    arrived: Vec<bool>,
    /// The first arrival (its member index and call): every later one must call the same.
    first: Option<(usize, Fingerprint)>,
    count: usize,
    /// The latest arrival time so far.
    latest: f64,
    /// Where the end is published; the waiters hold it and park, so a
    /// collective wakes each of its ranks once, without the world's lock.
    done: Arc<Done>,
    /// The threads parked on `done`.
    waiters: Vec<std::thread::Thread>,
}

/// A collective's end time, once every rank has arrived (f64 bits; `NOT_YET` before).
struct Done(AtomicU64);

const NOT_YET: u64 = u64::MAX;

impl Done {
    fn get(&self) -> Option<f64> {
        match self.0.load(Ordering::Acquire) {
            NOT_YET => None,
            bits => Some(f64::from_bits(bits)),
        }
    }
}

struct SplitSlot {
    ranks: Arc<Vec<usize>>,
    arrived: Vec<Option<(Option<u32>, i64)>>,
    count: usize,
    /// Running members, who all arrive.
    expected: usize,
    departed: usize,
}

/// A split as a mirrored member would make it: the communicator's name,
/// its split's number (0 for its first), its size and the member's index in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitQuery<'a> {
    /// The communicator split (`root`, `root/split1:color0`).
    pub communicator: &'a str,
    /// Which of its splits.
    pub split: u64,
    /// Its ranks.
    pub size: usize,
    /// The member's index in it.
    pub index: usize,
}

/// How a rank that does not run splits: its (color, key) for a query, or
/// `None` where the rule does not know (the split fails, saying so).
pub type SplitRule = Arc<dyn Fn(&SplitQuery<'_>) -> Option<(Option<u32>, i64)> + Send + Sync>;

#[derive(Default)]
struct WorldState {
    slots: HashMap<(Arc<str>, u64), Slot>,
    splits: HashMap<(Arc<str>, u64), SplitSlot>,
    /// Ranks whose run has ended.
    ended: Vec<bool>,
    /// The first divergence: every later call fails with it.
    divergence: Option<Divergence>,
    /// An abort's reason: every later call fails with it.
    aborted: Option<String>,
    /// Ranks ended so far (the scan for a waited-on ended rank is skipped while none has).
    ended_count: usize,
}

/// The ranks of one plan: the rendezvous every virtual communicator uses.
pub struct VirtWorld {
    /// Set once the world has failed (a divergence or an abort): parked waiters look here.
    failed_flag: std::sync::atomic::AtomicBool,
    size: usize,
    /// Per global rank, whether it runs (all do unless the world is symmetric).
    running: Vec<bool>,
    /// How the ranks that do not run split.
    mirror: Option<SplitRule>,
    timeout: Duration,
    cost: Arc<dyn crate::cost::CostModel>,
    state: Mutex<WorldState>,
    cv: Condvar,
}

impl std::fmt::Debug for VirtWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VirtWorld({} ranks)", self.size)
    }
}

type Guard<'a> = MutexGuard<'a, WorldState>;

impl VirtWorld {
    /// A world of `size` ranks whose collectives take the times `cost`
    /// gives; a rank waiting longer than `timeout` (real time) for the
    /// others fails with `Timeout`.
    pub fn new(size: usize, cost: Arc<dyn crate::cost::CostModel>, timeout: Duration) -> Arc<VirtWorld> {
        VirtWorld::with_ranks(size, vec![true; size], None, cost, timeout)
    }

    /// A world of `size` ranks of which only `running` run; the others
    /// mirror them (see the module's doc) and split as `rule` says.
    pub fn symmetric(
        size: usize,
        running: &[usize],
        rule: SplitRule,
        cost: Arc<dyn crate::cost::CostModel>,
        timeout: Duration,
    ) -> Arc<VirtWorld> {
        let mut run = vec![false; size];
        for r in running.iter().filter(|r| **r < size) {
            run[*r] = true;
        }
        VirtWorld::with_ranks(size, run, Some(rule), cost, timeout)
    }

    fn with_ranks(
        size: usize,
        running: Vec<bool>,
        mirror: Option<SplitRule>,
        cost: Arc<dyn crate::cost::CostModel>,
        timeout: Duration,
    ) -> Arc<VirtWorld> {
        let state = WorldState { ended: vec![false; size], ..WorldState::default() };
        Arc::new(VirtWorld {
            failed_flag: Default::default(),
            size,
            running,
            mirror,
            timeout,
            cost,
            state: Mutex::new(state),
            cv: Condvar::new(),
        })
    }

    /// How many of `ranks` run.
    fn running_among(&self, ranks: &[usize]) -> usize {
        ranks.iter().filter(|r| self.running.get(**r).copied().unwrap_or(false)).count()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Rank `rank`'s communicator over the whole world, on `device`; what it
    /// issues is appended to `log`.
    pub fn communicator(
        self: &Arc<Self>,
        rank: usize,
        device: VirtDevice,
        log: Arc<Mutex<Vec<CollectiveRecord>>>,
    ) -> Result<VirtComm, CommError> {
        if rank >= self.size {
            return Err(CommError::InvalidArgument {
                op: "communicator",
                reason: format!("rank {rank} is out of range for {} ranks", self.size),
            });
        }
        Ok(VirtComm {
            world: self.clone(),
            id: Arc::from("root"),
            ranks: Arc::new((0..self.size).collect()),
            expected: self.running_among(&(0..self.size).collect::<Vec<_>>()),
            index: rank,
            device,
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            log,
        })
    }

    /// Fails every waiting and later call with `reason` (a rank that could
    /// not start, a communicator's abort).
    pub fn abort(&self, reason: &str) {
        if let Ok(mut st) = self.state.lock() {
            st.aborted.get_or_insert_with(|| reason.to_string());
            self.wake_all_if_failed(&st);
        }
        self.cv.notify_all();
    }

    /// Marks `rank`'s run as ended: calls that wait for it fail at once.
    pub fn rank_ended(&self, rank: usize) {
        if let Ok(mut st) = self.state.lock() {
            if let Some(e) = st.ended.get_mut(rank) {
                *e = true;
                st.ended_count += 1;
            }
            let open: Vec<(Arc<str>, u64)> = st.slots.keys().cloned().collect();
            for key in open {
                if st.divergence.is_none() {
                    let d = st.slots.get(&key).and_then(|s| ended_member(&st.ended, &key, s));
                    st.divergence = d;
                }
            }
            self.wake_all_if_failed(&st);
        }
        self.cv.notify_all();
    }

    /// Once the world has failed, wakes every parked waiter (they then find the failure).
    fn wake_all_if_failed(&self, st: &WorldState) {
        if Self::failed(st).is_some() {
            self.failed_flag.store(true, Ordering::Release);
            for t in st.slots.values().flat_map(|s| s.waiters.iter()) {
                t.unpark();
            }
        }
    }

    /// The first divergence found, if any.
    pub fn divergence(&self) -> Option<Divergence> {
        self.state.lock().ok().and_then(|s| s.divergence.clone())
    }

    fn lock(&self) -> Result<Guard<'_>, CommError> {
        self.state.lock().map_err(|_| CommError::Aborted { reason: "the virtual world's lock is poisoned".into() })
    }

    fn failed(st: &WorldState) -> Option<CommError> {
        if let Some(d) = &st.divergence {
            return Some(d.error());
        }
        st.aborted.as_ref().map(|r| CommError::Aborted { reason: r.clone() })
    }

    /// Waits on the condition variable until `done` gives a value, the world
    /// fails, or the deadline passes (`what` and the missing ranks name the timeout).
    fn wait_until<'a, T>(
        &'a self,
        mut st: Guard<'a>,
        seq: u64,
        what: &str,
        mut done: impl FnMut(&mut WorldState) -> Option<T>,
        missing: impl Fn(&WorldState) -> Vec<usize>,
    ) -> Result<T, CommError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(v) = done(&mut st) {
                return Ok(v);
            }
            if let Some(e) = Self::failed(&st) {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: what.to_string(),
                    seq,
                    waited: self.timeout,
                    missing: missing(&st),
                });
            }
            st = match self.cv.wait_timeout(st, deadline - now) {
                Ok((g, _)) => g,
                Err(_) => return Err(CommError::Aborted { reason: "the virtual world's lock is poisoned".into() }),
            };
        }
    }
}

/// The divergence a slot shows when a member that has not arrived has ended.
fn ended_member(ended: &[bool], key: &(Arc<str>, u64), slot: &Slot) -> Option<Divergence> {
    let (_, &rank) = slot.ranks.iter().enumerate().find(|(i, r)| !slot.arrived[*i] && ended[**r])?;
    let (j, fp) = slot.first?;
    Some(Divergence {
        group: key.0.to_string(),
        seq: key.1,
        rank,
        called: None,
        other_rank: slot.ranks[j],
        other_called: Some(fp.to_string()),
    })
}

/// One rank's endpoint of a virtual communicator.
pub struct VirtComm {
    world: Arc<VirtWorld>,
    id: Arc<str>,
    /// The communicator's global ranks, in its rank order.
    ranks: Arc<Vec<usize>>,
    /// How many of them run: a collective completes when these have arrived.
    expected: usize,
    /// This rank's position in `ranks`.
    index: usize,
    device: VirtDevice,
    /// The next collective's position (the Communicator's numbering, kept here too for splits).
    seq: AtomicU64,
    splits: AtomicU64,
    log: Arc<Mutex<Vec<CollectiveRecord>>>,
}

impl VirtComm {
    /// The communicator's name (`root`, `root/split0:color1`).
    pub fn id(&self) -> &str {
        &self.id
    }

    fn global_rank(&self) -> usize {
        self.ranks[self.index]
    }

    /// Every member's (color, key) in split `n`: what each running member
    /// passed (`arrived`), and for the others what the world's
    /// [`SplitRule`] says, which must agree with the running members'.
    fn choices(&self, n: u64, arrived: Vec<Option<(Option<u32>, i64)>>) -> Result<Vec<(Option<u32>, i64)>, CommError> {
        let Some(rule) = &self.world.mirror else {
            return Ok(arrived.into_iter().map(|a| a.unwrap_or((None, 0))).collect());
        };
        let size = self.ranks.len();
        let mut choices = Vec::with_capacity(size);
        for (index, passed) in arrived.into_iter().enumerate() {
            let ruled = rule(&SplitQuery { communicator: &self.id, split: n, size, index });
            let rank = self.ranks[index];
            choices.push(match (passed, ruled) {
                (Some(p), Some(r)) if p != r => {
                    return Err(CommError::InvalidArgument {
                        op: "split",
                        reason: format!(
                            "split #{n} of {}: rank {rank} split with (color, key) {p:?} where the symmetric plan's rule says {r:?}: the ranks it does not run would split otherwise",
                            self.id
                        ),
                    })
                }
                (Some(p), _) => p,
                (None, Some(r)) => r,
                (None, None) => {
                    return Err(CommError::InvalidArgument {
                        op: "split",
                        reason: format!("split #{n} of {}: the symmetric plan has no rule for how rank {rank} splits", self.id),
                    })
                }
            });
        }
        Ok(choices)
    }

    /// The rendezvous of one collective: returns the time it ends.
    fn rendezvous(&self, seq: u64, fp: Fingerprint, arrival: f64, bytes: u64) -> Result<f64, CommError> {
        let world = &self.world;
        let key = (self.id.clone(), seq);
        let mut st = world.lock()?;
        if let Some(e) = VirtWorld::failed(&st) {
            return Err(e);
        }
        let n = self.ranks.len();
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
            ranks: self.ranks.clone(),
            arrived: vec![false; n],
            first: None,
            count: 0,
            latest: 0.0,
            done: Arc::new(Done(AtomicU64::new(NOT_YET))),
            waiters: Vec::new(),
        });
        if let Some((j, other)) = slot.first.filter(|(_, other)| *other != fp) {
            let d = Divergence {
                group: self.id.to_string(),
                seq,
                rank: self.global_rank(),
                called: Some(fp.to_string()),
                other_rank: self.ranks[j],
                other_called: Some(other.to_string()),
            };
            let e = d.error();
            st.divergence.get_or_insert(d);
            world.wake_all_if_failed(&st);
            world.cv.notify_all();
            return Err(e);
        }
        slot.first.get_or_insert((self.index, fp));
        slot.arrived[self.index] = true;
        slot.count += 1;
        slot.latest = slot.latest.max(arrival);
        if slot.count == self.expected {
            let shape = CollectiveShape { op: fp.op, bytes, ranks: self.ranks.to_vec() };
            let end = slot.latest + world.cost.collective_seconds(&shape).max(0.0);
            slot.done.0.store(end.to_bits(), Ordering::Release);
            let waiters = std::mem::take(&mut slot.waiters);
            st.slots.remove(&key);
            drop(st);
            for t in waiters {
                t.unpark();
            }
            return Ok(end);
        }
        slot.waiters.push(std::thread::current());
        let done = slot.done.clone();
        if st.divergence.is_none() && st.ended_count > 0 {
            let d = st.slots.get(&key).and_then(|s| ended_member(&st.ended, &key, s));
            if d.is_some() {
                st.divergence = d;
                world.wake_all_if_failed(&st);
                world.cv.notify_all();
            }
        }
        drop(st);
        let deadline = Instant::now() + world.timeout;
        loop {
            if let Some(end) = done.get() {
                return Ok(end);
            }
            if world.failed_flag.load(Ordering::Acquire) {
                if let Some(e) = VirtWorld::failed(&*world.lock()?) {
                    return Err(e);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                let st = world.lock()?;
                let missing = match st.slots.get(&key) {
                    Some(s) => s.ranks.iter().zip(&s.arrived).filter(|(_, a)| !**a).map(|(r, _)| *r).collect(),
                    None => Vec::new(),
                };
                return Err(CommError::Timeout { op: fp.op.name().to_string(), seq, waited: world.timeout, missing });
            }
            std::thread::park_timeout(deadline - now);
        }
    }
}

/// The larger of a rank's input and output, in bytes (what [`CollectiveShape::bytes`] is).
fn shape_bytes(fp: &Fingerprint, size: usize) -> u64 {
    let elems = match fp.op {
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => fp.count.saturating_mul(size),
        OpKind::Barrier => 0,
        _ => fp.count,
    };
    (elems as u64).saturating_mul(fp.dtype.size() as u64)
}

impl CommBackend for VirtComm {
    type B = Virt;
    const NAME: &'static str = "virtual";

    fn rank(&self) -> usize {
        self.index
    }
    fn size(&self) -> usize {
        self.ranks.len()
    }
    fn device(&self) -> &VirtDevice {
        &self.device
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            avg: true,
            premul_sum: true,
            ranks_share_device: false,
            world_abort: true,
            fault_injection: false,
            detects_mismatch: true,
            names_missing_ranks: true,
        }
    }

    /// Blocks the host until every rank has issued each call (the calls of a
    /// group one after another), then moves `stream` to each call's end.
    /// Send and receive are not modelled: a typed error.
    fn launch(&self, calls: Vec<Call<'_, Virt>>, stream: &VirtStream) -> Result<(), CommError> {
        if let Some(c) = calls.iter().find(|c| matches!(c.kind(), CallKind::Send { .. } | CallKind::Recv { .. })) {
            return Err(CommError::Unsupported {
                backend: Self::NAME,
                what: format!("{} (the planner models collectives only)", c.kind().kind().name()),
            });
        }
        for call in calls {
            let fp = *call.fingerprint();
            let seq = call.seq();
            self.seq.store(seq + 1, Ordering::Release);
            if let Ok(mut log) = self.log.lock() {
                log.push(CollectiveRecord::of(&self.id, seq, &fp));
            }
            // The host enqueues the call (NCCL's launch) before the stream can reach it.
            self.device.host_work(self.device.cost().host_cost(Issuer::Collective).issue_s);
            let arrival = stream.ready_at();
            let bytes = shape_bytes(&fp, self.ranks.len());
            let end = self.rendezvous(seq, fp, arrival, bytes)?;
            // The collective occupies the stream from its arrival until the end.
            stream.run_until(fp.op.name(), end);
        }
        Ok(())
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Self>, CommError> {
        let n = self.splits.fetch_add(1, Ordering::AcqRel);
        let world = &self.world;
        let skey = (self.id.clone(), n);
        let mut st = world.lock()?;
        if let Some(e) = VirtWorld::failed(&st) {
            return Err(e);
        }
        let size = self.ranks.len();
        let slot = st.splits.entry(skey.clone()).or_insert_with(|| SplitSlot {
            ranks: self.ranks.clone(),
            arrived: vec![None; size],
            count: 0,
            expected: self.expected,
            departed: 0,
        });
        slot.arrived[self.index] = Some((color, key));
        slot.count += 1;
        if slot.count == slot.expected {
            world.cv.notify_all();
        }
        let missing = |st: &WorldState| match st.splits.get(&skey) {
            Some(s) => s
                .ranks
                .iter()
                .zip(&s.arrived)
                .filter(|(r, a)| a.is_none() && world.running[**r])
                .map(|(r, _)| *r)
                .collect(),
            None => Vec::new(),
        };
        let arrived = world.wait_until(
            st,
            n,
            "split",
            |st| {
                let slot = st.splits.get_mut(&skey)?;
                if slot.count < slot.expected {
                    return None;
                }
                let arrived = slot.arrived.clone();
                slot.departed += 1;
                if slot.departed == slot.expected {
                    st.splits.remove(&skey);
                }
                Some(arrived)
            },
            missing,
        )?;
        let choices = self.choices(n, arrived)?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> =
            choices.iter().enumerate().filter(|(_, (c, _))| *c == Some(color)).map(|(i, (_, k))| (*k, i)).collect();
        members.sort();
        let ranks: Vec<usize> = members.iter().map(|(_, i)| self.ranks[*i]).collect();
        let index = members.iter().position(|(_, i)| *i == self.index).unwrap_or(0);
        Ok(Some(VirtComm {
            world: self.world.clone(),
            id: Arc::from(format!("{}/split{n}:color{color}", self.id)),
            expected: self.world.running_among(&ranks),
            ranks: Arc::new(ranks),
            index,
            device: self.device.clone(),
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            log: self.log.clone(),
        }))
    }

    fn abort(&self, reason: &str) {
        self.world.abort(reason)
    }

    fn async_error(&self) -> Option<CommError> {
        self.world.state.lock().ok().and_then(|st| VirtWorld::failed(&st))
    }
}
