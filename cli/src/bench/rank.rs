//! One rank's measurement on any backend: fill its input with the
//! pattern, time the collective, count the wrong output elements.

use chorus_collectives::{CommBackend, CommError, Communicator};
use chorus_devices::{Buffer, Device, Element, Priority, Stream, StreamExt};

use super::geometry::Geometry;
use super::op::Op;
use super::pattern::Expectation;
use super::timing::{self, timed_loop, Spans};

/// Elements per host staging piece when filling inputs and checking outputs:
/// whole-buffer host copies would double the memory of the largest sizes.
const PIECE: usize = 1 << 22;

/// One rank's part, on any backend: set up, time, check. Returns its spans and its wrong-element count.
pub(crate) fn measure_rank<C: CommBackend, T: Element>(
    comm: &Communicator<C>,
    g: Geometry,
    barrier: &dyn timing::IterBarrier,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<(Spans, u64)> {
    let me = comm.rank();
    let stream = comm.device().create_stream(Priority::Normal)?;
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

/// Enqueues one `op` (sum for the reducing ones, root 0 for broadcast) on any backend.
fn launch<C: chorus_collectives::CommBackend>(
    comm: &chorus_collectives::Communicator<C>,
    op: Op,
    send: chorus_devices::View<'_, C::B>,
    recv: chorus_devices::View<'_, C::B>,
    stream: &<C::B as chorus_devices::Backend>::Stream,
) -> Result<(), chorus_collectives::CommError> {
    use chorus_collectives::ReduceOp;
    match op {
        Op::AllReduce => comm.all_reduce(send, recv, ReduceOp::Sum, stream),
        Op::AllGather => comm.all_gather(send, recv, stream),
        Op::ReduceScatter => comm.reduce_scatter(send, recv, ReduceOp::Sum, stream),
        Op::Broadcast => comm.broadcast(send, recv, 0, stream),
        Op::AllToAll => comm.all_to_all(send, recv, stream),
    }
}
