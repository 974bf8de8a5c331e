//! Streams of the hip device: every operation is one or two asynchronous HIP calls.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::device::{defer_drop, DeferredDrops, HipBuffer, HipDevice, Parked};
use super::event::{poll_event, HipEvent};
use super::kernels::{self, Args};
use super::sys::{self, hipStream_t};
use super::{result, Hip};
use crate::failure::{poisoned, StreamState};
use crate::gpu_kernels::{blocks_for, code, BLOCK, REDUCE_BLOCK};
use crate::{checks, host_fn, FailureHandle};
use crate::{Copy2d, DType, DeviceError, Priority, Readback, Result, Scalar, View};

/// The owned `hipStream_t`, destroyed when the last user (stream handle,
/// buffer homed on it, buffer it used) is gone.
#[derive(Debug)]
pub(crate) struct StreamInner {
    raw: usize,
    ordinal: usize,
    pub(crate) name: String,
    priority: Priority,
    pub(crate) state: Arc<StreamState>,
    parked: Parked,
    deferred: DeferredDrops,
}

impl StreamInner {
    pub(crate) fn create(
        ordinal: usize,
        name: String,
        priority: Priority,
        hip_priority: i32,
        parked: &Parked,
        deferred: &DeferredDrops,
    ) -> Result<StreamInner> {
        result::set_device(ordinal)?;
        let raw = result::stream_create(hip_priority)? as usize;
        Ok(StreamInner {
            raw,
            ordinal,
            state: StreamState::new(name.clone()),
            name,
            priority,
            parked: parked.clone(),
            deferred: deferred.clone(),
        })
    }

    pub(crate) fn raw(&self) -> hipStream_t {
        self.raw as hipStream_t
    }

    /// Blocks the host until the work enqueued so far has finished (polling,
    /// with `timeout`); returns the stream's failure, if any.
    pub(crate) fn synchronize(&self, timeout: Duration) -> Result<()> {
        result::set_device(self.ordinal)?;
        let event = result::event_create()?;
        // SAFETY: live handles of the current device; the event is destroyed once below.
        let waited = unsafe {
            result::event_record(event, self.raw())
                .and_then(|_| poll_event(event, timeout, &format!("{} to finish", self.name)))
        };
        // SAFETY: created above.
        let _ = unsafe { result::event_destroy(event) };
        let upto = self.state.position();
        if let Err(e) = waited {
            if !matches!(e, DeviceError::Timeout { .. }) {
                // A HIP error from the queued work: sticky from here on.
                self.state.fail(upto, e.clone());
            }
            return Err(e);
        }
        match self.state.failure_at(upto) {
            Some(e) => Err(e),
            None => {
                self.state.mark_synced(upto);
                Ok(())
            }
        }
    }
}

// SAFETY: a hipStream_t may be used from any thread; the struct's own state is synchronized.
unsafe impl Send for StreamInner {}
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Returns at once; HIP finishes the queued work before releasing the
        // stream. Inside a host function, postponed to a thread that may call HIP.
        let raw = self.raw;
        defer_drop(&self.deferred, &self.parked, self.ordinal, "hipStreamDestroy", move || {
            // SAFETY: the last owner destroys the stream once.
            unsafe { result::stream_destroy(raw as hipStream_t) }
        });
    }
}

/// A stream of a hip device.
#[derive(Debug)]
pub struct HipStream {
    pub(super) inner: Arc<StreamInner>,
    pub(super) device: HipDevice,
}

/// How an input relates to the output of a kernel.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Reads {
    /// Element i of the output depends only on element i of this input, so
    /// the exact same range is safe in place.
    Elementwise,
    /// Any overlap with the output must be staged.
    Whole,
}

impl HipStream {
    pub(crate) fn create(device: &HipDevice, priority: Priority) -> Result<HipStream> {
        let d = &device.inner;
        let index = d.next_stream.fetch_add(1, Ordering::Relaxed);
        let suffix = if priority == Priority::High { " (high)" } else { "" };
        let name = format!("{}/stream{index}{suffix}", device.label());
        let hip_priority = match priority {
            Priority::Normal => d.priorities.0,
            Priority::High => d.priorities.1,
        };
        let inner =
            Arc::new(StreamInner::create(d.config.ordinal, name, priority, hip_priority, &d.parked, &d.deferred)?);
        d.streams.add(&inner);
        Ok(HipStream { inner, device: device.clone() })
    }

