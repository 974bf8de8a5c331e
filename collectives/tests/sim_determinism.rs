//! The sim backend's reductions are bitwise deterministic and in rank order
//! 0..n-1, checked on inputs where the order of float additions changes the
//! result (magnitudes spread over many orders, with cancellations): the
//! expected values are a plain host loop adding in rank order, and the test
//! first shows that another order gives other bits on these inputs.

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::ReduceOp;
use chorus_devices::{bf16, f16, Buffer, DType, Device, Priority, Stream, StreamExt};

const RANKS: usize = 4;
const COUNT: usize = 4096;

/// Rank `r`'s inputs: values spread over `10^-span .. 10^span`, half of them
/// negative, so that rounding depends on the order of the additions.
fn inputs(r: usize, span: i32) -> Vec<f64> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (r as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..COUNT)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            let exponent = ((state >> 3) % (2 * span as u64 + 1)) as i32 - span;
            let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
            sign * (1.0 + unit) * 10f64.powi(exponent)
        })
        .collect()
}

/// One dtype's storage, with "round to this dtype" written out for the host loop.
trait Lane: chorus_devices::Element + PartialEq + std::fmt::Debug + Bits {
    fn of(v: f64) -> Self;
    /// `a + b` in the dtype's opmath (f32 for halves), rounded to the dtype once.
    fn add(a: Self, b: Self) -> Self;
}
impl Lane for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}
impl Lane for f64 {
    fn of(v: f64) -> Self {
        v
    }
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
}
impl Lane for f16 {
    fn of(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn add(a: Self, b: Self) -> Self {
        f16::from_f32(a.to_f32() + b.to_f32())
    }
}
impl Lane for bf16 {
    fn of(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn add(a: Self, b: Self) -> Self {
        bf16::from_f32(a.to_f32() + b.to_f32())
    }
}

/// The sum of every rank's element in the order `order`, rounded at each step.
fn ordered_sum<T: Lane>(per_rank: &[Vec<T>], order: &[usize]) -> Vec<T> {
    (0..COUNT)
        .map(|i| order.iter().skip(1).fold(per_rank[order[0]][i], |acc, &r| T::add(acc, per_rank[r][i])))
        .collect()
}

fn check<T: Lane>(dtype: DType, span: i32) -> anyhow::Result<()> {
    let per_rank: Vec<Vec<T>> = (0..RANKS).map(|r| inputs(r, span).into_iter().map(T::of).collect()).collect();
    let forward: Vec<usize> = (0..RANKS).collect();
    let want = ordered_sum(&per_rank, &forward);
    // The inputs are order-sensitive: another order changes many results.
    let reversed: Vec<usize> = (0..RANKS).rev().collect();
    let other = ordered_sum(&per_rank, &reversed);
    let differ = want.iter().zip(&other).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    anyhow::ensure!(differ > COUNT / 50, "{dtype}: only {differ} of {COUNT} sums depend on the order; weak inputs");

    let per_rank = std::sync::Arc::new(per_rank);
    let results = SimWorld::run(RANKS, SimConfig::default(), move |comm| -> anyhow::Result<(Vec<T>, Vec<T>)> {
        let s = comm.device().create_stream(Priority::Normal)?;
        let x = s.buffer_from(&per_rank[comm.rank()])?;
        let y = s.alloc(dtype, COUNT)?;
        let mut runs = Vec::new();
        for _ in 0..3 {
            comm.all_reduce(x.view(), y.view(), ReduceOp::Sum, &s)?;
            runs.push(s.read_vec::<T>(y.view())?);
        }
        let same = |a: &[T], b: &[T]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        anyhow::ensure!(runs.iter().all(|r| same(r, &runs[0])), "all_reduce is not repeatable on rank {}", comm.rank());
        let chunk = s.alloc(dtype, COUNT / RANKS)?;
        comm.reduce_scatter(x.view(), chunk.view(), ReduceOp::Sum, &s)?;
        Ok((runs.swap_remove(0), s.read_vec::<T>(chunk.view())?))
    })?;
    let results: Vec<_> =
        results.into_iter().collect::<Result<Vec<_>, _>>()?.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    for (r, (all, chunk)) in results.iter().enumerate() {
        for (i, (g, w)) in all.iter().zip(&want).enumerate() {
            anyhow::ensure!(
                g.to_bits() == w.to_bits(),
                "{dtype} all_reduce rank {r} [{i}]: {g:?}, rank-order sum {w:?}"
            );
        }
        let mine = &want[r * COUNT / RANKS..(r + 1) * COUNT / RANKS];
        for (i, (g, w)) in chunk.iter().zip(mine).enumerate() {
            anyhow::ensure!(
                g.to_bits() == w.to_bits(),
                "{dtype} reduce_scatter rank {r} [{i}]: {g:?}, rank-order sum {w:?}"
            );
        }
    }
    Ok(())
}

trait Bits {
    fn to_bits(&self) -> u64;
}
macro_rules! bits {
    ($($t:ty => $f:expr),*) => {$(impl Bits for $t { fn to_bits(&self) -> u64 { $f(*self) } })*};
}
bits!(f32 => |x: f32| x.to_bits() as u64, f64 => |x: f64| x.to_bits(), f16 => |x: f16| x.to_bits() as u64, bf16 => |x: bf16| x.to_bits() as u64);

#[test]
fn float_sums_are_in_rank_order_and_bitwise_repeatable() -> anyhow::Result<()> {
    check::<f32>(DType::F32, 6)?;
    check::<f64>(DType::F64, 6)?;
    // f16 tops out at 65504: keep sums finite.
    check::<f16>(DType::F16, 3)?;
    check::<bf16>(DType::BF16, 6)?;
    Ok(())
}
