//! `chorus generate`: text from a Hugging Face Llama directory (chorus's
//! `train` output or any `save_pretrained` Llama it loads), tokenized with
//! the directory's `tokenizer.json` and decoded by
//! [`chorus_train::generate::Decoder`] — KV-cached, on the CPU, greedy or
//! sampled as transformers' `generate`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use chorus_train::generate::{Decoder, Decoding, GenerateError, Generation, Sampling};

use crate::{Outcome, UsageError};

/// The most new tokens one run may ask for (the model's
/// `max_position_embeddings` bounds it further).
const MAX_NEW_TOKENS: usize = 1 << 20;

/// Arguments of `chorus generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// The model directory: config.json, the safetensors weights and tokenizer.json.
    pub dir: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// The most tokens to generate (fewer when an end-of-sequence token comes first).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=MAX_NEW_TOKENS as u64))]
    pub max_new_tokens: u64,
    /// Sample with this temperature (0: greedy, the default when no sampling flag is given).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Sampling: keep the K most likely tokens (default 50, transformers' default; 0 keeps all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sampling: keep the most likely tokens whose probability reaches P, in (0, 1] (default 1: all).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Sampling: the generator's seed (default: from the clock, and reported), for repeatable draws.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON object on stdout: prompt_ids, ids (the new tokens), text, and the timings.
    #[arg(long)]
    pub json: bool,
}

/// The decoding the flags ask for: greedy without sampling flags or with
/// `--temperature 0`, else sampling with transformers' defaults for what is not given.
fn decoding(args: &GenerateArgs) -> Result<Decoding, UsageError> {
    let sampling_flags = args.top_k.is_some() || args.top_p.is_some();
    match args.temperature {
        Some(0.0) => {
            if sampling_flags || args.seed.is_some() {
                return Err(UsageError(
                    "--temperature 0 is greedy decoding: --top-k, --top-p and --seed are for sampling".into(),
                ));
            }
            return Ok(Decoding::Greedy);
        }
        None if !sampling_flags => {
            if args.seed.is_some() {
                return Err(UsageError(
                    "--seed is for sampling: give --temperature, --top-k or --top-p too (without them decoding is greedy)"
                        .into(),
                ));
            }
            return Ok(Decoding::Greedy);
        }
        _ => {}
    }
    let seed = args.seed.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        now.as_nanos() as u64
    });
    let s = Sampling {
        temperature: args.temperature.unwrap_or(1.0),
        top_k: Some(args.top_k.unwrap_or(50)),
        top_p: args.top_p,
        seed,
    };
    s.validate().map_err(|e| UsageError(format!("{e}")))?;
    Ok(Decoding::Sample(s))
}

/// The directory's `tokenizer.json`, checked to be a regular file of a sane
/// size before it is read ([`chorus_train::tokenizer::read_tokenizer_json`]).
fn tokenizer(dir: &Path) -> anyhow::Result<tokenizers::Tokenizer> {
    use chorus_train::tokenizer::{read_tokenizer_json, TokenizerError};
    let path = dir.join("tokenizer.json");
    match read_tokenizer_json(&path) {
        Ok((t, _)) => Ok(t),
        Err(TokenizerError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Err(UsageError(format!(
                "{}: no such file; chorus generate tokenizes with the model directory's tokenizer.json",
                path.display()
            ))
            .into())
        }
        Err(e) => Err(UsageError(e.to_string()).into()),
    }
}

/// What `dir`, which is no model directory, is and what to pass instead,
/// where it is something chorus wrote: a `chorus train` out-dir (a Llama's
/// model is in its `model/`; another model's is no Llama), a checkpoint
/// (`chorus consolidate` writes a Llama's as a model directory), a plan.
/// `None` for anything else (the missing file is then named).
fn what_dir_is(dir: &Path) -> Option<String> {
    let d = dir.display();
    let marker = std::fs::read_to_string(dir.join(".chorus-out")).unwrap_or_default();
    let command = marker.lines().find_map(|l| l.strip_prefix("command: ")).map(str::to_string);
    let is_checkpoint = ["chorus_checkpoint.json", "latest"].iter().any(|f| dir.join(f).exists())
        || std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| {
            e.file_name().to_string_lossy().starts_with("step-") && e.path().join("chorus_checkpoint.json").exists()
        });
    match command.as_deref() {
        Some("train") if dir.join("model").join("config.json").exists() => Some(format!(
            "{d} is the out-dir of a `chorus train --model llama` run; its Hugging Face model directory is {}: pass that",
            dir.join("model").display()
        )),
        Some("train") => Some(format!(
            "{d} is the out-dir of a `chorus train` run of a model that is no Hugging Face Llama (--model gpt, moe or \
             mlp); chorus generate runs Llama directories: train one with --model llama and pass its OUT/model"
        )),
        Some(other) => Some(format!("{d} is the out-dir of `chorus {other}`, which holds no model: give a model directory")),
        None if is_checkpoint => Some(format!(
            "{d} is a checkpoint of `chorus train`, not a model directory: a --model llama checkpoint becomes one with \
             `chorus consolidate {d} OUT` (then pass OUT)"
        )),
        None => None,
    }
}

