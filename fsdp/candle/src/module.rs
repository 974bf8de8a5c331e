//! [`FsdpModel`]: a candle model whose layers are grouped into FSDP param
//! groups, each piece of the model run as a candle custom op.
//!
//! A *stage* is a piece of the model that uses one group's parameters: a
//! function of a [`VarBuilder`] (holding the group's unsharded parameters
//! under their full names) and an input tensor. [`FsdpModel::run`] runs a
//! stage and applies it to candle's graph as a [`CustomOp2`] on the input
//! and a one-element anchor variable (so candle records the op even when
//! the input, token ids, has no graph). The forward runs FSDP's pre-forward
//! (all-gather) at the group's first stage, binds the group's unsharded
//! parameters as candle variables once for the phase (borrowing FSDP's
//! buffers on candle's CUDA device, copies on candle's CPU:
//! [`crate::device`]), runs the stage on the input itself, hands its output
//! to the op (its storage moved, not copied, where it is the stage's own:
//! [`crate::storage`]), and runs FSDP's post-forward (reshard) once the
//! group's last stage has run, giving the parameters back first. The op's
//! backward runs FSDP's pre-backward (all-gather again; the prefetch of the
//! next group) and then, per group:
//! - with **recompute** (activation checkpointing, the default): the stage
//!   ran without a graph in forward; it is recomputed with the parameters
//!   (bound once for the backward phase) and the input as candle variables;
//! - without: the stage ran with its graph in forward, and that graph (its
//!   intermediates and the parameters it used) was kept for backward.
//!
//! candle's backward seeded at the stage's output with the output's
//! gradient ([`crate::storage::seed_backward`]) then gives the parameter
//! gradients, which are added from candle's storage into FSDP's unsharded
//! gradients; post-backward (reduce-scatter) runs once the group's last
//! stage has been differentiated, and the input's gradient goes back to
//! candle's backward. The design and its trade-offs are in `docs/fsdp.md`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{CustomOp2, Device as CandleDevice, Shape, Storage, Tensor, Var};
use candle_nn::VarBuilder;
use chorus_collectives::CommBackend;
use chorus_devices::{AccessKind, Buffer, ComputeBackend, Stream, StreamExt, View};
use chorus_fsdp::{DeferredParam, Fsdp, FsdpError, ParamInit, PendingValue, Reshard, ShardedOptimizer, ShardedState};

use crate::convert::{candle_dtype, to_f32_vec};
use crate::device::{copy_storage, Side, Transfers};
use crate::storage::{seed_backward, storage_extent, take_output};
use crate::{Error, Result};

mod group;
mod recompute;
mod stage_op;
use group::{GroupInfo, PhaseParams, SavedGraph};
pub use recompute::Recompute;
use stage_op::StageOp;

/// What a stage computes: builds its layers from the [`VarBuilder`] (the
/// group's unsharded parameters under their full names, in the param dtype)
/// and applies them to the input. In a group that recomputes it runs twice
/// per step (forward, and the recomputation in backward), so it must be a
/// pure function of its inputs.
pub type StageFn = dyn Fn(VarBuilder, &Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// A param group of an [`FsdpModel`] (the index of its FSDP group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupId(pub usize);

/// A stage of an [`FsdpModel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StageId(pub usize);

/// Host time the adapter spent, besides FSDP's own hooks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdapterTimes {
    /// Waiting for and copying unsharded parameters out of FSDP, and
    /// gradients into it (the host copies between candle and the device).
    pub transfer: Duration,
    /// Running stages (forward, recomputation, backward), in candle.
    pub compute: Duration,
    /// Stage applications (forward) and differentiations (backward).
    pub stage_calls: usize,
    /// Stages recomputed in backward (those of groups that recompute).
    pub recomputed: usize,
    /// Parameters read back and gradients uploaded through the stream API
    /// ([`Transfers::Staged`], or a device without host memory).
    pub staged_transfers: usize,
}

/// A stage's output, made by [`FsdpModel::run`] before candle applies the
/// stage's op, which returns it.
struct PendingOutput {
    stage: usize,
    storage: Storage,
    shape: Shape,
}

