//! safetensors files written once, tensor by tensor ([`StreamWriter`]):
//! every tensor's size is known before its values are, so the header goes
//! first and the values follow as they arrive, converted piece by piece;
//! nothing is encoded in memory and copied. The full model of a run, its
//! consolidation and the checkpoints' shard files are written this way.
//!
//! And a reader's diagnosis of a header safetensors refuses
//! ([`header_problem`]): the library reports an inconsistent offset against
//! the tensor *after* the one that is wrong; this names the wrong one.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::crc32::Crc32;

/// The bytes a [`StreamWriter`] buffers before writing to its file.
pub const WRITE_BUFFER: usize = 256 << 10;

/// A file that could not be written, or a writer used against its plan.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct WriteError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub source: std::io::Error,
}

/// One tensor of a file, as planned before its values come.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Its name in the file.
    pub name: String,
    /// Its dtype on disk: F32 or BF16 (values arrive as f32).
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// What a finished file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    /// Its length in bytes.
    pub bytes: u64,
    /// Its CRC-32 (the checkpoints' per-file checksum).
    pub crc32: u32,
}

/// Bytes per element of the dtypes a [`StreamWriter`] writes.
fn width(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::BF16 => Some(2),
        _ => None,
    }
}

/// The data bytes of `t`, or why it cannot be written.
fn data_bytes(t: &Planned) -> Result<usize, String> {
    let es = width(t.dtype).ok_or_else(|| format!("{}: dtype {:?} is not F32 or BF16", t.name, t.dtype))?;
    t.shape
        .iter()
        .try_fold(es, |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| format!("{}: shape {:?} is too large", t.name, t.shape))
}

/// A safetensors file being written: its header is on disk, its tensors'
/// values follow in plan order ([`StreamWriter::write_f32`]).
pub struct StreamWriter {
    path: PathBuf,
    out: BufWriter<File>,
    /// Each tensor's dtype and element count, in plan order.
    plan: Vec<(Dtype, usize)>,
    /// The tensor being written, and its elements written so far.
    current: usize,
    done: usize,
    crc: Crc32,
    bytes: u64,
    scratch: Vec<u8>,
}

impl StreamWriter {
    /// Creates `path` (it must not exist) and writes the header of the
    /// `tensors` (in this order in the file) and `metadata`.
    pub fn create(
        path: &Path,
        tensors: &[Planned],
        metadata: &BTreeMap<String, String>,
    ) -> Result<StreamWriter, WriteError> {
        let err = |source| WriteError { path: path.to_path_buf(), source };
        let invalid = |m: String| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, m));
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            header.insert("__metadata__".into(), serde_json::json!(metadata));
        }
        let mut offset = 0usize;
        let mut plan = Vec::with_capacity(tensors.len());
        for t in tensors {
            let n = data_bytes(t).map_err(invalid)?;
            let end = offset.checked_add(n).ok_or_else(|| invalid(format!("{}: the file is too large", t.name)))?;
            let entry = serde_json::json!({
                "dtype": format!("{:?}", t.dtype), "shape": t.shape, "data_offsets": [offset, end],
            });
            if header.insert(t.name.clone(), entry).is_some() || t.name == "__metadata__" {
                return Err(invalid(format!("tensor name `{}` given twice", t.name)));
            }
            plan.push((t.dtype, t.shape.iter().product::<usize>()));
            offset = end;
        }
        let mut text = serde_json::to_string(&header).map_err(|e| invalid(e.to_string()))?.into_bytes();
        // The data starts 8-byte aligned, as safetensors' own writer pads it.
        text.resize(text.len().next_multiple_of(8), b' ');
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(err)?;
        let mut w = StreamWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(WRITE_BUFFER, file),
            plan,
            current: 0,
            done: 0,
            crc: Crc32::new(),
            bytes: 0,
            scratch: Vec::new(),
        };
        w.put(&(text.len() as u64).to_le_bytes())?;
        w.put(&text)?;
        w.skip_empty();
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        self.out.write_all(bytes).map_err(|source| WriteError { path: self.path.clone(), source })?;
        self.crc.update(bytes);
        self.bytes += bytes.len() as u64;
        Ok(())
    }

    /// Moves past the tensors whose values are complete (empty ones included).
    fn skip_empty(&mut self) {
        while self.plan.get(self.current).is_some_and(|(_, n)| self.done == *n) {
            self.current += 1;
            self.done = 0;
        }
    }

    /// The next `values` of the file, in plan order (a piece may end one
    /// tensor and start the next), converted to each tensor's dtype (BF16
    /// rounded to nearest even, as `torch.Tensor.to(torch.bfloat16)`).
    pub fn write_f32(&mut self, mut values: &[f32]) -> Result<(), WriteError> {
        while !values.is_empty() {
            let Some(&(dtype, numel)) = self.plan.get(self.current) else {
                return Err(WriteError {
                    path: self.path.clone(),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "more values than the tensors hold"),
                });
            };
            let take = (numel - self.done).min(values.len());
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.clear();
            match dtype {
                Dtype::BF16 => {
                    scratch.extend(values[..take].iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()))
                }
                _ => scratch.extend(values[..take].iter().flat_map(|x| x.to_le_bytes())),
            }
            let put = self.put(&scratch);
            self.scratch = scratch;
            put?;
            self.done += take;
            values = &values[take..];
            self.skip_empty();
        }
        Ok(())
    }

    /// Whether every tensor's values have been written.
    pub fn is_complete(&self) -> bool {
        self.current == self.plan.len()
    }

    /// Checks that every value was written, flushes and syncs the file.
    pub fn finish(mut self) -> Result<Written, WriteError> {
        let path = self.path.clone();
        let err = |source| WriteError { path: path.clone(), source };
        if !self.is_complete() {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "fewer values than the tensors hold",
            )));
        }
        self.out.flush().map_err(err)?;
        self.out.get_ref().sync_all().map_err(err)?;
        Ok(Written { bytes: self.bytes, crc32: self.crc.finish() })
    }
}

