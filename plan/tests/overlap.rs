//! Overlap comes out of FSDP's own events, as on a GPU. In rank 0's trace
//! of a 4-layer Llama at 2 ranks (constant rates): no stage computes before
//! its group's all-gather ends, the all-gather two groups ahead runs under
//! each stage's forward (prefetch), every reduce-scatter but the last runs
//! while the compute stream is busy, and when the collectives are slower
//! than the compute the step stretches to their sum.

use crate::common;

use std::sync::Arc;

use chorus_fsdp::OptimizerKind;
use chorus_plan::constant::ConstantRates;
use chorus_plan::run::{run, GroupSpec, ModelSpec, RankPlan, RunSpec};
use chorus_plan::virt::TraceOp;
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::groups;

/// The lanes FSDP creates its streams in (`chorus_plan::run::FSDP_STREAMS`).
const COMPUTE: usize = 0;
const ALL_GATHER: usize = 2;
const REDUCE_SCATTER: usize = 3;
const LAYERS: usize = 4;

fn plan(rates: ConstantRates) -> RankPlan {
    let cfg = LlamaConfig::new(256, 64, 128, LAYERS, 4, 2);
    let g = groups(&cfg).unwrap();
    let specs = g.groups.iter().map(|g| GroupSpec { name: g.name.clone(), params: g.params.clone(), root: g.root });
    // 1 GFLOP forward per stage: 1 ms at 1 TFLOP/s, long against a layer's all-gather.
    let work = common::decoder_work(LAYERS, 1e9, 1 << 20);
    let model = ModelSpec::decoder(specs.collect(), g.embed, g.head, work).unwrap();
    let spec = RunSpec { optimizer: OptimizerKind::adamw(1e-3, 0.1), trace_rank: Some(0), ..RunSpec::new(2, 2) };
    let r = run(&model, &spec, Arc::new(rates)).unwrap();
    assert_eq!(r.divergence, None);
    r.ranks[0].clone().unwrap()
}

fn on(p: &RankPlan, stream: usize) -> Vec<&TraceOp> {
    p.trace.iter().filter(|t| t.stream == stream).collect()
}

fn kernel<'a>(p: &'a RankPlan, name: &str) -> &'a TraceOp {
    p.trace.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name} in the trace"))
}

fn inside(inner: &TraceOp, outer: &TraceOp) -> bool {
    inner.start >= outer.start && inner.end <= outer.end
}

/// Whether the compute stream is busy for all of `op` (its ops run back to back or not at all).
fn hidden(op: &TraceOp, compute: &[&TraceOp]) -> bool {
    let covered: f64 = compute.iter().map(|c| (c.end.min(op.end) - c.start.max(op.start)).max(0.0)).sum();
    covered >= (op.end - op.start) * (1.0 - 1e-9)
}

#[test]
fn prefetch_hides_the_all_gathers_and_the_backward_hides_the_reduce_scatters() {
    let p = plan(ConstantRates::round());
    // The Llama's groups, untied: the embedding's, one per layer, and the
    // root's (final norm and output projection), used in this stage order.
    let stages: Vec<String> = std::iter::once("embed".to_string())
        .chain((0..LAYERS).map(|i| format!("layers.{i}")))
        .chain(std::iter::once("head".to_string()))
        .collect();
    let compute = on(&p, COMPUTE);
    let gathers = on(&p, ALL_GATHER);
    assert!(gathers.len() > stages.len(), "{} all-gathers", gathers.len());
    for (i, stage) in stages.iter().enumerate() {
        let fwd = kernel(&p, &format!("{stage}.fwd"));
        // A stage computes only after its group's parameters are gathered.
        assert!(
            fwd.start >= gathers[i].end,
            "{stage} starts at {} before its all-gather ends at {}",
            fwd.start,
            gathers[i].end
        );
        // Two groups ahead is gathered while this stage computes.
        if let Some(ahead) = gathers.get(i + 2).filter(|_| i + 2 < stages.len()) {
            assert!(
                inside(ahead, fwd),
                "the all-gather of {} {ahead:?} is not under {stage}'s forward {fwd:?}",
                stages[i + 2]
            );
        }
    }
    // Backward: one reduce-scatter per group, the head's first and the
    // embedding's last; every one but the last runs while the compute
    // stream is busy (the next stage's backward and FSDP's copies).
    let scatters: Vec<&TraceOp> = on(&p, REDUCE_SCATTER).into_iter().filter(|t| t.name == "reduce_scatter").collect();
    assert_eq!(scatters.len(), stages.len());
    for (k, rs) in scatters.iter().enumerate().take(stages.len() - 1) {
        assert!(hidden(rs, &compute), "reduce-scatter {k} {rs:?} is exposed");
    }
    assert!(!hidden(scatters[stages.len() - 1], &compute), "the last reduce-scatter has nothing to hide under");
    // What is exposed is the first gather and the last reduce-scatter: a small part of the step.
    let exposed = p.step_time_s - p.compute_busy_s;
    assert!(exposed > 0.0 && exposed < 0.02 * p.step_time_s, "exposed {exposed} of {}", p.step_time_s);
}

#[test]
fn collectives_slower_than_compute_stretch_the_step_to_their_sum() {
    // Collectives 1,000× slower: each layer's all-gather now outlasts a stage's compute.
    let slow = ConstantRates { collective_bytes: 1e6, ..ConstantRates::round() };
    let p = plan(slow);
    let total = |s: usize| on(&p, s).iter().map(|t| t.end - t.start).sum::<f64>();
    let comm = total(ALL_GATHER) + total(REDUCE_SCATTER);
    assert!(comm > 2.0 * p.compute_busy_s, "the case must be communication-bound: {comm} vs {}", p.compute_busy_s);
    // The gathers of one step run one after another on their stream, as do the reduce-scatters.
    assert!(p.step_time_s >= total(ALL_GATHER) && p.step_time_s >= total(REDUCE_SCATTER));
    let fast = plan(ConstantRates::round());
    assert!(p.step_time_s - p.compute_busy_s > 50.0 * (fast.step_time_s - fast.compute_busy_s));
}
