//! A virtual stream: a clock that each operation advances by its modelled time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chorus_devices::{
    AdamWOperands, AdamWParams, Buffer, ComputeStream, Copy2d, Copy2dPiece, DType, Device, DeviceError, MatmulSpec,
    MemorySpace, Priority, Readback, Result, Scalar, SgdOperands, SgdParams, Stream, View,
};

use super::device::{TraceOp, VirtDevice, VirtEvent};
use super::{update, Virt, VirtBuffer};
use crate::cost::{Issuer, KernelCost, KernelKind};

/// An in-order queue whose work takes virtual time.
#[derive(Debug)]
pub struct VirtStream {
    device: VirtDevice,
    index: usize,
    priority: Priority,
    /// When the work enqueued so far ends, seconds of virtual time (f64
    /// bits; shared with the device, whose synchronize waits for every stream).
    clock: Arc<AtomicU64>,
    /// Seconds of operations run (collectives' waits not counted; f64 bits).
    busy: AtomicU64,
}

type V<'a> = View<'a, Virt>;

impl VirtStream {
    pub(crate) fn new(device: &VirtDevice, priority: Priority) -> VirtStream {
        let clock = Arc::new(AtomicU64::new(0f64.to_bits()));
        let index = device.add_stream(clock.clone());
        VirtStream { device: device.clone(), index, priority, clock, busy: AtomicU64::new(0f64.to_bits()) }
    }

    /// The stream's index on its device, in creation order (its trace lane).
    pub fn index(&self) -> usize {
        self.index
    }

    /// When the work enqueued so far ends.
    pub fn clock(&self) -> f64 {
        f64::from_bits(self.clock.load(Ordering::Acquire))
    }

    /// Seconds of operations (kernels, copies) run so far; a collective's time is not counted.
    pub fn busy(&self) -> f64 {
        f64::from_bits(self.busy.load(Ordering::Acquire))
    }

    /// When the next operation would start: the later of the stream's clock and the host's.
    pub fn ready_at(&self) -> f64 {
        self.clock().max(self.device.host_clock())
    }

    /// Runs an operation of `seconds` named `name`: it starts when the
    /// stream and the host are ready, and the stream's clock moves to its end.
    /// Returns (start, end).
    pub fn run_for(&self, name: &str, seconds: f64) -> (f64, f64) {
        let (start, end) = self.run_from(name, 0.0, seconds);
        update(&self.busy, |b| b + (end - start));
        (start, end)
    }

    /// Like [`VirtStream::run_for`], starting no earlier than `not_before`
    /// (a collective starts when its last rank arrives).
    pub fn run_from(&self, name: &str, not_before: f64, seconds: f64) -> (f64, f64) {
        let seconds = if seconds.is_finite() && seconds > 0.0 { seconds } else { 0.0 };
        let ready = not_before.max(self.device.host_clock());
        let (before, end) = update(&self.clock, |c| c.max(ready) + seconds);
        let start = before.max(ready);
        if self.device.tracing() {
            self.device.push_trace(TraceOp { stream: self.index, name: name.to_string(), start, end });
        }
        (start, end)
    }

    /// An operation that occupies the stream from when it is ready until
    /// `end` (a collective, from the rank's arrival to its completion).
    pub fn run_until(&self, name: &str, end: f64) -> (f64, f64) {
        let start = self.ready_at();
        let (start, end) = self.run_from(name, start, (end - start).max(0.0));
        // Its arrival is already fixed: only whether the host runs it applies.
        if self.device.cost().host_cost(Issuer::Collective).runs_on_host {
            self.device.advance_host(end);
        }
        (start, end)
    }

    /// Runs one of the model's kernels (issued by the framework): the host
    /// issues it [`KernelCost::issues`] times over.
    pub fn run_kernel(&self, kernel: &KernelCost) {
        let seconds = self.device.cost().kernel_seconds(kernel);
        let host = self.device.cost().host_cost(Issuer::Model);
        self.device.host_work(host.issue_s * kernel.issues.saturating_sub(1) as f64);
        self.run_issued(Issuer::Model, &kernel.name, seconds);
    }

