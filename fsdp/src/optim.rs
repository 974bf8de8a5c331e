//! Optimizers that step on the shards, with state sharded like the parameters.

use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{
    host_step, AdamWParams, Buffer, ComputeBackend, ComputeStream, DType, Device, Scalar, SgdParams, Stream, StreamExt,
};

use crate::{offload, Buf, Fsdp, FsdpError, Result};

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
    /// The learning rate (an lr schedule's base).
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerKind::Sgd { lr, .. } | OptimizerKind::AdamW { lr, .. } => lr,
        }
    }
}

/// An optimizer over every parameter of an [`Fsdp`], stepping on this rank's
/// shards (and on the whole of replicated parameters).
pub struct ShardedOptimizer<C: CommBackend> {
    kind: OptimizerKind,
    /// The lr of the next steps where a schedule set one; `kind`'s otherwise
    /// (`kind` keeps the base lr, which checkpoints record and compare).
    lr: Option<f64>,
    step: u64,
    /// Per group, per parameter: the moment buffers (momentum; or AdamW's two).
    state: Vec<Vec<Option<Moments<C>>>>,
}

type Moments<C> = [Option<Buf<C>>; 2];

impl<C: CommBackend> ShardedOptimizer<C>
where
    C::B: ComputeBackend,
{
    /// An optimizer of `kind`; state is created on the first step.
    pub fn new(kind: OptimizerKind) -> Self {
        ShardedOptimizer { kind, lr: None, step: 0, state: Vec::new() }
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The optimizer's kind and hyperparameters, with the base lr (not
    /// the one [`set_lr`](Self::set_lr) set).
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    /// Sets the lr the next steps use (an lr schedule's value for the
    /// step), as assigning a param group's `lr` in PyTorch does; [`kind`](Self::kind)
    /// keeps the base lr.
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = Some(lr);
    }

    /// The lr the next step uses.
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(self.kind.lr())
    }

    /// Whether parameter `i` of group `g` has optimizer state (moments) on
    /// this rank: after the first step, unless the optimizer keeps none.
    pub fn has_state(&self, g: usize, i: usize) -> bool {
        matches!(self.state.get(g).and_then(|v| v.get(i)), Some(Some(m)) if m.iter().flatten().next().is_some())
    }

    /// This rank's state of parameter `i` of group `g`, laid out like
    /// [`Fsdp::read_shard`]: SGD with momentum `[momentum_buffer]`; AdamW
    /// `[exp_avg, exp_avg_sq]`; empty before the first step or for plain SGD.
    /// Blocks on the compute stream.
    pub fn read_state(&self, fsdp: &Fsdp<C>, g: usize, i: usize) -> Result<Vec<Vec<f32>>> {
        let stream = &fsdp.ctx.streams.compute;
        let Some(Some(moments)) = self.state.get(g).and_then(|v| v.get(i)) else {
            return Ok(Vec::new());
        };
        moments.iter().flatten().map(|b| Ok(stream.read_vec::<f32>(b.view())?)).collect()
    }

    /// Restores the optimizer as a checkpoint left it: `steps` taken, and for
    /// each `(g, i, moments)` the state of that parameter in the layout of
    /// [`ShardedOptimizer::read_state`] on this rank. After a step
    /// (`steps > 0`) an optimizer with state (momentum, AdamW) needs the
    /// state of every parameter: one left out is an error, since starting
    /// it from zero at step `steps` would skip AdamW's bias correction of
    /// the first update. Uploads on the compute stream.
    pub fn load_state(&mut self, fsdp: &Fsdp<C>, steps: u64, states: Vec<(usize, usize, Vec<Vec<f32>>)>) -> Result<()> {
        let stream = &fsdp.ctx.streams.compute;
        let expected = match self.kind {
            OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::AdamW { .. } => 2,
        };
        let mut state: Vec<Vec<Option<Moments<C>>>> =
            fsdp.groups.iter().map(|grp| grp.params.iter().map(|_| None).collect()).collect();
        for (g, i, moments) in states {
            let p = fsdp
                .groups
                .get(g)
                .and_then(|grp| grp.params.get(i))
                .ok_or_else(|| FsdpError::InvalidArgument(format!("no parameter {i} in group {g}")))?;
            if moments.is_empty() {
                continue;
            }
            if moments.len() != expected || moments.iter().any(|m| m.len() != p.master.len()) {
                return Err(FsdpError::InvalidArgument(format!(
                    "{}: optimizer state of {} buffers of {:?} elements; {:?} expects {expected} of {}",
                    p.name,
                    moments.len(),
                    moments.iter().map(Vec::len).collect::<Vec<_>>(),
                    self.kind,
                    p.master.len()
                )));
            }
            let mut bufs: Moments<C> = [None, None];
            for (slot, m) in bufs.iter_mut().zip(&moments) {
                let b = offload::zeroed_f32(stream, m.len(), p.offload)?;
                stream.upload(m, b.view())?;
                *slot = Some(b);
            }
            state[g][i] = Some(bufs);
        }
        if steps > 0 && expected > 0 {
            for (grp, per_param) in fsdp.groups.iter().zip(&state) {
                if let Some((p, _)) = grp.params.iter().zip(per_param).find(|(_, s)| s.is_none()) {
                    return Err(FsdpError::InvalidArgument(format!(
                        "{}: no optimizer state after {steps} steps ({:?} keeps {expected} buffer(s) per parameter)",
                        p.name, self.kind
                    )));
                }
            }
        }
        self.state = state;
        self.step = steps;
        Ok(())
    }

    /// One step on every parameter that has a gradient, enqueued on the
    /// compute stream (after [`Fsdp::finalize_backward`]).
    pub fn step(&mut self, fsdp: &mut Fsdp<C>) -> Result<()> {
        self.step += 1;
        let lr = self.lr();
        let stream = &fsdp.ctx.streams.compute;
        self.state.resize_with(fsdp.groups.len(), Vec::new);
        for (g, grp) in fsdp.groups.iter().enumerate() {
            self.state[g].resize_with(grp.params.len(), || None);
            for (i, p) in grp.params.iter().enumerate() {
                let Some(grad) = &p.grad else { continue };
                let len = p.master.len();
                let slot = &mut self.state[g][i];
                if slot.is_none() {
                    let zeroed = |n: usize| offload::zeroed_f32(stream, n, p.offload);
                    *slot = Some(match self.kind {
                        OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => [Some(zeroed(len)?), None],
                        OptimizerKind::Sgd { .. } => [None, None],
                        OptimizerKind::AdamW { .. } => [Some(zeroed(len)?), Some(zeroed(len)?)],
                    });
                }
                let state = slot.as_ref().ok_or_else(|| FsdpError::InvalidArgument("optimizer state".into()))?;
                let step = self.kind.at_step(self.step, lr);
                if p.offload.is_some() && !stream.device().kernels_reach_host() {
                    host_step(stream, step, &p.master, grad, state)?;
                    continue;
                }
                match step {
                    Step::Sgd(params) => {
                        stream.sgd_step(params, p.master.view(), grad.view(), state[0].as_ref().map(|b| b.view()))?
                    }
                    Step::AdamW(params) => {
                        let (Some(m), Some(v)) = (&state[0], &state[1]) else {
                            return Err(FsdpError::InvalidArgument("AdamW state missing".into()));
                        };
                        stream.adamw_step(params, p.master.view(), grad.view(), m.view(), v.view())?
                    }
                }
            }
        }
        Ok(())
    }
}

