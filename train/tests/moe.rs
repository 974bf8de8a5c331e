//! The mixture-of-experts transformer under FSDP (each expert a routed
//! group, each rank routing its own tokens) against plain single-process
//! candle on the global batch, where every expert computes every token and
//! the routing masks: at 1, 2 and 3 ranks, with and without recompute,
//! SGD and AdamW, and a step where a rank routes no token to an expert that
//! another rank uses.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use chorus_fsdp::OptimizerKind;
use chorus_fsdp_candle::Recompute;
use chorus_train::decoder::{train_plain, train_sharded, Data, TrainReport, TrainSpec};
use chorus_train::models::gpt::GptConfig;
use chorus_train::models::moe::{init_params, Moe, MoeConfig, MoeModel, MAX_EXPERTS};
use chorus_train::text::{encode, generate, vocab_size, TextData};
use common::{max_diff, on_sim_ranks, unwrap_ranks};

type MoeSpec = TrainSpec<MoeModel>;

fn config(experts: usize, seq_len: usize) -> MoeConfig {
    MoeConfig { base: GptConfig { vocab: vocab_size(), d_model: 16, layers: 2, heads: 2, d_ff: 16, seq_len }, experts }
}

fn spec(cfg: MoeConfig, batch: usize, steps: u64, optimizer: OptimizerKind) -> MoeSpec {
    let data = Arc::new(Data::Text(TextData::new(encode(&generate(4000, 1)), cfg.base.seq_len, 7).unwrap()));
    let model = MoeModel { config: cfg, init: init_params(&cfg, 3).unwrap() };
    MoeSpec { collect_params: true, ..MoeSpec::new(model, data, batch, steps, optimizer) }
}

fn run(ranks: usize, spec: MoeSpec) -> Vec<TrainReport> {
    let spec = Arc::new(spec);
    unwrap_ranks(on_sim_ranks(ranks, move |comm| train_sharded(comm, &spec, &mut |_, _| {})))
}

/// Per rank, per layer: how many of the rank's step-0 tokens the initial
/// model routes to each expert (the plain model computes the routing).
fn step0_usage(s: &MoeSpec, ranks: usize) -> Vec<Vec<Vec<usize>>> {
    let tensors: HashMap<_, _> = s.model.init.iter().cloned().collect();
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let moe = Moe::new(s.model.config, vb).unwrap();
    let seq = s.data.seq_len();
    (0..ranks)
        .map(|r| {
            let (x, _) = s.data.rows(0, r * s.batch, s.batch);
            let ids = Tensor::from_vec(x, (s.batch, seq), &Device::Cpu).unwrap();
            let (_, routes) = moe.forward_routed(&ids).unwrap();
            routes
                .iter()
                .map(|choice| {
                    let mut used = vec![0; s.model.config.experts];
                    choice.iter().for_each(|&e| used[e as usize] += 1);
                    used
                })
                .collect()
        })
        .collect()
}

/// Whether some rank routes no token to an expert of a layer that another
/// rank routes tokens to (the case FSDP2 hangs on).
fn some_rank_skips_a_used_expert(usage: &[Vec<Vec<usize>>]) -> bool {
    let (layers, experts) = (usage[0].len(), usage[0][0].len());
    (0..layers).any(|l| (0..experts).any(|e| usage.iter().any(|u| u[l][e] == 0) && usage.iter().any(|u| u[l][e] > 0)))
}

/// Checks the ranks agree, the sharded run equals plain candle within
/// `tol` (parameters, relative) and 1e-4 (losses), and something moved.
fn check(reports: &[TrainReport], plain: &chorus_train::decoder::PlainReport, s: &MoeSpec, tol: f32, what: &str) {
    let first = &reports[0];
    for r in &reports[1..] {
        assert_eq!(r.params, first.params, "{what}: ranks disagree");
        assert_eq!(r.losses, first.losses, "{what}: ranks disagree");
        // The collectives never depend on the routing.
        assert_eq!(r.comm_counts.all_gathers, first.comm_counts.all_gathers, "{what}");
        assert_eq!(r.comm_counts.reduce_scatters, first.comm_counts.reduce_scatters, "{what}");
    }
    let d = max_diff(&first.params, &plain.params);
    eprintln!("{what}: max rel diff {d:e}, losses {:?}", first.losses);
    assert!(d <= tol, "{what}: parameters differ from plain candle by {d}");
    for (a, b) in first.losses.iter().zip(&plain.losses) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{what}: losses {:?} vs {:?}", first.losses, plain.losses);
    }
    let init: Vec<(String, Vec<f32>)> =
        s.model.init.iter().map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
    assert!(max_diff(&first.params, &init) > 1e-3, "{what}: nothing was learned");
}

