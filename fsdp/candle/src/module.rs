//! [`FsdpModel`]: a candle model whose layers are grouped into FSDP param
//! groups, each piece of the model run as a candle custom op.
//!
//! A *stage* is a piece of the model that uses one group's parameters: a
//! function of a [`VarBuilder`] (holding the group's unsharded parameters
//! under their full names) and an input tensor. [`FsdpModel::run`] applies a
//! stage as a candle [`CustomOp2`] on the input and a one-element anchor
//! variable (so candle records the op even when the input, token ids, has no
//! graph). Its forward runs FSDP's pre-forward (all-gather) at the group's
//! first stage, reads the group's unsharded parameters into candle variables
//! once for the phase, runs the stage, and runs FSDP's post-forward
//! (reshard) once the group's last stage has run, dropping the candle copies
//! with the device's. Its backward runs FSDP's pre-backward (all-gather
//! again; the prefetch of the next group) and then, per group:
//! - with **recompute** (activation checkpointing, the default): the stage
//!   ran without a graph in forward; it is recomputed with the parameters
//!   (read once for the backward phase) and the input as candle variables;
//! - without: the stage ran with its graph in forward, and that graph (its
//!   intermediates and the parameters it used) was kept for backward.
//!
//! candle's backward of `sum(out · grad_out)` then gives the parameter
//! gradients, which are added straight from candle's storage into FSDP's
//! unsharded gradients; post-backward (reduce-scatter) runs once the group's
//! last stage has been differentiated, and the input's gradient goes back to
//! candle's backward. The design and its trade-offs are in `docs/fsdp.md`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp2, Device as CandleDevice, Layout, Shape, Tensor, Var};
use candle_nn::VarBuilder;
use chorus_collectives::CommBackend;
use chorus_devices::{Buffer, ComputeBackend, Stream};
use chorus_fsdp::{DeferredParam, Fsdp, FsdpError, ParamInit, Reshard, ShardedOptimizer, ShardedState};

use crate::convert::{
    add_into_host, candle_dtype, host_memory, start_readback, storage_of, tensor_from_storage, to_f32_vec,
    upload_tensor, var_from_host, var_from_readback,
};
use crate::{Error, Result};

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
}

/// Which groups recompute their stages in backward (activation
/// checkpointing) and which keep their forward graphs (FSDP2 recomputes
/// only the blocks the user wraps in checkpointing). Written `true`, `false`
/// or a comma-separated list of the groups that recompute (`blocks.0,blocks.1`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every group recomputes (the least memory).
    #[default]
    All,
    /// No group recomputes (the least compute).
    Nothing,
    /// The named groups recompute; the others keep their graphs.
    Groups(Vec<String>),
}

impl Recompute {
    /// Whether the group named `group` recomputes.
    pub fn applies_to(&self, group: &str) -> bool {
        match self {
            Recompute::All => true,
            Recompute::Nothing => false,
            Recompute::Groups(names) => names.iter().any(|n| n == group),
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "true" => Ok(Recompute::All),
            "false" => Ok(Recompute::Nothing),
            list => {
                let names: Vec<String> = list.split(',').map(|n| n.trim().to_string()).collect();
                if names.iter().any(|n| n.is_empty()) {
                    return Err(format!("`{list}`: expected true, false or a comma-separated list of group names"));
                }
                Ok(Recompute::Groups(names))
            }
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::All => f.write_str("true"),
            Recompute::Nothing => f.write_str("false"),
            Recompute::Groups(names) => f.write_str(&names.join(",")),
        }
    }
}

/// A group's unsharded parameters as candle variables, read once per phase
/// (forward, backward) and shared by the phase's stages.
struct PhaseParams {
    /// In the group's parameter order (FSDP's index `i`).
    vars: Arc<Vec<Var>>,
    /// The variables under their names: stages that build a graph.
    tracked: VarBuilder<'static>,
    /// The same storage without a graph: forward stages that will be recomputed.
    detached: VarBuilder<'static>,
}

