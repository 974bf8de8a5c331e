//! [`TcpStoreServer`]: a TCPStore server that PyTorch clients and chorus
//! clients talk to, safe against hostile input.
//!
//! One thread runs an event loop over `poll(2)` with non-blocking sockets,
//! like PyTorch's libuv server, so a slow or silent client never blocks the
//! others: nothing in the loop waits on one connection. Each connection has
//! an input buffer (decoded with [`decode_request`] only once it holds the
//! bytes the decoder asked for) and an output buffer; a connection whose
//! output backs up stops being read until its client reads its answers.
//! A malformed or oversized request, a first request that is not `VALIDATE`
//! with the magic number, or a client that does not validate within the
//! handshake timeout closes *that* connection, with the reason sent to the
//! log callback; the store and the other connections carry on.
//!
//! Waits are answered when the awaited keys are set: a `WAIT` registers the
//! connection under each missing key, and a change to a key sends
//! `STOP_WAITING` to every connection whose last awaited key it was.
//!
//! Memory has one budget ([`ServerOptions::max_memory_bytes`]) that counts
//! everything clients make the server hold: stored keys and values, queue
//! elements, awaited keys (each with a fixed per-entry overhead), and every
//! connection's buffers (an unfinished request, unsent answers). Before it
//! has validated, a connection may hold at most [`UNVALIDATED_INPUT`] bytes,
//! and its first byte must be `VALIDATE`'s. When growth would exceed the
//! budget, the connection holding the most buffered bytes is cut (with a
//! log line) until it fits; if only stored data fills the budget, the
//! request that would add more closes its connection. So a hostile client
//! (an endless multi-set, answers it never reads) loses its connection and
//! the well-behaved ones, whose buffers are small, keep being served.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::protocol::{
    decode_request, put_bytes, Decoded, Limits, QueryType, Request, CHECK_NOT_READY, CHECK_READY, STOP_WAITING,
    VALIDATION_MAGIC, WAIT_CANCELED,
};
use crate::bootstrap::store::{add_outcome, compare_set_outcome, parse_counter};
use crate::{CommError, Result, StoreFailure};

/// Where the server reports why it closed a connection (one line each).
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// A connection's output above this many bytes stops its input being read.
const OUTPUT_HIGH_WATER: usize = 1 << 20;
/// At most this much is read from one connection per loop turn, so a fast
/// sender cannot starve the others.
const READ_PER_TURN: usize = 1 << 20;
/// One read from a socket.
const READ_CHUNK: usize = 64 * 1024;
/// Most bytes a connection may buffer before it has sent `VALIDATE` (5
/// bytes; PyTorch's client follows it with a 5-byte `PING`).
pub const UNVALIDATED_INPUT: usize = 4096;
/// What a stored key, queue element or awaited key costs beyond its bytes
/// (map entry, vector header), in the budget.
pub const ENTRY_OVERHEAD: usize = 64;
/// A connection's buffers above this capacity are freed once empty.
const KEEP_BUFFER: usize = 64 * 1024;

/// How a [`TcpStoreServer`] bounds what clients can make it do.
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

/// What a [`TcpStoreServer`] holds now (see [`TcpStoreServer::stats`]).
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
struct StatsCell {
    memory: AtomicUsize,
    peak: AtomicUsize,
    connections: AtomicUsize,
    cut: AtomicU64,
    requests: AtomicU64,
}

/// A running TCPStore server. Dropping it (or [`TcpStoreServer::shutdown`])
/// stops the loop and closes every connection.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    waker: UnixStream,
    thread: Option<JoinHandle<()>>,
    stats: Arc<StatsCell>,
    budget: usize,
}

