//! The trait family every device backend implements.
//!
//! One [`Backend`] trait carries the associated types; each role trait
//! ([`Device`], [`Stream`], [`Event`], [`Buffer`]) points back to it, so a
//! stream of one backend cannot be handed an event or buffer of another: the
//! mix does not compile.
//!
//! # Ordering
//! Every data operation on a [`Stream`] is *enqueued* and returns at once.
//! Operations on one stream run in the order they were enqueued. Across
//! streams, order exists only through events: [`Stream::record`] on stream A,
//! then [`Stream::wait`] on stream B makes everything B runs afterwards start
//! after what A had enqueued before the record. The host observes results
//! only after [`Stream::synchronize`] or [`Event::synchronize`] (both block)
//! or a completed [`Readback`]. [`Event::query`] never blocks.
//!
//! # Errors
//! Argument errors (lengths, dtypes, ranges) are returned by the enqueuing
//! call and nothing is enqueued. Failures while an operation runs are
//! asynchronous: they are sticky on the stream, every later operation on it
//! is skipped, and the next host synchronize on that stream (or on an event
//! recorded after the failure, or on a stream that waited for such an event)
//! returns the error.

use crate::{DType, DeviceError, Readback, Scalar, View};
use std::fmt;

/// Result of device operations.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// The backend: only associated types, so role traits can refer to each other.
pub trait Backend: Sized + Send + Sync + fmt::Debug + 'static {
    /// The backend's name (`cpu`, `cuda`, `hip`).
    const NAME: &'static str;
    /// A device (a GPU, or the host for `cpu`).
    type Device: Device<B = Self>;
    /// An in-order queue of work on a device.
    type Stream: Stream<B = Self>;
    /// A marker recorded on a stream; other streams and the host can wait for it.
    type Event: Event<B = Self>;
    /// Owned device memory.
    type Buffer: Buffer<B = Self>;
}

/// Declares a backend's uninhabited marker type and its [`Backend`] impl (each backend's is only these names).
#[macro_export]
macro_rules! backend {
    ($(#[$doc:meta])* $name:ident = $label:literal: $device:ty, $stream:ty, $event:ty, $buffer:ty) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub enum $name {}

        impl $crate::Backend for $name {
            const NAME: &'static str = $label;
            type Device = $device;
            type Stream = $stream;
            type Event = $event;
            type Buffer = $buffer;
        }
    };
}

/// Stream priority. Every device accepts both; a device without priorities treats them alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Priority {
    /// The default priority.
    #[default]
    Normal,
    /// Scheduled ahead of normal-priority work where the device supports it
    /// (FSDP puts its communication streams here).
    High,
}

/// Memory statistics of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Bytes held by live buffers now.
    pub bytes_in_use: usize,
    /// The most bytes in use at once since the device was made or the peak was reset.
    pub peak_bytes: usize,
    /// Number of live allocations.
    pub live_allocations: usize,
}

/// Which of a device's two memory spaces a buffer lives in.
///
/// Every device has device memory (what [`Device::alloc`] and
/// [`Stream::alloc`] return) and host memory ([`Device::alloc_host`]: pinned
/// where the device has pinned memory), counted apart
/// ([`Device::memory_stats`], [`Device::host_memory_stats`]). Data moves
/// between the spaces through [`Stream::copy`] (host-to-device and
/// device-to-host copies on a GPU).
///
/// What a device operation may do with a host buffer: on the cpu device,
/// anything (both spaces are plain memory there); on cuda and hip, only
/// [`Stream::copy`] from or to it and the host's own access (reading it
/// back, [`Stream::copy_from_host`]) — a kernel never touches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MemorySpace {
    /// The device's own memory.
    #[default]
    Device,
    /// Host memory allocated through the device (pinned where it has that).
    Host,
}

