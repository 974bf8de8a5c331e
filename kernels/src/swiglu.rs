//! SwiGLU's gate, `silu(gate) · up` (the Llama MLP's middle), forward and
//! backward in one pass each. The CUDA kernels are `cuda/swiglu.cuh`.
//!
//! With `σ = sigmoid(g)`: `y = g·σ·u`, `dg = dy·u·σ·(1 + g·(1 − σ))`,
//! `du = dy·g·σ`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use crate::host::{check_float, f32_values, storage_from_f32};
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
    timed(OpKind::Swiglu, gate.device(), || gate.apply_op2(&up, Swiglu))
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

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "chorus-swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (f32_values(self.name(), s1, l1)?, f32_values(self.name(), s2, l2)?);
        Ok((storage_from_f32(forward(&g, &u), s1.dtype())?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::swiglu_forward(s1, l1, s2, l2)?, l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        // One pass writes both gradients, stacked: `[2, ...]`, then two views.
        let both = timed(OpKind::SwigluBackward, g.device(), || g.apply_op3_no_bwd(u, &dy, &SwigluBackward))?;
        let (dg, du) = (both.get(0)?, both.get(1)?);
        Ok((Some(dg), Some(du)))
    }
}

/// `[dg, du]` stacked, from `(gate, up, dy)`.
struct SwigluBackward;

impl CustomOp3 for SwigluBackward {
    fn name(&self) -> &'static str {
        "chorus-swiglu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (g, u, dy) = (f32_values(op, s1, l1)?, f32_values(op, s2, l2)?, f32_values(op, s3, l3)?);
        let (mut dg, du) = backward(&g, &u, &dy);
        dg.extend(du);
        Ok((storage_from_f32(dg, s1.dtype())?, stacked(l1.shape())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::swiglu_backward(s1, l1, s2, l2, s3, l3)?, stacked(l1.shape())))
    }
}

fn stacked(shape: &Shape) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(shape.dims());
    Shape::from(dims)
}
