//! PyTorch's TCPStore wire format: the requests a client sends, their
//! encoder and an incremental, bounded decoder.
//!
//! Written from a reading of PyTorch's c10d sources (`TCPStore.cpp` for the
//! client, `TCPStoreLibUvBackend.cpp` for the server, `TCPStoreBackend.hpp`
//! for the constants) and checked against bytes recorded from torch 2.15
//! (`collectives/tests/data/tcpstore/`). Every integer is little-endian, as
//! PyTorch writes its native integers on x86-64 and aarch64:
//!
//! - a request is one byte of [`QueryType`] followed by its fields;
//! - a key or a value is a `u64` length, then that many bytes;
//! - a key list is a `u64` count, then the keys;
//! - the first request on a connection must be `VALIDATE` with the `u32`
//!   [`VALIDATION_MAGIC`]; the client then sends `PING` with a `u32` nonce
//!   (its pid) and the server echoes the nonce.
//!
//! | request | fields | answer |
//! | --- | --- | --- |
//! | VALIDATE (0) | magic `u32` | none |
//! | SET (1) | key, value | none |
//! | COMPARE_SET (2) | key, expected, desired | value |
//! | GET (3) | key | value (empty when absent: clients WAIT first) |
//! | ADD (4) | key, delta `i64` | new value `i64` |
//! | CHECK (5) | keys | `u8`: 0 ready, 1 not ready |
//! | WAIT (6) | keys | `u8` 0 (STOP_WAITING) once all are set |
//! | GETNUMKEYS (7) | — | `i64` |
//! | DELETE_KEY (8) | key | `i64` number deleted (0 or 1) |
//! | APPEND (9) | key, value | none |
//! | MULTI_GET (10) | keys | one value per key |
//! | MULTI_SET (11) | count, then key, value pairs | none |
//! | CANCEL_WAIT (12) | — | `u8` 1 (WAIT_CANCELED) |
//! | PING (13) | nonce `u32` | the nonce `u32` |
//! | QUEUE_PUSH (14) | key, value | none |
//! | QUEUE_POP (15) | key | `i64` queue length, then the value if it was not empty |
//! | QUEUE_LEN (16) | key | `i64` |
//! | LIST_KEYS (17) | — | `i64` count, then the keys |
//! | BARRIER (18) | key, world size `i64` | `u8` 0 (STOP_WAITING) once `world size` arrived |
//!
//! Limits are the libuv server's: keys up to 8 KiB, values up to 8 MiB, up
//! to 128 Ki keys per request; chorus adds a bound on a whole request
//! (64 MiB by default) so a multi-set cannot make a server buffer gigabytes.

use std::fmt;

/// The number a client sends in its first request, `VALIDATE`.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// The `CHECK` answer when every key is set.
pub const CHECK_READY: u8 = 0;
/// The `CHECK` answer when some key is missing.
pub const CHECK_NOT_READY: u8 = 1;
/// The `WAIT`/`BARRIER` answer: every awaited key is set.
pub const STOP_WAITING: u8 = 0;
/// The `CANCEL_WAIT` answer.
pub const WAIT_CANCELED: u8 = 1;

/// The request codes, in PyTorch's order (`c10d::detail::QueryType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    /// The handshake: the magic number.
    Validate = 0,
    /// Set a key.
    Set = 1,
    /// Compare-and-set.
    CompareSet = 2,
    /// Get a key (empty when absent).
    Get = 3,
    /// Add to a counter.
    Add = 4,
    /// Whether keys are set.
    Check = 5,
    /// Wait until keys are set.
    Wait = 6,
    /// Count keys.
    GetNumKeys = 7,
    /// Delete a key.
    DeleteKey = 8,
    /// Append bytes to a value.
    Append = 9,
    /// Get several keys.
    MultiGet = 10,
    /// Set several keys.
    MultiSet = 11,
    /// Stop the pending wait.
    CancelWait = 12,
    /// Echo a nonce.
    Ping = 13,
    /// Push to a queue.
    QueuePush = 14,
    /// Pop from a queue.
    QueuePop = 15,
    /// Length of a queue.
    QueueLen = 16,
    /// List every key.
    ListKeys = 17,
    /// Count an arrival and wait for `world size` of them.
    Barrier = 18,
}

