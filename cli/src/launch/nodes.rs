//! The launcher's nodes: the rendezvous through node 0's store, each
//! node's heartbeat and the watch on the others', and what UCX would take
//! for one machine.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::bootstrap::{ClientOptions, ServerOptions, Store, TcpStore, TcpStoreServer};

use super::{signal_name, stop_requested, Job, Plan, ENDED, HEARTBEAT};

/// What UCX compares to decide whether two processes are on one machine
/// (and may use shared memory): the kernel's boot id and the IPC namespace;
/// and the network namespace, which UCX does not compare but its
/// shared-memory wake-ups need.
#[derive(Debug, PartialEq)]
pub(super) struct MachineView {
    boot_id: String,
    ipc: String,
    net: String,
}

impl MachineView {
    pub(super) fn of_this_process() -> MachineView {
        let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default();
        let link = |path: &str| std::fs::read_link(path).map(|p| p.display().to_string()).unwrap_or_default();
        MachineView {
            boot_id: read("/proc/sys/kernel/random/boot_id"),
            ipc: link("/proc/self/ns/ipc"),
            net: link("/proc/self/ns/net"),
        }
    }

    pub(super) fn encode(&self) -> String {
        format!("{} {} {}", self.boot_id, self.ipc, self.net)
    }

    pub(super) fn decode(s: &str) -> Option<MachineView> {
        let mut parts = s.split(' ');
        let (boot_id, ipc, net) = (parts.next()?, parts.next()?, parts.next()?);
        Some(MachineView { boot_id: boot_id.into(), ipc: ipc.into(), net: net.into() })
    }

    /// The first two nodes (of their encoded views) that UCX would take for
    /// one machine although their network namespaces differ. A view that
    /// could not be read (an empty field) matches nothing.
    pub(super) fn shared_memory_across_networks(views: &[String]) -> Option<(usize, usize)> {
        let views: Vec<Option<MachineView>> = views.iter().map(|v| MachineView::decode(v)).collect();
        for (a, va) in views.iter().enumerate() {
            for (b, vb) in views.iter().enumerate().skip(a + 1) {
                let (Some(va), Some(vb)) = (va, vb) else { continue };
                let known = [&va.boot_id, &va.ipc, &va.net].iter().all(|f| !f.is_empty());
                if known && va.boot_id == vb.boot_id && va.ipc == vb.ipc && va.net != vb.net {
                    return Some((a, b));
                }
            }
        }
        None
    }
}

/// Bumps this node's heartbeat key every [`HEARTBEAT`] on a thread of its
/// own, so a launcher busy stopping its ranks still counts as alive; stops
/// when dropped.
pub(super) struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    pub(super) fn start(store: Arc<TcpStore>, key: String) -> anyhow::Result<Heartbeat> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    // A store that does not answer is noticed by the main thread.
                    let _ = store.add(&key, 1);
                    std::thread::sleep(HEARTBEAT);
                }
            })
            .context("starting the heartbeat thread")?;
        Ok(Heartbeat { stop })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The other nodes' heartbeats as last read, and when each last changed.
pub(super) struct NodeWatch {
    heard: Vec<Heard>,
}

/// One node's heartbeat as last read.
#[derive(Clone)]
struct Heard {
    beat: Vec<u8>,
    /// When it last changed, or when the watch began.
    since: Instant,
    /// When it was last seen to change between two reads: a launcher waiting
    /// to join counts as alive only then, not on a first read of a count
    /// that a dead launcher may have left behind.
    changed: Option<Instant>,
    read: bool,
}

/// Whether a launcher waiting to join is alive, as its heartbeat shows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Liveness {
    /// Its heartbeat changed within `--node-timeout`.
    Alive,
    /// Not known yet: not seen to change, and first read less than `--node-timeout` ago.
    Unknown,
    /// Unchanged for `--node-timeout`.
    Silent,
}

