//! One place to register a backend: the [`Harness`] trait and the one runner
//! every backend's suite goes through.
//!
//! A harness says how to make a world of the backend (every rank's
//! communicator, initialized together), what the backend offers (so cases
//! that do not apply are skipped with their reason, also without a device:
//! [`list`]), and its deadlines. [`run`] does the rest for every backend:
//!
//! Cases that leave the communicator healthy ([`Isolation::Shared`]) run one
//! after another in one world: its rank threads are spawned once and each
//! runs the cases in list order (with fresh streams per case), reporting
//! after every case. A failing rank aborts its communicator (and, where the
//! harness can, the whole world), so its peers fail promptly instead of
//! waiting for it; the runner then reports the case, makes a new world, and
//! goes on with the next case. Worlds are also replaced every
//! [`CASES_PER_WORLD`] cases.
//!
//! Cases that break their communicator on purpose ([`Isolation::Fresh`]) get
//! a world each, with the harness's short deadline so the timeouts they
//! provoke are quick.
//!
//! [`conformance_tests!`](crate::conformance_tests) emits one `#[test]` per
//! world size for a harness.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chorus_collectives::{CommBackend, Communicator};

use crate::{
    Case, CaseFn, CaseOutcome, Failure, Faults, Hooks, HostBarrier, Isolation, RankCtx, Status, Summary, Support,
};

/// Cases run in one shared world before it is replaced.
pub const CASES_PER_WORLD: usize = 400;

/// A world under test: every rank's communicator, in rank order, and what the
/// harness can do to the world from outside.
pub struct World<C: CommBackend> {
    /// Rank r's communicator at index r.
    pub comms: Vec<Communicator<C>>,
    /// Fault injection, where the backend has it.
    pub faults: Option<Arc<dyn Faults>>,
}

