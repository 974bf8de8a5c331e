//! Cross-entropy of the head's logits against the next tokens, per row,
//! forward and backward, never holding a probability tensor: the forward
//! keeps one log-sum-exp per row (f32), the backward writes the logits'
//! gradient straight in their own dtype. The CUDA kernels are
//! `cuda/cross_entropy.cuh`.
//!
//! Per row with target `t`: `lse = log Σ_j exp(x_j)` (in f32),
//! `loss = lse − x_t`; given the loss's gradient `g`:
//! `dx_j = g · (exp(x_j − lse) − [j = t])`.

use candle_core::{bail, CpuStorage, DType, Result, Shape, Storage, Tensor};

use crate::host::{check_float, dims, saved_f32};
use crate::op::{CpuInput, Kernel, Op};
use crate::saved::SavedLse;
use crate::timing::{timed, OpKind};

/// The loss of each row of `logits` (`[rows, vocab]`, f32/bf16/f16) against
/// `targets` (`[rows]`, u32, each below `vocab`), as f32 `[rows]`; reduce it
/// as the loss needs (`mean_all` for transformers' mean). Differentiable in
/// `logits`. A target outside the vocabulary is an error on the CPU; the
/// CUDA kernel cannot report one without a host wait, so its row's loss
/// and gradient are NaN (the training loop stops on a non-finite loss).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    check_float(OP, "logits", logits.dtype())?;
    let [rows, vocab] = dims::<2>(OP, "logits", logits.shape())?;
    if targets.dims() != [rows] || targets.dtype() != DType::U32 {
        bail!(
            "{OP}: targets {:?} {:?} for logits {:?}; expected u32 [{rows}]",
            targets.dtype(),
            targets.shape(),
            logits.shape()
        )
    }
    if vocab == 0 || vocab > i32::MAX as usize {
        bail!("{OP}: a vocabulary of {vocab}")
    }
    let (logits, targets) = (logits.contiguous()?, targets.contiguous()?);
    timed(OpKind::CrossEntropy, logits.device(), || {
        logits.apply_op2(&targets, Op(CrossEntropy { lse: SavedLse::new(OP) }))
    })
}

/// `(loss, lse)` per row on host values; an error names a target outside the vocabulary.
pub fn forward(logits: &[f32], targets: &[u32], vocab: usize) -> std::result::Result<(Vec<f32>, Vec<f32>), String> {
    let mut loss = Vec::with_capacity(targets.len());
    let mut lse = Vec::with_capacity(targets.len());
    for (row, &t) in logits.chunks_exact(vocab).zip(targets) {
        if t as usize >= vocab {
            return Err(format!("target {t} is outside the vocabulary of {vocab}"));
        }
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        let l = m + row.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
        lse.push(l);
        loss.push(l - row[t as usize]);
    }
    Ok((loss, lse))
}

/// The logits' gradient on host values, given each row's loss gradient `g`.
pub fn backward(logits: &[f32], targets: &[u32], lse: &[f32], g: &[f32], vocab: usize) -> Vec<f32> {
    let mut dx = Vec::with_capacity(logits.len());
    for (((row, &t), l), g) in logits.chunks_exact(vocab).zip(targets).zip(lse).zip(g) {
        dx.extend(row.iter().enumerate().map(|(j, x)| g * ((x - l).exp() - if j == t as usize { 1.0 } else { 0.0 })));
    }
    dx
}

/// The forward op on `(logits, targets)`; keeps each row's log-sum-exp.
struct CrossEntropy {
    lse: SavedLse,
}

impl Kernel<2> for CrossEntropy {
    const NAME: &'static str = "chorus-cross-entropy";

    fn shape(&self, [logits, _]: [&Shape; 2]) -> Result<Shape> {
        let [rows, _] = dims::<2>(Self::NAME, "logits", logits)?;
        Ok(Shape::from(rows))
    }

    /// The loss is f32 whatever the logits' dtype.
    fn dtype(&self, _logits: DType) -> DType {
        DType::F32
    }

    fn cpu(&self, [x, t]: [CpuInput; 2]) -> Result<Vec<f32>> {
        let [rows, vocab] = dims::<2>(Self::NAME, "logits", x.shape())?;
        let (x, t) = (x.f32()?, t.u32()?);
        let (loss, lse) = forward(&x, &t, vocab).map_err(|e| candle_core::Error::msg(format!("cross_entropy: {e}")))?;
        self.lse.keep(Storage::Cpu(CpuStorage::F32(lse)), rows)?;
        Ok(loss)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(x, lx), (t, lt)]: [crate::op::CudaInput; 2]) -> Result<candle_core::CudaStorage> {
        let [rows, _] = dims::<2>(Self::NAME, "logits", lx.shape())?;
        let (loss, lse) = crate::cuda::cross_entropy_forward(x, lx, t, lt)?;
        self.lse.keep(Storage::Cuda(lse), rows)?;
        Ok(loss)
    }

    fn bwd(&self, [logits, targets]: [&Tensor; 2], _loss: &Tensor, g: &Tensor) -> Result<[Option<Tensor>; 2]> {
        let lse = self.lse.get()?;
        let g = g.to_dtype(DType::F32)?.contiguous()?;
        let dx = timed(OpKind::CrossEntropyBackward, logits.device(), || {
            logits.apply_op3_no_bwd(targets, &g, &Op(CrossEntropyBackward { lse }))
        })?;
        Ok([Some(dx), None])
    }
}

/// The logits' gradient from `(logits, targets, g)`, in the logits' dtype.
struct CrossEntropyBackward {
    lse: Tensor,
}

impl Kernel<3> for CrossEntropyBackward {
    const NAME: &'static str = "chorus-cross-entropy-backward";

    fn shape(&self, [logits, _, _]: [&Shape; 3]) -> Result<Shape> {
        Ok(logits.clone())
    }

    fn cpu(&self, [x, t, g]: [CpuInput; 3]) -> Result<Vec<f32>> {
        let [_, vocab] = dims::<2>(Self::NAME, "logits", x.shape())?;
        let (x, t, g) = (x.f32()?, t.u32()?, g.f32()?);
        let lse = saved_f32(Self::NAME, "the saved log-sum-exp", &self.lse)?;
        Ok(backward(&x, &t, &lse, &g, vocab))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, [(x, lx), (t, lt), (g, lg)]: [crate::op::CudaInput; 3]) -> Result<candle_core::CudaStorage> {
        crate::cuda::cross_entropy_backward(x, lx, t, lt, g, lg, &self.lse)
    }
}
