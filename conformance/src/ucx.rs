//! The UCX backend's harness.
//!
//! [`UcxHarness`] is a [`Harness`] whose worlds are every rank in this
//! process (one UCP worker and progress thread each, connected over UCX's
//! shared-memory and TCP transports through an in-memory store), which is
//! how `cargo test` runs the whole suite quickly; and a
//! [`RankHarness`], so `chorus conformance
//! --backend ucx` under a launcher runs the same cases with one rank per
//! process ([`crate::process`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use chorus_collectives::bootstrap::{MemStore, Store};
use chorus_collectives::ucx::{UcxComm, UcxConfig};
use chorus_collectives::Communicator;
use chorus_devices::cpu::{CpuConfig, CpuDevice};

use crate::harness::{Harness, World};
use crate::process::{RankEnv, RankHarness};
use crate::rank_threads::{start_deadline, start_ranks};
use crate::{Case, Support};

/// The UCX backend's harness.
#[derive(Debug, Default)]
pub struct UcxHarness {
    worlds: AtomicU64,
    /// Hosts the ranks of a world pretend to be on (0: the real host keys).
    fake_hosts: usize,
}

impl UcxHarness {
    /// A harness whose worlds' ranks look like `hosts` hosts (ranks in
    /// consecutive blocks, through [`UcxConfig::host_key`]) and take the
    /// rings for every size, so the hierarchical schedules run on one machine.
    pub fn fake_hosts(hosts: usize) -> UcxHarness {
        UcxHarness { worlds: AtomicU64::new(0), fake_hosts: hosts }
    }

    fn config(&self, rank: usize, size: usize, timeout: Duration, prefix: String) -> UcxConfig {
        let config = UcxConfig { timeout, prefix, ..UcxConfig::default() };
        if self.fake_hosts == 0 {
            return config;
        }
        let host = rank * self.fake_hosts / size.max(1);
        UcxConfig { host_key: Some(format!("fake-host-{host}")), small_bytes: 0, ..config }
    }
}

fn device(rank: usize, timeout: Duration) -> CpuDevice {
    CpuDevice::new(CpuConfig::default().with_ordinal(rank).with_timeout(timeout.max(Duration::from_secs(10)) * 2))
}

impl Harness for UcxHarness {
    type C = UcxComm;

    fn name(&self) -> String {
        match self.fake_hosts {
            0 => "ucx".into(),
            h => format!("ucx ({h} fake hosts)"),
        }
    }

    fn support(&self) -> Support {
        Support { capabilities: UcxComm::declared_capabilities(), stream_sanitizer: true, fault_hooks: false }
    }

    fn max_world(&self) -> Result<usize, String> {
        Ok(usize::MAX)
    }

    fn world(&self, size: usize, timeout: Duration) -> Result<World<UcxComm>, crate::Failure> {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let prefix = format!("ucx/world{}", self.worlds.fetch_add(1, Ordering::Relaxed));
        let configs: Vec<UcxConfig> = (0..size).map(|rank| self.config(rank, size, timeout, prefix.clone())).collect();
        let comms = start_ranks("ucx", size, start_deadline(timeout), move |rank| {
            let config = configs.get(rank).cloned().ok_or_else(|| anyhow!("no rank {rank} in a world of {size}"))?;
            Ok(UcxComm::init(store.clone(), rank, size, device(rank, timeout), config)?)
        })?;
        Ok(World { comms, faults: None })
    }

    fn shared_timeout(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn fresh_timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn extra_cases(&self, world_size: usize) -> Vec<Case<UcxComm>> {
        crate::fsdp::cases(world_size)
    }
}

impl RankHarness for UcxHarness {
    fn join(&self, env: &RankEnv, prefix: &str, timeout: Duration) -> Result<Communicator<UcxComm>, crate::Failure> {
        let config = self.config(env.rank, env.size, timeout, prefix.to_string()).with_topology_from_env();
        Ok(UcxComm::init(env.store.clone(), env.rank, env.size, device(env.rank, timeout), config)?)
    }
}
