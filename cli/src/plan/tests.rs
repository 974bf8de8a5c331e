//! `chorus plan`'s checks and outputs, with the planner's constant-rate cost model and its real ones.

use std::sync::Arc;

use chorus_plan::constant::ConstantRates;
use chorus_plan::cost::{KernelCost, KernelKind};
use chorus_plan::workload::StageWork;
use clap::Parser;

use super::*;

#[derive(Debug, clap::Parser)]
struct Cli {
    #[command(flatten)]
    args: PlanArgs,
}

fn args(line: &str) -> PlanArgs {
    Cli::try_parse_from(std::iter::once("plan").chain(line.split_whitespace())).unwrap().args
}

fn usage_of(line: &str) -> String {
    match model(&args(line)) {
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
        let k = |f: f64| KernelCost::new(name.clone(), KernelKind::Gemm, f, 0.0);
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
    assert!(usage_of("--gpus 4 --hsdp 3").contains("--hsdp 3"));
    assert!(usage_of("--gpus 4 --batch 6 --micro-batches 4").contains("does not divide"));
    assert!(usage_of("--gpus 4 --layers 0").contains("--layers 0"));
    assert!(usage_of("--gpus 4 --model gpt --heads 3").contains("heads"));
    assert!(usage_of("--gpus 4 --model gpt --config c.json").contains("Llama"));
    assert!(usage_of("--gpus 99999999").contains("--gpus"));
    assert!(usage_of("--gpus 2 --max-grad-norm -1").contains("--max-grad-norm"));
}

#[test]
fn a_config_must_be_a_small_regular_file() {
    let dir = std::env::temp_dir().join(format!("chorus-plan-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert!(usage_of(&format!("--gpus 2 --config {}", dir.display())).contains("not a regular file"));
    let big = dir.join("big.json");
    std::fs::write(&big, vec![b' '; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
    assert!(usage_of(&format!("--gpus 2 --config {}", big.display())).contains("bytes"));
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )
    .unwrap();
    let m = model(&args(&format!("--gpus 2 --config {}", cfg.display()))).unwrap();
    assert_eq!((m.shape.layers, m.shape.d_model, m.shape.kv_heads, m.groups.groups.len()), (3, 32, 2, 5));
    assert!(usage_of(&format!("--gpus 2 --config {} --layers 4", cfg.display())).contains("config.json"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_gpu_kinds_and_the_cpu_device_price_the_plan() {
    let a = args("--model llama --gpus 2 --gpu h100-sxm --batch 2 --seq-len 64");
    let m = model(&a).unwrap();
    let priced = cost_inputs(&a, &m.shape).unwrap();
    assert_eq!(priced.cost.peak_flops(), Some(989e12));
    // embed, one stage per layer (2 by default), head.
    assert_eq!(priced.work.len(), m.shape.layers + 2);
    let plan = execute(&a, &m, priced).unwrap();
    let mfu = plan.mfu.unwrap();
    assert!(plan.step_time_s.unwrap() > 0.0 && mfu > 0.0 && mfu < 1.0, "{mfu}");
    assert_eq!((plan.fits, plan.gpu_memory_bytes), (Some(true), Some(81_559 << 20)));
    let reserved = plan.peak_reserved_bytes_estimate.unwrap();
    let expected = plan.peak_memory_bytes as f64 * chorus_plan::gpu::RESERVED_OVER_ALLOCATED;
    assert_eq!(reserved, expected as u64);

    // The cpu device: no peak to take a utilisation of, no caching-allocator estimate.
    let a = args("--model gpt --gpus 2 --gpu cpu --batch 2 --seq-len 16");
    let m = model(&a).unwrap();
    let plan = execute(&a, &m, cost_inputs(&a, &m.shape).unwrap()).unwrap();
    assert!(plan.step_time_s.unwrap() > 0.0);
    assert_eq!((plan.mfu, plan.peak_reserved_bytes_estimate, plan.fits), (None, None, None));

    let e = run_cli(&args("--gpus 2 --gpu tpu-v9")).unwrap_err();
    assert!(e.downcast_ref::<UsageError>().is_some() && e.to_string().contains("unknown --gpu"), "{e:#}");
}

#[test]
fn a_plan_reports_throughput_and_mfu_from_its_step_and_writes_its_outputs() {
    let a = args("--model gpt --gpus 4 --layers 2 --d-model 16 --heads 2 --batch 2 --seq-len 8");
    let m = model(&a).unwrap();
    let rates = ConstantRates::round();
    let plan = execute(&a, &m, Priced { cost: Arc::new(rates), work: work(2), rates: None }).unwrap();
    let step = plan.step_time_s.unwrap();
    assert!(step > 0.0);
    assert_eq!(plan.divergence, None);
    // 2 sequences of 8 tokens per GPU per step.
    let tokens = plan.tokens_per_s_per_gpu.unwrap();
    assert!((tokens - 16.0 / step).abs() < 1e-9 * tokens);
    // Four stages of 1 GFLOP forward, times three for the backward, against 1 TFLOP/s.
    let mfu = 12e9 / step / 1e12;
    assert!((plan.mfu.unwrap() - mfu).abs() < 1e-12, "{:?} vs {mfu}", plan.mfu);
    // The compute stream is busy 12 ms per step at least; the rest is exposed communication.
    assert!(step >= 12e-3 && plan.exposed_communication_s < step);
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
        let a = args(&format!("{line} --seq-len 64"));
        let m = model(&a).unwrap();
        let work = cost_inputs(&a, &m.shape).unwrap().work;
        assert_eq!(work, decoder_work_for(framework, &m.shape, 8, 64, 4, RecomputeMode::Full), "{line}");
    }
    // The two workloads differ where they should: candle keeps the attention scores.
    let a = args("--gpus 1 --seq-len 64 --recompute none");
    let m = model(&a).unwrap();
    let saved = |f| decoder_work_for(f, &m.shape, 8, 64, 4, RecomputeMode::None)[1].saved_bytes;
    assert!(saved(Framework::Candle) > saved(Framework::TorchEager));
}

fn parse_error(line: &str) -> String {
    match Cli::try_parse_from(std::iter::once("plan").chain(line.split_whitespace())) {
        Ok(_) => panic!("`{line}` was parsed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn train_flag_names_are_accepted() {
    let a = args("--gpus 2 --hidden 32 --intermediate 48 --heads 4 --recompute false");
    assert_eq!((a.d_model, a.d_ff, a.recompute), (Some(32), Some(48), RecomputeArg::None));
    let m = model(&a).unwrap();
    assert_eq!((m.shape.d_model, m.shape.ffn_hidden), (32, 48));
    assert_eq!(args("--gpus 2 --recompute true").recompute, RecomputeArg::Full);
    let a = args("--gpus 2 --all-gather-dtype float8 --offload --replicate-below 100");
    assert_eq!((a.all_gather_dtype, a.offload, a.replicate_below), (Some(DType::F8E4M3), true, 100));
    assert_eq!(args("--gpus 2 --param-dtype bf16 --all-gather-dtype bf16").all_gather_dtype, Some(DType::BF16));
}

#[test]
fn the_new_flags_refuse_what_they_cannot_plan() {
    assert!(usage_of("--gpus 2 --hidden 0").contains("--hidden"));
    assert!(usage_of("--gpus 2 --intermediate 0").contains("--intermediate"));
    assert!(usage_of("--gpus 2 --all-gather-dtype f16").contains("must be float8 or the param dtype (f32)"));
    assert!(parse_error("--gpus 2 --all-gather-dtype int8").contains("not an all-gather dtype"));
    assert!(parse_error("--gpus 2 --recompute model.layers.0").contains("--recompute"));
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
        execute(&a, &m, cost_inputs(&a, &m.shape).unwrap()).unwrap()
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
        on.step_time_s.unwrap() > expected,
        "{:?} s, {:?} s without offload, {expected} s on the host",
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
        match cost_inputs(&a, &m.shape) {
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
        execute(&a, &m, cost_inputs(&a, &m.shape).unwrap()).unwrap().step_time_s.unwrap()
    };
    let slower = step(&line(&good, "cpu"));
    let frozen = step("--model gpt --gpus 2 --gpu cpu");
    assert!(slower > frozen && frozen > 0.0, "{slower} vs {frozen}");
    std::fs::remove_dir_all(&dir).unwrap();
}
