//! The cpu device and its buffers.
//!
//! The device makes its streams and events, and each holds its device (to
//! allocate and to park errors): `device.rs`, `stream.rs` and `event.rs`
//! depend on each other, as a backend's device, queue and fence do.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::event::CpuEvent;
use super::memory::{Contents, Memory, RawRange};
use super::pool::{CacheStats, Pool};
use super::sanitizer::Sanitizer;
use super::stream::{CpuStream, StreamShared};
use super::Cpu;
use crate::bookkeeping::{first_error, Parked, StreamList};
use crate::call_count::CallCounter;
use crate::memory::MemCounters;
use crate::{host_fn, BufferMeta, DType, DeviceError, MemorySpace, MemoryStats, Priority, Result};

pub(crate) use crate::id::next_id;

/// Settings of a cpu device.
///
/// The stream sanitizer is on unless turned off with the `unsafe`
/// [`CpuConfig::without_sanitizer`]: on this device every stream is a thread
/// over host memory, so two stream operations on one buffer with no event
/// between them are a data race in the Rust sense, and the sanitizer is what
/// refuses them. Without it, keeping stream order is the caller's
/// obligation, as with `unsafe` code.
#[derive(Clone, Debug)]
pub struct CpuConfig {
    /// Index of the device (ranks of the sim backend use their rank).
    pub ordinal: usize,
    /// Deadline of every wait: host synchronizes, readbacks, and an
    /// executor's wait on an event.
    pub timeout: Duration,
    /// Bytes of freed blocks each memory space keeps for reuse at most (see
    /// [`CpuDevice::cache_stats`]); 0 returns every freed block to the system.
    pub cache_limit: usize,
    sanitizer: bool,
    /// Whether kernels reach host buffers ([`crate::Device::kernels_reach_host`]).
    pub(crate) host_kernels: bool,
}

/// The default [`CpuConfig::cache_limit`]: enough for a step's buffers of
/// the models this repository trains on the cpu device, per rank.
pub const DEFAULT_CACHE_LIMIT: usize = 1 << 30;

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            ordinal: 0,
            timeout: Duration::from_secs(120),
            cache_limit: DEFAULT_CACHE_LIMIT,
            sanitizer: true,
            host_kernels: true,
        }
    }
}

impl CpuConfig {
    /// These settings with another ordinal.
    pub fn with_ordinal(mut self, ordinal: usize) -> Self {
        self.ordinal = ordinal;
        self
    }

    /// These settings with another deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These settings with another cache limit.
    pub fn with_cache_limit(mut self, bytes: usize) -> Self {
        self.cache_limit = bytes;
        self
    }

    /// These settings with the stream sanitizer off (benchmarks, where its
    /// per-operation bookkeeping would be measured too).
    ///
    /// # Safety
    /// Every operation the device's streams run must be ordered after every
    /// conflicting earlier operation on another stream (through events or
    /// host synchronization), exactly what the sanitizer would have checked:
    /// otherwise two executor threads access the same memory concurrently.
    pub unsafe fn without_sanitizer(mut self) -> Self {
        self.sanitizer = false;
        self
    }

    /// Whether the stream sanitizer is on.
    pub fn sanitizer(&self) -> bool {
        self.sanitizer
    }

    /// These settings with kernels kept off host buffers, as on a GPU: only
    /// copies reach a buffer from `alloc_host`, every other operation on one
    /// is an `InvalidArgument` error, and `kernels_reach_host` is false. CI
    /// runs the protocol of a GPU device (CPU offload's staging and host
    /// optimizer step) with it.
    pub fn with_kernels_off_host(mut self) -> Self {
        self.host_kernels = false;
        self
    }
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) config: CpuConfig,
    /// Kept in the stream-ordered allocator's terms: a buffer counts from its
    /// allocation until its handle is dropped, the moment its memory is free
    /// for later work in stream order (what CUDA's `cudaFreeAsync` pool and
    /// PyTorch's `memory_allocated` report). The bytes themselves stay
    /// allocated until queued work that uses them has run, so the counts do
    /// not depend on how far the executors lag behind the host.
    pub(crate) counters: Arc<MemCounters>,
    /// The host space's counters (buffers from `alloc_host`), in the same terms.
    pub(crate) host_counters: MemCounters,
    /// The caching allocators of the device and host spaces: counted apart
    /// from the counters above, which see a buffer's bytes as the user does.
    pools: [Arc<Pool>; 2],
    pub(crate) sanitizer: Option<Mutex<Sanitizer>>,
    pub(crate) streams: StreamList<StreamShared>,
    pub(crate) next_stream: AtomicUsize,
    /// Errors of drops, reported by the next `synchronize`.
    pub(crate) parked: Parked,
    /// Operations, events and allocations, when counting ([`crate::Device::count_calls`]).
    pub(crate) calls: CallCounter,
}

