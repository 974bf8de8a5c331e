//! `--op-times`: the calls and device time of each kind of fused op
//! (chorus-kernels' [`timing`](chorus_kernels::timing)) in each step of
//! rank 0, as `summary.json`'s `op_times` and a line after the closing one.

use chorus_kernels::timing::{OpKind, OpTime};
use serde_json::{json, Map, Value};

use super::args::TrainArgs;
use super::report::median;
use crate::job::ModelArg;
use crate::usage;

/// `--op-times` times the decoder models' training steps: not the MLP
/// (it calls no fused op), not `--bench`.
pub(super) fn check(args: &TrainArgs) -> anyhow::Result<()> {
    if args.op_times && (args.model() == ModelArg::Mlp || args.bench) {
        return Err(usage("--op-times is for training --model gpt, moe and llama (not the mlp, not --bench)"));
    }
    Ok(())
}

/// The steps a median is taken over: all but the first where there are
/// more (its warm-up), as the throughput's medians.
fn steady<T>(steps: &[T]) -> &[T] {
    if steps.len() > 1 {
        &steps[1..]
    } else {
        steps
    }
}

/// The time of `kind` in one step's record.
fn time_of(step: &[(OpKind, OpTime)], kind: OpKind) -> OpTime {
    step.iter().filter(|(k, _)| *k == kind).map(|(_, t)| *t).next().unwrap_or_default()
}

/// `summary.json`'s `op_times`: null where the run timed no step; else
/// `steps` (the steps timed), `median_step_s` (the median over the steps
/// of all kinds' time in a step) and `kinds`, each kind by its name
/// (every kind, zero where it never ran) with its `calls` and `time_s`
/// over the run, `calls_per_step`, and `median_step_s` (its own median).
/// Medians leave out the first step where there are more.
pub(super) fn summary(steps: &[Vec<(OpKind, OpTime)>]) -> Value {
    if steps.is_empty() {
        return Value::Null;
    }
    let mut kinds = Map::new();
    for kind in OpKind::ALL {
        let each: Vec<OpTime> = steps.iter().map(|s| time_of(s, kind)).collect();
        let calls: usize = each.iter().map(|t| t.calls).sum();
        let per_step: Vec<f64> = each.iter().map(|t| t.time.as_secs_f64()).collect();
        kinds.insert(
            kind.name().into(),
            json!({
                "calls": calls,
                "time_s": per_step.iter().sum::<f64>(),
                "calls_per_step": calls as f64 / steps.len() as f64,
                "median_step_s": median(steady(&per_step)),
            }),
        );
    }
    let totals: Vec<f64> = steps.iter().map(|s| s.iter().map(|(_, t)| t.time.as_secs_f64()).sum()).collect();
    json!({ "steps": steps.len(), "median_step_s": median(steady(&totals)), "kinds": kinds })
}

/// The closing output's line: the kinds that ran, the slowest first, each
/// with its median time in a step and its calls per step; `None` where the
/// run timed no step.
pub(super) fn line(steps: &[Vec<(OpKind, OpTime)>]) -> Option<String> {
    let Value::Object(s) = summary(steps) else { return None };
    let n = steady(steps).len();
    let mut ran: Vec<(&str, f64, f64)> = OpKind::ALL
        .iter()
        .filter_map(|k| {
            let v = &s["kinds"][k.name()];
            let calls = v["calls_per_step"].as_f64().unwrap_or(0.0);
            (calls > 0.0).then(|| (k.name(), v["median_step_s"].as_f64().unwrap_or(0.0), calls))
        })
        .collect();
    if ran.is_empty() {
        return Some(format!("fused ops (rank 0): none ran in {} steps; this model calls none of them", steps.len()));
    }
    ran.sort_by(|a, b| b.1.total_cmp(&a.1));
    let each: Vec<String> = ran
        .iter()
        .map(|(name, t, calls)| {
            let s = if *calls == 1.0 { "" } else { "s" };
            format!("{name} {:.3} ms ({calls} call{s})", t * 1e3)
        })
        .collect();
    let total = s["median_step_s"].as_f64().unwrap_or(0.0);
    Some(format!("fused ops per step (rank 0, median of {n} steps): {:.3} ms: {}", total * 1e3, each.join(", ")))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn step(times: &[(OpKind, usize, u64)]) -> Vec<(OpKind, OpTime)> {
        OpKind::ALL
            .iter()
            .map(|k| {
                let (calls, ms) = times.iter().find(|(t, _, _)| t == k).map_or((0, 0), |(_, c, ms)| (*c, *ms));
                (*k, OpTime { calls, time: Duration::from_millis(ms) })
            })
            .collect()
    }

    #[test]
    fn every_kind_is_summed_and_its_median_leaves_out_the_first_step() {
        // Three steps: the first a slow warm-up.
        let steps = vec![
            step(&[(OpKind::Attention, 2, 100), (OpKind::AttentionBackward, 1, 200)]),
            step(&[(OpKind::Attention, 2, 10), (OpKind::AttentionBackward, 1, 30)]),
            step(&[(OpKind::Attention, 2, 20), (OpKind::AttentionBackward, 1, 40)]),
        ];
        let s = summary(&steps);
        assert_eq!(s["steps"], json!(3));
        let attention = &s["kinds"]["attention"];
        assert_eq!(attention["calls"], json!(6));
        assert_eq!(attention["calls_per_step"], json!(2.0));
        assert!((attention["time_s"].as_f64().unwrap() - 0.130).abs() < 1e-12);
        // The median of 10 and 20 ms, the first step's 100 left out.
        assert!((attention["median_step_s"].as_f64().unwrap() - 0.015).abs() < 1e-12);
        // All kinds: median of 40 and 60 ms.
        assert!((s["median_step_s"].as_f64().unwrap() - 0.050).abs() < 1e-12);
        let names: Vec<&String> = s["kinds"].as_object().unwrap().keys().collect();
        assert_eq!(names.len(), OpKind::ALL.len(), "every kind, the ones that never ran too");
        assert_eq!(
            s["kinds"]["rms_norm"],
            json!({ "calls": 0, "time_s": 0.0, "calls_per_step": 0.0, "median_step_s": 0.0 })
        );
        assert_eq!(
            line(&steps).unwrap(),
            "fused ops per step (rank 0, median of 2 steps): 50.000 ms: attention_backward 35.000 ms (1 call), \
             attention 15.000 ms (2 calls)"
        );
        // One step: its own median.
        assert!((summary(&steps[..1])["kinds"]["attention"]["median_step_s"].as_f64().unwrap() - 0.1).abs() < 1e-12);
    }

    #[test]
    fn no_step_is_null_and_no_op_says_so() {
        assert_eq!(summary(&[]), Value::Null);
        assert_eq!(line(&[]), None);
        let none = vec![step(&[]), step(&[])];
        assert_eq!(line(&none).unwrap(), "fused ops (rank 0): none ran in 2 steps; this model calls none of them");
    }
}
