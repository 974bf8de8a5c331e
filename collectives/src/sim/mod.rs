//! The `sim` backend: a cluster of `n` ranks as threads of one process.
//!
//! How the contract maps onto threads:
//! - each rank has its own [`CpuDevice`]; a collective is one job on the
//!   caller's stream executor, so it runs in stream order with everything else;
//! - the job meets the other ranks' jobs in a **rendezvous slot** keyed by the
//!   call's sequence number, where fingerprints are compared (a mismatch fails
//!   the call on every rank) and the ranks exchange pointers to their buffers;
//! - data moves directly between the ranks' buffers (one address space, no
//!   staging): each rank does an equal share of the work, then waits at an
//!   exit barrier so no buffer is reused while a peer still reads it;
//! - reductions go element by element in rank order 0..n-1, so every rank
//!   gets bitwise the same result (the arithmetic is `crate::arith`, shared
//!   with the `ucx` backend);
//! - every wait has the world's deadline; a rank that does not arrive makes
//!   the others fail with `Timeout`, and any failure aborts the world (and
//!   every communicator split from it), so the rest fail promptly;
//! - faults can be injected to test all of that.

mod kernels;
use crate::arith as reduce;
pub(crate) mod world;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_devices::cpu::{Access, Cpu, CpuConfig, CpuDevice, CpuStream, JobInput, RawRange};
use chorus_devices::{DeviceError, Stream};

use world::{AbortState, Arrival, Posted, WorldShared};
pub use world::{Fault, FaultKind};

use crate::backend::{Call, Capabilities, CommBackend, OpKind};
use crate::{CommError, Communicator, ReduceOp, Result};

/// Settings of a simulated world.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Deadline of every rendezvous: a rank that has not arrived by then
    /// makes the others fail with `Timeout`.
    pub timeout: Duration,
    /// Settings of each rank's cpu device (the ordinal is set to the rank).
    pub device: CpuConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { timeout: Duration::from_secs(60), device: CpuConfig::default() }
    }
}

/// The handle of a simulated world: the sim counterpart of NCCL's unique id.
/// Clone it into each rank's thread and call [`SimWorld::communicator`].
#[derive(Clone, Debug)]
pub struct SimWorld {
    shared: Arc<WorldShared>,
    config: SimConfig,
    taken: Arc<Mutex<Vec<bool>>>,
}

impl SimWorld {
    /// A world of `size` ranks.
    pub fn new(size: usize, config: SimConfig) -> Result<SimWorld> {
        if size == 0 {
            return Err(CommError::invalid("SimWorld::new", "a world needs at least one rank"));
        }
        let shared = WorldShared::new(size, "world".into(), config.timeout, Arc::new(AbortState::default()));
        Ok(SimWorld { shared, config, taken: Arc::new(Mutex::new(vec![false; size])) })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// Rank `rank`'s communicator, on a new cpu device. Each rank can be taken once.
    pub fn communicator(&self, rank: usize) -> Result<Communicator<SimComm>> {
        let mut taken = self.taken.lock().map_err(|_| CommError::invalid("communicator", "world lock poisoned"))?;
        match taken.get_mut(rank) {
            None => {
                return Err(CommError::invalid(
                    "communicator",
                    format!("rank {rank} is out of range for {} ranks", self.size()),
                ))
            }
            Some(true) => return Err(CommError::invalid("communicator", format!("rank {rank} was already taken"))),
            Some(t) => *t = true,
        }
        let device = CpuDevice::new(self.config.device.clone().with_ordinal(rank));
        Ok(Communicator::new(SimComm::new(self.shared.clone(), rank, device)))
    }

    /// Aborts the world: every pending and later call on every rank (and on
    /// communicators split from it) fails promptly with `Aborted`.
    pub fn abort(&self, reason: &str) {
        self.shared.abort.abort(CommError::Aborted { reason: reason.to_string() });
    }

    /// Injects a fault into the world's (not a split's) collective sequence.
    pub fn inject_fault(&self, fault: Fault) -> Result<()> {
        self.shared.lock()?.faults.push(fault);
        Ok(())
    }

    /// Runs `body` on `size` rank threads, each with its communicator, and
    /// returns each rank's result in rank order. A panicking rank aborts the
    /// world (so the others fail promptly) and its result is an error.
    pub fn run<T: Send + 'static>(
        size: usize,
        config: SimConfig,
        body: impl Fn(Communicator<SimComm>) -> T + Send + Sync + 'static,
    ) -> Result<Vec<Result<T>>> {
        let world = SimWorld::new(size, config)?;
        world.run_on(body)
    }

