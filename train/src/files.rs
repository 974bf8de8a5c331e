//! File-system checks every reader and writer of this crate makes before
//! touching a path (a regular file to read, a destination that may be
//! written), and where a file is staged until it is complete. Their errors
//! are the file system's (`std::io`), or a [`PathError`] naming the path.

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
