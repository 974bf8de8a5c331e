//! chorus's TCPStore against real PyTorch, when `import torch` works here
//! (otherwise each test prints `SKIPPED` with the reason and passes).
//!
//! - A `torch.distributed.TCPStore` client runs every PyTorch store
//!   operation against chorus's server (`data/tcpstore/torch_client.py`).
//! - chorus's client runs the whole store-semantics suite against a server
//!   hosted by PyTorch (`data/tcpstore/torch_server.py`).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::{ClientOptions, PrefixStore, Store, TcpStore, TcpStoreServer};
use common::Handles;

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Why PyTorch cannot be used here, or `None` when it can.
fn torch_missing() -> Option<String> {
    match Command::new(python())
        .args(["-c", "import torch.distributed as d; assert d.is_available()"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => None,
        Ok(s) => Some(format!("`{} -c \"import torch\"` failed ({s})", python())),
        Err(e) => Some(format!("cannot run {}: {e}", python())),
    }
}

fn script(name: &str) -> String {
    format!("{}/tests/data/tcpstore/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Kills the child if the test fails before it exits (no stray processes).
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_pytorch_client_uses_a_chorus_server() {
    if let Some(why) = torch_missing() {
        eprintln!("SKIPPED a_pytorch_client_uses_a_chorus_server: {why}");
        return;
    }
    let server = TcpStoreServer::bind_loopback(0).unwrap();
    let chorus = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
    chorus.set("from_chorus", b"hello from chorus").unwrap();
    let out = Command::new(python()).arg(script("torch_client.py")).arg(server.port().to_string()).output().unwrap();
    assert!(
        out.status.success(),
        "torch client failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(chorus.get("from_torch", Duration::from_secs(5)).unwrap(), b"hello from torch");
    assert_eq!(chorus.get("n", Duration::from_secs(5)).unwrap(), b"7");
}

#[test]
fn chorus_clients_pass_the_store_suite_against_a_pytorch_server() {
    if let Some(why) = torch_missing() {
        eprintln!("SKIPPED chorus_clients_pass_the_store_suite_against_a_pytorch_server: {why}");
        return;
    }
    let mut child = Reap(Command::new(python()).arg(script("torch_server.py")).stdout(Stdio::piped()).spawn().unwrap());
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let port: u16 = lines.next().expect("the torch server printed nothing").unwrap().trim().parse().unwrap();
    let options = ClientOptions { connect_timeout: Duration::from_secs(30), ..ClientOptions::default() };
    let chorus = TcpStore::connect("127.0.0.1", port, options.clone()).unwrap();
    assert_eq!(chorus.get("from_torch", Duration::from_secs(10)).unwrap(), b"hello from torch");
    let start = Instant::now();
    for (name, case) in common::CASES {
        // One PyTorch server for every case: each case gets its own key prefix.
        let options = options.clone();
        let handles: Handles = Arc::new(move || {
            Arc::new(PrefixStore::new(
                format!("suite/{name}"),
                TcpStore::connect("127.0.0.1", port, options.clone()).unwrap(),
            )) as Arc<dyn Store>
        });
        case(&handles);
        eprintln!("passed against PyTorch's server: {name}");
    }
    chorus.set("from_chorus", b"hello from chorus").unwrap();
    assert_eq!(chorus.add("chorus_counter", 42).unwrap(), 42);
    chorus.set("chorus_done", b"1").unwrap();
    let status = child.0.wait().unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(status.success(), "torch server failed: {rest:?}");
    assert!(rest.iter().any(|l| l.contains("torch server: ok")), "{rest:?}");
    assert!(start.elapsed() < Duration::from_secs(120));
}
