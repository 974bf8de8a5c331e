//! [`FsdpModel`]: a candle model whose layers are grouped into FSDP param
//! groups, each piece of the model run as a candle custom op.
//!
//! A *stage* is a piece of the model that uses one group's parameters: a
//! function of a [`VarBuilder`] (holding the group's unsharded parameters
//! under their full names) and an input tensor. [`FsdpModel::run`] applies a
//! stage as a candle [`CustomOp2`] on the input and a one-element anchor
//! variable (so candle records the op even when the input, token ids, has no
//! graph). Its forward runs FSDP's pre-forward (all-gather), copies the
//! unsharded parameters into candle tensors, runs the stage without a graph,
//! and runs FSDP's post-forward (reshard) once the group's last stage has
//! run. Its backward runs FSDP's pre-backward (all-gather again; the
//! prefetch of the next group), recomputes the stage with the parameters and
//! the input as candle variables (activation checkpointing), runs candle's
//! backward on it with the incoming gradient, adds the parameter gradients
//! into FSDP's unsharded gradients, runs post-backward (reduce-scatter) once
//! the group's last stage has been differentiated, and returns the input's
//! gradient to candle's backward. The design and its trade-offs are in
//! `docs/fsdp.md`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp2, Device as CandleDevice, Layout, Shape, Tensor, Var};
use candle_nn::VarBuilder;
use chorus_collectives::CommBackend;
use chorus_devices::{Buffer, ComputeBackend, Stream};
use chorus_fsdp::{DeferredParam, Fsdp, FsdpError, ParamInit, Reshard, ShardedOptimizer};

use crate::convert::{candle_dtype, start_readback, storage_of, tensor_from_readback, tensor_from_storage, to_f32_vec};
use crate::{Error, Result};

/// What a stage computes: builds its layers from the [`VarBuilder`] (the
/// group's unsharded parameters under their full names, in the param dtype)
/// and applies them to the input. It runs twice per step (forward, and the
/// recomputation in backward), so it must be a pure function of its inputs.
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
    /// Running stages (forward and recomputation with backward), in candle.
    pub compute: Duration,
    /// Stage applications (forward) and differentiations (backward).
    pub stage_calls: usize,
}

#[derive(Default)]
struct GroupInfo {
    stages: usize,
    forward_runs: usize,
    backward_pending: usize,
}

struct Shared<C: CommBackend> {
    fsdp: Fsdp<C>,
    groups: Vec<GroupInfo>,
    /// The FSDP error behind the last failed op: candle's error type cannot
    /// carry it, so [`FsdpModel`] takes it back from here.
    parked: Option<FsdpError>,
    times: AdapterTimes,
}

