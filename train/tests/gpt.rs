//! The transformer under FSDP through the candle adapter against plain
//! single-process candle on the global batch (candle-nn's own optimizers),
//! at world sizes 1, 2, 4 and HSDP 2 × 2 on simulated ranks; every FSDP
//! policy that applies (reshard-after-forward true/false/int, HSDP,
//! prefetch, gradient accumulation, replication, shard placement, clipping)
//! against the same plain candle run, and mixed precision against a bf16
//! data-parallel reference written directly in candle.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use chorus_fsdp::{DataParallel, Fsdp, FsdpConfig, MixedPrecision, OptimizerKind, Reshard};
use chorus_fsdp_candle::{Recompute, Transfers};
use chorus_train::decoder::{loss, train_plain, train_sharded, Data, TrainReport, TrainSpec};
use chorus_train::models::gpt::{self, init_params, Gpt, GptConfig, GptModel};
use chorus_train::text::{encode, generate, vocab_size, TextData};
use common::{max_diff, on_sim_ranks, unwrap_ranks};

type GptSpec = TrainSpec<GptModel>;

fn config() -> GptConfig {
    GptConfig { vocab: vocab_size(), d_model: 16, layers: 2, heads: 2, d_ff: 32, seq_len: 12 }
}

fn spec(batch: usize, steps: u64, optimizer: OptimizerKind) -> GptSpec {
    let cfg = config();
    let data = Arc::new(Data::Text(TextData::new(encode(&generate(4000, 1)), cfg.seq_len, 7).unwrap()));
    // The tests compare every trained parameter: each rank gathers them all.
    let model = GptModel { config: cfg, init: init_params(&cfg, 3).unwrap() };
    GptSpec { collect_params: true, ..GptSpec::new(model, data, batch, steps, optimizer) }
}

fn run(ranks: usize, spec: GptSpec) -> Vec<TrainReport> {
    let spec = Arc::new(spec);
    unwrap_ranks(on_sim_ranks(ranks, move |comm| train_sharded(comm, &spec, &mut |_, _| {})))
}

