//! The cuda device's host memory space ([`MemorySpace::Host`]): pinned
//! blocks from `cuMemHostAlloc` or pageable ones from the heap, their
//! stream-ordered release, and the copies that reach them.
//!
//! Which copy does what:
//! - device ↔ pinned: one `cuMemcpyAsync` on the stream (unified addressing
//!   makes a pinned host pointer a valid copy operand), asynchronous;
//! - device ↔ pageable: **staged** through a pinned block of the device's
//!   staging pool, so the copy keeps its place in stream order (a direct
//!   `cuMemcpyHtoDAsync` from pageable memory would read the bytes when it
//!   is called, before earlier work on the stream has written them): a host
//!   function copies between the pageable buffer and the block, the DMA
//!   copy moves the block;
//! - host ↔ host, [`Stream::copy_from_host`](crate::Stream::copy_from_host)
//!   and [`Stream::copy_to_host`](crate::Stream::copy_to_host) of a host
//!   buffer: a host function (`memmove` in stream order; no CUDA call);
//! - kernels, fills and vendor work on a host buffer are refused
//!   ([`crate::Device::kernels_reach_host`] is false).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as drv;
use cudarc::driver::sys::{self, CUdeviceptr, CUmemorytype, CUstream, CUDA_MEMCPY2D};

use super::device::{bind_ctx, defer, CudaDevice, DeviceInner};
use super::memory::CudaBuffer;
use super::result::DriverResult;
use super::stream::{device_ptr, CudaStream, StreamShared};
use super::Cuda;
use crate::bookkeeping::first_error;
use crate::host_alloc;
use crate::host_update::{self, HeldRange};
use crate::{host_fn, Copy2d, DType, DeviceError, MemorySpace, Readback, Result, View};

/// One host allocation; freed when the last holder lets go (the buffer and
/// the keep-alive host functions its drop enqueues on every stream that
/// used it).
pub(crate) struct HostMemory {
    ptr: *mut u8,
    bytes: usize,
    /// `None` when pinned (`cuMemHostAlloc`), else the pageable block.
    pageable: Option<Vec<u64>>,
    device: Arc<DeviceInner>,
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMemory({} bytes, pinned: {})", self.bytes, self.pageable.is_none())
    }
}

// SAFETY: plain host memory; every access is ordered by a stream (copies and
// host functions enqueued on it) or happens after a host wait.
unsafe impl Send for HostMemory {}
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// `bytes` (> 0) zeroed bytes of host memory of `device`.
    pub(crate) fn alloc(device: &CudaDevice, bytes: usize, pinned: bool) -> Result<HostMemory> {
        let label = device.label();
        if !pinned {
            let mut block = host_alloc::pageable_block(label, bytes)?;
            let ptr = block.as_mut_ptr() as *mut u8;
            return Ok(HostMemory { ptr, bytes, pageable: Some(block), device: device.inner.clone() });
        }
        device.bind()?;
        // SAFETY: a fresh allocation, owned by the returned value and freed once in its drop.
        let ptr = unsafe { drv::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.drv_alloc(
            "cuMemHostAlloc",
            label,
            bytes,
        )? as *mut u8;
        // SAFETY: `bytes` writable bytes just allocated; no copy uses them yet.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(HostMemory { ptr, bytes, pageable: None, device: device.inner.clone() })
    }

    fn pinned(&self) -> bool {
        self.pageable.is_none()
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.pinned() {
            let ptr = self.ptr as usize;
            // Inside a host function (a keep-alive job was the last holder)
            // the free waits for the next bind on an ordinary thread.
            defer(&self.device, "cuMemFreeHost", move |inner| {
                bind_ctx(inner)?;
                // SAFETY: allocated by cuMemHostAlloc, freed once; the last
                // holder is gone, so no queued copy refers to it.
                unsafe { drv::free_host(ptr as *mut c_void) }.drv("cuMemFreeHost", "host memory")
            });
        }
    }
}

/// The host function that drops one holder of a host allocation.
unsafe extern "C" fn release_trampoline(data: *mut c_void) {
    // SAFETY: `data` is the Box leaked by `keep_alive`, given to exactly one call.
    let held = unsafe { Box::from_raw(data as *mut Arc<HostMemory>) };
    // The drop of the last holder defers its driver call (marked thread).
    let _ = host_fn::run(move || drop(held));
}

