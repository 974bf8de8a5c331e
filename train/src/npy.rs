//! Reading and writing float32 `.npy` files (NumPy's format 1.0/2.0), the
//! interchange format for initial weights, data and trained parameters.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use chorus_fsdp::{FsdpError, Result};

/// A float32 array: its shape and row-major values.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    /// The shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> FsdpError {
    FsdpError::InvalidArgument(format!("{}: {why}", path.display()))
}

/// Reads a little-endian float32, C-order `.npy` file.
pub fn read(path: &Path) -> Result<Array> {
    regular_file(path).map_err(|e| bad(path, e))?;
    let mut bytes = Vec::new();
    std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(|e| bad(path, e))?;
    parse(&bytes).map_err(|e| bad(path, e))
}

fn parse(bytes: &[u8]) -> std::result::Result<Array, String> {
    let (descr, shape, data) = split(bytes)?;
    if !["<f4", "|f4", "=f4"].contains(&descr.as_str()) {
        return Err(format!("only little-endian float32 ('<f4') is supported, found '{descr}'"));
    }
    let count = numel(&shape)?;
    let needed = count.checked_mul(4).ok_or(format!("shape {shape:?} has too many elements"))?;
    if data.len() != needed {
        return Err(format!("shape {shape:?} needs {needed} data bytes, found {}", data.len()));
    }
    let values = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Array { shape, values })
}

fn numel(shape: &[usize]) -> std::result::Result<usize, String> {
    shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d)).ok_or(format!("shape {shape:?} has too many elements"))
}

/// A C-order `.npy` file's dtype descriptor, shape and data bytes.
fn split(bytes: &[u8]) -> std::result::Result<(String, Vec<usize>, &[u8]), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not an .npy file".into());
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let end = start.checked_add(header_len).ok_or("header length overflows")?;
    let header = bytes.get(start..end).ok_or("truncated header")?;
    if !header.is_ascii() {
        return Err("the header is not ASCII".into());
    }
    let header = std::str::from_utf8(header).map_err(|_| "the header is not text")?;
    let dict = header_dict(header)?;
    let get =
        |key: &str| dict.iter().find(|(k, _)| k == key).map(|(_, v)| v).ok_or(format!("the header has no '{key}'"));
    let descr = match get("descr")? {
        Value::Str(d) => d.clone(),
        other => return Err(format!("descr must be a string, found {other}")),
    };
    match get("fortran_order")? {
        Value::Bool(false) => {}
        Value::Bool(true) => return Err("Fortran-order arrays are not supported".into()),
        other => return Err(format!("fortran_order must be True or False, found {other}")),
    }
    let shape = match get("shape")? {
        Value::Tuple(dims) => dims.clone(),
        other => return Err(format!("shape must be a tuple of integers, found {other}")),
    };
    Ok((descr, shape, &bytes[end..]))
}

/// Token ids: a 2-d integer array `[rows, cols]`, row-major, memory-mapped
/// from a `.npy` file ([`read_tokens`]: a rank reads only the rows it
/// trains on) or held in memory ([`Tokens::from_ids`]).
#[derive(Clone)]
pub struct Tokens {
    /// Rows (sequences).
    pub rows: usize,
    /// Columns (tokens per sequence).
    pub cols: usize,
    ids: Ids,
    /// The largest id (0 when there are none).
    max: u32,
    /// What identifies the ids (FNV-1a over them, seeded with `cols`).
    hash: u64,
}

#[derive(Clone)]
enum Ids {
    Memory(std::sync::Arc<Vec<u32>>),
    /// The file mapped, where its data starts, and the ids' type.
    Mapped {
        map: std::sync::Arc<memmap2::Mmap>,
        start: usize,
        dtype: IdType,
    },
}

/// The integer types a token file holds ids in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdType {
    /// `<u2`: vocabularies of at most 65,536 tokens (what `chorus tokenize` writes for them).
    U16,
    /// `<u4`: larger vocabularies (what `chorus tokenize` writes for them).
    U32,
    /// `<i4`.
    I32,
    /// `<i8` (`numpy.save` of a Python list of ints).
    I64,
}