/// PyTorch's name of the dtype computed in (what `model.dtype` prints).
fn torch_name(d: candle_core::DType) -> &'static str {
    match d {
        candle_core::DType::BF16 => "bfloat16",
        candle_core::DType::F16 => "float16",
        _ => "float32",
    }
}

/// Tokens per second, 0 where nothing was timed.
fn rate(tokens: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        tokens as f64 / secs
    } else {
        0.0
    }
}

/// Runs `chorus generate`.
pub fn run(args: &GenerateArgs) -> anyhow::Result<Outcome> {
    let decoding = decoding(args)?;
    if args.prompt.is_empty() {
        return Err(UsageError("--prompt is empty: give the text to continue".into()).into());
    }
    if !args.dir.is_dir() {
        let why = if args.dir.exists() { "is not a directory" } else { "does not exist" };
        return Err(UsageError(format!("{} {why}; give a model directory", args.dir.display())).into());
    }
    if !args.dir.join("config.json").exists() || !args.dir.join("tokenizer.json").exists() {
        if let Some(what) = what_dir_is(&args.dir) {
            return Err(UsageError(what).into());
        }
    }
    let tokenizer = tokenizer(&args.dir)?;
    let decoder = match Decoder::open(&args.dir) {
        Err(GenerateError::Model(e)) => return Err(UsageError(e.to_string()).into()),
        r => r.with_context(|| format!("loading {}", args.dir.display()))?,
    };
    // Ids the model may emit but the tokenizer has no text for are left out of the decoded text: said, never silent.
    let tokenizer_vocab = tokenizer.get_vocab(true).values().max().map_or(0, |m| *m as usize + 1);
    let model_vocab = decoder.config().vocab_size;
    if tokenizer_vocab < model_vocab {
        eprintln!(
            "warning: {}/tokenizer.json has ids below {tokenizer_vocab}, the model's vocab_size is {model_vocab}: \
             ids {tokenizer_vocab}..{} have no text, and any generated is left out of the text (--json lists every id)",
            args.dir.display(),
            model_vocab - 1
        );
    }
    let encoding =
        tokenizer.encode(args.prompt.as_str(), true).map_err(|e| UsageError(format!("tokenizing the prompt: {e}")))?;
    let prompt_ids = encoding.get_ids().to_vec();
    let max_new = args.max_new_tokens as usize;
    let g: Generation = match decoder.generate(&prompt_ids, max_new, &decoding, |_| {}) {
        Err(GenerateError::InvalidArgument(why)) => return Err(UsageError(why).into()),
        r => r.context("generating")?,
    };
    let text = tokenizer.decode(&g.ids, true).map_err(|e| anyhow::anyhow!("decoding the new tokens: {e}"))?;
    let textless: Vec<u32> = g.ids.iter().copied().filter(|&id| id as usize >= tokenizer_vocab).collect();
    if !textless.is_empty() {
        let shown: Vec<String> = textless.iter().take(8).map(u32::to_string).collect();
        eprintln!(
            "warning: {} of the {} new tokens have ids the tokenizer has no text for ({}{}): they are missing from the text",
            textless.len(),
            g.ids.len(),
            shown.join(", "),
            if textless.len() > 8 { ", ..." } else { "" }
        );
    }
    // The prefill computes the first new token; each later one is a decode step.
    let steps = g.ids.len().saturating_sub(1);
    let (prefill_rate, decode_rate) = (rate(prompt_ids.len(), g.prefill_s), rate(steps, g.decode_s));
    let seed = match decoding {
        Decoding::Sample(s) => Some(s.seed),
        Decoding::Greedy => None,
    };
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "prompt_ids": prompt_ids,
            "ids": g.ids,
            "text": text,
            "stopped_at_eos": g.stopped_at_eos,
            "seed": seed,
            "dtype": torch_name(decoder.dtype()),
            "prefill_s": g.prefill_s,
            "decode_s": g.decode_s,
            "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate,
        });
        writeln!(stdout, "{v}")?;
    } else {
        writeln!(stdout, "{}{text}", args.prompt)?;
    }
    stdout.flush()?;
    let seed = seed.map_or(String::new(), |s| format!(", seed {s}"));
    let end = if g.stopped_at_eos { "stopped at end-of-sequence" } else { "max-new-tokens reached" };
    eprintln!(
        "prefill: {} tokens in {:.3} s ({prefill_rate:.1} tokens/s); decode: {steps} tokens in {:.3} s \
         ({decode_rate:.1} tokens/s); {} new tokens, {end}{seed}",
        prompt_ids.len(),
        g.prefill_s,
        g.decode_s,
        g.ids.len()
    );
    Ok(Outcome::Passed)
}
