//! `chorus launch`: torchrun's role. Hosts the job's store on node 0 (or
//! joins node 0's), starts this node's ranks with torchrun's variables,
//! prefixes their output with `[rank R]`, and stops every rank when one
//! fails or the launcher is told to stop.
//!
//! Nothing a rank starts outlives the launcher: each rank runs in its own
//! process group (stopping a rank stops what it started, and a Ctrl-C
//! reaches the launcher, which stops the ranks in order: SIGTERM, then
//! SIGKILL after the grace period). A rank dies with the launcher through
//! `PR_SET_PDEATHSIG = SIGKILL`, and its whole group through the
//! [`guardian`], even when the launcher is killed by SIGKILL. When a rank
//! exits, whatever is left in its process group is killed at once (while
//! the exited rank still holds the group's id, which no other process can
//! then have).
//!
//! Start-up takes time linear in the rank count: one thread forwards every
//! rank's output ([`forward`]), exited ranks are reaped as they exit, and a
//! stop signal or a failed rank ends the start-up. The rank count is bounded
//! by what node 0's store serves (one connection per rank and per launcher)
//! and by the files the launcher may open.
//!
//! Nodes agree through the store, under `chorus/launch/<run id>/`: each
//! launcher registers its node rank and `--nproc-per-node` (a second
//! launcher with the same node rank, or nodes with different rank counts,
//! are errors before any rank starts); the first node whose rank fails
//! publishes it and the others stop their ranks and name it; node 0 keeps
//! the store up until every node has finished.
//!
//! A node that dies or hangs cannot publish anything: every launcher of a
//! multi-node job bumps its heartbeat key every [`HEARTBEAT`] from a thread
//! of its own, and watches the others'. A node not heard from for
//! `--node-timeout` (the store not answering within it, for node 0) has
//! failed: the first launcher to see it publishes it and every node stops
//! its ranks, so a dead or hung host ends the job within seconds instead of
//! `--timeout`.
//!
//! UCX takes two processes with the same boot id and IPC namespace for one
//! machine and joins them by shared memory, whose wake-ups (abstract Unix
//! sockets) do not cross network namespaces: nodes that are containers
//! sharing a machine's IPC namespace but not its network stall about 100 ms
//! per message. Each launcher publishes what UCX compares ([`MachineView`]);
//! where two nodes would be joined that way, the ranks get
//! `UCX_TLS=^sm` (no shared memory) unless `UCX_TLS` is set, and the
//! launcher says so.

mod dumps;
mod forward;
mod guardian;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::bootstrap::{ClientOptions, ServerOptions, Store, TcpStore, TcpStoreServer};
use clap::Args;

use crate::{Outcome, UsageError};

/// Arguments of `chorus launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Ranks (processes) to start on this node; the job's ranks and launchers together at most the
    /// connections node 0's store serves (1024: 1023 ranks on one node).
    #[arg(long, value_name = "N")]
    pub nproc_per_node: usize,
    /// Nodes in the job; every node runs `chorus launch` with the same arguments but --node-rank.
    #[arg(long, default_value_t = 1, value_name = "M")]
    pub nnodes: usize,
    /// This node's index, 0..M; node 0 hosts the store.
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub node_rank: usize,
    /// Host of the store (node 0), as the other nodes reach it.
    #[arg(long, default_value = "127.0.0.1", value_name = "A")]
    pub master_addr: String,
    /// Port of the store [default: a free port on one node, 29500 on several].
    #[arg(long, value_name = "P")]
    pub master_port: Option<u16>,
    /// Seconds to wait for the store and for the other nodes to join.
    #[arg(long, default_value_t = 300.0, value_name = "S")]
    pub timeout: f64,
    /// Seconds without a heartbeat from another node's launcher (or an answer from node 0's store)
    /// after which that node counts as dead or hung and the job is stopped; several nodes only.
    /// Shorter detects a dead host sooner; too short stops a job whose launcher was merely starved
    /// of CPU for that long.
    #[arg(long, default_value_t = 5.0, value_name = "S")]
    pub node_timeout: f64,
    /// Seconds a rank gets between SIGTERM and SIGKILL when ranks are stopped.
    #[arg(long, default_value_t = 5.0, value_name = "S")]
    pub grace: f64,
    /// The job's name, the same on every node (TORCHELASTIC_RUN_ID).
    #[arg(long, default_value = "none")]
    pub run_id: String,
    /// The program to run as every rank, and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "PROGRAM ARGS")]
    pub command: Vec<String>,
}

