//! The job's attempts (`--max-restarts`): when a rank or a node fails,
//! every node stops its ranks, the nodes meet again and the ranks start
//! anew, until an attempt succeeds or the restarts are spent; then the
//! launcher says every attempt's fate.
//!
//! Each attempt has its own key scope in the launchers' store
//! (`attempt/<a>/`, the first attempt's keys where they always were), so
//! nothing of an earlier attempt (its failure, its dumps) is read as this
//! one's. Its ranks get the attempt in `TORCHELASTIC_RESTART_COUNT` (chorus's
//! ranks scope their own keys with it) and, from the first restart on, a
//! store of their own that node 0 hosts on a free port, fresh for each
//! attempt, as torchrun's agent makes one per restart (PyTorch's ranks put
//! no attempt in their keys). Each restart's flight-recorder dumps go to
//! `attempt-<a>/` under the dump directory, so an attempt's dumps do not
//! replace an earlier one's.
//!
//! A restart starts once every node has stopped its ranks and said so
//! (`attempt/<a>/ready/<node>`), within `--timeout`. Node 0 decides which
//! nodes take part and publishes them (`attempt/<a>/members`): with a fixed
//! `--nnodes M`, every node, so a node that ended instead (told to stop) or
//! fell silent ends the job; with `--nnodes MIN:MAX`, the nodes that are
//! ready, the others dropped while at least MIN remain, and the ranks
//! renumbered over them (`WORLD_SIZE` shrinks; a checkpoint reshards on
//! load). A stop signal to a launcher, a lost node 0 (it holds the store),
//! or a lost node of a fixed set is not restarted. On several nodes with
//! restarts allowed, a node whose
//! ranks all succeeded waits until every node's have (or one failed, which
//! restarts it too), since a node that had left could not meet the others
//! again.
//!
//! With `--nnodes MIN:MAX` a launcher that finds the job started (a node
//! that comes back after it was left behind, or one that never joined)
//! waits to join (`waiting/<node>`, its heartbeat beating) and node 0 takes
//! it in at the next attempt. While node 0's ranks run and a restart
//! remains, a node waiting stops the attempt as a failure does, as
//! torchrun's agent restarts its workers for a node waiting at the
//! rendezvous; here that spends a restart, so a node that keeps coming
//! back cannot restart the job without end. A node that comes when no
//! attempt can take it (restarts spent, the job ended, a fixed node count)
//! is refused at once.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chorus_collectives::bootstrap::{ServerOptions, Store, TcpStoreServer};
use chorus_collectives::CommError;

use super::nodes::{
    decode_nodes, describe_silence, encode_nodes, epoch_us, listen_address, node_name, per_node, shared_memory_env,
    Liveness, STARTED_ATTEMPT,
};
use super::{dumps, signal_name, stop_requested, Job, Plan, ENDED};
use crate::Outcome;

/// The variable that gives every rank the attempts before its own: a JSON
/// array of `{"attempt", "seconds", "failure"}` (`[]` in the first attempt),
/// which `chorus train` puts in its summary.
pub const HISTORY_VAR: &str = "CHORUS_LAUNCH_HISTORY";

/// How one attempt ended on this node.
pub(super) enum Ended {
    /// Every rank (on every node, where that is waited for) succeeded.
    Passed,
    /// What failed first, as this node learnt it; whether another attempt may mend it.
    Failed { what: String, restartable: bool },
}

/// An attempt that failed.
pub(super) struct Failed {
    attempt: usize,
    seconds: f64,
    what: String,
}

/// How often the waits of this file look at the store.
const POLL: Duration = Duration::from_millis(50);

impl Job {
    /// The store key `rest` of this attempt.
    pub(super) fn attempt_key(&self, plan: &Plan, rest: &str) -> String {
        attempt_key(plan, self.attempt, rest)
    }

    /// "attempt 2: " from the first restart on; nothing in a job that never restarted.
    pub(super) fn attempt_label(&self) -> String {
        match self.attempt {
            0 => String::new(),
            a => format!("attempt {a}: "),
        }
    }

    /// Where this attempt's ranks write their flight-recorder dumps.
    pub(super) fn trace_dir(&self, plan: &Plan) -> std::path::PathBuf {
        trace_dir(&plan.trace_dir, self.attempt)
    }

