//! chorus's TCPStore against real PyTorch (`$CHORUS_PYTHON`; ignored unless
//! run with `--ignored`, as `ci/test.sh` does after `source ci/python-env.sh`).
//!
//! - A `torch.distributed.TCPStore` client runs every PyTorch store
//!   operation against chorus's server (`data/tcpstore/torch_client.py`).
//! - chorus's client runs the whole store-semantics suite against a server
//!   hosted by PyTorch (`data/tcpstore/torch_server.py`).

use crate::common;
use crate::torch_python;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::{ClientOptions, PrefixStore, Store, TcpStore, TcpStoreServer};
use common::Handles;

/// The venv's python, with `torch.distributed` available.
fn python() -> String {
    let python = torch_python::torch_python("torch.distributed");
    let probe = Command::new(&python)
        .args(["-c", "import torch.distributed as d; assert d.is_available()"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(probe.status.success(), "{python}: torch.distributed is not available in this build of torch");
    python
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
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn a_pytorch_client_uses_a_chorus_server() {
    let python = python();
    let server = TcpStoreServer::bind_loopback(0).unwrap();
    let chorus = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
    chorus.set("from_chorus", b"hello from chorus").unwrap();
    let out = Command::new(&python).arg(script("torch_client.py")).arg(server.port().to_string()).output().unwrap();
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
#[ignore = "needs PyTorch (ci/python-env.sh)"]
fn chorus_clients_pass_the_store_suite_against_a_pytorch_server() {
    let python = python();
    let mut child = Reap(Command::new(&python).arg(script("torch_server.py")).stdout(Stdio::piped()).spawn().unwrap());
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