impl std::fmt::Debug for StatsCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsCell")
    }
}

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port: see
    /// [`TcpStoreServer::local_addr`]) and starts serving. Fails with
    /// [`StoreFailure::AddressInUse`] when the address is taken, and
    /// [`StoreFailure::Io`] for other socket errors.
    pub fn bind(addr: SocketAddr, options: ServerOptions) -> Result<TcpStoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            let failure = if e.kind() == ErrorKind::AddrInUse { StoreFailure::AddressInUse } else { StoreFailure::Io };
            CommError::store(addr.to_string(), failure, format!("cannot listen: {e}"))
        })?;
        let io = |what: &str, e: std::io::Error| {
            CommError::store(addr.to_string(), StoreFailure::Io, format!("{what}: {e}"))
        };
        let local_addr = listener.local_addr().map_err(|e| io("no local address", e))?;
        listener.set_nonblocking(true).map_err(|e| io("cannot make the socket non-blocking", e))?;
        let (waker, wake_rx) = UnixStream::pair().map_err(|e| io("cannot create the wake-up pipe", e))?;
        wake_rx.set_nonblocking(true).map_err(|e| io("cannot make the wake-up pipe non-blocking", e))?;
        let stopping = Arc::new(AtomicBool::new(false));
        let log: LogFn = options.log.clone().unwrap_or_else(|| {
            let addr = local_addr;
            Arc::new(move |line: &str| eprintln!("chorus store server {addr}: {line}"))
        });
        let stats = Arc::new(StatsCell::default());
        let budget = options.max_memory_bytes;
        let mut event_loop = EventLoop {
            listener,
            wake_rx,
            stopping: stopping.clone(),
            options,
            log,
            conns: BTreeMap::new(),
            next_id: 0,
            state: State::default(),
            buffered: 0,
            stats: stats.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("store-server-{}", local_addr.port()))
            .spawn(move || event_loop.run())
            .map_err(|e| io("cannot start the server thread", e))?;
        Ok(TcpStoreServer { local_addr, stopping, waker, thread: Some(thread), stats, budget })
    }

    /// Listens on `127.0.0.1:port` with default options.
    pub fn bind_loopback(port: u16) -> Result<TcpStoreServer> {
        TcpStoreServer::bind(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)), ServerOptions::default())
    }

    /// The address it listens on (with the port picked when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// What it holds now and at most so far, against its memory budget.
    pub fn stats(&self) -> ServerStats {
        ServerStats {
            memory_bytes: self.stats.memory.load(Ordering::Acquire),
            peak_memory_bytes: self.stats.peak.load(Ordering::Acquire),
            memory_budget: self.budget,
            connections: self.stats.connections.load(Ordering::Acquire),
            cut_over_budget: self.stats.cut.load(Ordering::Acquire),
            requests: self.stats.requests.load(Ordering::Acquire),
        }
    }

    /// Stops serving and closes every connection (what dropping does).
    pub fn shutdown(self) {}
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // The loop polls the other end; a failed write means it already ended.
        let _ = self.waker.write_all(&[1]);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One client connection.
struct Conn {
    stream: TcpStream,
    peer: String,
    input: Vec<u8>,
    /// Decode again only once `input` holds this many bytes.
    needed: usize,
    output: Vec<u8>,
    written: usize,
    validated: bool,
    opened: Instant,
    /// The peer closed its side: answer what it sent, then close.
    eof: bool,
    /// Why it must close, when it must (logged), or `Some("")` for a quiet close.
    close: Option<String>,
    /// The capacity of its buffers as last counted in [`EventLoop::buffered`].
    accounted: usize,
}

impl Conn {
    fn pending_output(&self) -> usize {
        self.output.len() - self.written
    }

    /// Whether to read more input from the socket: not past the
    /// pre-validation allowance (the buffered bytes are decoded first).
    fn wants_read(&self) -> bool {
        !self.eof && self.wants_requests() && (self.validated || self.input.len() < UNVALIDATED_INPUT)
    }

    /// Whether to decode more of the input: not while answers back up,
    /// except after the peer closed (what it sent still counts: a `SET`
    /// followed by a close must be applied).
    fn wants_requests(&self) -> bool {
        self.close.is_none() && (self.eof || self.pending_output() < OUTPUT_HIGH_WATER)
    }
}

/// The capacity `v` gets to take `n` more bytes: its own when they fit,
/// else doubled (amortised growth, at most to `soft_max` unless the bytes
/// need more), so a buffer or value that grows by pieces is copied O(log n)
/// times, not once per piece.
fn grown_capacity(v: &Vec<u8>, n: usize, soft_max: usize) -> usize {
    if v.capacity() - v.len() >= n {
        v.capacity()
    } else {
        (v.len() + n).max(v.capacity().saturating_mul(2).min(soft_max))
    }
}

