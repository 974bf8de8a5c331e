//! Starting a world of ranks in one call: the backend this build selected,
//! as threads of this process or as this process's rank of a launched job.
//!
//! [`run`] is `torch.distributed`'s `init_process_group` and `mp.spawn` in
//! one: under a launcher (torchrun, `chorus launch`, Slurm, `mpirun`) this
//! process is one rank of the launcher's world; otherwise the ranks are
//! threads of this process — a simulated cluster (`sim`), one rank per GPU
//! (`nccl`, `rccl`), or UCX ranks in one process (`ucx`). The same `main`
//! builds for each backend by flipping a cargo feature.

use std::sync::Arc;
use std::time::Duration;

use chorus_collectives::Communicator;

use crate::backend::SelectedBackend;
use crate::rank::Rank;
use crate::threads::{run_on_threads, RankThreads};
use crate::{BoxError, Error, Result};
use chorus_collectives::bootstrap::Job;

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
        let maker = crate::threads::maker(n, self.timeout)?;
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
        let device = crate::threads::gpu::device(job.env.local_rank, timeout)?;
        let config = VendorConfig {
            timeout,
            store_key: format!("{}/unique_id", job.prefix("world/nccl")),
            ..VendorConfig::default()
        };
        Ok(SelectedBackend::init(&*job.store(), job.env.rank, job.env.world_size, device, config)?)
    }
}
