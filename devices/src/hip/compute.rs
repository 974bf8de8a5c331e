//! The compute operations of the hip device's streams (the model and
//! optimizer kernels of [`ComputeStream`](crate::ComputeStream)), apart from
//! the core operations a communicator needs (`stream.rs`).

use super::kernels::{Args, Kernel, TILE};
use super::Hip;
use crate::checks;
use crate::{AdamWParams, DeviceError, MatmulSpec, Result, SgdParams, View};

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
        self.launch(op, Kernel::Matmul(a.dtype(), c.dtype()), &inputs, c, Dims { grid, block: (TILE, TILE) }, |p, d| {
            Args::default()
                .ptr(p[0])
                .ptr(p[1])
                .ptr(d)
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
        let k = Kernel::BiasAdd(x.dtype(), bias.dtype());
        self.launch("bias_add", k, &[(bias, Reads::Whole)], x, Dims::linear(n), |p, d| {
            Args::default().ptr(d).ptr(p[0]).u64(n as u64).u64(cols as u64)
        })
    }

    fn relu(&self, x: View<'_, Hip>, y: View<'_, Hip>) -> Result<()> {
        checks::relu(x, y)?;
        let n = x.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        self.launch("relu", Kernel::Relu(x.dtype()), &[(x, Reads::Elementwise)], y, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).ptr(d).u64(n as u64)
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
        self.launch(op, Kernel::ReluBackward(out.dtype()), &inputs, grad_in, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).ptr(p[1]).ptr(d).u64(n as u64)
        })
    }

    fn mse_loss(&self, pred: View<'_, Hip>, target: View<'_, Hip>, loss: View<'_, Hip>, scale: f64) -> Result<()> {
        let op = "mse_loss";
        checks::mse_loss(pred, target, loss)?;
        let n = pred.len();
        let k = Kernel::MseLoss(pred.dtype(), target.dtype(), loss.dtype());
        let inputs = [(pred, Reads::Whole), (target, Reads::Whole)];
        self.launch(op, k, &inputs, loss, Dims::ONE_BLOCK, |p, d| {
            Args::default().ptr(p[0]).ptr(p[1]).ptr(d).u64(n as u64).f64(scale)
        })
    }

    fn mse_grad(&self, pred: View<'_, Hip>, target: View<'_, Hip>, grad: View<'_, Hip>, scale: f64) -> Result<()> {
        let op = "mse_grad";
        checks::mse_grad(pred, target, grad)?;
        let n = pred.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let k = Kernel::MseGrad(pred.dtype(), target.dtype(), grad.dtype());
        let inputs = [(pred, Reads::Elementwise), (target, Reads::Elementwise)];
        self.launch(op, k, &inputs, grad, Dims::linear(n), |p, d| {
            Args::default().ptr(p[0]).ptr(p[1]).ptr(d).u64(n as u64).f64(scale)
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
        let k = Kernel::ColumnSums(x.dtype(), out.dtype());
        self.launch(op, k, &[(x, Reads::Whole)], out, Dims::linear(cols), |p, d| {
            Args::default().ptr(p[0]).ptr(d).u64(rows as u64).u64(cols as u64).i32(accumulate as i32)
        })
    }

    fn sum_squares(&self, x: View<'_, Hip>, out: View<'_, Hip>, accumulate: bool) -> Result<()> {
        let op = "sum_squares";
        checks::sum_squares(x, out)?;
        let n = x.len();
        let k = Kernel::SumSquares(x.dtype(), out.dtype());
        self.launch(op, k, &[(x, Reads::Whole)], out, Dims::ONE_BLOCK, |p, d| {
            Args::default().ptr(p[0]).ptr(d).u64(n as u64).i32(accumulate as i32)
        })
    }

    fn sgd_step(
        &self,
        params: SgdParams,
        param: View<'_, Hip>,
        grad: View<'_, Hip>,
        momentum_buf: Option<View<'_, Hip>>,
    ) -> Result<()> {
        let op = "sgd_step";
        checks::sgd_step(&params, param, grad, momentum_buf)?;
        let n = param.len();
        let buf = momentum_buf.map(|m| self.device_ptr(op, m)).transpose()?.unwrap_or(0);
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        let use_buf = params.momentum != 0.0 && momentum_buf.is_some();
        let flags = (params.weight_decay != 0.0) as i32
            | (use_buf as i32) << 1
            | (params.first_step as i32) << 2
            | (params.nesterov as i32) << 3;
        let (lr, wd, mom, damp) =
            (params.lr as f32, params.weight_decay as f32, params.momentum as f32, (1.0 - params.dampening) as f32);
        self.launch(op, Kernel::Sgd, &[(grad, Reads::Whole)], param, Dims::linear(n), |p, d| {
            Args::default().ptr(d).ptr(p[0]).ptr(buf).u64(n as u64).f32(lr).f32(wd).f32(mom).f32(damp).i32(flags)
        })
    }

    fn adamw_step(
        &self,
        params: AdamWParams,
        param: View<'_, Hip>,
        grad: View<'_, Hip>,
        exp_avg: View<'_, Hip>,
        exp_avg_sq: View<'_, Hip>,
    ) -> Result<()> {
        let op = "adamw_step";
        checks::adamw_step(param, grad, exp_avg, exp_avg_sq)?;
        let (m, v) = (self.device_ptr(op, exp_avg)?, self.device_ptr(op, exp_avg_sq)?);
        let n = param.len();
        if n == 0 {
            return self.enqueue(|_| Ok(()));
        }
        // The scalars exactly as the cpu device (and torch) computes them.
        let step = params.step.max(1) as i32;
        let decay = (1.0 - params.lr * params.weight_decay) as f32;
        let one_minus_b1 = (1.0 - params.beta1) as f32;
        let (b2, one_minus_b2) = (params.beta2 as f32, (1.0 - params.beta2) as f32);
        let bc1 = 1.0 - params.beta1.powi(step);
        let bc2_sqrt = (1.0 - params.beta2.powi(step)).sqrt() as f32;
        let step_size = (params.lr / bc1) as f32;
        let eps = params.eps as f32;
        self.launch(op, Kernel::AdamW, &[(grad, Reads::Whole)], param, Dims::linear(n), |p, d| {
            Args::default()
                .ptr(d)
                .ptr(p[0])
                .ptr(m)
                .ptr(v)
                .u64(n as u64)
                .f32(decay)
                .f32(one_minus_b1)
                .f32(b2)
                .f32(one_minus_b2)
                .f32(bc2_sqrt)
                .f32(step_size)
                .f32(eps)
        })
    }
}
