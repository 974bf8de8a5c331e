//! `chorus tokenize`: text files (plain text, documents separated by blank
//! lines, or JSON lines with `--field`) into the token rows `chorus train
//! --model llama --data` reads, with a Hugging Face `tokenizer.json`, or
//! with a byte-level BPE trained on the same input (`--train-tokenizer`).
//! The work is [`chorus_train::tokenize`]'s; this checks the arguments and
//! paths before anything is read or written, shows the bytes read on
//! stderr (when it is a terminal) and prints one summary line.
//!
//! Nothing it reads is ever written: `--out` (and, with `--train-tokenizer`,
//! `--tokenizer` and its `tokenizer_config.json`) is refused where it is
//! an input or the tokenizer, however spelled (links resolved, hard links
//! by identity). A `tokenizer_config.json` already beside `--tokenizer` is
//! replaced only with the tokenizer it describes (see [`companion_config`]).
//! Outputs are staged (`.NAME.PID.partial`) and renamed into place when
//! complete; SIGINT, SIGTERM and SIGHUP remove this run's staged files
//! before ending it as they would have, SIGUSR1 does not end it
//! ([`crate::interrupt`]), and a later run removes those of
//! runs that died otherwise (a process no longer running; never a live
//! one's).
//!
//! `chorus train --model llama --tokenizer … --text FILE` packs a small text
//! the same way in memory ([`rows_in_memory`]).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use chorus_train::files::{check_dest, regular_file};
use chorus_train::npy::Tokens;
use chorus_train::tokenize::{self, Format, MemoryRows, Packed, MAX_SEQ_LEN};
use chorus_train::tokenizer::HfTokenizer;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::{Outcome, UsageError};

