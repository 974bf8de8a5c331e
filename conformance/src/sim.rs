//! The sim backend's harness: ranks as threads of this process, each with a
//! cpu device running the stream sanitizer (the suite checks the contract,
//! and the sanitizer is part of it here), with fault injection.

use std::sync::Arc;
use std::time::Duration;

use chorus_collectives::sim::{Fault, FaultKind, SimComm, SimConfig, SimWorld};
use chorus_devices::cpu::CpuConfig;

use crate::harness::{Harness, World};
use crate::{FaultAction, FaultSpec, Faults, Support};

/// The sim backend's harness.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimHarness;

fn config(timeout: Duration) -> SimConfig {
    let device = CpuConfig::default().with_timeout(timeout.max(Duration::from_secs(10)) * 2);
    SimConfig { timeout, device }
}

/// Faults and world-wide abort, through the world's handle.
struct SimFaults(SimWorld);

impl Faults for SimFaults {
    fn inject(&self, fault: FaultSpec) -> Result<(), crate::Failure> {
        let kind = match fault.action {
            FaultAction::Fail => FaultKind::Fail,
            FaultAction::Stall(d) => FaultKind::Stall(d),
        };
        Ok(self.0.inject_fault(Fault { rank: fault.rank, call: fault.call, kind })?)
    }
    fn abort_world(&self, reason: &str) {
        self.0.abort(reason)
    }
}

impl Harness for SimHarness {
    type C = SimComm;

    fn name(&self) -> String {
        "sim".into()
    }

    fn support(&self) -> Support {
        let caps = SimWorld::new(1, config(Duration::from_secs(1)))
            .and_then(|w| w.communicator(0))
            .map(|c| (c.capabilities(), c.device().sanitizer_enabled()));
        match caps {
            Ok((capabilities, stream_sanitizer)) => Support { capabilities, stream_sanitizer, fault_hooks: true },
            // A world of one always exists; should it not, nothing optional runs.
            Err(_) => Support {
                capabilities: chorus_collectives::Capabilities {
                    avg: false,
                    premul_sum: false,
                    ranks_share_device: false,
                    world_abort: false,
                    fault_injection: false,
                    detects_mismatch: false,
                    names_missing_ranks: false,
                },
                stream_sanitizer: false,
                fault_hooks: false,
            },
        }
    }

    fn max_world(&self) -> Result<usize, String> {
        Ok(usize::MAX)
    }

    fn world(&self, size: usize, timeout: Duration) -> Result<World<SimComm>, crate::Failure> {
        let world = SimWorld::new(size, config(timeout))?;
        let comms = (0..size).map(|r| world.communicator(r)).collect::<Result<Vec<_>, _>>()?;
        Ok(World { comms, faults: Some(Arc::new(SimFaults(world))) })
    }

    fn shared_timeout(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn fresh_timeout(&self) -> Duration {
        Duration::from_millis(500)
    }

    fn case_deadline(&self, timeout: Duration) -> Duration {
        (timeout * 3).max(Duration::from_secs(20))
    }
}
