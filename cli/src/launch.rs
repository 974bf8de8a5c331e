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
//! launcher with the same node rank while the nodes gather, or nodes with
//! different rank counts, are errors before any rank starts); the first
//! node whose rank fails publishes it and the others stop their ranks and
//! name it; node 0 keeps the store up until every node has finished.
//!
//! A node that dies or hangs cannot publish anything: every launcher of a
//! multi-node job bumps its heartbeat key every [`HEARTBEAT`] from a thread
//! of its own, and watches the others'. A node not heard from for
//! `--node-timeout` (the store not answering within it, for node 0) has
//! failed: the first launcher to see it publishes it and every node stops
//! its ranks, so a dead or hung host ends the job within seconds instead of
//! `--timeout`, or (with `--max-restarts`) starts its next attempt.
//!
//! A failed job is started again up to `--max-restarts` times, each
//! attempt with its own keys, dumps and ranks' store, and with `--nnodes
//! MIN:MAX` on the nodes that remain; a launcher started for a node that
//! was left behind (or never joined) waits and is taken in at the next
//! attempt, which node 0 starts for it while restarts remain ([`attempts`]).
//!
//! UCX takes two processes with the same boot id and IPC namespace for one
//! machine and joins them by shared memory, whose wake-ups (abstract Unix
//! sockets) do not cross network namespaces: nodes that are containers
//! sharing a machine's IPC namespace but not its network stall about 100 ms
//! per message. Each launcher publishes what UCX compares ([`MachineView`](nodes::MachineView));
//! where two nodes would be joined that way, the ranks get
//! `UCX_TLS=^sm` (no shared memory) unless `UCX_TLS` is set, and the
//! launcher says so.
//!
//! The launch is one [`Job`] whose phases are written beside what they use:
//! the rendezvous and the nodes' heartbeats in `nodes.rs`, the ranks in
//! `ranks.rs`, the attempts in `attempts.rs`, the end in `end.rs`; the job holds their types, and they
//! extend it, so this file and those depend on each other.

mod attempts;
mod dumps;
mod end;
mod forward;
mod guardian;
mod nodes;
mod ranks;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chorus_collectives::bootstrap::{ServerOptions, TcpStore, TcpStoreServer};
use clap::Args;

use crate::{Outcome, UsageError};
pub use attempts::HISTORY_VAR;
use nodes::{Heartbeat, NodeWatch};
use ranks::Rank;

/// Arguments of `chorus launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Ranks (processes) to start on this node; the job's ranks and launchers together at most the
    /// connections node 0's store serves (1024: 1023 ranks on one node).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = whole_number)]
    pub nproc_per_node: usize,
    /// Nodes in the job; every node runs `chorus launch` with the same arguments but --node-rank. MIN:MAX
    /// (elastic, as torchrun's): the job starts with the nodes that joined when all MAX have, or at --timeout
    /// with at least MIN; a restart (--max-restarts) continues without nodes found dead while MIN remain, and a
    /// launcher started later for a node (one that came back, or a new one) is taken in at a restart.
    #[arg(long, default_value = "1", value_name = "M|MIN:MAX", allow_negative_numbers = true, value_parser = node_count)]
    pub nnodes: NodeCount,
    /// This node's index, 0..M; node 0 hosts the store.
    #[arg(long, default_value_t = 0, value_name = "K", allow_negative_numbers = true, value_parser = whole_number)]
    pub node_rank: usize,
    /// Host of the store (node 0), as the other nodes reach it.
    #[arg(long, default_value = "127.0.0.1", value_name = "A")]
    pub master_addr: String,
    /// Port of the store [default: a free port on one node, 29500 on several].
    #[arg(long, value_name = "P")]
    pub master_port: Option<u16>,
    /// Seconds to wait for the store and for the other nodes to join (at the start, and at each restart).
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
    /// Times the job is started again after a rank or a node fails (torchrun's --max-restarts): every
    /// node stops its ranks, the nodes meet again, and every rank starts anew with the attempt in
    /// TORCHELASTIC_RESTART_COUNT (`chorus train --resume auto` continues from its last checkpoint).
    /// The same on every node.
    #[arg(long, default_value_t = 0, value_name = "N", allow_negative_numbers = true, value_parser = whole_number)]
    pub max_restarts: usize,
    /// The program to run as every rank, and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "PROGRAM ARGS")]
    pub command: Vec<String>,
}

/// A count or index given on the command line: a whole number (a negative
/// one is named as such, not taken for a flag).
fn whole_number(text: &str) -> Result<usize, String> {
    match text.trim().parse::<i128>() {
        Ok(n) if n < 0 => Err(format!("{n} is negative; give a whole number (0, 1, 2, ...)")),
        Ok(n) => usize::try_from(n).map_err(|_| format!("{n} is too large")),
        Err(_) => Err(format!("{text:?} is not a whole number")),
    }
}

/// `--nnodes`: a fixed count (`min == max`), or `MIN:MAX`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NodeCount {
    /// Nodes an attempt needs.
    pub min: usize,
    /// Nodes the job has at most (node ranks `0..max`).
    pub max: usize,
}

/// `--nnodes M` or `--nnodes MIN:MAX`.
fn node_count(text: &str) -> Result<NodeCount, String> {
    match text.split_once(':') {
        None => whole_number(text).map(|n| NodeCount { min: n, max: n }),
        Some((min, max)) => {
            let (min, max) = (whole_number(min)?, whole_number(max)?);
            if min > max {
                return Err(format!("{text}: MIN {min} is above MAX {max}"));
            }
            Ok(NodeCount { min, max })
        }
    }
}