    /// [`VirtStream::run_for`] with the host's cost of issuing the
    /// operation ([`CostModel::host_cost`](crate::cost::CostModel::host_cost)):
    /// the host is busy for its issue time first, and until the operation's
    /// end where the host runs it.
    pub fn run_issued(&self, issuer: Issuer, name: &str, seconds: f64) -> (f64, f64) {
        let host = self.device.cost().host_cost(issuer);
        self.device.host_work(host.issue_s);
        let (start, end) = self.run_for(name, seconds);
        if host.runs_on_host {
            self.device.advance_host(end);
        }
        (start, end)
    }

    fn memory_bound(&self, name: &'static str, bytes: usize) {
        self.memory_bound_by(Issuer::Fsdp, name, bytes)
    }

    fn memory_bound_by(&self, issuer: Issuer, name: &'static str, bytes: usize) {
        let k = KernelCost::new(name, KernelKind::MemoryBound, 0.0, bytes as f64);
        self.run_issued(issuer, name, self.device.cost().kernel_seconds(&k));
    }

    /// An optimizer step of `bytes` of traffic: a memory-bound kernel, or
    /// on host buffers during a GPU's host steps ([`VirtDevice::set_host_steps`])
    /// the host's work, once the stream has reached it, at the host's bandwidth.
    fn optimizer_step(&self, name: &'static str, param: &V<'_>, bytes: usize) {
        if self.device.host_steps() && param.buffer().space() == MemorySpace::Host {
            self.device.run_on_host(self.clock(), bytes as f64 / crate::cost::HOST_STEP_BYTES_PER_S);
        } else {
            self.memory_bound_by(Issuer::Optimizer, name, bytes);
        }
    }

    fn copy_between(&self, name: &'static str, bytes: usize, from: MemorySpace, to: MemorySpace) {
        let seconds = self.device.cost().copy_seconds(bytes as u64, from, to);
        self.run_issued(Issuer::Fsdp, name, seconds);
    }

    /// Checks a 2-D copy as every device does; returns the bytes it moves.
    fn check_copy_2d(&self, src: V<'_>, dst: V<'_>, layout: &Copy2d) -> Result<usize> {
        self.mine("copy_2d", &[src, dst])?;
        same_dtype("copy_2d", &src, &dst)?;
        let fits = |ext: Option<usize>, len: usize| ext.is_some_and(|e| e <= len);
        if !fits(layout.extent(layout.src_offset, layout.src_stride), src.len())
            || !fits(layout.extent(layout.dst_offset, layout.dst_stride), dst.len())
        {
            return Err(DeviceError::InvalidArgument { op: "copy_2d", reason: format!("{layout:?} does not fit") });
        }
        Ok(layout.rows.saturating_mul(layout.row_len).saturating_mul(src.dtype().size()))
    }

    fn mine(&self, op: &'static str, views: &[V<'_>]) -> Result<()> {
        chorus_devices::host_fn::check(op)?;
        for v in views {
            if !v.buffer().device().is_same(&self.device) {
                return Err(DeviceError::InvalidArgument {
                    op,
                    reason: format!("a buffer of {} on a stream of {}", v.buffer().device().name(), self.device.name()),
                });
            }
        }
        Ok(())
    }
}

fn same_len(op: &'static str, a: &V<'_>, b: &V<'_>) -> Result<()> {
    if a.len() != b.len() {
        return Err(DeviceError::InvalidArgument { op, reason: format!("lengths {} and {} differ", a.len(), b.len()) });
    }
    Ok(())
}

fn same_dtype(op: &'static str, a: &V<'_>, b: &V<'_>) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(DeviceError::DTypeMismatch { op, expected: a.dtype(), found: b.dtype() });
    }
    Ok(())
}

fn float(op: &'static str, v: &V<'_>) -> Result<()> {
    if !v.dtype().is_float() {
        return Err(DeviceError::InvalidArgument { op, reason: format!("{} is not a float dtype", v.dtype()) });
    }
    Ok(())
}

impl Stream for VirtStream {
    type B = Virt;

