//! `chorus bench --backend nccl`: one rank per GPU, as threads of this process.
//!
//! Each (operation, size) gets a fresh world (bootstrapped through an
//! in-memory store). Every rank fills its input from [`Pattern`], runs the
//! warm-up and timed iterations of [`timed_loop`] (enqueue the collective on
//! its stream, synchronize the stream), then reads its output back and
//! counts the elements that differ from the host-computed expectation.
//!
//! For all-reduce it also measures the **host overhead per call**: the time
//! to enqueue 200 small all-reduces through chorus's `Communicator`
//! (validation, sequence numbers, the group, the watchdog event) against 200
//! `ncclAllReduce` calls made directly through the loaded symbol, on the same
//! stream and buffers. It is printed to stderr as a comment line.
//!
//! [`Pattern`]: super::pattern::Pattern

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl::{sys, NcclComm, NcclConfig};
use chorus_collectives::nccl_abi::{DataType, RedOp, ResultCode};
use chorus_collectives::{CommError, Communicator, ReduceOp};
use chorus_devices::cuda::{self, CudaConfig, CudaDevice, CudaStream};
use chorus_devices::{bf16, f16, Buffer, Device, Element, Priority, Stream};

use super::measure_rank;
use super::timing::{median_window, HostBarrier, Spans};
use super::{Geometry, Measured, Op};

/// Deadline of initialization and of every wait.
const DEADLINE: Duration = Duration::from_secs(600);
/// Calls per host-overhead measurement, and their element count.
const OVERHEAD_CALLS: usize = 200;
const OVERHEAD_COUNT: usize = 1024;

/// Measures one collective of geometry `g` on `g.n` GPUs.
pub fn measure(g: Geometry, warmup: usize, iters: usize) -> anyhow::Result<Measured> {
    let gpus = cuda::device_count().context("no CUDA devices")?;
    if g.n > gpus {
        anyhow::bail!("{} ranks need as many GPUs (one rank per GPU); {gpus} visible", g.n);
    }
    let barrier = Arc::new(HostBarrier::new(g.n, DEADLINE));
    let store = MemStore::new();
    let results: Vec<anyhow::Result<(Spans, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..g.n)
            .map(|rank| {
                let (barrier, store) = (barrier.clone(), store.clone());
                s.spawn(move || {
                    let out = rank_main(rank, g, &store, &barrier, warmup, iters);
                    if out.is_err() {
                        barrier.cancel();
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank panicked")))).collect()
    });
    let mut spans = Vec::with_capacity(g.n);
    let mut wrong = 0;
    for (r, result) in results.into_iter().enumerate() {
        let (s, w) = result.with_context(|| format!("rank {r}"))?;
        spans.push(s);
        wrong += w;
    }
    Ok(Measured { time: median_window(&spans)?, wrong })
}

fn rank_main(
    rank: usize,
    g: Geometry,
    store: &MemStore,
    barrier: &HostBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)> {
    let device = CudaDevice::with_config(CudaConfig { ordinal: rank, timeout: DEADLINE })?;
    let config =
        NcclConfig { timeout: DEADLINE, store_key: format!("bench/{}/{}", g.op.name(), g.size), blocking: false };
    let comm = NcclComm::init(store, rank, g.n, device, config)?;
    let out = match g.dtype {
        chorus_devices::DType::F32 => run::<f32>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::F64 => run::<f64>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::F16 => run::<f16>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::BF16 => run::<bf16>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::I32 => run::<i32>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::I64 => run::<i64>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::I8 => run::<i8>(&comm, g, barrier, warmup, iters),
        chorus_devices::DType::U8 => run::<u8>(&comm, g, barrier, warmup, iters),
    };
    if let Err(e) = &out {
        comm.abort(&format!("{e:#}"));
    }
    out
}

fn run<T: Element>(
    comm: &Communicator<NcclComm>,
    g: Geometry,
    barrier: &HostBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)> {
    let me = comm.rank();
    let (spans, wrong) = measure_rank::<NcclComm, T>(comm, g, barrier, warmup, iters)?;
    if g.op == Op::AllReduce {
        let stream = comm.device().create_stream(Priority::Normal)?;
        let (ours, direct) = host_overhead::<T>(comm, barrier, &stream)?;
        if me == 0 {
            eprintln!(
                "# nccl host overhead per all_reduce call ({OVERHEAD_COUNT} x {}, enqueue only, mean of {OVERHEAD_CALLS}): chorus {:.2} us, ncclAllReduce directly {:.2} us, difference {:.2} us",
                T::DTYPE,
                ours * 1e6,
                direct * 1e6,
                (ours - direct) * 1e6
            );
        }
    }
    Ok((spans, wrong))
}

/// Seconds per enqueue: through the `Communicator`, and through the raw symbol.
fn host_overhead<T: Element>(
    comm: &Communicator<NcclComm>,
    barrier: &HostBarrier,
    stream: &CudaStream,
) -> anyhow::Result<(f64, f64)> {
    let buf = stream.alloc(T::DTYPE, OVERHEAD_COUNT)?;
    stream.fill(buf.view(), chorus_devices::Scalar::Int(0))?;
    stream.synchronize()?;

    barrier.wait()?;
    let t = Instant::now();
    for _ in 0..OVERHEAD_CALLS {
        comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, stream)?;
    }
    let ours = t.elapsed().as_secs_f64() / OVERHEAD_CALLS as f64;
    stream.synchronize().map_err(CommError::from)?;

    let nccl = sys::nccl()?;
    let ptr = cuda::device_ptr(&buf.view()) as *mut std::ffi::c_void;
    let raw_stream = stream.raw() as sys::Stream;
    let (dtype, sum) = (DataType::of(T::DTYPE).raw(), RedOp::Sum.raw());
    barrier.wait()?;
    // SAFETY: every rank makes the same calls on a live communicator; the
    // buffer is valid for OVERHEAD_COUNT elements in the stream's order and
    // outlives the synchronize below.
    let direct = unsafe {
        comm.backend().with_raw(|raw| {
            let t = Instant::now();
            let mut status = 0;
            for _ in 0..OVERHEAD_CALLS {
                let mut r = (nccl.all_reduce)(ptr, ptr, OVERHEAD_COUNT, dtype, sum, raw, raw_stream);
                // A non-blocking communicator may still be connecting: wait as a direct user must.
                while r == ResultCode::IN_PROGRESS.0 {
                    let mut state = 0;
                    (nccl.comm_get_async_error)(raw, &mut state);
                    r = state;
                }
                if r != 0 {
                    status = r;
                }
            }
            (t.elapsed().as_secs_f64() / OVERHEAD_CALLS as f64, status)
        })
    }?;
    if direct.1 != 0 {
        anyhow::bail!("ncclAllReduce returned {}", ResultCode(direct.1));
    }
    stream.synchronize().map_err(CommError::from)?;
    Ok((ours, direct.0))
}
