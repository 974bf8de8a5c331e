//! The adapter on the `cuda` device (feature `candle-cuda`): stages compute
//! on candle's CUDA device, on the same GPU as FSDP's buffers.
//!
//! candle 0.11's `CudaDevice` computes on a stream of its own (it cannot be
//! built on an existing one), so candle's stream and FSDP's compute stream
//! are ordered by events, both ways, at the two places they meet (the rule
//! of `docs/fsdp.md`, "the adapter on the cuda device"):
//! - **parameters**, once per group and phase: candle's stream waits for an
//!   event recorded on the compute stream after FSDP's pre-forward or
//!   pre-backward (the all-gathered parameters are written), copies each
//!   unsharded parameter device to device into a candle variable of its own,
//!   and the compute stream then waits for an event recorded on candle's
//!   stream after the copies, declared as reading the parameters (so FSDP's
//!   reshard, which frees or overwrites them, comes after the copies);
//! - **gradients**, once per stage's backward: the compute stream allocates
//!   one staging buffer per gradient, candle's stream waits for it, copies
//!   each candle gradient into its buffer (after candle's backward, in
//!   stream order), and the compute stream waits for candle's stream,
//!   declared as writing the buffers, then accumulates them into FSDP's
//!   unsharded gradients (which reduce-scatter reads).
//!
//! No byte goes through the host. candle's own tensors (the stage's input
//! and output, its intermediates) live on candle's stream only.

use std::any::Any;
use std::panic::AssertUnwindSafe;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdeviceptr, CUevent_flags, CUevent_wait_flags, CUstream};
use candle_core::cuda_backend::cudarc::driver::{self, DevicePtr, DevicePtrMut, DriverError};
use candle_core::cuda_backend::{CudaDevice as CandleCuda, CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{Device as CandleDevice, Layout, Storage, Tensor, Var};
use chorus_devices::cuda::{device_ptr, Cuda, CudaBuffer, CudaDevice, CudaStream};
use chorus_devices::{AccessKind, Backend, Buffer, Device, DeviceError, ForeignBackend, Stream, View};
use chorus_fsdp::FsdpError;

use crate::convert::candle_dtype;
use crate::{Error, Result};

fn device_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Fsdp(FsdpError::from(DeviceError::Backend { library: "libcuda", code: -1, message: format!("{what}: {e}") }))
}

fn driver_error(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| device_error(what, e)
}

/// candle's CUDA device on the GPU of `device` when it is a chorus `cuda`
/// device; `None` for any other device. The libraries candle opens (the
/// driver, cuBLAS, cuRAND) are probed first, so a missing one is a typed
/// error, never cudarc's panic.
pub(crate) fn candle_device<B: Backend>(device: &B::Device) -> Result<Option<CandleDevice>> {
    let Some(device) = (device as &dyn Any).downcast_ref::<CudaDevice>() else { return Ok(None) };
    Ok(Some(cuda_device(device.config().ordinal)?))
}

/// candle's CUDA device on GPU `ordinal` (with a stream of its own), the
/// libraries it opens probed first: a missing one is a typed error, never
/// cudarc's panic. What plain candle runs on beside the adapter.
pub fn cuda_device(ordinal: usize) -> Result<CandleDevice> {
    for probe in [
        chorus_devices::cuda::driver_library,
        chorus_devices::cuda::cublas_library,
        chorus_devices::cuda::curand_library,
    ] {
        probe().map_err(FsdpError::from)?;
    }
    // The probes make cudarc's panic on a missing library unreachable; this is the second line of defence.
    let made = std::panic::catch_unwind(AssertUnwindSafe(|| CandleCuda::new_with_stream(ordinal)))
        .map_err(|_| device_error("candle's CUDA device", "cudarc panicked while loading a CUDA library"))?;
    Ok(CandleDevice::Cuda(made?))
}

fn chorus_stream<S: Stream>(stream: &S) -> Result<&CudaStream> {
    (stream as &dyn Any)
        .downcast_ref::<CudaStream>()
        .ok_or_else(|| Error::InvalidArgument("candle's CUDA device with a stream of another device".into()))
}

fn cuda_view<'a, B: Backend>(view: View<'a, B>) -> Result<View<'a, Cuda>> {
    let buffer = (view.buffer() as &dyn Any)
        .downcast_ref::<CudaBuffer>()
        .ok_or_else(|| Error::InvalidArgument("candle's CUDA device with a buffer of another device".into()))?;
    Ok(View::<Cuda>::whole(buffer).slice(view.offset(), view.len()).map_err(FsdpError::from)?)
}

