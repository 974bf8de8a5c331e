//! The compute operations of the cpu device's streams (the model and
//! optimizer kernels of [`ComputeStream`](crate::ComputeStream)), apart from
//! the core operations a communicator needs (`stream.rs`).

use super::kernels::{self, with_float};
use super::sanitizer::Access;
use super::Cpu;
use crate::checks;
use crate::{AdamWOperands, AdamWParams, Element, MatmulSpec, Result, SgdOperands, SgdParams, View};

use super::stream::{store_scalar, typed, typed_mut};
use super::{CpuStream, JobInput};

impl crate::ComputeStream for CpuStream {
    fn matmul(&self, spec: MatmulSpec, a: View<'_, Cpu>, b: View<'_, Cpu>, c: View<'_, Cpu>) -> Result<()> {
        let op = "matmul";
        checks::matmul(&spec, a, b, c)?;
        let (ad, cd) = (a.dtype(), c.dtype());
        self.map_job(op, [a, b, c], c, move |[a, b, old], out| {
            out.copy_from_slice(old);
            with_float!(ad, T => with_float!(cd, C => kernels::matmul::<T, C>(spec, typed(a), typed(b), typed_mut(out))))
        })
    }

    fn bias_add(&self, x: View<'_, Cpu>, bias: View<'_, Cpu>) -> Result<()> {
        checks::bias_add(x, bias)?;
        let (xd, bd) = (x.dtype(), bias.dtype());
        self.map_job("bias_add", [bias, x], x, move |[b, old], x| {
            x.copy_from_slice(old);
            with_float!(xd, X => with_float!(bd, B => kernels::bias_add::<X, B>(typed_mut(x), typed(b))))
        })
    }

    fn relu(&self, x: View<'_, Cpu>, y: View<'_, Cpu>) -> Result<()> {
        checks::relu(x, y)?;
        let d = x.dtype();
        self.map_job("relu", [x], y, move |[x], y| with_float!(d, T => kernels::relu::<T>(typed(x), typed_mut(y))))
    }

    fn relu_backward(&self, grad_out: View<'_, Cpu>, out: View<'_, Cpu>, grad_in: View<'_, Cpu>) -> Result<()> {
        let op = "relu_backward";
        checks::relu_backward(grad_out, out, grad_in)?;
        let d = out.dtype();
        self.map_job(
            op,
            [grad_out, out],
            grad_in,
            move |[g, o], gi| with_float!(d, T => kernels::relu_backward::<T>(typed(g), typed(o), typed_mut(gi))),
        )
    }

    fn mse_loss(&self, pred: View<'_, Cpu>, target: View<'_, Cpu>, loss: View<'_, Cpu>, scale: f64) -> Result<()> {
        let op = "mse_loss";
        checks::mse_loss(pred, target, loss)?;
        let (pd, td, ld) = (pred.dtype(), target.dtype(), loss.dtype());
        self.map_job(op, [pred, target], loss, move |[p, t], l| {
            let s = with_float!(pd, P => with_float!(td, T => kernels::mse_sum::<P, T>(typed(p), typed(t))));
            with_float!(ld, L => store_scalar::<L>(l, s * scale, false))
        })
    }

    fn mse_grad(&self, pred: View<'_, Cpu>, target: View<'_, Cpu>, grad: View<'_, Cpu>, scale: f64) -> Result<()> {
        let op = "mse_grad";
        checks::mse_grad(pred, target, grad)?;
        let (pd, td, gd) = (pred.dtype(), target.dtype(), grad.dtype());
        self.map_job(op, [pred, target], grad, move |[p, t], g| {
            with_float!(pd, P => with_float!(td, T => with_float!(gd, G =>
                kernels::mse_grad::<P, T, G>(typed(p), typed(t), typed_mut(g), scale))))
        })
    }

    fn column_sums(&self, x: View<'_, Cpu>, out: View<'_, Cpu>, accumulate: bool) -> Result<()> {
        let op = "column_sums";
        checks::column_sums(x, out)?;
        let (xd, od) = (x.dtype(), out.dtype());
        self.map_job(op, [x, out], out, move |[x, old], o| {
            o.copy_from_slice(old);
            with_float!(xd, X => with_float!(od, O => kernels::column_sums::<X, O>(typed(x), typed_mut(o), accumulate)))
        })
    }

    fn sum_squares(&self, x: View<'_, Cpu>, out: View<'_, Cpu>, accumulate: bool) -> Result<()> {
        let op = "sum_squares";
        checks::sum_squares(x, out)?;
        let (xd, od) = (x.dtype(), out.dtype());
        self.map_job(op, [x, out], out, move |[x, old], o| {
            o.copy_from_slice(old);
            let s = with_float!(xd, X => kernels::sum_squares::<X>(typed(x)));
            with_float!(od, O => store_scalar::<O>(o, s, accumulate))
        })
    }

    fn clip_scale(&self, x: View<'_, Cpu>, sq: [View<'_, Cpu>; 2], max_norm: f64) -> Result<()> {
        checks::clip_scale(x, sq, max_norm)?;
        let (xd, ad, bd) = (x.dtype(), sq[0].dtype(), sq[1].dtype());
        self.map_job("clip_scale", [sq[0], sq[1], x], x, move |[a, b, old], x| {
            x.copy_from_slice(old);
            let total =
                with_float!(ad, A => typed::<A>(a)[0].to_f64()) + with_float!(bd, B => typed::<B>(b)[0].to_f64());
            let coef = max_norm / (total.sqrt() + 1e-6);
            if coef < 1.0 {
                with_float!(xd, T => kernels::scale::<T>(typed_mut(x), coef));
            }
        })
    }

    fn sgd_step(&self, params: SgdParams, operands: SgdOperands<'_, Cpu>) -> Result<()> {
        let op = "sgd_step";
        checks::sgd_step(&params, &operands)?;
        let SgdOperands { param, grad, momentum_buf } = operands;
        let p = self.own(op, &param)?;
        let g = self.own(op, &grad)?;
        let m = momentum_buf.map(|v| self.own(op, &v)).transpose()?;
        let mut accesses = vec![Access::read(grad), Access::write(param)];
        accesses.extend(momentum_buf.map(Access::write));
        self.enqueue(op, &accesses, move |input| {
            if let JobInput::Run = input {
                // SAFETY: disjoint ranges (checked above), stream-ordered.
                unsafe { kernels::sgd(params, p.as_mut_slice(), g.as_slice(), m.as_ref().map(|m| m.as_mut_slice())) };
            }
            Ok(())
        })
    }

    fn adamw_step(&self, params: AdamWParams, operands: AdamWOperands<'_, Cpu>) -> Result<()> {
        let op = "adamw_step";
        checks::adamw_step(&operands)?;
        let mut raws = Vec::with_capacity(4);
        for v in operands.views() {
            raws.push(self.own(op, &v)?);
        }
        let AdamWOperands { param, grad, exp_avg, exp_avg_sq } = operands;
        let accesses = [Access::read(grad), Access::write(param), Access::write(exp_avg), Access::write(exp_avg_sq)];
        self.enqueue(op, &accesses, move |input| {
            if let JobInput::Run = input {
                let [p, g, m, v] = [&raws[0], &raws[1], &raws[2], &raws[3]];
                // SAFETY: disjoint ranges (checked above), stream-ordered.
                unsafe { kernels::adamw(params, p.as_mut_slice(), g.as_slice(), m.as_mut_slice(), v.as_mut_slice()) };
            }
            Ok(())
        })
    }
}