    /// The `hipStream_t`, for libraries that enqueue their own work (RCCL).
    /// Valid while this stream lives.
    pub fn raw(&self) -> hipStream_t {
        self.inner.raw()
    }

    /// Operations enqueued on this stream so far (each enqueuing call counts one).
    pub fn position(&self) -> u64 {
        self.inner.state.position()
    }

    /// The stream's failure, if it has failed.
    pub fn failure(&self) -> Option<DeviceError> {
        self.inner.state.own_failure()
    }

    /// The device address of `view`'s first element, after checking that it
    /// is of this stream's device and recording that this stream uses its
    /// buffer (so dropping the buffer frees it only after this stream's work).
    /// A view of a host buffer is refused: kernels and vendor work never
    /// reach host memory (copies take their own path, `host.rs`).
    pub fn device_ptr(&self, op: &'static str, view: View<'_, Hip>) -> Result<u64> {
        checks::on_device(op, &self.device, &view)?;
        if super::host::in_host(&view) {
            return Err(DeviceError::invalid(
                op,
                format!(
                    "buffer {} is in host memory, which hip kernels do not reach: copy it to a device buffer first",
                    crate::Buffer::id(view.buffer())
                ),
            ));
        }
        let buf: &HipBuffer = view.buffer();
        buf.note_use(&self.inner);
        Ok(buf.device_ptr() + (view.offset() * view.dtype().size()) as u64)
    }

    /// Runs `f` to enqueue one operation, unless the stream has failed (then
    /// the operation is skipped, as the contract says, and `Ok` returned).
    pub(super) fn enqueue(&self, f: impl FnOnce(hipStream_t) -> Result<()>) -> Result<()> {
        self.enqueue_at(f).map(|_| ())
    }

    /// [`HipStream::enqueue`], returning the operation's position, or `None`
    /// when the stream has failed and the operation was skipped.
    pub(crate) fn enqueue_at(&self, f: impl FnOnce(hipStream_t) -> Result<()>) -> Result<Option<u64>> {
        host_fn::check("a hip stream operation")?;
        let at = self.inner.state.advance();
        if self.inner.state.own_failure().is_some() {
            return Ok(None);
        }
        self.device.bind()?;
        f(self.raw())?;
        Ok(Some(at))
    }

    /// A handle that fails this stream from a given position on (what a
    /// collective's watchdog holds).
    pub(crate) fn failure_handle(&self) -> FailureHandle {
        self.inner.state.failure_handle()
    }

    pub(super) fn timeout(&self) -> Duration {
        self.device.config().timeout
    }

    /// Enqueues host work after what is queued. If that fails, waits for the
    /// stream and runs the work on this thread (the copies it follows are
    /// then done), or leaks it if the wait fails; the error is returned.
    pub(super) fn host_work(&self, work: result::HostWork) -> Result<()> {
        // SAFETY: the stream is live.
        match unsafe { result::launch_host_work(self.raw(), work) } {
            Ok(()) => Ok(()),
            Err((e, work)) => {
                match self.inner.synchronize(self.timeout()) {
                    Ok(()) => work(Ok(())),
                    Err(_) => std::mem::forget(work),
                }
                Err(e)
            }
        }
    }

