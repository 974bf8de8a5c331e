//! Same code, exact counts: the planner's FSDP memory peaks per rank (device
//! and host) equal the ones `chorus train`'s loop measures on simulated
//! ranks (its report's `peak_memory_bytes` and `peak_host_memory_bytes`,
//! which `summary.json` writes), and its per-rank collective sequence (op,
//! dtype, count, bytes, communicator) equals the flight recorder's record
//! of the real run. HSDP's communicators are compared in `exact_hsdp.rs`.

use crate::common;
use crate::train;

use chorus_devices::DType;
use chorus_fsdp::{FsdpConfig, MixedPrecision, OffloadPolicy, OptimizerKind, Reshard};
use chorus_plan::constant::ConstantRates;
use chorus_plan::cost::HOST_STEP_BYTES_PER_S;
use chorus_plan::run::{run, ModelSpec, RankPlan, RunSpec};
use chorus_train::decoder::TrainSpec;
use chorus_train::models::DecoderGroups;
use train::{check, gpt_spec, llama_spec};

#[test]
fn the_transformer_at_1_2_4_and_8_ranks() {
    for ranks in [1, 2, 4, 8] {
        let (groups, layers, spec) = gpt_spec(ranks);
        check(ranks, &groups, layers, spec, None);
    }
}

#[test]
fn the_llama_at_1_2_4_and_8_ranks() {
    for ranks in [1, 2, 4, 8] {
        let (groups, layers, spec) = llama_spec(ranks, false);
        check(ranks, &groups, layers, spec, None);
    }
}

fn mixed(param: DType, reduce: Option<DType>, all_gather: Option<DType>) -> MixedPrecision {
    MixedPrecision { param_dtype: Some(param), reduce_dtype: reduce, output_dtype: None, all_gather_dtype: all_gather }
}

/// bf16 parameters with f32 reduction, no reshard after forward, two
/// micro-batches, clipping, a tied Llama and SGD with momentum: every
/// setting that changes what FSDP allocates or issues.
#[test]
fn the_llama_with_mixed_precision_accumulation_and_clipping() {
    for ranks in [2, 4] {
        let (groups, layers, spec) = llama_spec(ranks, true);
        let fsdp = FsdpConfig {
            reshard_after_forward: Reshard::No,
            mixed_precision: mixed(DType::BF16, Some(DType::F32), None),
            ..FsdpConfig::default()
        };
        let spec = TrainSpec {
            fsdp,
            micro_batches: 2,
            max_grad_norm: Some(1.0),
            optimizer: OptimizerKind::sgd(1e-2, 0.9),
            ..spec
        };
        check(ranks, &groups, layers, spec, None);
    }
}

/// Each rank's padded f32 shard bytes of every parameter, from the shapes:
/// sharded on the first dimension over `shard_world` ranks (rows padded to
/// a multiple of it), or whole where it has fewer than `replicate_below`
/// elements.
fn shard_bytes(groups: &DecoderGroups, shard_world: usize, replicate_below: usize) -> usize {
    let params = groups.groups.iter().flat_map(|g| &g.params);
    params
        .map(|(_, shape)| {
            let numel: usize = shape.iter().product();
            let rest: usize = shape[1..].iter().product();
            4 * if numel < replicate_below { numel } else { shape[0].div_ceil(shard_world) * rest }
        })
        .sum()
}

/// The measured gradients: every rank's f32 shards of every parameter.
fn assert_gradients(plans: &[RankPlan], device: usize, host: usize, what: &str) {
    for p in plans {
        assert_eq!((p.gradient_bytes, p.host_gradient_bytes), (device, host), "rank {}: {what}", p.rank);
    }
}

/// CPU offload (`chorus train --offload`): the masters, gradients and
/// optimizer state in host memory; the device and host peaks both equal
/// the real run's, and the gradients are in host memory.
#[test]
fn offload_of_the_transformer_and_the_llama() {
    let offload = FsdpConfig { offload: Some(OffloadPolicy::default()), ..FsdpConfig::default() };
    for ranks in [1, 2] {
        let (groups, layers, spec) = gpt_spec(ranks);
        let (plans, _) = check(ranks, &groups, layers, TrainSpec { fsdp: offload.clone(), ..spec }, None);
        assert!(plans.iter().all(|p| p.host_peak_bytes > 0));
        assert_gradients(&plans, 0, shard_bytes(&groups, ranks, 0), "gpt offloaded");
        let (groups, layers, spec) = llama_spec(ranks, false);
        let fsdp = FsdpConfig { mixed_precision: mixed(DType::BF16, Some(DType::F32), None), ..offload.clone() };
        let spec = TrainSpec { fsdp, max_grad_norm: Some(1.0), ..spec };
        let (plans, _) = check(ranks, &groups, layers, spec, None);
        assert_gradients(&plans, 0, shard_bytes(&groups, ranks, 0), "llama offloaded");
    }
}

