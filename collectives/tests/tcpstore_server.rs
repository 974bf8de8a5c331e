//! The TCPStore server under hostile or broken clients, and the client
//! against an absent server: every case is a clear error or a closed
//! connection with a logged reason, and the server keeps serving the others.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::tcp::protocol::{
    encode_request, put_bytes, Limits, QueryType, Request, VALIDATION_MAGIC,
};
use chorus_collectives::bootstrap::{ClientOptions, ServerOptions, Store, StoreBarrier, TcpStore, TcpStoreServer};
use chorus_collectives::{CommError, StoreFailure};

/// A server on a free loopback port whose log lines are collected.
fn server_with(options: ServerOptions) -> (TcpStoreServer, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    let options =
        ServerOptions { log: Some(Arc::new(move |line: &str| sink.lock().unwrap().push(line.to_string()))), ..options };
    let server = TcpStoreServer::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), options).unwrap();
    (server, log)
}

fn validated(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut hello = Vec::new();
    encode_request(&Request::Validate { magic: VALIDATION_MAGIC }, &mut hello);
    s.write_all(&hello).unwrap();
    s
}

/// Waits (bounded) until the server closes `s`.
fn assert_closed(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
}

fn wait_for_log(log: &Mutex<Vec<String>>, needle: &str) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if log.lock().unwrap().iter().any(|l| l.contains(needle)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no log line with {needle:?}: {:?}", log.lock().unwrap());
}

/// A normal client still works, promptly.
fn assert_serving(port: u16) {
    let start = Instant::now();
    let c = TcpStore::connect(
        "127.0.0.1",
        port,
        ClientOptions { connect_timeout: Duration::from_secs(5), ..ClientOptions::default() },
    )
    .unwrap();
    c.set("alive", b"yes").unwrap();
    assert_eq!(c.get("alive", Duration::from_secs(5)).unwrap(), b"yes");
    assert!(start.elapsed() < Duration::from_secs(2), "serving took {:?}", start.elapsed());
}

#[test]
fn malformed_requests_close_only_their_connection_with_a_logged_reason() {
    let (server, log) = server_with(ServerOptions::default());
    let port = server.port();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![0xff, 1, 2, 3], "unknown request type 255"),
        (
            {
                let mut b = Vec::new();
                encode_request(&Request::Validate { magic: 0xdead_beef }, &mut b);
                b
            },
            "bad validation number",
        ),
        (
            {
                let mut b = Vec::new();
                encode_request(&Request::GetNumKeys, &mut b);
                b
            },
            "the first request must be VALIDATE",
        ),
    ];
    let mut other = validated(port);
    for (bytes, reason) in cases {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&bytes).unwrap();
        assert_closed(&mut s);
        wait_for_log(&log, reason);
    }
    // Oversized lengths after a valid handshake: closed before the bytes are sent.
    let mut key = vec![QueryType::Set as u8];
    key.extend_from_slice(&(1u64 << 30).to_le_bytes());
    let mut value = vec![QueryType::Set as u8];
    put_bytes(&mut value, b"/k");
    value.extend_from_slice(&(100u64 << 20).to_le_bytes());
    let mut keys = vec![QueryType::Wait as u8];
    keys.extend_from_slice(&u64::MAX.to_le_bytes());
    for (bytes, reason) in
        [(key, "key of 1073741824 bytes"), (value, "value of 104857600 bytes"), (keys, "keys in one request")]
    {
        let mut s = validated(port);
        s.write_all(&bytes).unwrap();
        assert_closed(&mut s);
        wait_for_log(&log, reason);
    }
    // An earlier connection is untouched.
    let mut ping = Vec::new();
    encode_request(&Request::Ping { nonce: 9 }, &mut ping);
    other.write_all(&ping).unwrap();
    let mut echo = [0u8; 4];
    other.read_exact(&mut echo).unwrap();
    assert_eq!(u32::from_le_bytes(echo), 9);
    assert_serving(port);
}

#[test]
fn a_silent_client_blocks_nobody_and_is_closed_after_the_handshake_timeout() {
    let (server, log) =
        server_with(ServerOptions { handshake_timeout: Duration::from_millis(300), ..ServerOptions::default() });
    let mut silent = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    // Half a request: the server must not wait for the rest.
    let mut half = validated(server.port());
    half.write_all(&[QueryType::Set as u8, 5, 0]).unwrap();
    assert_serving(server.port());
    assert_closed(&mut silent);
    wait_for_log(&log, "no VALIDATE within");
    assert_serving(server.port());
}

