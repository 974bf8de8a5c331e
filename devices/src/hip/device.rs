//! The hip device, its memory accounting and its buffers.
//!
//! The device makes its streams, events and buffers, and each holds its
//! device (to bind it and to defer frees); a host buffer is released in the
//! order of the streams that used it (`host.rs`, the streams' host-memory
//! half): `device.rs`, `stream.rs`, `event.rs` and `host.rs` depend on each
//! other, as the cpu device's do.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::event::HipEvent;
use super::host::{keep_alive, HostMemory};
use super::kernels::KernelCache;
use super::result;
use super::stream::{HipStream, StreamInner};
use super::Hip;
use crate::bookkeeping::{first_error, StreamList};
use crate::deferred::Deferred;
use crate::memory::{MemCounters, StreamUsers};
use crate::{BufferMeta, DType, DeviceError, MemorySpace, MemoryStats, Priority, Result};

pub(crate) use crate::id::next_id;

/// Settings of a hip device.
#[derive(Clone, Debug)]
pub struct HipConfig {
    /// Which GPU (`hipSetDevice` ordinal).
    pub ordinal: usize,
    /// Deadline of every host wait: stream, event and device synchronize, readbacks.
    pub timeout: Duration,
    /// The architecture kernels are compiled for (`gfx90a`, `gfx942`, ...).
    /// `None` lets hipRTC use the current device's; the environment variable
    /// `CHORUS_HIP_ARCH` sets the default.
    pub arch: Option<String>,
}

impl Default for HipConfig {
    fn default() -> Self {
        let arch = std::env::var("CHORUS_HIP_ARCH").ok().filter(|a| !a.is_empty());
        HipConfig { ordinal: 0, timeout: Duration::from_secs(120), arch }
    }
}

/// Errors from `Drop` implementations, returned by the next device synchronize.
pub(crate) type Parked = Arc<crate::bookkeeping::Parked>;

/// HIP work of drops that ran inside host functions (see `crate::deferred`).
pub(crate) type DeferredDrops = Arc<Deferred<()>>;

/// What every hip handle's drop does with its HIP calls (`work`): runs them
/// now with device `ordinal` current or, inside a host function, at the
/// device's next bind from another thread; their error is parked.
pub(crate) fn defer_drop(
    deferred: &DeferredDrops,
    parked: &Parked,
    ordinal: usize,
    what: &'static str,
    work: impl FnOnce() -> Result<()> + Send + 'static,
) {
    let work = move |_: &()| {
        result::set_device(ordinal)?;
        work()
    };
    deferred.run_or_defer(&(), what, work, |e| parked.park(e));
}

/// A page-locked host block for staging host↔device copies (so they are
/// truly asynchronous). Raw: given back to its pool, never freed on drop.
#[derive(Debug)]
pub(crate) struct PinnedBlock {
    ptr: usize,
    capacity: usize,
}

impl PinnedBlock {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

/// Page-locked blocks of power-of-two sizes, reused. Taking may allocate
/// (`hipHostMalloc`); giving back never calls HIP, so host functions do it.
/// The blocks are freed when the device is dropped.
#[derive(Debug, Default)]
pub(crate) struct PinnedPool {
    free: Mutex<Vec<PinnedBlock>>,
}

impl PinnedPool {
    pub(crate) fn take(&self, bytes: usize) -> Result<PinnedBlock> {
        let capacity = bytes.max(4096).checked_next_power_of_two().unwrap_or(bytes);
        if let Ok(mut free) = self.free.lock() {
            if let Some(i) = free.iter().position(|b| b.capacity == capacity) {
                return Ok(free.swap_remove(i));
            }
        }
        Ok(PinnedBlock { ptr: result::host_malloc(capacity)? as usize, capacity })
    }

    pub(crate) fn give(&self, block: PinnedBlock) {
        if let Ok(mut free) = self.free.lock() {
            free.push(block);
        }
    }

    fn drain(&self) -> Vec<PinnedBlock> {
        self.free.lock().map(|mut f| std::mem::take(&mut *f)).unwrap_or_default()
    }
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) config: HipConfig,
    name: String,
    /// `(least, greatest)` stream priority.
    pub(crate) priorities: (i32, i32),
    /// Our own accounting of live buffers: counted when allocated, uncounted when dropped.
    counters: MemCounters,
    /// The host space's counters (`alloc_host`), in the same terms.
    host_counters: MemCounters,
    pub(crate) streams: StreamList<StreamInner>,
    /// Allocations of `Device::alloc` and their frees run here.
    internal: Arc<StreamInner>,
    pub(crate) kernels: KernelCache,
    pub(crate) pinned: Arc<PinnedPool>,
    pub(crate) parked: Parked,
    pub(crate) deferred: DeferredDrops,
    pub(crate) next_stream: AtomicUsize,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // No stream, buffer or event of this device is left, but work they
        // queued may be: wait for it before unloading the kernels it runs.
        let idle = result::set_device(self.config.ordinal).and_then(|_| result::device_synchronize());
        if idle.is_ok() {
            if let Some(k) = self.kernels.take() {
                let _ = k.unload();
            }
            for b in self.pinned.drain() {
                // SAFETY: from hipHostMalloc; the device is idle, so no copy uses it.
                let _ = unsafe { result::host_free(b.ptr() as *mut _) };
            }
        }
    }
}

