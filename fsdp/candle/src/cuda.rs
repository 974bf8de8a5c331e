//! The adapter on the `cuda` device (feature `candle-cuda`): stages compute
//! on candle's CUDA device, on the same GPU as FSDP's buffers, **on FSDP's
//! buffers themselves**.
//!
//! candle 0.11's `CudaDevice` computes on a stream of its own (it cannot be
//! built on an existing one), so candle's stream and FSDP's compute stream
//! are ordered by two events made once per model ([`CudaSide`]), at the
//! places they meet (the rule of `docs/fsdp.md`, "The candle-CUDA path"):
//! - **chorus → candle**: after FSDP's pre-forward or pre-backward (the
//!   all-gathered parameters and the zeroed gradients are written), candle's
//!   stream waits for an event recorded on the compute stream
//!   ([`CudaSide::candle_waits_for`]);
//! - **candle → chorus**: before an FSDP hook that may free or overwrite what
//!   candle used (post-forward's reshard, post-backward's reduce-scatter and
//!   reshard, the end of a step), the compute stream waits for an event
//!   recorded on candle's stream, declared to chorus as reads of the
//!   parameters and writes of the gradients candle touched
//!   ([`CudaSide::compute_waits_for`]), so that chorus orders their reuse and
//!   frees after candle's work.
//!
//! What crosses without a copy:
//! - **parameters**: a group's unsharded parameters become candle variables
//!   whose storage *is* FSDP's buffer ([`borrow_view`]): a cudarc `CudaSlice`
//!   made from the buffer's address. cudarc frees a slice's pointer when it
//!   drops, so such a slice must never drop inside candle: [`Borrowed`] takes
//!   it back out of candle's storage when the phase ends (candle's in-place op
//!   hands out `&mut CudaStorage`), puts a fresh allocation of the same size
//!   in its place (so any tensor still sharing that storage reads memory it
//!   owns, never freed memory) and forgets the slice without freeing it
//!   (`CudaSlice::leak`). With event tracking off (below), making and leaking
//!   such a slice calls no driver function;
//! - **gradients**: one kernel per gradient on candle's stream reads candle's
//!   gradient (any float dtype, contiguous or a 2-D strided view such as the
//!   transposed weight gradient of `x·Wᵀ`) and adds it into FSDP's unsharded
//!   gradient, rounding once as the device's `accumulate` does (the kernel is
//!   the chorus kernel source's loads and stores, [`chorus_devices::gpu_kernels`],
//!   compiled by NVRTC); no staging buffer;
//! - a stage's input, where candle must differentiate by it, is a variable
//!   borrowing the input tensor's allocation ([`borrow_tensor`]).
//!
//! **Event tracking is off on the adapter's candle device.** cudarc records
//! two events on every use of every allocation (and makes two per
//! allocation) to order streams it cannot see; the adapter's device needs
//! none of it, because every candle tensor of it is used on candle's stream
//! only (see [`candle_device`]'s SAFETY argument).

use std::any::Any;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdeviceptr, CUevent_wait_flags, CUstream};
use candle_core::cuda_backend::cudarc::driver::{
    self, CudaEvent as CudarcEvent, CudaFunction, CudaSlice, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaDevice as CandleCuda, CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{Device as CandleDevice, InplaceOp1, Layout, Storage, Tensor, Var};
use chorus_devices::cuda::{device_ptr, Cuda, CudaBuffer, CudaDevice, CudaEvent, CudaStream};
use chorus_devices::gpu_kernels::{blocks_for, code, BLOCK, SOURCE};
use chorus_devices::{AccessKind, Backend, Device, DeviceError, ForeignBackend, Stream, View};
use chorus_fsdp::FsdpError;

use crate::convert::candle_dtype;
use crate::{Error, Result};

fn device_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Fsdp(FsdpError::from(DeviceError::Backend { library: "libcuda", code: -1, message: format!("{what}: {e}") }))
}

fn driver_error(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| device_error(what, e)
}

