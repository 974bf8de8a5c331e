//! The harness that runs the suite on the sim backend: ranks as threads.
//!
//! Cases that leave the communicator healthy ([`Isolation::Shared`]) run one
//! after another in one world: its rank threads are spawned once and each
//! runs the cases in list order (with fresh streams per case), reporting
//! after every case. A failing rank aborts that world, so its peers fail
//! promptly instead of waiting for it; the harness then reports the case,
//! starts a new world, and goes on with the next case. Worlds are also
//! replaced every [`CASES_PER_WORLD`] cases so that per-device bookkeeping
//! (the stream sanitizer's clocks grow with every stream ever made) stays small.
//!
//! Cases that break their communicator on purpose ([`Isolation::Fresh`]) get
//! a world each, with a short rendezvous deadline ([`FRESH_TIMEOUT`]) so that
//! the timeouts they provoke are quick.
//!
//! The devices always run the stream sanitizer, whatever `CHORUS_SANITIZER`
//! says: the suite checks the contract, and the sanitizer is part of it here.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus_collectives::sim::{Fault, FaultKind, SimComm, SimConfig, SimWorld};
use chorus_collectives::Communicator;
use chorus_devices::cpu::CpuConfig;

use crate::{
    Case, CaseFn, CaseOutcome, FaultAction, FaultSpec, Faults, Hooks, HostBarrier, Isolation, RankCtx, Status, Summary,
    Support,
};

/// Rendezvous deadline of the world shared by value cases.
pub const SHARED_TIMEOUT: Duration = Duration::from_secs(30);
/// Rendezvous deadline of the fresh world of each error case.
pub const FRESH_TIMEOUT: Duration = Duration::from_millis(500);
/// Cases run in one shared world before it is replaced.
pub const CASES_PER_WORLD: usize = 400;
/// How long the harness waits for every rank to finish a shared-world case.
const SHARED_DEADLINE: Duration = Duration::from_secs(90);
/// How long the harness waits for every rank to finish a fresh-world case.
const FRESH_DEADLINE: Duration = Duration::from_secs(20);

fn config(timeout: Duration) -> SimConfig {
    let device = CpuConfig::default().with_timeout(timeout.max(Duration::from_secs(10)) * 2);
    SimConfig { timeout, device }
}

/// The names of the suite's cases for a world of `world_size` ranks, in run order.
pub fn case_names(world_size: usize) -> Vec<String> {
    crate::cases::<SimComm>(world_size).into_iter().map(|c| c.name).collect()
}

/// What the sim backend and this harness offer.
pub fn support() -> Result<Support, chorus_collectives::CommError> {
    let world = SimWorld::new(1, config(SHARED_TIMEOUT))?;
    let comm = world.communicator(0)?;
    Ok(Support {
        capabilities: comm.capabilities(),
        stream_sanitizer: comm.device().sanitizer_enabled(),
        fault_hooks: true,
    })
}

/// Runs the cases whose name contains `filter` (all when `None`) on a world
/// of `world_size` ranks, calling `on_outcome` after each case, and returns
/// the counts.
pub fn run(world_size: usize, filter: Option<&str>, on_outcome: &mut dyn FnMut(&CaseOutcome)) -> Summary {
    let mut summary = Summary::default();
    let mut emit = |name: &str, status: Status, duration: Duration| {
        let o = CaseOutcome { name: name.to_string(), world_size, status, duration };
        summary.add(&o);
        on_outcome(&o);
    };
    let support = match (world_size, support()) {
        (0, _) => {
            emit("sim/world", Status::Failed("a world needs at least one rank".into()), Duration::ZERO);
            return summary;
        }
        (_, Err(e)) => {
            emit("sim/world", Status::Failed(format!("could not make a sim world: {e}")), Duration::ZERO);
            return summary;
        }
        (_, Ok(s)) => s,
    };

    let mut shared: Option<Runner> = None;
    for case in crate::select::<SimComm>(world_size, filter) {
        if let Some(reason) = case.skip_reason(world_size, &support) {
            emit(&case.name, Status::Skipped(reason), Duration::ZERO);
            continue;
        }
        let (status, duration) = match case.isolation {
            Isolation::Shared => {
                if shared.as_ref().is_some_and(|r| !r.healthy || r.cases_run >= CASES_PER_WORLD) {
                    if let Some(r) = shared.take() {
                        r.close();
                    }
                }
                if shared.is_none() {
                    match Runner::start(world_size, SHARED_TIMEOUT, support) {
                        Ok(r) => shared = Some(r),
                        Err(e) => {
                            emit(&case.name, Status::Failed(format!("could not start a world: {e}")), Duration::ZERO);
                            continue;
                        }
                    }
                }
                match shared.as_mut() {
                    Some(r) => r.run(&case, SHARED_DEADLINE),
                    None => continue,
                }
            }
            Isolation::Fresh => match Runner::start(world_size, FRESH_TIMEOUT, support) {
                Ok(mut r) => {
                    let out = r.run(&case, FRESH_DEADLINE);
                    r.close();
                    out
                }
                Err(e) => (Status::Failed(format!("could not start a world: {e}")), Duration::ZERO),
            },
        };
        emit(&case.name, status, duration);
    }
    if let Some(r) = shared {
        r.close();
    }
    summary
}

struct SimHooks {
    world: SimWorld,
    barrier: Arc<HostBarrier>,
}

