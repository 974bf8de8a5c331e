//! CPU offload as a GPU runs it, on sim: every rank's cpu device keeps its
//! kernels off host buffers (`CpuConfig::with_kernels_off_host`, as cuda and
//! hip do), so FSDP must stage every host operand through device memory and
//! step the optimizer on the host; the offload cases must still pass (equal
//! to no offload bit for bit, checkpoints, the device-memory drop).

use std::time::Duration;

use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_conformance::harness::{Harness, World};
use chorus_conformance::sim::SimHarness;
use chorus_conformance::{Case, Failure, Status, Support};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::Device;

/// The sim harness with the GPU's rule for host memory.
struct KernelsOffHost;

impl Harness for KernelsOffHost {
    type C = SimComm;

    fn name(&self) -> String {
        "sim (kernels off host memory)".into()
    }
    fn support(&self) -> Support {
        SimHarness.support()
    }
    fn max_world(&self) -> Result<usize, String> {
        Ok(usize::MAX)
    }
    fn world(&self, size: usize, timeout: Duration) -> Result<World<SimComm>, Failure> {
        let device =
            CpuConfig::default().with_timeout(timeout.max(Duration::from_secs(10)) * 2).with_kernels_off_host();
        let world = SimWorld::new(size, SimConfig { timeout, device })?;
        let comms = (0..size).map(|r| world.communicator(r)).collect::<Result<Vec<_>, _>>()?;
        Ok(World { comms, faults: None })
    }
    fn shared_timeout(&self) -> Duration {
        SimHarness.shared_timeout()
    }
    fn fresh_timeout(&self) -> Duration {
        SimHarness.fresh_timeout()
    }
    fn case_deadline(&self, timeout: Duration) -> Duration {
        SimHarness.case_deadline(timeout)
    }
    fn extra_cases(&self, world_size: usize) -> Vec<Case<SimComm>> {
        chorus_conformance::fsdp::cases(world_size)
    }
}

#[test]
fn the_offload_cases_pass_when_kernels_cannot_reach_host_memory() {
    let world = KernelsOffHost.world(1, Duration::from_secs(5)).expect("a world of one");
    assert!(!world.comms[0].device().kernels_reach_host(), "the harness must keep kernels off host memory");
    drop(world);
    for ranks in [1, 2, 3, 4] {
        let mut failures = Vec::new();
        let summary = chorus_conformance::harness::run(&KernelsOffHost, ranks, Some("fsdp/offload/"), &mut |o| {
            if let Status::Failed(_) = &o.status {
                failures.push(o.to_string());
            }
        });
        assert!(failures.is_empty(), "{ranks} ranks: {failures:#?}");
        assert!(summary.passed >= 8, "{ranks} ranks: {}", summary.line());
        assert_eq!(summary.skipped, 0, "{ranks} ranks: {}", summary.line());
    }
}
