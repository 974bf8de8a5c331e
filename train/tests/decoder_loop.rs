//! The training loop's features on the Llama (the same loop trains the
//! transformer): micro-batches, the lr schedule and validation, each
//! against plain single-process candle (candle-nn's optimizers with
//! `set_learning_rate`, a whole-batch forward for validation) or a closed
//! form.

use crate::common;

use std::sync::Arc;

use chorus_fsdp::OptimizerKind;
use chorus_train::decoder::{train_plain, train_sharded, Data, TokenRows, TrainReport, TrainSpec, Validation};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::{init_params, LlamaModel};
use chorus_train::npy::Tokens;
use chorus_train::schedule::{Decay, Schedule};
use common::{max_diff, on_sim_ranks, unwrap_ranks};

type LlamaSpec = TrainSpec<LlamaModel>;

const VOCAB: usize = 40;

/// `rows` rows of 9 ids; id `k` of row `r` is a function of both.
fn tokens(rows: usize) -> Tokens {
    let cols = 9;
    let ids = (0..rows * cols).map(|i| ((i * 7919 + i / 3) % VOCAB) as u32).collect();
    Tokens::from_ids(rows, cols, ids).unwrap()
}

fn spec(global: usize, ranks: usize, steps: u64, data: TokenRows) -> LlamaSpec {
    let cfg = Arc::new(LlamaConfig { head_dim: 6, ..LlamaConfig::new(VOCAB as _, 16, 24, 2, 4, 2) });
    let model = LlamaModel { config: cfg.clone(), init: init_params(&cfg, 5) };
    let s =
        LlamaSpec::new(model, Arc::new(Data::Tokens(data)), global / ranks, steps, OptimizerKind::adamw(3e-3, 0.01));
    LlamaSpec { collect_params: true, ..s }
}

fn run(ranks: usize, spec: LlamaSpec) -> Vec<TrainReport> {
    let spec = Arc::new(spec);
    unwrap_ranks(on_sim_ranks(ranks, move |comm| train_sharded(comm, &spec, &mut |_, _| {})))
}

#[test]
fn two_micro_batches_equal_one() {
    let global = 8;
    let rows = || TokenRows::new(tokens(21), VOCAB, global).unwrap();
    let one = run(2, spec(global, 2, 4, rows()));
    let two = run(2, LlamaSpec { micro_batches: 2, ..spec(global, 2, 4, rows()) });
    for (a, b) in one[0].losses.iter().zip(&two[0].losses) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", one[0].losses, two[0].losses);
    }
    let d = max_diff(&one[0].params, &two[0].params);
    assert!(d < 1e-5, "params differ by {d}");
    // Two forwards per step where there was one: the accumulation ran.
    assert_eq!(two[0].adapter.stage_calls, 2 * one[0].adapter.stage_calls);
}

/// The sharded optimizer takes each step's scheduled lr as candle-nn's
/// optimizer does, and the lrs follow the schedule's closed form.
#[test]
fn a_scheduled_run_equals_plain_candle_with_the_same_lrs() {
    let global = 8;
    let rows = || TokenRows::new(tokens(21), VOCAB, global).unwrap();
    let schedule = Schedule { warmup_steps: 2, decay: Decay::Cosine, min_lr: 3e-4 };
    let s = LlamaSpec { schedule, max_grad_norm: Some(0.5), ..spec(global, 4, 6, rows()) };
    let plain = train_plain(&LlamaSpec { batch: global, ..s.clone() }, 1).unwrap();
    let constant = train_plain(&LlamaSpec { schedule: Schedule::default(), batch: global, ..s.clone() }, 1).unwrap();
    let sharded = run(4, s);
    // Warmup 1/3, 2/3 of 3e-3; then 3e-4 + 2.7e-3 · (1 + cos(π p)) / 2, p = (s − 1) / 5.
    let expect: Vec<f64> = (0..6u64)
        .map(|s| match s {
            0 | 1 => 3e-3 * (s + 1) as f64 / 3.0,
            _ => 3e-4 + 2.7e-3 * 0.5 * (1.0 + (std::f64::consts::PI * (s - 1) as f64 / 5.0).cos()),
        })
        .collect();
    for (a, b) in sharded[0].lrs.iter().zip(&expect) {
        assert!((a - b).abs() < 1e-15, "{:?} vs {expect:?}", sharded[0].lrs);
    }
    assert_eq!(plain.lrs, sharded[0].lrs);
    for (a, b) in sharded[0].losses.iter().zip(&plain.losses) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", sharded[0].losses, plain.losses);
    }
    let d = max_diff(&sharded[0].params, &plain.params);
    assert!(d < 2e-5, "params differ by {d}");
    // The schedule changed the training: a constant lr ends elsewhere.
    assert!(max_diff(&constant.params, &plain.params) > 1e-4);
}

