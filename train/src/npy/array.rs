//! float32 arrays in `.npy` files: the initial weights, data and trained
//! parameters chorus exchanges with PyTorch and NumPy users.

use std::io::{Read, Write};
use std::path::Path;

use super::header::{header_of, numel, split};
use super::{bad, Result};
use crate::files::regular_file;

/// A float32 array: its shape and row-major values.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    /// The shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
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

#[cfg(test)]
mod tests {
    use super::super::file_with_header;
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
        let mut rng = crate::rng::SplitMix::new(99);
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
