//! FSDP2's state machine: each hook allowed only in its state (a wrong one
//! is a state error naming the event), the states each hook leaves, and the
//! asynchronous unshard and explicit prefetch.

use anyhow::{anyhow, ensure};
use chorus_collectives::backend::OpKind;
use chorus_collectives::CommBackend;
use chorus_devices::{ComputeBackend, Scalar, Stream, StreamExt};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, FsdpError, ParamInit, Reshard, ShardedState, TrainingState};

use super::world::{counted, own_world};
use crate::{Case, Failure, RankCtx};

pub(super) fn param(name: &str, shape: &[usize]) -> ParamInit {
    let n: usize = shape.iter().product();
    ParamInit { name: name.into(), shape: shape.to_vec(), values: (0..n).map(|i| i as f32 - 3.0).collect() }
}

fn state_error<T>(r: Result<T, FsdpError>, event: &str) -> Result<(), Failure> {
    match r {
        Err(FsdpError::State { event: e, .. }) if e == event => Ok(()),
        Err(e) => Err(anyhow!("{event}: expected a state error, got {e}")),
        Ok(_) => Err(anyhow!("{event}: expected a state error, got success")),
    }
}

pub(super) fn state_machine_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/state-machine", |ctx: &RankCtx<'_, C>| {
        let n = ctx.size();
        for reshard in [Reshard::Yes, Reshard::No, Reshard::To(1)] {
            let world = own_world(ctx)?;
            let config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
            let mut f = Fsdp::new(DataParallel::fsdp(world), config)?;
            let w = param("w", &[5, 3]);
            let expected = w.values.clone();
            let g = f.add_group("g", vec![w], false)?;
            let state = |f: &Fsdp<C>| -> Result<_, Failure> { Ok((f.training_state(g)?, f.sharded_state(g)?)) };
            ensure!(state(&f)? == (TrainingState::Idle, ShardedState::Sharded), "initial state");
            state_error(f.param(g, 0), "parameter access")?;
            state_error(f.post_forward(g), "post_forward")?;
            state_error(f.post_backward(g), "post_backward")?;

            f.pre_forward(g)?;
            ensure!(state(&f)? == (TrainingState::Forward, ShardedState::Unsharded), "after pre_forward");
            ensure!(f.compute_stream().read_vec::<f32>(f.param(g, 0)?)? == expected, "unsharded values");
            state_error(f.pre_forward(g), "pre_forward")?;
            state_error(f.pre_backward(g), "pre_backward")?;
            state_error(f.post_backward(g), "post_backward")?;
            state_error(f.grad(g, 0), "gradient access")?;

            f.post_forward(g)?;
            let after_forward = match reshard {
                Reshard::No => ShardedState::Unsharded,
                Reshard::To(k) if k < n => ShardedState::ShardedPostForward,
                _ => ShardedState::Sharded,
            };
            ensure!(
                state(&f)? == (TrainingState::Idle, after_forward),
                "{reshard}: after post_forward {:?}",
                state(&f)?
            );

            f.pre_backward(g)?;
            ensure!(state(&f)? == (TrainingState::PreBackward, ShardedState::Unsharded), "after pre_backward");
            ensure!(f.compute_stream().read_vec::<f32>(f.param(g, 0)?)? == expected, "{reshard}: values in backward");
            f.compute_stream().fill(f.grad(g, 0)?, Scalar::Float(1.0))?;
            f.pre_backward(g)?; // a second pre-backward is a no-op, as in FSDP2
            f.post_backward(g)?;
            ensure!(state(&f)? == (TrainingState::PostBackward, ShardedState::Sharded), "after post_backward");
            state_error(f.post_backward(g), "post_backward")?;
            state_error(f.pre_forward(g), "pre_forward")?;
            f.finalize_backward()?;
            ensure!(state(&f)? == (TrainingState::Idle, ShardedState::Sharded), "after finalize");

            // Without reshard-after-backward the next forward needs no all-gather.
            f.set_reshard_after_backward(false);
            f.pre_forward(g)?;
            f.post_forward(g)?;
            f.pre_backward(g)?;
            f.post_backward(g)?;
            ensure!(f.sharded_state(g)? == ShardedState::Unsharded, "kept after backward");
            f.finalize_backward()?;
            let before = f.comm_counts().all_gathers;
            f.pre_forward(g)?;
            ensure!(f.comm_counts().all_gathers == before, "an all-gather for kept parameters");
            f.post_forward(g)?;
            f.synchronize()?;
        }
        Ok(())
    })
}

pub(super) fn prefetch_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/async-unshard-and-explicit-prefetch", |ctx: &RankCtx<'_, C>| {
        let (world, counts) = counted(ctx)?;
        let n = world.size();
        let mut f = Fsdp::new(DataParallel::fsdp(world), FsdpConfig::default())?;
        let a = f.add_group("a", vec![param("a", &[4, 2])], false)?;
        let b = f.add_group("b", vec![param("b", &[3, 3])], false)?;
        let handle = f.unshard(a, true)?;
        ensure!(f.sharded_state(a)? == ShardedState::Sharded, "sharded until waited on");
        f.wait_unshard(handle)?;
        ensure!(f.sharded_state(a)? == ShardedState::Unsharded, "unsharded after wait");
        ensure!(f.compute_stream().read_vec::<f32>(f.param(a, 0)?)? == param("a", &[4, 2]).values, "values of a");
        f.set_forward_prefetch(a, vec![b])?;
        ensure!(f.set_forward_prefetch(a, vec![7]).is_err(), "prefetching a missing group");
        counts.clear();
        f.pre_forward(a)?;
        f.post_forward(a)?;
        ensure!(counts.get(OpKind::AllGather, n) == 1, "a's pre-forward all-gathers b once");
        f.pre_forward(b)?;
        ensure!(counts.get(OpKind::AllGather, n) == 1, "b's pre-forward uses the prefetch");
        ensure!(f.compute_stream().read_vec::<f32>(f.param(b, 0)?)? == param("b", &[3, 3]).values, "values of b");
        f.post_forward(b)?;
        f.synchronize()?;
        Ok(())
    })
}
