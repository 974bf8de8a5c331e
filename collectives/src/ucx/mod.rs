//! The `ucx` backend: ranks as processes (or hosts), one rank per process,
//! over UCX's tagged messages, on cpu devices.
//!
//! How the contract maps onto UCX:
//! - **One job, one UCP worker.** [`UcxComm::init`] starts a UCP context
//!   and worker in this process, owned by a progress thread (`engine.rs`)
//!   that sleeps on the worker's event fd when idle. Each rank publishes its
//!   worker address (and the world size it was started with) in the
//!   rendezvous [`Store`], reads every other rank's, and creates an
//!   endpoint to each (itself included). Communicators split
//!   from it share the worker and endpoints; each gets a 16-bit id from a
//!   counter in the store.
//! - **Stream-ordered.** A launch (one call, or a group) is one job on the
//!   caller's cpu stream, declaring its reads and writes to the stream
//!   sanitizer; the host returns at once. When the stream reaches it, the
//!   job runs the algorithm (`algorithms.rs`) on the executor thread
//!   (`exec.rs`): it hands sends and receives to the progress thread and
//!   waits for them.
//! - **Tags** (`wire.rs`): kind, communicator id, sequence number and
//!   sender; so concurrent calls on different streams (FSDP's all-gather
//!   and reduce-scatter streams) never take each other's messages.
//! - **Algorithms** (`algorithms.rs`): one round of direct messages for
//!   small calls, reduced in rank order (bitwise the sim's results); rings
//!   for large ones (deterministic, the same on every rank, not rank
//!   order); pairwise all-to-all; dissemination barrier; and for a
//!   communicator that spans hosts, the hierarchical schedules
//!   (`hierarchy.rs`, over the host layout of `layout.rs`). Which one a
//!   call takes is `schedule.rs`'s: the switch is
//!   [`UcxConfig::small_bytes`] (per rank's buffer, `config.rs`), measured in
//!   `docs/benchmarks.md`. A call runs against its communicator's `Core`
//!   (`member.rs`: the job, the members, the scratch pool).
//! - **Mismatch.** Every collective sends its sequence number and
//!   fingerprint to every other rank alongside its first data messages, and
//!   checks theirs before it uses any data; a send carries its dtype and count and waits for the
//!   receiver's answer. A mismatch is `CommError::Mismatch` naming both
//!   calls, on every rank.
//! - **Failures** reach every rank: a rank whose call fails (a mismatch, a
//!   deadline, a failed transfer) or whose stream failed before a call, or
//!   that calls [`abort`](crate::CommBackend::abort), sends the error to every rank of the
//!   job as a control message; their pending and later calls fail with it
//!   (the first error wins). Every wait has the deadline
//!   [`UcxConfig::timeout`], counted from the last progress of the call: a
//!   dead peer is found by it, or sooner when UCX reports the peer's
//!   connection failed (which aborts the job too; see
//!   [`UcxConfig::peer_failure`]). A rank whose communicator goes tells the
//!   others how it leaves (`job.rs`): as a failure when its thread panics
//!   (they fail at once), else as a rank that left, and a call still
//!   waiting for it a few seconds later fails instead of waiting out the
//!   deadline.
//! - **Memory.** A transfer keeps the memory it uses alive until UCX has
//!   finished with it (a cancelled receive cannot write into freed memory);
//!   the algorithms read and write memory only through bounds-checked
//!   regions (`region.rs`).
//!
//! Capabilities: native `Avg` and `PreMulSum`, world-wide abort, mismatch
//! detection. A `Timeout` says which peer a rank waited for but cannot know
//! which rank never arrived (`names_missing_ranks` is false), and there is
//! no fault injection.

mod algorithms;
mod config;
mod engine;
mod exec;
mod hierarchy;
mod job;
mod layout;
mod member;
mod p2p;
mod pool;
mod raw;
mod region;
mod result;
mod schedule;
mod start_up;
mod wire;
mod worker;

pub(crate) use start_up::give_back_sighup;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use chorus_devices::cpu::{Access, Cpu, CpuDevice, CpuStream, JobInput};
use chorus_devices::{DeviceError, Stream};

