//! One rank per process: `bench`, `conformance` and `train` started by a
//! launcher (`chorus launch`, torchrun, `srun`, `mpirun`) find their rank
//! and the job's store here.
//!
//! The `ucx` backend always runs this way; `nccl` and `rccl` do when a
//! launcher's variables are present (and run one rank per GPU as threads
//! otherwise); the simulated backends always run their ranks as threads.

use std::time::Duration;

use anyhow::Context;
use chorus_collectives::bootstrap::{Job, JobError};

use crate::UsageError;

/// This process's place in a launched job and the job's store: the
/// bootstrap layer's [`Job`] (which this dereferences to; the library's
/// `chorus::Job`), with the
/// command line's choices of deadlines and messages.
pub struct RankProcess {
    job: Job,
}

impl std::ops::Deref for RankProcess {
    type Target = Job;
    fn deref(&self) -> &Job {
        &self.job
    }
}

impl RankProcess {
    /// The job this process belongs to, or `None` when no launcher started it.
    pub fn detect() -> anyhow::Result<Option<RankProcess>> {
        let joined = Job::detect(RankProcess::ucx_timeout(Duration::from_secs(300)));
        let job = joined.map_err(|e| match e {
            JobError::Launcher(e) => anyhow::Error::new(e).context("reading the launcher's variables"),
            e => anyhow::Error::new(e).context("joining the job's store"),
        })?;
        Ok(job.map(|job| RankProcess { job }))
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

    /// Every rank waits until all have arrived, rank 0 (which may host the
    /// store) until the others have left ([`Job::finish`]).
    pub fn finish(&self, what: &str, timeout: Duration) -> anyhow::Result<()> {
        self.job
            .finish(what, timeout)
            .with_context(|| format!("waiting for the {} ranks to finish", self.env.world_size))
    }
}
