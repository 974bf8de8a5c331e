//! Argument checks of the [`Stream`](crate::Stream) operations, written once
//! for every backend.
//!
//! Each function checks one operation's dtypes, lengths, shapes and overlaps
//! as the trait documents them, and returns the error the enqueuing call must
//! return (so nothing is enqueued). A backend calls it first, then checks
//! what only it can (that the views belong to its device) and enqueues.
//!
//! The checks and the traits (`api.rs`) depend on each other on purpose:
//! the checks are written over the traits' types, and the traits' provided
//! batch methods check every piece before enqueuing any.

use crate::api::{AdamWOperands, Backend, Buffer, Copy2d, Device, MatmulSpec, Result, SgdOperands, SgdParams};
use crate::{DType, DeviceError, Scalar, View};

/// `what` (a view, an event) passed to a stream of `ours` must be of that device.
pub(crate) fn same_device<D: Device>(op: &'static str, what: &str, ours: &D, theirs: &D) -> Result<()> {
    if ours.is_same(theirs) {
        return Ok(());
    }
    Err(DeviceError::invalid(op, format!("{what} of {} was passed to a stream of {}", theirs.name(), ours.name())))
}

/// A view passed to a stream of `device` must be of that device.
pub(crate) fn on_device<B: Backend>(op: &'static str, device: &B::Device, view: &View<'_, B>) -> Result<()> {
    same_device(op, "a view", device, view.buffer().device())
}

fn need_float(op: &'static str, d: DType) -> Result<()> {
    if d.is_float() {
        Ok(())
    } else {
        Err(DeviceError::invalid(op, format!("needs a float dtype, got {d}")))
    }
}

fn need_len(op: &'static str, what: &str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(DeviceError::invalid(op, format!("{what} has {found} elements, expected {expected}")))
    }
}

fn need_dtype(op: &'static str, expected: DType, found: DType) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(DeviceError::DTypeMismatch { op, expected, found })
    }
}

/// `what` (a reduction's result, a scalar operand): one f32 or f64 element.
fn one_scalar<B: Backend>(op: &'static str, what: &str, v: &View<'_, B>) -> Result<()> {
    if v.len() != 1 || !matches!(v.dtype(), DType::F32 | DType::F64) {
        return Err(DeviceError::invalid(
            op,
            format!("{what} must be one f32 or f64 element, got {}[{}]", v.dtype(), v.len()),
        ));
    }
    Ok(())
}

/// `x` must be whole rows of `cols`; an empty `x` is zero rows of any `cols`.
fn whole_rows(op: &'static str, x: usize, cols: usize) -> Result<()> {
    if x != 0 && (cols == 0 || x % cols != 0) {
        return Err(DeviceError::invalid(op, format!("{x} elements are not rows of {cols}")));
    }
    Ok(())
}

/// [`Stream::copy`](crate::Stream::copy): same dtype and length.
pub(crate) fn copy<B: Backend>(src: View<'_, B>, dst: View<'_, B>) -> Result<()> {
    need_dtype("copy", dst.dtype(), src.dtype())?;
    need_len("copy", "the source", dst.len(), src.len())
}

/// [`Stream::copy_2d`](crate::Stream::copy_2d): same dtype, every block inside
/// its view, views disjoint.
pub(crate) fn copy_2d<B: Backend>(src: View<'_, B>, dst: View<'_, B>, layout: &Copy2d) -> Result<()> {
    let op = "copy_2d";
    need_dtype(op, dst.dtype(), src.dtype())?;
    let fits = |extent: Option<usize>, len: usize| extent.is_some_and(|e| e <= len);
    if !fits(layout.extent(layout.src_offset, layout.src_stride), src.len())
        || !fits(layout.extent(layout.dst_offset, layout.dst_stride), dst.len())
    {
        return Err(DeviceError::invalid(
            op,
            format!("{layout:?} does not fit views of {} and {}", src.len(), dst.len()),
        ));
    }
    if src.overlaps(&dst) {
        return Err(DeviceError::invalid(op, "the source and destination overlap"));
    }
    Ok(())
}

/// [`Stream::copy_from_host`](crate::Stream::copy_from_host): exactly `dst`'s bytes.
pub(crate) fn copy_from_host<B: Backend>(src: &[u8], dst: View<'_, B>) -> Result<()> {
    need_len("copy_from_host", "the host slice (bytes)", dst.bytes(), src.len())
}

/// [`Stream::fill`](crate::Stream::fill): `value` must fit `dst`'s dtype.
/// Returns one element of `value` in `dst`'s dtype (little-endian bytes).
pub(crate) fn fill<B: Backend>(dst: View<'_, B>, value: Scalar) -> Result<Vec<u8>> {
    value.encode(dst.dtype()).map_err(|r| DeviceError::invalid("fill", r))
}