    /// The attempts before this one, as [`HISTORY_VAR`] gives them.
    pub(super) fn history_json(&self) -> String {
        let entries: Vec<serde_json::Value> = self
            .history
            .iter()
            .map(|f| serde_json::json!({"attempt": f.attempt, "seconds": f.seconds, "failure": f.what}))
            .collect();
        serde_json::Value::Array(entries).to_string()
    }

    /// Runs attempts until one succeeds, the restarts are spent, or a
    /// failure cannot be mended by another; says every attempt's fate.
    pub(super) fn run_attempts(&mut self, plan: &Plan) -> anyhow::Result<Outcome> {
        loop {
            let started = Instant::now();
            let ended = match self.run_ranks(plan)? {
                Ended::Passed => self.wait_for_every_node_to_succeed(plan),
                failed => failed,
            };
            let seconds = started.elapsed().as_secs_f64();
            let (what, restartable) = match ended {
                Ended::Passed => {
                    self.say_history(plan, &format!("succeeded after {seconds:.1} s"));
                    return Ok(Outcome::Passed);
                }
                Ended::Failed { what, restartable } => (what, restartable),
            };
            self.history.push(Failed { attempt: self.attempt, seconds, what });
            if self.attempt >= plan.max_restarts {
                if plan.max_restarts > 0 {
                    eprintln!("chorus launch: the {} restarts (--max-restarts) are spent", plan.max_restarts);
                }
                self.say_history(plan, "");
                return Ok(Outcome::Failed);
            }
            if !restartable {
                let why = "the launcher was told to stop, node 0's store is lost, or a node is lost from a fixed \
                           --nnodes (MIN:MAX continues on fewer)";
                eprintln!("chorus launch: not restarting: {why}");
                if plan.node_rank == 0 && !self.store_lost {
                    // The other nodes, ready to restart, learn at once that node 0 will not.
                    let abandoned = attempt_key(plan, self.attempt + 1, "abandoned");
                    let _ = self.store.set(&abandoned, format!("node 0 is not restarting: {why}").as_bytes());
                }
                self.say_history(plan, "");
                return Ok(Outcome::Failed);
            }
            eprintln!(
                "chorus launch: restarting: attempt {} of at most {} (--max-restarts {})",
                self.attempt + 1,
                plan.max_restarts + 1,
                plan.max_restarts
            );
            if let Err(e) = self.rejoin(plan) {
                eprintln!("chorus launch: the nodes did not meet again for attempt {}: {e:#}", self.attempt);
                self.say_history(plan, &format!("did not start: {e:#}"));
                return Ok(Outcome::Failed);
            }
        }
    }

    /// Every attempt's fate, once the job ends (only where restarts were allowed).
    fn say_history(&self, plan: &Plan, this: &str) {
        if plan.max_restarts == 0 || (self.history.is_empty() && !this.is_empty()) {
            return;
        }
        let count = self.history.len() + usize::from(!this.is_empty());
        eprintln!("chorus launch: run {:?} on node {}: {count} attempt(s):", plan.run_id, plan.node_rank);
        for f in &self.history {
            eprintln!("  attempt {}: failed after {:.1} s: {}", f.attempt, f.seconds, f.what);
        }
        if !this.is_empty() {
            eprintln!("  attempt {}: {this}", self.attempt);
        }
    }

