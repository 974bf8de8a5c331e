//! The suite with one rank per process: each process runs the same cases
//! in the same order (the list of [`harness::cases`](crate::harness::cases)),
//! with host barriers and the cases' results going through the job's
//! rendezvous [`Store`], and rank 0 reporting every case's outcome.
//!
//! A backend that can run one rank per process implements [`RankHarness`]
//! on top of its [`Harness`]: how this process joins a new world. The rest
//! is the threaded runner's logic, per process ([`run_rank`]):
//!
//! - cases that leave the world healthy share one world until a case fails
//!   (or [`CASES_PER_WORLD`] have run); each error case gets a world of its
//!   own with the harness's short deadline; skips are decided from the
//!   harness's declared support, identically on every rank;
//! - each case runs on a thread of its own with the harness's case
//!   deadline; a rank whose case fails aborts its communicator and cancels
//!   the case's host barrier, so the others fail promptly;
//! - every rank publishes its result under `{prefix}/case{i}/r{rank}`;
//!   rank 0 gathers them (a rank that never reports is named), publishes
//!   the verdict, and every rank continues from the same verdict — so all
//!   agree when a world must be replaced, and every rank's summary is
//!   rank 0's.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::{RoundBarrier, Store};
use chorus_collectives::{CommBackend, CommError, Communicator};

use crate::harness::{select, Harness, CASES_PER_WORLD};
use crate::{Case, CaseFn, CaseOutcome, Failure, Faults, Hooks, Isolation, RankCtx, Status, Summary, Support};

/// A harness whose ranks can be processes: how this process joins a world.
pub trait RankHarness: Harness {
    /// This process's communicator of a new world: rank `env.rank` of
    /// `env.size` (its device picked by `env.local_rank`), through
    /// `env.store` under `prefix` (unique per world), giving up on a missing
    /// peer after `timeout`. Every rank calls it for every world, in the
    /// same order.
    fn join(&self, env: &RankEnv, prefix: &str, timeout: Duration) -> Result<Communicator<Self::C>, Failure>;
}

/// Where this process is in the job.
#[derive(Clone)]
pub struct RankEnv {
    /// This process's rank.
    pub rank: usize,
    /// Ranks (processes) in the job.
    pub size: usize,
    /// This process's rank on its node (picks its GPU).
    pub local_rank: usize,
    /// The job's rendezvous store.
    pub store: Arc<dyn Store>,
    /// The store prefix of this run (unique per run in the store).
    pub prefix: String,
}

/// Extra time beyond a case's deadline for the ranks' results and the verdict to go through the store.
const REPORT_SLACK: Duration = Duration::from_secs(30);

/// The case's host barrier: rounds of a [`RoundBarrier`] through the job's
/// store, waited for on the store's side; a rank that fails cancels it, and
/// the others' waits fail at once instead of at the deadline.
struct CaseBarrier {
    rounds: RoundBarrier,
    timeout: Duration,
}

impl CaseBarrier {
    fn wait(&self) -> Result<(), Failure> {
        self.rounds.wait(self.timeout).map_err(|e| match e {
            CommError::Aborted { .. } => anyhow::anyhow!("host barrier cancelled: another rank failed ({e})"),
            CommError::Timeout { .. } => {
                anyhow::anyhow!("host barrier: not every rank arrived within {:?} ({e})", self.timeout)
            }
            other => anyhow::Error::new(other).context("host barrier"),
        })
    }

    fn cancel(&self, reason: &str) {
        // Best effort: a store that cannot be reached fails the others' waits anyway.
        let _ = self.rounds.cancel(reason);
    }
}

struct ProcessHooks<C: CommBackend> {
    barrier: CaseBarrier,
    comm: Arc<Communicator<C>>,
}

impl<C: CommBackend> Hooks for ProcessHooks<C> {
    fn host_barrier(&self) -> Result<(), Failure> {
        self.barrier.wait()
    }
    fn faults(&self) -> Option<&dyn Faults> {
        None
    }
}

impl<C: CommBackend> ProcessHooks<C> {
    fn fail(&self, reason: &str) {
        self.comm.abort(reason);
        self.barrier.cancel(reason);
    }
}

struct Job<C: CommBackend> {
    name: String,
    run: CaseFn<C>,
    hooks: Arc<ProcessHooks<C>>,
}