impl IdType {
    /// Bytes per id.
    pub fn width(self) -> usize {
        match self {
            IdType::U16 => 2,
            IdType::U32 | IdType::I32 => 4,
            IdType::I64 => 8,
        }
    }

    /// The narrowest unsigned type that holds every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> IdType {
        if vocab_size <= 1 << 16 {
            IdType::U16
        } else {
            IdType::U32
        }
    }

    /// NumPy's descriptor.
    pub fn descr(self) -> &'static str {
        match self {
            IdType::U16 => "<u2",
            IdType::U32 => "<u4",
            IdType::I32 => "<i4",
            IdType::I64 => "<i8",
        }
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.ids {
            Ids::Memory(_) => "in memory",
            Ids::Mapped { .. } => "mapped",
        };
        write!(f, "Tokens {{ rows: {}, cols: {}, {kind}, hash: {:#x} }}", self.rows, self.cols, self.hash)
    }
}

/// FNV-1a over the ids, seeded with the row length (the data's identity
/// that checkpoints record).
struct IdHash(u64);

impl IdHash {
    fn new(cols: usize) -> IdHash {
        IdHash(0xcbf2_9ce4_8422_2325u64 ^ cols as u64)
    }
    fn add(&mut self, id: u32) {
        self.0 = (self.0 ^ id as u64).wrapping_mul(0x100_0000_01b3);
    }
}

/// One id of `dtype` (`c` holds its little-endian bytes), as the valid id it must be.
fn decode_id(c: &[u8], dtype: IdType) -> std::result::Result<u32, i64> {
    let v: i64 = match dtype {
        IdType::U16 => u16::from_le_bytes([c[0], c[1]]) as i64,
        IdType::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
        IdType::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
        IdType::I64 => i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
    };
    u32::try_from(v).map_err(|_| v)
}

impl Tokens {
    /// `rows × cols` ids held in memory (row-major).
    pub fn from_ids(rows: usize, cols: usize, ids: Vec<u32>) -> std::result::Result<Tokens, String> {
        if rows.checked_mul(cols) != Some(ids.len()) {
            return Err(format!("{} ids are not {rows} rows of {cols}", ids.len()));
        }
        let mut hash = IdHash::new(cols);
        ids.iter().for_each(|t| hash.add(*t));
        let max = ids.iter().copied().max().unwrap_or(0);
        Ok(Tokens { rows, cols, ids: Ids::Memory(std::sync::Arc::new(ids)), max, hash: hash.0 })
    }

    /// Id `i` (row-major); `i` must be below `rows × cols`.
    pub fn id(&self, i: usize) -> u32 {
        match &self.ids {
            Ids::Memory(v) => v.get(i).copied().unwrap_or(0),
            Ids::Mapped { map, start, dtype } => {
                let width = dtype.width();
                let at = start + i * width;
                map.get(at..at + width).and_then(|c| decode_id(c, *dtype).ok()).unwrap_or(0)
            }
        }
    }

    /// Appends row `r`'s ids from column `from` on to `out`.
    pub fn extend_row(&self, r: usize, from: usize, out: &mut Vec<u32>) {
        let base = r * self.cols;
        out.extend((base + from..base + self.cols).map(|i| self.id(i)));
    }

    /// The largest id (0 when there are none).
    pub fn max_id(&self) -> u32 {
        self.max
    }

    /// The position of the first id at least `v`, if any.
    pub fn first_at_least(&self, v: u32) -> Option<usize> {
        if self.max < v {
            return None;
        }
        (0..self.rows * self.cols).find(|i| self.id(*i) >= v)
    }

    /// What identifies the ids (a resumed run must train on the same).
    pub fn content_hash(&self) -> u64 {
        self.hash
    }
}

