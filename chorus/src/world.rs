//! Starting a world of ranks in one call: the backend this build selected,
//! as threads of this process or as this process's rank of a launched job.
//!
//! [`run`] is `torch.distributed`'s `init_process_group` and `mp.spawn` in
//! one: under a launcher (torchrun, `chorus launch`, Slurm, `mpirun`) this
//! process is one rank of the launcher's world; otherwise the ranks are
//! threads of this process — a simulated cluster (`sim`), one rank per GPU
//! (`nccl`, `rccl`), or UCX ranks in one process (`ucx`). The same `main`
//! builds for each backend by flipping a cargo feature.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chorus_collectives::{CommBackend, Communicator};

use crate::job::Job;
use crate::rank::Rank;
use crate::{BoxError, Error, Result};

/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(feature = "nccl")]
pub type SelectedBackend = chorus_collectives::nccl::NcclComm;
/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(all(feature = "rccl", not(feature = "nccl")))]
pub type SelectedBackend = chorus_collectives::rccl::RcclComm;
/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(all(feature = "ucx", not(any(feature = "nccl", feature = "rccl"))))]
pub type SelectedBackend = chorus_collectives::ucx::UcxComm;
/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(all(feature = "sim", not(any(feature = "nccl", feature = "rccl", feature = "ucx"))))]
pub type SelectedBackend = chorus_collectives::sim::SimComm;

#[cfg(not(any(feature = "sim", feature = "ucx", feature = "nccl", feature = "rccl")))]
compile_error!("chorus needs a backend feature: `sim` (the default), `ucx`, `nccl` or `rccl`");

/// The name of [`SelectedBackend`]: `"nccl"`, `"rccl"`, `"ucx"` or `"sim"`.
pub const SELECTED_BACKEND: &str = if cfg!(feature = "nccl") {
    "nccl"
} else if cfg!(feature = "rccl") {
    "rccl"
} else if cfg!(feature = "ucx") {
    "ucx"
} else {
    "sim"
};

/// Where the ranks come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ranks {
    /// `n` threads of this process.
    Threads(usize),
    /// This process, as one rank of the launcher's world.
    Launched,
    /// The launcher's world where a launcher started this process, else `n` threads.
    LaunchedOrThreads(usize),
}

/// How to start a world; [`World::run`] starts it.
///
/// ```
/// let sums = chorus::World::threads(3).run(|rank| rank.all_reduce(&[rank.rank() as f32], chorus::ReduceOp::Sum))?;
/// assert_eq!(sums, vec![vec![3.0f32]; 3]);
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct World {
    ranks: Ranks,
    timeout: Duration,
    deadline: Option<Duration>,
    threads_per_rank: Option<usize>,
}

impl World {
    /// `n` ranks as threads of this process (never a launcher's world).
    pub fn threads(n: usize) -> World {
        World::with(Ranks::Threads(n))
    }

    /// This process as one rank of the world a launcher started; an error
    /// where no launcher's variables are set.
    pub fn launched() -> World {
        World::with(Ranks::Launched)
    }

    /// The launcher's world where a launcher started this process (its
    /// `WORLD_SIZE`, not `n`), else `n` ranks as threads of this process:
    /// what [`run`] does.
    pub fn launched_or_threads(n: usize) -> World {
        World::with(Ranks::LaunchedOrThreads(n))
    }

    fn with(ranks: Ranks) -> World {
        World { ranks, timeout: Duration::from_secs(300), deadline: None, threads_per_rank: None }
    }

    /// The deadline of every wait: a collective whose peers do not arrive,
    /// the rendezvous, joining the job (300 s by default). A rank that waits
    /// longer fails with a timeout, and so do the others.
    pub fn timeout(mut self, timeout: Duration) -> World {
        self.timeout = timeout;
        self
    }

    /// A deadline for the whole run of ranks that are threads of this
    /// process: past it the world is aborted and [`World::run`] returns
    /// [`Error::Deadline`] naming the ranks still running (none by default).
    pub fn deadline(mut self, deadline: Duration) -> World {
        self.deadline = Some(deadline);
        self
    }

    /// The threads each rank's candle CPU kernels (matrix products) may use
    /// (feature `candle`): each rank's function runs in a thread pool of its
    /// own of that many threads. By default, ranks that are threads of this
    /// process share its cores (`cores / ranks`, at least 1), so they do not
    /// oversubscribe them; a launched rank keeps candle's own choice.
    #[cfg(feature = "candle")]
    pub fn threads_per_rank(mut self, threads: usize) -> World {
        self.threads_per_rank = Some(threads);
        self
    }

