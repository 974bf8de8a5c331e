//! One measurement: its buffers ([`Geometry`], nccl-tests' size and count
//! conventions) and what a backend measured ([`Measured`]).

use std::time::Duration;

use chorus_devices::DType;

use super::op::Op;
use super::pattern::Pattern;

/// The buffers of one measurement.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// The operation.
    pub op: Op,
    /// Ranks.
    pub n: usize,
    /// Element type.
    pub dtype: DType,
    /// nccl-tests' `count`: elements in `size`.
    pub count: usize,
    /// nccl-tests' `size` in bytes.
    pub size: u64,
    /// Elements of each rank's send buffer.
    pub send_len: usize,
    /// Elements of each rank's receive buffer.
    pub recv_len: usize,
    /// Elements per chunk (see [`Expectation::chunk`](super::pattern::Expectation::chunk)).
    pub chunk: usize,
    /// The inputs.
    pub pattern: Pattern,
}

impl Geometry {
    /// The geometry for a requested size: the element count is rounded down to
    /// whole elements, and to a multiple of `n` where the op splits buffers in
    /// `n` chunks (as nccl-tests does).
    pub fn new(op: Op, n: usize, dtype: DType, requested: u64) -> Geometry {
        let mut count = usize::try_from(requested).unwrap_or(usize::MAX) / dtype.size();
        let chunked = matches!(op, Op::AllGather | Op::ReduceScatter | Op::AllToAll);
        if chunked {
            count -= count % n;
        }
        let chunk = if chunked { count / n } else { count };
        let (send_len, recv_len) = match op {
            Op::AllReduce | Op::Broadcast | Op::AllToAll => (count, count),
            Op::ReduceScatter => (count, chunk),
            Op::AllGather => (chunk, count),
        };
        Geometry {
            op,
            n,
            dtype,
            count,
            size: (count * dtype.size()) as u64,
            send_len,
            recv_len,
            chunk,
            pattern: Pattern::new(dtype, n),
        }
    }
}

/// What a backend measured for one geometry.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// Median iteration time.
    pub time: Duration,
    /// Output elements, over all ranks, that differ from the expected values.
    pub wrong: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_follows_nccl_tests_size_conventions() {
        // all_gather: size is the output; each rank sends size/n.
        let g = Geometry::new(Op::AllGather, 8, DType::F32, 1024);
        assert_eq!((g.count, g.size, g.send_len, g.recv_len, g.chunk), (256, 1024, 32, 256, 32));
        // reduce_scatter: size is the input; each rank keeps size/n.
        let g = Geometry::new(Op::ReduceScatter, 8, DType::F32, 1024);
        assert_eq!((g.send_len, g.recv_len, g.chunk), (256, 32, 32));
        // Counts are rounded down to a multiple of n where buffers are chunked.
        let g = Geometry::new(Op::AllToAll, 3, DType::F32, 1024);
        assert_eq!((g.count, g.size, g.chunk), (255, 1020, 85));
        let g = Geometry::new(Op::AllReduce, 3, DType::F64, 1028);
        assert_eq!((g.count, g.size, g.send_len, g.recv_len), (128, 1024, 128, 128));
    }
}
