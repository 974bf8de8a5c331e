//! Routed groups: parameter groups that a step may use on some ranks and not
//! on others (the experts of a mixture-of-experts layer), without a hang.
//!
//! FSDP2 issues a group's all-gather when its forward starts and its
//! reduce-scatter when its backward ends, so a group one rank skips leaves
//! that rank's collective sequence short and its peers wait forever in the
//! next collective. Here the model declares such groups as alternatives
//! under a parent group that every rank runs ([`Fsdp::set_routed_groups`]),
//! and their collectives move to points every rank reaches, in the declared
//! order:
//! - the parent's pre-forward and pre-backward issue every routed group's
//!   all-gather (those not already unsharded);
//! - a routed group's own hooks then issue no collective: its pre-forward
//!   copies the gathered parameters out, its post-backward only marks its
//!   gradients ready;
//! - the parent's post-forward finishes every routed group this rank did not
//!   use as if it had run on no tokens (the all-gather output is dropped, or
//!   copied out where the reshard policy keeps it), and the parent's
//!   post-backward reduce-scatters every routed group's gradients, an unused
//!   one's as zeros, before the parent's own.
//!
//! So every rank issues the same collectives in the same order whatever its
//! forward used. A routed hook outside its parent's, or a routed group used
//! twice in one forward of its parent, is a [`FsdpError::State`] on the rank
//! that does it, not a collective the others never join.

use crate::collectives::ReducePlan;
use crate::comm_context::CommContext;
use crate::param_group::{Group, Route};
use crate::state::Fsdp;
use crate::training_state::{ShardedState, TrainingState};
use crate::{FsdpError, Result};
use chorus_collectives::CommBackend;

impl<C: CommBackend> Fsdp<C> {
    /// Declares `routed` as alternatives under `parent`: groups that a step
    /// may use on some ranks and not on others (experts of one
    /// mixture-of-experts layer), whose forward and backward run inside
    /// `parent`'s (every rank runs `parent`'s hooks every step). Their
    /// collectives are issued in the order of `routed` at `parent`'s hooks,
    /// whatever each rank used; docs/fsdp.md gives the cost. A routed group
    /// runs at most one forward per forward of its parent. Call it between
    /// steps; every rank must declare the same.
    pub fn set_routed_groups(&mut self, parent: usize, routed: &[usize]) -> Result<()> {
        self.group(parent)?;
        if self.groups.iter().any(|g| g.training != TrainingState::Idle) || self.root_ready {
            return Err(FsdpError::InvalidArgument("set_routed_groups during a step".into()));
        }
        if routed.is_empty() {
            return Err(FsdpError::InvalidArgument("set_routed_groups needs at least one routed group".into()));
        }
        if self.groups[parent].route != Route::None {
            return Err(FsdpError::InvalidArgument(format!(
                "group `{}` is already routed or a parent",
                self.groups[parent].name
            )));
        }
        for (i, &r) in routed.iter().enumerate() {
            let grp = self.group(r)?;
            if r == parent || routed[..i].contains(&r) {
                return Err(FsdpError::InvalidArgument(format!("group `{}` is listed twice", grp.name)));
            }
            if grp.route != Route::None {
                return Err(FsdpError::InvalidArgument(format!("group `{}` is already routed or a parent", grp.name)));
            }
            if !grp.forward_prefetch.is_empty() || grp.backward_prefetch.is_some() {
                // Its hooks run on some ranks only: a prefetch from them would too.
                return Err(FsdpError::InvalidArgument(format!(
                    "routed group `{}` has explicit prefetch targets",
                    grp.name
                )));
            }
        }
        for &r in routed {
            self.groups[r].route = Route::Routed(parent);
        }
        self.groups[parent].route = Route::Parent(routed.to_vec());
        Ok(())
    }

    /// The groups routed under `g`, in their collectives' order.
    pub fn routed_groups(&self, g: usize) -> Result<Vec<usize>> {
        Ok(match &self.group(g)?.route {
            Route::Parent(r) => r.clone(),
            _ => Vec::new(),
        })
    }

    /// The routed groups of `g` (none unless `g` is a parent).
    fn children(&self, g: usize) -> Vec<usize> {
        match &self.groups[g].route {
            Route::Parent(r) => r.clone(),
            _ => Vec::new(),
        }
    }

