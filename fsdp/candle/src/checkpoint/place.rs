//! Putting a complete directory in place of another, and recovering what
//! an interrupted replacement left: the one copy of this logic, used by
//! checkpoints (`step-*`) and by `chorus train`'s out-dir.
//!
//! A replacement exchanges the two directories in one step
//! (`renameat2(RENAME_EXCHANGE)`). Where the file system cannot (NFS, FUSE,
//! old kernels) it falls back to two renames: the old directory aside, then
//! the new one in. A crash between them leaves the destination missing and
//! the old copy complete beside it; [`recover_aside`] (run by the next
//! writer, holding the directory's lock) renames it back, and removes an
//! aside copy only while a complete destination exists. A failing second
//! rename puts the old copy back at once.

use std::path::Path;

use crate::CheckpointError;

/// Swaps two paths in one step (Linux's `renameat2` with `RENAME_EXCHANGE`):
/// at every instant each path names one of the two, never nothing. Both
/// must exist.
#[cfg(target_os = "linux")]
pub fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
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

/// Swaps two paths in one step: not available on this system.
#[cfg(not(target_os = "linux"))]
pub fn exchange(_: &Path, _: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "no atomic exchange of directories here"))
}

type Op<'a> = &'a dyn Fn(&Path, &Path) -> std::io::Result<()>;

/// Puts the complete directory `tmp` at `dest`. An existing `dest` is
/// exchanged with it in one step ([`exchange`]) and the replaced copy
/// removed, so `dest` never names nothing. Where the file system cannot
/// exchange, the old `dest` is renamed to `aside` first and `tmp` to `dest`
/// second: a crash between the two leaves the old copy complete at `aside`
/// for [`recover_aside`]; a failing second rename renames it back (or, if
/// that fails too, says where it is). On an error `tmp` still holds the new
/// copy.
pub fn replace_dir(tmp: &Path, dest: &Path, aside: &Path) -> Result<(), CheckpointError> {
    replace_via(tmp, dest, aside, &exchange, &|a, b| std::fs::rename(a, b))
}

/// [`replace_dir`] through the given operations (a test makes them fail).
fn replace_via(tmp: &Path, dest: &Path, aside: &Path, swap: Op<'_>, rename: Op<'_>) -> Result<(), CheckpointError> {
    if std::fs::symlink_metadata(dest).is_err() {
        return rename(tmp, dest).map_err(|e| CheckpointError::io(dest, e));
    }
    if swap(tmp, dest).is_ok() {
        // `tmp` now holds the replaced copy; failing to remove it loses nothing.
        let _ = std::fs::remove_dir_all(tmp);
        return Ok(());
    }
    // A leftover at `aside` is stale: `dest`, complete, is still in place.
    if std::fs::symlink_metadata(aside).is_ok() {
        std::fs::remove_dir_all(aside).map_err(|e| CheckpointError::io(aside, e))?;
    }
    rename(dest, aside).map_err(|e| CheckpointError::io(dest, e))?;
    if let Err(e) = rename(tmp, dest) {
        let error = match rename(aside, dest) {
            Ok(()) => std::io::Error::new(e.kind(), format!("{e} (the previous copy is back in place)")),
            Err(back) => std::io::Error::new(
                e.kind(),
                format!(
                    "{e}; moving the previous copy back failed too ({back}): it is complete at {}, and the next run restores it",
                    aside.display()
                ),
            ),
        };
        return Err(CheckpointError::io(dest, error));
    }
    // The new copy is in place: the old one may go.
    let _ = std::fs::remove_dir_all(aside);
    Ok(())
}

/// What [`recover_aside`] did with a copy left aside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovered {
    /// The destination was missing: the aside copy is back in its place.
    Restored,
    /// The destination is complete: the stale aside copy was removed.
    Removed,
    /// Neither is complete (something else wrote them): both left alone.
    Kept,
}

/// Recovers a copy that [`replace_dir`]'s fallback left at `aside` (a
/// crash between its renames, or after them): with `dest` missing, the
/// aside copy, if `complete`, is renamed back; with `dest` complete, the
/// aside copy is removed. Nothing else is removed: the only complete copy
/// of a directory is never deleted.
pub fn recover_aside(
    aside: &Path,
    dest: &Path,
    complete: &dyn Fn(&Path) -> bool,
) -> Result<Recovered, CheckpointError> {
    if complete(dest) {
        std::fs::remove_dir_all(aside).map_err(|e| CheckpointError::io(aside, e))?;
        return Ok(Recovered::Removed);
    }
    if std::fs::symlink_metadata(dest).is_err() && complete(aside) {
        std::fs::rename(aside, dest).map_err(|e| CheckpointError::io(dest, e))?;
        return Ok(Recovered::Restored);
    }
    Ok(Recovered::Kept)
}

/// Whether `dir` is a complete checkpoint: its manifest, written last, is
/// there and whole.
pub(super) fn is_checkpoint(dir: &Path) -> bool {
    std::fs::read(dir.join(super::files::MANIFEST))
        .is_ok_and(|bytes| serde_json::from_slice::<super::files::Manifest>(&bytes).is_ok())
}