/// Refuses what is not a regular file (a FIFO or a device would block a
/// read forever, a directory cannot be read): `path` as the error names it.
pub fn regular_file(path: &Path) -> std::io::Result<()> {
    let m = std::fs::metadata(path)?;
    if m.is_file() {
        return Ok(());
    }
    let what = if m.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
    Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("is {what}; give a regular file")))
}

/// Reads a 2-d little-endian C-order `.npy` array of token ids: uint16,
/// uint32 (what `chorus tokenize` writes), int32 or int64 (what `numpy.save`
/// of Python ints gives), memory-mapped:
/// the ids are checked (a negative id, or one beyond `u32`, is an error
/// naming its position) in one streamed pass that holds none of them, and
/// training then reads only the rows it uses. Only a regular file is read.
pub fn read_tokens(path: &Path) -> Result<Tokens> {
    regular_file(path).map_err(|e| bad(path, e))?;
    let file = std::fs::File::open(path).map_err(|e| bad(path, e))?;
    // SAFETY: the map is read-only; like the model's weights, chorus
    // requires the data not to be modified while a run reads it.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(path, e))?;
    let (rows, cols, start, dtype) = token_layout(&map).map_err(|e| bad(path, e))?;
    let width = dtype.width();
    // The check and the hash read the file in pieces (the page cache holds
    // them, not this process), so even a file larger than memory is checked.
    let mut reader = std::io::BufReader::with_capacity(1 << 20, &file);
    std::io::Seek::seek(&mut reader, std::io::SeekFrom::Start(start as u64)).map_err(|e| bad(path, e))?;
    let (mut hash, mut max) = (IdHash::new(cols), 0u32);
    let mut c = [0u8; 8];
    for i in 0..rows * cols {
        reader.read_exact(&mut c[..width]).map_err(|e| bad(path, e))?;
        let id = decode_id(&c[..width], dtype).map_err(|v| {
            bad(path, format!("token id {v} at row {}, column {} is not a valid id", i / cols, i % cols))
        })?;
        hash.add(id);
        max = max.max(id);
    }
    Ok(Tokens { rows, cols, ids: Ids::Mapped { map: std::sync::Arc::new(map), start, dtype }, max, hash: hash.0 })
}

/// The rows, columns, data offset and id type of a token `.npy` file.
fn token_layout(bytes: &[u8]) -> std::result::Result<(usize, usize, usize, IdType), String> {
    let (descr, shape, data) = split(bytes)?;
    let [rows, cols] = shape[..] else {
        return Err(format!("token ids must be a 2-d array [sequences, seq_len + 1], found shape {shape:?}"));
    };
    let dtype = match descr.as_str() {
        "<u2" | "=u2" | "|u2" => IdType::U16,
        "<u4" | "=u4" => IdType::U32,
        "<i4" | "=i4" => IdType::I32,
        "<i8" | "=i8" => IdType::I64,
        d => {
            return Err(format!(
                "token ids must be uint16, uint32, int32 or int64 ('<u2', '<u4', '<i4', '<i8'), found '{d}'"
            ))
        }
    };
    let count = numel(&shape)?;
    let needed = count.checked_mul(dtype.width()).ok_or(format!("shape {shape:?} has too many elements"))?;
    if data.len() != needed {
        return Err(format!("shape {shape:?} needs {needed} data bytes, found {}", data.len()));
    }
    Ok((rows, cols, bytes.len() - data.len(), dtype))
}

/// A value of the header's Python dict literal.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Str(s) => write!(f, "'{s}'"),
            Value::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Value::Tuple(t) => write!(f, "{t:?}"),
        }
    }
}

