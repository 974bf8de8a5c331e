//! [`FileStore`]: a store in a directory of a filesystem that every rank
//! sees (NFS, Lustre, GPFS, or a local disk for processes of one host).
//!
//! One file per key, named from the key (`k-<hex of the key>`, or
//! `h-<128-bit hash>` for long keys; the file repeats the key so a hash
//! collision is detected, not served). A write goes to a temporary file that
//! is then renamed over the entry, so a reader sees the old value or the new
//! one, never half of one. Every change (set, add, compare-set, delete,
//! multi-set) holds the directory's lock file; that makes read-modify-write
//! operations atomic across processes and hosts. Waiting operations poll
//! (1 ms doubling to 20 ms) until their deadline. On NFS, a new entry
//! becomes visible to other hosts when their attribute cache expires
//! (`actimeo`), so waits there take up to that long.
//!
//! **The lock.** Its file names its owner — host, process id, the
//! process's start time, and a token unique to this acquisition — and is
//! made whole before it appears: the record is written to a temporary file
//! that is then hard-linked to `.lock`, which fails if `.lock` exists (atomic
//! on local filesystems and on NFS, the classic NFS-safe lock). Only its
//! owner removes it, and only while it still holds the owner's token. A
//! rank that dies holding it leaves it behind; another rank takes it to be
//! stale:
//! - at once when the owner ran on this host (same host name, boot id and
//!   pid namespace) and that process is gone (no such pid, or a pid reused
//!   by a process started later);
//! - when the owner ran elsewhere (or the file names no owner), only after
//!   this rank has seen the same owner hold it for
//!   [`FileStore::with_stale_lock_after`] (30 s by default; a critical
//!   section lasts milliseconds) — measured on this rank's own clock, so
//!   clock skew between hosts does not matter.
//!
//! A stale lock is renamed aside, then removed if it still names the
//! owner judged dead; when two ranks break it at once, the one that renamed
//! a fresh lock puts it back. What this does not cover: a host that stops
//! for longer than the stale time while holding the lock (its critical
//! section then overlaps the next owner's), and a fresh lock taken in the
//! microseconds between a wrong rename and its undoing.

use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::store::{add_outcome, compare_set_outcome, deadline_after, poll_until, timeout_error, wait_op, Store};
use crate::{CommError, Result, StoreFailure};

/// Keys longer than this are named by their hash (file names are limited to
/// 255 bytes, and hex doubles the length).
const MAX_HEX_KEY: usize = 100;
const LOCK_NAME: &str = ".lock";
const TMP_PREFIX: &str = ".tmp-";
/// Numbers the temporary files of this process, across every `FileStore`
/// of it (threads opening the same directory must not share a name).
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);
/// The first line of a lock file (the format of its owner record).
const LOCK_FORMAT: &str = "chorus file store lock v1";

/// A store in a shared directory; see the module documentation for the
/// layout and the atomicity argument.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    lock_timeout: Duration,
    stale_lock_after: Duration,
}

