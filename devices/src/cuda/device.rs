//! The cuda device: one GPU's primary context, its memory accounting, its
//! kernels and its internal allocation stream.
//!
//! The device makes its streams, events and buffers, and each holds its
//! device (to bind the context and to defer frees); a host buffer is
//! released in the order of the streams that used it (`host.rs`, the
//! streams' host-memory half): `device.rs`, `stream.rs`, `event.rs`,
//! `memory.rs` and `host.rs` depend on each other, as the cpu device's do.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::result as drv;
use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdevice_attribute};

use super::event::CudaEvent;
use super::kernels::Kernels;
use super::loader;
use super::memory::{CudaBuffer, StagingPool};
use super::result::DriverResult;
use super::stream::{CudaStream, StreamShared};
use super::Cuda;
use crate::bookkeeping::{first_error, Parked, StreamList};
use crate::deferred::Deferred;
use crate::memory::MemCounters;
use crate::{host_fn, DType, DeviceError, MemoryStats, Priority, Result};

pub(crate) use crate::id::next_id;

/// Settings of a cuda device.
#[derive(Clone, Debug)]
pub struct CudaConfig {
    /// The GPU's index among the visible CUDA devices.
    pub ordinal: usize,
    /// Deadline of every host wait (stream and event synchronize, readbacks).
    pub timeout: Duration,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig { ordinal: 0, timeout: Duration::from_secs(120) }
    }
}

/// Loads the driver (probing first) and runs `cuInit` once per process.
pub(crate) fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        loader::driver_library()?;
        loader::guarded("libcuda", || drv::init().drv("cuInit", "cuda"))
    })
    .clone()
}

/// Makes the device's default memory pool (what `cuMemAllocAsync` takes
/// from, chorus's buffers and candle's alike) keep the memory freed into it,
/// as PyTorch's caching allocator does. Its release threshold is 0 unless
/// set: every synchronize handed the pool's free memory back to the driver,
/// and the next step's allocations had it mapped again.
fn keep_freed_memory(device: CUdevice, label: &str) -> Result<()> {
    // SAFETY: a device returned by cuDeviceGet.
    let pool = unsafe { drv::device::get_default_mem_pool(device) }.drv("cuDeviceGetDefaultMemPool", label)?;
    let mut threshold = u64::MAX;
    // SAFETY: the device's default pool; the release threshold's value is a
    // cuuint64_t, which `threshold` is, read during the call.
    unsafe {
        drv::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .drv("cuMemPoolSetAttribute", label)
}

/// Number of CUDA devices visible to this process, or why there are none to
/// be had (the driver library missing, `cuInit` failing).
pub fn device_count() -> Result<usize> {
    init()?;
    Ok(drv::device::get_count().drv("cuDeviceGetCount", "cuda")?.max(0) as usize)
}

/// The driver's CUDA version (`12080` for 12.8), without touching a GPU.
pub fn driver_version() -> Result<i32> {
    loader::driver_library()?;
    loader::guarded("libcuda", || {
        let mut v = 0;
        // SAFETY: an out-pointer to a local.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result().drv("cuDriverGetVersion", "cuda")?;
        Ok(v)
    })
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) config: CudaConfig,
    /// `cuda:N`, for errors and stream names (made once: labels are on every call's error path).
    pub(crate) label: String,
    pub(crate) cu_device: CUdevice,
    pub(crate) ctx: CUcontext,
    pub(crate) gpu_name: String,
    pub(crate) compute_capability: (i32, i32),
    /// `(normal, high)` stream priorities (CUDA: lower is higher).
    pub(crate) priorities: (i32, i32),
    /// Updated when a buffer is made and when its free is enqueued.
    pub(crate) counters: MemCounters,
    /// The host space's counters (`alloc_host`), in the same terms.
    pub(crate) host_counters: MemCounters,
    pub(crate) streams: StreamList<StreamShared>,
    pub(crate) next_stream: AtomicUsize,
    pub(crate) kernels: OnceLock<Result<Arc<Kernels>>>,
    pub(crate) parked: Parked,
    pub(crate) staging: Arc<StagingPool>,
    /// Events for the waits of stream-ordered frees (`memory.rs`), reused:
    /// a wait takes the event's record when it is enqueued, so an event may
    /// be recorded again as soon as the wait is (CUDA's `cuStreamWaitEvent`).
    pub(crate) spare_events: Mutex<Vec<usize>>,
    /// Driver work of drops that ran inside host functions.
    pub(crate) deferred: Deferred<DeviceInner>,
}

