//! The dump format: what a rank writes and `chorus trace` reads (JSON).

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The version of the format written here; a reader refuses any other
/// (fields added since are optional, so older dumps of this version read).
pub const FORMAT_VERSION: u32 = 1;

/// The variable in which `chorus launch` gives every rank of a job the
/// job's start (microseconds since the Unix epoch, the same on every node),
/// written into each dump as [`RankDump::run_started_us`].
pub const RUN_STARTED_VAR: &str = "CHORUS_RUN_STARTED_US";

/// Most ranks a dump may claim for its world (a reader bounds what it
/// allocates by it): the largest world a communicator can have.
pub const MAX_WORLD_SIZE: u64 = 1 << 20;

/// Where a recorded launch stands, as the host last observed it.
///
/// What each state means is the same on every backend, because it is read
/// from device events recorded around the launch on its stream (cpu events
/// for `sim`, `ucx` and the simulated NCCL ABI; CUDA/HIP events for `nccl`
/// and `rccl`):
/// - `Enqueued`: the host issued the call (the backend accepted it), and the
///   stream has not reached it yet — work enqueued before it is still running
///   (when the ring does not track starts, [`CommRecord::tracks_starts`]:
///   issued and not finished, whether or not the stream has reached it);
/// - `Started`: the stream reached the call (the event recorded just before it
///   completed) and it has not finished: the rank is inside the collective,
///   typically waiting for its peers (only when starts are tracked);
/// - `Completed`: the event recorded just after it completed without error;
/// - `Failed`: that event reports the stream's error (a mismatch, a timeout,
///   an abort, a backend error), or the stream failed before the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Issued by the host; the stream has not reached it.
    Enqueued,
    /// The stream reached it; not finished.
    Started,
    /// Finished without error.
    Completed,
    /// Finished with an error (or skipped because the stream had failed).
    Failed,
}

impl CallState {
    /// The state's name as the dump writes it.
    pub fn name(self) -> &'static str {
        match self {
            CallState::Enqueued => "enqueued",
            CallState::Started => "started",
            CallState::Completed => "completed",
            CallState::Failed => "failed",
        }
    }
}

/// One call of a launch: what every rank must agree on, and its size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// The operation (`all_reduce`, `send`, ...).
    pub op: String,
    /// Position in the communicator's collective sequence (`None` for
    /// send/recv, which are numbered per peer).
    pub seq: Option<u64>,
    /// Element type.
    pub dtype: String,
    /// Elements, as in the call's fingerprint (per rank for `all_gather`,
    /// the receive count for `reduce_scatter`).
    pub count: u64,
    /// Bytes of `count` elements.
    pub bytes: u64,
    /// The reduce operator of a reducing collective.
    pub reduce: Option<String>,
    /// Root of `broadcast`/`reduce`.
    pub root: Option<u64>,
    /// Peer of `send`/`recv`.
    pub peer: Option<u64>,
}

impl CallRecord {
    /// What ranks must agree on, as one line: `all_reduce(1024 x f32, sum)`.
    pub fn signature(&self) -> String {
        let mut s = format!("{}({} x {}", self.op, self.count, self.dtype);
        if let Some(r) = &self.reduce {
            s.push_str(&format!(", {r}"));
        }
        if let Some(r) = self.root {
            s.push_str(&format!(", root {r}"));
        }
        if let Some(p) = self.peer {
            s.push_str(&format!(", peer {p}"));
        }
        s.push(')');
        s
    }
}

/// One launch: a single call, or the calls of one group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntryRecord {
    /// Position among this communicator's launches (counts every launch,
    /// including those the ring has since dropped).
    pub id: u64,
    /// The calls, in the order they were added.
    pub calls: Vec<CallRecord>,
    /// Where the launch stands.
    pub state: CallState,
    /// When the host issued it (microseconds since the Unix epoch).
    pub enqueued_us: u64,
    /// When the recorder saw the stream reach it (at most its polling
    /// interval late).
    pub started_us: Option<u64>,
    /// When the recorder saw it finish, completed or failed.
    pub finished_us: Option<u64>,
    /// The error of a failed launch.
    pub error: Option<String>,
}

impl EntryRecord {
    /// The first collective sequence number of the launch.
    pub fn seq(&self) -> Option<u64> {
        self.calls.iter().find_map(|c| c.seq)
    }
}

/// One communicator's ring.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommRecord {
    /// The communicator's name, the same on every member: `root`, and
    /// `root/split0:color1` for the communicator split from it first (with
    /// color 1). Members of one communicator are the ranks whose dumps hold
    /// its name.
    pub id: String,
    /// This rank within the communicator.
    pub rank: u64,
    /// Ranks in the communicator.
    pub size: u64,
    /// The backend (`sim`, `ucx`, `nccl`, ...).
    pub backend: String,
    /// The device of this rank.
    pub device: String,
    /// The ring's capacity (launches kept).
    pub capacity: u64,
    /// Whether `started` is tracked (an event before each launch); without,
    /// an unfinished launch is `enqueued` whether or not its stream reached it.
    pub tracks_starts: bool,
    /// Launches recorded so far, including those dropped from the ring.
    pub launches: u64,
    /// Why the communicator was aborted, when it was.
    pub aborted: Option<String>,
    /// The kept launches, oldest first.
    pub entries: Vec<EntryRecord>,
}

/// How the reason of a dump taken on a signal begins (`signal SIGTERM`).
pub const SIGNAL_REASON: &str = "signal ";

/// One rank's dump: every communicator of the rank (the root and its splits).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankDump {
    /// The format's version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The rank in its root communicator.
    pub rank: u64,
    /// Ranks in the root communicator.
    pub world_size: u64,
    /// The host's name.
    pub host: String,
    /// The process.
    pub pid: u32,
    /// What made the rank dump (`timeout`, `signal SIGTERM`, ...).
    pub reason: String,
    /// When the dump was written (microseconds since the Unix epoch).
    pub dumped_us: u64,
    /// The job's name (`TORCHELASTIC_RUN_ID`, which `chorus launch --run-id`
    /// sets), when the process had one.
    #[serde(default)]
    pub run_id: Option<String>,
    /// When the run started (microseconds since the Unix epoch): the time
    /// `chorus launch` gave every rank of the job ([`RUN_STARTED_VAR`]),
    /// else this process's start. Two runs under one run id differ here.
    #[serde(default)]
    pub run_started_us: Option<u64>,
    /// The communicators, the root first.
    pub communicators: Vec<CommRecord>,
}

impl RankDump {
    /// Whether the dump was taken on a signal (`SIGTERM`, `SIGINT`,
    /// `SIGUSR1`) rather than for a failure: a snapshot of a run that may
    /// have been healthy, whose unfinished calls were merely in flight.
    pub fn is_snapshot(&self) -> bool {
        self.reason.starts_with(SIGNAL_REASON)
    }

    /// The file a rank's dump is written to: its rank and host in the name.
    pub fn file_name(rank: u64, host: &str) -> String {
        let host: String =
            host.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
        format!("rank{rank:05}-{host}.json")
    }
}

/// Microseconds since the Unix epoch of an `Instant` (one base per process,
/// so every ring of a process agrees).
pub(super) fn epoch_us(t: Instant) -> u64 {
    static BASE: OnceLock<(Instant, u64)> = OnceLock::new();
    let (base, base_us) = *BASE.get_or_init(|| {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        (Instant::now(), now.as_micros() as u64)
    });
    match t.checked_duration_since(base) {
        Some(d) => base_us.saturating_add(d.as_micros() as u64),
        None => base_us.saturating_sub(base.duration_since(t).as_micros() as u64),
    }
}
