//! Inputs and expected results, computed on the host from the inputs alone.
//!
//! Every participant `id` (a world rank) contributes, at element `k`, a
//! small integer value drawn from a hash of `(seed, id, k mod PERIOD)`. The
//! values are chosen per reduce operator so that every result is exact in
//! every dtype whatever order a backend reduces in:
//! - sums, minima, maxima and pre-multiplied sums use −4..=4 (0..=8 for u8):
//!   sums over 8 ranks stay within ±64, and pre-multiplied sums with scalars
//!   in halves up to 4 stay within ±128 in halves, exact even in bf16;
//! - products use 1, 2 and −1 (1 and 2 for u8): partial products are powers
//!   of two up to 256, exact in bf16, wrapping in i8/u8 the same in any order;
//! - averages of float dtypes use multiples of the world size, so the
//!   average is an exact integer; integer averages use the additive values
//!   and check truncating division.
//!
//! Inputs and expected results are periodic in `k` with period [`PERIOD`] (a
//! prime above every small count), so the expected result of a reduction
//! over `n` ranks costs `PERIOD × n` host steps and the check of a count-long
//! result is one pass of byte comparisons: O(count) per rank even for the
//! megabyte counts. The host reduction follows the documented semantics
//! step by step anyway (rank order, each step rounded to the dtype with
//! f16/bf16 computed in f32, integers wrapping, `Avg` as the sum divided by
//! n, `PreMulSum`'s scalar converted to the dtype first), so it is exact by
//! construction and not only because the values are small.

use chorus_collectives::ReduceOp;
use chorus_devices::{bf16, f16, DType, Element, Float8E4M3};

use crate::Failure;

/// The period of every input pattern, in elements (prime, above 1023).
pub const PERIOD: usize = 1031;

/// The value output buffers are filled with before a collective, so an
/// element it fails to write is caught. No input or result is ever 99.
pub const SENTINEL: i64 = 99;

/// The reduce operator a case uses: one operator for every rank, or a
/// pre-multiplied sum whose scalar differs per rank (NCCL allows that).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OpSpec {
    /// The same operator on every rank.
    Uniform(ReduceOp),
    /// `PreMulSum(0.5 × (rank + 1))` on each rank.
    PerRankPreMulSum,
}

impl OpSpec {
    /// `ReduceOp::ALL` as uniform operators, then the per-rank pre-multiplied sum.
    pub fn all() -> Vec<OpSpec> {
        let mut v: Vec<OpSpec> = ReduceOp::ALL.into_iter().map(OpSpec::Uniform).collect();
        v.push(OpSpec::PerRankPreMulSum);
        v
    }

    /// The operator participant `id` passes.
    pub fn for_rank(self, id: usize) -> ReduceOp {
        match self {
            OpSpec::Uniform(op) => op,
            OpSpec::PerRankPreMulSum => ReduceOp::PreMulSum(0.5 * (id + 1) as f64),
        }
    }

    /// The operators of `ids`, in order.
    pub fn ops(self, ids: &[usize]) -> Vec<ReduceOp> {
        ids.iter().map(|id| self.for_rank(*id)).collect()
    }

    /// A name for case names (`sum`, `premul_sum(0.5)`, `premul_sum(per_rank)`).
    pub fn name(self) -> String {
        match self {
            OpSpec::Uniform(op) => op.to_string(),
            OpSpec::PerRankPreMulSum => "premul_sum(per_rank)".into(),
        }
    }

    /// The underlying operator kind (the scalar of a per-rank sum is irrelevant here).
    pub fn kind(self) -> ReduceOp {
        self.for_rank(0)
    }
}

/// Which values participants contribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Values {
    /// −4..=4 (0..=8 for u8).
    Additive,
    /// 1, 2, −1 (1, 2 for u8).
    Multiplicative,
    /// For float dtypes `n × (−3..=3)`, `n` being the number of ranks
    /// reduced over; for integer dtypes as `Additive`.
    Averaged(usize),
}

/// The inputs of one collective: which values, and a seed that keeps the
/// inputs of different cases (and of different subgroups) apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pattern {
    /// Which values.
    pub values: Values,
    /// The seed.
    pub seed: u64,
}