/// The adapter's state. The fields drop in order: the groups' bound
/// parameters and the kept graphs before the FSDP whose buffers they borrow.
struct Shared<C: CommBackend> {
    groups: Vec<GroupInfo>,
    /// Per stage: the graph kept from forward (groups without recompute).
    saved: Vec<Option<SavedGraph>>,
    pending: Option<PendingOutput>,
    fsdp: Fsdp<C>,
    /// Where the stages compute ([`crate::device`]).
    device: CandleDevice,
    /// How data crosses between candle and FSDP's buffers.
    side: Side,
    /// The FSDP error behind the last failed op: candle's error type cannot
    /// carry it, so [`FsdpModel`] takes it back from here.
    parked: Option<FsdpError>,
    times: AdapterTimes,
}

impl<C: CommBackend> Shared<C>
where
    C::B: ComputeBackend,
{
    fn group_info(&self, g: usize) -> Result<&GroupInfo> {
        self.groups.get(g).ok_or_else(|| Error::InvalidArgument(format!("no group {g}")))
    }

    /// Group `g`'s unsharded parameters as candle variables, bound once per
    /// phase ([`Side::bind_params`]: borrowed on CUDA, where the caller has
    /// made candle's stream wait for FSDP's hook; copied on the host).
    fn phase_params(&mut self, g: usize) -> Result<&PhaseParams> {
        if self.groups[g].params.is_none() {
            let t0 = Instant::now();
            let specs = self.fsdp.group_params(g)?;
            let dtype = self.param_dtype()?;
            let views = specs
                .iter()
                .enumerate()
                .map(|(i, (_, shape))| Ok((self.fsdp.param(g, i)?, shape.clone())))
                .collect::<Result<Vec<_>>>()?;
            let (bound, staged) = self.side.bind_params(self.fsdp.compute_stream(), &self.device, views)?;
            self.times.staged_transfers += staged;
            let names = specs.into_iter().map(|(name, _)| name).collect();
            self.groups[g].params = Some(PhaseParams::new(names, bound, dtype, &self.device));
            self.times.transfer += t0.elapsed();
        }
        self.groups[g].params.as_ref().ok_or_else(|| Error::InvalidArgument(format!("group {g} has no parameters")))
    }

    fn param_dtype(&self) -> Result<candle_core::DType> {
        candle_dtype(self.fsdp.mixed_precision().param())
    }

    /// Group `g`'s parameter views, each with `kind` (a crossing's declared accesses).
    fn param_accesses(&self, g: usize, kind: AccessKind) -> Result<Vec<(View<'_, C::B>, AccessKind)>> {
        (0..self.fsdp.group_params(g)?.len()).map(|i| Ok((self.fsdp.param(g, i)?, kind))).collect()
    }

    /// Runs stage `stage` of group `g` on `x` (the op's input, on candle's
    /// device, contiguous) and returns what the op gives candle: the
    /// stage's output storage, taken without a copy where it is the
    /// stage's own ([`take_output`]), else a copy.
    fn forward_stage(&mut self, stage: usize, g: usize, f: &StageFn, x: &Tensor) -> Result<(Storage, Shape)> {
        let info = self.group_info(g)?;
        let (recompute, first) = (info.recompute, info.forward_runs == 0);
        if !recompute && self.saved.get(stage).is_some_and(|s| s.is_some()) {
            return Err(Error::InvalidArgument(format!(
                "stage {stage} ran forward again before its backward; a group that keeps its graph runs each stage once per backward"
            )));
        }
        if first {
            self.fsdp.pre_forward(g)?;
            self.side.candle_waits_for(self.fsdp.compute_stream())?;
        }
        let dtype = self.param_dtype()?;
        let params = self.phase_params(g)?;
        let mut protected = params.addresses();
        protected.extend(storage_extent(x).map(|(a, _)| a));
        let (vb, vars) = match recompute {
            true => (params.detached.clone(), None),
            false => (params.tracked.clone(), Some(params.vars.clone())),
        };
        let t0 = Instant::now();
        let out = match vars {
            None => {
                let x = if x.dtype().is_float() { x.to_dtype(dtype)? } else { x.clone() };
                f(vb, &x)?
            }
            Some(vars) => {
                let input = if x.dtype().is_float() { Some(self.side.input_var(x)?) } else { None };
                let xin = match &input {
                    Some(v) => v.var().as_tensor().to_dtype(dtype)?,
                    None => x.clone(),
                };
                let out = f(vb, &xin)?;
                if self.saved.len() <= stage {
                    self.saved.resize_with(stage + 1, || None);
                }
                self.saved[stage] = Some(SavedGraph { out: out.clone(), input, vars });
                out
            }
        };
        // The kept graph reads its output's values in backward: copied then.
        let taken = match recompute {
            true => take_output(&out, &protected)?,
            false => None,
        };
        let storage = match taken {
            Some(s) => s,
            None => copy_storage(&out)?,
        };
        let shape = out.shape().clone();
        drop(out);
        self.times.compute += t0.elapsed();
        self.times.stage_calls += 1;
        let info = &mut self.groups[g];
        info.forward_runs += 1;
        if info.forward_runs == info.stages {
            info.forward_runs = 0;
            info.backward_pending = info.stages;
            self.end_forward(g, recompute)?;
        }
        Ok((storage, shape))
    }

    /// The end of group `g`'s forward: the parameters FSDP may now free are
    /// given back (copied first when the kept graph still reads them), the
    /// compute stream waits for candle's reads of them, and FSDP's
    /// post-forward runs. A group FSDP keeps unsharded (learned from its
    /// last post-forward) keeps them bound for its backward.
    fn end_forward(&mut self, g: usize, recompute: bool) -> Result<()> {
        let t0 = Instant::now();
        let stays = self.groups[g].stayed_unsharded == Some(true);
        let mut released = false;
        if let Some(params) = self.groups[g].params.as_mut().filter(|p| p.borrows()) {
            if !stays {
                params.release(!recompute)?;
                released = true;
            }
            let reads = self.param_accesses(g, AccessKind::Read)?;
            self.side.compute_waits_for(self.fsdp.compute_stream(), &reads)?;
        }
        self.times.transfer += t0.elapsed();
        self.fsdp.post_forward(g)?;
        let unsharded = self.fsdp.sharded_state(g)? == ShardedState::Unsharded;
        self.groups[g].stayed_unsharded = Some(unsharded);
        // Copies on the host go with the device's reshard; a group that stays
        // unsharded (the root) keeps its parameters for its backward.
        if released || !unsharded {
            if let Some(mut params) = self.groups[g].params.take() {
                if params.borrows() && !released {
                    // FSDP resharded a group that stayed unsharded before:
                    // candle's reads were ordered before the reshard above, but
                    // a kept graph has lost the values it reads in backward.
                    params.release(false)?;
                    if !recompute {
                        return Err(Error::InvalidArgument(format!(
                            "group {g} was resharded after forward although it stayed unsharded before; a group that keeps its graph needs one reshard policy"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn backward_stage(
        &mut self,
        stage: usize,
        g: usize,
        f: &StageFn,
        input: &Tensor,
        grad_out: &Tensor,
    ) -> Result<Option<Tensor>> {
        let recompute = self.group_info(g)?.recompute;
        // On the GPU candle adds into FSDP's gradients on its own stream, so
        // they exist before candle's backward starts. On the host they are
        // made after it, when the gradients are added: the group's
        // gradients and candle's (with its backward's intermediates) are
        // not held at once (the 125M Llama's peak, `docs/fsdp.md`).
        let grads_first = self.side.on_device();
        match grads_first {
            true => self.fsdp.pre_backward(g)?,
            false => self.fsdp.pre_backward_without_grads(g)?,
        }
        // The all-gather and the zeroed gradients come before candle reads and adds.
        self.side.candle_waits_for(self.fsdp.compute_stream())?;
        let dtype = self.param_dtype()?;
        let (grads, vars, mut x_var) = if recompute {
            let params = self.phase_params(g)?;
            let (vb, vars) = (params.tracked.clone(), params.vars.clone());
            if !grads_first {
                // candle has its copies: FSDP's are not read again this step.
                self.fsdp.release_params_in_backward(g)?;
            }
            let t0 = Instant::now();
            let input = input.contiguous()?;
            let x_var = if input.dtype().is_float() { Some(self.side.input_var(&input)?) } else { None };
            let x = match &x_var {
                Some(v) => v.var().as_tensor().to_dtype(dtype)?,
                None => input.detach(),
            };
            let out = f(vb, &x)?;
            let grads = seed_backward(&out, grad_out)?;
            self.times.compute += t0.elapsed();
            self.times.recomputed += 1;
            (grads, vars, x_var)
        } else {
            if !grads_first {
                // The graph kept from forward holds candle's copies.
                self.fsdp.release_params_in_backward(g)?;
            }
            let saved =
                self.saved.get_mut(stage).and_then(Option::take).ok_or_else(|| {
                    Error::InvalidArgument(format!("stage {stage} has no graph kept from its forward"))
                })?;
            let t0 = Instant::now();
            let grads = seed_backward(&saved.out, grad_out)?;
            self.times.compute += t0.elapsed();
            (grads, saved.vars, saved.input)
        };
        self.times.stage_calls += 1;
        let t1 = Instant::now();
        if !grads_first {
            self.fsdp.ensure_grads(g)?;
        }
        let present = vars.iter().enumerate().filter_map(|(i, v)| Some((i, grads.get(v.as_tensor())?.clone())));
        let pairs = present.map(|(i, grad)| Ok((grad, self.fsdp.grad(g, i)?))).collect::<Result<Vec<_>>>()?;
        self.times.staged_transfers += self.side.add_grads(self.fsdp.compute_stream(), pairs)?;
        self.times.transfer += t1.elapsed();
        let gx = match &x_var {
            Some(v) => Some(match grads.get(v.var().as_tensor()) {
                Some(gx) => gx.clone(),
                None => v.var().as_tensor().zeros_like()?,
            }),
            None => None,
        };
        drop(grads);
        // Everything that reads the borrowed input is enqueued; the gradient is a tensor of its own.
        if let Some(v) = x_var.as_mut() {
            v.release(false)?;
        }
        let info = &mut self.groups[g];
        info.backward_pending = info.backward_pending.saturating_sub(1);
        if info.backward_pending == 0 {
            self.end_backward(g)?;
        }
        Ok(gx)
    }

    /// The end of group `g`'s backward: its borrowed parameters are given
    /// back, the compute stream waits for candle's reads of them and its
    /// additions into the gradients, and FSDP's post-backward
    /// (reduce-scatter) runs.
    fn end_backward(&mut self, g: usize) -> Result<()> {
        if self.side.on_device() {
            let borrowed = self.groups[g].params.as_ref().is_some_and(PhaseParams::borrows);
            if let Some(params) = self.groups[g].params.as_mut() {
                params.release(false)?;
            }
            let mut accesses = match borrowed {
                true => self.param_accesses(g, AccessKind::Read)?,
                false => Vec::new(),
            };
            for i in 0..self.fsdp.group_params(g)?.len() {
                accesses.push((self.fsdp.grad(g, i)?, AccessKind::Write));
            }
            self.side.compute_waits_for(self.fsdp.compute_stream(), &accesses)?;
        }
        self.groups[g].params = None;
        self.fsdp.post_backward(g)?;
        Ok(())
    }

    /// Forgets every phase's parameters and kept graph: the step is over.
    /// Borrowed parameters still bound (a group off the loss's path, an
    /// error) are given back, with the compute stream ordered after
    /// candle's reads of them.
    fn end_step(&mut self) -> Result<()> {
        let mut result = Ok(());
        for g in 0..self.groups.len() {
            let info = &mut self.groups[g];
            info.forward_runs = 0;
            info.backward_pending = 0;
            let Some(mut params) = info.params.take() else { continue };
            if params.borrows() {
                let crossed = params.release(false).and_then(|()| {
                    let reads = self.param_accesses(g, AccessKind::Read)?;
                    self.side.compute_waits_for(self.fsdp.compute_stream(), &reads)
                });
                result = result.and(crossed);
            }
        }
        for saved in self.saved.iter_mut() {
            if let Some(mut s) = saved.take() {
                if let Some(v) = s.input.as_mut() {
                    result = result.and(v.release(false));
                }
            }
        }
        self.pending = None;
        result
    }
}

/// A candle model sharded with FSDP on one rank: its param groups, its
/// stages, and the [`Fsdp`] behind them.
///
/// ```text
/// let mut model = FsdpModel::new(fsdp)?;
/// let mut params = named_tensors(&varmap);                    // the plain candle model's parameters
/// let root = model.add_group("root", take_params(&mut params, &["embed.", "norm.", "head."]), true)?;
/// let embed = model.add_stage(root, |vb, ids| candle_nn::embedding(V, D, vb.pp("embed"))?.forward(ids))?;
/// let block = model.add_group("blocks.0", take_params(&mut params, &["blocks.0."]), false)?;
/// let b0 = model.add_stage(block, |vb, x| Block::new(vb.pp("blocks.0"))?.forward(x))?;
/// ...
/// let logits = model.run(head, &model.run(b0, &model.run(embed, &ids)?)?)?;
/// model.backward(&loss(&logits)?)?;                         // candle's backward, then FSDP's finalize
/// model.optimizer_step(&mut optimizer)?;                   // chorus_fsdp::ShardedOptimizer on the shards
/// ```
///
/// Every rank builds the same groups and stages in the same order. Each
/// stage must run exactly once per forward; a group's forward ends (and it
/// reshards) when its last stage has run, and its backward ends (and its
/// gradients are reduce-scattered) when candle's backward has passed
/// through all of its stages.
pub struct FsdpModel<C: CommBackend> {
    shared: Arc<Mutex<Shared<C>>>,
    anchor: Var,
    device: CandleDevice,
    stages: Vec<Stage>,
}

/// A stage of an [`FsdpModel`]: its group, what it computes, and its op.
struct Stage {
    group: usize,
    f: Arc<StageFn>,
    op: Arc<Box<dyn CustomOp2 + Send + Sync>>,
}

impl<C: CommBackend + 'static> FsdpModel<C>
where
    C::B: ComputeBackend,
{
    /// Wraps `fsdp` (with no groups yet, or groups the model adds stages to).
    /// The stages compute on [`FsdpModel::device`]: on a GPU device, candle's
    /// device for that GPU, or [`Error::NoCandleDevice`] where this build has
    /// none (never a silent fall back to the CPU).
    pub fn new(fsdp: Fsdp<C>) -> Result<Self> {
        let device = crate::device::candle_device::<C::B>(fsdp.device())?;
        use chorus_devices::Device as _;
        crate::device::check_compute_placement(&device, fsdp.device().kernels_reach_host(), || fsdp.device().name())?;
        Self::on(fsdp, device)
    }

    /// Like [`FsdpModel::new`], with candle computing on the CPU whatever
    /// the device: on a GPU device, parameters and gradients cross between
    /// the GPU and the host every step ([`Transfers::Staged`]'s route).
    pub fn new_computing_on_host(fsdp: Fsdp<C>) -> Result<Self> {
        Self::on(fsdp, CandleDevice::Cpu)
    }

    fn on(fsdp: Fsdp<C>, device: CandleDevice) -> Result<Self> {
        let groups = (0..fsdp.num_groups()).map(|_| GroupInfo::default()).collect();
        let side = Side::new(fsdp.compute_stream(), &device, Transfers::Direct)?;
        let anchor = Var::zeros(1, candle_core::DType::F32, &device)?;
        Ok(FsdpModel {
            shared: Arc::new(Mutex::new(Shared {
                groups,
                saved: Vec::new(),
                pending: None,
                fsdp,
                device: device.clone(),
                side,
                parked: None,
                times: AdapterTimes::default(),
            })),
            anchor,
            device,
            stages: Vec::new(),
        })
    }

    /// The candle device the stages compute on: candle's CUDA device on the
    /// same GPU for the `cuda` device with the `candle-cuda` feature, else
    /// candle's CPU. [`FsdpModel::run`] moves its input there; a loss's
    /// targets belong there. A CUDA device here is the adapter's own, with
    /// cudarc's cross-stream event tracking off: its tensors are used on its
    /// stream only (candle's operations all are).
    pub fn device(&self) -> &CandleDevice {
        &self.device
    }

    /// How parameters and gradients cross between FSDP's buffers and candle
    /// on candle's CPU ([`Transfers::Direct`] by default; [`Transfers::Staged`]
    /// takes the route of a device without host memory on any device). An
    /// error on candle's CUDA device, which copies nothing. Set between steps.
    pub fn set_transfers(&self, transfers: Transfers) -> Result<()> {
        let mut shared = self.lock()?;
        match (&mut shared.side, transfers) {
            (Side::Host(t), _) => {
                *t = transfers;
                Ok(())
            }
            #[allow(unreachable_patterns)]
            (_, Transfers::Direct) => Ok(()),
            #[allow(unreachable_patterns)]
            _ => Err(Error::InvalidArgument(
                "staged transfers are a route of candle's CPU; this model computes on FSDP's buffers on the device"
                    .into(),
            )),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Shared<C>>> {
        self.shared
            .lock()
            .map_err(|_| Error::InvalidArgument("the FSDP model's state is poisoned by an earlier panic".into()))
    }

    /// Puts `params` (full names and initial values; every rank passes the
    /// same) under FSDP as one group (FSDP2's `fully_shard` on a module).
    /// `root` groups do not reshard after forward, as FSDP2's root.
    pub fn add_group(&mut self, name: &str, params: Vec<(String, Tensor)>, root: bool) -> Result<GroupId> {
        self.push_group(params, |fsdp, inits| fsdp.add_group(name, inits, root))
    }

    /// Like [`FsdpModel::add_group`] with this group's own reshard-after-forward.
    pub fn add_group_with(&mut self, name: &str, params: Vec<(String, Tensor)>, reshard: Reshard) -> Result<GroupId> {
        self.push_group(params, |fsdp, inits| fsdp.add_group_with(name, inits, reshard))
    }

    /// Like [`FsdpModel::add_group`] with each parameter given by a source of
    /// its shards (deferred initialisation: this rank reads only its rows).
    pub fn add_group_deferred(&mut self, name: &str, params: Vec<DeferredParam>, root: bool) -> Result<GroupId> {
        let mut shared = self.lock()?;
        let g = shared.fsdp.add_group_deferred(name, params, root)?;
        shared.groups.push(GroupInfo::default());
        Ok(GroupId(g))
    }

    /// Adds a group of `params` to FSDP through `add` (one of [`Fsdp`]'s
    /// group constructors), and the adapter's record of its stages.
    fn push_group(
        &mut self,
        params: Vec<(String, Tensor)>,
        add: impl FnOnce(&mut Fsdp<C>, Vec<ParamInit>) -> chorus_fsdp::Result<usize>,
    ) -> Result<GroupId> {
        let inits = to_inits(params)?;
        let mut shared = self.lock()?;
        let g = add(&mut shared.fsdp, inits)?;
        shared.groups.push(GroupInfo::default());
        Ok(GroupId(g))
    }

    /// Adds a stage that computes with `group`'s parameters. A group may have
    /// several stages (FSDP2's root: the embedding first, the head last).
    /// Its output becomes the op's output without a copy where it is the
    /// stage's own, so a stage returns a tensor it computed, not one it keeps
    /// elsewhere (a constant it captured; its input and parameters are
    /// recognised and copied).
    pub fn add_stage(
        &mut self,
        group: GroupId,
        f: impl Fn(VarBuilder, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    ) -> Result<StageId> {
        let mut shared = self.lock()?;
        let info =
            shared.groups.get_mut(group.0).ok_or_else(|| Error::InvalidArgument(format!("no group {}", group.0)))?;
        info.stages += 1;
        drop(shared);
        let stage = self.stages.len();
        let f: Arc<StageFn> = Arc::new(f);
        let op = StageOp { shared: self.shared.clone(), stage, group: group.0, f: f.clone() };
        self.stages.push(Stage { group: group.0, f, op: Arc::new(Box::new(op)) });
        Ok(StageId(stage))
    }

    /// Whether `group` recomputes its stages in backward (activation
    /// checkpointing; the default) or keeps their graphs from forward:
    /// faster by a forward per stage, at the memory of the group's candle
    /// parameters and intermediates from forward until backward (the bounds
    /// are in `docs/fsdp.md`). Set between steps.
    pub fn set_recompute(&self, group: GroupId, recompute: bool) -> Result<()> {
        let mut shared = self.lock()?;
        let info =
            shared.groups.get_mut(group.0).ok_or_else(|| Error::InvalidArgument(format!("no group {}", group.0)))?;
        if info.forward_runs != 0 || info.backward_pending != 0 {
            return Err(Error::InvalidArgument(format!("group {} is in a step; set recompute between steps", group.0)));
        }
        info.recompute = recompute;
        Ok(())
    }

    /// Sets every group's recompute choice from `recompute` by the groups'
    /// names; a name that is no group is an error (nothing is changed).
    pub fn apply_recompute(&self, recompute: &Recompute) -> Result<()> {
        let names = {
            let shared = self.lock()?;
            (0..shared.fsdp.num_groups())
                .map(|g| Ok(shared.fsdp.group_name(g)?.to_string()))
                .collect::<Result<Vec<_>>>()?
        };
        if let Recompute::Groups(listed) = recompute {
            if let Some(unknown) = listed.iter().find(|n| !names.contains(n)) {
                return Err(Error::InvalidArgument(format!(
                    "recompute names `{unknown}`, which is no group (the groups: {})",
                    names.join(", ")
                )));
            }
        }
        for (g, name) in names.iter().enumerate() {
            self.set_recompute(GroupId(g), recompute.applies_to(name))?;
        }
        Ok(())
    }

    /// Applies `stage` to `x`: the output carries candle's graph, so the
    /// loss's backward runs the stage's FSDP backward.
    pub fn run(&self, stage: StageId, x: &Tensor) -> Result<Tensor> {
        let s = self.stages.get(stage.0).ok_or_else(|| Error::InvalidArgument(format!("no stage {}", stage.0)))?;
        let x = x.to_device(&self.device)?.contiguous()?;
        {
            let mut shared = self.lock()?;
            let (storage, shape) = shared.forward_stage(stage.0, s.group, s.f.as_ref(), &x)?;
            shared.pending = Some(PendingOutput { stage: stage.0, storage, shape });
        }
        let out = x.apply_op2_arc(self.anchor.as_tensor(), s.op.clone());
        if out.is_err() {
            // An op that failed before taking its output leaves nothing behind.
            self.lock()?.pending = None;
        }
        self.unpark(out)
    }

    fn unpark<T>(&self, r: candle_core::Result<T>) -> Result<T> {
        r.map_err(|e| match self.shared.lock().ok().and_then(|mut s| s.parked.take()) {
            Some(f) => Error::Fsdp(f),
            None => Error::Candle(e),
        })
    }

    /// candle's backward from `loss`, which runs every stage's FSDP backward,
    /// then FSDP's end of backward (the compute stream waits for every
    /// reduction). The sharded gradients are then ready for clipping and the
    /// optimizer.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let result = self.unpark(loss.backward().map(|_| ()));
        let mut shared = self.lock()?;
        // Whatever candle's backward reached, nothing of this step's phases
        // may outlive it (a stage off the loss's path is never differentiated).
        let ended = shared.end_step();
        result?;
        ended?;
        shared.fsdp.finalize_backward()?;
        Ok(())
    }

    /// Ends a step that ran forward without backward (evaluation): the
    /// groups return to idle.
    pub fn finish_without_backward(&self) -> Result<()> {
        let mut shared = self.lock()?;
        shared.end_step()?;
        shared.fsdp.finalize_backward()?;
        Ok(())
    }

    /// Runs `f` on the [`Fsdp`] (switches, prefetch lists, statistics).
    pub fn with_fsdp<R>(&self, f: impl FnOnce(&mut Fsdp<C>) -> R) -> Result<R> {
        Ok(f(&mut self.lock()?.fsdp))
    }

    /// Clips the global gradient norm (see [`Fsdp::clip_grad_norm`]); returns the norm before clipping.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        Ok(self.lock()?.fsdp.clip_grad_norm(max_norm)?)
    }

    /// Clips the global gradient norm without waiting for it (see
    /// [`Fsdp::clip_grad_norm_async`]); the norm is read from the handle.
    pub fn clip_grad_norm_async(&self, max_norm: f64) -> Result<PendingValue> {
        Ok(self.lock()?.fsdp.clip_grad_norm_async(max_norm)?)
    }

    /// The mean over every rank of `local` (one value on candle's device:
    /// this rank's loss), without waiting for it. The value crosses to FSDP's
    /// compute stream in stream order (on CUDA one kernel on candle's stream;
    /// candle's CPU computes as it is called, so there its value is read at
    /// once), and its sum over the ranks and the copy to the host are
    /// enqueued ([`Fsdp::mean_over_ranks_async`]). A collective: every rank
    /// calls it, in the same order as the others.
    pub fn mean_over_ranks_async(&self, local: &Tensor) -> Result<PendingValue> {
        if local.elem_count() != 1 {
            return Err(Error::InvalidArgument(format!(
                "mean_over_ranks_async: one value, not a tensor of shape {:?}",
                local.dims()
            )));
        }
        let local = local.detach().to_dtype(candle_core::DType::F32)?.reshape(1)?;
        let shared = self.lock()?;
        let compute = shared.fsdp.compute_stream();
        let buf = if local.device().is_cpu() {
            compute.buffer_from(&to_f32_vec(&local)?).map_err(FsdpError::from)?
        } else {
            let buf = compute.alloc(chorus_devices::DType::F32, 1).map_err(FsdpError::from)?;
            compute.fill(buf.view(), chorus_devices::Scalar::Float(0.0)).map_err(FsdpError::from)?;
            shared.side.candle_waits_for(compute)?;
            shared.side.add_grads(compute, vec![(local, buf.view())])?;
            shared.side.compute_waits_for(compute, &[(buf.view(), AccessKind::Write)])?;
            buf
        };
        Ok(shared.fsdp.mean_over_ranks_async(buf.view())?)
    }

    /// One optimizer step on the shards, then drops the gradients.
    pub fn optimizer_step(&self, optimizer: &mut ShardedOptimizer<C>) -> Result<()> {
        let mut shared = self.lock()?;
        optimizer.step(&mut shared.fsdp)?;
        shared.fsdp.zero_grad();
        Ok(())
    }

    /// Every parameter's full values as f32 tensors, all-gathered from the
    /// shards; every rank must call it. Blocks.
    pub fn full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let shared = self.lock()?;
        let mut shapes = HashMap::new();
        for g in 0..shared.fsdp.num_groups() {
            shapes.extend(shared.fsdp.group_params(g)?);
        }
        shared
            .fsdp
            .full_parameters()?
            .into_iter()
            .map(|(name, values)| {
                let shape = shapes.get(&name).cloned().unwrap_or_else(|| vec![values.len()]);
                Ok((name, Tensor::from_vec(values, shape, &CandleDevice::Cpu)?))
            })
            .collect()
    }

    /// Host time the adapter spent besides FSDP's hooks.
    pub fn times(&self) -> Result<AdapterTimes> {
        Ok(self.lock()?.times)
    }
}

fn to_inits(params: Vec<(String, Tensor)>) -> Result<Vec<ParamInit>> {
    params
        .into_iter()
        .map(|(name, t)| Ok(ParamInit { shape: t.dims().to_vec(), values: to_f32_vec(&t)?, name }))
        .collect()
}

/// Every variable of a candle [`VarMap`](candle_nn::VarMap) with its name, sorted by name.
pub fn named_tensors(varmap: &candle_nn::VarMap) -> Result<Vec<(String, Tensor)>> {
    let data = varmap.data().lock().map_err(|_| Error::InvalidArgument("the VarMap's lock is poisoned".into()))?;
    let mut out: Vec<(String, Tensor)> = data.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Removes and returns the parameters whose names start with one of `prefixes`.
pub fn take_params(params: &mut Vec<(String, Tensor)>, prefixes: &[&str]) -> Vec<(String, Tensor)> {
    let (taken, kept): (Vec<_>, Vec<_>) =
        std::mem::take(params).into_iter().partition(|(n, _)| prefixes.iter().any(|p| n.starts_with(p)));
    *params = kept;
    taken
}
