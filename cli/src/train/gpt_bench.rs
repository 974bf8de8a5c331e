//! `chorus train --bench --model gpt|llama`: the transformer or the Llama
//! through the candle adapter against plain candle, each side in a process
//! of its own (on sim; on nccl with the `candle-cuda` feature, both on the
//! GPU: FSDP on candle's CUDA device against plain candle-CUDA).

use anyhow::Context;
use chorus_fsdp::OptimizerKind;
use chorus_fsdp_candle::checkpoint::optimizer_json;
use serde_json::json;

use super::args::{BenchPart, TrainArgs};
use super::ranks::{candle_threads, run_on, DecoderJob};
use super::report::{median, say};
use crate::job::ModelArg;
use crate::{usage, Outcome};

/// `chorus train --bench --model gpt`: the transformer through the candle
/// adapter on `--world-size` simulated ranks against plain single-process
/// candle on the same global batch (`world × batch` sequences): step times
/// (median of the timed steps, after warm-up), FSDP's host overhead per
/// group and step, the adapter's own host time, and the device memory per
/// rank.
///
/// Each side runs in a fresh process of this binary (`--bench-part`), one
/// after the other: candle sizes its thread pools once per process
/// ((`ranks::limit_candle_threads`)), so plain candle gets candle's defaults (every
/// core) and the ranks get their share of the cores each.
pub(super) fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let on_gpu = cfg!(feature = "candle-cuda") && args.backend.name() == "nccl";
    if args.backend.name() != "sim" && !on_gpu {
        return Err(usage(
            "--bench --model gpt|llama runs on the sim backend (the ranks as threads beside plain candle), or on nccl in a build with the candle-cuda feature",
        ));
    }
    if let Some(part) = args.bench_part {
        let result = bench_gpt_part(args, part)?;
        say(format_args!("{result}"))?;
        return Ok(Outcome::Passed);
    }
    let exe = std::env::current_exe().context("finding this program to run the benchmark's parts")?;
    let forwarded: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let part = |name: &str, threads: Option<String>| -> anyhow::Result<serde_json::Value> {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(&forwarded).args(["--bench-part", name]).stdin(std::process::Stdio::null());
        cmd.stderr(std::process::Stdio::inherit());
        if let Some(t) = threads {
            cmd.env("RAYON_NUM_THREADS", t);
        }
        let out = cmd.output().with_context(|| format!("running the {name} part of the benchmark"))?;
        if !out.status.success() {
            anyhow::bail!("the {name} part of the benchmark failed ({})", out.status);
        }
        serde_json::from_slice(&out.stdout).with_context(|| format!("reading the {name} part's result"))
    };
    let num = |v: &serde_json::Value, key: &str| v[key].as_f64().unwrap_or(f64::NAN);
    // Plain candle at its best: candle's default threads and one thread, the faster (unless the user chose).
    let user_threads = std::env::var("RAYON_NUM_THREADS").ok();
    let mut plains = vec![part("plain", None)?];
    // On the GPU candle's threads do not compute: one plain run.
    if user_threads.is_none() && !on_gpu {
        plains.push(part("plain", Some("1".into()))?);
    }
    let plain = plains
        .iter()
        .min_by(|a, b| num(a, "median_step_time_s").total_cmp(&num(b, "median_step_time_s")))
        .cloned()
        .context("no plain run")?;
    let fsdp =
        part("fsdp", Some(user_threads.unwrap_or_else(|| candle_threads(args.backend, args.world()).to_string())))?;
    let (plain_step, fsdp_step) = (num(&plain, "median_step_time_s"), num(&fsdp, "median_step_time_s"));
    let ratio = fsdp_step / plain_step;
    // Both sides train the same init on the same batches: the losses must agree.
    let losses = |v: &serde_json::Value| -> Vec<f64> {
        v["losses"].as_array().map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect()).unwrap_or_default()
    };
    let (plain_losses, fsdp_losses) = (losses(&plain), losses(&fsdp));
    let loss_difference = if plain_losses.is_empty() || plain_losses.len() != fsdp_losses.len() {
        f64::NAN
    } else {
        plain_losses.iter().zip(&fsdp_losses).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
    };
    let (what, params) = match args.model() {
        ModelArg::Llama => {
            let c = args.job.llama_config();
            (
                format!(
                    "Llama hidden {} x {} layers, {} heads / {} kv",
                    c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
                ),
                c.num_params(),
            )
        }
        _ => {
            let c = args.job.gpt_config();
            (format!("transformer d_model {} x {} layers", c.d_model, c.layers), c.num_params())
        }
    };
    let seq_len = fsdp["seq_len"].as_u64().unwrap_or(0);
    let world = args.world();
    let sides = if on_gpu {
        format!("{world} nccl rank(s) on candle-CUDA vs plain candle-CUDA on GPU 0")
    } else {
        format!("{world} sim ranks")
    };
    let state_per_param = match args.job.optimizer() {
        OptimizerKind::AdamW { .. } => 16,
        OptimizerKind::Sgd { .. } => 8,
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string())
    });
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    if args.json {
        say(format_args!(
            "{}",
            json!({
                "model": format!("{:?}", args.model()).to_lowercase(), "what": what, "parameters": params,
                "backend": args.backend.name(), "world_size": world, "hsdp": args.job.hsdp,
                "max_loss_difference": loss_difference,
                "batch_per_rank": args.job.batch, "global_batch": world * args.job.batch, "micro_batches": args.job.micro_batches,
                "reshard_after_forward": args.job.reshard_after_forward.to_string(),
                "recompute": args.job.recompute.to_string(),
                "optimizer": optimizer_json(args.job.optimizer()), "warmup_steps": GPT_BENCH_WARMUP, "timed_steps": args.steps(),
                "plain": plain, "plain_runs": plains, "fsdp": fsdp, "ratio": ratio,
                "plain_training_state_bytes": params * state_per_param,
                "machine": { "cores": cores, "cpu": cpu },
            })
        ))?;
        return Ok(Outcome::Passed);
    }
    say(format_args!(
        "# chorus train --bench: {what} ({params} parameters), global batch {} x {seq_len} tokens, {} timed steps after {GPT_BENCH_WARMUP}; {sides}",
        world * args.job.batch,
        args.steps()
    ))?;
    let runs: Vec<String> = plains
        .iter()
        .map(|p| {
            format!(
                "{} threads {:.2} ms",
                p["candle_threads"].as_str().unwrap_or("?"),
                num(p, "median_step_time_s") * 1e3
            )
        })
        .collect();
    say(format_args!(
        "# each side in its own process; plain candle at its best of [{}]; each FSDP rank {} candle thread(s); reshard-after-forward {}, recompute {}",
        runs.join(", "),
        fsdp["candle_threads"].as_str().unwrap_or("?"),
        args.job.reshard_after_forward,
        args.job.recompute,
    ))?;
    let row = |label: String, value: String| say(format_args!("{label:<46} {value:>10}"));
    row("plain candle, 1 process: step ms (median)".into(), format!("{:.2}", plain_step * 1e3))?;
    row(format!("FSDP, {world} ranks: step ms (median)"), format!("{:.2}", fsdp_step * 1e3))?;
    row(format!("ratio (goal <= {})", if on_gpu { "1.1" } else { "1.5" }), format!("{ratio:.2}x"))?;
    row("largest loss difference, FSDP vs plain".into(), format!("{loss_difference:.2e}"))?;
    row(
        format!("FSDP host overhead, us/group/step ({} groups)", fsdp["groups"]),
        format!("{:.1}", num(&fsdp, "host_overhead_per_group_per_step_s") * 1e6),
    )?;
    row(
        "  of it the rank thread's own CPU, us/group/step".into(),
        format!("{:.1}", num(&fsdp, "host_overhead_cpu_per_group_per_step_s") * 1e6),
    )?;
    row(
        "adapter host copies and waits, ms/step".into(),
        format!("{:.2}", num(&fsdp, "adapter_transfer_per_step_s") * 1e3),
    )?;
    row(
        "candle compute per rank (incl. recompute), ms/step".into(),
        format!("{:.2}", num(&fsdp, "candle_compute_per_step_s") * 1e3),
    )?;
    row(
        "FSDP peak device memory, KiB/rank".into(),
        format!("{:.1}", num(&fsdp, "peak_memory_bytes_per_rank") / 1024.0),
    )?;
    row(
        "plain training state (params+grads+optim), KiB".into(),
        format!("{:.1}", (params * state_per_param) as f64 / 1024.0),
    )?;
    Ok(Outcome::Passed)
}

