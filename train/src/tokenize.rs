//! Text in: documents read from text files in pieces, encoded with a
//! [`HfTokenizer`] in parallel over the cores, joined with its end-of-text
//! token and packed into rows of `seq_len + 1` ids — the token rows
//! `chorus train --model llama --data` reads (row `k` is ids
//! `k·(S+1) .. (k+1)·(S+1)` of the stream; the tail that fills no row is
//! dropped) — written as they fill ([`TokenWriter`]) or kept in memory.
//!
//! What a document is ([`Format`]): in plain text, a run of lines ended by
//! a blank line (one with only whitespace) or the end of the file, its text
//! verbatim but for the last line's line break; in JSON lines, the string
//! field `field` of each line's object (blank lines skipped). An empty
//! document gives nothing, not even an end-of-text token.
//!
//! A file's UTF-8 byte-order mark is not text: it is left out.
//!
//! Memory stays bounded whatever the input's size: files are read line by
//! line, at most [`BATCH_BYTES`] of text is encoded at once, and a document
//! longer than [`MAX_DOC_BYTES`] (a run of lines, or one long line or JSON
//! string) is encoded in pieces of at most that size, cut at a line end
//! where there is one, else before a space that follows a word, else
//! between two characters (a line longer than [`MAX_LINE_BYTES`] is an
//! error naming it): encoding takes about a hundred times its text's bytes,
//! so a piece, not a document, sets the memory. The order of the output is
//! the input's, however many threads encode.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::npy::{IdType, TokenWriter};
use crate::tokenizer::{HfTokenizer, TokenizerError};

/// The longest sequence (`--seq-len`) rows are packed for.
pub const MAX_SEQ_LEN: usize = 1 << 20;
/// The longest line read (longer is an error naming the file and line).
pub const MAX_LINE_BYTES: usize = 16 << 20;
/// A document is encoded in pieces of at most this size (see the module's doc).
pub const MAX_DOC_BYTES: usize = 1 << 20;
/// The text encoded in parallel at once.
pub const BATCH_BYTES: usize = 4 << 20;

/// How documents are laid out in the input files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// Plain text: documents separated by blank lines.
    Text,
    /// JSON lines: one object per line, the document in its string field `field`.
    JsonLines {
        /// The field holding the text.
        field: String,
    },
}

/// What goes wrong turning text into token rows.
#[derive(Debug, thiserror::Error)]
pub enum TextInError {
    /// An input file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line of an input is not what the format needs.
    #[error("{}:{line}: {why}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: u64,
        /// What is wrong.
        why: String,
    },
    /// `seq_len` is 0 or above [`MAX_SEQ_LEN`].
    #[error("the sequence length must be from 1 to {MAX_SEQ_LEN}, {0} asked")]
    SeqLen(usize),
    /// The input gives no full row.
    #[error("the input gives {tokens} tokens, fewer than one row of seq_len + 1 = {cols}")]
    TooFewTokens {
        /// Tokens in the stream (end-of-text tokens included).
        tokens: u64,
        /// Ids per row.
        cols: usize,
    },
    /// The tokenizer failed or has no end-of-text token.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The output could not be written.
    #[error("{0}")]
    Output(String),
}

/// What this module returns.
pub type Result<T> = std::result::Result<T, TextInError>;

/// What a packing pass saw and wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Packed {
    /// Non-empty documents.
    pub documents: u64,
    /// Tokens in the stream, end-of-text tokens included.
    pub tokens: u64,
    /// Rows of `seq_len + 1` written.
    pub rows: u64,
    /// Tokens at the end that filled no row.
    pub dropped: u64,
    /// Bytes of input read.
    pub bytes: u64,
}

/// Where packed rows go.
pub trait RowSink {
    /// One row of `seq_len + 1` ids.
    fn row(&mut self, ids: &[u32]) -> Result<()>;
}

impl RowSink for TokenWriter {
    fn row(&mut self, ids: &[u32]) -> Result<()> {
        self.write_row(ids).map_err(|e| TextInError::Output(e.to_string()))
    }
}

