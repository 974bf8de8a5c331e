//! The CPU side's plumbing shared by the ops: a candle CPU storage (or a
//! tensor an op saved) read as f32 values, values written back in a float
//! dtype (one rounding), and the argument checks every op makes before it
//! reaches a kernel.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

/// The float dtypes the ops take: f32 and the two 16-bit formats (computed in
/// f32, rounded once on output, as the CUDA kernels do).
pub(crate) fn check_float(op: &str, what: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => bail!("{op}: {what} is {other:?}; the op takes f32, bf16 or f16"),
    }
}

/// The elements of a contiguous `storage` under `layout`, widened to f32.
pub(crate) fn f32_values(op: &str, storage: &CpuStorage, layout: &Layout) -> Result<Vec<f32>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: an input is not contiguous (the op makes its inputs contiguous first)")
    };
    Ok(match storage {
        CpuStorage::F32(v) => v[start..end].to_vec(),
        CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        other => bail!("{op}: an input is {:?}; the op takes f32, bf16 or f16", other.dtype()),
    })
}

/// The elements of `t`, a tensor an op saved for its backward, widened to
/// f32; `what` names it when it is not on the CPU.
pub(crate) fn saved_f32(op: &str, what: &str, t: &Tensor) -> Result<Vec<f32>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(c) = &*storage else { bail!("{op}: {what} is not on the CPU") };
    f32_values(op, c, layout)
}

/// The elements of a contiguous u32 `storage` (token ids).
pub(crate) fn u32_values(op: &str, storage: &CpuStorage, layout: &Layout) -> Result<Vec<u32>> {
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("{op}: the targets are not contiguous") };
    match storage {
        CpuStorage::U32(v) => Ok(v[start..end].to_vec()),
        other => bail!("{op}: the targets are {:?}; they must be u32 token ids", other.dtype()),
    }
}

/// `values` as a storage of `dtype`, each rounded once (to nearest even).
pub(crate) fn storage_from_f32(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::BF16 => CpuStorage::BF16(values.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(values.into_iter().map(f16::from_f32).collect()),
        other => bail!("no f32 conversion to {other:?}"),
    })
}

/// `v` rounded to `dtype` and widened back: what a kernel that stores an
/// intermediate in `dtype` computes with afterwards.
pub(crate) fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// The dims of `shape`, checked to number `n`.
pub(crate) fn dims<const N: usize>(op: &str, what: &str, shape: &Shape) -> Result<[usize; N]> {
    match <[usize; N]>::try_from(shape.dims()) {
        Ok(d) => Ok(d),
        Err(_) => bail!("{op}: {what} has shape {shape:?}; expected {N} dims"),
    }
}