use chorus_devices::MemoryStats;
use engine::{ControlTag, Engine};
use exec::{Exec, Prepared};
use job::{AbortState, Job, Peers};
use member::Core;
use worker::{Event, EventHandler};

pub use config::{UcxConfig, DEFAULT_SMALL_BYTES};
pub use raw::raw_round_trips;

use crate::backend::{Call, CallKind, Capabilities, CommBackend, OpKind};
use crate::bootstrap::{Store, StoreBarrier};
use crate::{CommError, Communicator, Result};

/// One rank's endpoint of a UCX communicator.
pub struct UcxComm {
    core: Arc<Core>,
    device: CpuDevice,
    /// Store prefix of this communicator (its splits' keys go under it).
    prefix: String,
    splits: AtomicU64,
    /// Sends to / receives from each peer so far (p2p messages are numbered per pair).
    sent: Mutex<Vec<u64>>,
    received: Mutex<Vec<u64>>,
}

impl std::fmt::Debug for UcxComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "UcxComm(rank {}/{}, id {}, world rank {})",
            self.core.rank, self.core.size, self.core.id, self.core.job.world_rank
        )
    }
}

impl Drop for UcxComm {
    /// A communicator dropped while its thread panics fails the job on
    /// every rank at once (see `job.rs`): its owner failed outside it, and
    /// the other ranks must not wait for it.
    fn drop(&mut self) {
        self.core.job.fail_if_panicking();
    }
}

fn world_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/rank/{rank}")
}

impl UcxComm {
    /// Joins the job's world as `rank` of `size` on `device`: starts this
    /// process's UCP worker, publishes its address under `config.prefix` in
    /// `store`, reads every other rank's (up to `config.timeout`) and
    /// connects to them. Every rank calls it with the same prefix and size;
    /// a rank that joined with another size makes the others fail with
    /// `Mismatch` naming both sizes, and a rank that never joins makes them
    /// fail with `Timeout`. Blocks the host until every rank has connected.
    /// The keys go under `{config.prefix}/world{w}`, `w` counting the
    /// worlds made under the prefix (every rank makes the same worlds in
    /// the same order); a rank whose earlier `init` failed after counting
    /// itself in puts later worlds out of step, which ends in `Timeout`.
    pub fn init(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        device: CpuDevice,
        config: UcxConfig,
    ) -> Result<Communicator<UcxComm>> {
        CommError::check_rank("UcxComm::init", rank, size)?;
        if size > wire::MAX_RANKS {
            return Err(CommError::invalid("UcxComm::init", format!("{size} ranks; at most {}", wire::MAX_RANKS)));
        }
        crate::host_fn_check("ucx init")?;
        // UCX's start-up took SIGHUP (start_up.rs): a world's process answers it as chorus documents.
        give_back_sighup();
        let abort = Arc::new(AbortState::default());
        let peers = Arc::new(Peers::default());
        let timeout = config.timeout;
        let on_event: EventHandler = {
            let (abort, peers) = (abort.clone(), peers.clone());
            Arc::new(move |event| match event {
                Event::PeerFailed(r, status) => peers.failed(r, status),
                Event::Control(bytes) => match wire::decode_control(&bytes, timeout) {
                    wire::Control::Leaving(r) => peers.left(r),
                    wire::Control::Failure(e) => {
                        abort.set(e);
                    }
                },
            })
        };
        // The worlds made under this prefix so far: every rank of a world
        // counts itself in before any can finish `init` (it waits for all at
        // the end), so the count numbers the worlds and their keys never mix.
        let joined = store.add(&format!("{}/joined", config.prefix), 1)?;
        let world = (joined - 1).max(0) / size as i64;
        let config = UcxConfig { prefix: format!("{}/world{world}", config.prefix), ..config };
        let (ctag, cmask) = wire::control_match();
        let engine = Engine::start(
            &format!("rank {rank}"),
            ControlTag { tag: ctag, mask: cmask },
            on_event,
            config.progress_spin,
        )?;
        let mut mine = (size as u64).to_le_bytes().to_vec();
        mine.extend_from_slice(engine.address());
        store.set(&world_key(&config.prefix, rank), &mine)?;
        let host = layout::host_key(config.host_key.as_deref());
        store.set(&format!("{}/host/{rank}", config.prefix), host.as_bytes())?;
        let mut addresses = vec![None; size];
        // An endpoint to itself too: a group may send to its own rank.
        addresses[rank] = Some(engine.address().to_vec());
        for (r, slot) in addresses.iter_mut().enumerate().filter(|(r, _)| *r != rank) {
            let value = store.get(&world_key(&config.prefix, r), config.timeout).map_err(|e| match e {
                CommError::Timeout { waited, .. } => CommError::Timeout {
                    op: format!("ucx init: rank {r} never published its address"),
                    seq: 0,
                    waited,
                    missing: vec![r],
                },
                other => other,
            })?;
            if value.len() < 8 {
                return Err(CommError::invalid(
                    "UcxComm::init",
                    format!("rank {r}'s address record is {} bytes", value.len()),
                ));
            }
            let mut their = [0u8; 8];
            their.copy_from_slice(&value[..8]);
            let their = u64::from_le_bytes(their);
            if their != size as u64 {
                return Err(CommError::Mismatch {
                    seq: 0,
                    details: format!("rank {r} joined a world of {their} ranks; rank {rank} a world of {size}"),
                });
            }
            *slot = Some(value[8..].to_vec());
        }
        engine.connect(addresses, config.peer_failure, config.timeout)?;
        // Creating an endpoint attaches the peer's shared memory: no rank may
        // tear its worker down before every rank has connected to it, so
        // `init` returns only once all have.
        StoreBarrier::new(format!("{}/connected", config.prefix), size)?
            .arrive_and_wait(&*store, config.timeout)
            .map_err(|e| match e {
                CommError::Timeout { op, waited, .. } => {
                    CommError::Timeout { op: format!("ucx init: {op}"), seq: 0, waited, missing: vec![] }
                }
                other => other,
            })?;
        // Every rank published its host key before connecting: all are there.
        let host_keys: Vec<String> = (0..size).map(|r| format!("{}/host/{r}", config.prefix)).collect();
        let refs: Vec<&str> = host_keys.iter().map(String::as_str).collect();
        let hosts =
            store.multi_get(&refs, config.timeout)?.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect();
        let job = Arc::new(Job {
            engine,
            world_rank: rank,
            world_size: size,
            store,
            timeout,
            config: config.clone(),
            abort,
            peers,
            hosts,
        });
        let core = Arc::new(Core::new(job, 0, rank, (0..size).collect()));
        Ok(Communicator::new(UcxComm::with_core(core, device, config.prefix)))
    }

