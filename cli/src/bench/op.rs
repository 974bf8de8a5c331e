//! The collectives the bench measures ([`Op`]), with nccl-tests' bus
//! factor and the bytes any algorithm must move.

/// A collective the bench measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Sum over ranks, result on every rank.
    AllReduce,
    /// Every rank's input, concatenated in rank order, on every rank.
    AllGather,
    /// Sum over ranks, chunk r on rank r.
    ReduceScatter,
    /// Rank 0's buffer on every rank.
    Broadcast,
    /// Chunk j of rank r's input to chunk r of rank j's output.
    AllToAll,
}

impl Op {
    /// Every operation, in the order `--op all` runs them.
    pub const ALL: [Op; 5] = [Op::AllReduce, Op::AllGather, Op::ReduceScatter, Op::Broadcast, Op::AllToAll];

    /// The name, as in the table.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
        }
    }

    /// The reduce operator (`none` for data movement only).
    pub fn redop(self) -> &'static str {
        match self {
            Op::AllReduce | Op::ReduceScatter => "sum",
            Op::AllGather | Op::Broadcast | Op::AllToAll => "none",
        }
    }

    /// The root, for rooted collectives.
    pub fn root(self) -> Option<usize> {
        (self == Op::Broadcast).then_some(0)
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }

    /// Bytes any algorithm must read and write in one address space, summed
    /// over the `n` ranks, for a collective of nccl-tests size `size`:
    /// - all_reduce (`size` per rank): each rank's output is written (`size`)
    ///   and each rank's input read (`size`): `2·size·n`;
    /// - all_gather (output `size` per rank): `size` read and `size` written per rank: `2·size·n`;
    /// - reduce_scatter (input `size` per rank): `size` read, `size/n` written per rank: `size·n + size`;
    /// - broadcast: each non-root reads `size` (of the root) and writes `size`: `2·size·(n−1)`;
    /// - all_to_all (`size` per rank): `size` read, `size` written per rank: `2·size·n`.
    pub fn required_bytes(self, size: u64, n: usize) -> f64 {
        let (s, n) = (size as f64, n as f64);
        match self {
            Op::AllReduce | Op::AllGather | Op::AllToAll => 2.0 * s * n,
            Op::ReduceScatter => s * n + s,
            Op::Broadcast => 2.0 * s * (n - 1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_and_required_bytes() {
        assert_eq!(Op::AllReduce.bus_factor(8), 1.75);
        assert_eq!(Op::AllGather.bus_factor(8), 0.875);
        assert_eq!(Op::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Op::AllReduce.required_bytes(100, 4), 800.0);
        assert_eq!(Op::ReduceScatter.required_bytes(100, 4), 500.0);
        assert_eq!(Op::Broadcast.required_bytes(100, 4), 600.0);
    }
}
