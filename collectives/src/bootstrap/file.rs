//! [`FileStore`]: a store in a directory of a filesystem that every rank
//! sees (NFS, Lustre, GPFS, or a local disk for processes of one host).
//!
//! One file per key, named from the key (`k-<hex of the key>`, or
//! `h-<128-bit hash>` for long keys; the file repeats the key so a hash
//! collision is detected, not served). A write goes to a temporary file that
//! is then renamed over the entry, so a reader sees the old value or the new
//! one, never half of one. Every change (set, add, compare-set, delete,
//! multi-set) holds the directory's lock file, created with `O_EXCL`
//! (`create_new`), which is atomic on local filesystems and on NFSv3+; that
//! makes read-modify-write operations atomic across processes and hosts.
//! Waiting operations poll (1 ms doubling to 20 ms) until their deadline.
//!
//! A rank that dies holding the lock leaves the lock file behind; a lock
//! file older than [`FileStore::with_stale_lock_after`] (10 s by default;
//! a critical section lasts microseconds) is removed with a message on
//! stderr. On NFS, a new entry becomes visible to other hosts when their
//! attribute cache expires (`actimeo`), so waits there take up to that long.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::store::{add_outcome, compare_set_outcome, deadline_after, poll_until, timeout_error, wait_op, Store};
use crate::{CommError, Result, StoreFailure};

/// Keys longer than this are named by their hash (file names are limited to
/// 255 bytes, and hex doubles the length).
const MAX_HEX_KEY: usize = 100;
const LOCK_NAME: &str = ".lock";
const TMP_PREFIX: &str = ".tmp-";

/// A store in a shared directory; see the module documentation for the
/// layout and the atomicity argument.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    lock_timeout: Duration,
    stale_lock_after: Duration,
    tmp_counter: AtomicU64,
}

impl FileStore {
    /// Opens (creating it if needed) the store in directory `dir`. Every
    /// rank passes the same path.
    pub fn open(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| io_error(&dir, "create the directory", &e))?;
        Ok(FileStore {
            dir,
            lock_timeout: Duration::from_secs(60),
            stale_lock_after: Duration::from_secs(10),
            tmp_counter: AtomicU64::new(0),
        })
    }

    /// How long a change waits for the lock before failing with
    /// [`CommError::Timeout`] (60 s by default).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> FileStore {
        self.lock_timeout = timeout;
        self
    }

    /// After how long a lock file is taken to be left by a dead rank and removed.
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
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
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

    /// Takes the directory's lock (exclusive creation of the lock file),
    /// removing a stale one, until the lock timeout.
    fn lock(&self, op: &str) -> Result<LockGuard> {
        let path = self.dir.join(LOCK_NAME);
        let acquired = poll_until(deadline_after(self.lock_timeout), || {
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    self.break_stale_lock(&path);
                    Ok(false)
                }
                Err(e) => Err(io_error(&path, "create the lock file", &e)),
            }
        })?;
        if acquired {
            Ok(LockGuard { path })
        } else {
            Err(timeout_error(format!("file store lock for {op}"), self.lock_timeout))
        }
    }

    fn break_stale_lock(&self, path: &Path) {
        let age =
            fs::metadata(path).and_then(|m| m.modified()).ok().and_then(|t| SystemTime::now().duration_since(t).ok());
        if age.is_some_and(|a| a > self.stale_lock_after) && fs::remove_file(path).is_ok() {
            eprintln!(
                "chorus file store {}: removed a lock file older than {:?} (left by a dead rank)",
                self.dir.display(),
                self.stale_lock_after
            );
        }
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

/// Removes the lock file when the critical section ends.
struct LockGuard {
    path: PathBuf,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // A failure leaves a lock that goes stale; nothing better to do in Drop.
        let _ = fs::remove_file(&self.path);
    }
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

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("chorus-filestore-unit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_held_lock_times_out_and_a_stale_one_is_broken() {
        let d = dir("lock");
        let store = FileStore::open(&d).unwrap().with_lock_timeout(Duration::from_millis(100));
        let lock = File::create(d.join(LOCK_NAME)).unwrap();
        let e = store.set("k", b"v").unwrap_err();
        assert!(matches!(e, CommError::Timeout { ref op, .. } if op == "file store lock for set"), "{e}");
        lock.set_modified(SystemTime::now() - Duration::from_secs(60)).unwrap();
        store.set("k", b"v").unwrap();
        assert_eq!(store.get("k", Duration::from_secs(1)).unwrap(), b"v");
        assert!(!d.join(LOCK_NAME).exists(), "the lock is released after the change");
        let _ = fs::remove_dir_all(&d);
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
