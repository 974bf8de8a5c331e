//! The compute operations of the hip device's streams (the model and
//! optimizer kernels of [`ComputeStream`](crate::ComputeStream)), apart from
//! the core operations a communicator needs (`stream.rs`).

use super::kernels::Args;
use super::Hip;
use crate::checks;
use crate::gpu_kernels::{code, AdamWScalars, SgdScalars, TILE};
use crate::{AdamWOperands, AdamWParams, DeviceError, MatmulSpec, Result, SgdOperands, SgdParams, View};

use super::stream::{Dims, Reads};
use super::HipStream;

impl crate::ComputeStream for HipStream {
    fn matmul(&self, spec: MatmulSpec, a: View<'_, Hip>, b: View<'_, Hip>, c: View<'_, Hip>) -> Result<()> {
        let op = "matmul";
        checks::matmul(&spec, a, b, c)?;
        let MatmulSpec { m, n, k, trans_a, trans_b, accumulate } = spec;
        if m == 0 || n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let tiles = |x: usize| {
            u32::try_from(x.div_ceil(TILE as usize)).map_err(|_| DeviceError::invalid(op, "too many columns"))
        };
        let grid = (tiles(n)?, tiles(m)?.min(65_535));
        let inputs = [(a, Reads::Whole), (b, Reads::Whole)];
        let (t, ct) = (code(a.dtype()), code(c.dtype()));
        self.launch(op, "chorus_matmul", &inputs, c, Dims { grid, block: (TILE, TILE) }, |p, d| {
            Args::default()
                .ptr(p[0])
                .ptr(p[1])
                .i32(t)
                .ptr(d)
                .i32(ct)
                .u64(m as u64)
                .u64(n as u64)
                .u64(k as u64)
                .i32(trans_a as i32)
                .i32(trans_b as i32)
                .i32(accumulate as i32)
        })
    }

    fn bias_add(&self, x: View<'_, Hip>, bias: View<'_, Hip>) -> Result<()> {
        checks::bias_add(x, bias)?;
        let (n, cols) = (x.len(), bias.len());
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let (xt, bt) = (code(x.dtype()), code(bias.dtype()));
        self.launch("bias_add", "chorus_bias_add", &[(bias, Reads::Whole)], x, Dims::linear(n), |p, d| {
            Args::default().ptr(d).i32(xt).ptr(p[0]).i32(bt).u64(n as u64).u64(cols as u64)
        })
    }