    /// Runs `body` on every rank of this process and returns their results
    /// in rank order: every rank's with threads, this process's one under a
    /// launcher. The first rank to fail (an error or a panic) aborts the
    /// world, so the others fail promptly instead of waiting for it, and its
    /// failure is the error returned ([`Error::Rank`], [`Error::Panicked`]).
    pub fn run<T, E, F>(self, body: F) -> Result<Vec<T>>
    where
        T: Send + 'static,
        E: Into<BoxError> + Send + 'static,
        F: Fn(Rank) -> std::result::Result<T, E> + Send + Sync + 'static,
    {
        let job = match self.ranks {
            Ranks::Threads(_) => None,
            Ranks::Launched => Some(Job::detect(self.timeout)?.ok_or_else(|| {
                Error::InvalidArgument(
                    "World::launched: no launcher started this process (no RANK / WORLD_SIZE, SLURM_PROCID, \
                     OMPI_COMM_WORLD_RANK or PMI_RANK): start it with `chorus launch`, torchrun, srun or mpirun"
                        .into(),
                )
            })?),
            Ranks::LaunchedOrThreads(_) => Job::detect(self.timeout)?,
        };
        match (job, self.ranks) {
            (Some(job), _) => run_launched(&job, self.timeout, body).map(|v| vec![v]),
            (None, Ranks::Threads(n) | Ranks::LaunchedOrThreads(n)) => self.run_threads(n, body),
            (None, Ranks::Launched) => unreachable_launch(),
        }
    }

    fn run_threads<T, E, F>(&self, n: usize, body: F) -> Result<Vec<T>>
    where
        T: Send + 'static,
        E: Into<BoxError> + Send + 'static,
        F: Fn(Rank) -> std::result::Result<T, E> + Send + Sync + 'static,
    {
        let maker = threads::maker(n, self.timeout)?;
        run_on_threads(n, maker, RankThreads { deadline: self.deadline, pool: self.threads_per_rank }, body)
    }
}

/// `World::launched` without a launcher returned above; kept as an error,
/// not a panic, should the match ever change.
fn unreachable_launch<T>() -> Result<T> {
    Err(Error::InvalidArgument("no launcher started this process".into()))
}

/// Runs `body` on `n` ranks as threads of this process, or on this
/// process's rank where a launcher started it ([`World::launched_or_threads`]).
///
/// ```
/// let gathered = chorus::run(4, |rank| rank.all_gather(&[rank.rank() as i32]))?;
/// assert!(gathered.iter().all(|g| g == &[0, 1, 2, 3]));
/// # Ok::<(), chorus::Error>(())
/// ```
pub fn run<T, E, F>(n: usize, body: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    E: Into<BoxError> + Send + 'static,
    F: Fn(Rank) -> std::result::Result<T, E> + Send + Sync + 'static,
{
    World::launched_or_threads(n).run(body)
}

/// Makes a rank's communicator on its thread, and aborts the whole world.
pub(crate) struct Maker<C: CommBackend> {
    /// Rank `r`'s communicator (called on rank `r`'s thread: a GPU
    /// communicator's init waits for every rank).
    pub(crate) make: Box<dyn Fn(usize) -> Result<Arc<Communicator<C>>> + Send + Sync>,
    /// Aborts every rank's communicator made so far and any made later.
    pub(crate) abort: Box<dyn Fn(&str) + Send + Sync>,
}

/// How the ranks' threads run: the whole run's deadline, and the size of
/// each rank's own thread pool for candle (`None`: the cores shared out).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RankThreads {
    pub(crate) deadline: Option<Duration>,
    pub(crate) pool: Option<usize>,
}

/// What a rank's thread sends back.
enum Outcome<T> {
    Done(T),
    Failed(Error),
}