    fn with_core(core: Arc<Core>, device: CpuDevice, prefix: String) -> UcxComm {
        let size = core.size;
        UcxComm {
            core,
            device,
            prefix,
            splits: AtomicU64::new(0),
            sent: Mutex::new(vec![0; size]),
            received: Mutex::new(vec![0; size]),
        }
    }

    /// The capabilities every UCX communicator has (declared without one).
    pub fn declared_capabilities() -> Capabilities {
        Capabilities {
            avg: true,
            premul_sum: true,
            ranks_share_device: false,
            world_abort: true,
            fault_injection: false,
            detects_mismatch: true,
            names_missing_ranks: false,
        }
    }

    /// The scratch memory of this communicator (partial results, received
    /// slots): every buffer alive, whether a call or a transfer uses it or
    /// it waits in the pool for the next call, its peak, and their number.
    /// The pool is bounded ([`UcxConfig::scratch_pool_buffers`],
    /// [`UcxConfig::scratch_pool_bytes`]); [`UcxComm::release_scratch`] empties it.
    pub fn scratch_memory(&self) -> MemoryStats {
        self.core.pool.stats()
    }

    /// Frees the scratch buffers kept for later calls (a call in flight
    /// keeps its own); the bytes freed. Later calls allocate again.
    pub fn release_scratch(&self) -> usize {
        self.core.pool.release()
    }

    /// This rank's rank in the job's world (the communicator it was split from).
    pub fn world_rank(&self) -> usize {
        self.core.job.world_rank
    }