fn cuda_of(dev: &CandleDevice) -> Result<&CandleCuda> {
    match dev {
        CandleDevice::Cuda(d) => Ok(d),
        _ => Err(Error::InvalidArgument("the adapter's candle device is not CUDA".into())),
    }
}

/// candle's stream waits (on the device) for everything enqueued on `compute` so far.
fn candle_waits_for(compute: &CudaStream, dev: &CandleCuda) -> Result<()> {
    let event = compute.device().create_event().map_err(FsdpError::from)?;
    compute.record(&event).map_err(FsdpError::from)?;
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().map_err(driver_error("binding candle's context"))?;
    // SAFETY: both handles are alive; a wait enqueued before the event's
    // destruction (when `event` drops) still waits for its record.
    unsafe {
        driver::result::stream::wait_event(stream.cu_stream(), event.raw(), CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
    }
    .map_err(driver_error("cuStreamWaitEvent (candle after chorus)"))
}

/// `compute` waits (on the device) for everything enqueued on candle's stream
/// so far, declaring `accesses`: the chorus buffers that work used, so that
/// chorus orders their reuse and free after it.
fn compute_waits_for(compute: &CudaStream, dev: &CandleCuda, accesses: &[(View<'_, Cuda>, AccessKind)]) -> Result<()> {
    let stream = dev.cuda_stream();
    let event = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(driver_error("recording an event on candle's stream"))?;
    let raw_event = event.cu_event();
    Cuda::enqueue_foreign(compute, "candle", accesses, &mut |raw| {
        // SAFETY: `raw` is the compute stream's handle, `raw_event` is alive until `event` drops below.
        unsafe {
            driver::result::stream::wait_event(raw as CUstream, raw_event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(|e| DeviceError::Backend {
            library: "libcuda",
            code: e.0 as i64,
            message: format!("cuStreamWaitEvent (chorus after candle): {e}"),
        })
    })
    .map_err(FsdpError::from)?;
    Ok(())
}

/// Copies `bytes` from `src` to `dst` on candle's stream.
fn copy_on(dev: &CandleCuda, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    // SAFETY: the caller gives two live ranges of `bytes` bytes on this GPU,
    // ordered with candle's stream by the events of this module.
    unsafe { driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
        .map_err(driver_error("cuMemcpyDtoDAsync on candle's stream"))
}

/// Runs `f` with the address of `storage`'s first element (used on candle's stream).
fn with_ptr<R>(storage: &CudaStorage, dev: &CandleCuda, f: impl FnOnce(CUdeviceptr) -> Result<R>) -> Result<R> {
    let stream = dev.cuda_stream();
    macro_rules! ptr {
        ($s:expr) => {{
            let (ptr, _record) = $s.device_ptr(&stream);
            f(ptr)
        }};
    }
    match &storage.slice {
        CudaStorageSlice::F32(s) => ptr!(s),
        CudaStorageSlice::BF16(s) => ptr!(s),
        CudaStorageSlice::F16(s) => ptr!(s),
        CudaStorageSlice::F64(s) => ptr!(s),
        _ => Err(Error::InvalidArgument("the adapter moves float tensors only".into())),
    }
}

/// Like [`with_ptr`], for a write.
fn with_ptr_mut<R>(storage: &mut CudaStorage, dev: &CandleCuda, f: impl FnOnce(CUdeviceptr) -> Result<R>) -> Result<R> {
    let stream = dev.cuda_stream();
    macro_rules! ptr {
        ($s:expr) => {{
            let (ptr, _record) = $s.device_ptr_mut(&stream);
            f(ptr)
        }};
    }
    match &mut storage.slice {
        CudaStorageSlice::F32(s) => ptr!(s),
        CudaStorageSlice::BF16(s) => ptr!(s),
        CudaStorageSlice::F16(s) => ptr!(s),
        CudaStorageSlice::F64(s) => ptr!(s),
        _ => Err(Error::InvalidArgument("the adapter moves float tensors only".into())),
    }
}

/// Group parameters as candle variables on candle's CUDA device: one
/// device-to-device copy each from FSDP's unsharded parameters, ordered by
/// the module's rule. `params` are the views and shapes in the group's order.
pub(crate) fn vars_from_device<B: Backend, S: Stream<B = B>>(
    compute: &S,
    dev: &CandleDevice,
    params: &[(View<'_, B>, Vec<usize>)],
) -> Result<Vec<Var>> {
    let (compute, dev) = (chorus_stream(compute)?, cuda_of(dev)?);
    let views = params.iter().map(|(v, _)| cuda_view(*v)).collect::<Result<Vec<_>>>()?;
    candle_waits_for(compute, dev)?;
    let mut vars = Vec::with_capacity(params.len());
    for (view, (_, shape)) in views.iter().zip(params) {
        if shape.iter().product::<usize>() != view.len() {
            return Err(Error::InvalidArgument(format!("a parameter of {} elements as shape {shape:?}", view.len())));
        }
        let shape = candle_core::Shape::from(shape.clone());
        // SAFETY: every element is written by the copy below before candle reads it (stream order).
        let mut storage = unsafe { dev.alloc_uninit(&shape, candle_dtype(view.dtype())?) }?;
        let bytes = view.len() * view.dtype().size();
        with_ptr_mut(&mut storage, dev, |dst| copy_on(dev, dst, device_ptr(view), bytes))?;
        // A variable from the start, so candle's `Var` wraps it without another copy.
        let t = Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), true);
        vars.push(Var::from_tensor(&t)?);
    }
    let reads: Vec<_> = views.iter().map(|v| (*v, AccessKind::Read)).collect();
    compute_waits_for(compute, dev, &reads)?;
    Ok(vars)
}

/// Adds candle gradients (`grads[i]` into `dsts[i]`, same length; converted
/// to the destination's dtype) into FSDP's unsharded gradients: one
/// device-to-device copy each into a staging buffer of the compute stream,
/// then `accumulate` there, ordered by the module's rule.
pub(crate) fn add_grads_on_device<B: Backend, S: Stream<B = B>>(
    compute: &S,
    dev: &CandleDevice,
    grads: &[(Tensor, View<'_, B>)],
) -> Result<()> {
    let (cstream, cdev) = (chorus_stream(compute)?, cuda_of(dev)?);
    let mut staged = Vec::with_capacity(grads.len());
    let mut sources = Vec::with_capacity(grads.len());
    for (grad, dst) in grads {
        let want = candle_dtype(dst.dtype())?;
        if grad.elem_count() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "cannot add a tensor of {} elements into {} elements",
                grad.elem_count(),
                dst.len()
            )));
        }
        if !matches!(grad.device(), CandleDevice::Cuda(d) if d.same_device(cdev)) {
            return Err(Error::InvalidArgument("a gradient on another device than the adapter's".into()));
        }
        sources.push(grad.to_dtype(want)?.contiguous()?);
        staged.push(cstream.alloc(dst.dtype(), dst.len()).map_err(FsdpError::from)?);
    }
    candle_waits_for(cstream, cdev)?;
    for (src, buf) in sources.iter().zip(&staged) {
        let (storage, layout) = src.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(Error::InvalidArgument("a gradient that is not a CUDA tensor".into()));
        };
        let elem = src.dtype().size_in_bytes();
        let (start, bytes) = (layout.start_offset() * elem, src.elem_count() * elem);
        let dst = device_ptr(&buf.view());
        with_ptr(storage, cdev, |ptr| copy_on(cdev, dst, ptr + start as CUdeviceptr, bytes))?;
    }
    let writes: Vec<_> = staged.iter().map(|b| (b.view(), AccessKind::Write)).collect();
    compute_waits_for(cstream, cdev, &writes)?;
    // The candle gradients may go now: their frees are ordered after the copies on candle's stream.
    drop(sources);
    for (buf, (_, dst)) in staged.iter().zip(grads) {
        cstream.accumulate(buf.view(), cuda_view(*dst)?).map_err(FsdpError::from)?;
    }
    Ok(())
}

/// A tensor with a copy of the elements `layout` selects in `storage` (what
/// the stage op's `cuda_fwd` receives); a candle variable when `variable`.
pub(crate) fn tensor_from_storage(
    storage: &CudaStorage,
    layout: &Layout,
    variable: bool,
) -> candle_core::Result<Tensor> {
    let shape = layout.shape().clone();
    let dev = storage.device();
    // SAFETY: `copy_strided_src` writes every element before any read.
    let mut copy = unsafe { dev.alloc_uninit(&shape, storage.dtype()) }?;
    storage.copy_strided_src(&mut copy, 0, layout)?;
    let variable = variable && storage.dtype().is_float();
    Ok(Tensor::from_storage(Storage::Cuda(copy), shape, BackpropOp::none(), variable))
}

/// A contiguous copy of `t`'s elements as a CUDA storage (what `cuda_fwd` returns).
pub(crate) fn storage_of(t: &Tensor) -> candle_core::Result<CudaStorage> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(storage) = &*storage else {
        candle_core::bail!("a stage on the CUDA device returned a tensor of another device")
    };
    // SAFETY: `copy_strided_src` writes every element before any read.
    let mut copy = unsafe { storage.device().alloc_uninit(layout.shape(), storage.dtype()) }?;
    storage.copy_strided_src(&mut copy, 0, layout)?;
    Ok(copy)
}
