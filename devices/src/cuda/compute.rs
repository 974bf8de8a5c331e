//! The compute operations of the cuda device's streams (the model and
//! optimizer kernels of [`ComputeStream`](crate::ComputeStream)), apart from
//! the core operations a communicator needs (`stream.rs`).

use super::blas::BlasHandle;
use super::kernels::{code, Args, REDUCE_BLOCK};
use super::Cuda;
use crate::checks;
use crate::gpu_kernels::{sum_squares_split, AdamWScalars, SgdScalars};
use crate::{
    AdamWOperands, AdamWParams, Buffer, DType, DeviceError, MatmulSpec, Result, Scalar, SgdOperands, SgdParams, View,
};

use super::stream::device_ptr;
use super::CudaStream;
use crate::Stream;

impl crate::ComputeStream for CudaStream {
    fn matmul(&self, spec: MatmulSpec, a: View<'_, Cuda>, b: View<'_, Cuda>, c: View<'_, Cuda>) -> Result<()> {
        let op = "matmul";
        checks::matmul(&spec, a, b, c)?;
        let MatmulSpec { m, n, k, accumulate, .. } = spec;
        if m == 0 || n == 0 || (k == 0 && accumulate) {
            return self.run(op, &[a, b, c], |_| Ok(()));
        }
        if k == 0 {
            return self.fill(c, Scalar::Float(0.0));
        }
        // f64 inputs with an f32 output: cuBLAS has no such gemm, so compute
        // in f64 and round once on the cast.
        if a.dtype() == DType::F64 && c.dtype() == DType::F32 {
            let tmp = self.alloc(DType::F64, c.len())?;
            if accumulate {
                self.cast(c, tmp.view())?;
            }
            self.matmul(spec, a, b, tmp.view())?;
            return self.cast(tmp.view(), c);
        }
        let label = self.device.label();
        self.run(op, &[a, b, c], |s| {
            let (pa, _sa) = self.input_ptr(&a, &c, true)?;
            let (pb, _sb) = self.input_ptr(&b, &c, true)?;
            let mut guard = self.shared.blas.lock().map_err(|_| DeviceError::invalid(op, "cuBLAS handle poisoned"))?;
            if guard.is_none() {
                *guard = Some(BlasHandle::create(s)?);
            }
            let handle = guard.as_ref().ok_or_else(|| DeviceError::invalid(op, "no cuBLAS handle"))?;
            let _ = &label;
            // SAFETY: ranges checked against the spec above, valid in stream order.
            unsafe { handle.gemm(spec, a.dtype(), c.dtype(), pa, pb, device_ptr(&c)) }
        })
    }

    fn bias_add(&self, x: View<'_, Cuda>, bias: View<'_, Cuda>) -> Result<()> {
        checks::bias_add(x, bias)?;
        self.elementwise("bias_add", &[x, bias], x.len(), |k, s, label| {
            let (pb, _staged) = self.input_ptr(&bias, &x, true)?;
            let (xt, bt, n) = (code(x.dtype()), code(bias.dtype()), x.len() as u64);
            let args = Args::default().ptr(device_ptr(&x)).i32(xt).ptr(pb).i32(bt).u64(n).u64(bias.len() as u64);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_bias_add", n, s, args, label) }
        })
    }

    fn relu(&self, x: View<'_, Cuda>, y: View<'_, Cuda>) -> Result<()> {
        checks::relu(x, y)?;
        self.elementwise("relu", &[x, y], y.len(), |k, s, label| {
            let (from, _staged) = self.input_ptr(&x, &y, false)?;
            let n = y.len() as u64;
            let args = Args::default().ptr(from).ptr(device_ptr(&y)).i32(code(x.dtype())).u64(n);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_relu", n, s, args, label) }
        })
    }

    fn relu_backward(&self, grad_out: View<'_, Cuda>, out: View<'_, Cuda>, grad_in: View<'_, Cuda>) -> Result<()> {
        let op = "relu_backward";
        checks::relu_backward(grad_out, out, grad_in)?;
        self.elementwise(op, &[grad_out, out, grad_in], grad_in.len(), |k, s, label| {
            let (g, _s1) = self.input_ptr(&grad_out, &grad_in, false)?;
            let (o, _s2) = self.input_ptr(&out, &grad_in, false)?;
            let n = grad_in.len() as u64;
            let args = Args::default().ptr(g).ptr(o).ptr(device_ptr(&grad_in)).i32(code(out.dtype())).u64(n);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_relu_backward", n, s, args, label) }
        })
    }

    fn mse_loss(&self, pred: View<'_, Cuda>, target: View<'_, Cuda>, loss: View<'_, Cuda>, scale: f64) -> Result<()> {
        let op = "mse_loss";
        checks::mse_loss(pred, target, loss)?;
        let kernels = self.kernels()?;
        let label = self.device.label();
        self.run(op, &[pred, target, loss], |s| {
            let (p, _s1) = self.input_ptr(&pred, &loss, true)?;
            let (q, _s2) = self.input_ptr(&target, &loss, true)?;
            let (pt, qt, lt) = (code(pred.dtype()), code(target.dtype()), code(loss.dtype()));
            let n = pred.len() as u64;
            let args = Args::default().ptr(p).i32(pt).ptr(q).i32(qt).ptr(device_ptr(&loss)).i32(lt).u64(n).f64(scale);
            // SAFETY: as in `cast`; one block of REDUCE_BLOCK threads.
            unsafe { kernels.launch_grid("chorus_mse_loss", 1, REDUCE_BLOCK, s, args, label) }
        })
    }