/// The host as a device. Cheap to clone; clones are the same device.
#[derive(Clone, Debug)]
pub struct CpuDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

impl CpuDevice {
    /// A device with the given settings.
    pub fn new(config: CpuConfig) -> CpuDevice {
        let sanitizer = config.sanitizer().then(|| Mutex::new(Sanitizer::default()));
        let pools = [Arc::new(Pool::new(config.cache_limit)), Arc::new(Pool::new(config.cache_limit))];
        CpuDevice {
            inner: Arc::new(DeviceInner {
                config,
                counters: Arc::new(MemCounters::default()),
                host_counters: MemCounters::default(),
                pools,
                sanitizer,
                streams: StreamList::default(),
                next_stream: AtomicUsize::new(0),
                parked: Parked::default(),
                calls: CallCounter::default(),
            }),
        }
    }

    /// A device with default settings and the given ordinal.
    pub fn with_ordinal(ordinal: usize) -> CpuDevice {
        CpuDevice::new(CpuConfig::default().with_ordinal(ordinal))
    }

    /// The settings this device was made with.
    pub fn config(&self) -> &CpuConfig {
        &self.inner.config
    }

    /// Whether the stream sanitizer is on.
    pub fn sanitizer_enabled(&self) -> bool {
        self.inner.sanitizer.is_some()
    }

    /// Keeps an error that arose where no caller can take it (a drop inside
    /// a host function); the next [`Device::synchronize`](crate::Device::synchronize) reports it.
    pub fn park(&self, e: DeviceError) {
        self.inner.parked.park(e)
    }

    /// Errors parked by drops since the last call, oldest first.
    pub fn take_parked_errors(&self) -> Vec<DeviceError> {
        self.inner.parked.take_all()
    }

    /// Reports a handle dropped inside a host function: harmless on the cpu,
    /// but a driver call (and so refused) on a GPU, so it is parked as the
    /// GPU devices would report it.
    pub(crate) fn check_drop(&self, what: &str) {
        if crate::host_fn::in_host_fn() {
            self.park(DeviceError::InHostFunction { op: format!("dropping {what}") });
        }
    }

    pub(crate) fn label(&self) -> String {
        format!("cpu:{}", self.inner.config.ordinal)
    }

    /// Runs `f` on the sanitizer, if it is on. A poisoned lock (a panic while
    /// holding it) disables checking rather than failing the caller.
    pub(crate) fn with_sanitizer<R>(&self, f: impl FnOnce(&mut Sanitizer) -> R) -> Option<R> {
        let s = self.inner.sanitizer.as_ref()?;
        let mut guard = s.lock().ok()?;
        Some(f(&mut guard))
    }

    /// Waits until every live stream has run the work enqueued on it, each
    /// up to the device's deadline, as a vendor library's free waits for the
    /// whole device (the simulated NCCL's destroy does this). Reports
    /// nothing: stream failures and parked errors stay for a synchronize.
    pub fn wait_idle(&self) {
        for s in self.inner.streams.live() {
            let _ = s.synchronize(self);
        }
    }

    /// A buffer of unspecified contents for `Stream::alloc`: a cached block
    /// as it is, or, with the sanitizer on, every byte 0xFF so that code
    /// reading it before writing sees NaNs rather than stale zeros.
    pub(crate) fn alloc_uninit(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        let contents = if self.sanitizer_enabled() { Contents::Poisoned } else { Contents::Any };
        self.alloc_in(MemorySpace::Device, dtype, len, contents)
    }

    /// The caching allocator's counts for `space` (bytes of whole blocks:
    /// [`Device::memory_stats`](crate::Device::memory_stats) counts the
    /// bytes buffers asked for, and its peak is unchanged by caching).
    pub fn cache_stats(&self, space: MemorySpace) -> CacheStats {
        self.pool(space).stats()
    }

