//! What an interrupted command leaves behind: nothing it staged. Every
//! command that writes or runs long answers the signals chorus documents
//! from its start (`chorus_collectives::recorder::answer_ending_signals`):
//! SIGUSR1 writes the flight-recorder dumps and the command goes on;
//! SIGINT, SIGTERM and SIGHUP write the dumps that are due, remove the
//! paths registered here (staged files and directories, the locks this
//! process took) and end the process as the signal would have. A signal
//! the process inherited as ignored stays ignored.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The paths this process created and removes when a signal ends it.
static STAGED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Answers SIGUSR1, SIGINT, SIGTERM and SIGHUP from now on (see the module's doc).
pub fn answer_signals() {
    chorus_collectives::recorder::answer_ending_signals(remove_staged);
}

/// Removes `path` (a file or a directory this process created, or will
/// create under a name only it uses) if a signal ends the process.
pub fn remove_if_interrupted(path: &Path) {
    let mut staged = STAGED.lock().unwrap_or_else(|p| p.into_inner());
    staged.push(path.to_path_buf());
}

/// `path` is no longer this process's to remove (committed, or removed).
pub fn forget(path: &Path) {
    let mut staged = STAGED.lock().unwrap_or_else(|p| p.into_inner());
    staged.retain(|p| p != path);
}

/// Runs on the signal thread before the process ends.
fn remove_staged() {
    let staged = STAGED.lock().unwrap_or_else(|p| p.into_inner());
    for path in staged.iter() {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => {
                let _ = std::fs::remove_dir_all(path);
            }
            Ok(_) => {
                let _ = std::fs::remove_file(path);
            }
            Err(_) => {}
        }
    }
}
