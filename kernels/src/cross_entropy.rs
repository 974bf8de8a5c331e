//! Cross-entropy of the head's logits against the next tokens, per row,
//! forward and backward, never holding a probability tensor: the forward
//! keeps one log-sum-exp per row (f32), the backward writes the logits'
//! gradient straight in their own dtype. The CUDA kernels are
//! `cuda/cross_entropy.cuh`.
//!
//! Per row with target `t`: `lse = log Σ_j exp(x_j)` (in f32),
//! `loss = lse − x_t`; given the loss's gradient `g`:
//! `dx_j = g · (exp(x_j − lse) − [j = t])`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};

use crate::host::{check_float, dims, f32_values, saved_f32, storage_from_f32, u32_values};
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
    timed(OpKind::CrossEntropy, logits.device(), || logits.apply_op2(&targets, CrossEntropy { lse: SavedLse::new(OP) }))
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

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "chorus-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let [rows, vocab] = dims::<2>(self.name(), "logits", l1.shape())?;
        let (x, t) = (f32_values(self.name(), s1, l1)?, u32_values(self.name(), s2, l2)?);
        let (loss, lse) = forward(&x, &t, vocab).map_err(|e| candle_core::Error::msg(format!("cross_entropy: {e}")))?;
        self.lse.keep(Storage::Cpu(CpuStorage::F32(lse)), rows)?;
        Ok((CpuStorage::F32(loss), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let [rows, _] = dims::<2>(self.name(), "logits", l1.shape())?;
        let (loss, lse) = crate::cuda::cross_entropy_forward(s1, l1, s2, l2)?;
        self.lse.keep(Storage::Cuda(lse), rows)?;
        Ok((loss, Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.get()?;
        let g = g.to_dtype(DType::F32)?.contiguous()?;
        let dx = timed(OpKind::CrossEntropyBackward, logits.device(), || {
            logits.apply_op3_no_bwd(targets, &g, &CrossEntropyBackward { lse })
        })?;
        Ok((Some(dx), None))
    }
}

/// The logits' gradient from `(logits, targets, g)`, in the logits' dtype.
struct CrossEntropyBackward {
    lse: Tensor,
}

impl CustomOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "chorus-cross-entropy-backward"
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
        let [_, vocab] = dims::<2>(op, "logits", l1.shape())?;
        let (x, t, g) = (f32_values(op, s1, l1)?, u32_values(op, s2, l2)?, f32_values(op, s3, l3)?);
        let lse = saved_f32(op, "the saved log-sum-exp", &self.lse)?;
        Ok((storage_from_f32(backward(&x, &t, &lse, &g, vocab), s1.dtype())?, l1.shape().clone()))
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
        Ok((crate::cuda::cross_entropy_backward(s1, l1, s2, l2, s3, l3, &self.lse)?, l1.shape().clone()))
    }
}
