//! `chorus bench` on the NCCL family (`simnccl`, `nccl`, `rccl`): one rank
//! per device, as threads of this process.
//!
//! Each (operation, size) gets a fresh world (bootstrapped through an
//! in-memory store). Every rank fills its input from [`Pattern`], runs the
//! warm-up and timed iterations of [`timed_loop`] (enqueue the collective on
//! its stream, synchronize the stream), then reads its output back and
//! counts the elements that differ from the host-computed expectation.
//!
//! For the first all-reduce of a run it also measures the **host overhead per
//! call**, once: the time to enqueue 200 small all-reduces through chorus's
//! `Communicator` (validation, sequence numbers, the group, the watchdog's
//! events) against 200 `ncclAllReduce` calls made directly through the loaded
//! symbol, on the same stream and buffers, and the same calls with the
//! checked wrapper switched on (each rank's communicator is wrapped; the
//! checks are off for everything else). It is printed to stderr as one
//! comment line.
//!
//! [`Pattern`]: super::pattern::Pattern
//! [`timed_loop`]: super::timing::timed_loop

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::checked::Checked;
use chorus_collectives::nccl_abi::{DataType, RedOp, ResultCode};
use chorus_collectives::nccl_family::{VendorComm, VendorConfig, VendorLib};
use chorus_collectives::{CommError, Communicator, ReduceOp};
use chorus_conformance::vendor::HarnessDevice;
use chorus_devices::with_element;
use chorus_devices::{Backend, Buffer, Device, Element, ForeignBackend, Priority, Stream};

use super::geometry::{Geometry, Measured};
use super::op::Op;
use super::rank::measure_rank;
use super::timing::{median_window, HostBarrier, Spans};

/// Deadline of initialization and of every wait.
const DEADLINE: Duration = Duration::from_secs(600);
/// Calls per host-overhead measurement, and their element count.
const OVERHEAD_CALLS: usize = 200;
const OVERHEAD_COUNT: usize = 1024;

/// Whether the host-overhead line has been printed in this run.
static OVERHEAD_PRINTED: AtomicBool = AtomicBool::new(false);

/// Measures one collective of geometry `g` on `g.n` devices of library `L`.
pub fn measure<L: VendorLib>(g: Geometry, warmup: usize, iters: usize) -> anyhow::Result<Measured>
where
    L::B: HarnessDevice,
{
    let devices = L::B::count().map_err(anyhow::Error::msg)?;
    if g.n > devices {
        anyhow::bail!("{} ranks need as many devices (one rank per device); {devices} visible", g.n);
    }
    let barrier = Arc::new(HostBarrier::new(g.n, DEADLINE));
    let store = MemStore::new();
    // Every rank's thread is started before any initialises (which waits for all ranks, with no deadline in
    // the library): one that cannot start stops the others (`crate::gate`).
    let results = crate::gate::run_gated(g.n, |rank| {
        let out = rank_main::<L>(rank, g, &store, &barrier, warmup, iters);
        if out.is_err() {
            barrier.cancel();
        }
        out
    });
    let results = results?;
    let mut spans = Vec::with_capacity(g.n);
    let mut wrong = 0;
    for (r, result) in results.into_iter().enumerate() {
        let (s, w) = result.with_context(|| format!("rank {r}"))?;
        spans.push(s);
        wrong += w;
    }
    Ok(Measured { time: median_window(&spans)?, wrong })
}

fn rank_main<L: VendorLib>(
    rank: usize,
    g: Geometry,
    store: &MemStore,
    barrier: &HostBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)>
where
    L::B: HarnessDevice,
{
    let device = L::B::make(rank, DEADLINE)?;
    let config =
        VendorConfig { timeout: DEADLINE, store_key: format!("bench/{}/{}", g.op.name(), g.size), blocking: false };
    let comm = VendorComm::<L>::init(store, rank, g.n, device, config)?;
    // Wrapped in the checked wrapper, switched off but for its own measurement.
    let side: Arc<dyn chorus_collectives::bootstrap::Store> = Arc::new(store.clone());
    let prefix = format!("bench/checked/{}/{}", g.op.name(), g.size);
    let comm = Checked::wrap(comm, side, &prefix, DEADLINE);
    comm.backend().set_enabled(false);
    let out = with_element!(g.dtype, T => run::<L, T>(&comm, g, barrier, warmup, iters));
    if let Err(e) = &out {
        comm.abort(&format!("{e:#}"));
    }
    out
}

