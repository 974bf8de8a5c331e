//! `chorus train --model gpt` (and `--model moe`, the same run of another
//! [`CliDecoder`]): the transformer through the candle adapter, with
//! checkpoints, resume, and its outputs (the unsharded model as safetensors,
//! the summary, the loss curve, a sample).

use std::sync::Arc;

use std::path::Path;

use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::codec::Alphabet;
use chorus_train::decoder::{config_changes, Data, Sample, TrainSpec};
use chorus_train::model_out::SafetensorsOutput;
use chorus_train::models::gpt::{init_params, GptModel};
use chorus_train::models::DecoderModel;
use chorus_train::text::{self, TextData};
use serde_json::json;

use super::outputs::{self, Finished};
use super::ranks::{limit_candle_threads, DecoderJob};
use super::resume::{check_resume, Resuming};
use super::throughput::Throughput;
use super::{read_text, run_with_progress, say, usage, ModelArg, TrainArgs};
use crate::Outcome;

/// What a run of `chorus train` needs of a transformer on text besides the
/// loop's [`DecoderModel`]: the rest of the run is the same.
pub(super) trait CliDecoder: DecoderModel + Clone + 'static {
    /// `--model`'s value, and its name in the outputs ("gpt", "moe").
    const FLAG: (ModelArg, &'static str);
    /// The model the arguments describe, its parameters initialised from `--seed`.
    fn from_args(args: &TrainArgs) -> anyhow::Result<Self>;
    /// Context length.
    fn seq_len(&self) -> usize;
    /// Parameter names and shapes, in registration order.
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)>;
    /// Number of parameters.
    fn num_params(&self) -> usize {
        self.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum()
    }
    /// The sizes, as the summary and checkpoints record them.
    fn sizes(&self) -> serde_json::Value;
    /// Tokens/s and MFU of a run of it.
    fn throughput(&self, args: &TrainArgs) -> Throughput;
}

impl CliDecoder for GptModel {
    const FLAG: (ModelArg, &'static str) = (ModelArg::Gpt, "gpt");
    fn from_args(args: &TrainArgs) -> anyhow::Result<Self> {
        let cfg = args.gpt_config();
        Ok(GptModel { config: cfg, init: init_params(&cfg, args.seed)? })
    }
    fn seq_len(&self) -> usize {
        self.config.seq_len
    }
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.config.param_shapes()
    }
    fn sizes(&self) -> serde_json::Value {
        json!(self.config)
    }
    fn throughput(&self, args: &TrainArgs) -> Throughput {
        Throughput::gpt(&self.config, args)
    }
}

/// `chorus train --model gpt` (with `M` = [`GptModel`]) or `--model moe`.
pub(super) fn run<M: CliDecoder>(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    // Before candle computes anything: it sizes its pools once per process.
    limit_candle_threads(args.backend, world);
    let steps = args.steps();
    let (flag, key) = M::FLAG;
    let checkpoint_dir = (args.save_every.is_some() || args.checkpoint_dir.is_some()).then(|| args.checkpoint_dir());
    let spec = TrainSpec {
        max_grad_norm: args.max_grad_norm,
        checkpoint_dir: checkpoint_dir.clone(),
        save_every: args.save_every.unwrap_or(0),
        keep_last: args.keep_last,
        resume: args.resume.clone(),
        allow_optimizer_change: args.allow_optimizer_change,
        allow_nonfinite: args.allow_nonfinite,
        op_times: args.op_times,
        ..spec::<M>(args, steps)?
    };
    let optimizer_changes = match &args.resume {
        Some(dir) => check_resume(
            args,
            dir,
            &Resuming {
                model: spec.model.name(),
                flag,
                config_changes: &|saved| config_changes(saved, &spec.model.sizes()),
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
        tensors: spec.model.param_shapes(),
    };
    let spec = TrainSpec {
        output: Some(Arc::new(output)),
        sample: Some(Sample { prompt: sample_prompt, tokens: 60, codec: Arc::new(Alphabet) }),
        ..spec
    };
    let throughput = spec.model.throughput(args);
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
        return run.fail(out, key, stop, config);
    }
    let sample = first.sample.clone().unwrap_or_default();
    let mut summary = run.summary(key, config, &throughput);
    summary.insert("sample".into(), sample.clone().into());
    let dest = run.commit(out, key, summary)?;
    say(format_args!(
        "{}",
        run.closing(spec.model.name(), spec.model.num_params(), world, steps, 3, &dest, &throughput)
    ))?;
    if let Some(line) = run.op_times_line() {
        say(format_args!("{line}"))?;
    }
    say(format_args!("sample: {sample:?}"))?;
    Ok(Outcome::Passed)
}

/// The run's configuration as the summary records it.
fn config_json<M: CliDecoder>(
    args: &TrainArgs,
    spec: &TrainSpec<M>,
    checkpoint_dir: Option<&Path>,
    start_step: u64,
    optimizer_changes: &[String],
) -> serde_json::Value {
    json!({
        "model": M::FLAG.1,
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
        "transformer": spec.model.sizes(),
        "parameters": spec.model.num_params(),
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
pub(super) fn spec<M: CliDecoder>(args: &TrainArgs, steps: u64) -> anyhow::Result<TrainSpec<M>> {
    let model = M::from_args(args)?;
    let seq_len = model.seq_len();
    let corpus = match &args.text {
        Some(path) => read_text(path)?,
        None => text::generate(200_000, args.seed),
    };
    let data = TextData::new(text::encode(&corpus), seq_len, args.seed).ok_or_else(|| {
        usage(format!(
            "the text has {} characters; --seq-len {seq_len} needs at least {}",
            corpus.chars().count(),
            seq_len + 2
        ))
    })?;
    Ok(TrainSpec {
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        micro_batches: args.micro_batches,
        recompute: args.recompute.clone(),
        schedule: args.decoder.schedule(),
        ..TrainSpec::new(model, Arc::new(Data::Text(data)), args.batch, steps, args.optimizer())
    })
}
