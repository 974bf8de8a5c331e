//! The host's cost of issuing operations in the virtual run
//! (`CostModel::host_cost`), against closed forms on a 1-rank plan whose
//! only time is the model's kernels or the host's, and the cpu rates file's
//! refusals.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use chorus_devices::MemorySpace;
use chorus_plan::constant::ConstantRates;
use chorus_plan::cost::{CollectiveShape, CostModel, HostCost, Issuer, KernelCost};
use chorus_plan::cpu_model::{CpuModel, CpuRates, RatesError};
use chorus_plan::run::{run, GroupSpec, ModelSpec, RunSpec};

const LAYERS: usize = 3;
/// Each stage's forward GEMM: 1 ms at 1 TFLOP/s (its backward 2 ms).
const FLOPS: f64 = 1e9;

/// Constant rates where only GEMMs take time (at `flops`), with a host cost per issuer.
#[derive(Debug)]
struct HostModel {
    flops: f64,
    model: HostCost,
    fsdp: HostCost,
    hook: HostCost,
    collective: HostCost,
    fsdp_calls: AtomicUsize,
}

impl HostModel {
    fn new(model: HostCost, fsdp: HostCost) -> Arc<HostModel> {
        Arc::new(HostModel {
            flops: 1e12,
            model,
            fsdp,
            hook: HostCost::default(),
            collective: HostCost::default(),
            fsdp_calls: AtomicUsize::new(0),
        })
    }
    fn rates(&self) -> ConstantRates {
        ConstantRates {
            flops: self.flops,
            memory_bytes: f64::INFINITY,
            collective_latency: 0.0,
            collective_bytes: f64::INFINITY,
            peak_flops: None,
        }
    }
}

impl CostModel for HostModel {
    fn kernel_seconds(&self, k: &KernelCost) -> f64 {
        self.rates().kernel_seconds(k)
    }
    fn collective_seconds(&self, s: &CollectiveShape) -> f64 {
        self.rates().collective_seconds(s)
    }
    fn copy_seconds(&self, bytes: u64, from: MemorySpace, to: MemorySpace) -> f64 {
        self.rates().copy_seconds(bytes, from, to)
    }
    fn peak_flops(&self) -> Option<f64> {
        None
    }
    fn host_cost(&self, issuer: Issuer) -> HostCost {
        match issuer {
            Issuer::Model => self.model,
            Issuer::Fsdp | Issuer::Optimizer => {
                self.fsdp_calls.fetch_add(1, Ordering::Relaxed);
                self.fsdp
            }
            Issuer::Hook => self.hook,
            Issuer::Collective => self.collective,
            Issuer::CopyPiece => HostCost::default(),
        }
    }
}

fn model_issuing(issues: u32) -> ModelSpec {
    let g = |name: &str, root| GroupSpec { name: name.into(), params: vec![(format!("{name}.w"), vec![8, 8])], root };
    let mut groups = vec![g("root", true)];
    groups.extend((0..LAYERS).map(|i| g(&format!("layers.{i}"), false)));
    let mut work = common::decoder_work(LAYERS, FLOPS, 1 << 10);
    for k in work.iter_mut().flat_map(|s| s.forward.iter_mut().chain(s.backward.iter_mut())) {
        k.issues = issues;
    }
    ModelSpec::decoder(groups, 0, 0, work).unwrap()
}

fn model() -> ModelSpec {
    model_issuing(1)
}

/// Rank 0's measured step (the second of `steps`) with `cost`.
fn rank0(model: &ModelSpec, cost: Arc<HostModel>, steps: usize) -> chorus_plan::run::RankPlan {
    let plan = run(model, &RunSpec::new(1, steps), cost).unwrap();
    plan.ranks[0].clone().unwrap()
}

fn step(cost: Arc<HostModel>, steps: usize) -> f64 {
    rank0(&model(), cost, steps).step_time_s
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-9)
}

/// Each stage's kernels: forward FLOPS, backward 2 × FLOPS (`common::stage`).
const STAGES: f64 = (LAYERS + 2) as f64;
const KERNEL_TIME: f64 = STAGES * 3.0 * FLOPS / 1e12;

