//! The byte-level text the decoders train on without token rows: `--text`'s
//! file, or text generated from `--seed`.

use chorus_train::text::{self, TextData};

use super::args::TrainArgs;
use crate::usage;

/// The text of a `--text` file: UTF-8, or else Latin-1 (every byte one
/// character), so that any file reads; characters outside the vocabulary
/// become spaces when encoded. Only a regular file is read (a FIFO would
/// block the run).
fn read_text(path: &std::path::Path) -> anyhow::Result<String> {
    let bad = |e: std::io::Error| usage(format!("--text {}: {e}", path.display()));
    chorus_train::files::regular_file(path).map_err(bad)?;
    let bytes = std::fs::read(path).map_err(bad)?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| e.into_bytes().iter().map(|b| char::from(*b)).collect()))
}

/// Windows of `seq_len` tokens of `--text`'s file or generated text, drawn
/// with `--seed`.
pub(super) fn text_data(args: &TrainArgs, seq_len: usize) -> anyhow::Result<TextData> {
    let corpus = match &args.text {
        Some(path) => read_text(path)?,
        None => text::generate(200_000, args.seed),
    };
    TextData::new(text::encode(&corpus), seq_len, args.seed).ok_or_else(|| {
        usage(format!(
            "the text has {} characters; --seq-len {seq_len} needs at least {}",
            corpus.chars().count(),
            seq_len + 2
        ))
    })
}
