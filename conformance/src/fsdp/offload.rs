//! CPU offload (FSDP2's `CPUOffloadPolicy`): training with the sharded
//! state in host memory equals training without it bit for bit, a
//! checkpoint of offloaded state resumes exactly, and the device memory a
//! rank holds drops by the offloaded state (docs/fsdp.md, "CPU offload").

use anyhow::ensure;
use chorus_collectives::CommBackend;
use chorus_devices::{ComputeBackend, DType};
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, MixedPrecision, OffloadPolicy, OptimizerKind, ShardedOptimizer};
use chorus_train::mlp::{init_layers, Mlp};

use super::memory::{fake_steps, padded_shard_bytes, StepMemory, MEMORY_SHAPES, OFFLOAD as ON};
use super::parity::{adamw, batch, sgd, train_fsdp, Setup, SEED};
use super::world::own_world;
use crate::{Case, Failure, RankCtx};

/// The first element where two runs' parameters differ in their bits.
fn first_bit_difference(a: &Params, b: &Params) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} parameters against {}", a.len(), b.len()));
    }
    for ((n1, x), (n2, y)) in a.iter().zip(b) {
        if n1 != n2 || x.len() != y.len() {
            return Some(format!("{n1} ({}) against {n2} ({})", x.len(), y.len()));
        }
        if let Some(i) = x.iter().zip(y).position(|(p, q)| p.to_bits() != q.to_bits()) {
            return Some(format!("{n1}[{i}]: {} with offload, {} without", x[i], y[i]));
        }
    }
    None
}

fn equal_case<C: CommBackend>(name: &str, setup: Setup) -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new(format!("fsdp/offload/equals-no-offload/{name}"), move |ctx: &RankCtx<'_, C>| {
        let plain = train_fsdp(own_world(ctx)?, &setup)?;
        let mut off = setup.clone();
        off.config.offload = ON;
        let got = train_fsdp(own_world(ctx)?, &off)?;
        ensure!(
            first_bit_difference(&got, &plain).is_none(),
            "{}",
            first_bit_difference(&got, &plain).unwrap_or_default()
        );
        Ok(())
    })
}

/// This rank's steps taken, shards and optimizer state.
type Checkpoint = (u64, Vec<(usize, usize, Vec<f32>)>, Vec<(usize, usize, Vec<Vec<f32>>)>);
/// Full parameters by name.
type Params = Vec<(String, Vec<f32>)>;

/// Trains `steps` steps of the reference MLP (AdamW, so the state matters),
/// optionally from a checkpoint, and returns the parameters with a checkpoint
/// of this rank's shards and optimizer state.
fn train_from<C: CommBackend>(
    ctx: &RankCtx<'_, C>,
    offload: Option<OffloadPolicy>,
    steps: std::ops::Range<usize>,
    resume: Option<&Checkpoint>,
) -> Result<(Params, Checkpoint), Failure>
where
    C::B: ComputeBackend,
{
    let world = own_world(ctx)?;
    let (rank, n) = (world.rank(), world.size());
    let dims = [37, 64, 33, 5];
    let mut fsdp = Fsdp::new(DataParallel::fsdp(world), FsdpConfig { offload, ..FsdpConfig::default() })?;
    let mlp = Mlp::register(&mut fsdp, init_layers(&dims, SEED))?;
    let mut opt = ShardedOptimizer::new(OptimizerKind::adamw(1e-3, 0.01));
    if let Some((taken, shards, states)) = resume {
        for (g, i, v) in shards {
            fsdp.write_shard(*g, *i, v)?;
        }
        opt.load_state(&fsdp, *taken, states.clone())?;
    }
    for step in steps {
        let (x, y) = batch(&dims, n * 3, step);
        mlp.forward_backward(
            &mut fsdp,
            &x[rank * 3 * dims[0]..(rank + 1) * 3 * dims[0]],
            &y[rank * 3 * 5..(rank + 1) * 15],
        )?;
        fsdp.finalize_backward()?;
        opt.step(&mut fsdp)?;
        fsdp.zero_grad();
    }
    let mut shards = Vec::new();
    let mut states = Vec::new();
    for g in 0..fsdp.num_groups() {
        for i in 0..fsdp.group_params(g)?.len() {
            shards.push((g, i, fsdp.read_shard(g, i)?));
            states.push((g, i, opt.read_state(&fsdp, g, i)?));
        }
    }
    let params = fsdp.full_parameters()?;
    fsdp.synchronize()?;
    Ok((params, (opt.steps(), shards, states)))
}

