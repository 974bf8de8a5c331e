//! One rank per process: `bench`, `conformance` and `train` started by a
//! launcher (`chorus launch`, torchrun, `srun`, `mpirun`) find their rank
//! and the job's store here.
//!
//! The `ucx` backend always runs this way; `nccl` and `rccl` do when a
//! launcher's variables are present (and run one rank per GPU as threads
//! otherwise); the simulated backends always run their ranks as threads.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::bootstrap::{
    connect_from_env, ConnectOptions, EnvError, LaunchEnv, Rendezvous, Store, StoreBarrier,
};

use crate::UsageError;

/// This process's place in a launched job and the job's store.
pub struct RankProcess {
    /// Rank, world size, local rank, from the launcher's variables.
    pub env: LaunchEnv,
    rendezvous: Rendezvous,
    /// Which of the job's chorus commands this is (several may run one
    /// after another in one job, sharing its store).
    run: i64,
}

/// Fails unless every rank was started with the same world size: each
/// publishes its own, the others compare theirs with rank 0's and rank 0
/// with everyone's. Before any other key, because the command keys below
/// are numbered by world size, and ranks that disagree on it would
/// otherwise wait for each other under different keys until they time out.
fn check_world_sizes(env: &LaunchEnv, store: &dyn Store, timeout: Duration) -> anyhow::Result<()> {
    let prefix = format!("chorus/world-size/{}", env.key_scope());
    store.set(&format!("{prefix}/{}", env.rank), env.world_size.to_string().as_bytes())?;
    let peers: Vec<usize> = if env.rank == 0 { (1..env.world_size).collect() } else { vec![0] };
    for r in peers {
        let theirs = store.get(&format!("{prefix}/{r}"), timeout).with_context(|| format!("waiting for rank {r}"))?;
        let theirs = String::from_utf8_lossy(&theirs).trim().to_string();
        if theirs != env.world_size.to_string() {
            anyhow::bail!(
                "rank {r} joined a world of {theirs} ranks; rank {} a world of {} (the launcher's variables disagree)",
                env.rank,
                env.world_size
            );
        }
    }
    Ok(())
}

impl RankProcess {
    /// The job this process belongs to, or `None` when no launcher started it.
    pub fn detect() -> anyhow::Result<Option<RankProcess>> {
        match LaunchEnv::from_process_env() {
            Err(EnvError::NoLauncher { .. }) => Ok(None),
            Err(e) => Err(anyhow::Error::new(e).context("reading the launcher's variables")),
            Ok(env) => {
                let rendezvous = connect_from_env(&env, &ConnectOptions::default())
                    .with_context(|| format!("rank {} joining the job's store", env.rank))?;
                check_world_sizes(&env, &*rendezvous.store(), RankProcess::ucx_timeout(Duration::from_secs(300)))?;
                // Every rank of a command counts itself in before any rank can
                // finish it (`finish` waits for all), so the count tells the
                // commands of one job apart and their keys never mix.
                let key = format!("chorus/commands/{}", env.key_scope());
                let n = rendezvous.store().add(&key, 1)?;
                let run = (n - 1) / env.world_size.max(1) as i64;
                Ok(Some(RankProcess { env, rendezvous, run }))
            }
        }
    }

    /// The job, or a usage error naming the launchers when there is none.
    #[cfg(feature = "ucx")]
    pub fn require(backend: &str) -> anyhow::Result<RankProcess> {
        RankProcess::detect()?.ok_or_else(|| {
            UsageError(format!(
                "the {backend} backend runs one rank per process: start it with a launcher, e.g. \
                 `chorus launch --nproc-per-node 4 -- chorus ...` (or torchrun --no-python, srun, mpirun)"
            ))
            .into()
        })
    }

    /// The job's store.
    pub fn store(&self) -> Arc<dyn Store> {
        self.rendezvous.store()
    }

    /// A store prefix for `what` that is unique per job, restart and command.
    pub fn prefix(&self, what: &str) -> String {
        format!("chorus/{what}/{}/{}", self.env.key_scope(), self.run)
    }

    /// The deadline of the UCX backend's waits, and of the world-size check
    /// every process-mode backend makes on joining: `CHORUS_UCX_TIMEOUT_S`
    /// seconds, else `default`.
    pub fn ucx_timeout(default: Duration) -> Duration {
        std::env::var("CHORUS_UCX_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map_or(default, Duration::from_secs_f64)
    }

    /// The UCX settings of a process-mode command: its store prefix and
    /// deadline, `CHORUS_UCX_PEER_FAILURE=1` for UCX's peer-failure
    /// handling, `CHORUS_UCX_SMALL_BYTES` for the algorithm switch,
    /// `CHORUS_UCX_PROGRESS_SPIN_US` for the progress thread's spin,
    /// `CHORUS_UCX_FLAT=1` for the flat rings across hosts and
    /// `CHORUS_UCX_HOST_KEY` for this rank's host key (see `UcxConfig`).
    #[cfg(feature = "ucx")]
    pub fn ucx_config(&self, what: &str, timeout: Duration) -> chorus_collectives::ucx::UcxConfig {
        let mut c = chorus_collectives::ucx::UcxConfig { timeout, prefix: self.prefix(what), ..Default::default() };
        c.peer_failure = std::env::var("CHORUS_UCX_PEER_FAILURE").is_ok_and(|v| v == "1");
        if let Some(bytes) = std::env::var("CHORUS_UCX_SMALL_BYTES").ok().and_then(|v| v.parse().ok()) {
            c.small_bytes = bytes;
        }
        if let Some(us) = std::env::var("CHORUS_UCX_PROGRESS_SPIN_US").ok().and_then(|v| v.parse().ok()) {
            c.progress_spin = Duration::from_micros(us);
        }
        c.with_topology_from_env()
    }

    /// The process mode takes its world size from the launcher: a
    /// different `--world-size` is a usage error.
    pub fn check_world_size(&self, requested: usize) -> anyhow::Result<()> {
        if requested != self.env.world_size {
            return Err(UsageError(format!(
                "--world-size {requested} but the launcher started {} ranks (WORLD_SIZE): pass --world-size {}",
                self.env.world_size, self.env.world_size
            ))
            .into());
        }
        Ok(())
    }

    /// Every rank waits here until all have arrived (bounded by `timeout`),
    /// and rank 0, which may host the store, until every other rank has
    /// made its last store request: it leaves last. Both are barriers
    /// waited for on the store's side ([`StoreBarrier`]); the second one's
    /// parties are the other ranks, and rank 0 only waits for it.
    pub fn finish(&self, what: &str, timeout: Duration) -> anyhow::Result<()> {
        let store = self.store();
        let n = self.env.world_size;
        StoreBarrier::new(format!("{}/finished", self.prefix(what)), n)?
            .arrive_and_wait(&*store, timeout)
            .with_context(|| format!("waiting for the {n} ranks to finish"))?;
        if n == 1 {
            return Ok(());
        }
        let released = StoreBarrier::new(format!("{}/released", self.prefix(what)), n - 1)?;
        if self.env.rank != 0 {
            released.arrive(&*store)?;
            return Ok(());
        }
        released.wait(&*store, timeout).with_context(|| format!("waiting for the other {} ranks to leave", n - 1))?;
        Ok(())
    }
}
