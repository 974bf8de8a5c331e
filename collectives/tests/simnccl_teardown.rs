//! A communicator of the NCCL family dropped on the watchdog's thread (which
//! can hold the last reference while it polls) is torn down on a thread of
//! its own: NCCL's destroy blocks until the whole device is idle, and the
//! watchdog must keep watching every other communicator meanwhile. The
//! simulated library records a finalize or destroy on the watchdog's thread
//! as a violation of its rules.

use std::time::Duration;

use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::vendor::simlib::{take_violations, SimNccl228};
use chorus_collectives::vendor::{VendorComm, VendorConfig};
use chorus_devices::cpu::{CpuConfig, CpuDevice};

#[test]
fn a_drop_on_the_watchdog_thread_tears_down_elsewhere() -> anyhow::Result<()> {
    let store = MemStore::new();
    let device = CpuDevice::new(CpuConfig::default());
    let config = VendorConfig { timeout: Duration::from_secs(10), ..VendorConfig::default() };
    let comm = VendorComm::<SimNccl228>::init(&store, 0, 1, device, config)?;
    take_violations();
    std::thread::Builder::new()
        .name("chorus-watchdog".into())
        .spawn(move || drop(comm))?
        .join()
        .map_err(|_| anyhow::anyhow!("the drop panicked"))?;
    // The teardown thread runs on; give it time to finalize and destroy.
    std::thread::sleep(Duration::from_millis(500));
    let seen = take_violations();
    anyhow::ensure!(seen.is_empty(), "the simulated NCCL saw its rules broken: {seen:?}");
    Ok(())
}
