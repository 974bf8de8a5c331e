//! Optimizers that step on the shards, with state sharded like the parameters
//! and laid out as each group's masters; gradient clipping.

use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{
    host_step, AdamWOperands, AdamWParams, Backend, Buffer, ComputeBackend, ComputeStream, DType, DeviceError, Scalar,
    SgdOperands, SgdParams, Stream, StreamExt,
};

use crate::pending::{Finish, PendingValue};
use crate::storage::{kernels_reach, zeroed_like, GroupStorage};
use crate::{offload, Buf, Fsdp, FsdpError, Result, Strm};

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
///
/// Its state is one buffer per moment and group, laid out as the group's
/// masters, so a step is one kernel per group, whatever the number of
/// parameters (the update is elementwise, so the values are those of a
/// step per parameter; the shards' padding stays zero).
pub struct ShardedOptimizer<C: CommBackend> {
    kind: OptimizerKind,
    /// The lr of the next steps where a schedule set one; `kind`'s otherwise
    /// (`kind` keeps the base lr, which checkpoints record and compare).
    lr: Option<f64>,
    step: u64,
    /// Per group: its moment buffers (momentum; or AdamW's two) once it has state.
    state: Vec<Option<GroupState<C>>>,
}

/// One group's optimizer state.
struct GroupState<C: CommBackend> {
    moments: [Option<Buf<C>>; 2],
    /// Parameters in the group (the state covers all of them).
    params: usize,
}