impl QueryType {
    /// Every query type with PyTorch's name for it, in code order: the
    /// decoder's byte lookup and the names in logs both read this one table.
    const ALL: [(QueryType, &'static str); 19] = {
        use QueryType::*;
        [
            (Validate, "VALIDATE"),
            (Set, "SET"),
            (CompareSet, "COMPARE_SET"),
            (Get, "GET"),
            (Add, "ADD"),
            (Check, "CHECK"),
            (Wait, "WAIT"),
            (GetNumKeys, "GETNUMKEYS"),
            (DeleteKey, "DELETE_KEY"),
            (Append, "APPEND"),
            (MultiGet, "MULTI_GET"),
            (MultiSet, "MULTI_SET"),
            (CancelWait, "CANCEL_WAIT"),
            (Ping, "PING"),
            (QueuePush, "QUEUE_PUSH"),
            (QueuePop, "QUEUE_POP"),
            (QueueLen, "QUEUE_LEN"),
            (ListKeys, "LIST_KEYS"),
            (Barrier, "BARRIER"),
        ]
    };

    /// The query type of a request's first byte, if it is one.
    pub fn from_byte(b: u8) -> Option<QueryType> {
        QueryType::ALL.get(usize::from(b)).map(|&(query, _)| query)
    }

    /// PyTorch's name of the request (`SET`, `COMPARE_SET`, ...), for logs and errors.
    pub fn name(self) -> &'static str {
        // Every discriminant indexes the table (a test checks the order).
        QueryType::ALL[self as usize].1
    }
}

/// Size limits of the protocol (the libuv server's, plus a request bound).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest key in bytes (PyTorch: 8 KiB).
    pub max_key_len: usize,
    /// Longest value in bytes (PyTorch: 8 MiB).
    pub max_value_len: usize,
    /// Most keys in one request (PyTorch: 128 Ki).
    pub max_keys: usize,
    /// Longest whole request in bytes (chorus: 64 MiB; PyTorch has none).
    pub max_request_len: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_key_len: 8 * 1024,
            max_value_len: 8 * 1024 * 1024,
            max_keys: 128 * 1024,
            max_request_len: 64 * 1024 * 1024,
        }
    }
}

