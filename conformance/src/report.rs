//! Outcomes of cases and the summary of a run.

use std::fmt;
use std::time::Duration;

/// How a case ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Every rank returned `Ok`.
    Passed,
    /// At least one rank failed (or the case did not finish in time); the
    /// message names the ranks and what they reported, first failure first.
    Failed(String),
    /// The case does not apply to this backend or world; the reason says why.
    Skipped(String),
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Passed => f.write_str("ok"),
            Status::Failed(m) => write!(f, "FAILED: {m}"),
            Status::Skipped(r) => write!(f, "skipped: {r}"),
        }
    }
}

/// One case's result on one world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaseOutcome {
    /// The case's name.
    pub name: String,
    /// The number of ranks it ran on.
    pub world_size: usize,
    /// How it ended.
    pub status: Status,
    /// Wall time from dispatch to the last rank's result (zero when skipped).
    pub duration: Duration,
}

impl fmt::Display for CaseOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{} ranks] {} ... {}", self.world_size, self.name, self.status)?;
        match self.status {
            Status::Skipped(_) => Ok(()),
            _ => write!(f, " ({:.1?})", self.duration),
        }
    }
}

/// Counts of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Cases that passed.
    pub passed: usize,
    /// Cases that failed.
    pub failed: usize,
    /// Cases that were skipped.
    pub skipped: usize,
}

impl Summary {
    /// Counts one outcome.
    pub fn add(&mut self, outcome: &CaseOutcome) {
        match outcome.status {
            Status::Passed => self.passed += 1,
            Status::Failed(_) => self.failed += 1,
            Status::Skipped(_) => self.skipped += 1,
        }
    }

    /// `N passed, N failed, N skipped`.
    pub fn line(&self) -> String {
        format!("{} passed, {} failed, {} skipped", self.passed, self.failed, self.skipped)
    }
}
