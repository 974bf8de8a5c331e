//! Inputs whose collective results are exact, and the expected results.
//!
//! Rank `r`'s element `i` is `(3·r + i) mod m`, a small whole number. `m` is
//! chosen per dtype and world size so that every partial sum of `n` such
//! values is exactly representable (bf16 holds whole numbers up to 256, f16
//! up to 2048, i8 up to 127 ...), so a correct sum is exact in any order and
//! the check is an equality. The `3·r` shift makes ranks' inputs differ, so a
//! chunk delivered to the wrong place is caught.

use chorus_devices::DType;

use super::op::Op;

/// The largest whole number every partial sum may reach in `dtype`.
fn exact_limit(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1 << 24,
        DType::F64 => 1 << 53,
        DType::F16 => 2048,
        DType::BF16 => 256,
        DType::I32 => i32::MAX as u64,
        DType::I64 => i64::MAX as u64,
        DType::I8 => i8::MAX as u64,
        DType::U8 => u8::MAX as u64,
        // Three mantissa bits: whole numbers are exact up to 16.
        DType::F8E4M3 => 16,
    }
}

/// The input pattern of one benchmark.
#[derive(Clone, Copy, Debug)]
pub struct Pattern {
    modulus: usize,
}

impl Pattern {
    /// The pattern for `n` ranks in `dtype`: values below `m ≤ 64` with `n·(m−1)` exact.
    pub fn new(dtype: DType, n: usize) -> Pattern {
        let limit = exact_limit(dtype);
        let m = (limit / n.max(1) as u64).saturating_add(1).clamp(1, 64);
        Pattern { modulus: m as usize }
    }

    /// Rank `rank`'s input element `index`.
    pub fn value(&self, rank: usize, index: usize) -> f64 {
        ((3 * rank + index) % self.modulus) as f64
    }

    /// The sum over ranks `0..n` of element `index` (exact by construction).
    pub fn sum(&self, n: usize, index: usize) -> f64 {
        (0..n).map(|r| self.value(r, index)).sum()
    }

    /// Sums of every residue class: `sums[i mod m]` is the sum for element `i`,
    /// so checking a large buffer costs one lookup per element.
    pub fn sums(&self, n: usize) -> Vec<f64> {
        (0..self.modulus).map(|i| self.sum(n, i)).collect()
    }
}

/// What checking a rank's output needs: the geometry and the pattern.
#[derive(Clone, Copy, Debug)]
pub struct Expectation {
    /// The operation.
    pub op: Op,
    /// Ranks.
    pub n: usize,
    /// Elements per chunk: the send count of all_gather, the receive count of
    /// reduce_scatter, the per-peer count of all_to_all, the buffer length otherwise.
    pub chunk: usize,
    /// The inputs.
    pub pattern: Pattern,
}

impl Expectation {
    /// Counts the elements of rank `rank`'s output that differ from the
    /// expected ones; `got` holds the output's elements from index `start` on (as f64).
    pub fn count_wrong(&self, rank: usize, start: usize, got: impl Iterator<Item = f64>) -> u64 {
        let (n, c, p) = (self.n, self.chunk.max(1), &self.pattern);
        let sums = p.sums(n);
        let m = sums.len();
        let mut wrong = 0u64;
        for (k, v) in (start..).zip(got) {
            let want = match self.op {
                Op::AllReduce => sums[k % m],
                Op::ReduceScatter => sums[(rank * c + k) % m],
                Op::AllGather => p.value(k / c, k % c),
                Op::Broadcast => p.value(0, k),
                Op::AllToAll => p.value(k / c, rank * c + k % c),
            };
            wrong += u64::from(v != want);
        }
        wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_sums_stay_exact() {
        for dtype in DType::ALL {
            for n in [1, 2, 3, 8, 64, 300] {
                let p = Pattern::new(dtype, n);
                let max = p.sums(n).into_iter().fold(0.0f64, f64::max);
                assert!(p.modulus == 1 || max <= exact_limit(dtype) as f64, "{dtype} n={n}: {max}");
            }
        }
        assert_eq!(Pattern::new(DType::BF16, 8).modulus, 33);
        assert_eq!(Pattern::new(DType::F32, 8).modulus, 64);
    }

    #[test]
    fn expected_outputs_follow_nccl_chunk_order() {
        let p = Pattern::new(DType::F32, 4);
        let (n, c) = (4, 3);
        // all_gather: chunk j of the output is rank j's input.
        let gathered: Vec<f64> = (0..n).flat_map(|j| (0..c).map(move |i| p.value(j, i))).collect();
        let e = Expectation { op: Op::AllGather, n, chunk: c, pattern: p };
        assert_eq!(e.count_wrong(2, 0, gathered.iter().copied()), 0);
        // A swapped chunk is caught.
        let mut swapped = gathered.clone();
        swapped.rotate_left(c);
        assert!(e.count_wrong(2, 0, swapped.into_iter()) > 0);
        // reduce_scatter: rank r keeps the sums of chunk r.
        let rank = 1;
        let kept: Vec<f64> = (0..c).map(|i| p.sum(n, rank * c + i)).collect();
        let e = Expectation { op: Op::ReduceScatter, n, chunk: c, pattern: p };
        assert_eq!(e.count_wrong(rank, 0, kept.into_iter()), 0);
        // all_to_all: chunk j of rank r's output is chunk r of rank j's input.
        let got: Vec<f64> = (0..n).flat_map(|j| (0..c).map(move |i| p.value(j, rank * c + i))).collect();
        let e = Expectation { op: Op::AllToAll, n, chunk: c, pattern: p };
        assert_eq!(e.count_wrong(rank, 0, got.into_iter()), 0);
    }
}