impl<C: CommBackend> Shared<C>
where
    C::B: ComputeBackend,
{
    /// Group `g`'s unsharded parameters as candle tensors (names, tensors).
    fn read_params(&mut self, g: usize) -> Result<Vec<(String, Tensor)>> {
        let t0 = Instant::now();
        let specs = self.fsdp.group_params(g)?;
        let s = self.fsdp.compute_stream();
        let mut pending = Vec::with_capacity(specs.len());
        for (i, (name, shape)) in specs.into_iter().enumerate() {
            pending.push((name, shape, start_readback(s, self.fsdp.param(g, i)?)?));
        }
        let out = pending
            .into_iter()
            .map(|(name, shape, rb)| Ok((name, tensor_from_readback(rb, &shape)?)))
            .collect::<Result<Vec<_>>>();
        self.times.transfer += t0.elapsed();
        out
    }

    fn param_dtype(&self) -> Result<candle_core::DType> {
        candle_dtype(self.fsdp.mixed_precision().param())
    }

    fn forward_stage(&mut self, g: usize, f: &StageFn, x: &Tensor) -> Result<Tensor> {
        let info = self.groups.get(g).ok_or_else(|| Error::InvalidArgument(format!("no group {g}")))?;
        if info.forward_runs == 0 {
            self.fsdp.pre_forward(g)?;
        }
        let params = self.read_params(g)?;
        let dtype = self.param_dtype()?;
        let t0 = Instant::now();
        let vb = VarBuilder::from_tensors(params.into_iter().collect::<HashMap<_, _>>(), dtype, &CandleDevice::Cpu);
        let x = if x.dtype().is_float() { x.to_dtype(dtype)? } else { x.clone() };
        let out = f(vb, &x)?;
        self.times.compute += t0.elapsed();
        self.times.stage_calls += 1;
        let info = &mut self.groups[g];
        info.forward_runs += 1;
        if info.forward_runs == info.stages {
            info.forward_runs = 0;
            info.backward_pending = info.stages;
            self.fsdp.post_forward(g)?;
        }
        Ok(out)
    }

    fn backward_stage(&mut self, g: usize, f: &StageFn, input: &Tensor, grad_out: &Tensor) -> Result<Option<Tensor>> {
        if g >= self.groups.len() {
            return Err(Error::InvalidArgument(format!("no group {g}")));
        }
        self.fsdp.pre_backward(g)?;
        let params = self.read_params(g)?;
        let dtype = self.param_dtype()?;
        let t0 = Instant::now();
        let vars = params
            .into_iter()
            .map(|(name, t)| Ok((name, Var::from_tensor(&t)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let vb = VarBuilder::from_tensors(
            vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect(),
            dtype,
            &CandleDevice::Cpu,
        );
        let x_var = if input.dtype().is_float() { Some(Var::from_tensor(&input.detach())?) } else { None };
        let x = match &x_var {
            Some(v) => v.as_tensor().to_dtype(dtype)?,
            None => input.detach(),
        };
        let out = f(vb, &x)?;
        // d(sum(out · grad_out))/dθ is exactly the vector-Jacobian product candle's backward wants.
        let grads = (out * grad_out.detach())?.sum_all()?.backward()?;
        self.times.compute += t0.elapsed();
        self.times.stage_calls += 1;
        let t1 = Instant::now();
        let s = self.fsdp.compute_stream();
        for (i, (_, var)) in vars.iter().enumerate() {
            if let Some(grad) = grads.get(var.as_tensor()) {
                let dst = self.fsdp.grad(g, i)?;
                let staged = s.alloc(dst.dtype(), dst.len()).map_err(FsdpError::from)?;
                crate::convert::upload_tensor(s, &grad.to_dtype(dtype)?, staged.view())?;
                s.accumulate(staged.view(), dst).map_err(FsdpError::from)?;
            }
        }
        self.times.transfer += t1.elapsed();
        let info = &mut self.groups[g];
        info.backward_pending = info.backward_pending.saturating_sub(1);
        if info.backward_pending == 0 {
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
}

/// One stage as a candle custom op (see the module docs).
struct StageOp<C: CommBackend> {
    shared: Arc<Mutex<Shared<C>>>,
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
        let x = tensor_from_storage(s1, l1)?;
        let mut shared = lock(&self.shared)?;
        let out = shared.forward_stage(self.group, self.f.as_ref(), &x).map_err(|e| park(&mut shared, e))?;
        Ok((storage_of(&out)?, out.shape().clone()))
    }

    fn bwd(
        &self,
        arg1: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut shared = lock(&self.shared)?;
        let gx =
            shared.backward_stage(self.group, self.f.as_ref(), arg1, grad_res).map_err(|e| park(&mut shared, e))?;
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
    stages: Vec<(usize, Arc<Box<dyn CustomOp2 + Send + Sync>>)>,
}

impl<C: CommBackend + 'static> FsdpModel<C>
where
    C::B: ComputeBackend,
    Fsdp<C>: Send,
{
    /// Wraps `fsdp` (with no groups yet, or groups the model adds stages to).
    pub fn new(fsdp: Fsdp<C>) -> Result<Self> {
        let groups = (0..fsdp.num_groups()).map(|_| GroupInfo::default()).collect();
        let anchor = Var::zeros(1, candle_core::DType::F32, &CandleDevice::Cpu)?;
        Ok(FsdpModel {
            shared: Arc::new(Mutex::new(Shared { fsdp, groups, parked: None, times: AdapterTimes::default() })),
            anchor,
            stages: Vec::new(),
        })
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
        let op = StageOp { shared: self.shared.clone(), group: group.0, f: Arc::new(f) };
        self.stages.push((group.0, Arc::new(Box::new(op))));
        Ok(StageId(self.stages.len() - 1))
    }

    /// Applies `stage` to `x`: the output carries candle's graph, so the
    /// loss's backward runs the stage's FSDP backward.
    pub fn run(&self, stage: StageId, x: &Tensor) -> Result<Tensor> {
        let (_, op) =
            self.stages.get(stage.0).ok_or_else(|| Error::InvalidArgument(format!("no stage {}", stage.0)))?;
        let x = x.contiguous()?;
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
        self.unpark(loss.backward().map(|_| ()))?;
        self.lock()?.fsdp.finalize_backward()?;
        Ok(())
    }

    /// Ends a step that ran forward without backward (evaluation): the
    /// groups return to idle.
    pub fn finish_without_backward(&self) -> Result<()> {
        let mut shared = self.lock()?;
        shared.groups.iter_mut().for_each(|g| {
            g.forward_runs = 0;
            g.backward_pending = 0
        });
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
