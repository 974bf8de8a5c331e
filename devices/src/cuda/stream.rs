//! Streams of the cuda device: CUDA streams with priorities, host waits with
//! deadlines, host functions that never call the driver, sticky host-seen
//! failures, and every stream operation.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::result::{self as drv, stream::StreamKind};
use cudarc::driver::sys::{CUdeviceptr, CUevent_wait_flags, CUmemorytype, CUresult, CUstream, CUDA_MEMCPY2D};

use super::blas::BlasHandle;
use super::device::{bind_ctx, defer, next_id, CudaDevice, DeviceInner};
use super::event::CudaEvent;
use super::kernels::{code, Args, REDUCE_BLOCK};
use super::memory::CudaBuffer;
use super::result::{self as res, DriverResult};
use super::Cuda;
use crate::failure::{poisoned, StreamState};
use crate::gpu_batch::{self, CopyPiece, FillPiece, Step};
use crate::{checks, host_fn, wait};
use crate::{Copy2d, Copy2dPiece, DType, DeviceError, Priority, Readback, Result, Scalar, View};

pub(crate) struct StreamShared {
    pub(crate) raw: CUstream,
    pub(crate) id: u64,
    pub(crate) priority: Priority,
    pub(crate) device: Arc<DeviceInner>,
    /// Position and failures, shared with host functions and watchdogs.
    pub(crate) state: Arc<StreamState>,
    pub(super) blas: Mutex<Option<BlasHandle>>,
}

impl std::fmt::Debug for StreamShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamShared({})", self.state.name)
    }
}

// SAFETY: the stream handle is a driver handle usable from any thread once
// the context is bound; the rest is synchronized.
unsafe impl Send for StreamShared {}
unsafe impl Sync for StreamShared {}

impl StreamShared {
    pub(crate) fn create(device: &Arc<DeviceInner>, priority: Priority, label: &str) -> Result<Arc<StreamShared>> {
        bind_ctx(device)?;
        let index = device.next_stream.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dev = &device.label;
        let prio = match priority {
            Priority::Normal => device.priorities.0,
            Priority::High => device.priorities.1,
        };
        let raw =
            drv::stream::create_with_priority(StreamKind::NonBlocking, prio).drv("cuStreamCreateWithPriority", dev)?;
        let suffix = if priority == Priority::High { " (high)" } else { "" };
        let shared = Arc::new(StreamShared {
            raw,
            id: next_id(),
            priority,
            device: device.clone(),
            state: StreamState::new(format!("{dev}/{label}{index}{suffix}")),
            blas: Mutex::new(None),
        });
        device.streams.add(&shared);
        Ok(shared)
    }

    pub(crate) fn name(&self) -> &str {
        &self.state.name
    }

    fn label(&self) -> &str {
        &self.device.label
    }

    /// Blocks the host until the work enqueued so far has run, a failure is
    /// known, or the device's deadline passes. Polls the driver and the
    /// host-seen failures; it never runs anything else.
    pub(crate) fn host_wait(&self, device: &CudaDevice) -> Result<()> {
        let upto = self.state.position();
        device.bind()?;
        wait::poll_until(device.config().timeout, &format!("{} to finish", self.name()), || {
            if let Some(e) = self.state.failure_at(upto) {
                return Err(e);
            }
            // SAFETY: a live stream of the bound context.
            match unsafe { cudarc::driver::sys::cuStreamQuery(self.raw) }.result() {
                Ok(()) => {
                    // A watchdog may have failed the work just before it completed.
                    if let Some(e) = self.state.failure_at(upto) {
                        return Err(e);
                    }
                    self.state.mark_synced(upto);
                    Ok(true)
                }
                Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                Err(e) => {
                    // A device fault: sticky for the whole context, so for every position.
                    let err = res::driver("cuStreamQuery", e, self.label(), 0);
                    self.state.fail(0, err.clone());
                    Err(err)
                }
            }
        })
    }
}

