//! `chorus consolidate`: a sharded checkpoint of `chorus train --model gpt`
//! as plain full-tensor safetensors files (`model-0000i-of-0000N.safetensors`
//! and `model.safetensors.index.json`), which candle and Python's
//! `safetensors` load; see `chorus_fsdp_candle::checkpoint::consolidate`.
//! A checkpoint of `chorus train --model llama` (its directory records the
//! model's config) becomes a Hugging Face model directory instead:
//! `config.json` and the weights in `--save-dtype`, which
//! `LlamaForCausalLM.from_pretrained` loads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use chorus_fsdp_candle::checkpoint::FullTensors;
use chorus_fsdp_candle::CheckpointError;

use crate::size::{format_bytes, parse_nonzero_bytes};
use crate::{Outcome, UsageError};

/// The file in a checkpoint directory of `chorus train --model llama` that
/// records the Llama's config, from which a Hugging Face directory is written.
pub(crate) const LLAMA_CONFIG_FILE: &str = "llama-config.json";

/// Arguments of `chorus consolidate`.
#[derive(Debug, clap::Args)]
pub struct ConsolidateArgs {
    /// The checkpoint: a `step-*` directory, or a checkpoint directory with a `latest` file.
    pub checkpoint: PathBuf,
    /// The directory to write (it must not exist; written whole or not at all).
    pub out: PathBuf,
    /// Start a new file when one would pass this size (K/M/G = 1024-based, or plain bytes).
    #[arg(long, default_value = "2G", value_parser = parse_nonzero_bytes)]
    pub max_file_bytes: u64,
    /// Llama checkpoints: dtype of the Hugging Face model written (f32 or bf16).
    #[arg(long, value_enum, default_value = "f32")]
    pub save_dtype: crate::train::SaveDtypeArg,
}

/// Whether a checkpoint error says the path given names no checkpoint (a
/// mistake in the arguments, exit status 2, alike for `chorus consolidate`
/// and `chorus train --resume`) rather than a damaged one.
pub(crate) fn names_no_checkpoint(e: &CheckpointError) -> bool {
    matches!(
        e,
        CheckpointError::NotFound { .. }
            | CheckpointError::NotACheckpoint { .. }
            | CheckpointError::DanglingLatest { .. }
    )
}

/// Runs `chorus consolidate`.
pub fn run(args: &ConsolidateArgs) -> anyhow::Result<Outcome> {
    // A link to nothing counts: writing through it would fail half-way.
    if let Ok(m) = std::fs::symlink_metadata(&args.out) {
        let what = if m.file_type().is_symlink() && !args.out.exists() { " (a symbolic link to nothing)" } else { "" };
        return Err(UsageError(format!(
            "{} exists{what}; consolidate writes a new directory: give a path that does not exist",
            args.out.display()
        ))
        .into());
    }
    match chorus_fsdp_candle::checkpoint::resolve(&args.checkpoint) {
        Err(e) if names_no_checkpoint(&e) => return Err(UsageError(e.to_string()).into()),
        Err(e) => return Err(e).with_context(|| format!("consolidating {}", args.checkpoint.display())),
        Ok(_) => {}
    }
    let max = usize::try_from(args.max_file_bytes)
        .map_err(|_| UsageError(format!("--max-file-bytes {} is too large", format_bytes(args.max_file_bytes))))?;
    if let Some(config) = llama_config(&args.checkpoint) {
        return consolidate_llama(args, &config, max);
    }
    if args.save_dtype != crate::train::SaveDtypeArg::F32 {
        return Err(UsageError("--save-dtype is for checkpoints of --model llama".into()).into());
    }
    // Its staging directory goes if a signal ends the run (`crate::interrupt`).
    let stage = chorus_fsdp_candle::checkpoint::consolidate_stage(&args.out);
    crate::interrupt::remove_if_interrupted(&stage);
    let files = chorus_fsdp_candle::checkpoint::consolidate(&args.checkpoint, &args.out, max)
        .with_context(|| format!("consolidating {}", args.checkpoint.display()));
    crate::interrupt::forget(&stage);
    let files = files?;
    crate::print_out(format_args!(
        "wrote {} file(s) and model.safetensors.index.json to {}\n",
        files.len(),
        args.out.display()
    ))?;
    Ok(Outcome::Passed)
}

/// The Llama config a checkpoint directory (or a `step-*` directory's
/// parent) records, if it is a checkpoint of `--model llama`.
fn llama_config(checkpoint: &Path) -> Option<PathBuf> {
    let name = LLAMA_CONFIG_FILE;
    [Some(checkpoint), checkpoint.parent()].into_iter().flatten().map(|d| d.join(name)).find(|p| p.is_file())
}

/// A Llama checkpoint as a Hugging Face model directory: each parameter
/// read whole from the shard files (checked against the config's names
/// and shapes first) and streamed into the weights files in the asked
/// dtype, one tensor at a time, in a staging directory renamed to `out`
/// when complete.
fn consolidate_llama(args: &ConsolidateArgs, config: &Path, max: usize) -> anyhow::Result<Outcome> {
    chorus_train::files::regular_file(config).with_context(|| format!("reading {}", config.display()))?;
    let text = std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let cfg = chorus_train::models::llama::config::LlamaConfig::from_json(&text)
        .with_context(|| format!("reading {}", config.display()))?;
    // This process's own (`.NAME.consolidate-PID`), removed if a signal ends the run.
    let stage = chorus_fsdp_candle::checkpoint::consolidate_stage(&args.out);
    let mut full =
        FullTensors::open(&args.checkpoint).with_context(|| format!("consolidating {}", args.checkpoint.display()))?;
    // The checkpoint's tensors are the config's, by name and shape, before anything is written.
    let saved: BTreeMap<String, Vec<usize>> = full.tensors().into_iter().collect();
    let wanted: BTreeMap<String, Vec<usize>> = cfg.param_shapes().into_iter().collect();
    if saved != wanted {
        let differs = wanted
            .iter()
            .find(|(n, s)| saved.get(*n) != Some(*s))
            .map(|(n, s)| format!("{n}: the config gives {s:?}, the checkpoint {:?}", saved.get(n)))
            .or_else(|| {
                saved.keys().find(|n| !wanted.contains_key(*n)).map(|n| format!("{n} is not a parameter of the config"))
            })
            .unwrap_or_default();
        return Err(UsageError(format!(
            "{}: the checkpoint is not of the Llama {} records ({differs})",
            args.checkpoint.display(),
            config.display()
        ))
        .into());
    }
    if let Some(parent) = stage.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::create_dir(&stage).with_context(|| format!("creating {}", stage.display()))?;
    crate::interrupt::remove_if_interrupted(&stage);
    let result = (|| -> anyhow::Result<usize> {
        let layout = chorus_train::models::llama::hf::HfLayout::new(&cfg, args.save_dtype.dtype(), max);
        let mut w = chorus_train::models::llama::hf::HfWriter::create(&stage, &cfg, layout.clone())?;
        for name in layout.order() {
            w.write(&full.read(&name)?)?;
        }
        let files = w.finish()?;
        std::fs::rename(&stage, &args.out)
            .with_context(|| format!("renaming {} to {}", stage.display(), args.out.display()))?;
        Ok(files.len())
    })();
    // Only what this command created goes.
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    crate::interrupt::forget(&stage);
    let files = result?;
    crate::print_out(format_args!("wrote a Hugging Face Llama directory ({files} files) to {}\n", args.out.display()))?;
    Ok(Outcome::Passed)
}
