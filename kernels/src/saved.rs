//! The log-sum-exp a forward keeps for its backward ([`SavedLse`]): attention
//! and cross-entropy save one per row rather than recompute it.

use std::sync::{Mutex, MutexGuard};

use candle_core::op::BackpropOp;
use candle_core::{bail, Result, Shape, Storage, Tensor};

/// The f32 log-sum-exp of an op's last forward, on the forward's device.
pub(crate) struct SavedLse {
    /// The op's name in the errors.
    op: &'static str,
    lse: Mutex<Option<Tensor>>,
}

impl SavedLse {
    /// Empty until the forward runs.
    pub(crate) fn new(op: &'static str) -> SavedLse {
        SavedLse { op, lse: Mutex::new(None) }
    }

    /// Keeps `lse` as a tensor of `shape` (outside the graph: a constant of the backward).
    pub(crate) fn keep(&self, lse: Storage, shape: impl Into<Shape>) -> Result<()> {
        *self.lock()? = Some(Tensor::from_storage(lse, shape, BackpropOp::none(), false));
        Ok(())
    }

    /// The kept log-sum-exp, left in place (a graph's backward may run more than once).
    pub(crate) fn get(&self) -> Result<Tensor> {
        let lse = self.lock()?.clone();
        let Some(lse) = lse else { bail!("{}: backward before forward", self.op) };
        Ok(lse)
    }

    fn lock(&self) -> Result<MutexGuard<'_, Option<Tensor>>> {
        self.lse.lock().map_err(|_| candle_core::Error::msg(format!("{}: poisoned", self.op)))
    }
}
