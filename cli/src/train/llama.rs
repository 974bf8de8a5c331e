//! `chorus train --model llama`: a Hugging Face Llama (`--init-from DIR`,
//! or transformers' initialisation at the sizes the flags give) trained
//! under FSDP on `.npy` token ids (`--data`) or byte-level text, written
//! back as a Hugging Face model directory (`<out-dir>/model`) that
//! `LlamaForCausalLM.from_pretrained` loads, with the summary and the loss
//! curve; checkpoints and resume as for the transformer.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use chorus_fsdp_candle::checkpoint::optimizer_json;
use chorus_train::codec::{Alphabet, TextCodec};
use chorus_train::decoder::{config_changes, Data, Sample, TokenRows, TrainSpec, Validation};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::hf as llama_hf;
use chorus_train::models::llama::{init_params, LlamaModel};
use chorus_train::text::{self, TextData};
use chorus_train::tokenizer::HfTokenizer;
use serde_json::json;

use super::loop_args::DEFAULT_VAL_BATCHES;
use super::outputs::{self, Finished};
use super::ranks::{limit_candle_threads, DecoderJob};
use super::resume::{check_resume, Resuming};
use super::throughput::Throughput;
use super::{read_text, run_with_progress, say, usage, TrainArgs};
use crate::outdir::write_file;
use crate::Outcome;

/// The file in a checkpoint directory that records the Llama's config, so
/// `chorus consolidate` writes a Hugging Face directory from it.
pub(crate) const CHECKPOINT_CONFIG: &str = "llama-config.json";

/// `chorus train --model llama`.
pub(super) fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    limit_candle_threads(args.backend, world);
    let steps = args.steps();
    let tokenizer = tokenizer(args)?;
    let spec = spec_with(args, steps, tokenizer.as_deref())?;
    let sample = sample(args, tokenizer.as_ref())?;
    let cfg = spec.model.config.clone();
    args.check_recompute("model.layers.", cfg.num_hidden_layers, 0)?;
    let max_file_bytes = usize::try_from(args.llama.max_file_bytes)
        .map_err(|_| usage(format!("--max-file-bytes {} is too large", args.llama.max_file_bytes)))?;
    let optimizer_changes = match &args.resume {
        Some(dir) => check_resume(
            args,
            dir,
            &Resuming {
                model: "Llama configuration",
                flag: super::ModelArg::Llama,
                config_changes: &|saved| config_changes(saved, &*cfg),
                data_seed: spec.data.seed(),
                data_mismatch: &|saved, now| {
                    format!("saved with other data (--data, --text or --seed: {saved:#x}), this run's is {now:#x}")
                },
                optimizer: spec.optimizer,
                steps,
            },
        )?,
        None => Vec::new(),
    };
    let (out, _checkpoint_lock) = outputs::acquire(
        args,
        &[
            ("--init-from", args.llama.init_from.as_deref()),
            ("--data", args.llama.data.as_deref()),
            ("--text", args.text.as_deref()),
            ("--tokenizer", args.llama.tokenizer.as_deref()),
            ("--checkpoint-dir", spec.checkpoint_dir.as_deref()),
            ("--resume", args.resume.as_deref()),
        ],
        spec.checkpoint_dir.as_deref(),
    )?;
    // One process records it (under a launcher, the one writing the outputs), holding the lock.
    if let (Some(dir), Some(_)) = (&spec.checkpoint_dir, &out) {
        record_config(dir, &cfg)?;
    }
    if !optimizer_changes.is_empty() {
        eprintln!("resuming with changed optimizer settings: {}", optimizer_changes.join(", "));
    }
    // The Hugging Face directory, gathered and written one tensor at a time at the end of the run.
    let output = llama_hf::HfOutput {
        dir: out.as_ref().map(|o| o.stage().join("model")),
        config: cfg.clone(),
        layout: llama_hf::HfLayout::new(&cfg, args.llama.save_dtype.dtype(), max_file_bytes),
    };
    let spec = TrainSpec { output: Some(Arc::new(output)), sample, ..spec };
    let throughput = Throughput::llama(&cfg, spec.data.seq_len(), args);
    let reports = run_with_progress(args.backend, world, DecoderJob(spec.clone()), steps, Some(&throughput))?;
    let Some(out) = out.filter(|_| !reports.is_empty()) else {
        return match reports.first().and_then(|r| r.stopped) {
            Some(stop) => Err(stop.error().into()),
            None => Ok(Outcome::Passed),
        };
    };
    let run = Finished::of(&reports)?;
    let first = run.first();
    let config = config_json(args, &spec, first.start_step, &optimizer_changes);
    if let Some(stop) = first.stopped {
        return run.fail(out, "llama", stop, config);
    }
    let mut summary = run.summary("llama", config, &throughput);
    summary.insert("hf_model_dir".into(), "model".into());
    if let Some(sample) = &first.sample {
        summary.insert("sample".into(), sample.clone().into());
    }
    if let Some(tok) = &tokenizer {
        // Into the staged out-dir: committed with the model, or not at all.
        for (name, bytes) in tok.hf_files(cfg.max_position_embeddings)? {
            write_file(&out.stage().join("model").join(name), &bytes)?;
        }
    }
    let dest = run.commit(out, "llama", summary)?;
    let line = run.closing("Llama", cfg.num_params(), world, steps, 4, &dest, &throughput);
    say(format_args!("{line} (Hugging Face model in {})", dest.join("model").display()))?;
    if let Some(line) = run.op_times_line() {
        say(format_args!("{line}"))?;
    }
    if let Some((step, loss)) = first.val_losses.last() {
        say(format_args!("validation loss after step {step}: {loss:.4}"))?;
    }
    if let Some(sample) = &first.sample {
        say(format_args!("sample: {sample:?}"))?;
    }
    Ok(Outcome::Passed)
}