fn mix(mut z: u64) -> u64 {
    // splitmix64's finalizer.
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Pattern {
    /// Additive values with `seed`.
    pub fn additive(seed: u64) -> Pattern {
        Pattern { values: Values::Additive, seed }
    }

    /// The values that keep operator `op` exact when reducing over `n` ranks.
    pub fn for_op(op: OpSpec, n: usize, seed: u64) -> Pattern {
        let values = match op.kind() {
            ReduceOp::Prod => Values::Multiplicative,
            ReduceOp::Avg => Values::Averaged(n.max(1)),
            _ => Values::Additive,
        };
        Pattern { values, seed }
    }

    /// Participant `id`'s value at element `k` (taken modulo [`PERIOD`]).
    pub fn value(&self, dtype: DType, id: usize, k: usize) -> i64 {
        let h = mix(self.seed ^ mix((id as u64) << 32 | (k % PERIOD) as u64));
        let unsigned = dtype == DType::U8;
        match self.values {
            Values::Additive if unsigned => (h % 9) as i64,
            Values::Additive => (h % 9) as i64 - 4,
            Values::Multiplicative if unsigned => [1, 2][(h % 2) as usize],
            Values::Multiplicative => [1, 2, -1][(h % 3) as usize],
            Values::Averaged(n) if dtype.is_float() => n as i64 * ((h % 7) as i64 - 3),
            Values::Averaged(_) => Pattern { values: Values::Additive, seed: self.seed }.value(dtype, id, k),
        }
    }
}

/// A host type with the element arithmetic of the collectives contract.
trait HostValue: Element {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div_n(a: Self, n: usize) -> Self;
    /// A pre-multiplied sum's scalar converted to this type.
    fn scalar(s: f64) -> Self;
}

macro_rules! int_value {
    ($($t:ty),*) => {$(
        impl HostValue for $t {
            fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            fn div_n(a: Self, n: usize) -> Self { (i128::from(a) / n as i128) as $t }
            fn scalar(s: f64) -> Self { s as $t }
        }
    )*};
}
int_value!(i32, i64, i8, u8);

macro_rules! float_value {
    ($t:ty, $up:expr, $down:expr) => {
        impl HostValue for $t {
            fn add(a: Self, b: Self) -> Self {
                $down($up(a) + $up(b))
            }
            fn mul(a: Self, b: Self) -> Self {
                $down($up(a) * $up(b))
            }
            fn min(a: Self, b: Self) -> Self {
                if $up(b) < $up(a) {
                    b
                } else {
                    a
                }
            }
            fn max(a: Self, b: Self) -> Self {
                if $up(b) > $up(a) {
                    b
                } else {
                    a
                }
            }
            fn div_n(a: Self, n: usize) -> Self {
                $down($up(a) / n as f32)
            }
            fn scalar(s: f64) -> Self {
                <$t as Element>::from_f64(s)
            }
        }
    };
}
float_value!(f32, |x: f32| x, |x: f32| x);
float_value!(f16, |x: f16| x.to_f32(), f16::from_f32);
float_value!(bf16, |x: bf16| x.to_f32(), bf16::from_f32);
// Only data movement is checked on float8 (reductions of it are refused),
// so this arithmetic only completes the table.
float_value!(Float8E4M3, |x: Float8E4M3| x.to_f32(), Float8E4M3::from_f32);

impl HostValue for f64 {
    fn add(a: Self, b: Self) -> Self {
        a + b
    }
    fn mul(a: Self, b: Self) -> Self {
        a * b
    }
    fn min(a: Self, b: Self) -> Self {
        if b < a {
            b
        } else {
            a
        }
    }
    fn max(a: Self, b: Self) -> Self {
        if b > a {
            b
        } else {
            a
        }
    }
    fn div_n(a: Self, n: usize) -> Self {
        a / n as f64
    }
    fn scalar(s: f64) -> Self {
        s
    }
}

/// Calls `$body` with `$t` bound to the host type of `$dtype`.
macro_rules! with_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        with_type!(@each $dtype, $t => $body; F32 f32, F64 f64, F16 f16, BF16 bf16, I32 i32, I64 i64, I8 i8, U8 u8,
            F8E4M3 Float8E4M3)
    };
    (@each $dtype:expr, $t:ident => $body:expr; $($variant:ident $host:ty),*) => {
        match $dtype {
            $(DType::$variant => {
                type $t = $host;
                $body
            })*
        }
    };
}