impl Drop for StreamShared {
    fn drop(&mut self) {
        // Work still queued finishes: CUDA releases a destroyed stream's
        // resources after its work completes. Inside a host function the
        // destruction waits for a thread that may call the driver.
        let raw = self.raw as usize;
        let blas = self.blas.lock().ok().and_then(|mut b| b.take());
        defer(&self.device, "cuStreamDestroy", move |device| {
            bind_ctx(device)?;
            let b = blas.map(BlasHandle::destroy).unwrap_or(Ok(()));
            // SAFETY: destroyed once, here.
            let s = unsafe { drv::stream::destroy(raw as CUstream) }.drv("cuStreamDestroy", &device.label);
            b.and(s)
        });
    }
}

/// A stream of a cuda device: a CUDA stream created with
/// `cuStreamCreateWithPriority` (non-blocking with respect to the legacy
/// default stream).
#[derive(Debug)]
pub struct CudaStream {
    pub(crate) shared: Arc<StreamShared>,
    pub(super) device: CudaDevice,
}

/// A temporary device copy of an input that overlaps an output, freed in
/// stream order after the kernel that reads it.
pub(super) struct Staged {
    ptr: CUdeviceptr,
    stream: CUstream,
    device: CudaDevice,
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by cuMemAllocAsync on `stream`, freed once in its order.
            if let Err(e) = unsafe { drv::free_async(self.ptr, self.stream) }.drv("cuMemFreeAsync", "staging") {
                self.device.park(e);
            }
        }
    }
}

/// A host function's work: told the stream's failure before it, if any; an
/// error it returns fails the stream from its position on.
pub(super) type HostWork = Box<dyn FnOnce(Result<()>) -> Result<()> + Send>;

/// A host function in flight: the closure, and where on which stream it runs.
struct HostJob {
    f: HostWork,
    state: Arc<StreamState>,
    position: u64,
}

/// The host function every chorus host job runs through. It runs on a CUDA
/// driver thread and so must not call CUDA: it marks the thread (so any
/// driver entry point reached from here refuses, and drops defer their
/// driver calls), consults only host-side failure state, and runs the job.
unsafe extern "C" fn host_fn_trampoline(data: *mut c_void) {
    // SAFETY: `data` is the Box leaked by `launch_host_job`, given to exactly one call.
    let job = unsafe { Box::from_raw(data as *mut HostJob) };
    let (state, position) = (job.state.clone(), job.position);
    let ran = host_fn::run(move || {
        let HostJob { f, state, position } = *job;
        match state.failure_at(position) {
            Some(e) => f(Err(poisoned(&e))),
            None => f(Ok(())),
        }
    });
    match ran {
        Ok(Ok(())) => {}
        Ok(Err(e)) => state.fail(position, e),
        Err(panic) => {
            state.fail(position, DeviceError::invalid("launch_host_fn", format!("the host function panicked: {panic}")))
        }
    }
}

/// The device address of a view's first element.
pub fn device_ptr(v: &View<'_, Cuda>) -> CUdeviceptr {
    v.buffer().ptr + v.byte_range().start as u64
}

impl CudaStream {
    pub(crate) fn create(device: &CudaDevice, priority: Priority) -> Result<CudaStream> {
        let shared = StreamShared::create(&device.inner, priority, "stream")?;
        Ok(CudaStream { shared, device: device.clone() })
    }

    /// A process-unique id of this stream.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The driver handle. Vendor libraries enqueue through
    /// [`ForeignBackend::enqueue_foreign`](crate::ForeignBackend::enqueue_foreign)
    /// instead, which keeps the buffers alive and the failures tracked.
    pub fn raw(&self) -> CUstream {
        self.shared.raw
    }

