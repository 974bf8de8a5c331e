//! Routed groups (parameters some ranks do not use in a step): the MoE test
//! model trains on every rank count without a hang and equals the host
//! reference on the global batch, issuing the same collectives on every
//! rank whatever it routed; the routing rules fail with typed errors; and a
//! group a rank skips without having been declared is still reported as a
//! mismatch, not hidden.

use std::sync::Arc;

use anyhow::{anyhow, ensure};
use chorus_collectives::recorder::{CallState, RecorderOptions};
use chorus_collectives::{CommBackend, CommError, Communicator};
use chorus_devices::ComputeBackend;
use chorus_fsdp::{
    DataParallel, Fsdp, FsdpConfig, FsdpError, OptimizerKind, ParamInit, Reshard, ShardedOptimizer, TrainingState,
};
use chorus_train::rng::SplitMix;

use super::moe::{init_moe, MoeNet, MoeShape};
use super::moe_reference::RefMoe;
use super::parity::max_diff;
use super::reference::RefOpt;
use super::world::own_world;
use crate::{Case, Failure, RankCtx, Requirements};

const SHAPE: MoeShape = MoeShape { d: 6, experts: 4, layers: 2, d_out: 3 };
const SEED: u64 = 11;

/// How one MoE parity case trains.
#[derive(Clone)]
struct MoeSetup {
    /// Rows per rank per micro-batch.
    rows: usize,
    micro: usize,
    steps: usize,
    opt: RefOpt,
    config: FsdpConfig,
}

impl MoeSetup {
    fn new(opt: RefOpt) -> Self {
        MoeSetup { rows: 3, micro: 1, steps: 4, opt, config: FsdpConfig::default() }
    }
}