/// Parses the header: `{'key': value, ...}` with string, boolean and
/// integer-tuple values (what NumPy writes), and nothing else.
fn header_dict(text: &str) -> std::result::Result<Vec<(String, Value)>, String> {
    let b = text.trim().as_bytes();
    let mut i = 0;
    let skip = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let expect = |i: &mut usize, c: u8| -> std::result::Result<(), String> {
        if b.get(*i) == Some(&c) {
            *i += 1;
            Ok(())
        } else {
            Err(format!("malformed header: expected `{}` at byte {i}", c as char))
        }
    };
    let string = |i: &mut usize| -> std::result::Result<String, String> {
        let quote = *b.get(*i).ok_or("malformed header: unexpected end")?;
        if quote != b'\'' && quote != b'"' {
            return Err(format!("malformed header: expected a string at byte {i}"));
        }
        let from = *i + 1;
        let len = b[from..].iter().position(|c| *c == quote).ok_or("malformed header: unterminated string")?;
        *i = from + len + 1;
        Ok(String::from_utf8_lossy(&b[from..from + len]).into_owned())
    };
    expect(&mut i, b'{')?;
    let mut out = Vec::new();
    loop {
        skip(&mut i);
        if b.get(i) == Some(&b'}') {
            break;
        }
        let key = string(&mut i)?;
        skip(&mut i);
        expect(&mut i, b':')?;
        skip(&mut i);
        let value = match b.get(i) {
            Some(b'\'') | Some(b'"') => Value::Str(string(&mut i)?),
            Some(b'T') if b[i..].starts_with(b"True") => {
                i += 4;
                Value::Bool(true)
            }
            Some(b'F') if b[i..].starts_with(b"False") => {
                i += 5;
                Value::Bool(false)
            }
            Some(b'(') => {
                i += 1;
                let mut dims = Vec::new();
                loop {
                    skip(&mut i);
                    if b.get(i) == Some(&b')') {
                        i += 1;
                        break;
                    }
                    let from = i;
                    while i < b.len() && b[i].is_ascii_digit() {
                        i += 1;
                    }
                    if from == i {
                        return Err(format!("malformed shape: expected a dimension at byte {from}"));
                    }
                    let digits = std::str::from_utf8(&b[from..i]).map_err(|_| "malformed shape")?;
                    dims.push(digits.parse::<usize>().map_err(|_| format!("dimension {digits} is too large"))?);
                    skip(&mut i);
                    match b.get(i) {
                        Some(b',') => i += 1,
                        Some(b')') => {}
                        _ => return Err(format!("malformed shape: expected `,` or `)` at byte {i}")),
                    }
                }
                Value::Tuple(dims)
            }
            _ => return Err(format!("malformed header: unexpected value at byte {i}")),
        };
        out.push((key, value));
        skip(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => {}
            _ => return Err(format!("malformed header: expected `,` or `}}` at byte {i}")),
        }
    }
    Ok(out)
}

/// Writes a float32 `.npy` file (format 1.0).
pub fn write(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    let out = encode(shape, values).map_err(|e| bad(path, e))?;
    std::fs::File::create(path).and_then(|mut f| f.write_all(&out)).map_err(|e| bad(path, e))
}

