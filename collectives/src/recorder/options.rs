//! How a communicator records its launches ([`RecorderOptions`]), from the
//! process environment, and the recorder's constants.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// Launches a ring keeps unless told otherwise.
pub const DEFAULT_ENTRIES: usize = 1024;
/// The most launches a ring may keep (about 200 bytes each).
pub const MAX_ENTRIES: usize = 1 << 20;
/// The variable that sets [`RecorderOptions::entries`] (0 turns recording off).
pub const ENTRIES_VAR: &str = "CHORUS_FLIGHT_RECORDER_ENTRIES";
/// The variable that turns on [`RecorderOptions::track_starts`] (`1`).
pub const STARTS_VAR: &str = "CHORUS_FLIGHT_RECORDER_STARTS";
/// The variable that sets [`RecorderOptions::dump_dir`].
pub const DIR_VAR: &str = "CHORUS_TRACE_DIR";
/// How often the recorder's thread reads the events of unfinished launches.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// How a communicator records its launches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecorderOptions {
    /// Launches kept (the oldest is dropped first); 0 records nothing.
    pub entries: usize,
    /// Where dumps are written (created when the first dump is); `None`:
    /// the ring is kept but never written.
    pub dump_dir: Option<PathBuf>,
    /// Also record an event just before each launch, so the ring tells
    /// `enqueued` (the stream has not reached the call) from `started`.
    /// Off by default: a second event per call (on the cpu device a few
    /// microseconds more per small call, `examples/recorder_cost.rs` and
    /// `docs/benchmarks.md`). Without
    /// it an unfinished launch stays `enqueued`, whether or not its stream
    /// has reached it, and `chorus trace` cannot name a stalled stream.
    pub track_starts: bool,
}

impl Default for RecorderOptions {
    fn default() -> Self {
        RecorderOptions { entries: DEFAULT_ENTRIES, dump_dir: None, track_starts: false }
    }
}

impl RecorderOptions {
    /// Records nothing.
    pub fn off() -> Self {
        RecorderOptions { entries: 0, dump_dir: None, track_starts: false }
    }

    /// Parses a ring size: a count in `0..=MAX_ENTRIES`.
    pub fn parse_entries(text: &str) -> Result<usize, String> {
        match text.trim().parse::<usize>() {
            Ok(n) if n <= MAX_ENTRIES => Ok(n),
            Ok(n) => Err(format!("{ENTRIES_VAR}={n}: at most {MAX_ENTRIES} entries")),
            Err(_) => Err(format!("{ENTRIES_VAR}={text:?} is not a count of entries")),
        }
    }

    /// The options the process environment gives: [`ENTRIES_VAR`] (default
    /// [`DEFAULT_ENTRIES`]), [`DIR_VAR`] (default: no dumps) and
    /// [`STARTS_VAR`] (default: off). A value
    /// that does not parse is reported once on stderr and the default kept:
    /// a communicator is made without a way to return the error.
    pub fn from_env() -> Self {
        static FROM_ENV: OnceLock<RecorderOptions> = OnceLock::new();
        FROM_ENV
            .get_or_init(|| {
                let entries = match std::env::var(ENTRIES_VAR) {
                    Ok(text) => RecorderOptions::parse_entries(&text).unwrap_or_else(|e| {
                        eprintln!("chorus: {e}; the flight recorder keeps {DEFAULT_ENTRIES} launches");
                        DEFAULT_ENTRIES
                    }),
                    Err(_) => DEFAULT_ENTRIES,
                };
                let dump_dir = std::env::var_os(DIR_VAR).filter(|d| !d.is_empty()).map(PathBuf::from);
                let track_starts = std::env::var(STARTS_VAR).is_ok_and(|v| v == "1");
                RecorderOptions { entries, dump_dir, track_starts }
            })
            .clone()
    }
}