fn checkpoint_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/offload/checkpoint-resumes-exactly", |ctx: &RankCtx<'_, C>| {
        let (plain, _) = train_from(ctx, None, 0..4, None)?;
        let (_, saved) = train_from(ctx, ON, 0..2, None)?;
        let (resumed, _) = train_from(ctx, ON, 2..4, Some(&saved))?;
        let d = first_bit_difference(&resumed, &plain);
        ensure!(d.is_none(), "resumed with offload against 4 steps without: {}", d.unwrap_or_default());
        Ok(())
    })
}

/// What one rank held in the second of `super::memory::fake_steps`'s steps with the
/// first `offloaded` groups offloaded.
fn measure<C: CommBackend>(ctx: &RankCtx<'_, C>, shapes: &[&[usize]], offloaded: usize) -> Result<StepMemory, Failure>
where
    C::B: ComputeBackend,
{
    let [_, second] = fake_steps(ctx, shapes, offloaded)?;
    Ok(second)
}

fn memory_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/offload/device-memory-drops-by-the-offloaded-state", |ctx: &RankCtx<'_, C>| {
        let n = ctx.size();
        let shapes = MEMORY_SHAPES;
        let s: Vec<usize> = shapes.iter().map(|shape| padded_shard_bytes(shape, n)).collect();
        let total: usize = s.iter().sum();
        let plain = measure(ctx, &shapes, 0)?;
        let all = measure(ctx, &shapes, shapes.len())?;
        // Master, momentum and gradient of every shard: on the device without
        // offload, on the host with it (docs/fsdp.md's formula).
        ensure!(plain.device_after_step == 3 * total, "without offload after the step: {plain:?}, shards {total} B");
        ensure!(plain.host_after_step == 0, "without offload the host space holds {} B", plain.host_after_step);
        ensure!(all.device_after_step == 0, "with offload the device holds {} B after the step", all.device_after_step);
        ensure!(all.host_after_step == 3 * total, "with offload after the step: {all:?}, shards {total} B");
        ensure!(all.host_after_zero_grad == 2 * total, "with offload after zero_grad: {all:?}");
        // The peak drops by the offloaded state resident at the peak: every
        // master and momentum (2·Σs) and the gradients reduced by then, less
        // the staging of one shard: between 2·Σs − max s and 3·Σs.
        let drop = plain.device_peak as i64 - all.device_peak as i64;
        let max_s = s.iter().copied().max().unwrap_or(0);
        let (lo, hi) = ((2 * total - max_s) as i64, (3 * total) as i64);
        ensure!(
            (lo..=hi).contains(&drop),
            "device peak {} B without offload, {} B with: a drop of {drop} B, expected {lo}..={hi} B",
            plain.device_peak,
            all.device_peak
        );
        // Per group: offloading the first two moves only their state.
        let half = measure(ctx, &shapes, 2)?;
        ensure!(half.device_after_step == 3 * (s[2] + s[3]), "half offloaded, device: {half:?}");
        ensure!(half.host_after_step == 3 * (s[0] + s[1]), "half offloaded, host: {half:?}");
        Ok(())
    })
}

/// The offload cases for a world of `world_size` ranks.
pub fn cases<C: CommBackend>(world_size: usize) -> Vec<Case<C>>
where
    C::B: ComputeBackend,
{
    let mp = MixedPrecision {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: None,
        all_gather_dtype: None,
    };
    let mut out = vec![
        equal_case("sgd", Setup::new(sgd(0.05, 0.0))),
        equal_case("adamw", Setup::new(adamw())),
        equal_case("sgd-momentum-clip-grad-norm", Setup { clip_fraction: Some(0.5), ..Setup::new(sgd(0.05, 0.9)) }),
        equal_case(
            "replicate-below-threshold",
            Setup { config: FsdpConfig { replicate_below: 200, ..FsdpConfig::default() }, ..Setup::new(adamw()) },
        ),
        equal_case("accumulate-4-micro-batches", Setup { micro: 4, ..Setup::new(sgd(0.05 / 4.0, 0.0)) }),
        equal_case(
            "bf16-params",
            Setup { config: FsdpConfig { mixed_precision: mp, ..FsdpConfig::default() }, ..Setup::new(sgd(0.05, 0.0)) },
        ),
        checkpoint_case(),
        memory_case(),
    ];
    if world_size >= 4 && world_size % 2 == 0 {
        out.push(equal_case("hsdp", Setup { replicate: Some(2), ..Setup::new(adamw()) }));
    }
    out
}