/// The bytes of a float32 `.npy` file (format 1.0) of `shape` and `values`.
pub fn encode(shape: &[usize], values: &[f32]) -> std::result::Result<Vec<u8>, String> {
    let count = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
    if count != Some(values.len()) {
        return Err(format!("{} values for shape {shape:?}", values.len()));
    }
    let mut out = header(shape);
    out.reserve(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Ok(out)
}

/// The header of a float32 `.npy` file (format 1.0) of `shape`: the values
/// follow it, little-endian, row-major.
pub fn header(shape: &[usize]) -> Vec<u8> {
    header_of("<f4", shape)
}

/// The header (format 1.0, padded to a multiple of 64 bytes) of an array of
/// NumPy type `descr` and `shape`.
fn header_of(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

/// A token file `[rows, cols]` written row by row, so that no more than a
/// buffer of it is ever in memory: into a staged file beside `dest` (its
/// header's row count fixed up at the end: a 2-d token header is 128 bytes
/// whatever the counts), renamed into place by [`finish`](Self::finish).
/// Dropped unfinished, it removes the staged file, so an interrupted run
/// leaves no half-written output.
#[derive(Debug)]
pub struct TokenWriter {
    file: Option<std::io::BufWriter<std::fs::File>>,
    staged: PathBuf,
    dest: PathBuf,
    dtype: IdType,
    cols: usize,
    rows: usize,
    overwrite: bool,
    bytes: Vec<u8>,
}

/// The size of a 2-d token file's header (see [`TokenWriter`]).
const TOKEN_HEADER: usize = 128;

impl TokenWriter {
    /// Starts `dest` (rows of `cols` ids of `dtype`, unsigned). An existing
    /// `dest` is refused unless `overwrite`, and then only a regular file is replaced.
    pub fn create(dest: &Path, dtype: IdType, cols: usize, overwrite: bool) -> Result<TokenWriter> {
        if cols == 0 || matches!(dtype, IdType::I32 | IdType::I64) {
            return Err(bad(
                dest,
                format!("token rows are written as uint16 or uint32, of at least one id ({cols} asked)"),
            ));
        }
        check_dest(dest, overwrite)?;
        let staged = staged_path(dest, std::process::id()).ok_or_else(|| bad(dest, "names no file"))?;
        let file =
            std::fs::OpenOptions::new().write(true).create_new(true).open(&staged).map_err(|e| bad(&staged, e))?;
        let mut w = TokenWriter {
            file: Some(std::io::BufWriter::with_capacity(1 << 20, file)),
            staged,
            dest: dest.to_path_buf(),
            dtype,
            cols,
            rows: 0,
            overwrite,
            bytes: Vec::new(),
        };
        w.put(&header_of(dtype.descr(), &[0, cols]))?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        match self.file.as_mut() {
            Some(f) => f.write_all(bytes).map_err(|e| bad(&self.staged, e)),
            None => Err(bad(&self.staged, "already finished")),
        }
    }

    /// Appends one row: `cols` ids, each fitting the file's type.
    pub fn write_row(&mut self, ids: &[u32]) -> Result<()> {
        if ids.len() != self.cols {
            return Err(bad(&self.dest, format!("a row of {} ids, the rows have {}", ids.len(), self.cols)));
        }
        let mut bytes = std::mem::take(&mut self.bytes);
        bytes.clear();
        for id in ids {
            match self.dtype {
                IdType::U16 => match u16::try_from(*id) {
                    Ok(v) => bytes.extend_from_slice(&v.to_le_bytes()),
                    Err(_) => return Err(bad(&self.dest, format!("token id {id} does not fit uint16"))),
                },
                _ => bytes.extend_from_slice(&id.to_le_bytes()),
            }
        }
        let put = self.put(&bytes);
        self.bytes = bytes;
        put?;
        self.rows += 1;
        Ok(())
    }

    /// Rows written so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Writes the header's row count, syncs the file and renames it into
    /// place (checking again that it replaces nothing it may not).
    pub fn finish(mut self) -> Result<PathBuf> {
        let header = header_of(self.dtype.descr(), &[self.rows, self.cols]);
        let Some(writer) = self.file.take() else { return Err(bad(&self.staged, "already finished")) };
        let staged = self.staged.clone();
        let io = |e: std::io::Error| bad(&staged, e);
        if header.len() != TOKEN_HEADER {
            return Err(bad(&self.dest, format!("a {}-byte header, {TOKEN_HEADER} expected", header.len())));
        }
        let mut file = writer.into_inner().map_err(|e| io(e.into_error()))?;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).and_then(|_| file.sync_all()).map_err(io)?;
        drop(file);
        check_dest(&self.dest, self.overwrite)?;
        std::fs::rename(&self.staged, &self.dest).map_err(io)?;
        self.staged = PathBuf::new();
        Ok(self.dest.clone())
    }
}

impl Drop for TokenWriter {
    fn drop(&mut self) {
        if !self.staged.as_os_str().is_empty() {
            self.file = None;
            let _ = std::fs::remove_file(&self.staged);
        }
    }
}

/// Where process `pid` stages `dest` (a token file, a tokenizer) until it
/// is complete: `.NAME.PID.partial` beside it; `None` where `dest` names no file.
pub fn staged_path(dest: &Path, pid: u32) -> Option<PathBuf> {
    let name = dest.file_name()?;
    Some(dest.with_file_name(format!(".{}.{pid}.partial", name.to_string_lossy())))
}

/// Removes the files of `dest` staged by processes that no longer run (an
/// interrupted run's; [`staged_path`]); a running process's are kept,
/// whatever it is. Returns those removed.
pub fn remove_stale_staged(dest: &Path) -> Vec<PathBuf> {
    let (Some(name), Some(parent)) = (dest.file_name(), dest.parent()) else { return Vec::new() };
    let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let pid =
            file.strip_prefix(&prefix).and_then(|r| r.strip_suffix(".partial")).and_then(|p| p.parse::<u32>().ok());
        let Some(pid) = pid else { continue };
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        let dead = pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists();
        if is_file && dead && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    removed
}

/// Refuses to replace `dest` unless `overwrite`, and then only a regular file.
pub fn check_dest(dest: &Path, overwrite: bool) -> Result<()> {
    match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(bad(dest, e)),
        Ok(m) if !m.is_file() => Err(bad(dest, "exists and is not a regular file; choose another path")),
        Ok(_) if !overwrite => Err(bad(dest, "exists; give --overwrite to replace it")),
        Ok(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_other_dtypes() {
        let dir = std::env::temp_dir().join(format!("chorus-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for shape in [vec![3usize], vec![2, 3], vec![2, 1, 4], vec![0, 5]] {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
            let p = dir.join("a.npy");
            write(&p, &shape, &values).unwrap();
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!((bytes.len() - values.len() * 4) % 64, 0, "header aligned to 64 bytes");
            assert_eq!(read(&p).unwrap(), Array { shape, values });
        }
        // A float64 header (as numpy writes for np.float64) is refused with a clear error.
        let mut f64_file = b"\x93NUMPY\x01\x00".to_vec();
        let h = "{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }          \n";
        f64_file.extend_from_slice(&(h.len() as u16).to_le_bytes());
        f64_file.extend_from_slice(h.as_bytes());
        f64_file.extend_from_slice(&1.0f64.to_le_bytes());
        assert!(parse(&f64_file).unwrap_err().contains("float32"));
        assert!(parse(b"garbage").is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn token_ids_in_every_integer_dtype() {
        let dir = std::env::temp_dir().join(format!("chorus-npy-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |name: &str, bytes: Vec<u8>| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            read_tokens(&p).map_err(|e| e.to_string())
        };
        let h = |d: &str| format!("{{'descr': '{d}', 'fortran_order': False, 'shape': (2, 3), }}");
        let i4: Vec<u8> = [0i32, 1, 2, 70000, 4, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let i8: Vec<u8> = [0i64, 1, 2, 70000, 4, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let u2: Vec<u8> = [0u16, 1, 2, 65535, 4, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let u4: Vec<u8> = [0u32, 1, 2, 4_000_000_000, 4, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        for (name, bytes, x) in [("i4", &i4, 70000), ("i8", &i8, 70000), ("u2", &u2, 65535), ("u4", &u4, 4_000_000_000)]
        {
            let t = read(name, file_with_header(&h(&format!("<{name}")), bytes)).unwrap();
            let want = Tokens::from_ids(2, 3, vec![0, 1, 2, x, 4, 5]).unwrap();
            let ids: Vec<u32> = (0..6).map(|i| t.id(i)).collect();
            assert_eq!(ids, vec![0, 1, 2, x, 4, 5], "{name}");
            assert_eq!((t.rows, t.cols, t.max_id()), (2, 3, x));
            assert_eq!(t.content_hash(), want.content_hash(), "{name}: mapped and in-memory ids hash alike");
            let mut row = Vec::new();
            t.extend_row(1, 1, &mut row);
            assert_eq!(row, vec![4, 5]);
            assert_eq!(t.first_at_least(6), Some(3));
        }
        let neg: Vec<u8> = [0i64, 1, 2, -1, 4, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        let err = read("neg", file_with_header(&h("<i8"), &neg)).unwrap_err();
        assert!(err.contains("token id -1 at row 1, column 0"), "{err}");
        assert!(read("be", file_with_header(&h(">i8"), &i8)).unwrap_err().contains("uint16, uint32, int32 or int64"));
        assert!(read("short", file_with_header(&h("<i8"), &i8[..40])).unwrap_err().contains("data bytes"));
        assert!(read_tokens(&dir).unwrap_err().to_string().contains("directory"));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A FIFO given as the data is refused at once (reading it would block
    /// until some writer came), naming the path.
    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_not_read() {
        let dir = std::env::temp_dir().join(format!("chorus-npy-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("tokens.npy");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc_mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        let err = read_tokens(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file") && err.contains("tokens.npy"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[cfg(unix)]
    extern "C" {
        #[link_name = "mkfifo"]
        fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }

    fn file_with_header(h: &str, data: &[u8]) -> Vec<u8> {
        let mut f = b"\x93NUMPY\x01\x00".to_vec();
        f.extend_from_slice(&(h.len() as u16).to_le_bytes());
        f.extend_from_slice(h.as_bytes());
        f.extend_from_slice(data);
        f
    }

    #[test]
    fn malformed_headers_are_errors_not_panics() {
        for (h, why) in [
            ("{'descr': '<f4', 'fortran_order': False, 'shape': ), }", "unexpected value"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,,), }", "malformed shape"),
            ("{'descr': '<fé4', 'fortran_order': False, 'shape': (1,), }", "not ASCII"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (1é,), }", "not ASCII"),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296), }",
                "too many elements",
            ),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }", "too large"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", "needs 24 data bytes"),
            ("{'descr': '<f4', 'fortran_order': 'no', 'shape': (1,), }", "True or False"),
            ("{'descr': '<f4', 'fortran_order': 1, 'shape': (1,), }", "unexpected value"),
            ("{'descr': '<f4', 'shape': (1,), }", "no 'fortran_order'"),
            ("{'descr': '<f4", "unterminated"),
            ("", "expected `{`"),
        ] {
            let err = parse(&file_with_header(h, &[0; 4])).unwrap_err();
            assert!(err.contains(why), "{h:?}: {err}");
        }
        // A (0, n) array parses to no values (the training data checks refuse it).
        let a = parse(&file_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }", &[])).unwrap();
        assert_eq!((a.shape, a.values.len()), (vec![0, 3], 0));
    }

    /// Random mutations of valid files in bounded time: every one parses or
    /// is refused, none panics.
    #[test]
    fn fuzzed_files_never_panic() {
        let mut rng = crate::mlp::SplitMix::new(99);
        let valid = [
            encode(&[2, 3], &[1.0; 6]).unwrap(),
            encode(&[5], &[0.5; 5]).unwrap(),
            file_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1), }", &[0; 4]),
        ];
        let alphabet = b"{}()[],:' \"0123456789TrueFalse<f4descrshape\xc3\xa9\xff\x00";
        let started = std::time::Instant::now();
        let mut n = 0;
        while n < 20_000 && started.elapsed() < std::time::Duration::from_secs(10) {
            let mut f = valid[(rng.next_u64() % 3) as usize].clone();
            for _ in 0..1 + rng.next_u64() % 4 {
                let at = (rng.next_u64() as usize) % f.len().max(1);
                let c = alphabet[(rng.next_u64() as usize) % alphabet.len()];
                match rng.next_u64() % 4 {
                    0 => f[at] = c,
                    1 => f.insert(at, c),
                    2 => {
                        f.remove(at);
                    }
                    _ => f.truncate(at),
                }
                if f.is_empty() {
                    break;
                }
            }
            if let Ok(a) = parse(&f) {
                assert_eq!(a.values.len(), a.shape.iter().product::<usize>());
            }
            n += 1;
        }
        assert!(n >= 1000, "only {n} cases ran");
    }
}