/// A device: creates streams, events and buffers, and reports memory.
pub trait Device: Clone + Send + Sync + fmt::Debug + 'static {
    /// The backend.
    type B: Backend<Device = Self>;

    /// A human-readable name (`cpu:0`, `cuda:1 (NVIDIA H100)`).
    fn name(&self) -> String;
    /// The device's index among devices of its backend in this process.
    fn ordinal(&self) -> usize;
    /// Whether two handles are the same device (clones of one device are).
    fn is_same(&self, other: &Self) -> bool;
    /// Creates a stream with the given priority.
    fn create_stream(&self, priority: Priority) -> Result<<Self::B as Backend>::Stream>;
    /// Creates an event that has never been recorded (synchronizing or
    /// waiting on it returns at once).
    fn create_event(&self) -> Result<<Self::B as Backend>::Event>;
    /// Allocates `len` zeroed elements of `dtype`, synchronously: the buffer
    /// may be used on any stream at once.
    fn alloc(&self, dtype: DType, len: usize) -> Result<<Self::B as Backend>::Buffer>;
    /// Current memory statistics of device memory.
    fn memory_stats(&self) -> MemoryStats;
    /// Resets the device memory's peak to the bytes in use now.
    fn reset_peak_memory(&self);
    /// Allocates `len` zeroed elements of `dtype` in host memory
    /// ([`MemorySpace::Host`]), synchronously, counted in
    /// [`Device::host_memory_stats`]: page-locked (pinned) when `pinned` and
    /// the device has pinned memory, else pageable. See [`MemorySpace`] for
    /// what device operations may do with it. A device without a host space
    /// of its own returns an error.
    fn alloc_host(&self, dtype: DType, len: usize, pinned: bool) -> Result<<Self::B as Backend>::Buffer> {
        let _ = (dtype, len, pinned);
        Err(DeviceError::invalid("alloc_host", format!("{} has no host memory space in chorus", self.name())))
    }
    /// Current memory statistics of host memory allocated through this device.
    fn host_memory_stats(&self) -> MemoryStats {
        MemoryStats::default()
    }
    /// Resets the host memory's peak to the bytes in use now.
    fn reset_peak_host_memory(&self) {}
    /// Whether device operations (kernels) may read and write host buffers
    /// of this device: true on the cpu device only (see [`MemorySpace`]).
    fn kernels_reach_host(&self) -> bool {
        false
    }
    /// Starts counting this device's calls from zero (`true`) or stops
    /// (`false`; the counts stay readable), for benchmarks and tests of the
    /// host path. What a call is depends on the device: on the cpu device,
    /// each operation enqueued on one of its streams (by operation name,
    /// records and waits included), each event made and each allocation; on
    /// the cuda device, each CUDA driver call of the process (by entry
    /// point), since a driver call is what costs host time there. Returns
    /// whether this device counts at all; one that does not returns `false`
    /// and [`Device::call_counts`] stays empty. Off by default (a relaxed
    /// atomic load per call).
    fn count_calls(&self, on: bool) -> bool {
        let _ = on;
        false
    }
    /// The calls counted since [`Device::count_calls`] last started
    /// counting, by name, in the order each name was first seen.
    fn call_counts(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// Blocks until every stream of this device has finished its work; returns
    /// the first asynchronous error among them, or else the first error a
    /// drop could not return (a stream-ordered free that failed, a handle
    /// dropped inside a host function).
    fn synchronize(&self) -> Result<()>;
}

/// Owned device memory. Dropping a buffer while queued work still uses it is
/// safe: the memory is released after that work (stream-ordered free, or the
/// queued work keeps the allocation alive).
pub trait Buffer: Send + Sync + fmt::Debug + 'static {
    /// The backend.
    type B: Backend<Buffer = Self>;
    /// What every buffer records about itself; the accessors below read it.
    fn meta(&self) -> &BufferMeta<Self::B>;
    /// The element type.
    fn dtype(&self) -> DType {
        self.meta().dtype
    }
    /// Number of elements.
    fn len(&self) -> usize {
        self.meta().len
    }
    /// A process-unique id (used in sanitizer and error reports).
    fn id(&self) -> u64 {
        self.meta().id
    }
    /// The device that owns the memory.
    fn device(&self) -> &<Self::B as Backend>::Device {
        &self.meta().device
    }
    /// The memory space the buffer lives in.
    fn space(&self) -> MemorySpace {
        self.meta().space
    }
    /// Whether the buffer holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Size in bytes.
    fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// A view of the whole buffer.
    fn view(&self) -> View<'_, Self::B>
    where
        Self: Sized,
    {
        View::whole(self)
    }
    /// A view of `len` elements from `offset`; an error if it does not fit.
    fn slice(&self, offset: usize, len: usize) -> Result<View<'_, Self::B>>
    where
        Self: Sized,
    {
        View::whole(self).slice(offset, len)
    }
}