// SAFETY: the context handle is a driver handle usable from any thread
// (each call binds it first); everything else is Send + Sync.
unsafe impl Send for DeviceInner {}
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // Inside a host function the driver may not be called: the context
        // stays retained (a leak, never a forbidden call).
        if host_fn::in_host_fn() {
            return;
        }
        // Nothing can be parked any more: the device is gone. Release what
        // the device owns, best effort, never panicking.
        // SAFETY: our retained primary context.
        if unsafe { drv::ctx::set_current(self.ctx) }.is_ok() {
            self.deferred.drain(self, |_| {});
            if let Some(Ok(k)) = self.kernels.get() {
                let _ = k.unload();
            }
            let _ = self.staging.trim(false);
            for event in self.spare_events.get_mut().map(std::mem::take).unwrap_or_default() {
                // SAFETY: created by `memory::release`, idle in the pool, destroyed once.
                let _ = unsafe { drv::event::destroy(event as sys::CUevent) };
            }
        }
        // SAFETY: retained once in `CudaDevice::with_config`, released once here.
        let _ = unsafe { drv::primary_ctx::release(self.cu_device) };
    }
}

/// One NVIDIA GPU (its primary context). Cheap to clone; clones are the same device.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    pub(crate) inner: Arc<DeviceInner>,
    /// The stream `Device::alloc` orders its allocations on.
    pub(crate) internal: Arc<StreamShared>,
}

