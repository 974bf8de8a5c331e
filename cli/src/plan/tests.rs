//! `chorus plan`'s checks and outputs, with the planner's constant-rate cost model and its real ones.

use std::sync::Arc;

use chorus_plan::constant::ConstantRates;
use chorus_plan::cost::{KernelCost, KernelKind};
use chorus_plan::workload::StageWork;
use clap::Parser;

use super::*;
use crate::UsageError;

#[derive(Debug, clap::Parser)]
struct Cli {
    #[command(flatten)]
    args: PlanArgs,
}

fn args(line: &str) -> PlanArgs {
    Cli::try_parse_from(std::iter::once("plan").chain(line.split_whitespace())).unwrap().args
}

fn usage_of(line: &str) -> String {
    match model(&args(line)).and_then(|m| cost_inputs(&args(line), &m).map(|_| ())) {
        Ok(_) => panic!("`{line}` was accepted"),
        Err(e) => {
            assert!(e.downcast_ref::<UsageError>().is_some(), "not a usage error: {e:#}");
            e.to_string()
        }
    }
}

/// Embed, `layers` layers and head: a 1 GFLOP GEMM forward each, keeping 1 MiB.
fn work(layers: usize) -> Vec<StageWork> {
    let stage = |name: String| {
        let k = |f: f64| KernelCost { name: name.clone(), kind: KernelKind::Gemm, flops: f, bytes: 0.0 };
        StageWork {
            name: name.clone(),
            forward: vec![k(1e9)],
            backward: vec![k(2e9)],
            saved_bytes: 1 << 20,
            transient_bytes: 0,
        }
    };
    let mut w = vec![stage("embed".into())];
    w.extend((0..layers).map(|i| stage(format!("layers.{i}"))));
    w.push(stage("head".into()));
    w
}

#[test]
fn every_size_and_combination_is_checked_before_anything_runs() {
    assert!(usage_of("--gpus 0").contains("--gpus 0"));
    assert!(usage_of("--world-size 0").contains("--world-size 0"));
    assert!(usage_of("--gpus 4 --hsdp 3").contains("--hsdp 3"));
    assert!(usage_of("--gpus 4 --batch 6 --micro-batches 4").contains("must divide --batch 6"));
    assert!(usage_of("--gpus 4 --layers 0").contains("every transformer size must be positive"));
    assert!(usage_of("--gpus 4 --model gpt --heads 3").contains("heads"));
    assert!(usage_of("--gpus 4 --model gpt --kv-heads 2").contains("--kv-heads is for --model llama"));
    assert!(usage_of("--gpus 99999999").contains("--gpus"));
    assert!(usage_of("--gpus 2 --max-grad-norm -1").contains("--max-grad-norm"));
    assert!(usage_of("--gpus 2 --model mlp").contains("gpt and llama"));
    assert!(usage_of("--gpus 2 --model moe").contains("gpt and llama"));
}

/// What `chorus train` refuses, a plan refuses too (`job::check`, one validation).
#[test]
fn a_plan_refuses_what_train_refuses() {
    assert!(usage_of("--gpus 2 --optimizer adamw --momentum 0.9").contains("--momentum is for --optimizer sgd"));
    assert!(usage_of("--gpus 2 --model gpt --vocab 256").contains("--vocab is for --model llama"));
    assert!(usage_of("--gpus 2 --model llama --dims 4,4").contains("--dims is for --model mlp"));
    assert!(usage_of("--gpus 2 --model llama --recompute root,model.layers.9").contains("model.layers.9"));
    assert!(usage_of("--gpus 2 --global-batch 3").contains("--global-batch 3"));
    let e = usage_of("--gpus 2 --global-batch 4 --micro-batches 4");
    assert!(e.contains("--global-batch 4 over 2 ranks") && !e.contains("--batch 2"), "{e}");
}

