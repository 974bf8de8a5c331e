//! The root (FSDP2's `_fsdp_state`): [`Fsdp`], which owns the param groups
//! and their shared communication context, checks that each hook is allowed
//! in the group's state, and orders the groups — the root's first
//! pre-forward, implicit and explicit prefetch, the post-forward order that
//! backward prefetch follows, and the end of backward.

use std::collections::HashMap;
use std::sync::Arc;

use chorus_collectives::{CommBackend, Communicator, ReduceOp};
use chorus_devices::{Backend, Buffer, DType, Device, Priority, Stream, StreamExt, View};

use crate::collectives::{self, ReducePlan};
use crate::comm_context::{CommContext, CommCounts, Streams};
use crate::config::{DataParallel, FsdpConfig, MixedPrecision, OffloadPolicy, Reshard};
use crate::events::EventPool;
use crate::layout::{normalize_dim, GroupLayout};
use crate::overhead::{Hook, HookStart, HostOverhead};
use crate::param::{DeferredParam, Param, ParamInit};
use crate::param_group::{Group, Route};
use crate::pending::{Finish, PendingValue};
use crate::storage::GroupStorage;
use crate::training_state::{ShardedState, TrainingState};
use crate::{FsdpError, Result, Strm, B};

/// FSDP for one rank: the root state, its groups, streams and policies.
///
/// A model calls, per group and step: [`Fsdp::pre_forward`] /
/// [`Fsdp::post_forward`] around the group's forward (or [`Fsdp::forward`]
/// with a closure), [`Fsdp::pre_backward`] / [`Fsdp::post_backward`] around
/// its backward (or [`Fsdp::backward`]), and once per step
/// [`Fsdp::finalize_backward`]. Model compute goes on
/// [`Fsdp::compute_stream`]; unsharded parameters and gradients are reached
/// with [`Fsdp::param`] and [`Fsdp::grad`] while the group is unsharded.
pub struct Fsdp<C: CommBackend> {
    pub(crate) ctx: CommContext<C>,
    pub(crate) groups: Vec<Group<C>>,
    pub(crate) config: FsdpConfig,
    /// Communicators of the post-forward worlds, one per size K.
    post_forward_comms: HashMap<usize, Arc<Communicator<C>>>,
    /// Groups in the order their forward ended this step.
    post_forward_order: Vec<usize>,
    /// The root's first pre-forward of the step has run.
    pub(crate) root_ready: bool,
    overhead: HostOverhead,
    /// The offload policy of groups added from now on.
    offload: Option<OffloadPolicy>,
}

/// Handle of an asynchronous unshard; see [`Fsdp::unshard`].
#[derive(Debug)]
#[must_use = "wait on the handle (Fsdp::wait_unshard) before using the parameters"]
pub struct UnshardHandle {
    group: usize,
}

impl<C: CommBackend> Fsdp<C> {
    /// FSDP over `dp` with `config`; creates the compute stream and the four
    /// communication streams on the communicator's device (copy-in,
    /// all-gather and reduce-scatter at high priority, as FSDP2 does).
    pub fn new(dp: DataParallel<C>, config: FsdpConfig) -> Result<Self> {
        let device = dp.shard.device().clone();
        config.mixed_precision.validate()?;
        let streams = Streams {
            compute: device.create_stream(Priority::Normal)?,
            copy_in: device.create_stream(Priority::High)?,
            all_gather: device.create_stream(Priority::High)?,
            reduce_scatter: device.create_stream(Priority::High)?,
            all_reduce: device.create_stream(Priority::Normal)?,
        };
        Ok(Fsdp {
            ctx: CommContext {
                dp,
                device,
                streams,
                events: EventPool::default(),
                all_gather_state: None,
                reduce_scatter_state: None,
                counts: CommCounts::default(),
            },
            groups: Vec::new(),
            offload: config.offload,
            config,
            post_forward_comms: HashMap::new(),
            post_forward_order: Vec::new(),
            root_ready: false,
            overhead: HostOverhead::default(),
        })
    }

    /// Adds a param group (FSDP2's `fully_shard` on one module). Every rank
    /// must add the same groups in the same order. `is_root` groups do not
    /// reshard after forward (FSDP2's root default). Returns the group's index.
    pub fn add_group(&mut self, name: &str, params: Vec<ParamInit>, is_root: bool) -> Result<usize> {
        let reshard = if is_root { Reshard::No } else { self.config.reshard_after_forward };
        self.add_group_with(name, params, reshard)
    }