/// How often each launcher of a multi-node job bumps its heartbeat key.
const HEARTBEAT: Duration = Duration::from_millis(500);

/// The last signal that asked the launcher to stop (0: none).
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    // Only an atomic store: the one thing a signal handler may safely do here.
    STOP_SIGNAL.store(signal, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `on_stop_signal` is an `extern "C"` function that only
        // stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(signal, on_stop_signal as *const () as libc::sighandler_t);
        }
    }
}

fn stop_requested() -> Option<i32> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `chorus launch`.
pub fn run(args: &LaunchArgs) -> anyhow::Result<Outcome> {
    let plan = Plan::from_args(args)?;
    let open_files = raise_open_file_limit(&plan)?;
    install_signal_handlers();
    let mut job = Job::rendezvous(&plan)?;
    job.open_files = open_files;
    let outcome = job.run_ranks(&plan);
    job.finish(&plan);
    outcome
}

/// The validated arguments.
struct Plan {
    nproc: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: u16,
    timeout: Duration,
    node_timeout: Duration,
    grace: Duration,
    run_id: String,
    program: String,
    args: Vec<String>,
    /// Where the ranks' flight recorders write their dumps (CHORUS_TRACE_DIR).
    trace_dir: std::path::PathBuf,
}

/// The ranks' dump directory: the launcher's own `CHORUS_TRACE_DIR`, else
/// `./chorus-trace/<run id>` (a run id of `none` is replaced by the time and pid).
fn trace_dir(run_id: &str) -> anyhow::Result<std::path::PathBuf> {
    use chorus_collectives::recorder::DIR_VAR;
    if let Some(dir) = std::env::var_os(DIR_VAR).filter(|d| !d.is_empty()) {
        return Ok(dir.into());
    }
    let name = if run_id == "none" {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        format!("{secs}-{}", std::process::id())
    } else {
        run_id.to_string()
    };
    let cwd = std::env::current_dir().context("reading the current directory (for ./chorus-trace)")?;
    Ok(cwd.join("chorus-trace").join(name))
}

fn seconds(name: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| UsageError(format!("{name} {value} is not a number of seconds")).into())
}

impl Plan {
    /// Checks everything before anything starts; problems are usage errors (exit 2).
    fn from_args(a: &LaunchArgs) -> anyhow::Result<Plan> {
        let usage = |m: String| -> anyhow::Error { UsageError(m).into() };
        if a.nproc_per_node == 0 {
            return Err(usage("--nproc-per-node must be at least 1".into()));
        }
        if a.nnodes == 0 {
            return Err(usage("--nnodes must be at least 1".into()));
        }
        // Every rank of a job (chorus's commands, PyTorch's) holds a connection
        // to node 0's store, and so does every launcher: more ranks than the
        // store serves would fail one by one as they start.
        let connections = ServerOptions::default().max_connections;
        let per_node = connections.saturating_sub(a.nnodes) / a.nnodes;
        if per_node == 0 {
            return Err(usage(format!(
                "--nnodes {}: node 0's store serves {connections} connections, one per launcher and one per rank; \
                 at most {} nodes",
                a.nnodes,
                connections / 2
            )));
        }
        if a.nproc_per_node > per_node {
            return Err(usage(format!(
                "--nproc-per-node {}: at most {per_node} ranks per node on {} node(s) (node 0's store serves \
                 {connections} connections, one per rank and one per launcher)",
                a.nproc_per_node, a.nnodes
            )));
        }
        if a.node_rank >= a.nnodes {
            return Err(usage(format!("--node-rank {} must be below --nnodes {}", a.node_rank, a.nnodes)));
        }
        if a.master_addr.trim().is_empty() {
            return Err(usage("--master-addr is empty".into()));
        }
        let master_port = a.master_port.unwrap_or(if a.nnodes == 1 { 0 } else { 29500 });
        if master_port == 0 && a.nnodes > 1 {
            return Err(usage(
                "--master-port 0 (pick a free port) works on one node only: the other nodes must know the port".into(),
            ));
        }
        let timeout = seconds("--timeout", a.timeout)?;
        if timeout.is_zero() {
            return Err(usage("--timeout must be positive".into()));
        }
        let node_timeout = seconds("--node-timeout", a.node_timeout)?;
        if node_timeout < 2 * HEARTBEAT {
            return Err(usage(format!(
                "--node-timeout {}: at least {} s (two heartbeats)",
                a.node_timeout,
                (2 * HEARTBEAT).as_secs_f64()
            )));
        }
        let grace = seconds("--grace", a.grace)?;
        if a.run_id.is_empty() || a.run_id.contains('/') {
            return Err(usage(format!("--run-id {:?} must be a non-empty name without '/'", a.run_id)));
        }
        let (program, args) =
            a.command.split_first().ok_or_else(|| usage("no program to run (give it after `--`)".into()))?;
        if !is_runnable(program) {
            return Err(usage(format!("program {program:?} not found (or not executable)")));
        }
        Ok(Plan {
            nproc: a.nproc_per_node,
            nnodes: a.nnodes,
            node_rank: a.node_rank,
            master_addr: a.master_addr.trim().to_string(),
            master_port,
            timeout,
            node_timeout,
            grace,
            run_id: a.run_id.clone(),
            program: program.clone(),
            args: args.to_vec(),
            trace_dir: trace_dir(&a.run_id)?,
        })
    }