impl NodeWatch {
    pub(super) fn new(nnodes: usize) -> NodeWatch {
        NodeWatch { heard: vec![Heard { beat: Vec::new(), since: Instant::now(), changed: None, read: false }; nnodes] }
    }

    /// Reads `node`'s heartbeat once (absent counts as unchanged).
    fn read(&mut self, store: &TcpStore, plan: &Plan, node: usize) -> Result<&Heard, chorus_collectives::CommError> {
        let key = plan.key(&format!("alive/{node}"));
        let beat = if store.check(&[&key])? { store.get(&key, plan.node_timeout)? } else { Vec::new() };
        let heard = &mut self.heard[node];
        if heard.beat != beat {
            heard.beat = beat;
            heard.since = Instant::now();
            if heard.read {
                heard.changed = Some(heard.since);
            }
        }
        heard.read = true;
        Ok(heard)
    }

    /// Whether the launcher of `node`, waiting to join, is alive: its
    /// heartbeat seen to change within `--node-timeout`.
    pub(super) fn liveness(
        &mut self,
        store: &TcpStore,
        plan: &Plan,
        node: usize,
    ) -> Result<Liveness, chorus_collectives::CommError> {
        let heard = self.read(store, plan, node)?;
        Ok(match heard.changed {
            Some(at) if at.elapsed() < plan.node_timeout => Liveness::Alive,
            _ if heard.since.elapsed() >= plan.node_timeout => Liveness::Silent,
            _ => Liveness::Unknown,
        })
    }

    /// The first node among `nodes` (not this one) whose heartbeat has not
    /// changed for `--node-timeout` and that has not reported finishing
    /// (a finished launcher stops beating), with how long it has been silent.
    pub(super) fn silent(
        &mut self,
        store: &TcpStore,
        plan: &Plan,
        nodes: impl Iterator<Item = usize>,
    ) -> Result<Option<(usize, Duration)>, chorus_collectives::CommError> {
        for node in nodes.filter(|&n| n != plan.node_rank) {
            let since = self.read(store, plan, node)?.since;
            if since.elapsed() >= plan.node_timeout && !store.check(&[&plan.key(&format!("finished/{node}"))])? {
                return Ok(Some((node, since.elapsed())));
            }
        }
        Ok(None)
    }

    /// Reads every other node's heartbeat once; a node found silent is added
    /// to `silent` (once).
    pub(super) fn note_silent(
        &mut self,
        store: &TcpStore,
        plan: &Plan,
        members: &[usize],
        silent: &mut Vec<usize>,
    ) -> Result<(), chorus_collectives::CommError> {
        if let Some((node, _)) = self.silent(store, plan, members.iter().copied())? {
            if !silent.contains(&node) {
                silent.push(node);
            }
        }
        Ok(())
    }
}

/// What the nodes `nodes` published under `{name}/{node}`, indexed by node
/// (empty for the nodes of `0..--nnodes` not among them).
pub(super) fn per_node(
    store: &TcpStore,
    plan: &Plan,
    nodes: &[usize],
    name: &str,
) -> Result<Vec<String>, chorus_collectives::CommError> {
    let mut found = vec![String::new(); plan.nnodes];
    if nodes.is_empty() {
        return Ok(found);
    }
    let keys: Vec<String> = nodes.iter().map(|n| plan.key(&format!("{name}/{n}"))).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    for (node, v) in nodes.iter().zip(store.multi_get(&keys, plan.timeout)?) {
        found[*node] = String::from_utf8_lossy(&v).into_owned();
    }
    Ok(found)
}

