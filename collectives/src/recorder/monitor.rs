//! The recorder's one thread per process: follows every ring's unfinished
//! launches, writes the dumps, and answers the dump signals.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, Weak};

use super::dump::{self, epoch_us, CommRecord, RankDump, RUN_STARTED_VAR};
use super::options::POLL_INTERVAL;

/// A ring, as the thread sees it (whatever its device backend).
pub(super) trait Watched: Send + Sync {
    /// Reads the events of unfinished launches; a reason to dump when a
    /// launch has just failed or the communicator was aborted.
    fn poll(&self) -> Option<String>;
    /// The ring as the dump writes it.
    fn record(&self) -> CommRecord;
    /// Where its rank's dump goes.
    fn dir(&self) -> Option<&Path>;
    /// Rank in the root communicator and the root's size.
    fn owner(&self) -> (usize, usize);
    /// Gives back a reason to dump that `poll` returned to someone other
    /// than the monitor (a snapshot), so the monitor still dumps for it.
    fn requeue(&self, reason: String);
}

/// Polls `ring` outside the monitor: a reason to dump found is left for it.
pub(super) fn poll_aside(ring: &dyn Watched) {
    if let Some(reason) = ring.poll() {
        ring.requeue(reason);
    }
}

/// The last record of a dropped ring that had a dump directory: a rank that
/// drops its communicator on the error it just saw still has it dumped.
pub(super) struct Retired {
    pub(super) dir: PathBuf,
    pub(super) owner: (usize, usize),
    pub(super) record: CommRecord,
    /// Its reason to dump, when its last poll found one.
    pub(super) trigger: Option<String>,
}

/// Entries kept in retired records at most (the oldest records go first).
const RETIRED_ENTRIES: usize = 1 << 16;

struct Registry {
    /// Every live ring, in creation order (a rank's root before its splits).
    rings: Mutex<Vec<Weak<dyn Watched>>>,
    retired: Mutex<std::collections::VecDeque<Retired>>,
    /// Directories already dumped for a failure (a signal dumps again).
    dumped: Mutex<HashSet<PathBuf>>,
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    let reg = REGISTRY.get_or_init(|| Registry {
        rings: Mutex::new(Vec::new()),
        retired: Mutex::new(Default::default()),
        dumped: Mutex::new(HashSet::new()),
    });
    thread_started(reg);
    reg
}

/// Starts the recorder's thread once; whether it runs.
fn thread_started(reg: &'static Registry) -> bool {
    static STARTED: OnceLock<bool> = OnceLock::new();
    *STARTED.get_or_init(|| {
        // A rank that exits on the error it just saw (before the thread's
        // next poll) still writes its dump.
        // SAFETY: `at_exit` is an `extern "C"` function that does not unwind.
        unsafe {
            libc::atexit(at_exit);
        }
        match std::thread::Builder::new().name("chorus-recorder".into()).spawn(move || run(reg)) {
            Ok(_) => true,
            Err(e) => {
                eprintln!(
                    "chorus: the flight recorder's thread could not start ({e}); launches are recorded, not dumped"
                );
                false
            }
        }
    })
}

/// Follows `ring` from now on; whether the recorder's thread runs (the
/// dump signals are answered only then).
pub(super) fn register(ring: Weak<dyn Watched>) -> bool {
    let reg = registry();
    if let Ok(mut rings) = reg.rings.lock() {
        rings.push(ring);
    }
    thread_started(reg)
}

/// Called from a ring's drop (`ring` its address): keeps its last record
/// (where it has a dump directory), then stops following it. Until then a
/// dump that finds the ring without strong references waits for this, so a
/// communicator dropped on another thread is never in neither list.
pub(super) fn retire(ring: *const (), last: Option<Retired>) {
    let reg = registry();
    if let (Some(r), Ok(mut retired)) = (last, reg.retired.lock()) {
        retired.push_back(r);
        let mut total: usize = retired.iter().map(|r| r.record.entries.len()).sum();
        while total > RETIRED_ENTRIES && retired.len() > 1 {
            total -= retired.pop_front().map_or(0, |r| r.record.entries.len());
        }
    }
    if let Ok(mut rings) = reg.rings.lock() {
        rings.retain(|w| !std::ptr::eq(w.as_ptr() as *const (), ring));
    }
}