    /// A scratch allocation in this stream's order, freed after the work enqueued next.
    fn scratch(&self, bytes: usize) -> Result<Scratch<'_>> {
        // SAFETY: this stream is live and its device current (callers are inside `enqueue`).
        let ptr = unsafe { result::malloc_async(bytes, self.raw(), &self.device.label()) }? as usize;
        Ok(Scratch { ptr, stream: self })
    }

    /// The pointer a kernel should read `input` through: the view itself, or
    /// a staged copy when it overlaps `output` in a way the kernel cannot handle.
    fn read_ptr<'s>(
        &'s self,
        op: &'static str,
        input: View<'_, Hip>,
        output: &View<'_, Hip>,
        reads: Reads,
        scratch: &mut Vec<Scratch<'s>>,
    ) -> Result<u64> {
        let p = self.device_ptr(op, input)?;
        let staged = input.overlaps(output) && !(reads == Reads::Elementwise && input.same_range(output));
        if !staged {
            return Ok(p);
        }
        let s = self.scratch(input.bytes())?;
        // SAFETY: both ranges are `bytes` long on this device, ordered on this stream.
        unsafe {
            result::memcpy_async(
                s.ptr as *mut c_void,
                p as *const c_void,
                input.bytes(),
                sys::hipMemcpyDeviceToDevice,
                self.raw(),
            )
        }?;
        let at = s.ptr as u64;
        scratch.push(s);
        Ok(at)
    }

    /// Launches the kernel named `kernel` (the device compiles the kernels on
    /// first use): `inputs` are read, `output` is written; `args` builds the
    /// argument list from the input pointers and the output pointer.
    pub(super) fn launch(
        &self,
        op: &'static str,
        kernel: &'static str,
        inputs: &[(View<'_, Hip>, Reads)],
        output: View<'_, Hip>,
        dims: Dims,
        args: impl FnOnce(&[u64], u64) -> Args,
    ) -> Result<()> {
        let out = self.device_ptr(op, output)?;
        let mut ptrs = Vec::with_capacity(inputs.len());
        for (v, _) in inputs {
            self.device_ptr(op, *v)?;
        }
        self.enqueue(|stream| {
            let loaded = self.device.inner.kernels.get(self.device.config().arch.as_deref())?;
            let mut scratch = Vec::new();
            for (v, reads) in inputs {
                ptrs.push(self.read_ptr(op, *v, &output, *reads, &mut scratch)?);
            }
            // SAFETY: the arguments follow the kernel's signature in the shared
            // source; the buffers are kept alive past the kernel by their
            // stream-ordered free.
            unsafe { kernels::launch(&loaded, kernel, stream, dims.grid, dims.block, args(&ptrs, out)) }
        })
    }
}

/// What host work enqueued at position `at` is told: the runtime's error
/// (`hipStreamAddCallback` passes the stream's), else the stream's host-seen
/// failure up to `at`. Runs in the host function, so it calls no HIP.
pub(super) fn host_outcome(outcome: Result<(), i32>, state: &StreamState, at: u64, before: &str) -> Result<()> {
    match outcome {
        Err(code) => Err(DeviceError::Backend {
            library: result::LIBRARY,
            code: code as i64,
            message: format!("the stream failed before {before}"),
        }),
        Ok(()) => state.failure_at(at).map_or(Ok(()), |e| Err(poisoned(&e))),
    }
}

/// Stream-ordered scratch memory: freed on its stream when dropped, after the work enqueued before.
struct Scratch<'a> {
    ptr: usize,
    stream: &'a HipStream,
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by hipMallocAsync on this stream; freed once, after the work that used it.
        if let Err(e) = unsafe { result::free_async(self.ptr as *mut c_void, self.stream.raw()) } {
            self.stream.device.inner.parked.park(e);
        }
    }
}

/// The grid and block of a launch.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub(super) grid: (u32, u32),
    pub(super) block: (u32, u32),
}

impl Dims {
    /// One block of `REDUCE_BLOCK` threads (the reductions).
    pub(super) const ONE_BLOCK: Dims = Dims { grid: (1, 1), block: (REDUCE_BLOCK, 1) };

    /// A grid-stride launch over `n` elements.
    pub(super) fn linear(n: usize) -> Dims {
        Dims { grid: (blocks_for(n as u64), 1), block: (BLOCK, 1) }
    }
}

impl crate::Stream for HipStream {
    type B = Hip;

    fn device(&self) -> &HipDevice {
        &self.device
    }
    fn priority(&self) -> Priority {
        self.inner.priority
    }
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<HipBuffer> {
        self.device.alloc_on(&self.inner, dtype, len)
    }