/// Rows kept in memory (row-major), at most `limit` ids.
#[derive(Debug, Default)]
pub struct MemoryRows {
    /// The ids.
    pub ids: Vec<u32>,
    /// The most ids kept; a row beyond is an error.
    pub limit: usize,
}

impl RowSink for MemoryRows {
    fn row(&mut self, ids: &[u32]) -> Result<()> {
        if self.ids.len() + ids.len() > self.limit {
            return Err(TextInError::Output(format!("more than {} token ids to hold in memory", self.limit)));
        }
        self.ids.extend_from_slice(ids);
        Ok(())
    }
}

/// A piece of a document, whether it is the document's last, and whether
/// a piece of the same document came before it.
struct Piece {
    text: String,
    ends_doc: bool,
    continued: bool,
}

/// Where to cut `text` (longer than `limit`) so that the first part has at
/// most `limit` bytes and is not empty: after the last line end within the
/// limit, else before the last space that follows a word (the byte-level
/// pre-tokenizer's own boundary, ` word`), else at the last character
/// boundary.
fn cut_point(text: &str, limit: usize) -> usize {
    let head = &text.as_bytes()[..limit.min(text.len())];
    if let Some(p) = head.iter().rposition(|b| *b == b'\n').filter(|p| *p > 0) {
        return p + 1;
    }
    let space_after_word =
        (1..head.len()).rev().find(|&i| head[i].is_ascii_whitespace() && !head[i - 1].is_ascii_whitespace());
    if let Some(i) = space_after_word {
        return i;
    }
    let mut i = limit.min(text.len());
    while i > 1 && !text.is_char_boundary(i) {
        i -= 1;
    }
    // A first character longer than the limit (a limit under 4 bytes) is kept whole.
    if i <= 1 {
        return text.char_indices().nth(1).map_or(text.len(), |(i, _)| i);
    }
    i
}

/// `text`, a whole document (`ends_doc`) or its start, as pieces of at
/// most [`MAX_DOC_BYTES`] (the last one holding what is left when the
/// document goes on); `continued`: a piece of it came before.
fn split_pieces(mut text: String, ends_doc: bool, mut continued: bool, out: &mut std::collections::VecDeque<Piece>) {
    while text.len() > MAX_DOC_BYTES {
        let rest = text.split_off(cut_point(&text, MAX_DOC_BYTES));
        out.push_back(Piece { text, ends_doc: false, continued });
        continued = true;
        text = rest;
    }
    out.push_back(Piece { text, ends_doc, continued });
}

/// The documents of the input files, read a line at a time.
struct Documents<'a> {
    inputs: &'a [PathBuf],
    format: &'a Format,
    file: usize,
    reader: Option<BufReader<std::fs::File>>,
    line: u64,
    bytes: u64,
    /// The plain-text document being gathered.
    doc: String,
    /// Whether pieces of the document being gathered went out already.
    doc_continued: bool,
    /// Pieces cut and not yet handed out.
    pending: std::collections::VecDeque<Piece>,
    buf: Vec<u8>,
}

