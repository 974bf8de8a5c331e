//! What the adapter keeps of each group across a step's phases: its
//! parameters bound as candle variables for the phase, the graphs kept from
//! forward, and its stage counts.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device as CandleDevice, Tensor, Var};
use candle_nn::VarBuilder;

use crate::device::BoundVar;
use crate::storage::storage_extent;
use crate::Result;

/// A group's unsharded parameters as candle variables, bound once per phase
/// (forward, backward) and shared by the phase's stages.
pub(super) struct PhaseParams {
    /// What backs each variable (a copy, or FSDP's buffer borrowed).
    pub(super) bound: Vec<BoundVar>,
    /// In the group's parameter order (FSDP's index `i`).
    pub(super) vars: Arc<Vec<Var>>,
    /// The variables under their names: stages that build a graph.
    pub(super) tracked: VarBuilder<'static>,
    /// The same storage without a graph: forward stages that will be recomputed.
    pub(super) detached: VarBuilder<'static>,
}

impl PhaseParams {
    pub(super) fn new(names: Vec<String>, bound: Vec<BoundVar>, dtype: candle_core::DType, dev: &CandleDevice) -> Self {
        let vars: Vec<Var> = bound.iter().map(|b| b.var().clone()).collect();
        let tracked = names.iter().cloned().zip(vars.iter().map(|v| v.as_tensor().clone())).collect::<HashMap<_, _>>();
        let detached = names.into_iter().zip(vars.iter().map(|v| v.as_detached_tensor())).collect::<HashMap<_, _>>();
        PhaseParams {
            bound,
            vars: Arc::new(vars),
            tracked: VarBuilder::from_tensors(tracked, dtype, dev),
            detached: VarBuilder::from_tensors(detached, dtype, dev),
        }
    }

    /// Whether the variables borrow FSDP's buffers (candle's CUDA device).
    pub(super) fn borrows(&self) -> bool {
        self.bound.iter().any(BoundVar::is_borrowed)
    }

    /// The addresses of the variables' storages (a stage's output is never
    /// taken from one of them).
    pub(super) fn addresses(&self) -> Vec<u64> {
        self.vars.iter().filter_map(|v| storage_extent(v.as_tensor()).map(|(a, _)| a)).collect()
    }

    /// Gives FSDP's buffers back (see [`BoundVar::release`]).
    pub(super) fn release(&mut self, keep_values: bool) -> Result<()> {
        self.bound.iter_mut().try_for_each(|b| b.release(keep_values))
    }
}

/// What a stage of a group without recompute keeps from forward for its
/// backward: its output with candle's graph, the variable of its input (for
/// float inputs), and the parameters the graph refers to.
pub(super) struct SavedGraph {
    pub(super) out: Tensor,
    pub(super) input: Option<BoundVar>,
    pub(super) vars: Arc<Vec<Var>>,
}

pub(super) struct GroupInfo {
    pub(super) stages: usize,
    pub(super) forward_runs: usize,
    pub(super) backward_pending: usize,
    pub(super) recompute: bool,
    pub(super) params: Option<PhaseParams>,
    /// Whether FSDP kept the group unsharded at its last post-forward (the
    /// root; reshard-after-forward false): its borrowed parameters then stay
    /// bound from forward through backward. Unknown before the first.
    pub(super) stayed_unsharded: Option<bool>,
}

impl Default for GroupInfo {
    fn default() -> Self {
        GroupInfo {
            stages: 0,
            forward_runs: 0,
            backward_pending: 0,
            recompute: true,
            params: None,
            stayed_unsharded: None,
        }
    }
}
