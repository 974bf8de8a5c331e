//! Device buffers on the stream-ordered allocator, our own accounting, and
//! the pinned host blocks that device-to-host copies land in.

use std::sync::{Arc, Mutex};

use cudarc::driver::result as drv;
use cudarc::driver::sys::{CUdeviceptr, CUevent, CUevent_flags, CUevent_wait_flags};

use super::device::{bind_ctx, defer, CudaDevice, DeviceInner};
use super::host::{keep_alive, HostMemory};
use super::result::DriverResult;
use super::stream::StreamShared;
use super::Cuda;
use crate::memory::{StreamUsers, UNKNOWN_USE};
use crate::{BufferMeta, DType, DeviceError, MemorySpace};

/// A cuda buffer: device memory from the stream-ordered allocator
/// (`cuMemAllocAsync`), freed in stream order after every stream that used
/// it; or host memory ([`MemorySpace::Host`], see `host.rs`), released the
/// same way through host functions that hold it until the streams' work is done.
///
/// The buffer remembers its *owner* stream (the one the allocation is
/// ordered on) and every other stream that enqueued work on it. Dropping it
/// records an event on each of those streams, makes the owner wait on them,
/// and enqueues `cuMemFreeAsync` on the owner: the memory returns to the pool
/// only after all queued work that touches it. Failures are parked on the
/// device (see [`CudaDevice::take_parked_errors`]); drop never panics.
#[derive(Debug)]
pub struct CudaBuffer {
    /// The device address (device memory; 0 for host buffers, which are
    /// reached through `host` only).
    pub(crate) ptr: CUdeviceptr,
    /// The host allocation of a non-empty host buffer.
    pub(crate) host: Option<Arc<HostMemory>>,
    bytes: usize,
    meta: BufferMeta<Cuda>,
    /// The owner stream and the others that used the buffer.
    users: StreamUsers<StreamShared>,
}

impl CudaBuffer {
    /// Takes ownership of `ptr` (`bytes` long, allocated in `owner`'s order) and counts it.
    pub(crate) fn adopt(
        device: &CudaDevice,
        owner: &Arc<StreamShared>,
        ptr: CUdeviceptr,
        dtype: DType,
        len: usize,
    ) -> CudaBuffer {
        let bytes = len * dtype.size();
        device.inner.counters.add(bytes);
        CudaBuffer {
            ptr,
            host: None,
            bytes,
            meta: BufferMeta::new(dtype, len, super::device::next_id(), device.clone(), MemorySpace::Device),
            users: StreamUsers::new(owner),
        }
    }

    /// Takes ownership of host memory (`None` when empty) and counts it in the host counters.
    pub(crate) fn adopt_host(device: &CudaDevice, host: Option<Arc<HostMemory>>, dtype: DType, len: usize) -> Self {
        let bytes = len * dtype.size();
        device.inner.host_counters.add(bytes);
        CudaBuffer {
            ptr: 0,
            host,
            bytes,
            meta: BufferMeta::new(dtype, len, super::device::next_id(), device.clone(), MemorySpace::Host),
            users: StreamUsers::new(&device.internal),
        }
    }

    /// The device address of the first byte (for vendor libraries such as NCCL).
    ///
    /// Valid while the buffer lives; use it only in the order of a stream
    /// that has been passed to `CudaBuffer::note_use` (chorus's own
    /// operations do this themselves).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Records that work enqueued on `stream` uses this buffer, so the
    /// stream-ordered free waits for it.
    pub(crate) fn note_use(&self, stream: &Arc<StreamShared>) {
        self.users.note(stream)
    }

    /// Places the use just noted at `position` of `stream`.
    pub(crate) fn note_use_at(&self, stream: &Arc<StreamShared>, position: u64) {
        self.users.note_at(stream, position)
    }
}