impl PhaseParams {
    fn new(names: Vec<String>, vars: Vec<Var>, dtype: candle_core::DType, dev: &CandleDevice) -> Self {
        let tracked = names.iter().cloned().zip(vars.iter().map(|v| v.as_tensor().clone())).collect::<HashMap<_, _>>();
        let detached = names.into_iter().zip(vars.iter().map(|v| v.as_detached_tensor())).collect::<HashMap<_, _>>();
        PhaseParams {
            vars: Arc::new(vars),
            tracked: VarBuilder::from_tensors(tracked, dtype, dev),
            detached: VarBuilder::from_tensors(detached, dtype, dev),
        }
    }
}

/// What a stage of a group without recompute keeps from forward for its
/// backward: its output with candle's graph, the variable of its input (for
/// float inputs), and the parameters the graph refers to.
struct SavedGraph {
    out: Tensor,
    input: Option<Var>,
    vars: Arc<Vec<Var>>,
}

struct GroupInfo {
    stages: usize,
    forward_runs: usize,
    backward_pending: usize,
    recompute: bool,
    params: Option<PhaseParams>,
}

impl Default for GroupInfo {
    fn default() -> Self {
        GroupInfo { stages: 0, forward_runs: 0, backward_pending: 0, recompute: true, params: None }
    }
}

struct Shared<C: CommBackend> {
    fsdp: Fsdp<C>,
    /// Where the stages compute ([`crate::device`]).
    device: CandleDevice,
    groups: Vec<GroupInfo>,
    /// Per stage: the graph kept from forward (groups without recompute).
    saved: Vec<Option<SavedGraph>>,
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

    /// Group `g`'s unsharded parameters as candle variables, read from FSDP
    /// once per phase: one copy each where the device's memory is the
    /// host's (after synchronizing the compute stream, which orders every
    /// write to them), else a readback each.
    fn phase_params(&mut self, g: usize) -> Result<&PhaseParams> {
        if self.groups[g].params.is_none() {
            let t0 = Instant::now();
            let specs = self.fsdp.group_params(g)?;
            let dtype = self.param_dtype()?;
            let s = self.fsdp.compute_stream();
            let mut names = Vec::with_capacity(specs.len());
            let mut vars = Vec::with_capacity(specs.len());
            let views = || {
                let view = |(i, (_, shape)): (usize, &(String, Vec<usize>))| -> Result<_> {
                    Ok((self.fsdp.param(g, i)?, shape.clone()))
                };
                specs.iter().enumerate().map(view)
            };
            if let Some(on_device) = crate::device::vars_on_device(s, &self.device, views)? {
                vars = on_device;
                names = specs.into_iter().map(|(name, _)| name).collect();
            } else if specs.is_empty() || host_memory(self.fsdp.param(g, 0)?).is_some() {
                s.synchronize().map_err(FsdpError::from)?;
                for (i, (name, shape)) in specs.into_iter().enumerate() {
                    let src = host_memory(self.fsdp.param(g, i)?)
                        .ok_or_else(|| Error::InvalidArgument("a group's parameters on two kinds of device".into()))?;
                    // SAFETY: the compute stream, the only writer of the
                    // unsharded parameters, is synchronized, and nothing is
                    // enqueued until the copy is made.
                    vars.push(unsafe { var_from_host(&src, &shape) }?);
                    names.push(name);
                }
            } else {
                let mut pending = Vec::with_capacity(specs.len());
                for (i, (name, shape)) in specs.into_iter().enumerate() {
                    pending.push((name, shape, start_readback(s, self.fsdp.param(g, i)?)?));
                }
                for (name, shape, rb) in pending {
                    vars.push(var_from_readback(rb, &shape)?);
                    names.push(name);
                }
            }
            self.groups[g].params = Some(PhaseParams::new(names, vars, dtype, &self.device));
            self.times.transfer += t0.elapsed();
        }
        self.groups[g].params.as_ref().ok_or_else(|| Error::InvalidArgument(format!("group {g} has no parameters")))
    }

    fn param_dtype(&self) -> Result<candle_core::DType> {
        candle_dtype(self.fsdp.mixed_precision().param())
    }

