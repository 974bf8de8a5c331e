//! `chorus launch`: torchrun's role. Hosts the job's store on node 0 (or
//! joins node 0's), starts this node's ranks with torchrun's variables,
//! prefixes their output with `[rank R]`, and stops every rank when one
//! fails or the launcher is told to stop.
//!
//! No rank outlives the launcher: each rank is started with
//! `PR_SET_PDEATHSIG = SIGKILL` (it dies if the launcher dies, even by
//! SIGKILL) in its own process group (so stopping a rank stops what it
//! started, and a Ctrl-C reaches the launcher, which stops the ranks in
//! order: SIGTERM, then SIGKILL after the grace period). When the job ends,
//! whatever is left in a rank's process group is killed.
//!
//! Nodes agree through the store, under `chorus/launch/<run id>/`: each
//! launcher registers its node rank and `--nproc-per-node` (a second
//! launcher with the same node rank, or nodes with different rank counts,
//! are errors before any rank starts); the first node whose rank fails
//! publishes it and the others stop their ranks and name it; node 0 keeps
//! the store up until every node has finished.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::bootstrap::{ClientOptions, ServerOptions, Store, TcpStore, TcpStoreServer};
use clap::Args;

use crate::{Outcome, UsageError};

/// Arguments of `chorus launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Ranks (processes) to start on this node.
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
    install_signal_handlers();
    let mut job = Job::rendezvous(&plan)?;
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
    grace: Duration,
    run_id: String,
    program: String,
    args: Vec<String>,
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
            grace,
            run_id: a.run_id.clone(),
            program: program.clone(),
            args: args.to_vec(),
        })
    }

    fn world_size(&self) -> usize {
        self.nproc * self.nnodes
    }

    /// The store keys of this job.
    fn key(&self, rest: &str) -> String {
        format!("chorus/launch/{}/{rest}", self.run_id)
    }
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
    child: Child,
    pid: u32,
    status: Option<ExitStatus>,
    /// When the launcher sent it a signal (it was stopped, not failed).
    stopped: bool,
}