    /// On several nodes with restarts allowed, once this node's ranks have
    /// all succeeded: waits until every node's have, or one failed (then
    /// this node restarts with the others), or a node fell silent.
    fn wait_for_every_node_to_succeed(&mut self, plan: &Plan) -> Ended {
        if plan.nnodes == 1 || plan.max_restarts == 0 {
            return Ended::Passed;
        }
        let lost = |job: &mut Job, e: &CommError| {
            job.lose_store("waiting for the other nodes' ranks", e);
            Ended::Failed { what: format!("lost the job's store: {e}"), restartable: false }
        };
        if self.store_lost {
            return Ended::Failed { what: "lost the job's store".into(), restartable: false };
        }
        if let Err(e) = self.store.set(&self.attempt_key(plan, &format!("succeeded/{}", plan.node_rank)), b"1") {
            return lost(self, &e);
        }
        let failed_key = self.attempt_key(plan, "failed");
        loop {
            if let Some(signal) = stop_requested() {
                let what = format!("the launcher of node {} received {}", plan.node_rank, signal_name(signal));
                self.tell_other_nodes(plan, &what);
                return Ended::Failed { what, restartable: false };
            }
            let mut pending = Vec::new();
            for &n in &self.members {
                match self.store.check(&[&self.attempt_key(plan, &format!("succeeded/{n}"))]) {
                    Ok(true) => {}
                    Ok(false) => pending.push(n),
                    Err(e) => return lost(self, &e),
                }
            }
            if pending.is_empty() {
                return Ended::Passed;
            }
            match self.store.check(&[&failed_key]) {
                Ok(false) => {}
                Ok(true) => {
                    let what = match self.store.get(&failed_key, plan.node_timeout) {
                        Ok(v) => String::from_utf8_lossy(&v).into_owned(),
                        Err(e) => return lost(self, &e),
                    };
                    eprintln!("chorus launch: {what}; this node's ranks had succeeded, and restart with the others");
                    return Ended::Failed { what, restartable: true };
                }
                Err(e) => return lost(self, &e),
            }
            let silent = match self.watch.as_mut() {
                Some(watch) => match watch.silent(&self.store, plan, pending.into_iter()) {
                    Ok(found) => found,
                    Err(e) => return lost(self, &e),
                },
                None => None,
            };
            if let Some((node, silent)) = silent {
                self.silent_nodes.push(node);
                let what = describe_silence(&node_name(&self.hosts, node), silent);
                eprintln!("chorus launch: {what}");
                self.tell_other_nodes(plan, &what);
                return Ended::Failed { what, restartable: plan.elastic() };
            }
            std::thread::sleep(POLL);
        }
    }

    /// The nodes meet again for the next attempt, once each has stopped its
    /// ranks and said so (`ready`), within `--timeout`. Node 0 decides who
    /// takes part: every node of the last attempt; with `--nnodes MIN:MAX`,
    /// those that are ready, not waiting for a node found silent or ended,
    /// while at least MIN remain. It publishes them with the port of the
    /// attempt's fresh store for the ranks and the attempt's start, or why
    /// the job cannot go on (`abandoned`). A stop signal, a lost store, or
    /// node 0 leaving this node out end it here.
    fn rejoin(&mut self, plan: &Plan) -> anyhow::Result<()> {
        let previous = self.attempt;
        self.attempt += 1;
        let attempt = self.attempt;
        let key = |rest: &str| attempt_key(plan, attempt, rest);
        self.store.set(&key(&format!("ready/{}", plan.node_rank)), b"1")?;
        let outcome = if plan.node_rank == 0 { self.decide_members(plan) } else { self.await_members(plan) };
        let members = match outcome {
            Ok(members) => members,
            Err(e) => {
                if plan.node_rank == 0 {
                    // The others learn it at once rather than at their deadline.
                    let _ = self.store.set(&key("abandoned"), format!("{e:#}").as_bytes());
                }
                return Err(e);
            }
        };
        let gone: Vec<usize> = self.members.iter().copied().filter(|n| !members.contains(n)).collect();
        if !gone.is_empty() {
            let names: Vec<String> = gone.iter().map(|&n| node_name(&self.hosts, n)).collect();
            // Node 0's reasons; the nodes it left behind are the fault's culprits,
            // which a rank's own error (a peer's reset) may not have named.
            let why = match self.store.check(&[&key("dropped")]) {
                Ok(true) => String::from_utf8_lossy(&self.store.get(&key("dropped"), plan.node_timeout)?).into_owned(),
                _ => format!("{} left behind", names.join(", ")),
            };
            eprintln!(
                "chorus launch: attempt {attempt} continues without {} ({why}; {} of --nnodes {}:{})",
                names.join(", "),
                members.len(),
                plan.min_nodes,
                plan.nnodes
            );
            if let Some(last) = self.history.last_mut() {
                last.what = format!("{}; {why}", last.what);
            }
        }
        if plan.node_rank == 0 {
            // For a node taken in now, which did not see the earlier attempts.
            self.store.set(&key("history"), self.history_json().as_bytes())?;
        }
        let comers = match self.store.check(&[&key("joined")])? {
            true => decode_nodes(&self.store.get(&key("joined"), plan.node_timeout)?).unwrap_or_default(),
            false => Vec::new(),
        };
        if !comers.is_empty() {
            for (node, host) in per_node(&self.store, plan, &comers, "host")?.into_iter().enumerate() {
                if comers.contains(&node) {
                    self.hosts[node] = host;
                }
            }
            let names: Vec<String> = comers.iter().map(|&n| node_name(&self.hosts, n)).collect();
            eprintln!(
                "chorus launch: attempt {attempt} takes in {}, which waited to join ({} of --nnodes {}:{})",
                names.join(", "),
                members.len(),
                plan.min_nodes,
                plan.nnodes
            );
            // A node that joins may share this machine in the way UCX mistakes.
            self.rank_env = shared_memory_env(&per_node(&self.store, plan, &members, "view")?);
        }
        self.members = members;
        self.silent_nodes.clear();
        self.read_attempt_start(plan)?;
        if plan.node_rank == 0 {
            let old = attempt_key(plan, previous, "dumps");
            if let Err(e) = dumps::clean(&*self.store, |rest| format!("{old}/{rest}"), plan.nnodes) {
                self.lose_store("deleting the previous attempt's flight-recorder dumps", &e);
            }
        }
        Ok(())
    }

