//! The launcher's ranks: starting them with torchrun's variables, reaping
//! them as they exit, and stopping them (SIGTERM, then SIGKILL after the
//! grace period).

use std::os::fd::OwnedFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use chorus_collectives::bootstrap::Store;

use super::attempts::Ended;
use super::nodes::{describe_silence, node_name};
use super::{forward, guardian, signal_name, stop_requested, Job, Plan};

/// How long ranks get to end with their own errors when the job's store is
/// lost (its node died) before they are stopped: a peer's reset reaches them
/// within milliseconds; the fault-to-exit limit is 10 s.
const OWN_ERROR_GRACE: Duration = Duration::from_secs(1);

/// One rank of this node.
pub(super) struct Rank {
    pub(super) rank: usize,
    pub(super) local_rank: usize,
    pub(super) pid: libc::pid_t,
    pub(super) status: Option<ExitStatus>,
    /// When the launcher sent it a signal (it was stopped, not failed).
    pub(super) stopped: bool,
}

impl Job {
    /// Starts this attempt's ranks and watches them until all have exited;
    /// how the attempt ended as seen from this node. A stop signal, a failed
    /// rank or a failure on another node ends the start-up at once.
    pub(super) fn run_ranks(&mut self, plan: &Plan) -> anyhow::Result<Ended> {
        self.ranks.clear();
        self.by_pid.clear();
        self.output = Some(forward::Forwarder::start().context("starting the thread that forwards the ranks' output")?);
        if self.guardian.is_none() {
            self.guardian = Some(
                guardian::Guardian::start(plan.nproc)
                    .context("starting the guardian that kills the ranks if the launcher dies")?,
            );
        }
        let mut failure: Option<String> = None;
        // Whether another attempt could mend this failure: not when the
        // launcher was told to stop, nor when a node is lost (a fixed set of
        // nodes cannot meet again without it, and node 0 holds the store).
        let mut restartable = true;
        let mut last_remote_check = Instant::now();
        loop {
            if let Some(signal) = stop_requested() {
                restartable = false;
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
                let failed_key = self.attempt_key(plan, "failed");
                // Node 0: a node waiting to join stops the attempt as a failure
                // would (unless one came first); a store error is met just below.
                if let Ok(Some(what)) = self.node_waiting_to_join(plan) {
                    let _ = self.store.compare_set(&failed_key, b"", what.as_bytes());
                }
                let remote = match self.store.check(&[&failed_key]) {
                    Ok(false) => None,
                    Ok(true) => Some(match self.store.get(&failed_key, Duration::from_secs(5)) {
                        Ok(v) => String::from_utf8_lossy(&v).into_owned(),
                        Err(e) => format!("another node failed (its report is unreadable: {e})"),
                    }),
                    Err(e) => {
                        self.store_lost = true;
                        Some(format!("lost the job's store at {} ({}): {e}", self.address, node_name(&self.hosts, 0)))
                    }
                };
                let members = self.members.clone();
                let remote =
                    remote.or_else(|| match self.watch.as_mut()?.silent(&self.store, plan, members.into_iter()) {
                        Ok(None) => None,
                        Ok(Some((node, silent))) => {
                            self.silent_nodes.push(node);
                            let what = describe_silence(&node_name(&self.hosts, node), silent);
                            // Best effort and bounded: the failure is this node's own finding.
                            let _ = self.store.set(&failed_key, what.as_bytes());
                            Some(what)
                        }
                        Err(e) => {
                            self.store_lost = true;
                            Some(format!(
                                "lost the job's store at {} ({}): {e}",
                                self.address,
                                node_name(&self.hosts, 0)
                            ))
                        }
                    });
                if let Some(what) = remote {
                    eprintln!("chorus launch: {what}; stopping the ranks of node {}", plan.node_rank);
                    if self.store_lost || (!self.silent_nodes.is_empty() && !plan.elastic()) {
                        restartable = false;
                    }
                    failure = Some(what);
                    if self.store_lost {
                        // The store's node is gone, so the ranks' connections to its ranks
                        // reset too: let them end with their own typed errors (the cause a
                        // user reads first) for a moment before they are stopped.
                        self.wait_for_ranks(OWN_ERROR_GRACE);
                    }
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
            None => Ok(Ended::Passed),
            Some(what) => {
                eprintln!("chorus launch: {}failed: {what}", self.attempt_label());
                for r in &self.ranks {
                    let status = r.status.map_or_else(|| "still running".to_string(), describe);
                    let how = if r.stopped { format!("stopped by the launcher ({status})") } else { status };
                    eprintln!("  rank {} (local rank {}, pid {}): {how}", r.rank, r.local_rank, r.pid);
                }
                let started = self.ranks.len();
                if started < plan.nproc {
                    let first = self.group_rank(plan) * plan.nproc;
                    eprintln!(
                        "  ranks {}..={} (local ranks {started}..={}): not started",
                        first + started,
                        first + plan.nproc - 1,
                        plan.nproc - 1
                    );
                }
                self.gather_dumps(plan);
                let trace_dir = self.trace_dir(plan);
                let dumps = super::dumps::of_run(&trace_dir, self.run_started_us);
                if dumps > 0 {
                    eprintln!(
                        "chorus launch: the ranks' flight-recorder dumps are in {} (read them with `chorus trace {}`)",
                        trace_dir.display(),
                        trace_dir.display()
                    );
                }
                // A lost store or node found while the ranks stopped counts too
                // (a lost node only where the job may continue without it).
                let restartable = restartable && !self.store_lost && (self.silent_nodes.is_empty() || plan.elastic());
                Ok(Ended::Failed { what, restartable })
            }
        }
    }

    pub(super) fn spawn(&mut self, plan: &Plan, local_rank: usize) -> anyhow::Result<()> {
        // Ranks are numbered over this attempt's nodes, in node order.
        let group_rank = self.group_rank(plan);
        let (nodes, world_size) = (self.members.len(), self.members.len() * plan.nproc);
        let rank = group_rank * plan.nproc + local_rank;
        let port = self.rank_port;
        let vars: [(&str, String); 16] = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world_size.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", plan.nproc.to_string()),
            ("GROUP_RANK", group_rank.to_string()),
            ("GROUP_WORLD_SIZE", nodes.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_WORLD_SIZE", world_size.to_string()),
            ("ROLE_NAME", "default".into()),
            ("MASTER_ADDR", plan.master_addr.clone()),
            ("MASTER_PORT", port.to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCHELASTIC_RESTART_COUNT", self.attempt.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", plan.max_restarts.to_string()),
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
            .env(chorus_collectives::recorder::DIR_VAR, self.trace_dir(plan))
            .env(super::attempts::HISTORY_VAR, self.history_json())
            .env(chorus_collectives::recorder::RUN_STARTED_VAR, self.run_started_us.to_string())
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
    pub(super) fn reap(&mut self) -> Vec<usize> {
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
    /// Reaps the ranks that end by themselves within `d` (no signal sent).
    fn wait_for_ranks(&mut self, d: Duration) {
        let deadline = Instant::now() + d;
        while self.running > 0 && Instant::now() < deadline {
            self.reap();
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub(super) fn stop(&mut self, grace: Duration) {
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
    pub(super) fn kill_unreaped_groups(&self) {
        for r in self.ranks.iter().filter(|r| r.status.is_none()) {
            signal_group(r.pid, libc::SIGKILL);
        }
    }
}

pub(super) fn signal_group(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    // Each rank leads its own group (pgid = pid); ESRCH (already gone) is fine.
    unsafe {
        libc::kill(-pid, signal);
    }
}

/// "exited with code 3", "was killed by signal 9 (SIGKILL)".
pub(super) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal} ({})", signal_name(signal)),
        _ => format!("ended with status {status}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn statuses_are_described_with_code_or_signal() {
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exited with code 3");
        assert_eq!(describe(ExitStatus::from_raw(9)), "was killed by signal 9 (SIGKILL)");
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(64), "signal 64");
    }
}