/// With every group recomputing in backward, none, or some (the root and
/// one block keep their graphs).
#[test]
fn fsdp_matches_plain_candle_at_1_2_4_ranks_and_hsdp() {
    let global = 8;
    let some = Recompute::Groups(vec!["blocks.0".into()]);
    for (optimizer, tol) in [(OptimizerKind::sgd(0.5, 0.0), 1e-6f32), (OptimizerKind::adamw(3e-3, 0.01), 1e-6)] {
        let plain = train_plain(&spec(global, 4, optimizer), 1).unwrap();
        for (ranks, replicate, reshard, recompute) in [
            (1, None, Reshard::Yes, Recompute::All),
            (1, None, Reshard::Yes, Recompute::Nothing),
            (1, None, Reshard::No, Recompute::Nothing),
            (2, None, Reshard::Yes, Recompute::All),
            (2, None, Reshard::Yes, Recompute::Nothing),
            (4, None, Reshard::Yes, Recompute::All),
            (4, None, Reshard::Yes, Recompute::Nothing),
            (4, None, Reshard::Yes, some.clone()),
            (4, Some(2), Reshard::Yes, Recompute::All),
            (4, Some(2), Reshard::Yes, Recompute::Nothing),
            (4, None, Reshard::No, Recompute::All),
            (4, None, Reshard::No, Recompute::Nothing),
            (4, None, Reshard::To(2), Recompute::All),
            (4, None, Reshard::To(2), Recompute::Nothing),
        ] {
            let mut s = spec(global / ranks, 4, optimizer);
            s.replicate = replicate;
            s.fsdp.reshard_after_forward = reshard;
            s.recompute = recompute.clone();
            let reports = run(ranks, s);
            let first = &reports[0];
            for r in &reports[1..] {
                assert_eq!(r.params, first.params, "ranks disagree");
                assert_eq!(r.losses, first.losses);
            }
            // Stages recomputed per step: the embedding, the blocks, the head, of the groups that recompute.
            let stages = |g: &str| if g == "root" { 2 } else { 1 };
            let groups = ["root".to_string(), "blocks.0".into(), "blocks.1".into()];
            let per_step: usize = groups.iter().filter(|g| recompute.applies_to(g)).map(|g| stages(g)).sum();
            assert_eq!(first.adapter.recomputed, 4 * per_step, "recompute {recompute}: stages recomputed");
            let d = max_diff(&first.params, &plain.params);
            eprintln!(
                "{ranks} {replicate:?} {reshard} recompute {recompute}: max rel diff {d:e}, losses {:?}",
                first.losses
            );
            assert!(
                d <= tol,
                "{optimizer:?} {ranks} ranks hsdp {replicate:?} reshard {reshard} recompute {recompute}: parameters differ by {d}"
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
        self.model.init.iter().map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
    }
}

/// A policy case: its name, world size, and how it changes the spec.
type Policy = (&'static str, usize, fn(&mut GptSpec));

/// Every policy that must not change the numbers ends where plain candle on
/// the global batch ends (f32 tolerance), with every rank agreeing.
#[test]
fn every_fsdp_policy_through_the_adapter_matches_plain_candle() {
    let global = 8;
    let optimizer = OptimizerKind::adamw(3e-3, 0.01);
    let plain = train_plain(&spec(global, 4, optimizer), 1).unwrap();
    let policies: &[Policy] = &[
        ("no forward prefetch", 4, |s| s.forward_prefetch = false),
        ("2 micro-batches", 2, |s| s.micro_batches = 2),
        ("2 micro-batches, 4 ranks", 4, |s| s.micro_batches = 2),
        ("2 micro-batches, HSDP 2x2", 4, |s| {
            s.micro_batches = 2;
            s.replicate = Some(2);
        }),
        ("2 micro-batches, no reshard after forward", 4, |s| {
            s.micro_batches = 2;
            s.fsdp.reshard_after_forward = Reshard::No;
        }),
        ("2 micro-batches, reshard to 2, no prefetch", 4, |s| {
            s.micro_batches = 2;
            s.fsdp.reshard_after_forward = Reshard::To(2);
            s.forward_prefetch = false;
        }),
        ("HSDP 2x2, reshard after forward to 1 rank", 4, |s| {
            s.replicate = Some(2);
            s.fsdp.reshard_after_forward = Reshard::To(1);
        }),
        ("norm weights replicated (replicate_below)", 4, |s| s.fsdp.replicate_below = 17),
        ("sharded on dim 1", 4, |s| s.fsdp.shard_placement = Some(Arc::new(|_, shape| (shape.len() - 1) as isize))),
        ("reduce by sums, divide after", 4, |s| s.fsdp.force_sum = true),
        ("2 micro-batches, no recompute", 4, |s| {
            s.micro_batches = 2;
            s.recompute = Recompute::Nothing;
        }),
        ("2 micro-batches, HSDP 2x2, no recompute, reshard to 2", 4, |s| {
            s.micro_batches = 2;
            s.replicate = Some(2);
            s.recompute = Recompute::Nothing;
            s.fsdp.reshard_after_forward = Reshard::To(2);
        }),
        ("no forward prefetch, only the root recomputes", 4, |s| {
            s.forward_prefetch = false;
            s.recompute = Recompute::Groups(vec!["root".into()]);
        }),
        // The route of a device without host memory (ROCm's): every parameter
        // read back, every gradient uploaded and accumulated on the stream.
        ("staged transfers", 2, |s| s.transfers = Transfers::Staged),
        ("staged transfers, 2 micro-batches, no recompute, no reshard", 4, |s| {
            s.transfers = Transfers::Staged;
            s.micro_batches = 2;
            s.recompute = Recompute::Nothing;
            s.fsdp.reshard_after_forward = Reshard::No;
        }),
    ];
    for (name, ranks, policy) in policies {
        let mut s = spec(global / ranks, 4, optimizer);
        policy(&mut s);
        let micro = s.micro_batches as u64;
        let staged = s.transfers == Transfers::Staged;
        let reports = run(*ranks, s);
        let first = &reports[0];
        assert_eq!(
            first.adapter.staged_transfers > 0,
            staged,
            "{name}: {} staged transfers",
            first.adapter.staged_transfers
        );
        for r in &reports[1..] {
            assert_eq!(r.params, first.params, "{name}: ranks disagree");
            assert_eq!(r.losses, first.losses, "{name}: ranks disagree");
        }
        let d = max_diff(&first.params, &plain.params);
        eprintln!("{name}: max rel diff {d:e}, counts {:?}", first.comm_counts);
        assert!(d <= 1e-6, "{name}: parameters differ from plain candle by {d}");
        for (a, b) in first.losses.iter().zip(&plain.losses) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{name}: losses {:?} vs {:?}", first.losses, plain.losses);
        }
        // Gradient accumulation reduces once per step, not once per micro-batch.
        let groups = first.groups as u64;
        assert_eq!(
            first.comm_counts.reduce_scatters as u64,
            4 * groups,
            "{name}: one reduce-scatter per group and step"
        );
        assert!(first.comm_counts.all_gathers as u64 >= 4 * micro * (groups - 1), "{name}: every block re-gathered");
    }
}

/// Clipping through the adapter (chorus's sharded clip over the shards)
/// equals clipping plain candle's gradients (`clip_grad_norm_`'s formula),
/// and the clip was active: without it the run ends elsewhere.
#[test]
fn gradient_clipping_through_the_adapter_matches_plain_candle() {
    let global = 8;
    let optimizer = OptimizerKind::sgd(0.5, 0.0);
    let mut clipped = spec(global, 4, optimizer);
    clipped.max_grad_norm = Some(0.05);
    let plain = train_plain(&clipped, 1).unwrap();
    let unclipped = train_plain(&spec(global, 4, optimizer), 1).unwrap();
    assert!(max_diff(&plain.params, &unclipped.params) > 1e-3, "the clip never acted");
    for (ranks, replicate) in [(2, None), (4, Some(2))] {
        let mut s = spec(global / ranks, 4, optimizer);
        s.max_grad_norm = Some(0.05);
        s.replicate = replicate;
        let first = run(ranks, s).swap_remove(0);
        let d = max_diff(&first.params, &plain.params);
        assert!(d <= 1e-6, "{ranks} ranks hsdp {replicate:?}: parameters differ from clipped plain candle by {d}");
    }
}

/// bf16 data-parallel SGD written directly in candle, independent of FSDP:
/// each step every "rank" casts the f32 masters to bf16, runs the plain
/// model on its rows in bf16, and its bf16 gradients are summed in rank
/// order (in bf16, rounding after each addition, when `reduce_bf16`; else in
/// f32) and divided by the rank count; the f32 masters take the SGD step.
fn bf16_data_parallel_reference(s: &GptSpec, ranks: usize, lr: f64, reduce_bf16: bool) -> Vec<(String, Vec<f32>)> {
    let dev = &Device::Cpu;
    let mut masters: Vec<(String, Tensor)> = s.model.init.clone();
    let seq = s.data.seq_len();
    for step in 0..s.steps {
        let mut sums: Vec<Option<Tensor>> = vec![None; masters.len()];
        for r in 0..ranks {
            let vars: Vec<Var> =
                masters.iter().map(|(_, m)| Var::from_tensor(&m.to_dtype(DType::BF16).unwrap()).unwrap()).collect();
            let map: HashMap<String, Tensor> =
                masters.iter().zip(&vars).map(|((n, _), v)| (n.clone(), v.as_tensor().clone())).collect();
            let gpt = Gpt::new(s.model.config, VarBuilder::from_tensors(map, DType::BF16, dev)).unwrap();
            let (x, y) = s.data.rows(step, r * s.batch, s.batch);
            let x = Tensor::from_vec(x, (s.batch, seq), dev).unwrap();
            let y = Tensor::from_vec(y, (s.batch, seq), dev).unwrap();
            let logits = gpt.forward(&x).unwrap();
            assert_eq!(logits.dtype(), DType::BF16);
            let grads = loss(&logits, &y).unwrap().backward().unwrap();
            for (sum, v) in sums.iter_mut().zip(&vars) {
                let g = grads.get(v.as_tensor()).unwrap();
                let g = if reduce_bf16 { g.clone() } else { g.to_dtype(DType::F32).unwrap() };
                *sum = Some(match sum.take() {
                    None => g,
                    Some(acc) => (acc + g).unwrap(),
                });
            }
        }
        for ((_, m), sum) in masters.iter_mut().zip(sums) {
            let mean = (sum.unwrap() / ranks as f64).unwrap().to_dtype(DType::F32).unwrap();
            *m = (&*m - (mean * lr).unwrap()).unwrap();
        }
    }
    masters.iter().map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// Mixed precision through the adapter: the stages compute in the param
/// dtype (bf16), gradients are reduced in the reduce dtype, masters stay
/// f32. It ends where the bf16 data-parallel reference ends, far closer
/// than either is to f32 training (so bf16 was really used).
#[test]
fn mixed_precision_through_the_adapter_matches_a_bf16_reference() {
    let (lr, ranks, global) = (0.5, 2, 8);
    let optimizer = OptimizerKind::sgd(lr, 0.0);
    let f32_run = train_plain(&spec(global, 4, optimizer), 1).unwrap();
    for (reduce, output, recompute) in [
        (DType::F32, Some(chorus_devices::DType::F32), Recompute::All),
        (DType::BF16, None, Recompute::All),
        (DType::BF16, None, Recompute::Nothing),
    ] {
        let reduce_bf16 = reduce == DType::BF16;
        let mut s = spec(global / ranks, 4, optimizer);
        s.recompute = recompute;
        s.fsdp.mixed_precision = MixedPrecision {
            param_dtype: Some(chorus_devices::DType::BF16),
            reduce_dtype: Some(if reduce_bf16 { chorus_devices::DType::BF16 } else { chorus_devices::DType::F32 }),
            output_dtype: output,
            all_gather_dtype: None,
        };
        let reference = bf16_data_parallel_reference(&s, ranks, lr, reduce_bf16);
        let first = run(ranks, s).swap_remove(0);
        let d = max_diff(&first.params, &reference);
        let bf16_effect = max_diff(&reference, &f32_run.params);
        eprintln!("reduce {reduce:?}: vs the bf16 reference {d:e}, bf16 vs f32 training {bf16_effect:e}");
        assert!(bf16_effect > 1e-4, "bf16 changed nothing: {bf16_effect}");
        assert!(d <= 1e-6 && d * 100.0 < bf16_effect, "reduce {reduce:?}: {d} from the bf16 reference");
    }
}

/// The mixed-precision output dtype applies to the model's output (the
/// logits), differentiably, as FSDP2's root casts its outputs.
#[test]
fn the_output_dtype_casts_the_logits() {
    let dtypes = on_sim_ranks(1, |comm| {
        let cfg = config();
        let fsdp_config = FsdpConfig {
            mixed_precision: MixedPrecision {
                param_dtype: Some(chorus_devices::DType::BF16),
                reduce_dtype: None,
                output_dtype: Some(chorus_devices::DType::F32),
                all_gather_dtype: None,
            },
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::new(DataParallel::fsdp(comm), fsdp_config).unwrap();
        let gpt = gpt::shard(fsdp, cfg, init_params(&cfg, 3).unwrap(), true).unwrap();
        let ids = Tensor::from_vec(encode("the cat sees"), (1, 12), &Device::Cpu).unwrap();
        let logits = gpt.forward(&ids).unwrap();
        gpt.model.finish_without_backward().unwrap();
        logits.dtype()
    });
    assert_eq!(dtypes[0], DType::F32);
}

/// A recompute list that names no group is refused before training.
#[test]
fn recomputing_a_group_that_does_not_exist_is_an_error() {
    let mut s = spec(4, 1, OptimizerKind::sgd(0.5, 0.0));
    s.recompute = Recompute::Groups(vec!["blocks.0".into(), "blocks.7".into()]);
    let s = Arc::new(s);
    let errors = on_sim_ranks(1, move |comm| train_sharded(comm, &s, &mut |_, _| {}).err().map(|e| e.to_string()));
    let e = errors[0].clone().expect("an error");
    assert!(e.contains("blocks.7") && e.contains("no group"), "{e}");
}
