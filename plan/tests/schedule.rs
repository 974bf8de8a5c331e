//! The schedule check on an MoE-style model whose ranks route to different
//! experts: without routed groups their collective sequences diverge, and
//! the plan names the first divergence (and ends) instead of hanging; with
//! [`Fsdp::set_routed_groups`](chorus_fsdp::Fsdp::set_routed_groups) every
//! rank issues the same sequence.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_fsdp::OptimizerKind;
use chorus_plan::run::{run, GroupSpec, ModelSpec, RunSpec, Stage};
use chorus_plan::schedule::first_divergence;

const EXPERTS: usize = 4;

fn group(name: &str, shapes: &[(&str, Vec<usize>)], root: bool) -> GroupSpec {
    let params = shapes.iter().map(|(n, s)| (format!("{name}.{n}"), s.clone())).collect();
    GroupSpec { name: name.to_string(), params, root }
}

/// Groups: root (embedding and head), the MoE layer's gate, its experts, a
/// dense layer. Rank `r` routes its tokens to experts `r % 4` and, on even
/// ranks, `(r + 1) % 4` too: the ranks use different experts, and different numbers of them.
fn moe(routed: bool) -> ModelSpec {
    let mut groups =
        vec![group("root", &[("embed", vec![40, 16])], true), group("moe.gate", &[("w", vec![EXPERTS, 16])], false)];
    groups.extend(
        (0..EXPERTS).map(|e| group(&format!("moe.experts.{e}"), &[("w", vec![24, 16]), ("b", vec![24])], false)),
    );
    groups.push(group("dense", &[("w", vec![16, 16])], false));
    let stages_of = Arc::new(|rank: usize| {
        let mut experts = vec![2 + rank % EXPERTS];
        if rank % 2 == 0 {
            experts.push(2 + (rank + 1) % EXPERTS);
        }
        vec![
            Stage { group: 0, work: common::stage("embed", 1e6, 1024), inner: Vec::new() },
            Stage { group: 1, work: common::stage("moe", 1e6, 1024), inner: experts },
            Stage { group: 2 + EXPERTS, work: common::stage("dense", 1e6, 1024), inner: Vec::new() },
            Stage { group: 0, work: common::stage("head", 1e6, 1024), inner: Vec::new() },
        ]
    });
    let routed = if routed { vec![(1, (2..2 + EXPERTS).collect())] } else { Vec::new() };
    ModelSpec { groups, stages_of, routed, same_on_every_rank: false }
}

fn spec(world: usize) -> RunSpec {
    RunSpec {
        forward_prefetch: false,
        optimizer: OptimizerKind::adamw(1e-3, 0.0),
        kernels_reach_host: false,
        ..RunSpec::new(world, 2)
    }
}

#[test]
fn ranks_routing_to_different_experts_diverge_and_the_first_divergence_is_named() {
    let t0 = Instant::now();
    let plan = run(&moe(false), &spec(4), common::cost()).unwrap();
    // Found at once, not by the 60 s deadline.
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let d = plan.divergence.expect("a divergence");
    assert_eq!(d.group, "root");
    // Forward: embed's all-gather is call 0, the gate's call 1, each rank's first expert's call 2
    // (same shapes on every rank), and call 3 is an even rank's second expert against an odd
    // rank's dense layer: all_gather of 24·16 + 24 = 408 f32 against 16·16 = 256.
    assert_eq!(d.seq, 3, "{d}");
    let calls = [d.called.clone().unwrap_or_default(), d.other_called.clone().unwrap_or_default()];
    assert!(calls.iter().any(|c| c.contains("all_gather(102 x f32)")), "{d}");
    assert!(calls.iter().any(|c| c.contains("all_gather(64 x f32)")), "{d}");
    assert!(plan.ranks.iter().any(|r| r.is_err()));
    // The comparison of the recorded sequences names the same call.
    // The comparison of the recorded sequences names the same call.
    let again = first_divergence(&plan.sequences).expect("the sequences differ");
    assert_eq!((again.group.as_str(), again.seq), ("root", 3), "{again}");
}

#[test]
fn with_routed_groups_every_rank_issues_the_same_collectives() {
    let plan = run(&moe(true), &spec(4), common::cost()).unwrap();
    assert_eq!(plan.divergence, None);
    let seqs: Vec<_> = plan.ranks.iter().map(|r| r.as_ref().unwrap().collectives.clone()).collect();
    assert_eq!(first_divergence(&seqs), None);
    // Every expert is all-gathered on every rank, used or not: 2 + 4 + 2 groups forward.
    assert!(seqs.iter().all(|s| s == &seqs[0]));
    assert!(seqs[0].len() > 2 * (2 + EXPERTS));
}