impl Faults for SimHooks {
    fn inject(&self, fault: FaultSpec) -> Result<(), crate::Failure> {
        let kind = match fault.action {
            FaultAction::Fail => FaultKind::Fail,
            FaultAction::Stall(d) => FaultKind::Stall(d),
        };
        Ok(self.world.inject_fault(Fault { rank: fault.rank, call: fault.call, kind })?)
    }
    fn abort_world(&self, reason: &str) {
        self.world.abort(reason)
    }
}

impl Hooks for SimHooks {
    fn host_barrier(&self) -> Result<(), crate::Failure> {
        self.barrier.wait()
    }
    fn faults(&self) -> Option<&dyn Faults> {
        Some(self)
    }
}

struct Job {
    id: u64,
    name: String,
    run: CaseFn<SimComm>,
}

struct RankResult {
    job: u64,
    rank: usize,
    result: Result<(), String>,
}

/// One world and its rank threads, which run the cases they are sent.
struct Runner {
    world: SimWorld,
    barrier: Arc<HostBarrier>,
    jobs: Vec<Sender<Job>>,
    results: Receiver<RankResult>,
    threads: Vec<JoinHandle<()>>,
    next_job: u64,
    cases_run: usize,
    /// No rank has failed or hung: the world can take another case.
    healthy: bool,
    /// Some rank did not finish its last case: its thread must not be joined.
    stuck: bool,
}

impl Runner {
    fn start(size: usize, timeout: Duration, support: Support) -> Result<Runner, crate::Failure> {
        let world = SimWorld::new(size, config(timeout))?;
        let barrier = Arc::new(HostBarrier::new(size, FRESH_DEADLINE.max(timeout * 2)));
        let (result_tx, results) = mpsc::channel();
        let mut jobs = Vec::with_capacity(size);
        let mut threads = Vec::with_capacity(size);
        for rank in 0..size {
            let comm = world.communicator(rank)?;
            let (job_tx, job_rx) = mpsc::channel();
            let hooks = SimHooks { world: world.clone(), barrier: barrier.clone() };
            let result_tx = result_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("conformance-rank{rank}"))
                .spawn(move || rank_loop(comm, hooks, support, timeout, job_rx, result_tx))?;
            jobs.push(job_tx);
            threads.push(thread);
        }
        Ok(Runner { world, barrier, jobs, results, threads, next_job: 0, cases_run: 0, healthy: true, stuck: false })
    }

    /// Runs `case` on every rank; the status and the wall time until the last rank reported.
    fn run(&mut self, case: &Case<SimComm>, deadline: Duration) -> (Status, Duration) {
        let n = self.jobs.len();
        let id = self.next_job;
        self.next_job += 1;
        self.cases_run += 1;
        let start = Instant::now();
        for tx in &self.jobs {
            if tx.send(Job { id, name: case.name.clone(), run: case.run.clone() }).is_err() {
                self.healthy = false;
                return (Status::Failed("a rank thread of the harness has exited".into()), start.elapsed());
            }
        }
        let end = start + deadline;
        let mut done = vec![false; n];
        let mut failures: Vec<(usize, String)> = Vec::new();
        let mut received = 0;
        let mut waiting_until = end;
        while received < n {
            match self.results.recv_timeout(waiting_until.saturating_duration_since(Instant::now())) {
                Ok(r) if r.job == id => {
                    received += 1;
                    done[r.rank] = true;
                    if let Err(e) = r.result {
                        failures.push((r.rank, e));
                    }
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) if waiting_until == end => {
                    // Unblock whatever waits on the missing ranks, then give them a moment to report.
                    self.world.abort(&format!("the case did not finish on every rank within {deadline:?}"));
                    self.barrier.cancel();
                    waiting_until = Instant::now() + Duration::from_secs(5);
                }
                Err(_) => break,
            }
        }
        let duration = start.elapsed();
        let hung: Vec<usize> = (0..n).filter(|r| !done[*r]).collect();
        if !hung.is_empty() {
            self.stuck = true;
            self.healthy = false;
            failures.insert(0, (hung[0], format!("ranks {hung:?} did not finish within {deadline:?}")));
        }
        if failures.is_empty() {
            return (Status::Passed, duration);
        }
        self.healthy = false;
        let msg: Vec<String> = failures.into_iter().map(|(r, e)| format!("rank {r}: {e}")).collect();
        (Status::Failed(msg.join("; ")), duration)
    }

    /// Stops the rank threads (joining them unless one is stuck).
    fn close(self) {
        drop(self.jobs);
        if self.stuck {
            return;
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn rank_loop(
    comm: Communicator<SimComm>,
    hooks: SimHooks,
    support: Support,
    timeout: Duration,
    jobs: Receiver<Job>,
    results: Sender<RankResult>,
) {
    let rank = comm.rank();
    while let Ok(job) = jobs.recv() {
        let ctx = RankCtx { comm: &comm, hooks: &hooks, support, comm_timeout: timeout };
        let result = match catch_unwind(AssertUnwindSafe(|| (job.run)(&ctx))) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(panic) => Err(format!("panicked: {}", panic_message(&panic))),
        };
        if result.is_err() {
            // The peers may be waiting for this rank in a collective or at the
            // host barrier: make them fail now rather than at their deadline.
            hooks.world.abort(&format!("rank {rank} failed case {}", job.name));
            hooks.barrier.cancel();
        }
        if results.send(RankResult { job: job.id, rank, result }).is_err() {
            break;
        }
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
