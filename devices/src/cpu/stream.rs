//! Streams of the cpu device: an executor thread per stream.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::device::{next_id, CpuDevice};
use super::event::{Completion, CpuEvent};
use super::kernels::{self, with_float, Float};
use super::memory::RawRange;
use super::sanitizer::Access;
use super::{raw, Cpu};
use crate::{checks, host_fn};
use crate::{Copy2d, DType, DeviceError, Element, Float8E4M3, Priority, Readback, Result, Scalar, View};

/// What a job is told when the executor reaches it.
#[derive(Debug)]
pub enum JobInput<'a> {
    /// Run the work.
    Run,
    /// The stream has failed earlier: do not run, only release what the job
    /// holds (fail a readback, tell peers a collective will not come).
    Skip(&'a DeviceError),
}

type JobFn = Box<dyn FnOnce(JobInput<'_>) -> Result<()> + Send>;

enum Job {
    Run { op: &'static str, f: JobFn },
    Wait(Arc<Completion>, u64),
    Stop,
}

#[derive(Debug, Default)]
struct Progress {
    submitted: u64,
    completed: u64,
    error: Option<DeviceError>,
    /// Recorded events behind queued jobs: each completes when `completed`
    /// reaches its count. A record is not a job of its own, so it never costs
    /// the executor a wake-up (the flight recorder records after every call).
    markers: VecDeque<(u64, Arc<Completion>)>,
}

impl Progress {
    /// Completes the markers whose jobs have all run.
    fn complete_markers(&mut self) {
        while let Some((at, _)) = self.markers.front() {
            if *at > self.completed {
                break;
            }
            if let Some((_, c)) = self.markers.pop_front() {
                c.complete(self.error.as_ref().map(poisoned));
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct StreamShared {
    /// The stream's slot in the device's sanitizer (0 without one).
    slot: usize,
    pub(crate) name: String,
    priority: Priority,
    progress: Mutex<Progress>,
    done: Condvar,
}

impl StreamShared {
    fn error(&self) -> Option<DeviceError> {
        self.progress.lock().ok().and_then(|p| p.error.clone())
    }

    pub(crate) fn fail(&self, e: DeviceError) {
        if let Ok(mut p) = self.progress.lock() {
            p.error.get_or_insert(e);
        }
    }

    fn finish_one(&self) {
        if let Ok(mut p) = self.progress.lock() {
            p.completed += 1;
            p.complete_markers();
        }
        self.done.notify_all();
    }

    /// Records `c` after every job submitted so far: at once, on the
    /// caller's thread, when the stream is idle; otherwise when the executor
    /// finishes the last of them.
    fn record(&self, c: Arc<Completion>) -> Result<()> {
        let mut p = self.progress.lock().map_err(|_| DeviceError::invalid("record", "stream state poisoned"))?;
        let at = p.submitted;
        p.markers.push_back((at, c));
        p.complete_markers();
        Ok(())
    }

    pub(crate) fn synchronize(&self, device: &CpuDevice) -> Result<()> {
        let timeout = device.config().timeout;
        let deadline = Instant::now() + timeout;
        let lock_err = || DeviceError::invalid("synchronize", "stream state poisoned");
        let mut p = self.progress.lock().map_err(|_| lock_err())?;
        let target = p.submitted;
        while p.completed < target {
            let now = Instant::now();
            if now >= deadline {
                return Err(DeviceError::Timeout { what: format!("{} to finish", self.name), waited: timeout });
            }
            p = self.done.wait_timeout(p, deadline - now).map_err(|_| lock_err())?.0;
        }
        if let Some(e) = p.error.clone() {
            return Err(e);
        }
        drop(p);
        let slot = self.slot;
        device.with_sanitizer(|s| s.host_synced_stream(slot));
        Ok(())
    }
}

use crate::failure::poisoned;

/// The executor: runs the stream's jobs in order. Every job (and whatever it
/// drops) runs as a host function, so device API calls from inside it are
/// refused as on a GPU (see [`crate::host_fn`]).
fn run_executor(rx: Receiver<Job>, shared: Arc<StreamShared>, device: CpuDevice) {
    let timeout = device.config().timeout;
    while let Ok(job) = rx.recv() {
        match job {
            Job::Run { op, f } => match shared.error() {
                Some(e) => {
                    let skipped = poisoned(&e);
                    let _ = host_fn::run(|| f(JobInput::Skip(&skipped)));
                }
                None => match host_fn::run(|| f(JobInput::Run)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => shared.fail(e),
                    Err(msg) => shared.fail(DeviceError::invalid(op, format!("the operation panicked: {msg}"))),
                },
            },
            Job::Wait(c, event) => {
                if shared.error().is_none() {
                    if let Err(e) = c.wait(timeout, &format!("event #{event} on {}", shared.name)) {
                        shared.fail(poisoned(&e));
                    }
                }
            }
            Job::Stop => break,
        }
        shared.finish_one();
    }
    // Every job of this stream has run, and every later enqueue on another
    // stream takes the sanitizer's lock after this: they are ordered after
    // all of this stream's work, so its records can go.
    let slot = shared.slot;
    device.with_sanitizer(|s| s.retire_stream(slot));
}

/// A stream of the cpu device.
#[derive(Debug)]
pub struct CpuStream {
    pub(crate) shared: Arc<StreamShared>,
    tx: Sender<Job>,
    device: CpuDevice,
    id: u64,
}

impl CpuStream {
    pub(crate) fn spawn(device: &CpuDevice, priority: Priority) -> Result<CpuStream> {
        let number = device.inner.next_stream.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let suffix = if priority == Priority::High { " (high)" } else { "" };
        let name = format!("{}/stream{number}{suffix}", device.label());
        // The sanitizer's slot; the executor frees it when it exits.
        let slot = device.with_sanitizer(|s| s.add_stream(name.clone())).unwrap_or(0);
        let shared = Arc::new(StreamShared {
            slot,
            name: name.clone(),
            priority,
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = shared.clone();
        let executor_device = device.clone();
        std::thread::Builder::new().name(name).spawn(move || run_executor(rx, worker, executor_device)).map_err(
            |e| {
                device.with_sanitizer(|s| s.retire_stream(slot));
                DeviceError::Backend { library: "std::thread", code: 0, message: e.to_string() }
            },
        )?;
        device.inner.streams.add(&shared);
        Ok(CpuStream { shared, tx, device: device.clone(), id: next_id() })
    }

    /// A process-unique id of this stream.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether an operation of this stream has failed (later ones are skipped).
    pub fn failed(&self) -> bool {
        self.shared.error().is_some()
    }

    /// Operations enqueued so far.
    pub(crate) fn submitted(&self) -> u64 {
        self.shared.progress.lock().map(|p| p.submitted).unwrap_or(0)
    }

    fn send(&self, job: Job) -> Result<()> {
        match &job {
            // The sanitizer's allocation job: the allocation is counted where it is made.
            Job::Run { op: "alloc", .. } => {}
            Job::Run { op, .. } => self.device.inner.calls.note(op),
            Job::Wait(..) => self.device.inner.calls.note("wait"),
            Job::Stop => {}
        }
        if let Ok(mut p) = self.shared.progress.lock() {
            p.submitted += 1;
        }
        self.tx.send(job).map_err(|_| {
            if let Ok(mut p) = self.shared.progress.lock() {
                p.submitted -= 1;
            }
            DeviceError::invalid("enqueue", format!("the executor of {} has stopped", self.shared.name))
        })
    }

    /// Enqueues a job that declares `accesses`. With the sanitizer on, the
    /// accesses are checked first and a race is returned without enqueueing.
    /// The job is called once, with [`JobInput::Run`] normally or
    /// [`JobInput::Skip`] if the stream has failed; an error it returns
    /// fails the stream.
    pub fn enqueue(
        &self,
        op: &'static str,
        accesses: &[Access],
        f: impl FnOnce(JobInput<'_>) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        host_fn::check(op)?;
        let job = Job::Run { op, f: Box::new(f) };
        match &self.device.inner.sanitizer {
            Some(s) => {
                let mut s = s.lock().map_err(|_| DeviceError::invalid(op, "sanitizer poisoned"))?;
                s.enqueue(self.shared.slot, op, accesses).map_err(DeviceError::Race)?;
                // Sent under the lock so queue order matches the clocks.
                self.send(job)
            }
            None => self.send(job),
        }
    }

    pub(super) fn own(&self, op: &'static str, v: &View<'_, Cpu>) -> Result<RawRange> {
        checks::on_device(op, &self.device, v)?;
        // Copies and host work reach host buffers on every device; kernels only where the device says so.
        let copy =
            matches!(op, "copy" | "copy_2d" | "copy_2d_batch" | "copy_from_host" | "copy_to_host" | "update_on_host");
        if !copy
            && !self.device.inner.config.host_kernels
            && crate::Buffer::space(v.buffer()) == crate::MemorySpace::Host
        {
            return Err(DeviceError::invalid(op, "a host buffer, which this device's kernels do not reach"));
        }
        Ok(raw(*v))
    }

    /// Enqueues an elementwise job over `inputs` (read) and `output` (written).
    /// Inputs that overlap the output are copied first so the kernel sees
    /// disjoint slices.
    pub(super) fn map_job<const N: usize>(
        &self,
        op: &'static str,
        inputs: [View<'_, Cpu>; N],
        output: View<'_, Cpu>,
        kernel: impl FnOnce([&[u8]; N], &mut [u8]) + Send + 'static,
    ) -> Result<()> {
        let out = self.own(op, &output)?;
        let mut ins = Vec::with_capacity(N);
        let mut accesses = Vec::with_capacity(N + 1);
        for v in &inputs {
            ins.push(self.own(op, v)?);
            accesses.push(Access::read(*v));
        }
        accesses.push(Access::write(output));
        self.enqueue(op, &accesses, move |input| {
            if let JobInput::Skip(_) = input {
                return Ok(());
            }
            let copies: Vec<Option<Vec<u64>>> = ins
                .iter()
                .map(|r| {
                    r.overlaps(&out).then(|| {
                        // u64 words keep the copy aligned for any dtype.
                        let mut words = vec![0u64; r.bytes().div_ceil(8)];
                        // SAFETY: stream order makes this job the only writer; reading before writing.
                        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..r.bytes()]
                            .copy_from_slice(unsafe { r.as_bytes() });
                        words
                    })
                })
                .collect();
            let slices: [&[u8]; N] = std::array::from_fn(|i| match &copies[i] {
                Some(w) => &bytemuck::cast_slice::<u64, u8>(w)[..ins[i].bytes()],
                // SAFETY: no overlap with the output; stream order excludes other writers.
                None => unsafe { ins[i].as_bytes() },
            });
            // SAFETY: the sole access to the output range in this job.
            kernel(slices, unsafe { out.as_bytes_mut() });
            Ok(())
        })
    }
}

/// Fills `d` with copies of one element's bytes: the element, then the
/// filled prefix doubled — a few large copies instead of one per element.
fn fill_with(d: &mut [u8], pattern: &[u8]) {
    let Some(first) = d.get_mut(..pattern.len()) else { return };
    first.copy_from_slice(pattern);
    let mut filled = pattern.len();
    while filled < d.len() {
        let n = filled.min(d.len() - filled);
        d.copy_within(..n, filled);
        filled += n;
    }
}

/// The blocks of one 2-D copy, checked by `checks::copy_2d` (in bounds,
/// disjoint views). Only the blocks are touched, so it writes through the
/// raw range instead of rewriting the whole destination.
fn copy_blocks(s: &RawRange, d: &RawRange, layout: &Copy2d) {
    let size = s.dtype().size();
    // SAFETY: disjoint views (checked when enqueued); stream order excludes
    // other access while the job runs, and the slices end with this call.
    let (s, d) = unsafe { (s.as_bytes(), d.as_bytes_mut()) };
    let n = layout.row_len * size;
    // Empty blocks may start past the end (a rank with no real rows).
    for i in (0..layout.rows).filter(|_| n > 0) {
        let so = (layout.src_offset + i * layout.src_stride) * size;
        let d_o = (layout.dst_offset + i * layout.dst_stride) * size;
        d[d_o..d_o + n].copy_from_slice(&s[so..so + n]);
    }
}

pub(super) fn typed<T: Element>(b: &[u8]) -> &[T] {
    bytemuck::cast_slice(b)
}
pub(super) fn typed_mut<T: Element>(b: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(b)
}

/// Stores `value` (an f64 result) into a one-element f32 or f64 output.
pub(super) fn store_scalar<T: Float>(out: &mut [u8], value: f64, accumulate: bool) {
    let o = &mut typed_mut::<T>(out)[0];
    let v = if accumulate { o.to_f64() + value } else { value };
    *o = T::from_f64(v);
}

impl crate::Stream for CpuStream {
    type B = Cpu;

    fn device(&self) -> &CpuDevice {
        &self.device
    }
    fn priority(&self) -> Priority {
        self.shared.priority
    }
    fn name(&self) -> String {
        self.shared.name.clone()
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<super::CpuBuffer> {
        let buf = self.device.alloc_uninit(dtype, len)?;
        // With the sanitizer on, the allocation counts as a write on this
        // stream, so another stream touching it without an event is reported
        // like any other race. Without it the memory is ready at once (no
        // earlier work uses a block the pool hands out), so no job is queued
        // and the executor is not woken for nothing.
        if self.device.sanitizer_enabled() {
            self.enqueue("alloc", &[Access::write(View::whole(&buf))], |_| Ok(()))?;
        }
        Ok(buf)
    }

    fn copy(&self, src: View<'_, Cpu>, dst: View<'_, Cpu>) -> Result<()> {
        checks::copy(src, dst)?;
        self.map_job("copy", [src], dst, |[s], d| d.copy_from_slice(s))
    }

    fn copy_2d(&self, src: View<'_, Cpu>, dst: View<'_, Cpu>, layout: Copy2d) -> Result<()> {
        let op = "copy_2d";
        checks::copy_2d(src, dst, &layout)?;
        let (s, d) = (self.own(op, &src)?, self.own(op, &dst)?);
        self.enqueue(op, &[Access::read(src), Access::write(dst)], move |input| {
            if let JobInput::Run = input {
                copy_blocks(&s, &d, &layout);
            }
            Ok(())
        })
    }

    fn copy_2d_batch(&self, copies: &[crate::Copy2dPiece<'_, Cpu>]) -> Result<()> {
        let op = "copy_2d_batch";
        let mut ranges = Vec::with_capacity(copies.len());
        for (src, dst, layout) in copies {
            checks::copy_2d(*src, *dst, layout)?;
            ranges.push((self.own(op, src)?, self.own(op, dst)?, *layout));
        }
        // The accesses are only read by the sanitizer: without it, none are built.
        let accesses: Vec<Access> = match self.device.sanitizer_enabled() {
            true => copies.iter().flat_map(|(s, d, _)| [Access::read(*s), Access::write(*d)]).collect(),
            false => Vec::new(),
        };
        self.enqueue(op, &accesses, move |input| {
            if let JobInput::Run = input {
                ranges.iter().for_each(|(s, d, layout)| copy_blocks(s, d, layout));
            }
            Ok(())
        })
    }

    fn copy_from_host(&self, src: &[u8], dst: View<'_, Cpu>) -> Result<()> {
        checks::copy_from_host(src, dst)?;
        let out = self.own("copy_from_host", &dst)?;
        let staged = src.to_vec();
        self.enqueue("copy_from_host", &[Access::write(dst)], move |input| {
            if let JobInput::Run = input {
                // SAFETY: the only access to this range in stream order.
                unsafe { out.as_bytes_mut() }.copy_from_slice(&staged);
            }
            Ok(())
        })
    }

    fn copy_to_host(&self, src: View<'_, Cpu>) -> Result<Readback> {
        let input = self.own("copy_to_host", &src)?;
        let (readback, filler) = Readback::pending(src.dtype(), src.len(), self.device.config().timeout);
        self.enqueue("copy_to_host", &[Access::read(src)], move |job| {
            match job {
                // SAFETY: stream order excludes concurrent writers.
                JobInput::Run => filler.fill(unsafe { input.as_bytes() }.to_vec()),
                JobInput::Skip(e) => filler.fail(e.clone()),
            }
            Ok(())
        })?;
        Ok(readback)
    }

    fn fill(&self, dst: View<'_, Cpu>, value: Scalar) -> Result<()> {
        let pattern = checks::fill(dst, value)?;
        self.map_job("fill", [], dst, move |[], d| fill_with(d, &pattern))
    }

    fn fill_batch(&self, dsts: &[View<'_, Cpu>], value: Scalar) -> Result<()> {
        let op = "fill_batch";
        let mut ranges = Vec::with_capacity(dsts.len());
        for dst in dsts {
            ranges.push((self.own(op, dst)?, checks::fill(*dst, value)?));
        }
        let accesses: Vec<Access> = match self.device.sanitizer_enabled() {
            true => dsts.iter().map(|d| Access::write(*d)).collect(),
            false => Vec::new(),
        };
        self.enqueue(op, &accesses, move |input| {
            if let JobInput::Run = input {
                // SAFETY: each range is this job's alone in stream order; one slice at a time.
                ranges.iter().for_each(|(d, pattern)| fill_with(unsafe { d.as_bytes_mut() }, pattern));
            }
            Ok(())
        })
    }

    fn cast(&self, src: View<'_, Cpu>, dst: View<'_, Cpu>) -> Result<()> {
        checks::cast(src, dst)?;
        let (sd, dd) = (src.dtype(), dst.dtype());
        self.map_job(
            "cast",
            [src],
            dst,
            move |[s], d| with_float!(sd, S => with_float!(dd, D => kernels::cast::<S, D>(typed(s), typed_mut(d)))),
        )
    }

    fn scale(&self, x: View<'_, Cpu>, alpha: f64) -> Result<()> {
        checks::scale(x)?;
        let d = x.dtype();
        self.map_job("scale", [], x, move |[], x| with_float!(d, T => kernels::scale::<T>(typed_mut(x), alpha)))
    }

    fn abs_max(&self, x: View<'_, Cpu>, out: View<'_, Cpu>, accumulate: bool) -> Result<()> {
        checks::abs_max(x, out)?;
        let d = x.dtype();
        self.map_job("abs_max", [x, out], out, move |[x, old], o| {
            let m = with_float!(d, T => kernels::abs_max::<T>(typed(x)));
            let old = typed::<f32>(old)[0];
            typed_mut::<f32>(o)[0] = if accumulate { kernels::max_nan(old, m) } else { m };
        })
    }

    fn quantize_f8(&self, src: View<'_, Cpu>, amax: View<'_, Cpu>, dst: View<'_, Cpu>) -> Result<()> {
        checks::scaled_f8("quantize_f8", src, amax, dst)?;
        let d = src.dtype();
        self.map_job("quantize_f8", [src, amax], dst, move |[s, a], o| {
            let scale = Float8E4M3::scale_for(typed::<f32>(a)[0]);
            with_float!(d, S => kernels::quantize_f8::<S>(typed(s), scale, typed_mut(o)))
        })
    }

    fn dequantize_f8(&self, src: View<'_, Cpu>, amax: View<'_, Cpu>, dst: View<'_, Cpu>) -> Result<()> {
        checks::scaled_f8("dequantize_f8", dst, amax, src)?;
        let d = dst.dtype();
        self.map_job("dequantize_f8", [src, amax], dst, move |[s, a], o| {
            let scale = Float8E4M3::scale_for(typed::<f32>(a)[0]);
            with_float!(d, D => kernels::dequantize_f8::<D>(typed(s), scale, typed_mut(o)))
        })
    }

    fn accumulate(&self, src: View<'_, Cpu>, dst: View<'_, Cpu>) -> Result<()> {
        checks::accumulate(src, dst)?;
        let (sd, dd) = (src.dtype(), dst.dtype());
        if sd.is_float() && dd.is_float() {
            return self.map_job("accumulate", [src, dst], dst, move |[s, o], d| {
                d.copy_from_slice(o);
                with_float!(sd, S => with_float!(dd, D => kernels::accumulate::<S, D>(typed(s), typed_mut(d))))
            });
        }
        self.map_job("accumulate", [src, dst], dst, move |[s, o], d| {
            d.copy_from_slice(o);
            match dd {
                DType::I32 => kernels::accumulate_int::<i32>(typed(s), typed_mut(d)),
                DType::I64 => kernels::accumulate_int::<i64>(typed(s), typed_mut(d)),
                DType::I8 => kernels::accumulate_int::<i8>(typed(s), typed_mut(d)),
                _ => kernels::accumulate_int::<u8>(s, d),
            }
        })
    }

    fn axpy(&self, alpha: f64, x: View<'_, Cpu>, y: View<'_, Cpu>) -> Result<()> {
        checks::axpy(x, y)?;
        let (xd, yd) = (x.dtype(), y.dtype());
        self.map_job("axpy", [x, y], y, move |[x, o], y| {
            y.copy_from_slice(o);
            with_float!(xd, S => with_float!(yd, D => kernels::axpy::<S, D>(alpha, typed(x), typed_mut(y))))
        })
    }

    fn record(&self, event: &CpuEvent) -> Result<()> {
        host_fn::check("record")?;
        checks::same_device("record", "an event", &self.device, &event.device)?;
        let completion = event.begin_record();
        self.device.inner.calls.note("record");
        match &self.device.inner.sanitizer {
            Some(s) => {
                let mut s = s.lock().map_err(|_| DeviceError::invalid("record", "sanitizer poisoned"))?;
                s.record_event(event.id, self.shared.slot);
                self.shared.record(completion)
            }
            None => self.shared.record(completion),
        }
    }

    fn wait(&self, event: &CpuEvent) -> Result<()> {
        host_fn::check("wait")?;
        checks::same_device("wait", "an event", &self.device, &event.device)?;
        let Some(completion) = event.current() else {
            return Ok(());
        };
        match &self.device.inner.sanitizer {
            Some(s) => {
                let mut s = s.lock().map_err(|_| DeviceError::invalid("wait", "sanitizer poisoned"))?;
                s.wait_event(event.id, self.shared.slot);
                self.send(Job::Wait(completion, event.id))
            }
            None => self.send(Job::Wait(completion, event.id)),
        }
    }

    fn synchronize(&self) -> Result<()> {
        host_fn::check("stream synchronize")?;
        self.shared.synchronize(&self.device)
    }

    fn update_on_host(&self, reads: &[View<'_, Cpu>], writes: &[View<'_, Cpu>], f: crate::HostUpdate) -> Result<()> {
        let op = "update_on_host";
        checks::update_on_host(reads, writes)?;
        let read_ranges = reads.iter().map(|v| self.own(op, v)).collect::<Result<Vec<_>>>()?;
        let write_ranges = writes.iter().map(|v| self.own(op, v)).collect::<Result<Vec<_>>>()?;
        let accesses: Vec<Access> =
            reads.iter().map(|v| Access::read(*v)).chain(writes.iter().map(|v| Access::write(*v))).collect();
        self.enqueue(op, &accesses, move |input| match input {
            JobInput::Run => {
                // SAFETY: stream order excludes concurrent writers of these ranges, and the
                // written ranges overlap nothing else (checked), so the slices do not alias.
                let read: Vec<&[u8]> = read_ranges.iter().map(|r| unsafe { r.as_bytes() }).collect();
                // SAFETY: as above.
                let mut written: Vec<&mut [u8]> = write_ranges.iter().map(|r| unsafe { r.as_bytes_mut() }).collect();
                f(&read, &mut written)
            }
            JobInput::Skip(_) => Ok(()),
        })
    }

    fn launch_host_fn(&self, f: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        // A panic fails the stream with its message: the executor catches it.
        self.enqueue("launch_host_fn", &[], move |input| {
            match input {
                JobInput::Run => f(Ok(())),
                JobInput::Skip(e) => f(Err(e.clone())),
            }
            Ok(())
        })
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        self.device.check_drop("a cpu stream");
        // The executor drains what is queued, then exits; jobs keep their
        // buffers alive, so nothing waits here.
        let _ = self.tx.send(Job::Stop);
    }
}