/// Which tensor makes a safetensors header inconsistent, for a file of
/// `file_len` bytes whose header (the JSON after the 8-byte length) is
/// `header`: one whose `data_offsets` do not hold its dtype and shape, else
/// one that starts where the previous one does not end, else one that runs
/// past the file. `None` when no tensor is at fault (or the header is not
/// readable JSON, which the library's own message describes).
pub fn header_problem(header: &[u8], file_len: u64) -> Option<String> {
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut spans = Vec::new();
    for (name, t) in v.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let offsets: Vec<u64> = serde_json::from_value(t.get("data_offsets")?.clone()).ok()?;
        let shape: Vec<u64> = serde_json::from_value(t.get("shape")?.clone()).ok()?;
        let dtype: Dtype = serde_json::from_value(t.get("dtype")?.clone()).ok()?;
        let &[s, e] = &offsets[..] else {
            return Some(format!("tensor {name}: data_offsets {offsets:?} are not [begin, end]"));
        };
        let needed = shape.iter().try_fold(dtype.bitsize() as u64, |a, d| a.checked_mul(*d)).map(|bits| bits / 8);
        if e < s || needed != Some(e - s) {
            return Some(format!(
                "tensor {name}: data_offsets [{s}, {e}] hold {} bytes; {dtype:?} {shape:?} needs {}",
                e.saturating_sub(s),
                needed.map_or_else(|| "more than fit".to_string(), |n| n.to_string())
            ));
        }
        spans.push((s, e, name));
    }
    spans.sort();
    let data = file_len.saturating_sub(8 + header.len() as u64);
    if contiguous(spans.iter().map(|s| (s.0, s.1)), data, 0) {
        return None;
    }
    // One tensor moved leaves the others contiguous but for a hole of its
    // size: that one is at fault (searched where the header is small enough).
    if spans.len() <= 4096 {
        let culprits: Vec<&(u64, u64, &String)> = (0..spans.len())
            .filter(|&i| {
                let rest = spans.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, s)| (s.0, s.1));
                contiguous(rest, data, spans[i].1 - spans[i].0)
            })
            .map(|i| &spans[i])
            .collect();
        if let [(s, e, name)] = culprits[..] {
            return Some(format!(
                "tensor {name}: data_offsets [{s}, {e}] overlap another tensor or leave a gap; the others leave room for it elsewhere"
            ));
        }
    }
    let mut end = 0;
    for (s, e, name) in &spans {
        if *s != end {
            return Some(format!("tensor {name}: its data starts at byte {s}, the tensor before it ends at {end}"));
        }
        end = *e;
    }
    let last = spans.last().map_or("(none)", |s| s.2.as_str());
    Some(format!("the tensors' data ends at byte {end} (tensor {last}); the file holds {data} bytes of data"))
}