    fn world_size(&self) -> usize {
        self.nproc * self.nnodes
    }

    /// Files the launcher holds open at most: two pipes per rank of this
    /// node, on node 0 the store's connection of every rank and launcher of
    /// the job, and a reserve for its own (the store's socket, the guardian's
    /// pipe, the epoll set, the standard streams, the ranks' start-up).
    fn open_files_needed(&self) -> u64 {
        let store = if self.node_rank == 0 { self.world_size() + self.nnodes } else { 0 };
        (2 * self.nproc + store + 64) as u64
    }

    /// The store keys of this job.
    fn key(&self, rest: &str) -> String {
        format!("chorus/launch/{}/{rest}", self.run_id)
    }
}

/// Raises the launcher's open-file limit to `needed` where it is lower (up
/// to the hard limit); returns the limit it had, which the ranks get back.
/// A hard limit below `needed` is a usage error, before anything starts.
fn raise_open_file_limit(plan: &Plan) -> anyhow::Result<Option<libc::rlimit>> {
    let needed = plan.open_files_needed();
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit fills the struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error()).context("reading the open-file limit");
    }
    let infinite = |v: libc::rlim_t| v == libc::RLIM_INFINITY;
    if infinite(limit.rlim_cur) || limit.rlim_cur >= needed {
        return Ok(None);
    }
    if !infinite(limit.rlim_max) && limit.rlim_max < needed {
        return Err(UsageError(format!(
            "--nproc-per-node {} needs about {needed} open files in the launcher (two pipes per rank, and on \
             node 0 the store's connection of every rank); the limit is {} (`ulimit -Hn`)",
            plan.nproc, limit.rlim_max
        ))
        .into());
    }
    let raised = libc::rlimit { rlim_cur: needed, rlim_max: limit.rlim_max };
    // SAFETY: setrlimit reads the struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("raising the open-file limit to {needed}"));
    }
    Ok(Some(limit))
}

/// Whether `program` names an executable file, directly or on `PATH`.
fn is_runnable(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| executable(&dir.join(program))))
}

/// One rank of this node.
struct Rank {
    rank: usize,
    local_rank: usize,
    pid: libc::pid_t,
    status: Option<ExitStatus>,
    /// When the launcher sent it a signal (it was stopped, not failed).
    stopped: bool,
}

/// The store, the ranks, the guardian and the output thread.
struct Job {
    server: Option<TcpStoreServer>,
    store: Arc<TcpStore>,
    address: String,
    /// The ranks started so far, in local-rank order.
    ranks: Vec<Rank>,
    /// Index in `ranks` of each rank's pid.
    by_pid: HashMap<libc::pid_t, usize>,
    /// Ranks started and not yet reaped.
    running: usize,
    guardian: Option<guardian::Guardian>,
    output: Option<forward::Forwarder>,
    /// The open-file limit to give back to the ranks, where the launcher raised its own.
    open_files: Option<libc::rlimit>,
    /// This node's heartbeat (beating until the launcher exits) and its
    /// watch on the others' (several nodes only).
    _heartbeat: Option<Heartbeat>,
    watch: Option<NodeWatch>,
    /// Variables every rank gets besides torchrun's (the shared-memory workaround).
    rank_env: Vec<(String, String)>,
    /// Node 0's store did not answer: nothing more is sent to it (each try would wait --node-timeout).
    store_lost: bool,
    /// Nodes found silent (dead, hung or cut off): not waited for again.
    silent_nodes: Vec<usize>,
    /// Each node's host name, as its launcher published it.
    hosts: Vec<String>,
}