/// [`Stream::cast`](crate::Stream::cast): float dtypes, same length.
pub(crate) fn cast<B: Backend>(src: View<'_, B>, dst: View<'_, B>) -> Result<()> {
    need_float("cast", src.dtype())?;
    need_float("cast", dst.dtype())?;
    need_len("cast", "the source", dst.len(), src.len())
}

/// [`Stream::scale`](crate::Stream::scale): a float dtype.
pub(crate) fn scale<B: Backend>(x: View<'_, B>) -> Result<()> {
    need_float("scale", x.dtype())
}

/// [`Stream::abs_max`](crate::Stream::abs_max): a float `x`, one f32 `out`.
pub(crate) fn abs_max<B: Backend>(x: View<'_, B>, out: View<'_, B>) -> Result<()> {
    need_float("abs_max", x.dtype())?;
    one_f32("abs_max", "the result", &out)
}

/// [`Stream::quantize_f8`](crate::Stream::quantize_f8) and
/// [`Stream::dequantize_f8`](crate::Stream::dequantize_f8): the high-precision
/// side a float, the other side f8e4m3 of the same length, one f32 amax.
pub(crate) fn scaled_f8<B: Backend>(
    op: &'static str,
    high: View<'_, B>,
    amax: View<'_, B>,
    f8: View<'_, B>,
) -> Result<()> {
    need_float(op, high.dtype())?;
    need_dtype(op, DType::F8E4M3, f8.dtype())?;
    need_len(op, "the float8 side", high.len(), f8.len())?;
    one_f32(op, "amax", &amax)
}

fn one_f32<B: Backend>(op: &'static str, what: &str, v: &View<'_, B>) -> Result<()> {
    if v.len() != 1 || v.dtype() != DType::F32 {
        return Err(DeviceError::invalid(
            op,
            format!("{what} must be one f32 element, got {}[{}]", v.dtype(), v.len()),
        ));
    }
    Ok(())
}

/// [`Stream::accumulate`](crate::Stream::accumulate): same length; any float
/// into any float, otherwise the same dtype.
pub(crate) fn accumulate<B: Backend>(src: View<'_, B>, dst: View<'_, B>) -> Result<()> {
    need_len("accumulate", "the source", dst.len(), src.len())?;
    let (sd, dd) = (src.dtype(), dst.dtype());
    if sd.is_float() && dd.is_float() {
        return Ok(());
    }
    need_dtype("accumulate", dd, sd)
}

/// [`Stream::axpy`](crate::Stream::axpy): float dtypes, same length.
pub(crate) fn axpy<B: Backend>(x: View<'_, B>, y: View<'_, B>) -> Result<()> {
    need_float("axpy", x.dtype())?;
    need_float("axpy", y.dtype())?;
    need_len("axpy", "x", y.len(), x.len())
}

/// [`Stream::matmul`](crate::Stream::matmul): `a` and `b` of one float dtype,
/// `c` of that dtype or f32, lengths as the spec's shape says.
pub(crate) fn matmul<B: Backend>(spec: &MatmulSpec, a: View<'_, B>, b: View<'_, B>, c: View<'_, B>) -> Result<()> {
    let op = "matmul";
    need_float(op, a.dtype())?;
    need_dtype(op, a.dtype(), b.dtype())?;
    if c.dtype() != a.dtype() && c.dtype() != DType::F32 {
        return Err(DeviceError::invalid(op, format!("the output must be {} or f32, got {}", a.dtype(), c.dtype())));
    }
    let MatmulSpec { m, n, k, .. } = *spec;
    let size = |x: usize, y: usize| x.checked_mul(y).ok_or_else(|| DeviceError::invalid(op, "shape overflows"));
    need_len(op, "A", size(m, k)?, a.len())?;
    need_len(op, "B", size(k, n)?, b.len())?;
    need_len(op, "C", size(m, n)?, c.len())
}

/// [`Stream::bias_add`](crate::Stream::bias_add): float dtypes, `x` whole rows of `bias`.
pub(crate) fn bias_add<B: Backend>(x: View<'_, B>, bias: View<'_, B>) -> Result<()> {
    need_float("bias_add", x.dtype())?;
    need_float("bias_add", bias.dtype())?;
    whole_rows("bias_add", x.len(), bias.len())
}

/// [`Stream::relu`](crate::Stream::relu): one float dtype, same length.
pub(crate) fn relu<B: Backend>(x: View<'_, B>, y: View<'_, B>) -> Result<()> {
    need_float("relu", x.dtype())?;
    need_dtype("relu", x.dtype(), y.dtype())?;
    need_len("relu", "y", x.len(), y.len())
}