impl<C: CommBackend> GroupState<C> {
    /// Zeroed state of `kind` for `storage`'s masters: in host memory under offload.
    fn zeroed(kind: OptimizerKind, stream: &Strm<C>, storage: &GroupStorage<C>, params: usize) -> Result<Self> {
        let zeroed = || -> Result<Option<Buf<C>>> { Ok(Some(zeroed_like(stream, storage)?)) };
        let moments = match kind.buffers() {
            0 => [None, None],
            1 => [zeroed()?, None],
            _ => [zeroed()?, zeroed()?],
        };
        Ok(GroupState { moments, params })
    }
}

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
    /// this rank: after its group's first step (or a load of its state),
    /// unless the optimizer keeps none.
    pub fn has_state(&self, g: usize, i: usize) -> bool {
        matches!(self.state.get(g), Some(Some(s)) if i < s.params && s.moments.iter().flatten().next().is_some())
    }

    /// This rank's state of parameter `i` of group `g`, laid out like
    /// [`Fsdp::read_shard`]: SGD with momentum `[momentum_buffer]`; AdamW
    /// `[exp_avg, exp_avg_sq]`; empty before the first step or for plain SGD.
    /// Blocks on the compute stream.
    pub fn read_state(&self, fsdp: &Fsdp<C>, g: usize, i: usize) -> Result<Vec<Vec<f32>>> {
        let stream = &fsdp.ctx.streams.compute;
        let (Some(Some(state)), Some(p)) = (self.state.get(g), fsdp.groups.get(g).and_then(|grp| grp.params.get(i)))
        else {
            return Ok(Vec::new());
        };
        let reads = state
            .moments
            .iter()
            .flatten()
            .map(|b| Ok(stream.copy_to_host(b.slice(p.shard.start, p.shard.len())?)?))
            .collect::<Result<Vec<_>>>()?;
        reads.into_iter().map(|r| Ok(r.wait_typed::<f32>()?)).collect()
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
        let expected = self.kind.buffers();
        let mut state: Vec<Option<GroupState<C>>> = fsdp.groups.iter().map(|_| None).collect();
        let mut given: Vec<Vec<bool>> = fsdp.groups.iter().map(|grp| vec![false; grp.params.len()]).collect();
        for (g, i, moments) in states {
            let grp = fsdp.groups.get(g);
            let p = grp
                .and_then(|grp| grp.params.get(i))
                .ok_or_else(|| FsdpError::InvalidArgument(format!("no parameter {i} in group {g}")))?;
            if moments.is_empty() {
                continue;
            }
            if moments.len() != expected || moments.iter().any(|m| m.len() != p.shard.len()) {
                return Err(FsdpError::InvalidArgument(format!(
                    "{}: optimizer state of {} buffers of {:?} elements; {:?} expects {expected} of {}",
                    p.name,
                    moments.len(),
                    moments.iter().map(Vec::len).collect::<Vec<_>>(),
                    self.kind,
                    p.shard.len()
                )));
            }
            let grp = &fsdp.groups[g];
            if state[g].is_none() {
                state[g] = Some(GroupState::zeroed(self.kind, stream, &grp.storage, grp.params.len())?);
            }
            let group_state = state[g].as_ref().ok_or_else(|| FsdpError::InvalidArgument("optimizer state".into()))?;
            for (b, m) in group_state.moments.iter().flatten().zip(&moments) {
                stream.upload(m, b.slice(p.shard.start, p.shard.len())?)?;
            }
            given[g][i] = true;
        }
        if steps > 0 && expected > 0 {
            for (grp, given) in fsdp.groups.iter().zip(&given) {
                if let Some((p, _)) = grp.params.iter().zip(given).find(|(_, given)| !**given) {
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

    /// One step on every group that has a gradient, enqueued on the compute
    /// stream (after [`Fsdp::finalize_backward`]): one kernel per group over
    /// its flat masters, gradient and state, or, for a group offloaded to
    /// host memory that the device's kernels do not reach, the same math on
    /// the host in stream order ([`Stream::update_on_host`]).
    pub fn step(&mut self, fsdp: &mut Fsdp<C>) -> Result<()> {
        self.step += 1;
        let lr = self.lr();
        let stream = &fsdp.ctx.streams.compute;
        self.state.resize_with(fsdp.groups.len(), || None);
        let step = self.kind.at_step(self.step, lr);
        for (grp, slot) in fsdp.groups.iter().zip(self.state.iter_mut()) {
            let storage = &grp.storage;
            let Some(grad) = &storage.grad else { continue };
            if slot.is_none() {
                *slot = Some(GroupState::zeroed(self.kind, stream, storage, grp.params.len())?);
            }
            let state = slot.as_ref().ok_or_else(|| FsdpError::InvalidArgument("optimizer state".into()))?;
            if !kernels_reach(storage) {
                host_step(stream, step, &storage.master, grad, &state.moments)?;
                continue;
            }
            let moment = |k: usize| state.moments[k].as_ref().map(|b| b.view());
            match step {
                Step::Sgd(params) => {
                    let operands =
                        SgdOperands { param: storage.master.view(), grad: grad.view(), momentum_buf: moment(0) };
                    stream.sgd_step(params, operands)?
                }
                Step::AdamW(params) => {
                    let (Some(m), Some(v)) = (moment(0), moment(1)) else {
                        return Err(FsdpError::InvalidArgument("AdamW state missing".into()));
                    };
                    let operands =
                        AdamWOperands { param: storage.master.view(), grad: grad.view(), exp_avg: m, exp_avg_sq: v };
                    stream.adamw_step(params, operands)?
                }
            }
        }
        Ok(())
    }
}

/// One step's hyper-parameters.
#[derive(Clone, Copy)]
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

    /// Moment buffers per parameter: SGD with momentum 1, plain SGD 0, AdamW 2.
    fn buffers(self) -> usize {
        match self {
            OptimizerKind::Sgd { momentum, .. } if momentum != 0.0 => 1,
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::AdamW { .. } => 2,
        }
    }
}

/// An offloaded group's step where the device's kernels do not reach host
/// memory: the kernels' own math ([`chorus_devices::host_step`]) run on the
/// host, in the compute stream's order, directly on the host buffers — one
/// pass, nothing read back or written again, and the host does not wait.
fn host_step<S: Stream>(
    s: &S,
    step: Step,
    master: &<S::B as Backend>::Buffer,
    grad: &<S::B as Backend>::Buffer,
    moments: &[Option<<S::B as Backend>::Buffer>; 2],
) -> Result<()> {
    let mut writes = vec![master.view()];
    writes.extend(moments.iter().flatten().map(|b| b.view()));
    let update = move |reads: &[&[u8]], writes: &mut [&mut [u8]]| -> chorus_devices::Result<()> {
        let g = as_f32(reads.first().copied().unwrap_or_default())?;
        let mut parts = writes.iter_mut().map(|w| as_f32_mut(w)).collect::<chorus_devices::Result<Vec<_>>>()?;
        match (step, parts.as_mut_slice()) {
            (Step::Sgd(params), [w]) => host_step::sgd(params, w, g, None),
            (Step::Sgd(params), [w, m]) => host_step::sgd(params, w, g, Some(m)),
            (Step::AdamW(params), [w, m, v]) => host_step::adamw(params, w, g, m, v),
            _ => Err(host_step_error("optimizer state does not match its kind".into())),
        }
    };
    Ok(s.update_on_host(&[grad.view()], &writes, Box::new(update))?)
}

/// Gradient clipping needs a reduction kernel ([`ComputeStream::sum_squares`]).
impl<C: CommBackend> Fsdp<C>
where
    C::B: ComputeBackend,
{
    /// The global L2 norm of all gradients across shards (padding is zero and
    /// adds nothing; replicated parameters count once). If it exceeds
    /// `max_norm`, scales every gradient by `max_norm / (norm + 1e-6)` as
    /// `torch.nn.utils.clip_grad_norm_` does. Every rank must call it; blocks
    /// until the norm is on the host ([`Fsdp::clip_grad_norm_async`] does not).
    /// Returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        self.clip_grad_norm_async(max_norm)?.read()
    }

    /// [`Fsdp::clip_grad_norm`] without waiting: the norm, the coefficient and
    /// the scaling are all enqueued on the compute stream (the coefficient is
    /// computed on the device, [`ComputeStream::clip_scale`]), so the host can
    /// enqueue the optimizer step at once. The norm is read from the returned
    /// [`PendingValue`] when wanted. Every rank must call it. `max_norm` must be
    /// finite and not negative.
    pub fn clip_grad_norm_async(&mut self, max_norm: f64) -> Result<PendingValue> {
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(FsdpError::InvalidArgument(format!(
                "clip_grad_norm: max_norm must be finite and not negative, got {max_norm}"
            )));
        }
        let s = &self.ctx.streams.compute;
        // [the shards' sum of squares, the replicated parameters'].
        let sq = s.alloc(DType::F32, 2)?;
        s.fill(sq.view(), Scalar::Float(0.0))?;
        let (sharded, replicated) = (sq.view().slice(0, 1)?, sq.view().slice(1, 1)?);
        for storage in self.groups.iter().map(|g| &g.storage) {
            if let Some(grad) = &storage.grad {
                // The sharded part, then the replicated parameters whole.
                let split = storage.sharded_numel;
                let parts = [(grad.slice(0, split)?, sharded), (grad.slice(split, grad.len() - split)?, replicated)];
                for (part, out) in parts.into_iter().filter(|(part, _)| !part.is_empty()) {
                    offload::on_kernel_view(s, part, false, |g| s.sum_squares(g, out, true))?;
                }
            }
        }
        // Shards differ across the shard group only; replicas hold the same values.
        self.ctx.dp.shard.all_reduce_in_place(sharded, ReduceOp::Sum, s)?;
        for grad in self.groups.iter().filter_map(|g| g.storage.grad.as_ref()) {
            offload::on_kernel_view(s, grad.view(), true, |g| s.clip_scale(g, [sharded, replicated], max_norm))?;
        }
        Ok(PendingValue::new(s.copy_to_host(sq.view())?, Finish::Norm))
    }
}

fn host_step_error(reason: String) -> DeviceError {
    DeviceError::InvalidArgument { op: "optimizer host step", reason }
}

/// Host bytes of f32 elements as f32s (devices align host buffers to at least 8 bytes).
fn as_f32(b: &[u8]) -> chorus_devices::Result<&[f32]> {
    bytemuck::try_cast_slice(b).map_err(|e| host_step_error(format!("host bytes not f32-aligned: {e}")))
}

/// [`as_f32`], mutable.
fn as_f32_mut(b: &mut [u8]) -> chorus_devices::Result<&mut [f32]> {
    bytemuck::try_cast_slice_mut(b).map_err(|e| host_step_error(format!("host bytes not f32-aligned: {e}")))
}