    /// Like [`Fsdp::add_group`] with this group's own reshard-after-forward.
    pub fn add_group_with(&mut self, name: &str, params: Vec<ParamInit>, reshard: Reshard) -> Result<usize> {
        for p in &params {
            let numel: usize = p.shape.iter().product();
            if p.values.len() != numel {
                return Err(FsdpError::InvalidArgument(format!(
                    "{}: {} values for shape {:?}",
                    p.name,
                    p.values.len(),
                    p.shape
                )));
            }
        }
        self.add_group_deferred_with(name, params.into_iter().map(DeferredParam::from).collect(), reshard)
    }

    /// Like [`Fsdp::add_group`], with each parameter given by its shape and
    /// a source of its values: this rank reads only the rows of its own
    /// shards (deferred initialisation; no rank holds the whole group).
    pub fn add_group_deferred(&mut self, name: &str, params: Vec<DeferredParam>, is_root: bool) -> Result<usize> {
        let reshard = if is_root { Reshard::No } else { self.config.reshard_after_forward };
        self.add_group_deferred_with(name, params, reshard)
    }

    /// Like [`Fsdp::add_group_deferred`] with this group's own reshard-after-forward.
    pub fn add_group_deferred_with(
        &mut self,
        name: &str,
        params: Vec<DeferredParam>,
        reshard: Reshard,
    ) -> Result<usize> {
        let t0 = HookStart::now();
        let world = self.ctx.dp.shard.size();
        let rank = self.ctx.dp.shard.rank();
        let mut sharded_specs = Vec::new();
        let mut is_sharded = Vec::new();
        for p in &params {
            let numel: usize = p.shape.iter().product();
            let shard = numel >= self.config.replicate_below && !p.shape.is_empty();
            is_sharded.push(shard);
            if shard {
                let dim = match &self.config.shard_placement {
                    Some(f) => f(&p.name, &p.shape),
                    None => 0,
                };
                sharded_specs.push((p.shape.clone(), normalize_dim(dim, p.shape.len())?));
            }
        }
        let layout = GroupLayout::new(&sharded_specs, world)?;
        let post_forward = match reshard {
            Reshard::To(k) if k == world => None,
            Reshard::To(k) => Some((self.post_forward_comm(k)?, GroupLayout::new(&sharded_specs, k)?)),
            _ => None,
        };
        let reshard = match reshard {
            Reshard::To(k) if k == world => Reshard::Yes,
            r => r,
        };
        // Where each parameter lies in the group's flat buffers: sharded
        // ones at their layout offsets, replicated ones after them whole;
        // unsharded, every parameter whole in order.
        let mut out = Vec::with_capacity(params.len());
        let (mut next, mut replicated_at, mut full) = (0, layout.shard_numel, 0);
        for (p, shard) in params.iter().zip(&is_sharded) {
            let numel: usize = p.shape.iter().product();
            let (index, range) = if *shard {
                let l = &layout.params[next];
                next += 1;
                (Some(next - 1), l.offset..l.offset + l.shard_numel)
            } else {
                replicated_at += numel;
                (None, replicated_at - numel..replicated_at)
            };
            out.push(Param::new(p, index, range, full));
            full += numel;
        }
        let stream = &self.ctx.streams.compute;
        let storage = GroupStorage::<C>::new(stream, replicated_at, layout.shard_numel, full, self.offload)?;
        for (p, init) in out.iter().zip(&params) {
            let values = Param::initial_shard(init, p.layout.map(|i| &layout.params[i]), rank)?;
            stream.upload(&values, storage.master.slice(p.shard.start, p.shard.len())?)?;
            // The upload stages its values until the stream runs it: waiting
            // here keeps one parameter's slice staged at a time, so a rank's
            // peak while loading is its shards plus one slice, not twice its shards.
            stream.synchronize()?;
        }
        let mp = self.config.mixed_precision;
        self.groups.push(Group::new(name, (out, storage), layout, post_forward, reshard, mp));
        self.note_overhead(Hook::AddGroup, t0);
        Ok(self.groups.len() - 1)
    }

    /// The CPU offload policy of the groups added after this call (FSDP2
    /// gives each `fully_shard` call its own); [`FsdpConfig::offload`] until
    /// then. Every rank must set the same.
    pub fn set_offload(&mut self, policy: Option<OffloadPolicy>) {
        self.offload = policy;
    }

