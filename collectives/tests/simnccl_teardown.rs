//! The teardown of a communicator of the NCCL family. NCCL's destroy blocks
//! until the whole device is idle (its frees wait for every stream), and the
//! simulated library does the same, so:
//! - a drop on the watchdog's thread (which can hold the last reference while
//!   it polls) does not wait: the watchdog keeps watching every other
//!   communicator (the simulated library records a finalize or destroy on
//!   the watchdog's thread as a violation);
//! - a drop elsewhere waits for the teardown only up to its deadline, so
//!   device work that never ends cannot hang it: a `Timeout` is parked on
//!   the device instead.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl_family::simlib::{take_violations, SimNccl228};
use chorus_collectives::nccl_family::{VendorComm, VendorConfig};
use chorus_collectives::ReduceOp;
use chorus_devices::cpu::{CpuConfig, CpuDevice};
use chorus_devices::{Buffer, DType, Device, Priority, Stream};

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

#[test]
fn a_destroy_held_up_by_the_device_does_not_hang_the_drop() -> anyhow::Result<()> {
    let store = MemStore::new();
    let device = CpuDevice::new(CpuConfig::default().with_timeout(Duration::from_secs(30)));
    let deadline = Duration::from_millis(300);
    let config = VendorConfig { timeout: deadline, ..VendorConfig::default() };
    let comm = VendorComm::<SimNccl228>::init(&store, 0, 1, device.clone(), config)?;
    let stream = device.create_stream(Priority::Normal)?;
    let buf = device.alloc(DType::F32, 4)?;
    comm.all_reduce(buf.view(), buf.view(), ReduceOp::Sum, &stream)?;
    stream.synchronize()?;
    // Past the watchdog's next poll (every 100 ms) of the finished launch, so this thread
    // holds the last reference.
    std::thread::sleep(Duration::from_millis(300));
    // Work that does not end until the test says so.
    let (release, released) = mpsc::channel::<()>();
    stream.launch_host_fn(Box::new(move |_| {
        let _ = released.recv_timeout(Duration::from_secs(20));
    }))?;
    let t0 = Instant::now();
    drop(comm);
    let waited = t0.elapsed();
    let _ = release.send(());
    anyhow::ensure!(waited < Duration::from_secs(5), "the drop waited {waited:?} for a destroy held up by the device");
    anyhow::ensure!(
        waited >= deadline * 2,
        "the drop returned after {waited:?}, before its deadline: did it wait at all?"
    );
    let parked = device.synchronize();
    let message = format!("{parked:?}");
    anyhow::ensure!(
        parked.is_err() && message.contains("ncclCommDestroy"),
        "expected the destroy's timeout parked on the device, got {message}"
    );
    Ok(())
}