    /// Node 0: waits (within `--timeout`) until each node of the last attempt
    /// is ready, ended, or silent; the nodes of the next attempt are the
    /// ready ones, which must be all of them unless the job is elastic and
    /// at least MIN, and (elastic) every node waiting to join whose launcher
    /// is alive. Hosts the attempt's store for the ranks and publishes the
    /// nodes, its port and the attempt's start.
    fn decide_members(&mut self, plan: &Plan) -> anyhow::Result<Vec<usize>> {
        let attempt = self.attempt;
        let key = |rest: &str| attempt_key(plan, attempt, rest);
        let deadline = Instant::now() + plan.timeout;
        let (ready, comers, lost) = loop {
            if let Some(signal) = stop_requested() {
                bail!("received {}", signal_name(signal));
            }
            let (mut ready, mut comers, mut lost, mut waiting, mut unsure) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for n in 0..plan.nnodes {
                let member = self.members.contains(&n);
                if member && self.store.check(&[&key(&format!("ready/{n}"))])? {
                    ready.push(n);
                    continue;
                }
                // A launcher waiting to join: a node that came back (perhaps
                // in place of a member whose launcher died), or a new one.
                if let Some(watch) = self.watch.as_mut().filter(|_| plan.elastic() && n != plan.node_rank) {
                    if self.store.check(&[&plan.key(&format!("waiting/{n}"))])? {
                        match watch.liveness(&self.store, plan, n)? {
                            Liveness::Alive => {
                                comers.push(n);
                                continue;
                            }
                            Liveness::Unknown => {
                                unsure.push(n);
                                continue;
                            }
                            // It died waiting: a member is judged as any other.
                            Liveness::Silent => {}
                        }
                    }
                }
                if !member {
                    continue;
                }
                if self.store.check(&[&plan.key(&format!("finished/{n}"))])? {
                    lost.push(format!("{} ended the job instead of restarting", node_name(&self.hosts, n)));
                } else if self.silent_nodes.contains(&n) {
                    lost.push(format!(
                        "{} was not heard from for --node-timeout (dead, hung or cut off)",
                        node_name(&self.hosts, n)
                    ));
                } else {
                    waiting.push(n);
                }
            }
            if let Some(watch) = self.watch.as_mut() {
                if let Some((node, _)) = watch.silent(&self.store, plan, waiting.iter().copied())? {
                    self.silent_nodes.push(node);
                    continue;
                }
            }
            // A launcher waiting to join is known alive or silent within --node-timeout.
            if waiting.is_empty() && (unsure.is_empty() || Instant::now() >= deadline) {
                break (ready, comers, lost);
            }
            if Instant::now() >= deadline {
                let names: Vec<String> = waiting.iter().map(|&n| node_name(&self.hosts, n)).collect();
                bail!("{} did not stop its ranks within {:?} (--timeout)", names.join(", "), plan.timeout);
            }
            std::thread::sleep(POLL);
        };
        let nodes = ready.len() + comers.len();
        // (A node left out without a reason is one whose replacement was not seen alive in time.)
        if (!lost.is_empty() && !plan.elastic()) || nodes < plan.min_nodes {
            let need = if plan.elastic() {
                format!("{nodes} node(s) remain, --nnodes {}:{} needs {}", plan.min_nodes, plan.nnodes, plan.min_nodes)
            } else {
                format!("--nnodes {} needs every node (MIN:MAX continues on fewer)", plan.nnodes)
            };
            let lost = lost.iter().map(|l| format!("{l}; ")).collect::<String>();
            bail!("{lost}{need}");
        }
        let mut members: Vec<usize> = ready.into_iter().chain(comers.iter().copied()).collect();
        // Ranks are numbered in node order, whoever came back.
        members.sort_unstable();
        let addr = listen_address(&plan.master_addr, 0);
        let server = TcpStoreServer::bind(addr, ServerOptions::default())
            .with_context(|| format!("hosting the ranks' store of attempt {attempt} on {addr}"))?;
        self.store.set(&key("rank_port"), server.port().to_string().as_bytes())?;
        self.store.set(&key("started"), epoch_us().to_string().as_bytes())?;
        if !lost.is_empty() {
            // Before the list: a node that reads the list finds the reasons.
            self.store.set(&key("dropped"), lost.join("; ").as_bytes())?;
        }
        if !comers.is_empty() {
            self.store.set(&key("joined"), encode_nodes(&comers).as_bytes())?;
        }
        self.store.set(&key("members"), encode_nodes(&members).as_bytes())?;
        self.store.set(&plan.key(STARTED_ATTEMPT), attempt.to_string().as_bytes())?;
        for n in &comers {
            self.store.delete(&plan.key(&format!("waiting/{n}")))?;
        }
        // The previous attempt's ranks have all stopped: their store goes.
        self._rank_server = Some(server);
        Ok(members)
    }

