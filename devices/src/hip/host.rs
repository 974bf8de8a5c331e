//! The hip device's host memory space ([`MemorySpace::Host`]): pinned
//! blocks from `hipHostMalloc` or pageable ones from the heap, their
//! stream-ordered release, and the copies that reach them — the cuda
//! device's design (`cuda/host.rs`) on HIP:
//! - device ↔ pinned: one `hipMemcpyAsync`, asynchronous;
//! - device ↔ pageable: staged through a pinned block of the device's pool
//!   by host work in stream order (a direct copy from pageable memory would
//!   read the bytes when called, before earlier work has written them);
//! - host ↔ host, `copy_from_host` / `copy_to_host` of a host buffer: host
//!   work (`memmove` in stream order; no HIP call);
//! - kernels, fills and vendor work on a host buffer are refused.

use std::ffi::c_void;
use std::sync::Arc;

use super::device::{defer_drop, DeferredDrops, HipBuffer, HipDevice, Parked};
use super::stream::{host_outcome, HipStream, StreamInner};
use super::sys::{self, hipMemcpyKind};
use super::{result, Hip};
use crate::bookkeeping::first_error;
use crate::host_alloc;
use crate::host_update::{self, HeldRange};
use crate::{host_fn, Copy2d, DType, DeviceError, MemorySpace, Readback, Result, View};

/// One host allocation; freed when the last holder lets go (the buffer and
/// the keep-alive host work its drop enqueues on every stream that used it).
pub(crate) struct HostMemory {
    ptr: *mut u8,
    /// `None` when pinned (`hipHostMalloc`), else the pageable block.
    pageable: Option<Vec<u64>>,
    deferred: DeferredDrops,
    parked: Parked,
    ordinal: usize,
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMemory(pinned: {})", self.pageable.is_none())
    }
}

// SAFETY: plain host memory; every access is ordered by a stream (copies and
// host work enqueued on it) or happens after a host wait.
unsafe impl Send for HostMemory {}
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn pinned(&self) -> bool {
        self.pageable.is_none()
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.pinned() {
            let ptr = self.ptr as usize;
            defer_drop(&self.deferred, &self.parked, self.ordinal, "hipHostFree", move || {
                // SAFETY: from hipHostMalloc, freed once; the last holder is
                // gone, so no queued copy refers to it.
                unsafe { result::host_free(ptr as *mut c_void) }
            });
        }
    }
}

/// Enqueues on each stream host work holding `memory`, so it is freed only
/// after all work those streams had queued. A stream whose launch fails
/// keeps the memory forever: a leak, never a free under a queued copy.
/// The device must be current.
pub(crate) fn keep_alive(memory: Arc<HostMemory>, streams: Vec<Arc<StreamInner>>) -> Result<()> {
    first_error(streams.into_iter().map(|s| {
        let held = memory.clone();
        // SAFETY: a live stream of the current device.
        unsafe { result::launch_host_work(s.raw(), Box::new(move |_| drop(held))) }.map_err(|(e, work)| {
            std::mem::forget(work);
            e
        })
    }))
}

impl HipDevice {
    /// `Device::alloc_host`: zeroed host memory, counted in the host counters.
    pub(crate) fn alloc_host_buffer(&self, dtype: DType, len: usize, pinned: bool) -> Result<HipBuffer> {
        host_fn::check("alloc_host")?;
        let label = self.label();
        let bytes = host_alloc::host_bytes(&label, dtype, len)?;
        let memory = if bytes == 0 {
            None
        } else {
            let inner = &self.inner;
            let (ptr, pageable) = if pinned {
                self.bind()?;
                let ptr = result::host_malloc(bytes)? as *mut u8;
                // SAFETY: `bytes` writable bytes just allocated; no copy uses them yet.
                unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
                (ptr, None)
            } else {
                let mut block = host_alloc::pageable_block(&label, bytes)?;
                (block.as_mut_ptr() as *mut u8, Some(block))
            };
            Some(Arc::new(HostMemory {
                ptr,
                pageable,
                deferred: inner.deferred.clone(),
                parked: inner.parked.clone(),
                ordinal: inner.config.ordinal,
            }))
        };
        Ok(HipBuffer::adopt_host(self, memory, dtype, len))
    }
}

fn host_of<'a>(v: &View<'a, Hip>) -> Option<&'a Arc<HostMemory>> {
    v.buffer().host.as_ref()
}

