//! Moving tensors between candle's CPU tensors and chorus device buffers.
//!
//! The devices the adapter runs on hold host memory (the sim backend's `cpu`
//! device), so a move is a host copy, done through the public [`Stream`]
//! API: [`Stream::copy_to_host`] (a readback the host waits on, ordered after
//! everything earlier on the stream) and [`Stream::copy_from_host`] (enqueued).

use candle_core::{CpuStorage, Device as CandleDevice, Layout, Tensor};
use chorus_devices::{DType, Readback, Stream, View};

use crate::{Error, Result};

/// The candle dtype of a chorus float dtype (the ones FSDP computes in).
pub fn candle_dtype(d: DType) -> Result<candle_core::DType> {
    match d {
        DType::F32 => Ok(candle_core::DType::F32),
        DType::BF16 => Ok(candle_core::DType::BF16),
        DType::F16 => Ok(candle_core::DType::F16),
        DType::F64 => Ok(candle_core::DType::F64),
        d => Err(Error::InvalidArgument(format!("{d} has no candle counterpart the adapter uses"))),
    }
}

/// A tensor's elements in row-major order as little-endian bytes.
pub fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let flat = t.flatten_all()?;
    Ok(match flat.dtype() {
        candle_core::DType::F32 => bytes_of(&flat.to_vec1::<f32>()?),
        candle_core::DType::BF16 => bytes_of(&flat.to_vec1::<half::bf16>()?),
        candle_core::DType::F16 => bytes_of(&flat.to_vec1::<half::f16>()?),
        candle_core::DType::F64 => bytes_of(&flat.to_vec1::<f64>()?),
        d => return Err(Error::InvalidArgument(format!("tensor of {d:?}: the adapter moves float tensors only"))),
    })
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// Enqueues a device→host copy of `src` on `stream`; [`tensor_from_readback`] waits for it.
pub fn start_readback<S: Stream>(stream: &S, src: View<'_, S::B>) -> Result<Readback> {
    Ok(stream.copy_to_host(src).map_err(chorus_fsdp::FsdpError::from)?)
}

/// Waits for `readback` and makes a tensor of `shape` from its bytes.
pub fn tensor_from_readback(readback: Readback, shape: &[usize]) -> Result<Tensor> {
    let dtype = candle_dtype(readback.dtype())?;
    let bytes = readback.wait().map_err(chorus_fsdp::FsdpError::from)?;
    Ok(Tensor::from_raw_buffer(&bytes, dtype, shape, &CandleDevice::Cpu)?)
}

/// Enqueues a host→device copy of `t` (whose dtype must be `dst`'s) into `dst`.
pub fn upload_tensor<S: Stream>(stream: &S, t: &Tensor, dst: View<'_, S::B>) -> Result<()> {
    let expected = candle_dtype(dst.dtype())?;
    if t.dtype() != expected || t.elem_count() != dst.len() {
        return Err(Error::InvalidArgument(format!(
            "cannot upload a {:?} tensor of {} elements into {} elements of {}",
            t.dtype(),
            t.elem_count(),
            dst.len(),
            dst.dtype()
        )));
    }
    stream.copy_from_host(&tensor_bytes(t)?, dst).map_err(chorus_fsdp::FsdpError::from)?;
    Ok(())
}

/// A tensor with the elements of a contiguous CPU storage (what a custom
/// op's forward receives).
pub fn tensor_from_storage(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Tensor> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("the adapter's custom op takes contiguous inputs")
    };
    let shape = layout.shape().clone();
    let dev = &CandleDevice::Cpu;
    match storage {
        CpuStorage::U8(v) => Tensor::from_slice(&v[start..end], shape, dev),
        CpuStorage::U32(v) => Tensor::from_slice(&v[start..end], shape, dev),
        CpuStorage::I64(v) => Tensor::from_slice(&v[start..end], shape, dev),
        CpuStorage::BF16(v) => Tensor::from_slice(&v[start..end], shape, dev),
        CpuStorage::F16(v) => Tensor::from_slice(&v[start..end], shape, dev),
        CpuStorage::F32(v) => Tensor::from_slice(&v[start..end], shape, dev),
        CpuStorage::F64(v) => Tensor::from_slice(&v[start..end], shape, dev),
        _ => candle_core::bail!("the adapter's custom op takes u8, u32, i64 or float inputs"),
    }
}

/// A tensor's elements as a CPU storage (what a custom op's forward returns).
pub fn storage_of(t: &Tensor) -> candle_core::Result<CpuStorage> {
    let flat = t.flatten_all()?;
    Ok(match flat.dtype() {
        candle_core::DType::U8 => CpuStorage::U8(flat.to_vec1()?),
        candle_core::DType::U32 => CpuStorage::U32(flat.to_vec1()?),
        candle_core::DType::I64 => CpuStorage::I64(flat.to_vec1()?),
        candle_core::DType::BF16 => CpuStorage::BF16(flat.to_vec1()?),
        candle_core::DType::F16 => CpuStorage::F16(flat.to_vec1()?),
        candle_core::DType::F32 => CpuStorage::F32(flat.to_vec1()?),
        candle_core::DType::F64 => CpuStorage::F64(flat.to_vec1()?),
        d => candle_core::bail!("the adapter's custom op does not return {d:?} outputs"),
    })
}

/// A tensor's values as f32 (any float dtype).
pub fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}