    /// Whether parameters of group `g` live in host memory (CPU offload).
    pub fn is_offloaded(&self, g: usize) -> Result<bool> {
        Ok(self.group(g)?.storage.offload.is_some())
    }

    /// The communicator of this rank's `k` consecutive shard ranks, split
    /// once per `k` and shared by every group resharding to `k`.
    fn post_forward_comm(&mut self, k: usize) -> Result<Arc<Communicator<C>>> {
        let (world, rank) = (self.ctx.dp.shard.size(), self.ctx.dp.shard.rank());
        if k == 0 || world % k != 0 {
            return Err(FsdpError::InvalidArgument(format!(
                "reshard-after-forward to {k} ranks must divide the shard world of {world}"
            )));
        }
        if let Some(c) = self.post_forward_comms.get(&k) {
            return Ok(c.clone());
        }
        let split = self.ctx.dp.shard.split(Some((rank / k) as u32), (rank % k) as i64)?;
        let missing = || FsdpError::InvalidArgument("split for the post-forward world returned nothing".into());
        let c = Arc::new(split.ok_or_else(missing)?);
        self.post_forward_comms.insert(k, c.clone());
        Ok(c)
    }

    fn note_overhead(&mut self, hook: Hook, t0: HookStart) {
        self.overhead.note(hook, t0)
    }

    pub(crate) fn group(&self, g: usize) -> Result<&Group<C>> {
        self.groups.get(g).ok_or_else(|| FsdpError::InvalidArgument(format!("no group {g}")))
    }

    fn group_mut(&mut self, g: usize) -> Result<&mut Group<C>> {
        self.groups.get_mut(g).ok_or_else(|| FsdpError::InvalidArgument(format!("no group {g}")))
    }

    /// Group `g`, which `event` (a hook) requires to be in `state`.
    fn group_in(&self, g: usize, state: TrainingState, event: &'static str) -> Result<&Group<C>> {
        let grp = self.group(g)?;
        if grp.training != state {
            return Err(grp.state_error(event));
        }
        Ok(grp)
    }