/// The nodes the job starts with: every node of `--nnodes M`, once all have
/// joined (within `--timeout`); with `--nnodes MIN:MAX`, node 0 decides
/// (all MAX once they have joined, else at `--timeout` those that have,
/// at least MIN) and publishes them, and the others read them (waiting at
/// most twice `--timeout`: node 0 may start that much later and then wait
/// that long). A node left out gets `None`: it waits to join a later attempt.
fn first_members(store: &TcpStore, plan: &Plan, address: &str) -> anyhow::Result<Option<Vec<usize>>> {
    let node_keys: Vec<String> = (0..plan.nnodes).map(|n| plan.key(&format!("node/{n}"))).collect();
    let node_keys: Vec<&str> = node_keys.iter().map(String::as_str).collect();
    let all: Vec<usize> = (0..plan.nnodes).collect();
    let waiting = || format!("waiting for the {} nodes of run {:?} at {address}", plan.nnodes, plan.run_id);
    if !plan.elastic() {
        wait_interruptibly(store, &node_keys, plan.timeout).with_context(waiting)?;
        return Ok(Some(all));
    }
    let members_key = plan.key("members");
    if plan.node_rank == 0 {
        let members = match wait_interruptibly(store, &node_keys, plan.timeout) {
            Ok(()) => all,
            Err(e) if stop_requested().is_some() => return Err(e.context(waiting())),
            Err(_) => {
                let mut joined = Vec::new();
                for (n, key) in node_keys.iter().enumerate() {
                    if store.check(&[key])? {
                        joined.push(n);
                    }
                }
                if joined.len() < plan.min_nodes {
                    bail!(
                        "run {:?}: {} node(s) joined within --timeout ({joined:?}); --nnodes {}:{} needs at least {}",
                        plan.run_id,
                        joined.len(),
                        plan.min_nodes,
                        plan.nnodes,
                        plan.min_nodes
                    );
                }
                eprintln!(
                    "chorus launch: starting run {:?} with nodes {joined:?} of {} (--nnodes {}:{}): the others did \
                     not join within --timeout",
                    plan.run_id, plan.nnodes, plan.min_nodes, plan.nnodes
                );
                joined
            }
        };
        store.set(&members_key, encode_nodes(&members).as_bytes())?;
    } else {
        wait_interruptibly(store, &[&members_key], 2 * plan.timeout)
            .with_context(|| format!("waiting for node 0 to start run {:?} at {address}", plan.run_id))?;
    }
    let members = decode_nodes(&store.get(&members_key, plan.timeout)?)
        .with_context(|| format!("node 0's list of the nodes of run {:?}", plan.run_id))?;
    if !members.contains(&plan.node_rank) {
        eprintln!(
            "chorus launch: run {:?} started with nodes {members:?} without node {}, which joined after node 0's \
             --timeout",
            plan.run_id, plan.node_rank
        );
        return Ok(None);
    }
    Ok(Some(members))
}

/// A list of nodes as the store holds it: "0,1,3".
pub(super) fn encode_nodes(nodes: &[usize]) -> String {
    nodes.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// [`encode_nodes`]' list read back; `None` for anything else.
pub(super) fn decode_nodes(bytes: &[u8]) -> Option<Vec<usize>> {
    let text = std::str::from_utf8(bytes).ok()?;
    text.split(',').map(|n| n.parse().ok()).collect()
}

/// "node 1 on host h1": a node and the host its launcher runs on (as it
/// published it when joining).
pub(super) fn node_name(hosts: &[String], node: usize) -> String {
    match hosts.get(node).filter(|h| !h.is_empty()) {
        Some(host) => format!("node {node} on host {host}"),
        None => format!("node {node}"),
    }
}

/// "node 1 on host h1 has not been heard from for 5.2 s (its launcher is dead, hung or cut off)".
pub(super) fn describe_silence(node: &str, silent: Duration) -> String {
    format!("{node} has not been heard from for {:.1} s (its launcher is dead, hung or cut off)", silent.as_secs_f64())
}

/// Now, in microseconds since the Unix epoch.
pub(super) fn epoch_us() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.as_micros()).unwrap_or(u64::MAX)
}