/// An AMD GPU. Cheap to clone; clones are the same device.
#[derive(Clone, Debug)]
pub struct HipDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

impl HipDevice {
    /// Opens GPU `config.ordinal`: loads HIP, initializes it and creates the
    /// device's internal stream. No GPU (or no driver) is [`DeviceError::NoDevice`];
    /// no runtime is [`DeviceError::LibraryUnavailable`].
    pub fn new(config: HipConfig) -> Result<HipDevice> {
        let ordinal = config.ordinal;
        result::init().map_err(|e| match e {
            DeviceError::NoDevice { backend, visible, reason, .. } => {
                DeviceError::NoDevice { backend, ordinal, visible, reason }
            }
            other => other,
        })?;
        let visible = result::device_count()?;
        if ordinal >= visible {
            return Err(DeviceError::NoDevice {
                backend: "hip",
                ordinal,
                visible,
                reason: format!("hipGetDeviceCount reports {visible}"),
            });
        }
        result::set_device(ordinal)?;
        let name = format!("hip:{ordinal} ({})", result::device_name(ordinal)?);
        let priorities = result::stream_priority_range()?;
        let parked: Parked = Arc::default();
        let deferred: DeferredDrops = Arc::default();
        let internal = Arc::new(StreamInner::create(
            ordinal,
            format!("hip:{ordinal}/internal"),
            Priority::Normal,
            priorities.0,
            &parked,
            &deferred,
        )?);
        Ok(HipDevice {
            inner: Arc::new(DeviceInner {
                config,
                name,
                priorities,
                counters: MemCounters::default(),
                host_counters: MemCounters::default(),
                streams: StreamList::default(),
                internal,
                kernels: KernelCache::default(),
                pinned: Arc::default(),
                parked,
                deferred,
                next_stream: AtomicUsize::new(0),
            }),
        })
    }

    /// GPU `ordinal` with default settings.
    pub fn with_ordinal(ordinal: usize) -> Result<HipDevice> {
        HipDevice::new(HipConfig { ordinal, ..HipConfig::default() })
    }

    /// The settings this device was made with.
    pub fn config(&self) -> &HipConfig {
        &self.inner.config
    }

    /// Makes this device current on the calling thread (every HIP call that
    /// creates or enqueues does this first), and does the HIP work that drops
    /// inside host functions postponed. Refused inside a host function.
    pub fn bind(&self) -> Result<()> {
        result::set_device(self.inner.config.ordinal)?;
        let parked = &self.inner.parked;
        self.inner.deferred.drain(&(), |e| parked.park(e));
        Ok(())
    }

    /// Keeps an error met where it cannot be returned (a `Drop` in another
    /// crate, a watchdog): the next [`Device::synchronize`](crate::Device::synchronize) returns it.
    pub fn park_error(&self, error: DeviceError) {
        self.inner.parked.park(error);
    }

    pub(crate) fn label(&self) -> String {
        format!("hip:{}", self.inner.config.ordinal)
    }

    /// Allocates `len` elements on `home` in its stream order.
    pub(crate) fn alloc_on(&self, home: &Arc<StreamInner>, dtype: DType, len: usize) -> Result<HipBuffer> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| DeviceError::OutOfMemory { device: self.label(), bytes: usize::MAX })?;
        let ptr = if bytes == 0 {
            0
        } else {
            self.bind()?;
            // SAFETY: `home` is a live stream of this device, now current.
            unsafe { result::malloc_async(bytes, home.raw(), &self.label()) }? as usize
        };
        self.inner.counters.add(bytes);
        Ok(HipBuffer {
            ptr,
            host: None,
            bytes,
            meta: BufferMeta::new(dtype, len, next_id(), self.clone(), MemorySpace::Device),
            users: StreamUsers::new(home),
        })
    }
}

impl crate::Device for HipDevice {
    type B = Hip;