/// The fields every backend's buffer has, behind [`Buffer`]'s accessors
/// (one struct, so each backend does not repeat them).
#[derive(Debug)]
pub struct BufferMeta<B: Backend> {
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    pub(crate) id: u64,
    pub(crate) device: B::Device,
    pub(crate) space: MemorySpace,
}

impl<B: Backend> BufferMeta<B> {
    /// `len` elements of `dtype` in `space` of `device`, known by `id`.
    pub fn new(dtype: DType, len: usize, id: u64, device: B::Device, space: MemorySpace) -> Self {
        BufferMeta { dtype, len, id, device, space }
    }
}

/// A marker on a stream.
pub trait Event: Send + Sync + fmt::Debug + 'static {
    /// The backend.
    type B: Backend<Event = Self>;
    /// Blocks the host until the work enqueued before the most recent record
    /// has finished (at once if never recorded). Returns that work's error,
    /// if it failed, or `Timeout` after the device's deadline.
    fn synchronize(&self) -> Result<()>;
    /// Whether the work before the most recent record has finished. Never
    /// blocks. An asynchronous failure of that work is returned as an error.
    fn query(&self) -> Result<bool>;
}

/// Shape of a matrix product `C[m×n] (+)= op(A)[m×k] · op(B)[k×n]`, all row-major.
/// `A` is stored `[m, k]`, or `[k, m]` when `trans_a`; `B` is stored `[k, n]`, or `[n, k]` when `trans_b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulSpec {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Use Aᵀ.
    pub trans_a: bool,
    /// Use Bᵀ.
    pub trans_b: bool,
    /// Add the product to C instead of overwriting it.
    pub accumulate: bool,
}

/// One copy of a [`Stream::copy_2d_batch`]: source, destination and shape.
pub type Copy2dPiece<'a, B> = (View<'a, B>, View<'a, B>, Copy2d);

/// The host work of [`Stream::update_on_host`]: it gets the bytes of the
/// views read, then those of the views written (to change in place); an
/// error fails the stream.
pub type HostUpdate = Box<dyn FnOnce(&[&[u8]], &mut [&mut [u8]]) -> Result<()> + Send>;

/// The largest pitch a single 2-D copy takes on CUDA and HIP
/// (`CU_DEVICE_ATTRIBUTE_MAX_PITCH` and `hipDeviceAttributeMaxPitch` are
/// 2^31 − 1 bytes); a copy with a longer stride goes block by block. FSDP's
/// copy-out strides by a whole group shard, which passes 2 GiB on an 8B
/// model's embedding at two ranks in f32.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub(crate) const MAX_COPY_PITCH_BYTES: usize = i32::MAX as usize;

/// The shape of a strided copy; see [`Stream::copy_2d`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Copy2d {
    /// Number of blocks.
    pub rows: usize,
    /// Elements per block.
    pub row_len: usize,
    /// First element read, relative to the source view.
    pub src_offset: usize,
    /// Elements between the starts of consecutive source blocks.
    pub src_stride: usize,
    /// First element written, relative to the destination view.
    pub dst_offset: usize,
    /// Elements between the starts of consecutive destination blocks.
    pub dst_stride: usize,
}