    fn copy(&self, src: View<'_, Hip>, dst: View<'_, Hip>) -> Result<()> {
        let op = "copy";
        checks::copy(src, dst)?;
        if super::host::in_host(&src) || super::host::in_host(&dst) {
            return self.copy_host(src, dst);
        }
        let (s, d) = (self.device_ptr(op, src)?, self.device_ptr(op, dst)?);
        let bytes = src.bytes();
        self.enqueue(|stream| {
            if bytes == 0 || src.same_range(&dst) {
                return Ok(());
            }
            let mut scratch = Vec::new();
            let s = if src.overlaps(&dst) { self.read_ptr(op, src, &dst, Reads::Whole, &mut scratch)? } else { s };
            // SAFETY: both ranges hold `bytes` on this device and are ordered on this stream.
            unsafe {
                result::memcpy_async(d as *mut c_void, s as *const c_void, bytes, sys::hipMemcpyDeviceToDevice, stream)
            }
        })
    }

    fn copy_2d(&self, src: View<'_, Hip>, dst: View<'_, Hip>, layout: Copy2d) -> Result<()> {
        let op = "copy_2d";
        checks::copy_2d(src, dst, &layout)?;
        if super::host::in_host(&src) || super::host::in_host(&dst) {
            return self.copy_2d_host(src, dst, layout);
        }
        let size = src.dtype().size();
        let (s, d) = (self.device_ptr(op, src)?, self.device_ptr(op, dst)?);
        let Copy2d { rows, row_len, src_offset, src_stride, dst_offset, dst_stride } = layout;
        self.enqueue(|stream| {
            if rows == 0 || row_len == 0 {
                return Ok(());
            }
            let (s0, d0) = (s + (src_offset * size) as u64, d + (dst_offset * size) as u64);
            let width = row_len * size;
            let max = crate::api::MAX_COPY_PITCH_BYTES;
            let pitches_fit =
                src_stride >= row_len && dst_stride >= row_len && src_stride * size <= max && dst_stride * size <= max;
            if rows == 1 || pitches_fit {
                let (sp, dp) = if rows == 1 { (width, width) } else { (src_stride * size, dst_stride * size) };
                // SAFETY: every row lies inside its view (checked above); ordered on this stream.
                return unsafe {
                    result::memcpy_2d_async(
                        d0 as *mut c_void,
                        dp,
                        s0 as *const c_void,
                        sp,
                        width,
                        rows,
                        sys::hipMemcpyDeviceToDevice,
                        stream,
                    )
                };
            }
            // Blocks closer than their length: row by row, in order, as the cpu device does.
            for i in 0..rows {
                let (si, di) = (s0 + (i * src_stride * size) as u64, d0 + (i * dst_stride * size) as u64);
                // SAFETY: as above.
                unsafe {
                    result::memcpy_async(
                        di as *mut c_void,
                        si as *const c_void,
                        width,
                        sys::hipMemcpyDeviceToDevice,
                        stream,
                    )
                }?;
            }
            Ok(())
        })
    }

    fn copy_from_host(&self, src: &[u8], dst: View<'_, Hip>) -> Result<()> {
        let op = "copy_from_host";
        checks::copy_from_host(src, dst)?;
        if super::host::in_host(&dst) {
            return self.copy_from_host_to_host(src, dst);
        }
        let d = self.device_ptr(op, dst)?;
        if src.is_empty() {
            return self.enqueue(|_| Ok(()));
        }
        let pool = self.device.inner.pinned.clone();
        self.enqueue(|stream| {
            // Staged in page-locked memory, so the copy is asynchronous and `src` free at once.
            let block = pool.take(src.len())?;
            // SAFETY: the block holds at least `src.len()` bytes and nothing else uses it.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), block.ptr(), src.len()) };
            // SAFETY: the block stays out of the pool until the host work below, after the copy.
            let copied = unsafe {
                result::memcpy_async(
                    d as *mut c_void,
                    block.ptr().cast(),
                    src.len(),
                    sys::hipMemcpyHostToDevice,
                    stream,
                )
            };
            if let Err(e) = copied {
                pool.give(block);
                return Err(e);
            }
            let back = pool.clone();
            self.host_work(Box::new(move |_| back.give(block)))
        })
    }