#[test]
fn fsdp_matches_plain_candle_at_1_2_3_ranks() {
    let (global, steps, cfg) = (6, 4, config(8, 4));
    for optimizer in [OptimizerKind::sgd(0.5, 0.0), OptimizerKind::adamw(3e-3, 0.01)] {
        let plain = train_plain(&spec(cfg, global, steps, optimizer), 1).unwrap();
        for (ranks, recompute) in [
            (1, Recompute::All),
            (2, Recompute::All),
            (2, Recompute::Nothing),
            (3, Recompute::All),
            (3, Recompute::Nothing),
        ] {
            let mut s = spec(cfg, global / ranks, steps, optimizer);
            s.recompute = recompute.clone();
            if ranks > 1 {
                // Otherwise this case would not exercise the routed groups.
                assert!(some_rank_skips_a_used_expert(&step0_usage(&s, ranks)), "{ranks} ranks route alike");
            }
            let reports = run(ranks, s.clone());
            check(&reports, &plain, &s, 2e-6, &format!("{optimizer:?} {ranks} ranks recompute {recompute}"));
            // The root, and per layer the block and its eight experts.
            assert_eq!(reports[0].groups, 1 + 2 * 9);
        }
    }
}

/// FSDP policies that change when the routed groups' collectives run:
/// accumulated micro-batches (the experts' gradients summed over two
/// routings before one reduce-scatter), reshard-after-forward false and to
/// a smaller world, no forward prefetch, HSDP.
#[test]
fn fsdp_policies_with_routed_experts_match_plain_candle() {
    let (global, steps, cfg) = (8, 3, config(8, 4));
    let optimizer = OptimizerKind::adamw(3e-3, 0.01);
    let plain = train_plain(&spec(cfg, global, steps, optimizer), 1).unwrap();
    type Policy = (&'static str, usize, fn(&mut MoeSpec));
    let policies: &[Policy] = &[
        ("2 micro-batches", 2, |s| s.micro_batches = 2),
        ("reshard after forward false", 2, |s| s.fsdp.reshard_after_forward = chorus_fsdp::Reshard::No),
        ("reshard after forward to 2 of 4", 4, |s| s.fsdp.reshard_after_forward = chorus_fsdp::Reshard::To(2)),
        ("no forward prefetch", 4, |s| s.forward_prefetch = false),
        ("HSDP 2 x 2", 4, |s| s.replicate = Some(2)),
    ];
    for (name, ranks, apply) in policies {
        let mut s = spec(cfg, global / ranks, steps, optimizer);
        apply(&mut s);
        let reports = run(*ranks, s.clone());
        check(&reports, &plain, &s, 2e-6, name);
    }
}

/// Eight experts, four tokens a rank: at step 0 rank 0 routes no token to
/// an expert rank 1 uses; the step finishes (no hang) and ends where plain
/// candle does.
#[test]
fn a_rank_that_routes_no_token_to_an_expert_still_finishes_the_step() {
    let cfg = config(8, 4);
    let optimizer = OptimizerKind::adamw(3e-3, 0.0);
    let s = spec(cfg, 1, 3, optimizer);
    let usage = step0_usage(&s, 2);
    let skipped = (0..2).any(|l| (0..8).any(|e| usage[0][l][e] == 0 && usage[1][l][e] > 0));
    assert!(skipped, "rank 0 uses every expert rank 1 uses: {usage:?}");
    let plain = train_plain(&spec(cfg, 2, 3, optimizer), 1).unwrap();
    let reports = run(2, s.clone());
    check(&reports, &plain, &s, 2e-6, "8 experts, 4 tokens a rank");
}

#[test]
fn the_expert_count_is_checked() {
    for experts in [0, MAX_EXPERTS + 1] {
        let err = config(experts, 8).validate().unwrap_err();
        assert!(err.contains("experts"), "{err}");
    }
    assert!(config(1, 8).validate().is_ok() && config(MAX_EXPERTS, 8).validate().is_ok());
    // One expert is the transformer with a gated MLP: every token routes to it.
    assert_eq!(config(1, 8).active_params(), config(1, 8).num_params());
    let c = config(4, 8);
    assert_eq!(c.num_params() - c.active_params(), 2 * 3 * 2 * 16 * 16);
}
