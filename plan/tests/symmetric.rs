//! Two ranks standing for all (`Ranks::Symmetric`): on small worlds the
//! first and the last rank's plans equal, field for field, what they are
//! when every rank runs a thread of its own — plain FSDP at 1 to 8 ranks
//! with uneven shards, HSDP 2 × 2 and 2 × 4, resharding to 2 after
//! forward, bf16 with f32 reduction, two micro-batches and clipping, CPU
//! offload on a GPU, float8 all-gathers — on NCCL's model of nodes of two
//! GPUs, where the ranks' placement matters; the ranks' placement that
//! breaks the symmetry is refused; and a plan of every rank is bounded.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision, OffloadPolicy, OptimizerKind, Reshard};
use chorus_plan::cost::CostModel;
use chorus_plan::run::{run, GroupSpec, ModelSpec, PlanError, PlanRun, Ranks, RunSpec, MAX_THREADED_RANKS};

/// A decoder of 3 layers whose parameters shard unevenly at 3, 4 and 8 ranks.
fn model() -> ModelSpec {
    let g = |name: &str, params: &[(&str, Vec<usize>)], root| GroupSpec {
        name: name.into(),
        params: params.iter().map(|(n, s)| (format!("{name}.{n}"), s.clone())).collect(),
        root,
    };
    let mut groups = vec![g("root", &[("embed", vec![37, 12]), ("norm", vec![12]), ("head", vec![37, 12])], true)];
    groups.extend((0..3).map(|i| {
        g(&format!("layers.{i}"), &[("attn", vec![12, 12]), ("mlp", vec![30, 12]), ("norm", vec![12])], false)
    }));
    ModelSpec::decoder(groups, 0, 0, common::decoder_work(3, 1e6, 1 << 16)).unwrap()
}

/// NCCL's model of H100s, two to a node: where the ranks sit changes what collectives cost.
fn gpu() -> Arc<dyn CostModel> {
    chorus_plan::gpu::cost_model("h100-sxm", 2).unwrap()
}

fn spec(world: usize) -> RunSpec {
    RunSpec { kernels_reach_host: false, trace_rank: Some(0), ..RunSpec::new(world, 2) }
}

fn plan(model: &ModelSpec, spec: &RunSpec, ranks: Ranks) -> PlanRun {
    let r = run(model, &RunSpec { ranks, ..spec.clone() }, gpu()).unwrap();
    assert_eq!(r.divergence, None);
    r
}

/// The symmetric plan's ranks equal the same ranks of the plan of every rank.
fn symmetric_equals_every_rank(what: &str, spec: RunSpec) {
    let m = model();
    let every = plan(&m, &spec, Ranks::Every);
    let sym = plan(&m, &spec, Ranks::Symmetric);
    let last = spec.world - 1;
    assert_eq!(sym.run_ranks, if spec.world == 1 { vec![0] } else { vec![0, last] }, "{what}");
    assert_eq!(every.run_ranks, (0..spec.world).collect::<Vec<_>>(), "{what}");
    for (i, &rank) in sym.run_ranks.iter().enumerate() {
        let s = sym.ranks[i].as_ref().unwrap();
        let e = every.ranks[rank].as_ref().unwrap();
        assert_eq!(s, e, "{what}: rank {rank}");
        assert_eq!(sym.sequences[i], every.sequences[rank], "{what}: rank {rank}'s collectives");
    }
    let p = sym.ranks[0].as_ref().unwrap();
    assert!(p.step_time_s > 0.0 && p.fsdp_peak_bytes > 0 && !p.trace.is_empty(), "{what}: {p:?}");
}

#[test]
fn plain_fsdp_at_one_to_eight_ranks() {
    for world in [1, 2, 3, 4, 8] {
        symmetric_equals_every_rank(&format!("FSDP at {world}"), spec(world));
    }
}