    fn mse_grad(&self, pred: View<'_, Cuda>, target: View<'_, Cuda>, grad: View<'_, Cuda>, scale: f64) -> Result<()> {
        let op = "mse_grad";
        checks::mse_grad(pred, target, grad)?;
        self.elementwise(op, &[pred, target, grad], grad.len(), |k, s, label| {
            let (p, _s1) = self.input_ptr(&pred, &grad, false)?;
            let (q, _s2) = self.input_ptr(&target, &grad, false)?;
            let (pt, qt, gt) = (code(pred.dtype()), code(target.dtype()), code(grad.dtype()));
            let n = grad.len() as u64;
            let args = Args::default().ptr(p).i32(pt).ptr(q).i32(qt).ptr(device_ptr(&grad)).i32(gt).u64(n).f64(scale);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_mse_grad", n, s, args, label) }
        })
    }

    fn column_sums(&self, x: View<'_, Cuda>, out: View<'_, Cuda>, accumulate: bool) -> Result<()> {
        let op = "column_sums";
        checks::column_sums(x, out)?;
        let rows = if out.is_empty() { 0 } else { x.len() / out.len() };
        self.elementwise(op, &[x, out], out.len(), |k, s, label| {
            let (px, _staged) = self.input_ptr(&x, &out, true)?;
            let (xt, ot, cols) = (code(x.dtype()), code(out.dtype()), out.len() as u64);
            let args = Args::default()
                .ptr(px)
                .i32(xt)
                .ptr(device_ptr(&out))
                .i32(ot)
                .u64(rows as u64)
                .u64(cols)
                .i32(accumulate as i32);
            // SAFETY: as in `cast`.
            unsafe { k.launch("chorus_column_sums", cols, s, args, label) }
        })
    }

    fn sum_squares(&self, x: View<'_, Cuda>, out: View<'_, Cuda>, accumulate: bool) -> Result<()> {
        let op = "sum_squares";
        checks::sum_squares(x, out)?;
        let kernels = self.kernels()?;
        let label = self.device.label();
        self.run(op, &[x, out], |s| {
            let (px, _staged) = self.input_ptr(&x, &out, true)?;
            let (xt, ot, n) = (code(x.dtype()), code(out.dtype()), x.len() as u64);
            let (chunk, parts) = sum_squares_split(n);
            if parts <= 1 {
                let args = Args::default().ptr(px).i32(xt).ptr(device_ptr(&out)).i32(ot).u64(n).i32(accumulate as i32);
                // SAFETY: as in `cast`; one block.
                return unsafe { kernels.launch_grid("chorus_sum_squares", 1, REDUCE_BLOCK, s, args, label) };
            }
            let (part, _scratch) = self.scratch(parts as usize * std::mem::size_of::<f64>())?;
            let args = Args::default().ptr(px).i32(xt).ptr(part).u64(n).u64(chunk);
            // SAFETY: as in `cast`; `parts` blocks each write its f64 of the scratch.
            unsafe { kernels.launch_grid("chorus_sum_squares_part", parts as u32, REDUCE_BLOCK, s, args, label) }?;
            let args = Args::default().ptr(part).u64(parts).ptr(device_ptr(&out)).i32(ot).i32(accumulate as i32);
            // SAFETY: the scratch's `parts` f64 written above in stream order; one block.
            unsafe { kernels.launch_grid("chorus_sum_squares_finish", 1, REDUCE_BLOCK, s, args, label) }
        })
    }

    fn clip_scale(&self, x: View<'_, Cuda>, sq: [View<'_, Cuda>; 2], max_norm: f64) -> Result<()> {
        checks::clip_scale(x, sq, max_norm)?;
        self.elementwise("clip_scale", &[sq[0], sq[1], x], x.len(), |k, s, label| {
            let n = x.len() as u64;
            let args = Args::default()
                .ptr(device_ptr(&x))
                .i32(code(x.dtype()))
                .u64(n)
                .ptr(device_ptr(&sq[0]))
                .i32(code(sq[0].dtype()))
                .ptr(device_ptr(&sq[1]))
                .i32(code(sq[1].dtype()))
                .f64(max_norm);
            // SAFETY: as in `cast`; the parts do not overlap `x` (checked above).
            unsafe { k.launch("chorus_clip_scale", n, s, args, label) }
        })
    }

    fn sgd_step(&self, params: SgdParams, operands: SgdOperands<'_, Cuda>) -> Result<()> {
        let op = "sgd_step";
        checks::sgd_step(&params, &operands)?;
        let views = operands.views();
        let SgdOperands { param, grad, momentum_buf } = operands;
        let sc = SgdScalars::new(&params, momentum_buf.is_some());
        self.elementwise(op, &views, param.len(), |k, s, label| {
            let buf = momentum_buf.map(|m| device_ptr(&m)).unwrap_or(0);
            let n = param.len() as u64;
            let args = Args::default().ptr(device_ptr(&param)).ptr(device_ptr(&grad)).ptr(buf).u64(n).sgd(&sc);
            // SAFETY: as in `cast`; disjoint f32 ranges.
            unsafe { k.launch("chorus_sgd", n, s, args, label) }
        })
    }

    fn adamw_step(&self, params: AdamWParams, operands: AdamWOperands<'_, Cuda>) -> Result<()> {
        let op = "adamw_step";
        checks::adamw_step(&operands)?;
        let views = operands.views();
        let param = operands.param;
        // The scalars as torch computes them (f64 in Python), applied in f32.
        let sc = AdamWScalars::new(&params);
        self.elementwise(op, &views, param.len(), |k, s, label| {
            let [w, g, m, v] = views.map(|v| device_ptr(&v));
            let n = param.len() as u64;
            let args = Args::default().ptr(w).ptr(g).ptr(m).ptr(v).u64(n).adamw(&sc);
            // SAFETY: as in `cast`; disjoint f32 ranges.
            unsafe { k.launch("chorus_adamw", n, s, args, label) }
        })
    }
}