/// The store, the ranks and their output threads.
struct Job {
    server: Option<TcpStoreServer>,
    store: Arc<TcpStore>,
    address: String,
    ranks: Vec<Rank>,
    output: Vec<JoinHandle<()>>,
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
        Ok(Job { server, store, address, ranks: Vec::new(), output: Vec::new() })
    }

    /// Starts the ranks and watches them until all have exited; the outcome
    /// of the job as seen from this node.
    fn run_ranks(&mut self, plan: &Plan) -> anyhow::Result<Outcome> {
        for local_rank in 0..plan.nproc {
            if let Err(e) = self.spawn(plan, local_rank) {
                self.stop(plan.grace);
                return Err(e);
            }
        }
        let mut failure: Option<String> = None;
        let mut last_remote_check = Instant::now();
        loop {
            if let Some(signal) = stop_requested() {
                if failure.is_none() {
                    let what = format!("the launcher of node {} received {}", plan.node_rank, signal_name(signal));
                    let _ = self.store.set(&plan.key("failed"), what.as_bytes());
                    failure = Some(what);
                    self.stop(plan.grace);
                }
            }
            for r in self.ranks.iter_mut().filter(|r| r.status.is_none()) {
                if let Ok(Some(status)) = r.child.try_wait() {
                    r.status = Some(status);
                    if failure.is_none() && !status.success() {
                        let what = format!(
                            "rank {} (node {}, local rank {}, pid {}) {}",
                            r.rank,
                            plan.node_rank,
                            r.local_rank,
                            r.pid,
                            describe(status)
                        );
                        eprintln!("chorus launch: {what}; stopping the other ranks");
                        // Tell the other nodes; if the store is gone they find out themselves.
                        let _ = self.store.set(&plan.key("failed"), what.as_bytes());
                        failure = Some(what);
                    }
                }
            }
            if failure.is_some() && self.ranks.iter().any(|r| r.status.is_none()) {
                self.stop(plan.grace);
            }
            if self.ranks.iter().all(|r| r.status.is_some()) {
                break;
            }
            if plan.nnodes > 1 && failure.is_none() && last_remote_check.elapsed() >= Duration::from_millis(250) {
                last_remote_check = Instant::now();
                let remote = match self.store.check(&[&plan.key("failed")]) {
                    Ok(false) => None,
                    Ok(true) => Some(match self.store.get(&plan.key("failed"), Duration::from_secs(5)) {
                        Ok(v) => String::from_utf8_lossy(&v).into_owned(),
                        Err(e) => format!("another node failed (its report is unreadable: {e})"),
                    }),
                    Err(e) => Some(format!("lost the job's store at {}: {e}", self.address)),
                };
                if let Some(what) = remote {
                    eprintln!("chorus launch: {what}; stopping the ranks of node {}", plan.node_rank);
                    failure = Some(what);
                    self.stop(plan.grace);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.reap_process_groups();
        self.join_output();
        match failure {
            None => Ok(Outcome::Passed),
            Some(what) => {
                eprintln!("chorus launch: failed: {what}");
                for r in &self.ranks {
                    let status = r.status.map_or_else(|| "still running".to_string(), describe);
                    let how = if r.stopped { format!("stopped by the launcher ({status})") } else { status };
                    eprintln!("  rank {} (local rank {}, pid {}): {how}", r.rank, r.local_rank, r.pid);
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
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (prctl, getppid), allocating nothing.
        unsafe {
            command.pre_exec(move || {
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
        let pid = child.id();
        if let Some(out) = child.stdout.take() {
            self.output.push(forward_lines(out, rank, false));
        }
        if let Some(err) = child.stderr.take() {
            self.output.push(forward_lines(err, rank, true));
        }
        self.ranks.push(Rank { rank, local_rank, child, pid, status: None, stopped: false });
        Ok(())
    }

    /// SIGTERM to every running rank's process group, SIGKILL after `grace`.
    fn stop(&mut self, grace: Duration) {
        for r in self.ranks.iter_mut().filter(|r| r.status.is_none() && !r.stopped) {
            r.stopped = true;
            signal_group(r.pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        loop {
            for r in self.ranks.iter_mut().filter(|r| r.status.is_none()) {
                if let Ok(Some(status)) = r.child.try_wait() {
                    r.status = Some(status);
                }
            }
            if self.ranks.iter().all(|r| r.status.is_some()) || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for r in self.ranks.iter().filter(|r| r.status.is_none()) {
            signal_group(r.pid, libc::SIGKILL);
        }
        // SIGKILL cannot be caught; a process stuck in the kernel may still take a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.ranks.iter().any(|r| r.status.is_none()) && Instant::now() < deadline {
            for r in self.ranks.iter_mut().filter(|r| r.status.is_none()) {
                if let Ok(Some(status)) = r.child.try_wait() {
                    r.status = Some(status);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills what the ranks left behind in their process groups.
    fn reap_process_groups(&self) {
        for r in &self.ranks {
            signal_group(r.pid, libc::SIGKILL);
        }
    }

    /// Waits (at most a second) for the last output lines; a process that
    /// left the rank's group may hold a pipe open, and is not waited for.
    fn join_output(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.output.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for t in self.output.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }

    /// Reports this node finished; node 0 keeps the store up until every node has.
    fn finish(&mut self, plan: &Plan) {
        let _ = self.store.add(&plan.key("finished"), 1);
        if self.server.is_none() || plan.nnodes == 1 {
            return;
        }
        // After a stop signal only the grace period is left to wait.
        let limit = if stop_requested().is_some() { plan.grace + Duration::from_secs(2) } else { plan.timeout };
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            match self.store.get(&plan.key("finished"), Duration::from_secs(1)) {
                Ok(v) if v == plan.nnodes.to_string().as_bytes() => return,
                Ok(_) => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => return,
            }
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

fn signal_group(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    // Each rank leads its own group (pgid = pid); ESRCH (already gone) is fine.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
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

/// Copies a rank's stdout or stderr to the launcher's, each line prefixed
/// with `[rank R] `. A line longer than 64 KiB is cut into several.
fn forward_lines(pipe: impl Read + Send + 'static, rank: usize, stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        let prefix = format!("[rank {rank}] ");
        loop {
            line.clear();
            match reader.by_ref().take(64 * 1024).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    // A closed launcher stdout (`| head`) is not the rank's problem.
                    let _ = if stderr {
                        write_line(&mut std::io::stderr().lock(), &prefix, &line)
                    } else {
                        write_line(&mut std::io::stdout().lock(), &prefix, &line)
                    };
                }
            }
        }
    })
}

fn write_line(out: &mut impl Write, prefix: &str, line: &[u8]) -> std::io::Result<()> {
    out.write_all(prefix.as_bytes())?;
    out.write_all(line)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_described_with_code_or_signal() {
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exited with code 3");
        assert_eq!(describe(ExitStatus::from_raw(9)), "was killed by signal 9 (SIGKILL)");
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(64), "signal 64");
    }
}