/// [`Stream::relu_backward`](crate::Stream::relu_backward): one float dtype, same length.
pub(crate) fn relu_backward<B: Backend>(grad_out: View<'_, B>, out: View<'_, B>, grad_in: View<'_, B>) -> Result<()> {
    let op = "relu_backward";
    need_float(op, grad_out.dtype())?;
    need_dtype(op, grad_out.dtype(), out.dtype())?;
    need_dtype(op, grad_out.dtype(), grad_in.dtype())?;
    need_len(op, "out", grad_out.len(), out.len())?;
    need_len(op, "grad_in", grad_out.len(), grad_in.len())
}

/// [`Stream::mse_loss`](crate::Stream::mse_loss): float inputs of one length,
/// a one-element f32 or f64 `loss`.
pub(crate) fn mse_loss<B: Backend>(pred: View<'_, B>, target: View<'_, B>, loss: View<'_, B>) -> Result<()> {
    let op = "mse_loss";
    need_float(op, pred.dtype())?;
    need_float(op, target.dtype())?;
    need_len(op, "target", pred.len(), target.len())?;
    one_scalar(op, "the result", &loss)
}

/// [`Stream::mse_grad`](crate::Stream::mse_grad): float dtypes, same length.
pub(crate) fn mse_grad<B: Backend>(pred: View<'_, B>, target: View<'_, B>, grad: View<'_, B>) -> Result<()> {
    let op = "mse_grad";
    need_float(op, pred.dtype())?;
    need_float(op, target.dtype())?;
    need_float(op, grad.dtype())?;
    need_len(op, "target", pred.len(), target.len())?;
    need_len(op, "grad", pred.len(), grad.len())
}

/// [`Stream::column_sums`](crate::Stream::column_sums): float dtypes, `x` whole rows of `out`.
pub(crate) fn column_sums<B: Backend>(x: View<'_, B>, out: View<'_, B>) -> Result<()> {
    let op = "column_sums";
    need_float(op, x.dtype())?;
    need_float(op, out.dtype())?;
    whole_rows(op, x.len(), out.len())
}

/// [`Stream::sum_squares`](crate::Stream::sum_squares): a float `x`, a
/// one-element f32 or f64 `out`.
pub(crate) fn sum_squares<B: Backend>(x: View<'_, B>, out: View<'_, B>) -> Result<()> {
    let op = "sum_squares";
    need_float(op, x.dtype())?;
    one_scalar(op, "the result", &out)
}

/// [`ComputeStream::clip_scale`](crate::ComputeStream::clip_scale): a float
/// `x`, two one-element f32 or f64 parts that do not overlap it, a finite
/// non-negative `max_norm`.
pub(crate) fn clip_scale<B: Backend>(x: View<'_, B>, sq: [View<'_, B>; 2], max_norm: f64) -> Result<()> {
    let op = "clip_scale";
    need_float(op, x.dtype())?;
    for part in &sq {
        one_scalar(op, "a squared-norm part", part)?;
        if part.overlaps(&x) {
            return Err(DeviceError::invalid(op, "a part of the squared norm overlaps the scaled view"));
        }
    }
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(DeviceError::invalid(op, format!("max_norm must be finite and not negative, got {max_norm}")));
    }
    Ok(())
}

/// Optimizer operands: f32, all as long as the first.
fn f32_operands<B: Backend>(op: &'static str, operands: &[View<'_, B>]) -> Result<()> {
    for v in operands {
        need_dtype(op, DType::F32, v.dtype())?;
        need_len(op, "every operand", operands[0].len(), v.len())?;
    }
    Ok(())
}

/// No two of `operands` overlap; `names` says which they are in the error.
fn disjoint<B: Backend>(op: &'static str, operands: &[View<'_, B>], names: &str) -> Result<()> {
    for (i, a) in operands.iter().enumerate() {
        if operands[i + 1..].iter().any(|b| a.overlaps(b)) {
            return Err(DeviceError::invalid(op, format!("{names} must not overlap")));
        }
    }
    Ok(())
}

/// [`ComputeStream::sgd_step`](crate::ComputeStream::sgd_step): f32
/// operands of one length, a momentum buffer when momentum is on, no two
/// operands overlapping.
pub(crate) fn sgd_step<B: Backend>(params: &SgdParams, operands: &SgdOperands<'_, B>) -> Result<()> {
    let op = "sgd_step";
    let views = operands.views();
    f32_operands(op, &views)?;
    if params.momentum != 0.0 && operands.momentum_buf.is_none() {
        return Err(DeviceError::invalid(op, "momentum needs a momentum buffer"));
    }
    disjoint(op, &views, "param, grad and momentum buffer")
}

