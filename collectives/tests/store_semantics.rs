//! One suite of store semantics (`common/mod.rs`), run on every store:
//! in memory, on files, over TCP against chorus's server, and through a
//! `PrefixStore`.

use crate::common;
use crate::store_suite;

use std::sync::Arc;

use chorus_collectives::bootstrap::{ClientOptions, FileStore, MemStore, PrefixStore, Store, TcpStore, TcpStoreServer};
use common::Handles;

fn mem() -> Handles {
    let store = MemStore::new();
    Arc::new(move || Arc::new(store.clone()) as Arc<dyn Store>)
}

fn file() -> Handles {
    let dir = tempdir();
    Arc::new(move || Arc::new(FileStore::open(&dir).unwrap()) as Arc<dyn Store>)
}

/// A fresh directory under the target's temporary folder (no tempfile crate).
fn tempdir() -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "chorus-filestore-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tcp() -> Handles {
    // The server lives as long as some handle factory does.
    let server = Arc::new(TcpStoreServer::bind_loopback(0).unwrap());
    Arc::new(move || {
        let client = TcpStore::connect("127.0.0.1", server.port(), ClientOptions::default()).unwrap();
        Arc::new(client) as Arc<dyn Store>
    })
}

/// The suite through a prefix store over a shared memory store: the prefix
/// must not change any semantics.
fn prefixed() -> Handles {
    let store = MemStore::new();
    Arc::new(move || Arc::new(PrefixStore::new("p", store.clone())) as Arc<dyn Store>)
}

store_suite!(mem_store, mem());
store_suite!(file_store, file());
store_suite!(tcp_store, tcp());
store_suite!(prefix_store, prefixed());
