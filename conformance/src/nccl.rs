//! The harness that runs the suite on NCCL: one rank per GPU, as threads of
//! this process, bootstrapped through an in-memory [`MemStore`].
//!
//! On one GPU the world has one rank, which still runs every collective
//! (NCCL's one-rank communicators are real) and every stream and event case
//! on the cuda device. On several GPUs rank r drives GPU r. Cases that leave
//! the communicator healthy share one world; cases that break it on purpose
//! get a fresh world with a short deadline. NCCL cannot inject faults and has
//! no stream sanitizer, and an abort stays on its rank: the cases that need
//! those are reported as skipped, with the reason.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use anyhow::bail;
use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl::{NcclComm, NcclConfig};
use chorus_collectives::Communicator;
use chorus_devices::cuda::{self, CudaConfig, CudaDevice};

use crate::{Case, CaseOutcome, Faults, Hooks, HostBarrier, Isolation, RankCtx, Status, Summary, Support};

/// Deadline of the world shared by value cases.
pub const SHARED_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline of the fresh world of each error case.
pub const FRESH_TIMEOUT: Duration = Duration::from_secs(5);

/// The names of the suite's cases for `world_size` ranks, in run order.
pub fn case_names(world_size: usize) -> Vec<String> {
    crate::cases::<NcclComm>(world_size).into_iter().map(|c| c.name).collect()
}

/// Number of GPUs visible (the largest world this harness can run), or why there are none.
pub fn gpus() -> Result<usize, chorus_devices::DeviceError> {
    cuda::device_count()
}

/// The harness's hooks: a host barrier, and no fault injection (NCCL has none).
struct NcclHooks {
    barrier: HostBarrier,
}

impl Hooks for NcclHooks {
    fn host_barrier(&self) -> Result<(), crate::Failure> {
        self.barrier.wait()
    }
    fn faults(&self) -> Option<&dyn Faults> {
        None
    }
}

/// Makes a world: one thread per rank initializes its communicator (NCCL's
/// init is collective, so they must run at once).
fn world(size: usize, timeout: Duration) -> Result<Vec<Communicator<NcclComm>>, crate::Failure> {
    let store = MemStore::new();
    let config = NcclConfig { timeout, ..NcclConfig::default() };
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (store, config) = (store.clone(), config.clone());
                s.spawn(move || {
                    let device = CudaDevice::with_config(CudaConfig { ordinal: rank, timeout: timeout * 2 })?;
                    Ok::<_, crate::Failure>(NcclComm::init(&store, rank, size, device, config)?)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| bail!("a rank panicked while joining"))).collect()
    });
    results.into_iter().collect()
}

/// Runs `case` on every rank of `comms`; the status and the wall time.
fn run_case(comms: &[Communicator<NcclComm>], case: &Case<NcclComm>, support: Support, timeout: Duration) -> Status {
    let hooks = NcclHooks { barrier: HostBarrier::new(comms.len(), timeout * 2) };
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let hooks = &hooks;
                s.spawn(move || {
                    let ctx = RankCtx { comm, hooks, support, comm_timeout: timeout };
                    let r = match catch_unwind(AssertUnwindSafe(|| (case.run)(&ctx))) {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(e)) => Err(format!("rank {}: {e:#}", comm.rank())),
                        Err(_) => Err(format!("rank {}: panicked", comm.rank())),
                    };
                    if r.is_err() {
                        // Peers waiting for this rank fail now, not at their deadline.
                        hooks.barrier.cancel();
                        comm.abort(&format!("rank {} failed {}", comm.rank(), case.name));
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().unwrap_or_else(|_| Err("a rank thread panicked".into())).err())
            .collect()
    });
    if failures.is_empty() {
        Status::Passed
    } else {
        Status::Failed(failures.join("; "))
    }
}

/// Runs the cases whose name contains `filter` on `world_size` ranks (one
/// per GPU), calling `on_outcome` after each, and returns the counts.
pub fn run(world_size: usize, filter: Option<&str>, on_outcome: &mut dyn FnMut(&CaseOutcome)) -> Summary {
    let mut summary = Summary::default();
    let mut emit = |name: &str, status: Status, duration: Duration| {
        let o = CaseOutcome { name: name.to_string(), world_size, status, duration };
        summary.add(&o);
        on_outcome(&o);
    };
    match gpus() {
        Err(e) => {
            emit("nccl/world", Status::Failed(format!("no CUDA devices: {e}")), Duration::ZERO);
            return summary;
        }
        Ok(n) if world_size == 0 || world_size > n => {
            let reason = format!("a world of {world_size} needs as many GPUs (one rank per GPU); {n} visible");
            emit("nccl/world", Status::Failed(reason), Duration::ZERO);
            return summary;
        }
        Ok(_) => {}
    }
    let mut shared: Option<Vec<Communicator<NcclComm>>> = None;
    let mut support: Option<Support> = None;
    for case in crate::select::<NcclComm>(world_size, filter) {
        if let Some(reason) = support.and_then(|s| case.skip_reason(world_size, &s)) {
            emit(&case.name, Status::Skipped(reason), Duration::ZERO);
            continue;
        }
        let start = Instant::now();
        let fresh = case.isolation == Isolation::Fresh;
        let timeout = if fresh { FRESH_TIMEOUT } else { SHARED_TIMEOUT };
        let mut fresh_world = None;
        let comms = if fresh {
            match world(world_size, timeout) {
                Ok(w) => fresh_world.insert(w),
                Err(e) => {
                    emit(&case.name, Status::Failed(format!("could not make a world: {e:#}")), start.elapsed());
                    continue;
                }
            }
        } else {
            if shared.is_none() {
                match world(world_size, timeout) {
                    Ok(w) => shared = Some(w),
                    Err(e) => {
                        emit(&case.name, Status::Failed(format!("could not make a world: {e:#}")), start.elapsed());
                        continue;
                    }
                }
            }
            match shared.as_mut() {
                Some(w) => w,
                None => continue,
            }
        };
        let s = *support.get_or_insert(Support {
            capabilities: comms[0].capabilities(),
            stream_sanitizer: false,
            fault_hooks: false,
        });
        if let Some(reason) = case.skip_reason(world_size, &s) {
            emit(&case.name, Status::Skipped(reason), Duration::ZERO);
            continue;
        }
        let status = run_case(comms, &case, s, timeout);
        if !fresh && !matches!(status, Status::Passed) {
            // A failed case may leave the shared world out of step: replace it.
            shared = None;
        }
        emit(&case.name, status, start.elapsed());
    }
    summary
}
