//! The arithmetic of the cpu device: plain loops over typed slices.
//!
//! f16 and bf16 compute in f32 and round once per result (PyTorch's opmath);
//! f32 in f32; f64 in f64.

use half::{bf16, f16};
use std::ops::{Add, Mul, Sub};

use crate::{AdamWParams, DType, Element, Float8E4M3, SgdParams};

/// The type arithmetic is done in.
pub(crate) trait Math:
    Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + PartialOrd + Send + Sync + 'static
{
    const ZERO: Self;
    fn of(v: f64) -> Self;
    fn f64(self) -> f64;
}

impl Math for f32 {
    const ZERO: f32 = 0.0;
    fn of(v: f64) -> f32 {
        v as f32
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Math for f64 {
    const ZERO: f64 = 0.0;
    fn of(v: f64) -> f64 {
        v
    }
    fn f64(self) -> f64 {
        self
    }
}

/// A float element with its opmath type.
pub(crate) trait Float: Element {
    type M: Math;
    fn up(self) -> Self::M;
    fn down(m: Self::M) -> Self;
    /// Converts another float's opmath value into this type's opmath
    /// (the exact value, rounded once).
    fn m_from<S: Float>(s: S) -> Self::M {
        Self::M::of(s.to_f64())
    }
}

impl Float for f32 {
    type M = f32;
    fn up(self) -> f32 {
        self
    }
    fn down(m: f32) -> f32 {
        m
    }
    fn m_from<S: Float>(s: S) -> f32 {
        // Every float narrower than f64 widens to f32 exactly.
        if S::DTYPE == DType::F64 {
            s.to_f64() as f32
        } else {
            s.up().f64() as f32
        }
    }
}
impl Float for f64 {
    type M = f64;
    fn up(self) -> f64 {
        self
    }
    fn down(m: f64) -> f64 {
        m
    }
}
impl Float for f16 {
    type M = f32;
    fn up(self) -> f32 {
        self.to_f32()
    }
    fn down(m: f32) -> f16 {
        f16::from_f32(m)
    }
}
impl Float for bf16 {
    type M = f32;
    fn up(self) -> f32 {
        self.to_f32()
    }
    fn down(m: f32) -> bf16 {
        bf16::from_f32(m)
    }
}

/// Calls `$body` with `$t` bound to the host type of a float dtype.
macro_rules! with_float {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            _ => unreachable!("checked to be a float dtype before dispatch"),
        }
    };
}
pub(crate) use with_float;

pub(crate) fn cast<S: Float, D: Float>(src: &[S], dst: &mut [D]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f64(s.to_f64());
    }
}

/// The larger of two magnitudes, NaN if either is (as `torch.max`).
pub(crate) fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b > a {
        b
    } else {
        a
    }
}

/// `max |x|` (0 for an empty `x`), NaN if any element is.
pub(crate) fn abs_max<T: Float>(x: &[T]) -> f32 {
    // Every float but f64 widens to f32 exactly; f64 rounds once at the end.
    let mut m = 0.0f64;
    for v in x {
        let a = v.to_f64().abs();
        if a.is_nan() {
            return f32::NAN;
        }
        m = m.max(a);
    }
    m as f32
}

/// `dst = e4m3(f32(src) · scale)`, saturated (torchao's `to_fp8_saturated`).
pub(crate) fn quantize_f8<S: Float>(src: &[S], scale: f32, dst: &mut [Float8E4M3]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = Float8E4M3::from_f32(s.to_f64() as f32 * scale);
    }
}

/// `dst = f32(src) / scale`, rounded once to `D`.
pub(crate) fn dequantize_f8<D: Float>(src: &[Float8E4M3], scale: f32, dst: &mut [D]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f64((s.to_f32() / scale) as f64);
    }
}

pub(crate) fn scale<T: Float>(x: &mut [T], alpha: f64) {
    let a = T::M::of(alpha);
    for v in x {
        *v = T::down(v.up() * a);
    }
}

pub(crate) fn accumulate<S: Float, D: Float>(src: &[S], dst: &mut [D]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::down(d.up() + D::m_from(*s));
    }
}

pub(crate) fn axpy<S: Float, D: Float>(alpha: f64, x: &[S], y: &mut [D]) {
    let a = D::M::of(alpha);
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv = D::down(yv.up() + a * D::m_from(*xv));
    }
}

pub(crate) fn accumulate_int<T: Element + IntWrap>(src: &[T], dst: &mut [T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = d.wrapping_add_(*s);
    }
}

/// Wrapping integer addition (NCCL and CUDA integer arithmetic wraps).
pub(crate) trait IntWrap: Copy {
    fn wrapping_add_(self, o: Self) -> Self;
}
macro_rules! int_wrap {
    ($($t:ty),*) => {$(impl IntWrap for $t { fn wrapping_add_(self, o: Self) -> Self { self.wrapping_add(o) } })*};
}
int_wrap!(i32, i64, i8, u8);