/// Where node 0 listens: loopback stays loopback; any other address listens
/// on every interface so the other nodes reach it.
pub(super) fn listen_address(master_addr: &str, port: u16) -> SocketAddr {
    let resolved = (master_addr, port).to_socket_addrs().ok().and_then(|mut a| a.next());
    match resolved {
        Some(addr) if addr.ip().is_loopback() => addr,
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
    }
}

/// The key (under the job's) where node 0 keeps the attempt running now,
/// set once its first nodes are known: a launcher that finds it joins late.
pub(super) const STARTED_ATTEMPT: &str = "attempt";

/// The first nodes' rank counts and restart budgets agree with this node's.
fn check_first_members(store: &TcpStore, plan: &Plan, members: &[usize]) -> anyhow::Result<()> {
    let counts = per_node(store, plan, members, "node")?;
    for &node in members {
        let count = &counts[node];
        if *count != plan.nproc.to_string() {
            bail!(
                "node {node} runs {count} ranks and node {} runs {}: every node must use the same --nproc-per-node",
                plan.node_rank,
                plan.nproc
            );
        }
    }
    // Nodes that would give up after different numbers of restarts would
    // wait for each other at the restart one of them does not make.
    for (node, restarts) in per_node(store, plan, members, "restarts")?.iter().enumerate() {
        if members.contains(&node) && *restarts != plan.max_restarts.to_string() {
            bail!(
                "node {node} has --max-restarts {restarts} and node {} has {}: every node must use the same \
                 --max-restarts",
                plan.node_rank,
                plan.max_restarts
            );
        }
    }
    Ok(())
}

/// A launcher that finds its job started (or was left out at the start):
/// whether it may wait to be taken in at a restart. Returns the attempt
/// running now; every refusal comes at once, before this node publishes
/// anything but its launcher count (`launchers`: this one's place among
/// its node's launchers).
fn check_late(store: &TcpStore, plan: &Plan, launchers: i64) -> anyhow::Result<usize> {
    let (run, node) = (&plan.run_id, plan.node_rank);
    let text = |key: &str| -> anyhow::Result<String> {
        Ok(String::from_utf8_lossy(&store.get(&plan.key(key), plan.timeout)?).into_owned())
    };
    if store.check(&[&plan.key(ENDED)])? {
        bail!("run {run:?} has ended ({}): node {node} is not taken in", text(ENDED)?);
    }
    if !plan.elastic() {
        bail!(
            "run {run:?} has started on its fixed --nnodes {}: a node that comes back or joins late is taken in \
             only with --nnodes MIN:MAX",
            plan.nnodes
        );
    }
    let nnodes = format!("{}:{}", plan.min_nodes, plan.nnodes);
    let theirs = text("nnodes")?;
    if theirs != nnodes {
        bail!("run {run:?} has --nnodes {theirs} and node {node} has {nnodes}: every node must use the same --nnodes");
    }
    let restarts = text("restarts/0")?;
    if restarts != plan.max_restarts.to_string() {
        bail!(
            "node 0 has --max-restarts {restarts} and node {node} has {}: every node must use the same --max-restarts",
            plan.max_restarts
        );
    }
    let count = text("node/0")?;
    if count != plan.nproc.to_string() {
        bail!(
            "node 0 runs {count} ranks and node {node} runs {}: every node must use the same --nproc-per-node",
            plan.nproc
        );
    }
    let attempt = text(STARTED_ATTEMPT)?;
    let attempt: usize =
        attempt.parse().with_context(|| format!("node 0's attempt {attempt:?} is not a whole number"))?;
    if attempt >= plan.max_restarts {
        if plan.max_restarts == 0 {
            bail!(
                "run {run:?} has started, and no later attempt takes node {node} in: the job has no restarts \
                 (--max-restarts 0)"
            );
        }
        bail!(
            "run {run:?} is in its last attempt ({attempt}; --max-restarts {}): no restart is left to take node \
             {node} in",
            plan.max_restarts
        );
    }
    if launchers > 1 {
        previous_launcher_gone(store, plan)?;
    }
    Ok(attempt)
}

