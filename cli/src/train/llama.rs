//! `chorus train --model llama`: a Hugging Face Llama (`--init-from DIR`,
//! or transformers' initialisation at the sizes the flags give) trained
//! under FSDP on `.npy` token ids (`--data`) or byte-level text, written
//! back as a Hugging Face model directory (`<out-dir>/model`) that
//! `LlamaForCausalLM.from_pretrained` loads, with the summary and the loss
//! curve; checkpoints and resume as for the transformer.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use chorus_train::codec::{Alphabet, TextCodec};
use chorus_train::decoder::{config_changes, Data, Sample, TokenRows, TrainSpec, Validation};
use chorus_train::models::llama::config::LlamaConfig;
use chorus_train::models::llama::hf as llama_hf;
use chorus_train::models::llama::{init_params, LlamaModel};
use chorus_train::text;
use chorus_train::tokenizer::HfTokenizer;

use super::args::TrainArgs;
use super::loop_args::DEFAULT_VAL_BATCHES;
use super::memory;
use super::outputs;
use super::ranks::{limit_candle_threads, return_freed_blocks};
use super::report::say;
use super::resume::{check_resume, Resuming};
use super::text_data::text_data;
use super::throughput::Throughput;
use crate::consolidate::LLAMA_CONFIG_FILE;
use crate::job::ModelArg;
use crate::outdir::write_file;
use crate::{usage, Outcome};