/// Enqueues on each stream a host function holding `memory`, so it is freed
/// only after all work those streams had queued (the stream-ordered release
/// of a host buffer). A stream whose launch fails keeps the memory forever:
/// a leak, never a free under a queued copy.
pub(crate) fn keep_alive(memory: Arc<HostMemory>, streams: Vec<Arc<StreamShared>>) -> Result<()> {
    first_error(streams.into_iter().map(|s| {
        let held = Box::into_raw(Box::new(memory.clone()));
        // SAFETY: `held` goes to exactly one trampoline call, which frees it.
        // On an error `held` stays leaked: the memory is never freed.
        unsafe { drv::stream::launch_host_function(s.raw, release_trampoline, held as *mut c_void) }
            .drv("cuLaunchHostFunc", s.name())
    }))
}

impl CudaDevice {
    /// `Device::alloc_host`: zeroed host memory, counted in the host counters.
    pub(crate) fn alloc_host_buffer(&self, dtype: DType, len: usize, pinned: bool) -> Result<CudaBuffer> {
        host_fn::check("alloc_host")?;
        let bytes = host_alloc::host_bytes(self.label(), dtype, len)?;
        let memory = if bytes == 0 { None } else { Some(Arc::new(HostMemory::alloc(self, bytes, pinned)?)) };
        Ok(CudaBuffer::adopt_host(self, memory, dtype, len))
    }
}

/// The host allocation behind a view (`None`: device memory, or empty).
fn host_of<'a>(v: &View<'a, Cuda>) -> Option<&'a Arc<HostMemory>> {
    v.buffer().host.as_ref()
}

/// The host address of a host view's first byte.
fn host_addr(memory: &HostMemory, v: &View<'_, Cuda>) -> usize {
    memory.ptr as usize + v.byte_range().start
}

impl CudaStream {
    /// `copy` where at least one side is in host memory (checked by the caller).
    pub(super) fn copy_host(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        let op = "copy";
        let bytes = dst.bytes();
        if bytes == 0 || src.same_range(&dst) {
            return self.run_copy(op, &[src, dst], |_| Ok(()));
        }
        match (host_of(&src), host_of(&dst)) {
            (Some(from), Some(to)) => {
                let (from, to) = (from.clone(), to.clone());
                let (s_at, d_at) = (host_addr(&from, &src), host_addr(&to, &dst));
                self.host_job(op, &[src, dst], move || {
                    // SAFETY: both ranges lie in live allocations (held here)
                    // and earlier stream work on them is done; they may overlap.
                    unsafe { std::ptr::copy(s_at as *const u8, d_at as *mut u8, bytes) };
                    drop((from, to));
                })
            }
            (Some(from), None) if from.pinned() => {
                self.pinned_copy(src, dst, device_ptr(&dst), host_addr(from, &src) as CUdeviceptr)
            }
            (None, Some(to)) if to.pinned() => {
                self.pinned_copy(src, dst, host_addr(to, &dst) as CUdeviceptr, device_ptr(&src))
            }
            (Some(from), None) => self.pageable_to_device(from.clone(), src, dst),
            (None, Some(to)) => self.device_to_pageable(src, to.clone(), dst),
            (None, None) => Err(DeviceError::invalid(op, "copy_host with no host operand")),
        }
    }

    /// `copy` of `dst`'s bytes from `from` to `to`, one a pinned range and
    /// the other a device range: one `cuMemcpyAsync` on the stream.
    fn pinned_copy(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>, to: CUdeviceptr, from: CUdeviceptr) -> Result<()> {
        let (bytes, label) = (dst.bytes(), self.device.label());
        self.run_copy("copy", &[src, dst], |s| {
            // SAFETY: a pinned range and a device range of `bytes` (the
            // caller's views), valid in stream order.
            unsafe { memcpy(to, from, bytes, s) }.drv("cuMemcpyAsync", label)
        })
    }

