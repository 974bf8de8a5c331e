//! The simulated library's state: its communicators by handle, their
//! rendezvous, the calls of the open group, and the rule violations seen.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus_devices::cpu::{CpuDevice, RawRange};

use crate::nccl_family::abi::{ResultCode, UNIQUE_ID_BYTES};
use crate::nccl_family::sys::{ncclComm_t, ncclResult_t};
use crate::sim::world::{AbortState, WorldShared};
use crate::sim::Prepared;

/// The result codes the library returns.
pub(super) const OK: ncclResult_t = ResultCode::SUCCESS.0;
pub(super) const IN_PROGRESS: ncclResult_t = ResultCode::IN_PROGRESS.0;
pub(super) const INVALID_ARGUMENT: ncclResult_t = ResultCode::INVALID_ARGUMENT.0;
pub(super) const INTERNAL: ncclResult_t = ResultCode::INTERNAL_ERROR.0;
pub(super) const REMOTE: ncclResult_t = ResultCode::REMOTE_ERROR.0;

/// The handle a communicator pointer stands for (the library's table key).
pub(super) fn handle_of(comm: ncclComm_t) -> usize {
    comm as usize
}

/// How long the library's own rendezvous wait: beyond any test's deadline,
/// so the caller's deadline (its watchdog) is what ends a wait on a dead
/// peer, as with NCCL. An abort ends it at once.
pub(crate) const HORIZON: Duration = Duration::from_secs(600);

static VIOLATIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The rule violations seen since the last call, oldest first (a handle used
/// after abort or destroy, concurrent calls on one communicator, a call while
/// a non-blocking operation is in progress, a destroyed reduce operator).
pub fn take_violations() -> Vec<String> {
    std::mem::take(&mut *VIOLATIONS.lock().unwrap_or_else(|p| p.into_inner()))
}

pub(crate) fn violation(what: String) -> i32 {
    VIOLATIONS.lock().unwrap_or_else(|p| p.into_inner()).push(what);
    ResultCode::INVALID_USAGE.0
}

/// A communicator's asynchronous state, as `ncclCommGetAsyncError` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AsyncState {
    Ready,
    InProgress,
    Failed(i32),
}

/// The ranks that joined one unique id.
pub(crate) struct Rendezvous {
    pub(crate) world: Arc<WorldShared>,
    joined: Mutex<usize>,
    all: Condvar,
}

impl Rendezvous {
    pub(crate) fn complete(&self) -> bool {
        self.joined.lock().map(|j| *j >= self.world.size).unwrap_or(false)
    }

    /// Blocks until every rank has joined (blocking initialization).
    pub(crate) fn wait_all(&self) -> bool {
        let deadline = Instant::now() + HORIZON;
        let Ok(mut j) = self.joined.lock() else { return false };
        while *j < self.world.size {
            let now = Instant::now();
            if now >= deadline || self.world.abort.error().is_some() {
                return false;
            }
            j = match self.all.wait_timeout(j, (deadline - now).min(Duration::from_millis(50))) {
                Ok((j, _)) => j,
                Err(_) => return false,
            };
        }
        true
    }
}

/// Joins the rendezvous of `id` as one of `size` ranks.
pub(crate) fn join(id: [u8; UNIQUE_ID_BYTES], size: usize) -> Result<Arc<Rendezvous>, &'static str> {
    static INITS: Mutex<Vec<([u8; UNIQUE_ID_BYTES], Arc<Rendezvous>)>> = Mutex::new(Vec::new());
    let mut inits = INITS.lock().unwrap_or_else(|p| p.into_inner());
    let r = match inits.iter().find(|(k, _)| *k == id) {
        Some((_, r)) => r.clone(),
        None => {
            let world = WorldShared::new(size, "simnccl".into(), HORIZON, Arc::new(AbortState::default()));
            let r = Arc::new(Rendezvous { world, joined: Mutex::new(0), all: Condvar::new() });
            inits.push((id, r.clone()));
            r
        }
    };
    if r.world.size != size {
        return Err("the ranks of one unique id disagree on the world size");
    }
    let mut j = r.joined.lock().map_err(|_| "rendezvous poisoned")?;
    *j += 1;
    if *j >= size {
        // Complete: later inits with this id start a new world.
        inits.retain(|(k, _)| *k != id);
    }
    drop(j);
    r.all.notify_all();
    Ok(r)
}

