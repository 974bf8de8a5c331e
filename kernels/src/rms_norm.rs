//! RMSNorm over the last dim, forward and backward (the weight's gradient
//! too), as transformers' `LlamaRMSNorm` computes it:
//! `y = w ∘ round(x · r)` with `r = 1 / sqrt(mean(x²) + eps)` in f32, the
//! normalised row rounded to the input's dtype before the weight multiplies
//! it (exact in f32). The CUDA kernels are `cuda/rms_norm.cuh`.
//!
//! Backward, with `x̂ = x · r` and `g = w ∘ dy`:
//! `dx = r · (g − x̂ · mean(g ∘ x̂))`, `dw = Σ_rows dy ∘ x̂`.

use candle_core::{bail, Result, Shape, Tensor};

use crate::host::{check_float, round_to};
use crate::op::{CpuInput, Kernel, Op};
use crate::timing::{timed, OpKind};

/// `weight ∘ x / sqrt(mean(x²) + eps)` over `x`'s last dim; `weight` is
/// 1-D of that size and `x`'s dtype (f32, bf16 or f16). Differentiable in
/// both arguments.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    check_float(OP, "x", x.dtype())?;
    let d = x.dims().last().copied().unwrap_or(0);
    if weight.dims() != [d] || d == 0 {
        bail!(
            "{OP}: weight of shape {:?} for x of shape {:?}; it must be 1-D of x's last dim",
            weight.shape(),
            x.shape()
        )
    }
    if weight.dtype() != x.dtype() {
        bail!("{OP}: weight is {:?} and x {:?}; they must match", weight.dtype(), x.dtype())
    }
    // The kernels compute in f32: an eps f32 cannot hold is refused, not rounded to infinity.
    if !(eps >= 0.0 && (eps as f32).is_finite()) {
        bail!("{OP}: eps {eps} must be finite in f32 and not negative")
    }
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    timed(OpKind::RmsNorm, x.device(), || x.apply_op2(&weight, Op(RmsNorm { eps: eps as f32 })))
}

/// The forward: `x` `[rows, d]` flattened, `w` `[d]`; outputs rounded with `round`.
pub fn forward(x: &[f32], w: &[f32], eps: f32, round: impl Fn(f32) -> f32) -> Vec<f32> {
    let d = w.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let r = inv_rms(row, eps);
        y.extend(row.iter().zip(w).map(|(v, w)| round(w * round(v * r))));
    }
    y
}

/// `dx` of the forward, given `dy`.
pub fn backward_x(x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut dx = Vec::with_capacity(x.len());
    for (row, dyr) in x.chunks_exact(d).zip(dy.chunks_exact(d)) {
        let r = inv_rms(row, eps);
        let dot: f32 = row.iter().zip(dyr).zip(w).map(|((v, g), w)| v * r * g * w).sum::<f32>() / d as f32;
        dx.extend(row.iter().zip(dyr).zip(w).map(|((v, g), w)| r * (g * w - v * r * dot)));
    }
    dx
}

/// `dw` of the forward (summed over rows), given `dy`.
pub fn backward_w(x: &[f32], dy: &[f32], d: usize, eps: f32) -> Vec<f32> {
    let mut dw = vec![0f32; d];
    for (row, dyr) in x.chunks_exact(d).zip(dy.chunks_exact(d)) {
        let r = inv_rms(row, eps);
        for ((acc, v), g) in dw.iter_mut().zip(row).zip(dyr) {
            *acc += g * v * r;
        }
    }
    dw
}

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// The forward op on `(x, weight)`.
struct RmsNorm {
    eps: f32,
}

impl Kernel<2> for RmsNorm {
    const NAME: &'static str = "chorus-rms-norm";

    fn shape(&self, [x, _]: [&Shape; 2]) -> Result<Shape> {
        Ok(x.clone())
    }

    fn cpu(&self, [x, w]: [CpuInput; 2]) -> Result<Vec<f32>> {
        let dtype = x.dtype();
        Ok(forward(&x.f32()?, &w.f32()?, self.eps, |v| round_to(dtype, v)))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(x, lx), (w, lw)]: [crate::op::CudaInput; 2]) -> Result<candle_core::CudaStorage> {
        crate::cuda::rms_norm_forward(x, lx, w, lw, self.eps)
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let dy = dy.contiguous()?;
        let dx = timed(OpKind::RmsNormBackward, x.device(), || {
            x.apply_op3_no_bwd(w, &dy, &Op(RmsNormBackwardX { eps: self.eps }))
        })?;
        let dw = timed(OpKind::RmsNormBackward, x.device(), || {
            x.apply_op2_no_bwd(&dy, &Op(RmsNormBackwardW { eps: self.eps }))
        })?;
        Ok([Some(dx), Some(dw)])
    }
}

/// `dx` from `(x, weight, dy)`, in `x`'s dtype.
struct RmsNormBackwardX {
    eps: f32,
}

impl Kernel<3> for RmsNormBackwardX {
    const NAME: &'static str = "chorus-rms-norm-backward-x";

    fn shape(&self, [x, _, _]: [&Shape; 3]) -> Result<Shape> {
        Ok(x.clone())
    }

    fn cpu(&self, [x, w, dy]: [CpuInput; 3]) -> Result<Vec<f32>> {
        Ok(backward_x(&x.f32()?, &w.f32()?, &dy.f32()?, self.eps))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(x, lx), (w, lw), (dy, ldy)]: [crate::op::CudaInput; 3]) -> Result<candle_core::CudaStorage> {
        crate::cuda::rms_norm_backward_x(x, lx, w, lw, dy, ldy, self.eps)
    }
}

/// `dw` from `(x, dy)`, `[d]` in `x`'s dtype (summed in f32).
struct RmsNormBackwardW {
    eps: f32,
}

impl Kernel<2> for RmsNormBackwardW {
    const NAME: &'static str = "chorus-rms-norm-backward-w";

    fn shape(&self, [x, _]: [&Shape; 2]) -> Result<Shape> {
        Ok(Shape::from(last_dim(x)))
    }

    fn cpu(&self, [x, dy]: [CpuInput; 2]) -> Result<Vec<f32>> {
        let d = last_dim(x.shape());
        Ok(backward_w(&x.f32()?, &dy.f32()?, d, self.eps))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(x, lx), (dy, ldy)]: [crate::op::CudaInput; 2]) -> Result<candle_core::CudaStorage> {
        crate::cuda::rms_norm_backward_w(x, lx, dy, ldy, self.eps)
    }
}

fn last_dim(shape: &Shape) -> usize {
    shape.dims().last().copied().unwrap_or(0)
}
