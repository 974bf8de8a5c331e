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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::protocol::{
    decode_request, put_bytes, Decoded, Limits, Request, CHECK_NOT_READY, CHECK_READY, STOP_WAITING, VALIDATION_MAGIC,
    WAIT_CANCELED,
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
    /// Most bytes of keys and values the store holds; a request that would
    /// exceed it closes its connection (1 GiB).
    pub max_store_bytes: usize,
    /// Where the reasons for closed connections go (stderr when `None`).
    pub log: Option<LogFn>,
}

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            limits: Limits::default(),
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(30),
            max_store_bytes: 1 << 30,
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
            .field("max_store_bytes", &self.max_store_bytes)
            .field("log", &self.log.as_ref().map(|_| "callback"))
            .finish()
    }
}

/// A running TCPStore server. Dropping it (or [`TcpStoreServer::shutdown`])
/// stops the loop and closes every connection.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    waker: UnixStream,
    thread: Option<JoinHandle<()>>,
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
        let mut event_loop = EventLoop {
            listener,
            wake_rx,
            stopping: stopping.clone(),
            options,
            log,
            conns: BTreeMap::new(),
            next_id: 0,
            state: State::default(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("store-server-{}", local_addr.port()))
            .spawn(move || event_loop.run())
            .map_err(|e| io("cannot start the server thread", e))?;
        Ok(TcpStoreServer { local_addr, stopping, waker, thread: Some(thread) })
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
}

impl Conn {
    fn pending_output(&self) -> usize {
        self.output.len() - self.written
    }

    /// Whether to read more input from the socket.
    fn wants_read(&self) -> bool {
        !self.eof && self.wants_requests()
    }

    /// Whether to decode more of the input: not while answers back up,
    /// except after the peer closed (what it sent still counts: a `SET`
    /// followed by a close must be applied).
    fn wants_requests(&self) -> bool {
        self.close.is_none() && (self.eof || self.pending_output() < OUTPUT_HIGH_WATER)
    }
}

/// The keys, values, queues and waiting connections.
#[derive(Default)]
struct State {
    data: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Key -> connections waiting for it.
    waiters: HashMap<Vec<u8>, Vec<u64>>,
    /// Connection -> (keys still awaited, the keys it is registered under).
    awaiting: HashMap<u64, (usize, Vec<Vec<u8>>)>,
    bytes: usize,
}

impl State {
    fn present(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Stores `value` under `key` within the byte budget.
    fn put(&mut self, key: &[u8], value: Vec<u8>, max_bytes: usize) -> std::result::Result<(), String> {
        let old = self.data.get(key).map_or(0, |v| key.len() + v.len());
        let new_total = self.bytes - old + key.len() + value.len();
        if new_total > max_bytes {
            return Err(format!("the store would hold {new_total} bytes (the limit is {max_bytes})"));
        }
        self.bytes = new_total;
        self.data.insert(key.to_vec(), value);
        Ok(())
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        match self.data.remove(key) {
            Some(v) => {
                self.bytes -= key.len() + v.len();
                true
            }
            None => false,
        }
    }

    fn register_wait(&mut self, conn: u64, keys: Vec<Vec<u8>>) {
        self.clear_wait(conn);
        for k in &keys {
            self.waiters.entry(k.clone()).or_default().push(conn);
        }
        self.awaiting.insert(conn, (keys.len(), keys));
    }

    fn clear_wait(&mut self, conn: u64) {
        if let Some((_, keys)) = self.awaiting.remove(&conn) {
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
                    self.awaiting.remove(&conn);
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

struct EventLoop {
    listener: TcpListener,
    wake_rx: UnixStream,
    stopping: Arc<AtomicBool>,
    options: ServerOptions,
    log: LogFn,
    conns: BTreeMap<u64, Conn>,
    next_id: u64,
    state: State,
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
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of file descriptors, say: keep serving the open connections.
                    (self.log)(&format!("accept failed: {e}"));
                    return;
                }
            }
        }
    }