/// [`ComputeStream::adamw_step`](crate::ComputeStream::adamw_step): f32
/// operands of one length, no two overlapping.
pub(crate) fn adamw_step<B: Backend>(operands: &AdamWOperands<'_, B>) -> Result<()> {
    let op = "adamw_step";
    let views = operands.views();
    f32_operands(op, &views)?;
    disjoint(op, &views, "param, grad and the moments")
}

/// [`Stream::update_on_host`](crate::Stream::update_on_host): every view in
/// host memory, no written view overlapping another view.
pub(crate) fn update_on_host<B: Backend>(reads: &[View<'_, B>], writes: &[View<'_, B>]) -> Result<()> {
    let op = "update_on_host";
    if let Some(v) = reads.iter().chain(writes).find(|v| v.buffer().space() != crate::MemorySpace::Host) {
        return Err(DeviceError::invalid(op, format!("buffer {} is not in host memory", v.buffer().id())));
    }
    for (i, w) in writes.iter().enumerate() {
        if reads.iter().chain(&writes[i + 1..]).any(|other| w.overlaps(other)) {
            return Err(DeviceError::invalid(
                op,
                format!("a written range of buffer {} overlaps another view", w.buffer().id()),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuDevice;
    use crate::{Buffer, Device};

    fn message(r: Result<()>) -> String {
        r.expect_err("the check should fail").to_string()
    }

    #[test]
    fn rows_must_be_whole_unless_there_are_none() {
        let dev = CpuDevice::with_ordinal(0);
        let (x6, b3, b4, e) = (
            dev.alloc(DType::F32, 6).unwrap(),
            dev.alloc(DType::F32, 3).unwrap(),
            dev.alloc(DType::F32, 4).unwrap(),
            dev.alloc(DType::F32, 0).unwrap(),
        );
        assert!(bias_add(x6.view(), b3.view()).is_ok());
        assert!(bias_add(e.view(), e.view()).is_ok());
        assert!(column_sums(e.view(), b3.view()).is_ok());
        assert!(message(bias_add(x6.view(), b4.view())).contains("6 elements are not rows of 4"));
        assert!(message(column_sums(x6.view(), e.view())).contains("6 elements are not rows of 0"));
    }

    #[test]
    fn optimizer_operands_must_be_disjoint() {
        let dev = CpuDevice::with_ordinal(0);
        let buf = dev.alloc(DType::F32, 8).unwrap();
        let (a, b, overlapping) = (buf.slice(0, 4).unwrap(), buf.slice(4, 4).unwrap(), buf.slice(2, 4).unwrap());
        let sgd =
            SgdParams { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false, first_step: true };
        let sgd_of = |param, grad, momentum_buf| sgd_step(&sgd, &SgdOperands { param, grad, momentum_buf });
        assert!(message(sgd_of(a, b, None)).contains("momentum needs a momentum buffer"));
        assert!(message(sgd_of(a, overlapping, Some(b))).contains("must not overlap"));
        let other = dev.alloc(DType::F32, 8).unwrap();
        let (c, d) = (other.slice(0, 4).unwrap(), other.slice(4, 4).unwrap());
        assert!(sgd_of(a, b, Some(c)).is_ok());
        let adamw_of = |exp_avg_sq| adamw_step(&AdamWOperands { param: a, grad: b, exp_avg: c, exp_avg_sq });
        assert!(adamw_of(d).is_ok());
        assert!(message(adamw_of(c)).contains("must not overlap"));
    }

    #[test]
    fn reductions_write_one_f32_or_f64_element() {
        let dev = CpuDevice::with_ordinal(0);
        let (x, two, int) =
            (dev.alloc(DType::F32, 4).unwrap(), dev.alloc(DType::F64, 2).unwrap(), dev.alloc(DType::I32, 1).unwrap());
        assert!(message(sum_squares(x.view(), two.view())).contains("got f64[2]"));
        assert!(message(mse_loss(x.view(), x.view(), int.view())).contains("got i32[1]"));
        assert!(sum_squares(x.view(), two.slice(0, 1).unwrap()).is_ok());
    }

    #[test]
    fn matmul_shapes_that_overflow_are_errors() {
        let dev = CpuDevice::with_ordinal(0);
        let x = dev.alloc(DType::F32, 4).unwrap();
        let spec = MatmulSpec { m: usize::MAX, n: 1, k: 2, trans_a: false, trans_b: false, accumulate: false };
        assert!(message(matmul(&spec, x.view(), x.view(), x.view())).contains("shape overflows"));
    }
}
