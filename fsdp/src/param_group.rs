//! A param group's state machine (FSDP2's `_fsdp_param_group`): unshard /
//! wait-for-unshard / reshard and what each hook does to the group (its
//! states are in `training_state`, what the groups share in `comm_context`).
//!
//! The root ([`Fsdp`](crate::Fsdp)) checks a hook is allowed, orders the
//! groups (prefetch, post-forward order) and calls into a group; a group
//! calls [`collectives`](crate::collectives) to move data.

use std::sync::Arc;

use chorus_collectives::{CommBackend, Communicator};
use chorus_devices::Stream;

use crate::collectives::{self, AllGatherResult, CopyInSource, ReducePlan};
use crate::comm_context::CommContext;
use crate::config::{MixedPrecision, Reshard};
use crate::layout::GroupLayout;
use crate::param::Param;
use crate::storage::GroupStorage;
use crate::training_state::{ShardedState, TrainingState};
use crate::{Buf, Ev, FsdpError, Result};

/// One param group: its parameters, layouts, states, policies, and the
/// buffers and events it keeps between hooks.
pub(crate) struct Group<C: CommBackend> {
    pub(crate) name: String,
    pub(crate) params: Vec<Param>,
    /// The group's buffers: masters, gradients, unsharded parameters.
    pub(crate) storage: GroupStorage<C>,
    pub(crate) layout: GroupLayout,
    /// Reshard-after-forward to K ranks: the communicator of this rank's K and the layout over them.
    post_forward: Option<(Arc<Communicator<C>>, GroupLayout)>,
    pub(crate) training: TrainingState,
    pub(crate) sharded: ShardedState,
    pub(crate) reshard_after_forward: Reshard,
    pub(crate) reshard_after_backward: bool,
    pub(crate) requires_gradient_sync: bool,
    pub(crate) requires_all_reduce: bool,
    pub(crate) mp: MixedPrecision,
    /// An all-gather issued but not yet copied out.
    pub(crate) pending: Option<AllGatherResult<C>>,
    post_forward_buffer: Option<Buf<C>>,
    post_forward_event: Option<Ev<C>>,
    post_reduce_event: Option<Ev<C>>,
    reduce_outputs: Vec<Buf<C>>,
    /// HSDP: reduce-scatter sums whose all-reduce is deferred.
    partial_reduce: Option<Buf<C>>,
    /// This group's positions in the root's post-forward order, for backward prefetch.
    post_forward_indices: Vec<usize>,
    pub(crate) forward_prefetch: Vec<usize>,
    pub(crate) backward_prefetch: Option<Vec<usize>>,
    /// Routed groups ([`Fsdp::set_routed_groups`](crate::Fsdp::set_routed_groups)):
    /// this group's parent, or the alternatives this group is the parent of.
    pub(crate) route: Route,
    /// A routed group's forward ran in its parent's current forward.
    pub(crate) used: bool,
    /// A routed group's backward ended; its reduction waits for its parent's.
    pub(crate) reduce_deferred: bool,
}

/// A group's place in a routed layer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Route {
    /// An ordinary group.
    #[default]
    None,
    /// The parent of these routed groups, in the order their collectives are issued.
    Parent(Vec<usize>),
    /// A routed group under this parent.
    Routed(usize),
}

impl<C: CommBackend> Group<C> {
    /// A sharded, idle group. `post_forward` is given only for `Reshard::To(k)` with `k` below the shard world.
    pub(crate) fn new(
        name: &str,
        (params, storage): (Vec<Param>, GroupStorage<C>),
        layout: GroupLayout,
        post_forward: Option<(Arc<Communicator<C>>, GroupLayout)>,
        reshard_after_forward: Reshard,
        mp: MixedPrecision,
    ) -> Self {
        Group {
            name: name.to_string(),
            params,
            storage,
            layout,
            post_forward,
            training: TrainingState::Idle,
            sharded: ShardedState::Sharded,
            reshard_after_forward,
            reshard_after_backward: true,
            requires_gradient_sync: true,
            requires_all_reduce: true,
            mp,
            pending: None,
            post_forward_buffer: None,
            post_forward_event: None,
            post_reduce_event: None,
            reduce_outputs: Vec::new(),
            partial_reduce: None,
            post_forward_indices: Vec::new(),
            forward_prefetch: Vec::new(),
            backward_prefetch: None,
            route: Route::None,
            used: false,
            reduce_deferred: false,
        }
    }

    /// The error for `event` (a hook or an access) in the current state.
    pub(crate) fn state_error(&self, event: &'static str) -> FsdpError {
        FsdpError::State { group: self.name.clone(), event, state: self.training }
    }