/// A world of this process: its communicator and the thread that runs cases on it.
struct LocalWorld<C: CommBackend> {
    comm: Arc<Communicator<C>>,
    jobs: Sender<Job<C>>,
    results: Receiver<Result<(), String>>,
    thread: Option<JoinHandle<()>>,
    cases_run: usize,
    healthy: bool,
    stuck: bool,
}

impl<C: CommBackend> LocalWorld<C> {
    fn start(comm: Communicator<C>, support: Support, timeout: Duration) -> Result<LocalWorld<C>, Failure> {
        let comm = Arc::new(comm);
        let (jobs, job_rx) = mpsc::channel::<Job<C>>();
        let (result_tx, results) = mpsc::channel();
        let thread_comm = comm.clone();
        let thread = std::thread::Builder::new().name("conformance-case".into()).spawn(move || {
            while let Ok(job) = job_rx.recv() {
                let ctx = RankCtx { comm: &thread_comm, hooks: job.hooks.as_ref(), support, comm_timeout: timeout };
                let result = match catch_unwind(AssertUnwindSafe(|| (job.run)(&ctx))) {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(format!("{e:#}")),
                    Err(p) => Err(format!(
                        "panicked: {}",
                        p.downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_default()
                    )),
                };
                if result.is_err() {
                    job.hooks.fail(&format!("rank {} failed case {}", thread_comm.rank(), job.name));
                }
                if result_tx.send(result).is_err() {
                    break;
                }
            }
        })?;
        Ok(LocalWorld { comm, jobs, results, thread: Some(thread), cases_run: 0, healthy: true, stuck: false })
    }

    /// Runs `case` here; this rank's result.
    fn run(&mut self, case: &Case<C>, hooks: Arc<ProcessHooks<C>>, deadline: Duration) -> Result<(), String> {
        self.cases_run += 1;
        let job = Job { name: case.name.clone(), run: case.run.clone(), hooks: hooks.clone() };
        if self.jobs.send(job).is_err() {
            self.healthy = false;
            return Err("the case thread has exited".into());
        }
        match self.results.recv_timeout(deadline) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => {
                hooks.fail(&format!("the case did not finish within {deadline:?}"));
                match self.results.recv_timeout(Duration::from_secs(5)) {
                    Ok(Err(e)) => Err(format!("did not finish within {deadline:?}: {e}")),
                    Ok(Ok(())) => Err(format!("did not finish within {deadline:?}")),
                    Err(_) => {
                        self.stuck = true;
                        Err(format!("did not finish within {deadline:?} and is stuck"))
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => Err("the case thread has exited".into()),
        }
    }
}

impl<C: CommBackend> Drop for LocalWorld<C> {
    fn drop(&mut self) {
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, tx));
        if let Some(t) = self.thread.take() {
            if !self.stuck {
                let _ = t.join();
            }
        }
    }
}

fn encode(status: &Status) -> Vec<u8> {
    match status {
        Status::Passed => b"P".to_vec(),
        Status::Failed(m) => format!("F{m}").into_bytes(),
        Status::Skipped(m) => format!("S{m}").into_bytes(),
    }
}

fn decode(bytes: &[u8]) -> Status {
    let text = String::from_utf8_lossy(bytes.get(1..).unwrap_or_default()).into_owned();
    match bytes.first() {
        Some(b'P') => Status::Passed,
        Some(b'S') => Status::Skipped(text),
        _ => Status::Failed(text),
    }
}