    /// Before a routed group `g`'s `event` (a pre-forward or pre-backward):
    /// its parent must be in `parent_state`, and in forward the group must be
    /// unused so far and its all-gather already issued (or not needed), so
    /// that it issues no collective of its own.
    pub(crate) fn check_routed(&self, g: usize, parent_state: TrainingState, event: &'static str) -> Result<()> {
        let Route::Routed(parent) = self.groups[g].route else { return Ok(()) };
        let grp = &self.groups[g];
        if self.groups[parent].training != parent_state {
            return Err(grp.state_error(event));
        }
        let gathered = grp.pending.is_some() || grp.sharded == ShardedState::Unsharded || grp.layout.params.is_empty();
        if parent_state == TrainingState::Forward && (grp.used || !gathered) {
            return Err(grp.state_error(match event {
                "pre_forward" => "a second pre_forward within one forward of its parent",
                e => e,
            }));
        }
        Ok(())
    }

    /// At a parent's pre-forward or pre-backward: issues each routed group's
    /// all-gather, in the declared order.
    pub(crate) fn unshard_routed(&mut self, parent: usize) -> Result<()> {
        for r in self.children(parent) {
            self.groups[r].used = false;
            self.groups[r].unshard(&mut self.ctx)?;
        }
        Ok(())
    }

    /// At a parent's post-forward: every routed group this rank did not use
    /// ends its forward as if it had run on no tokens.
    pub(crate) fn finish_routed_forward(&mut self, parent: usize) -> Result<()> {
        for r in self.children(parent) {
            let grp = &mut self.groups[r];
            match grp.training {
                TrainingState::Idle if !grp.used => grp.skip_forward(&mut self.ctx)?,
                TrainingState::Idle => {}
                _ => return Err(grp.state_error("post_forward of its parent")),
            }
        }
        Ok(())
    }

    /// At a parent's post-backward: reduces every routed group's gradients in
    /// the declared order, an unused group's as zeros.
    pub(crate) fn finish_routed_backward(&mut self, parent: usize) -> Result<()> {
        for r in self.children(parent) {
            let plan = ReducePlan::new(
                &self.ctx.dp,
                self.groups[r].mp.reduce(),
                self.config.force_sum,
                self.config.divide_factor,
            );
            let grp = &mut self.groups[r];
            match (grp.training, grp.reduce_deferred) {
                (TrainingState::PostBackward, true) => grp.reduce_deferred = false,
                (TrainingState::PreBackward, _) => {}
                (TrainingState::Idle, _) => grp.skip_backward(&mut self.ctx)?,
                _ => return Err(grp.state_error("post_backward of its parent")),
            }
            grp.post_backward(&mut self.ctx, plan)?;
        }
        Ok(())
    }

    /// At the root's end of backward: a routed group whose backward started
    /// but whose parent's backward did not end cannot be reduced in the
    /// fixed order any more.
    pub(crate) fn check_routed_finished(&self) -> Result<()> {
        for grp in &self.groups {
            if let Route::Routed(_) = grp.route {
                if grp.reduce_deferred || grp.training == TrainingState::PreBackward {
                    return Err(grp.state_error("finalize_backward before its parent's post_backward"));
                }
            }
        }
        Ok(())
    }
}

impl<C: CommBackend> Group<C> {
    /// Frees an issued all-gather's output unread. The compute stream waits
    /// for the all-gather as a copy-out would, so the optimizer's later
    /// write of the masters follows the copy-in's read of them; the copy-in
    /// stream (which allocated the output) waits too, so the stream-ordered
    /// free follows the all-gather.
    fn drop_pending(&mut self, ctx: &CommContext<C>) -> Result<()> {
        if let Some(res) = self.pending.take() {
            ctx.events.wait_and_give(res.event, &[&ctx.streams.compute, &ctx.streams.copy_in])?;
        }
        Ok(())
    }

    /// A forward that ran on no tokens: the all-gather output is dropped when
    /// the policy reshards to the full world anyway, else copied out and
    /// resharded as a used group would be, so every rank's group ends in the
    /// same sharded state (and the backward all-gathers the same way).
    fn skip_forward(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        self.training = TrainingState::Forward;
        if self.reshard_after_forward == crate::Reshard::Yes && self.sharded != ShardedState::Unsharded {
            self.drop_pending(ctx)?;
        } else {
            self.wait_for_unshard(ctx)?;
        }
        self.post_forward(ctx, None)
    }

    /// A backward that ran on no tokens: zero unsharded gradients (so the
    /// reduce-scatter this rank joins adds nothing), with the all-gather
    /// output dropped unread when the group reshards after backward anyway.
    fn skip_backward(&mut self, ctx: &mut CommContext<C>) -> Result<()> {
        if self.reshard_after_backward && self.sharded != ShardedState::Unsharded {
            ctx.release_all_gather_output()?;
            self.training = TrainingState::PreBackward;
            self.drop_pending(ctx)?;
            self.storage.ensure_unsharded_grads(&ctx.streams.compute, self.mp.param())
        } else {
            self.pre_backward(ctx)
        }
    }
}
