//! An output directory written all at once, and the locks of the
//! directories a run writes.
//!
//! A run writes into a staging directory beside its out-dir and swaps it
//! into place only when everything is written, so an out-dir holds one
//! complete run (the previous one until the new one is complete), never a
//! mix. The marker file [`MARKER`] in every out-dir a chorus run wrote
//! names the command that wrote it and lists what it wrote; a later run of
//! the same command replaces such a directory only while it holds nothing
//! else, and otherwise is refused before anything runs, naming the files it
//! would lose (as is a non-empty directory without a marker, one another
//! command wrote — `chorus plan` never replaces a `chorus train` output —
//! and inputs and checkpoints inside the out-dir). An out-dir that
//! is a symbolic link is written through: its target is replaced, the link
//! stays. The swap is [`chorus_fsdp_candle::checkpoint::replace_dir`], the
//! checkpoints' own; a previous out-dir its fallback left aside (a crash
//! between two renames) is put back by the next run.
//!
//! A checkpoint directory ([`CheckpointDir`]) is recovered the same way,
//! and a run that is not resuming refuses one that holds another run's
//! checkpoints unless told to start over (`--overwrite-checkpoints`).
//!
//! This file is the out-dir's staging and swap; `marker.rs` the marker and
//! what else a directory holds, `lock.rs` the locks, `checkpoints.rs` the
//! checkpoint directory.
//!
//! # Locks
//! A lock file ([`RunLock`]) refuses a second live run into the same
//! out-dir (`.NAME.lock` beside it) or checkpoint directory (`.lock` in it).
//! It records the holder's host, boot, pid and process start time
//! (`/proc/PID/stat` field 22): a lock is live while a process with that
//! pid *and* that start time runs on this host since that boot, so a pid
//! reused by another process, or a reboot, frees it. This holds on one
//! host. On a file system shared by several hosts, a lock taken on another
//! host cannot be judged from here: it is never taken over, and the error
//! names the host (remove the lock by hand once no run is active there).

use std::fs::File;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use anyhow::Context;

mod checkpoints;
mod lock;
mod marker;

pub use checkpoints::CheckpointDir;
pub use lock::RunLock;
use lock::{me, running};
pub use marker::MARKER;
use marker::{refuse_foreign, write_marker, MARKER_HEAD};

fn usage(msg: String) -> anyhow::Error {
    crate::usage(msg)
}

/// `path` made absolute with the symbolic links of its existing part
/// resolved and `.`/`..` applied to the rest, so that two spellings of one
/// place compare equal (whether or not it exists yet).
pub fn resolved(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    let base = loop {
        if let Ok(c) = std::fs::canonicalize(existing) {
            break c;
        }
        // The last component, `..` included (which `file_name` does not give).
        match (existing.parent(), existing.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last.as_os_str().to_os_string());
                existing = parent;
            }
            _ => break existing.to_path_buf(),
        }
    };
    let mut out = base;
    for c in rest.iter().rev().flat_map(|n| Path::new(n).components().collect::<Vec<_>>()) {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    out
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    dir.with_file_name(format!(".{name}.{suffix}"))
}

/// A locked out-dir and its staging directory.
#[derive(Debug)]
pub struct OutDir {
    /// `--out-dir` as given, as errors name it.
    given: PathBuf,
    /// The command writing it (`train`, `plan`), as its marker records it.
    command: &'static str,
    dest: PathBuf,
    stage: PathBuf,
    committed: bool,
    _lock: RunLock,
}