/// candle's CUDA device for the adapter on the GPU of `device` when it is a
/// chorus `cuda` device (a device of its own, with cudarc's event tracking
/// off); `None` for any other device.
pub(crate) fn candle_device<B: Backend>(device: &B::Device) -> Result<Option<CandleDevice>> {
    let Some(device) = (device as &dyn Any).downcast_ref::<CudaDevice>() else { return Ok(None) };
    let dev = cuda_device(device.config().ordinal)?;
    let CandleDevice::Cuda(cuda) = &dev else {
        return Err(Error::InvalidArgument("candle's CUDA device is not CUDA".into()));
    };
    // SAFETY: this device is the adapter's alone (a context handle of its
    // own: `cuda_device` makes a new one, so plain candle's devices keep
    // cudarc's tracking), turned off before it allocates anything, and every
    // use of its memory is ordered without cudarc's events:
    // - candle computes on one stream, the device's (its kernels, its cuBLAS
    //   and cuRAND handles, its copies to and from the host, which
    //   synchronize it); the adapter enqueues its kernels and copies on that
    //   stream too, so every candle tensor is used on candle's stream only;
    // - candle's frees are `cuMemFreeAsync` on that same stream, after every
    //   use of the memory in stream order;
    // - the one cross-stream traffic is candle's stream reading FSDP's
    //   parameters and writing FSDP's gradients (chorus buffers, never
    //   candle's), ordered both ways by the explicit events of `CudaSide`
    //   and declared to chorus, which orders their reuse and frees.
    // `FsdpModel::device` says that its tensors belong on its stream.
    unsafe { cuda.disable_event_tracking() };
    Ok(Some(dev))
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

/// The gradient-adding kernel, after the chorus kernels it borrows its
/// loads and stores from (`ldf`/`ldd` read any float dtype exactly, `stf`/
/// `std64` round once): `dst[i] += src[(i / cols)·s0 + (i % cols)·s1]`, in
/// f64 for f64 destinations and in f32 otherwise, as `chorus_accumulate`.
const ADD_STRIDED: &str = r#"
extern "C" __global__ void __launch_bounds__(CHORUS_BLOCK) chorus_adapter_add_strided(
        const void* src, int st, u64 cols, u64 s0, u64 s1, void* dst, int dt, u64 n) {
    if (dt == T_F64) {
        GRID_STRIDE(i, n) ((double*)dst)[i] = ((double*)dst)[i] + ldd(src, st, (i / cols) * s0 + (i % cols) * s1);
    } else {
        GRID_STRIDE(i, n) stf(dst, dt, i, ldf(dst, dt, i) + ldf(src, st, (i / cols) * s0 + (i % cols) * s1));
    }
}
"#;

/// PTX of [`ADD_STRIDED`] per compute capability, compiled once per process.
fn add_strided_ptx(cc: (i32, i32)) -> Result<String> {
    static CACHE: OnceLock<Mutex<HashMap<(i32, i32), String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(ptx) = cache.lock().ok().and_then(|c| c.get(&cc).cloned()) {
        return Ok(ptx);
    }
    chorus_devices::cuda::nvrtc_library().map_err(FsdpError::from)?;
    let source = format!("{SOURCE}{ADD_STRIDED}");
    // As the chorus device compiles its kernels: no multiply-add contraction,
    // IEEE division; the GPU's own architecture, or compute_52 (JIT-compiled
    // by the driver) where this NVRTC predates it.
    let compile = |arch: String| {
        let options = nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture={arch}"), "--fmad=false".into(), "--std=c++14".into()],
            name: Some("chorus_adapter.cu".into()),
            ..Default::default()
        };
        nvrtc::compile_ptx_with_opts(&source, options)
    };
    let compiled = std::panic::catch_unwind(AssertUnwindSafe(|| {
        compile(format!("compute_{}{}", cc.0, cc.1)).or_else(|first| compile("compute_52".into()).map_err(|_| first))
    }))
    .map_err(|_| device_error("NVRTC", "cudarc panicked while loading libnvrtc"))?
    .map_err(|e| device_error("compiling the adapter's gradient kernel", e))?;
    let ptx = compiled.to_src();
    if let Ok(mut c) = cache.lock() {
        c.insert(cc, ptx.clone());
    }
    Ok(ptx)
}

