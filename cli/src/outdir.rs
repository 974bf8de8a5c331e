//! An output directory written all at once: a run writes into a staging
//! directory beside it and renames it into place only when everything is
//! written, so an out-dir holds one complete run (the previous one until the
//! new one is complete), never a mix; a lock beside it refuses a second live
//! run into the same out-dir.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

/// Whether process `pid` is alive (Linux: its `/proc` entry exists).
fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    dir.with_file_name(format!(".{name}.{suffix}"))
}

/// A locked out-dir and its staging directory.
#[derive(Debug)]
pub struct OutDir {
    dest: PathBuf,
    stage: PathBuf,
    lock: PathBuf,
    committed: bool,
}

impl OutDir {
    /// Locks `dest` against other runs (a stale lock of a dead process is
    /// taken over) and creates the staging directory, so an unwritable
    /// location is found before any work.
    pub fn acquire(dest: &Path) -> anyhow::Result<OutDir> {
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        if dest.exists() && !dest.is_dir() {
            anyhow::bail!("{} exists and is not a directory", dest.display());
        }
        let lock = sibling(dest, "lock");
        let me = std::process::id();
        for attempt in 0..2 {
            match OpenOptions::new().write(true).create_new(true).open(&lock) {
                Ok(mut f) => {
                    f.write_all(format!("{me}\n").as_bytes())
                        .and_then(|_| f.sync_all())
                        .with_context(|| format!("writing {}", lock.display()))?;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt == 0 => {
                    let mut text = String::new();
                    File::open(&lock).and_then(|mut f| f.read_to_string(&mut text)).ok();
                    match text.trim().parse::<u32>() {
                        Ok(pid) if alive(pid) => anyhow::bail!(
                            "{} is being written by another chorus run (pid {pid}); its lock is {}",
                            dest.display(),
                            lock.display()
                        ),
                        // A lock left by a run that died (or half-written): take it over.
                        _ => {
                            std::fs::remove_file(&lock).with_context(|| format!("removing stale {}", lock.display()))?
                        }
                    }
                }
                Err(e) => return Err(e).with_context(|| format!("creating the lock {}", lock.display())),
            }
        }
        let out =
            OutDir { dest: dest.to_path_buf(), stage: sibling(dest, &format!("partial-{me}")), lock, committed: false };
        out.remove_dead_partials(parent);
        if out.stage.exists() {
            std::fs::remove_dir_all(&out.stage).with_context(|| format!("removing {}", out.stage.display()))?;
        }
        std::fs::create_dir(&out.stage).with_context(|| format!("creating {}", out.stage.display()))?;
        Ok(out)
    }

    /// Staging directories of runs that died (their pid is gone).
    fn remove_dead_partials(&self, parent: &Path) {
        let prefix = match self.dest.file_name() {
            Some(n) => format!(".{}.partial-", n.to_string_lossy()),
            None => return,
        };
        for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) {
                if !alive(pid) {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
    }

    /// Where this run writes its files.
    pub fn stage(&self) -> &Path {
        &self.stage
    }

    /// The out-dir the files will be in.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Syncs the staged files and renames the staging directory to the
    /// out-dir. A previous out-dir is swapped with the new one in one step
    /// (Linux's `renameat2(RENAME_EXCHANGE)`), so at every instant the
    /// out-dir is one complete run; where the file system cannot exchange,
    /// the previous one is moved aside first (a crash between the two renames
    /// leaves it beside, as `.NAME.old-PID`). The previous run is then removed.
    pub fn commit(mut self) -> anyhow::Result<()> {
        sync_tree(&self.stage)?;
        if self.dest.exists() {
            if exchange(&self.stage, &self.dest).is_ok() {
                // The staging path now holds the previous run.
                let _ = std::fs::remove_dir_all(&self.stage);
            } else {
                let old = sibling(&self.dest, &format!("old-{}", std::process::id()));
                let _ = std::fs::remove_dir_all(&old);
                std::fs::rename(&self.dest, &old)
                    .with_context(|| format!("moving the previous {} aside", self.dest.display()))?;
                std::fs::rename(&self.stage, &self.dest)
                    .with_context(|| format!("renaming into {}", self.dest.display()))?;
                let _ = std::fs::remove_dir_all(&old);
            }
        } else {
            std::fs::rename(&self.stage, &self.dest)
                .with_context(|| format!("renaming into {}", self.dest.display()))?;
        }
        if let Some(parent) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            File::open(parent).and_then(|f| f.sync_all()).ok();
        }
        self.committed = true;
        Ok(())
    }
}

/// Swaps two paths atomically (`renameat2` with `RENAME_EXCHANGE`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "no atomic exchange of directories here"))
}

fn sync_tree(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", path.display()))?;
        }
    }
    File::open(dir).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", dir.display()))
}

impl Drop for OutDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.stage);
        }
        let _ = std::fs::remove_file(&self.lock);
    }
}

/// Writes `bytes` to `path` with the path in any error.
pub fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_replaces_the_out_dir_whole_and_a_second_run_is_refused() {
        let root = std::env::temp_dir().join(format!("chorus-outdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dest = root.join("run");
        let a = OutDir::acquire(&dest).unwrap();
        write_file(&a.stage().join("one"), b"1").unwrap();
        let err = OutDir::acquire(&dest).unwrap_err().to_string();
        assert!(err.contains("another chorus run"), "{err}");
        a.commit().unwrap();
        assert_eq!(std::fs::read(dest.join("one")).unwrap(), b"1");
        // A failed run (dropped without commit) leaves the previous out-dir as it was.
        let b = OutDir::acquire(&dest).unwrap();
        write_file(&b.stage().join("two"), b"2").unwrap();
        drop(b);
        assert!(dest.join("one").exists() && !dest.join("two").exists());
        // A lock of a dead process is taken over.
        std::fs::write(sibling(&dest, "lock"), b"4294967294\n").unwrap();
        let c = OutDir::acquire(&dest).unwrap();
        write_file(&c.stage().join("three"), b"3").unwrap();
        c.commit().unwrap();
        assert!(!dest.join("one").exists() && dest.join("three").exists(), "never a mix of two runs");
        std::fs::remove_dir_all(&root).ok();
    }
}