    // ---- unshard / reshard ----

    /// Issues the group's all-gather (FSDP2's `unshard`) unless its
    /// parameters are unsharded or an all-gather is already in flight:
    /// from the post-forward shard within the post-forward world, else from
    /// the masters over the shard world.
    pub(crate) fn unshard(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        if self.pending.is_some() || self.sharded == ShardedState::Unsharded {
            return Ok(());
        }
        if let Some(e) = self.post_forward_event.take() {
            // The post-forward copy was written on the compute stream.
            ctx.events.wait_and_give(e, &[&ctx.streams.copy_in, &ctx.streams.all_gather])?;
        }
        let from_post_forward = self.sharded == ShardedState::ShardedPostForward;
        let (comm, layout) = match (&self.post_forward, from_post_forward) {
            (Some((c, l)), true) => (c.clone(), l),
            _ => (ctx.dp.shard.clone(), &self.layout),
        };
        if layout.params.is_empty() {
            return Ok(());
        }
        let source = if from_post_forward {
            let buf = self.post_forward_buffer.as_ref().ok_or_else(|| self.state_error("post-forward unshard"))?;
            CopyInSource::PostForward(buf)
        } else {
            CopyInSource::Masters(&self.storage.master)
        };
        // A post-forward shard is already in the param dtype: it is gathered
        // so, not quantized a second time.
        let float8 = self.mp.float8_all_gather() && !from_post_forward;
        let result = collectives::all_gather(ctx, &comm, layout, self.mp.param(), source, float8)?;
        self.pending = Some(result);
        Ok(())
    }

    /// Copies the issued all-gather out into the unsharded parameters on the
    /// compute stream (FSDP2's `wait_for_unshard`). In forward the output is
    /// kept in `ctx` until the next group's copy-out (so the next all-gather
    /// can overlap this copy-out); otherwise it is released at once.
    pub(crate) fn wait_for_unshard(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        if self.sharded == ShardedState::Unsharded {
            return Ok(());
        }
        let pending = self.pending.take();
        if self.training == TrainingState::Forward {
            // Implicit prefetch: the previous group's all-gather output is
            // freed only now, after this group's copy-in has been issued.
            ctx.release_all_gather_output()?;
        }
        let s = &ctx.streams;
        let (world, layout) = match (&self.post_forward, pending.as_ref().is_some_and(|p| p.post_forward)) {
            (Some((c, l)), true) => (c.size(), l),
            _ => (ctx.dp.shard.size(), &self.layout),
        };
        if pending.is_none() && self.params.iter().any(|p| p.layout.is_some()) {
            return Err(self.state_error("unshard without an all-gather"));
        }
        let gathered = match &pending {
            Some(res) => {
                s.compute.wait(&res.event)?;
                Some((&res.buffer, layout, world))
            }
            None => None,
        };
        collectives::copy_out(&s.compute, gathered, &self.params, &mut self.storage, self.mp.param())?;
        self.sharded = ShardedState::Unsharded;
        self.post_forward_buffer = None;
        if let Some(res) = pending {
            ctx.events.give(res.event);
            let copied_out = ctx.events.record(&ctx.device, &s.compute)?;
            if self.training == TrainingState::Forward {
                ctx.all_gather_state = Some((res.buffer, copied_out));
            } else {
                ctx.events.wait_and_give(copied_out, &[&s.copy_in, &s.all_gather])?;
            }
        }
        Ok(())
    }

    /// Frees the unsharded parameters (FSDP2's `reshard`). In forward this
    /// follows reshard-after-forward: `No` keeps them; `To(k)` keeps this
    /// rank's chunk over the post-forward world.
    pub(crate) fn reshard(&mut self, ctx: &CommContext<C>) -> Result<()> {
        if self.training == TrainingState::Forward {
            match self.reshard_after_forward {
                Reshard::No => return Ok(()),
                Reshard::To(_) if self.sharded == ShardedState::Unsharded => {
                    let (comm, layout) =
                        self.post_forward.as_ref().ok_or_else(|| self.state_error("post-forward reshard"))?;
                    let unsharded =
                        self.storage.unsharded.as_ref().ok_or_else(|| self.state_error("post-forward reshard"))?;
                    let (buf, e) = collectives::post_forward_shard(
                        ctx,
                        comm.rank(),
                        layout,
                        &self.params,
                        unsharded,
                        self.mp.param(),
                    )?;
                    self.post_forward_buffer = Some(buf);
                    self.post_forward_event = Some(e);
                    self.storage.unsharded = None;
                    self.sharded = ShardedState::ShardedPostForward;
                    return Ok(());
                }
                _ => {}
            }
        }
        self.storage.unsharded = None;
        self.post_forward_buffer = None;
        // Nothing will wait on it: back to the pool.
        if let Some(e) = self.post_forward_event.take() {
            ctx.events.give(e);
        }
        self.sharded = ShardedState::Sharded;
        Ok(())
    }