impl FileStore {
    /// Opens (creating it if needed) the store in directory `dir`. Every
    /// rank passes the same path.
    pub fn open(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| io_error(&dir, "create the directory", &e))?;
        Ok(FileStore { dir, lock_timeout: Duration::from_secs(60), stale_lock_after: Duration::from_secs(30) })
    }

    /// How long a change waits for the lock before failing with
    /// [`CommError::Timeout`] (60 s by default).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> FileStore {
        self.lock_timeout = timeout;
        self
    }

    /// After how long of waiting behind the same owner of another host a
    /// lock is taken to be left by a dead rank and removed (30 s by
    /// default; an owner on this host is checked directly, see the module
    /// documentation).
    pub fn with_stale_lock_after(mut self, age: Duration) -> FileStore {
        self.stale_lock_after = age;
        self
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn address(&self) -> String {
        self.dir.display().to_string()
    }

    fn entry_path(&self, key: &str) -> PathBuf {
        let bytes = key.as_bytes();
        let name = if bytes.len() <= MAX_HEX_KEY {
            format!("k-{}", hex(bytes))
        } else {
            format!("h-{:016x}{:016x}", fnv1a(bytes, 0xcbf2_9ce4_8422_2325), fnv1a(bytes, 0x6c62_272e_07bb_0142))
        };
        self.dir.join(name)
    }

    /// The value under `key`, or `None` when absent.
    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.entry_path(key);
        let content = match fs::read(&path) {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(&path, "read", &e)),
        };
        let corrupt = || {
            CommError::store(
                self.address(),
                StoreFailure::Io,
                format!("{} is not a store entry (or two keys hash alike)", path.display()),
            )
        };
        let len_bytes: [u8; 8] = content.get(..8).and_then(|b| b.try_into().ok()).ok_or_else(corrupt)?;
        let key_len = usize::try_from(u64::from_le_bytes(len_bytes)).map_err(|_| corrupt())?;
        let stored_key = content.get(8..8usize.saturating_add(key_len)).ok_or_else(corrupt)?;
        if stored_key != key.as_bytes() {
            return Err(corrupt());
        }
        Ok(Some(content[8 + key_len..].to_vec()))
    }

    /// Writes `value` under `key` atomically (temporary file, then rename).
    fn write(&self, key: &str, value: &[u8]) -> Result<()> {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!("{TMP_PREFIX}{}-{n}", std::process::id()));
        let mut content = Vec::with_capacity(8 + key.len() + value.len());
        content.extend_from_slice(&(key.len() as u64).to_le_bytes());
        content.extend_from_slice(key.as_bytes());
        content.extend_from_slice(value);
        let written = File::create(&tmp).and_then(|mut f| f.write_all(&content));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io_error(&tmp, "write", &e));
        }
        let path = self.entry_path(key);
        fs::rename(&tmp, &path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_error(&path, "rename into place", &e)
        })
    }

    fn remove(&self, key: &str) -> Result<bool> {
        let path = self.entry_path(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_error(&path, "remove", &e)),
        }
    }

    /// Takes the directory's lock (see the module documentation), breaking
    /// a stale one, until the lock timeout.
    fn lock(&self, op: &str) -> Result<LockGuard> {
        let path = self.dir.join(LOCK_NAME);
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let record = Owner::this_process(n).record();
        let tmp = self.dir.join(format!("{TMP_PREFIX}lock-{}-{n}", std::process::id()));
        fs::write(&tmp, &record).map_err(|e| io_error(&tmp, "write the lock record", &e))?;
        // The owner seen holding the lock, and since when (on this rank's clock).
        let mut seen: Option<(Vec<u8>, Instant)> = None;
        let acquired = poll_until(deadline_after(self.lock_timeout), || match fs::hard_link(&tmp, &path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                self.break_if_stale(&path, &mut seen);
                Ok(false)
            }
            Err(e) => Err(io_error(&path, "create the lock file", &e)),
        });
        let _ = fs::remove_file(&tmp);
        if acquired? {
            Ok(LockGuard { path, record })
        } else {
            Err(timeout_error(format!("file store lock for {op}"), self.lock_timeout))
        }
    }

    /// Removes the lock at `path` if its owner is dead (this host) or has
    /// held it for the stale time while this rank waited (another host).
    fn break_if_stale(&self, path: &Path, seen: &mut Option<(Vec<u8>, Instant)>) {
        let Ok(held) = fs::read(path) else { return };
        let stale = match Owner::parse(&held) {
            Some(owner) if owner.is_this_host() => !owner.is_alive(),
            _ => match seen {
                Some((record, since)) if *record == held => since.elapsed() >= self.stale_lock_after,
                _ => {
                    *seen = Some((held.clone(), Instant::now()));
                    false
                }
            },
        };
        if !stale {
            return;
        }
        // Rename it aside first: if another rank broke it and took the lock
        // meanwhile, what was renamed is that rank's fresh lock, put back.
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let aside = self.dir.join(format!("{TMP_PREFIX}stale-{}-{n}", std::process::id()));
        if fs::rename(path, &aside).is_err() {
            return;
        }
        if fs::read(&aside).is_ok_and(|v| v == held) {
            let _ = fs::remove_file(&aside);
            let who = Owner::parse(&held).map_or_else(|| "no owner recorded".to_string(), |o| o.describe());
            eprintln!("chorus file store {}: removed a lock left by a dead rank ({who})", self.dir.display());
        } else {
            let _ = fs::hard_link(&aside, path);
            let _ = fs::remove_file(&aside);
        }
        *seen = None;
    }

    fn all_present(&self, keys: &[&str]) -> Result<bool> {
        for k in keys {
            if !self.entry_path(k).exists() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn wait_for(&self, keys: &[&str], timeout: Duration, op: impl FnOnce() -> String) -> Result<()> {
        if poll_until(deadline_after(timeout), || self.all_present(keys))? {
            Ok(())
        } else {
            Err(timeout_error(op(), timeout))
        }
    }
}

/// Removes the lock file when the critical section ends, if it is still
/// this acquisition's (a lock judged stale and taken over is not removed).
struct LockGuard {
    path: PathBuf,
    record: Vec<u8>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // A failure leaves a lock that goes stale; nothing better to do in Drop.
        if fs::read(&self.path).is_ok_and(|held| held == self.record) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Who holds a lock: enough to tell, on the owner's host, whether the
/// owner still runs, and a token that tells one acquisition from another.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Owner {
    /// Host name, boot id and pid namespace: equal only on the same host and namespace.
    host: String,
    pid: u32,
    /// The process's start time (clock ticks since boot), telling a reused pid apart.
    start: String,
    token: String,
}

impl Owner {
    fn this_process(n: u64) -> Owner {
        let pid = std::process::id();
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        Owner { host: host_identity(), pid, start: start_time(pid).unwrap_or_default(), token: format!("{nanos}-{n}") }
    }

    fn record(&self) -> Vec<u8> {
        format!("{LOCK_FORMAT}\nhost={}\npid={}\nstart={}\ntoken={}\n", self.host, self.pid, self.start, self.token)
            .into_bytes()
    }

    fn parse(bytes: &[u8]) -> Option<Owner> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        if lines.next()? != LOCK_FORMAT {
            return None;
        }
        let mut field = |name: &str| lines.next()?.strip_prefix(name)?.strip_prefix('=').map(str::to_string);
        Some(Owner {
            host: field("host")?,
            pid: field("pid")?.parse().ok()?,
            start: field("start")?,
            token: field("token")?,
        })
    }

    fn is_this_host(&self) -> bool {
        self.host == host_identity()
    }

    /// Whether the owner (of this host) still runs: its pid exists and was
    /// started when the owner was.
    fn is_alive(&self) -> bool {
        match start_time(self.pid) {
            Some(start) => start == self.start || self.start.is_empty(),
            // No /proc entry: gone (or no /proc: ask the kernel).
            None if Path::new("/proc/self/stat").exists() => false,
            // SAFETY: kill with signal 0 only checks that the process exists.
            None => unsafe { libc::kill(self.pid as libc::pid_t, 0) == 0 },
        }
    }

    fn describe(&self) -> String {
        format!("pid {} on {}", self.pid, self.host)
    }
}