/// `chorus train --model llama`.
pub(super) fn run(args: &TrainArgs) -> anyhow::Result<Outcome> {
    let world = args.world();
    limit_candle_threads(args.backend, world);
    return_freed_blocks(args.backend);
    let steps = args.steps();
    let tokenizer = tokenizer(args)?;
    let spec = spec_with(args, steps, tokenizer.as_deref())?;
    let sample = sample(args, tokenizer.as_ref())?;
    let cfg = spec.model.config.clone();
    // The sizes of an --init-from directory are known only now.
    args.job.check_recompute("model.layers.", cfg.num_hidden_layers, 0)?;
    let max_file_bytes = usize::try_from(args.llama.max_file_bytes)
        .map_err(|_| usage(format!("--max-file-bytes {} is too large", args.llama.max_file_bytes)))?;
    let optimizer_changes = match &args.resume {
        Some(dir) => check_resume(
            args,
            dir,
            &Resuming {
                model: "Llama configuration",
                flag: ModelArg::Llama,
                config_changes: &|saved| config_changes(saved, &*cfg),
                data_seed: spec.data.seed(),
                data_mismatch: &|saved, now| data_mismatch(args, saved, now),
                optimizer: spec.optimizer,
                steps,
            },
        )?,
        None => Vec::new(),
    };
    let (out, _checkpoint_lock) = outputs::acquire(
        args,
        &[
            ("--init-from", args.job.init_from.as_deref()),
            ("--data", args.job.data.as_deref()),
            ("--text", args.text.as_deref()),
            ("--tokenizer", args.job.tokenizer.as_deref()),
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
    let config = |start_step| config_json(args, &spec, start_step, &optimizer_changes);
    outputs::run_to_end(args, &spec, out, "llama", &throughput, config, |run, out, mut summary| {
        let first = run.first();
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
        Ok(())
    })
}

/// Why a checkpoint's data is not this run's, naming the flags that make
/// the data: `saved` and `now` are the data's identities (token rows'
/// hashes, or the text's seed).
fn data_mismatch(args: &TrainArgs, saved: u64, now: u64) -> String {
    let job = &args.job;
    match (&job.data, &job.tokenizer) {
        (Some(_), _) => format!("saved with other token rows (--data; their hash {saved:#x}, this run's {now:#x})"),
        (None, Some(_)) => format!(
            "saved with other token rows (--text, --tokenizer and --seq-len {} make them; their hash {saved:#x}, this run's {now:#x})",
            job.seq_len()
        ),
        (None, None) => format!("saved with --seed {saved}, this run's is {now}"),
    }
}

/// The run's configuration as the summary records it.
fn config_json(
    args: &TrainArgs,
    spec: &TrainSpec<LlamaModel>,
    start_step: u64,
    optimizer_changes: &[String],
) -> serde_json::Value {
    let mut config = outputs::config_json(args, spec, start_step, optimizer_changes);
    let d = &args.decoder;
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
    for (key, value) in [
        ("val_data", path(&d.val_data).into()),
        ("val_fraction", d.val_fraction.into()),
        ("val_batches", spec.validation.as_ref().map(|v| v.batches).into()),
        ("eval_every", d.eval_every.into()),
        ("llama", serde_json::to_value(&*spec.model.config).unwrap_or_default()),
        ("parameters", spec.model.config.num_params().into()),
        ("seq_len", spec.data.seq_len().into()),
        ("init_from", path(&args.job.init_from).into()),
        ("data", path(&args.job.data).into()),
        ("tokenizer", path(&args.job.tokenizer).into()),
        ("save_dtype", args.llama.save_dtype.dtype().torch_name().into()),
    ] {
        config.insert(key.into(), value);
    }
    config.into()
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
    let Some(path) = &args.job.tokenizer else { return Ok(None) };
    let tok = HfTokenizer::from_file(path).map_err(|e| usage(format!("--tokenizer {e}")))?;
    tok.eos().map_err(|e| usage(format!("--tokenizer {}: {e}", path.display())))?;
    Ok(Some(Arc::new(tok)))
}

/// [`spec`] with the tokenizer read: it sets the vocabulary and special
/// tokens of a model made from flags, and tokenizes `--text`.
fn spec_with(args: &TrainArgs, steps: u64, tokenizer: Option<&HfTokenizer>) -> anyhow::Result<TrainSpec<LlamaModel>> {
    let world = args.world();
    let (cfg, init) = match &args.job.init_from {
        Some(dir) => {
            let hf = llama_hf::open(dir).map_err(|e| usage(format!("--init-from: {e}")))?;
            (hf.config, hf.params)
        }
        None => {
            let mut cfg = args.job.llama_config();
            if let Some(tok) = tokenizer {
                if args.job.vocab.is_none() {
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
            if args.job.init_from.is_some() { "" } else { " (raise --vocab, or leave it out to take the tokenizer's)" }
        )));
    }
    let (seq_len, data_bytes) = data_size(args, tokenizer.is_some())?;
    memory::check_llama(args, &cfg, seq_len, data_bytes)?;
    let global = world * args.job.batch;
    let data = match &args.job.data {
        Some(path) => {
            let tokens = chorus_train::npy::read_tokens(path).map_err(|e| usage(format!("--data: {e}")))?;
            // The rows give the length; a --seq-len that disagrees is a mistake, not a setting.
            if let Some(seq) = args.job.seq_len.filter(|s| *s + 1 != tokens.cols) {
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
            let (tokens, packed) = crate::tokenize::rows_in_memory(tok, path, args.job.seq_len())?;
            eprintln!(
                "--text {}: {} documents, {} tokens into {} rows of {} ({} tail tokens dropped)",
                path.display(),
                packed.documents,
                packed.tokens,
                packed.rows,
                args.job.seq_len() + 1,
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
            Data::Text(text_data(args, args.job.seq_len())?)
        }
    };
    let (data, validation) = validation(args, data, cfg.vocab_size, global)?;
    let model = LlamaModel { config: Arc::new(cfg), init };
    Ok(args.with_run_settings(TrainSpec {
        fsdp: args.job.fsdp_config(),
        replicate: args.job.hsdp,
        micro_batches: args.job.micro_batches,
        recompute: args.recompute(),
        schedule: args.decoder.schedule(),
        validation,
        ..TrainSpec::new(model, Arc::new(data), args.job.batch, steps, args.job.optimizer())
    }))
}

/// The sequence length of the run's data and the bytes its token rows will
/// take in memory, known before the data is read or tokenized: `--data`'s
/// header and size (ids held as u32, at most twice a u16 file), `--text`'s
/// bound on its ids ([`crate::tokenize::ids_bound`]), or none for the
/// byte-level text.
fn data_size(args: &TrainArgs, tokenized_text: bool) -> anyhow::Result<(usize, u128)> {
    let len = |path: &Path| std::fs::metadata(path).map_or(0, |m| m.len() as u128);
    Ok(match (&args.job.data, &args.text) {
        (Some(path), _) => {
            let cols = chorus_train::npy::token_columns(path).map_err(|e| usage(format!("--data: {e}")))?;
            (cols.saturating_sub(1), len(path).saturating_mul(2))
        }
        (None, Some(text)) if tokenized_text => {
            let ids = crate::tokenize::ids_bound(len(text) as u64, args.job.seq_len());
            (args.job.seq_len(), (ids as u128).saturating_mul(4))
        }
        _ => (args.job.seq_len(), 0),
    })
}

/// The closing sample `--sample-prompt` asks for: through `--tokenizer`
/// when there is one, else through the text's character vocabulary; ids
/// from `--data` without `--tokenizer` came from a tokenizer this run does
/// not know, so a sample of them is refused.
fn sample(args: &TrainArgs, tokenizer: Option<&Arc<HfTokenizer>>) -> anyhow::Result<Option<Sample>> {
    let Some(prompt) = &args.decoder.sample_prompt else { return Ok(None) };
    let codec: Arc<dyn TextCodec> = match (tokenizer, &args.job.data) {
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
    let path = dir.join(LLAMA_CONFIG_FILE);
    // The checkpoints there are of the recorded configuration: another one
    // would make `chorus consolidate` read them as this run's model.
    if let Ok(text) = std::fs::read_to_string(&path) {
        let recorded = LlamaConfig::from_json(&text).ok();
        if recorded.as_ref() != Some(cfg) {
            let changes = recorded.map(|r| config_changes(&serde_json::to_value(&r).unwrap_or_default(), cfg));
            return Err(usage(format!(
                "--checkpoint-dir {} holds checkpoints of another Llama configuration ({}); choose another directory",
                dir.display(),
                changes.map_or_else(|| format!("{LLAMA_CONFIG_FILE} unreadable"), |c| c.join(", "))
            )));
        }
        return Ok(());
    }
    let tmp = dir.join(format!(".{LLAMA_CONFIG_FILE}.tmp"));
    write_file(&tmp, serde_json::to_string_pretty(&cfg.to_hf_json("float32"))?.as_bytes())?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
