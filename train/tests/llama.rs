//! The Llama under FSDP through the candle adapter against plain
//! single-process candle on the global batch (candle-nn's own optimizers),
//! at world sizes 1, 2, 4 and HSDP 2 × 2 on simulated ranks, with grouped-
//! query attention, tied and untied heads, and the FSDP policies that apply
//! (reshard-after-forward, prefetch, micro-batches, clipping); and the
//! deferred initialisation: the same parameters at every world size.

use crate::common;

use std::sync::Arc;

use chorus_devices::DType;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, MixedPrecision, OptimizerKind, Reshard};
use chorus_fsdp_candle::Recompute;
use chorus_train::decoder::{train_plain, train_sharded, Data, TokenRows, TrainReport, TrainSpec};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::{self, init_params, materialize, LlamaModel};
use chorus_train::npy::Tokens;
use common::{max_diff, on_sim_ranks, unwrap_ranks};

fn config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        tie_word_embeddings: tied,
        head_dim: 6,
        rope_theta: 500.0,
        rms_norm_eps: 1e-5,
        ..LlamaConfig::new(40, 16, 24, 2, 4, 2)
    }
}

/// 21 rows of 9 ids from a small generator (rows wrap around at step 3 with a global batch of 8).
type LlamaSpec = TrainSpec<LlamaModel>;

fn data(global: usize) -> Data {
    let (rows, cols) = (21, 9);
    let ids = (0..rows * cols).map(|i| ((i * 7919 + i / 3) % 40) as u32).collect();
    Data::Tokens(TokenRows::new(Tokens::from_ids(rows, cols, ids).unwrap(), 40, global).unwrap())
}

fn spec(tied: bool, global: usize, ranks: usize, steps: u64, optimizer: OptimizerKind) -> LlamaSpec {
    let cfg = Arc::new(config(tied));
    // The tests compare every trained parameter: each rank gathers them all.
    let model = LlamaModel { config: cfg.clone(), init: init_params(&cfg, 5) };
    let s = LlamaSpec::new(model, Arc::new(data(global)), global / ranks, steps, optimizer);
    LlamaSpec { collect_params: true, ..s }
}

fn run(ranks: usize, spec: LlamaSpec) -> Vec<TrainReport> {
    let spec = Arc::new(spec);
    unwrap_ranks(on_sim_ranks(ranks, move |comm| train_sharded(comm, &spec, &mut |_, _| {})))
}

#[test]
fn fsdp_matches_plain_candle_at_1_2_4_ranks_and_hsdp() {
    let global = 8;
    for tied in [false, true] {
        for optimizer in [OptimizerKind::sgd(0.5, 0.0), OptimizerKind::adamw(3e-3, 0.01)] {
            let mut plain_spec = spec(tied, global, 1, 4, optimizer);
            plain_spec.max_grad_norm = Some(0.5);
            let plain = train_plain(&plain_spec, 1).unwrap();
            assert!(plain.losses.iter().all(|l| l.is_finite()));
            assert!(plain.losses[3] < plain.losses[0], "training lowers the loss: {:?}", plain.losses);
            let one_layer = || Recompute::Groups(vec!["model.layers.1".into()]);
            for (ranks, replicate, reshard, micro, recompute) in [
                (1, None, Reshard::Yes, 1, Recompute::All),
                (2, None, Reshard::Yes, 1, Recompute::All),
                (4, None, Reshard::Yes, 1, Recompute::All),
                (4, Some(2), Reshard::Yes, 1, Recompute::All),
                (4, None, Reshard::No, 2, Recompute::All),
                (4, None, Reshard::To(2), 1, Recompute::All),
                (1, None, Reshard::Yes, 1, Recompute::Nothing),
                (2, None, Reshard::No, 2, Recompute::Nothing),
                (4, Some(2), Reshard::Yes, 1, one_layer()),
            ] {
                let mut s = spec(tied, global, ranks, 4, optimizer);
                s.replicate = replicate;
                s.fsdp.reshard_after_forward = reshard;
                s.micro_batches = micro;
                s.max_grad_norm = Some(0.5);
                s.recompute = recompute.clone();
                let reports = run(ranks, s);
                let first = &reports[0];
                // Untied as torchtitan groups it: the embedding, each layer, norm + head; tied: the root and each layer.
                assert_eq!(first.groups, if tied { 3 } else { 4 }, "tied {tied}: groups");
                // Stages per step: the root's two (embedding, head) and one per layer.
                let stages_recomputed = match &recompute {
                    Recompute::All => 4,
                    Recompute::Nothing => 0,
                    Recompute::Groups(_) => 1,
                };
                assert_eq!(first.adapter.recomputed, stages_recomputed * 4 * micro, "{recompute}: stages recomputed");
                for r in &reports[1..] {
                    assert_eq!(r.params, first.params, "ranks disagree");
                    assert_eq!(r.losses, first.losses);
                }
                for (a, b) in first.losses.iter().zip(&plain.losses) {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "tied {tied}, {ranks} ranks: losses {:?} vs {:?}",
                        first.losses,
                        plain.losses
                    );
                }
                let d = max_diff(&first.params, &plain.params);
                assert!(
                    d < 2e-5,
                    "tied {tied}, {optimizer:?}, {ranks} ranks {replicate:?} {reshard}: params differ by {d}"
                );
            }
        }
    }
}