/// The validation loss at each evaluation equals plain candle's mean loss
/// over the same rows after as many steps; the held-out rows are never
/// trained on.
#[test]
fn validation_losses_equal_plain_candle_and_held_out_rows_are_not_trained_on() {
    let global = 4;
    // 24 rows: 18 to train on, the last 6 held out (a quarter, rounded up); one validation batch of 4.
    let (train, val) = TokenRows::new(tokens(24), VOCAB, global).unwrap().split(0.25, global).unwrap();
    assert_eq!((train.len(), val.len()), (18, 6));
    let (train_data, val_data) = (Data::Tokens(train.clone()), Data::Tokens(val.clone()));
    let all = tokens(24);
    let row = |r: usize| {
        let mut v = Vec::new();
        all.extend_row(r, 0, &mut v);
        v[..8].to_vec()
    };
    for step in 0..20 {
        let (x, _) = train_data.rows(step, 0, global);
        for k in 0..global {
            let r = (0..24).find(|r| row(*r) == x[k * 8..(k + 1) * 8]).unwrap();
            assert!(r < 18, "step {step} trains on held-out row {r}");
        }
    }
    let (x, _) = val_data.rows(0, 0, global);
    assert_eq!(x[..8], row(18)[..], "validation starts at the first held-out row");
    let validation = Validation { data: Arc::new(val_data), batches: 1, every: 2 };
    let s = LlamaSpec { validation: Some(validation), micro_batches: 2, ..spec(global, 2, 5, train) };
    let plain = train_plain(&LlamaSpec { batch: global, micro_batches: 1, ..s.clone() }, 1).unwrap();
    let sharded = run(2, s);
    let steps: Vec<u64> = sharded[0].val_losses.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, vec![2, 4, 5], "every 2 steps and after the last");
    assert_eq!(plain.val_losses.len(), 3);
    for ((s, a), (t, b)) in sharded[0].val_losses.iter().zip(&plain.val_losses) {
        assert_eq!(s, t);
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", sharded[0].val_losses, plain.val_losses);
    }
    for r in &sharded[1..] {
        assert_eq!(r.val_losses, sharded[0].val_losses);
    }
    // Validation does not change the training.
    for (a, b) in sharded[0].losses.iter().zip(&plain.losses) {
        assert!((a - b).abs() < 1e-5);
    }
}

#[test]
fn splits_that_leave_too_little_are_refused() {
    let rows = TokenRows::new(tokens(10), VOCAB, 4).unwrap();
    assert!(rows.clone().split(0.0, 4).unwrap_err().contains("between 0 and 1"));
    // 10 rows, 7 held out: 3 left to train on, fewer than a global batch of 4.
    assert!(rows.clone().split(0.7, 4).unwrap_err().contains("leaves 3 to train on"));
    // 1 held out, fewer than the validation's global batch of 4.
    assert!(rows.split(0.1, 4).unwrap_err().contains("1 to validate on"));
}

/// A scheduled run resumed from its step-3 checkpoint continues the
/// schedule at step 3 (the checkpoint records the base lr, so the resume
/// check passes) and ends where the run that never stopped ended.
#[test]
fn a_resumed_run_continues_the_schedule() {
    let global = 8;
    let rows = || TokenRows::new(tokens(21), VOCAB, global).unwrap();
    let schedule = Schedule { warmup_steps: 2, decay: Decay::Linear, min_lr: 0.0 };
    let dir = std::env::temp_dir().join(format!("chorus-schedule-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let whole = LlamaSpec { schedule, checkpoint_dir: Some(dir.clone()), save_every: 3, ..spec(global, 2, 6, rows()) };
    let whole = run(2, whole);
    assert_eq!(whole[0].saved.len(), 2);
    let rest = LlamaSpec { schedule, resume: Some(whole[0].saved[0].clone()), ..spec(global, 2, 6, rows()) };
    let resumed = run(2, rest);
    assert_eq!(resumed[0].start_step, 3);
    assert_eq!(resumed[0].lrs, whole[0].lrs[3..]);
    for (a, b) in resumed[0].losses.iter().zip(&whole[0].losses[3..]) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", resumed[0].losses, whole[0].losses);
    }
    let d = max_diff(&resumed[0].params, &whole[0].params);
    assert!(d < 2e-5, "params differ by {d}");
    std::fs::remove_dir_all(&dir).unwrap();
}
