//! Bounded-time randomized tests of the TCPStore request decoder and server
//! (seeded, so a failure reproduces; about a second each on CI's cores).
//!
//! The decoder must never panic and must always do one of three things:
//! decode a request that re-encodes to exactly the bytes it consumed, ask
//! for more bytes (and still ask for them given any shorter buffer), or
//! reject. The server must survive random byte streams and keep serving.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::tcp::protocol::{
    decode_request, encode_request, Decoded, Limits, Request, VALIDATION_MAGIC,
};
use chorus_collectives::bootstrap::{ClientOptions, ServerOptions, Store, TcpStore, TcpStoreServer};

/// xorshift64*: small, seeded, good enough to explore byte strings.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn key(&mut self) -> Vec<u8> {
        let n = self.below(12);
        self.bytes(n)
    }
}

fn random_request(r: &mut Rng) -> Request {
    let keys = |r: &mut Rng| (0..r.below(4)).map(|_| r.key()).collect::<Vec<_>>();
    match r.below(19) {
        0 => Request::Validate { magic: if r.below(2) == 0 { VALIDATION_MAGIC } else { r.next() as u32 } },
        1 => Request::Set { key: r.key(), value: r.key() },
        2 => Request::CompareSet { key: r.key(), expected: r.key(), desired: r.key() },
        3 => Request::Get { key: r.key() },
        4 => Request::Add { key: r.key(), delta: r.next() as i64 },
        5 => Request::Check { keys: keys(r) },
        6 => Request::Wait { keys: keys(r) },
        7 => Request::GetNumKeys,
        8 => Request::DeleteKey { key: r.key() },
        9 => Request::Append { key: r.key(), value: r.key() },
        10 => Request::MultiGet { keys: keys(r) },
        11 => Request::MultiSet { entries: (0..r.below(4)).map(|_| (r.key(), r.key())).collect() },
        12 => Request::CancelWait,
        13 => Request::Ping { nonce: r.next() as u32 },
        14 => Request::QueuePush { key: r.key(), value: r.key() },
        15 => Request::QueuePop { key: r.key() },
        16 => Request::QueueLen { key: r.key() },
        17 => Request::ListKeys,
        _ => Request::Barrier { key: r.key(), world_size: r.next() as i64 },
    }
}

/// Valid requests, then damaged: bit flips, cut, spliced, lengths replaced.
fn random_input(r: &mut Rng) -> Vec<u8> {
    if r.below(4) == 0 {
        let n = r.below(48);
        return r.bytes(n);
    }
    let mut bytes = Vec::new();
    for _ in 0..1 + r.below(3) {
        encode_request(&random_request(r), &mut bytes);
    }
    for _ in 0..r.below(4) {
        if bytes.is_empty() {
            break;
        }
        let at = r.below(bytes.len());
        match r.below(4) {
            0 => bytes[at] ^= 1 << r.below(8),
            1 => bytes.truncate(at),
            2 => {
                let n = r.below(8);
                let extra = r.bytes(n);
                bytes.splice(at..at, extra);
            }
            _ => {
                // A length field made huge or arbitrary.
                let len = if r.below(2) == 0 { u64::MAX - r.next() % 1000 } else { r.next() % 100_000 };
                let end = (at + 8).min(bytes.len());
                bytes.splice(at..end, len.to_le_bytes());
            }
        }
    }
    bytes
}

fn check_decode(buf: &[u8], limits: &Limits) {
    match decode_request(buf, limits) {
        Decoded::Request { request, len } => {
            assert!(len <= buf.len() && len <= limits.max_request_len);
            let mut again = Vec::new();
            encode_request(&request, &mut again);
            assert_eq!(again, buf[..len], "decoding is not the inverse of encoding");
        }
        Decoded::Incomplete { needed } => {
            assert!(needed > buf.len() && needed <= limits.max_request_len, "needed {needed} for {} bytes", buf.len());
            // Any prefix needs more too (and never decodes to something else).
            let cut = buf.len() / 2;
            assert!(matches!(decode_request(&buf[..cut], limits), Decoded::Incomplete { .. }));
        }
        Decoded::Invalid(_) => {}
    }
}

#[test]
fn the_decoder_never_panics_and_always_decodes_asks_for_more_or_rejects() {
    let mut r = Rng(0x5eed_c0de_1234_5678);
    let small = Limits { max_key_len: 8, max_value_len: 16, max_keys: 3, max_request_len: 64 };
    let start = Instant::now();
    let mut cases = 0u64;
    while cases < 300_000 && start.elapsed() < Duration::from_secs(2) {
        let input = random_input(&mut r);
        check_decode(&input, &Limits::default());
        check_decode(&input, &small);
        cases += 1;
    }
    assert!(cases > 1000, "only {cases} cases ran");
}

#[test]
fn the_server_survives_random_byte_streams() {
    let server = TcpStoreServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        ServerOptions {
            log: Some(std::sync::Arc::new(|_: &str| {})),
            handshake_timeout: Duration::from_millis(200),
            ..ServerOptions::default()
        },
    )
    .unwrap();
    let mut r = Rng(0xfeed_f00d_0bad_cafe);
    let start = Instant::now();
    let mut streams = Vec::new();
    let mut sent = 0;
    while sent < 300 && start.elapsed() < Duration::from_secs(2) {
        let mut s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        let mut bytes = Vec::new();
        if r.below(2) == 0 {
            encode_request(&Request::Validate { magic: VALIDATION_MAGIC }, &mut bytes);
        }
        bytes.extend(random_input(&mut r));
        // The server may close first; that is one of the allowed outcomes.
        let _ = s.write_all(&bytes);
        if r.below(3) == 0 {
            streams.push(s);
        }
        sent += 1;
    }
    let c = TcpStore::connect(
        "127.0.0.1",
        server.port(),
        ClientOptions { connect_timeout: Duration::from_secs(5), ..ClientOptions::default() },
    )
    .unwrap();
    c.set("still", b"serving").unwrap();
    assert_eq!(c.get("still", Duration::from_secs(5)).unwrap(), b"serving");
    drop(streams);
}
