//! `chorus plan`'s checks and outputs, with the planner's constant-rate cost model and its real ones.

use std::sync::Arc;

use chorus_plan::constant::ConstantRates;
use chorus_plan::cost::{KernelCost, KernelKind};
use chorus_plan::kernel_rates::KernelRates;
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

/// The plan of `line` with its own cost model and workload.
fn planned(line: &str) -> Plan {
    let a = args(line);
    let m = model(&a).unwrap();
    execute(&a, &m, cost_inputs(&a, &m).unwrap()).unwrap()
}

/// The usage error `line` gets from its checks and its pricing.
fn usage_of(line: &str) -> String {
    refusal(line, model(&args(line)).and_then(|m| cost_inputs(&args(line), &m).map(|_| ())))
}

/// `result`'s error, which must be a usage error (`line` names the case).
fn refusal(line: &str, result: anyhow::Result<()>) -> String {
    match result {
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
    let priced = cost_inputs(&a, &m).unwrap();
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
    let plan = execute(&a, &m, cost_inputs(&a, &m).unwrap()).unwrap();
    assert!(plan.step_time_s.unwrap() > 0.0);
    assert_eq!((plan.mfu, plan.peak_reserved_bytes_estimate, plan.fits), (None, None, None));

    assert!(usage_of("--gpus 2 --gpu tpu-v9").contains("unknown --gpu"));
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
    // Two of the four ranks run (the first and the last); the others mirror them.
    assert_eq!((plan.ranks_run.clone(), plan.collectives.len()), (vec![0, 3], 2));
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
    use chorus_plan::workload::RecomputeMode;
    for (line, framework) in [
        ("--gpus 1 --gpu h100-sxm", Framework::TorchEager),
        ("--gpus 1 --gpu h100-sxm --kernels candle", Framework::Candle),
        ("--gpus 1 --gpu cpu", Framework::Candle),
        ("--gpus 1 --gpu cpu --kernels torch", Framework::TorchEager),
    ] {
        let a = args(&format!("{line} --model llama --seq-len 64"));
        let m = model(&a).unwrap();
        let work = cost_inputs(&a, &m).unwrap().work;
        assert_eq!(work, framework.decoder_work(&m.shape, 8, 64, 4, RecomputeMode::Full), "{line}");
    }
    // The two workloads differ where they should: candle keeps the attention scores.
    let a = args("--gpus 1 --model llama --seq-len 64 --recompute none");
    let m = model(&a).unwrap();
    let saved = |f: Framework| f.decoder_work(&m.shape, 8, 64, 4, RecomputeMode::None)[1].saved_bytes;
    assert!(saved(Framework::Candle) > saved(Framework::TorchEager));
}

/// A list of groups recomputes those stages whole and keeps the others':
/// the embedding and head are the root group's, stage `i + 1` layer `i`'s.
#[test]
fn recompute_by_group_prices_each_stage_as_its_group_runs() {
    use chorus_plan::workload::RecomputeMode;
    let line = "--gpus 1 --gpu cpu --model llama --layers 3 --seq-len 16";
    let a = args(&format!("{line} --recompute root,model.layers.1"));
    let m = model(&a).unwrap();
    let work = cost_inputs(&a, &m).unwrap().work;
    let whole = |mode| Framework::Candle.decoder_work(&m.shape, 8, 16, 4, mode);
    let (full, none) = (whole(RecomputeMode::Full), whole(RecomputeMode::None));
    assert_ne!(full[1], none[1], "the modes differ per layer");
    assert_eq!(work, [full[0].clone(), none[1].clone(), full[2].clone(), none[3].clone(), full[4].clone()]);
    // `true` and `false` are every group and none, as `full` and `none` are.
    for (value, want) in [("true", &full), ("full", &full), ("false", &none), ("none", &none)] {
        let a = args(&format!("{line} --recompute {value}"));
        assert_eq!(&cost_inputs(&a, &model(&a).unwrap()).unwrap().work, want, "{value}");
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
    let plan = |extra: &str| planned(&format!("{line} {extra}"));
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
    let expected = 7.0 * b.sharded_params as f64 / chorus_plan::cost::HOST_STEP_BYTES_PER_S;
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
    let refused = |line: String| refused_pricing(&line);
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
        execute(&a, &m, cost_inputs(&a, &m).unwrap()).unwrap().step_time_s.unwrap()
    };
    let slower = step(&line(&good, "cpu"));
    let frozen = step("--model gpt --gpus 2 --gpu cpu");
    assert!(slower > frozen && frozen > 0.0, "{slower} vs {frozen}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file in a fresh temporary directory of this test's own.
fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("chorus-plan-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The usage error of `line`'s pricing, its checks passed.
fn refused_pricing(line: &str) -> String {
    let a = args(line);
    let m = model(&a).unwrap();
    refusal(line, cost_inputs(&a, &m).map(|_| ()))
}

#[test]
fn chorus_kernels_are_priced_from_kernel_rates_with_the_host() {
    // chorus's trainer on an H200: the shipped rates, the host's issue time, the runtime's memory.
    let line = "--model llama --gpus 1 --gpu h200 --batch 8 --seq-len 256 --param-dtype bf16";
    let plan_of = |extra: &str| planned(&format!("{line} {extra}"));
    let chorus = plan_of("--kernels chorus");
    let shipped = KernelRates::default_for("h200").unwrap();
    assert_eq!(chorus.kernels, "chorus");
    assert_eq!(
        chorus.kernel_rates.as_deref(),
        Some(format!("{}, measured {}", shipped.gpu, shipped.measured).as_str())
    );
    assert_eq!(chorus.runtime_memory_bytes, shipped.runtime_bytes);
    assert_eq!(chorus.gpu_memory_used_bytes_estimate, Some(chorus.peak_memory_bytes as u64 + shipped.runtime_bytes));
    assert!(chorus.host_issue_s > 0.0 && chorus.peak_reserved_bytes_estimate.is_none());
    // candle's composed ops issue more and keep the attention scores.
    let candle = plan_of("--kernels candle");
    assert!(candle.host_issue_s > chorus.host_issue_s && candle.peak_memory_bytes > chorus.peak_memory_bytes);
    // PyTorch's model has no host and keeps its caching allocator's estimate.
    let torch = plan_of("--kernels torch");
    assert_eq!((torch.host_issue_s, torch.runtime_memory_bytes, torch.kernel_rates.clone()), (0.0, 0, None));
    assert_eq!(torch.gpu_memory_used_bytes_estimate, torch.peak_reserved_bytes_estimate);
    // A host ten times slower per operation: the step is the host's.
    let dir = temp("slow-host");
    let mut slow = shipped.clone();
    slow.host.model_op_us *= 10.0;
    let file = dir.join("slow.json");
    std::fs::write(&file, serde_json::to_string(&slow).unwrap()).unwrap();
    let slow = plan_of(&format!("--kernels chorus --kernel-rates {}", file.display()));
    assert!(slow.host_bound && slow.step_time_s.unwrap() > 5.0 * chorus.step_time_s.unwrap());
    assert!(slow.text().contains("host-bound"), "{}", slow.text());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kernel_rates_come_from_a_small_regular_file_of_good_numbers_for_a_gpu() {
    let dir = temp("kernel-rates");
    let line = |file: &std::path::Path, rest: &str| format!("--gpus 2 --kernel-rates {} {rest}", file.display());
    let gpu = "--gpu h100-sxm --kernels chorus";
    assert!(refused_pricing(&line(&dir, gpu)).contains("not a regular file"));
    assert!(refused_pricing(&line(&dir.join("absent.json"), gpu)).contains("--kernel-rates"));
    let big = dir.join("big.json");
    std::fs::write(&big, vec![b' '; (chorus_plan::kernel_rates::MAX_FILE_BYTES + 1) as usize]).unwrap();
    assert!(refused_pricing(&line(&big, gpu)).contains("more than"));
    let bad = dir.join("bad.json");
    let mut v = serde_json::to_value(KernelRates::default_for("h100-sxm").unwrap()).unwrap();
    v["kernels"]["attention"]["tflop_per_s"] = (-1.0).into();
    std::fs::write(&bad, v.to_string()).unwrap();
    assert!(refused_pricing(&line(&bad, gpu)).contains("kernels.attention.tflop_per_s"));
    // A good file, but for PyTorch's kernels or the cpu device: refused.
    let good = dir.join("good.json");
    std::fs::write(&good, serde_json::to_string(&KernelRates::default_for("h100-sxm").unwrap()).unwrap()).unwrap();
    for rest in ["--gpu h100-sxm", "--gpu h100-sxm --kernels torch", "--gpu cpu --kernels candle"] {
        assert!(refused_pricing(&line(&good, rest)).contains("--kernel-rates prices chorus's trainer"), "{rest}");
    }
    // No file shipped for the A100: it must be given.
    assert!(refused_pricing("--gpus 2 --gpu a100-80gb --kernels candle").contains("--kernel-rates FILE"));
    let a = args(&line(&good, "--gpu a100-80gb --kernels candle"));
    let m = model(&a).unwrap();
    assert!(execute(&a, &m, cost_inputs(&a, &m).unwrap()).unwrap().step_time_s.unwrap() > 0.0);
    assert!(refused_pricing("--gpus 2 --gpu cpu --kernels chorus").contains("candle's kernels only"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_plan_that_does_not_fit_says_so_and_fails() {
    // The probe's case: 16 Mi tokens of sequence on an 80 GB GPU.
    let a = args("--model llama --gpus 1 --seq-len 16777216");
    let m = model(&a).unwrap();
    let plan = execute(&a, &m, cost_inputs(&a, &m).unwrap()).unwrap();
    assert_eq!(plan.fits, Some(false));
    assert!(plan.peak_memory_bytes as u64 > plan.gpu_memory_bytes.unwrap());
    assert_eq!((plan.step_time_s, plan.tokens_per_s_per_gpu, plan.mfu), (None, None, None));
    let text = plan.text();
    assert!(text.contains("DOES NOT FIT") && !text.contains("tokens/s") && !text.contains("MFU"), "{text}");
    let json = serde_json::to_value(&plan).unwrap();
    assert_eq!((json["fits"].clone(), json["step_time_s"].clone()), (false.into(), serde_json::Value::Null));
    assert_eq!(run_plan(&a).unwrap(), Outcome::Failed);
    // What fits passes.
    assert_eq!(run_plan(&args("--model llama --gpus 1 --seq-len 64")).unwrap(), Outcome::Passed);
}

#[test]
fn the_planners_own_limits_are_named_before_anything_runs() {
    let e = usage_of("--model llama --gpus 8 --layers 65536");
    assert!(e.contains("--layers 65536 is more than chorus plans (at most 4096 layers") && e.contains("65536)"), "{e}");
    // Past train's limit too: the job's words, the same as train's.
    let e = usage_of("--model llama --gpus 8 --layers 65537");
    assert!(e.contains("--layers 65537 is more than chorus trains or plans (at most 65536)"), "{e}");
    let e = usage_of("--model llama --gpus 8 --layers 4000 --batch 16 --micro-batches 16");
    assert!(e.contains("stage runs") && e.contains(&MAX_STAGE_RUNS.to_string()), "{e}");
    let e = usage_of("--model llama --gpus 1 --vocab 16777216 --d-model 4096 --heads 32");
    assert!(e.contains("model.embed_tokens.weight") && e.contains("at most 1 GiB"), "{e}");
    // Past the thread limit, groups placed unlike on the nodes are refused, naming both limits.
    let a = args("--model llama --gpus 2048 --hsdp 2 --gpus-per-node 3");
    let m = model(&a).unwrap();
    let e = execute(&a, &m, cost_inputs(&a, &m).unwrap()).unwrap_err();
    assert!(e.downcast_ref::<UsageError>().is_some(), "{e:#}");
    assert!(e.to_string().contains("sit differently") && e.to_string().contains("1024"), "{e}");
}

#[test]
fn thousands_of_ranks_run_two_and_unlike_groups_run_every_rank() {
    let plan_of = planned;
    let p = plan_of("--model llama --gpus 8192");
    assert_eq!(p.ranks_run, vec![0, 8191]);
    assert_eq!(p.collectives.iter().map(|c| c.rank).collect::<Vec<_>>(), vec![0, 8191]);
    assert!(p.text().contains("ranks run             0 and 8191"), "{}", p.text());
    // HSDP 2 × 6 on nodes of 8: the shard groups sit unlike (6 on node 0; 2 and 4), so every rank runs.
    let p = plan_of("--model llama --gpus 12 --hsdp 2 --gpus-per-node 8");
    assert_eq!(p.ranks_run, (0..12).collect::<Vec<_>>());
    // On nodes of 6 they are alike: two run.
    assert_eq!(plan_of("--model llama --gpus 12 --hsdp 2 --gpus-per-node 6").ranks_run, vec![0, 11]);
}

/// Issue 43: a job file sets the plan's own flags as it sets the job's
/// (`gpus = 8` was "no flag of chorus plan", though `--gpus` is); `out_dir`
/// in a file is the run's (a `config.toml`'s), passed over, never the
/// plan's out-dir; the command line wins.
#[test]
fn a_job_file_sets_the_plans_own_flags() {
    let dir = std::env::temp_dir().join(format!("chorus-plan-job-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("job.toml");
    std::fs::write(&path, "gpus = 8\ngpu = \"a100\"\ngpus_per_node = 4\nout_dir = \"run\"\n[model]\nlayers = 2\n")
        .unwrap();
    let argv = |extra: &[&str]| -> Vec<std::ffi::OsString> {
        ["--config", path.to_str().unwrap()].iter().chain(extra).map(Into::into).collect()
    };
    let resolved = crate::job::file::resolve::<PlanArgs>("plan", argv(&[]), file_scope()).unwrap().args;
    assert_eq!((resolved.gpus, resolved.gpu.as_str(), resolved.gpus_per_node), (Some(8), "a100", 4));
    assert_eq!(resolved.out_dir, None, "a file's out_dir is the run's");
    assert_eq!(resolved.job.layers, Some(2));
    let resolved = crate::job::file::resolve::<PlanArgs>("plan", argv(&["--gpus", "16"]), file_scope()).unwrap().args;
    assert_eq!(resolved.gpus, Some(16), "the command line wins");
    std::fs::remove_dir_all(&dir).ok();
}