    /// Like [`SimWorld::run`] on this world (so faults can be injected first).
    pub fn run_on<T: Send + 'static>(
        &self,
        body: impl Fn(Communicator<SimComm>) -> T + Send + Sync + 'static,
    ) -> Result<Vec<Result<T>>> {
        let body = Arc::new(body);
        let mut handles = Vec::with_capacity(self.size());
        for rank in 0..self.size() {
            let started = self.communicator(rank).and_then(|comm| {
                let body = body.clone();
                let world = self.clone();
                std::thread::Builder::new()
                    .name(format!("sim-rank{rank}"))
                    .spawn(move || {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(comm)));
                        if r.is_err() {
                            world.abort(&format!("rank {rank} panicked"));
                        }
                        r
                    })
                    .map_err(|e| CommError::Backend {
                        library: "sim",
                        code: e.raw_os_error().map_or(-1, i64::from),
                        message: format!("rank {rank}'s thread could not start: {e}"),
                    })
            });
            match started {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    // The ranks already started would wait for this one until their timeout: they fail now,
                    // and are joined before the error is returned, so none outlives the world's run.
                    self.abort(&e.to_string());
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.join() {
                Ok(Ok(v)) => Ok(v),
                _ => Err(CommError::Aborted { reason: format!("rank {rank} panicked") }),
            })
            .collect())
    }
}

/// One rank's endpoint of a simulated world.
pub struct SimComm {
    world: Arc<WorldShared>,
    rank: usize,
    device: CpuDevice,
    splits: AtomicU64,
}

impl SimComm {
    fn new(world: Arc<WorldShared>, rank: usize, device: CpuDevice) -> SimComm {
        SimComm { world, rank, device, splits: AtomicU64::new(0) }
    }
}

/// A call with its buffers resolved to raw memory, ready to run on an executor.
pub(crate) struct Prepared {
    pub(crate) seq: u64,
    pub(crate) fingerprint: crate::backend::Fingerprint,
    pub(crate) op: OpKind,
    pub(crate) reduce: ReduceOp,
    pub(crate) root: usize,
    pub(crate) send: Option<RawRange>,
    pub(crate) recv: Option<RawRange>,
}

impl SimComm {
    fn prepare(&self, call: &Call<'_, Cpu>, accesses: &mut Vec<Access>) -> Prepared {
        let b = crate::host_call::resolve(call, self.rank, accesses);
        Prepared {
            seq: call.seq,
            fingerprint: call.fingerprint,
            op: call.kind.kind(),
            reduce: b.reduce,
            root: b.root,
            send: b.send,
            recv: b.recv,
        }
    }
}

fn scalar_of(op: ReduceOp) -> f64 {
    match op {
        ReduceOp::PreMulSum(s) => s,
        _ => 1.0,
    }
}

/// Runs one group of prepared calls on rank `me`'s executor.
pub(crate) fn run_group(world: &WorldShared, me: usize, calls: &[Prepared]) -> Result<()> {
    // Sends first, so the peers' receives in this group can complete.
    let mut posted = Vec::new();
    for c in calls.iter().filter(|c| c.op == OpKind::Send) {
        let data = c.send.clone().ok_or_else(|| CommError::invalid("send", "no buffer"))?;
        let p = Arc::new(Posted { fingerprint: c.fingerprint, data, outcome: Mutex::new(None) });
        world.post(me, c.root, p.clone())?;
        posted.push((p, c.root));
    }
    for c in calls.iter().filter(|c| !matches!(c.op, OpKind::Send | OpKind::Recv)) {
        run_collective(world, me, c)?;
    }
    for c in calls.iter().filter(|c| c.op == OpKind::Recv) {
        let sent = world.take(c.root, me)?;
        let recv = c.recv.as_ref().ok_or_else(|| CommError::invalid("recv", "no buffer"))?;
        let theirs = sent.fingerprint;
        let outcome = if theirs.dtype != c.fingerprint.dtype || theirs.count != c.fingerprint.count {
            let e = CommError::Mismatch {
                seq: 0,
                details: format!(
                    "rank {} sent {} x {} to rank {me}, which posted recv of {} x {}",
                    c.root, theirs.count, theirs.dtype, c.fingerprint.count, c.fingerprint.dtype
                ),
            };
            world.abort.abort(e.clone());
            Err(e)
        } else {
            kernels::copy(&sent.data, recv);
            Ok(())
        };
        world.settle(&sent, outcome.clone());
        outcome?;
    }
    for (p, peer) in posted {
        world.wait_consumed(&p, peer)?;
    }
    Ok(())
}