    /// Resolves `call`'s buffers and declares its accesses; a send or
    /// receive takes the next number of its pair from `sent`/`received`
    /// (copies that [`CommBackend::launch`] keeps only once the launch is enqueued).
    fn prepare(
        &self,
        call: &Call<'_, Cpu>,
        accesses: &mut Vec<Access>,
        sent: &mut Vec<u64>,
        received: &mut Vec<u64>,
    ) -> Result<Prepared> {
        let fp = call.fingerprint;
        let b = crate::host_call::resolve(call, self.core.rank, accesses);
        let mut p = Prepared {
            seq: call.seq,
            fingerprint: fp.to_string(),
            op: call.kind.kind(),
            dtype: fp.dtype,
            count: fp.count,
            reduce: b.reduce,
            root: b.root,
            send: b.send,
            recv: b.recv,
            p2p_no: 0,
        };
        let next = |counters: &mut Vec<u64>, peer: usize| -> Result<u64> {
            let slot =
                counters.get_mut(peer).ok_or_else(|| CommError::invalid("ucx", format!("peer {peer} out of range")))?;
            let n = *slot;
            *slot += 1;
            Ok(n)
        };
        match &call.kind {
            CallKind::Send { buf, peer } => {
                p.count = buf.len();
                p.dtype = buf.dtype();
                p.p2p_no = next(sent, *peer)?;
            }
            CallKind::Recv { buf, peer } => {
                p.count = buf.len();
                p.dtype = buf.dtype();
                p.p2p_no = next(received, *peer)?;
            }
            _ => {}
        }
        Ok(p)
    }
}

