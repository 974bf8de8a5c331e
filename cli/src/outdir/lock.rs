//! The lock of a directory a run writes ([`RunLock`]): the holder's host,
//! boot, pid and start time, so a lock of a process that ended, a reused
//! pid or an earlier boot is taken over, and one of another host never is.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::usage;

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
pub(super) fn me() -> (u32, u64) {
    let pid = std::process::id();
    (pid, start_time(pid).unwrap_or(0))
}

/// Whether the process `pid` that started at `start` still runs (a pid now
/// held by a process that started at another time is not it).
pub(super) fn running(pid: u32, start: u64) -> bool {
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
                    // Ours from here: removed if a signal ends the run, as the drop would.
                    crate::interrupt::remove_if_interrupted(path);
                    let lock = RunLock { path: path.to_path_buf() };
                    f.write_all(record.as_bytes())
                        .and_then(|_| f.sync_all())
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(lock);
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
        crate::interrupt::forget(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let root = std::env::temp_dir().join(format!("chorus-outdir-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
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
}
