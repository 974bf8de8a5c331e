//! The NCCL family's watchdog never blocks: one thread watches every
//! communicator of the process, so one communicator whose handle is held —
//! a blocking call in progress, an abort stuck in the library, here a
//! caller inside `with_raw` — must not keep another's deadline from being
//! enforced.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl_family::simlib::SimNccl228;
use chorus_collectives::nccl_family::{VendorComm, VendorConfig};
use chorus_collectives::{CommError, Communicator, ReduceOp};
use chorus_devices::cpu::{CpuConfig, CpuDevice};
use chorus_devices::{Buffer, DType, Device, DeviceError, Priority, Stream};

type Comm = Communicator<VendorComm<SimNccl228>>;

/// A two-rank world of the simulated NCCL (ranks as threads, each with its
/// own cpu device) whose launches expire after `deadline`.
fn world(deadline: Duration) -> anyhow::Result<Vec<(Comm, CpuDevice)>> {
    let store = MemStore::new();
    let config = VendorConfig { timeout: deadline, ..VendorConfig::default() };
    thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (store, config) = (&store, config.clone());
                s.spawn(move || -> anyhow::Result<(Comm, CpuDevice)> {
                    // The device's own waits end long after every deadline here.
                    let device = CpuDevice::new(CpuConfig::default().with_timeout(Duration::from_secs(60)));
                    Ok((VendorComm::<SimNccl228>::init(store, rank, 2, device.clone(), config)?, device))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().map_err(|_| anyhow::anyhow!("init panicked"))?).collect()
    })
}

/// Whether `e` is the watchdog's timeout of a collective.
fn is_timeout(e: &DeviceError) -> bool {
    let text = format!("{e:?}");
    text.contains("Timeout") && text.contains("all_reduce")
}

#[test]
fn a_held_communicator_does_not_keep_the_watchdog_from_another() -> anyhow::Result<()> {
    // World A: rank 0 all-reduces, rank 1 never does, so the launch expires
    // after 300 ms; meanwhile another thread holds rank 0's handle, so the
    // abort cannot take its lock until that thread lets go (at most 20 s).
    let mut a = world(Duration::from_millis(300))?;
    let (a0, a_dev) = a.remove(0);
    let a_stream = a_dev.create_stream(Priority::Normal)?;
    let a_buf = a_dev.alloc(DType::F32, 4)?;
    a0.all_reduce_in_place(a_buf.view(), ReduceOp::Sum, &a_stream)?;

    let (let_go, told) = mpsc::channel::<()>();
    let (holding, held) = mpsc::channel::<()>();
    thread::scope(|s| -> anyhow::Result<()> {
        let a0 = &a0;
        let holder = s.spawn(move || {
            // SAFETY: the closure only waits; it neither keeps nor releases the handle.
            unsafe {
                a0.backend().with_raw(|_, _| {
                    let _ = holding.send(());
                    let _ = told.recv_timeout(Duration::from_secs(20));
                })
            }
        });
        held.recv_timeout(Duration::from_secs(10))?;
        // Past A's deadline and a few polls: the watchdog has decided to
        // abort A, and needs A's lock to release its handle. (A's stream
        // reports the timeout once the abort has released its kernel.)
        thread::sleep(Duration::from_millis(1000));

        // World B: the same, with a deadline of 500 ms. Its timeout must be
        // reported within the deadline and a few of the watchdog's polls,
        // while A's handle is still held.
        let deadline = Duration::from_millis(500);
        let mut b = world(deadline)?;
        let (b0, b_dev) = b.remove(0);
        let b_stream = b_dev.create_stream(Priority::Normal)?;
        let b_buf = b_dev.alloc(DType::F32, 4)?;
        let t0 = Instant::now();
        b0.all_reduce_in_place(b_buf.view(), ReduceOp::Sum, &b_stream)?;
        let failed = b_stream.synchronize();
        let waited = t0.elapsed();
        let _ = let_go.send(());
        anyhow::ensure!(
            failed.as_ref().is_err_and(is_timeout),
            "world B's all-reduce should have timed out, got {failed:?} after {waited:?}"
        );
        anyhow::ensure!(
            waited < deadline + Duration::from_secs(2),
            "world B's timeout was reported after {waited:?} (deadline {deadline:?}): the watchdog waited for world A"
        );
        holder.join().map_err(|_| anyhow::anyhow!("the holder panicked"))??;
        drop((b0, b));
        Ok(())
    })?;
    // Once the holder let go, the abort released A's handle and its kernel:
    // A's stream reports the timeout, a later call on A is refused, and the
    // timeout is the recorded reason.
    let failed = a_stream.synchronize();
    anyhow::ensure!(
        failed.as_ref().is_err_and(is_timeout),
        "world A's all-reduce should have timed out, got {failed:?}"
    );
    let after = a0.all_reduce_in_place(a_buf.view(), ReduceOp::Sum, &a_stream);
    let refused = a_stream.synchronize();
    anyhow::ensure!(
        after.is_err() || refused.is_err(),
        "a call on world A after its abort should fail, got {after:?} / {refused:?}"
    );
    let reason = a0.async_error();
    anyhow::ensure!(
        matches!(reason, Some(CommError::Timeout { .. })) || format!("{reason:?}").contains("Timeout"),
        "world A's recorded error should be its timeout, got {reason:?}"
    );
    Ok(())
}
