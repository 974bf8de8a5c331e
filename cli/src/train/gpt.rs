//! `chorus train --model gpt`: the transformer through the candle adapter,
//! with checkpoints, resume, and its outputs (the unsharded model as
//! safetensors, the summary, the loss curve, a sample).

use std::sync::Arc;

use std::path::Path;

use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::codec::Alphabet;
use chorus_train::decoder::{config_changes, Data, Sample, TrainSpec};
use chorus_train::model_out::SafetensorsOutput;
use chorus_train::models::gpt::{init_params, GptModel};
use chorus_train::text::{self, TextData};
use serde_json::json;

use super::outputs::{self, Finished};
use super::ranks::{limit_candle_threads, DecoderJob};
use super::resume::{check_resume, Resuming};
use super::throughput::Throughput;
use super::{read_text, run_with_progress, say, usage, TrainArgs};
use crate::Outcome;

/// `chorus train --model gpt`.
pub(super) fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    // Before candle computes anything: it sizes its pools once per process.
    limit_candle_threads(args.backend, world);
    let steps = args.steps();
    let cfg = args.gpt_config();
    let checkpoint_dir = (args.save_every.is_some() || args.checkpoint_dir.is_some()).then(|| args.checkpoint_dir());
    let spec = TrainSpec {
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
                flag: super::ModelArg::Gpt,
                config_changes: &|saved| config_changes(saved, &spec.model.config),
                data_seed: spec.data.seed(),
                data_mismatch: &|saved, now| format!("saved with --seed {saved}, this run's is {now}"),
                optimizer: spec.optimizer,
                steps: spec.steps,
            },
        )?,
        None => Vec::new(),
    };
    let (out, _checkpoint_lock) = outputs::acquire(
        args,
        &[
            ("--text", args.text.as_deref()),
            ("--checkpoint-dir", checkpoint_dir.as_deref()),
            ("--resume", args.resume.as_deref()),
        ],
        checkpoint_dir.as_deref(),
    )?;
    if !optimizer_changes.is_empty() {
        eprintln!("resuming with changed optimizer settings: {}", optimizer_changes.join(", "));
    }
    // The trained model, unsharded, as candle and Python load it: gathered
    // and written one tensor at a time at the end of the run; and a sample
    // the sharded model writes.
    let sample_prompt = args.decoder.sample_prompt.clone().unwrap_or_else(|| "the cat ".into());
    let output = SafetensorsOutput {
        path: out.as_ref().map(|o| o.stage().join("model.safetensors")),
        tensors: cfg.param_shapes(),
    };
    let spec = TrainSpec {
        output: Some(Arc::new(output)),
        sample: Some(Sample { prompt: sample_prompt, tokens: 60, codec: Arc::new(Alphabet) }),
        ..spec
    };
    let throughput = Throughput::gpt(&cfg, args);
    let reports = run_with_progress(args.backend, world, DecoderJob(spec.clone()), steps, Some(&throughput))?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else {
        return match reports.first().and_then(|r| r.stopped) {
            Some(stop) => Err(stop.error().into()),
            None => Ok(Outcome::Passed),
        };
    };
    let run = Finished::of(&reports)?;
    let first = run.first();
    let config = config_json(args, &spec, checkpoint_dir.as_deref(), first.start_step, &optimizer_changes);
    if let Some(stop) = first.stopped {
        return run.fail(out, "gpt", stop, config);
    }
    let sample = first.sample.clone().unwrap_or_default();
    let mut summary = run.summary("gpt", config, &throughput);
    summary.insert("sample".into(), sample.clone().into());
    let dest = run.commit(out, "gpt", summary)?;
    say(format_args!("{}", run.closing("transformer", cfg.num_params(), world, steps, 3, &dest, &throughput)))?;
    say(format_args!("sample: {sample:?}"))?;
    Ok(Outcome::Passed)
}

/// The run's configuration as the summary records it.
fn config_json(
    args: &TrainArgs,
    spec: &TrainSpec<GptModel>,
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
        "lr_schedule": spec.schedule,
        "optimizer": optimizer_json(spec.optimizer),
        "optimizer_changes": optimizer_changes,
        "param_dtype": args.param_dtype.name(),
        "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
        "reshard_after_forward": args.reshard_after_forward.to_string(),
        "recompute": args.recompute.to_string(),
        "transformer": spec.model.config,
        "parameters": spec.model.config.num_params(),
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

/// The run the arguments describe, for `steps` steps, on `--text` or on
/// generated text, with the defaults of [`TrainSpec::new`] where no argument
/// applies (the benchmark and the training run share it).
pub(super) fn spec(args: &TrainArgs, steps: u64) -> anyhow::Result<TrainSpec<GptModel>> {
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
    let model = GptModel { config: cfg, init: init_params(&cfg, args.seed)? };
    Ok(TrainSpec {
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        micro_batches: args.micro_batches,
        recompute: args.recompute.clone(),
        schedule: args.decoder.schedule(),
        ..TrainSpec::new(model, Arc::new(Data::Text(data)), args.batch, steps, args.optimizer())
    })
}