    // ---- hooks (the root has checked the training state) ----

    /// Forward starts: unshard, waiting for a prefetch if one was issued.
    pub(crate) fn pre_forward(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        self.training = TrainingState::Forward;
        self.unshard(ctx)?;
        self.wait_for_unshard(ctx)
    }

    /// Forward ends: reshard per policy and remember this group's place
    /// (`index`) in the post-forward order (routed groups have none).
    pub(crate) fn post_forward(&mut self, ctx: &CommContext<C>, index: Option<usize>) -> Result<()> {
        self.reshard(ctx)?;
        self.post_forward_indices.extend(index);
        self.training = TrainingState::Idle;
        Ok(())
    }

    /// Backward starts: unshard and give every parameter a zeroed unsharded
    /// gradient if it has none. The last forward all-gather output is freed
    /// first: backward does not need it.
    pub(crate) fn pre_backward(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        self.pre_backward_unshard(ctx)?;
        self.ensure_grads(ctx)
    }

    /// [`Self::pre_backward`] without the gradients ([`Self::ensure_grads`] makes them).
    pub(crate) fn pre_backward_unshard(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        ctx.release_all_gather_output()?;
        self.training = TrainingState::PreBackward;
        self.unshard(ctx)?;
        self.wait_for_unshard(ctx)
    }

    /// Zeroed unsharded gradients for every parameter, unless the group has them.
    pub(crate) fn ensure_grads(&mut self, ctx: &CommContext<C>) -> Result<()> {
        self.storage.ensure_unsharded_grads(&ctx.streams.compute, self.mp.param())
    }

    /// The groups to unshard when this group's backward starts: the explicit
    /// list, or the group that ran forward just before this one
    /// (`post_forward_order` is the root's, FSDP2's reverse-post-forward default).
    pub(crate) fn backward_prefetch_targets(&mut self, post_forward_order: &[usize]) -> Vec<usize> {
        match &self.backward_prefetch {
            Some(t) => t.clone(),
            None => self
                .post_forward_indices
                .pop()
                .and_then(|i| i.checked_sub(1))
                .and_then(|i| post_forward_order.get(i))
                .copied()
                .into_iter()
                .collect(),
        }
    }

    /// Backward ends: reshard (if so configured) and reduce the gradients
    /// with `plan`, or, without gradient sync, keep them accumulating.
    pub(crate) fn post_backward(&mut self, ctx: &mut CommContext<C>, plan: ReducePlan) -> Result<()> {
        self.training = TrainingState::PostBackward;
        let (param_dtype, reduce_dtype) = (self.mp.param(), self.mp.reduce());
        self.storage.fold_into_accumulator(&ctx.streams.compute)?;
        if !self.requires_gradient_sync {
            if self.reshard_after_backward {
                self.reshard(ctx)?;
            }
            if reduce_dtype != param_dtype {
                self.storage.start_accumulator(&ctx.streams.compute, reduce_dtype)?;
            }
            return Ok(());
        }
        let grads = self.storage.take_grads_to_reduce(&ctx.streams.compute, param_dtype, reduce_dtype)?;
        if self.reshard_after_backward {
            self.reshard(ctx)?;
        }
        let Some(grads) = grads else {
            return Ok(());
        };
        let reduced = collectives::reduce_gradients(
            ctx,
            plan,
            &self.layout,
            &self.params,
            &mut self.storage,
            grads,
            &mut self.partial_reduce,
            self.requires_all_reduce,
        )?;
        self.post_reduce_event = Some(reduced.post_reduce_event);
        self.reduce_outputs.extend(reduced.outputs);
        Ok(())
    }

    /// The root's end of backward for this group: the compute stream waits
    /// for its reduction, the kept reduce outputs are freed, and it is idle.
    pub(crate) fn finalize_backward(&mut self, ctx: &CommContext<C>) -> Result<()> {
        if let Some(e) = self.post_reduce_event.take() {
            ctx.events.wait_and_give(e, &[&ctx.streams.compute])?;
        }
        self.reduce_outputs.clear();
        self.training = TrainingState::Idle;
        self.post_forward_indices.clear();
        self.used = false;
        self.reduce_deferred = false;
        Ok(())
    }
}
