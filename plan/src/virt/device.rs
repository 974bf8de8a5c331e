//! The virtual device: memory counters, the host clock, events and the trace.
//!
//! The device makes its streams, and each holds its device (its clock and
//! trace): `device.rs` and `stream.rs` depend on each other, as the cpu
//! device's do.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use chorus_devices::{Buffer, BufferMeta, DType, DeviceError, MemCounters, MemorySpace, MemoryStats, Priority, Result};

use super::{Virt, VirtStream};
use crate::cost::CostModel;

/// How a virtual device behaves.
#[derive(Clone, Debug)]
pub struct VirtConfig {
    /// The device's index (the rank, in a plan).
    pub ordinal: usize,
    /// Whether kernels may touch host buffers: true to model the cpu device
    /// (FSDP's offload then needs no staging buffers), false for a GPU.
    pub kernels_reach_host: bool,
}

/// One operation of the trace: which stream (in creation order), what, and when.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceOp {
    /// The stream's index on its device, in creation order.
    pub stream: usize,
    /// What ran (`"all_gather"`, `"layers.3.attn.qkv"`).
    pub name: String,
    /// Start, seconds of virtual time.
    pub start: f64,
    /// End, seconds of virtual time.
    pub end: f64,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) config: VirtConfig,
    pub(crate) cost: Arc<dyn CostModel>,
    /// FSDP's (everything allocated through the device API), device space.
    pub(crate) device_mem: MemCounters,
    pub(crate) host_mem: MemCounters,
    /// The model's activations ([`VirtDevice::alloc_activation`]), apart from FSDP's.
    pub(crate) activations: MemCounters,
    /// Device space, FSDP's and the activations together.
    pub(crate) total: MemCounters,
    /// No operation starts before this (seconds, f64 bits): what the host waited for.
    host_clock: AtomicU64,
    /// Each stream's clock (f64 bits), in creation order: what a device synchronize waits for.
    clocks: Mutex<Vec<Arc<AtomicU64>>>,
    tracing: AtomicBool,
    trace: Mutex<Vec<TraceOp>>,
    /// A GPU's offloaded optimizer step in progress ([`VirtDevice::set_host_steps`]).
    host_steps: AtomicBool,
    /// Seconds the host has spent in optimizer steps (f64 bits).
    host_step_s: AtomicU64,
    /// Readbacks the host reads later ([`VirtDevice::set_deferred_readbacks`]).
    deferred_readbacks: AtomicBool,
    /// Seconds the host has spent issuing operations ([`VirtDevice::host_work`], f64 bits).
    host_issue_s: AtomicU64,
}

/// A device that keeps sizes and virtual time. Cheap to clone; clones are the same device.
#[derive(Clone, Debug)]
pub struct VirtDevice {
    pub(crate) inner: Arc<DeviceInner>,
}

static NEXT_BUFFER: AtomicU64 = AtomicU64::new(1);

/// The most operations a trace keeps (a timeline of a step of thousands of
/// layers would otherwise hold millions of bars).
pub const MAX_TRACE_OPS: usize = 200_000;

impl VirtDevice {
    /// A device whose operations take the times `cost` gives.
    pub fn new(config: VirtConfig, cost: Arc<dyn CostModel>) -> VirtDevice {
        VirtDevice {
            inner: Arc::new(DeviceInner {
                config,
                cost,
                device_mem: MemCounters::default(),
                host_mem: MemCounters::default(),
                activations: MemCounters::default(),
                total: MemCounters::default(),
                host_clock: AtomicU64::new(0f64.to_bits()),
                clocks: Mutex::new(Vec::new()),
                tracing: AtomicBool::new(false),
                trace: Mutex::new(Vec::new()),
                host_steps: AtomicBool::new(false),
                host_step_s: AtomicU64::new(0f64.to_bits()),
                deferred_readbacks: AtomicBool::new(false),
                host_issue_s: AtomicU64::new(0f64.to_bits()),
            }),
        }
    }

    /// The cost model.
    pub fn cost(&self) -> &Arc<dyn CostModel> {
        &self.inner.cost
    }

    /// The host's clock: the latest time the host has waited for.
    pub fn host_clock(&self) -> f64 {
        f64::from_bits(self.inner.host_clock.load(Ordering::Acquire))
    }

    /// Turns deferred readbacks on or off. A readback's copy runs in its
    /// stream's order either way; with them off the host waits for it at once
    /// (a blocking read), with them on it does not, and the caller says when
    /// the host waits (an event's `synchronize`), as a loop that reads a
    /// step's loss during the next step does.
    pub fn set_deferred_readbacks(&self, on: bool) {
        self.inner.deferred_readbacks.store(on, Ordering::Release)
    }

    /// Whether readbacks are deferred.
    pub(crate) fn deferred_readbacks(&self) -> bool {
        self.inner.deferred_readbacks.load(Ordering::Acquire)
    }

    /// Moves the host clock to at least `t` (the host waited until then).
    pub fn advance_host(&self, t: f64) {
        raise(&self.inner.host_clock, t)
    }