/// What the adapter keeps per model on the cuda device: candle's device, the
/// two events that order its stream with FSDP's compute stream (recorded
/// again at every crossing: a wait already enqueued keeps the record it was
/// enqueued after), and the gradient kernel.
pub(crate) struct CudaSide {
    dev: CandleCuda,
    /// Recorded on the compute stream, waited on by candle's.
    to_candle: CudaEvent,
    /// Recorded on candle's stream, waited on by the compute stream.
    to_chorus: CudarcEvent,
    add_strided: CudaFunction,
}

impl CudaSide {
    /// The crossings of candle's device `dev` with `compute`; `None` when
    /// `dev` is not CUDA.
    pub(crate) fn new<S: Stream>(compute: &S, dev: &CandleDevice) -> Result<Option<CudaSide>> {
        let CandleDevice::Cuda(dev) = dev else { return Ok(None) };
        let compute = chorus_stream(compute)?;
        if dev.is_event_tracking() {
            return Err(Error::InvalidArgument(
                "the adapter's candle device tracks events; make it with the adapter's candle_device".into(),
            ));
        }
        let to_candle = compute.device().create_event().map_err(FsdpError::from)?;
        let stream = dev.cuda_stream();
        let to_chorus = stream.context().new_event(None).map_err(driver_error("cuEventCreate on candle's context"))?;
        let ptx = add_strided_ptx(compute.device().compute_capability())?;
        let module = stream
            .context()
            .load_module(nvrtc::Ptx::from_src(ptx))
            .map_err(driver_error("loading the adapter's gradient kernel"))?;
        let add_strided =
            module.load_function("chorus_adapter_add_strided").map_err(driver_error("cuModuleGetFunction"))?;
        Ok(Some(CudaSide { dev: dev.clone(), to_candle, to_chorus, add_strided }))
    }