fn encode<T: Element>(values: impl Iterator<Item = T>) -> Vec<u8> {
    let v: Vec<T> = values.collect();
    bytemuck::cast_slice(&v).to_vec()
}

/// Participant `id`'s values at elements `0..PERIOD`, as bytes of `dtype`.
pub fn table(dtype: DType, pattern: &Pattern, id: usize) -> Vec<u8> {
    with_type!(dtype, T => encode((0..PERIOD).map(|k| T::from_f64(pattern.value(dtype, id, k) as f64))))
}

/// One element of `dtype` holding `value` (a one-element table).
pub fn filled(dtype: DType, value: i64) -> Vec<u8> {
    with_type!(dtype, T => encode(std::iter::once(T::from_f64(value as f64))))
}

/// Elements `start..start + len` of the periodic extension of `table`.
pub fn repeat(dtype: DType, table: &[u8], start: usize, len: usize) -> Vec<u8> {
    let size = dtype.size();
    let period = table.len() / size;
    let mut out = Vec::with_capacity(len * size);
    if period == 0 {
        return out;
    }
    let mut p = start % period;
    let mut left = len;
    while left > 0 {
        let m = (period - p).min(left);
        out.extend_from_slice(&table[p * size..(p + m) * size]);
        left -= m;
        p = 0;
    }
    out
}

/// Participant `id`'s input, elements `start..start + len`.
pub fn input(dtype: DType, pattern: &Pattern, id: usize, start: usize, len: usize) -> Vec<u8> {
    repeat(dtype, &table(dtype, pattern, id), start, len)
}

/// The reduction over participants `ids` (in that order), each using the
/// operator at the same position of `ops`, of their values at `0..PERIOD`.
pub fn reduced(dtype: DType, pattern: &Pattern, ids: &[usize], ops: &[ReduceOp]) -> Vec<u8> {
    with_type!(dtype, T => encode(reduce_host::<T>(dtype, pattern, ids, ops).into_iter()))
}

fn reduce_host<T: HostValue>(dtype: DType, pattern: &Pattern, ids: &[usize], ops: &[ReduceOp]) -> Vec<T> {
    let scalar = |op: &ReduceOp| match op {
        ReduceOp::PreMulSum(s) => T::scalar(*s),
        _ => T::from_f64(1.0),
    };
    let scalars: Vec<T> = ops.iter().map(scalar).collect();
    let x = |j: usize, k: usize| T::from_f64(pattern.value(dtype, ids[j], k) as f64);
    let Some(first) = ops.first() else {
        return Vec::new();
    };
    (0..PERIOD)
        .map(|k| {
            let mut acc = match first {
                ReduceOp::PreMulSum(_) => T::mul(x(0, k), scalars[0]),
                _ => x(0, k),
            };
            for j in 1..ids.len() {
                let v = x(j, k);
                acc = match ops[j] {
                    ReduceOp::Sum | ReduceOp::Avg => T::add(acc, v),
                    ReduceOp::Prod => T::mul(acc, v),
                    ReduceOp::Min => T::min(acc, v),
                    ReduceOp::Max => T::max(acc, v),
                    ReduceOp::PreMulSum(_) => T::add(acc, T::mul(v, scalars[j])),
                };
            }
            if *first == ReduceOp::Avg {
                acc = T::div_n(acc, ids.len());
            }
            acc
        })
        .collect()
}

/// Elements of type `T` from little-endian bytes (any alignment).
pub fn decode<T: Element>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

fn show(dtype: DType, bytes: &[u8]) -> String {
    with_type!(dtype, T => format!("{:?}", bytemuck::pod_read_unaligned::<T>(bytes)))
}

/// Checks that `got` (elements of `dtype`) equals, bit for bit, elements
/// `start..` of the periodic extension of `table`. The error names `what`,
/// how many elements differ and the first of them.
pub fn check(what: &str, dtype: DType, got: &[u8], table: &[u8], start: usize) -> Result<(), Failure> {
    let size = dtype.size();
    let period = table.len() / size;
    let len = got.len() / size;
    if len == 0 {
        return Ok(());
    }
    anyhow::ensure!(period > 0, "{what}: empty expectation for {len} elements");
    let (mut i, mut p) = (0, start % period);
    while i < len {
        let m = (period - p).min(len - i);
        if got[i * size..(i + m) * size] != table[p * size..(p + m) * size] {
            return Err(describe(what, dtype, got, table, start));
        }
        i += m;
        p = 0;
    }
    Ok(())
}