/// Runs `body` on `n` threads, rank `r`'s communicator made on its thread
/// by `maker`; see [`World::run`] for how failures end the world.
pub(crate) fn run_on_threads<C, T, E, F>(n: usize, maker: Maker<C>, how: RankThreads, body: F) -> Result<Vec<T>>
where
    C: CommBackend + 'static,
    T: Send + 'static,
    E: Into<BoxError> + Send + 'static,
    F: Fn(Rank<C>) -> std::result::Result<T, E> + Send + Sync + 'static,
{
    if n == 0 {
        return Err(Error::InvalidArgument("a world needs at least one rank".into()));
    }
    let maker = Arc::new(maker);
    let body = Arc::new(body);
    // The rank that failed first, claimed before it aborts the world: the
    // failures that abort causes on the other ranks may arrive before its own.
    let first = Arc::new(AtomicUsize::new(usize::MAX));
    let (tx, rx) = mpsc::channel::<(usize, Outcome<T>)>();
    for rank in 0..n {
        let (rank_maker, body, tx, first) = (maker.clone(), body.clone(), tx.clone(), first.clone());
        let spawned = std::thread::Builder::new().name(format!("chorus-rank{rank}")).spawn(move || {
            let maker = rank_maker;
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let comm = (maker.make)(rank)?;
                let r = Rank::new(comm)?;
                in_rank_pool(rank, n, how.pool, || body(r).map_err(|e| Error::Rank { rank, error: e.into() }))?
            }));
            let outcome = match outcome {
                Ok(Ok(v)) => Outcome::Done(v),
                Ok(Err(e)) => Outcome::Failed(e),
                Err(payload) => Outcome::Failed(Error::Panicked { rank, message: panic_message(&*payload) }),
            };
            if let Outcome::Failed(e) = &outcome {
                let _ = first.compare_exchange(usize::MAX, rank, Ordering::AcqRel, Ordering::Acquire);
                (maker.abort)(&format!("rank {rank} failed: {e}"));
            }
            let _ = tx.send((rank, outcome));
        });
        if let Err(e) = spawned {
            // The ranks already started would wait for this one: end them now.
            let reason = format!("rank {rank}'s thread could not be started: {e}");
            (maker.abort)(&reason);
            return Err(Error::Unsupported(format!("{reason} (a world of {n} ranks as threads of this process)")));
        }
    }
    drop(tx);
    collect(n, &rx, how.deadline, &*maker.abort, &first)
}

/// Runs `f` in a thread pool of this rank's own (`threads`, else this
/// process's cores shared out among its `n` ranks), where candle's CPU
/// matrix products split their work.
#[cfg(feature = "candle")]
fn in_rank_pool<R: Send>(rank: usize, n: usize, threads: Option<usize>, f: impl FnOnce() -> R + Send) -> Result<R> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = threads.unwrap_or(cores / n.max(1)).max(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("chorus-rank{rank}-pool{i}"))
        .build()
        .map_err(|e| Error::Unsupported(format!("rank {rank}'s thread pool of {threads} threads: {e}")))?;
    Ok(pool.install(f))
}

#[cfg(not(feature = "candle"))]
fn in_rank_pool<R>(_rank: usize, _n: usize, _threads: Option<usize>, f: impl FnOnce() -> R) -> Result<R> {
    Ok(f())
}

/// Waits for every rank's outcome (up to `deadline`) and returns the values
/// in rank order, or the failure of the rank that failed first (`first`):
/// the others usually failed because of it (the world was aborted).
fn collect<T>(
    n: usize,
    rx: &mpsc::Receiver<(usize, Outcome<T>)>,
    deadline: Option<Duration>,
    abort: &(dyn Fn(&str) + Send + Sync),
    first: &AtomicUsize,
) -> Result<Vec<T>> {
    let start = Instant::now();
    let mut values: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut failures: Vec<Option<Error>> = (0..n).map(|_| None).collect();
    let mut arrived = vec![false; n];
    for _ in 0..n {
        let next = match deadline {
            None => rx.recv().map_err(|_| None),
            Some(d) => rx.recv_timeout(d.saturating_sub(start.elapsed())).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => Some(d),
                mpsc::RecvTimeoutError::Disconnected => None,
            }),
        };
        match next {
            Ok((rank, outcome)) => {
                arrived[rank] = true;
                match outcome {
                    Outcome::Done(v) => values[rank] = Some(v),
                    Outcome::Failed(e) => failures[rank] = Some(e),
                }
            }
            Err(Some(d)) => {
                let ranks: Vec<usize> = (0..n).filter(|r| !arrived[*r]).collect();
                abort(&format!("the world's deadline of {:.1} s passed", d.as_secs_f64()));
                return Err(first_of(failures, first).unwrap_or(Error::Deadline { ranks, seconds: d.as_secs_f64() }));
            }
            // A rank's thread ended without a word: only a panic inside the
            // panic handler does that; report what is known.
            Err(None) => break,
        }
    }
    if let Some(e) = first_of(failures, first) {
        return Err(e);
    }
    values
        .into_iter()
        .enumerate()
        .map(|(rank, v)| v.ok_or_else(|| Error::Panicked { rank, message: "its thread ended without a result".into() }))
        .collect()
}

