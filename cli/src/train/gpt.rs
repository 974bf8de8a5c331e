//! `chorus train --model gpt`: the transformer through the candle adapter,
//! with checkpoints, resume, and its outputs (the unsharded model as
//! safetensors, the summary, the loss curve, a sample).

use std::sync::Arc;

use std::path::Path;

use anyhow::Context;
use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::gpt::init_params;
use chorus_train::gpt_train::{config_changes, GptSpec};
use chorus_train::text::{self, TextData};
use serde_json::json;

use super::ranks::{limit_candle_threads, writes_outputs, GptJob};
use super::resume::{check_resume, Resuming};
use super::{median, run_with_progress, say, span, summarize, usage, TrainArgs};
use crate::outdir::{write_file, CheckpointDir, OutDir};
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
        keep_last: args.keep_last,
        resume: args.resume.clone(),
        allow_optimizer_change: args.allow_optimizer_change,
        allow_nonfinite: args.allow_nonfinite,
        ..spec(args, steps)?
    };
    let optimizer_changes = match &args.resume {
        Some(dir) => check_resume(
            args,
            dir,
            &Resuming {
                model: "transformer",
                config_changes: &|saved| config_changes(saved, &spec.config),
                data_seed: spec.data.seed(),
                data_mismatch: &|saved, now| format!("saved with --seed {saved}, this run's is {now}"),
                optimizer: spec.optimizer,
                steps: spec.steps,
            },
        )?,
        None => Vec::new(),
    };
    let (out, _checkpoint_lock) = if writes_outputs(args.backend) {
        let mut inside: Vec<(&str, &Path)> = Vec::new();
        if let Some(p) = &args.text {
            inside.push(("--text", p));
        }
        if let Some(p) = &checkpoint_dir {
            inside.push(("--checkpoint-dir", p));
        }
        if let Some(p) = &args.resume {
            inside.push(("--resume", p));
        }
        let out = OutDir::acquire(&args.out_dir(), &inside)?;
        (Some(out), checkpoint_dir.as_deref().map(CheckpointDir::acquire).transpose()?)
    } else {
        (None, None)
    };
    if !optimizer_changes.is_empty() {
        eprintln!("resuming with changed optimizer settings: {}", optimizer_changes.join(", "));
    }
    let reports = run_with_progress(args.backend, world, GptJob(spec.clone()), steps)?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else {
        return match reports.first().and_then(|r| r.stopped) {
            Some(stop) => Err(stop.error().into()),
            None => Ok(Outcome::Passed),
        };
    };
    let first = reports.first().context("no ranks")?;
    let all_losses: Vec<f64> = first.earlier_losses.iter().chain(&first.losses).copied().collect();
    let s = summarize(&all_losses);
    let median_step = median(&first.step_times_s);
    let ran = first.losses.len().max(1) as f64;
    let overhead_per_group_step = first.overhead.total.as_secs_f64() / (first.groups.max(1) as f64 * ran);
    let first_step = first.start_step - first.earlier_losses.len() as u64;
    if let Some(stop) = first.stopped {
        // The losses until the divergence are kept: the summary, marked
        // failed, and the curve with the non-finite steps marked; no model.
        let summary = json!({
            "model": "gpt",
            "status": "failed",
            "error": stop.error().to_string(),
            "stopped_at_step": stop.step,
            "first_step": first_step,
            "losses": all_losses,
            "loss_window": s.window,
            "step_times_s": first.step_times_s,
            "checkpoints": first.saved.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "config": config_json(args, &spec, checkpoint_dir.as_deref(), first.start_step, &optimizer_changes),
        });
        write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
        let title = format!("chorus train --model gpt: stopped, loss {} at step {}", stop.loss, stop.step);
        crate::plot::loss_curve(&out.stage().join("loss.svg"), &title, first_step, &all_losses, s.window)?;
        let dest = out.dest().to_path_buf();
        out.commit()?;
        return Err(anyhow::Error::from(stop.error())
            .context(format!("the run failed; its summary (marked failed) and loss curve are in {}", dest.display())));
    }
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
        "status": "completed",
        "config": config_json(args, &spec, checkpoint_dir.as_deref(), first.start_step, &optimizer_changes),
    });
    write_file(&out.stage().join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
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
    // The closing line is about this run's steps (a resumed run's earlier ones are in the summary).
    let this = summarize(&first.losses);
    let last_start = first.start_step + (first.losses.len() - this.window) as u64;
    say(format_args!(
        "trained the transformer ({} parameters) on {world} ranks, steps {}..{steps}: loss {:.3} (mean of {}) -> {:.3} (mean of {}), median step {:.1} ms, peak FSDP memory {:.1} KiB/rank, wrote {}",
        cfg.num_params(),
        first.start_step,
        this.start,
        span(first.start_step, this.window),
        this.end,
        span(last_start, this.window),
        median_step * 1e3,
        peak as f64 / 1024.0,
        dest.display(),
    ))?;
    say(format_args!("sample: {sample:?}"))?;
    Ok(Outcome::Passed)
}

/// The run's configuration as the summary records it.
fn config_json(
    args: &TrainArgs,
    spec: &GptSpec,
    checkpoint_dir: Option<&Path>,
    start_step: u64,
    optimizer_changes: &[String],
) -> serde_json::Value {
    json!({
        "model": "gpt",
        "backend": args.backend.name(),
        "world_size": args.world(),
        "hsdp": args.hsdp,
        "steps": spec.steps,
        "batch": args.batch,
        "micro_batches": args.micro_batches,
        "optimizer": optimizer_json(spec.optimizer),
        "optimizer_changes": optimizer_changes,
        "param_dtype": args.param_dtype.name(),
        "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
        "reshard_after_forward": args.reshard_after_forward.to_string(),
        "recompute": args.recompute.to_string(),
        "transformer": spec.config,
        "parameters": spec.config.num_params(),
        "max_grad_norm": args.max_grad_norm,
        "seed": args.seed,
        "text": args.text.as_ref().map(|p| p.display().to_string()),
        "resume": args.resume.as_ref().map(|p| p.display().to_string()),
        "start_step": start_step,
        "save_every": args.save_every,
        "keep_last": args.keep_last,
        "checkpoint_dir": checkpoint_dir.map(|p| p.display().to_string()),
    })
}

/// The text of a `--text` file: UTF-8, or else Latin-1 (every byte one
/// character), so that any file reads; characters outside the vocabulary
/// become spaces when encoded.
fn read_text(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).map_err(|e| usage(format!("--text {}: {e}", path.display())))?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| e.into_bytes().iter().map(|b| char::from(*b)).collect()))
}

/// The run the arguments describe, for `steps` steps, on `--text` or on
/// generated text, with the defaults of [`GptSpec::new`] where no argument
/// applies (the benchmark and the training run share it).
pub(super) fn spec(args: &TrainArgs, steps: u64) -> anyhow::Result<GptSpec> {
    let cfg = args.gpt_config();
    let corpus = match &args.text {
        Some(path) => read_text(path)?,
        None => text::generate(200_000, args.seed),
    };
    let data = TextData::new(text::encode(&corpus), cfg.seq_len, args.seed).ok_or_else(|| {
        usage(format!(
            "the text has {} characters; --seq-len {} needs at least {}",
            corpus.chars().count(),
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