#[test]
fn a_client_that_never_reads_its_answers_blocks_nobody() {
    let (server, _log) = server_with(ServerOptions::default());
    let c = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
    c.set("big", &vec![7u8; 4 << 20]).unwrap();
    let mut greedy = validated(server.port());
    greedy.set_write_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut get = Vec::new();
    encode_request(&Request::Get { key: b"/big".to_vec() }, &mut get);
    // Ask for the 4 MiB value until the socket buffers are full; never read.
    for _ in 0..200 {
        if greedy.write_all(&get).is_err() {
            break;
        }
    }
    assert_serving(server.port());
}

#[test]
fn the_connection_limit_refuses_extra_clients_and_frees_slots_on_close() {
    let (server, log) = server_with(ServerOptions { max_connections: 2, ..ServerOptions::default() });
    let a = validated(server.port());
    let _b = validated(server.port());
    std::thread::sleep(Duration::from_millis(100));
    let mut c = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    assert_closed(&mut c);
    wait_for_log(&log, "connections are open (the limit)");
    drop(a);
    std::thread::sleep(Duration::from_millis(100));
    assert_serving(server.port());
}

#[test]
fn memory_budget_and_bad_counters_close_the_offending_connection() {
    let (server, log) = server_with(ServerOptions { max_memory_bytes: 1000, ..ServerOptions::default() });
    let c = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
    let e = c.set("huge", &[0u8; 2000]).unwrap_err();
    assert!(matches!(e, CommError::Store { failure: StoreFailure::Protocol, .. }), "{e}");
    wait_for_log(&log, "the limit is 1000");
    assert!(server.stats().peak_memory_bytes <= 1000, "{:?}", server.stats());
    c.set("word", b"abc").unwrap();
    let e = c.add("word", 1).unwrap_err();
    assert!(
        matches!(e, CommError::Store { failure: StoreFailure::Protocol, ref address, .. } if address == &format!("127.0.0.1:{}", server.port())),
        "{e}"
    );
    wait_for_log(&log, "is not a decimal integer");
    // The client reconnects for the next operation.
    assert_eq!(c.add("n", 2).unwrap(), 2);
}

#[test]
fn limits_are_checked_by_the_client_before_sending() {
    let (server, log) = server_with(ServerOptions::default());
    let c = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
    let limits = Limits::default();
    let e = c.set(&"k".repeat(limits.max_key_len), b"v").unwrap_err();
    assert!(matches!(e, CommError::Store { failure: StoreFailure::Limit, .. }), "{e}");
    let e = c.set("k", &vec![0u8; limits.max_value_len + 1]).unwrap_err();
    assert!(matches!(e, CommError::Store { failure: StoreFailure::Limit, .. }), "{e}");
    c.set("k", &vec![1u8; limits.max_value_len]).unwrap();
    assert_eq!(c.get("k", Duration::from_secs(5)).unwrap().len(), limits.max_value_len);
    assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
}

#[test]
fn binding_loopback_port_zero_and_address_in_use() {
    let server = TcpStoreServer::bind_loopback(0).unwrap();
    assert_ne!(server.port(), 0);
    assert!(server.local_addr().ip().is_loopback());
    let e = TcpStoreServer::bind_loopback(server.port()).unwrap_err();
    assert!(
        matches!(e, CommError::Store { failure: StoreFailure::AddressInUse, ref address, .. } if address.ends_with(&format!(":{}", server.port()))),
        "{e}"
    );
}

#[test]
fn an_unreachable_server_is_a_typed_error_after_the_deadline_naming_the_address() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let start = Instant::now();
    let options = ClientOptions { connect_timeout: Duration::from_millis(400), ..ClientOptions::default() };
    let e = TcpStore::connect("127.0.0.1", port, options).unwrap_err();
    let waited = start.elapsed();
    assert!(
        matches!(e, CommError::Store { failure: StoreFailure::Unreachable, ref address, .. } if address == &format!("127.0.0.1:{port}")),
        "{e}"
    );
    assert!(waited >= Duration::from_millis(400) && waited < Duration::from_secs(5), "{waited:?}");
}

#[test]
fn the_client_retries_until_a_late_server_comes_up() {
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        TcpStoreServer::bind_loopback(port).unwrap()
    });
    let options = ClientOptions { connect_timeout: Duration::from_secs(10), ..ClientOptions::default() };
    let c = TcpStore::connect("127.0.0.1", port, options).unwrap();
    let _server = late.join().unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", Duration::from_secs(5)).unwrap(), b"v");
}

#[test]
fn a_waiting_client_that_disconnects_leaves_no_trace() {
    let (server, _log) = server_with(ServerOptions::default());
    let mut waiter = validated(server.port());
    let mut wait = Vec::new();
    encode_request(&Request::Wait { keys: vec![b"/w".to_vec()] }, &mut wait);
    waiter.write_all(&wait).unwrap();
    drop(waiter);
    std::thread::sleep(Duration::from_millis(50));
    let c = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
    c.set("w", b"1").unwrap();
    assert_serving(server.port());
}

