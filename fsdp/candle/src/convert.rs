//! Moving tensors between candle's CPU tensors and chorus device buffers.
//!
//! The devices the adapter runs on hold host memory (the sim backend's `cpu`
//! device), so a move is a host copy. Where a buffer is host memory
//! ([`host_memory`]: the `cpu` device's buffers), the adapter reads and
//! writes it directly once the stream that orders it has been synchronized:
//! a parameter is one copy into a candle variable ([`var_from_host`]), a
//! gradient is added straight from candle's storage into FSDP's buffer
//! ([`add_into_host`]). On other devices it goes through the public
//! [`Stream`] API: [`Stream::copy_to_host`] (a readback the host waits on,
//! ordered after everything earlier on the stream) and
//! [`Stream::copy_from_host`] (enqueued).

use std::any::Any;

use candle_core::{CpuStorage, Device as CandleDevice, Storage, Tensor, Var};
use chorus_devices::cpu::{Cpu, CpuBuffer, RawRange};
use chorus_devices::{bf16, f16, Backend, DType, Element, Readback, Stream, View};

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

/// The chorus dtype of a candle float dtype.
pub fn chorus_dtype(d: candle_core::DType) -> Result<DType> {
    match d {
        candle_core::DType::F32 => Ok(DType::F32),
        candle_core::DType::BF16 => Ok(DType::BF16),
        candle_core::DType::F16 => Ok(DType::F16),
        candle_core::DType::F64 => Ok(DType::F64),
        d => Err(Error::InvalidArgument(format!("{d:?} has no chorus counterpart the adapter uses"))),
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

/// Waits for `readback` and makes a candle variable of `shape` from its bytes.
pub fn var_from_readback(readback: Readback, shape: &[usize]) -> Result<Var> {
    let dev = &CandleDevice::Cpu;
    let dtype = readback.dtype();
    let r = readback;
    Ok(match dtype {
        DType::F32 => Var::from_vec(r.wait_typed::<f32>().map_err(chorus_fsdp::FsdpError::from)?, shape, dev)?,
        DType::BF16 => Var::from_vec(r.wait_typed::<bf16>().map_err(chorus_fsdp::FsdpError::from)?, shape, dev)?,
        DType::F16 => Var::from_vec(r.wait_typed::<f16>().map_err(chorus_fsdp::FsdpError::from)?, shape, dev)?,
        DType::F64 => Var::from_vec(r.wait_typed::<f64>().map_err(chorus_fsdp::FsdpError::from)?, shape, dev)?,
        d => return Err(Error::InvalidArgument(format!("{d} has no candle counterpart the adapter uses"))),
    })
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

/// The host memory behind `view` when its device's buffers are host memory
/// (the `cpu` device of the sim, simnccl and ucx backends); `None` on other
/// devices. The caller may touch the bytes only in stream order: after
/// synchronizing every stream that wrote them, and before enqueueing any
/// later access.
pub fn host_memory<B: Backend>(view: View<'_, B>) -> Option<RawRange> {
    let buffer = (view.buffer() as &dyn Any).downcast_ref::<CpuBuffer>()?;
    let cpu_view = View::<Cpu>::whole(buffer).slice(view.offset(), view.len()).ok()?;
    Some(chorus_devices::cpu::raw(cpu_view))
}

/// A candle variable of `shape` with a copy of the elements of `src`, the
/// one copy of a parameter from FSDP's unsharded buffer into candle.
///
/// # Safety
/// No operation may write `src` while this runs (the stream that wrote it
/// has been synchronized and nothing later is enqueued yet).
pub unsafe fn var_from_host(src: &RawRange, shape: &[usize]) -> Result<Var> {
    let dev = &CandleDevice::Cpu;
    // SAFETY (each arm): the caller's contract; the dtype is the range's.
    Ok(match src.dtype() {
        DType::F32 => Var::from_slice(unsafe { src.as_slice::<f32>() }, shape, dev)?,
        DType::BF16 => Var::from_slice(unsafe { src.as_slice::<bf16>() }, shape, dev)?,
        DType::F16 => Var::from_slice(unsafe { src.as_slice::<f16>() }, shape, dev)?,
        DType::F64 => Var::from_slice(unsafe { src.as_slice::<f64>() }, shape, dev)?,
        d => return Err(Error::InvalidArgument(format!("{d} has no candle counterpart the adapter uses"))),
    })
}

/// Adds the elements of `src` (a candle CPU tensor of `dst`'s dtype and
/// length) into `dst` in place, straight from candle's storage: each sum is
/// computed exactly and rounded once to the dtype, as the devices'
/// `accumulate` does.
///
/// # Safety
/// No other access to `dst` may happen while this runs (the stream that
/// last touched it has been synchronized and nothing later is enqueued yet).
pub unsafe fn add_into_host(src: &Tensor, dst: &RawRange) -> Result<()> {
    let expected = candle_dtype(dst.dtype())?;
    if src.dtype() != expected || src.elem_count() != dst.elements() {
        return Err(Error::InvalidArgument(format!(
            "cannot add a {:?} tensor of {} elements into {} elements of {}",
            src.dtype(),
            src.elem_count(),
            dst.elements(),
            dst.dtype()
        )));
    }
    let src = src.contiguous()?;
    let (storage, layout) = src.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::InvalidArgument("a contiguous tensor without contiguous offsets".into()));
    };
    fn add<T: Element>(src: &[T], dst: &RawRange) {
        // SAFETY: the caller's contract; the dtype was checked above.
        let dst = unsafe { dst.as_mut_slice::<T>() };
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f64(d.to_f64() + s.to_f64());
        }
    }
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => {
            // f32 sums are exact in f64 and rounded once: the same as adding in f32.
            // SAFETY: the caller's contract; the dtype was checked above.
            let dst = unsafe { dst.as_mut_slice::<f32>() };
            dst.iter_mut().zip(&v[start..end]).for_each(|(d, s)| *d += *s);
        }
        Storage::Cpu(CpuStorage::BF16(v)) => add(&v[start..end], dst),
        Storage::Cpu(CpuStorage::F16(v)) => add(&v[start..end], dst),
        Storage::Cpu(CpuStorage::F64(v)) => add(&v[start..end], dst),
        _ => return Err(Error::InvalidArgument("the adapter adds float CPU tensors only".into())),
    }
    Ok(())
}

/// A copy of a tensor's elements as a CPU storage (a stage's output whose
/// storage cannot be taken).
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
