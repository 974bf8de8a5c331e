//! FSDP's memory: one rank's device peak and what it holds after the step
//! and after `zero_grad`, against the ZeRO-3 bound of docs/fsdp.md computed
//! here from the layout rule (the steps the offload cases measure too).

use anyhow::ensure;
use chorus_collectives::CommBackend;
use chorus_devices::{ComputeBackend, Device, Scalar, Stream};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, OptimizerKind, ShardedOptimizer};

use super::state_machine::param;
use super::world::own_world;
use crate::{Case, Failure, RankCtx};

/// The memory bound of docs/fsdp.md for groups without model compute (f32, SGD with momentum).
struct Bound {
    after_step: usize,
    after_zero_grad: usize,
    peak: usize,
    floor: usize,
}

/// Bytes of one rank's f32 shard of a parameter of `shape` sharded on dim 0
/// over `world` ranks, padding included: by docs/fsdp.md's rule every rank
/// holds `ceil(rows / world)` rows. Computed here from the rule, not by
/// FSDP's own layout code, so a layout bug cannot move the oracle with it.
pub(super) fn padded_shard_bytes(shape: &[usize], world: usize) -> usize {
    let rows = shape[0];
    let row_len: usize = shape[1..].iter().product();
    rows.div_ceil(world) * row_len * 4
}

/// The bound for groups of one f32 parameter each, of these shapes, over `world` ranks.
fn bound(shapes: &[&[usize]], world: usize) -> Bound {
    let s: Vec<usize> = shapes.iter().map(|shape| padded_shard_bytes(shape, world)).collect();
    let n: Vec<usize> = shapes.iter().map(|shape| shape.iter().product::<usize>() * 4).collect();
    let ag: Vec<usize> = s.iter().map(|s| s * world).collect();
    let l = s.len();
    let base: usize = s.iter().map(|s| 2 * s).sum();
    let mut peak = 0;
    for i in 0..l {
        let prev = if i > 0 { ag[i - 1] } else { 0 };
        peak = peak.max(base + (prev + ag[i]).max(ag[i] + n[i]));
    }
    for i in (0..l).rev() {
        let done: usize = (i + 1..l).map(|j| 2 * s[j]).sum();
        let rs_later = if i + 1 < l { ag[i + 1] } else { 0 };
        let prefetch = if i > 0 { ag[i - 1] } else { 0 };
        let pre = (rs_later + ag[i] + n[i]).max(rs_later + 2 * n[i] + prefetch);
        let post = n[i] + ag[i] + 2 * s[i] + prefetch;
        peak = peak.max(base + done + pre.max(post));
    }
    Bound {
        after_step: base + s.iter().sum::<usize>(),
        after_zero_grad: base,
        peak,
        floor: base + n.iter().map(|n| 2 * n).max().unwrap_or(0),
    }
}

/// CPU offload with pinned host memory (FSDP2's default policy).
pub(super) const OFFLOAD: Option<chorus_fsdp::OffloadPolicy> = Some(chorus_fsdp::OffloadPolicy { pin_memory: true });

/// The groups of the memory cases: one f32 parameter each, of these shapes.
pub(super) const MEMORY_SHAPES: [&[usize]; 4] = [&[64, 48], &[96, 64], &[33, 96], &[50, 33]];

/// What one rank's device and host spaces held in one fake training step,
/// less what they held before FSDP was made (the harness's buffers).
#[derive(Debug)]
pub(super) struct StepMemory {
    pub(super) device_peak: usize,
    pub(super) device_after_step: usize,
    pub(super) device_after_zero_grad: usize,
    pub(super) host_after_step: usize,
    pub(super) host_after_zero_grad: usize,
}

/// Two training steps of groups without model compute (the forward only
/// gathers, every gradient is 0.5; SGD with momentum) over groups of
/// `shapes`, the first `offloaded` of them offloaded (per group, through
/// `set_offload`), measuring each step: what the memory cases share.
pub(super) fn fake_steps<C: CommBackend>(
    ctx: &RankCtx<'_, C>,
    shapes: &[&[usize]],
    offloaded: usize,
) -> Result<[StepMemory; 2], Failure>
where
    C::B: ComputeBackend,
{
    let world = own_world(ctx)?;
    ctx.device().synchronize()?;
    let dev = ctx.device().clone();
    let (others, host_others) = (dev.memory_stats().bytes_in_use, dev.host_memory_stats().bytes_in_use);
    let mut f = Fsdp::new(DataParallel::fsdp(world), FsdpConfig::default())?;
    for (i, shape) in shapes.iter().enumerate() {
        f.set_offload(if i < offloaded { OFFLOAD } else { None });
        f.add_group(&format!("g{i}"), vec![param(&format!("p{i}"), shape)], false)?;
        ensure!(f.is_offloaded(i)? == (i < offloaded), "group {i}'s offload");
    }
    let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(0.1, 0.9));
    let l = shapes.len();
    let mut step = || -> Result<StepMemory, Failure> {
        f.synchronize()?;
        dev.reset_peak_memory();
        for g in 0..l {
            f.pre_forward(g)?;
            f.post_forward(g)?;
        }
        for g in (0..l).rev() {
            f.pre_backward(g)?;
            f.compute_stream().fill(f.grad(g, 0)?, Scalar::Float(0.5))?;
            f.post_backward(g)?;
        }
        f.finalize_backward()?;
        opt.step(&mut f)?;
        f.synchronize()?;
        let device_peak = dev.memory_stats().peak_bytes.saturating_sub(others);
        let device_after_step = dev.memory_stats().bytes_in_use.saturating_sub(others);
        let host_after_step = dev.host_memory_stats().bytes_in_use.saturating_sub(host_others);
        f.zero_grad();
        Ok(StepMemory {
            device_peak,
            device_after_step,
            host_after_step,
            device_after_zero_grad: dev.memory_stats().bytes_in_use.saturating_sub(others),
            host_after_zero_grad: dev.host_memory_stats().bytes_in_use.saturating_sub(host_others),
        })
    };
    Ok([step()?, step()?])
}

pub(super) fn memory_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/memory-within-zero3-bound", |ctx: &RankCtx<'_, C>| {
        let b = bound(&MEMORY_SHAPES, ctx.size());
        for (step, m) in fake_steps(ctx, &MEMORY_SHAPES, 0)?.iter().enumerate() {
            if step == 1 {
                let peak = m.device_peak;
                ensure!(peak as f64 <= b.peak as f64 * 1.05, "peak {peak} B above the bound {} B", b.peak);
                ensure!(
                    peak >= b.floor,
                    "peak {peak} B below the floor {} B: the bound is not being exercised",
                    b.floor
                );
            }
            let now = m.device_after_step;
            ensure!(now == b.after_step, "after step {step}: {now} B, expected {}", b.after_step);
            let now = m.device_after_zero_grad;
            ensure!(now == b.after_zero_grad, "after zero_grad: {now} B, expected {}", b.after_zero_grad);
        }
        Ok(())
    })
}