/// The arguments of `chorus tokenize`.
#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    /// The Hugging Face tokenizer.json to encode with (its special tokens from a tokenizer_config.json beside it);
    /// with --train-tokenizer, where the trained one is written (with a tokenizer_config.json beside it).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The text files, read in this order: plain text (a document is a run of lines ended by a blank line or the
    /// end of the file) or, with --field, JSON lines. UTF-8.
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// The token file to write: rows of seq-len + 1 ids, uint16 where the vocabulary fits (≤ 65,536), else uint32.
    #[arg(long)]
    pub out: PathBuf,
    /// Tokens per training sequence: each row holds seq-len + 1 (inputs and the targets one later).
    #[arg(long)]
    pub seq_len: usize,
    /// The inputs are JSON lines; the text of each document is this string field of its line's object.
    #[arg(long)]
    pub field: Option<String>,
    /// The token that ends each document (default: eos_token of tokenizer_config.json, else the first of
    /// <|endoftext|>, </s>, <|end_of_text|>, <|im_end|>, <eos> that the tokenizer has).
    #[arg(long, conflicts_with = "train_tokenizer")]
    pub eos: Option<String>,
    /// Replace an existing --out (and, with --train-tokenizer, --tokenizer and its tokenizer_config.json).
    #[arg(long)]
    pub overwrite: bool,
    /// Train a byte-level BPE on the inputs (<|endoftext|> its end-of-text, beginning and padding token) and write
    /// it to --tokenizer before tokenizing with it.
    #[arg(long, requires = "vocab_size")]
    pub train_tokenizer: bool,
    /// With --train-tokenizer: the vocabulary's size, the 256 bytes and <|endoftext|> included.
    #[arg(long, requires = "train_tokenizer")]
    pub vocab_size: Option<usize>,
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// Runs `chorus tokenize`.
pub fn run(args: &TokenizeArgs) -> anyhow::Result<Outcome> {
    if args.seq_len == 0 || args.seq_len > MAX_SEQ_LEN {
        return Err(usage(format!("--seq-len must be from 1 to {MAX_SEQ_LEN}, {} given", args.seq_len)));
    }
    if args.field.as_deref() == Some("") {
        return Err(usage("--field names no field"));
    }
    let mut total = 0u64;
    for path in &args.input {
        regular_file(path).map_err(|e| usage(format!("--input {}: {e}", path.display())))?;
        total += std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    }
    // Never write what is read (the inputs, the tokenizer encoded with and the tokenizer_config.json beside it,
    // which names its end-of-text token), whatever --overwrite says.
    let config = args.tokenizer.with_file_name("tokenizer_config.json");
    let mut read: Vec<(&str, &Path)> = args.input.iter().map(|p| ("--input", p.as_path())).collect();
    if !args.train_tokenizer {
        read.push(("--tokenizer", &args.tokenizer));
        read.push(("--tokenizer's tokenizer_config.json", &config));
    }
    refuse_overlap("--out", &args.out, &read)?;
    check_dest(&args.out, args.overwrite).map_err(|e| usage(format!("--out: {e}")))?;
    parent_dir("--out", &args.out)?;
    let mut staged = vec![args.out.clone()];
    if args.train_tokenizer {
        let mut taken = read.clone();
        taken.push(("--out", &args.out));
        refuse_overlap("--tokenizer", &args.tokenizer, &taken)?;
        taken.push(("--tokenizer", &args.tokenizer));
        refuse_overlap("--tokenizer's tokenizer_config.json", &config, &taken)?;
        parent_dir("--tokenizer", &args.tokenizer)?;
        companion_config(&args.tokenizer, &config)?;
        for path in [&args.tokenizer, &config] {
            check_dest(path, args.overwrite).map_err(|e| usage(format!("--tokenizer: {e}")))?;
        }
        staged.extend([args.tokenizer.clone(), config.clone()]);
    }
    for path in &staged {
        for stale in chorus_train::files::remove_stale_staged(path) {
            eprintln!("removed {}, left by an interrupted run", stale.display());
        }
    }
    // Removed when a signal ends the run (`crate::interrupt`): their names are this process's.
    for path in &staged {
        if let Some(staged) = chorus_train::files::staged_path(path, std::process::id()) {
            crate::interrupt::remove_if_interrupted(&staged);
        }
    }
    let format = match &args.field {
        Some(field) => Format::JsonLines { field: field.clone() },
        None => Format::Text,
    };
    let started = Instant::now();
    // Printed once everything is written: a closed stdout then loses only the lines, never the outputs.
    let mut trained_line = String::new();
    let tok = if let (true, Some(v)) = (args.train_tokenizer, args.vocab_size) {
        check_encode_memory().map_err(usage)?;
        let bar = bytes_bar(total, "training the tokenizer");
        let trained = tokenize::train_tokenizer(&args.input, &format, v, &|b| bar.set_position(b));
        bar.finish_and_clear();
        let tok = trained?;
        write_staged(&args.tokenizer, tok.json(), args.overwrite)?;
        let config_bytes = serde_json::to_vec_pretty(&tok.config_json(args.seq_len + 1))?;
        write_staged(&config, &config_bytes, args.overwrite)?;
        trained_line = format!(
            "{}: a byte-level BPE of {} tokens trained on {} bytes in {:.1} s (and {})\n",
            args.tokenizer.display(),
            tok.vocab_size(),
            total,
            started.elapsed().as_secs_f64(),
            config.display()
        );
        tok
    } else {
        let tok = HfTokenizer::from_file(&args.tokenizer).map_err(|e| usage(format!("--tokenizer {e}")))?;
        // Once the tokenizer is read (a file too large for one is refused by its size first), before anything is
        // staged.
        check_encode_memory().map_err(usage)?;
        match &args.eos {
            Some(eos) => tok.with_eos(eos).map_err(|e| usage(format!("--eos: {e}")))?,
            None => tok,
        }
    };
    tok.eos().map_err(|e| usage(e.to_string()))?;
    let started = Instant::now();
    let bar = bytes_bar(total, "tokenizing");
    let done = tokenize::tokenize_to_file(&tok, &args.input, &format, args.seq_len, &args.out, args.overwrite, &|b| {
        bar.set_position(b)
    });
    bar.finish_and_clear();
    let (packed, dtype) = done?;
    let secs = started.elapsed().as_secs_f64();
    crate::print_out(format_args!(
        "{trained_line}{}: {} rows of {} ({}): {} documents, {} tokens, {} tail tokens dropped; {} bytes in {secs:.1} s ({:.1} MB/s, {:.0} tokens/s)\n",
        args.out.display(),
        packed.rows,
        args.seq_len + 1,
        dtype.descr(),
        packed.documents,
        packed.tokens,
        packed.dropped,
        packed.bytes,
        packed.bytes as f64 / secs.max(1e-9) / 1e6,
        packed.tokens as f64 / secs.max(1e-9),
    ))?;
    Ok(Outcome::Passed)
}

