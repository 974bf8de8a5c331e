//! Reading and writing float32 `.npy` files (NumPy's format 1.0/2.0), the
//! interchange format for initial weights, data and trained parameters.

use std::io::{Read, Write};
use std::path::Path;

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
    let mut bytes = Vec::new();
    std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(|e| bad(path, e))?;
    parse(&bytes).map_err(|e| bad(path, e))
}

fn parse(bytes: &[u8]) -> std::result::Result<Array, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not an .npy file".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = bytes.get(start..start + header_len).ok_or("truncated header")?;
    let header = std::str::from_utf8(header).map_err(|_| "header is not text")?;
    let field = |key: &str| -> std::result::Result<&str, String> {
        let at = header.find(&format!("'{key}'")).ok_or(format!("header has no '{key}'"))?;
        let rest = &header[at + key.len() + 2..];
        Ok(rest.trim_start().trim_start_matches(':').trim_start())
    };
    let descr = field("descr")?;
    if !(descr.starts_with("'<f4'") || descr.starts_with("'|f4'")) {
        return Err(format!("only little-endian float32 ('<f4') is supported, found {}", &descr[..descr.len().min(8)]));
    }
    if field("fortran_order")?.starts_with("True") {
        return Err("Fortran-order arrays are not supported".into());
    }
    let shape_text = field("shape")?;
    let close = shape_text.find(')').ok_or("malformed shape")?;
    let shape: Vec<usize> = shape_text[1..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| format!("bad dimension `{s}`")))
        .collect::<std::result::Result<_, _>>()?;
    let count: usize = shape.iter().product();
    let data = &bytes[start + header_len..];
    if data.len() != count * 4 {
        return Err(format!("shape {shape:?} needs {} data bytes, found {}", count * 4, data.len()));
    }
    let values = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Array { shape, values })
}

/// Writes a float32 `.npy` file (format 1.0).
pub fn write(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    let count: usize = shape.iter().product();
    if count != values.len() {
        return Err(bad(path, format!("{} values for shape {shape:?}", values.len())));
    }
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + values.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::File::create(path).and_then(|mut f| f.write_all(&out)).map_err(|e| bad(path, e))
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
}
