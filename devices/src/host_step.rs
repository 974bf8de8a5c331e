//! The optimizer kernels' math on host slices: what a caller runs on the
//! host when its state lives in host memory that the device's kernels may
//! not touch (CPU offload on a GPU). The same functions are the cpu device's
//! `sgd_step` / `adamw_step`, and the GPU kernels compute the same f32
//! formulas in the same order, so a step here equals a step there.

use crate::{AdamWParams, DeviceError, Result, SgdParams};

/// One SGD step on `param` (see [`ComputeStream::sgd_step`](crate::ComputeStream::sgd_step)).
/// Every slice must have `param`'s length.
pub fn sgd(p: SgdParams, param: &mut [f32], grad: &[f32], momentum_buf: Option<&mut [f32]>) -> Result<()> {
    let n = param.len();
    if grad.len() != n || momentum_buf.as_ref().is_some_and(|b| b.len() != n) {
        return Err(DeviceError::invalid("host sgd step", "param, grad and momentum lengths differ"));
    }
    crate::cpu::kernels::sgd(p, param, grad, momentum_buf);
    Ok(())
}

/// One AdamW step on `param` (see [`ComputeStream::adamw_step`](crate::ComputeStream::adamw_step)).
/// Every slice must have `param`'s length.
pub fn adamw(
    p: AdamWParams,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
) -> Result<()> {
    let n = param.len();
    if grad.len() != n || exp_avg.len() != n || exp_avg_sq.len() != n {
        return Err(DeviceError::invalid("host adamw step", "param, grad and moment lengths differ"));
    }
    crate::cpu::kernels::adamw(p, param, grad, exp_avg, exp_avg_sq);
    Ok(())
}
