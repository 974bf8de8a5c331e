//! The job's end on this node: the other nodes' flight-recorder dumps
//! gathered, the last output lines, and node 0's store kept up until every
//! node has finished.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chorus_collectives::bootstrap::Store;

use super::nodes::{describe_silence, node_name};
use super::{dumps, stop_requested, Job, Plan, ENDED};

impl Job {
    /// Brings the other nodes' flight-recorder dumps into this node's dump
    /// directory (several nodes, store still up), saying what is missing.
    pub(super) fn gather_dumps(&mut self, plan: &Plan) {
        if plan.nnodes == 1 || self.store_lost {
            return;
        }
        let ranks: HashSet<usize> = self.ranks.iter().map(|r| r.rank).collect();
        let dumps_key = self.attempt_key(plan, "dumps");
        let key = |rest: &str| format!("{dumps_key}/{rest}");
        let trace_dir = self.trace_dir(plan);
        // While waiting, the heartbeats are still read: a node that falls
        // silent is not waited for, and the silence is timed from fresh reads.
        let (store, watch, silent, members) = (&self.store, &mut self.watch, &mut self.silent_nodes, &self.members);
        // Nodes not in this attempt publish nothing: they count as gone.
        let outside: Vec<usize> = (0..plan.nnodes).filter(|n| !members.contains(n)).collect();
        let gone = || {
            if let Some(w) = watch.as_mut() {
                w.note_silent(store, plan, members, silent)?;
            }
            Ok(silent.iter().chain(&outside).copied().collect())
        };
        // A node publishes once its ranks have ended: a rank that ignores SIGTERM
        // (stopped, stuck) holds it for the grace period before SIGKILL.
        let wait = plan.grace + dumps::WAIT;
        let here = dumps::Node {
            index: plan.node_rank,
            count: plan.nnodes,
            ranks: &ranks,
            dir: &trace_dir,
            run: self.run_started_us,
        };
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
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        for w in &got.withheld {
            eprintln!(
                "chorus launch: {} ({:.1} MiB) not shared with the other nodes: over {} MiB, or past this node's \
                 share of the store ({:.1} MiB); it stays in {}",
                w.name,
                mib(w.bytes),
                dumps::MAX_DUMP >> 20,
                mib(dumps::node_share(plan.nnodes)),
                trace_dir.display()
            );
        }
        for (node, w) in &got.not_shared {
            eprintln!(
                "chorus launch: {} did not share {} ({:.1} MiB, too large for the store); it stays on that host",
                node_name(&self.hosts, *node),
                w.name,
                mib(w.bytes)
            );
        }
        for node in got.missing.into_iter().filter(|n| self.members.contains(n)) {
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
    pub(super) fn finish_output(&mut self) {
        if let Some(mut output) = self.output.take() {
            output.finish(Duration::from_secs(1));
        }
    }

    /// Reports this node finished (node 0: the job ended, and whether it
    /// `passed`); node 0 keeps the store up until every node has finished or
    /// gone silent, then deletes the dumps the nodes exchanged through it. A
    /// store that does not answer is lost, not a node that finished.
    pub(super) fn finish(&mut self, plan: &Plan, passed: bool) {
        if self.store_lost {
            return;
        }
        if plan.node_rank == 0 && plan.nnodes > 1 {
            // A node waiting to join, or one that comes back now, learns it at once.
            let how: &[u8] = if passed { b"succeeded" } else { b"failed" };
            if let Err(e) = self.store.set(&plan.key(ENDED), how) {
                self.lose_store("saying the job ended", &e);
                return;
            }
        }
        if let Err(e) = self.store.set(&plan.key(&format!("finished/{}", plan.node_rank)), b"1") {
            self.lose_store("reporting this node finished", &e);
            return;
        }
        if self.server.is_none() || plan.nnodes == 1 {
            return;
        }
        if let Err(e) = self.wait_for_every_node(plan) {
            self.lose_store("waiting for every node to finish", &e);
            return;
        }
        let dumps_key = self.attempt_key(plan, "dumps");
        if let Err(e) = dumps::clean(&*self.store, |rest| format!("{dumps_key}/{rest}"), plan.nnodes) {
            self.lose_store("deleting the exchanged flight-recorder dumps", &e);
        }
    }

    /// Node 0: waits until every node has reported finishing or gone silent
    /// (at most `--timeout`, or the grace period after a stop signal).
    fn wait_for_every_node(&mut self, plan: &Plan) -> Result<(), chorus_collectives::CommError> {
        let limit = if stop_requested().is_some() { plan.grace + Duration::from_secs(2) } else { plan.timeout };
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let mut pending = Vec::new();
            for &n in &self.members {
                if !self.store.check(&[&plan.key(&format!("finished/{n}"))])? {
                    pending.push(n);
                }
            }
            if pending.is_empty() {
                return Ok(());
            }
            if let Some(watch) = self.watch.as_mut() {
                if let Some((node, silent)) = watch.silent(&self.store, plan, pending.into_iter())? {
                    eprintln!(
                        "chorus launch: {} and did not report finishing; stopping the store",
                        describe_silence(&node_name(&self.hosts, node), silent)
                    );
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("chorus launch: not every node reported finishing within {limit:?}; stopping the store");
        Ok(())
    }
}