    fn device(&self) -> &VirtDevice {
        &self.device
    }
    fn priority(&self) -> Priority {
        self.priority
    }
    fn name(&self) -> String {
        format!("{}/stream{}", self.device.label(), self.index)
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<VirtBuffer> {
        chorus_devices::host_fn::check("alloc")?;
        self.device.alloc_device(dtype, len)
    }
    fn copy(&self, src: V<'_>, dst: V<'_>) -> Result<()> {
        self.mine("copy", &[src, dst])?;
        same_dtype("copy", &src, &dst)?;
        same_len("copy", &src, &dst)?;
        self.copy_between("copy", src.bytes(), src.buffer().space(), dst.buffer().space());
        Ok(())
    }
    fn copy_2d(&self, src: V<'_>, dst: V<'_>, layout: Copy2d) -> Result<()> {
        let bytes = self.check_copy_2d(src, dst, &layout)?;
        self.copy_between("copy_2d", bytes, src.buffer().space(), dst.buffer().space());
        Ok(())
    }
    /// One operation for the whole batch, as the devices run it (one job
    /// on the cpu device; FSDP2 on a GPU copies a group out with one
    /// `split_with_sizes_copy` kernel): priced once per pair of memory
    /// spaces, not once per piece, and one enqueue instead of world ×
    /// parameters of them — the planner's largest cost at 1,024 ranks.
    /// The host pays [`Issuer::CopyPiece`] per piece on top: the cuda
    /// device issues one driver call per piece.
    fn copy_2d_batch(&self, copies: &[Copy2dPiece<'_, Virt>]) -> Result<()> {
        let mut bytes: Vec<(MemorySpace, MemorySpace, usize)> = Vec::new();
        for (src, dst, layout) in copies {
            let b = self.check_copy_2d(*src, *dst, layout)?;
            let (from, to) = (src.buffer().space(), dst.buffer().space());
            match bytes.iter_mut().find(|(f, t, _)| *f == from && *t == to) {
                Some((_, _, sum)) => *sum = sum.saturating_add(b),
                None => bytes.push((from, to, b)),
            }
        }
        self.device.host_work(self.device.cost().host_cost(Issuer::CopyPiece).issue_s * copies.len() as f64);
        for (from, to, b) in bytes {
            self.copy_between("copy_2d", b, from, to);
        }
        Ok(())
    }
    fn copy_from_host(&self, src: &[u8], dst: V<'_>) -> Result<()> {
        self.mine("copy_from_host", &[dst])?;
        if src.len() != dst.bytes() {
            return Err(DeviceError::InvalidArgument {
                op: "copy_from_host",
                reason: format!("{} bytes for a view of {}", src.len(), dst.bytes()),
            });
        }
        self.copy_between("copy_from_host", dst.bytes(), MemorySpace::Host, dst.buffer().space());
        Ok(())
    }
    /// The copy takes its time; the host waits for it and reads zeros.
    fn copy_to_host(&self, src: V<'_>) -> Result<Readback> {
        self.mine("copy_to_host", &[src])?;
        let (_, end) = self.run_issued(Issuer::Fsdp, "copy_to_host", {
            self.device.cost().copy_seconds(src.bytes() as u64, src.buffer().space(), MemorySpace::Host)
        });
        if !self.device.deferred_readbacks() {
            self.device.advance_host(end);
        }
        let (rb, filler) = Readback::pending(src.dtype(), src.len(), std::time::Duration::from_secs(1));
        filler.fill(vec![0u8; src.bytes()]);
        Ok(rb)
    }
    fn fill(&self, dst: V<'_>, _value: Scalar) -> Result<()> {
        self.mine("fill", &[dst])?;
        self.memory_bound("fill", dst.bytes());
        Ok(())
    }
    /// One memory-bound operation for the whole batch (see `copy_2d_batch`).
    fn fill_batch(&self, dsts: &[V<'_>], _value: Scalar) -> Result<()> {
        self.mine("fill_batch", dsts)?;
        self.memory_bound("fill", dsts.iter().map(|d| d.bytes()).sum());
        Ok(())
    }
    fn cast(&self, src: V<'_>, dst: V<'_>) -> Result<()> {
        self.mine("cast", &[src, dst])?;
        same_len("cast", &src, &dst)?;
        float("cast", &src)?;
        float("cast", &dst)?;
        self.memory_bound("cast", src.bytes() + dst.bytes());
        Ok(())
    }
    fn scale(&self, x: V<'_>, _alpha: f64) -> Result<()> {
        self.mine("scale", &[x])?;
        float("scale", &x)?;
        self.memory_bound("scale", 2 * x.bytes());
        Ok(())
    }
    fn accumulate(&self, src: V<'_>, dst: V<'_>) -> Result<()> {
        self.mine("accumulate", &[src, dst])?;
        same_len("accumulate", &src, &dst)?;
        if src.dtype() != dst.dtype() {
            float("accumulate", &src)?;
            float("accumulate", &dst)?;
        }
        self.memory_bound("accumulate", src.bytes() + 2 * dst.bytes());
        Ok(())
    }
    fn axpy(&self, _alpha: f64, x: V<'_>, y: V<'_>) -> Result<()> {
        self.mine("axpy", &[x, y])?;
        same_len("axpy", &x, &y)?;
        float("axpy", &x)?;
        float("axpy", &y)?;
        self.memory_bound("axpy", x.bytes() + 2 * y.bytes());
        Ok(())
    }
    fn abs_max(&self, x: V<'_>, out: V<'_>, _accumulate: bool) -> Result<()> {
        self.mine("abs_max", &[x, out])?;
        float("abs_max", &x)?;
        if out.dtype() != DType::F32 || out.len() != 1 {
            return Err(DeviceError::InvalidArgument { op: "abs_max", reason: "out is not one f32".into() });
        }
        self.memory_bound("abs_max", x.bytes() + out.bytes());
        Ok(())
    }
    fn quantize_f8(&self, src: V<'_>, amax: V<'_>, dst: V<'_>) -> Result<()> {
        self.mine("quantize_f8", &[src, amax, dst])?;
        same_len("quantize_f8", &src, &dst)?;
        float("quantize_f8", &src)?;
        if dst.dtype() != DType::F8E4M3 {
            return Err(DeviceError::InvalidArgument { op: "quantize_f8", reason: format!("dst is {}", dst.dtype()) });
        }
        self.memory_bound("quantize_f8", src.bytes() + dst.bytes());
        Ok(())
    }
    fn dequantize_f8(&self, src: V<'_>, amax: V<'_>, dst: V<'_>) -> Result<()> {
        self.mine("dequantize_f8", &[src, amax, dst])?;
        same_len("dequantize_f8", &src, &dst)?;
        float("dequantize_f8", &dst)?;
        if src.dtype() != DType::F8E4M3 {
            return Err(DeviceError::InvalidArgument {
                op: "dequantize_f8",
                reason: format!("src is {}", src.dtype()),
            });
        }
        self.memory_bound("dequantize_f8", src.bytes() + dst.bytes());
        Ok(())
    }
    fn record(&self, event: &VirtEvent) -> Result<()> {
        chorus_devices::host_fn::check("record")?;
        if let Ok(mut t) = event.time.lock() {
            *t = Some(self.ready_at());
        }
        Ok(())
    }
    fn wait(&self, event: &VirtEvent) -> Result<()> {
        chorus_devices::host_fn::check("wait")?;
        if let Some(t) = event.time() {
            update(&self.clock, |c| c.max(t));
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        chorus_devices::host_fn::check("stream synchronize")?;
        self.device.advance_host(self.clock());
        Ok(())
    }
    /// Runs `f` at once, marked as a host function (virtual work has no
    /// data for it to wait for).
    fn launch_host_fn(&self, f: Box<dyn FnOnce(Result<()>) + Send>) -> Result<()> {
        chorus_devices::host_fn::check("launch_host_fn")?;
        let _scope = chorus_devices::host_fn::HostFnScope::enter();
        f(Ok(()));
        Ok(())
    }
}

impl ComputeStream for VirtStream {
    fn matmul(&self, spec: MatmulSpec, a: V<'_>, b: V<'_>, c: V<'_>) -> Result<()> {
        self.mine("matmul", &[a, b, c])?;
        same_dtype("matmul", &a, &b)?;
        let need = |v: &V<'_>, rows: usize, cols: usize, what: &str| {
            if rows.checked_mul(cols) != Some(v.len()) {
                return Err(DeviceError::InvalidArgument {
                    op: "matmul",
                    reason: format!("{what} has {} elements, expected {rows}×{cols}", v.len()),
                });
            }
            Ok(())
        };
        need(&a, spec.m, spec.k, "a")?;
        need(&b, spec.k, spec.n, "b")?;
        need(&c, spec.m, spec.n, "c")?;
        let flops = 2.0 * spec.m as f64 * spec.n as f64 * spec.k as f64;
        let bytes = (a.bytes() + b.bytes() + c.bytes() * if spec.accumulate { 2 } else { 1 }) as f64;
        self.run_kernel(&KernelCost::new("matmul", KernelKind::Gemm, flops, bytes));
        Ok(())
    }
    fn bias_add(&self, x: V<'_>, bias: V<'_>) -> Result<()> {
        self.mine("bias_add", &[x, bias])?;
        self.memory_bound("bias_add", 2 * x.bytes() + bias.bytes());
        Ok(())
    }
    fn relu(&self, x: V<'_>, y: V<'_>) -> Result<()> {
        self.mine("relu", &[x, y])?;
        same_len("relu", &x, &y)?;
        self.memory_bound("relu", x.bytes() + y.bytes());
        Ok(())
    }
    fn relu_backward(&self, grad_out: V<'_>, out: V<'_>, grad_in: V<'_>) -> Result<()> {
        self.mine("relu_backward", &[grad_out, out, grad_in])?;
        same_len("relu_backward", &grad_out, &grad_in)?;
        self.memory_bound("relu_backward", grad_out.bytes() + out.bytes() + grad_in.bytes());
        Ok(())
    }
    fn mse_loss(&self, pred: V<'_>, target: V<'_>, loss: V<'_>, _scale: f64) -> Result<()> {
        self.mine("mse_loss", &[pred, target, loss])?;
        same_len("mse_loss", &pred, &target)?;
        self.memory_bound("mse_loss", pred.bytes() + target.bytes());
        Ok(())
    }
    fn mse_grad(&self, pred: V<'_>, target: V<'_>, grad: V<'_>, _scale: f64) -> Result<()> {
        self.mine("mse_grad", &[pred, target, grad])?;
        same_len("mse_grad", &pred, &grad)?;
        self.memory_bound("mse_grad", pred.bytes() + target.bytes() + grad.bytes());
        Ok(())
    }
    fn column_sums(&self, x: V<'_>, out: V<'_>, _accumulate: bool) -> Result<()> {
        self.mine("column_sums", &[x, out])?;
        self.memory_bound("column_sums", x.bytes() + out.bytes());
        Ok(())
    }
    fn sum_squares(&self, x: V<'_>, out: V<'_>, _accumulate: bool) -> Result<()> {
        self.mine("sum_squares", &[x, out])?;
        self.memory_bound("sum_squares", x.bytes());
        Ok(())
    }
    /// Costed as scaling `x` (read and written): the coefficient is computed
    /// on the device from values a plan does not have, and a norm over
    /// `max_norm` is the common case early in training.
    fn clip_scale(&self, x: V<'_>, sq: [V<'_>; 2], _max_norm: f64) -> Result<()> {
        self.mine("clip_scale", &[x, sq[0], sq[1]])?;
        self.memory_bound("clip_scale", 2 * x.bytes());
        Ok(())
    }
    fn sgd_step(&self, _p: SgdParams, operands: SgdOperands<'_, Virt>) -> Result<()> {
        let SgdOperands { param, grad, momentum_buf } = operands;
        self.mine("sgd_step", &[param, grad])?;
        same_len("sgd_step", &param, &grad)?;
        let momentum = momentum_buf.map_or(0, |m| 2 * m.bytes());
        self.optimizer_step("sgd_step", &param, 2 * param.bytes() + grad.bytes() + momentum);
        Ok(())
    }
    fn adamw_step(&self, _p: AdamWParams, operands: AdamWOperands<'_, Virt>) -> Result<()> {
        let AdamWOperands { param, grad, exp_avg: m, exp_avg_sq: v } = operands;
        self.mine("adamw_step", &[param, grad, m, v])?;
        same_len("adamw_step", &param, &grad)?;
        // Reads param, grad and both moments; writes param and both moments.
        self.optimizer_step("adamw_step", &param, 2 * param.bytes() + grad.bytes() + 2 * m.bytes() + 2 * v.bytes());
        Ok(())
    }
}