    fn forward_stage(&mut self, stage: usize, g: usize, f: &StageFn, x: &Tensor) -> Result<Tensor> {
        let info = self.group_info(g)?;
        let (recompute, first) = (info.recompute, info.forward_runs == 0);
        if !recompute && self.saved.get(stage).is_some_and(|s| s.is_some()) {
            return Err(Error::InvalidArgument(format!(
                "stage {stage} ran forward again before its backward; a group that keeps its graph runs each stage once per backward"
            )));
        }
        if first {
            self.fsdp.pre_forward(g)?;
        }
        let dtype = self.param_dtype()?;
        let params = self.phase_params(g)?;
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
                // The op's input is already a variable (`tensor_from_storage`): no copy.
                let input = if x.dtype().is_float() { Some(Var::from_tensor(x)?) } else { None };
                let xin = match &input {
                    Some(v) => v.as_tensor().to_dtype(dtype)?,
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
        self.times.compute += t0.elapsed();
        self.times.stage_calls += 1;
        let info = &mut self.groups[g];
        info.forward_runs += 1;
        if info.forward_runs == info.stages {
            info.forward_runs = 0;
            info.backward_pending = info.stages;
            self.fsdp.post_forward(g)?;
            // The candle copies go with the device's; a group that stays
            // unsharded (the root) keeps them for its backward.
            if self.fsdp.sharded_state(g)? != ShardedState::Unsharded {
                self.groups[g].params = None;
            }
        }
        Ok(out)
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
        self.fsdp.pre_backward(g)?;
        let dtype = self.param_dtype()?;
        let (grads, vars, x_var) = if recompute {
            let params = self.phase_params(g)?;
            let (vb, vars) = (params.tracked.clone(), params.vars.clone());
            let t0 = Instant::now();
            let x_var = if input.dtype().is_float() { Some(Var::from_tensor(&input.detach())?) } else { None };
            let x = match &x_var {
                Some(v) => v.as_tensor().to_dtype(dtype)?,
                None => input.detach(),
            };
            let out = f(vb, &x)?;
            // d(sum(out · grad_out))/dθ is exactly the vector-Jacobian product candle's backward wants.
            let grads = (out * grad_out.detach())?.sum_all()?.backward()?;
            self.times.compute += t0.elapsed();
            self.times.recomputed += 1;
            (grads, vars, x_var)
        } else {
            let saved =
                self.saved.get_mut(stage).and_then(Option::take).ok_or_else(|| {
                    Error::InvalidArgument(format!("stage {stage} has no graph kept from its forward"))
                })?;
            let t0 = Instant::now();
            let grads = (saved.out * grad_out.detach())?.sum_all()?.backward()?;
            self.times.compute += t0.elapsed();
            (grads, saved.vars, saved.input)
        };
        self.times.stage_calls += 1;
        let t1 = Instant::now();
        let s = self.fsdp.compute_stream();
        // Host memory is written directly: the compute stream (zeroed
        // gradients, earlier accumulations) must have run first.
        let mut synchronized = false;
        let on_device = crate::device::grads_on_device(s, &self.device, || {
            let present = vars.iter().enumerate().filter_map(|(i, v)| Some((i, grads.get(v.as_tensor())?)));
            present.map(|(i, grad)| Ok((grad.to_dtype(dtype)?, self.fsdp.grad(g, i)?))).collect()
        })?;
        // Gradients on candle's CUDA device went device to device; the others go here.
        let host_side: &[Var] = if on_device { &[] } else { &vars };
        for (i, var) in host_side.iter().enumerate() {
            let Some(grad) = grads.get(var.as_tensor()) else { continue };
            let grad = grad.to_dtype(dtype)?;
            let dst = self.fsdp.grad(g, i)?;
            match host_memory(dst) {
                Some(dst) => {
                    if !synchronized {
                        s.synchronize().map_err(FsdpError::from)?;
                        synchronized = true;
                    }
                    // SAFETY: the compute stream, the only user of the
                    // unsharded gradients until post-backward, is
                    // synchronized and nothing is enqueued during the add.
                    unsafe { add_into_host(&grad, &dst) }?;
                }
                None => {
                    let staged = s.alloc(dst.dtype(), dst.len()).map_err(FsdpError::from)?;
                    upload_tensor(s, &grad, staged.view())?;
                    s.accumulate(staged.view(), dst).map_err(FsdpError::from)?;
                }
            }
        }
        self.times.transfer += t1.elapsed();
        let info = &mut self.groups[g];
        info.backward_pending = info.backward_pending.saturating_sub(1);
        if info.backward_pending == 0 {
            info.params = None;
            self.fsdp.post_backward(g)?;
        }
        Ok(match &x_var {
            Some(v) => Some(match grads.get(v.as_tensor()) {
                Some(gx) => gx.clone(),
                None => v.as_tensor().zeros_like()?,
            }),
            None => None,
        })
    }

    /// Forgets every phase's parameters and kept graph: the step is over.
    fn end_step(&mut self) {
        self.groups.iter_mut().for_each(|g| {
            g.forward_runs = 0;
            g.backward_pending = 0;
            g.params = None;
        });
        self.saved.iter_mut().for_each(|s| *s = None);
    }
}

/// One stage as a candle custom op (see the module docs).
struct StageOp<C: CommBackend> {
    shared: Arc<Mutex<Shared<C>>>,
    stage: usize,
    group: usize,
    f: Arc<StageFn>,
}

fn lock<C: CommBackend>(shared: &Mutex<Shared<C>>) -> candle_core::Result<MutexGuard<'_, Shared<C>>> {
    shared.lock().map_err(|_| candle_core::Error::msg("the FSDP model's state is poisoned by an earlier panic"))
}