/// Grows `v` to `target` capacity (from [`grown_capacity`]) and appends `bytes`.
fn extend_to(v: &mut Vec<u8>, target: usize, bytes: &[u8]) {
    if v.capacity() < target {
        v.reserve_exact(target - v.len());
    }
    v.extend_from_slice(bytes);
}

/// What a stored key and value cost in the budget.
fn entry_cost(key: &[u8], value: &Vec<u8>) -> usize {
    key.len() + value.capacity() + ENTRY_OVERHEAD
}

/// What waiting for `keys` costs: each key is held twice (by key, by connection).
fn wait_cost(keys: &[Vec<u8>]) -> usize {
    keys.iter().map(|k| 2 * (k.len() + ENTRY_OVERHEAD)).sum()
}

/// The keys, values, queues and waiting connections, and what they cost.
#[derive(Default)]
struct State {
    data: HashMap<Vec<u8>, Vec<u8>>,
    /// Queues; a queue that empties is removed.
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Key -> connections waiting for it.
    waiters: HashMap<Vec<u8>, Vec<u64>>,
    /// Connection -> (keys still awaited, the keys it is registered under).
    awaiting: HashMap<u64, (usize, Vec<Vec<u8>>)>,
    /// The budget's share of all of the above.
    bytes: usize,
}

impl State {
    fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// The budget `put(key, value)` adds (0 when it shrinks the entry).
    fn put_cost(&self, key: &[u8], value: &Vec<u8>) -> usize {
        let old = self.data.get(key).map_or(0, |v| entry_cost(key, v));
        entry_cost(key, value).saturating_sub(old)
    }

    /// Stores `value` under `key` (its cost checked by the caller).
    fn put(&mut self, key: &[u8], value: Vec<u8>) {
        self.bytes += entry_cost(key, &value);
        if let Some(old) = self.data.insert(key.to_vec(), value) {
            self.bytes -= entry_cost(key, &old);
        }
    }

    /// The budget appending `n` bytes to `key` adds.
    fn append_cost(&self, key: &[u8], n: usize) -> usize {
        match self.data.get(key) {
            Some(v) => grown_capacity(v, n, usize::MAX) - v.capacity(),
            None => key.len() + n + ENTRY_OVERHEAD,
        }
    }

    /// Appends in place, growing the value by doubling: linear in the bytes
    /// appended overall, where copying the value each time was quadratic.
    fn append(&mut self, key: &[u8], bytes: &[u8]) {
        match self.data.get_mut(key) {
            Some(v) => {
                let before = v.capacity();
                extend_to(v, grown_capacity(v, bytes.len(), usize::MAX), bytes);
                self.bytes += v.capacity() - before;
            }
            None => self.put(key, bytes.to_vec()),
        }
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        match self.data.remove(key) {
            Some(v) => {
                self.bytes -= entry_cost(key, &v);
                true
            }
            None => false,
        }
    }

    /// The budget pushing `value` to queue `key` adds.
    fn push_cost(&self, key: &[u8], value: &Vec<u8>) -> usize {
        let new_queue = if self.queues.contains_key(key) { 0 } else { key.len() + ENTRY_OVERHEAD };
        new_queue + value.capacity() + ENTRY_OVERHEAD
    }

    fn push(&mut self, key: &[u8], value: Vec<u8>) {
        self.bytes += self.push_cost(key, &value);
        self.queues.entry(key.to_vec()).or_default().push_back(value);
    }

    /// The queue's length before the pop and the element popped; a queue
    /// left empty is removed (a pop of an absent queue creates nothing).
    fn pop(&mut self, key: &[u8]) -> (usize, Option<Vec<u8>>) {
        let Some(queue) = self.queues.get_mut(key) else { return (0, None) };
        let len = queue.len();
        let value = queue.pop_front();
        if let Some(v) = &value {
            self.bytes -= v.capacity() + ENTRY_OVERHEAD;
        }
        if queue.is_empty() {
            self.queues.remove(key);
            self.bytes -= key.len() + ENTRY_OVERHEAD;
        }
        (len, value)
    }

