//! chorus's TCPStore client and server against bytes recorded from real
//! PyTorch (torch 2.15: its client talking to its libuv server through a
//! logging proxy; `data/tcpstore/record_transcript.py` made the files).
//!
//! - Server: the recorded client bytes are sent to chorus's server, which
//!   must answer exactly the recorded server bytes.
//! - Client: a scripted server replays the recorded server bytes to
//!   chorus's client running the same operations as the recording script,
//!   and checks that the client sends exactly the recorded client bytes
//!   (except the ping nonce, which is the sender's pid).

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use chorus_collectives::bootstrap::{ClientOptions, Store, TcpStore, TcpStoreServer};
use chorus_collectives::CommError;

#[derive(Debug)]
enum Segment {
    Client(Vec<u8>),
    Server(Vec<u8>),
}

fn load(name: &str) -> Vec<Segment> {
    let path = format!("{}/tests/data/tcpstore/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let hex = |s: &str| -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    };
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| match l.split_once(' ') {
            Some(("C", h)) => Segment::Client(hex(h.trim())),
            Some(("S", h)) => Segment::Server(hex(h.trim())),
            _ => panic!("{path}: bad line {l:?}"),
        })
        .collect()
}

fn read_exactly(stream: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    stream.read_exact(&mut buf).unwrap_or_else(|e| panic!("expected {n} bytes: {e}"));
    buf
}

fn replay_against_chorus_server(name: &str) {
    let server = TcpStoreServer::bind_loopback(0).unwrap();
    let mut stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for (i, segment) in load(name).iter().enumerate() {
        match segment {
            Segment::Client(bytes) => stream.write_all(bytes).unwrap(),
            Segment::Server(expected) => {
                let got = read_exactly(&mut stream, expected.len());
                assert_eq!(hex(&got), hex(expected), "{name}: server segment {i}");
            }
        }
    }
    // Nothing more than what PyTorch's server sent.
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut extra = [0u8; 1];
    match stream.read(&mut extra) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("{name}: unexpected extra answer {other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn chorus_server_answers_the_recorded_store_operations_byte_for_byte() {
    replay_against_chorus_server("store_ops.txt");
}

#[test]
fn chorus_server_answers_the_recorded_queue_and_barrier_requests_byte_for_byte() {
    replay_against_chorus_server("server_extras.txt");
}

/// A server that plays PyTorch's recorded answers and checks the client's bytes.
fn scripted_server(listener: TcpListener, segments: Vec<Segment>) -> Result<(), String> {
    let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let mut nonce = None;
    for (i, segment) in segments.iter().enumerate() {
        match segment {
            Segment::Client(expected) => {
                let mut got = vec![0u8; expected.len()];
                stream
                    .read_exact(&mut got)
                    .map_err(|e| format!("client segment {i}: {e} (expected {})", hex(expected)))?;
                if i == 0 {
                    // validate (5 bytes), then ping with the sender's pid as nonce.
                    if got[..6] != expected[..6] {
                        return Err(format!("handshake: got {}, expected {}", hex(&got), hex(expected)));
                    }
                    nonce = Some(got[6..10].to_vec());
                } else if got != *expected {
                    return Err(format!("client segment {i}: got {}, expected {}", hex(&got), hex(expected)));
                }
            }
            Segment::Server(bytes) => {
                let answer = match (i, &nonce) {
                    (1, Some(n)) => n.clone(),
                    _ => bytes.clone(),
                };
                stream.write_all(&answer).map_err(|e| e.to_string())?;
            }
        }
    }
    let mut extra = Vec::new();
    stream.read_to_end(&mut extra).map_err(|e| e.to_string())?;
    if !extra.is_empty() {
        return Err(format!("client sent more than PyTorch's: {}", hex(&extra)));
    }
    Ok(())
}

#[test]
fn chorus_client_sends_what_pytorchs_client_sends() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || scripted_server(listener, load("store_ops.txt")));
    // PyTorch's client does not confirm writes with a ping; for the same bytes, neither do we here.
    let options = ClientOptions { confirm_writes: false, ..ClientOptions::default() };
    let long = Duration::from_secs(10);
    {
        let s = TcpStore::connect("127.0.0.1", port, options).unwrap();
        s.set("key0", b"value0").unwrap();
        assert_eq!(s.get("key0", long).unwrap(), b"value0");
        assert_eq!(s.add("counter", 5).unwrap(), 5);
        assert_eq!(s.add("counter", -2).unwrap(), 3);
        assert_eq!(s.compare_set("cas", b"", b"first").unwrap(), b"first");
        assert_eq!(s.compare_set("cas", b"wrong", b"second").unwrap(), b"first");
        assert_eq!(s.compare_set("cas", b"first", b"second").unwrap(), b"second");
        assert_eq!(s.compare_set("missing", b"x", b"y").unwrap(), b"x");
        assert!(s.check(&["key0", "counter"]).unwrap());
        assert!(!s.check(&["key0", "nope"]).unwrap());
        s.wait(&["key0", "counter"], long).unwrap();
        assert!(matches!(s.wait(&["never"], Duration::from_millis(200)), Err(CommError::Timeout { .. })));
        s.multi_set(&[("m1", b"a"), ("m2", b"bb")]).unwrap();
        assert_eq!(s.multi_get(&["m1", "m2"], long).unwrap(), [b"a".to_vec(), b"bb".to_vec()]);
        assert_eq!(s.num_keys().unwrap(), 5);
        assert!(s.delete("key0").unwrap());
        assert!(!s.delete("key0").unwrap());
        assert_eq!(s.num_keys().unwrap(), 4);
        let big: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 256) as u8).collect();
        s.set("big", &big).unwrap();
        assert_eq!(s.get("big", long).unwrap(), big);
        s.set("bin", &[0, 1, 0, 255]).unwrap();
        assert_eq!(s.get("bin", long).unwrap(), [0, 1, 0, 255]);
        s.append("log", b"ab").unwrap();
        s.append("log", b"cd").unwrap();
        assert_eq!(s.get("log", long).unwrap(), b"abcd");
    }
    server.join().unwrap().unwrap();
}