    fn copy_to_host(&self, src: View<'_, Hip>) -> Result<Readback> {
        if super::host::in_host(&src) {
            return self.copy_host_to_host(src);
        }
        let s = self.device_ptr("copy_to_host", src)?;
        host_fn::check("copy_to_host")?;
        let (readback, filler) = Readback::pending(src.dtype(), src.len(), self.timeout());
        let at = self.inner.state.advance();
        if let Some(e) = self.inner.state.own_failure() {
            filler.fail(poisoned(&e));
            return Ok(readback);
        }
        let bytes = src.bytes();
        if bytes == 0 {
            filler.fill(Vec::new());
            return Ok(readback);
        }
        self.device.bind()?;
        let pool = self.device.inner.pinned.clone();
        let block = pool.take(bytes)?;
        // SAFETY: the block holds `bytes` and stays out of the pool until the host work below.
        let copied = unsafe {
            result::memcpy_async(block.ptr().cast(), s as *const c_void, bytes, sys::hipMemcpyDeviceToHost, self.raw())
        };
        if let Err(e) = copied {
            pool.give(block);
            return Err(e);
        }
        let state = self.inner.state.clone();
        self.host_work(Box::new(move |outcome| {
            let result = host_outcome(outcome, &state, at, "the device-to-host copy completed")
                // SAFETY: the copy into the block has completed (stream order).
                .map(|()| unsafe { std::slice::from_raw_parts(block.ptr(), bytes) }.to_vec());
            pool.give(block);
            match result {
                Ok(data) => filler.fill(data),
                Err(e) => filler.fail(e),
            }
        }))?;
        Ok(readback)
    }

    fn fill(&self, dst: View<'_, Hip>, value: Scalar) -> Result<()> {
        let pattern = checks::fill(dst, value)?;
        let size = pattern.len();
        if pattern.iter().all(|b| *b == pattern[0]) {
            let d = self.device_ptr("fill", dst)?;
            let bytes = dst.bytes();
            return self.enqueue(|stream| {
                if bytes == 0 {
                    return Ok(());
                }
                // SAFETY: `bytes` of this device, ordered on this stream.
                unsafe { result::memset_async(d as *mut c_void, pattern[0], bytes, stream) }
            });
        }
        let mut word = [0u8; 8];
        word[..size].copy_from_slice(&pattern);
        let word = u64::from_le_bytes(word);
        let n = dst.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        self.launch("fill", "chorus_fill", &[], dst, Dims::linear(n), |_, d| {
            Args::default().ptr(d).i32(size as i32).u64(n as u64).u64(word)
        })
    }

