//! Element arithmetic of reductions, written once for every backend that
//! reduces on the host (`sim`, `ucx`).
//!
//! Each step is rounded to the dtype (f16/bf16 computed in f32 and rounded,
//! as NCCL's kernels do); integers wrap. The order in which ranks are
//! combined is the backend's (the sim backend: rank order 0..n-1; `ucx`: see
//! its module documentation).
//! `Avg` is the sum divided by n (rounded; integer division for integers);
//! `PreMulSum(s)` converts `s` to the dtype, multiplies each rank's input by
//! it, then sums.

use chorus_devices::{bf16, f16, Element, Float8E4M3};

use crate::ReduceOp;

pub(crate) trait Reducible: Element {
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div_n(a: Self, n: usize) -> Self;
    /// The scalar of a pre-multiplied sum, converted to this type.
    fn scalar(s: f64) -> Self;
}

macro_rules! int_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            fn div_n(a: Self, n: usize) -> Self { (a as i128 / n as i128) as $t }
            fn scalar(s: f64) -> Self { s as $t }
        }
    )*};
}
int_reducible!(i32, i64, i8, u8);

macro_rules! float_reducible {
    ($t:ty, $m:ty, $up:expr, $down:expr) => {
        impl Reducible for $t {
            fn sum(a: Self, b: Self) -> Self {
                $down($up(a) + $up(b))
            }
            fn prod(a: Self, b: Self) -> Self {
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
                $down($up(a) / (n as $m))
            }
            fn scalar(s: f64) -> Self {
                <$t as Element>::from_f64(s)
            }
        }
    };
}
float_reducible!(f32, f32, |x: f32| x, |x: f32| x);
float_reducible!(f64, f64, |x: f64| x, |x: f64| x);
float_reducible!(f16, f32, |x: f16| x.to_f32(), f16::from_f32);
float_reducible!(bf16, f32, |x: bf16| x.to_f32(), bf16::from_f32);
// Float8 reductions are refused before a backend sees them (the
// communicator's validation); this only completes the dtype table.
float_reducible!(Float8E4M3, f32, |x: Float8E4M3| x.to_f32(), Float8E4M3::from_f32);

/// `acc = x * s` (the first rank of a pre-multiplied sum) or `acc = x`.
pub(crate) fn start<T: Reducible>(acc: &mut [T], x: &[T], op: ReduceOp, scalar: f64) {
    match op {
        ReduceOp::PreMulSum(_) => {
            let s = T::scalar(scalar);
            for (a, v) in acc.iter_mut().zip(x) {
                *a = T::prod(*v, s);
            }
        }
        _ => acc.copy_from_slice(x),
    }
}

/// `acc = acc op x` for one more rank (whose own input `x` is scaled by its
/// `scalar` for a pre-multiplied sum).
pub(crate) fn combine<T: Reducible>(acc: &mut [T], x: &[T], op: ReduceOp, scalar: f64) {
    macro_rules! each {
        ($f:expr) => {
            for (a, v) in acc.iter_mut().zip(x) {
                *a = $f(*a, *v);
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(T::sum),
        ReduceOp::Prod => each!(T::prod),
        ReduceOp::Min => each!(T::min),
        ReduceOp::Max => each!(T::max),
        ReduceOp::PreMulSum(_) => {
            let s = T::scalar(scalar);
            each!(|a, v| T::sum(a, T::prod(v, s)))
        }
    }
}

/// The last step: divide by n for `Avg`.
pub(crate) fn finish<T: Reducible>(acc: &mut [T], op: ReduceOp, n: usize) {
    if op == ReduceOp::Avg {
        for a in acc {
            *a = T::div_n(*a, n);
        }
    }
}

// The dtype table; the kernels find it here with the rest of the arithmetic.
pub(crate) use chorus_devices::with_element;

/// The operator that combines two partial results (already scaled and not
/// yet divided): a sum for `Avg` and `PreMulSum`, the operator itself otherwise.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) fn partial_op(op: ReduceOp) -> ReduceOp {
    match op {
        ReduceOp::Avg | ReduceOp::PreMulSum(_) => ReduceOp::Sum,
        other => other,
    }
}

/// The `i`-th of `n` balanced shares of `0..len` (the first `len % n`
/// shares one element longer).
pub(crate) fn share(len: usize, n: usize, i: usize) -> (usize, usize) {
    let base = len / n;
    let extra = len % n;
    let lo = i * base + i.min(extra);
    (lo, lo + base + usize::from(i < extra))
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn shares_cover_the_range_once_and_differ_by_at_most_one() {
        for len in [0, 1, 7, 1023, 1 << 20] {
            for n in 1..=8 {
                let mut next = 0;
                for i in 0..n {
                    let (lo, hi) = share(len, n, i);
                    assert_eq!(lo, next);
                    assert!(hi - lo == len / n || hi - lo == len / n + 1);
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }
}