impl<'a> Documents<'a> {
    fn new(inputs: &'a [PathBuf], format: &'a Format) -> Documents<'a> {
        Documents {
            inputs,
            format,
            file: 0,
            reader: None,
            line: 0,
            bytes: 0,
            doc: String::new(),
            doc_continued: false,
            pending: std::collections::VecDeque::new(),
            buf: Vec::new(),
        }
    }

    fn path(&self) -> &Path {
        &self.inputs[self.file.min(self.inputs.len().saturating_sub(1))]
    }

    fn input_err(&self, why: impl Into<String>) -> TextInError {
        TextInError::Input { path: self.path().to_path_buf(), line: self.line, why: why.into() }
    }

    /// The next line of the inputs (without its end when it is blank-checked),
    /// or `None` at the end of a file (`Some(None)`) and of them all (`None`).
    fn next_line(&mut self) -> Result<Option<Option<String>>> {
        if self.file >= self.inputs.len() {
            return Ok(None);
        }
        if self.reader.is_none() {
            let path = self.path().to_path_buf();
            let io = |source| TextInError::Io { path: path.clone(), source };
            crate::files::regular_file(&path).map_err(io)?;
            self.reader = Some(BufReader::with_capacity(1 << 20, std::fs::File::open(&path).map_err(io)?));
            self.line = 0;
        }
        let Some(reader) = self.reader.as_mut() else { return Ok(None) };
        self.buf.clear();
        let n = reader
            .by_ref()
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut self.buf)
            .map_err(|source| TextInError::Io { path: self.inputs[self.file].clone(), source })?;
        if n == 0 {
            self.reader = None;
            self.file += 1;
            return Ok(Some(None));
        }
        self.line += 1;
        self.bytes += n as u64;
        if n > MAX_LINE_BYTES {
            return Err(self.input_err(format!("a line longer than {MAX_LINE_BYTES} bytes")));
        }
        let text = std::str::from_utf8(&self.buf).map_err(|e| {
            self.input_err(format!("not UTF-8 (byte {} of the line); convert it first", e.valid_up_to()))
        })?;
        // A byte-order mark says how the file is encoded; it is no part of the text.
        let text = if self.line == 1 { text.strip_prefix('\u{feff}').unwrap_or(text) } else { text };
        Ok(Some(Some(text.to_string())))
    }

    /// The next piece of a document, or `None` at the end of the inputs.
    fn next_piece(&mut self) -> Result<Option<Piece>> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                return Ok(Some(p));
            }
            let Some(line) = self.next_line()? else {
                return Ok(None);
            };
            match (self.format, line) {
                (Format::Text, Some(line)) if !line.trim().is_empty() => {
                    self.doc.push_str(&line);
                    if self.doc.len() > MAX_DOC_BYTES {
                        // All but the last piece go out; the last one gathers the lines that follow.
                        let doc = std::mem::take(&mut self.doc);
                        split_pieces(doc, false, self.doc_continued, &mut self.pending);
                        if let Some(last) = self.pending.pop_back() {
                            self.doc = last.text;
                        }
                        self.doc_continued = true;
                    }
                }
                // A blank line or the end of a file ends the document.
                (Format::Text, _) => {
                    if !self.doc.is_empty() || self.doc_continued {
                        let mut text = std::mem::take(&mut self.doc);
                        let end = text.trim_end_matches(['\n', '\r']).len();
                        text.truncate(end);
                        let continued = std::mem::take(&mut self.doc_continued);
                        return Ok(Some(Piece { text, ends_doc: true, continued }));
                    }
                }
                (Format::JsonLines { .. }, None) => {}
                (Format::JsonLines { field }, Some(line)) => {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let value: serde_json::Value =
                        serde_json::from_str(&line).map_err(|e| self.input_err(format!("not JSON: {e}")))?;
                    let serde_json::Value::Object(mut object) = value else {
                        let kind = match value {
                            serde_json::Value::Array(_) => "an array",
                            serde_json::Value::String(_) => "a string",
                            serde_json::Value::Number(_) => "a number",
                            serde_json::Value::Bool(_) => "a boolean",
                            _ => "null",
                        };
                        return Err(self.input_err(format!(
                            "a JSON line is {kind}, not an object: each line must be an object with the text in its \
                             string field {field:?}"
                        )));
                    };
                    match object.remove(field.as_str()) {
                        Some(serde_json::Value::String(s)) => split_pieces(s, true, false, &mut self.pending),
                        Some(other) => {
                            let kind = if other.is_null() { "null" } else { "not a string" };
                            return Err(self.input_err(format!("field {field:?} is {kind}")));
                        }
                        None => return Err(self.input_err(format!("no field {field:?} (choose it with --field)"))),
                    }
                }
            }
        }
    }

    /// Pieces of about `bytes` of text in all (at least one), empty at the end.
    fn next_batch(&mut self, bytes: usize) -> Result<Vec<Piece>> {
        let (mut batch, mut size) = (Vec::new(), 0);
        while size < bytes {
            match self.next_piece()? {
                Some(p) => {
                    size += p.text.len().max(1);
                    batch.push(p);
                }
                None => break,
            }
        }
        Ok(batch)
    }
}