    fn name(&self) -> String {
        self.inner.name.clone()
    }
    fn ordinal(&self) -> usize {
        self.inner.config.ordinal
    }
    fn is_same(&self, other: &HipDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
    fn create_stream(&self, priority: Priority) -> Result<HipStream> {
        HipStream::create(self, priority)
    }
    fn create_event(&self) -> Result<HipEvent> {
        HipEvent::create(self)
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<HipBuffer> {
        let internal = self.inner.internal.clone();
        let buf = self.alloc_on(&internal, dtype, len)?;
        if buf.bytes > 0 {
            // SAFETY: the allocation is `bytes` long and ordered before the memset on this stream.
            unsafe { result::memset_async(buf.ptr as *mut _, 0, buf.bytes, internal.raw()) }?;
        }
        // "Usable on any stream at once": the allocation and zeroing are done before this returns.
        internal.synchronize(self.inner.config.timeout)?;
        Ok(buf)
    }
    fn memory_stats(&self) -> MemoryStats {
        self.inner.counters.stats()
    }
    fn reset_peak_memory(&self) {
        self.inner.counters.reset_peak()
    }
    fn alloc_host(&self, dtype: DType, len: usize, pinned: bool) -> Result<HipBuffer> {
        self.alloc_host_buffer(dtype, len, pinned)
    }
    fn host_memory_stats(&self) -> MemoryStats {
        self.inner.host_counters.stats()
    }
    fn reset_peak_host_memory(&self) {
        self.inner.host_counters.reset_peak()
    }
    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        let streams = self.inner.streams.live();
        let timeout = self.inner.config.timeout;
        let internal = self.inner.internal.synchronize(timeout);
        let first = internal.and(first_error(streams.iter().map(|s| s.synchronize(timeout))));
        match self.inner.parked.take_oldest() {
            Some(e) => Err(e),
            None => first,
        }
    }
}

/// Device memory of a hip device, freed in stream order when dropped.
#[derive(Debug)]
pub struct HipBuffer {
    /// The device address (0 for host buffers, reached through `host` only).
    ptr: usize,
    /// The host allocation of a non-empty host buffer (`host.rs`).
    pub(crate) host: Option<Arc<HostMemory>>,
    bytes: usize,
    meta: BufferMeta<Hip>,
    /// The stream that allocated it, where it is freed, and the others that
    /// have used it: the free waits for them.
    users: StreamUsers<StreamInner>,
}

impl HipBuffer {
    /// Takes ownership of host memory (`None` when empty) and counts it in the host counters.
    pub(crate) fn adopt_host(device: &HipDevice, host: Option<Arc<HostMemory>>, dtype: DType, len: usize) -> Self {
        let bytes = len * dtype.size();
        device.inner.host_counters.add(bytes);
        let users = StreamUsers::new(&device.inner.internal);
        HipBuffer {
            ptr: 0,
            host,
            bytes,
            meta: BufferMeta::new(dtype, len, next_id(), device.clone(), MemorySpace::Host),
            users,
        }
    }

    /// The device address of the first byte (0 for an empty buffer or a host buffer).
    pub fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Remembers that `stream` uses this buffer, so the free waits for it.
    pub(crate) fn note_use(&self, stream: &Arc<StreamInner>) {
        self.users.note(stream)
    }
}

/// The stream-ordered free of a buffer: the home stream waits for every other
/// stream that used it, then frees (`hipFreeAsync`).
fn release(ptr: usize, home: &StreamInner, users: Vec<Arc<StreamInner>>) -> Result<()> {
    for user in users {
        // The free on the home stream comes after everything the user stream has queued so far.
        let event = result::event_create()?;
        // SAFETY: live handles of this device; the event is destroyed once, after the wait is enqueued.
        let ordered = unsafe {
            result::event_record(event, user.raw()).and_then(|_| result::stream_wait_event(home.raw(), event))
        };
        // SAFETY: as above; destroying a pending event is allowed.
        let destroyed = unsafe { result::event_destroy(event) };
        ordered?;
        destroyed?;
    }
    // SAFETY: allocated by hipMallocAsync, freed once, after every use (ordered above).
    unsafe { result::free_async(ptr as *mut _, home.raw()) }
}

impl crate::Buffer for HipBuffer {
    type B = Hip;
    fn meta(&self) -> &BufferMeta<Hip> {
        &self.meta
    }
}

impl Drop for HipBuffer {
    fn drop(&mut self) {
        let inner = &self.meta.device.inner;
        if self.meta.space == MemorySpace::Host {
            if let Some(memory) = self.host.take() {
                let (home, mut users) = self.users.take();
                users.push(home);
                defer_drop(&inner.deferred, &inner.parked, inner.config.ordinal, "hipLaunchHostFunc", move || {
                    keep_alive(memory, users)
                });
            }
            inner.host_counters.sub(self.bytes);
            return;
        }
        if self.bytes > 0 {
            let (inner, ptr) = (&self.meta.device.inner, self.ptr);
            let (home, users) = self.users.take();
            // On failure the memory is leaked rather than freed while work may still use it.
            defer_drop(&inner.deferred, &inner.parked, inner.config.ordinal, "hipFreeAsync", move || {
                release(ptr, &home, users)
            });
        }
        self.meta.device.inner.counters.sub(self.bytes);
    }
}