#[test]
fn hsdp_resharding_mixed_precision_micro_batches_and_clipping() {
    symmetric_equals_every_rank("HSDP 2 × 2", RunSpec { replicate: Some(2), ..spec(4) });
    symmetric_equals_every_rank("HSDP 2 × 4", RunSpec { replicate: Some(2), ..spec(8) });
    let to2 = FsdpConfig { reshard_after_forward: Reshard::To(2), ..FsdpConfig::default() };
    symmetric_equals_every_rank("reshard to 2 of 4", RunSpec { fsdp: to2.clone(), ..spec(4) });
    symmetric_equals_every_rank("HSDP 2 × 4, reshard to 2", RunSpec { fsdp: to2, replicate: Some(2), ..spec(8) });
    symmetric_equals_every_rank(
        "bf16, two micro-batches, clipping, SGD with momentum",
        RunSpec {
            fsdp: common::bf16_f32(),
            micro_batches: 2,
            max_grad_norm: Some(1.0),
            optimizer: OptimizerKind::sgd(1e-2, 0.9),
            ..spec(4)
        },
    );
}

#[test]
fn offload_and_float8() {
    let offload = FsdpConfig { offload: Some(OffloadPolicy::default()), ..FsdpConfig::default() };
    symmetric_equals_every_rank("offload on a GPU", RunSpec { fsdp: offload, ..spec(4) });
    let float8 = FsdpConfig {
        mixed_precision: MixedPrecision {
            param_dtype: Some(DType::BF16),
            reduce_dtype: None,
            output_dtype: None,
            all_gather_dtype: Some(DType::F8E4M3),
        },
        ..FsdpConfig::default()
    };
    symmetric_equals_every_rank("float8 all-gathers", RunSpec { fsdp: float8, ..spec(4) });
}

#[test]
fn groups_placed_differently_on_the_nodes_are_refused_and_every_rank_still_runs() {
    // HSDP 2 × 3 on nodes of two: the shard groups are ranks 0..3 (nodes 0
    // and 1: two and one) and 3..6 (nodes 1 and 2: one and two), alike; the
    // replicate groups {0, 3}, {1, 4}, {2, 5} span nodes alike too. Resharding
    // to 1 of 3 is no split; a world of 6 in nodes of 4 is not alike.
    let m = model();
    let cost = chorus_plan::gpu::cost_model("h100-sxm", 4).unwrap();
    let s = RunSpec { replicate: Some(2), ranks: Ranks::Symmetric, ..spec(6) };
    match run(&m, &s, cost.clone()) {
        Err(PlanError::Asymmetric(why)) => assert!(why.contains("sit differently on the nodes"), "{why}"),
        other => panic!("{other:?}"),
    }
    let every = run(&m, &RunSpec { ranks: Ranks::Every, ..s }, cost).unwrap();
    assert!(every.ranks.iter().all(|r| r.is_ok()));
    // On nodes of two the same layout is alike: the symmetric plan runs.
    let alike = run(&m, &RunSpec { replicate: Some(2), ranks: Ranks::Symmetric, ..spec(6) }, gpu()).unwrap();
    assert_eq!(alike.run_ranks, vec![0, 5]);
}

#[test]
fn a_model_whose_ranks_differ_is_refused_a_symmetric_plan() {
    let mut m = model();
    m.same_on_every_rank = false;
    let s = RunSpec { ranks: Ranks::Symmetric, ..spec(4) };
    assert!(matches!(run(&m, &s, gpu()), Err(PlanError::Asymmetric(_))));
}

#[test]
fn every_rank_runs_at_most_the_thread_limit_and_thousands_run_symmetric() {
    let m = model();
    let s = RunSpec { ranks: Ranks::Every, ..spec(MAX_THREADED_RANKS + 1) };
    match run(&m, &s, gpu()) {
        Err(PlanError::Invalid(why)) => assert!(why.contains(&MAX_THREADED_RANKS.to_string()), "{why}"),
        other => panic!("{other:?}"),
    }
    // 8,192 ranks, two threads: the time and memory of a small plan.
    let t0 = Instant::now();
    let big = plan(
        &m,
        &RunSpec { ranks: Ranks::Symmetric, timeout: Duration::from_secs(60), ..spec(8192) },
        Ranks::Symmetric,
    );
    assert_eq!(big.run_ranks, vec![0, 8191]);
    assert!(big.ranks.iter().all(|r| r.is_ok()));
    println!("8,192 ranks planned in {:.2} s", t0.elapsed().as_secs_f64());
}