impl Copy2d {
    /// The elements of a view of `len` that blocks starting at `offset` with `stride` reach, or `None` on overflow.
    pub fn extent(&self, offset: usize, stride: usize) -> Option<usize> {
        if self.rows == 0 || self.row_len == 0 {
            return Some(0);
        }
        (self.rows - 1).checked_mul(stride)?.checked_add(offset)?.checked_add(self.row_len)
    }
}

/// SGD hyper-parameters with PyTorch's semantics (`torch.optim.SGD`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdParams {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening for momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Whether this is the first step (the momentum buffer is set to the gradient).
    pub first_step: bool,
}

/// The f32 views one SGD step works on, named so that two of one type
/// cannot be swapped unnoticed.
pub struct SgdOperands<'a, B: Backend> {
    /// The parameter, updated in place.
    pub param: View<'a, B>,
    /// Its gradient, read.
    pub grad: View<'a, B>,
    /// The momentum buffer, updated in place; needed when momentum ≠ 0.
    pub momentum_buf: Option<View<'a, B>>,
}

impl<'a, B: Backend> SgdOperands<'a, B> {
    /// `param`, `grad` and the momentum buffer when there is one.
    pub fn views(&self) -> Vec<View<'a, B>> {
        [Some(self.param), Some(self.grad), self.momentum_buf].into_iter().flatten().collect()
    }
}

/// The f32 views one AdamW step works on, named so that two of one type
/// cannot be swapped unnoticed.
pub struct AdamWOperands<'a, B: Backend> {
    /// The parameter, updated in place.
    pub param: View<'a, B>,
    /// Its gradient, read.
    pub grad: View<'a, B>,
    /// The first moment, updated in place.
    pub exp_avg: View<'a, B>,
    /// The second moment, updated in place.
    pub exp_avg_sq: View<'a, B>,
}

impl<'a, B: Backend> AdamWOperands<'a, B> {
    /// `[param, grad, exp_avg, exp_avg_sq]`.
    pub fn views(&self) -> [View<'a, B>; 4] {
        [self.param, self.grad, self.exp_avg, self.exp_avg_sq]
    }
}

/// AdamW hyper-parameters with PyTorch's semantics (`torch.optim.AdamW`):
/// decoupled weight decay, bias correction, eps added outside the square root.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The step number, starting at 1 (for bias correction).
    pub step: u64,
}

