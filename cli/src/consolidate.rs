//! `chorus consolidate`: a sharded checkpoint of `chorus train --model gpt`
//! as plain full-tensor safetensors files (`model-0000i-of-0000N.safetensors`
//! and `model.safetensors.index.json`), which candle and Python's
//! `safetensors` load; see `chorus_fsdp_candle::checkpoint::consolidate`.

use std::path::PathBuf;

use anyhow::Context;

use crate::size::{format_bytes, parse_nonzero_bytes};
use crate::{Outcome, UsageError};

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
}

/// Runs `chorus consolidate`.
pub fn run(args: &ConsolidateArgs) -> anyhow::Result<Outcome> {
    if args.out.exists() {
        return Err(UsageError(format!("{} exists; consolidate writes a new directory", args.out.display())).into());
    }
    let max = usize::try_from(args.max_file_bytes)
        .map_err(|_| UsageError(format!("--max-file-bytes {} is too large", format_bytes(args.max_file_bytes))))?;
    let files = chorus_fsdp_candle::checkpoint::consolidate(&args.checkpoint, &args.out, max)
        .with_context(|| format!("consolidating {}", args.checkpoint.display()))?;
    println!("wrote {} file(s) and model.safetensors.index.json to {}", files.len(), args.out.display());
    Ok(Outcome::Passed)
}
