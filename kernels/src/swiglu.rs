//! SwiGLU's gate, `silu(gate) · up` (the Llama MLP's middle), forward and
//! backward in one pass each. The CUDA kernels are `cuda/swiglu.cuh`.
//!
//! With `σ = sigmoid(g)`: `y = g·σ·u`, `dg = dy·u·σ·(1 + g·(1 − σ))`,
//! `du = dy·g·σ`.

use candle_core::{bail, Result, Shape, Tensor};

use crate::host::check_float;
use crate::op::{CpuInput, Kernel, Op};
use crate::timing::{timed, OpKind};

/// `silu(gate) · up`, elementwise; both of one shape and float dtype.
/// Differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu";
    check_float(OP, "gate", gate.dtype())?;
    if gate.shape() != up.shape() || gate.dtype() != up.dtype() {
        bail!("{OP}: gate {:?} {:?} and up {:?} {:?} differ", gate.dtype(), gate.shape(), up.dtype(), up.shape())
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    timed(OpKind::Swiglu, gate.device(), || gate.apply_op2(&up, Op(Swiglu)))
}

/// The forward on host values.
pub fn forward(g: &[f32], u: &[f32]) -> Vec<f32> {
    g.iter().zip(u).map(|(g, u)| g * sigmoid(*g) * u).collect()
}

/// `(dg, du)` on host values.
pub fn backward(g: &[f32], u: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = Vec::with_capacity(g.len());
    let mut du = Vec::with_capacity(g.len());
    for ((g, u), dy) in g.iter().zip(u).zip(dy) {
        let s = sigmoid(*g);
        dg.push(dy * u * s * (1.0 + g * (1.0 - s)));
        du.push(dy * g * s);
    }
    (dg, du)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The forward op on `(gate, up)`.
struct Swiglu;

impl Kernel<2> for Swiglu {
    const NAME: &'static str = "chorus-swiglu";

    fn shape(&self, [g, _]: [&Shape; 2]) -> Result<Shape> {
        Ok(g.clone())
    }

    fn cpu(&self, [g, u]: [CpuInput; 2]) -> Result<Vec<f32>> {
        Ok(forward(&g.f32()?, &u.f32()?))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(g, lg), (u, lu)]: [crate::op::CudaInput; 2]) -> Result<candle_core::CudaStorage> {
        crate::cuda::swiglu_forward(g, lg, u, lu)
    }

    fn bwd(&self, [g, u]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let dy = dy.contiguous()?;
        // One pass writes both gradients, stacked: `[2, ...]`, then two views.
        let both = timed(OpKind::SwigluBackward, g.device(), || g.apply_op3_no_bwd(u, &dy, &Op(SwigluBackward)))?;
        let (dg, du) = (both.get(0)?, both.get(1)?);
        Ok([Some(dg), Some(du)])
    }
}

/// `[dg, du]` stacked, from `(gate, up, dy)`.
struct SwigluBackward;

impl Kernel<3> for SwigluBackward {
    const NAME: &'static str = "chorus-swiglu-backward";

    fn shape(&self, [g, _, _]: [&Shape; 3]) -> Result<Shape> {
        let mut dims = vec![2];
        dims.extend_from_slice(g.dims());
        Ok(Shape::from(dims))
    }

    fn cpu(&self, [g, u, dy]: [CpuInput; 3]) -> Result<Vec<f32>> {
        let (mut dg, du) = backward(&g.f32()?, &u.f32()?, &dy.f32()?);
        dg.extend(du);
        Ok(dg)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(g, lg), (u, lu), (dy, ldy)]: [crate::op::CudaInput; 3]) -> Result<candle_core::CudaStorage> {
        crate::cuda::swiglu_backward(g, lg, u, lu, dy, ldy)
    }
}