    /// candle's stream waits (on the device) for everything enqueued on `compute` so far.
    pub(crate) fn candle_waits_for<S: Stream>(&self, compute: &S) -> Result<()> {
        let compute = chorus_stream(compute)?;
        compute.record(&self.to_candle).map_err(FsdpError::from)?;
        let stream = self.dev.cuda_stream();
        stream.context().bind_to_thread().map_err(driver_error("binding candle's context"))?;
        // SAFETY: both handles are alive (the event as long as `self`); the
        // wait is for the record just enqueued, whatever later records do.
        unsafe {
            driver::result::stream::wait_event(
                stream.cu_stream(),
                self.to_candle.raw(),
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(driver_error("cuStreamWaitEvent (candle after chorus)"))
    }

    /// `compute` waits (on the device) for everything enqueued on candle's
    /// stream so far, declaring `accesses` (the chorus buffers that work
    /// used), so that chorus orders their reuse and free after it.
    pub(crate) fn compute_waits_for<B: Backend, S: Stream<B = B>>(
        &self,
        compute: &S,
        accesses: &[(View<'_, B>, AccessKind)],
    ) -> Result<()> {
        let compute = chorus_stream(compute)?;
        let accesses = accesses.iter().map(|(v, kind)| Ok((cuda_view(*v)?, *kind))).collect::<Result<Vec<_>>>()?;
        let stream = self.dev.cuda_stream();
        self.to_chorus.record(&stream).map_err(driver_error("recording an event on candle's stream"))?;
        let raw_event = self.to_chorus.cu_event();
        Cuda::enqueue_foreign(compute, "candle", &accesses, &mut |raw| {
            // SAFETY: `raw` is the compute stream's handle; the event lives as long as `self`.
            unsafe {
                driver::result::stream::wait_event(
                    raw as CUstream,
                    raw_event,
                    CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
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

    /// Adds each candle gradient into its destination (FSDP's unsharded
    /// gradient, of the same number of elements) on candle's stream, one
    /// kernel each: after candle's backward (stream order), before the
    /// caller's [`CudaSide::compute_waits_for`] declaring the writes. The
    /// caller has made candle's stream wait for the compute stream since the
    /// destinations were last touched there.
    pub(crate) fn add_grads<B: Backend>(&self, grads: &[(Tensor, View<'_, B>)]) -> Result<()> {
        let stream = self.dev.cuda_stream();
        for (grad, dst) in grads {
            let dst = cuda_view(*dst)?;
            let n = grad.elem_count();
            if n != dst.len() {
                return Err(Error::InvalidArgument(format!(
                    "cannot add a tensor of {n} elements into {} elements",
                    dst.len()
                )));
            }
            candle_dtype(dst.dtype())?;
            if !matches!(grad.device(), CandleDevice::Cuda(d) if d.same_device(&self.dev)) {
                return Err(Error::InvalidArgument("a gradient on another device than the adapter's".into()));
            }
            if n == 0 {
                continue;
            }
            // A layout the kernel does not walk (a strided view of more than
            // two dimensions; candle's gradients are contiguous or transposed
            // matrices) is made contiguous by candle first.
            let grad = match strided_2d(grad.layout()) {
                Some(_) => grad.clone(),
                None => grad.contiguous()?,
            };
            let (storage, layout) = grad.storage_and_layout();
            let Storage::Cuda(storage) = &*storage else {
                return Err(Error::InvalidArgument("a gradient that is not a CUDA tensor".into()));
            };
            let (cols, s0, s1) = strided_2d(layout)
                .ok_or_else(|| Error::InvalidArgument("a contiguous gradient without a layout".into()))?;
            let src_dtype = crate::convert::chorus_dtype(grad.dtype())?;
            let src = slice_ptr(storage)? + (layout.start_offset() * src_dtype.size()) as CUdeviceptr;
            let (st, dt) = (code(src_dtype), code(dst.dtype()));
            let (cols, s0, s1, n) = (cols as u64, s0 as u64, s1 as u64, n as u64);
            let dst_ptr = device_ptr(&dst);
            let mut launch = stream.launch_builder(&self.add_strided);
            launch.arg(&src).arg(&st).arg(&cols).arg(&s0).arg(&s1).arg(&dst_ptr).arg(&dt).arg(&n);
            let config =
                LaunchConfig { grid_dim: (blocks_for(n), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match the kernel's signature; `src` holds
            // the gradient's elements at the strides given (candle's layout of
            // a live tensor, kept until the launch is enqueued, and its free
            // comes after the kernel on this stream); `dst` is FSDP's live
            // buffer of `n` elements of `dt`, ordered with this stream by the
            // caller's events.
            unsafe { launch.launch(config) }.map_err(driver_error("launching the adapter's gradient kernel"))?;
        }
        Ok(())
    }
}

/// How the gradient kernel walks `layout`: `(cols, s0, s1)` with element `i`
/// of the row-major order at `(i / cols)·s0 + (i % cols)·s1` from the
/// start; `None` for a strided layout of more than two dimensions.
fn strided_2d(layout: &Layout) -> Option<(usize, usize, usize)> {
    if layout.is_contiguous() {
        return Some((layout.shape().elem_count().max(1), 0, 1));
    }
    match (layout.dims(), layout.stride()) {
        ([rows, cols], [s0, s1]) if *rows > 0 && *cols > 0 => Some((*cols, *s0, *s1)),
        _ => None,
    }
}

/// The address of `storage`'s first element.
fn slice_ptr(storage: &CudaStorage) -> Result<CUdeviceptr> {
    cuda_extent(storage)
        .map(|(ptr, _)| ptr as CUdeviceptr)
        .ok_or_else(|| Error::InvalidArgument("a CUDA storage of a dtype the adapter does not move".into()))
}

/// The address of `storage`'s first element and its element count (the
/// dtypes a stage's output may have); see [`crate::storage::storage_extent`].
pub(crate) fn cuda_extent(storage: &CudaStorage) -> Option<(u64, usize)> {
    let stream = storage.device.cuda_stream();
    macro_rules! extent {
        ($s:expr) => {{
            // Event tracking is off on the adapter's device: the guard records nothing.
            let (ptr, _record) = $s.device_ptr(&stream);
            Some((ptr as u64, $s.len()))
        }};
    }
    match &storage.slice {
        CudaStorageSlice::U8(s) => extent!(s),
        CudaStorageSlice::U32(s) => extent!(s),
        CudaStorageSlice::I64(s) => extent!(s),
        CudaStorageSlice::F32(s) => extent!(s),
        CudaStorageSlice::BF16(s) => extent!(s),
        CudaStorageSlice::F16(s) => extent!(s),
        CudaStorageSlice::F64(s) => extent!(s),
        _ => None,
    }
}

/// A candle variable whose storage is memory candle does not own: an FSDP
/// buffer ([`borrow_view`]) or another candle tensor's allocation
/// ([`borrow_tensor`]). [`Borrowed::release`] (or the drop) gives it back.
pub(crate) struct Borrowed {
    /// The variable (its storage holds the borrowed slice until release).
    var: Var,
    ptr: CUdeviceptr,
    /// The tensor whose allocation is borrowed, kept alive until release.
    _owner: Option<Tensor>,
    released: bool,
}

impl Borrowed {
    /// The variable on the borrowed memory.
    pub(crate) fn var(&self) -> &Var {
        &self.var
    }

    /// Whether the memory is still borrowed (not yet released).
    pub(crate) fn is_bound(&self) -> bool {
        !self.released
    }

    /// Gives the memory back: the variable's storage gets an allocation of
    /// its own — a copy of the values when `keep_values` (a graph kept for
    /// backward still reads them after the owner frees its memory), else
    /// uninitialised (nothing in the adapter reads it again; a tensor a
    /// stage kept against its contract reads memory it owns) — and the
    /// borrowed slice is forgotten, never freed by candle. Every candle work
    /// that reads the memory must be enqueued before, and the owner's reuse
    /// ordered after that work (the crossings of [`CudaSide`]); a copy is
    /// enqueued here, so it comes before the caller's next crossing.
    pub(crate) fn release(&mut self, keep_values: bool) -> Result<()> {
        if self.released {
            return Ok(());
        }
        let replacement = if keep_values { Replacement::Copy } else { Replacement::Uninit };
        let released = self.var.as_tensor().inplace_op1(&ReleaseBorrowed { ptr: self.ptr, replacement });
        // Whatever the outcome, the slice is out of candle's storage or the
        // op failed before taking it (then `fallback` below takes it).
        self.released = released.is_ok();
        released?;
        Ok(())
    }

    /// Takes the slice out without allocating, leaving an empty slice in
    /// candle's storage: the last resort of a drop whose release could not
    /// allocate (out of memory), so that candle never frees the owner's
    /// memory.
    fn fallback(&mut self) {
        let _ = self.var.as_tensor().inplace_op1(&ReleaseBorrowed { ptr: self.ptr, replacement: Replacement::Empty });
        self.released = true;
    }

    fn dev_synchronize(&self) -> Result<()> {
        if let CandleDevice::Cuda(d) = self.var.device() {
            d.cuda_stream().synchronize().map_err(driver_error("synchronizing candle's stream"))?;
        }
        Ok(())
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // Not released by the adapter (an error path): no crossing ordered
        // candle's queued reads of the memory before its owner's reuse, so
        // they are waited for here.
        let _ = self.dev_synchronize();
        if self.release(false).is_err() {
            self.fallback();
        }
    }
}

/// Makes a [`Borrowed`] variable of `shape` and `dtype` on `ptr`.
///
/// # Safety
/// `ptr` holds `shape`'s elements of `dtype` on `dev`'s GPU and stays
/// allocated until the borrow is released; `dev` does not track events.
unsafe fn borrow(
    dev: &CandleCuda,
    ptr: CUdeviceptr,
    shape: &[usize],
    dtype: candle_core::DType,
    owner: Option<Tensor>,
) -> Result<Borrowed> {
    if dev.is_event_tracking() {
        return Err(Error::InvalidArgument("borrowing on a candle device that tracks events".into()));
    }
    let len: usize = shape.iter().product();
    // SAFETY: the caller's contract; the slice is taken back out of candle's
    // storage by `release` (or the drop) before it can drop.
    let slice = unsafe { slice_at(dev, dtype, ptr, len) }.map_err(Error::InvalidArgument)?;
    let storage = Storage::Cuda(CudaStorage { slice, device: dev.clone() });
    // A variable from the start (`Var::from_tensor` keeps it, no copy).
    let t = Tensor::from_storage(storage, shape.to_vec(), BackpropOp::none(), true);
    Ok(Borrowed { var: Var::from_tensor(&t)?, ptr, _owner: owner, released: false })
}

/// A cudarc slice of `len` elements of `dtype` at `ptr`, which cudarc will
/// free when it drops. Without event tracking (the adapter's device) this
/// makes no event, so it calls nothing and cannot fail on a float dtype.
///
/// # Safety
/// `ptr` holds `len` elements of `dtype` on `dev`'s GPU (or is 0 with `len`
/// 0), and the slice never drops while `ptr` is another owner's memory.
unsafe fn slice_at(
    dev: &CandleCuda,
    dtype: candle_core::DType,
    ptr: CUdeviceptr,
    len: usize,
) -> std::result::Result<CudaStorageSlice, String> {
    let stream = dev.cuda_stream();
    // SAFETY (each arm): the caller's contract.
    Ok(match dtype {
        candle_core::DType::F32 => CudaStorageSlice::F32(unsafe { stream.upgrade_device_ptr(ptr, len) }),
        candle_core::DType::BF16 => CudaStorageSlice::BF16(unsafe { stream.upgrade_device_ptr(ptr, len) }),
        candle_core::DType::F16 => CudaStorageSlice::F16(unsafe { stream.upgrade_device_ptr(ptr, len) }),
        candle_core::DType::F64 => CudaStorageSlice::F64(unsafe { stream.upgrade_device_ptr(ptr, len) }),
        d => return Err(format!("the adapter borrows float memory only, not {d:?}")),
    })
}

/// FSDP's buffer `view` (an unsharded parameter) as a candle variable of
/// `shape`, without a copy. The caller orders candle's reads after FSDP's
/// writes ([`CudaSide::candle_waits_for`]) and FSDP's reuse after candle's
/// reads ([`CudaSide::compute_waits_for`]), and releases it before FSDP may
/// free the buffer.
pub(crate) fn borrow_view<B: Backend>(dev: &CandleDevice, view: View<'_, B>, shape: &[usize]) -> Result<Borrowed> {
    let dev = cuda_of(dev)?;
    let view = cuda_view(view)?;
    if shape.iter().product::<usize>() != view.len() {
        return Err(Error::InvalidArgument(format!("a parameter of {} elements as shape {shape:?}", view.len())));
    }
    // SAFETY: the view's buffer is FSDP's live unsharded parameter on this
    // GPU, of `view.len()` elements of its dtype; the caller releases the
    // borrow before FSDP may free it (module docs).
    unsafe { borrow(dev, device_ptr(&view), shape, candle_dtype(view.dtype())?, None) }
}

/// A candle variable on the allocation of `t` (a contiguous float CUDA
/// tensor of the adapter's device), without a copy: candle differentiates
/// by it as by `t`. `t` is kept alive until the borrow is released.
pub(crate) fn borrow_tensor(t: &Tensor) -> Result<Borrowed> {
    let dev = cuda_of(t.device())?;
    let Some((start, _)) = t.layout().contiguous_offsets() else {
        return Err(Error::InvalidArgument("borrowing a tensor that is not contiguous".into()));
    };
    let base = {
        let (storage, _) = t.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(Error::InvalidArgument("borrowing a tensor that is not on CUDA".into()));
        };
        slice_ptr(storage)?
    };
    let ptr = base + (start * t.dtype().size_in_bytes()) as CUdeviceptr;
    // SAFETY: the elements `t`'s contiguous layout selects, on this device;
    // `t` (kept in the borrow) keeps its allocation until the release.
    unsafe { borrow(dev, ptr, t.dims(), t.dtype(), Some(t.clone())) }
}

/// What replaces a borrowed slice in candle's storage when it is given back.
#[derive(Clone, Copy, PartialEq)]
enum Replacement {
    /// An uninitialised allocation of the same size (nothing reads it).
    Uninit,
    /// A copy of the values (a kept graph reads them after the owner's free).
    Copy,
    /// An empty slice at address 0: no allocation (a drop whose release
    /// could not allocate).
    Empty,
}

/// The in-place op that takes a borrowed slice out of candle's storage.
struct ReleaseBorrowed {
    ptr: CUdeviceptr,
    replacement: Replacement,
}

/// Takes the borrowed slice out of `storage`, putting `replacement` in its
/// place, and forgets it without freeing; an error (and `storage`
/// unchanged) when `storage` does not hold the borrowed slice.
fn swap_out_borrowed(storage: &mut CudaStorage, ptr: CUdeviceptr, replacement: CudaStorage) -> candle_core::Result<()> {
    let holds = matches!(slice_ptr(storage), Ok(p) if p == ptr);
    if !holds {
        candle_core::bail!("the adapter's borrowed variable no longer holds the borrowed memory")
    }
    let borrowed = std::mem::replace(storage, replacement);
    macro_rules! leak {
        ($s:expr) => {{
            // Not freed: the memory is its owner's.
            let _ = CudaSlice::leak($s);
        }};
    }
    match borrowed.slice {
        CudaStorageSlice::F32(s) => leak!(s),
        CudaStorageSlice::BF16(s) => leak!(s),
        CudaStorageSlice::F16(s) => leak!(s),
        CudaStorageSlice::F64(s) => leak!(s),
        // `slice_ptr` matched a float slice above.
        _ => {}
    }
    Ok(())
}

impl InplaceOp1 for ReleaseBorrowed {
    fn name(&self) -> &'static str {
        "chorus-release-borrowed"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("a borrowed variable on the CPU")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let dev = storage.device.clone();
        let fresh = match self.replacement {
            Replacement::Empty => {
                // SAFETY: address 0 with no element (as cudarc's `null`
                // makes); its eventual free of address 0 frees nothing of anyone's.
                let slice = unsafe { slice_at(&dev, storage.dtype(), 0, 0) }.map_err(candle_core::Error::msg)?;
                CudaStorage { slice, device: dev }
            }
            Replacement::Uninit | Replacement::Copy => {
                // SAFETY: read only where `Copy` writes every element into it first.
                let mut fresh = unsafe { dev.alloc_uninit(layout.shape(), storage.dtype()) }?;
                if self.replacement == Replacement::Copy {
                    storage.copy_strided_src(&mut fresh, 0, layout)?;
                }
                fresh
            }
        };
        swap_out_borrowed(storage, self.ptr, fresh)
    }
}

/// Moves `storage` out of a CUDA tensor's storage, leaving an uninitialised
/// allocation of the same size in its place (what [`crate::storage`]'s
/// take does on the cuda device).
pub(crate) fn take_cuda_storage(storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<CudaStorage> {
    let dev = storage.device.clone();
    // SAFETY: nothing the adapter runs reads it; a tensor that still shares
    // the storage against the stage contract reads memory it owns.
    let fresh = unsafe { dev.alloc_uninit(layout.shape(), storage.dtype()) }?;
    Ok(std::mem::replace(storage, fresh))
}

/// A zero scalar on the device of `storage` (the backward seed's forward).
pub(crate) fn cuda_scalar_zero(storage: &CudaStorage) -> candle_core::Result<CudaStorage> {
    storage.device.zeros_impl(&candle_core::Shape::from(()), candle_core::DType::F32)
}

/// A contiguous copy of `t`'s elements as a CUDA storage (a stage's output
/// that cannot be taken: [`crate::storage::take_output`]).
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
