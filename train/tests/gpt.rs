//! The transformer under FSDP through the candle adapter against plain
//! single-process candle on the global batch (candle-nn's own optimizers),
//! at world sizes 1, 2, 4 and HSDP 2 × 2 on simulated ranks.

use std::sync::Arc;

use chorus_collectives::sim::{SimConfig, SimWorld};
use chorus_fsdp::{FsdpConfig, OptimizerKind, Reshard};
use chorus_train::gpt::{init_params, GptConfig};
use chorus_train::gpt_train::{train_gpt, train_plain, GptReport, GptSpec};
use chorus_train::text::{encode, generate, vocab_size, TextData};

fn config() -> GptConfig {
    GptConfig { vocab: vocab_size(), d_model: 16, layers: 2, heads: 2, d_ff: 32, seq_len: 12 }
}

fn spec(batch: usize, steps: u64, optimizer: OptimizerKind) -> GptSpec {
    let cfg = config();
    GptSpec {
        config: cfg,
        init: init_params(&cfg, 3).unwrap(),
        data: Arc::new(TextData::new(encode(&generate(4000, 1)), cfg.seq_len, 7).unwrap()),
        batch,
        steps,
        optimizer,
        fsdp: FsdpConfig::default(),
        replicate: None,
        max_grad_norm: None,
        forward_prefetch: true,
        micro_batches: 1,
        checkpoint_dir: None,
        save_every: 0,
        resume: None,
        allow_nonfinite: false,
    }
}

fn run(ranks: usize, spec: GptSpec) -> Vec<GptReport> {
    let spec = Arc::new(spec);
    SimWorld::run(ranks, SimConfig::default(), move |comm| train_gpt(Arc::new(comm), &spec, &mut |_, _| {}))
        .expect("sim world")
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.expect("rank finished").unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let sorted = |v: &[(String, Vec<f32>)]| {
        let mut v = v.to_vec();
        v.sort_by(|x, y| x.0.cmp(&y.0));
        v
    };
    let (a, b) = (sorted(a), sorted(b));
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.0, y.0);
        assert_eq!(x.1.len(), y.1.len());
        for (u, v) in x.1.iter().zip(&y.1) {
            worst = worst.max((u - v).abs() / (1.0 + v.abs()));
        }
    }
    worst
}

#[test]
fn fsdp_matches_plain_candle_at_1_2_4_ranks_and_hsdp() {
    let global = 8;
    for (optimizer, tol) in [(OptimizerKind::sgd(0.5, 0.0), 1e-6f32), (OptimizerKind::adamw(3e-3, 0.01), 1e-6)] {
        let plain = train_plain(&spec(global, 4, optimizer), 1).unwrap();
        for (ranks, replicate, reshard) in [
            (1, None, Reshard::Yes),
            (2, None, Reshard::Yes),
            (4, None, Reshard::Yes),
            (4, Some(2), Reshard::Yes),
            (4, None, Reshard::No),
            (4, None, Reshard::To(2)),
        ] {
            let mut s = spec(global / ranks, 4, optimizer);
            s.replicate = replicate;
            s.fsdp.reshard_after_forward = reshard;
            let reports = run(ranks, s);
            let first = &reports[0];
            for r in &reports[1..] {
                assert_eq!(r.params, first.params, "ranks disagree");
                assert_eq!(r.losses, first.losses);
            }
            let d = max_diff(&first.params, &plain.params);
            eprintln!("{ranks} {replicate:?} {reshard}: max rel diff {d:e}, losses {:?}", first.losses);
            assert!(
                d <= tol,
                "{optimizer:?} {ranks} ranks hsdp {replicate:?} reshard {reshard}: parameters differ by {d}"
            );
            for (a, b) in first.losses.iter().zip(&plain.losses) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "losses {:?} vs {:?}", first.losses, plain.losses);
            }
            // Something was learned and the parameters moved away from the start.
            assert!(max_diff(&first.params, &spec(1, 0, optimizer).init_values()) > 1e-3);
        }
    }
}

trait InitValues {
    fn init_values(&self) -> Vec<(String, Vec<f32>)>;
}

impl InitValues for GptSpec {
    fn init_values(&self) -> Vec<(String, Vec<f32>)> {
        self.init.iter().map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
    }
}