/// The stream-ordered free of a buffer: make the owner stream wait for every
/// other stream that used it, then `cuMemFreeAsync` on the owner. A user the
/// owner already waited for after its last use (FSDP's streams wait on one
/// another at every hand-over), or whose work a host wait saw finish, needs
/// no new wait. The others' waits go through the device's spare events: each
/// is recorded on a user, waited on by the owner and back in the pool at
/// once (the wait has taken the record), so a free costs at most a record
/// and a wait per other stream, no event made or destroyed.
fn release(
    ptr: CUdeviceptr,
    owner: &StreamShared,
    users: Vec<(Arc<StreamShared>, u64)>,
    inner: &DeviceInner,
) -> Result<(), DeviceError> {
    let label = inner.label.as_str();
    for (user, last_use) in users {
        if last_use != UNKNOWN_USE && owner.state.follows(&user.state, last_use) {
            // The owner already waited for this use (or a host wait saw it finish).
            continue;
        }
        let spare = inner.spare_events.lock().ok().and_then(|mut s| s.pop());
        let event = match spare {
            Some(e) => e as CUevent,
            None => drv::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).drv("cuEventCreate", label)?,
        };
        // SAFETY: live stream and event handles of the bound context.
        let waited = unsafe {
            drv::event::record(event, user.raw).drv("cuEventRecord", label).and_then(|_| {
                drv::stream::wait_event(owner.raw, event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    .drv("cuStreamWaitEvent", label)
            })
        };
        // Back to the pool whatever happened: recording it again is always allowed.
        match inner.spare_events.lock() {
            Ok(mut spare) => spare.push(event as usize),
            Err(_) => {
                // SAFETY: not in the pool, destroyed once.
                let _ = unsafe { drv::event::destroy(event) };
            }
        }
        waited?;
    }
    // SAFETY: allocated by cuMemAllocAsync, freed once, in the owner's order
    // after every user's work (the waits above).
    unsafe { drv::free_async(ptr, owner.raw) }.drv("cuMemFreeAsync", label)
}

impl crate::Buffer for CudaBuffer {
    type B = Cuda;
    fn meta(&self) -> &BufferMeta<Cuda> {
        &self.meta
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.meta.space == MemorySpace::Host {
            if let Some(memory) = self.host.take() {
                let (owner, mut users) = self.users.take();
                users.push(owner);
                defer(&self.meta.device.inner, "cuLaunchHostFunc", move |inner| {
                    bind_ctx(inner)?;
                    keep_alive(memory, users)
                });
            }
            self.meta.device.inner.host_counters.sub(self.bytes);
            return;
        }
        if self.bytes > 0 {
            let ptr = self.ptr;
            let (owner, users) = self.users.take_with_positions();
            defer(&self.meta.device.inner, "cuMemFreeAsync", move |inner| {
                bind_ctx(inner)?;
                release(ptr, &owner, users, inner)
            });
        }
        self.meta.device.inner.counters.sub(self.bytes);
    }
}

/// A page-locked host block that a device-to-host copy lands in.
#[derive(Debug)]
pub(crate) struct PinnedBlock {
    pub(crate) ptr: *mut u8,
    pub(crate) capacity: usize,
}

// SAFETY: plain host memory; access is ordered by the stream and the host
// callback that hands it back.
unsafe impl Send for PinnedBlock {}

/// Reused pinned blocks: `cuMemHostAlloc` is slow, and a host callback may
/// not call CUDA, so callbacks return blocks here instead of freeing them.
#[derive(Debug, Default)]
pub(crate) struct StagingPool {
    free: Mutex<Vec<PinnedBlock>>,
}

/// Blocks kept for reuse at most; more are freed at the next device synchronize.
const KEEP_BLOCKS: usize = 8;

impl StagingPool {
    /// A block of at least `bytes` (the device's context must be current).
    pub(crate) fn take(&self, bytes: usize, device: &str) -> Result<PinnedBlock, DeviceError> {
        if let Ok(mut free) = self.free.lock() {
            if let Some(i) = free.iter().position(|b| b.capacity >= bytes) {
                return Ok(free.swap_remove(i));
            }
        }
        let capacity = bytes.max(4096).next_power_of_two();
        // SAFETY: a fresh pinned allocation, owned by the returned block.
        let ptr = unsafe { drv::malloc_host(capacity, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE) }.drv_alloc(
            "cuMemHostAlloc",
            device,
            capacity,
        )?;
        Ok(PinnedBlock { ptr: ptr as *mut u8, capacity })
    }

    /// Returns a block (callable from a host callback: no CUDA calls).
    pub(crate) fn put(&self, block: PinnedBlock) {
        if let Ok(mut free) = self.free.lock() {
            free.push(block);
        }
    }

    /// Frees blocks beyond [`KEEP_BLOCKS`] (or all); the context must be current.
    pub(crate) fn trim(&self, keep: bool) -> Result<(), DeviceError> {
        let excess: Vec<PinnedBlock> = match self.free.lock() {
            Ok(mut free) => {
                free.sort_by_key(|b| std::cmp::Reverse(b.capacity));
                let at = if keep { KEEP_BLOCKS.min(free.len()) } else { 0 };
                free.split_off(at)
            }
            Err(_) => Vec::new(),
        };
        let mut first = Ok(());
        for b in excess {
            // SAFETY: allocated by cuMemHostAlloc, no longer referenced by any copy.
            let r = unsafe { drv::free_host(b.ptr as *mut std::ffi::c_void) }.drv("cuMemFreeHost", "");
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}