/// The global batch of `step`.
fn batch(rows: usize, step: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix::new(2000 + step as u64);
    let x = (0..rows * SHAPE.d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let y = (0..rows * SHAPE.d_out).map(|_| rng.uniform(-1.0, 1.0)).collect();
    (x, y)
}

/// The final parameters, and per micro-batch and layer the expert each of
/// this rank's rows was routed to.
type Trained = (Vec<(String, Vec<f32>)>, Vec<Vec<Vec<usize>>>);

/// Trains the MoE model under FSDP on `world`, checking that each step's
/// collectives do not depend on the routing (so every rank issues the same).
fn train_fsdp<C: CommBackend>(world: Arc<Communicator<C>>, s: &MoeSetup) -> Result<Trained, Failure>
where
    C::B: ComputeBackend,
{
    let (rank, n) = (world.rank(), world.size());
    let mut fsdp = Fsdp::new(DataParallel::fsdp(world), s.config.clone())?;
    let net = MoeNet::register(&mut fsdp, SHAPE, init_moe(SHAPE, SEED))?;
    let kind = match s.opt {
        RefOpt::Sgd { lr, momentum } => OptimizerKind::sgd(lr, momentum),
        RefOpt::AdamW { lr, weight_decay } => OptimizerKind::adamw(lr, weight_decay),
    };
    let mut opt = ShardedOptimizer::new(kind);
    let (d, o) = (SHAPE.d, SHAPE.d_out);
    let mut all_routes = Vec::new();
    let per_step_groups = SHAPE.layers * (1 + SHAPE.experts) + 1;
    for step in 0..s.steps {
        let (x, y) = batch(n * s.rows * s.micro, step);
        let before = fsdp.comm_counts();
        for m in 0..s.micro {
            fsdp.set_requires_gradient_sync(m + 1 == s.micro);
            let row = (m * n + rank) * s.rows;
            let (_, routes) =
                net.forward_backward(&mut fsdp, &x[row * d..(row + s.rows) * d], &y[row * o..(row + s.rows) * o])?;
            fsdp.finalize_backward()?;
            all_routes.push(routes);
        }
        let c = fsdp.comm_counts();
        let (ag, rs) = (c.all_gathers - before.all_gathers, c.reduce_scatters - before.reduce_scatters);
        // Every group all-gathers in forward and (resharded) again in
        // backward, and reduce-scatters once per synced micro-batch, used or not.
        let backward_ag = if s.config.reshard_after_forward == Reshard::No { 0 } else { 1 };
        ensure!(
            ag == s.micro * per_step_groups * (1 + backward_ag) && rs == per_step_groups,
            "step {step}: {ag} all-gathers and {rs} reduce-scatters, which depend on the routing"
        );
        opt.step(&mut fsdp)?;
        fsdp.zero_grad();
    }
    let params = fsdp.full_parameters()?;
    fsdp.synchronize()?;
    Ok((params, all_routes))
}

/// What the reference gives: the parameters, per micro-batch and layer the
/// expert of each of `rank`'s rows, and whether some micro-batch had an
/// expert used by one rank's rows and not by another's.
type Reference = (Vec<(String, Vec<f64>)>, Vec<Vec<Vec<usize>>>, bool);

/// Trains the reference on the global batch of `n` ranks.
fn train_reference(s: &MoeSetup, n: usize, rank: usize) -> Reference {
    let mut model = RefMoe::new(SHAPE, SEED);
    let (mut mine, mut ranks_differ) = (Vec::new(), false);
    for step in 0..s.steps {
        let (x, y) = batch(n * s.rows * s.micro, step);
        let (mut grads, routes) = model.grads(&x, &y);
        // Accumulated micro-batch means sum to `micro` times the global mean.
        grads.values_mut().flatten().for_each(|v| *v *= s.micro as f64);
        for m in 0..s.micro {
            let rows_of = |r: usize, l: usize| &routes[l][(m * n + r) * s.rows..(m * n + r + 1) * s.rows];
            mine.push((0..SHAPE.layers).map(|l| rows_of(rank, l).to_vec()).collect());
            for (l, e) in (0..SHAPE.layers).flat_map(|l| (0..SHAPE.experts).map(move |e| (l, e))) {
                let used: Vec<bool> = (0..n).map(|r| rows_of(r, l).contains(&e)).collect();
                ranks_differ |= used.contains(&true) && used.contains(&false);
            }
        }
        model.apply(&grads, s.opt);
    }
    (model.named(), mine, ranks_differ)
}

fn parity_case<C: CommBackend>(name: &str, setup: MoeSetup, tol: f64) -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new(format!("fsdp/routed/moe-parity/{name}"), move |ctx: &RankCtx<'_, C>| {
        let (got, routes) = train_fsdp(own_world(ctx)?, &setup)?;
        let (want, want_routes, ranks_differ) = train_reference(&setup, ctx.size(), ctx.rank());
        ensure!(routes == want_routes, "routing {routes:?}, the reference routes {want_routes:?}");
        ensure!(ctx.size() == 1 || ranks_differ, "no step routed differently across ranks: the case tests nothing");
        let d = max_diff(&got, &want)?;
        ensure!(d <= tol, "max |fsdp - reference| = {d:e} > {tol:e}");
        Ok(())
    })
}

fn sgd(lr: f64, momentum: f64) -> RefOpt {
    RefOpt::Sgd { lr, momentum }
}