/// The run's configuration as the summary records it.
fn config_json(
    args: &TrainArgs,
    spec: &TrainSpec<LlamaModel>,
    start_step: u64,
    optimizer_changes: &[String],
) -> serde_json::Value {
    json!({
        "model": "llama",
        "backend": args.backend.name(),
        "world_size": args.world(),
        "hsdp": args.hsdp,
        "steps": spec.steps,
        "batch": args.batch,
        "micro_batches": args.micro_batches,
        "lr_schedule": spec.schedule,
        "val_data": args.decoder.val_data.as_ref().map(|p| p.display().to_string()),
        "val_fraction": args.decoder.val_fraction,
        "val_batches": spec.validation.as_ref().map(|v| v.batches),
        "eval_every": args.decoder.eval_every,
        "optimizer": optimizer_json(spec.optimizer),
        "optimizer_changes": optimizer_changes,
        "param_dtype": args.param_dtype.name(),
        "reduce_dtype": args.reduce_dtype.unwrap_or(args.param_dtype).name(),
        "reshard_after_forward": args.reshard_after_forward.to_string(),
        "llama": &*spec.model.config,
        "parameters": spec.model.config.num_params(),
        "seq_len": spec.data.seq_len(),
        "max_grad_norm": args.max_grad_norm,
        "seed": args.seed,
        "init_from": args.llama.init_from.as_ref().map(|p| p.display().to_string()),
        "data": args.llama.data.as_ref().map(|p| p.display().to_string()),
        "text": args.text.as_ref().map(|p| p.display().to_string()),
        "tokenizer": args.llama.tokenizer.as_ref().map(|p| p.display().to_string()),
        "save_dtype": args.llama.save_dtype.dtype().torch_name(),
        "resume": args.resume.as_ref().map(|p| p.display().to_string()),
        "start_step": start_step,
        "save_every": args.save_every,
        "keep_last": args.keep_last,
        "checkpoint_dir": spec.checkpoint_dir.as_ref().map(|p| p.display().to_string()),
    })
}

/// The run the arguments describe: the model (from `--init-from`, whose
/// config and weights are checked here, or initialised shard by shard), the
/// data (checked against the vocabulary and the global batch) and the
/// memory they need, all before anything is written.
pub(super) fn spec(args: &TrainArgs, steps: u64) -> anyhow::Result<TrainSpec<LlamaModel>> {
    spec_with(args, steps, tokenizer(args)?.as_deref())
}

/// `--tokenizer`, read and checked (its end-of-text token included).
fn tokenizer(args: &TrainArgs) -> anyhow::Result<Option<Arc<HfTokenizer>>> {
    let Some(path) = &args.llama.tokenizer else { return Ok(None) };
    let tok = HfTokenizer::from_file(path).map_err(|e| usage(format!("--tokenizer {e}")))?;
    tok.eos().map_err(|e| usage(format!("--tokenizer {}: {e}", path.display())))?;
    Ok(Some(Arc::new(tok)))
}