/// `C (+)= op(A) op(B)` with f32 (f64) accumulation, through a fast GEMM.
pub(crate) fn matmul<T: Float, C: Float>(spec: crate::MatmulSpec, a: &[T], b: &[T], c: &mut [C]) {
    let crate::MatmulSpec { m, n, k, trans_a, trans_b, accumulate } = spec;
    // Strides of op(A) [m×k] and op(B) [k×n] as stored.
    let (rsa, csa) = if trans_a { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if trans_b { (1, k as isize) } else { (n as isize, 1) };
    if m == 0 || n == 0 {
        return;
    }
    if T::DTYPE == DType::F64 {
        let a64: Vec<f64> = a.iter().map(|v| v.to_f64()).collect();
        let b64: Vec<f64> = b.iter().map(|v| v.to_f64()).collect();
        let mut out = vec![0f64; m * n];
        // SAFETY: the slices hold the strided extents computed above (checked by the caller).
        unsafe {
            matrixmultiply::dgemm(
                m,
                k,
                n,
                1.0,
                a64.as_ptr(),
                rsa,
                csa,
                b64.as_ptr(),
                rsb,
                csb,
                0.0,
                out.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        finish(out.iter().copied(), c, accumulate);
    } else {
        let a32: Vec<f32> = a.iter().map(|v| v.to_f64() as f32).collect();
        let b32: Vec<f32> = b.iter().map(|v| v.to_f64() as f32).collect();
        let mut out = vec![0f32; m * n];
        // SAFETY: as above.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a32.as_ptr(),
                rsa,
                csa,
                b32.as_ptr(),
                rsb,
                csb,
                0.0,
                out.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        finish(out.iter().map(|v| *v as f64), c, accumulate);
    }

    // Add the old C in f64 and round into C once, rather than rounding the
    // product to C's precision first and the sum again (an f64 product into
    // an f32 C lost up to an extra half ulp that way).
    fn finish<C: Float>(out: impl Iterator<Item = f64>, c: &mut [C], accumulate: bool) {
        for (cv, o) in c.iter_mut().zip(out) {
            *cv = C::from_f64(if accumulate { cv.to_f64() + o } else { o });
        }
    }
}

pub(crate) fn bias_add<X: Float, B: Float>(x: &mut [X], bias: &[B]) {
    if bias.is_empty() {
        return;
    }
    for row in x.chunks_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v = X::down(v.up() + X::m_from(*b));
        }
    }
}

// NaN propagates as in PyTorch: relu(NaN) = NaN (only x ≤ 0 becomes 0), and
// the gradient passes where the output is not ≤ 0 (threshold_backward).
pub(crate) fn relu<T: Float>(x: &[T], y: &mut [T]) {
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv = if xv.up() <= T::M::ZERO { T::down(T::M::ZERO) } else { *xv };
    }
}

pub(crate) fn relu_backward<T: Float>(grad_out: &[T], out: &[T], grad_in: &mut [T]) {
    for ((gi, go), o) in grad_in.iter_mut().zip(grad_out).zip(out) {
        *gi = if o.up() <= T::M::ZERO { T::down(T::M::ZERO) } else { *go };
    }
}

pub(crate) fn mse_sum<P: Float, T: Float>(pred: &[P], target: &[T]) -> f64 {
    pred.iter().zip(target).map(|(p, t)| (p.to_f64() - t.to_f64()).powi(2)).sum()
}

pub(crate) fn mse_grad<P: Float, T: Float, G: Float>(pred: &[P], target: &[T], grad: &mut [G], scale: f64) {
    let s = G::M::of(2.0 * scale);
    for ((g, p), t) in grad.iter_mut().zip(pred).zip(target) {
        *g = G::down(s * (G::m_from(*p) - G::m_from(*t)));
    }
}

pub(crate) fn column_sums<X: Float, O: Float>(x: &[X], out: &mut [O], accumulate: bool) {
    let cols = out.len();
    if cols == 0 {
        return;
    }
    let mut acc = vec![O::M::ZERO; cols];
    for row in x.chunks(cols) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a = *a + O::m_from(*v);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = O::down(if accumulate { o.up() + a } else { a });
    }
}

pub(crate) fn sum_squares<T: Float>(x: &[T]) -> f64 {
    x.iter().map(|v| v.to_f64() * v.to_f64()).sum()
}

/// One SGD step in f32, mirroring `torch.optim.SGD`'s single-tensor update.
pub(crate) fn sgd(p: SgdParams, param: &mut [f32], grad: &[f32], buf: Option<&mut [f32]>) {
    let (lr, wd, mom, damp) = (p.lr as f32, p.weight_decay as f32, p.momentum as f32, (1.0 - p.dampening) as f32);
    match buf {
        Some(buf) if p.momentum != 0.0 => {
            for ((w, g), b) in param.iter_mut().zip(grad).zip(buf.iter_mut()) {
                let d = if p.weight_decay != 0.0 { *g + wd * *w } else { *g };
                *b = if p.first_step { d } else { *b * mom + damp * d };
                let step = if p.nesterov { d + mom * *b } else { *b };
                *w += -lr * step;
            }
        }
        _ => {
            for (w, g) in param.iter_mut().zip(grad) {
                let d = if p.weight_decay != 0.0 { *g + wd * *w } else { *g };
                *w += -lr * d;
            }
        }
    }
}

/// One AdamW step in f32, mirroring `torch.optim.AdamW`'s single-tensor update
/// (scalars in f64 as Python computes them, applied in f32).
pub(crate) fn adamw(p: AdamWParams, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    let step = p.step.max(1) as i32;
    let decay = (1.0 - p.lr * p.weight_decay) as f32;
    let (b1, b2) = (p.beta1, p.beta2);
    let one_minus_b1 = (1.0 - b1) as f32;
    let (b2f, one_minus_b2) = (b2 as f32, (1.0 - b2) as f32);
    let bc1 = 1.0 - b1.powi(step);
    let bc2_sqrt = (1.0 - b2.powi(step)).sqrt() as f32;
    let step_size = (p.lr / bc1) as f32;
    let eps = p.eps as f32;
    for (((w, g), mv), vv) in param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
        *w *= decay;
        *mv += one_minus_b1 * (*g - *mv);
        *vv = *vv * b2f + one_minus_b2 * *g * *g;
        let denom = vv.sqrt() / bc2_sqrt + eps;
        *w += -step_size * (*mv / denom);
    }
}