/// Bytes of address space encoding takes per byte of text encoded at once
/// (the module doc of [`chorus_train::tokenize`] says about a hundred).
const ENCODE_BYTES_PER_BYTE: u128 = 100;

/// Address space each encoding thread takes: its stack, and the malloc
/// arena it makes (64 MiB, mapped as 128 MiB while it is aligned).
const ENCODE_THREAD_BYTES: u128 = 130 << 20;

/// Refuses, before anything is staged or encoded, to tokenize where the
/// address-space limit (`ulimit -v`) cannot hold the encoding: the text
/// encoded at once (a batch of [`tokenize::BATCH_BYTES`], a piece of
/// [`tokenize::MAX_DOC_BYTES`] past it) and the encoding threads. A failed
/// allocation would abort the process, its staged file left behind.
/// Measured peaks (2026-11-29, 2 cores): a 16.8 MB document 621, 710 and
/// 1,448 MB mapped with 1, 2 and 8 threads, against 716, 846 and 1,626
/// MB counted here; a 3 MiB line 486 MB with 2 threads.
fn check_encode_memory() -> Result<(), String> {
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<u128>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) as u128);
    let text = (tokenize::BATCH_BYTES + tokenize::MAX_DOC_BYTES) as u128;
    let needed = text * ENCODE_BYTES_PER_BYTE + threads * ENCODE_THREAD_BYTES;
    crate::size::check_address_space(needed, "tokenizing")
}

/// Refuses an output path whose directory does not exist (before any work is done).
fn parent_dir(flag: &str, path: &Path) -> anyhow::Result<()> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(usage(format!("{flag} {}: the directory {} does not exist", path.display(), parent.display())));
    }
    Ok(())
}

/// Refuses `path` (an output, named by `flag`) where it is one of `taken`
/// (flag and path), however either is spelled.
fn refuse_overlap(flag: &str, path: &Path, taken: &[(&str, &Path)]) -> anyhow::Result<()> {
    match taken.iter().find(|(_, other)| same_file(path, other)) {
        Some((other_flag, other)) => Err(usage(format!(
            "{flag} {} is {other_flag} {}: an output never replaces what the run reads or writes; choose another path",
            path.display(),
            other.display()
        ))),
        None => Ok(()),
    }
}

/// Whether `a` and `b` are one file: one place however spelled (links and
/// `..` resolved, whether or not it exists yet), or one file under two
/// names (a hard link: the same device and inode).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if crate::outdir::resolved(a) == crate::outdir::resolved(b) {
        return true;
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => false,
    }
}

