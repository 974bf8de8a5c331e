//! NumPy's `.npy` files: float32 arrays (`array`: initial weights, data
//! and trained parameters, the interchange with PyTorch and NumPy users)
//! and token files (`tokens`: rows of token ids, read memory-mapped and
//! written row by row), over one header reader and writer (`header.rs`).
//! Their errors are [`NpyError`]s, naming the file.

mod array;
mod header;
mod tokens;

use std::path::{Path, PathBuf};

pub use array::{encode, header, read, write, Array};
pub use tokens::{read_tokens, token_columns, IdType, TokenWriter, Tokens};

/// A `.npy` file that cannot be read or written: which, and why.
#[derive(Debug, thiserror::Error)]
#[error("{}: {why}", path.display())]
pub struct NpyError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub why: String,
}

/// A result whose error is an [`NpyError`].
pub type Result<T> = std::result::Result<T, NpyError>;

fn bad(path: &Path, why: impl std::fmt::Display) -> NpyError {
    NpyError { path: path.to_path_buf(), why: why.to_string() }
}

/// A `.npy` file's bytes: the version 1.0 magic, `h` as the header, then `data`.
#[cfg(test)]
fn file_with_header(h: &str, data: &[u8]) -> Vec<u8> {
    let mut f = b"\x93NUMPY\x01\x00".to_vec();
    f.extend_from_slice(&(h.len() as u16).to_le_bytes());
    f.extend_from_slice(h.as_bytes());
    f.extend_from_slice(data);
    f
}