/// Float8 all-gathers (`--all-gather-dtype float8`): the amax all-reduces
/// (MAX) and the e4m3 all-gathers, with the peak, equal the real run's.
#[test]
fn float8_all_gathers_of_the_transformer_and_the_llama() {
    let fsdp = |param| FsdpConfig { mixed_precision: mixed(param, None, Some(DType::F8E4M3)), ..FsdpConfig::default() };
    for ranks in [2, 4] {
        let (groups, layers, spec) = gpt_spec(ranks);
        let (plans, real) = check(ranks, &groups, layers, TrainSpec { fsdp: fsdp(DType::F32), ..spec }, None);
        let (groups, layers, spec) = llama_spec(ranks, true);
        check(ranks, &groups, layers, TrainSpec { fsdp: fsdp(DType::BF16), ..spec }, None);
        // The path is taken: e4m3 all-gathers, and the MAX all-reduces of
        // their scales, at the positions where the real run issued them.
        let calls = &plans[0].collectives;
        assert!(calls.iter().any(|c| c.op == "all_gather" && c.dtype == "f8e4m3"), "{calls:?}");
        let max: Vec<&str> = real[0]
            .reduce_ops
            .iter()
            .zip(calls)
            .filter(|(r, _)| r.as_deref() == Some("max"))
            .map(|(_, c)| c.op.as_str())
            .collect();
        assert!(!max.is_empty() && max.iter().all(|op| *op == "all_reduce"), "{max:?}: {:?}", real[0].reduce_ops);
    }
}

/// Parameters below a size replicated (`--replicate-below`): their
/// gradients all-reduced, whole on every rank.
#[test]
fn replicated_small_parameters() {
    let below = 100;
    let fsdp = FsdpConfig { replicate_below: below, ..FsdpConfig::default() };
    let (groups, layers, spec) = llama_spec(2, false);
    let (plans, _) = check(2, &groups, layers, TrainSpec { fsdp: fsdp.clone(), ..spec }, None);
    assert_gradients(&plans, shard_bytes(&groups, 2, below), 0, "llama replicate-below");
    let (groups, layers, spec) = gpt_spec(2);
    check(2, &groups, layers, TrainSpec { fsdp, ..spec }, None);
}

/// The breakdown's gradients are measured (what `zero_grad` frees): they
/// equal the padded f32 shards from the shapes, whatever the reduce dtype.
#[test]
fn the_measured_gradients_are_the_padded_f32_shards() {
    for ranks in [1, 2, 4] {
        let (groups, layers, spec) = llama_spec(ranks, false);
        let (plans, _) = check(ranks, &groups, layers, spec, None);
        assert_gradients(&plans, shard_bytes(&groups, ranks, 0), 0, "f32");
    }
    let (groups, layers, spec) = gpt_spec(4);
    let fsdp = FsdpConfig { mixed_precision: mixed(DType::BF16, Some(DType::BF16), None), ..FsdpConfig::default() };
    let (plans, _) = check(4, &groups, layers, TrainSpec { fsdp, replicate: Some(2), ..spec }, None);
    assert_gradients(&plans, shard_bytes(&groups, 2, 0), 0, "bf16 reduce under HSDP 2 × 2");
}

/// On a GPU (kernels cannot reach host memory) an offloaded optimizer
/// steps on the host: AdamW reads the f32 masters, gradients and both
/// moments and writes back the masters and moments, 7 bytes of traffic per
/// shard byte, priced at the host's bandwidth and part of the step.
#[test]
fn the_host_optimizer_step_of_an_offloaded_gpu_run_is_priced() {
    let (groups, layers, spec) = llama_spec(2, false);
    let spec =
        TrainSpec { fsdp: FsdpConfig { offload: Some(OffloadPolicy::default()), ..FsdpConfig::default() }, ..spec };
    let model = ModelSpec::decoder(
        train::groups_of(&groups),
        groups.embed,
        groups.head,
        common::decoder_work(layers, 1e6, 1 << 20),
    )
    .unwrap();
    let gpu = RunSpec { kernels_reach_host: false, ..train::run_spec(2, &spec) };
    let plan = run(&model, &gpu, common::cost()).unwrap();
    let expected = 7.0 * shard_bytes(&groups, 2, 0) as f64 / HOST_STEP_BYTES_PER_S;
    for p in plan.ranks.iter().map(|p| p.as_ref().unwrap()) {
        assert!(
            (p.host_step_s - expected).abs() <= 1e-12 * expected,
            "rank {}: {} s, not {expected} s",
            p.rank,
            p.host_step_s
        );
        assert!(p.step_time_s > p.host_step_s, "rank {}: {p:?}", p.rank);
    }
    // The cpu device steps in place: nothing on the host; the same bytes as
    // kernels at the memory rate. Nothing else differs (the offload's
    // staging takes one path on every device; no clipping, no float8), and
    // the step is the last thing a step does, so the steps differ by the
    // two prices of those bytes.
    let cpu = run(&model, &train::run_spec(2, &spec), common::cost()).unwrap();
    let device_s = 7.0 * shard_bytes(&groups, 2, 0) as f64 / ConstantRates::round().memory_bytes;
    for (g, c) in plan.ranks.iter().zip(&cpu.ranks) {
        let (g, c) = (g.as_ref().unwrap(), c.as_ref().unwrap());
        assert_eq!(c.host_step_s, 0.0);
        let d = c.step_time_s - g.step_time_s;
        assert!((d - (device_s - expected)).abs() < 1e-9 * device_s, "rank {}: {d} s", g.rank);
    }
}