impl CudaDevice {
    /// The GPU with this ordinal, default settings.
    ///
    /// Fails with [`DeviceError::LibraryUnavailable`] when `libcuda.so.1`
    /// cannot be loaded, and with a `libcuda` backend error when the driver
    /// finds no such GPU. Never panics.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        CudaDevice::with_config(CudaConfig { ordinal, ..CudaConfig::default() })
    }

    /// The GPU `config.ordinal` with the given settings.
    pub fn with_config(config: CudaConfig) -> Result<CudaDevice> {
        init()?;
        let label = format!("cuda:{}", config.ordinal);
        let ordinal =
            i32::try_from(config.ordinal).map_err(|_| DeviceError::invalid("CudaDevice::new", "ordinal too large"))?;
        let cu_device = drv::device::get(ordinal).drv("cuDeviceGet", &label)?;
        let attr = |a: CUdevice_attribute| {
            // SAFETY: a device returned by cuDeviceGet.
            unsafe { drv::device::get_attribute(cu_device, a) }.drv("cuDeviceGetAttribute", &label)
        };
        let cc = (
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        if attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? == 0 {
            return Err(DeviceError::Backend {
                library: "libcuda",
                code: 801,
                message: format!("{label} does not support the stream-ordered allocator (cuMemAllocAsync)"),
            });
        }
        keep_freed_memory(cu_device, &label)?;
        let gpu_name = drv::device::get_name(cu_device).drv("cuDeviceGetName", &label)?;
        // SAFETY: a device returned by cuDeviceGet; released in DeviceInner::drop.
        let ctx = unsafe { drv::primary_ctx::retain(cu_device) }.drv("cuDevicePrimaryCtxRetain", &label)?;
        // SAFETY: the context just retained.
        let bound = unsafe { drv::ctx::set_current(ctx) }.drv("cuCtxSetCurrent", &label);
        let priorities =
            bound.and_then(|_| drv::stream::get_priority_range().drv("cuCtxGetStreamPriorityRange", &label));
        let priorities = match priorities {
            Ok((least, greatest)) => (least, greatest),
            Err(e) => {
                // SAFETY: retained above.
                let _ = unsafe { drv::primary_ctx::release(cu_device) };
                return Err(e);
            }
        };
        let inner = Arc::new(DeviceInner {
            config,
            label: label.clone(),
            cu_device,
            ctx,
            gpu_name,
            compute_capability: cc,
            priorities,
            counters: MemCounters::default(),
            host_counters: MemCounters::default(),
            streams: StreamList::default(),
            next_stream: AtomicUsize::new(0),
            kernels: OnceLock::new(),
            parked: Parked::default(),
            staging: Arc::new(StagingPool::default()),
            spare_events: Mutex::new(Vec::new()),
            deferred: Deferred::default(),
        });
        let internal = StreamShared::create(&inner, Priority::Normal, "internal")?;
        let device = CudaDevice { inner, internal };
        // The kernels are loaded now, before any stream holds work: under
        // CUDA's lazy module loading (the default since 12.2) loading a
        // kernel waits for the context's running work, so a first launch
        // behind a blocked stream (a host function, an NCCL kernel waiting
        // for its peers) would stall until that work ends — seen on an H100
        // as a 20 s stall of the device suite. A failure here (no NVRTC) is
        // kept and reported by the first operation that needs a kernel.
        let _ = device.kernels();
        Ok(device)
    }

    /// The settings this device was made with.
    pub fn config(&self) -> &CudaConfig {
        &self.inner.config
    }

    /// The GPU's marketing name (`NVIDIA H100 80GB HBM3`).
    pub fn gpu_name(&self) -> &str {
        &self.inner.gpu_name
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// The driver's device handle (for vendor libraries such as NCCL).
    pub fn cu_device(&self) -> CUdevice {
        self.inner.cu_device
    }

    /// Makes this device's context current on the calling thread. Every
    /// chorus call does this itself; vendor libraries called directly need it.
    pub fn bind(&self) -> Result<()> {
        bind_ctx(&self.inner)
    }

    /// Errors from drops (stream-ordered frees, stream and event destruction)
    /// that had no caller to return them to; [`crate::Device::synchronize`]
    /// returns the first of them too.
    pub fn take_parked_errors(&self) -> Vec<DeviceError> {
        self.inner.parked.take_all()
    }

    /// Parks an error that arose where no caller can take it (a `Drop` of a
    /// vendor object built on this device); [`crate::Device::synchronize`]
    /// and [`CudaDevice::take_parked_errors`] report it.
    pub fn park(&self, e: DeviceError) {
        self.inner.parked.park(e)
    }

    pub(crate) fn label(&self) -> &str {
        &self.inner.label
    }

    /// The kernels, compiled and loaded on first use.
    pub(crate) fn kernels(&self) -> Result<Arc<Kernels>> {
        self.inner
            .kernels
            .get_or_init(|| {
                let ptx = super::kernels::ptx_for(self.inner.compute_capability)?;
                self.bind()?;
                Kernels::load(&ptx, self.label()).map(Arc::new)
            })
            .clone()
    }

    /// Allocates `len` elements in `stream`'s order (contents unspecified).
    pub(crate) fn alloc_on(&self, stream: &Arc<StreamShared>, dtype: DType, len: usize) -> Result<CudaBuffer> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| DeviceError::OutOfMemory { device: self.label().to_string(), bytes: usize::MAX })?;
        let ptr = if bytes == 0 {
            0
        } else {
            self.bind()?;
            // SAFETY: a live stream of this device's context.
            unsafe { drv::malloc_async(stream.raw, bytes) }.drv_alloc("cuMemAllocAsync", self.label(), bytes)?
        };
        Ok(CudaBuffer::adopt(self, stream, ptr, dtype, len))
    }
}