/// How to run the suite on one backend.
pub trait Harness: Sync {
    /// The backend.
    type C: CommBackend;
    /// The backend's name in reports (`sim`, `simnccl`, `nccl`, `rccl`).
    fn name(&self) -> String;
    /// What the backend and harness offer, declared without making a world
    /// (so skips can be listed on a machine without the backend's device).
    fn support(&self) -> Support;
    /// The largest world this machine can run (GPUs visible), or why none.
    fn max_world(&self) -> Result<usize, String>;
    /// Makes a world of `size` ranks whose communicators give up on a missing
    /// peer after `timeout`.
    fn world(&self, size: usize, timeout: Duration) -> Result<World<Self::C>, Failure>;
    /// The deadline of a shared world.
    fn shared_timeout(&self) -> Duration;
    /// The deadline of a fresh world (error cases): short, so provoked timeouts are quick.
    fn fresh_timeout(&self) -> Duration;
    /// How long the runner waits for every rank to finish a case before it
    /// gives up on the world.
    fn case_deadline(&self, timeout: Duration) -> Duration {
        (timeout * 3).max(Duration::from_secs(20))
    }
    /// Cases beyond the collective suite that this backend runs: the FSDP
    /// cases, for a backend whose device has the compute kernels
    /// (`chorus_devices::ComputeStream`).
    fn extra_cases(&self, world_size: usize) -> Vec<Case<Self::C>> {
        let _ = world_size;
        Vec::new()
    }
    /// A check after every case that is not a case's own: the simulated
    /// library's record of rule violations, say. An `Err` fails the case.
    fn after_case(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Every case `harness` runs at `world_size`, in run order: the collective
/// suite (the errors last), with the harness's extra cases before the errors.
pub fn cases<H: Harness>(harness: &H, world_size: usize) -> Vec<Case<H::C>> {
    let mut all = crate::cases::<H::C>(world_size);
    let errors = all.iter().position(|c| c.name.starts_with("errors/")).unwrap_or(all.len());
    let tail = all.split_off(errors);
    all.extend(harness.extra_cases(world_size));
    all.extend(tail);
    all
}

/// The cases of [`cases`] whose name contains `filter` (all when `None`).
pub fn select<H: Harness>(harness: &H, world_size: usize, filter: Option<&str>) -> Vec<Case<H::C>> {
    cases(harness, world_size).into_iter().filter(|c| selected(&c.name, filter)).collect()
}

/// Whether the case `name` is selected by `filter`: comma-separated terms; a
/// case is selected when its name contains a plain term (any name when there
/// is none) and no term written `!text` (`fsdp/parity,!bf16`; `!fsdp` runs
/// everything but FSDP, so a GPU run can take the collectives and FSDP apart).
pub fn selected(name: &str, filter: Option<&str>) -> bool {
    let Some(filter) = filter else { return true };
    let terms = filter.split(',').map(str::trim).filter(|t| !t.is_empty());
    let (mut any_plain, mut plain_hit) = (false, false);
    for term in terms {
        match term.strip_prefix('!') {
            Some(excluded) if !excluded.is_empty() && name.contains(excluded) => return false,
            Some(_) => {}
            None => {
                any_plain = true;
                plain_hit |= name.contains(term);
            }
        }
    }
    plain_hit || !any_plain
}

/// The names of the cases `harness` runs at `world_size`, in run order.
pub fn case_names<H: Harness>(harness: &H, world_size: usize) -> Vec<String> {
    cases(harness, world_size).into_iter().map(|c| c.name).collect()
}

/// Each case whose name contains `filter`, with whether it would run or be
/// skipped (and why) on `harness` at `world_size` — without a device.
pub fn list<H: Harness>(harness: &H, world_size: usize, filter: Option<&str>) -> Vec<(String, Option<String>)> {
    let support = harness.support();
    select(harness, world_size, filter)
        .into_iter()
        .map(|c| {
            let reason = c.skip_reason(world_size, &support);
            (c.name, reason)
        })
        .collect()
}

/// Runs the cases `filter` selects (see [`selected`]; all when `None`) on a world
/// of `world_size` ranks of `harness`, calling `on_outcome` after each case,
/// and returns the counts.
pub fn run<H: Harness>(
    harness: &H,
    world_size: usize,
    filter: Option<&str>,
    on_outcome: &mut dyn FnMut(&CaseOutcome),
) -> Summary {
    let mut summary = Summary::default();
    let mut emit = |name: &str, status: Status, duration: Duration| {
        let o = CaseOutcome { name: name.to_string(), world_size, status, duration };
        summary.add(&o);
        on_outcome(&o);
    };
    let world_case = format!("{}/world", harness.name());
    match harness.max_world() {
        _ if world_size == 0 => {
            emit(&world_case, Status::Failed("a world needs at least one rank".into()), Duration::ZERO);
            return summary;
        }
        Err(e) => {
            emit(&world_case, Status::Failed(e), Duration::ZERO);
            return summary;
        }
        Ok(n) if world_size > n => {
            emit(
                &world_case,
                Status::Failed(format!("a world of {world_size} ranks needs {world_size} devices; {n} here")),
                Duration::ZERO,
            );
            return summary;
        }
        Ok(_) => {}
    }
    let support = harness.support();
    let mut shared: Option<Runner<H::C>> = None;
    for case in select(harness, world_size, filter) {
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
                    match Runner::start(harness, world_size, harness.shared_timeout(), support) {
                        Ok(r) => shared = Some(r),
                        Err(e) => {
                            emit(&case.name, Status::Failed(format!("could not make a world: {e:#}")), Duration::ZERO);
                            continue;
                        }
                    }
                }
                match shared.as_mut() {
                    Some(r) => r.run(&case, harness.case_deadline(harness.shared_timeout())),
                    None => continue,
                }
            }
            Isolation::Fresh => match Runner::start(harness, world_size, harness.fresh_timeout(), support) {
                Ok(mut r) => {
                    let out = r.run(&case, harness.case_deadline(harness.fresh_timeout()));
                    r.close();
                    out
                }
                Err(e) => (Status::Failed(format!("could not make a world: {e:#}")), Duration::ZERO),
            },
        };
        let status = match (status, harness.after_case()) {
            (Status::Passed, Err(e)) => Status::Failed(e),
            (Status::Failed(m), Err(e)) => Status::Failed(format!("{m}; {e}")),
            (s, _) => s,
        };
        emit(&case.name, status, duration);
    }
    if let Some(r) = shared {
        r.close();
    }
    summary
}

/// The runner's hooks for one rank: the host barrier and the world's faults.
struct RankHooks {
    barrier: Arc<HostBarrier>,
    faults: Option<Arc<dyn Faults>>,
}

impl Hooks for RankHooks {
    fn host_barrier(&self) -> Result<(), Failure> {
        self.barrier.wait()
    }
    fn faults(&self) -> Option<&dyn Faults> {
        self.faults.as_deref()
    }
}

struct Job<C: CommBackend> {
    id: u64,
    name: String,
    run: CaseFn<C>,
}

struct RankResult {
    job: u64,
    rank: usize,
    result: Result<(), String>,
}

