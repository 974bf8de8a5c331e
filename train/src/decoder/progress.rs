//! How far a run got, for the run that continues it after a fault: rank 0
//! of a run that saves checkpoints records, after every step, the last step
//! done and the last checkpoint saved, with their times, in
//! `<checkpoint dir>/progress.json` (written whole under a temporary name
//! and renamed into place, so a reader never sees half of it). A run that
//! resumes reads it before its first step: the steps past the checkpoint
//! it resumes from, and the time they took, are the work the fault cost.
//!
//! The record names its job (the data's seed and the model's
//! configuration, as a checkpoint does), so a record of another job is not
//! taken for this one's. It is not synced: a host that loses power may lose
//! its last updates, which then under-count the work lost.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use chorus_fsdp_candle::{CheckpointError, Result};

/// The file's name in the checkpoint directory.
pub const FILE: &str = "progress.json";

/// What `progress.json` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Steps done (the next step to run).
    pub step: u64,
    /// When the last of them ended (microseconds since the Unix epoch).
    pub at_us: u64,
    /// The step of the last checkpoint this run saved or resumed from (0: none).
    pub saved_step: u64,
    /// When that checkpoint was complete (or the run started).
    pub saved_at_us: u64,
    /// The job: the data's seed.
    pub data_seed: u64,
    /// The job: the model's configuration.
    pub model: serde_json::Value,
}

/// Now, in microseconds since the Unix epoch.
pub fn now_us() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.as_micros()).unwrap_or(u64::MAX)
}

/// Reads `dir`'s record; `None` when there is none or it cannot be read
/// (a record is advice about the past, never needed to train).
pub fn read(dir: &Path) -> Option<Progress> {
    serde_json::from_slice(&std::fs::read(dir.join(FILE)).ok()?).ok()
}

/// Rank 0's record of its run, kept up to date in `dir`.
pub(super) struct Recorder {
    path: PathBuf,
    tmp: PathBuf,
    now: Progress,
}

impl Recorder {
    /// A record for a run starting at `step` (its checkpoint's step when it
    /// resumes), the job named by `data_seed` and `model`; written at once.
    pub(super) fn start(dir: &Path, step: u64, data_seed: u64, model: serde_json::Value) -> Result<Recorder> {
        // The first save would make it; the record comes first.
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
        let at_us = now_us();
        let now = Progress { step, at_us, saved_step: step, saved_at_us: at_us, data_seed, model };
        let rec = Recorder { path: dir.join(FILE), tmp: dir.join(format!(".{FILE}.tmp")), now };
        rec.write()?;
        Ok(rec)
    }

    /// Step `step` is done (recorded before its save, if it has one).
    pub(super) fn step_done(&mut self, step: u64) -> Result<()> {
        self.now.step = step;
        self.now.at_us = now_us();
        self.write()
    }

    /// The checkpoint of step `step`, whose step ended at `at_us`, is complete.
    pub(super) fn saved(&mut self, step: u64, at_us: u64) -> Result<()> {
        self.now.saved_step = step;
        self.now.saved_at_us = at_us;
        self.write()
    }

    fn write(&self) -> Result<()> {
        let bytes = serde_json::to_vec(&self.now).map_err(|e| CheckpointError::format(&self.path, e))?;
        std::fs::write(&self.tmp, bytes).map_err(|e| CheckpointError::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| CheckpointError::io(&self.path, e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_follows_the_steps_and_saves() {
        let dir = std::env::temp_dir().join(format!("chorus-progress-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read(&dir), None);
        let mut rec = Recorder::start(&dir, 4, 7, serde_json::json!({"d_model": 8})).unwrap();
        let first = read(&dir).unwrap();
        assert_eq!((first.step, first.saved_step, first.data_seed), (4, 4, 7));
        rec.step_done(5).unwrap();
        rec.step_done(6).unwrap();
        let six = read(&dir).unwrap().at_us;
        rec.saved(6, six).unwrap();
        rec.step_done(7).unwrap();
        let last = read(&dir).unwrap();
        assert_eq!((last.step, last.saved_step), (7, 6));
        assert!(last.at_us >= last.saved_at_us && last.saved_at_us == six && six >= first.at_us);
        assert_eq!(last.model, serde_json::json!({"d_model": 8}));
        std::fs::write(dir.join(FILE), b"{").unwrap();
        assert_eq!(read(&dir), None, "a torn record is no record");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