/// A rank's communicator: the library's, inside the checked wrapper.
type Comm<L> = Communicator<Checked<VendorComm<L>>>;

fn run<L: VendorLib, T: Element>(
    comm: &Comm<L>,
    g: Geometry,
    barrier: &HostBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)> {
    let me = comm.rank();
    let (spans, wrong) = measure_rank::<Checked<VendorComm<L>>, T>(comm, g, barrier, warmup, iters)?;
    // Every rank decides alike (the flag is set only after all have measured).
    if g.op == Op::AllReduce && !OVERHEAD_PRINTED.load(Ordering::Acquire) {
        let stream = comm.device().create_stream(Priority::Normal)?;
        let (ours, checked, direct) = host_overhead::<L, T>(comm, barrier, &stream)?;
        barrier.wait()?;
        if me == 0 {
            OVERHEAD_PRINTED.store(true, Ordering::Release);
            eprintln!(
                "# {} host overhead per all_reduce call ({OVERHEAD_COUNT} x {}, enqueue only, mean of {OVERHEAD_CALLS}): chorus {:.2} us, ncclAllReduce directly {:.2} us, difference {:.2} us; with the checked wrapper on {:.2} us",
                L::NAME,
                T::DTYPE,
                ours * 1e6,
                direct * 1e6,
                (ours - direct) * 1e6,
                checked * 1e6
            );
        }
    }
    Ok((spans, wrong))
}

/// Seconds per enqueue: through the `Communicator` (checks off), through it
/// with the checked wrapper on, and through the raw symbol.
fn host_overhead<L: VendorLib, T: Element>(
    comm: &Comm<L>,
    barrier: &HostBarrier,
    stream: &<L::B as Backend>::Stream,
) -> anyhow::Result<(f64, f64, f64)> {
    let buf = stream.alloc(T::DTYPE, OVERHEAD_COUNT)?;
    stream.fill(buf.view(), chorus_devices::Scalar::Int(0))?;
    stream.synchronize()?;

    let per_call = |checked: bool| -> anyhow::Result<f64> {
        comm.backend().set_enabled(checked);
        barrier.wait()?;
        let t = Instant::now();
        for _ in 0..OVERHEAD_CALLS {
            comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, stream)?;
        }
        let per_call = t.elapsed().as_secs_f64() / OVERHEAD_CALLS as f64;
        comm.backend().set_enabled(false);
        stream.synchronize().map_err(CommError::from)?;
        Ok(per_call)
    };
    let ours = per_call(false)?;
    let checked = per_call(true)?;

    let ptr = L::B::address(&buf.view()) as *mut std::ffi::c_void;
    let (dtype, sum) = (DataType::of(T::DTYPE).raw(), RedOp::Sum.raw());
    let view = buf.view();
    barrier.wait()?;
    let mut direct = (0.0, 0);
    // SAFETY: every rank makes the same calls on a live communicator; the
    // buffer is valid for OVERHEAD_COUNT elements in the stream's order and
    // outlives the synchronize below; each call completes before the next.
    unsafe {
        comm.backend().inner().with_raw(|raw, lib| {
            // The raw stream handle, with the buffer declared as used by it.
            let access = [(view, chorus_devices::AccessKind::Write)];
            L::B::enqueue_foreign(stream, "ncclAllReduce (direct)", &access, &mut |raw_stream| {
                let t = Instant::now();
                let mut status = 0;
                for _ in 0..OVERHEAD_CALLS {
                    let mut r = (lib.api.ncclAllReduce)(ptr, ptr, OVERHEAD_COUNT, dtype, sum, raw, raw_stream);
                    // A non-blocking communicator enqueues later: wait as a direct user must.
                    while r == ResultCode::IN_PROGRESS.0 {
                        let mut state = 0;
                        (lib.api.ncclCommGetAsyncError)(raw, &mut state);
                        r = state;
                    }
                    if r != 0 {
                        status = r;
                    }
                }
                direct = (t.elapsed().as_secs_f64() / OVERHEAD_CALLS as f64, status);
                Ok(())
            })
        })
    }??;
    if direct.1 != 0 {
        anyhow::bail!("ncclAllReduce returned {}", ResultCode(direct.1));
    }
    stream.synchronize().map_err(CommError::from)?;
    Ok((ours, checked, direct.0))
}