    /// Every node but 0: waits for node 0's decision (within `--timeout`
    /// and the node timeout it may take to find a node silent).
    fn await_members(&mut self, plan: &Plan) -> anyhow::Result<Vec<usize>> {
        let attempt = self.attempt;
        let key = |rest: &str| attempt_key(plan, attempt, rest);
        let (members_key, abandoned_key) = (key("members"), key("abandoned"));
        let limit = plan.timeout + 2 * plan.node_timeout;
        let deadline = Instant::now() + limit;
        loop {
            if let Some(signal) = stop_requested() {
                bail!("received {}", signal_name(signal));
            }
            let slice = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
            match self.store.wait(&[&members_key], slice) {
                Ok(()) => break,
                Err(CommError::Timeout { .. }) if Instant::now() < deadline => {}
                Err(CommError::Timeout { .. }) => bail!("node 0 did not start attempt {attempt} within {limit:?}"),
                Err(e) => {
                    self.lose_store("meeting the other nodes again", &e);
                    return Err(e.into());
                }
            }
            if self.store.check(&[&abandoned_key])? {
                let why = self.store.get(&abandoned_key, plan.node_timeout)?;
                bail!("{}", String::from_utf8_lossy(&why));
            }
            if let Some(watch) = self.watch.as_mut() {
                if let Some((node, silent)) = watch.silent(&self.store, plan, std::iter::once(0))? {
                    bail!("{}", describe_silence(&node_name(&self.hosts, node), silent));
                }
            }
        }
        let members = decode_nodes(&self.store.get(&members_key, plan.node_timeout)?)
            .with_context(|| format!("node 0's list of the nodes of attempt {attempt}"))?;
        if !members.contains(&plan.node_rank) {
            bail!("node 0 started attempt {attempt} with nodes {members:?}, without this one (found silent)");
        }
        Ok(members)
    }

    /// The port of the attempt's store for the ranks and the attempt's
    /// start, as node 0 published them.
    fn read_attempt_start(&mut self, plan: &Plan) -> anyhow::Result<()> {
        let text = |k: &str| -> anyhow::Result<u64> {
            let v = self.store.get(k, plan.timeout)?;
            String::from_utf8_lossy(&v)
                .parse::<u64>()
                .with_context(|| format!("{k}: {:?} is not a number", String::from_utf8_lossy(&v)))
        };
        self.rank_port =
            u16::try_from(text(&self.attempt_key(plan, "rank_port"))?).context("the ranks' store's port")?;
        self.run_started_us = text(&self.attempt_key(plan, "started"))?;
        Ok(())
    }

