//! The checkpoint directory of a run: locked like an out-dir, recovered
//! from interrupted saves, and refused to a run that would mix its
//! checkpoints with another run's.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::{resolved, usage, RunLock};

/// A checkpoint directory locked for this run: created (so an unusable one
/// is found before training) and locked like an out-dir, with what
/// interrupted saves left recovered ([`chorus_fsdp_candle::checkpoint::recover`]).
/// One this run created is removed again if the run leaves nothing in it
/// (a resume that failed to load).
#[derive(Debug)]
pub struct CheckpointDir {
    dir: PathBuf,
    created: bool,
    _lock: RunLock,
}

impl CheckpointDir {
    /// Creates and locks `dir` (`--checkpoint-dir`) for a run resuming from
    /// `resume` (if any). A run that is not resuming from a checkpoint in
    /// `dir` is refused while `dir` holds checkpoints (`step-*`, `latest`):
    /// another run's, which its saves would mix with; with `overwrite`
    /// (`--overwrite-checkpoints`) they are removed instead. One that
    /// cannot be created or written is a usage error.
    pub fn acquire(dir: &Path, resume: Option<&Path>, overwrite: bool) -> anyhow::Result<CheckpointDir> {
        if dir.exists() && !dir.is_dir() {
            return Err(usage(format!("--checkpoint-dir {} exists and is not a directory", dir.display())));
        }
        let created = !dir.exists();
        std::fs::create_dir_all(dir)
            .map_err(|e| usage(format!("--checkpoint-dir {}: cannot create it: {e}", dir.display())))?;
        let lock = RunLock::acquire(&dir.join(".lock"), dir)?;
        let out = CheckpointDir { dir: dir.to_path_buf(), created, _lock: lock };
        // Holding the lock, nothing else writes here: what staging left is of a run that died.
        for note in
            chorus_fsdp_candle::checkpoint::recover(dir).with_context(|| format!("recovering {}", dir.display()))?
        {
            eprintln!("{note}");
        }
        let config_tmp = dir.join(format!(".{}.tmp", crate::consolidate::LLAMA_CONFIG_FILE));
        if config_tmp.is_file() {
            let _ = std::fs::remove_file(config_tmp);
        }
        let continues = resume.is_some_and(|r| resolved(r).starts_with(resolved(dir)));
        if continues {
            if overwrite {
                return Err(usage(format!(
                    "--overwrite-checkpoints would remove the checkpoints of --checkpoint-dir {}, which --resume {} continues from",
                    dir.display(),
                    resume.map(|r| r.display().to_string()).unwrap_or_default()
                )));
            }
            return Ok(out);
        }
        let found = checkpoints_in(dir);
        let config = dir.join(crate::consolidate::LLAMA_CONFIG_FILE);
        if found.is_empty() && !overwrite {
            // A Llama run's config with no checkpoint describes nothing: a new run records its own.
            if config.is_file() {
                std::fs::remove_file(&config).with_context(|| format!("removing {}", config.display()))?;
            }
            return Ok(out);
        }
        if !overwrite {
            let shown = found.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
            let more = if found.len() > 5 { format!(" and {} more", found.len() - 5) } else { String::new() };
            return Err(usage(format!(
                "--checkpoint-dir {} holds another run's checkpoints ({shown}{more}), which this run's would mix with: continue that run with --resume {}, start over with --overwrite-checkpoints (removes them), or choose another directory",
                dir.display(),
                dir.display()
            )));
        }
        // Starting over: `latest` first, so no reader follows it into a step
        // being removed; a Llama run's recorded config goes with its checkpoints.
        let mut found = found;
        if config.is_file() {
            found.insert(0, crate::consolidate::LLAMA_CONFIG_FILE.to_string());
        }
        for name in found.iter().rev() {
            let path = dir.join(name);
            let real_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
            let removed = if real_dir { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.with_context(|| format!("--overwrite-checkpoints: removing {}", path.display()))?;
        }
        if !found.is_empty() {
            eprintln!("--overwrite-checkpoints: removed {} from {}", found.join(", "), dir.display());
        }
        Ok(out)
    }
}

/// Another run's checkpoints in a checkpoint directory: its `step-NNNNNNNN`
/// checkpoints, then `latest`.
fn checkpoints_in(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.strip_prefix("step-").is_some_and(|d| d.len() == 8 && d.bytes().all(|b| b.is_ascii_digit())))
        .collect();
    found.sort();
    if std::fs::symlink_metadata(dir.join("latest")).is_ok() {
        found.push("latest".into());
    }
    found
}

impl Drop for CheckpointDir {
    fn drop(&mut self) {
        if !self.created {
            return;
        }
        // Only what this run wrote and nothing else: the Llama's config alone, or nothing.
        let names: Vec<String> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".lock")
            .collect();
        if names.iter().all(|n| n == crate::consolidate::LLAMA_CONFIG_FILE) {
            let _ = std::fs::remove_file(self.dir.join(crate::consolidate::LLAMA_CONFIG_FILE));
            let _ = std::fs::remove_file(self.dir.join(".lock"));
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 24: a run that is not resuming refuses a checkpoint directory
    /// holding another run's checkpoints, naming them, unless told to
    /// start over; one resuming from there continues; a directory the run
    /// created and left empty is removed.
    #[test]
    fn another_runs_checkpoints_are_refused_unless_starting_over() {
        let root = std::env::temp_dir().join(format!("chorus-ckptdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("ckpt");
        drop(CheckpointDir::acquire(&dir, None, false).unwrap());
        assert!(!dir.exists(), "a directory this run created and left empty is removed");
        std::fs::create_dir_all(dir.join("step-00000002")).unwrap();
        std::fs::create_dir_all(dir.join("step-00000004")).unwrap();
        std::fs::write(dir.join("latest"), "step-00000004\n").unwrap();
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        let err = CheckpointDir::acquire(&dir, None, false).unwrap_err().to_string();
        assert!(
            err.contains("step-00000002, step-00000004, latest") && err.contains("--overwrite-checkpoints"),
            "{err}"
        );
        assert!(dir.join("step-00000002").exists() && dir.join("latest").exists());
        // A resume from elsewhere mixes too; one from here continues.
        assert!(CheckpointDir::acquire(&dir, Some(&root.join("other")), false).is_err());
        drop(CheckpointDir::acquire(&dir, Some(&dir.join("step-00000002")), false).unwrap());
        let err = CheckpointDir::acquire(&dir, Some(&dir), true).unwrap_err().to_string();
        assert!(err.contains("continues from"), "{err}");
        drop(CheckpointDir::acquire(&dir, None, true).unwrap());
        let mut left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["notes.txt"], "only the checkpoints are removed");
        std::fs::remove_dir_all(&root).ok();
    }
}