    /// The host works for `seconds` (non-negative and finite, else nothing):
    /// its clock moves on by that much from where it is.
    pub fn host_work(&self, seconds: f64) {
        if seconds.is_finite() && seconds > 0.0 {
            super::update(&self.inner.host_clock, |t| t + seconds);
            super::update(&self.inner.host_issue_s, |t| t + seconds);
        }
    }

    /// Seconds the host has spent issuing operations so far (its
    /// [`VirtDevice::host_work`], waits not counted).
    pub fn host_issue_seconds(&self) -> f64 {
        f64::from_bits(self.inner.host_issue_s.load(Ordering::Acquire))
    }

    /// The latest end of any operation so far: the latest stream clock.
    pub fn latest_end(&self) -> f64 {
        let clocks = self.inner.clocks.lock().map(|c| c.clone()).unwrap_or_default();
        clocks.iter().map(|c| f64::from_bits(c.load(Ordering::Acquire))).fold(0.0, f64::max)
    }

    /// Starts or stops appending operations to the trace.
    pub fn set_tracing(&self, on: bool) {
        self.inner.tracing.store(on, Ordering::Release);
    }

    pub(crate) fn tracing(&self) -> bool {
        self.inner.tracing.load(Ordering::Acquire)
    }

    /// Appends `op` to the trace; an op that continues the last one (same
    /// stream and name, starting at its end) extends it, so FSDP's one copy
    /// per rank of a copy-out is one bar, not thousands. The trace keeps
    /// the first [`MAX_TRACE_OPS`] operations.
    pub(crate) fn push_trace(&self, op: TraceOp) {
        if let Ok(mut t) = self.inner.trace.lock() {
            let room = t.len() < MAX_TRACE_OPS;
            match t.last_mut() {
                Some(last) if last.stream == op.stream && last.end == op.start && last.name == op.name => {
                    last.end = op.end
                }
                _ if room => t.push(op),
                _ => {}
            }
        }
    }

    /// The operations traced so far, leaving none.
    pub fn take_trace(&self) -> Vec<TraceOp> {
        self.inner.trace.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default()
    }

    /// Activation memory: counted apart from FSDP's (and in the total) until
    /// the returned guard is dropped.
    pub fn alloc_activation(&self, bytes: u64) -> Result<ActivationBuf> {
        let bytes =
            usize::try_from(bytes).map_err(|_| DeviceError::OutOfMemory { device: self.label(), bytes: usize::MAX })?;
        self.inner.activations.add(bytes);
        self.inner.total.add(bytes);
        Ok(ActivationBuf { device: self.clone(), bytes })
    }

    /// The activations' counters.
    pub fn activation_stats(&self) -> MemoryStats {
        self.inner.activations.stats()
    }

    /// Device memory of FSDP and the activations together.
    pub fn total_stats(&self) -> MemoryStats {
        self.inner.total.stats()
    }

    /// Resets every peak (FSDP's, host, activations, total) to what is in use now.
    pub fn reset_all_peaks(&self) {
        for c in [&self.inner.device_mem, &self.inner.host_mem, &self.inner.activations, &self.inner.total] {
            c.reset_peak();
        }
    }

    pub(crate) fn label(&self) -> String {
        format!("virtual:{}", self.inner.config.ordinal)
    }

    fn alloc_in(&self, space: MemorySpace, dtype: DType, len: usize) -> Result<VirtBuffer> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| DeviceError::OutOfMemory { device: self.label(), bytes: usize::MAX })?;
        match space {
            MemorySpace::Device => {
                self.inner.device_mem.add(bytes);
                self.inner.total.add(bytes);
            }
            MemorySpace::Host => self.inner.host_mem.add(bytes),
        }
        let id = NEXT_BUFFER.fetch_add(1, Ordering::Relaxed);
        Ok(VirtBuffer { meta: BufferMeta::new(dtype, len, id, self.clone(), space) })
    }

    pub(crate) fn alloc_device(&self, dtype: DType, len: usize) -> Result<VirtBuffer> {
        self.alloc_in(MemorySpace::Device, dtype, len)
    }

    /// Registers a new stream's clock; returns the stream's index.
    pub(crate) fn add_stream(&self, clock: Arc<AtomicU64>) -> usize {
        match self.inner.clocks.lock() {
            Ok(mut c) => {
                c.push(clock);
                c.len() - 1
            }
            Err(_) => usize::MAX,
        }
    }
}

impl chorus_devices::Device for VirtDevice {
    type B = Virt;