#[test]
fn without_a_host_cost_the_step_is_its_kernels() {
    let t = step(HostModel::new(HostCost::default(), HostCost::default()), 2);
    assert!(close(t, KERNEL_TIME), "{t} vs {KERNEL_TIME}");
}

#[test]
fn a_host_that_runs_the_kernels_adds_its_issue_time_to_each() {
    let c = 250e-6;
    let on_host = HostCost { issue_s: c, runs_on_host: true };
    let t = step(HostModel::new(on_host, HostCost::default()), 2);
    // Each of the 2 × stages kernels waits for the host to issue it, and the host for its end.
    let expected = KERNEL_TIME + 2.0 * STAGES * c;
    assert!(close(t, expected), "{t} vs {expected}");
    // Issued, not run, by the host: the stream stays ahead, only the first issue shows.
    let queued = HostCost { issue_s: c, runs_on_host: false };
    let t = step(HostModel::new(queued, HostCost::default()), 2);
    assert!(close(t, KERNEL_TIME + c), "{t} vs {}", KERNEL_TIME + c);
}

/// A GPU whose host issues each kernel in more time than the kernel runs:
/// every kernel waits for its issue, the stream idles between them, and the
/// step is the host's issue time and the last kernel (the embedding's
/// backward, 2 ms). An operation issued `issues` times costs that many issues.
#[test]
fn a_host_slower_than_the_gpu_makes_the_step_its_issue_time() {
    let c = 5e-3;
    let kernels = 2.0 * STAGES;
    for issues in [1, 3] {
        let queued = HostModel::new(HostCost { issue_s: c, runs_on_host: false }, HostCost::default());
        let p = rank0(&model_issuing(issues), queued, 2);
        let issued = kernels * issues as f64 * c;
        assert!(close(p.host_issue_s, issued), "{} vs {issued}", p.host_issue_s);
        let expected = issued + 2.0 * FLOPS / 1e12;
        assert!(close(p.step_time_s, expected), "{issues} issues: {} vs {expected}", p.step_time_s);
        assert!(close(p.compute_busy_s, KERNEL_TIME) && p.host_issue_s > p.compute_busy_s, "{p:?}");
    }
}

/// FSDP's hooks cost their own host time, each call: per micro-batch the
/// root's pre-forward and post-forward, each layer's pre- and
/// post-forward and pre- and post-backward, the root's pre-backward at
/// the head and at the embedding and its post-backward, and
/// `finalize_backward`: 4 · layers + 6. Collectives cost theirs per call.
#[test]
fn hooks_and_collectives_cost_the_host_per_call() {
    let h = 7e-6;
    let mut hooks = HostModel::new(HostCost::default(), HostCost::default());
    Arc::get_mut(&mut hooks).unwrap().hook = HostCost { issue_s: h, runs_on_host: false };
    let p = rank0(&model(), hooks, 2);
    let expected = (4 * LAYERS + 6) as f64 * h;
    assert!(close(p.host_issue_s, expected), "{} vs {expected}", p.host_issue_s);
    let c = 11e-6;
    let calls =
        |steps| rank0(&model(), HostModel::new(HostCost::default(), HostCost::default()), steps).collectives.len();
    let per_step = (calls(2) - calls(1)) as f64;
    assert!(per_step > 0.0);
    let mut collectives = HostModel::new(HostCost::default(), HostCost::default());
    Arc::get_mut(&mut collectives).unwrap().collective = HostCost { issue_s: c, runs_on_host: false };
    let p = rank0(&model(), collectives, 2);
    assert!(close(p.host_issue_s, per_step * c), "{} vs {per_step} × {c}", p.host_issue_s);
}

#[test]
fn fsdp_issue_time_adds_once_per_operation_it_issues() {
    let f = 3e-6;
    // The operations FSDP issues in the measured step: two steps' less one step's.
    let count = |steps| {
        let cost = HostModel::new(HostCost::default(), HostCost::default());
        step(cost.clone(), steps);
        cost.fsdp_calls.load(Ordering::Relaxed)
    };
    let ops = (count(2) - count(1)) as f64;
    assert!(ops > 0.0);
    // Nothing takes device time: the step is the host's issue time alone.
    let mut host_only = HostModel::new(HostCost::default(), HostCost { issue_s: f, runs_on_host: true });
    Arc::get_mut(&mut host_only).unwrap().flops = f64::INFINITY;
    let t = step(host_only, 2);
    assert!(close(t, ops * f), "{t} vs {ops} × {f}");
}

