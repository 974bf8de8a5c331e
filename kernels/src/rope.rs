//! Rotary position embedding (rotate-half, as transformers' Llama) on
//! `[batch, seq, heads, head_dim]`, forward and backward, and the cosine and
//! sine tables it reads, computed once per device and reused. The CUDA kernel
//! is `cuda/rope.cuh`.
//!
//! For `j < d/2`, with `c = cos[t, j]`, `s = sin[t, j]`:
//! `y[j] = x[j]·c − x[j + d/2]·s`, `y[j + d/2] = x[j + d/2]·c + x[j]·s`.
//! The backward is the same rotation by `−θ` (the transpose of a rotation).

use std::sync::{Arc, Mutex};

use candle_core::{bail, DType, Device, Result, Shape, Tensor};

use crate::host::{check_float, dims};
use crate::op::{CpuInput, Kernel, Op};
use crate::timing::{timed, OpKind};

/// The rotation of `x` (`[batch, seq, heads, head_dim]`) by the angles of
/// `cos`/`sin` (`[seq, head_dim / 2]`, f32, on `x`'s device: one row per
/// position of `x`). Differentiable in `x`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    const OP: &str = "rope";
    check_float(OP, "x", x.dtype())?;
    let [_, t, _, d] = dims::<4>(OP, "x", x.shape())?;
    if d == 0 || d % 2 != 0 {
        bail!("{OP}: head_dim {d} must be even and positive")
    }
    for (name, table) in [("cos", cos), ("sin", sin)] {
        if table.dims() != [t, d / 2] || table.dtype() != DType::F32 {
            bail!("{OP}: {name} is {:?} {:?}; expected f32 [{t}, {}]", table.dtype(), table.shape(), d / 2)
        }
    }
    let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    timed(OpKind::Rope, x.device(), || x.apply_op3(&cos, &sin, Op(Rope { inverse: false })))
}

/// The rotation on host values: `x` `[rows, t, heads, d]` flattened (rows =
/// batch), tables `[t, d/2]`; `inverse` rotates by `−θ`.
pub fn forward(x: &[f32], cos: &[f32], sin: &[f32], t: usize, heads: usize, d: usize, inverse: bool) -> Vec<f32> {
    let half = d / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut y = vec![0f32; x.len()];
    for (i, (xr, yr)) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).enumerate() {
        let pos = (i / heads) % t;
        for j in 0..half {
            let (c, s) = (cos[pos * half + j], sign * sin[pos * half + j]);
            let (x1, x2) = (xr[j], xr[j + half]);
            yr[j] = x1 * c - x2 * s;
            yr[j + half] = x2 * c + x1 * s;
        }
    }
    y
}

/// The op on `(x, cos, sin)`.
struct Rope {
    inverse: bool,
}

impl Kernel<3> for Rope {
    const NAME: &'static str = "chorus-rope";

    fn shape(&self, [x, _, _]: [&Shape; 3]) -> Result<Shape> {
        Ok(x.clone())
    }

    fn cpu(&self, [x, cos, sin]: [CpuInput; 3]) -> Result<Vec<f32>> {
        let [_, t, h, d] = dims::<4>(Self::NAME, "x", x.shape())?;
        Ok(forward(&x.f32()?, &cos.f32()?, &sin.f32()?, t, h, d, self.inverse))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(x, lx), (c, lc), (s, ls)]: [crate::op::CudaInput; 3]) -> Result<candle_core::CudaStorage> {
        crate::cuda::rope(x, lx, c, lc, s, ls, self.inverse)
    }

    fn bwd(&self, [_x, cos, sin]: [&Tensor; 3], _y: &Tensor, dy: &Tensor) -> Result<[Option<Tensor>; 3]> {
        let dy = dy.contiguous()?;
        let dx = timed(OpKind::RopeBackward, dy.device(), || {
            dy.apply_op3_no_bwd(cos, sin, &Op(Rope { inverse: !self.inverse }))
        })?;
        Ok([Some(dx), None, None])
    }
}

/// RoPE's tables for one head size and base, made once per device and
/// grown on demand: `cos`/`sin` `[positions, head_dim / 2]` in f32, as
/// transformers' `LlamaRotaryEmbedding` computes them
/// (`inv_freq[j] = 1 / theta^(2j / head_dim)` and `angle = position · inv_freq[j]`
/// in f32; the cosine of that f32 angle).
#[derive(Debug)]
pub struct RopeCache {
    head_dim: usize,
    theta: f32,
    tables: Mutex<Vec<(Device, Tensor, Tensor)>>,
}

impl RopeCache {
    /// The cache for `head_dim` (even) and base `theta` (positive).
    pub fn new(head_dim: usize, theta: f64) -> Result<Arc<RopeCache>> {
        if head_dim == 0 || head_dim % 2 != 0 {
            bail!("rope: head_dim {head_dim} must be even and positive")
        }
        // The tables are computed in f32, as transformers computes them: the base must be an f32.
        if !(theta > 0.0 && (theta as f32).is_finite()) {
            bail!("rope: theta {theta} must be positive and finite in f32")
        }
        Ok(Arc::new(RopeCache { head_dim, theta: theta as f32, tables: Mutex::new(Vec::new()) }))
    }

    /// The tables' rows for positions `start..start + len` on `device` (views
    /// of the cached tables; made or grown here only when they are missing).
    pub fn tables(&self, device: &Device, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let end = start.checked_add(len).ok_or_else(|| candle_core::Error::msg("rope: positions overflow"))?;
        let mut cached = self.tables.lock().map_err(|_| candle_core::Error::msg("rope: the cache is poisoned"))?;
        let slot = cached.iter().position(|(d, _, _)| d.same_device(device));
        let have = slot.map_or(0, |i| cached[i].1.dim(0).unwrap_or(0));
        let i = match slot {
            Some(i) if have >= end => i,
            _ => {
                // Double, so a growing decode makes few tables.
                let (cos, sin) = self.make(end.max(2 * have), device)?;
                match slot {
                    Some(i) => {
                        cached[i] = (device.clone(), cos, sin);
                        i
                    }
                    None => {
                        cached.push((device.clone(), cos, sin));
                        cached.len() - 1
                    }
                }
            }
        };
        let (_, cos, sin) = &cached[i];
        Ok((cos.narrow(0, start, len)?, sin.narrow(0, start, len)?))
    }

    fn make(&self, positions: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.head_dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|j| 1.0f32 / self.theta.powf((2 * j) as f32 / self.head_dim as f32)).collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv {
                let angle = p as f32 * f;
                cos.push((angle as f64).cos() as f32);
                sin.push((angle as f64).sin() as f32);
            }
        }
        Ok((Tensor::from_vec(cos, (positions, half), device)?, Tensor::from_vec(sin, (positions, half), device)?))
    }
}