/// Runs the cases `filter` selects ([`selected`](crate::harness::selected)) as rank `env.rank` of a job
/// of `env.size` processes, calling `on_outcome` after each case with the
/// outcome every rank agreed on (print it on rank 0). Every rank of the job
/// calls it with the same arguments; every rank returns rank 0's summary.
pub fn run_rank<H: RankHarness>(
    harness: &H,
    env: &RankEnv,
    filter: Option<&str>,
    on_outcome: &mut dyn FnMut(&CaseOutcome),
) -> Summary {
    let n = env.size;
    let mut summary = Summary::default();
    let mut emit = |name: &str, status: Status, duration: Duration| {
        let o = CaseOutcome { name: name.to_string(), world_size: n, status, duration };
        summary.add(&o);
        on_outcome(&o);
    };
    let support = harness.support();
    let mut shared: Option<LocalWorld<H::C>> = None;
    let mut worlds = 0u64;
    for (index, case) in select(harness, n, filter).into_iter().enumerate() {
        if let Some(reason) = case.skip_reason(n, &support) {
            emit(&case.name, Status::Skipped(reason), Duration::ZERO);
            continue;
        }
        let start = Instant::now();
        let timeout = match case.isolation {
            Isolation::Shared => harness.shared_timeout(),
            Isolation::Fresh => harness.fresh_timeout(),
        };
        let deadline = harness.case_deadline(timeout);
        if case.isolation == Isolation::Fresh
            || shared.as_ref().is_some_and(|w| !w.healthy || w.cases_run >= CASES_PER_WORLD)
        {
            shared = None;
        }
        let mut fresh = None;
        let world = match (&mut shared, case.isolation) {
            (Some(w), Isolation::Shared) => Ok(w),
            (slot, isolation) => {
                let prefix = format!("{}/world{worlds}", env.prefix);
                worlds += 1;
                let made =
                    harness.join(env, &prefix, timeout).and_then(|comm| LocalWorld::start(comm, support, timeout));
                match (made, isolation) {
                    (Ok(w), Isolation::Shared) => Ok(slot.insert(w)),
                    (Ok(w), Isolation::Fresh) => Ok(fresh.insert(w)),
                    (Err(e), _) => Err(format!("could not make a world: {e:#}")),
                }
            }
        };
        let case_prefix = format!("{}/case{index}", env.prefix);
        let local = match world {
            Ok(w) => {
                let rounds = RoundBarrier::new(env.store.clone(), format!("{case_prefix}/barrier"), n);
                let ran = rounds.map_err(|e| format!("host barrier: {e}")).and_then(|rounds| {
                    let barrier = CaseBarrier { rounds, timeout: deadline };
                    w.run(&case, Arc::new(ProcessHooks { barrier, comm: w.comm.clone() }), deadline)
                });
                match (ran, harness.after_case()) {
                    (Ok(()), after) => after,
                    (Err(e), Ok(())) => Err(e),
                    (Err(e), Err(a)) => Err(format!("{e}; {a}")),
                }
            }
            Err(e) => Err(e),
        };
        // A fresh world goes only once every rank has reported: no rank tears
        // its endpoints down while another is still joining or running.
        let status = agree(env, &case_prefix, local, deadline + REPORT_SLACK);
        drop(fresh);
        if !matches!(status, Status::Passed) {
            if let Some(w) = shared.as_mut() {
                w.healthy = false;
            }
        }
        emit(&case.name, status, start.elapsed());
    }
    summary
}

/// Publishes this rank's result; rank 0 gathers every rank's and publishes
/// the verdict, which every rank returns.
fn agree(env: &RankEnv, case_prefix: &str, local: Result<(), String>, wait: Duration) -> Status {
    let mine = match &local {
        Ok(()) => b"P".to_vec(),
        Err(e) => format!("F{e}").into_bytes(),
    };
    let verdict_key = format!("{case_prefix}/verdict");
    if let Err(e) = env.store.set(&format!("{case_prefix}/r{}", env.rank), &mine) {
        return Status::Failed(format!("rank {}: could not publish its result: {e}", env.rank));
    }
    if env.rank != 0 {
        return match env.store.get(&verdict_key, wait) {
            Ok(v) => decode(&v),
            Err(e) => Status::Failed(format!("rank {}: rank 0's verdict never came: {e}", env.rank)),
        };
    }
    let deadline = Instant::now() + wait;
    let mut failures = Vec::new();
    for r in 0..env.size {
        let key = format!("{case_prefix}/r{r}");
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match env.store.get(&key, left) {
            Ok(v) if v.first() == Some(&b'P') => {}
            Ok(v) => failures.push(format!("rank {r}: {}", String::from_utf8_lossy(&v[1.min(v.len())..]))),
            Err(_) => failures.push(format!("rank {r}: never reported (within {wait:?})")),
        }
    }
    let status = if failures.is_empty() { Status::Passed } else { Status::Failed(failures.join("; ")) };
    let _ = env.store.set(&verdict_key, &encode(&status));
    status
}