    /// Enqueues one operation: checks that `views` are of this device, in
    /// device memory (kernels and vendor work never reach host memory) and
    /// that this is not a host function, notes the views as used (so their
    /// stream-ordered frees wait for this stream), binds the context and
    /// calls `f` with the stream handle. Returns `Ok(None)` without calling
    /// `f` when the stream has already failed (the work is skipped, as on
    /// every device), else `Ok(Some(position))`.
    pub(crate) fn enqueue_op(
        &self,
        op: &'static str,
        views: &[View<'_, Cuda>],
        f: impl FnOnce(CUstream) -> Result<()>,
    ) -> Result<Option<u64>> {
        if let Some(v) = views.iter().find(|v| super::host::in_host(v)) {
            return Err(DeviceError::invalid(
                op,
                format!(
                    "buffer {} is in host memory, which cuda kernels do not reach: copy it to a device buffer first",
                    crate::Buffer::id(v.buffer())
                ),
            ));
        }
        self.enqueue_any(op, views, f)
    }

    /// `enqueue_op` for copies, which may have host-memory operands.
    fn enqueue_any(
        &self,
        op: &'static str,
        views: &[View<'_, Cuda>],
        f: impl FnOnce(CUstream) -> Result<()>,
    ) -> Result<Option<u64>> {
        host_fn::check(op)?;
        for v in views {
            checks::on_device(op, &self.device, v)?;
        }
        if self.shared.state.own_failure().is_some() {
            return Ok(None);
        }
        self.device.bind()?;
        // Noted before `f` (whatever of it is enqueued, the free waits for)
        // and placed after, so a free can tell a wait already made.
        for v in views {
            v.buffer().note_use(&self.shared);
        }
        f(self.shared.raw)?;
        let position = self.shared.state.advance();
        for v in views {
            v.buffer().note_use_at(&self.shared, position);
        }
        Ok(Some(position))
    }

    /// Enqueues a copy whose operands may be in host memory (see `enqueue_op`).
    pub(super) fn run_copy(
        &self,
        op: &'static str,
        views: &[View<'_, Cuda>],
        f: impl FnOnce(CUstream) -> Result<()>,
    ) -> Result<()> {
        self.enqueue_any(op, views, f).map(|_| ())
    }

    /// The failure that has made this stream skip its work, if any.
    pub fn failure(&self) -> Option<DeviceError> {
        self.shared.state.own_failure()
    }

    /// Enqueues one of our own operations (see `enqueue_op`).
    pub(super) fn run(
        &self,
        op: &'static str,
        views: &[View<'_, Cuda>],
        f: impl FnOnce(CUstream) -> Result<()>,
    ) -> Result<()> {
        self.enqueue_op(op, views, f).map(|_| ())
    }

    /// Enqueues `f` as a host function (`cuLaunchHostFunc`) after the work
    /// enqueued so far; it gets the stream's failure up to that point, if any.
    ///
    /// It is enqueued on a failed stream too, so it still runs only after
    /// that work: what it releases (a staging block that a queued copy
    /// writes, a host buffer a queued copy reads) stays out of reuse until
    /// the copies have run, even when another thread (a collective's
    /// watchdog) fails the stream between the copy's enqueue and this one.
    /// Only when the driver refuses the launch does `f` run at once.
    pub(super) fn launch_host_job(&self, op: &'static str, f: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        self.launch_host_work(
            op,
            Box::new(move |outcome| {
                f(outcome);
                Ok(())
            }),
        )
    }

    /// [`CudaStream::launch_host_job`] for work that may fail the stream.
    pub(super) fn launch_host_work(&self, op: &'static str, f: HostWork) -> Result<()> {
        host_fn::check(op)?;
        self.device.bind()?;
        let position = self.shared.state.position() + 1;
        let job = Box::into_raw(Box::new(HostJob { f, state: self.shared.state.clone(), position }));
        // SAFETY: `job` is handed to exactly one trampoline call, which frees it.
        let launched =
            unsafe { drv::stream::launch_host_function(self.shared.raw, host_fn_trampoline, job as *mut c_void) }
                .drv("cuLaunchHostFunc", self.device.label());
        match launched {
            Ok(()) => {
                self.shared.state.advance();
                Ok(())
            }
            Err(e) => {
                // Not enqueued: the trampoline will never run, so the job comes back.
                // SAFETY: leaked above and not handed to CUDA.
                let job = unsafe { Box::from_raw(job) };
                // It may release what queued work still uses: only once that
                // work is known to be done, else never (a leak, and a
                // readback that ends at its deadline; never a reuse under a copy).
                match self.shared.host_wait(&self.device) {
                    Ok(()) => {
                        let _ = (job.f)(Err(e.clone()));
                    }
                    Err(_) => std::mem::forget(job),
                }
                Err(e)
            }
        }
    }

    /// `input`'s address, or that of a stream-ordered copy when it overlaps
    /// `output` (always when `always`, else unless it is the same range).
    pub(super) fn input_ptr(
        &self,
        input: &View<'_, Cuda>,
        output: &View<'_, Cuda>,
        always: bool,
    ) -> Result<(CUdeviceptr, Option<Staged>)> {
        let ptr = device_ptr(input);
        if !input.overlaps(output) || (!always && input.same_range(output)) {
            return Ok((ptr, None));
        }
        let bytes = input.bytes();
        // SAFETY: a fresh allocation on this stream, then a copy in its order.
        let tmp = unsafe { drv::malloc_async(self.shared.raw, bytes) }.drv_alloc(
            "cuMemAllocAsync",
            self.device.label(),
            bytes,
        )?;
        let staged = Staged { ptr: tmp, stream: self.shared.raw, device: self.device.clone() };
        // SAFETY: both ranges are valid for `bytes` in this stream's order.
        unsafe { drv::memcpy_dtod_async(tmp, ptr, bytes, self.shared.raw) }
            .drv("cuMemcpyDtoDAsync", self.device.label())?;
        Ok((tmp, Some(staged)))
    }

    /// `bytes` of device scratch for a kernel's partial results, freed in
    /// stream order after the work enqueued next (cuMemAllocAsync's pool).
    pub(super) fn scratch(&self, bytes: usize) -> Result<(CUdeviceptr, Staged)> {
        // SAFETY: a fresh allocation on this stream; freed by `Staged` in its order.
        let ptr = unsafe { drv::malloc_async(self.shared.raw, bytes) }.drv_alloc(
            "cuMemAllocAsync",
            self.device.label(),
            bytes,
        )?;
        Ok((ptr, Staged { ptr, stream: self.shared.raw, device: self.device.clone() }))
    }

    pub(super) fn kernels(&self) -> Result<Arc<super::kernels::Kernels>> {
        self.device.kernels()
    }
}

impl crate::Stream for CudaStream {
    type B = Cuda;

    fn device(&self) -> &CudaDevice {
        &self.device
    }
    fn priority(&self) -> Priority {
        self.shared.priority
    }
    fn name(&self) -> String {
        self.shared.name().to_string()
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<CudaBuffer> {
        self.device.alloc_on(&self.shared, dtype, len)
    }

    fn copy(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        checks::copy(src, dst)?;
        if super::host::in_host(&src) || super::host::in_host(&dst) {
            return self.copy_host(src, dst);
        }
        if src.is_empty() || src.same_range(&dst) {
            return self.run("copy", &[src, dst], |_| Ok(()));
        }
        self.run("copy", &[src, dst], |s| {
            let (from, _staged) = self.input_ptr(&src, &dst, false)?;
            // SAFETY: valid, non-overlapping ranges of `bytes` in stream order.
            unsafe { drv::memcpy_dtod_async(device_ptr(&dst), from, dst.bytes(), s) }
                .drv("cuMemcpyDtoDAsync", self.device.label())
        })
    }

    fn copy_2d(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>, layout: Copy2d) -> Result<()> {
        let op = "copy_2d";
        checks::copy_2d(src, dst, &layout)?;
        if super::host::in_host(&src) || super::host::in_host(&dst) {
            return self.copy_2d_host(src, dst, layout);
        }
        let size = src.dtype().size();
        let width = layout.row_len * size;
        if layout.rows == 0 || width == 0 {
            return self.run(op, &[src, dst], |_| Ok(()));
        }
        let label = self.device.label();
        self.run(op, &[src, dst], |s| {
            let (sp, dp) = (device_ptr(&src), device_ptr(&dst));
            let (src_pitch, dst_pitch) = (layout.src_stride * size, layout.dst_stride * size);
            let max = crate::api::MAX_COPY_PITCH_BYTES;
            if layout.rows == 1 || src_pitch < width || dst_pitch < width || src_pitch > max || dst_pitch > max {
                // cuMemcpy2D needs pitches of at least the width and at most
                // the device's limit: otherwise copy block by block.
                for i in 0..layout.rows {
                    let so = ((layout.src_offset + i * layout.src_stride) * size) as u64;
                    let d_o = ((layout.dst_offset + i * layout.dst_stride) * size) as u64;
                    // SAFETY: blocks inside the views (checked above), valid in stream order.
                    unsafe { drv::memcpy_dtod_async(dp + d_o, sp + so, width, s) }.drv("cuMemcpyDtoDAsync", label)?;
                }
                return Ok(());
            }
            let copy = CUDA_MEMCPY2D {
                srcXInBytes: layout.src_offset * size,
                srcY: 0,
                srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: sp,
                srcArray: std::ptr::null_mut(),
                srcPitch: src_pitch,
                dstXInBytes: layout.dst_offset * size,
                dstY: 0,
                dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dp,
                dstArray: std::ptr::null_mut(),
                dstPitch: dst_pitch,
                WidthInBytes: width,
                Height: layout.rows,
            };
            // SAFETY: a fully initialized descriptor of ranges inside the views.
            unsafe { cudarc::driver::sys::cuMemcpy2DAsync_v2(&copy, s) }.result().drv("cuMemcpy2DAsync", label)
        })
    }

    fn copy_2d_batch(&self, copies: &[Copy2dPiece<'_, Cuda>]) -> Result<()> {
        let op = "copy_2d_batch";
        for (src, dst, layout) in copies {
            checks::copy_2d(*src, *dst, layout)?;
        }
        if copies.iter().any(|(src, dst, _)| super::host::in_host(src) || super::host::in_host(dst)) {
            // Host operands take the copies of `host.rs`, piece by piece.
            return copies.iter().try_for_each(|(src, dst, layout)| self.copy_2d(*src, *dst, *layout));
        }
        let pieces = copies.iter().filter_map(|(src, dst, layout)| {
            CopyPiece::new(device_ptr(src), device_ptr(dst), layout, src.dtype().size())
        });
        let steps = gpu_batch::plan_copies(pieces);
        let kernels = match steps.iter().any(|step| matches!(step, Step::Launch { .. })) {
            true => Some(self.kernels()?),
            false => None,
        };
        let views: Vec<View<'_, Cuda>> = copies.iter().flat_map(|(src, dst, _)| [*src, *dst]).collect();
        let label = self.device.label();
        self.run(op, &views, |s| {
            for step in steps {
                match step {
                    // SAFETY: a contiguous range inside the views (checked above), valid in
                    // stream order; source and destination are disjoint (checked above).
                    Step::Single(p) => unsafe { drv::memcpy_dtod_async(p.dst, p.src, p.row_bytes as usize, s) }
                        .drv("cuMemcpyDtoDAsync", label)?,
                    Step::Launch { mut block, grid } => {
                        let k = kernels.as_ref().ok_or_else(|| DeviceError::invalid(op, "no kernels"))?;
                        // SAFETY: the planner's parameter block of chorus_copy_batch over
                        // ranges inside the views, valid in stream order; no piece meets
                        // what an earlier piece of the launch writes (the planner's rule).
                        unsafe { k.launch_block("chorus_copy_batch", grid, s, &mut block, label) }?
                    }
                }
            }
            Ok(())
        })
    }

    fn copy_from_host(&self, src: &[u8], dst: View<'_, Cuda>) -> Result<()> {
        checks::copy_from_host(src, dst)?;
        if super::host::in_host(&dst) {
            return self.copy_from_host_to_host(src, dst);
        }
        if src.is_empty() {
            return self.run("copy_from_host", &[dst], |_| Ok(()));
        }
        self.run("copy_from_host", &[dst], |s| {
            // From pageable memory the driver stages `src` before returning
            // (CUDA's "API synchronization behavior"), so the caller may
            // reuse it at once, as the contract requires.
            // SAFETY: `dst` is valid for `src.len()` bytes in stream order.
            unsafe { drv::memcpy_htod_async(device_ptr(&dst), src, s) }.drv("cuMemcpyHtoDAsync", self.device.label())
        })
    }

    fn copy_to_host(&self, src: View<'_, Cuda>) -> Result<Readback> {
        let op = "copy_to_host";
        host_fn::check(op)?;
        checks::on_device(op, &self.device, &src)?;
        if super::host::in_host(&src) {
            return self.copy_host_to_host(src);
        }
        let (readback, filler) = Readback::pending(src.dtype(), src.len(), self.device.config().timeout);
        if let Some(e) = self.shared.state.own_failure() {
            filler.fail(poisoned(&e));
            return Ok(readback);
        }
        let bytes = src.bytes();
        self.device.bind()?;
        let pool = self.device.inner.staging.clone();
        let block = pool.take(bytes, self.device.label())?;
        let block_ptr = block.ptr;
        let copied = self.enqueue_op(op, &[src], |s| {
            if bytes > 0 {
                // SAFETY: the pinned block holds at least `bytes`, and stays
                // out of the pool until the host job below has read it.
                let dst = unsafe { std::slice::from_raw_parts_mut(block_ptr, bytes) };
                // SAFETY: the device range is valid in stream order.
                unsafe { drv::memcpy_dtoh_async(dst, device_ptr(&src), s) }
                    .drv("cuMemcpyDtoHAsync", self.device.label())?;
            }
            Ok(())
        });
        if let Err(e) = copied {
            pool.put(block);
            return Err(e);
        }
        // Runs on a driver thread: only host memory and host-side state.
        self.launch_host_job(
            op,
            Box::new(move |outcome| {
                match outcome {
                    Ok(()) => {
                        // SAFETY: the copy into the block has completed (stream order).
                        let data = unsafe { std::slice::from_raw_parts(block.ptr, bytes) }.to_vec();
                        filler.fill(data);
                    }
                    Err(e) => filler.fail(e),
                }
                pool.put(block);
            }),
        )?;
        Ok(readback)
    }

    fn fill(&self, dst: View<'_, Cuda>, value: Scalar) -> Result<()> {
        let pattern = checks::fill(dst, value)?;
        let Some(piece) = FillPiece::new(device_ptr(&dst), dst.len(), &pattern) else {
            return self.run("fill", &[dst], |_| Ok(()));
        };
        let kernels = if piece.width == 8 { Some(self.kernels()?) } else { None };
        self.run("fill", &[dst], |s| self.fill_piece(&piece, kernels.as_deref(), s))
    }

    fn fill_batch(&self, dsts: &[View<'_, Cuda>], value: Scalar) -> Result<()> {
        let op = "fill_batch";
        let mut pieces = Vec::with_capacity(dsts.len());
        for dst in dsts {
            let pattern = checks::fill(*dst, value)?;
            pieces.extend(FillPiece::new(device_ptr(dst), dst.len(), &pattern));
        }
        let steps = gpu_batch::plan_fills(pieces);
        let kernel_needed = |step: &Step<FillPiece>| !matches!(step, Step::Single(p) if p.width < 8);
        let kernels = if steps.iter().any(kernel_needed) { Some(self.kernels()?) } else { None };
        let label = self.device.label();
        self.run(op, dsts, |s| {
            for step in steps {
                match step {
                    Step::Single(piece) => self.fill_piece(&piece, kernels.as_deref(), s)?,
                    Step::Launch { mut block, grid } => {
                        let k = kernels.as_ref().ok_or_else(|| DeviceError::invalid(op, "no kernels"))?;
                        // SAFETY: the planner's parameter block of chorus_fill_batch over ranges
                        // inside the views (checked above), valid in stream order.
                        unsafe { k.launch_block("chorus_fill_batch", grid, s, &mut block, label) }?
                    }
                }
            }
            Ok(())
        })
    }

    fn cast(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        checks::cast(src, dst)?;
        self.elementwise("cast", &[src, dst], dst.len(), |k, s, label| {
            let (from, _staged) = self.input_ptr(&src, &dst, false)?;
            let n = dst.len() as u64;
            let args =
                Args::default().ptr(from).i32(code(src.dtype())).ptr(device_ptr(&dst)).i32(code(dst.dtype())).u64(n);
            // SAFETY: the kernel's parameters; ranges valid in stream order.
            unsafe { k.launch("chorus_cast", n, s, args, label) }
        })
    }

    fn scale(&self, x: View<'_, Cuda>, alpha: f64) -> Result<()> {
        checks::scale(x)?;
        self.elementwise("scale", &[x], x.len(), |k, s, label| {
            let n = x.len() as u64;
            let args = Args::default().ptr(device_ptr(&x)).i32(code(x.dtype())).u64(n).f64(alpha);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_scale", n, s, args, label) }
        })
    }

    fn abs_max(&self, x: View<'_, Cuda>, out: View<'_, Cuda>, accumulate: bool) -> Result<()> {
        let op = "abs_max";
        checks::abs_max(x, out)?;
        let kernels = self.kernels()?;
        let label = self.device.label();
        self.run(op, &[x, out], |s| {
            let (px, _staged) = self.input_ptr(&x, &out, true)?;
            let args = Args::default()
                .ptr(px)
                .i32(code(x.dtype()))
                .ptr(device_ptr(&out))
                .u64(x.len() as u64)
                .i32(accumulate as i32);
            // SAFETY: as in `cast`; one block.
            unsafe { kernels.launch_grid("chorus_abs_max", 1, REDUCE_BLOCK, s, args, label) }
        })
    }

    fn quantize_f8(&self, src: View<'_, Cuda>, amax: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        checks::scaled_f8("quantize_f8", src, amax, dst)?;
        self.elementwise("quantize_f8", &[src, amax, dst], dst.len(), |k, s, label| {
            // Different element sizes: any overlap with the output is staged.
            let (from, _staged) = self.input_ptr(&src, &dst, true)?;
            let (a, _staged_amax) = self.input_ptr(&amax, &dst, true)?;
            let n = dst.len() as u64;
            let args = Args::default().ptr(from).i32(code(src.dtype())).ptr(a).ptr(device_ptr(&dst)).u64(n);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_quantize_f8", n, s, args, label) }
        })
    }

    fn dequantize_f8(&self, src: View<'_, Cuda>, amax: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        checks::scaled_f8("dequantize_f8", dst, amax, src)?;
        self.elementwise("dequantize_f8", &[src, amax, dst], dst.len(), |k, s, label| {
            let (from, _staged) = self.input_ptr(&src, &dst, true)?;
            let (a, _staged_amax) = self.input_ptr(&amax, &dst, true)?;
            let n = dst.len() as u64;
            let args = Args::default().ptr(from).ptr(a).ptr(device_ptr(&dst)).i32(code(dst.dtype())).u64(n);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_dequantize_f8", n, s, args, label) }
        })
    }

    fn accumulate(&self, src: View<'_, Cuda>, dst: View<'_, Cuda>) -> Result<()> {
        checks::accumulate(src, dst)?;
        let (sd, dd) = (src.dtype(), dst.dtype());
        let float = sd.is_float() && dd.is_float();
        self.elementwise("accumulate", &[src, dst], dst.len(), |k, s, label| {
            let (from, _staged) = self.input_ptr(&src, &dst, false)?;
            let (to, n) = (device_ptr(&dst), dst.len() as u64);
            let (kernel, args) = if float {
                ("chorus_accumulate", Args::default().ptr(from).i32(code(sd)).ptr(to).i32(code(dd)).u64(n))
            } else {
                ("chorus_accumulate_int", Args::default().ptr(from).ptr(to).i32(code(dd)).u64(n))
            };
            // SAFETY: as in `cast`.
            unsafe { k.launch(kernel, n, s, args, label) }
        })
    }

    fn axpy(&self, alpha: f64, x: View<'_, Cuda>, y: View<'_, Cuda>) -> Result<()> {
        checks::axpy(x, y)?;
        self.elementwise("axpy", &[x, y], y.len(), |k, s, label| {
            let (from, _staged) = self.input_ptr(&x, &y, false)?;
            let n = y.len() as u64;
            let args = Args::default()
                .f64(alpha)
                .ptr(from)
                .i32(code(x.dtype()))
                .ptr(device_ptr(&y))
                .i32(code(y.dtype()))
                .u64(n);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_axpy", n, s, args, label) }
        })
    }

    fn record(&self, event: &CudaEvent) -> Result<()> {
        host_fn::check("record")?;
        checks::same_device("record", "an event", &self.device, &event.device)?;
        self.device.bind()?;
        // SAFETY: live event and stream of the bound context.
        unsafe { drv::event::record(event.raw, self.shared.raw) }.drv("cuEventRecord", self.device.label())?;
        let pos = self.shared.state.advance();
        event.recorded.set(&self.shared.state, pos);
        Ok(())
    }

    fn wait(&self, event: &CudaEvent) -> Result<()> {
        host_fn::check("wait")?;
        checks::same_device("wait", "an event", &self.device, &event.device)?;
        self.device.bind()?;
        // SAFETY: live event and stream of the bound context.
        unsafe { drv::stream::wait_event(self.shared.raw, event.raw, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .drv("cuStreamWaitEvent", self.device.label())?;
        let ours = self.shared.state.advance();
        if let Some((stream, theirs)) = event.recorded.get() {
            if !Arc::ptr_eq(&stream, &self.shared.state) {
                self.shared.state.add_upstream(&stream, theirs, ours);
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        host_fn::check("stream synchronize")?;
        self.shared.host_wait(&self.device)
    }

    fn launch_host_fn(&self, f: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        self.launch_host_job("launch_host_fn", f)
    }

    fn update_on_host(&self, reads: &[View<'_, Cuda>], writes: &[View<'_, Cuda>], f: crate::HostUpdate) -> Result<()> {
        self.update_host_memory(reads, writes, f)
    }
}

impl CudaStream {
    /// Enqueues one fill on `s` (inside `run`): `cuMemsetD8/16/32Async` for
    /// elements of 1, 2 or 4 bytes, the fill kernel for 8 (`kernels` given).
    fn fill_piece(&self, p: &FillPiece, kernels: Option<&super::kernels::Kernels>, s: CUstream) -> Result<()> {
        let (ptr, n, label) = (p.dst, p.n as usize, self.device.label());
        // SAFETY: `n` elements of `width` bytes at `ptr` lie inside a view the caller checked, valid in stream order.
        unsafe {
            match p.width {
                1 => drv::memset_d8_async(ptr, p.pattern as u8, n, s).drv("cuMemsetD8Async", label),
                2 => cudarc::driver::sys::cuMemsetD16Async(ptr, p.pattern as u16, n, s)
                    .result()
                    .drv("cuMemsetD16Async", label),
                4 => cudarc::driver::sys::cuMemsetD32Async(ptr, p.pattern as u32, n, s)
                    .result()
                    .drv("cuMemsetD32Async", label),
                _ => {
                    let args = Args::default().ptr(ptr).i32(8).u64(p.n).u64(p.pattern);
                    let k = kernels.ok_or_else(|| DeviceError::invalid("fill", "no kernels"))?;
                    k.launch("chorus_fill", p.n, s, args, label)
                }
            }
        }
    }

    /// Enqueues a kernel over `n` elements touching `views`; nothing is
    /// launched for `n == 0` (the operation still takes its place in order).
    pub(super) fn elementwise(
        &self,
        op: &'static str,
        views: &[View<'_, Cuda>],
        n: usize,
        launch: impl FnOnce(&super::kernels::Kernels, CUstream, &str) -> Result<()>,
    ) -> Result<()> {
        if n == 0 {
            return self.run(op, views, |_| Ok(()));
        }
        let kernels = self.kernels()?;
        let label = self.device.label();
        self.run(op, views, |s| launch(&kernels, s, label))
    }
}