impl OutDir {
    /// Checks `dest` (`--out-dir` of `chorus {command}`) and the paths the
    /// run reads or writes (`inside`: flag and path), locks it against other
    /// runs and creates the staging directory, so that every problem is
    /// found before any work. Refused with a usage error: a `dest` that is
    /// not a directory, is non-empty and holds anything no run of `command`
    /// wrote there (another command's output included), is or holds the
    /// current directory, is a link to nothing, or holds one of `inside`;
    /// one whose parent or staging directory cannot be created.
    pub fn acquire(dest: &Path, command: &'static str, inside: &[(&str, &Path)]) -> anyhow::Result<OutDir> {
        let given = dest;
        // A link is written through: its target is the out-dir.
        let dest = match std::fs::symlink_metadata(given) {
            Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(given).map_err(|e| {
                usage(format!("--out-dir {} is a symbolic link to nothing usable ({e})", given.display()))
            })?,
            _ => resolved(given),
        };
        if dest.file_name().is_none() || dest.parent().is_none() {
            return Err(usage(format!("--out-dir {}: the root cannot be an out-dir", given.display())));
        }
        if let Ok(cwd) = std::env::current_dir().and_then(std::fs::canonicalize) {
            if cwd.starts_with(&dest) {
                return Err(usage(format!(
                    "--out-dir {} is the current directory or holds it; it is replaced whole when the run ends: name a directory of its own",
                    given.display()
                )));
            }
        }
        if let Ok(m) = std::fs::metadata(&dest) {
            if !m.is_dir() {
                return Err(usage(format!("--out-dir {} exists and is not a directory", given.display())));
            }
        }
        for (flag, path) in inside {
            if resolved(path).starts_with(&dest) {
                return Err(usage(format!(
                    "{flag} {} is inside --out-dir {}, which is replaced whole when the run ends: choose a path outside it",
                    path.display(),
                    given.display()
                )));
            }
        }
        let parent = dest.parent().unwrap_or(Path::new("/")).to_path_buf();
        std::fs::create_dir_all(&parent)
            .map_err(|e| usage(format!("--out-dir {}: cannot create {}: {e}", given.display(), parent.display())))?;
        let lock = RunLock::acquire(&sibling(&dest, "lock"), &dest)?;
        // Holding the lock: a previous out-dir an interrupted swap left aside goes back first.
        recover_out_dir(&dest)?;
        if dest.is_dir() {
            refuse_foreign(given, &dest, command)?;
        }
        let (pid, start) = me();
        let out = OutDir {
            given: given.to_path_buf(),
            command,
            stage: sibling(&dest, &format!("partial-{pid}-{start}")),
            dest,
            committed: false,
            _lock: lock,
        };
        out.remove_dead_partials(&parent);
        // Named by this process's pid and start time, so only ours: removed if a signal ends the run.
        crate::interrupt::remove_if_interrupted(&out.stage);
        let made = (|| {
            if out.stage.exists() {
                std::fs::remove_dir_all(&out.stage)?;
            }
            std::fs::create_dir(&out.stage)?;
            std::fs::write(out.stage.join(MARKER), MARKER_HEAD)
        })();
        made.map_err(|e| usage(format!("--out-dir {}: cannot create {}: {e}", given.display(), out.stage.display())))?;
        Ok(out)
    }