/// A launcher for a node that had one before: returns once the earlier one
/// has ended, or its heartbeat has not changed for `--node-timeout` (dead,
/// hung or cut off: it is replaced); one whose heartbeat still beats is
/// refused, so two launchers never run one node.
fn previous_launcher_gone(store: &TcpStore, plan: &Plan) -> anyhow::Result<()> {
    let node = plan.node_rank;
    let (alive, finished) = (plan.key(&format!("alive/{node}")), plan.key(&format!("finished/{node}")));
    if !store.check(&[&alive])? || store.check(&[&finished])? {
        return Ok(());
    }
    eprintln!(
        "chorus launch: node {node} of run {:?} had a launcher before; watching its heartbeat for --node-timeout \
         ({:.1} s) to be sure it is gone",
        plan.run_id,
        plan.node_timeout.as_secs_f64()
    );
    let first = store.get(&alive, plan.node_timeout)?;
    let start = Instant::now();
    loop {
        if let Some(signal) = stop_requested() {
            bail!("received {}", signal_name(signal));
        }
        if store.check(&[&finished])? {
            return Ok(());
        }
        if store.get(&alive, plan.node_timeout)? != first {
            bail!(
                "another launcher is running as node {node} of run {:?} (its heartbeat beats): a node's launcher is \
                 replaced only once the earlier one has ended or been silent for --node-timeout",
                plan.run_id
            );
        }
        if start.elapsed() >= plan.node_timeout {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The variables every rank gets for the nodes whose encoded views are
/// `views` (the shared-memory workaround; see the launcher's doc), said
/// where it applies.
pub(super) fn shared_memory_env(views: &[String]) -> Vec<(String, String)> {
    let mut rank_env = Vec::new();
    if let Some((a, b)) = MachineView::shared_memory_across_networks(views) {
        let why = format!(
            "nodes {a} and {b} share this machine's boot id and IPC namespace but not its network namespace: UCX \
             would join their ranks by shared memory, whose wake-ups do not cross network namespaces (each \
             message stalls ~100 ms)"
        );
        match std::env::var_os("UCX_TLS") {
            None => {
                eprintln!("chorus launch: {why}; the ranks get UCX_TLS=^sm (no shared-memory transports)");
                rank_env.push(("UCX_TLS".to_string(), "^sm".to_string()));
            }
            Some(tls) => eprintln!(
                "chorus launch: warning: {why}; UCX_TLS is set ({}), so it is left as it is (^sm avoids it)",
                tls.to_string_lossy()
            ),
        }
    }
    rank_env
}

impl Job {
    /// Hosts or joins the store and agrees with the other nodes on the job.
    /// A launcher that finds the job started (a node that comes back, or one
    /// that joins late), or that node 0 left out at the start, waits to be
    /// taken in at the next attempt ([`Job::wait_to_join`]).
    pub(super) fn rendezvous(plan: &Plan) -> anyhow::Result<Job> {
        let server = if plan.node_rank == 0 {
            let addr = listen_address(&plan.master_addr, plan.master_port);
            Some(
                TcpStoreServer::bind(addr, ServerOptions::default())
                    .with_context(|| format!("hosting the job's store on {addr}"))?,
            )
        } else {
            None
        };
        let port = server.as_ref().map_or(plan.master_port, TcpStoreServer::port);
        let address = format!("{}:{port}", plan.master_addr);
        let options = ClientOptions { connect_timeout: plan.timeout, ..ClientOptions::default() };
        let store = Arc::new(
            TcpStore::connect(&plan.master_addr, port, options)
                .with_context(|| format!("joining the job's store at {address}"))?,
        );
        let launchers = store.add(&plan.key(&format!("joined/{}", plan.node_rank)), 1)?;
        // Node 0 marks the job started once it knows its first nodes: from
        // then on a node joins only at a restart.
        let late = plan.nnodes > 1 && store.check(&[&plan.key(STARTED_ATTEMPT)])?;
        let mut joining = None;
        if late {
            joining = Some(check_late(&store, plan, launchers)?);
        } else if launchers > 1 {
            bail!(
                "another launcher already joined run {:?} as node {} at {address} while its nodes gather",
                plan.run_id,
                plan.node_rank
            );
        }
        let beat = plan.key(&format!("alive/{}", plan.node_rank));
        if plan.nnodes > 1 {
            // Before this node counts as joined: every node's key exists once all have.
            store.add(&beat, 1)?;
        }
        store
            .set(&plan.key(&format!("view/{}", plan.node_rank)), MachineView::of_this_process().encode().as_bytes())?;
        // Before the node key too: every host name exists once all nodes have joined.
        // The name the flight recorder gives this host's dumps, so summaries and `chorus trace` agree.
        let host = chorus_collectives::recorder::host_name();
        store.set(&plan.key(&format!("host/{}", plan.node_rank)), host.as_bytes())?;
        if plan.node_rank == 0 {
            // The job's start, the same on every node: every dump names it.
            store.set(&plan.key("started"), epoch_us().to_string().as_bytes())?;
            // What a node that joins late must agree with.
            store.set(&plan.key("nnodes"), format!("{}:{}", plan.min_nodes, plan.nnodes).as_bytes())?;
        }
        // Before the node key too: every node's restart budget exists once all have joined.
        store.set(&plan.key(&format!("restarts/{}", plan.node_rank)), plan.max_restarts.to_string().as_bytes())?;
        store.set(&plan.key(&format!("node/{}", plan.node_rank)), plan.nproc.to_string().as_bytes())?;
        let first = if late { None } else { first_members(&store, plan, &address)? };
        let members = match first {
            Some(members) => {
                check_first_members(&store, plan, &members)?;
                if plan.node_rank == 0 && plan.nnodes > 1 {
                    store.set(&plan.key(STARTED_ATTEMPT), b"0")?;
                }
                members
            }
            None => {
                if joining.is_none() {
                    // Left out by node 0 at the start: the first launcher of its node.
                    joining = Some(check_late(&store, plan, 1)?);
                }
                Vec::new()
            }
        };
        let started = store.get(&plan.key("started"), plan.timeout)?;
        let run_started_us = String::from_utf8_lossy(&started)
            .parse::<u64>()
            .with_context(|| format!("node 0's start time {:?} is not a number", String::from_utf8_lossy(&started)))?;
        let views = per_node(&store, plan, &members, "view")?;
        let hosts = per_node(&store, plan, &members, "host")?;
        let rank_env = shared_memory_env(&views);
        let (mut store, mut heartbeat, mut watch) = (store, None, None);
        if plan.nnodes > 1 {
            // From here on a store that does not answer within --node-timeout
            // means node 0 is dead or hung, not that the job is still gathering.
            let options = ClientOptions {
                connect_timeout: plan.node_timeout,
                io_timeout: plan.node_timeout,
                ..ClientOptions::default()
            };
            store = Arc::new(
                TcpStore::connect(&plan.master_addr, port, options)
                    .with_context(|| format!("joining the job's store at {address}"))?,
            );
            heartbeat = Some(Heartbeat::start(store.clone(), beat)?);
            watch = Some(NodeWatch::new(plan.nnodes));
        }
        let mut job = Job {
            server,
            store,
            address,
            ranks: Vec::new(),
            by_pid: HashMap::new(),
            running: 0,
            guardian: None,
            output: None,
            open_files: None,
            _heartbeat: heartbeat,
            watch,
            rank_env,
            store_lost: false,
            silent_nodes: Vec::new(),
            hosts,
            run_started_us,
            attempt: 0,
            _rank_server: None,
            rank_port: port,
            history: Vec::new(),
            members,
        };
        if let Some(attempt) = joining {
            job.wait_to_join(plan, attempt, launchers)?;
        }
        Ok(job)
    }

    /// Reads the other nodes' heartbeats once, noting a node found silent.
    pub(super) fn watch_heartbeats(&mut self, plan: &Plan) {
        if self.store_lost {
            return;
        }
        let Some(watch) = self.watch.as_mut() else { return };
        if let Err(e) = watch.note_silent(&self.store, plan, &self.members, &mut self.silent_nodes) {
            self.lose_store("reading the other nodes' heartbeats", &e);
        }
    }

    /// Publishes this node's failure for the other nodes, unless the store
    /// is already known lost (each request to a lost store costs the
    /// client's retry deadline).
    pub(super) fn tell_other_nodes(&mut self, plan: &Plan, what: &str) {
        if self.store_lost {
            return;
        }
        if let Err(e) = self.store.set(&self.attempt_key(plan, "failed"), what.as_bytes()) {
            self.lose_store("reporting the failure", &e);
        }
    }

    /// Notes that the job's store no longer answers: no later step asks it again.
    pub(super) fn lose_store(&mut self, during: &str, e: &chorus_collectives::CommError) {
        eprintln!(
            "chorus launch: lost the job's store at {} ({}) while {during}: {e}",
            self.address,
            node_name(&self.hosts, 0)
        );
        self.store_lost = true;
    }
}

/// Waits for `keys` in slices, so a stop signal ends the wait.
pub(super) fn wait_interruptibly(store: &dyn Store, keys: &[&str], timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(signal) = stop_requested() {
            bail!("received {}", signal_name(signal));
        }
        let slice = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
        match store.wait(keys, slice) {
            Ok(()) => return Ok(()),
            Err(chorus_collectives::CommError::Timeout { .. }) if Instant::now() < deadline => continue,
            Err(chorus_collectives::CommError::Timeout { .. }) => {
                let missing: Vec<&str> = keys.iter().copied().filter(|k| !store.check(&[k]).unwrap_or(false)).collect();
                bail!("timed out after {timeout:?}; missing {}", missing.join(", "));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_sharing_memory_but_not_the_network_are_found() {
        let view = |boot: &str, ipc: &str, net: &str| {
            MachineView { boot_id: boot.into(), ipc: ipc.into(), net: net.into() }.encode()
        };
        let find = MachineView::shared_memory_across_networks;
        // Containers on one machine sharing its IPC namespace, each its own network.
        assert_eq!(find(&[view("b", "ipc:[1]", "net:[7]"), view("b", "ipc:[1]", "net:[8]")]), Some((0, 1)));
        // Each its own IPC namespace (UCX uses TCP between them), or another machine, or one network.
        assert_eq!(find(&[view("b", "ipc:[1]", "net:[7]"), view("b", "ipc:[2]", "net:[8]")]), None);
        assert_eq!(find(&[view("b", "ipc:[1]", "net:[7]"), view("c", "ipc:[1]", "net:[8]")]), None);
        assert_eq!(find(&[view("b", "ipc:[1]", "net:[7]"), view("b", "ipc:[1]", "net:[7]")]), None);
        // The third node pairs with the first; unreadable views match nothing.
        let three = [view("b", "ipc:[1]", "net:[7]"), view("c", "ipc:[1]", "net:[8]"), view("b", "ipc:[1]", "net:[9]")];
        assert_eq!(find(&three), Some((0, 2)));
        assert_eq!(find(&[view("", "", ""), view("", "", "net:[8]")]), None);
        assert_eq!(find(&["garbage".to_string(), view("b", "ipc:[1]", "net:[8]")]), None);
        let here = MachineView::of_this_process();
        assert_eq!(MachineView::decode(&here.encode()), Some(here));
    }
}