/// Every rank's shard of the deferred init, all-gathered, at 1, 2, 3
/// (padded) and 4 ranks, equals the whole tensors the sources give at once.
#[test]
fn init_is_the_same_at_every_world_size() {
    let cfg = Arc::new(config(false));
    let whole: Vec<(String, Vec<f32>)> = materialize(&init_params(&cfg, 11))
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    // Sharded on dim 0, and on the last dim (a source asked for columns), with 64-element tensors replicated.
    for (ranks, last_dim) in [(1, false), (2, false), (3, false), (4, false), (3, true)] {
        let c = cfg.clone();
        let got = on_sim_ranks(ranks, move |comm| {
            let config = if last_dim {
                FsdpConfig {
                    shard_placement: Some(Arc::new(|_: &str, _: &[usize]| -1)),
                    replicate_below: 65,
                    ..FsdpConfig::default()
                }
            } else {
                FsdpConfig::default()
            };
            let fsdp = Fsdp::new(DataParallel::fsdp(comm), config).unwrap();
            let m = llama::shard(fsdp, c.clone(), init_params(&c, 11), false).unwrap();
            m.model.with_fsdp(|f| f.full_parameters()).unwrap().unwrap()
        });
        for g in got {
            let mut g = g;
            g.sort_by(|a, b| a.0.cmp(&b.0));
            let mut w = whole.clone();
            w.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(g, w, "{ranks} ranks, last dim {last_dim}");
        }
    }
    // transformers' distribution: normal(0, 0.02) weights, norms at one; another seed differs.
    let other = materialize(&init_params(&cfg, 12)).unwrap();
    for ((name, v), (_, o)) in whole.iter().zip(&other) {
        let o = o.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        if name.ends_with("norm.weight") {
            assert!(v.iter().all(|x| *x == 1.0), "{name}");
            continue;
        }
        assert_ne!(v, &o, "{name}: the seed changes the weights");
        let n = v.len() as f64;
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / n;
        let std = (v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        // Tolerances of five standard errors.
        assert!(mean.abs() < 5.0 * 0.02 / n.sqrt(), "{name}: mean {mean}");
        assert!((std - 0.02).abs() < 5.0 * 0.02 / (2.0 * n).sqrt(), "{name}: std {std}");
    }
}

#[test]
fn the_padding_row_starts_at_zero() {
    let cfg = LlamaConfig { pad_token_id: Some(3), ..config(false) };
    let params = materialize(&init_params(&cfg, 0)).unwrap();
    let embed = params[0].1.to_vec2::<f32>().unwrap();
    assert!(embed[3].iter().all(|x| *x == 0.0));
    assert!(embed[2].iter().any(|x| *x != 0.0) && embed[4].iter().any(|x| *x != 0.0));
}

#[test]
fn token_rows_follow_the_global_batch_formula_and_reject_bad_data() {
    let tokens = Tokens::from_ids(5, 3, (0..15).collect()).unwrap();
    let d = Data::Tokens(TokenRows::new(tokens.clone(), 15, 4).unwrap());
    // Step 1, global batch 4: rows (4 + k) mod 5 = 4, 0, 1, 2; rank 1 of 2 takes k = 2, 3.
    let (x, y) = d.rows(1, 2, 2);
    assert_eq!(x, vec![3, 4, 6, 7]);
    assert_eq!(y, vec![4, 5, 7, 8]);
    assert!(TokenRows::new(tokens.clone(), 14, 4).unwrap_err().contains("token id 14 at row 4, column 2"));
    assert!(TokenRows::new(tokens.clone(), 15, 6).unwrap_err().contains("fewer than one global batch"));
    assert!(TokenRows::new(Tokens::from_ids(5, 1, (0..5).collect()).unwrap(), 15, 4).is_err());
}

/// A run saved at 4 ranks and resumed at 2 (the same global batch) and at
/// HSDP 2 × 2 ends where an uninterrupted run ends.
#[test]
fn checkpoints_reshard_on_resume() {
    let global = 8;
    let adamw = OptimizerKind::adamw(3e-3, 0.01);
    let whole = run(4, spec(false, global, 4, 4, adamw));
    let dir = std::env::temp_dir().join(format!("chorus-llama-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut first = spec(false, global, 4, 2, adamw);
    first.checkpoint_dir = Some(dir.clone());
    let saved = run(4, first);
    assert_eq!(saved[0].saved.len(), 1);
    for (ranks, replicate) in [(2, None), (4, Some(2))] {
        let mut rest = spec(false, global, ranks, 4, adamw);
        rest.resume = Some(saved[0].saved[0].clone());
        rest.replicate = replicate;
        let resumed = run(ranks, rest);
        assert_eq!(resumed[0].start_step, 2);
        let losses: Vec<f64> = resumed[0].earlier_losses.iter().chain(&resumed[0].losses).copied().collect();
        for (a, b) in losses.iter().zip(&whole[0].losses) {
            assert!((a - b).abs() < 1e-5, "{losses:?} vs {:?}", whole[0].losses);
        }
        let d = max_diff(&resumed[0].params, &whole[0].params);
        assert!(d < 2e-5, "resumed at {ranks} ranks {replicate:?}: params differ by {d}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// bf16 parameters with f32 reduction (FSDP2's MixedPrecisionPolicy) train
/// the Llama close to the f32 run: the bf16 rounding of the weights and
/// activations, no more.
#[test]
fn mixed_precision_trains_close_to_f32() {
    let global = 8;
    let adamw = OptimizerKind::adamw(3e-3, 0.01);
    let f32_run = run(2, spec(false, global, 2, 3, adamw));
    let mut s = spec(false, global, 2, 3, adamw);
    s.fsdp.mixed_precision = MixedPrecision {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        output_dtype: Some(DType::F32),
        all_gather_dtype: None,
    };
    let bf16_run = run(2, s);
    for (a, b) in bf16_run[0].losses.iter().zip(&f32_run[0].losses) {
        assert!((a - b).abs() < 2e-2, "bf16 {:?} vs f32 {:?}", bf16_run[0].losses, f32_run[0].losses);
    }
    assert_ne!(bf16_run[0].losses, f32_run[0].losses, "bf16 compute changes the losses");
    let d = max_diff(&bf16_run[0].params, &f32_run[0].params);
    assert!(d < 1e-2, "params differ by {d}");
}
