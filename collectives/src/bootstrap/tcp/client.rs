//! [`TcpStore`]: a client of a TCPStore server (chorus's or PyTorch's).
//!
//! It speaks as PyTorch's `TCPStore` client does, byte for byte: every key
//! goes on the wire with PyTorch's `/` prefix (so `set("a")` here and
//! `store.set("a")` in Python name the same key), `get` is `WAIT` then
//! `GET`, and a wait that passes its deadline sends `CANCEL_WAIT` and reads
//! the server's `WAIT_CANCELED` so the connection stays usable.
//!
//! A connection serves one operation at a time; the client keeps a small
//! pool of them so that threads sharing one `TcpStore` do not queue behind
//! each other's waits (a thread waiting for a key that another thread of the
//! same process will set would otherwise never be answered). A connection
//! that fails mid-operation is dropped and the next operation opens a new one.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::protocol::{
    encode_request, Limits, Request, CHECK_NOT_READY, CHECK_READY, STOP_WAITING, VALIDATION_MAGIC, WAIT_CANCELED,
};
use crate::bootstrap::store::{deadline_after, timeout_error, wait_op, Store};
use crate::{CommError, Result, StoreFailure};

/// PyTorch's `TCPStore` puts this before every key it sends.
const KEY_PREFIX: &str = "/";
/// Idle connections kept for reuse.
const MAX_IDLE: usize = 8;
/// The longest value a client accepts in an answer (a hostile server could
/// otherwise make it buffer without end).
const MAX_ANSWER_VALUE: u64 = 256 << 20;

/// How a [`TcpStore`] connects and how long it waits.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long to keep trying to reach the server (refused connections are
    /// retried with exponential backoff) before failing with
    /// [`StoreFailure::Unreachable`] (60 s by default).
    pub connect_timeout: Duration,
    /// The deadline of operations that do not wait for other ranks (set,
    /// add, check...): a server that does not answer within it is a
    /// [`CommError::Timeout`] (300 s by default, PyTorch's store timeout).
    pub io_timeout: Duration,
    /// Limits checked before sending, so the server never has to close the
    /// connection over them (PyTorch's server's limits by default).
    pub limits: Limits,
    /// Whether `set`, `multi_set` and `append` return only once the server
    /// has applied them (true by default). The protocol does not answer
    /// those requests, so the client follows them with a `PING` on the same
    /// connection and waits for its echo: the server handles a connection's
    /// requests in order. Without it (PyTorch's client behaviour), a write
    /// may still be in flight when the call returns, and an operation on
    /// another connection (another thread, another rank) can miss it.
    pub confirm_writes: bool,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            connect_timeout: Duration::from_secs(60),
            io_timeout: Duration::from_secs(300),
            limits: Limits::default(),
            confirm_writes: true,
        }
    }
}

/// A TCPStore client; see the module documentation.
#[derive(Debug)]
pub struct TcpStore {
    host: String,
    port: u16,
    address: String,
    options: ClientOptions,
    idle: Mutex<Vec<Conn>>,
}

/// How an operation on a connection failed, and whether the connection can
/// be reused.
enum Failure {
    /// The connection is in a known state (a wait that timed out and was cancelled).
    Keep(CommError),
    /// The connection is broken or out of step with the server.
    Drop(CommError),
}

type OpResult<T> = std::result::Result<T, Failure>;

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    /// For the `waited` of timeout errors.
    io_timeout: Duration,
}

impl TcpStore {
    /// Connects to the server at `host:port` (validate, then ping), retrying
    /// until [`ClientOptions::connect_timeout`]; fails with
    /// [`StoreFailure::Unreachable`] naming the address after that.
    pub fn connect(host: &str, port: u16, options: ClientOptions) -> Result<TcpStore> {
        let store = TcpStore {
            host: host.to_string(),
            port,
            address: format!("{host}:{port}"),
            options,
            idle: Mutex::new(Vec::new()),
        };
        let conn = store.open(deadline_after(store.options.connect_timeout))?;
        store.put_back(conn);
        Ok(store)
    }

