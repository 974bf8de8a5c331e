//! An output directory written all at once, and the locks of the
//! directories a run writes.
//!
//! A run writes into a staging directory beside its out-dir and swaps it
//! into place only when everything is written, so an out-dir holds one
//! complete run (the previous one until the new one is complete), never a
//! mix. Only a directory an earlier chorus run wrote (it holds the marker
//! file [`MARKER`]) or an empty one is replaced; any other is refused before
//! anything runs, as are inputs and checkpoints inside the out-dir (the
//! swap would delete them). An out-dir that is a symbolic link is written
//! through: its target is replaced, the link stays.
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

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use anyhow::Context;

use crate::UsageError;

/// The file in every out-dir a chorus run wrote, by which a later run
/// recognises one it may replace.
pub const MARKER: &str = ".chorus-out";

fn usage(msg: String) -> anyhow::Error {
    UsageError(msg).into()
}

/// This host's name, as the kernel reports it.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// The id of this boot (a new one after every reboot).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// When process `pid` started (clock ticks since boot, `/proc/PID/stat`
/// field 22), or `None` when there is no such process.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2, the command name, may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// This process as a lock records it.
fn me() -> (u32, u64) {
    let pid = std::process::id();
    (pid, start_time(pid).unwrap_or(0))
}

/// Whether the process `pid` that started at `start` still runs (a pid now
/// held by a process that started at another time is not it).
fn running(pid: u32, start: u64) -> bool {
    start_time(pid) == Some(start)
}

/// Who holds a lock, as its file says.
#[derive(Debug, PartialEq, Eq)]
enum Holder {
    /// A live process on this host: the lock holds.
    Live(u32),
    /// Nobody (the process ended, its pid was reused, the host rebooted, or
    /// the file is half-written): the lock may be taken over.
    Gone,
    /// A process on another host, which cannot be checked from here.
    Elsewhere { host: String, pid: String },
}

/// Judges a lock file's text (`key=value` fields; a bare pid from older
/// chorus versions is judged by its pid alone).
fn judge(text: &str) -> Holder {
    let field = |key: &str| {
        text.split_whitespace().find_map(|f| f.strip_prefix(key).and_then(|v| v.strip_prefix('=')).map(str::to_string))
    };
    if let Ok(pid) = text.trim().parse::<u32>() {
        return if Path::new(&format!("/proc/{pid}")).exists() { Holder::Live(pid) } else { Holder::Gone };
    }
    let (Some(pid), Some(start)) = (field("pid"), field("start")) else { return Holder::Gone };
    if let Some(h) = field("host").filter(|h| *h != host()) {
        return Holder::Elsewhere { host: h, pid };
    }
    if field("boot").is_some_and(|b| b != boot_id()) {
        return Holder::Gone;
    }
    match (pid.parse::<u32>(), start.parse::<u64>()) {
        (Ok(p), Ok(s)) if running(p, s) => Holder::Live(p),
        _ => Holder::Gone,
    }
}

/// A lock file held by this process, removed when dropped.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock file `path` for the directory `what`, or says who
    /// holds it. A lock whose holder is gone is taken over. The file cannot
    /// be created where the directory cannot be written: a usage error.
    pub fn acquire(path: &Path, what: &Path) -> anyhow::Result<RunLock> {
        let (pid, start) = me();
        let record = format!("pid={pid} start={start} boot={} host={}\n", boot_id(), host());
        for attempt in 0..2 {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    f.write_all(record.as_bytes())
                        .and_then(|_| f.sync_all())
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(RunLock { path: path.to_path_buf() });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt == 0 => {
                    let mut text = String::new();
                    File::open(path).and_then(|mut f| f.read_to_string(&mut text)).ok();
                    match judge(&text) {
                        Holder::Live(pid) => anyhow::bail!(
                            "{} is being written by another chorus run (pid {pid}); its lock is {}",
                            what.display(),
                            path.display()
                        ),
                        Holder::Elsewhere { host, pid } => anyhow::bail!(
                            "{} is locked by a chorus run on host {host} (pid {pid}), which cannot be checked from here; if no run is active there, remove {}",
                            what.display(),
                            path.display()
                        ),
                        Holder::Gone => std::fs::remove_file(path)
                            .with_context(|| format!("removing the stale lock {}", path.display()))?,
                    }
                }
                Err(e) => {
                    return Err(usage(format!("{}: cannot take the lock {}: {e}", what.display(), path.display())))
                }
            }
        }
        anyhow::bail!("{}: another run took the lock {} at the same time", what.display(), path.display())
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
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
    dest: PathBuf,
    stage: PathBuf,
    committed: bool,
    _lock: RunLock,
}