/// `--init-from`'s config.json gives the Llama's sizes (the weights are not
/// read); it must be a small regular file, and the size flags are refused beside it.
#[test]
fn init_from_reads_a_small_regular_config_json() {
    let dir = std::env::temp_dir().join(format!("chorus-plan-config-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("config.json")).unwrap();
    let line = |extra: &str| format!("--model llama --gpus 2 --init-from {} {extra}", dir.display());
    assert!(usage_of(&line("")).contains("directory"));
    std::fs::remove_dir(dir.join("config.json")).unwrap();
    let max = chorus_train::models::llama::hf::MAX_CONFIG_BYTES;
    std::fs::write(dir.join("config.json"), vec![b' '; (max + 1) as usize]).unwrap();
    assert!(usage_of(&line("")).contains("bytes"));
    std::fs::write(
        dir.join("config.json"),
        r#"{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )
    .unwrap();
    let m = model(&args(&line(""))).unwrap();
    assert_eq!((m.shape.layers, m.shape.d_model, m.shape.kv_heads, m.groups.groups.len()), (3, 32, 2, 5));
    assert!(usage_of(&line("--layers 4")).contains("config.json"));
    // The groups --recompute names are checked against the file's layers.
    assert!(usage_of(&line("--recompute model.layers.3")).contains("model.layers.3"));
    assert!(model(&args(&line("--recompute root,model.layers.2"))).is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_gpu_kinds_and_the_cpu_device_price_the_plan() {
    let a = args("--model llama --gpus 2 --gpu h100-sxm --batch 2 --seq-len 64");
    let m = model(&a).unwrap();
    let (cost, work) = cost_inputs(&a, &m).unwrap();
    assert_eq!(cost.peak_flops(), Some(989e12));
    // embed, one stage per layer (2 by default), head.
    assert_eq!(work.len(), m.shape.layers + 2);
    let plan = execute(&a, &m, cost, work).unwrap();
    let mfu = plan.mfu.unwrap();
    assert!(plan.step_time_s > 0.0 && mfu > 0.0 && mfu < 1.0, "{mfu}");
    let reserved = plan.peak_reserved_bytes_estimate.unwrap();
    let expected = plan.peak_memory_bytes as f64 * chorus_plan::gpu::RESERVED_OVER_ALLOCATED;
    assert_eq!(reserved, expected as u64);

    // The cpu device: no peak to take a utilisation of, no caching-allocator estimate.
    let a = args("--model gpt --gpus 2 --gpu cpu --batch 2 --seq-len 16");
    let m = model(&a).unwrap();
    let (cost, work) = cost_inputs(&a, &m).unwrap();
    let plan = execute(&a, &m, cost, work).unwrap();
    assert!(plan.step_time_s > 0.0);
    assert_eq!((plan.mfu, plan.peak_reserved_bytes_estimate), (None, None));

    assert!(usage_of("--gpus 2 --gpu tpu-v9").contains("unknown --gpu"));
}

#[test]
fn a_plan_reports_throughput_and_mfu_from_its_step_and_writes_its_outputs() {
    let a = args("--model gpt --gpus 4 --layers 2 --d-model 16 --heads 2 --batch 2 --seq-len 8");
    let m = model(&a).unwrap();
    let rates = ConstantRates::round();
    let plan = execute(&a, &m, Arc::new(rates), work(2)).unwrap();
    assert!(plan.step_time_s > 0.0);
    assert_eq!(plan.divergence, None);
    // 2 sequences of 8 tokens per GPU per step.
    assert!((plan.tokens_per_s_per_gpu - 16.0 / plan.step_time_s).abs() < 1e-9 * plan.tokens_per_s_per_gpu);
    // Four stages of 1 GFLOP forward, times three for the backward, against 1 TFLOP/s.
    let mfu = 12e9 / plan.step_time_s / 1e12;
    assert!((plan.mfu.unwrap() - mfu).abs() < 1e-12, "{:?} vs {mfu}", plan.mfu);
    // The compute stream is busy 12 ms per step at least; the rest is exposed communication.
    assert!(plan.step_time_s >= 12e-3 && plan.exposed_communication_s < plan.step_time_s);
    assert!(plan.peak_memory_bytes >= plan.fsdp_peak_memory_bytes + (1 << 20));
    assert_eq!(plan.collectives.len(), 4);
    assert!(plan.collectives.iter().all(|c| c.digest == plan.collectives[0].digest && c.calls > 0));

    let dir = std::env::temp_dir().join(format!("chorus-plan-out-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    plan.write(&dir).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    for key in [
        "step_time_s",
        "tokens_per_s_per_gpu",
        "mfu",
        "peak_memory_bytes",
        "fsdp_peak_memory_bytes",
        "breakdown",
        "collectives",
    ] {
        assert!(json.get(key).is_some(), "plan.json has no {key}");
    }
    let svg = std::fs::read_to_string(dir.join("timeline.svg")).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("all-gather") && svg.contains("<rect"),
        "{}",
        &svg[..svg.len().min(400)]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kernels_picks_whose_workload_is_priced() {
    use chorus_plan::decoder_cost::decoder_work_for;
    use chorus_plan::workload::RecomputeMode;
    for (line, framework) in [
        ("--gpus 1 --gpu h100-sxm", Framework::TorchEager),
        ("--gpus 1 --gpu h100-sxm --kernels candle", Framework::Candle),
        ("--gpus 1 --gpu cpu", Framework::Candle),
        ("--gpus 1 --gpu cpu --kernels torch", Framework::TorchEager),
    ] {
        let a = args(&format!("{line} --model llama --seq-len 64"));
        let m = model(&a).unwrap();
        let (_, work) = cost_inputs(&a, &m).unwrap();
        assert_eq!(work, decoder_work_for(framework, &m.shape, 8, 64, 4, RecomputeMode::Full), "{line}");
    }
    // The two workloads differ where they should: candle keeps the attention scores.
    let a = args("--gpus 1 --model llama --seq-len 64 --recompute none");
    let m = model(&a).unwrap();
    let saved = |f| decoder_work_for(f, &m.shape, 8, 64, 4, RecomputeMode::None)[1].saved_bytes;
    assert!(saved(Framework::Candle) > saved(Framework::TorchEager));
}

/// A list of groups recomputes those stages whole and keeps the others':
/// the embedding and head are the root group's, stage `i + 1` layer `i`'s.
#[test]
fn recompute_by_group_prices_each_stage_as_its_group_runs() {
    use chorus_plan::decoder_cost::decoder_work_for;
    use chorus_plan::workload::RecomputeMode;
    let line = "--gpus 1 --gpu cpu --model llama --layers 3 --seq-len 16";
    let a = args(&format!("{line} --recompute root,model.layers.1"));
    let m = model(&a).unwrap();
    let (_, work) = cost_inputs(&a, &m).unwrap();
    let whole = |mode| decoder_work_for(Framework::Candle, &m.shape, 8, 16, 4, mode);
    let (full, none) = (whole(RecomputeMode::Full), whole(RecomputeMode::None));
    assert_ne!(full[1], none[1], "the modes differ per layer");
    assert_eq!(work, [full[0].clone(), none[1].clone(), full[2].clone(), none[3].clone(), full[4].clone()]);
    // `true` and `false` are every group and none, as `full` and `none` are.
    for (value, want) in [("true", &full), ("full", &full), ("false", &none), ("none", &none)] {
        let a = args(&format!("{line} --recompute {value}"));
        assert_eq!(&cost_inputs(&a, &model(&a).unwrap()).unwrap().1, want, "{value}");
    }
}

fn parse_error(line: &str) -> String {
    match Cli::try_parse_from(std::iter::once("plan").chain(line.split_whitespace())) {
        Ok(_) => panic!("`{line}` was parsed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn train_flag_names_are_accepted() {
    use chorus_devices::DType;
    use chorus_fsdp_candle::Recompute;
    let a = args("--gpus 2 --model llama --hidden 32 --intermediate 48 --heads 4 --recompute false");
    assert_eq!((a.job.d_model, a.job.d_ff), (Some(32), Some(48)));
    assert_eq!(a.job.recompute, RecomputeArg::Groups(Recompute::Nothing));
    let m = model(&a).unwrap();
    assert_eq!((m.shape.d_model, m.shape.ffn_hidden), (32, 48));
    assert_eq!(args("--gpus 2 --recompute true").job.recompute, RecomputeArg::Groups(Recompute::All));
    let a = args("--gpus 2 --all-gather-dtype float8 --offload");
    assert_eq!((a.job.all_gather_dtype, a.job.offload), (Some(DType::F8E4M3), true));
    assert_eq!(args("--gpus 2 --param-dtype bf16 --all-gather-dtype bf16").job.all_gather_dtype, Some(DType::BF16));
}

#[test]
fn the_flags_refuse_what_they_cannot_plan() {
    assert!(
        usage_of("--gpus 2 --hidden 0").contains("--d-model") || usage_of("--gpus 2 --hidden 0").contains("positive")
    );
    assert!(usage_of("--gpus 2 --all-gather-dtype f16").contains("must be float8 or the param dtype (f32)"));
    assert!(parse_error("--gpus 2 --all-gather-dtype int8").contains("not an all-gather dtype"));
    assert!(usage_of("--gpus 2 --model llama --recompute model.layers.5").contains("--recompute"));
    assert!(parse_error("--gpus 2 --d-model 32 --hidden 32").contains("--d-model"));
    assert!(parse_error("--gpus 2 --replicate-below -1").contains("--replicate-below"));
    assert!(parse_error("--gpus 2 --offload true").contains("true"));
}

#[test]
fn an_offloaded_gpu_plan_holds_the_state_in_host_memory_and_steps_there() {
    let line = "--model llama --gpus 2 --gpu h100-sxm --batch 2 --seq-len 64 --optimizer adamw";
    let plan = |extra: &str| {
        let a = args(&format!("{line} {extra}"));
        let m = model(&a).unwrap();
        let (cost, work) = cost_inputs(&a, &m).unwrap();
        execute(&a, &m, cost, work).unwrap()
    };
    let (on, off) = (plan("--offload"), plan(""));
    let b = &off.breakdown;
    // f32 masters and f32 gradients: the same padded shards, measured apart.
    assert!(b.sharded_params > 0 && b.gradients == b.sharded_params && b.optimizer_state == 2 * b.sharded_params);
    assert_eq!((off.host_peak_memory_bytes, off.host_optimizer_step_s), (0, 0.0));
    // Offloaded: nothing of it on the device; masters, two moments and the gradients on the host.
    let h = &on.breakdown;
    assert_eq!((h.sharded_params, h.gradients, h.optimizer_state), (0, 0, 0));
    assert_eq!(on.host_gradient_bytes, b.gradients);
    assert_eq!(on.host_peak_memory_bytes, b.sharded_params + b.gradients + b.optimizer_state);
    assert!(on.fsdp_peak_memory_bytes < off.fsdp_peak_memory_bytes);
    let expected = 7.0 * b.sharded_params as f64 / chorus_plan::run::HOST_STEP_BYTES_PER_S;
    assert!((on.host_optimizer_step_s - expected).abs() <= 1e-12 * expected, "{}", on.host_optimizer_step_s);
    assert!(
        on.step_time_s > expected,
        "{} s, {} s without offload, {expected} s on the host",
        on.step_time_s,
        off.step_time_s
    );
    assert!(on.text().contains("optimizer on the host"));

    let f8 = plan("--param-dtype bf16 --all-gather-dtype float8");
    assert!(f8.rank0_collectives.iter().any(|c| c.op == "all_gather" && c.dtype == "f8e4m3"));
}

#[test]
fn cpu_rates_come_from_a_small_regular_file_of_good_numbers() {
    let dir = std::env::temp_dir().join(format!("chorus-plan-rates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let line =
        |file: &std::path::Path, gpu: &str| format!("--model gpt --gpus 2 --gpu {gpu} --cpu-rates {}", file.display());
    let refused = |line: String| -> String {
        let a = args(&line);
        let m = model(&a).unwrap();
        match cost_inputs(&a, &m) {
            Ok(_) => panic!("`{line}` was accepted"),
            Err(e) => {
                assert!(e.downcast_ref::<UsageError>().is_some(), "not a usage error: {e:#}");
                e.to_string()
            }
        }
    };
    assert!(refused(line(&dir, "cpu")).contains("not a regular file"));
    assert!(refused(line(&dir.join("absent.json"), "cpu")).contains("--cpu-rates"));
    let big = dir.join("big.json");
    std::fs::write(&big, vec![b' '; (MAX_RATES_BYTES + 1) as usize]).unwrap();
    assert!(refused(line(&big, "cpu")).contains("more than"));
    let bad = dir.join("bad.json");
    let mut v = serde_json::to_value(chorus_plan::cpu_model::CpuRates::frozen()).unwrap();
    v["sim_busbw"] = (-1.0).into();
    std::fs::write(&bad, v.to_string()).unwrap();
    assert!(refused(line(&bad, "cpu")).contains("sim_busbw"));

    // A good file prices the plan with its rates; another kind of GPU refuses it.
    let good = dir.join("rates.json");
    let mut rates = chorus_plan::cpu_model::CpuRates::frozen();
    rates.one_thread.gemm_flops_per_s /= 10.0;
    std::fs::write(&good, serde_json::to_string(&rates).unwrap()).unwrap();
    assert!(refused(line(&good, "h100-sxm")).contains("--gpu cpu"));
    let step = |line: &str| {
        let a = args(line);
        let m = model(&a).unwrap();
        let (cost, work) = cost_inputs(&a, &m).unwrap();
        execute(&a, &m, cost, work).unwrap().step_time_s
    };
    let slower = step(&line(&good, "cpu"));
    let frozen = step("--model gpt --gpus 2 --gpu cpu");
    assert!(slower > frozen && frozen > 0.0, "{slower} vs {frozen}");
    std::fs::remove_dir_all(&dir).unwrap();
}