    /// A launcher that joins a started job (a node that comes back, or a
    /// new one within MAX; `attempt` is the one running, `launchers` this
    /// launcher's place among its node's): says so, and waits until node 0
    /// takes it in at the next attempt. A way out other than being taken in
    /// (the job ended or does not restart, the restarts spent, a stop
    /// signal, node 0 silent, the deadline) says why, and leaves the node
    /// ended for node 0.
    pub(super) fn wait_to_join(&mut self, plan: &Plan, attempt: usize, launchers: i64) -> anyhow::Result<()> {
        let node = plan.node_rank;
        let (waiting, finished) = (plan.key(&format!("waiting/{node}")), plan.key(&format!("finished/{node}")));
        // An earlier launcher of this node said it ended; this one has not.
        self.store.delete(&finished)?;
        self.store.set(&waiting, launchers.to_string().as_bytes())?;
        let running = decode_nodes(&self.store.get(&attempt_key(plan, attempt, "members"), plan.node_timeout)?)
            .unwrap_or_default();
        if running.contains(&node) {
            // The earlier launcher of this node, gone, was in the running
            // attempt, and this one's heartbeat (the same key) now hides its
            // silence: the attempt is stopped here, and the restart takes this one in.
            let what = format!(
                "node {node}'s launcher was replaced (the earlier one had ended or been silent for --node-timeout)"
            );
            self.store.compare_set(&attempt_key(plan, attempt, "failed"), b"", what.as_bytes())?;
        }
        eprintln!(
            "chorus launch: node {node} waits to join run {:?} at its next attempt (it is in attempt {attempt}; \
             --max-restarts {}, --nnodes {}:{})",
            plan.run_id, plan.max_restarts, plan.min_nodes, plan.nnodes
        );
        let joined = self.await_next_attempt(plan, attempt);
        if joined.is_err() {
            // Best effort: node 0 then neither takes it in nor waits for it.
            let _ = self.store.delete(&waiting);
            let _ = self.store.set(&finished, b"1");
        }
        joined
    }

