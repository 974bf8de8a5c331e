//! What bounds a [`TcpStoreServer`](super::TcpStoreServer) ([`ServerOptions`]
//! and the loop's constants) and what it reports ([`ServerStats`]).

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use super::super::protocol::Limits;

/// Where the server reports why it closed a connection (one line each).
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// A connection's output above this many bytes stops its input being read.
pub(super) const OUTPUT_HIGH_WATER: usize = 1 << 20;
/// At most this much is read from one connection per loop turn, so a fast
/// sender cannot starve the others.
pub(super) const READ_PER_TURN: usize = 1 << 20;
/// One read from a socket.
pub(super) const READ_CHUNK: usize = 64 * 1024;
/// Most bytes a connection may buffer before it has sent `VALIDATE` (5
/// bytes; PyTorch's client follows it with a 5-byte `PING`).
pub const UNVALIDATED_INPUT: usize = 4096;
/// What a stored key, queue element or awaited key costs beyond its bytes
/// (map entry, vector header), in the budget.
pub const ENTRY_OVERHEAD: usize = 64;
/// A connection's buffers above this capacity are freed once empty.
pub(super) const KEEP_BUFFER: usize = 64 * 1024;

/// How a [`TcpStoreServer`](crate::bootstrap::TcpStoreServer) bounds what clients can make it do.
#[derive(Clone)]
pub struct ServerOptions {
    /// Request size limits (PyTorch's by default).
    pub limits: Limits,
    /// Most connections open at once; more are accepted and closed at once,
    /// with a log line (1024 by default).
    pub max_connections: usize,
    /// How long a new connection may take to send `VALIDATE` (30 s).
    pub handshake_timeout: Duration,
    /// The memory budget, in bytes, of everything clients make the server
    /// hold (see the module documentation): stored keys, values and queue
    /// elements, awaited keys, and the connections' unfinished requests and
    /// unsent answers (512 MiB). Over it, the connection holding the most
    /// buffered bytes is cut; a write that only stored data would push over
    /// it closes its own connection.
    pub max_memory_bytes: usize,
    /// Where the reasons for closed connections go (stderr when `None`).
    pub log: Option<LogFn>,
}

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            limits: Limits::default(),
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(30),
            max_memory_bytes: 512 << 20,
            log: None,
        }
    }
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("limits", &self.limits)
            .field("max_connections", &self.max_connections)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_memory_bytes", &self.max_memory_bytes)
            .field("log", &self.log.as_ref().map(|_| "callback"))
            .finish()
    }
}

/// What a [`TcpStoreServer`](crate::bootstrap::TcpStoreServer) holds now (see
/// [`TcpStoreServer::stats`](crate::bootstrap::TcpStoreServer::stats)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerStats {
    /// Bytes counted against [`ServerOptions::max_memory_bytes`] now.
    pub memory_bytes: usize,
    /// The most bytes counted at any moment since the server started.
    pub peak_memory_bytes: usize,
    /// The budget ([`ServerOptions::max_memory_bytes`]).
    pub memory_budget: usize,
    /// Connections open.
    pub connections: usize,
    /// Connections cut to keep the server within its budget.
    pub cut_over_budget: u64,
    /// Requests handled since the server started.
    pub requests: u64,
}

/// The event loop's counters, read by [`TcpStoreServer::stats`].
#[derive(Default)]
pub(super) struct StatsCell {
    pub(super) memory: AtomicUsize,
    pub(super) peak: AtomicUsize,
    pub(super) connections: AtomicUsize,
    pub(super) cut: AtomicU64,
    pub(super) requests: AtomicU64,
}

impl std::fmt::Debug for StatsCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsCell")
    }
}