    /// `copy_2d` where at least one side is in host memory: one
    /// `cuMemcpy2DAsync` between pinned and device memory, else block by
    /// block through [`CudaStream::copy_host`].
    pub(super) fn copy_2d_host(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>, layout: Copy2d) -> Result<()> {
        let op = "copy_2d";
        let size = src.dtype().size();
        let width = layout.row_len * size;
        let (sp, dp) = (host_of(&src), host_of(&dst));
        let pinned_and_device = match (sp, dp) {
            (Some(h), None) | (None, Some(h)) => h.pinned(),
            _ => false,
        };
        let (src_pitch, dst_pitch) = (layout.src_stride * size, layout.dst_stride * size);
        let max = crate::api::MAX_COPY_PITCH_BYTES;
        let pitches_fit = src_pitch >= width && dst_pitch >= width && src_pitch <= max && dst_pitch <= max;
        if !pinned_and_device || layout.rows <= 1 || width == 0 || !pitches_fit {
            for i in 0..layout.rows {
                let from = src.slice(layout.src_offset + i * layout.src_stride, layout.row_len)?;
                let to = dst.slice(layout.dst_offset + i * layout.dst_stride, layout.row_len)?;
                self.copy_host(from, to)?;
            }
            return Ok(());
        }
        let side = |v: &View<'_, Cuda>, h: Option<&Arc<HostMemory>>| match h {
            Some(m) => (CUmemorytype::CU_MEMORYTYPE_HOST, host_addr(m, v), 0),
            None => (CUmemorytype::CU_MEMORYTYPE_DEVICE, 0, device_ptr(v)),
        };
        let ((s_type, s_host, s_dev), (d_type, d_host, d_dev)) = (side(&src, sp), side(&dst, dp));
        let copy = CUDA_MEMCPY2D {
            srcXInBytes: layout.src_offset * size,
            srcY: 0,
            srcMemoryType: s_type,
            srcHost: s_host as *const c_void,
            srcDevice: s_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: layout.dst_offset * size,
            dstY: 0,
            dstMemoryType: d_type,
            dstHost: d_host as *mut c_void,
            dstDevice: d_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: layout.rows,
        };
        let label = self.device.label();
        self.run_copy(op, &[src, dst], |s| {
            // SAFETY: a fully initialized descriptor of ranges inside the
            // views (checked by the caller): pinned host memory and device
            // memory, both valid in stream order.
            unsafe { sys::cuMemcpy2DAsync_v2(&copy, s) }.result().drv("cuMemcpy2DAsync", label)
        })
    }

    /// A pageable source: a host function fills a pinned block, the DMA
    /// copy moves it, a last host function returns the block to the pool.
    fn pageable_to_device(&self, from: Arc<HostMemory>, src: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        let (op, bytes) = ("copy", dst.bytes());
        let pool = self.device.inner.staging.clone();
        self.device.bind()?;
        let block = pool.take(bytes, self.device.label())?;
        let (block_at, s_at) = (block.ptr as usize, host_addr(&from, &src));
        self.host_job(op, &[src], move || {
            // SAFETY: the block holds at least `bytes` and is ours until the
            // last job below; the source is live (held) and written by now.
            unsafe { std::ptr::copy_nonoverlapping(s_at as *const u8, block_at as *mut u8, bytes) };
            drop(from);
        })?;
        let label = self.device.label();
        let copied = self.run_copy(op, &[dst], |s| {
            // SAFETY: a pinned block and a device range of `bytes`, in stream order.
            unsafe { memcpy(device_ptr(&dst), block_at as CUdeviceptr, bytes, s) }.drv("cuMemcpyAsync", label)
        });
        // On an error the fill job above may still be queued: the block is
        // then not returned to the pool (a leak), so no other copy gets it under it.
        copied?;
        self.launch_host_job(op, Box::new(move |_| pool.put(block)))
    }

    /// A pageable destination: the DMA copy fills a pinned block, a host
    /// function moves it into the buffer and returns the block.
    fn device_to_pageable(&self, src: View<'_, Cuda>, to: Arc<HostMemory>, dst: View<'_, Cuda>) -> Result<()> {
        let (op, bytes) = ("copy", dst.bytes());
        let pool = self.device.inner.staging.clone();
        self.device.bind()?;
        let block = pool.take(bytes, self.device.label())?;
        let block_at = block.ptr as usize;
        let label = self.device.label();
        let copied = self.run_copy(op, &[src], |s| {
            // SAFETY: a device range and a pinned block of `bytes`, in stream order.
            unsafe { memcpy(block_at as CUdeviceptr, device_ptr(&src), bytes, s) }.drv("cuMemcpyAsync", label)
        });
        if let Err(e) = copied {
            pool.put(block);
            return Err(e);
        }
        let d_at = host_addr(&to, &dst);
        self.launch_host_job(
            op,
            Box::new(move |outcome| {
                if outcome.is_ok() {
                    // SAFETY: the DMA copy into the block has completed (stream
                    // order); the destination is live (held here).
                    unsafe { std::ptr::copy_nonoverlapping(block_at as *const u8, d_at as *mut u8, bytes) };
                }
                drop(to);
                pool.put(block);
            }),
        )
    }

    /// `copy_from_host` into a host buffer: the bytes are captured now and
    /// written in stream order by a host function.
    pub(super) fn copy_from_host_to_host(&self, src: &[u8], dst: View<'_, Cuda>) -> Result<()> {
        let op = "copy_from_host";
        let Some(to) = host_of(&dst).cloned() else {
            return self.run_copy(op, &[dst], |_| Ok(()));
        };
        let data = src.to_vec();
        let d_at = host_addr(&to, &dst);
        self.host_job(op, &[dst], move || {
            // SAFETY: `data.len()` is the view's byte length (checked), inside a live allocation.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), d_at as *mut u8, data.len()) };
            drop(to);
        })
    }

    /// `copy_to_host` of a host buffer: a host function reads it in stream order.
    pub(super) fn copy_host_to_host(&self, src: View<'_, Cuda>) -> Result<Readback> {
        let op = "copy_to_host";
        host_fn::check(op)?;
        crate::checks::on_device(op, &self.device, &src)?;
        let (readback, filler) = Readback::pending(src.dtype(), src.len(), self.device.config().timeout);
        let Some(from) = host_of(&src).cloned() else {
            filler.fill(Vec::new());
            return Ok(readback);
        };
        let (s_at, bytes) = (host_addr(&from, &src), src.bytes());
        self.launch_host_job(
            op,
            Box::new(move |outcome| {
                match outcome {
                    // SAFETY: the range lies in a live allocation (held here),
                    // written by every earlier operation of the stream.
                    Ok(()) => filler.fill(unsafe { std::slice::from_raw_parts(s_at as *const u8, bytes) }.to_vec()),
                    Err(e) => filler.fail(e),
                }
                drop(from);
            }),
        )?;
        Ok(readback)
    }

    /// `Stream::update_on_host`: a host function gives `f` the host bytes in
    /// stream order, holding the allocations until it has run.
    pub(super) fn update_host_memory(
        &self,
        reads: &[View<'_, Cuda>],
        writes: &[View<'_, Cuda>],
        f: crate::HostUpdate,
    ) -> Result<()> {
        let op = "update_on_host";
        host_fn::check(op)?;
        crate::checks::update_on_host(reads, writes)?;
        for v in reads.iter().chain(writes) {
            crate::checks::on_device(op, &self.device, v)?;
        }
        let held =
            |v: &View<'_, Cuda>| HeldRange::new(host_of(v), host_of(v).map_or(0, |m| host_addr(m, v)), v.bytes());
        let read: Vec<_> = reads.iter().map(held).collect();
        let written: Vec<_> = writes.iter().map(held).collect();
        self.launch_host_work(
            op,
            Box::new(move |outcome| match outcome {
                // SAFETY: the ranges lie in the allocations they hold; the host function
                // runs in stream order; written ranges overlap nothing else (checked).
                Ok(()) => unsafe { host_update::run(&read, &written, f) },
                Err(_) => Ok(()),
            }),
        )
    }

    /// A host function doing `f` on host memory in stream order (skipped
    /// when earlier work failed), after checking `views` like every operation.
    fn host_job(&self, op: &'static str, views: &[View<'_, Cuda>], f: impl FnOnce() + Send + 'static) -> Result<()> {
        for v in views {
            crate::checks::on_device(op, &self.device, v)?;
        }
        self.launch_host_job(
            op,
            Box::new(move |outcome| {
                if outcome.is_ok() {
                    f()
                }
            }),
        )
    }
}

/// `cuMemcpyAsync`: the direction is inferred from the addresses (unified
/// addressing; pinned host memory is a valid operand).
///
/// # Safety
/// Both ranges must be valid for `bytes` when the copy runs in `stream`'s order.
unsafe fn memcpy(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<(), drv::DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }.result()
}

/// Whether a buffer is in host memory (for the kernel refusal).
pub(super) fn in_host(v: &View<'_, Cuda>) -> bool {
    crate::Buffer::space(v.buffer()) == MemorySpace::Host
}