/// Runs one launch's calls on this rank's executor: sends first (so the
/// group's receives can complete), then the collectives in order, then the
/// receives, then the sends' answers.
fn run_group(core: &Core, calls: &[Prepared]) -> Result<()> {
    if let Some(e) = core.job.abort_error() {
        return Err(e);
    }
    let mut posted = Vec::new();
    for c in calls.iter().filter(|c| c.op == OpKind::Send) {
        posted.push(p2p::post_send(core, c)?);
    }
    for c in calls.iter().filter(|c| !matches!(c.op, OpKind::Send | OpKind::Recv)) {
        Exec::new(core, c.seq, c.op.name()).run(c)?;
    }
    for c in calls.iter().filter(|c| c.op == OpKind::Recv) {
        p2p::receive(core, c)?;
    }
    for p in posted {
        p2p::finish_send(core, p)?;
    }
    // A peer that failed (and said so) before this launch was posted may
    // have left messages that this launch's receives took as its own: the
    // launch fails with the job. (The progress thread sets the job's
    // error before it posts the receives of commands queued after the
    // report arrived.)
    match core.job.abort_error() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl CommBackend for UcxComm {
    type B = Cpu;
    const NAME: &'static str = "ucx";

    fn rank(&self) -> usize {
        self.core.rank
    }
    fn size(&self) -> usize {
        self.core.size
    }
    fn device(&self) -> &CpuDevice {
        &self.device
    }
    fn capabilities(&self) -> Capabilities {
        UcxComm::declared_capabilities()
    }

    fn launch(&self, calls: Vec<Call<'_, Cpu>>, stream: &CpuStream) -> Result<()> {
        // A job that has failed fails the call when the stream reaches it
        // (asynchronously, like every failure found while running).
        let mut accesses = Vec::new();
        let lock_err = || CommError::invalid("ucx", "a send/recv counter lock was poisoned");
        let mut sent_guard = self.sent.lock().map_err(|_| lock_err())?;
        let mut received_guard = self.received.lock().map_err(|_| lock_err())?;
        let (mut sent, mut received) = (sent_guard.clone(), received_guard.clone());
        let prepared = calls
            .iter()
            .map(|c| self.prepare(c, &mut accesses, &mut sent, &mut received))
            .collect::<Result<Vec<_>>>()?;
        let name = if calls.len() == 1 { calls[0].kind.kind().name() } else { "group" };
        let core = self.core.clone();
        let stream_name = stream.name();
        stream
            .enqueue(name, &accesses, move |input| match input {
                JobInput::Run => run_group(&core, &prepared).map_err(|e| {
                    core.job.fail(e.clone());
                    // A later error of the job (a peer's report) stays the job's;
                    // this call fails with what it saw.
                    DeviceError::OpFailed { op: name, stream: stream_name, source: Arc::new(e) }
                }),
                JobInput::Skip(cause) => {
                    core.job.fail(CommError::Aborted {
                        reason: format!("world rank {}'s stream failed before {name}: {cause}", core.job.world_rank),
                    });
                    Ok(())
                }
            })
            .map_err(CommError::Device)?;
        // Enqueued: the pairs' numbers are taken (a refused launch takes none).
        *sent_guard = sent;
        *received_guard = received;
        Ok(())
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<UcxComm>> {
        crate::host_fn_check("ucx split")?;
        if let Some(e) = self.core.job.abort_error() {
            return Err(e);
        }
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let (me, size) = (self.core.rank, self.core.size);
        let timeout = self.core.job.timeout;
        let store = &self.core.job.store;
        let base = format!("{}/split{n}", self.prefix);
        let entry = match color {
            Some(c) => format!("{c},{key}"),
            None => format!("-,{key}"),
        };
        store.set(&format!("{base}/{me}"), entry.as_bytes())?;
        let keys: Vec<String> = (0..size).map(|r| format!("{base}/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let values = store.multi_get(&refs, timeout).map_err(|e| match e {
            CommError::Timeout { waited, .. } => {
                let missing = refs
                    .iter()
                    .enumerate()
                    .filter(|(_, k)| !store.check(&[k]).unwrap_or(true))
                    .map(|(r, _)| r)
                    .collect();
                CommError::Timeout { op: "split".into(), seq: n, waited, missing }
            }
            other => other,
        })?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = Vec::new();
        for (r, v) in values.iter().enumerate() {
            let text = String::from_utf8_lossy(v);
            let (c, k) = text
                .split_once(',')
                .ok_or_else(|| CommError::invalid("split", format!("rank {r}'s entry {text:?} is not color,key")))?;
            if c == color.to_string() {
                let k: i64 = k.parse().map_err(|_| CommError::invalid("split", format!("rank {r}'s key {k:?}")))?;
                members.push((k, r));
            }
        }
        members.sort();
        let my_index = members
            .iter()
            .position(|(_, r)| *r == me)
            .ok_or_else(|| CommError::invalid("split", "not in my own color"))?;
        let child_prefix = format!("{base}/c{color}");
        let id_key = format!("{child_prefix}/id");
        let id = if my_index == 0 {
            let id = store.add(&format!("{}/next_comm_id", self.core.job.config.prefix), 1)?;
            store.set(&id_key, id.to_string().as_bytes())?;
            id
        } else {
            let v = store.get(&id_key, timeout)?;
            String::from_utf8_lossy(&v)
                .parse()
                .map_err(|_| CommError::invalid("split", "the communicator id in the store does not parse"))?
        };
        if id <= 0 || id as u64 >= wire::MAX_COMMS {
            return Err(CommError::invalid(
                "split",
                format!("communicator id {id}: at most {} communicators per job", wire::MAX_COMMS - 1),
            ));
        }
        let world: Vec<usize> = members.iter().map(|(_, r)| self.core.members[*r]).collect();
        let core = Arc::new(Core::new(self.core.job.clone(), id as u16, my_index, world));
        Ok(Some(UcxComm::with_core(core, self.device.clone(), child_prefix)))
    }

    fn abort(&self, reason: &str) {
        self.core.job.fail(CommError::Aborted {
            reason: format!("world rank {} called abort: {reason}", self.core.job.world_rank),
        });
    }

    fn async_error(&self) -> Option<CommError> {
        self.core.job.abort_error()
    }
}

/// Starts a UCP context and worker and stops them: whether UCX works in
/// this process, and what it is (for `chorus info`).
pub fn probe() -> Result<String> {
    let (ctag, cmask) = wire::control_match();
    let engine = Engine::start("probe", ControlTag { tag: ctag, mask: cmask }, Arc::new(|_| {}), engine::DEFAULT_SPIN)?;
    Ok(format!("UCX {} (bundled), worker address {} bytes", ucx_rs::VENDORED_UCX_VERSION, engine.address().len()))
}

#[cfg(test)]
mod tests;
