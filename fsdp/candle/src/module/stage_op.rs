//! The candle custom op that stands for one stage of an [`FsdpModel`](super::FsdpModel) in
//! candle's graph: its forward hands candle the output `FsdpModel::run`
//! computed, its backward runs the stage's FSDP backward.
//!
//! The model makes one op per stage, and each op runs on the model's shared
//! state (`Shared`, private to `module.rs`): the two files depend on each
//! other, as a child module on its parent's state.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor};
use chorus_collectives::CommBackend;
use chorus_devices::ComputeBackend;

use super::{Shared, StageFn};
use crate::Error;

/// One stage as a candle custom op (see the module docs): its forward hands
/// candle the output [`FsdpModel::run`](super::FsdpModel::run) computed, its backward runs the
/// stage's FSDP backward.
pub(super) struct StageOp<C: CommBackend> {
    pub(super) shared: Arc<Mutex<Shared<C>>>,
    pub(super) stage: usize,
    pub(super) group: usize,
    pub(super) f: Arc<StageFn>,
}

fn lock<C: CommBackend>(shared: &Mutex<Shared<C>>) -> candle_core::Result<MutexGuard<'_, Shared<C>>> {
    shared.lock().map_err(|_| candle_core::Error::msg("the FSDP model's state is poisoned by an earlier panic"))
}

/// Turns an adapter error into candle's, parking an FSDP error so that
/// [`FsdpModel`](super::FsdpModel) can return it typed.
fn park<C: CommBackend>(shared: &mut Shared<C>, e: Error) -> candle_core::Error {
    match e {
        Error::Candle(c) => c,
        Error::Fsdp(f) => {
            let msg = f.to_string();
            shared.parked = Some(f);
            candle_core::Error::msg(msg)
        }
        other => candle_core::Error::msg(other.to_string()),
    }
}

impl<C: CommBackend + 'static> StageOp<C>
where
    C::B: ComputeBackend,
{
    /// The output [`FsdpModel::run`](super::FsdpModel::run) made for this stage.
    fn output(&self) -> candle_core::Result<(Storage, Shape)> {
        let mut shared = lock(&self.shared)?;
        match shared.pending.take() {
            Some(p) if p.stage == self.stage => Ok((p.storage, p.shape)),
            _ => candle_core::bail!("stage {} applied outside FsdpModel::run", self.stage),
        }
    }
}

impl<C: CommBackend + 'static> CustomOp2 for StageOp<C>
where
    C::B: ComputeBackend,
{
    fn name(&self) -> &'static str {
        "chorus-fsdp-stage"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.output()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("stage {}'s output is not on the CPU", self.stage),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        match self.output()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("stage {}'s output is not on CUDA", self.stage),
        }
    }

    fn bwd(
        &self,
        arg1: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut shared = lock(&self.shared)?;
        let gx = shared
            .backward_stage(self.stage, self.group, self.f.as_ref(), arg1, grad_res)
            .map_err(|e| park(&mut shared, e))?;
        Ok((gx, None))
    }
}
