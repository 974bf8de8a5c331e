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
    let (cost, work) = cost_inputs(&a, &m.shape).unwrap();
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
    let (cost, work) = cost_inputs(&a, &m.shape).unwrap();
    let plan = execute(&a, &m, cost, work).unwrap();
    assert!(plan.step_time_s > 0.0);
    assert_eq!((plan.mfu, plan.peak_reserved_bytes_estimate), (None, None));

    let e = run_cli(&args("--gpus 2 --gpu tpu-v9")).unwrap_err();
    assert!(e.downcast_ref::<UsageError>().is_some() && e.to_string().contains("unknown --gpu"), "{e:#}");
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
        let (cost, work) = cost_inputs(&a, &m.shape).unwrap();
        execute(&a, &m, cost, work).unwrap().step_time_s
    };
    let slower = step(&line(&good, "cpu"));
    let frozen = step("--model gpt --gpus 2 --gpu cpu");
    assert!(slower > frozen && frozen > 0.0, "{slower} vs {frozen}");
    std::fs::remove_dir_all(&dir).unwrap();
}