    fn name(&self) -> String {
        self.label()
    }
    fn ordinal(&self) -> usize {
        self.inner.config.ordinal
    }
    fn is_same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
    fn create_stream(&self, priority: Priority) -> Result<VirtStream> {
        chorus_devices::host_fn::check("create_stream")?;
        Ok(VirtStream::new(self, priority))
    }
    fn create_event(&self) -> Result<VirtEvent> {
        chorus_devices::host_fn::check("create_event")?;
        Ok(VirtEvent { device: self.clone(), time: Mutex::new(None) })
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<VirtBuffer> {
        chorus_devices::host_fn::check("alloc")?;
        self.alloc_device(dtype, len)
    }
    fn memory_stats(&self) -> MemoryStats {
        self.inner.device_mem.stats()
    }
    fn reset_peak_memory(&self) {
        self.inner.device_mem.reset_peak()
    }
    fn alloc_host(&self, dtype: DType, len: usize, _pinned: bool) -> Result<VirtBuffer> {
        chorus_devices::host_fn::check("alloc_host")?;
        self.alloc_in(MemorySpace::Host, dtype, len)
    }
    fn host_memory_stats(&self) -> MemoryStats {
        self.inner.host_mem.stats()
    }
    fn reset_peak_host_memory(&self) {
        self.inner.host_mem.reset_peak()
    }
    fn kernels_reach_host(&self) -> bool {
        self.inner.config.kernels_reach_host || self.host_steps()
    }
    /// Returns at once; the host clock moves to the end of all work enqueued so far.
    fn synchronize(&self) -> Result<()> {
        chorus_devices::host_fn::check("device synchronize")?;
        self.advance_host(self.latest_end());
        Ok(())
    }
}

/// Moves the f64 held in `cell` (as bits) to at least `t`.
fn raise(cell: &AtomicU64, t: f64) {
    let mut cur = cell.load(Ordering::Acquire);
    while f64::from_bits(cur) < t {
        match cell.compare_exchange(cur, t.to_bits(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
}

/// A buffer: a dtype and a length, counted while the handle lives.
#[derive(Debug)]
pub struct VirtBuffer {
    meta: BufferMeta<Virt>,
}

impl chorus_devices::Buffer for VirtBuffer {
    type B = Virt;
    fn meta(&self) -> &BufferMeta<Virt> {
        &self.meta
    }
}

impl Drop for VirtBuffer {
    fn drop(&mut self) {
        // `len * size` did not overflow when the buffer was made.
        let bytes = self.bytes();
        let inner = &self.device().inner;
        match self.space() {
            MemorySpace::Device => {
                inner.device_mem.sub(bytes);
                inner.total.sub(bytes);
            }
            MemorySpace::Host => inner.host_mem.sub(bytes),
        }
    }
}

/// Activation memory of the model, counted until dropped ([`VirtDevice::alloc_activation`]).
#[derive(Debug)]
pub struct ActivationBuf {
    device: VirtDevice,
    bytes: usize,
}

impl ActivationBuf {
    /// Its size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for ActivationBuf {
    fn drop(&mut self) {
        self.device.inner.activations.sub(self.bytes);
        self.device.inner.total.sub(self.bytes);
    }
}

/// An event: the clock of the stream it was last recorded on, at the record.
#[derive(Debug)]
pub struct VirtEvent {
    pub(crate) device: VirtDevice,
    pub(crate) time: Mutex<Option<f64>>,
}

impl VirtEvent {
    /// The time of the most recent record (`None` if never recorded).
    pub fn time(&self) -> Option<f64> {
        self.time.lock().ok().and_then(|t| *t)
    }
}

impl chorus_devices::Event for VirtEvent {
    type B = Virt;
    fn synchronize(&self) -> Result<()> {
        chorus_devices::host_fn::check("event synchronize")?;
        if let Some(t) = self.time() {
            self.device.advance_host(t);
        }
        Ok(())
    }
    /// Virtual work is always finished as far as the host can tell.
    fn query(&self) -> Result<bool> {
        Ok(true)
    }
}

/// A GPU's offloaded optimizer step. FSDP steps an offloaded parameter on
/// the host when the device's kernels cannot reach host memory, reading
/// every buffer back into a `Vec` (`fsdp/src/optim.rs`, `host_step`): on
/// the virtual device that would hold and compute real zeros, as large as
/// the shards. While host steps are on, the device says its kernels reach
/// host memory, so FSDP enqueues the step kernels on the host buffers
/// instead, and the stream charges them to the host (`VirtStream`'s
/// optimizer kernels): the same work at the same point, without the data.
impl VirtDevice {
    /// Turns host steps on (around a GPU's offloaded optimizer step) or off.
    pub fn set_host_steps(&self, on: bool) {
        self.inner.host_steps.store(on, Ordering::Release)
    }

    /// Whether host steps are on.
    pub(crate) fn host_steps(&self) -> bool {
        self.inner.host_steps.load(Ordering::Acquire)
    }

    /// Seconds the host has spent in optimizer steps so far.
    pub fn host_step_seconds(&self) -> f64 {
        f64::from_bits(self.inner.host_step_s.load(Ordering::Acquire))
    }

    /// Host work of `seconds` that needs the stream's work up to
    /// `not_before` (the host waits for it, then computes): the host clock
    /// moves to the end, and no later operation starts before it.
    pub(crate) fn run_on_host(&self, not_before: f64, seconds: f64) {
        let seconds = if seconds.is_finite() && seconds > 0.0 { seconds } else { 0.0 };
        self.advance_host(self.host_clock().max(not_before) + seconds);
        super::update(&self.inner.host_step_s, |t| t + seconds);
    }
}
