//! Bootstrap: how the ranks of a job find each other before a communicator
//! exists.
//!
//! Rank 0 publishes what the others need (NCCL's 128-byte unique id, a
//! worker address) in a [`Store`]; the others wait for it there. What is where:
//!
//! - [`Store`] (`store.rs`): the key-value operations, with PyTorch's
//!   semantics and a deadline on everything that waits; [`PrefixStore`]
//!   namespaces keys as PyTorch's `PrefixStore` does.
//! - [`StoreBarrier`], [`RoundBarrier`] (`barrier.rs`): barriers waited for
//!   on the store's side (an `add`, then a wait for the key the last party
//!   sets), on every store.
//! - [`MemStore`] (`mem.rs`): ranks that are threads of one process.
//! - [`FileStore`] (`file.rs`): a directory on a filesystem every rank sees.
//! - [`tcp`]: PyTorch's TCPStore protocol — [`TcpStore`] (client),
//!   [`TcpStoreServer`], and the wire format in [`tcp::protocol`]; a chorus
//!   rank joins torchrun's store and PyTorch processes join chorus's.
//! - [`LaunchEnv`] (`env.rs`): rank, world size, local rank, the store's
//!   address, read from torchrun's, Slurm's, Open MPI's or PMI's variables,
//!   with Slurm's node lists expanded by [`nodelist`].
//! - [`connect_from_env`]: the store a [`LaunchEnv`] points to — a client of
//!   torchrun's (or `chorus launch`'s) agent store, or else a server on rank
//!   0 at `MASTER_ADDR:MASTER_PORT` that every rank connects to.
//! - [`Job`] (`job.rs`): this process as a rank of a launched job — the
//!   variables read, the store joined, the world sizes checked, the
//!   barriers that end a command.

mod barrier;
mod env;
mod file;
mod job;
mod mem;
pub mod nodelist;
mod store;
pub mod tcp;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

pub use barrier::{RoundBarrier, StoreBarrier};
pub use env::{key_scope, process_key_scope, EnvError, LaunchEnv, Launcher};
pub use file::FileStore;
pub use job::{Job, JobError};
pub use mem::MemStore;
pub use store::{PrefixStore, Store};
pub use tcp::{ClientOptions, ServerOptions, ServerStats, TcpStore, TcpStoreServer};

use crate::{CommError, Result, StoreFailure};

/// How [`connect_from_env`] connects.
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    /// The client's options; its `connect_timeout` bounds how long ranks
    /// wait for rank 0's (or the agent's) server to come up.
    pub client: ClientOptions,
    /// The options of the server rank 0 hosts when there is no agent store.
    pub server: ServerOptions,
}

/// The store of a job, and the server behind it when this rank hosts it
/// (dropping the `Rendezvous` stops that server: rank 0 keeps it alive
/// until the others no longer need the store).
#[derive(Debug)]
pub struct Rendezvous {
    store: Arc<TcpStore>,
    server: Option<TcpStoreServer>,
}

impl Rendezvous {
    /// The store, to share between threads or hand to a communicator.
    pub fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    /// The client, for TCP-only operations (`append`).
    pub fn client(&self) -> &TcpStore {
        &self.store
    }

    /// The server this rank hosts, if it hosts one.
    pub fn server(&self) -> Option<&TcpStoreServer> {
        self.server.as_ref()
    }
}

/// Connects the store `env` points to:
///
/// - under torchrun or `chorus launch` (`use_agent_store`), the agent already
///   hosts the store at `MASTER_ADDR:MASTER_PORT`; every rank connects as a
///   client. PyTorch 2.15's workers add no per-attempt prefix there (the
///   agent makes a new store for every restart), so neither does chorus:
///   keys are shared with PyTorch processes of the same job as written
///   (older PyTorch used `PrefixStore("/worker/attempt_{restart}")`; wrap the
///   store in a [`PrefixStore`] to talk to those);
/// - otherwise rank 0 hosts a [`TcpStoreServer`] on `MASTER_PORT` — on the
///   loopback address when `MASTER_ADDR` is a loopback address or
///   `localhost`, on every interface otherwise, so the other nodes reach it —
///   and every rank, rank 0 included, connects to `MASTER_ADDR:MASTER_PORT`.
///
/// Waiting for the server is bounded by `options.client.connect_timeout`;
/// a port already taken on rank 0 is [`StoreFailure::AddressInUse`].
pub fn connect_from_env(env: &LaunchEnv, options: &ConnectOptions) -> Result<Rendezvous> {
    let server = if env.use_agent_store || env.rank != 0 {
        None
    } else {
        if env.master_port == 0 && env.world_size > 1 {
            return Err(CommError::invalid(
                "connect_from_env",
                "MASTER_PORT=0: the other ranks cannot learn a port rank 0 picks",
            ));
        }
        Some(TcpStoreServer::bind(listen_address(&env.master_addr, env.master_port), options.server.clone())?)
    };
    let port = server.as_ref().map_or(env.master_port, TcpStoreServer::port);
    let store = TcpStore::connect(&env.master_addr, port, options.client.clone()).map_err(|e| match e {
        CommError::Store { address, failure: StoreFailure::Unreachable, reason } => CommError::Store {
            address,
            failure: StoreFailure::Unreachable,
            reason: format!(
                "{reason} (rank {} of {}, {} store{})",
                env.rank,
                env.world_size,
                env.launcher,
                if env.use_agent_store { ", hosted by the launcher's agent" } else { ", hosted by rank 0" }
            ),
        },
        other => other,
    })?;
    Ok(Rendezvous { store: Arc::new(store), server })
}

/// Where rank 0 listens for `MASTER_ADDR`: loopback stays loopback, any
/// other name listens on every interface.
fn listen_address(master_addr: &str, port: u16) -> SocketAddr {
    let loopback =
        (master_addr, port).to_socket_addrs().ok().and_then(|mut a| a.next()).filter(|a| a.ip().is_loopback());
    match loopback {
        Some(addr) => addr,
        None => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
    }
}

impl Store for Rendezvous {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.store.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.store.add(key, delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.store.compare_set(key, expected, desired)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.store.wait(keys, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.store.check(keys)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.store.delete(key)
    }
    fn num_keys(&self) -> Result<u64> {
        self.store.num_keys()
    }
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.store.multi_get(keys, timeout)
    }
    fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<()> {
        self.store.multi_set(entries)
    }
}