/// Refuses to write the trained tokenizer's `config` (the
/// `tokenizer_config.json` beside `--tokenizer`) over one that describes
/// another tokenizer. Such a file describes the folder's `tokenizer.json`
/// (transformers' layout; chorus reads it beside any `--tokenizer`), so an
/// existing one is replaced only with `--overwrite`, together with the
/// tokenizer it describes: `--tokenizer` exists, and is the folder's
/// `tokenizer.json` or the folder has none.
fn companion_config(tokenizer: &Path, config: &Path) -> anyhow::Result<()> {
    if std::fs::symlink_metadata(config).is_err() {
        return Ok(());
    }
    let folder_tokenizer = tokenizer.with_file_name("tokenizer.json");
    let is_folders = tokenizer.file_name() == folder_tokenizer.file_name() || !folder_tokenizer.exists();
    if tokenizer.exists() && is_folders {
        // Replaced with the tokenizer it describes (check_dest asks for --overwrite).
        return Ok(());
    }
    let whose = if is_folders {
        format!("{} does not exist, so it describes another tokenizer", tokenizer.display())
    } else {
        format!("it describes {}", folder_tokenizer.display())
    };
    Err(usage(format!(
        "--tokenizer {}: the trained tokenizer's config goes beside it as {}, which exists ({whose}); it is \
         never replaced: train the tokenizer into a folder of its own",
        tokenizer.display(),
        config.display()
    )))
}

/// A progress bar of bytes read, drawn on stderr only when it is a terminal.
fn bytes_bar(total: u64, what: &str) -> ProgressBar {
    let target =
        if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what.to_string());
    bar
}

/// Writes `bytes` to `dest` through a staged file beside it, synced and
/// renamed into place: `dest` is whole or untouched. An existing `dest` is
/// replaced only with `overwrite` (and only a regular file).
pub(crate) fn write_staged(dest: &Path, bytes: &[u8], overwrite: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let staged = chorus_train::files::staged_path(dest, std::process::id())
        .with_context(|| format!("{} names no file", dest.display()))?;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&staged)
        .and_then(|mut f| f.write_all(bytes).and_then(|_| f.sync_all()))
        .with_context(|| format!("writing {}", staged.display()))
        .and_then(|_| Ok(check_dest(dest, overwrite)?))
        .and_then(|_| std::fs::rename(&staged, dest).with_context(|| format!("renaming to {}", dest.display())));
    if written.is_err() {
        // Ours (created above), never someone else's file.
        let _ = std::fs::remove_file(&staged);
    }
    written
}

/// The most bytes of text `chorus train --tokenizer … --text` tokenizes in
/// memory; a larger corpus goes through `chorus tokenize` and `--data`.
pub const MAX_TRAIN_TEXT_BYTES: u64 = 256 << 20;

/// The most ids a text of `bytes` bytes packs into rows of `seq_len + 1`:
/// ids never outnumber bytes plus one end-of-text token per line, as every
/// token holds at least one byte.
pub fn ids_bound(bytes: u64, seq_len: usize) -> usize {
    usize::try_from(bytes.saturating_mul(2).saturating_add(seq_len as u64 + 1)).unwrap_or(usize::MAX)
}

/// `--text` tokenized as `chorus tokenize` does, into rows of `seq_len + 1`
/// held in memory (the file at most [`MAX_TRAIN_TEXT_BYTES`]).
pub fn rows_in_memory(tok: &HfTokenizer, text: &Path, seq_len: usize) -> anyhow::Result<(Tokens, Packed)> {
    regular_file(text).map_err(|e| usage(format!("--text {}: {e}", text.display())))?;
    let size = std::fs::metadata(text).with_context(|| format!("--text {}", text.display()))?.len();
    if size > MAX_TRAIN_TEXT_BYTES {
        return Err(usage(format!(
            "--text {} has {size} bytes; with --tokenizer it is tokenized in memory, at most {MAX_TRAIN_TEXT_BYTES}: \
             tokenize a larger corpus with `chorus tokenize` and give --data",
            text.display()
        )));
    }
    check_encode_memory().map_err(|e| usage(format!("--text {}: {e}", text.display())))?;
    let mut rows = MemoryRows { ids: Vec::new(), limit: ids_bound(size, seq_len) };
    let packed = tokenize::pack(tok, &[text.to_path_buf()], &Format::Text, seq_len, &mut rows, &|_| {})
        .map_err(|e| usage(format!("--text: {e}")))?;
    let tokens = Tokens::from_ids(packed.rows as usize, seq_len + 1, rows.ids).map_err(anyhow::Error::msg)?;
    Ok((tokens, packed))
}