/// What UCX compares to decide whether two processes are on one machine
/// (and may use shared memory): the kernel's boot id and the IPC namespace;
/// and the network namespace, which UCX does not compare but its
/// shared-memory wake-ups need.
#[derive(Debug, PartialEq)]
struct MachineView {
    boot_id: String,
    ipc: String,
    net: String,
}

impl MachineView {
    fn of_this_process() -> MachineView {
        let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default();
        let link = |path: &str| std::fs::read_link(path).map(|p| p.display().to_string()).unwrap_or_default();
        MachineView {
            boot_id: read("/proc/sys/kernel/random/boot_id"),
            ipc: link("/proc/self/ns/ipc"),
            net: link("/proc/self/ns/net"),
        }
    }

    fn encode(&self) -> String {
        format!("{} {} {}", self.boot_id, self.ipc, self.net)
    }

    fn decode(s: &str) -> Option<MachineView> {
        let mut parts = s.split(' ');
        let (boot_id, ipc, net) = (parts.next()?, parts.next()?, parts.next()?);
        Some(MachineView { boot_id: boot_id.into(), ipc: ipc.into(), net: net.into() })
    }

    /// The first two nodes (of their encoded views) that UCX would take for
    /// one machine although their network namespaces differ. A view that
    /// could not be read (an empty field) matches nothing.
    fn shared_memory_across_networks(views: &[String]) -> Option<(usize, usize)> {
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
struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    fn start(store: Arc<TcpStore>, key: String) -> anyhow::Result<Heartbeat> {
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
struct NodeWatch {
    heard: Vec<(Vec<u8>, Instant)>,
}

impl NodeWatch {
    fn new(nnodes: usize) -> NodeWatch {
        NodeWatch { heard: vec![(Vec::new(), Instant::now()); nnodes] }
    }

    /// The first node among `nodes` (not this one) whose heartbeat has not
    /// changed for `--node-timeout` and that has not reported finishing
    /// (a finished launcher stops beating), with how long it has been silent.
    fn silent(
        &mut self,
        store: &TcpStore,
        plan: &Plan,
        nodes: impl Iterator<Item = usize>,
    ) -> Result<Option<(usize, Duration)>, chorus_collectives::CommError> {
        for node in nodes.filter(|&n| n != plan.node_rank) {
            let beat = store.get(&plan.key(&format!("alive/{node}")), plan.node_timeout)?;
            let (last, since) = &mut self.heard[node];
            if *last != beat {
                *last = beat;
                *since = Instant::now();
            } else if since.elapsed() >= plan.node_timeout && !store.check(&[&plan.key(&format!("finished/{node}"))])? {
                return Ok(Some((node, since.elapsed())));
            }
        }
        Ok(None)
    }

    /// Reads every other node's heartbeat once; a node found silent is added
    /// to `silent` (once).
    fn note_silent(
        &mut self,
        store: &TcpStore,
        plan: &Plan,
        silent: &mut Vec<usize>,
    ) -> Result<(), chorus_collectives::CommError> {
        if let Some((node, _)) = self.silent(store, plan, 0..plan.nnodes)? {
            if !silent.contains(&node) {
                silent.push(node);
            }
        }
        Ok(())
    }
}

/// What every node published under `{name}/{node}`, in node order.
fn per_node(store: &TcpStore, plan: &Plan, name: &str) -> Result<Vec<String>, chorus_collectives::CommError> {
    let keys: Vec<String> = (0..plan.nnodes).map(|n| plan.key(&format!("{name}/{n}"))).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    Ok(store.multi_get(&keys, plan.timeout)?.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect())
}

/// "node 1 on host h1": a node and the host its launcher runs on (as it
/// published it when joining).
fn node_name(hosts: &[String], node: usize) -> String {
    match hosts.get(node) {
        Some(host) => format!("node {node} on host {host}"),
        None => format!("node {node}"),
    }
}

/// "node 1 on host h1 has not been heard from for 5.2 s (its launcher is dead, hung or cut off)".
fn describe_silence(node: &str, silent: Duration) -> String {
    format!("{node} has not been heard from for {:.1} s (its launcher is dead, hung or cut off)", silent.as_secs_f64())
}

/// Where node 0 listens: loopback stays loopback; any other address listens
/// on every interface so the other nodes reach it.
fn listen_address(master_addr: &str, port: u16) -> SocketAddr {
    let resolved = (master_addr, port).to_socket_addrs().ok().and_then(|mut a| a.next());
    match resolved {
        Some(addr) if addr.ip().is_loopback() => addr,
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
    }
}

impl Job {
    /// Hosts or joins the store and agrees with the other nodes on the job.
    fn rendezvous(plan: &Plan) -> anyhow::Result<Job> {
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
        let joined = store.add(&plan.key(&format!("joined/{}", plan.node_rank)), 1)?;
        if joined > 1 {
            bail!("another launcher already joined run {:?} as node {} at {address}", plan.run_id, plan.node_rank);
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
        store.set(&plan.key(&format!("node/{}", plan.node_rank)), plan.nproc.to_string().as_bytes())?;
        let node_keys: Vec<String> = (0..plan.nnodes).map(|n| plan.key(&format!("node/{n}"))).collect();
        let node_keys: Vec<&str> = node_keys.iter().map(String::as_str).collect();
        wait_interruptibly(&*store, &node_keys, plan.timeout)
            .with_context(|| format!("waiting for the {} nodes of run {:?} at {address}", plan.nnodes, plan.run_id))?;
        let counts = store.multi_get(&node_keys, plan.timeout)?;
        for (node, count) in counts.iter().enumerate() {
            if count != plan.nproc.to_string().as_bytes() {
                bail!(
                    "node {node} runs {} ranks and node {} runs {}: every node must use the same --nproc-per-node",
                    String::from_utf8_lossy(count),
                    plan.node_rank,
                    plan.nproc
                );
            }
        }
        let views = per_node(&store, plan, "view")?;
        let hosts = per_node(&store, plan, "host")?;
        let mut rank_env = Vec::new();
        if let Some((a, b)) = MachineView::shared_memory_across_networks(&views) {
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
        Ok(Job {
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
        })
    }

    /// Starts the ranks and watches them until all have exited; the outcome
    /// of the job as seen from this node. A stop signal, a failed rank or a
    /// failure on another node ends the start-up at once.
    fn run_ranks(&mut self, plan: &Plan) -> anyhow::Result<Outcome> {
        self.output = Some(forward::Forwarder::start().context("starting the thread that forwards the ranks' output")?);
        self.guardian = Some(
            guardian::Guardian::start(plan.nproc)
                .context("starting the guardian that kills the ranks if the launcher dies")?,
        );
        let mut failure: Option<String> = None;
        let mut last_remote_check = Instant::now();
        loop {
            if let Some(signal) = stop_requested() {
                if failure.is_none() {
                    let what = format!("the launcher of node {} received {}", plan.node_rank, signal_name(signal));
                    self.tell_other_nodes(plan, &what);
                    failure = Some(what);
                    self.stop(plan.grace);
                }
            }
            for i in self.reap() {
                let (r, status) = (&self.ranks[i], self.ranks[i].status);
                if let Some(status) = status.filter(|s| failure.is_none() && !s.success()) {
                    let what = format!(
                        "rank {} ({}, local rank {}, pid {}) {}",
                        r.rank,
                        node_name(&self.hosts, plan.node_rank),
                        r.local_rank,
                        r.pid,
                        describe(status)
                    );
                    eprintln!("chorus launch: {what}; stopping the other ranks");
                    // Tell the other nodes; if the store is gone they find out themselves.
                    self.tell_other_nodes(plan, &what);
                    failure = Some(what);
                }
            }
            if failure.is_some() && self.running > 0 {
                self.stop(plan.grace);
            }
            let starting = failure.is_none() && self.ranks.len() < plan.nproc;
            if !starting && self.running == 0 {
                break;
            }
            if plan.nnodes > 1 && failure.is_some() && last_remote_check.elapsed() >= Duration::from_millis(250) {
                // While the ranks stop, keep reading the others' heartbeats: a
                // silence is timed from the last change seen, so a gap in
                // watching would push a dead node's detection later.
                last_remote_check = Instant::now();
                self.watch_heartbeats(plan);
            }
            if plan.nnodes > 1 && failure.is_none() && last_remote_check.elapsed() >= Duration::from_millis(250) {
                last_remote_check = Instant::now();
                let remote = match self.store.check(&[&plan.key("failed")]) {
                    Ok(false) => None,
                    Ok(true) => Some(match self.store.get(&plan.key("failed"), Duration::from_secs(5)) {
                        Ok(v) => String::from_utf8_lossy(&v).into_owned(),
                        Err(e) => format!("another node failed (its report is unreadable: {e})"),
                    }),
                    Err(e) => {
                        self.store_lost = true;
                        Some(format!("lost the job's store at {} ({}): {e}", self.address, node_name(&self.hosts, 0)))
                    }
                };
                let remote = remote.or_else(|| match self.watch.as_mut()?.silent(&self.store, plan, 0..plan.nnodes) {
                    Ok(None) => None,
                    Ok(Some((node, silent))) => {
                        self.silent_nodes.push(node);
                        let what = describe_silence(&node_name(&self.hosts, node), silent);
                        // Best effort and bounded: the failure is this node's own finding.
                        let _ = self.store.set(&plan.key("failed"), what.as_bytes());
                        Some(what)
                    }
                    Err(e) => {
                        self.store_lost = true;
                        Some(format!("lost the job's store at {} ({}): {e}", self.address, node_name(&self.hosts, 0)))
                    }
                });
                if let Some(what) = remote {
                    eprintln!("chorus launch: {what}; stopping the ranks of node {}", plan.node_rank);
                    failure = Some(what);
                    self.stop(plan.grace);
                    continue;
                }
            }
            if starting {
                if let Err(e) = self.spawn(plan, self.ranks.len()) {
                    self.stop(plan.grace);
                    self.kill_unreaped_groups();
                    self.finish_output();
                    return Err(e);
                }
            } else {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill_unreaped_groups();
        self.finish_output();
        match failure {
            None => Ok(Outcome::Passed),
            Some(what) => {
                eprintln!("chorus launch: failed: {what}");
                for r in &self.ranks {
                    let status = r.status.map_or_else(|| "still running".to_string(), describe);
                    let how = if r.stopped { format!("stopped by the launcher ({status})") } else { status };
                    eprintln!("  rank {} (local rank {}, pid {}): {how}", r.rank, r.local_rank, r.pid);
                }
                let started = self.ranks.len();
                if started < plan.nproc {
                    let first = plan.node_rank * plan.nproc;
                    eprintln!(
                        "  ranks {}..={} (local ranks {started}..={}): not started",
                        first + started,
                        first + plan.nproc - 1,
                        plan.nproc - 1
                    );
                }
                self.gather_dumps(plan);
                let dumps = std::fs::read_dir(&plan.trace_dir).map_or(0, |d| d.count());
                if dumps > 0 {
                    eprintln!(
                        "chorus launch: the ranks' flight-recorder dumps are in {} (read them with `chorus trace {}`)",
                        plan.trace_dir.display(),
                        plan.trace_dir.display()
                    );
                }
                Ok(Outcome::Failed)
            }
        }
    }

    fn spawn(&mut self, plan: &Plan, local_rank: usize) -> anyhow::Result<()> {
        let rank = plan.node_rank * plan.nproc + local_rank;
        let port = self.server.as_ref().map_or(plan.master_port, TcpStoreServer::port);
        let vars: [(&str, String); 16] = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", plan.world_size().to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", plan.nproc.to_string()),
            ("GROUP_RANK", plan.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", plan.nnodes.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_WORLD_SIZE", plan.world_size().to_string()),
            ("ROLE_NAME", "default".into()),
            ("MASTER_ADDR", plan.master_addr.clone()),
            ("MASTER_PORT", port.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            ("TORCHELASTIC_MAX_RESTARTS", "0".into()),
            ("TORCHELASTIC_RUN_ID", plan.run_id.clone()),
            (
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                std::env::var("TORCH_NCCL_ASYNC_ERROR_HANDLING").unwrap_or_else(|_| "1".into()),
            ),
        ];
        let mut command = Command::new(&plan.program);
        command
            .args(&plan.args)
            .envs(vars)
            .envs(self.rank_env.iter().map(|(k, v)| (k, v)))
            .env(chorus_collectives::recorder::DIR_VAR, &plan.trace_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let launcher = std::process::id() as libc::pid_t;
        let open_files = self.open_files;
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (setrlimit, prctl, getppid),
        // allocating nothing.
        unsafe {
            command.pre_exec(move || {
                // The rank gets the open-file limit the launcher was given.
                if let Some(limit) = open_files {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // The death signal follows the thread that forked: ranks are
                // spawned from the main thread, which lives as long as the launcher.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died between fork and prctl: no signal will come.
                if libc::getppid() != launcher {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let mut child = command.spawn().with_context(|| format!("starting rank {rank}: {}", plan.program))?;
        // Reaped by `reap` (waitid on any child), not through `child`.
        let pid = child.id() as libc::pid_t;
        if let Some(g) = self.guardian.as_mut() {
            g.record(local_rank, pid);
        }
        self.by_pid.insert(pid, self.ranks.len());
        self.ranks.push(Rank { rank, local_rank, pid, status: None, stopped: false });
        self.running += 1;
        let pipes = [
            child.stdout.take().map(|p| (OwnedFd::from(p), false)),
            child.stderr.take().map(|p| (OwnedFd::from(p), true)),
        ];
        if let Some(output) = &self.output {
            for (pipe, stderr) in pipes.into_iter().flatten() {
                output.add(pipe, rank, stderr).with_context(|| format!("forwarding the output of rank {rank}"))?;
            }
        }
        Ok(())
    }

    /// Reaps every child that has exited; returns the indices of the ranks
    /// among them. Before a rank is reaped, whatever is left in its process
    /// group is killed and the guardian forgets the group: while the exited
    /// rank is unreaped its pid is taken, so the group id names no other group.
    fn reap(&mut self) -> Vec<usize> {
        let mut exited = Vec::new();
        loop {
            // SAFETY: waitid fills `info`; WNOWAIT leaves the child unreaped.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let found =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
            // SAFETY: waitid filled `info` for an exited child (si_pid 0: none).
            let pid = unsafe { info.si_pid() };
            if found != 0 || pid == 0 {
                // ECHILD (no children), EINTR (tried again at the next call) or nothing exited.
                return exited;
            }
            let index = self.by_pid.get(&pid).copied();
            if let Some(i) = index {
                signal_group(pid, libc::SIGKILL);
                if let Some(g) = self.guardian.as_mut() {
                    g.withdraw(self.ranks[i].local_rank);
                }
            }
            let mut raw = 0;
            // SAFETY: waitpid reaps the child found above.
            if unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) } != pid {
                return exited;
            }
            match index {
                Some(i) => {
                    self.ranks[i].status = Some(ExitStatus::from_raw(raw));
                    self.running -= 1;
                    exited.push(i);
                }
                None => {
                    if let Some(g) = self.guardian.as_mut().filter(|g| g.pid() == pid) {
                        g.exited();
                    }
                }
            }
        }
    }

    /// SIGTERM to every running rank's process group, SIGKILL after `grace`.
    fn stop(&mut self, grace: Duration) {
        for r in self.ranks.iter_mut().filter(|r| r.status.is_none() && !r.stopped) {
            r.stopped = true;
            signal_group(r.pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while self.running > 0 && Instant::now() < deadline {
            self.reap();
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill_unreaped_groups();
        // SIGKILL cannot be caught; a process stuck in the kernel may still take a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            self.reap();
            if self.running == 0 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL to the process group of every rank not reaped yet (each
    /// reaped rank's group was killed when it was reaped).
    fn kill_unreaped_groups(&self) {
        for r in self.ranks.iter().filter(|r| r.status.is_none()) {
            signal_group(r.pid, libc::SIGKILL);
        }
    }

    /// Reads the other nodes' heartbeats once, noting a node found silent.
    fn watch_heartbeats(&mut self, plan: &Plan) {
        if self.store_lost {
            return;
        }
        let Some(watch) = self.watch.as_mut() else { return };
        if let Err(e) = watch.note_silent(&self.store, plan, &mut self.silent_nodes) {
            self.lose_store("reading the other nodes' heartbeats", &e);
        }
    }

    /// Publishes this node's failure for the other nodes, unless the store
    /// is already known lost (each request to a lost store costs the
    /// client's retry deadline).
    fn tell_other_nodes(&mut self, plan: &Plan, what: &str) {
        if self.store_lost {
            return;
        }
        if let Err(e) = self.store.set(&plan.key("failed"), what.as_bytes()) {
            self.lose_store("reporting the failure", &e);
        }
    }

    /// Notes that the job's store no longer answers: no later step asks it again.
    fn lose_store(&mut self, during: &str, e: &chorus_collectives::CommError) {
        eprintln!(
            "chorus launch: lost the job's store at {} ({}) while {during}: {e}",
            self.address,
            node_name(&self.hosts, 0)
        );
        self.store_lost = true;
    }

    /// Brings the other nodes' flight-recorder dumps into this node's dump
    /// directory (several nodes, store still up), saying what is missing.
    fn gather_dumps(&mut self, plan: &Plan) {
        if plan.nnodes == 1 || self.store_lost {
            return;
        }
        let ranks: HashSet<usize> = self.ranks.iter().map(|r| r.rank).collect();
        let key = |rest: &str| plan.key(&format!("dumps/{rest}"));
        // While waiting, the heartbeats are still read: a node that falls
        // silent is not waited for, and the silence is timed from fresh reads.
        let (store, watch, silent) = (&self.store, &mut self.watch, &mut self.silent_nodes);
        let gone = || {
            if let Some(w) = watch.as_mut() {
                w.note_silent(store, plan, silent)?;
            }
            Ok(silent.clone())
        };
        // A node publishes once its ranks have ended: a rank that ignores SIGTERM
        // (stopped, stuck) holds it for the grace period before SIGKILL.
        let wait = plan.grace + dumps::WAIT;
        let here = dumps::Node { index: plan.node_rank, count: plan.nnodes, ranks: &ranks, dir: &plan.trace_dir };
        let got = match dumps::exchange(&**store, key, &here, wait, gone) {
            Ok(got) => got,
            Err(e) => {
                self.lose_store("gathering the flight-recorder dumps", &e);
                return;
            }
        };
        if got.fetched > 0 {
            eprintln!("chorus launch: fetched {} flight-recorder dumps of the other nodes", got.fetched);
        }
        for node in got.missing {
            eprintln!(
                "chorus launch: no flight-recorder dumps from {} within {:?} of the failure (dead, hung or cut off; \
                 any its ranks wrote stay on its host)",
                node_name(&self.hosts, node),
                wait
            );
        }
    }

    /// Waits (at most a second) for the last output lines; a process that
    /// left the rank's group may hold a pipe open, and is not waited for.
    fn finish_output(&mut self) {
        if let Some(mut output) = self.output.take() {
            output.finish(Duration::from_secs(1));
        }
    }

    /// Reports this node finished; node 0 keeps the store up until every
    /// node has finished or gone silent.
    fn finish(&mut self, plan: &Plan) {
        if self.store_lost {
            return;
        }
        let _ = self.store.set(&plan.key(&format!("finished/{}", plan.node_rank)), b"1");
        if self.server.is_none() || plan.nnodes == 1 {
            return;
        }
        // After a stop signal only the grace period is left to wait.
        let limit = if stop_requested().is_some() { plan.grace + Duration::from_secs(2) } else { plan.timeout };
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let finished = |n: &usize| self.store.check(&[&plan.key(&format!("finished/{n}"))]).unwrap_or(true);
            let pending: Vec<usize> = (0..plan.nnodes).filter(|n| !finished(n)).collect();
            if pending.is_empty() {
                return;
            }
            if let Some(watch) = self.watch.as_mut() {
                if let Ok(Some((node, silent))) = watch.silent(&self.store, plan, pending.into_iter()) {
                    eprintln!(
                        "chorus launch: {} and did not report finishing; stopping the store",
                        describe_silence(&node_name(&self.hosts, node), silent)
                    );
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("chorus launch: not every node reported finishing within {limit:?}; stopping the store");
    }
}

/// Waits for `keys` in slices, so a stop signal ends the wait.
fn wait_interruptibly(store: &dyn Store, keys: &[&str], timeout: Duration) -> anyhow::Result<()> {
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

fn signal_group(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    // Each rank leads its own group (pgid = pid); ESRCH (already gone) is fine.
    unsafe {
        libc::kill(-pid, signal);
    }
}

/// "exited with code 3", "was killed by signal 9 (SIGKILL)".
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal} ({})", signal_name(signal)),
        _ => format!("ended with status {status}"),
    }
}

fn signal_name(signal: i32) -> String {
    let names: HashMap<i32, &str> = [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGUSR2, "SIGUSR2"),
    ]
    .into_iter()
    .collect();
    names.get(&signal).map_or_else(|| format!("signal {signal}"), |n| n.to_string())
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

    #[test]
    fn statuses_are_described_with_code_or_signal() {
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exited with code 3");
        assert_eq!(describe(ExitStatus::from_raw(9)), "was killed by signal 9 (SIGKILL)");
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(64), "signal 64");
    }
}
