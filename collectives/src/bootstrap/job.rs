//! This process as one rank of a launched job: the launcher's variables
//! (torchrun, `chorus launch`, Slurm, Open MPI, PMI) read, the job's store
//! joined, and the barriers that end a command together. The library
//! (`chorus::Job`) and the command line start their ranks through it.

use std::sync::Arc;
use std::time::Duration;

use super::{connect_from_env, ConnectOptions, EnvError, LaunchEnv, Rendezvous, Store, StoreBarrier};
use crate::CommError;

/// Why a job could not be joined or ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// The launcher's variables are incomplete or contradict each other.
    #[error("reading the launcher's variables: {0}")]
    Launcher(#[from] EnvError),
    /// The job's store could not be joined, or failed or timed out.
    #[error(transparent)]
    Store(#[from] CommError),
    /// Ranks were started with different world sizes.
    #[error("rank {peer} joined a world of {theirs} ranks; rank {rank} a world of {ours} (the launcher's variables disagree)")]
    WorldSize {
        /// This rank.
        rank: usize,
        /// The rank whose world size differs.
        peer: usize,
        /// Its world size, as it published it.
        theirs: String,
        /// This rank's world size.
        ours: usize,
    },
}

type Result<T, E = JobError> = std::result::Result<T, E>;

/// This process's place in a launched job, and the job's store.
#[derive(Debug)]
pub struct Job {
    /// Rank, world size, local rank and the rest, from the launcher's variables.
    pub env: LaunchEnv,
    rendezvous: Rendezvous,
    /// Which of the job's commands this is: several programs may run one
    /// after another in one job, sharing its store, and their keys must not mix.
    run: i64,
}

impl Job {
    /// The job this process belongs to, or `None` when no launcher started
    /// it. Joins the job's store (hosted by rank 0, or by the launcher's
    /// agent) and checks that every rank was started with the same world
    /// size; both waits are bounded by `timeout`.
    pub fn detect(timeout: Duration) -> Result<Option<Job>> {
        let env = match LaunchEnv::from_process_env() {
            Err(EnvError::NoLauncher { .. }) => return Ok(None),
            Err(e) => return Err(JobError::Launcher(e)),
            Ok(env) => env,
        };
        let rendezvous = connect_from_env(&env, &ConnectOptions::default())?;
        check_world_sizes(&env, &*rendezvous.store(), timeout)?;
        // Every rank of a command counts itself in before any rank can
        // finish it (`finish` waits for all), so the count tells the
        // commands of one job apart.
        let key = format!("chorus/commands/{}", env.key_scope());
        let n = rendezvous.store().add(&key, 1)?;
        let run = (n - 1) / env.world_size.max(1) as i64;
        Ok(Some(Job { env, rendezvous, run }))
    }

    /// The job's store.
    pub fn store(&self) -> Arc<dyn Store> {
        self.rendezvous.store()
    }

    /// A store prefix for `what` that is unique per job, restart and command.
    pub fn prefix(&self, what: &str) -> String {
        format!("chorus/{what}/{}/{}", self.env.key_scope(), self.run)
    }

    /// Every rank waits here until all have arrived (bounded by `timeout`),
    /// and rank 0, which may host the store, until every other rank has
    /// made its last store request: it leaves last.
    pub fn finish(&self, what: &str, timeout: Duration) -> Result<()> {
        let store = self.store();
        let n = self.env.world_size;
        StoreBarrier::new(format!("{}/finished", self.prefix(what)), n)?.arrive_and_wait(&*store, timeout)?;
        if n == 1 {
            return Ok(());
        }
        let released = StoreBarrier::new(format!("{}/released", self.prefix(what)), n - 1)?;
        if self.env.rank != 0 {
            released.arrive(&*store)?;
            return Ok(());
        }
        released.wait(&*store, timeout)?;
        Ok(())
    }
}

/// Fails unless every rank was started with the same world size: each
/// publishes its own, the others compare theirs with rank 0's and rank 0
/// with everyone's. Before any other key, because later keys are numbered
/// by world size, and ranks that disagree on it would otherwise wait for
/// each other under different keys until they time out.
fn check_world_sizes(env: &LaunchEnv, store: &dyn Store, timeout: Duration) -> Result<()> {
    let prefix = format!("chorus/world-size/{}", env.key_scope());
    store.set(&format!("{prefix}/{}", env.rank), env.world_size.to_string().as_bytes())?;
    let peers: Vec<usize> = if env.rank == 0 { (1..env.world_size).collect() } else { vec![0] };
    for r in peers {
        let theirs = store.get(&format!("{prefix}/{r}"), timeout)?;
        let theirs = String::from_utf8_lossy(&theirs).trim().to_string();
        if theirs != env.world_size.to_string() {
            return Err(JobError::WorldSize { rank: env.rank, peer: r, theirs, ours: env.world_size });
        }
    }
    Ok(())
}
