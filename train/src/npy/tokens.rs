//! Token files: 2-d integer `.npy` arrays of token ids (what `chorus
//! tokenize` writes and `chorus train --data` reads), read memory-mapped
//! and written row by row.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::header::{header_of, numel, split};
use super::{bad, Result};
use crate::files::{check_dest, regular_file, staged_path};

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

/// The columns (a sequence's tokens and its last target) of a token `.npy`
/// file, from its header alone (the ids are neither read nor checked).
pub fn token_columns(path: &Path) -> Result<usize> {
    regular_file(path).map_err(|e| bad(path, e))?;
    // A header is at most 64 KiB (format 1.0's length field), and a token file's far less.
    let mut bytes = Vec::new();
    std::fs::File::open(path).and_then(|f| f.take(1 << 16).read_to_end(&mut bytes)).map_err(|e| bad(path, e))?;
    let (descr, shape, _) = split(&bytes).map_err(|e| bad(path, e))?;
    id_type(&descr).map_err(|e| bad(path, e))?;
    match shape[..] {
        [_, cols] => Ok(cols),
        _ => Err(bad(path, format!("token ids must be a 2-d array [sequences, seq_len + 1], found shape {shape:?}"))),
    }
}

/// The id type NumPy's descriptor `descr` names.
fn id_type(descr: &str) -> std::result::Result<IdType, String> {
    match descr {
        "<u2" | "=u2" | "|u2" => Ok(IdType::U16),
        "<u4" | "=u4" => Ok(IdType::U32),
        "<i4" | "=i4" => Ok(IdType::I32),
        "<i8" | "=i8" => Ok(IdType::I64),
        d => Err(format!("token ids must be uint16, uint32, int32 or int64 ('<u2', '<u4', '<i4', '<i8'), found '{d}'")),
    }
}

/// The rows, columns, data offset and id type of a token `.npy` file.
fn token_layout(bytes: &[u8]) -> std::result::Result<(usize, usize, usize, IdType), String> {
    let (descr, shape, data) = split(bytes)?;
    let [rows, cols] = shape[..] else {
        return Err(format!("token ids must be a 2-d array [sequences, seq_len + 1], found shape {shape:?}"));
    };
    let dtype = id_type(&descr)?;
    let count = numel(&shape)?;
    let needed = count.checked_mul(dtype.width()).ok_or(format!("shape {shape:?} has too many elements"))?;
    if data.len() != needed {
        return Err(format!("shape {shape:?} needs {needed} data bytes, found {}", data.len()));
    }
    Ok((rows, cols, bytes.len() - data.len(), dtype))
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
        check_dest(dest, overwrite).map_err(|e| bad(dest, e.why))?;
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
        check_dest(&self.dest, self.overwrite).map_err(|e| bad(&self.dest, e.why))?;
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

#[cfg(test)]
mod tests {
    use super::super::file_with_header;
    use super::*;

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
}