/// The routed-group cases for a world of `world_size` ranks.
pub fn cases<C: CommBackend>(world_size: usize) -> Vec<Case<C>>
where
    C::B: ComputeBackend,
{
    let half = (world_size / 2).max(1);
    let even = Requirements { even_world: true, ..Requirements::default() };
    let config = |reshard_after_forward| FsdpConfig { reshard_after_forward, ..FsdpConfig::default() };
    vec![
        parity_case("sgd-momentum", MoeSetup::new(sgd(0.1, 0.9)), 1e-5),
        parity_case(
            "adamw-reshard-after-forward-false",
            MoeSetup { config: config(Reshard::No), ..MoeSetup::new(RefOpt::AdamW { lr: 1e-2, weight_decay: 0.01 }) },
            1e-5,
        ),
        parity_case(
            &format!("reshard-after-forward-{half}"),
            MoeSetup { config: config(Reshard::To(half)), ..MoeSetup::new(sgd(0.1, 0.0)) },
            1e-5,
        )
        .needs(even),
        // No-sync micro-batches: an expert unused in one accumulates nothing.
        parity_case("accumulate-2-micro-batches", MoeSetup { micro: 2, ..MoeSetup::new(sgd(0.05, 0.0)) }, 1e-5),
        // Biases replicated: their all-reduces follow the same fixed order.
        parity_case(
            "replicate-below-threshold",
            MoeSetup {
                config: FsdpConfig { replicate_below: 10, ..FsdpConfig::default() },
                ..MoeSetup::new(sgd(0.1, 0.9))
            },
            1e-5,
        ),
        rules_case(),
        undeclared_skip_case().min_world(2).needs(Requirements { detects_mismatch: true, ..Requirements::default() }),
    ]
}

fn param(name: &str, shape: &[usize]) -> ParamInit {
    let n: usize = shape.iter().product();
    ParamInit { name: name.into(), shape: shape.to_vec(), values: (0..n).map(|i| i as f32 * 0.5 - 1.0).collect() }
}

fn expect_state<T>(r: Result<T, FsdpError>, what: &str) -> Result<(), Failure> {
    match r {
        Err(FsdpError::State { .. }) => Ok(()),
        Err(e) => Err(anyhow!("{what}: expected a state error, got {e}")),
        Ok(_) => Err(anyhow!("{what}: expected a state error, got success")),
    }
}

/// What the model must declare, and the typed errors for breaking it. Every
/// rank breaks the same rule at the same point (no collective is issued
/// before a refusal), so the world stays in step.
fn rules_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/routed/rules", |ctx: &RankCtx<'_, C>| {
        let mut f = Fsdp::new(DataParallel::fsdp(own_world(ctx)?), FsdpConfig::default())?;
        let parent = f.add_group("parent", vec![param("r", &[2, 4])], false)?;
        let a = f.add_group("a", vec![param("a", &[4, 4])], false)?;
        let b = f.add_group("b", vec![param("b", &[4, 4])], false)?;
        let other = f.add_group("other", vec![param("o", &[3])], false)?;
        for (bad, what) in [
            (vec![], "no routed groups"),
            (vec![a, a], "a group listed twice"),
            (vec![parent], "the parent routed under itself"),
            (vec![9], "a missing group"),
        ] {
            ensure!(f.set_routed_groups(parent, &bad).is_err(), "set_routed_groups accepted {what}");
        }
        f.set_routed_groups(parent, &[a, b])?;
        ensure!(f.routed_groups(parent)? == [a, b], "routed groups {:?}", f.routed_groups(parent)?);
        ensure!(f.set_routed_groups(other, &[a]).is_err(), "a group routed under two parents");
        ensure!(f.set_forward_prefetch(a, vec![b]).is_err(), "a routed group's forward prefetch");
        ensure!(f.set_backward_prefetch(b, vec![a]).is_err(), "a routed group's backward prefetch");
        let before = f.comm_counts();
        expect_state(f.pre_forward(a), "a routed forward outside its parent's")?;
        ensure!(f.comm_counts() == before, "a refused hook issued a collective");
        f.pre_forward(parent)?;
        // The parent's pre-forward gathered itself and both alternatives.
        ensure!(f.comm_counts().all_gathers == before.all_gathers + 3, "{:?}", f.comm_counts());
        f.pre_forward(a)?;
        f.post_forward(a)?;
        expect_state(f.pre_forward(a), "a routed group's second forward in one forward of its parent")?;
        f.post_forward(parent)?;
        ensure!(f.training_state(b)? == TrainingState::Idle, "the unused group after its parent's forward");
        expect_state(f.pre_backward(b), "a routed backward outside its parent's")?;
        f.pre_backward(parent)?;
        f.pre_backward(b)?;
        f.post_backward(b)?;
        ensure!(f.training_state(b)? == TrainingState::PostBackward, "b after its post_backward");
        let rs = f.comm_counts().reduce_scatters;
        f.post_backward(parent)?;
        // Both alternatives (a unused in backward) and the parent.
        ensure!(f.comm_counts().reduce_scatters == rs + 3, "{:?}", f.comm_counts());
        f.finalize_backward()?;
        // The parent's post-backward never called (FSDP2's end-of-backward
        // callback case): finalize runs it, the alternatives reduced first.
        f.pre_forward(parent)?;
        f.post_forward(parent)?;
        f.pre_backward(parent)?;
        f.pre_backward(a)?;
        let rs = f.comm_counts().reduce_scatters;
        f.finalize_backward()?;
        ensure!(f.comm_counts().reduce_scatters == rs + 3, "finalize: {:?}", f.comm_counts());
        ensure!(f.training_state(a)? == TrainingState::Idle, "a after finalize");
        f.synchronize()?;
        Ok(())
    })
}