    /// Staging directories of runs that died (their process is gone).
    fn remove_dead_partials(&self, parent: &Path) {
        let prefix = match self.dest.file_name() {
            Some(n) => format!(".{}.partial-", n.to_string_lossy()),
            None => return,
        };
        for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_prefix(&prefix) else { continue };
            let dead = match id.split_once('-') {
                Some((pid, start)) => match (pid.parse::<u32>(), start.parse::<u64>()) {
                    (Ok(p), Ok(s)) => !running(p, s),
                    _ => false,
                },
                None => id.parse::<u32>().is_ok_and(|p| !Path::new(&format!("/proc/{p}")).exists()),
            };
            if dead {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Where this run writes its files.
    pub fn stage(&self) -> &Path {
        &self.stage
    }

    /// The out-dir the files will be in (a link's target).
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Lists the staged files in the marker, syncs them and puts the
    /// staging directory in place of the out-dir
    /// ([`chorus_fsdp_candle::checkpoint::replace_dir`]: one exchange, so
    /// at every instant the out-dir is one complete run; where the file
    /// system cannot exchange, two renames, whose interruption the next run
    /// recovers). Files added to the out-dir while the run went are never
    /// deleted: then the previous out-dir stays, and this run's outputs are
    /// moved beside it (`NAME.unplaced-PID`), as the error says.
    pub fn commit(mut self) -> anyhow::Result<()> {
        write_marker(&self.stage, self.command)?;
        sync_tree(&self.stage)?;
        if self.dest.is_dir() {
            if let Err(e) = refuse_foreign(&self.given, &self.dest, self.command) {
                let name = self.dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let unplaced = self.dest.with_file_name(format!("{name}.unplaced-{}", std::process::id()));
                std::fs::rename(&self.stage, &unplaced)
                    .with_context(|| format!("{e:#}; keeping this run's outputs at {}", unplaced.display()))?;
                self.committed = true;
                anyhow::bail!(
                    "{e:#}; the files appeared during the run, so this run's outputs are at {}",
                    unplaced.display()
                );
            }
        }
        let aside = sibling(&self.dest, &format!("old-{}", std::process::id()));
        chorus_fsdp_candle::checkpoint::replace_dir(&self.stage, &self.dest, &aside)
            .with_context(|| format!("putting the run's outputs in place at {}", self.dest.display()))?;
        if let Some(parent) = self.dest.parent() {
            File::open(parent).and_then(|f| f.sync_all()).ok();
        }
        self.committed = true;
        Ok(())
    }
}

/// Puts back a previous out-dir that an interrupted swap left aside
/// (`.NAME.old-PID`: the out-dir is missing), or removes such a copy
/// where the out-dir is in place.
fn recover_out_dir(dest: &Path) -> anyhow::Result<()> {
    let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else { return Ok(()) };
    let prefix = format!(".{}.old-", name.to_string_lossy());
    let written = |d: &Path| d.join(MARKER).is_file();
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let aside = entry.path();
        let done = chorus_fsdp_candle::checkpoint::recover_aside(&aside, dest, &written)
            .with_context(|| format!("recovering {}", dest.display()))?;
        if done == chorus_fsdp_candle::checkpoint::Recovered::Restored {
            eprintln!("{}: restored from {}, left by an interrupted run", dest.display(), aside.display());
        }
    }
    Ok(())
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
        crate::interrupt::forget(&self.stage);
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

    fn root(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("chorus-outdir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    #[test]
    fn a_run_replaces_the_out_dir_whole_and_a_second_run_is_refused() {
        let root = root("replace");
        let dest = root.join("run");
        let a = OutDir::acquire(&dest, "train", &[]).unwrap();
        write_file(&a.stage().join("one"), b"1").unwrap();
        let err = OutDir::acquire(&dest, "train", &[]).unwrap_err().to_string();
        assert!(err.contains("another chorus run"), "{err}");
        a.commit().unwrap();
        assert_eq!(std::fs::read(dest.join("one")).unwrap(), b"1");
        // A failed run (dropped without commit) leaves the previous out-dir as it was.
        let b = OutDir::acquire(&dest, "train", &[]).unwrap();
        write_file(&b.stage().join("two"), b"2").unwrap();
        drop(b);
        assert!(dest.join("one").exists() && !dest.join("two").exists());
        // A lock of a dead process is taken over.
        std::fs::write(sibling(&dest, "lock"), b"4294967294\n").unwrap();
        let c = OutDir::acquire(&dest, "train", &[]).unwrap();
        write_file(&c.stage().join("three"), b"3").unwrap();
        c.commit().unwrap();
        assert!(!dest.join("one").exists() && dest.join("three").exists(), "never a mix of two runs");
        std::fs::remove_dir_all(&root).ok();
    }

    /// The files the out-dir `dest` holds, sorted, the marker left out.
    fn files(dest: &Path) -> Vec<String> {
        let mut all = Vec::new();
        fn walk(dir: &Path, rel: &str, all: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                let path = format!("{rel}{}", e.file_name().to_string_lossy());
                if e.file_type().unwrap().is_dir() {
                    walk(&e.path(), &format!("{path}/"), all);
                } else if path != MARKER {
                    all.push(path);
                }
            }
        }
        walk(dest, "", &mut all);
        all.sort();
        all
    }

    fn run_into(dest: &Path, written: &[(&str, &str)]) -> anyhow::Result<()> {
        command_into(dest, "train", written)
    }

    fn command_into(dest: &Path, command: &'static str, written: &[(&str, &str)]) -> anyhow::Result<()> {
        let out = OutDir::acquire(dest, command, &[])?;
        for (path, text) in written {
            let path = out.stage().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            write_file(&path, text.as_bytes()).unwrap();
        }
        out.commit()
    }

    /// Issue 24: files the user added to a chorus out-dir (a tokenizer in
    /// `model/`, notes, a directory) are never replaced: the next run is
    /// refused before it starts, naming them, and every file stays; once
    /// they are moved out, the run replaces what chorus wrote.
    #[test]
    fn files_the_user_added_are_named_and_never_lost() {
        let root = root("user-files");
        let dest = root.join("run");
        run_into(&dest, &[("summary.json", "1"), ("model/config.json", "1")]).unwrap();
        let marker = std::fs::read_to_string(dest.join(MARKER)).unwrap();
        assert!(marker.ends_with("command: train\nmodel/\nmodel/config.json\nsummary.json\n"), "{marker}");
        std::fs::write(dest.join("model/tokenizer.json"), "mine").unwrap();
        std::fs::write(dest.join("notes.txt"), "mine").unwrap();
        std::fs::create_dir_all(dest.join("plots")).unwrap();
        let err = run_into(&dest, &[("summary.json", "2")]).unwrap_err().to_string();
        for name in ["model/tokenizer.json", "notes.txt", "plots/"] {
            assert!(err.contains(name), "{name} not named: {err}");
        }
        assert!(!err.contains("summary.json"), "{err}");
        assert_eq!(files(&dest), ["model/config.json", "model/tokenizer.json", "notes.txt", "summary.json"]);
        assert_eq!(std::fs::read_to_string(dest.join("summary.json")).unwrap(), "1");
        // Moved out, the next run replaces what chorus wrote (and only that is there).
        std::fs::remove_file(dest.join("model/tokenizer.json")).unwrap();
        std::fs::remove_file(dest.join("notes.txt")).unwrap();
        std::fs::remove_dir(dest.join("plots")).unwrap();
        run_into(&dest, &[("summary.json", "2")]).unwrap();
        assert_eq!(files(&dest), ["summary.json"]);
        // A marker of an older chorus lists nothing: refused, naming what is there.
        std::fs::write(dest.join(MARKER), "written by chorus; replaced whole by the next run into it\n").unwrap();
        let err = run_into(&dest, &[]).unwrap_err().to_string();
        assert!(err.contains("older chorus") && err.contains("summary.json"), "{err}");
        assert!(dest.join("summary.json").exists());
        // Issue 43: a damaged marker is called damaged, not an older chorus's.
        std::fs::write(dest.join(MARKER), "\0\0garbage").unwrap();
        let err = run_into(&dest, &[]).unwrap_err().to_string();
        assert!(err.contains("no marker chorus wrote") && !err.contains("older"), "{err}");
        assert!(dest.join("summary.json").exists());
        std::fs::remove_dir_all(&root).ok();
    }

    /// Issue 35: one command's out-dir is never replaced by another's
    /// (`chorus plan --out-dir` of a finished `chorus train` output deleted
    /// its model): refused before anything runs and at the commit, naming
    /// the command and its files; the same command replaces it; a marker of
    /// the chorus before commands were recorded is refused too.
    #[test]
    fn another_commands_out_dir_is_never_replaced() {
        let root = root("commands");
        let dest = root.join("run");
        run_into(&dest, &[("summary.json", "1"), ("model/model.safetensors", "w")]).unwrap();
        let err = command_into(&dest, "plan", &[("plan.json", "p")]).unwrap_err().to_string();
        assert!(
            err.contains("output of `chorus train`")
                && err.contains("model/model.safetensors")
                && err.contains("summary.json"),
            "{err}"
        );
        assert_eq!(files(&dest), ["model/model.safetensors", "summary.json"]);
        // Refused again where the other command's output appears while the run goes.
        let other = root.join("other");
        let out = OutDir::acquire(&other, "plan", &[]).unwrap();
        write_file(&out.stage().join("plan.json"), b"p").unwrap();
        // What a train run would leave there (its lock aside): its file and its marker.
        std::fs::create_dir_all(&other).unwrap();
        write_file(&other.join("summary.json"), b"1").unwrap();
        write_marker(&other, "train").unwrap();
        let err = format!("{:#}", out.commit().unwrap_err());
        assert!(err.contains("output of `chorus train`") && err.contains("unplaced"), "{err}");
        assert_eq!(files(&other), ["summary.json"]);
        // The same command replaces its own output.
        run_into(&dest, &[("summary.json", "2")]).unwrap();
        assert_eq!(files(&dest), ["summary.json"]);
        // The previous chorus's marker listed the files but not the command: refused, naming them.
        let old = "written by chorus: the next run into this directory replaces the files listed below, and refuses to while it holds any other\nsummary.json\n";
        std::fs::write(dest.join(MARKER), old).unwrap();
        let err = command_into(&dest, "plan", &[]).unwrap_err().to_string();
        assert!(err.contains("older chorus") && err.contains("summary.json"), "{err}");
        assert!(dest.join("summary.json").exists());
        std::fs::remove_dir_all(&root).ok();
    }

    /// Issue 24: a file added to the out-dir while the run goes is kept:
    /// the previous out-dir stays, this run's outputs go beside it.
    #[test]
    fn files_added_during_the_run_are_kept() {
        let root = root("during");
        let dest = root.join("run");
        run_into(&dest, &[("summary.json", "1")]).unwrap();
        let out = OutDir::acquire(&dest, "train", &[]).unwrap();
        write_file(&out.stage().join("summary.json"), b"2").unwrap();
        std::fs::write(dest.join("notes.txt"), "mine").unwrap();
        let err = format!("{:#}", out.commit().unwrap_err());
        assert!(err.contains("notes.txt") && err.contains("unplaced"), "{err}");
        assert_eq!(files(&dest), ["notes.txt", "summary.json"]);
        assert_eq!(std::fs::read_to_string(dest.join("summary.json")).unwrap(), "1");
        let unplaced = root.join(format!("run.unplaced-{}", std::process::id()));
        assert_eq!(std::fs::read_to_string(unplaced.join("summary.json")).unwrap(), "2");
        std::fs::remove_dir_all(&root).ok();
    }

    /// Issue 24: where the exchange is unavailable, a crash between the
    /// fallback's two renames leaves the out-dir missing and the previous
    /// one aside (the state `chorus_fsdp_candle`'s replace test produces):
    /// the next run puts it back instead of losing it.
    #[test]
    fn an_out_dir_left_aside_is_restored() {
        let root = root("aside");
        let dest = root.join("run");
        run_into(&dest, &[("summary.json", "1")]).unwrap();
        let aside = sibling(&dest, "old-4242");
        std::fs::rename(&dest, &aside).unwrap();
        let out = OutDir::acquire(&dest, "train", &[]).unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("summary.json")).unwrap(), "1", "restored");
        assert!(!aside.exists());
        drop(out);
        // A stale aside copy beside a complete out-dir is removed; the out-dir kept.
        let stale = sibling(&dest, "old-4243");
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join(MARKER), MARKER_HEAD).unwrap();
        drop(OutDir::acquire(&dest, "train", &[]).unwrap());
        assert!(!stale.exists() && dest.join("summary.json").exists());
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn resolved_paths_compare_whatever_their_spelling() {
        let root = root("resolve");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::os::unix::fs::symlink(root.join("a"), root.join("link")).unwrap();
        assert_eq!(resolved(&root.join("link/new/../x")), resolved(&root.join("a/x")));
        assert!(resolved(&root.join("a/./b/c")).starts_with(resolved(&root.join("a"))));
        std::fs::remove_dir_all(&root).ok();
    }
}