#[test]
fn the_cpu_model_runs_the_models_kernels_on_the_host() {
    let one = CpuModel::for_ranks(1);
    assert_eq!(one.host_cost(Issuer::Model), HostCost { issue_s: 0.0, runs_on_host: true });
    // One rank has a core for its streams; two ranks on two cores do not.
    assert!(!one.host_cost(Issuer::Fsdp).runs_on_host);
    assert!(CpuModel::for_ranks(2).host_cost(Issuer::Collective).runs_on_host);
    // A batched copy is one job on the cpu device; its hooks cost what their operations cost.
    assert_eq!(one.host_cost(Issuer::CopyPiece), HostCost::default());
    assert_eq!(one.host_cost(Issuer::Hook), HostCost::default());
    assert_eq!(one.host_cost(Issuer::Optimizer), one.host_cost(Issuer::Fsdp));
    // The PyTorch GPU model keeps the default.
    let gpu = chorus_plan::gpu::cost_model("h100-sxm", 8).unwrap();
    for issuer in [Issuer::Model, Issuer::Fsdp, Issuer::CopyPiece, Issuer::Optimizer, Issuer::Hook, Issuer::Collective]
    {
        assert_eq!(gpu.host_cost(issuer), HostCost::default());
    }
}

fn refused(text: &str) -> RatesError {
    match CpuRates::from_json(text) {
        Ok(r) => panic!("accepted {r:?}"),
        Err(e) => e,
    }
}

/// The frozen rates as JSON with `edit` applied.
fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v = serde_json::to_value(CpuRates::frozen()).unwrap();
    edit(&mut v);
    v.to_string()
}

#[test]
fn a_rates_file_round_trips_and_every_bad_number_is_refused() {
    let frozen = CpuRates::frozen();
    assert_eq!(CpuRates::from_json(&serde_json::to_string(&frozen).unwrap()).unwrap(), frozen);
    assert_eq!(CpuModel::from_rates(&frozen, 2), CpuModel::for_ranks(2));

    assert!(matches!(refused("not json"), RatesError::Json(_)));
    assert!(matches!(refused("{}"), RatesError::Json(_)));
    assert!(matches!(refused(&edited(|v| v["extra"] = 1.into())), RatesError::Json(_)));
    assert!(matches!(refused(&edited(|v| v["sim_busbw"] = "fast".into())), RatesError::Json(_)));
    // Out of f64's range: serde_json refuses it rather than reading infinity.
    assert!(matches!(
        refused(&edited(|v| v["sim_call_s"] = 1.into()).replace("\"sim_call_s\":1", "\"sim_call_s\":1e999")),
        RatesError::Json(_)
    ));
    for (field, value) in
        [("sim_call_s", 0.0), ("sim_busbw", -1.0), ("host_copy_bytes_per_s", 0.0), ("fsdp_op_s", -1e-6)]
    {
        let e = refused(&edited(|v| v[field] = value.into()));
        assert!(matches!(&e, RatesError::Value { field: f, .. } if f == field), "{field}: {e}");
    }
    for field in
        ["gemm_flops_per_s", "attention_flops_per_s", "memory_bytes_per_s", "cached_bytes_per_s", "op_overhead_s"]
    {
        let e = refused(&edited(|v| v["two_threads"][field] = 0.into()));
        assert!(e.to_string().contains(&format!("two_threads.{field}")), "{e}");
    }
    assert!(refused(&edited(|v| v["cores"] = 0.into())).to_string().contains("cores"));
    assert!(refused(&edited(|v| v["cores"] = 100_000.into())).to_string().contains("cores"));
    assert!(matches!(refused(&edited(|v| v["cores"] = (-2).into())), RatesError::Json(_)));
    // FSDP's time may be zero (not measured).
    assert!(CpuRates::from_json(&edited(|v| v["fsdp_op_s"] = 0.into())).is_ok());
}