/// One world and its rank threads, which run the cases they are sent.
struct Runner<C: CommBackend> {
    faults: Option<Arc<dyn Faults>>,
    barrier: Arc<HostBarrier>,
    jobs: Vec<Sender<Job<C>>>,
    results: Receiver<RankResult>,
    threads: Vec<JoinHandle<()>>,
    next_job: u64,
    cases_run: usize,
    /// No rank has failed or hung: the world can take another case.
    healthy: bool,
    /// Some rank did not finish its last case: its thread must not be joined.
    stuck: bool,
}

impl<C: CommBackend> Runner<C> {
    fn start<H: Harness<C = C>>(
        harness: &H,
        size: usize,
        timeout: Duration,
        support: Support,
    ) -> Result<Runner<C>, Failure> {
        let world = harness.world(size, timeout)?;
        let barrier = Arc::new(HostBarrier::new(size, harness.case_deadline(timeout)));
        let (result_tx, results) = mpsc::channel();
        let mut jobs = Vec::with_capacity(size);
        let mut threads = Vec::with_capacity(size);
        for comm in world.comms {
            let rank = comm.rank();
            let (job_tx, job_rx) = mpsc::channel();
            let hooks = RankHooks { barrier: barrier.clone(), faults: world.faults.clone() };
            let result_tx = result_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("conformance-rank{rank}"))
                .spawn(move || rank_loop(comm, hooks, support, timeout, job_rx, result_tx))?;
            jobs.push(job_tx);
            threads.push(thread);
        }
        Ok(Runner {
            faults: world.faults,
            barrier,
            jobs,
            results,
            threads,
            next_job: 0,
            cases_run: 0,
            healthy: true,
            stuck: false,
        })
    }

    /// Runs `case` on every rank; the status and the wall time until the last rank reported.
    fn run(&mut self, case: &Case<C>, deadline: Duration) -> (Status, Duration) {
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
                    if let Some(f) = &self.faults {
                        f.abort_world(&format!("the case did not finish on every rank within {deadline:?}"));
                    }
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
        failures.sort_by_key(|(r, _)| *r);
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

fn rank_loop<C: CommBackend>(
    comm: Communicator<C>,
    hooks: RankHooks,
    support: Support,
    timeout: Duration,
    jobs: Receiver<Job<C>>,
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
            let reason = format!("rank {rank} failed case {}", job.name);
            match &hooks.faults {
                Some(f) => f.abort_world(&reason),
                None => comm.abort(&reason),
            }
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

/// Emits one `#[test]` per world size that runs the whole suite on a harness
/// and fails if any case failed (failures and skips are printed with their
/// reasons; run with `--nocapture` to see them when everything passes).
///
/// ```ignore
/// chorus_conformance::conformance_tests!(SimHarness::default(), one_rank = 1, two_ranks = 2);
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr, $($test:ident = $ranks:expr),+ $(,)?) => {
        /// The world sizes run one at a time: the error cases use short
        /// deadlines, which a machine busy with another world could miss.
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

        $(
            #[test]
            fn $test() {
                let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
                let harness = $harness;
                let start = std::time::Instant::now();
                let mut failures = Vec::new();
                let summary = $crate::harness::run(&harness, $ranks, None, &mut |o| match &o.status {
                    $crate::Status::Failed(_) => {
                        println!("{o}");
                        failures.push(o.name.clone());
                    }
                    $crate::Status::Skipped(_) => println!("{o}"),
                    $crate::Status::Passed => {}
                });
                println!(
                    "{}, {} ranks: {} in {:.1?}",
                    $crate::harness::Harness::name(&harness),
                    $ranks,
                    summary.line(),
                    start.elapsed()
                );
                assert!(summary.passed > 0, "no case ran");
                assert_eq!(summary.failed, 0, "failed cases: {failures:#?}");
            }
        )+
    };
}

#[cfg(test)]
mod tests {
    use super::selected;

    #[test]
    fn filter_terms_select_and_exclude() {
        let f = Some("fsdp/parity,!bf16");
        assert!(selected("fsdp/parity/sgd", f));
        assert!(!selected("fsdp/parity/bf16-params/f32-reduce", f));
        assert!(!selected("all_reduce/f32/sum", f));
        assert!(selected("all_reduce/f32/sum", Some("!fsdp")));
        assert!(!selected("fsdp/state-machine", Some("!fsdp")));
        assert!(selected("split/even_and_odd_ranks", Some("split, all_gather")));
        assert!(selected("anything", None));
        assert!(selected("anything", Some("")));
        assert!(selected("anything", Some("!")));
    }
}
