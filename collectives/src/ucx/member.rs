//! What a call runs against ([`Core`]): the job, this communicator's
//! members and this rank's place among them, its scratch pool and its host
//! layout.

use std::sync::Arc;

use super::job::Job;
use super::layout::Layout;
use super::pool::ScratchPool;
use super::region::Scratch;
use crate::{CommError, Result};

/// What a call runs against: the job and this communicator's place in it.
pub(crate) struct Core {
    pub(super) job: Arc<Job>,
    pub(super) id: u16,
    pub(super) rank: usize,
    pub(super) size: usize,
    /// World rank of each rank of this communicator.
    pub(super) members: Vec<usize>,
    /// Scratch buffers no transfer uses any more, for the next call.
    pub(super) pool: ScratchPool,
    /// How the members sit on hosts, when the hierarchical schedules apply.
    pub(super) layout: Option<Layout>,
}

impl Core {
    /// Rank `rank` of the communicator `id` whose members are the world ranks `members`.
    pub(super) fn new(job: Arc<Job>, id: u16, rank: usize, members: Vec<usize>) -> Core {
        let pool = ScratchPool::new(job.config.scratch_pool_buffers, job.config.scratch_pool_bytes);
        let keys: Vec<&str> = members.iter().map(|w| job.hosts.get(*w).map_or("", String::as_str)).collect();
        let layout = if job.config.hierarchical { Layout::of(&keys, rank) } else { None };
        Core { job, id, rank, size: members.len(), members, pool, layout }
    }

    pub(super) fn world_rank(&self, rank: usize) -> Result<usize> {
        self.members.get(rank).copied().ok_or_else(|| CommError::invalid("ucx", format!("rank {rank} is not a member")))
    }

    /// A scratch buffer of at least `bytes` (reused when one is free).
    pub(super) fn scratch(&self, bytes: usize) -> Arc<Scratch> {
        self.pool.take(bytes)
    }

    /// Returns a scratch buffer to the pool (when no transfer holds it).
    pub(super) fn give_back(&self, s: Arc<Scratch>) {
        self.pool.give_back(s)
    }
}