/// Connections a launcher holds to node 0's store: one, and on several
/// nodes a second for its heartbeat thread (which beats while the main
/// loop waits on the store).
fn launcher_connections(nnodes: usize) -> usize {
    if nnodes > 1 {
        2
    } else {
        1
    }
}

/// How often each launcher of a multi-node job bumps its heartbeat key.
const HEARTBEAT: Duration = Duration::from_millis(500);

/// The key (under the job's) where node 0 says the job has ended
/// (`succeeded`, `failed`), so a node that comes back then is refused at once.
const ENDED: &str = "ended";

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
    let outcome = job.run_attempts(&plan);
    job.finish(&plan, matches!(outcome, Ok(Outcome::Passed)));
    outcome
}

/// The validated arguments.
struct Plan {
    nproc: usize,
    /// Nodes in the job at most (`--nnodes`' MAX): the node ranks are `0..nnodes`.
    nnodes: usize,
    /// Nodes an attempt needs (`--nnodes`' MIN; `nnodes` unless elastic).
    min_nodes: usize,
    node_rank: usize,
    master_addr: String,
    master_port: u16,
    timeout: Duration,
    node_timeout: Duration,
    grace: Duration,
    run_id: String,
    /// Attempts after the first that a failure may start (`--max-restarts`).
    max_restarts: usize,
    program: String,
    args: Vec<String>,
    /// Where the ranks' flight recorders write their dumps (CHORUS_TRACE_DIR);
    /// each restart's in a folder of its own beside the first attempt's
    /// ([`attempts::trace_dir`]).
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
        if a.nnodes.min == 0 {
            return Err(usage("--nnodes must be at least 1".into()));
        }
        let nnodes = a.nnodes.max;
        // Every rank of a job (chorus's commands, PyTorch's) holds a connection
        // to node 0's store, and so does every launcher (two on several
        // nodes): more than the store serves would fail one by one as they start.
        let connections = ServerOptions::default().max_connections;
        let launchers = launcher_connections(nnodes).saturating_mul(nnodes);
        let per_node = connections.saturating_sub(launchers) / nnodes;
        let each = match launcher_connections(nnodes) {
            1 => "one per launcher",
            _ => "two per launcher",
        };
        if per_node == 0 {
            return Err(usage(format!(
                "--nnodes {}: node 0's store serves {connections} connections, {each} and one per rank; at most {} \
                 nodes",
                nnodes,
                connections / 3
            )));
        }
        if a.nproc_per_node > per_node {
            return Err(usage(format!(
                "--nproc-per-node {}: at most {per_node} ranks per node on {} node(s) (node 0's store serves \
                 {connections} connections, one per rank and {each})",
                a.nproc_per_node, nnodes
            )));
        }
        if a.node_rank >= nnodes {
            return Err(usage(format!("--node-rank {} must be below --nnodes {nnodes}", a.node_rank)));
        }
        if a.master_addr.trim().is_empty() {
            return Err(usage("--master-addr is empty".into()));
        }
        let master_port = a.master_port.unwrap_or(if nnodes == 1 { 0 } else { 29500 });
        if master_port == 0 && nnodes > 1 {
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
            nnodes,
            min_nodes: a.nnodes.min,
            node_rank: a.node_rank,
            master_addr: a.master_addr.trim().to_string(),
            master_port,
            timeout,
            node_timeout,
            grace,
            run_id: a.run_id.clone(),
            max_restarts: a.max_restarts,
            program: program.clone(),
            args: args.to_vec(),
            trace_dir: trace_dir(&a.run_id)?,
        })
    }

    /// The job's ranks at most (every node of `--nnodes`' MAX).
    fn world_size(&self) -> usize {
        self.nproc * self.nnodes
    }

    /// Whether the set of nodes may change between attempts (`--nnodes MIN:MAX`).
    fn elastic(&self) -> bool {
        self.min_nodes < self.nnodes
    }

    /// Files the launcher holds open at most: two pipes per rank of this
    /// node, on node 0 the store's connection of every rank and launcher of
    /// the job, and a reserve for its own (the store's socket, the guardian's
    /// pipe, the epoll set, the standard streams, the ranks' start-up).
    fn open_files_needed(&self) -> u64 {
        let store =
            if self.node_rank == 0 { self.world_size() + launcher_connections(self.nnodes) * self.nnodes } else { 0 };
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
    /// When this attempt started (node 0's clock, microseconds since the Unix
    /// epoch): every rank's dumps carry it, so runs (and attempts) under one run id keep apart.
    run_started_us: u64,
    /// This attempt: 0, then one more for each restart (TORCHELASTIC_RESTART_COUNT).
    attempt: usize,
    /// The store the ranks of a restart use (node 0; each restart gets a
    /// fresh one, as torchrun's agent makes one per restart); `None` in the
    /// first attempt, whose ranks use the launchers' store.
    _rank_server: Option<TcpStoreServer>,
    /// The port of the store this attempt's ranks use.
    rank_port: u16,
    /// The attempts that failed, in order.
    history: Vec<attempts::Failed>,
    /// The nodes of this attempt, in order (every node unless `--nnodes MIN:MAX`).
    members: Vec<usize>,
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
