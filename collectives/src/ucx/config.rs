//! The settings of a UCX communicator ([`UcxConfig`]) and their defaults.

use std::time::Duration;

use super::engine;
use crate::bootstrap::process_key_scope;

/// Settings of a UCX communicator.
#[derive(Clone, Debug)]
pub struct UcxConfig {
    /// Deadline of every wait: joining (the other ranks' addresses in the
    /// store), splits, and each step of a call (no message for this long
    /// fails the call with `Timeout` on this rank and, through the control
    /// message, on every rank).
    pub timeout: Duration,
    /// The store prefix of this job's keys (unique per job in the store).
    /// The default, `chorus/ucx/{run id}/{restart}` ([`process_key_scope`]),
    /// tells jobs and restarts apart as `chorus`'s commands do; and every
    /// `UcxComm::init` under one prefix counts itself in, so a second
    /// world made in the same store (a re-init) gets keys of its own
    /// instead of reading the first one's.
    pub prefix: String,
    /// Calls whose per-rank buffer is at most this many bytes take the
    /// one-round direct algorithms (rank-order reductions); larger ones
    /// take the rings.
    pub small_bytes: usize,
    /// UCX's peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`): a peer
    /// whose process dies is reported by its connection at once and aborts
    /// the job. UCX 1.22 then connects the ranks of one host over TCP only
    /// (its shared-memory transports do not support the mode), several
    /// times slower for large messages. Off (the default), ranks on one
    /// host use shared memory and cross-memory attach, and a dead peer is
    /// found by the deadline ([`UcxConfig::timeout`]).
    pub peer_failure: bool,
    /// At most this many free scratch buffers are kept for later calls, per
    /// communicator ([`UcxComm::scratch_memory`](super::UcxComm::scratch_memory) counts them).
    pub scratch_pool_buffers: usize,
    /// At most this many bytes of free scratch buffers are kept, per
    /// communicator (a large ring all-reduce uses three buffers of a
    /// `1/n` share of its input: 48 MiB at 64 MiB on four ranks).
    pub scratch_pool_bytes: usize,
    /// How long the progress thread keeps polling UCX, yielding the core,
    /// while transfers are in flight and nothing progresses, before it
    /// sleeps until UCX's event fd wakes it (a wake-up per fragment costs
    /// more than the fragment; a long spin takes a core from the ranks).
    pub progress_spin: Duration,
    /// Whether the large all-reduce, reduce-scatter and all-gather of a
    /// communicator that spans several hosts, with the same number (> 1)
    /// of its ranks on each, take the hierarchical schedules (inside each
    /// host, then across hosts; see `docs/architecture.md`). Off: the flat
    /// rings, which send every byte across each host boundary.
    pub hierarchical: bool,
    /// This rank's host key: ranks with equal keys are on one host. `None`
    /// (the default): the host name, the kernel's boot id and the network
    /// namespace. Set it to make ranks of one machine look like several
    /// hosts (tests) or to group ranks another way.
    pub host_key: Option<String>,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            timeout: Duration::from_secs(300),
            prefix: format!("chorus/ucx/{}", process_key_scope()),
            small_bytes: DEFAULT_SMALL_BYTES,
            peer_failure: false,
            scratch_pool_buffers: 6,
            scratch_pool_bytes: 256 << 20,
            progress_spin: engine::DEFAULT_SPIN,
            hierarchical: true,
            host_key: None,
        }
    }
}

impl UcxConfig {
    /// `self` with the topology settings of the environment applied:
    /// `CHORUS_UCX_FLAT=1` turns [`UcxConfig::hierarchical`] off, a
    /// non-empty `CHORUS_UCX_HOST_KEY` sets [`UcxConfig::host_key`].
    pub fn with_topology_from_env(mut self) -> UcxConfig {
        if std::env::var("CHORUS_UCX_FLAT").is_ok_and(|v| v == "1") {
            self.hierarchical = false;
        }
        if let Some(k) = std::env::var("CHORUS_UCX_HOST_KEY").ok().filter(|k| !k.is_empty()) {
            self.host_key = Some(k);
        }
        self
    }
}

/// The default switch from the direct algorithms to the rings (see
/// `docs/benchmarks.md` for the measurement it comes from).
pub const DEFAULT_SMALL_BYTES: usize = 128 * 1024;
