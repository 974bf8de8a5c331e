//! File-system checks every reader and writer of this crate makes before
//! touching a path: a regular file to read, a destination that may be
//! written. Their errors are the file system's (`std::io`), or a
//! [`PathError`] naming the path.

use std::path::{Path, PathBuf};

/// A path that cannot be used as asked: which, and why.
#[derive(Debug, thiserror::Error)]
#[error("{}: {why}", path.display())]
pub struct PathError {
    /// The path.
    pub path: PathBuf,
    /// Why it cannot be used.
    pub why: String,
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

/// Refuses to replace `dest` unless `overwrite`, and then only a regular file.
pub fn check_dest(dest: &Path, overwrite: bool) -> Result<(), PathError> {
    let refuse = |why: String| Err(PathError { path: dest.to_path_buf(), why });
    match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => refuse(e.to_string()),
        Ok(m) if !m.is_file() => refuse("exists and is not a regular file; choose another path".into()),
        Ok(_) if !overwrite => refuse("exists; give --overwrite to replace it".into()),
        Ok(_) => Ok(()),
    }
}