/// [`spec`] with the tokenizer read: it sets the vocabulary and special
/// tokens of a model made from flags, and tokenizes `--text`.
fn spec_with(args: &TrainArgs, steps: u64, tokenizer: Option<&HfTokenizer>) -> anyhow::Result<TrainSpec<LlamaModel>> {
    let world = args.world();
    let (cfg, init) = match &args.llama.init_from {
        Some(dir) => {
            let hf = llama_hf::open(dir).map_err(|e| usage(format!("--init-from: {e}")))?;
            (hf.config, hf.params)
        }
        None => {
            let mut cfg = args.llama_config();
            if let Some(tok) = tokenizer {
                if args.llama.vocab.is_none() {
                    cfg.vocab_size = tok.vocab_size();
                }
                cfg.bos_token_id = tok.bos_id().map(|id| id as usize);
                cfg.eos_token_id = tok.eos_id().map(serde_json::Value::from);
                cfg.validate_as(chorus_train::models::llama::config::Names::Flags)
                    .map_err(|e| usage(format!("the Llama's sizes with --tokenizer's vocabulary: {e}")))?;
            }
            let init = init_params(&cfg, args.seed);
            (cfg, init)
        }
    };
    if let Some(tok) = tokenizer.filter(|t| t.vocab_size() > cfg.vocab_size) {
        return Err(usage(format!(
            "--tokenizer has {} tokens, more than the model's vocabulary of {}{}",
            tok.vocab_size(),
            cfg.vocab_size,
            if args.llama.init_from.is_some() {
                ""
            } else {
                " (raise --vocab, or leave it out to take the tokenizer's)"
            }
        )));
    }
    let global = world * args.batch;
    let data = match &args.llama.data {
        Some(path) => {
            let tokens = chorus_train::npy::read_tokens(path).map_err(|e| usage(format!("--data: {e}")))?;
            // The rows give the length; a --seq-len that disagrees is a mistake, not a setting.
            if let Some(seq) = args.seq_len.filter(|s| *s + 1 != tokens.cols) {
                return Err(usage(format!(
                    "--seq-len {seq}: --data {} has rows of {} tokens, i.e. sequences of {} (give that, or leave --seq-len out)",
                    path.display(),
                    tokens.cols,
                    tokens.cols.saturating_sub(1)
                )));
            }
            Data::Tokens(
                TokenRows::new(tokens, cfg.vocab_size, global)
                    .map_err(|e| usage(format!("--data {}: {e}", path.display())))?,
            )
        }
        None if tokenizer.is_some() => {
            let (Some(tok), Some(path)) = (tokenizer, &args.text) else {
                return Err(usage("--tokenizer without --data needs --text FILE (the text it tokenizes)"));
            };
            let (tokens, packed) = crate::tokenize::rows_in_memory(tok, path, args.seq_len())?;
            eprintln!(
                "--text {}: {} documents, {} tokens into {} rows of {} ({} tail tokens dropped)",
                path.display(),
                packed.documents,
                packed.tokens,
                packed.rows,
                args.seq_len() + 1,
                packed.dropped
            );
            Data::Tokens(
                TokenRows::new(tokens, cfg.vocab_size, global)
                    .map_err(|e| usage(format!("--text {}: {e}", path.display())))?,
            )
        }
        None => {
            if cfg.vocab_size < text::vocab_size() {
                return Err(usage(format!(
                    "the model's vocabulary of {} is smaller than the byte-level text's {} tokens; give --data",
                    cfg.vocab_size,
                    text::vocab_size()
                )));
            }
            let corpus = match &args.text {
                Some(path) => read_text(path)?,
                None => text::generate(200_000, args.seed),
            };
            let seq_len = args.seq_len();
            Data::Text(TextData::new(text::encode(&corpus), seq_len, args.seed).ok_or_else(|| {
                usage(format!(
                    "the text has {} characters; --seq-len {seq_len} needs at least {}",
                    corpus.len(),
                    seq_len + 2
                ))
            })?)
        }
    };
    let (data, validation) = validation(args, data, cfg.vocab_size, global)?;
    args.check_llama_memory(&cfg, world, data.seq_len())?;
    let checkpoint_dir = (args.save_every.is_some() || args.checkpoint_dir.is_some()).then(|| args.checkpoint_dir());
    let model = LlamaModel { config: Arc::new(cfg), init };
    Ok(TrainSpec {
        fsdp: args.fsdp_config(),
        replicate: args.hsdp,
        micro_batches: args.micro_batches,
        max_grad_norm: args.max_grad_norm,
        checkpoint_dir,
        save_every: args.save_every.unwrap_or(0),
        keep_last: args.keep_last,
        resume: args.resume.clone(),
        allow_optimizer_change: args.allow_optimizer_change,
        allow_nonfinite: args.allow_nonfinite,
        op_times: args.op_times,
        recompute: args.recompute.clone(),
        schedule: args.decoder.schedule(),
        validation,
        ..TrainSpec::new(model, Arc::new(data), args.batch, steps, args.optimizer())
    })
}