fn check_seq_len(seq_len: usize) -> Result<()> {
    if seq_len == 0 || seq_len > MAX_SEQ_LEN {
        return Err(TextInError::SeqLen(seq_len));
    }
    Ok(())
}

/// Tokenizes the documents of `inputs` into rows of `seq_len + 1` ids
/// handed to `sink` in order; `progress` is told the bytes read so far.
pub fn pack(
    tok: &HfTokenizer,
    inputs: &[PathBuf],
    format: &Format,
    seq_len: usize,
    sink: &mut dyn RowSink,
    progress: &dyn Fn(u64),
) -> Result<Packed> {
    check_seq_len(seq_len)?;
    let eos = tok.eos()?.id;
    let cols = seq_len + 1;
    let mut docs = Documents::new(inputs, format);
    let (mut row, mut packed) = (Vec::with_capacity(cols), Packed::default());
    let mut push = |ids: &[u32], row: &mut Vec<u32>, packed: &mut Packed| -> Result<()> {
        for id in ids {
            row.push(*id);
            if row.len() == cols {
                sink.row(row)?;
                row.clear();
                packed.rows += 1;
            }
        }
        packed.tokens += ids.len() as u64;
        Ok(())
    };
    loop {
        let batch = docs.next_batch(BATCH_BYTES)?;
        if batch.is_empty() {
            break;
        }
        let encoded = tok.encode_plain_batch(batch.iter().map(|p| p.text.as_str()).collect())?;
        for (piece, ids) in batch.iter().zip(encoded) {
            push(&ids, &mut row, &mut packed)?;
            // The end of an empty document adds nothing; a document cut into pieces ends once.
            if piece.ends_doc && (piece.continued || !ids.is_empty() || !piece.text.is_empty()) {
                push(&[eos], &mut row, &mut packed)?;
                packed.documents += 1;
            }
        }
        progress(docs.bytes);
    }
    packed.dropped = row.len() as u64;
    packed.bytes = docs.bytes;
    if packed.rows == 0 {
        return Err(TextInError::TooFewTokens { tokens: packed.tokens, cols });
    }
    Ok(packed)
}

/// [`pack`] into the token file `out` (uint16 ids where the vocabulary
/// fits, else uint32), staged and renamed into place only when complete;
/// an existing `out` is replaced only with `overwrite`.
pub fn tokenize_to_file(
    tok: &HfTokenizer,
    inputs: &[PathBuf],
    format: &Format,
    seq_len: usize,
    out: &Path,
    overwrite: bool,
    progress: &dyn Fn(u64),
) -> Result<(Packed, IdType)> {
    check_seq_len(seq_len)?;
    tok.eos()?;
    let dtype = IdType::for_vocab(tok.vocab_size());
    let output = |e: crate::npy::NpyError| TextInError::Output(e.to_string());
    let mut writer = TokenWriter::create(out, dtype, seq_len + 1, overwrite).map_err(output)?;
    let packed = pack(tok, inputs, format, seq_len, &mut writer, progress)?;
    writer.finish().map_err(output)?;
    Ok((packed, dtype))
}