    /// The stream the model computes on.
    pub fn compute_stream(&self) -> &Strm<C> {
        &self.ctx.streams.compute
    }
    /// The device.
    pub fn device(&self) -> &<B<C> as Backend>::Device {
        &self.ctx.device
    }
    /// The data-parallel layout.
    pub fn data_parallel(&self) -> &DataParallel<C> {
        &self.ctx.dp
    }
    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    /// A group's name.
    pub fn group_name(&self, g: usize) -> Result<&str> {
        Ok(&self.group(g)?.name)
    }
    /// Names and shapes of a group's parameters.
    pub fn group_params(&self, g: usize) -> Result<Vec<(String, Vec<usize>)>> {
        Ok(self.group(g)?.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect())
    }
    /// The group's training state.
    pub fn training_state(&self, g: usize) -> Result<TrainingState> {
        Ok(self.group(g)?.training)
    }
    /// The group's sharded state.
    pub fn sharded_state(&self, g: usize) -> Result<ShardedState> {
        Ok(self.group(g)?.sharded)
    }
    /// The group's mixed-precision policy.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.config.mixed_precision
    }
    /// Collectives issued so far.
    pub fn comm_counts(&self) -> CommCounts {
        self.ctx.counts
    }
    /// Host time spent in hooks so far.
    pub fn host_overhead(&self) -> HostOverhead {
        self.overhead
    }
    /// Whether parameter `i` of group `g` is replicated (below the threshold).
    pub fn is_replicated(&self, g: usize, i: usize) -> Result<bool> {
        Ok(self.param_ref(g, i)?.layout.is_none())
    }

    fn param_ref(&self, g: usize, i: usize) -> Result<&Param> {
        let grp = self.group(g)?;
        grp.params
            .get(i)
            .ok_or_else(|| FsdpError::InvalidArgument(format!("group `{}` has no parameter {i}", grp.name)))
    }

    /// The unsharded parameter `i` of group `g` (param dtype); an error unless
    /// the group is unsharded.
    pub fn param(&self, g: usize, i: usize) -> Result<View<'_, B<C>>> {
        let p = self.param_ref(g, i)?;
        let grp = &self.groups[g];
        let full = grp.storage.unsharded.as_ref().ok_or_else(|| grp.state_error("parameter access"))?;
        Ok(full.slice(p.full, p.numel)?)
    }

    /// The unsharded gradient of parameter `i` of group `g` (param dtype),
    /// which the model's backward accumulates into; exists from pre-backward
    /// to post-backward.
    pub fn grad(&self, g: usize, i: usize) -> Result<View<'_, B<C>>> {
        let p = self.param_ref(g, i)?;
        let grp = &self.groups[g];
        let full = grp.storage.unsharded_grad.as_ref().ok_or_else(|| grp.state_error("gradient access"))?;
        Ok(full.slice(p.full, p.numel)?)
    }

    // ---- switches (FSDPModule's setters) ----

    /// Whether backward reduces gradients (false: accumulate unsharded gradients locally).
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.groups.iter_mut().for_each(|g| g.requires_gradient_sync = sync);
    }
    /// HSDP: whether backward all-reduces over the replicate group (false: keep partial sums).
    pub fn set_requires_all_reduce(&mut self, all_reduce: bool) {
        self.groups.iter_mut().for_each(|g| g.requires_all_reduce = all_reduce);
    }
    /// Whether groups reshard after backward.
    pub fn set_reshard_after_backward(&mut self, reshard: bool) {
        self.groups.iter_mut().for_each(|g| g.reshard_after_backward = reshard);
    }
    /// Groups to unshard (prefetch) when group `g`'s forward starts.
    pub fn set_forward_prefetch(&mut self, g: usize, targets: Vec<usize>) -> Result<()> {
        self.check_targets(&targets)?;
        self.check_not_routed(g)?;
        self.group_mut(g)?.forward_prefetch = targets;
        Ok(())
    }
    /// Groups to unshard when group `g`'s backward starts (replaces the default
    /// reverse-post-forward prefetch).
    pub fn set_backward_prefetch(&mut self, g: usize, targets: Vec<usize>) -> Result<()> {
        self.check_targets(&targets)?;
        self.check_not_routed(g)?;
        self.group_mut(g)?.backward_prefetch = Some(targets);
        Ok(())
    }
    /// A routed group's hooks run on some ranks only, so a prefetch from them would too.
    fn check_not_routed(&self, g: usize) -> Result<()> {
        match self.group(g)?.route {
            Route::Routed(_) => Err(FsdpError::InvalidArgument(format!(
                "routed group `{}` cannot have prefetch targets",
                self.groups[g].name
            ))),
            _ => Ok(()),
        }
    }
    fn check_targets(&self, targets: &[usize]) -> Result<()> {
        match targets.iter().find(|t| **t >= self.groups.len()) {
            Some(t) => Err(FsdpError::InvalidArgument(format!("no group {t} to prefetch"))),
            None => Ok(()),
        }
    }

    // ---- explicit unshard ----

    /// All-gathers group `g`'s parameters. With `async_op` the returned
    /// handle must be waited on ([`Fsdp::wait_unshard`]); otherwise this
    /// waits (copy-out enqueued) before returning.
    pub fn unshard(&mut self, g: usize, async_op: bool) -> Result<UnshardHandle> {
        let t0 = HookStart::now();
        self.group(g)?;
        if !self.root_ready {
            // Outside a step (FSDP2's explicit `unshard()`), order after the compute stream.
            self.ctx.all_gather_streams_follow_compute()?;
        }
        self.groups[g].unshard(&mut self.ctx)?;
        if !async_op {
            self.groups[g].wait_for_unshard(&mut self.ctx)?;
        }
        self.note_overhead(Hook::Unshard, t0);
        Ok(UnshardHandle { group: g })
    }

    /// Finishes an asynchronous unshard: the copy-out into the unsharded
    /// parameters is enqueued on the compute stream.
    pub fn wait_unshard(&mut self, handle: UnshardHandle) -> Result<()> {
        let t0 = HookStart::now();
        self.group(handle.group)?;
        self.groups[handle.group].wait_for_unshard(&mut self.ctx)?;
        self.note_overhead(Hook::WaitUnshard, t0);
        Ok(())
    }

    // ---- hooks ----

    fn root_pre_forward(&mut self) -> Result<()> {
        if self.root_ready {
            return Ok(());
        }
        self.ctx.all_gather_streams_follow_compute()?;
        self.post_forward_order.clear();
        self.root_ready = true;
        Ok(())
    }

    /// Before group `g`'s forward: unshards it (waits for a prefetch if one
    /// was issued) and prefetches the explicit forward targets.
    pub fn pre_forward(&mut self, g: usize) -> Result<()> {
        let t0 = HookStart::now();
        self.group_in(g, TrainingState::Idle, "pre_forward")?;
        self.check_routed(g, TrainingState::Forward, "pre_forward")?;
        self.root_pre_forward()?;
        self.groups[g].pre_forward(&mut self.ctx)?;
        self.groups[g].used = true;
        self.unshard_routed(g)?;
        for t in self.groups[g].forward_prefetch.clone() {
            self.groups[t].unshard(&mut self.ctx)?;
        }
        self.note_overhead(Hook::PreForward, t0);
        Ok(())
    }

    /// After group `g`'s forward: reshards per its policy and records the
    /// post-forward order used for backward prefetch.
    pub fn post_forward(&mut self, g: usize) -> Result<()> {
        let t0 = HookStart::now();
        self.group_in(g, TrainingState::Forward, "post_forward")?;
        self.finish_routed_forward(g)?;
        if let Route::Routed(_) = self.groups[g].route {
            // Not in the post-forward order: backward prefetch follows it on every rank.
            self.groups[g].post_forward(&self.ctx, None)?;
        } else {
            let index = self.post_forward_order.len();
            self.groups[g].post_forward(&self.ctx, Some(index))?;
            self.post_forward_order.push(g);
        }
        self.note_overhead(Hook::PostForward, t0);
        Ok(())
    }

    /// Before group `g`'s backward: unshards it, makes zeroed unsharded
    /// gradients if there are none, and prefetches the next group of backward
    /// (the previous one in post-forward order, or the explicit targets).
    pub fn pre_backward(&mut self, g: usize) -> Result<()> {
        self.pre_backward_with(g, true)
    }

    /// [`Fsdp::pre_backward`] without the zeroed unsharded gradients, which
    /// [`Fsdp::ensure_grads`] makes when the model has gradients to add. A
    /// model that computes its gradients in memory of its own (the candle
    /// adapter on the CPU) then holds FSDP's gradients only from the moment
    /// it adds into them, not through its whole backward, as autograd makes
    /// a parameter's `.grad` in FSDP2. A second pre-backward of the group
    /// keeps the gradients it has.
    pub fn pre_backward_without_grads(&mut self, g: usize) -> Result<()> {
        self.pre_backward_with(g, false)
    }

    /// Gives group `g` zeroed unsharded gradients unless it has them; the
    /// group is in its backward (after [`Fsdp::pre_backward_without_grads`]).
    pub fn ensure_grads(&mut self, g: usize) -> Result<()> {
        self.group_in(g, TrainingState::PreBackward, "ensure_grads")?;
        self.groups[g].ensure_grads(&self.ctx)
    }

    /// Frees group `g`'s unsharded parameters now, in its backward, rather
    /// than at its post-backward: for a model that computes on copies of its
    /// own (the candle adapter on the CPU copies them into candle's
    /// tensors), which then holds one copy through its backward, not two.
    /// A group that does not reshard after backward keeps them.
    pub fn release_params_in_backward(&mut self, g: usize) -> Result<()> {
        self.group_in(g, TrainingState::PreBackward, "release_params_in_backward")?;
        let grp = &mut self.groups[g];
        match grp.reshard_after_backward {
            true => grp.reshard(&self.ctx),
            false => Ok(()),
        }
    }

    fn pre_backward_with(&mut self, g: usize, grads: bool) -> Result<()> {
        let t0 = HookStart::now();
        let grp = self.group(g)?;
        match grp.training {
            // A second pre-backward of the same group is a no-op, as in FSDP2.
            TrainingState::PreBackward => return Ok(()),
            TrainingState::Idle => {}
            _ => return Err(grp.state_error("pre_backward")),
        }
        self.check_routed(g, TrainingState::PreBackward, "pre_backward outside its parent's backward")?;
        match grads {
            true => self.groups[g].pre_backward(&mut self.ctx)?,
            false => self.groups[g].pre_backward_unshard(&mut self.ctx)?,
        }
        self.unshard_routed(g)?;
        for t in self.groups[g].backward_prefetch_targets(&self.post_forward_order) {
            self.groups[t].unshard(&mut self.ctx)?;
        }
        self.note_overhead(Hook::PreBackward, t0);
        Ok(())
    }

    /// After group `g`'s backward: reshards (if so configured) and
    /// reduce-scatters its gradients (or accumulates them when gradient sync is off).
    pub fn post_backward(&mut self, g: usize) -> Result<()> {
        let t0 = HookStart::now();
        let grp = self.group_in(g, TrainingState::PreBackward, "post_backward")?;
        let plan = ReducePlan::new(&self.ctx.dp, grp.mp.reduce(), self.config.force_sum, self.config.divide_factor);
        if let Route::Routed(_) = grp.route {
            // Reduced at the parent's post-backward, in the declared order.
            let grp = &mut self.groups[g];
            grp.training = TrainingState::PostBackward;
            grp.reduce_deferred = true;
        } else {
            self.finish_routed_backward(g)?;
            self.groups[g].post_backward(&mut self.ctx, plan)?;
        }
        self.note_overhead(Hook::PostBackward, t0);
        Ok(())
    }

    /// The root's end of backward: runs post-backward for groups whose
    /// backward started but did not finish, makes the compute stream wait for
    /// every reduction, and returns every group to idle.
    pub fn finalize_backward(&mut self) -> Result<()> {
        let t0 = HookStart::now();
        for g in 0..self.groups.len() {
            let routed = matches!(self.groups[g].route, Route::Routed(_));
            if self.groups[g].training == TrainingState::PreBackward && !routed {
                self.post_backward(g)?;
            }
        }
        self.check_routed_finished()?;
        for grp in self.groups.iter_mut() {
            grp.finalize_backward(&self.ctx)?;
        }
        let (s, events) = (&self.ctx.streams, &self.ctx.events);
        if let Some((_, e)) = self.ctx.reduce_scatter_state.take() {
            events.wait_and_give(e, &[&s.compute])?;
        }
        if let Some((_, e)) = self.ctx.all_gather_state.take() {
            events.wait_and_give(e, &[&s.compute])?;
        }
        self.post_forward_order.clear();
        self.root_ready = false;
        self.note_overhead(Hook::FinalizeBackward, t0);
        Ok(())
    }

    /// Runs `body` between [`Fsdp::pre_forward`] and [`Fsdp::post_forward`] of group `g`.
    pub fn forward<T>(&mut self, g: usize, body: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.pre_forward(g)?;
        let out = body(self)?;
        self.post_forward(g)?;
        Ok(out)
    }

    /// Runs `body` between [`Fsdp::pre_backward`] and [`Fsdp::post_backward`] of group `g`.
    pub fn backward<T>(&mut self, g: usize, body: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.pre_backward(g)?;
        let out = body(self)?;
        self.post_backward(g)?;
        Ok(out)
    }

    /// Drops every sharded gradient (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        for grp in self.groups.iter_mut() {
            grp.storage.grad = None;
        }
    }

    /// Blocks until all of this rank's FSDP work has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.ctx.device.synchronize()?)
    }

    /// Parameter `i` of group `g` whole (f32, padding removed), all-gathered
    /// from the shards and handed to `sink` in row-major pieces of at most
    /// `piece` elements: how a run writes its full model tensor by tensor.
    /// Every rank of the shard world must call it for the same parameter, in
    /// the same order. A rank holds one gathered copy of this parameter and
    /// one piece beside its shards; nothing else is unsharded. An error of
    /// `sink` ends the gather on this rank only, so a sink that must not
    /// stall its peers keeps its own error and returns `Ok`. Blocks.
    pub fn gather_param(
        &self,
        g: usize,
        i: usize,
        piece: usize,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let grp = self.group(g)?;
        let p = self.param_ref(g, i)?;
        let layout = p.layout.map(|l| &grp.layout.params[l]);
        let master = grp.storage.master.slice(p.shard.start, p.shard.len())?;
        collectives::gather_param_pieces(&self.ctx.streams.compute, &self.ctx.dp.shard, layout, master, piece, sink)
    }

    /// The group and index of the parameter named `name`.
    pub fn find_param(&self, name: &str) -> Option<(usize, usize)> {
        self.groups
            .iter()
            .enumerate()
            .find_map(|(g, grp)| grp.params.iter().position(|p| p.name == name).map(|i| (g, i)))
    }

    /// Every parameter's full f32 values, gathered one parameter at a time
    /// ([`Fsdp::gather_param`]); every rank must call it. This holds the
    /// whole model on every rank: for tests and small models; a run's
    /// outputs gather and write one tensor at a time instead. Blocks.
    pub fn full_parameters(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let mut out = Vec::new();
        for (g, grp) in self.groups.iter().enumerate() {
            for (i, p) in grp.params.iter().enumerate() {
                let mut values = Vec::with_capacity(p.numel);
                self.gather_param(g, i, 1 << 20, &mut |piece| {
                    values.extend_from_slice(piece);
                    Ok(())
                })?;
                out.push((p.name.clone(), values));
            }
        }
        Ok(out)
    }

    // ---- export and import of this rank's shards (checkpoints) ----

    /// Where parameter `i` of group `g` lives on this rank: its layout over
    /// the shard world (this rank is `data_parallel().shard.rank()`), or
    /// `None` when it is replicated (every rank holds all of it).
    pub fn param_layout(&self, g: usize, i: usize) -> Result<Option<crate::layout::ParamLayout>> {
        let grp = self.group(g)?;
        let p = self.param_ref(g, i)?;
        Ok(p.layout.map(|l| grp.layout.params[l].clone()))
    }

    /// This rank's f32 master of parameter `i` of group `g`: the padded shard
    /// (`[outer, shard_rows, inner]`, zeros in the padding, see
    /// [`layout`](crate::layout)), or the whole parameter when replicated.
    /// Ordered after everything enqueued on the compute stream; blocks.
    pub fn read_shard(&self, g: usize, i: usize) -> Result<Vec<f32>> {
        let p = self.param_ref(g, i)?;
        let master = self.groups[g].storage.master.slice(p.shard.start, p.shard.len())?;
        Ok(self.ctx.streams.compute.read_vec::<f32>(master)?)
    }

    /// Replaces this rank's f32 master of parameter `i` of group `g` with
    /// `values` (same layout as [`Fsdp::read_shard`]; padding must be zero).
    /// Enqueued on the compute stream, so the next all-gather (which follows
    /// the compute stream) sees it. Allowed only while every group is idle and
    /// sharded, i.e. between steps; any other time is [`FsdpError::State`].
    pub fn write_shard(&mut self, g: usize, i: usize, values: &[f32]) -> Result<()> {
        let busy = |grp: &&Group<C>| grp.training != TrainingState::Idle || grp.sharded != ShardedState::Sharded;
        if let Some(grp) = self.groups.iter().find(busy) {
            return Err(grp.state_error("write_shard"));
        }
        if self.root_ready {
            return Err(FsdpError::InvalidArgument("write_shard during a step (before finalize_backward)".into()));
        }
        let p = self.param_ref(g, i)?;
        if values.len() != p.shard.len() {
            return Err(FsdpError::InvalidArgument(format!(
                "{}: {} values for a shard of {} elements",
                p.name,
                values.len(),
                p.shard.len()
            )));
        }
        let master = self.groups[g].storage.master.slice(p.shard.start, p.shard.len())?;
        self.ctx.streams.compute.upload(values, master)?;
        Ok(())
    }

    /// Mean of a one-element f32 value over the data-parallel world (every
    /// rank must call it); blocks and returns it on every rank.
    pub fn mean_over_ranks(&self, value: View<'_, B<C>>) -> Result<f64> {
        self.mean_over_ranks_async(value)?.read()
    }

    /// [`Fsdp::mean_over_ranks`] without waiting: the sum over the ranks and
    /// its copy to the host are enqueued on the compute stream after the work
    /// already there; the mean is read from the returned value when wanted
    /// (a training loop reads a step's loss once the next step is enqueued).
    pub fn mean_over_ranks_async(&self, value: View<'_, B<C>>) -> Result<PendingValue> {
        if value.len() != 1 || value.dtype() != DType::F32 {
            return Err(FsdpError::InvalidArgument(format!(
                "mean_over_ranks: one f32 value, not {}[{}]",
                value.dtype(),
                value.len()
            )));
        }
        let s = &self.ctx.streams.compute;
        let dp = &self.ctx.dp;
        let buf = s.alloc(DType::F32, 1)?;
        s.copy(value, buf.view())?;
        dp.shard.all_reduce_in_place(buf.view(), ReduceOp::Sum, s)?;
        if let Some(r) = &dp.replicate {
            r.all_reduce_in_place(buf.view(), ReduceOp::Sum, s)?;
        }
        Ok(PendingValue::new(s.copy_to_host(buf.view())?, Finish::Mean { world: dp.world_size() }))
    }
}