/// Turns an adapter error into candle's, parking an FSDP error so that
/// [`FsdpModel`] can return it typed.
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
    Fsdp<C>: Send,
{
    /// The stage's forward on what `input` makes of the op's input (a
    /// variable when the stage keeps its graph: it differentiates by its
    /// input, and no second copy is made).
    fn forward(&self, input: impl FnOnce(bool) -> candle_core::Result<Tensor>) -> candle_core::Result<Tensor> {
        let mut shared = lock(&self.shared)?;
        let keeps_graph = shared.groups.get(self.group).is_some_and(|g| !g.recompute);
        let x = input(keeps_graph)?;
        shared.forward_stage(self.stage, self.group, self.f.as_ref(), &x).map_err(|e| park(&mut shared, e))
    }
}

impl<C: CommBackend + 'static> CustomOp2 for StageOp<C>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    fn name(&self) -> &'static str {
        "chorus-fsdp-stage"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = self.forward(|keeps_graph| tensor_from_storage(s1, l1, keeps_graph))?;
        Ok((storage_of(&out)?, out.shape().clone()))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = self.forward(|keeps_graph| crate::cuda::tensor_from_storage(s1, l1, keeps_graph))?;
        Ok((crate::cuda::storage_of(&out)?, out.shape().clone()))
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
    stages: Vec<(usize, Arc<Box<dyn CustomOp2 + Send + Sync>>)>,
}

impl<C: CommBackend + 'static> FsdpModel<C>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    /// Wraps `fsdp` (with no groups yet, or groups the model adds stages to).
    /// The stages compute on [`FsdpModel::device`].
    pub fn new(fsdp: Fsdp<C>) -> Result<Self> {
        let groups = (0..fsdp.num_groups()).map(|_| GroupInfo::default()).collect();
        let device = crate::device::candle_device::<C::B>(fsdp.device())?;
        let anchor = Var::zeros(1, candle_core::DType::F32, &device)?;
        Ok(FsdpModel {
            shared: Arc::new(Mutex::new(Shared {
                fsdp,
                device: device.clone(),
                groups,
                saved: Vec::new(),
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
    /// targets belong there.
    pub fn device(&self) -> &CandleDevice {
        &self.device
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
        let op = StageOp { shared: self.shared.clone(), stage, group: group.0, f: Arc::new(f) };
        self.stages.push((group.0, Arc::new(Box::new(op))));
        Ok(StageId(self.stages.len() - 1))
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
        let (_, op) =
            self.stages.get(stage.0).ok_or_else(|| Error::InvalidArgument(format!("no stage {}", stage.0)))?;
        let x = x.to_device(&self.device)?.contiguous()?;
        let out = x.apply_op2_arc(self.anchor.as_tensor(), op.clone());
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
        shared.end_step();
        result?;
        shared.fsdp.finalize_backward()?;
        Ok(())
    }

    /// Ends a step that ran forward without backward (evaluation): the
    /// groups return to idle.
    pub fn finish_without_backward(&self) -> Result<()> {
        let mut shared = self.lock()?;
        shared.end_step();
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
