//! `chorus train --model gpt`: the transformer through the candle adapter,
//! with checkpoints, resume, and its outputs (the unsharded model as
//! safetensors, the summary, the loss curve, a sample).

use std::sync::Arc;

use anyhow::Context;
use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::gpt::init_params;
use chorus_train::gpt_train::GptSpec;
use chorus_train::text::{self, TextData};
use serde_json::json;

use super::ranks::{limit_candle_threads, writes_outputs, GptJob};
use super::{median, run_with_progress, say, summarize, usage, TrainArgs};
use crate::outdir::{write_file, OutDir};
use crate::Outcome;

/// `chorus train --model gpt`.
pub(super) fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    // Before candle computes anything: it sizes its pools once per process.
    limit_candle_threads(args.backend, world);
    let steps = args.steps();
    let cfg = args.gpt_config();
    let checkpoint_dir = (args.save_every.is_some() || args.checkpoint_dir.is_some()).then(|| args.checkpoint_dir());
    let spec = GptSpec {
        max_grad_norm: args.max_grad_norm,
        checkpoint_dir: checkpoint_dir.clone(),
        save_every: args.save_every.unwrap_or(0),
        resume: args.resume.clone(),
        allow_nonfinite: args.allow_nonfinite,
        ..spec(args, steps)?
    };
    if let Some(dir) = &args.resume {
        let state = chorus_fsdp_candle::checkpoint::read_training_state(dir)?;
        if state.step >= steps {
            return Err(usage(format!(
                "{} is at step {}; --steps {steps} leaves nothing to train",
                dir.display(),
                state.step
            )));
        }
    }
    let out = if writes_outputs(args.backend) { Some(OutDir::acquire(&args.out_dir())?) } else { None };
    let reports = run_with_progress(args.backend, world, GptJob(spec.clone()), steps)?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else { return Ok(Outcome::Passed) };
    let first = reports.first().context("no ranks")?;
    let all_losses: Vec<f64> = first.earlier_losses.iter().chain(&first.losses).copied().collect();
    let s = summarize(&all_losses);
    let median_step = median(&first.step_times_s);
    let ran = first.losses.len().max(1) as f64;
    let overhead_per_group_step = first.overhead.total.as_secs_f64() / (first.groups.max(1) as f64 * ran);
    // The trained model, unsharded, as candle and Python load it.
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = first
        .params
        .iter()
        .map(|(name, v)| {
            let shape = cfg
                .param_shapes()
                .into_iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s)
                .unwrap_or_else(|| vec![v.len()]);
            (name.clone(), shape, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect();
    let views = tensors
        .iter()
        .map(|(n, shape, b)| {
            Ok((n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    write_file(&out.stage().join("model.safetensors"), &safetensors::tensor::serialize(views, None)?)?;
    let sample = chorus_train::gpt::sample(&cfg, &first.params, "the cat ", 60)?;
    let summary = json!({
        "model": "gpt",
        "first_step": first.start_step - first.earlier_losses.len() as u64,
        "losses": all_losses,
        "loss_window": s.window,
        "loss_start_mean": s.start,
        "loss_end_mean": s.end,
        "loss_smoothed": crate::plot::smooth(&all_losses, s.window),
        "step_times_s": first.step_times_s,
        "median_step_time_s": median_step,
        "peak_memory_bytes": reports.iter().map(|r| r.peak_memory_bytes).collect::<Vec<_>>(),
        "fsdp_host_overhead_per_group_per_step_s": overhead_per_group_step,
        "adapter_transfer_per_step_s": first.adapter.transfer.as_secs_f64() / ran,
        "candle_compute_per_step_s": first.adapter.compute.as_secs_f64() / ran,
        "sample": sample,
        "checkpoints": first.saved.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "config": {
            "model": "gpt",
            "backend": args.backend.name(),
            "world_size": world,
            "hsdp": args.hsdp,
            "steps": steps,
            "batch": args.batch,
            "micro_batches": args.micro_batches,
            "optimizer": optimizer_json(spec.optimizer),
            "param_dtype": args.param_dtype.name(),
            "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
            "reshard_after_forward": args.reshard_after_forward.to_string(),
            "recompute": args.recompute.to_string(),
            "transformer": cfg,
            "parameters": cfg.num_params(),
            "max_grad_norm": args.max_grad_norm,
            "seed": args.seed,
            "text": args.text.as_ref().map(|p| p.display().to_string()),
            "resume": args.resume.as_ref().map(|p| p.display().to_string()),
            "start_step": first.start_step,
            "save_every": args.save_every,
            "checkpoint_dir": checkpoint_dir.as_ref().map(|p| p.display().to_string()),
        },
    });
    write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    let first_step = first.start_step - first.earlier_losses.len() as u64;
    crate::plot::loss_curve(
        &out.stage().join("loss.svg"),
        "chorus train --model gpt",
        first_step,
        &all_losses,
        s.window,
    )?;
    let dest = out.dest().to_path_buf();
    out.commit()?;
    let peak = reports.iter().map(|r| r.peak_memory_bytes).max().unwrap_or(0);
    say(format_args!(
        "trained the transformer ({} parameters) on {world} ranks, steps {}..{steps}: loss {:.3} (mean of the first {w} steps) -> {:.3} (mean of the last {w}), median step {:.1} ms, peak FSDP memory {:.1} KiB/rank, wrote {}",
        cfg.num_params(),
        first.start_step,
        s.start,
        s.end,
        median_step * 1e3,
        peak as f64 / 1024.0,
        dest.display(),
        w = s.window,
    ))?;
    say(format_args!("sample: {sample:?}"))?;
    Ok(Outcome::Passed)
}

/// The run the arguments describe, for `steps` steps, on `--text` or on
/// generated text, with the defaults of [`GptSpec::new`] where no argument
/// applies (the benchmark and the training run share it).
pub(super) fn spec(args: &TrainArgs, steps: u64) -> anyhow::Result<GptSpec> {
    let cfg = args.gpt_config();
    let corpus = match &args.text {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("--text {}", path.display()))?,
        None => text::generate(200_000, args.seed),
    };
    let data = TextData::new(text::encode(&corpus), cfg.seq_len, args.seed).ok_or_else(|| {
        usage(format!(
            "the text has {} characters; --seq-len {} needs at least {}",
            corpus.len(),
            cfg.seq_len,
            cfg.seq_len + 2
        ))
    })?;
    Ok(GptSpec {
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        micro_batches: args.micro_batches,
        recompute: args.recompute.clone(),
        ..GptSpec::new(cfg, init_params(&cfg, args.seed)?, Arc::new(data), args.batch, steps, args.optimizer())
    })
}