impl OutDir {
    /// Checks `dest` (`--out-dir`) and the paths the run reads or writes
    /// (`inside`: flag and path), locks it against other runs and creates
    /// the staging directory, so that every problem is found before any
    /// work. Refused with a usage error: a `dest` that is not a directory,
    /// is non-empty and was not written by chorus, is or holds the current
    /// directory, is a link to nothing, or holds one of `inside`; one whose
    /// parent or staging directory cannot be created.
    pub fn acquire(dest: &Path, inside: &[(&str, &Path)]) -> anyhow::Result<OutDir> {
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
        match std::fs::metadata(&dest) {
            Ok(m) if !m.is_dir() => {
                return Err(usage(format!("--out-dir {} exists and is not a directory", given.display())))
            }
            Ok(_) => refuse_foreign(given, &dest)?,
            Err(_) => {}
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
        let (pid, start) = me();
        let out =
            OutDir { stage: sibling(&dest, &format!("partial-{pid}-{start}")), dest, committed: false, _lock: lock };
        out.remove_dead_partials(&parent);
        let made = (|| {
            if out.stage.exists() {
                std::fs::remove_dir_all(&out.stage)?;
            }
            std::fs::create_dir(&out.stage)?;
            std::fs::write(out.stage.join(MARKER), b"written by chorus; replaced whole by the next run into it\n")
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

    /// Syncs the staged files and renames the staging directory to the
    /// out-dir. A previous out-dir is swapped with the new one in one step
    /// ([`chorus_fsdp_candle::checkpoint::exchange`]), so at every instant
    /// the out-dir is one complete run; where the file system cannot
    /// exchange, the previous one is moved aside first (a crash between the
    /// two renames leaves it beside, as `.NAME.old-PID`). The previous run
    /// is then removed.
    pub fn commit(mut self) -> anyhow::Result<()> {
        sync_tree(&self.stage)?;
        if self.dest.exists() {
            if chorus_fsdp_candle::checkpoint::exchange(&self.stage, &self.dest).is_ok() {
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
        if let Some(parent) = self.dest.parent() {
            File::open(parent).and_then(|f| f.sync_all()).ok();
        }
        self.committed = true;
        Ok(())
    }
}

/// Refuses an existing non-empty out-dir that no chorus run wrote.
fn refuse_foreign(given: &Path, dest: &Path) -> anyhow::Result<()> {
    if dest.join(MARKER).is_file() {
        return Ok(());
    }
    let mut names: Vec<String> = std::fs::read_dir(dest)
        .map_err(|e| usage(format!("--out-dir {}: {e}", given.display())))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    let shown = names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    let more = if names.len() > 3 { format!(" and {} more", names.len() - 3) } else { String::new() };
    Err(usage(format!(
        "--out-dir {} holds files no chorus run wrote ({shown}{more}); the out-dir is replaced whole, so choose an empty or new directory",
        given.display()
    )))
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
    }
}

/// A checkpoint directory locked for this run: created (so an unusable one
/// is found before training) and locked like an out-dir, with the staging
/// leftovers of runs that died removed.
#[derive(Debug)]
pub struct CheckpointDir {
    _lock: RunLock,
}

impl CheckpointDir {
    /// Creates and locks `dir` (`--checkpoint-dir`); one that cannot be
    /// created or written is a usage error.
    pub fn acquire(dir: &Path) -> anyhow::Result<CheckpointDir> {
        if dir.exists() && !dir.is_dir() {
            return Err(usage(format!("--checkpoint-dir {} exists and is not a directory", dir.display())));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| usage(format!("--checkpoint-dir {}: cannot create it: {e}", dir.display())))?;
        let lock = RunLock::acquire(&dir.join(".lock"), dir)?;
        // Holding the lock, nothing else writes here: what staging left is of a run that died.
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let leftover = [".tmp-step-", ".old-step-", ".pruned-step-"].iter().any(|p| name.starts_with(p));
            if leftover {
                let _ = std::fs::remove_dir_all(entry.path());
            } else if name.starts_with(".latest.tmp")
                || name == format!(".{}.tmp", crate::train::LLAMA_CHECKPOINT_CONFIG)
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(CheckpointDir { _lock: lock })
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
        let a = OutDir::acquire(&dest, &[]).unwrap();
        write_file(&a.stage().join("one"), b"1").unwrap();
        let err = OutDir::acquire(&dest, &[]).unwrap_err().to_string();
        assert!(err.contains("another chorus run"), "{err}");
        a.commit().unwrap();
        assert_eq!(std::fs::read(dest.join("one")).unwrap(), b"1");
        // A failed run (dropped without commit) leaves the previous out-dir as it was.
        let b = OutDir::acquire(&dest, &[]).unwrap();
        write_file(&b.stage().join("two"), b"2").unwrap();
        drop(b);
        assert!(dest.join("one").exists() && !dest.join("two").exists());
        // A lock of a dead process is taken over.
        std::fs::write(sibling(&dest, "lock"), b"4294967294\n").unwrap();
        let c = OutDir::acquire(&dest, &[]).unwrap();
        write_file(&c.stage().join("three"), b"3").unwrap();
        c.commit().unwrap();
        assert!(!dest.join("one").exists() && dest.join("three").exists(), "never a mix of two runs");
        std::fs::remove_dir_all(&root).ok();
    }

    /// The lock holds exactly while its process runs: the same pid with
    /// another start time (a reused pid) or another boot frees it; another
    /// host's lock is never taken over.
    #[test]
    fn a_lock_is_live_only_for_its_own_process_on_this_host() {
        let (pid, start) = me();
        let (boot, host) = (boot_id(), host());
        assert!(start > 0, "/proc/self/stat gives a start time");
        let live = format!("pid={pid} start={start} boot={boot} host={host}");
        assert_eq!(judge(&live), Holder::Live(pid));
        // PID 1 is alive, but not the process that started at our start time.
        assert_eq!(judge(&format!("pid=1 start={start} boot={boot} host={host}")), Holder::Gone, "a reused pid");
        assert_eq!(judge(&format!("pid={pid} start={start} boot=another-boot host={host}")), Holder::Gone, "a reboot");
        assert_eq!(
            judge(&format!("pid={pid} start={start} boot={boot} host=not-{host}")),
            Holder::Elsewhere { host: format!("not-{host}"), pid: pid.to_string() }
        );
        assert_eq!(judge("pid=12"), Holder::Gone, "half-written");
        // Through the lock file: a reused pid's lock is taken over; another host's is refused.
        let root = root("lock");
        let (path, what) = (root.join("x.lock"), root.join("x"));
        std::fs::write(&path, format!("pid=1 start={start} boot={boot} host={host}\n")).unwrap();
        let taken = RunLock::acquire(&path, &what).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains(&format!("pid={pid} ")));
        let err = RunLock::acquire(&path, &what).unwrap_err().to_string();
        assert!(err.contains("another chorus run"), "{err}");
        drop(taken);
        assert!(!path.exists());
        std::fs::write(&path, format!("pid={pid} start={start} boot={boot} host=elsewhere\n")).unwrap();
        let err = RunLock::acquire(&path, &what).unwrap_err().to_string();
        assert!(err.contains("host elsewhere") && err.contains("remove"), "{err}");
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