/// The closing sample `--sample-prompt` asks for: through `--tokenizer`
/// when there is one, else through the text's character vocabulary; ids
/// from `--data` without `--tokenizer` came from a tokenizer this run does
/// not know, so a sample of them is refused.
fn sample(args: &TrainArgs, tokenizer: Option<&Arc<HfTokenizer>>) -> anyhow::Result<Option<Sample>> {
    let Some(prompt) = &args.decoder.sample_prompt else { return Ok(None) };
    let codec: Arc<dyn TextCodec> = match (tokenizer, &args.llama.data) {
        (Some(tok), _) => tok.clone(),
        (None, Some(_)) => {
            return Err(usage(
                "--sample-prompt with --data needs --tokenizer: the ids' tokenizer is unknown to this run",
            ))
        }
        (None, None) => Arc::new(Alphabet),
    };
    Ok(Some(Sample { prompt: prompt.clone(), tokens: 60, codec }))
}

/// The validation the arguments ask for: `--val-fraction` of `data`'s rows
/// held out (the rest trained on), or `--val-data` (rows as long as
/// `data`'s), each checked against the vocabulary and `global` (the global
/// batch), with `--val-batches` (default [`DEFAULT_VAL_BATCHES`], or fewer
/// where the rows hold fewer) global batches that repeat no row.
fn validation(args: &TrainArgs, data: Data, vocab: usize, global: usize) -> anyhow::Result<(Data, Option<Validation>)> {
    let d = &args.decoder;
    let (data, val) = match (&d.val_data, d.val_fraction, data) {
        (None, None, data) => return Ok((data, None)),
        (None, Some(f), Data::Tokens(rows)) => {
            let (train, val) = rows.split(f, global).map_err(usage)?;
            (Data::Tokens(train), val)
        }
        (None, Some(_), Data::Text(_)) => return Err(usage("--val-fraction holds out rows of --data; give --data")),
        (Some(path), _, data) => {
            let tokens = chorus_train::npy::read_tokens(path).map_err(|e| usage(format!("--val-data: {e}")))?;
            if tokens.cols != data.seq_len() + 1 {
                return Err(usage(format!(
                    "--val-data {} has rows of {} tokens; the training rows have {}",
                    path.display(),
                    tokens.cols,
                    data.seq_len() + 1
                )));
            }
            let val = TokenRows::new(tokens, vocab, global)
                .map_err(|e| usage(format!("--val-data {}: {e}", path.display())))?;
            (data, val)
        }
    };
    let most = val.len() / global;
    let batches = match d.val_batches {
        Some(b) if b > most => {
            return Err(usage(format!(
                "--val-batches {b} needs {} validation rows (global batch {global}); there are {}",
                b.saturating_mul(global),
                val.len()
            )))
        }
        Some(b) => b,
        None => most.min(DEFAULT_VAL_BATCHES),
    };
    Ok((data, Some(Validation { data: Arc::new(Data::Tokens(val)), batches, every: d.eval_every })))
}

/// Writes the Llama's config into the checkpoint directory (once, before
/// the first checkpoint; replaced atomically), so the checkpoints can be
/// consolidated into a Hugging Face directory.
fn record_config(dir: &Path, cfg: &LlamaConfig) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(CHECKPOINT_CONFIG);
    // The checkpoints there are of the recorded configuration: another one
    // would make `chorus consolidate` read them as this run's model.
    if let Ok(text) = std::fs::read_to_string(&path) {
        let recorded = LlamaConfig::from_json(&text).ok();
        if recorded.as_ref() != Some(cfg) {
            let changes = recorded.map(|r| config_changes(&serde_json::to_value(&r).unwrap_or_default(), cfg));
            return Err(usage(format!(
                "--checkpoint-dir {} holds checkpoints of another Llama configuration ({}); choose another directory",
                dir.display(),
                changes.map_or_else(|| format!("{CHECKPOINT_CONFIG} unreadable"), |c| c.join(", "))
            )));
        }
        return Ok(());
    }
    let tmp = dir.join(format!(".{CHECKPOINT_CONFIG}.tmp"));
    write_file(&tmp, serde_json::to_string_pretty(&cfg.to_hf_json("float32"))?.as_bytes())?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