/// VALIDATE, then the start of a multi-set whose one 8 MiB value never
/// finishes: `bytes` of it are sent (or fewer, when the server cuts the
/// connection first).
fn unfinished_multi_set(port: u16, tag: usize, bytes: usize) {
    let mut s = validated(port);
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = vec![QueryType::MultiSet as u8];
    head.extend_from_slice(&1u64.to_le_bytes());
    put_bytes(&mut head, format!("/hostile{tag}").as_bytes());
    head.extend_from_slice(&(8u64 << 20).to_le_bytes());
    if s.write_all(&head).is_err() {
        return;
    }
    let piece = vec![0x55u8; 256 * 1024];
    let mut sent = 0;
    while sent < bytes && s.write_all(&piece).is_ok() {
        sent += piece.len();
    }
    // Hold the connection open (the request unfinished) until the server cuts it.
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.read(&mut [0u8; 1]);
}

#[test]
fn hostile_unfinished_requests_are_cut_within_the_memory_budget_while_a_good_client_is_served() {
    let budget = 48 << 20;
    let (server, log) = server_with(ServerOptions { max_memory_bytes: budget, ..ServerOptions::default() });
    let port = server.port();
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let c = TcpStore::connect("127.0.0.1", port, ClientOptions::default()).unwrap();
            let mut rounds = 0u64;
            while !stop.load(Ordering::Acquire) || rounds < 5 {
                let key = format!("good/{}", rounds % 16);
                let value = rounds.to_string().into_bytes();
                c.set(&key, &value).unwrap();
                assert_eq!(c.get(&key, Duration::from_secs(10)).unwrap(), value);
                c.wait(&[&key], Duration::from_secs(10)).unwrap();
                assert_eq!(c.add("good/count", 1).unwrap(), rounds as i64 + 1);
                rounds += 1;
            }
            rounds
        })
    };
    // 16 connections × 7 MiB unfinished = 112 MiB asked for, over twice the budget.
    let hostile: Vec<_> = (0..16).map(|i| std::thread::spawn(move || unfinished_multi_set(port, i, 7 << 20))).collect();
    for h in hostile {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    let rounds = good.join().expect("the good client failed while hostile connections were open");
    assert!(rounds >= 5);
    wait_for_log(&log, "the memory budget is full");
    let stats = server.stats();
    assert!(stats.peak_memory_bytes <= budget, "{stats:?}");
    assert!(stats.cut_over_budget >= 1, "{stats:?}");
    assert_serving(port);
}

#[test]
fn before_validating_a_connection_buffers_a_few_kilobytes_at_most() {
    let (server, log) = server_with(ServerOptions::default());
    let port = server.port();
    // A request that is not VALIDATE is refused at its first byte, before its 4 MiB are buffered.
    let mut set = Vec::new();
    encode_request(&Request::Set { key: b"/k".to_vec(), value: vec![1u8; 4 << 20] }, &mut set);
    let senders: Vec<_> = (0..8)
        .map(|_| {
            let set = set.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
                let _ = s.write_all(&set);
            })
        })
        .collect();
    for s in senders {
        s.join().unwrap();
    }
    wait_for_log(&log, "the first request must be VALIDATE, not SET");
    let stats = server.stats();
    assert!(stats.peak_memory_bytes <= 8 * 64 * 1024, "{stats:?}");
    assert_serving(port);
}

#[test]
fn a_store_barrier_is_waited_for_on_the_server_not_polled() {
    let (server, _log) = server_with(ServerOptions::default());
    let port = server.port();
    let parties = 4;
    let clients: Vec<TcpStore> =
        (0..parties).map(|_| TcpStore::connect("127.0.0.1", port, ClientOptions::default()).unwrap()).collect();
    let before = server.stats().requests;
    let start = Instant::now();
    let threads: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            std::thread::spawn(move || {
                // The last party comes 400 ms after the first: a 5 ms poll would ask ~80 times.
                std::thread::sleep(Duration::from_millis(100 * r as u64 + 100));
                StoreBarrier::new("job/finished", parties).unwrap().arrive_and_wait(&c, Duration::from_secs(20))
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    assert!(start.elapsed() >= Duration::from_millis(400));
    let requests = server.stats().requests - before;
    // add + ping-confirmed set (the last party) + wait + get each: at most 6 per party.
    assert!(requests <= 6 * parties as u64, "{requests} requests for a barrier of {parties}");
}