    fn read_from(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else { return };
        let mut chunk = [0u8; 64 * 1024];
        let mut read = 0;
        while conn.wants_read() && read < READ_PER_TURN {
            match conn.stream.read(&mut chunk) {
                Ok(0) => {
                    conn.eof = true;
                    return;
                }
                Ok(n) => {
                    conn.input.extend_from_slice(&chunk[..n]);
                    read += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    // Reset by the peer: nothing to report.
                    conn.close = Some(String::new());
                    return;
                }
            }
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
                    let mut woken = Vec::new();
                    let answered = self.handle(id, request, &mut woken);
                    if let Some(conn) = self.conns.get_mut(&id) {
                        match answered {
                            Ok(bytes) => conn.output.extend_from_slice(&bytes),
                            Err(reason) => conn.close = Some(reason),
                        }
                    }
                    for w in woken {
                        if let Some(c) = self.conns.get_mut(&w) {
                            c.output.push(STOP_WAITING);
                        }
                    }
                }
            }
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.input.drain(..consumed.min(conn.input.len()));
        }
    }

    /// Applies one request; the answer's bytes, or why the connection must close.
    fn handle(&mut self, id: u64, request: Request, woken: &mut Vec<u64>) -> std::result::Result<Vec<u8>, String> {
        let Some(conn) = self.conns.get_mut(&id) else { return Ok(Vec::new()) };
        let max_bytes = self.options.max_store_bytes;
        let max_answer = self.options.limits.max_request_len;
        let st = &mut self.state;
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
        let mut out = Vec::new();
        match request {
            Request::Validate { .. } => return Err("VALIDATE sent twice".into()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value } => {
                st.put(&key, value, max_bytes)?;
                st.wake_all(&key, woken);
            }
            Request::CompareSet { key, expected, desired } => {
                let (store, answer) = compare_set_outcome(st.data.get(&key).map(Vec::as_slice), &expected, &desired);
                if let Some(v) = store {
                    st.put(&key, v, max_bytes)?;
                    // PyTorch's server also wakes waiters when nothing was stored;
                    // waking only on a stored value keeps "woken" meaning "set".
                    st.wake_all(&key, woken);
                }
                put_bytes(&mut out, &answer);
            }
            Request::Get { key } => put_bytes(&mut out, st.data.get(&key).map_or(&[][..], Vec::as_slice)),
            Request::Add { key, delta } => {
                // PyTorch's server closes the connection here too (std::stoll throws).
                let sum = add_outcome(st.data.get(&key).map(Vec::as_slice), delta)
                    .map_err(|e| format!("add {}: {e}", String::from_utf8_lossy(&key)))?;
                st.put(&key, sum.to_string().into_bytes(), max_bytes)?;
                st.wake_all(&key, woken);
                out.extend_from_slice(&sum.to_le_bytes());
            }
            Request::Check { keys } => {
                out.push(if keys.iter().all(|k| st.present(k)) { CHECK_READY } else { CHECK_NOT_READY })
            }
            Request::Wait { keys } => {
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !st.present(k)).collect();
                if missing.is_empty() {
                    out.push(STOP_WAITING);
                } else {
                    st.register_wait(id, missing);
                }
            }
            Request::GetNumKeys => out.extend_from_slice(&(st.data.len() as i64).to_le_bytes()),
            Request::DeleteKey { key } => out.extend_from_slice(&i64::from(st.remove(&key)).to_le_bytes()),
            Request::Append { key, value } => {
                let mut v = st.data.get(&key).cloned().unwrap_or_default();
                v.extend_from_slice(&value);
                st.put(&key, v, max_bytes)?;
                st.wake_all(&key, woken);
            }
            Request::MultiGet { keys } => {
                for k in &keys {
                    put_bytes(&mut out, st.data.get(k).map_or(&[][..], Vec::as_slice));
                    if out.len() > max_answer {
                        return Err(format!("multi_get answer over {max_answer} bytes"));
                    }
                }
            }
            Request::MultiSet { entries } => {
                for (k, v) in entries {
                    st.put(&k, v, max_bytes)?;
                    st.wake_all(&k, woken);
                }
            }
            Request::CancelWait => {
                st.clear_wait(id);
                out.push(WAIT_CANCELED);
            }
            Request::QueuePush { key, value } => {
                let total = st.bytes + value.len();
                if total > max_bytes {
                    return Err(format!("the store would hold {total} bytes (the limit is {max_bytes})"));
                }
                st.bytes = total;
                st.queues.entry(key.clone()).or_default().push_back(value);
                st.wake_one(&key, woken);
            }
            Request::QueuePop { key } => {
                let queue = st.queues.entry(key).or_default();
                out.extend_from_slice(&(queue.len() as i64).to_le_bytes());
                if let Some(v) = queue.pop_front() {
                    st.bytes -= v.len();
                    put_bytes(&mut out, &v);
                }
            }
            Request::QueueLen { key } => {
                out.extend_from_slice(&(st.queues.get(&key).map_or(0, VecDeque::len) as i64).to_le_bytes())
            }
            Request::ListKeys => {
                out.extend_from_slice(&(st.data.len() as i64).to_le_bytes());
                for k in st.data.keys() {
                    put_bytes(&mut out, k);
                    if out.len() > max_answer {
                        return Err(format!("list_keys answer over {max_answer} bytes"));
                    }
                }
            }
            Request::Barrier { key, world_size } => {
                let arrived = match st.data.get(&key) {
                    None => 1,
                    Some(v) => parse_counter(v).and_then(|n| n.checked_add(1)).ok_or_else(|| {
                        format!("barrier {}: the counter is not an integer", String::from_utf8_lossy(&key))
                    })?,
                };
                st.put(&key, arrived.to_string().into_bytes(), max_bytes)?;
                if arrived >= world_size {
                    st.wake_all(&key, woken);
                    out.push(STOP_WAITING);
                } else {
                    st.register_wait(id, vec![key]);
                }
            }
        }
        Ok(out)
    }

    fn flush_all(&mut self) {
        for conn in self.conns.values_mut() {
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
                self.state.clear_wait(id);
                if let Some(reason) = conn.close.filter(|r| !r.is_empty()) {
                    (self.log)(&format!("closing connection from {}: {reason}", conn.peer));
                }
            }
        }
    }
}