fn describe(what: &str, dtype: DType, got: &[u8], table: &[u8], start: usize) -> Failure {
    let size = dtype.size();
    let period = table.len() / size;
    let len = got.len() / size;
    let mut first = None;
    let mut wrong = 0usize;
    for i in 0..len {
        let p = (start + i) % period;
        let (g, e) = (&got[i * size..(i + 1) * size], &table[p * size..(p + 1) * size]);
        if g != e {
            wrong += 1;
            first.get_or_insert((i, show(dtype, g), show(dtype, e)));
        }
    }
    match first {
        Some((i, g, e)) => {
            anyhow::anyhow!("{what}: {wrong} of {len} {dtype} elements differ; first at [{i}]: got {g}, expected {e}")
        }
        None => anyhow::anyhow!("{what}: differs from the expectation"),
    }
}

/// Checks that every element of `got` is [`SENTINEL`] (an output that must
/// not have been written).
pub fn check_untouched(what: &str, dtype: DType, got: &[u8]) -> Result<(), Failure> {
    check(what, dtype, got, &filled(dtype, SENTINEL), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_stay_in_their_ranges() {
        for dtype in DType::ALL {
            for k in 0..PERIOD {
                let add = Pattern::additive(1).value(dtype, 3, k);
                let mul = Pattern { values: Values::Multiplicative, seed: 1 }.value(dtype, 3, k);
                let avg = Pattern { values: Values::Averaged(3), seed: 1 }.value(dtype, 3, k);
                if dtype == DType::U8 {
                    assert!((0..=8).contains(&add) && [1, 2].contains(&mul));
                } else {
                    assert!((-4..=4).contains(&add) && [1, 2, -1].contains(&mul));
                }
                if dtype.is_float() {
                    assert!(avg % 3 == 0 && avg.abs() <= 9);
                }
            }
        }
    }

    #[test]
    fn sums_match_a_plain_loop_and_wrap_for_small_ints() {
        let p = Pattern::additive(7);
        let ids: Vec<usize> = (0..8).collect();
        let ops = vec![ReduceOp::Sum; 8];
        let got: Vec<f64> = decode(&reduced(DType::F64, &p, &ids, &ops));
        for (k, g) in got.iter().enumerate() {
            let want: i64 = ids.iter().map(|id| p.value(DType::F64, *id, k)).sum();
            assert_eq!(*g, want as f64);
        }
        // 2^8 wraps to 0 in u8 and i8, as a modular product does in any order.
        let m = Pattern { values: Values::Multiplicative, seed: 0 };
        let prods: Vec<u8> = reduced(DType::U8, &m, &ids, &[ReduceOp::Prod; 8]);
        for (k, g) in prods.iter().enumerate() {
            let want = ids.iter().fold(1u32, |a, id| a * m.value(DType::U8, *id, k) as u32) % 256;
            assert_eq!(*g as u32, want);
        }
    }

    #[test]
    fn integer_average_truncates_toward_zero() {
        assert_eq!(<i32 as HostValue>::div_n(-5, 2), -2);
        assert_eq!(<i8 as HostValue>::div_n(-7, 3), -2);
        assert_eq!(<f32 as HostValue>::div_n(-5.0, 2), -2.5);
    }

    #[test]
    fn check_finds_the_first_difference() {
        let t = table(DType::I32, &Pattern::additive(3), 0);
        let mut got = repeat(DType::I32, &t, 5, 3000);
        assert!(check("x", DType::I32, &got, &t, 5).is_ok());
        assert!(check("x", DType::I32, &got, &t, 6).is_err());
        got[4 * 2000] ^= 1;
        let e = check("x", DType::I32, &got, &t, 5).unwrap_err().to_string();
        assert!(e.contains("1 of 3000") && e.contains("[2000]"), "{e}");
        assert!(check_untouched("y", DType::BF16, &repeat(DType::BF16, &filled(DType::BF16, SENTINEL), 0, 9)).is_ok());
    }
}