    /// [`Job::wait_to_join`]'s wait: until node 0 publishes an attempt with
    /// this node (one published without it, chosen before node 0 saw it
    /// waiting, is passed over while a restart remains), within the time
    /// node 0 takes to stop its ranks and meet the others again.
    fn await_next_attempt(&mut self, plan: &Plan, mut attempt: usize) -> anyhow::Result<()> {
        let node = plan.node_rank;
        let limit = plan.timeout + plan.grace + 2 * plan.node_timeout + Duration::from_secs(5);
        let mut deadline = Instant::now() + limit;
        loop {
            if let Some(signal) = stop_requested() {
                bail!("received {}", signal_name(signal));
            }
            if self.store.check(&[&plan.key(ENDED)])? {
                let how = self.store.get(&plan.key(ENDED), plan.node_timeout)?;
                bail!(
                    "run {:?} ended ({}) before node {node} was taken in",
                    plan.run_id,
                    String::from_utf8_lossy(&how)
                );
            }
            let next = attempt + 1;
            let members_key = attempt_key(plan, next, "members");
            if self.store.check(&[&members_key])? {
                let members = decode_nodes(&self.store.get(&members_key, plan.node_timeout)?)
                    .with_context(|| format!("node 0's list of the nodes of attempt {next}"))?;
                if members.contains(&node) {
                    return self.take_in(plan, next, members);
                }
                if next >= plan.max_restarts {
                    bail!(
                        "run {:?} started attempt {next}, its last (--max-restarts {}), without node {node}: no \
                         restart is left to take it in",
                        plan.run_id,
                        plan.max_restarts
                    );
                }
                (attempt, deadline) = (next, Instant::now() + limit);
                continue;
            }
            let abandoned = attempt_key(plan, next, "abandoned");
            if self.store.check(&[&abandoned])? {
                let why = self.store.get(&abandoned, plan.node_timeout)?;
                bail!("run {:?} does not restart: {}", plan.run_id, String::from_utf8_lossy(&why));
            }
            if let Some(watch) = self.watch.as_mut() {
                if let Some((n, silent)) = watch.silent(&self.store, plan, std::iter::once(0))? {
                    bail!("{}", describe_silence(&node_name(&self.hosts, n), silent));
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "node {node} was not taken in by run {:?} within {limit:?} (node 0 restarts for it only while \
                     its own ranks run)",
                    plan.run_id
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// This launcher, waiting to join, is among the nodes of `attempt`:
    /// takes the attempt's nodes, their hosts, the attempts before it and
    /// the attempt's store for the ranks.
    fn take_in(&mut self, plan: &Plan, attempt: usize, members: Vec<usize>) -> anyhow::Result<()> {
        self.attempt = attempt;
        let history = self.store.get(&self.attempt_key(plan, "history"), plan.timeout)?;
        self.history = parse_history(&history).context("node 0's list of the earlier attempts")?;
        self.hosts = per_node(&self.store, plan, &members, "host")?;
        self.rank_env = shared_memory_env(&per_node(&self.store, plan, &members, "view")?);
        self.read_attempt_start(plan)?;
        eprintln!(
            "chorus launch: node {} joins run {:?} at attempt {attempt}, with nodes {members:?}",
            plan.node_rank, plan.run_id
        );
        self.members = members;
        Ok(())
    }

    /// Node 0, while its ranks run: what stops the attempt when a node
    /// waits to join (elastic, within MAX) with its launcher alive and a
    /// restart remains to take it in (torchrun's scale-up; here it spends a
    /// restart, so a node that keeps coming back cannot restart the job
    /// without end).
    pub(super) fn node_waiting_to_join(&mut self, plan: &Plan) -> Result<Option<String>, CommError> {
        if plan.node_rank != 0 || !plan.elastic() || self.attempt >= plan.max_restarts {
            return Ok(None);
        }
        let Some(watch) = self.watch.as_mut() else { return Ok(None) };
        for n in (1..plan.nnodes).filter(|n| !self.members.contains(n)) {
            if !self.store.check(&[&plan.key(&format!("waiting/{n}"))])?
                || watch.liveness(&self.store, plan, n)? != Liveness::Alive
            {
                continue;
            }
            let host = self.store.get(&plan.key(&format!("host/{n}")), plan.node_timeout)?;
            self.hosts[n] = String::from_utf8_lossy(&host).into_owned();
            return Ok(Some(format!(
                "{} is waiting to join (--nnodes {}:{}): the nodes restart to take it in",
                node_name(&self.hosts, n),
                plan.min_nodes,
                plan.nnodes
            )));
        }
        Ok(None)
    }

    /// This node's place among the attempt's nodes (its GROUP_RANK).
    pub(super) fn group_rank(&self, plan: &Plan) -> usize {
        self.members.iter().position(|&n| n == plan.node_rank).unwrap_or(plan.node_rank)
    }
}

/// The attempts [`Job::history_json`] wrote.
fn parse_history(json: &[u8]) -> anyhow::Result<Vec<Failed>> {
    let list: Vec<serde_json::Value> = serde_json::from_slice(json).context("not a JSON list")?;
    list.iter()
        .map(|entry| {
            let field = |name: &str| entry.get(name).with_context(|| format!("{entry}: no {name:?}"));
            Ok(Failed {
                attempt: field("attempt")?.as_u64().and_then(|a| usize::try_from(a).ok()).context("attempt")?,
                seconds: field("seconds")?.as_f64().context("seconds")?,
                what: field("failure")?.as_str().context("failure")?.to_string(),
            })
        })
        .collect()
}

/// The store key `rest` of attempt `attempt` (the first attempt's keys are
/// where a launch without restarts has them).
fn attempt_key(plan: &Plan, attempt: usize, rest: &str) -> String {
    match attempt {
        0 => plan.key(rest),
        a => plan.key(&format!("attempt/{a}/{rest}")),
    }
}

/// Where attempt `attempt`'s ranks write their dumps: the launch's dump
/// directory for the first, `attempt-<a>/` inside it for each restart.
pub(super) fn trace_dir(base: &std::path::Path, attempt: usize) -> std::path::PathBuf {
    match attempt {
        0 => base.to_path_buf(),
        a => base.join(format!("attempt-{a}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_restart_has_its_own_dump_directory() {
        let base = std::path::Path::new("/tmp/trace/job");
        assert_eq!(trace_dir(base, 0), base);
        assert_eq!(trace_dir(base, 2), base.join("attempt-2"));
    }
}