/// The failure of the rank that claimed `first`, else the lowest rank's.
fn first_of(mut failures: Vec<Option<Error>>, first: &AtomicUsize) -> Option<Error> {
    let claimed = first.load(Ordering::Acquire);
    failures.get_mut(claimed).and_then(Option::take).or_else(|| failures.into_iter().flatten().next())
}

/// A panic's message, where it is text.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a text message".into()
    }
}

/// Communicators made as they are asked for, kept so that an abort reaches
/// every one made so far; one asked for after an abort fails at once.
/// (The sim world aborts itself, and every communicator split from it.)
#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
pub(crate) struct Registry<C: CommBackend> {
    state: Mutex<Registered<C>>,
}

#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
struct Registered<C: CommBackend> {
    comms: Vec<Arc<Communicator<C>>>,
    /// Why the world was aborted, once it was.
    aborted: Option<String>,
}

#[cfg(any(feature = "ucx", feature = "nccl", feature = "rccl"))]
impl<C: CommBackend> Registry<C> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Registry { state: Mutex::new(Registered { comms: Vec::new(), aborted: None }) })
    }

    /// Keeps `comm` for [`Registry::abort`]; refuses it after an abort.
    pub(crate) fn keep(&self, comm: Communicator<C>) -> Result<Arc<Communicator<C>>> {
        let comm = Arc::new(comm);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.aborted {
            comm.abort(reason);
            return Err(Error::InvalidArgument(format!("the world was aborted before this rank joined: {reason}")));
        }
        state.comms.push(comm.clone());
        Ok(comm)
    }

    pub(crate) fn abort(&self, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.aborted.get_or_insert_with(|| reason.to_string());
        for c in &state.comms {
            c.abort(reason);
        }
    }
}

/// This process's rank of the launcher's world: its communicator made from
/// the job's store, `body` run, then every rank waits for the others to
/// finish (rank 0 hosts the store, so it leaves last).
fn run_launched<T, E, F>(job: &Job, timeout: Duration, body: F) -> Result<T>
where
    E: Into<BoxError>,
    F: Fn(Rank) -> std::result::Result<T, E>,
{
    let comm = Arc::new(launched::communicator(job, timeout)?);
    let rank = job.env.rank;
    let value = body(Rank::new(comm)?).map_err(|e| Error::Rank { rank, error: e.into() })?;
    job.finish("world", timeout)?;
    Ok(value)
}

/// How each backend makes the communicators of ranks that are threads.
mod threads {
    use super::*;

    /// The sim backend: one simulated world, a cpu device per rank, the
    /// stream sanitizer on (the strictest checks, as in tests).
    #[cfg(all(feature = "sim", not(any(feature = "nccl", feature = "rccl", feature = "ucx"))))]
    pub(super) fn maker(n: usize, timeout: Duration) -> Result<Maker<SelectedBackend>> {
        crate::testing::sim_maker(n, timeout)
    }

    /// The ucx backend: every rank in this process, over an in-memory store.
    #[cfg(all(feature = "ucx", not(any(feature = "nccl", feature = "rccl"))))]
    pub(super) fn maker(n: usize, timeout: Duration) -> Result<Maker<SelectedBackend>> {
        use chorus_collectives::bootstrap::MemStore;
        use chorus_collectives::ucx::{UcxComm, UcxConfig};
        use chorus_devices::cpu::{CpuConfig, CpuDevice};
        let store = Arc::new(MemStore::new());
        let registry = Registry::<SelectedBackend>::new();
        let aborts = registry.clone();
        Ok(Maker {
            make: Box::new(move |rank| {
                let device = CpuDevice::new(CpuConfig::default().with_ordinal(rank).with_timeout(timeout * 2));
                let config = UcxConfig { timeout, prefix: "chorus/world/ucx".into(), ..UcxConfig::default() };
                registry.keep(UcxComm::init(store.clone(), rank, n, device, config)?)
            }),
            abort: Box::new(move |reason| aborts.abort(reason)),
        })
    }

