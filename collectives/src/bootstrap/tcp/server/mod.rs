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

use std::collections::BTreeMap;
use std::io::{ErrorKind, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use budget::State;
use connections::EventLoop;
use options::StatsCell;
pub use options::{LogFn, ServerOptions, ServerStats, ENTRY_OVERHEAD, UNVALIDATED_INPUT};

use crate::{CommError, Result, StoreFailure};

mod budget;
mod connections;
mod options;
mod requests;

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
