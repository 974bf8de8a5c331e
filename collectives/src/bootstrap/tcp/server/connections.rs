//! The server's connections: the event loop over `poll(2)` that accepts,
//! reads, writes and closes them, and cuts the one holding the most
//! buffered bytes when the budget would be exceeded.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::protocol::QueryType;
use super::budget::{extend_to, grown_capacity, State};
use super::options::{
    LogFn, ServerOptions, StatsCell, KEEP_BUFFER, OUTPUT_HIGH_WATER, READ_CHUNK, READ_PER_TURN, UNVALIDATED_INPUT,
};

/// One client connection.
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) peer: String,
    pub(super) input: Vec<u8>,
    /// Decode again only once `input` holds this many bytes.
    pub(super) needed: usize,
    pub(super) output: Vec<u8>,
    pub(super) written: usize,
    pub(super) validated: bool,
    pub(super) opened: Instant,
    /// The peer closed its side: answer what it sent, then close.
    pub(super) eof: bool,
    /// Why it must close, when it must (logged), or `Some("")` for a quiet close.
    pub(super) close: Option<String>,
    /// The capacity of its buffers as last counted in [`EventLoop::buffered`].
    pub(super) accounted: usize,
}

impl Conn {
    pub(super) fn pending_output(&self) -> usize {
        self.output.len() - self.written
    }

    /// Whether to read more input from the socket: not past the
    /// pre-validation allowance (the buffered bytes are decoded first).
    pub(super) fn wants_read(&self) -> bool {
        !self.eof && self.wants_requests() && (self.validated || self.input.len() < UNVALIDATED_INPUT)
    }

    /// Whether to decode more of the input: not while answers back up,
    /// except after the peer closed (what it sent still counts: a `SET`
    /// followed by a close must be applied).
    pub(super) fn wants_requests(&self) -> bool {
        self.close.is_none() && (self.eof || self.pending_output() < OUTPUT_HIGH_WATER)
    }
}

/// Why a connection's first request cannot be `VALIDATE`, judged from its
/// first byte (so nothing more of it is buffered).
pub(super) fn refused_first_byte(b: u8) -> Option<String> {
    match QueryType::from_byte(b) {
        Some(QueryType::Validate) => None,
        Some(other) => Some(format!("the first request must be VALIDATE, not {}", other.name())),
        None => Some(format!("malformed request: unknown request type {b}")),
    }
}

pub(super) struct EventLoop {
    pub(super) listener: TcpListener,
    pub(super) wake_rx: UnixStream,
    pub(super) stopping: Arc<AtomicBool>,
    pub(super) options: ServerOptions,
    pub(super) log: LogFn,
    pub(super) conns: BTreeMap<u64, Conn>,
    pub(super) next_id: u64,
    pub(super) state: State,
    /// The sum of the connections' `accounted`.
    pub(super) buffered: usize,
    pub(super) stats: Arc<StatsCell>,
}

impl EventLoop {
    pub(super) fn run(&mut self) {
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
    pub(super) fn poll_timeout(&self) -> Duration {
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
    pub(super) fn used(&self) -> usize {
        self.state.bytes + self.buffered
    }

    /// Publishes the counters (after every change that can add to them).
    pub(super) fn note(&self) {
        let used = self.used();
        self.stats.memory.store(used, Ordering::Release);
        self.stats.peak.fetch_max(used, Ordering::AcqRel);
        self.stats.connections.store(self.conns.len(), Ordering::Release);
    }

    /// Counts connection `id`'s buffers as they are now.
    pub(super) fn sync(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            let now = c.input.capacity() + c.output.capacity();
            self.buffered = self.buffered - c.accounted + now;
            c.accounted = now;
        }
        self.note();
    }

    /// Closes connection `id` now, with `reason`, and frees its buffers.
    pub(super) fn cut(&mut self, id: u64, reason: String) {
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
    pub(super) fn make_room(&mut self, requester: u64, extra: usize) -> std::result::Result<(), String> {
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

    pub(super) fn accept(&mut self) {
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
    pub(super) fn read_from(&mut self, id: u64) {
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

    pub(super) fn flush_all(&mut self) {
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

    pub(super) fn expire_handshakes(&mut self) {
        let limit = self.options.handshake_timeout;
        for conn in self.conns.values_mut() {
            if !conn.validated && conn.close.is_none() && conn.opened.elapsed() >= limit {
                conn.close = Some(format!("no VALIDATE within {limit:?}"));
            }
        }
    }

    pub(super) fn close_marked(&mut self) {
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