fn host_addr(memory: &HostMemory, v: &View<'_, Hip>) -> usize {
    memory.ptr as usize + v.byte_range().start
}

/// Whether a view is of a host buffer.
pub(super) fn in_host(v: &View<'_, Hip>) -> bool {
    crate::Buffer::space(v.buffer()) == MemorySpace::Host
}

impl HipStream {
    /// `Stream::update_on_host`: host work gives `f` the host bytes in stream
    /// order, holding the allocations until it has run (the cuda device's design).
    pub(super) fn update_host_memory(
        &self,
        reads: &[View<'_, Hip>],
        writes: &[View<'_, Hip>],
        f: crate::HostUpdate,
    ) -> Result<()> {
        let op = "update_on_host";
        crate::checks::update_on_host(reads, writes)?;
        let held = |v: &View<'_, Hip>| HeldRange::new(host_of(v), host_of(v).map_or(0, |m| host_addr(m, v)), v.bytes());
        let read: Vec<_> = reads.iter().map(held).collect();
        let written: Vec<_> = writes.iter().map(held).collect();
        let views: Vec<View<'_, Hip>> = reads.iter().chain(writes).copied().collect();
        self.host_work_failing(op, &views, move || {
            // SAFETY: the ranges lie in the allocations they hold; the work runs in
            // stream order; written ranges overlap nothing else (checked).
            unsafe { host_update::run(&read, &written, f) }
        })
    }

    /// Host work doing `f` in stream order, skipped when earlier work failed.
    fn host_job(&self, op: &'static str, views: &[View<'_, Hip>], f: impl FnOnce() + Send + 'static) -> Result<()> {
        self.host_work_failing(op, views, move || {
            f();
            Ok(())
        })
    }

    /// [`HipStream::host_job`] whose error (or panic) fails the stream from its position on.
    fn host_work_failing(
        &self,
        op: &'static str,
        views: &[View<'_, Hip>],
        f: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Result<()> {
        host_fn::check(op)?;
        for v in views {
            crate::checks::on_device(op, &self.device, v)?;
        }
        let at = self.inner.state.advance();
        if self.inner.state.own_failure().is_some() {
            return Ok(());
        }
        self.device.bind()?;
        let state = self.inner.state.clone();
        self.host_work(Box::new(move |outcome| {
            if host_outcome(outcome, &state, at, op).is_err() {
                return;
            }
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => state.fail(at, e),
                Err(_) => state.fail(at, DeviceError::invalid(op, "the host work panicked")),
            }
        }))
    }

    /// One `hipMemcpyAsync` between device memory and pinned host memory.
    fn dma(
        &self,
        op: &'static str,
        views: [View<'_, Hip>; 2],
        dst: usize,
        src: usize,
        kind: hipMemcpyKind,
    ) -> Result<()> {
        for v in &views {
            crate::checks::on_device(op, &self.device, v)?;
            v.buffer().note_use(&self.inner);
        }
        let bytes = views[1].bytes();
        self.enqueue(|stream| {
            // SAFETY: device and pinned ranges of `bytes`, kept alive past the
            // copy by their stream-ordered release, ordered on this stream.
            unsafe { result::memcpy_async(dst as *mut c_void, src as *const c_void, bytes, kind, stream) }
        })
    }

    /// `copy` where at least one side is in host memory.
    pub(super) fn copy_host(&self, src: View<'_, Hip>, dst: View<'_, Hip>) -> Result<()> {
        let (op, bytes) = ("copy", dst.bytes());
        if bytes == 0 || src.same_range(&dst) {
            return self.host_job(op, &[src, dst], || {});
        }
        let dev_addr = |v: &View<'_, Hip>| v.buffer().device_ptr() as usize + v.byte_range().start;
        match (host_of(&src).cloned(), host_of(&dst).cloned()) {
            (Some(from), Some(to)) => {
                let (s_at, d_at) = (host_addr(&from, &src), host_addr(&to, &dst));
                self.host_job(op, &[src, dst], move || {
                    // SAFETY: both ranges lie in live allocations (held here); they may overlap.
                    unsafe { std::ptr::copy(s_at as *const u8, d_at as *mut u8, bytes) };
                    drop((from, to));
                })
            }
            (Some(from), None) if from.pinned() => {
                self.dma(op, [src, dst], dev_addr(&dst), host_addr(&from, &src), sys::hipMemcpyHostToDevice)
            }
            (None, Some(to)) if to.pinned() => {
                self.dma(op, [src, dst], host_addr(&to, &dst), dev_addr(&src), sys::hipMemcpyDeviceToHost)
            }
            (Some(from), None) => {
                let pool = self.device.inner.pinned.clone();
                self.device.bind()?;
                let block = pool.take(bytes)?;
                let (block_at, s_at) = (block.ptr() as usize, host_addr(&from, &src));
                self.host_job(op, &[src], move || {
                    // SAFETY: the block is ours until it is given back below; the source is live.
                    unsafe { std::ptr::copy_nonoverlapping(s_at as *const u8, block_at as *mut u8, bytes) };
                    drop(from);
                })?;
                // On an error the fill above may still be queued: the block is
                // then not given back (a leak), so no other copy gets it under it.
                self.dma(op, [dst, dst], dev_addr(&dst), block_at, sys::hipMemcpyHostToDevice)?;
                self.host_job(op, &[], move || pool.give(block))
            }
            (None, Some(to)) => {
                let pool = self.device.inner.pinned.clone();
                self.device.bind()?;
                let block = pool.take(bytes)?;
                let (block_at, d_at) = (block.ptr() as usize, host_addr(&to, &dst));
                if let Err(e) = self.dma(op, [src, src], block_at, dev_addr(&src), sys::hipMemcpyDeviceToHost) {
                    pool.give(block);
                    return Err(e);
                }
                let (state, at) = (self.inner.state.clone(), self.inner.state.advance());
                self.host_work(Box::new(move |outcome| {
                    if host_outcome(outcome, &state, at, op).is_ok() {
                        // SAFETY: the copy into the block has run (stream order); the destination is live.
                        unsafe { std::ptr::copy_nonoverlapping(block_at as *const u8, d_at as *mut u8, bytes) };
                    }
                    drop(to);
                    pool.give(block);
                }))
            }
            (None, None) => Err(DeviceError::invalid(op, "copy_host with no host operand")),
        }
    }

    /// `copy_2d` with a host side: block by block through [`HipStream::copy_host`].
    pub(super) fn copy_2d_host(&self, src: View<'_, Hip>, dst: View<'_, Hip>, layout: Copy2d) -> Result<()> {
        for i in 0..layout.rows {
            let from = src.slice(layout.src_offset + i * layout.src_stride, layout.row_len)?;
            let to = dst.slice(layout.dst_offset + i * layout.dst_stride, layout.row_len)?;
            self.copy_host(from, to)?;
        }
        Ok(())
    }

    /// `copy_from_host` into a host buffer: captured now, written in stream order.
    pub(super) fn copy_from_host_to_host(&self, src: &[u8], dst: View<'_, Hip>) -> Result<()> {
        let op = "copy_from_host";
        let Some(to) = host_of(&dst).cloned() else { return self.host_job(op, &[dst], || {}) };
        let (data, d_at) = (src.to_vec(), host_addr(&to, &dst));
        self.host_job(op, &[dst], move || {
            // SAFETY: `data.len()` is the view's byte length (checked), inside a live allocation.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), d_at as *mut u8, data.len()) };
            drop(to);
        })
    }

    /// `copy_to_host` of a host buffer: host work reads it in stream order.
    pub(super) fn copy_host_to_host(&self, src: View<'_, Hip>) -> Result<Readback> {
        let op = "copy_to_host";
        host_fn::check(op)?;
        crate::checks::on_device(op, &self.device, &src)?;
        let (readback, filler) = Readback::pending(src.dtype(), src.len(), self.timeout());
        let Some(from) = host_of(&src).cloned() else {
            filler.fill(Vec::new());
            return Ok(readback);
        };
        let (s_at, bytes) = (host_addr(&from, &src), src.bytes());
        let at = self.inner.state.advance();
        if let Some(e) = self.inner.state.own_failure() {
            filler.fail(crate::failure::poisoned(&e));
            return Ok(readback);
        }
        self.device.bind()?;
        let state = self.inner.state.clone();
        self.host_work(Box::new(move |outcome| {
            match host_outcome(outcome, &state, at, op) {
                // SAFETY: the range lies in a live allocation (held here), written by earlier work.
                Ok(()) => filler.fill(unsafe { std::slice::from_raw_parts(s_at as *const u8, bytes) }.to_vec()),
                Err(e) => filler.fail(e),
            }
            drop(from);
        }))?;
        Ok(readback)
    }
}