/// One decoded request. Keys are bytes: PyTorch's are `std::string`s,
/// which need not be UTF-8.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// `VALIDATE magic`.
    Validate {
        /// The number sent (the server checks it against [`VALIDATION_MAGIC`]).
        magic: u32,
    },
    /// `SET key value`.
    Set {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// `COMPARE_SET key expected desired`.
    CompareSet {
        /// The key.
        key: Vec<u8>,
        /// The value expected.
        expected: Vec<u8>,
        /// The value to store when it matches.
        desired: Vec<u8>,
    },
    /// `GET key`.
    Get {
        /// The key.
        key: Vec<u8>,
    },
    /// `ADD key delta`.
    Add {
        /// The key.
        key: Vec<u8>,
        /// The amount.
        delta: i64,
    },
    /// `CHECK keys`.
    Check {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// `WAIT keys`.
    Wait {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// `GETNUMKEYS`.
    GetNumKeys,
    /// `DELETE_KEY key`.
    DeleteKey {
        /// The key.
        key: Vec<u8>,
    },
    /// `APPEND key value`.
    Append {
        /// The key.
        key: Vec<u8>,
        /// The bytes to append.
        value: Vec<u8>,
    },
    /// `MULTI_GET keys`.
    MultiGet {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// `MULTI_SET count (key value)*`.
    MultiSet {
        /// The pairs, in order.
        entries: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// `CANCEL_WAIT`.
    CancelWait,
    /// `PING nonce`.
    Ping {
        /// The number to echo.
        nonce: u32,
    },
    /// `QUEUE_PUSH key value`.
    QueuePush {
        /// The queue.
        key: Vec<u8>,
        /// The element.
        value: Vec<u8>,
    },
    /// `QUEUE_POP key`.
    QueuePop {
        /// The queue.
        key: Vec<u8>,
    },
    /// `QUEUE_LEN key`.
    QueueLen {
        /// The queue.
        key: Vec<u8>,
    },
    /// `LIST_KEYS`.
    ListKeys,
    /// `BARRIER key world_size`.
    Barrier {
        /// The barrier's counter key.
        key: Vec<u8>,
        /// How many arrivals release it.
        world_size: i64,
    },
}

impl Request {
    /// The request's code, its first byte on the wire.
    pub fn query_type(&self) -> QueryType {
        match self {
            Request::Validate { .. } => QueryType::Validate,
            Request::Set { .. } => QueryType::Set,
            Request::CompareSet { .. } => QueryType::CompareSet,
            Request::Get { .. } => QueryType::Get,
            Request::Add { .. } => QueryType::Add,
            Request::Check { .. } => QueryType::Check,
            Request::Wait { .. } => QueryType::Wait,
            Request::GetNumKeys => QueryType::GetNumKeys,
            Request::DeleteKey { .. } => QueryType::DeleteKey,
            Request::Append { .. } => QueryType::Append,
            Request::MultiGet { .. } => QueryType::MultiGet,
            Request::MultiSet { .. } => QueryType::MultiSet,
            Request::CancelWait => QueryType::CancelWait,
            Request::Ping { .. } => QueryType::Ping,
            Request::QueuePush { .. } => QueryType::QueuePush,
            Request::QueuePop { .. } => QueryType::QueuePop,
            Request::QueueLen { .. } => QueryType::QueueLen,
            Request::ListKeys => QueryType::ListKeys,
            Request::Barrier { .. } => QueryType::Barrier,
        }
    }
}

/// Why bytes are not a request. The server closes the connection that sent them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The first byte is no [`QueryType`].
    UnknownQuery(u8),
    /// A key longer than the limit.
    KeyTooLong {
        /// The declared length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A value longer than the limit.
    ValueTooLong {
        /// The declared length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// More keys than the limit (or a negative count).
    TooManyKeys {
        /// The declared count.
        count: u64,
        /// The limit.
        max: usize,
    },
    /// The whole request would exceed the request limit.
    RequestTooLong {
        /// Bytes the request needs at least.
        len: u64,
        /// The limit.
        max: usize,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::UnknownQuery(b) => write!(f, "unknown request type {b}"),
            DecodeError::KeyTooLong { len, max } => write!(f, "key of {len} bytes (the limit is {max})"),
            DecodeError::ValueTooLong { len, max } => write!(f, "value of {len} bytes (the limit is {max})"),
            DecodeError::TooManyKeys { count, max } => write!(f, "{count} keys in one request (the limit is {max})"),
            DecodeError::RequestTooLong { len, max } => {
                write!(f, "request of at least {len} bytes (the limit is {max})")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// What [`decode_request`] found at the start of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A whole request, `len` bytes long.
    Request {
        /// The request.
        request: Request,
        /// How many bytes of the buffer it took.
        len: usize,
    },
    /// The buffer holds the start of a request; at least `needed` bytes
    /// (counted from the start of the buffer) are needed before decoding
    /// can get further, so there is no point in trying again with fewer.
    Incomplete {
        /// Bytes needed in total.
        needed: usize,
    },
    /// Not a request within the limits.
    Invalid(DecodeError),
}

enum Stop {
    Incomplete(usize),
    Invalid(DecodeError),
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a Limits,
}

impl Reader<'_> {
    /// The next `n` bytes, checking the request bound first so that a huge
    /// declared length is rejected without waiting for its bytes.
    fn take(&mut self, n: u64) -> Result<&[u8], Stop> {
        let end = (self.pos as u64).saturating_add(n);
        if end > self.limits.max_request_len as u64 {
            return Err(Stop::Invalid(DecodeError::RequestTooLong { len: end, max: self.limits.max_request_len }));
        }
        // `end` fits a usize: it is at most max_request_len.
        let end = end as usize;
        if end > self.buf.len() {
            return Err(Stop::Incomplete(end));
        }
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Stop> {
        let bytes = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, Stop> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, Stop> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, Stop> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn key(&mut self) -> Result<Vec<u8>, Stop> {
        let len = self.u64()?;
        if len > self.limits.max_key_len as u64 {
            return Err(Stop::Invalid(DecodeError::KeyTooLong { len, max: self.limits.max_key_len }));
        }
        Ok(self.take(len)?.to_vec())
    }

    fn value(&mut self) -> Result<Vec<u8>, Stop> {
        let len = self.u64()?;
        if len > self.limits.max_value_len as u64 {
            return Err(Stop::Invalid(DecodeError::ValueTooLong { len, max: self.limits.max_value_len }));
        }
        Ok(self.take(len)?.to_vec())
    }

    fn count(&mut self) -> Result<usize, Stop> {
        let count = self.u64()?;
        if count > self.limits.max_keys as u64 {
            return Err(Stop::Invalid(DecodeError::TooManyKeys { count, max: self.limits.max_keys }));
        }
        Ok(count as usize)
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, Stop> {
        let count = self.count()?;
        // The count is bounded, but allocate only as keys actually arrive.
        let mut keys = Vec::with_capacity(count.min(64));
        for _ in 0..count {
            keys.push(self.key()?);
        }
        Ok(keys)
    }

    fn request(&mut self) -> Result<Request, Stop> {
        let code = self.u8()?;
        let query = QueryType::from_byte(code).ok_or(Stop::Invalid(DecodeError::UnknownQuery(code)))?;
        Ok(match query {
            QueryType::Validate => Request::Validate { magic: self.u32()? },
            QueryType::Set => Request::Set { key: self.key()?, value: self.value()? },
            QueryType::CompareSet => {
                Request::CompareSet { key: self.key()?, expected: self.value()?, desired: self.value()? }
            }
            QueryType::Get => Request::Get { key: self.key()? },
            QueryType::Add => Request::Add { key: self.key()?, delta: self.i64()? },
            QueryType::Check => Request::Check { keys: self.keys()? },
            QueryType::Wait => Request::Wait { keys: self.keys()? },
            QueryType::GetNumKeys => Request::GetNumKeys,
            QueryType::DeleteKey => Request::DeleteKey { key: self.key()? },
            QueryType::Append => Request::Append { key: self.key()?, value: self.value()? },
            QueryType::MultiGet => Request::MultiGet { keys: self.keys()? },
            QueryType::MultiSet => {
                let count = self.count()?;
                let mut entries = Vec::with_capacity(count.min(64));
                for _ in 0..count {
                    entries.push((self.key()?, self.value()?));
                }
                Request::MultiSet { entries }
            }
            QueryType::CancelWait => Request::CancelWait,
            QueryType::Ping => Request::Ping { nonce: self.u32()? },
            QueryType::QueuePush => Request::QueuePush { key: self.key()?, value: self.value()? },
            QueryType::QueuePop => Request::QueuePop { key: self.key()? },
            QueryType::QueueLen => Request::QueueLen { key: self.key()? },
            QueryType::ListKeys => Request::ListKeys,
            QueryType::Barrier => Request::Barrier { key: self.key()?, world_size: self.i64()? },
        })
    }
}

/// Decodes the request at the start of `buf`. Never panics and never
/// allocates more than the bytes present; an oversized declared length is
/// [`Decoded::Invalid`] at once, before its bytes arrive.
pub fn decode_request(buf: &[u8], limits: &Limits) -> Decoded {
    let mut reader = Reader { buf, pos: 0, limits };
    match reader.request() {
        Ok(request) => Decoded::Request { request, len: reader.pos },
        Err(Stop::Incomplete(needed)) => Decoded::Incomplete { needed },
        Err(Stop::Invalid(e)) => Decoded::Invalid(e),
    }
}

/// Appends a length-prefixed byte string (a key or a value).
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn put_keys(out: &mut Vec<u8>, keys: &[Vec<u8>]) {
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        put_bytes(out, k);
    }
}

/// Appends the bytes of `request`, exactly as PyTorch's client writes it.
pub fn encode_request(request: &Request, out: &mut Vec<u8>) {
    out.push(request.query_type() as u8);
    // Requests are grouped by the layout of their fields.
    match request {
        Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
        Request::Validate { magic: n } | Request::Ping { nonce: n } => out.extend_from_slice(&n.to_le_bytes()),
        Request::Get { key } | Request::DeleteKey { key } | Request::QueuePop { key } | Request::QueueLen { key } => {
            put_bytes(out, key)
        }
        Request::Set { key, value } | Request::Append { key, value } | Request::QueuePush { key, value } => {
            put_bytes(out, key);
            put_bytes(out, value);
        }
        Request::CompareSet { key, expected, desired } => {
            put_bytes(out, key);
            put_bytes(out, expected);
            put_bytes(out, desired);
        }
        Request::Add { key, delta: n } | Request::Barrier { key, world_size: n } => {
            put_bytes(out, key);
            out.extend_from_slice(&n.to_le_bytes());
        }
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => put_keys(out, keys),
        Request::MultiSet { entries } => {
            out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
            for (k, v) in entries {
                put_bytes(out, k);
                put_bytes(out, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_requests() -> Vec<Request> {
        let k = |s: &str| s.as_bytes().to_vec();
        vec![
            Request::Validate { magic: VALIDATION_MAGIC },
            Request::Set { key: k("/a"), value: vec![0, 1, 2] },
            Request::CompareSet { key: k("/a"), expected: vec![], desired: k("x") },
            Request::Get { key: k("/a") },
            Request::Add { key: k("/c"), delta: -5 },
            Request::Check { keys: vec![k("/a"), k("/b")] },
            Request::Wait { keys: vec![] },
            Request::GetNumKeys,
            Request::DeleteKey { key: k("/a") },
            Request::Append { key: k("/l"), value: k("zz") },
            Request::MultiGet { keys: vec![k("/a")] },
            Request::MultiSet { entries: vec![(k("/a"), k("1")), (k("/b"), vec![])] },
            Request::CancelWait,
            Request::Ping { nonce: 77 },
            Request::QueuePush { key: k("/q"), value: k("v") },
            Request::QueuePop { key: k("/q") },
            Request::QueueLen { key: k("/q") },
            Request::ListKeys,
            Request::Barrier { key: k("/b"), world_size: 4 },
        ]
    }

    #[test]
    fn the_query_table_is_in_code_order() {
        for (i, (query, _)) in QueryType::ALL.iter().enumerate() {
            assert_eq!(*query as usize, i, "{query:?}");
        }
    }

    #[test]
    fn every_request_round_trips_and_every_prefix_is_incomplete() {
        let limits = Limits::default();
        for request in all_requests() {
            let mut bytes = Vec::new();
            encode_request(&request, &mut bytes);
            assert_eq!(
                decode_request(&bytes, &limits),
                Decoded::Request { request: request.clone(), len: bytes.len() }
            );
            for cut in 0..bytes.len() {
                match decode_request(&bytes[..cut], &limits) {
                    Decoded::Incomplete { needed } => {
                        assert!(needed > cut && needed <= bytes.len(), "{request:?} cut {cut}: needed {needed}")
                    }
                    other => panic!("{request:?} cut at {cut}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn oversized_lengths_are_rejected_before_their_bytes_arrive() {
        let limits = Limits::default();
        let mut set = vec![QueryType::Set as u8];
        set.extend_from_slice(&(8 * 1024 + 1u64).to_le_bytes());
        assert_eq!(
            decode_request(&set, &limits),
            Decoded::Invalid(DecodeError::KeyTooLong { len: 8 * 1024 + 1, max: 8 * 1024 })
        );
        let mut value = vec![QueryType::Set as u8];
        put_bytes(&mut value, b"k");
        value.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode_request(&value, &limits), Decoded::Invalid(DecodeError::ValueTooLong { .. })));
        let mut wait = vec![QueryType::Wait as u8];
        wait.extend_from_slice(&(-1i64).to_le_bytes());
        assert!(matches!(decode_request(&wait, &limits), Decoded::Invalid(DecodeError::TooManyKeys { .. })));
        let small = Limits { max_request_len: 32, ..Limits::default() };
        let mut big = vec![QueryType::Set as u8];
        put_bytes(&mut big, b"k");
        big.extend_from_slice(&100u64.to_le_bytes());
        assert!(matches!(decode_request(&big, &small), Decoded::Invalid(DecodeError::RequestTooLong { .. })));
        assert_eq!(decode_request(&[200], &limits), Decoded::Invalid(DecodeError::UnknownQuery(200)));
    }
}