/// This host as a lock owner names it: the host name, the boot id and the
/// pid namespace (containers may share a host name, and a pid means
/// something only in its namespace).
fn host_identity() -> String {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer.
    let ok = unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len()) } == 0;
    let host = if ok {
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        "?".into()
    };
    let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let pidns = fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{host}/{}/{pidns}", boot.trim())
}

/// A process's start time from `/proc/<pid>/stat` (field 22), if it runs.
fn start_time(pid: u32) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19).map(str::to_string)
}

fn io_error(path: &Path, what: &str, e: &std::io::Error) -> CommError {
    CommError::store(path.display().to_string(), StoreFailure::Io, format!("cannot {what}: {e}"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a from a given basis; two bases make a 128-bit name for long keys.
fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    bytes.iter().fold(basis, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let _lock = self.lock("set")?;
        self.write(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut value = None;
        let found = poll_until(deadline_after(timeout), || {
            value = self.read(key)?;
            Ok(value.is_some())
        })?;
        match value {
            Some(v) if found => Ok(v),
            _ => Err(timeout_error(format!("store get {key}"), timeout)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let _lock = self.lock("add")?;
        let sum = add_outcome(self.read(key)?.as_deref(), delta).map_err(|reason| {
            CommError::store(self.address(), StoreFailure::BadValue, format!("add {key}: {reason}"))
        })?;
        self.write(key, sum.to_string().as_bytes())?;
        Ok(sum)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let _lock = self.lock("compare_set")?;
        let (store, answer) = compare_set_outcome(self.read(key)?.as_deref(), expected, desired);
        if let Some(v) = store {
            self.write(key, &v)?;
        }
        Ok(answer)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_for(keys, timeout, || wait_op(keys))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.all_present(keys)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let _lock = self.lock("delete")?;
        self.remove(key)
    }

    fn num_keys(&self) -> Result<u64> {
        let entries = fs::read_dir(&self.dir).map_err(|e| io_error(&self.dir, "list", &e))?;
        let mut n = 0;
        for entry in entries {
            let entry = entry.map_err(|e| io_error(&self.dir, "list", &e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("k-") || name.starts_with("h-") {
                n += 1;
            }
        }
        Ok(n)
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let op = || format!("store multi_get [{}]", keys.join(", "));
        self.wait_for(keys, timeout, op)?;
        // Present now; a concurrent delete makes the read fail as a timeout would.
        keys.iter().map(|k| self.read(k)?.ok_or_else(|| timeout_error(op(), timeout))).collect()
    }

    fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()> {
        let _lock = self.lock("multi_set")?;
        entries.iter().try_for_each(|(k, v)| self.write(k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("chorus-filestore-unit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn owner(host: &str, pid: u32, start: &str) -> Vec<u8> {
        Owner { host: host.into(), pid, start: start.into(), token: "t".into() }.record()
    }

    #[test]
    fn a_lock_of_a_live_process_here_is_never_broken_however_old() {
        let d = dir("live");
        let store = FileStore::open(&d)
            .unwrap()
            .with_lock_timeout(Duration::from_millis(300))
            .with_stale_lock_after(Duration::from_millis(10));
        let me = std::process::id();
        fs::write(d.join(LOCK_NAME), owner(&host_identity(), me, &start_time(me).unwrap())).unwrap();
        File::options()
            .write(true)
            .open(d.join(LOCK_NAME))
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();
        let e = store.set("k", b"v").unwrap_err();
        assert!(matches!(e, CommError::Timeout { ref op, .. } if op == "file store lock for set"), "{e}");
        assert!(d.join(LOCK_NAME).exists());
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_lock_of_a_dead_process_here_is_broken_at_once() {
        let d = dir("dead");
        let store = FileStore::open(&d).unwrap().with_lock_timeout(Duration::from_secs(5));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let (pid, start) = (child.id(), start_time(child.id()).unwrap_or_else(|| "1".into()));
        child.wait().unwrap();
        fs::write(d.join(LOCK_NAME), owner(&host_identity(), pid, &start)).unwrap();
        let t = Instant::now();
        store.set("k", b"v").unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // A pid reused by a later process is dead too: this process with another start time.
        fs::write(d.join(LOCK_NAME), owner(&host_identity(), std::process::id(), "0")).unwrap();
        store.set("k", b"w").unwrap();
        assert_eq!(store.get("k", Duration::from_secs(1)).unwrap(), b"w");
        assert!(!d.join(LOCK_NAME).exists(), "the lock is released after the change");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_lock_of_another_host_is_broken_only_after_being_seen_held_for_the_stale_time() {
        let d = dir("foreign");
        let stale = Duration::from_millis(400);
        let foreign = owner("elsewhere/boot/pid:[1]", 1, "5");
        let quick =
            FileStore::open(&d).unwrap().with_lock_timeout(Duration::from_millis(200)).with_stale_lock_after(stale);
        fs::write(d.join(LOCK_NAME), &foreign).unwrap();
        assert!(matches!(quick.set("k", b"v"), Err(CommError::Timeout { .. })));
        assert_eq!(fs::read(d.join(LOCK_NAME)).unwrap(), foreign, "broken before the stale time");
        let patient =
            FileStore::open(&d).unwrap().with_lock_timeout(Duration::from_secs(5)).with_stale_lock_after(stale);
        let t = Instant::now();
        patient.set("k", b"v").unwrap();
        assert!(t.elapsed() >= stale, "{:?}", t.elapsed());
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn only_the_owner_removes_its_lock() {
        let d = dir("owner");
        let store = FileStore::open(&d).unwrap();
        let guard = store.lock("test").unwrap();
        // Another rank judged it stale and took it over: dropping ours must leave theirs.
        let theirs = owner("elsewhere/boot/pid:[1]", 2, "5");
        fs::write(d.join(LOCK_NAME), &theirs).unwrap();
        drop(guard);
        assert_eq!(fs::read(d.join(LOCK_NAME)).unwrap(), theirs);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn owner_records_round_trip() {
        let o = Owner::this_process(3);
        assert_eq!(Owner::parse(&o.record()), Some(o.clone()));
        assert!(o.is_this_host() && o.is_alive());
        assert_eq!(Owner::parse(b""), None);
    }

    #[test]
    fn a_file_that_is_not_an_entry_is_reported_not_served() {
        let d = dir("corrupt");
        let store = FileStore::open(&d).unwrap();
        fs::write(store.entry_path("k"), b"xx").unwrap();
        let e = store.get("k", Duration::from_millis(10)).unwrap_err();
        assert!(matches!(e, CommError::Store { failure: StoreFailure::Io, .. }), "{e}");
        let _ = fs::remove_dir_all(&d);
    }
}
