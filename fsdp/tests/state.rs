//! The state machine, the collectives each step issues, and memory, checked
//! from outside FSDP: states through the public accessors, collectives by a
//! counting communicator wrapped around the sim backend, memory by the cpu
//! device's exact statistics.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chorus_collectives::backend::{Call, Capabilities, CommBackend, OpKind};
use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_collectives::{Communicator, Mesh};
use chorus_devices::{Backend, DType, Device, Scalar, Stream, StreamExt};
use chorus_fsdp::layout::GroupLayout;
use chorus_fsdp::mlp::{init_layers, Mlp};
use chorus_fsdp::{
    DataParallel, Fsdp, FsdpConfig, FsdpError, OptimizerKind, ParamInit, Reshard, ShardedOptimizer, ShardedState,
    TrainingState,
};

type Counts = Arc<Mutex<HashMap<(OpKind, usize), usize>>>;

/// Counts every call by kind and communicator size, then delegates.
struct Counting<C> {
    inner: C,
    counts: Counts,
}

impl<C: CommBackend> CommBackend for Counting<C> {
    type B = C::B;
    const NAME: &'static str = C::NAME;
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn device(&self) -> &<C::B as Backend>::Device {
        self.inner.device()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn launch(&self, calls: Vec<Call<'_, C::B>>, stream: &<C::B as Backend>::Stream) -> chorus_collectives::Result<()> {
        let mut counts = self.counts.lock().unwrap();
        for c in &calls {
            *counts.entry((c.kind.kind(), self.inner.size())).or_default() += 1;
        }
        drop(counts);
        self.inner.launch(calls, stream)
    }
    fn split(&self, color: Option<u32>, key: i64) -> chorus_collectives::Result<Option<Self>> {
        Ok(self.inner.split(color, key)?.map(|inner| Counting { inner, counts: self.counts.clone() }))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn async_error(&self) -> Option<chorus_collectives::CommError> {
        self.inner.async_error()
    }
}

type World = Communicator<Counting<chorus_collectives::sim::SimComm>>;

fn run<T: Send + 'static>(
    world: usize,
    body: impl Fn(Arc<World>, Counts) -> anyhow::Result<T> + Send + Sync + 'static,
) -> anyhow::Result<Vec<T>> {
    let results = SimWorld::run(world, SimConfig::default(), move |comm| {
        let counts = Counts::default();
        let comm = Arc::new(Communicator::new(Counting { inner: comm.into_backend(), counts: counts.clone() }));
        body(comm, counts)
    })?;
    results.into_iter().map(|r| r.map_err(anyhow::Error::from).and_then(|v| v)).collect()
}

const DIMS: [usize; 4] = [16, 32, 32, 8];

fn one_step<C: CommBackend>(fsdp: &mut Fsdp<C>, mlp: &Mlp, rank: usize) -> anyhow::Result<()> {
    let x: Vec<f32> = (0..4 * DIMS[0]).map(|i| ((i + rank) % 7) as f32 * 0.1).collect();
    let y: Vec<f32> = (0..4 * DIMS[3]).map(|i| (i % 5) as f32 * 0.1).collect();
    mlp.forward_backward(fsdp, &x, &y)?;
    fsdp.finalize_backward()?;
    fsdp.synchronize()?;
    Ok(())
}

#[test]
fn each_step_issues_one_all_gather_per_group_each_way_and_one_reduce_scatter() -> anyhow::Result<()> {
    for (reshard, forward_ag, backward_ag) in [(Reshard::Yes, 3, 3), (Reshard::No, 3, 0), (Reshard::To(2), 3, 3)] {
        let per_rank = run(4, move |comm, counts| {
            let config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
            let mut fsdp = Fsdp::new(DataParallel::fsdp(comm.clone()), config)?;
            let mlp = Mlp::register(&mut fsdp, init_layers(&DIMS, 1))?;
            counts.lock().unwrap().clear();
            one_step(&mut fsdp, &mlp, comm.rank())?;
            let c = counts.lock().unwrap().clone();
            Ok((c, fsdp.comm_counts()))
        })?;
        for (counts, own) in per_rank {
            let get = |k, n| counts.get(&(k, n)).copied().unwrap_or(0);
            match reshard {
                Reshard::To(k) => {
                    assert_eq!(get(OpKind::AllGather, 4), forward_ag, "{reshard}");
                    assert_eq!(
                        get(OpKind::AllGather, k),
                        backward_ag,
                        "{reshard}: backward gathers on the smaller world"
                    );
                }
                _ => assert_eq!(get(OpKind::AllGather, 4), forward_ag + backward_ag, "{reshard}"),
            }
            assert_eq!(get(OpKind::ReduceScatter, 4), 3, "{reshard}");
            assert_eq!(get(OpKind::AllReduce, 4), 0, "{reshard}");
            assert_eq!((own.all_gathers, own.reduce_scatters, own.all_reduces), (forward_ag + backward_ag, 3, 0));
        }
    }
    Ok(())
}

#[test]
fn hsdp_reduce_scatters_over_shard_then_all_reduces_over_replicate() -> anyhow::Result<()> {
    let per_rank = run(4, |comm, counts| {
        let mesh = Mesh::new(&comm, &[("replicate", 2), ("shard", 2)])?;
        let mut fsdp = Fsdp::new(DataParallel::hsdp(&mesh)?, FsdpConfig::default())?;
        let mlp = Mlp::register(&mut fsdp, init_layers(&DIMS, 1))?;
        counts.lock().unwrap().clear();
        one_step(&mut fsdp, &mlp, comm.rank())?;
        // With the all-reduce deferred, only reduce-scatters happen.
        fsdp.set_requires_all_reduce(false);
        let before = counts.lock().unwrap().clone();
        one_step(&mut fsdp, &mlp, comm.rank())?;
        let after = counts.lock().unwrap().clone();
        Ok((before, after))
    })?;
    for (first, second) in per_rank {
        assert_eq!(first.get(&(OpKind::AllGather, 2)), Some(&6));
        assert_eq!(first.get(&(OpKind::ReduceScatter, 2)), Some(&3));
        assert_eq!(first.get(&(OpKind::AllReduce, 2)), Some(&3));
        assert_eq!(second.get(&(OpKind::ReduceScatter, 2)), Some(&6));
        assert_eq!(second.get(&(OpKind::AllReduce, 2)), Some(&3));
    }
    Ok(())
}

fn param(name: &str, shape: &[usize]) -> ParamInit {
    let n: usize = shape.iter().product();
    ParamInit { name: name.into(), shape: shape.to_vec(), values: (0..n).map(|i| i as f32 - 3.0).collect() }
}

fn is_state_error<T: std::fmt::Debug>(r: Result<T, FsdpError>, event: &str) -> bool {
    matches!(r, Err(FsdpError::State { event: e, .. }) if e == event)
}

#[test]
fn hooks_move_through_fsdp2_states_and_illegal_transitions_are_errors() -> anyhow::Result<()> {
    for reshard in [Reshard::Yes, Reshard::No, Reshard::To(1)] {
        run(2, move |comm, _| {
            let config = FsdpConfig { reshard_after_forward: reshard, ..FsdpConfig::default() };
            let mut f = Fsdp::new(DataParallel::fsdp(comm.clone()), config)?;
            let w = param("w", &[5, 3]);
            let expected = w.values.clone();
            let g = f.add_group("g", vec![w], false)?;
            let state = |f: &Fsdp<_>| (f.training_state(g).unwrap(), f.sharded_state(g).unwrap());
            assert_eq!(state(&f), (TrainingState::Idle, ShardedState::Sharded));
            assert!(is_state_error(f.param(g, 0), "parameter access"));
            assert!(is_state_error(f.post_forward(g), "post_forward"));
            assert!(is_state_error(f.post_backward(g), "post_backward"));

            f.pre_forward(g)?;
            assert_eq!(state(&f), (TrainingState::Forward, ShardedState::Unsharded));
            assert_eq!(f.compute_stream().read_vec::<f32>(f.param(g, 0)?)?, expected);
            assert!(is_state_error(f.pre_forward(g), "pre_forward"));
            assert!(is_state_error(f.pre_backward(g), "pre_backward"));
            assert!(is_state_error(f.post_backward(g), "post_backward"));
            assert!(is_state_error(f.grad(g, 0), "gradient access"));

            f.post_forward(g)?;
            let after_forward = match reshard {
                Reshard::Yes => ShardedState::Sharded,
                Reshard::No => ShardedState::Unsharded,
                Reshard::To(_) => ShardedState::ShardedPostForward,
            };
            assert_eq!(state(&f), (TrainingState::Idle, after_forward));

            f.pre_backward(g)?;
            assert_eq!(state(&f), (TrainingState::PreBackward, ShardedState::Unsharded));
            assert_eq!(f.compute_stream().read_vec::<f32>(f.param(g, 0)?)?, expected);
            f.compute_stream().fill(f.grad(g, 0)?, Scalar::Float(1.0))?;
            f.pre_backward(g)?; // a second pre-backward is a no-op, as in FSDP2
            f.post_backward(g)?;
            assert_eq!(state(&f), (TrainingState::PostBackward, ShardedState::Sharded));
            assert!(is_state_error(f.post_backward(g), "post_backward"));
            assert!(is_state_error(f.pre_forward(g), "pre_forward"));
            f.finalize_backward()?;
            assert_eq!(state(&f), (TrainingState::Idle, ShardedState::Sharded));

            // Without reshard-after-backward the next forward needs no all-gather.
            f.set_reshard_after_backward(false);
            f.pre_forward(g)?;
            f.post_forward(g)?;
            f.pre_backward(g)?;
            f.post_backward(g)?;
            assert_eq!(f.sharded_state(g)?, ShardedState::Unsharded);
            f.finalize_backward()?;
            let before = f.comm_counts().all_gathers;
            f.pre_forward(g)?;
            assert_eq!(f.comm_counts().all_gathers, before);
            f.post_forward(g)?;
            f.synchronize()?;
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn async_unshard_and_explicit_prefetch() -> anyhow::Result<()> {
    run(2, |comm, counts| {
        let mut f = Fsdp::new(DataParallel::fsdp(comm.clone()), FsdpConfig::default())?;
        let a = f.add_group("a", vec![param("a", &[4, 2])], false)?;
        let b = f.add_group("b", vec![param("b", &[3, 3])], false)?;
        let handle = f.unshard(a, true)?;
        assert_eq!(f.sharded_state(a)?, ShardedState::Sharded);
        f.wait_unshard(handle)?;
        assert_eq!(f.sharded_state(a)?, ShardedState::Unsharded);
        assert_eq!(f.compute_stream().read_vec::<f32>(f.param(a, 0)?)?, param("a", &[4, 2]).values);
        // Explicit forward prefetch: a's pre-forward all-gathers b too, once.
        f.set_forward_prefetch(a, vec![b])?;
        assert!(f.set_forward_prefetch(a, vec![7]).is_err());
        counts.lock().unwrap().clear();
        f.pre_forward(a)?;
        f.post_forward(a)?;
        assert_eq!(counts.lock().unwrap().get(&(OpKind::AllGather, 2)), Some(&1));
        f.pre_forward(b)?;
        assert_eq!(counts.lock().unwrap().get(&(OpKind::AllGather, 2)), Some(&1));
        assert_eq!(f.compute_stream().read_vec::<f32>(f.param(b, 0)?)?, param("b", &[3, 3]).values);
        f.post_forward(b)?;
        f.synchronize()?;
        Ok(())
    })?;
    Ok(())
}

/// FSDP's bytes at each point of a step of groups without model compute, per
/// the schedule in docs/architecture.md ("Memory bound").
struct Bound {
    sharded_after_step: usize,
    sharded_after_zero_grad: usize,
    peak: usize,
    floor: usize,
}

fn bound(layouts: &[(GroupLayout, usize)], world: usize) -> Bound {
    let f32s = 4;
    let s: Vec<usize> = layouts.iter().map(|(l, _)| l.shard_numel * f32s).collect();
    let n: Vec<usize> = layouts.iter().map(|(_, n)| n * f32s).collect();
    let ag: Vec<usize> = s.iter().map(|s| s * world).collect();
    let l = s.len();
    // master + momentum
    let base: usize = s.iter().map(|s| 2 * s).sum();
    let mut peak = 0;
    for i in 0..l {
        let prev_ag = if i > 0 { ag[i - 1] } else { 0 };
        // forward: the previous group's all-gather output lives until this group's copy-out
        peak = peak.max(base + (prev_ag + ag[i]).max(ag[i] + n[i]));
    }
    for i in (0..l).rev() {
        // backward: gradients and reduce-scatter outputs of later groups exist
        let done: usize = (i + 1..l).map(|j| 2 * s[j]).sum();
        let rs_in_later = if i + 1 < l { ag[i + 1] } else { 0 };
        let prefetch = if i > 0 { ag[i - 1] } else { 0 };
        let pre = (rs_in_later + ag[i] + n[i]).max(rs_in_later + n[i] + n[i] + prefetch);
        let post = n[i] + ag[i] + 2 * s[i] + prefetch;
        peak = peak.max(base + done + pre.max(post));
    }
    let floor = base + (0..l).map(|i| 2 * n[i]).max().unwrap_or(0);
    Bound { sharded_after_step: base + s.iter().sum::<usize>(), sharded_after_zero_grad: base, peak, floor }
}

#[test]
fn peak_memory_stays_within_the_zero3_bound_and_returns_to_the_sharded_footprint() -> anyhow::Result<()> {
    for world in [2, 4] {
        run(world, move |comm, _| {
            let mut f = Fsdp::new(DataParallel::fsdp(comm.clone()), FsdpConfig::default())?;
            let shapes: [&[usize]; 4] = [&[64, 48], &[96, 64], &[33, 96], &[50, 33]];
            let mut layouts = Vec::new();
            for (i, shape) in shapes.iter().enumerate() {
                f.add_group(&format!("g{i}"), vec![param(&format!("p{i}"), shape)], false)?;
                layouts.push((GroupLayout::new(&[(shape.to_vec(), 0)], world)?, shape.iter().product::<usize>()));
            }
            let b = bound(&layouts, world);
            let mut opt = ShardedOptimizer::new(OptimizerKind::sgd(0.1, 0.9));
            let dev = f.device().clone();
            for step in 0..2 {
                f.synchronize()?;
                dev.reset_peak_memory();
                let sample = |f: &Fsdp<Counting<chorus_collectives::sim::SimComm>>| -> anyhow::Result<()> {
                    // Statistics follow handles (stream-ordered), so this only
                    // checks that no hook left failed work behind.
                    f.synchronize()?;
                    Ok(())
                };
                for g in 0..4 {
                    f.pre_forward(g)?;
                    sample(&f)?;
                    f.post_forward(g)?;
                    sample(&f)?;
                }
                for g in (0..4).rev() {
                    f.pre_backward(g)?;
                    sample(&f)?;
                    f.compute_stream().fill(f.grad(g, 0)?, Scalar::Float(0.5))?;
                    f.post_backward(g)?;
                    sample(&f)?;
                }
                f.finalize_backward()?;
                opt.step(&mut f)?;
                f.synchronize()?;
                let peak = dev.memory_stats().peak_bytes;
                if step == 1 {
                    assert!(peak as f64 <= b.peak as f64 * 1.05, "world {world}: peak {peak} > bound {}", b.peak);
                    assert!(peak >= b.floor, "world {world}: peak {peak} below the floor {}", b.floor);
                }
                assert_eq!(dev.memory_stats().bytes_in_use, b.sharded_after_step, "world {world} step {step}");
                f.zero_grad();
                assert_eq!(dev.memory_stats().bytes_in_use, b.sharded_after_zero_grad);
            }
            let _ = DType::F32;
            Ok(())
        })?;
    }
    Ok(())
}