    /// `host:port` of the server.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The options it was made with.
    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// Appends `value` to the bytes under `key` (creating it), as PyTorch's
    /// `append` does. Not part of [`Store`]: only TCP stores have it.
    pub fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.wire_key(key)?;
        self.check_value(value)?;
        self.run(|conn, d| self.write(conn, Request::Append { key, value: value.to_vec() }, d, "append"))
    }

    fn wire_key(&self, key: &str) -> Result<Vec<u8>> {
        let wire = format!("{KEY_PREFIX}{key}").into_bytes();
        if wire.len() > self.options.limits.max_key_len {
            return Err(self.limit(format!(
                "key of {} bytes (the limit is {})",
                wire.len(),
                self.options.limits.max_key_len
            )));
        }
        Ok(wire)
    }

    fn wire_keys(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        if keys.len() > self.options.limits.max_keys {
            return Err(self.limit(format!(
                "{} keys in one request (the limit is {})",
                keys.len(),
                self.options.limits.max_keys
            )));
        }
        keys.iter().map(|k| self.wire_key(k)).collect()
    }

    fn check_value(&self, value: &[u8]) -> Result<()> {
        if value.len() > self.options.limits.max_value_len {
            return Err(self.limit(format!(
                "value of {} bytes (the limit is {})",
                value.len(),
                self.options.limits.max_value_len
            )));
        }
        Ok(())
    }

    fn limit(&self, reason: String) -> CommError {
        CommError::store(&self.address, StoreFailure::Limit, reason)
    }

    /// Opens and validates a connection, retrying with backoff until `deadline`.
    fn open(&self, deadline: Instant) -> Result<Conn> {
        let mut backoff = Duration::from_millis(10);
        let mut tries = 0u32;
        loop {
            tries += 1;
            let error = match self.try_open(deadline) {
                Ok(conn) => return Ok(conn),
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::store(
                    &self.address,
                    StoreFailure::Unreachable,
                    format!("gave up after {tries} attempts over {:?}: {error}", self.options.connect_timeout),
                ));
            }
            // Jitter (up to a quarter of the backoff, from the pid and the
            // attempt) spreads many ranks' retries so they do not arrive together.
            let spread = u64::from(std::process::id().wrapping_mul(2_654_435_761) ^ tries.wrapping_mul(40_503)) % 1024;
            let jitter = backoff / 4 * (spread as u32) / 1024;
            std::thread::sleep((backoff + jitter).min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    fn try_open(&self, deadline: Instant) -> std::result::Result<Conn, String> {
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {}: {e}", self.host))?
            .collect();
        let mut last = format!("{} resolves to no address", self.host);
        for addr in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match TcpStream::connect_timeout(&addr, remaining.min(Duration::from_secs(10))) {
                Ok(stream) => {
                    // Requests are small and answered one at a time.
                    let _ = stream.set_nodelay(true);
                    let mut conn = Conn { stream, io_timeout: self.options.io_timeout };
                    return conn.handshake(deadline).map(|()| conn).map_err(|e| format!("{addr}: {e}"));
                }
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        Err(last)
    }

    fn take_idle(&self) -> Option<Conn> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    fn put_back(&self, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    /// Runs `f` on a connection (idle or new) with the I/O deadline,
    /// returning the connection to the pool unless it broke.
    fn run<T>(&self, f: impl FnOnce(&mut Conn, Instant) -> OpResult<T>) -> Result<T> {
        let deadline = deadline_after(self.options.io_timeout);
        let mut conn = match self.take_idle() {
            Some(c) => c,
            None => self.open(deadline_after(self.options.connect_timeout))?,
        };
        match f(&mut conn, deadline) {
            Ok(v) => {
                self.put_back(conn);
                Ok(v)
            }
            Err(Failure::Keep(e)) => {
                self.put_back(conn);
                Err(e)
            }
            Err(Failure::Drop(e)) => Err(self.name_errors(e)),
        }
    }

    /// Puts this store's address into errors made below the client.
    fn name_errors(&self, e: CommError) -> CommError {
        match e {
            CommError::Store { failure, reason, .. } => CommError::store(&self.address, failure, reason),
            other => other,
        }
    }

    /// Sends a request that has no answer; with `confirm_writes`, follows it
    /// with a `PING` and waits for the echo, so the server has applied it.
    fn write(&self, conn: &mut Conn, request: Request, deadline: Instant, op: &str) -> OpResult<()> {
        conn.send(&request, deadline, op)?;
        if self.options.confirm_writes {
            let nonce = std::process::id();
            conn.send(&Request::Ping { nonce }, deadline, op)?;
            let echo = u32::from_le_bytes(conn.recv_array(deadline, op)?);
            if echo != nonce {
                return Err(Failure::Drop(protocol(format!("{op}: ping answered {echo}, not {nonce}"))));
            }
        }
        Ok(())
    }

    /// `WAIT` for `keys` until `timeout`, cancelling on the deadline.
    fn wait_on(
        &self,
        conn: &mut Conn,
        keys: Vec<Vec<u8>>,
        timeout: Duration,
        io_deadline: Instant,
        op: impl Fn() -> String,
    ) -> OpResult<()> {
        conn.send(&Request::Wait { keys }, io_deadline, "wait")?;
        match conn.recv_byte_until(deadline_after(timeout)) {
            Ok(STOP_WAITING) => Ok(()),
            Ok(other) => Err(Failure::Drop(protocol(format!("wait answered {other}, not STOP_WAITING")))),
            Err(e) if is_timeout(&e) => {
                conn.send(&Request::CancelWait, io_deadline, "cancel_wait")?;
                match conn.recv_byte(io_deadline, "cancel_wait")? {
                    WAIT_CANCELED => Err(Failure::Keep(timeout_error(op(), timeout))),
                    // The keys arrived as we cancelled: the wait succeeded.
                    STOP_WAITING => match conn.recv_byte(io_deadline, "cancel_wait")? {
                        WAIT_CANCELED => Ok(()),
                        other => {
                            Err(Failure::Drop(protocol(format!("cancel_wait answered {other}, not WAIT_CANCELED"))))
                        }
                    },
                    other => Err(Failure::Drop(protocol(format!("cancel_wait answered {other}")))),
                }
            }
            Err(e) => Err(Failure::Drop(io_failure(e, "wait"))),
        }
    }
}

fn protocol(reason: String) -> CommError {
    // The address is filled in by `TcpStore::name_errors`.
    CommError::store(String::new(), StoreFailure::Protocol, reason)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn io_failure(e: std::io::Error, op: &str) -> CommError {
    if e.kind() == ErrorKind::UnexpectedEof {
        protocol(format!("the server closed the connection during {op}"))
    } else {
        CommError::store(String::new(), StoreFailure::Io, format!("{op}: {e}"))
    }
}

/// The deadline left, at least a millisecond (std refuses a zero timeout).
fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

impl Conn {
    fn handshake(&mut self, deadline: Instant) -> std::result::Result<(), String> {
        let nonce = std::process::id();
        let mut bytes = Vec::new();
        encode_request(&Request::Validate { magic: VALIDATION_MAGIC }, &mut bytes);
        encode_request(&Request::Ping { nonce }, &mut bytes);
        self.stream.set_write_timeout(Some(remaining(deadline))).map_err(|e| e.to_string())?;
        self.stream.write_all(&bytes).map_err(|e| format!("validate: {e}"))?;
        let mut echo = [0u8; 4];
        self.stream.set_read_timeout(Some(remaining(deadline))).map_err(|e| e.to_string())?;
        self.stream.read_exact(&mut echo).map_err(|e| format!("no answer to ping: {e}"))?;
        let got = u32::from_le_bytes(echo);
        if got != nonce {
            return Err(format!("ping answered {got}, not the nonce {nonce}: not a TCPStore server"));
        }
        Ok(())
    }

    fn send(&mut self, request: &Request, deadline: Instant, op: &str) -> OpResult<()> {
        let mut bytes = Vec::new();
        encode_request(request, &mut bytes);
        let sent =
            self.stream.set_write_timeout(Some(remaining(deadline))).and_then(|()| self.stream.write_all(&bytes));
        sent.map_err(|e| {
            Failure::Drop(if is_timeout(&e) {
                timeout_error(format!("store {op} (sending)"), self.io_timeout)
            } else {
                io_failure(e, op)
            })
        })
    }

    fn recv_exact(&mut self, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
        self.stream.set_read_timeout(Some(remaining(deadline)))?;
        self.stream.read_exact(buf)
    }

    fn recv_byte_until(&mut self, deadline: Instant) -> std::io::Result<u8> {
        let mut b = [0u8; 1];
        self.recv_exact(&mut b, deadline)?;
        Ok(b[0])
    }

    fn recv_array<const N: usize>(&mut self, deadline: Instant, op: &str) -> OpResult<[u8; N]> {
        let mut buf = [0u8; N];
        self.recv_exact(&mut buf, deadline).map_err(|e| {
            Failure::Drop(if is_timeout(&e) {
                timeout_error(format!("store {op} (answer)"), self.io_timeout)
            } else {
                io_failure(e, op)
            })
        })?;
        Ok(buf)
    }

    fn recv_byte(&mut self, deadline: Instant, op: &str) -> OpResult<u8> {
        Ok(self.recv_array::<1>(deadline, op)?[0])
    }

    fn recv_i64(&mut self, deadline: Instant, op: &str) -> OpResult<i64> {
        Ok(i64::from_le_bytes(self.recv_array(deadline, op)?))
    }

    fn recv_value(&mut self, deadline: Instant, op: &str) -> OpResult<Vec<u8>> {
        let len = u64::from_le_bytes(self.recv_array(deadline, op)?);
        if len > MAX_ANSWER_VALUE {
            return Err(Failure::Drop(protocol(format!(
                "{op} answered a value of {len} bytes (more than {MAX_ANSWER_VALUE})"
            ))));
        }
        let mut value = Vec::new();
        // `take` grows the buffer as bytes arrive instead of trusting `len` up front.
        let read = self
            .stream
            .set_read_timeout(Some(remaining(deadline)))
            .and_then(|()| (&mut self.stream).take(len).read_to_end(&mut value));
        match read {
            Ok(n) if n as u64 == len => Ok(value),
            Ok(_) => Err(Failure::Drop(protocol(format!("the server closed the connection during {op}")))),
            Err(e) if is_timeout(&e) => {
                Err(Failure::Drop(timeout_error(format!("store {op} (answer)"), self.io_timeout)))
            }
            Err(e) => Err(Failure::Drop(io_failure(e, op))),
        }
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.wire_key(key)?;
        self.check_value(value)?;
        self.run(|conn, d| self.write(conn, Request::Set { key, value: value.to_vec() }, d, "set"))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let wire = self.wire_key(key)?;
        self.run(|conn, d| {
            self.wait_on(conn, vec![wire.clone()], timeout, d, || format!("store get {key}"))?;
            // The wait may have used most of `d`: the read gets a deadline of its own.
            let d = deadline_after(self.options.io_timeout);
            conn.send(&Request::Get { key: wire }, d, "get")?;
            conn.recv_value(d, "get")
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let key = self.wire_key(key)?;
        self.run(|conn, d| {
            conn.send(&Request::Add { key, delta }, d, "add")?;
            // A server that cannot add (the value is no integer) closes the connection.
            conn.recv_i64(d, "add (the server closes the connection when the stored value is not an integer)")
        })
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let key = self.wire_key(key)?;
        self.check_value(expected)?;
        self.check_value(desired)?;
        self.run(|conn, d| {
            conn.send(
                &Request::CompareSet { key, expected: expected.to_vec(), desired: desired.to_vec() },
                d,
                "compare_set",
            )?;
            conn.recv_value(d, "compare_set")
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let wire = self.wire_keys(keys)?;
        self.run(|conn, d| self.wait_on(conn, wire, timeout, d, || wait_op(keys)))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let wire = self.wire_keys(keys)?;
        self.run(|conn, d| {
            conn.send(&Request::Check { keys: wire }, d, "check")?;
            match conn.recv_byte(d, "check")? {
                CHECK_READY => Ok(true),
                CHECK_NOT_READY => Ok(false),
                other => Err(Failure::Drop(protocol(format!("check answered {other}")))),
            }
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let key = self.wire_key(key)?;
        self.run(|conn, d| {
            conn.send(&Request::DeleteKey { key }, d, "delete_key")?;
            Ok(conn.recv_i64(d, "delete_key")? == 1)
        })
    }

    fn num_keys(&self) -> Result<u64> {
        self.run(|conn, d| {
            conn.send(&Request::GetNumKeys, d, "num_keys")?;
            let n = conn.recv_i64(d, "num_keys")?;
            u64::try_from(n).map_err(|_| Failure::Drop(protocol(format!("num_keys answered {n}"))))
        })
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let wire = self.wire_keys(keys)?;
        self.run(|conn, d| {
            self.wait_on(conn, wire.clone(), timeout, d, || format!("store multi_get [{}]", keys.join(", ")))?;
            let n = wire.len();
            let d = deadline_after(self.options.io_timeout);
            conn.send(&Request::MultiGet { keys: wire }, d, "multi_get")?;
            (0..n).map(|_| conn.recv_value(d, "multi_get")).collect()
        })
    }

    fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()> {
        if entries.len() > self.options.limits.max_keys {
            return Err(self.limit(format!(
                "{} keys in one request (the limit is {})",
                entries.len(),
                self.options.limits.max_keys
            )));
        }
        let mut wire = Vec::with_capacity(entries.len());
        let mut total = 9usize;
        for (k, v) in entries {
            self.check_value(v)?;
            let key = self.wire_key(k)?;
            total += 16 + key.len() + v.len();
            wire.push((key, v.to_vec()));
        }
        if total > self.options.limits.max_request_len {
            return Err(self
                .limit(format!("multi_set of {total} bytes (the limit is {})", self.options.limits.max_request_len)));
        }
        self.run(|conn, d| self.write(conn, Request::MultiSet { entries: wire }, d, "multi_set"))
    }
}