/// The checkpoint a leftover's name is of: `.old-step-00000040-<id>` →
/// `step-00000040` (and likewise `.tmp-`, `.pruned-`).
fn leftover_of<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = name.strip_prefix(prefix)?;
    let step = rest.get(..13)?;
    let digits = step.strip_prefix("step-")?;
    (digits.bytes().all(|b| b.is_ascii_digit()) && rest[13..].starts_with('-')).then_some(step)
}

/// Recovers what interrupted saves left in the checkpoint root `root`
/// (call it holding the root's lock, so no save is running): a step whose
/// directory is missing gets back the copy a re-save moved aside
/// (`.old-step-*`), or else a complete copy that was not yet renamed into
/// place (`.tmp-step-*` with its manifest); aside copies of steps that are
/// in place, partial writes, half-pruned steps and `latest`'s temporary
/// files are removed. Returns one line per step recovered.
pub fn recover(root: &Path) -> Result<Vec<String>, CheckpointError> {
    let names = |root: &Path| -> Result<Vec<String>, CheckpointError> {
        let mut names: Vec<String> = std::fs::read_dir(root)
            .map_err(|e| CheckpointError::io(root, e))?
            .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
            .collect();
        names.sort();
        Ok(names)
    };
    let mut notes = Vec::new();
    // Aside copies first: they are what `latest` named when it was written.
    for prefix in [".old-", ".tmp-"] {
        for name in names(root)? {
            let Some(step) = leftover_of(&name, prefix) else { continue };
            let (left, dest) = (root.join(&name), root.join(step));
            if prefix == ".tmp-" && !is_checkpoint(&left) {
                // A partial write: nothing to recover.
                std::fs::remove_dir_all(&left).map_err(|e| CheckpointError::io(&left, e))?;
                continue;
            }
            if recover_aside(&left, &dest, &is_checkpoint)? == Recovered::Restored {
                notes.push(format!("{}: recovered from {name}, left by an interrupted save", dest.display()));
            }
        }
    }
    for name in names(root)? {
        let path = root.join(&name);
        if leftover_of(&name, ".pruned-").is_some() {
            std::fs::remove_dir_all(&path).map_err(|e| CheckpointError::io(&path, e))?;
        } else if name.starts_with(".latest.tmp-") {
            std::fs::remove_file(&path).map_err(|e| CheckpointError::io(&path, e))?;
        }
    }
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use super::super::files::{Manifest, MANIFEST};
    use super::*;
    use std::cell::Cell;

    fn root(name: &str) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("chorus-place-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    /// A complete checkpoint whose manifest records `text` as its save.
    fn checkpoint(dir: &Path, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        let manifest = Manifest {
            format: crate::checkpoint::FORMAT.into(),
            step: 0,
            shard_world: 1,
            replicate_world: 1,
            optimizer: serde_json::Value::Null,
            tensors: Vec::new(),
            files: Default::default(),
            save_id: Some(text.into()),
        };
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&manifest).unwrap()).unwrap();
    }

    /// The save a checkpoint's manifest records.
    fn manifest(dir: &Path) -> String {
        let bytes = std::fs::read(dir.join(MANIFEST)).unwrap();
        serde_json::from_slice::<Manifest>(&bytes).unwrap().save_id.unwrap()
    }

    fn no_exchange(_: &Path, _: &Path) -> std::io::Result<()> {
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "no exchange here (test)"))
    }

    /// Re-saving a step replaces its directory without a moment in which
    /// it is missing (a crash there would leave `latest` naming nothing):
    /// a reader polling the manifest while the step is replaced 300 times
    /// always finds it, and the old contents are gone after each.
    #[test]
    fn replacing_a_checkpoint_never_leaves_it_missing() {
        let root = root("exchange");
        let dest = root.join("step-00000001");
        checkpoint(&dest, "0");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watcher = {
            let (stop, dest) = (stop.clone(), dest.clone());
            std::thread::spawn(move || {
                let mut missing = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if !is_checkpoint(&dest) {
                        missing += 1;
                    }
                }
                missing
            })
        };
        for i in 1..=300 {
            let tmp = root.join(".tmp-step-00000001");
            checkpoint(&tmp, &i.to_string());
            replace_dir(&tmp, &dest, &root.join(".old-step-00000001")).unwrap();
            assert_eq!(manifest(&dest), i.to_string());
            assert!(!tmp.exists());
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(watcher.join().unwrap(), 0, "the checkpoint was missing while it was replaced");
        std::fs::remove_dir_all(&root).ok();
    }

    /// Without the exchange, the two renames still replace the step.
    #[test]
    fn the_fallback_replaces_the_step() {
        let root = root("fallback");
        let (tmp, dest, aside) = (root.join(".tmp-step-00000002-a"), root.join("step-00000002"), root.join(".old-x"));
        checkpoint(&dest, "old");
        checkpoint(&tmp, "new");
        replace_via(&tmp, &dest, &aside, &no_exchange, &|a, b| std::fs::rename(a, b)).unwrap();
        assert_eq!(manifest(&dest), "new");
        assert!(!tmp.exists() && !aside.exists());
        std::fs::remove_dir_all(&root).ok();
    }

    /// A crash between the fallback's two renames leaves the step missing
    /// and the old copy aside; the next writer's recovery puts the old copy
    /// back (it deleted it before) and drops the unplaced new one, so
    /// `latest` names a complete checkpoint again.
    #[test]
    fn a_crash_between_the_renames_is_recovered() {
        let root = root("crash");
        let name = "step-00000004";
        let (dest, tmp, aside) =
            (root.join(name), root.join(format!(".tmp-{name}-0123")), root.join(format!(".old-{name}-0123")));
        checkpoint(&dest, "old");
        checkpoint(&tmp, "new");
        std::fs::write(root.join("latest"), format!("{name}\n")).unwrap();
        let calls = Cell::new(0);
        let crashing = |a: &Path, b: &Path| {
            calls.set(calls.get() + 1);
            if calls.get() == 2 {
                panic!("the process dies between the two renames");
            }
            std::fs::rename(a, b)
        };
        let crash = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            replace_via(&tmp, &dest, &aside, &no_exchange, &crashing)
        }));
        assert!(crash.is_err());
        assert!(!dest.exists() && is_checkpoint(&aside) && is_checkpoint(&tmp), "the state a crash leaves");
        let notes = recover(&root).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(manifest(&dest), "old", "the copy `latest` named when it was written");
        assert!(!aside.exists() && !tmp.exists());
        assert_eq!(crate::checkpoint::resolve(&root).unwrap(), dest);
        std::fs::remove_dir_all(&root).ok();
    }

    /// A crash after both renames (before the old copy was removed) leaves
    /// a stale aside copy: removed, the new step kept.
    #[test]
    fn a_stale_aside_copy_is_removed_and_the_new_step_kept() {
        let root = root("stale");
        let name = "step-00000006";
        checkpoint(&root.join(name), "new");
        checkpoint(&root.join(format!(".old-{name}-77")), "old");
        std::fs::create_dir_all(root.join(format!(".tmp-{name}-78"))).unwrap();
        // A manifest cut short is no complete checkpoint.
        std::fs::create_dir_all(root.join(".tmp-step-00000007-78")).unwrap();
        std::fs::write(root.join(".tmp-step-00000007-78").join(MANIFEST), "{\"format\":").unwrap();
        std::fs::create_dir_all(root.join(".pruned-step-00000001-78")).unwrap();
        std::fs::write(root.join(".latest.tmp-78"), "x").unwrap();
        std::fs::create_dir_all(root.join("notes")).unwrap();
        assert!(recover(&root).unwrap().is_empty());
        let mut left: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["notes", name], "only leftovers are removed");
        assert_eq!(manifest(&root.join(name)), "new");
        std::fs::remove_dir_all(&root).ok();
    }

    /// A complete new step that was never renamed into place (a crash
    /// after its last sync) is recovered, not deleted.
    #[test]
    fn a_complete_unplaced_step_is_recovered() {
        let root = root("unplaced");
        checkpoint(&root.join(".tmp-step-00000008-9"), "new");
        assert_eq!(recover(&root).unwrap().len(), 1);
        assert_eq!(manifest(&root.join("step-00000008")), "new");
        std::fs::remove_dir_all(&root).ok();
    }

    /// A failing second rename puts the old copy back and leaves the new
    /// one where it was (neither is deleted).
    #[test]
    fn a_failing_second_rename_keeps_both_copies() {
        let root = root("second");
        let (tmp, dest, aside) = (root.join(".tmp-step-00000003-1"), root.join("step-00000003"), root.join(".old-y"));
        checkpoint(&dest, "old");
        checkpoint(&tmp, "new");
        let calls = Cell::new(0);
        let failing = |a: &Path, b: &Path| {
            calls.set(calls.get() + 1);
            if calls.get() == 2 {
                return Err(std::io::Error::other("rename failed (test)"));
            }
            std::fs::rename(a, b)
        };
        let err = replace_via(&tmp, &dest, &aside, &no_exchange, &failing).unwrap_err().to_string();
        assert!(err.contains("back in place"), "{err}");
        assert_eq!(manifest(&dest), "old");
        assert_eq!(manifest(&tmp), "new");
        assert!(!aside.exists());
        // Moving back failing too: both copies stay, and the error says where the old one is.
        let calls = Cell::new(0);
        let failing_twice = |a: &Path, b: &Path| {
            calls.set(calls.get() + 1);
            if calls.get() >= 2 {
                return Err(std::io::Error::other("rename failed (test)"));
            }
            std::fs::rename(a, b)
        };
        let err = replace_via(&tmp, &dest, &aside, &no_exchange, &failing_twice).unwrap_err().to_string();
        assert!(err.contains(&aside.display().to_string()), "{err}");
        assert!(!dest.exists() && manifest(&aside) == "old" && manifest(&tmp) == "new");
        std::fs::remove_dir_all(&root).ok();
    }
}
