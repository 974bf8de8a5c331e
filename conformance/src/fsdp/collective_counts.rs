//! The collectives FSDP issues per step: FSDP2's count of all-gathers,
//! reduce-scatters and all-reduces for each reshard policy, and HSDP's.

use anyhow::ensure;
use chorus_collectives::backend::OpKind;
use chorus_collectives::{CommBackend, Mesh};
use chorus_devices::ComputeBackend;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, Reshard};
use chorus_train::mlp::{init_layers, Mlp};

use super::world::counted;
use crate::{Case, Failure, RankCtx};

const DIMS: [usize; 4] = [16, 32, 32, 8];

fn one_step<C: CommBackend>(fsdp: &mut Fsdp<C>, mlp: &Mlp, rank: usize) -> Result<(), Failure>
where
    C::B: ComputeBackend,
{
    let x: Vec<f32> = (0..4 * DIMS[0]).map(|i| ((i + rank) % 7) as f32 * 0.1).collect();
    let y: Vec<f32> = (0..4 * DIMS[3]).map(|i| (i % 5) as f32 * 0.1).collect();
    mlp.forward_backward(fsdp, &x, &y)?;
    fsdp.finalize_backward()?;
    fsdp.synchronize()?;
    Ok(())
}

pub(super) fn counts_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/collectives-per-step", |ctx: &RankCtx<'_, C>| {
        let n = ctx.size();
        let half = (n / 2).max(1);
        let mut modes = vec![(Reshard::Yes, 3, 3), (Reshard::No, 3, 0)];
        if n % 2 == 0 && half < n {
            modes.push((Reshard::To(half), 3, 3));
        }
        for (reshard, forward_ag, backward_ag) in modes {
            let (world, counts) = counted(ctx)?;
            let config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
            let mut fsdp = Fsdp::new(DataParallel::fsdp(world.clone()), config)?;
            let mlp = Mlp::register(&mut fsdp, init_layers(&DIMS, 1))?;
            counts.clear();
            one_step(&mut fsdp, &mlp, world.rank())?;
            let get = |k| counts.get(k, n);
            match reshard {
                Reshard::To(k) => {
                    ensure!(
                        get(OpKind::AllGather) == forward_ag,
                        "{reshard}: forward all-gathers {}",
                        get(OpKind::AllGather)
                    );
                    ensure!(
                        counts.get(OpKind::AllGather, k) == backward_ag,
                        "{reshard}: backward all-gathers on {k} ranks"
                    );
                }
                _ => ensure!(
                    get(OpKind::AllGather) == forward_ag + backward_ag,
                    "reshard {reshard}: {} all-gathers, expected {}",
                    get(OpKind::AllGather),
                    forward_ag + backward_ag
                ),
            }
            // At one rank the gradients are the reduce-scatter's result: FSDP
            // counts the three reductions and issues no collective for them.
            let issued_rs = if n == 1 { 0 } else { 3 };
            ensure!(
                get(OpKind::ReduceScatter) == issued_rs,
                "{reshard}: {} reduce-scatters, expected {issued_rs}",
                get(OpKind::ReduceScatter)
            );
            ensure!(get(OpKind::AllReduce) == 0, "{reshard}: {} all-reduces", get(OpKind::AllReduce));
            let own = fsdp.comm_counts();
            ensure!((own.all_gathers, own.reduce_scatters) == (forward_ag + backward_ag, 3), "FSDP counted {own:?}");
        }
        Ok(())
    })
}

pub(super) fn hsdp_counts_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/hsdp-collectives-per-step", |ctx: &RankCtx<'_, C>| {
        let (world, counts) = counted(ctx)?;
        let shard = world.size() / 2;
        let mesh = Mesh::new(&world, &[("replicate", 2), ("shard", shard)])?;
        let mut fsdp = Fsdp::new(DataParallel::hsdp(&mesh)?, FsdpConfig::default())?;
        let mlp = Mlp::register(&mut fsdp, init_layers(&DIMS, 1))?;
        counts.clear();
        one_step(&mut fsdp, &mlp, world.rank())?;
        ensure!(
            counts.get(OpKind::AllGather, shard) == 6,
            "all-gathers over shard: {}",
            counts.get(OpKind::AllGather, shard)
        );
        ensure!(counts.get(OpKind::ReduceScatter, shard) == 3, "reduce-scatters over shard");
        ensure!(
            counts.get(OpKind::AllReduce, 2) == 3,
            "all-reduces over replicate: {}",
            counts.get(OpKind::AllReduce, 2)
        );
        // Deferred all-reduce: reduce-scatters only.
        fsdp.set_requires_all_reduce(false);
        counts.clear();
        one_step(&mut fsdp, &mlp, world.rank())?;
        ensure!(
            counts.get(OpKind::ReduceScatter, shard) == 3 && counts.get(OpKind::AllReduce, 2) == 0,
            "deferred step"
        );
        Ok(())
    })
}