/// One step's hyper-parameters.
enum Step {
    Sgd(SgdParams),
    AdamW(AdamWParams),
}

impl OptimizerKind {
    /// The kernels' parameters at step `step` (counted from 1) with the
    /// learning rate `lr` (the schedule's for that step).
    fn at_step(self, step: u64, lr: f64) -> Step {
        match self {
            OptimizerKind::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
                Step::Sgd(SgdParams { lr, momentum, dampening, weight_decay, nesterov, first_step: step == 1 })
            }
            OptimizerKind::AdamW { beta1, beta2, eps, weight_decay, .. } => {
                Step::AdamW(AdamWParams { lr, beta1, beta2, eps, weight_decay, step })
            }
        }
    }
}

/// An offloaded parameter's step on the host, for a device whose kernels
/// may not touch host memory: waits for the reduced gradient (the reads
/// block on the compute stream), runs the kernels' own math
/// ([`chorus_devices::host_step`]) and writes the master and state back in
/// stream order.
fn host_step<S: ComputeStream>(
    s: &S,
    step: Step,
    master: &<S::B as chorus_devices::Backend>::Buffer,
    grad: &<S::B as chorus_devices::Backend>::Buffer,
    state: &[Option<<S::B as chorus_devices::Backend>::Buffer>; 2],
) -> Result<()> {
    let mut w = s.read_vec::<f32>(master.view())?;
    let g = s.read_vec::<f32>(grad.view())?;
    let mut moments: Vec<Vec<f32>> =
        state.iter().flatten().map(|b| s.read_vec::<f32>(b.view())).collect::<Result<_, _>>()?;
    match (step, moments.as_mut_slice()) {
        (Step::Sgd(params), []) => host_step::sgd(params, &mut w, &g, None)?,
        (Step::Sgd(params), [m]) => host_step::sgd(params, &mut w, &g, Some(m))?,
        (Step::AdamW(params), [m, v]) => host_step::adamw(params, &mut w, &g, m, v)?,
        _ => return Err(FsdpError::InvalidArgument("optimizer state does not match its kind".into())),
    }
    s.upload(&w, master.view())?;
    for (b, m) in state.iter().flatten().zip(&moments) {
        s.upload(m, b.view())?;
    }
    Ok(())
}

/// Gradient clipping needs a reduction kernel ([`ComputeStream::sum_squares`]).
impl<C: CommBackend> Fsdp<C>
where
    C::B: ComputeBackend,
{
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
                offload::on_kernel_view(s, grad.view(), false, |g| s.sum_squares(g, out.view(), true))?;
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
                    offload::on_kernel_view(s, grad.view(), true, |g| s.scale(g, coef))?;
                }
            }
        }
        Ok(norm)
    }
}