    /// Returns every cached block of both spaces to the system (PyTorch's
    /// `torch.cuda.empty_cache`); live buffers are untouched.
    pub fn empty_cache(&self) {
        self.inner.pools.iter().for_each(|p| p.empty())
    }

    fn pool(&self, space: MemorySpace) -> &Arc<Pool> {
        match space {
            MemorySpace::Device => &self.inner.pools[0],
            MemorySpace::Host => &self.inner.pools[1],
        }
    }

    /// The counters of `space`.
    fn counters(&self, space: MemorySpace) -> &MemCounters {
        match space {
            MemorySpace::Device => &self.inner.counters,
            MemorySpace::Host => &self.inner.host_counters,
        }
    }

    /// Both spaces are plain memory here; only the counters differ.
    fn alloc_in(&self, space: MemorySpace, dtype: DType, len: usize, contents: Contents) -> Result<CpuBuffer> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| DeviceError::OutOfMemory { device: self.label(), bytes: usize::MAX })?;
        let mem = Memory::take(self.pool(space), bytes, contents, &self.label())?;
        self.counters(space).add(bytes);
        self.inner.calls.note(match space {
            MemorySpace::Device => "alloc",
            MemorySpace::Host => "alloc_host",
        });
        Ok(CpuBuffer { mem, meta: BufferMeta::new(dtype, len, next_id(), self.clone(), space) })
    }
}

impl crate::Device for CpuDevice {
    type B = Cpu;

    fn name(&self) -> String {
        self.label()
    }
    fn ordinal(&self) -> usize {
        self.inner.config.ordinal
    }
    fn is_same(&self, other: &CpuDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
    fn create_stream(&self, priority: Priority) -> Result<CpuStream> {
        host_fn::check("create_stream")?;
        CpuStream::spawn(self, priority)
    }
    fn create_event(&self) -> Result<CpuEvent> {
        host_fn::check("create_event")?;
        self.inner.calls.note("create_event");
        Ok(CpuEvent::new(self))
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        host_fn::check("alloc")?;
        self.alloc_in(MemorySpace::Device, dtype, len, Contents::Zeroed)
    }
    fn memory_stats(&self) -> MemoryStats {
        self.inner.counters.stats()
    }
    fn reset_peak_memory(&self) {
        self.inner.counters.reset_peak()
    }
    /// Pinned and pageable are the same plain memory here.
    fn alloc_host(&self, dtype: DType, len: usize, _pinned: bool) -> Result<CpuBuffer> {
        host_fn::check("alloc_host")?;
        self.alloc_in(MemorySpace::Host, dtype, len, Contents::Zeroed)
    }
    fn host_memory_stats(&self) -> MemoryStats {
        self.inner.host_counters.stats()
    }
    fn reset_peak_host_memory(&self) {
        self.inner.host_counters.reset_peak()
    }
    fn kernels_reach_host(&self) -> bool {
        self.inner.config.host_kernels
    }
    fn count_calls(&self, on: bool) -> bool {
        self.inner.calls.set(on);
        true
    }
    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        self.inner.calls.snapshot()
    }
    fn synchronize(&self) -> Result<()> {
        host_fn::check("device synchronize")?;
        let streams = first_error(self.inner.streams.live().iter().map(|s| s.synchronize(self)));
        let parked = self.take_parked_errors().into_iter().next().map_or(Ok(()), Err);
        streams.and(parked)
    }
}

/// A cpu buffer: owned, 64-byte-aligned host memory.
#[derive(Debug)]
pub struct CpuBuffer {
    mem: Arc<Memory>,
    meta: BufferMeta<Cpu>,
}

impl CpuBuffer {
    pub(crate) fn raw_range(&self, bytes: std::ops::Range<usize>) -> RawRange {
        RawRange::new(self.mem.clone(), bytes.start, bytes.end - bytes.start, self.meta.dtype)
    }
}

impl crate::Buffer for CpuBuffer {
    type B = Cpu;
    fn meta(&self) -> &BufferMeta<Cpu> {
        &self.meta
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        let m = &self.meta;
        m.device.check_drop("a cpu buffer");
        let id = m.id;
        m.device.counters(m.space).sub(self.mem.bytes());
        m.device.with_sanitizer(|s| s.forget_buffer(id));
    }
}