/// Whether the sorted `spans` cover `0..total` end to end, but for one
/// hole of exactly `hole` bytes (none when `hole` is 0).
fn contiguous(spans: impl Iterator<Item = (u64, u64)>, total: u64, hole: u64) -> bool {
    let (mut end, mut holes) = (0u64, 0);
    for (s, e) in spans {
        if s != end {
            if hole == 0 || holes > 0 || s != end + hole {
                return false;
            }
            holes += 1;
        }
        end = e;
    }
    if end != total {
        if hole == 0 || holes > 0 || total != end + hole {
            return false;
        }
        holes += 1;
    }
    hole == 0 || holes == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("chorus-st-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The streamed file is what safetensors' own serializer describes:
    /// the library reads back every tensor's values, in pieces that cross
    /// tensor boundaries; an empty tensor and bf16 included.
    #[test]
    fn streamed_file_reads_back() {
        let dir = tmp("read");
        let path = dir.join("m.safetensors");
        let plan = vec![
            Planned { name: "b".into(), dtype: Dtype::F32, shape: vec![2, 3] },
            Planned { name: "empty".into(), dtype: Dtype::F32, shape: vec![0, 4] },
            Planned { name: "a".into(), dtype: Dtype::BF16, shape: vec![5] },
        ];
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut w = StreamWriter::create(&path, &plan, &meta).unwrap();
        let values: Vec<f32> = (0..11).map(|i| i as f32 * 0.5 + 0.25).collect();
        for piece in values.chunks(4) {
            w.write_f32(piece).unwrap();
        }
        let written = w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(written.bytes, bytes.len() as u64);
        assert_eq!(written.crc32, crate::crc32::crc32(&bytes));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let b = st.tensor("b").unwrap();
        assert_eq!(b.shape(), &[2, 3]);
        let got: Vec<f32> = b.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, values[..6]);
        let a = st.tensor("a").unwrap();
        assert_eq!(a.dtype(), Dtype::BF16);
        let got: Vec<f32> =
            a.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
        assert_eq!(got, values[6..]);
        assert_eq!(st.tensor("empty").unwrap().shape(), &[0, 4]);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Too few or too many values, a second writer, a duplicate name: errors.
    #[test]
    fn misuse_is_an_error() {
        let dir = tmp("misuse");
        let path = dir.join("m.safetensors");
        let plan = vec![Planned { name: "x".into(), dtype: Dtype::F32, shape: vec![3] }];
        let mut w = StreamWriter::create(&path, &plan, &BTreeMap::new()).unwrap();
        assert!(StreamWriter::create(&path, &plan, &BTreeMap::new()).is_err(), "an existing file is never replaced");
        w.write_f32(&[1.0, 2.0]).unwrap();
        assert!(w.finish().is_err(), "fewer values than planned");
        let other = dir.join("n.safetensors");
        let mut w = StreamWriter::create(&other, &plan, &BTreeMap::new()).unwrap();
        assert!(w.write_f32(&[1.0, 2.0, 3.0, 4.0]).is_err(), "more values than planned");
        let twice = vec![plan[0].clone(), plan[0].clone()];
        assert!(StreamWriter::create(&dir.join("o.safetensors"), &twice, &BTreeMap::new()).is_err());
        let f16 = vec![Planned { name: "h".into(), dtype: Dtype::F16, shape: vec![1] }];
        assert!(StreamWriter::create(&dir.join("p.safetensors"), &f16, &BTreeMap::new()).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Tensor `a`'s offsets moved onto `b`'s: safetensors blames `b` (now
    /// first, starting at 8); the diagnosis names `a`. A size that does not
    /// match the shape is named too.
    #[test]
    fn a_corrupt_offset_is_named_on_its_tensor() {
        // Written as a [0, 8], b [8, 12], c [12, 16]; a's offsets corrupted to [8, 16].
        let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"c":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0u8; 16]);
        let lib = safetensors::SafeTensors::read_metadata(&file).unwrap_err();
        assert!(matches!(&lib, safetensors::SafeTensorError::InvalidOffset(n) if n == "b"), "{lib}");
        let ours = header_problem(header, file.len() as u64).unwrap();
        assert!(ours.starts_with("tensor a:"), "{ours}");
        let header = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let ours = header_problem(header, 8 + header.len() as u64 + 12).unwrap();
        assert!(ours.starts_with("tensor a:"), "{ours}");
        let good = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        assert_eq!(header_problem(good, 8 + good.len() as u64 + 4), None);
    }
}