/// How long [`live`] waits for rings being dropped to retire their records.
const DROP_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The rings alive now, once every ring being dropped has retired its record
/// (or [`DROP_WAIT`] has passed: a drop that cannot take the lock is dropped
/// from the list then).
fn live(reg: &Registry) -> Vec<std::sync::Arc<dyn Watched>> {
    let deadline = std::time::Instant::now() + DROP_WAIT;
    loop {
        let Ok(mut rings) = reg.rings.lock() else { return Vec::new() };
        let dropping = rings.iter().any(|w| w.strong_count() == 0);
        if !dropping || std::time::Instant::now() >= deadline {
            rings.retain(|w| w.strong_count() > 0);
            return rings.iter().filter_map(Weak::upgrade).collect();
        }
        drop(rings);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Held while polling and writing: a flush at exit waits for the thread's
/// write in progress instead of cutting it short.
static WRITING: Mutex<()> = Mutex::new(());

/// The rings' (and retired rings') reasons to dump, one per directory.
fn poll_all(reg: &Registry, rings: &[std::sync::Arc<dyn Watched>]) -> Vec<(PathBuf, String)> {
    let mut triggers: Vec<(PathBuf, String)> = Vec::new();
    let mut add = |dir: &Path, reason: String| {
        if !triggers.iter().any(|(d, _)| d == dir) {
            triggers.push((dir.to_path_buf(), reason));
        }
    };
    if let Ok(mut retired) = reg.retired.lock() {
        for r in retired.iter_mut() {
            if let Some(reason) = r.trigger.take() {
                add(&r.dir, reason);
            }
        }
    }
    for ring in rings {
        if let (Some(reason), Some(dir)) = (ring.poll(), ring.dir()) {
            add(dir, reason);
        }
    }
    triggers
}

/// Writes the first dump of each directory in `triggers` not dumped yet.
fn write_first(reg: &Registry, rings: &[std::sync::Arc<dyn Watched>], triggers: Vec<(PathBuf, String)>) {
    for (dir, reason) in triggers {
        let first = reg.dumped.lock().map(|mut d| d.insert(dir.clone())).unwrap_or(false);
        if first {
            write_dir(rings, &dir, &reason);
        }
    }
}

/// Polls every ring now and writes the dumps a failure calls for (what the
/// thread would do at its next poll); waits at most 2 s for a write in progress.
pub(super) fn flush() {
    let reg = registry();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let _guard = loop {
        match WRITING.try_lock() {
            Ok(g) => break g,
            Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(1))
            }
            Err(std::sync::TryLockError::WouldBlock) => return,
        }
    };
    let rings = live(reg);
    let triggers = poll_all(reg, &rings);
    write_first(reg, &rings, triggers);
}

extern "C" fn at_exit() {
    flush();
}

fn run(reg: &'static Registry) {
    loop {
        std::thread::sleep(POLL_INTERVAL);
        let _guard = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        let rings = live(reg);
        let triggers = poll_all(reg, &rings);
        write_first(reg, &rings, triggers);
    }
}

/// Writes every rank's dump of every directory (live and retired rings) now,
/// for a signal; returns how many directories there were. Waits for a write
/// in progress: the caller bounds the wait.
pub(super) fn write_all(reason: &str) -> usize {
    let reg = registry();
    let _guard = WRITING.lock().unwrap_or_else(|p| p.into_inner());
    let rings = live(reg);
    let mut dirs: Vec<PathBuf> = rings.iter().filter_map(|r| r.dir().map(Path::to_path_buf)).collect();
    if let Ok(retired) = reg.retired.lock() {
        dirs.extend(retired.iter().map(|r| r.dir.clone()));
    }
    dirs.sort();
    dirs.dedup();
    for dir in &dirs {
        write_dir(&rings, dir, reason);
    }
    dirs.len()
}