    fn register_wait(&mut self, conn: u64, keys: Vec<Vec<u8>>) {
        self.clear_wait(conn);
        for k in &keys {
            self.waiters.entry(k.clone()).or_default().push(conn);
        }
        self.bytes += wait_cost(&keys);
        self.awaiting.insert(conn, (keys.len(), keys));
    }

    /// Forgets `conn`'s wait, refunding what its registration cost.
    fn forget_wait(&mut self, conn: u64) -> Option<Vec<Vec<u8>>> {
        let (_, keys) = self.awaiting.remove(&conn)?;
        self.bytes -= wait_cost(&keys);
        Some(keys)
    }

    fn clear_wait(&mut self, conn: u64) {
        if let Some(keys) = self.forget_wait(conn) {
            for k in keys {
                if let Some(list) = self.waiters.get_mut(&k) {
                    list.retain(|&c| c != conn);
                    if list.is_empty() {
                        self.waiters.remove(&k);
                    }
                }
            }
        }
    }

    /// Counts `key` as arrived for one waiting connection; true when that
    /// was its last awaited key.
    fn arrived(&mut self, conn: u64) -> bool {
        match self.awaiting.get_mut(&conn) {
            Some((remaining, _)) => {
                *remaining = remaining.saturating_sub(1);
                if *remaining == 0 {
                    self.forget_wait(conn);
                    true
                } else {
                    false
                }
            }
            None => false,
        }
    }

    /// `key` is set: every connection waiting for it has one key fewer to wait for.
    fn wake_all(&mut self, key: &[u8], woken: &mut Vec<u64>) {
        if let Some(conns) = self.waiters.remove(key) {
            for conn in conns {
                if self.arrived(conn) {
                    woken.push(conn);
                }
            }
        }
    }

    /// An element was pushed to queue `key`: one waiting connection may take it.
    fn wake_one(&mut self, key: &[u8], woken: &mut Vec<u64>) {
        let Some(list) = self.waiters.get_mut(key) else { return };
        if list.is_empty() {
            return;
        }
        let conn = list.remove(0);
        if list.is_empty() {
            self.waiters.remove(key);
        }
        if self.arrived(conn) {
            woken.push(conn);
        }
    }
}

/// Why a connection's first request cannot be `VALIDATE`, judged from its
/// first byte (so nothing more of it is buffered).
fn refused_first_byte(b: u8) -> Option<String> {
    match QueryType::from_byte(b) {
        Some(QueryType::Validate) => None,
        Some(other) => Some(format!("the first request must be VALIDATE, not {}", other.name())),
        None => Some(format!("malformed request: unknown request type {b}")),
    }
}

struct EventLoop {
    listener: TcpListener,
    wake_rx: UnixStream,
    stopping: Arc<AtomicBool>,
    options: ServerOptions,
    log: LogFn,
    conns: BTreeMap<u64, Conn>,
    next_id: u64,
    state: State,
    /// The sum of the connections' `accounted`.
    buffered: usize,
    stats: Arc<StatsCell>,
}

impl EventLoop {
    fn run(&mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut ids: Vec<u64> = Vec::new();
        while !self.stopping.load(Ordering::Acquire) {
            fds.clear();
            ids.clear();
            fds.push(libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            fds.push(libc::pollfd { fd: self.wake_rx.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            for (&id, conn) in &self.conns {
                let mut events = 0;
                if conn.wants_read() {
                    events |= libc::POLLIN;
                }
                if conn.pending_output() > 0 {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd { fd: conn.stream.as_raw_fd(), events, revents: 0 });
                ids.push(id);
            }
            let timeout_ms = self.poll_timeout().as_millis().clamp(1, 1000) as libc::c_int;
            // SAFETY: `fds` is a valid, initialized array of `fds.len()`
            // pollfd structs that stays alive and unaliased during the call;
            // every fd in it is owned by a socket held in `self`.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if ready < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != ErrorKind::Interrupted {
                    (self.log)(&format!("poll failed: {e}"));
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            if fds[1].revents != 0 {
                let mut sink = [0u8; 64];
                while matches!(self.wake_rx.read(&mut sink), Ok(n) if n > 0) {}
            }
            if fds[0].revents != 0 {
                self.accept();
            }
            for (i, &id) in ids.iter().enumerate() {
                let revents = fds[i + 2].revents;
                if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.read_from(id);
                }
            }
            self.process_all();
            self.flush_all();
            for conn in self.conns.values_mut() {
                if conn.eof && conn.close.is_none() {
                    // Everything it sent was processed above; unsent answers have no reader.
                    conn.close = Some(String::new());
                }
            }
            self.expire_handshakes();
            self.close_marked();
        }
    }

    /// Until the next handshake deadline (at most a second, to notice shutdown).
    fn poll_timeout(&self) -> Duration {
        let now = Instant::now();
        self.conns
            .values()
            .filter(|c| !c.validated)
            .map(|c| (c.opened + self.options.handshake_timeout).saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1))
    }

    /// Bytes counted against the budget.
    fn used(&self) -> usize {
        self.state.bytes + self.buffered
    }

    /// Publishes the counters (after every change that can add to them).
    fn note(&self) {
        let used = self.used();
        self.stats.memory.store(used, Ordering::Release);
        self.stats.peak.fetch_max(used, Ordering::AcqRel);
        self.stats.connections.store(self.conns.len(), Ordering::Release);
    }

    /// Counts connection `id`'s buffers as they are now.
    fn sync(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            let now = c.input.capacity() + c.output.capacity();
            self.buffered = self.buffered - c.accounted + now;
            c.accounted = now;
        }
        self.note();
    }