    fn relu(&self, x: View<'_, Hip>, y: View<'_, Hip>) -> Result<()> {
        checks::relu(x, y)?;
        let n = x.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let t = code(x.dtype());
        self.launch("relu", "chorus_relu", &[(x, Reads::Elementwise)], y, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).ptr(d).i32(t).u64(n as u64)
        })
    }

    fn relu_backward(&self, grad_out: View<'_, Hip>, out: View<'_, Hip>, grad_in: View<'_, Hip>) -> Result<()> {
        let op = "relu_backward";
        checks::relu_backward(grad_out, out, grad_in)?;
        let n = grad_out.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let inputs = [(grad_out, Reads::Elementwise), (out, Reads::Elementwise)];
        let t = code(out.dtype());
        self.launch(op, "chorus_relu_backward", &inputs, grad_in, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).ptr(p[1]).ptr(d).i32(t).u64(n as u64)
        })
    }

    fn mse_loss(&self, pred: View<'_, Hip>, target: View<'_, Hip>, loss: View<'_, Hip>, scale: f64) -> Result<()> {
        let op = "mse_loss";
        checks::mse_loss(pred, target, loss)?;
        let n = pred.len();
        let (pt, tt, lt) = (code(pred.dtype()), code(target.dtype()), code(loss.dtype()));
        let inputs = [(pred, Reads::Whole), (target, Reads::Whole)];
        self.launch(op, "chorus_mse_loss", &inputs, loss, Dims::ONE_BLOCK, |p, d| {
            Args::default().ptr(p[0]).i32(pt).ptr(p[1]).i32(tt).ptr(d).i32(lt).u64(n as u64).f64(scale)
        })
    }

    fn mse_grad(&self, pred: View<'_, Hip>, target: View<'_, Hip>, grad: View<'_, Hip>, scale: f64) -> Result<()> {
        let op = "mse_grad";
        checks::mse_grad(pred, target, grad)?;
        let n = pred.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let (pt, tt, gt) = (code(pred.dtype()), code(target.dtype()), code(grad.dtype()));
        let inputs = [(pred, Reads::Elementwise), (target, Reads::Elementwise)];
        self.launch(op, "chorus_mse_grad", &inputs, grad, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).i32(pt).ptr(p[1]).i32(tt).ptr(d).i32(gt).u64(n as u64).f64(scale)
        })
    }

    fn column_sums(&self, x: View<'_, Hip>, out: View<'_, Hip>, accumulate: bool) -> Result<()> {
        let op = "column_sums";
        checks::column_sums(x, out)?;
        let cols = out.len();
        if cols == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let rows = x.len() / cols;
        let (xt, ot) = (code(x.dtype()), code(out.dtype()));
        self.launch(op, "chorus_column_sums", &[(x, Reads::Whole)], out, Dims::linear(cols), |p, d| {
            Args::default().ptr(p[0]).i32(xt).ptr(d).i32(ot).u64(rows as u64).u64(cols as u64).i32(accumulate as i32)
        })
    }

    fn sum_squares(&self, x: View<'_, Hip>, out: View<'_, Hip>, accumulate: bool) -> Result<()> {
        let op = "sum_squares";
        checks::sum_squares(x, out)?;
        let n = x.len();
        let (xt, ot) = (code(x.dtype()), code(out.dtype()));
        self.launch(op, "chorus_sum_squares", &[(x, Reads::Whole)], out, Dims::ONE_BLOCK, |p, d| {
            Args::default().ptr(p[0]).i32(xt).ptr(d).i32(ot).u64(n as u64).i32(accumulate as i32)
        })
    }

    fn clip_scale(&self, x: View<'_, Hip>, sq: [View<'_, Hip>; 2], max_norm: f64) -> Result<()> {
        let op = "clip_scale";
        checks::clip_scale(x, sq, max_norm)?;
        let n = x.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let (xt, at, bt) = (code(x.dtype()), code(sq[0].dtype()), code(sq[1].dtype()));
        let inputs = [(sq[0], Reads::Whole), (sq[1], Reads::Whole)];
        self.launch(op, "chorus_clip_scale", &inputs, x, Dims::linear(n), |p, d| {
            Args::default().ptr(d).i32(xt).u64(n as u64).ptr(p[0]).i32(at).ptr(p[1]).i32(bt).f64(max_norm)
        })
    }

    fn sgd_step(&self, params: SgdParams, operands: SgdOperands<'_, Hip>) -> Result<()> {
        let op = "sgd_step";
        checks::sgd_step(&params, &operands)?;
        let SgdOperands { param, grad, momentum_buf } = operands;
        let n = param.len();
        let buf = momentum_buf.map(|m| self.device_ptr(op, m)).transpose()?.unwrap_or(0);
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let sc = SgdScalars::new(&params, momentum_buf.is_some());
        self.launch(op, "chorus_sgd", &[(grad, Reads::Whole)], param, Dims::linear(n), |p, d| {
            Args::default().ptr(d).ptr(p[0]).ptr(buf).u64(n as u64).sgd(&sc)
        })
    }

    fn adamw_step(&self, params: AdamWParams, operands: AdamWOperands<'_, Hip>) -> Result<()> {
        let op = "adamw_step";
        checks::adamw_step(&operands)?;
        let AdamWOperands { param, grad, exp_avg, exp_avg_sq } = operands;
        let (m, v) = (self.device_ptr(op, exp_avg)?, self.device_ptr(op, exp_avg_sq)?);
        let n = param.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        // The scalars exactly as the cpu device (and torch) computes them.
        let sc = AdamWScalars::new(&params);
        self.launch(op, "chorus_adamw", &[(grad, Reads::Whole)], param, Dims::linear(n), |p, d| {
            Args::default().ptr(d).ptr(p[0]).ptr(m).ptr(v).u64(n as u64).adamw(&sc)
        })
    }
}