/// One simulated communicator.
pub(crate) struct SimComm {
    pub(crate) handle: usize,
    pub(crate) rank: usize,
    pub(crate) version: i32,
    pub(crate) blocking: bool,
    /// Where the world came from (its completion is the init's).
    pub(crate) rendezvous: Option<Arc<Rendezvous>>,
    pub(crate) world: Arc<WorldShared>,
    /// A call is inside the library on this communicator.
    busy: AtomicBool,
    pub(crate) state: Mutex<AsyncState>,
    pub(crate) next_seq: AtomicU64,
    pub(crate) next_split: AtomicU64,
    /// Pre-multiplied sums' scalars by operator.
    pub(crate) ops: Mutex<HashMap<i32, f64>>,
    /// The library's threads working for this communicator (joined by abort and destroy).
    pub(crate) jobs: Mutex<Vec<JoinHandle<()>>>,
    /// The device its work was enqueued on (the first stream's), which
    /// destroy waits to be idle, as NCCL's frees wait for the whole device.
    pub(crate) device: Mutex<Option<CpuDevice>>,
}

impl SimComm {
    pub(crate) fn new(
        rank: usize,
        version: i32,
        blocking: bool,
        world: Arc<WorldShared>,
        rendezvous: Option<Arc<Rendezvous>>,
    ) -> Arc<SimComm> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        // Handles look like pointers but are never dereferenced: a stale one is
        // caught by the registry.
        let handle = (NEXT.fetch_add(1, Ordering::Relaxed) as usize) << 4 | 0x8;
        let c = Arc::new(SimComm {
            handle,
            rank,
            version,
            blocking,
            rendezvous,
            world,
            busy: AtomicBool::new(false),
            state: Mutex::new(AsyncState::Ready),
            next_seq: AtomicU64::new(0),
            next_split: AtomicU64::new(0),
            ops: Mutex::new(HashMap::new()),
            jobs: Mutex::new(Vec::new()),
            device: Mutex::new(None),
        });
        registry().insert(handle, c.clone());
        c
    }

    pub(crate) fn size(&self) -> usize {
        self.world.size
    }

    pub(crate) fn state(&self) -> AsyncState {
        let s = *self.state.lock().unwrap_or_else(|p| p.into_inner());
        match (s, &self.rendezvous) {
            (AsyncState::Ready, Some(r)) if !r.complete() => AsyncState::InProgress,
            _ => s,
        }
    }

    pub(crate) fn set_state(&self, s: AsyncState) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    /// Joins the library's threads of this communicator.
    pub(crate) fn join_jobs(&self) {
        let jobs = std::mem::take(&mut *self.jobs.lock().unwrap_or_else(|p| p.into_inner()));
        for j in jobs {
            let _ = j.join();
        }
    }
}

fn registry() -> MutexGuard<'static, HashMap<usize, Arc<SimComm>>> {
    static COMMS: OnceLock<Mutex<HashMap<usize, Arc<SimComm>>>> = OnceLock::new();
    COMMS.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner())
}

/// A call in progress on one communicator: marks it busy (two at once is a
/// violation) and releases it when dropped.
pub(crate) struct Entered {
    pub(crate) comm: Arc<SimComm>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.comm.busy.store(false, Ordering::Release);
    }
}

/// Enters `call` on `handle`: the live communicator, or a violation code.
/// `while_in_progress` allows the calls NCCL allows during a non-blocking
/// operation (polling its state, aborting).
pub(crate) fn enter(handle: usize, call: &str, while_in_progress: bool) -> Result<Entered, i32> {
    let comm = match registry().get(&handle) {
        Some(c) => c.clone(),
        None => {
            return Err(violation(format!(
                "{call} on communicator {handle:#x}, which was aborted, destroyed or never created"
            )))
        }
    };
    if comm.busy.swap(true, Ordering::AcqRel) {
        return Err(violation(format!("{call} on communicator {handle:#x} while another call is inside it")));
    }
    let entered = Entered { comm };
    if !while_in_progress && entered.comm.state() == AsyncState::InProgress {
        return Err(violation(format!(
            "{call} on communicator {handle:#x} while its non-blocking operation is still in progress"
        )));
    }
    Ok(entered)
}

/// Removes a communicator from the registry: its handle is dead.
pub(crate) fn release(handle: usize) -> Option<Arc<SimComm>> {
    registry().remove(&handle)
}

/// A call added to the open group.
pub(crate) struct Queued {
    pub(crate) comm: Arc<SimComm>,
    pub(crate) stream: usize,
    pub(crate) call: Prepared,
    /// For the emulated one-rank scaling bug: the output's bytes and the
    /// input they are computed from.
    pub(crate) scaled: Option<(RawRange, RawRange, bool)>,
}

thread_local! {
    /// `ncclGroupStart` depth and the calls of the open group, per thread as in NCCL.
    pub(crate) static GROUP: std::cell::RefCell<(u32, Vec<Queued>)> = const { std::cell::RefCell::new((0, Vec::new())) };
}