/// Makes the device's context current. Every driver call goes through here
/// first, so this is where the host-function rule is enforced (CUDA answers
/// a call inside a host function with `CUDA_ERROR_NOT_PERMITTED`, or hangs),
/// and where driver work that drops postponed out of host functions is done.
///
/// The context is set only when the thread's current one is another: asking
/// is a read of the driver's thread-local state, cheaper than setting it on
/// every operation, and a thread keeps its context until something (another
/// device, a vendor library) sets another.
pub(crate) fn bind_ctx(inner: &DeviceInner) -> Result<()> {
    host_fn::check("cuCtxSetCurrent")?;
    let current = drv::ctx::get_current().drv("cuCtxGetCurrent", &inner.label)?;
    if current != Some(inner.ctx) {
        // SAFETY: the device's retained primary context.
        unsafe { drv::ctx::set_current(inner.ctx) }.drv("cuCtxSetCurrent", &inner.label)?;
    }
    inner.deferred.drain(inner, |e| inner.parked.park(e));
    Ok(())
}

/// Runs `work` (driver calls of a drop) now, or, inside a host function where
/// the driver may not be called, at the next bind from another thread. Its
/// error is parked on the device.
pub(crate) fn defer(
    inner: &Arc<DeviceInner>,
    what: &'static str,
    work: impl FnOnce(&DeviceInner) -> Result<()> + Send + 'static,
) {
    inner.deferred.run_or_defer(inner, what, work, |e| inner.parked.park(e));
}

impl crate::Device for CudaDevice {
    type B = Cuda;

    fn name(&self) -> String {
        format!("{} ({})", self.label(), self.inner.gpu_name)
    }
    fn ordinal(&self) -> usize {
        self.inner.config.ordinal
    }
    fn is_same(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
    fn create_stream(&self, priority: Priority) -> Result<CudaStream> {
        CudaStream::create(self, priority)
    }
    fn create_event(&self) -> Result<CudaEvent> {
        CudaEvent::create(self)
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<CudaBuffer> {
        let buf = self.alloc_on(&self.internal, dtype, len)?;
        if buf.bytes_len() > 0 {
            // SAFETY: the allocation just made, on the internal stream.
            unsafe { drv::memset_d8_async(buf.ptr, 0, buf.bytes_len(), self.internal.raw) }
                .drv("cuMemsetD8Async", self.label())?;
        }
        // "Usable on any stream at once": the allocation and zeroing are done
        // when this returns.
        self.internal.host_wait(self)?;
        Ok(buf)
    }
    fn memory_stats(&self) -> MemoryStats {
        self.inner.counters.stats()
    }
    fn reset_peak_memory(&self) {
        self.inner.counters.reset_peak()
    }
    fn alloc_host(&self, dtype: DType, len: usize, pinned: bool) -> Result<CudaBuffer> {
        self.alloc_host_buffer(dtype, len, pinned)
    }
    fn host_memory_stats(&self) -> MemoryStats {
        self.inner.host_counters.stats()
    }
    fn reset_peak_host_memory(&self) {
        self.inner.host_counters.reset_peak()
    }
    fn count_calls(&self, on: bool) -> bool {
        super::result::DRIVER_CALLS.set(on);
        true
    }
    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        super::result::DRIVER_CALLS.snapshot()
    }
    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        let streams = first_error(self.inner.streams.live().iter().map(|s| s.host_wait(self)));
        if self.bind().is_ok() {
            if let Err(e) = self.inner.staging.trim(true) {
                self.park(e);
            }
        }
        let parked = self.take_parked_errors().into_iter().next().map_or(Ok(()), Err);
        streams.and(parked)
    }
}

impl CudaBuffer {
    pub(crate) fn bytes_len(&self) -> usize {
        crate::Buffer::bytes(self)
    }
}