fn run_collective(world: &WorldShared, me: usize, c: &Prepared) -> Result<()> {
    let fault = world.lock()?.faults.iter().find(|f| f.rank == me && f.call == c.seq).copied();
    if let Some(f) = fault {
        match f.kind {
            FaultKind::Fail => {
                let e = CommError::Backend {
                    library: "sim",
                    code: -1,
                    message: format!("injected fault at call #{}", c.seq),
                };
                world.abort.abort(CommError::Aborted {
                    reason: format!("rank {me} failed at collective #{}: injected fault", c.seq),
                });
                return Err(e);
            }
            FaultKind::Stall(d) => std::thread::sleep(d),
        }
    }
    let arrival =
        Arrival { fingerprint: c.fingerprint, send: c.send.clone(), recv: c.recv.clone(), scalar: scalar_of(c.reduce) };
    let all = world.arrive(c.seq, me, arrival)?;
    let n = world.size;
    let count = c.fingerprint.count;
    let dtype = c.fingerprint.dtype;
    let sends: Vec<Option<&RawRange>> = all.iter().map(|a| a.send.as_ref()).collect();
    let recvs: Vec<Option<&RawRange>> = all.iter().map(|a| a.recv.as_ref()).collect();
    let scalars: Vec<f64> = all.iter().map(|a| a.scalar).collect();
    let work = kernels::Work { me, n, count, dtype, op: c.reduce, scalars: &scalars, sends: &sends, recvs: &recvs };
    let result = match c.op {
        OpKind::AllReduce => work.all_reduce(),
        OpKind::AllGather => work.all_gather(),
        OpKind::ReduceScatter => work.reduce_scatter(),
        OpKind::Broadcast => work.broadcast(c.root),
        OpKind::Reduce => work.reduce(c.root),
        OpKind::AllToAll => work.all_to_all(),
        OpKind::Barrier | OpKind::Send | OpKind::Recv => Ok(()),
    };
    // Depart even after a local failure, so peers are not left at the barrier.
    let departed = world.depart(c.seq);
    result?;
    departed
}

impl CommBackend for SimComm {
    type B = Cpu;
    const NAME: &'static str = "sim";

    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.world.size
    }
    fn device(&self) -> &CpuDevice {
        &self.device
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            avg: true,
            premul_sum: true,
            ranks_share_device: true,
            world_abort: true,
            fault_injection: true,
            detects_mismatch: true,
            names_missing_ranks: true,
        }
    }

    fn launch(&self, calls: Vec<Call<'_, Cpu>>, stream: &CpuStream) -> Result<()> {
        let mut accesses = Vec::new();
        let prepared: Vec<Prepared> = calls.iter().map(|c| self.prepare(c, &mut accesses)).collect();
        let name = if calls.len() == 1 { calls[0].kind.kind().name() } else { "group" };
        let world = self.world.clone();
        let me = self.rank;
        let stream_name = stream.name();
        stream
            .enqueue(name, &accesses, move |input| match input {
                JobInput::Run => run_group(&world, me, &prepared).map_err(|e| DeviceError::OpFailed {
                    op: name,
                    stream: stream_name,
                    source: Arc::new(e),
                }),
                JobInput::Skip(cause) => {
                    world.abort.abort(CommError::Aborted {
                        reason: format!("rank {me}'s stream failed before {name}: {cause}"),
                    });
                    Ok(())
                }
            })
            .map_err(CommError::Device)
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<SimComm>> {
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        Ok(self.world.split(seq, self.rank, color, key, false)?.map(|(w, r)| SimComm::new(w, r, self.device.clone())))
    }

    fn abort(&self, reason: &str) {
        self.world.abort.abort(CommError::Aborted { reason: format!("rank {} called abort: {reason}", self.rank) });
    }

    fn async_error(&self) -> Option<CommError> {
        self.world.abort.error()
    }
}