    /// The NCCL family: one rank per visible GPU, the unique id through an
    /// in-memory store.
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    pub(super) fn maker(n: usize, timeout: Duration) -> Result<Maker<SelectedBackend>> {
        use chorus_collectives::bootstrap::MemStore;
        use chorus_collectives::nccl_family::VendorConfig;
        let visible = gpu::count()?;
        if n > visible {
            return Err(Error::InvalidArgument(format!(
                "{n} ranks as threads need as many GPUs (one rank per GPU); {visible} visible"
            )));
        }
        let store = MemStore::new();
        let registry = Registry::<SelectedBackend>::new();
        let aborts = registry.clone();
        Ok(Maker {
            make: Box::new(move |rank| {
                let device = gpu::device(rank, timeout)?;
                let config =
                    VendorConfig { timeout, store_key: "chorus/world/unique_id".into(), ..VendorConfig::default() };
                registry.keep(SelectedBackend::init(&store, rank, n, device, config)?)
            }),
            abort: Box::new(move |reason| aborts.abort(reason)),
        })
    }

    #[cfg(feature = "nccl")]
    pub(super) mod gpu {
        use super::*;
        use chorus_devices::cuda::{CudaConfig, CudaDevice};
        pub(crate) fn count() -> Result<usize> {
            Ok(chorus_devices::cuda::device_count()?)
        }
        pub(crate) fn device(ordinal: usize, timeout: Duration) -> Result<CudaDevice> {
            Ok(CudaDevice::with_config(CudaConfig { ordinal, timeout })?)
        }
    }

    #[cfg(all(feature = "rccl", not(feature = "nccl")))]
    pub(super) mod gpu {
        use super::*;
        use chorus_devices::hip::{HipConfig, HipDevice};
        pub(crate) fn count() -> Result<usize> {
            Ok(chorus_devices::hip::device_count()?)
        }
        pub(crate) fn device(ordinal: usize, timeout: Duration) -> Result<HipDevice> {
            Ok(HipDevice::new(HipConfig { ordinal, timeout, ..HipConfig::default() })?)
        }
    }
}

/// How each backend makes this process's communicator under a launcher.
mod launched {
    use super::*;

    #[cfg(all(feature = "sim", not(any(feature = "nccl", feature = "rccl", feature = "ucx"))))]
    pub(super) fn communicator(job: &Job, _timeout: Duration) -> Result<Communicator<SelectedBackend>> {
        Err(Error::Unsupported(format!(
            "{} started this process as rank {} of {}, but the sim backend runs every rank as a thread of one \
             process: build with the `ucx` feature (CPU processes and hosts) or `nccl` (NVIDIA GPUs), or run \
             without a launcher",
            job.env.launcher, job.env.rank, job.env.world_size
        )))
    }

    #[cfg(all(feature = "ucx", not(any(feature = "nccl", feature = "rccl"))))]
    pub(super) fn communicator(job: &Job, timeout: Duration) -> Result<Communicator<SelectedBackend>> {
        use chorus_collectives::ucx::{UcxComm, UcxConfig};
        use chorus_devices::cpu::{CpuConfig, CpuDevice};
        let rank = job.env.rank;
        let device = CpuDevice::new(CpuConfig::default().with_ordinal(rank).with_timeout(timeout * 2));
        let config =
            UcxConfig { timeout, prefix: job.prefix("world/ucx"), ..UcxConfig::default() }.with_topology_from_env();
        Ok(UcxComm::init(job.store(), rank, job.env.world_size, device, config)?)
    }

    /// One rank per GPU: `LOCAL_RANK` picks it.
    #[cfg(any(feature = "nccl", feature = "rccl"))]
    pub(super) fn communicator(job: &Job, timeout: Duration) -> Result<Communicator<SelectedBackend>> {
        use chorus_collectives::nccl_family::VendorConfig;
        let device = super::threads::gpu::device(job.env.local_rank, timeout)?;
        let config = VendorConfig {
            timeout,
            store_key: format!("{}/unique_id", job.prefix("world/nccl")),
            ..VendorConfig::default()
        };
        Ok(SelectedBackend::init(&*job.store(), job.env.rank, job.env.world_size, device, config)?)
    }
}