    /// Closes connection `id` now, with `reason`, and frees its buffers.
    fn cut(&mut self, id: u64, reason: String) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.input = Vec::new();
            c.output = Vec::new();
            c.written = 0;
            if c.close.is_none() {
                c.close = Some(reason);
                self.stats.cut.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.sync(id);
    }

    /// Makes room for `extra` more bytes on behalf of connection
    /// `requester`: while they would not fit the budget, the connection
    /// holding the most buffered bytes is cut. `Err` when that is the
    /// requester itself, or when no connection holds any (stored data
    /// fills the budget): the requester must then be closed.
    fn make_room(&mut self, requester: u64, extra: usize) -> std::result::Result<(), String> {
        let budget = self.options.max_memory_bytes;
        // What cutting every other connection could make room for at most:
        // when that is not enough, cut nobody else.
        let own = self.conns.get(&requester).map_or(0, |c| c.accounted);
        if self.state.bytes.saturating_add(own).saturating_add(extra) > budget {
            return Err(format!(
                "the memory budget is full ({} bytes held, {extra} more needed; the limit is {budget}): \
                 {} bytes of stored data and this connection's {own} leave no room",
                self.used(),
                self.state.bytes
            ));
        }
        while self.used().saturating_add(extra) > budget {
            let largest = self
                .conns
                .iter()
                .filter(|(_, c)| c.accounted > 0)
                .max_by_key(|(_, c)| c.accounted)
                .map(|(&id, c)| (id, c.accounted));
            let over = format!(
                "the memory budget is full ({} bytes held, {extra} more needed; the limit is {budget})",
                self.used()
            );
            match largest {
                Some((victim, held)) if victim != requester => {
                    self.cut(victim, format!("{over}: this connection held the most, {held} bytes of unfinished requests and unsent answers"));
                }
                Some((_, held)) => return Err(format!("{over}: this connection holds the most, {held} bytes")),
                None => return Err(format!("{over}: {} bytes of it are stored data", self.state.bytes)),
            }
        }
        Ok(())
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if self.conns.len() >= self.options.max_connections {
                        (self.log)(&format!(
                            "refusing connection from {peer}: {} connections are open (the limit)",
                            self.conns.len()
                        ));
                        continue;
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        (self.log)(&format!("dropping connection from {peer}: cannot make it non-blocking: {e}"));
                        continue;
                    }
                    // Answers are small; without this each waits for the peer's delayed ACK.
                    let _ = stream.set_nodelay(true);
                    let id = self.next_id;
                    self.next_id += 1;
                    self.conns.insert(
                        id,
                        Conn {
                            stream,
                            peer: peer.to_string(),
                            input: Vec::new(),
                            needed: 1,
                            output: Vec::new(),
                            written: 0,
                            validated: false,
                            opened: Instant::now(),
                            eof: false,
                            close: None,
                            accounted: 0,
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of file descriptors, say: keep serving the open connections.
                    (self.log)(&format!("accept failed: {e}"));
                    break;
                }
            }
        }
        self.note();
    }

    /// Reads what connection `id` sent (at most [`READ_PER_TURN`], and
    /// before validation at most [`UNVALIDATED_INPUT`] buffered), each
    /// chunk kept only when the budget has room for it.
    fn read_from(&mut self, id: u64) {
        let mut chunk = vec![0u8; READ_CHUNK];
        let mut read = 0;
        // The buffer doubles up to a whole request and a turn's reading.
        let soft_max = self.options.limits.max_request_len.saturating_add(READ_PER_TURN);
        loop {
            let Some(conn) = self.conns.get_mut(&id) else { return };
            if !conn.wants_read() || read >= READ_PER_TURN {
                return;
            }
            let want = if conn.validated { READ_CHUNK } else { UNVALIDATED_INPUT - conn.input.len() };
            let n = match conn.stream.read(&mut chunk[..want.min(READ_CHUNK)]) {
                Ok(0) => {
                    conn.eof = true;
                    return;
                }
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    // Reset by the peer: nothing to report.
                    conn.close = Some(String::new());
                    return;
                }
            };
            let target = grown_capacity(&conn.input, n, soft_max);
            let extra = target - conn.input.capacity();
            if let Err(reason) = self.make_room(id, extra) {
                self.cut(id, reason);
                return;
            }
            let Some(conn) = self.conns.get_mut(&id) else { return };
            extend_to(&mut conn.input, target, &chunk[..n]);
            read += n;
            self.sync(id);
        }
    }

    fn process_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.process(id);
        }
    }

    /// Decodes and answers the whole requests in a connection's input.
    fn process(&mut self, id: u64) {
        let mut consumed = 0;
        loop {
            let Some(conn) = self.conns.get_mut(&id) else { return };
            if !conn.wants_requests() || conn.input.len() < consumed + conn.needed {
                break;
            }
            if !conn.validated {
                if let Some(reason) = refused_first_byte(conn.input[consumed]) {
                    conn.close = Some(reason);
                    break;
                }
            }
            match decode_request(&conn.input[consumed..], &self.options.limits) {
                Decoded::Incomplete { needed } => {
                    conn.needed = needed;
                    break;
                }
                Decoded::Invalid(e) => {
                    conn.close = Some(format!("malformed request: {e}"));
                    break;
                }
                Decoded::Request { request, len } => {
                    consumed += len;
                    conn.needed = 1;
                    self.stats.requests.fetch_add(1, Ordering::Relaxed);
                    let mut woken = Vec::new();
                    match self.handle(id, request, &mut woken) {
                        Ok(bytes) => self.answer(id, &bytes),
                        Err(reason) => {
                            if let Some(conn) = self.conns.get_mut(&id) {
                                conn.close.get_or_insert(reason);
                            }
                        }
                    }
                    for w in woken {
                        self.answer(w, &[STOP_WAITING]);
                    }
                }
            }
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.input.drain(..consumed.min(conn.input.len()));
            if conn.input.is_empty() && conn.input.capacity() > KEEP_BUFFER {
                conn.input = Vec::new();
            }
        }
        self.sync(id);
    }

    /// Queues `bytes` to connection `id`, within the budget (or cuts it).
    fn answer(&mut self, id: u64, bytes: &[u8]) {
        let Some(conn) = self.conns.get(&id) else { return };
        if bytes.is_empty() || conn.close.is_some() {
            return;
        }
        let target = grown_capacity(&conn.output, bytes.len(), usize::MAX);
        let extra = target - conn.output.capacity();
        if let Err(reason) = self.make_room(id, extra) {
            self.cut(id, reason);
            return;
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            extend_to(&mut conn.output, target, bytes);
        }
        self.sync(id);
    }

    /// Stores `value` under `key` for connection `id`, within the budget.
    fn put(&mut self, id: u64, key: &[u8], value: Vec<u8>) -> std::result::Result<(), String> {
        self.make_room(id, self.state.put_cost(key, &value))?;
        self.state.put(key, value);
        Ok(())
    }

    /// Applies one request; the answer's bytes, or why the connection must close.
    fn handle(&mut self, id: u64, request: Request, woken: &mut Vec<u64>) -> std::result::Result<Vec<u8>, String> {
        let Some(conn) = self.conns.get_mut(&id) else { return Ok(Vec::new()) };
        if !conn.validated {
            return match request {
                Request::Validate { magic } if magic == VALIDATION_MAGIC => {
                    conn.validated = true;
                    Ok(Vec::new())
                }
                Request::Validate { magic } => {
                    Err(format!("bad validation number {magic:#x} (expected {VALIDATION_MAGIC:#x})"))
                }
                other => Err(format!("the first request must be VALIDATE, not {}", other.query_type().name())),
            };
        }
        let max_answer = self.options.limits.max_request_len;
        let mut out = Vec::new();
        match request {
            Request::Validate { .. } => return Err("VALIDATE sent twice".into()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value } => {
                self.put(id, &key, value)?;
                self.state.wake_all(&key, woken);
            }
            Request::CompareSet { key, expected, desired } => {
                let current = self.state.data.get(&key).map(Vec::as_slice);
                let (store, answer) = compare_set_outcome(current, &expected, &desired);
                if let Some(v) = store {
                    self.put(id, &key, v)?;
                    // PyTorch's server also wakes waiters when nothing was stored;
                    // waking only on a stored value keeps "woken" meaning "set".
                    self.state.wake_all(&key, woken);
                }
                put_bytes(&mut out, &answer);
            }
            Request::Get { key } => put_bytes(&mut out, self.state.data.get(&key).map_or(&[][..], Vec::as_slice)),
            Request::Add { key, delta } => {
                // PyTorch's server closes the connection here too (std::stoll throws).
                let sum = add_outcome(self.state.data.get(&key).map(Vec::as_slice), delta)
                    .map_err(|e| format!("add {}: {e}", String::from_utf8_lossy(&key)))?;
                self.put(id, &key, sum.to_string().into_bytes())?;
                self.state.wake_all(&key, woken);
                out.extend_from_slice(&sum.to_le_bytes());
            }
            Request::Check { keys } => {
                let ready = keys.iter().all(|k| self.state.present(k));
                out.push(if ready { CHECK_READY } else { CHECK_NOT_READY })
            }
            Request::Wait { keys } => {
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.state.present(k)).collect();
                if missing.is_empty() {
                    out.push(STOP_WAITING);
                } else {
                    self.make_room(id, wait_cost(&missing))?;
                    self.state.register_wait(id, missing);
                }
            }
            Request::GetNumKeys => out.extend_from_slice(&(self.state.data.len() as i64).to_le_bytes()),
            Request::DeleteKey { key } => out.extend_from_slice(&i64::from(self.state.remove(&key)).to_le_bytes()),
            Request::Append { key, value } => {
                self.make_room(id, self.state.append_cost(&key, value.len()))?;
                self.state.append(&key, &value);
                self.state.wake_all(&key, woken);
            }
            Request::MultiGet { keys } => {
                for k in &keys {
                    put_bytes(&mut out, self.state.data.get(k).map_or(&[][..], Vec::as_slice));
                    if out.len() > max_answer {
                        return Err(format!("multi_get answer over {max_answer} bytes"));
                    }
                }
            }
            Request::MultiSet { entries } => {
                for (k, v) in entries {
                    self.put(id, &k, v)?;
                    self.state.wake_all(&k, woken);
                }
            }
            Request::CancelWait => {
                self.state.clear_wait(id);
                out.push(WAIT_CANCELED);
            }
            Request::QueuePush { key, value } => {
                self.make_room(id, self.state.push_cost(&key, &value))?;
                self.state.push(&key, value);
                self.state.wake_one(&key, woken);
            }
            Request::QueuePop { key } => {
                let (len, value) = self.state.pop(&key);
                out.extend_from_slice(&(len as i64).to_le_bytes());
                if let Some(v) = value {
                    put_bytes(&mut out, &v);
                }
            }
            Request::QueueLen { key } => {
                out.extend_from_slice(&(self.state.queues.get(&key).map_or(0, VecDeque::len) as i64).to_le_bytes())
            }
            Request::ListKeys => {
                out.extend_from_slice(&(self.state.data.len() as i64).to_le_bytes());
                for k in self.state.data.keys() {
                    put_bytes(&mut out, k);
                    if out.len() > max_answer {
                        return Err(format!("list_keys answer over {max_answer} bytes"));
                    }
                }
            }
            Request::Barrier { key, world_size } => {
                let arrived = match self.state.data.get(&key) {
                    None => 1,
                    Some(v) => parse_counter(v).and_then(|n| n.checked_add(1)).ok_or_else(|| {
                        format!("barrier {}: the counter is not an integer", String::from_utf8_lossy(&key))
                    })?,
                };
                self.put(id, &key, arrived.to_string().into_bytes())?;
                if arrived >= world_size {
                    self.state.wake_all(&key, woken);
                    out.push(STOP_WAITING);
                } else {
                    let keys = vec![key];
                    self.make_room(id, wait_cost(&keys))?;
                    self.state.register_wait(id, keys);
                }
            }
        }
        self.note();
        Ok(out)
    }

    fn flush_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            let Some(conn) = self.conns.get_mut(&id) else { continue };
            while conn.close.is_none() && conn.pending_output() > 0 {
                match conn.stream.write(&conn.output[conn.written..]) {
                    Ok(0) => conn.close = Some(String::new()),
                    Ok(n) => conn.written += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => conn.close = Some(String::new()),
                }
            }
            if conn.pending_output() == 0 {
                conn.output.clear();
                conn.written = 0;
                if conn.output.capacity() > KEEP_BUFFER {
                    conn.output = Vec::new();
                }
                self.sync(id);
            }
        }
    }

    fn expire_handshakes(&mut self) {
        let limit = self.options.handshake_timeout;
        for conn in self.conns.values_mut() {
            if !conn.validated && conn.close.is_none() && conn.opened.elapsed() >= limit {
                conn.close = Some(format!("no VALIDATE within {limit:?}"));
            }
        }
    }

    fn close_marked(&mut self) {
        let closing: Vec<u64> = self.conns.iter().filter(|(_, c)| c.close.is_some()).map(|(&id, _)| id).collect();
        for id in closing {
            if let Some(conn) = self.conns.remove(&id) {
                self.buffered -= conn.accounted;
                self.state.clear_wait(id);
                if let Some(reason) = conn.close.filter(|r| !r.is_empty()) {
                    (self.log)(&format!("closing connection from {}: {reason}", conn.peer));
                }
            }
        }
        self.note();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_grows_in_place_by_doubling() {
        let mut st = State::default();
        let mut moves = 0;
        let mut last = std::ptr::null();
        for i in 0..10_000u32 {
            st.append(b"k", &i.to_le_bytes());
            let v = &st.data[&b"k"[..]];
            if v.as_ptr() != last {
                moves += 1;
                last = v.as_ptr();
            }
        }
        let v = &st.data[&b"k"[..]];
        assert_eq!(v.len(), 40_000);
        assert_eq!(&v[4 * 9_999..], &9_999u32.to_le_bytes());
        // Copying the value on every append moved it 10 000 times.
        assert!(moves <= 20, "the value moved {moves} times");
        assert_eq!(st.bytes, 1 + v.capacity() + ENTRY_OVERHEAD);
        assert!(v.capacity() < 2 * v.len());
    }

    #[test]
    fn a_pop_leaves_no_empty_queue_and_the_budget_returns_to_zero() {
        let mut st = State::default();
        assert_eq!(st.pop(b"q"), (0, None));
        assert!(st.queues.is_empty(), "a pop of an absent queue created it");
        st.push(b"q", b"ab".to_vec());
        st.push(b"q", b"c".to_vec());
        assert_eq!(st.pop(b"q"), (2, Some(b"ab".to_vec())));
        assert_eq!(st.pop(b"q"), (1, Some(b"c".to_vec())));
        assert!(st.queues.is_empty());
        st.register_wait(7, vec![b"x".to_vec(), b"y".to_vec()]);
        st.put(b"x", b"1".to_vec());
        let mut woken = Vec::new();
        st.wake_all(b"x", &mut woken);
        st.wake_all(b"y", &mut woken);
        assert_eq!(woken, vec![7]);
        assert!(st.remove(b"x"));
        assert_eq!(st.bytes, 0);
    }
}
