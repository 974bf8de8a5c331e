//! Optimizers that step on the shards, with state sharded like the parameters.

use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{AdamWParams, Buffer, DType, Scalar, SgdParams, Stream, StreamExt};

use crate::{Buf, Fsdp, FsdpError, Result};

/// Which optimizer, with PyTorch's semantics and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerKind {
    /// `torch.optim.SGD`.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (0 for none).
        momentum: f64,
        /// Dampening.
        dampening: f64,
        /// L2 weight decay.
        weight_decay: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// `torch.optim.AdamW`.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// β1.
        beta1: f64,
        /// β2.
        beta2: f64,
        /// ε, added outside the square root.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
}

impl OptimizerKind {
    /// SGD with PyTorch's defaults apart from `lr` and `momentum`.
    pub fn sgd(lr: f64, momentum: f64) -> Self {
        OptimizerKind::Sgd { lr, momentum, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
    /// AdamW with PyTorch's defaults apart from `lr` and `weight_decay`.
    pub fn adamw(lr: f64, weight_decay: f64) -> Self {
        OptimizerKind::AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay }
    }
}

/// An optimizer over every parameter of an [`Fsdp`], stepping on this rank's
/// shards (and on the whole of replicated parameters).
pub struct ShardedOptimizer<C: CommBackend> {
    kind: OptimizerKind,
    step: u64,
    /// Per group, per parameter: the moment buffers (momentum; or AdamW's two).
    state: Vec<Vec<Option<Moments<C>>>>,
}

type Moments<C> = [Option<Buf<C>>; 2];

impl<C: CommBackend> ShardedOptimizer<C> {
    /// An optimizer of `kind`; state is created on the first step.
    pub fn new(kind: OptimizerKind) -> Self {
        ShardedOptimizer { kind, step: 0, state: Vec::new() }
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One step on every parameter that has a gradient, enqueued on the
    /// compute stream (after [`Fsdp::finalize_backward`]).
    pub fn step(&mut self, fsdp: &mut Fsdp<C>) -> Result<()> {
        self.step += 1;
        let stream = &fsdp.ctx.streams.compute;
        self.state.resize_with(fsdp.groups.len(), Vec::new);
        for (g, grp) in fsdp.groups.iter().enumerate() {
            self.state[g].resize_with(grp.params.len(), || None);
            for (i, p) in grp.params.iter().enumerate() {
                let Some(grad) = &p.grad else { continue };
                let len = p.master.len();
                let slot = &mut self.state[g][i];
                if slot.is_none() {
                    let zeroed = |n: usize| -> Result<Buf<C>> {
                        let b = stream.alloc(DType::F32, n)?;
                        stream.fill(b.view(), Scalar::Float(0.0))?;
                        Ok(b)
                    };
                    *slot = Some(match self.kind {
                        OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => [Some(zeroed(len)?), None],
                        OptimizerKind::Sgd { .. } => [None, None],
                        OptimizerKind::AdamW { .. } => [Some(zeroed(len)?), Some(zeroed(len)?)],
                    });
                }
                let state = slot.as_ref().ok_or_else(|| FsdpError::InvalidArgument("optimizer state".into()))?;
                match self.kind {
                    OptimizerKind::Sgd { lr, momentum, dampening, weight_decay, nesterov } => stream.sgd_step(
                        SgdParams { lr, momentum, dampening, weight_decay, nesterov, first_step: self.step == 1 },
                        p.master.view(),
                        grad.view(),
                        state[0].as_ref().map(|b| b.view()),
                    )?,
                    OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                        let (Some(m), Some(v)) = (&state[0], &state[1]) else {
                            return Err(FsdpError::InvalidArgument("AdamW state missing".into()));
                        };
                        stream.adamw_step(
                            AdamWParams { lr, beta1, beta2, eps, weight_decay, step: self.step },
                            p.master.view(),
                            grad.view(),
                            m.view(),
                            v.view(),
                        )?
                    }
                }
            }
        }
        Ok(())
    }
}

impl<C: CommBackend> Fsdp<C> {
    /// The global L2 norm of all gradients across shards (padding is zero and
    /// adds nothing; replicated parameters count once). If it exceeds
    /// `max_norm`, scales every gradient by `max_norm / (norm + 1e-6)` as
    /// `torch.nn.utils.clip_grad_norm_` does. Every rank must call it; blocks.
    /// Returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        let s = &self.ctx.streams.compute;
        let sharded = s.alloc(DType::F32, 1)?;
        let replicated = s.alloc(DType::F32, 1)?;
        s.fill(sharded.view(), Scalar::Float(0.0))?;
        s.fill(replicated.view(), Scalar::Float(0.0))?;
        for p in self.groups.iter().flat_map(|g| g.params.iter()) {
            if let Some(grad) = &p.grad {
                let out = if p.layout.is_some() { &sharded } else { &replicated };
                s.sum_squares(grad.view(), out.view(), true)?;
            }
        }
        // Shards differ across the shard group only; replicas hold the same values.
        self.ctx.dp.shard.all_reduce_in_place(sharded.view(), ReduceOp::Sum, s)?;
        let total = s.read_vec::<f32>(sharded.view())?[0] as f64 + s.read_vec::<f32>(replicated.view())?[0] as f64;
        let norm = total.sqrt();
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for p in self.groups.iter().flat_map(|g| g.params.iter()) {
                if let Some(grad) = &p.grad {
                    s.scale(grad.view(), coef)?;
                }
            }
        }
        Ok(norm)
    }
}