/// An in-order queue of work on one device: the core every communicator
/// needs (allocation, copies, fill, cast, scale, accumulate, axpy, events,
/// host functions). The model and optimizer kernels are [`ComputeStream`].
///
/// Every method that takes views enqueues work and returns at once; see the
/// module documentation for ordering and error rules. Views passed to a
/// method must belong to this stream's device. Floating-point arithmetic on
/// f16/bf16 is done in f32 and rounded once to nearest even (PyTorch's
/// "opmath"); f32 in f32; f64 in f64.
pub trait Stream: Send + Sync + fmt::Debug + 'static {
    /// The backend.
    type B: Backend<Stream = Self>;

    /// The device this stream belongs to.
    fn device(&self) -> &<Self::B as Backend>::Device;
    /// The stream's priority.
    fn priority(&self) -> Priority;
    /// A name for reports (`cpu:0/stream3`).
    fn name(&self) -> String;

    /// Allocates `len` elements of `dtype` in stream order: the contents are
    /// unspecified, and other streams may use the buffer only after waiting on
    /// an event recorded on this stream after the allocation.
    fn alloc(&self, dtype: DType, len: usize) -> Result<<Self::B as Backend>::Buffer>;

    /// Copies `src` to `dst` (same dtype and length).
    fn copy(&self, src: View<'_, Self::B>, dst: View<'_, Self::B>) -> Result<()>;
    /// Strided copy of `rows` blocks of `row_len` elements (cudaMemcpy2DAsync):
    /// block `i` goes from element `src_offset + i·src_stride` of `src` to
    /// element `dst_offset + i·dst_stride` of `dst` (offsets relative to the
    /// views). Same dtype; every block must lie inside its view; the two views
    /// must not overlap.
    fn copy_2d(&self, src: View<'_, Self::B>, dst: View<'_, Self::B>, layout: Copy2d) -> Result<()>;
    /// Several [`Stream::copy_2d`]s, run in order: every one is checked
    /// before any is enqueued. A device may run them as one operation (the
    /// cpu device runs one job for all), so packing many small pieces — a
    /// group's parameters — costs one enqueue instead of one per piece.
    fn copy_2d_batch(&self, copies: &[Copy2dPiece<'_, Self::B>]) -> Result<()> {
        for (src, dst, layout) in copies {
            crate::checks::copy_2d(*src, *dst, layout)?;
        }
        copies.iter().try_for_each(|(src, dst, layout)| self.copy_2d(*src, *dst, *layout))
    }
    /// Copies host bytes into `dst`; `src` must be exactly `dst`'s byte length.
    /// `src` is captured before this returns, so the caller may reuse it at once.
    fn copy_from_host(&self, src: &[u8], dst: View<'_, Self::B>) -> Result<()>;
    /// Copies `src` to the host; the returned [`Readback`] completes when the copy has run.
    fn copy_to_host(&self, src: View<'_, Self::B>) -> Result<Readback>;
    /// Sets every element of `dst` to `value`.
    fn fill(&self, dst: View<'_, Self::B>, value: Scalar) -> Result<()>;
    /// [`Stream::fill`] of every view in `dsts` with `value`, checked before
    /// any is enqueued; one job on the cpu device (see [`Stream::copy_2d_batch`]).
    fn fill_batch(&self, dsts: &[View<'_, Self::B>], value: Scalar) -> Result<()> {
        for dst in dsts {
            crate::checks::fill(*dst, value)?;
        }
        dsts.iter().try_for_each(|dst| self.fill(*dst, value))
    }
    /// Converts `src` into `dst` (same length, both float dtypes), rounding to nearest even.
    fn cast(&self, src: View<'_, Self::B>, dst: View<'_, Self::B>) -> Result<()>;
    /// `x *= alpha` (float dtypes).
    fn scale(&self, x: View<'_, Self::B>, alpha: f64) -> Result<()>;
    /// `dst += src`, same length; same dtype for every dtype (integers wrap),
    /// or any float `src` into a float `dst` (f16/bf16 into f32, say).
    fn accumulate(&self, src: View<'_, Self::B>, dst: View<'_, Self::B>) -> Result<()>;
    /// `y += alpha * x` (float dtypes; `x` may be a different float dtype than `y`).
    fn axpy(&self, alpha: f64, x: View<'_, Self::B>, y: View<'_, Self::B>) -> Result<()>;
    /// `out[0] = max |x|` over a float `x` (with `accumulate`, the larger of
    /// that and the old `out[0]`); `out` is one f32 element; an empty `x`
    /// gives 0 and a NaN in `x` gives NaN. The amax of float8 scaling.
    fn abs_max(&self, x: View<'_, Self::B>, out: View<'_, Self::B>, accumulate: bool) -> Result<()>;
    /// Float8 quantization, torchao's tensorwise cast: with `scale =`
    /// [`Float8E4M3::scale_for`](crate::Float8E4M3::scale_for)`(amax[0])`,
    /// `dst[i] = e4m3(f32(src[i]) · scale)`, the product in f32, then
    /// rounded to nearest even and saturated at ±448. `src` is a float dtype,
    /// `amax` one f32 element, `dst` [`DType::F8E4M3`] of `src`'s length.
    fn quantize_f8(&self, src: View<'_, Self::B>, amax: View<'_, Self::B>, dst: View<'_, Self::B>) -> Result<()>;
    /// The inverse of [`quantize_f8`](Stream::quantize_f8): `dst[i] =
    /// f32(src[i]) / scale` (divided in f32), rounded once to `dst`'s float
    /// dtype; `src` is [`DType::F8E4M3`], `amax` one f32 element.
    fn dequantize_f8(&self, src: View<'_, Self::B>, amax: View<'_, Self::B>, dst: View<'_, Self::B>) -> Result<()>;

    /// Records `event` on this stream: it completes when the work enqueued
    /// so far has finished. A later record replaces the earlier one.
    fn record(&self, event: &<Self::B as Backend>::Event) -> Result<()>;
    /// Makes this stream wait (on the device, not the host) until `event`'s
    /// most recent record has completed. Returns at once.
    fn wait(&self, event: &<Self::B as Backend>::Event) -> Result<()>;
    /// Blocks the host until all work enqueued so far has finished; returns
    /// the stream's asynchronous error, if any, or `Timeout` after the
    /// device's deadline.
    fn synchronize(&self) -> Result<()>;

    /// Enqueues `f` to run on the host, in stream order, once the work
    /// enqueued before it has finished (`cuLaunchHostFunc`). It runs on a
    /// thread of the device (a driver thread on GPUs), so it must be short
    /// and must not block on other streams' work; like CUDA, every device
    /// refuses device API calls made inside it — including those of
    /// handles it drops — with [`DeviceError::InHostFunction`]
    /// (see [`crate::host_fn`]). It runs even when earlier work failed, with
    /// that failure (`Err`), so it can release what it holds. A panic in `f`
    /// is caught and fails the stream from this operation on.
    fn launch_host_fn(&self, f: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()>;

    /// Runs `f` on the host, in stream order, on the bytes of buffers in
    /// host memory ([`MemorySpace::Host`]): `f` gets the bytes of `reads`,
    /// then those of `writes` to change in place, once the work enqueued
    /// before it has finished; work enqueued after it starts after `f`
    /// returns. It is how state kept in host memory is updated where it
    /// lives (CPU offload's optimizer step on a device whose kernels do not
    /// reach host memory): nothing is copied out and back, and the host does
    /// not wait. `f` runs as [`Stream::launch_host_fn`]'s functions do — on
    /// a thread of the device, where the device API is refused — and is
    /// skipped when earlier work failed; an error it returns, or a panic,
    /// fails the stream from this operation on. Every view must be of a host
    /// buffer of this device (each slice then starts aligned to its dtype's
    /// size), and a written view may not overlap any other view: otherwise
    /// `InvalidArgument`, and nothing is enqueued. A device without a host
    /// space of its own returns an error.
    fn update_on_host(&self, reads: &[View<'_, Self::B>], writes: &[View<'_, Self::B>], f: HostUpdate) -> Result<()> {
        let _ = (reads, writes, f);
        let device = crate::Device::name(self.device());
        Err(DeviceError::invalid("update_on_host", format!("{device} has no host memory space in chorus")))
    }
}

/// The model and optimizer kernels: what FSDP's reference model and its
/// sharded optimizers need beyond the core a communicator uses. A new device
/// implements [`Stream`] first (and passes the collective conformance suite
/// with it), then this.
///
/// Ordering and errors as [`Stream`]: every method enqueues and returns at
/// once; argument errors are returned and nothing is enqueued.
pub trait ComputeStream: Stream {
    /// Matrix product per [`MatmulSpec`]: `a` and `b` share a float dtype;
    /// `c` is that dtype or f32. Accumulates in f32 (f64 for f64) and rounds once.
    fn matmul(&self, spec: MatmulSpec, a: View<'_, Self::B>, b: View<'_, Self::B>, c: View<'_, Self::B>) -> Result<()>;
    /// `x[r, c] += bias[c]` for `x` of `rows × bias.len()`, any float dtypes.
    fn bias_add(&self, x: View<'_, Self::B>, bias: View<'_, Self::B>) -> Result<()>;
    /// `y = max(x, 0)`; `y` may be `x`.
    fn relu(&self, x: View<'_, Self::B>, y: View<'_, Self::B>) -> Result<()>;
    /// `grad_in = grad_out` where `out > 0`, else 0.
    fn relu_backward(
        &self,
        grad_out: View<'_, Self::B>,
        out: View<'_, Self::B>,
        grad_in: View<'_, Self::B>,
    ) -> Result<()>;
    /// `loss[0] = scale · Σ (pred − target)²`, summed in f64; `loss` is one f32 or f64 element.
    fn mse_loss(
        &self,
        pred: View<'_, Self::B>,
        target: View<'_, Self::B>,
        loss: View<'_, Self::B>,
        scale: f64,
    ) -> Result<()>;
    /// `grad = 2 · scale · (pred − target)`.
    fn mse_grad(
        &self,
        pred: View<'_, Self::B>,
        target: View<'_, Self::B>,
        grad: View<'_, Self::B>,
        scale: f64,
    ) -> Result<()>;
    /// `out[c] (+)= Σ_r x[r, c]` for `x` of `rows × out.len()`, summed in f32 (f64 for f64).
    fn column_sums(&self, x: View<'_, Self::B>, out: View<'_, Self::B>, accumulate: bool) -> Result<()>;
    /// `out[0] (+)= Σ x²`, summed in f64; `out` is one f32 or f64 element.
    fn sum_squares(&self, x: View<'_, Self::B>, out: View<'_, Self::B>, accumulate: bool) -> Result<()>;
    /// Scales `x` as `torch.nn.utils.clip_grad_norm_` does, with the squared
    /// norm read on the device rather than by the host: `c = max_norm /
    /// (√(sq[0][0] + sq[1][0]) + 1e-6)`, summed and rooted in f64, and `x ·= c`
    /// (in f32 for f16/bf16/f32) when `c < 1`; otherwise, a NaN norm included,
    /// `x` is left alone. `sq` are one f32 or f64 element each (the two parts
    /// of the squared norm, e.g. sharded and replicated) and do not overlap
    /// `x`; `max_norm` is finite and not negative.
    fn clip_scale(&self, x: View<'_, Self::B>, sq: [View<'_, Self::B>; 2], max_norm: f64) -> Result<()>;
    /// One SGD step on the parameter of `operands`.
    fn sgd_step(&self, params: SgdParams, operands: SgdOperands<'_, Self::B>) -> Result<()>;
    /// One AdamW step on the parameter of `operands`.
    fn adamw_step(&self, params: AdamWParams, operands: AdamWOperands<'_, Self::B>) -> Result<()>;
}

/// A backend whose streams have the compute kernels: how generic code (FSDP,
/// the reference model) asks for them. Every backend whose stream implements
/// [`ComputeStream`] is one.
pub trait ComputeBackend: Backend<Stream = <Self as ComputeBackend>::ComputeStream> {
    /// The stream type, with its compute kernels.
    type ComputeStream: ComputeStream<B = Self>;
}

impl<B: Backend> ComputeBackend for B
where
    B::Stream: ComputeStream,
{
    type ComputeStream = B::Stream;
}

/// Typed conveniences over [`Stream`], available on every backend.
pub trait StreamExt: Stream {
    /// Copies a typed host slice into `dst` (dtype must match `T`).
    fn upload<T: crate::Element>(&self, src: &[T], dst: View<'_, Self::B>) -> Result<()> {
        if dst.dtype() != T::DTYPE {
            return Err(DeviceError::DTypeMismatch { op: "upload", expected: dst.dtype(), found: T::DTYPE });
        }
        self.copy_from_host(bytemuck::cast_slice(src), dst)
    }
    /// Allocates a buffer in stream order and fills it from `src`.
    fn buffer_from<T: crate::Element>(&self, src: &[T]) -> Result<<Self::B as Backend>::Buffer> {
        let buf = self.alloc(T::DTYPE, src.len())?;
        self.upload(src, buf.view())?;
        Ok(buf)
    }
    /// Enqueues a copy of `src` to the host and blocks until it is there.
    fn read_vec<T: crate::Element>(&self, src: View<'_, Self::B>) -> Result<Vec<T>> {
        self.copy_to_host(src)?.wait_typed()
    }
}

impl<S: Stream> StreamExt for S {}