const GPT_BENCH_WARMUP: u64 = 3;

/// One side of [`run`], in this process: its numbers as JSON.
fn bench_gpt_part(args: &TrainArgs, part: BenchPart) -> anyhow::Result<serde_json::Value> {
    let world = args.world();
    let steps = args.steps() + GPT_BENCH_WARMUP;
    let timed = |times: &[f64]| median(&times[(GPT_BENCH_WARMUP as usize).min(times.len())..]);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    let (gpt, llama) = match args.model() {
        ModelArg::Llama => (None, Some(super::llama::spec(args, steps)?)),
        _ => (Some(super::gpt::spec::<chorus_train::models::gpt::GptModel>(args, steps)?), None),
    };
    let seq_len = match (&gpt, &llama) {
        (Some(s), _) => s.model.config.seq_len,
        (_, Some(s)) => s.data.seq_len(),
        _ => 0,
    };
    Ok(match part {
        BenchPart::Plain => {
            let device = plain_device(args)?;
            let plain = match (gpt, llama) {
                (Some(spec), _) => chorus_train::decoder::train_plain_on(&spec, world, &device)?,
                (_, Some(spec)) => chorus_train::decoder::train_plain_on(&spec, world, &device)?,
                _ => anyhow::bail!("no model"),
            };
            json!({
                "median_step_time_s": timed(&plain.step_times_s), "candle_threads": threads,
                "losses": plain.losses, "seq_len": seq_len,
            })
        }
        BenchPart::Fsdp => {
            let reports = match (gpt, llama) {
                (Some(spec), _) => run_on(args.backend, world, DecoderJob(spec), None)?,
                (_, Some(spec)) => run_on(args.backend, world, DecoderJob(spec), None)?,
                _ => anyhow::bail!("no model"),
            };
            let r = reports.first().context("no ranks")?;
            let all_steps = r.step_times_s.len().max(1) as f64;
            json!({
                "losses": r.losses, "seq_len": seq_len,
                "median_step_time_s": timed(&r.step_times_s),
                "groups": r.groups,
                "host_overhead_per_group_per_step_s": r.overhead.total.as_secs_f64() / (r.groups.max(1) as f64 * all_steps),
                // FSDP's own work: the rank thread's CPU time in the hooks; the rest of the above is waiting.
                "host_overhead_cpu_per_group_per_step_s": r.overhead.cpu.as_secs_f64() / (r.groups.max(1) as f64 * all_steps),
                "host_overhead_by_hook_us_per_step": chorus_fsdp::Hook::ALL
                    .iter()
                    .map(|h| (h.name().to_string(), json!(r.overhead.hook(*h).total.as_secs_f64() * 1e6 / all_steps)))
                    .collect::<serde_json::Map<_, _>>(),
                "adapter_transfer_per_step_s": r.adapter.transfer.as_secs_f64() / all_steps,
                "candle_compute_per_step_s": r.adapter.compute.as_secs_f64() / all_steps,
                "peak_memory_bytes_per_rank": reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0),
                "candle_threads": threads,
            })
        }
    })
}

/// Where plain candle runs: GPU 0 through candle's CUDA device on nccl
/// (feature `candle-cuda`), else the CPU.
fn plain_device(args: &TrainArgs) -> anyhow::Result<candle_core::Device> {
    #[cfg(feature = "candle-cuda")]
    if args.backend.name() == "nccl" {
        return Ok(chorus_fsdp_candle::cuda_device(0)?);
    }
    let _ = args;
    Ok(candle_core::Device::Cpu)
}
