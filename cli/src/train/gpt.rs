//! `chorus train --model gpt` (and `--model moe`, the same run of another
//! [`CliDecoder`]): the transformer through the candle adapter, with
//! checkpoints, resume, and its outputs (the unsharded model as safetensors,
//! the summary, the loss curve, a sample).

use std::sync::Arc;

use chorus_train::codec::Alphabet;
use chorus_train::decoder::{config_changes, Data, Sample, TrainSpec};
use chorus_train::model_out::SafetensorsOutput;
use chorus_train::models::gpt::{init_params, GptModel};
use chorus_train::models::DecoderModel;
use serde_json::json;

use super::args::TrainArgs;
use super::outputs;
use super::ranks::{limit_candle_threads, return_freed_blocks};
use super::report::say;
use super::resume::{check_resume, Resuming};
use super::text_data::text_data;
use super::throughput::Throughput;
use crate::job::ModelArg;
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
        let cfg = args.job.gpt_config();
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
    return_freed_blocks(args.backend);
    let steps = args.steps();
    let (flag, key) = M::FLAG;
    let spec = args.with_run_settings(spec::<M>(args, steps)?);
    let checkpoint_dir = spec.checkpoint_dir.clone();
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
    let config = |start_step| config_json(args, &spec, start_step, &optimizer_changes);
    outputs::run_to_end(args, &spec, out, key, &throughput, config, |run, out, mut summary| {
        let sample = run.first().sample.clone().unwrap_or_default();
        summary.insert("sample".into(), sample.clone().into());
        let dest = run.commit(out, key, summary)?;
        say(format_args!(
            "{}",
            run.closing(spec.model.name(), spec.model.num_params(), world, steps, 3, &dest, &throughput)
        ))?;
        if let Some(line) = run.op_times_line() {
            say(format_args!("{line}"))?;
        }
        say(format_args!("sample: {sample:?}"))
    })
}

/// The run's configuration as the summary records it.
fn config_json<M: CliDecoder>(
    args: &TrainArgs,
    spec: &TrainSpec<M>,
    start_step: u64,
    optimizer_changes: &[String],
) -> serde_json::Value {
    let mut config = outputs::config_json(args, spec, start_step, optimizer_changes);
    config.insert("transformer".into(), spec.model.sizes());
    config.insert("parameters".into(), spec.model.num_params().into());
    config.into()
}

/// The run the arguments describe, for `steps` steps, on `--text` or on
/// generated text, with the defaults of [`TrainSpec::new`] where no argument
/// applies (the benchmark and the training run share it).
pub(super) fn spec<M: CliDecoder>(args: &TrainArgs, steps: u64) -> anyhow::Result<TrainSpec<M>> {
    let model = M::from_args(args)?;
    let data = text_data(args, model.seq_len())?;
    Ok(TrainSpec {
        fsdp: args.job.fsdp_config(),
        replicate: args.job.hsdp,
        micro_batches: args.job.micro_batches,
        recompute: args.recompute(),
        schedule: args.decoder.schedule(),
        ..TrainSpec::new(model, Arc::new(Data::Text(data)), args.job.batch, steps, args.job.optimizer())
    })
}