    fn cast(&self, src: View<'_, Hip>, dst: View<'_, Hip>) -> Result<()> {
        checks::cast(src, dst)?;
        let n = src.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let (st, dt) = (code(src.dtype()), code(dst.dtype()));
        self.launch("cast", "chorus_cast", &[(src, Reads::Elementwise)], dst, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).i32(st).ptr(d).i32(dt).u64(n as u64)
        })
    }

    fn scale(&self, x: View<'_, Hip>, alpha: f64) -> Result<()> {
        checks::scale(x)?;
        let n = x.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let t = code(x.dtype());
        self.launch("scale", "chorus_scale", &[], x, Dims::linear(n), |_, d| {
            Args::default().ptr(d).i32(t).u64(n as u64).f64(alpha)
        })
    }

    fn abs_max(&self, x: View<'_, Hip>, out: View<'_, Hip>, accumulate: bool) -> Result<()> {
        checks::abs_max(x, out)?;
        let (n, xt) = (x.len(), code(x.dtype()));
        self.launch("abs_max", "chorus_abs_max", &[(x, Reads::Whole)], out, Dims::ONE_BLOCK, |p, d| {
            Args::default().ptr(p[0]).i32(xt).ptr(d).u64(n as u64).i32(accumulate as i32)
        })
    }

    fn quantize_f8(&self, src: View<'_, Hip>, amax: View<'_, Hip>, dst: View<'_, Hip>) -> Result<()> {
        checks::scaled_f8("quantize_f8", src, amax, dst)?;
        let n = src.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let st = code(src.dtype());
        // Different element sizes: any overlap with the output is staged.
        let inputs = [(src, Reads::Whole), (amax, Reads::Whole)];
        self.launch("quantize_f8", "chorus_quantize_f8", &inputs, dst, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).i32(st).ptr(p[1]).ptr(d).u64(n as u64)
        })
    }

    fn dequantize_f8(&self, src: View<'_, Hip>, amax: View<'_, Hip>, dst: View<'_, Hip>) -> Result<()> {
        checks::scaled_f8("dequantize_f8", dst, amax, src)?;
        let n = src.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let dt = code(dst.dtype());
        let inputs = [(src, Reads::Whole), (amax, Reads::Whole)];
        self.launch("dequantize_f8", "chorus_dequantize_f8", &inputs, dst, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).ptr(p[1]).ptr(d).i32(dt).u64(n as u64)
        })
    }

    fn accumulate(&self, src: View<'_, Hip>, dst: View<'_, Hip>) -> Result<()> {
        checks::accumulate(src, dst)?;
        let (sd, dd) = (src.dtype(), dst.dtype());
        let n = dst.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let inputs = [(src, Reads::Elementwise)];
        let (st, dt) = (code(sd), code(dd));
        if sd.is_float() && dd.is_float() {
            self.launch("accumulate", "chorus_accumulate", &inputs, dst, Dims::linear(n), |p, d| {
                Args::default().ptr(p[0]).i32(st).ptr(d).i32(dt).u64(n as u64)
            })
        } else {
            self.launch("accumulate", "chorus_accumulate_int", &inputs, dst, Dims::linear(n), |p, d| {
                Args::default().ptr(p[0]).ptr(d).i32(dt).u64(n as u64)
            })
        }
    }

    fn axpy(&self, alpha: f64, x: View<'_, Hip>, y: View<'_, Hip>) -> Result<()> {
        checks::axpy(x, y)?;
        let n = y.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let (xt, yt) = (code(x.dtype()), code(y.dtype()));
        self.launch("axpy", "chorus_axpy", &[(x, Reads::Elementwise)], y, Dims::linear(n), |p, d| {
            Args::default().f64(alpha).ptr(p[0]).i32(xt).ptr(d).i32(yt).u64(n as u64)
        })
    }

    fn record(&self, event: &HipEvent) -> Result<()> {
        host_fn::check("record")?;
        checks::same_device("record", "an event", &self.device, &event.device)?;
        self.device.bind()?;
        // SAFETY: live handles of one device.
        unsafe { result::event_record(event.raw(), self.raw()) }?;
        let position = self.inner.state.advance();
        event.recorded.set(&self.inner.state, position);
        Ok(())
    }

    fn wait(&self, event: &HipEvent) -> Result<()> {
        host_fn::check("wait")?;
        checks::same_device("wait", "an event", &self.device, &event.device)?;
        let Some((state, theirs)) = event.recorded.get() else {
            return Ok(());
        };
        self.device.bind()?;
        // SAFETY: live handles of one device.
        unsafe { result::stream_wait_event(self.raw(), event.raw()) }?;
        let ours = self.inner.state.advance();
        if !Arc::ptr_eq(&state, &self.inner.state) {
            self.inner.state.add_upstream(&state, theirs, ours);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        host_fn::check("stream synchronize")?;
        self.inner.synchronize(self.timeout())
    }

    fn update_on_host(&self, reads: &[View<'_, Hip>], writes: &[View<'_, Hip>], f: crate::HostUpdate) -> Result<()> {
        self.update_host_memory(reads, writes, f)
    }

    fn launch_host_fn(&self, f: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        host_fn::check("launch_host_fn")?;
        let at = self.inner.state.advance();
        // Enqueued on a failed stream too (it is told the failure): it runs
        // after the work before it, as on every device, so what it releases
        // is out of that work's reach.
        self.device.bind()?;
        let state = self.inner.state.clone();
        self.host_work(Box::new(move |outcome| {
            let told = host_outcome(outcome, &state, at, "the host function");
            if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || f(told))) {
                let msg = panic.downcast_ref::<&str>().map(|s| s.to_string()).unwrap_or_default();
                state.fail(at, DeviceError::invalid("launch_host_fn", format!("the host function panicked: {msg}")));
            }
        }))
    }
}
