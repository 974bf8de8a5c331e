//! `chorus bench --backend sim`: a world of rank threads, timed per iteration.
//!
//! Each (operation, size) gets a fresh world whose devices run with the
//! stream sanitizer **off** (it checks every enqueue against vector clocks,
//! which is not what a bandwidth number should include). Every rank fills
//! its input from the pattern, then runs the warm-up and timed iterations of
//! [`timed_loop`]: enqueue the collective on its stream, synchronize the
//! stream. After the timed iterations each rank reads its output back (in
//! pieces, to bound host memory) and counts the elements that differ from
//! the host-computed expectation.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::sim::{SimComm, SimConfig, SimWorld};
use chorus_collectives::{CommError, Communicator};
use chorus_devices::cpu::CpuConfig;
use chorus_devices::{bf16, f16, Buffer, Device, Element, Priority, Stream, StreamExt};

use super::launch;
use super::pattern::Expectation;
use super::timing::{median_window, timed_loop, HostBarrier, Spans};
use super::{Geometry, Measured};

/// Deadline of every rendezvous and device wait: generous, because a large
/// collective on a small machine is slow, and a bench should not time out.
const DEADLINE: Duration = Duration::from_secs(600);

/// Elements uploaded or read back at a time, to bound host memory.
const PIECE: usize = 1 << 22;

fn config() -> SimConfig {
    SimConfig { timeout: DEADLINE, device: CpuConfig { sanitizer: false, timeout: DEADLINE, ordinal: 0 } }
}

/// Measures one collective of geometry `g`.
pub fn measure(g: Geometry, warmup: usize, iters: usize) -> anyhow::Result<Measured> {
    let barrier = Arc::new(HostBarrier::new(g.n, DEADLINE));
    let results = SimWorld::run(g.n, config(), move |comm| {
        let out = match g.dtype {
            chorus_devices::DType::F32 => rank::<f32>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::F64 => rank::<f64>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::F16 => rank::<f16>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::BF16 => rank::<bf16>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::I32 => rank::<i32>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::I64 => rank::<i64>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::I8 => rank::<i8>(&comm, g, &barrier, warmup, iters),
            chorus_devices::DType::U8 => rank::<u8>(&comm, g, &barrier, warmup, iters),
        };
        if let Err(e) = &out {
            // Peers may wait for this rank at the barrier or in a collective.
            barrier.cancel();
            comm.abort(&format!("{e:#}"));
        }
        out
    })
    .context("could not start the sim world")?;
    let mut spans = Vec::with_capacity(g.n);
    let mut wrong = 0;
    for (r, result) in results.into_iter().enumerate() {
        let (s, w) = result.with_context(|| format!("rank {r}"))?.with_context(|| format!("rank {r}"))?;
        spans.push(s);
        wrong += w;
    }
    Ok(Measured { time: median_window(&spans)?, wrong })
}

/// One rank's part: set up, time, check. Returns its spans and its wrong-element count.
fn rank<T: Element>(
    comm: &Communicator<SimComm>,
    g: Geometry,
    barrier: &HostBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)> {
    let me = comm.rank();
    let stream = comm.device().create_stream(Priority::Normal)?;
    // Filled a piece at a time: each upload stages its bytes, so whole-buffer
    // host copies would double the memory of the largest sizes.
    let send = stream.alloc(T::DTYPE, g.send_len)?;
    let mut start = 0;
    while start < g.send_len {
        let len = PIECE.min(g.send_len - start);
        let piece: Vec<T> = (start..start + len).map(|i| T::from_f64(g.pattern.value(me, i))).collect();
        stream.upload(&piece, send.slice(start, len)?)?;
        stream.synchronize()?;
        start += len;
    }
    let recv = stream.alloc(T::DTYPE, g.recv_len)?;
    stream.synchronize()?;

    let spans = timed_loop(barrier, warmup, iters, || {
        launch(comm, g.op, send.view(), recv.view(), &stream)?;
        stream.synchronize().map_err(CommError::from)?;
        Ok(())
    })?;

    let expect = Expectation { op: g.op, n: g.n, chunk: g.chunk, pattern: g.pattern };
    let mut wrong = 0;
    start = 0;
    while start < recv.len() {
        let len = PIECE.min(recv.len() - start);
        let got: Vec<T> = stream.read_vec(recv.slice(start, len)?)?;
        wrong += expect.count_wrong(me, start, got.iter().map(|v| v.to_f64()));
        start += len;
    }
    Ok((spans, wrong))
}