/// A group that one rank skips without having declared it routed: the
/// collective sequences differ, and the backend (or the checked wrapper)
/// reports the mismatch on every rank instead of hanging; each rank's flight
/// recorder holds the diverging all-gather (its own group's size) as failed.
fn undeclared_skip_case<C: CommBackend>() -> Case<C>
where
    C::B: ComputeBackend,
{
    Case::new("fsdp/routed/undeclared-skip-is-reported", |ctx: &RankCtx<'_, C>| {
        let comm = ctx.comm.split(Some(0), ctx.rank() as i64)?.ok_or_else(|| anyhow!("split returned nothing"))?;
        // A ring of its own, whatever the environment says about recording.
        let options = RecorderOptions { entries: 16, dump_dir: None, track_starts: false };
        let world = Arc::new(Communicator::with_recorder(comm.into_backend(), &options));
        let n = world.size();
        let mut f = Fsdp::new(DataParallel::fsdp(world.clone()), FsdpConfig::default())?;
        // Different shard sizes at every world size, so the calls differ in count.
        let a = f.add_group("a", vec![param("a", &[6, 4])], false)?;
        let b = f.add_group("b", vec![param("b", &[5, 3])], false)?;
        let shard = if ctx.rank() == 0 { 5usize.div_ceil(n) * 3 } else { 6usize.div_ceil(n) * 4 };
        ctx.host_barrier()?;
        let run = |f: &mut Fsdp<C>| -> Result<(), FsdpError> {
            if ctx.rank() != 0 {
                f.pre_forward(a)?;
                f.post_forward(a)?;
            }
            f.pre_forward(b)?;
            f.post_forward(b)?;
            f.synchronize()
        };
        match run(&mut f) {
            Err(FsdpError::Comm(CommError::Mismatch { .. })) => {}
            Err(e) => return Err(anyhow!("expected a Mismatch, got {e}")),
            Ok(()) => return Err(anyhow!("a rank skipped an undeclared group and nothing was reported")),
        }
        let record = world.flight_record().ok_or_else(|| anyhow!("no flight record with recording on"))?;
        // The communicator's first launch is where the sequences diverged.
        let last = record.entries.first().ok_or_else(|| anyhow!("the flight recorder holds no launch"))?;
        let call = last.calls.first().ok_or_else(|| anyhow!("a launch without calls"))?;
        ensure!(
            call.op == "all_gather" && (call.count as usize == shard || call.count as usize == shard * n),
            "the recorder's first call is {} of {} elements; this rank's diverging all-gather has {shard} per rank",
            call.op,
            call.count
        );
        ensure!(
            last.state == CallState::Failed,
            "the recorder does not show the diverging all-gather as failed: {last:?}"
        );
        Ok(())
    })
    .fresh()
}