/// Writes every rank's dump of the rings in `dir`; failures are reported
/// on stderr (nobody else can take them).
fn write_dir(rings: &[std::sync::Arc<dyn Watched>], dir: &Path, reason: &str) {
    let mut owners: Vec<usize> = rings.iter().filter(|r| r.dir() == Some(dir)).map(|r| r.owner().0).collect();
    if let Ok(retired) = registry().retired.lock() {
        owners.extend(retired.iter().filter(|r| r.dir == dir).map(|r| r.owner.0));
    }
    owners.sort_unstable();
    owners.dedup();
    for owner in owners {
        if let Err(e) = write_owner(rings, dir, owner, reason) {
            eprintln!("chorus: the flight recorder could not write rank {owner}'s dump in {}: {e}", dir.display());
        }
    }
}

/// Writes rank `owner`'s dump of the rings in `dir` now; the file.
pub(super) fn write_rank(dir: &Path, owner: usize, reason: &str) -> std::io::Result<PathBuf> {
    let rings = live(registry());
    for ring in rings.iter().filter(|r| r.dir() == Some(dir) && r.owner().0 == owner) {
        poll_aside(&**ring);
    }
    write_owner(&rings, dir, owner, reason)
}

fn write_owner(
    rings: &[std::sync::Arc<dyn Watched>],
    dir: &Path,
    owner: usize,
    reason: &str,
) -> std::io::Result<PathBuf> {
    let mine = rings.iter().filter(|r| r.dir() == Some(dir) && r.owner().0 == owner);
    let mut records: Vec<((usize, usize), CommRecord)> = mine.map(|r| (r.owner(), r.record())).collect();
    if let Ok(retired) = registry().retired.lock() {
        let gone = retired.iter().filter(|r| r.dir == dir && r.owner.0 == owner);
        records.extend(gone.map(|r| (r.owner, r.record.clone())));
    }
    // The root first (a retired root was made before the live splits).
    records.sort_by_key(|(_, c)| c.id.contains('/'));
    let world_size = records.first().map_or(0, |(o, _)| o.1);
    let mut communicators: Vec<CommRecord> = Vec::with_capacity(records.len());
    for (_, mut c) in records {
        // Two live roots of one rank (a communicator wrapped again, say) keep apart.
        let same = communicators.iter().filter(|o| o.id == c.id || o.id.starts_with(&format!("{}#", c.id))).count();
        if same > 0 {
            c.id = format!("{}#{}", c.id, same + 1);
        }
        communicators.push(c);
    }
    let host = host_name();
    let dump = RankDump {
        version: dump::FORMAT_VERSION,
        rank: owner as u64,
        world_size: world_size as u64,
        host: host.clone(),
        pid: std::process::id(),
        reason: reason.to_string(),
        dumped_us: epoch_us(std::time::Instant::now()),
        run_id: run_identity().0,
        run_started_us: run_identity().1,
        communicators,
    };
    std::fs::create_dir_all(dir)?;
    let path = dir.join(RankDump::file_name(owner as u64, &host));
    // Written aside and renamed: a reader never sees half a dump.
    let tmp = dir.join(format!(".{}.{}.tmp", RankDump::file_name(owner as u64, &host), std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        serde_json::to_writer_pretty(&mut file, &dump).map_err(std::io::Error::other)?;
        file.write_all(b"\n")?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| path)
}

/// The job's name and start, as the process environment gives them
/// (`TORCHELASTIC_RUN_ID`, [`RUN_STARTED_VAR`]; read once).
fn run_identity() -> (Option<String>, Option<u64>) {
    static RUN: OnceLock<(Option<String>, Option<u64>)> = OnceLock::new();
    RUN.get_or_init(|| {
        let id = std::env::var("TORCHELASTIC_RUN_ID").ok().filter(|v| !v.is_empty());
        let started = std::env::var(RUN_STARTED_VAR).ok().and_then(|v| v.trim().parse().ok());
        (id, started)
    })
    .clone()
}

/// This host's name (`gethostname`), `unknown-host` if it cannot be read:
/// the name in the dumps' file names (and in `chorus launch`'s summaries).
pub fn host_name() -> String {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        match (rc, std::str::from_utf8(&buf[..end])) {
            (0, Ok(name)) if !name.is_empty() => name.to_string(),
            _ => "unknown-host".to_string(),
        }
    })
    .clone()
}