/// Trains a byte-level BPE of `vocab_size` tokens
/// ([`train_byte_level_bpe`](crate::tokenizer::train_byte_level_bpe)) on the
/// documents of `inputs`, streamed (a read error ends the stream and is returned).
pub fn train_tokenizer(
    inputs: &[PathBuf],
    format: &Format,
    vocab_size: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<HfTokenizer> {
    let failed: Mutex<Option<TextInError>> = Mutex::new(None);
    let mut docs = Documents::new(inputs, format);
    let texts = std::iter::from_fn(|| match docs.next_piece() {
        Ok(p) => {
            progress(docs.bytes);
            p.map(|p| p.text)
        }
        Err(e) => {
            *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            None
        }
    });
    let trained = crate::tokenizer::train_byte_level_bpe(texts, vocab_size);
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(trained?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::npy::read_tokens;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("chorus-tokenize-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// uint32 rows (vocabularies above 65,536) read back as written; an
    /// unfinished writer leaves nothing; an existing file is kept unless
    /// overwriting is allowed.
    #[test]
    fn token_files_are_staged_and_typed_by_vocabulary() {
        let d = dir("writer");
        assert_eq!((IdType::for_vocab(65_536), IdType::for_vocab(65_537)), (IdType::U16, IdType::U32));
        let out = d.join("t.npy");
        let mut w = TokenWriter::create(&out, IdType::U32, 3, false).unwrap();
        for r in 0..5u32 {
            w.write_row(&[r, 70_000 + r, 4_000_000_000 + r]).unwrap();
        }
        assert!(w.write_row(&[1, 2]).is_err(), "a short row");
        assert!(!out.exists(), "nothing at --out before the end");
        w.finish().unwrap();
        let t = read_tokens(&out).unwrap();
        assert_eq!((t.rows, t.cols, t.id(4), t.id(14)), (5, 3, 70_001, 4_000_000_004));
        assert!(TokenWriter::create(&out, IdType::U16, 3, false).unwrap_err().to_string().contains("--overwrite"));
        let mut w = TokenWriter::create(&out, IdType::U16, 2, true).unwrap();
        assert!(w.write_row(&[1, 65_536]).unwrap_err().to_string().contains("does not fit uint16"));
        drop(w);
        let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("t.npy")], "the staged file is gone, the old one kept");
        assert_eq!(read_tokens(&out).unwrap().rows, 5);
        std::fs::remove_dir_all(&d).ok();
    }

    /// Documents cut by blank lines, an over-long one in pieces, packed in order.
    #[test]
    fn plain_text_documents_and_packing() {
        let d = dir("pack");
        let tok = crate::tokenizer::train_byte_level_bpe(["ab cd ef"].iter(), 260).unwrap();
        let text = "ab cd\nef\n\n \n\ncd ab\n";
        std::fs::write(d.join("a.txt"), text).unwrap();
        std::fs::write(d.join("b.txt"), "ef").unwrap();
        let inputs = [d.join("a.txt"), d.join("b.txt")];
        let mut rows = MemoryRows { ids: Vec::new(), limit: 1000 };
        let seen = std::sync::atomic::AtomicU64::new(0);
        let packed = pack(&tok, &inputs, &Format::Text, 3, &mut rows, &|b| {
            seen.store(b, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
        let mut want = Vec::new();
        for doc in ["ab cd\nef", "cd ab", "ef"] {
            want.extend(tok.encode_plain(doc).unwrap());
            want.push(0);
        }
        let n = want.len() / 4 * 4;
        assert_eq!(rows.ids, want[..n]);
        let bytes = (text.len() + 2) as u64;
        assert_eq!(
            packed,
            Packed {
                documents: 3,
                tokens: want.len() as u64,
                rows: n as u64 / 4,
                dropped: (want.len() - n) as u64,
                bytes
            }
        );
        assert_eq!(seen.into_inner(), bytes);
        let mut small = MemoryRows { ids: Vec::new(), limit: 4 };
        assert!(matches!(pack(&tok, &inputs, &Format::Text, 3, &mut small, &|_| {}), Err(TextInError::Output(_))));
        assert!(matches!(pack(&tok, &inputs, &Format::Text, 0, &mut small, &|_| {}), Err(TextInError::SeqLen(0))));
        // A document longer than MAX_DOC_BYTES is encoded in pieces cut at line ends, ended once.
        let line = "ab ".repeat(1000) + "\n";
        let long = line.repeat(MAX_DOC_BYTES / line.len() + 2);
        std::fs::write(d.join("long.txt"), &long).unwrap();
        let mut rows = MemoryRows { ids: Vec::new(), limit: usize::MAX };
        let packed = pack(&tok, &[d.join("long.txt")], &Format::Text, 7, &mut rows, &|_| {}).unwrap();
        assert_eq!(packed.documents, 1);
        assert_eq!(rows.ids.iter().filter(|i| **i == 0).count(), (packed.dropped == 0) as usize);
        std::fs::remove_dir_all(&d).ok();
    }

    /// Issue 35: one long document (a single line, or a JSON string) is
    /// cut into pieces of at most MAX_DOC_BYTES, at a line end where there
    /// is one, else before a space after a word, else between characters;
    /// the pieces give back the text and end the document once.
    #[test]
    fn long_documents_are_cut_into_bounded_pieces() {
        assert_eq!(cut_point("ab\ncd ef", 7), 3, "after the line end");
        assert_eq!(cut_point("abc def ghi", 9), 7, "before the space after a word");
        assert_eq!(cut_point("abc  def", 5), 3, "before a run of spaces, not inside it");
        assert_eq!(cut_point("日本語日本語", 7), 6, "between characters");
        assert_eq!(cut_point("日本", 2), 3, "a first character longer than the limit is kept whole");
        let d = dir("pieces");
        let words = ["the ", "café ", "日本語 ", "\t"];
        let line: String = (0..(3 * MAX_DOC_BYTES / 5)).map(|i| words[i % words.len()]).collect();
        let spaceless = "語".repeat(MAX_DOC_BYTES / 2);
        for (name, text, format) in [
            ("one.txt", format!("{line}\n"), Format::Text),
            ("one.jsonl", format!("{}\n", serde_json::json!({ "t": line })), Format::JsonLines { field: "t".into() }),
            ("cjk.txt", format!("{spaceless}\n"), Format::Text),
        ] {
            std::fs::write(d.join(name), text).unwrap();
            let inputs = [d.join(name)];
            let mut docs = Documents::new(&inputs, &format);
            let mut pieces = Vec::new();
            while let Some(p) = docs.next_piece().unwrap() {
                pieces.push(p);
            }
            assert!(pieces.len() >= 2, "{name}: {} pieces", pieces.len());
            assert!(pieces.iter().all(|p| p.text.len() <= MAX_DOC_BYTES && !p.text.is_empty()), "{name}");
            let ends: Vec<(bool, bool)> = pieces.iter().map(|p| (p.ends_doc, p.continued)).collect();
            assert_eq!(ends.iter().filter(|e| e.0).count(), 1, "{name}: one end");
            assert!(ends.last().unwrap().0 && !ends[0].1 && ends[1..].iter().all(|e| e.1), "{name}: {ends:?}");
            let joined: String = pieces.iter().map(|p| p.text.as_str()).collect();
            let whole = if name == "cjk.txt" { &spaceless } else { &line };
            assert_eq!(&joined, whole, "{name}");
        }
        std::fs::remove_dir_all(&d).ok();
    }

    /// Issue 35: a byte-order mark starts no document; a JSON line that is
    /// no object says so, rather than missing its field.
    #[test]
    fn byte_order_marks_and_lines_that_are_no_objects() {
        let d = dir("bom");
        let tok = crate::tokenizer::train_byte_level_bpe(["ab cd ef"].iter(), 260).unwrap();
        let json = Format::JsonLines { field: "text".into() };
        std::fs::write(d.join("bom.jsonl"), "\u{feff}{\"text\": \"ab\"}\n").unwrap();
        std::fs::write(d.join("bom.txt"), "\u{feff}ab\n").unwrap();
        for (name, format) in [("bom.jsonl", &json), ("bom.txt", &Format::Text)] {
            let mut rows = MemoryRows { ids: Vec::new(), limit: 100 };
            pack(&tok, &[d.join(name)], format, 1, &mut rows, &|_| {}).unwrap();
            let mut want = tok.encode_plain("ab").unwrap();
            want.push(0);
            assert_eq!(rows.ids[..want.len() / 2 * 2], want[..want.len() / 2 * 2], "{name}");
        }
        for (line, kind) in [("[\"ab\"]", "an array"), ("\"ab\"", "a string"), ("3", "a number"), ("null", "null")] {
            std::fs::write(d.join("x.jsonl"), format!("{{\"text\": \"ab\"}}\n{line}\n")).unwrap();
            let mut rows = MemoryRows { ids: Vec::new(), limit: 100 };
            let e = pack(&tok, &[d.join("x.jsonl")], &json, 1, &mut rows, &|_| {}).unwrap_err().to_string();
            assert!(e.contains(&format!("x.jsonl:2: a JSON line is {kind}, not an object")), "{e}");
        }
        std::fs::remove_dir_all(&d).ok();
    }
}
