//! What went wrong, read from every rank's flight-recorder dump: the first
//! call ranks disagree on, the ranks that never reached a call the others
//! are blocked in, the calls that never started or never completed.
//!
//! Ranks are the ranks of the root communicator (the dumps' `rank`);
//! each communicator (the root, its splits) is analysed on its own, over the
//! collective sequence numbers its members' rings hold (a ring that dropped
//! its oldest launches takes no part in comparing them).

use std::collections::{BTreeMap, BTreeSet};

use chorus_collectives::recorder::{CallState, CommRecord, EntryRecord, RankDump};
use serde::Serialize;

/// The analysis of one directory of dumps.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Ranks of the root communicator (from the dumps).
    pub world_size: u64,
    /// Every dump read: rank, host, pid and why it was written.
    pub dumps: Vec<DumpSummary>,
    /// Ranks of the root communicator with no dump (killed, stopped, or
    /// never got to write one).
    pub missing_dumps: Vec<u64>,
    /// Each communicator's findings, the root first.
    pub communicators: Vec<CommReport>,
    /// Every dump was taken on a signal (SIGTERM, SIGINT, SIGUSR1), none for
    /// a failure: a snapshot of a run that may have been healthy, whose
    /// unfinished calls were in flight, not necessarily stuck.
    pub snapshot: bool,
    /// The findings in one line each, the most telling first.
    pub verdict: Vec<String>,
    /// The run analysed (its id and start), where the dumps say.
    pub run: Option<String>,
    /// Dumps of other runs in the directory, left out (one line per run).
    pub other_runs: Vec<String>,
}

/// One dump read.
#[derive(Debug, Serialize)]
pub struct DumpSummary {
    /// The rank.
    pub rank: u64,
    /// Its host.
    pub host: String,
    /// Its process.
    pub pid: u32,
    /// Why it dumped.
    pub reason: String,
}

/// The ranks that issued one call.
#[derive(Debug, Serialize, PartialEq)]
pub struct CallGroup {
    /// The call (`all_reduce(1024 x f32, sum)`).
    pub call: String,
    /// Ranks that issued it.
    pub ranks: Vec<u64>,
}

/// The first sequence number at which ranks issued different calls.
#[derive(Debug, Serialize)]
pub struct Mismatch {
    /// The sequence number.
    pub seq: u64,
    /// Each call and the ranks that issued it, the fewest ranks first.
    pub groups: Vec<CallGroup>,
}

/// A call some ranks are blocked in and others never issued.
#[derive(Debug, Serialize)]
pub struct Missing {
    /// Its sequence number.
    pub seq: u64,
    /// The call, as the blocked ranks issued it.
    pub call: String,
    /// Ranks inside it (issued, not completed).
    pub blocked: Vec<u64>,
    /// Ranks whose ring ends before it, with their last call.
    pub absent: Vec<Absent>,
}

/// A rank that never issued a call.
#[derive(Debug, Serialize)]
pub struct Absent {
    /// The rank.
    pub rank: u64,
    /// Its last recorded call and its state, if any.
    pub last: Option<String>,
}

/// A call some ranks issued but whose stream never reached it, while others are in it.
#[derive(Debug, Serialize)]
pub struct NotStarted {
    /// Its sequence number.
    pub seq: u64,
    /// The call.
    pub call: String,
    /// Ranks where it is still `enqueued`.
    pub ranks: Vec<u64>,
    /// Ranks where it started (or failed).
    pub others: Vec<u64>,
}

/// The first launch of a rank that did not complete.
#[derive(Debug, Serialize)]
pub struct Unfinished {
    /// The rank.
    pub rank: u64,
    /// The launch (`#3 all_reduce(1024 x f32, sum)`).
    pub call: String,
    /// Its state.
    pub state: CallState,
    /// Its error, if it failed.
    pub error: Option<String>,
}

/// One communicator's findings.
#[derive(Debug, Serialize)]
pub struct CommReport {
    /// Its name (`root`, `root/split0:color1`).
    pub id: String,
    /// Its size.
    pub size: u64,
    /// Ranks (of the root) whose dumps hold it, in communicator-rank order.
    pub members: Vec<u64>,
    /// The first call the members disagree on.
    pub mismatch: Option<Mismatch>,
    /// The first call some members are blocked in and others never issued.
    pub missing: Option<Missing>,
    /// The first call some members issued but never started while others are in it.
    pub not_started: Option<NotStarted>,
    /// Each member's first launch that did not complete.
    pub unfinished: Vec<Unfinished>,
}

/// `0,2-4,7`.
pub fn ranks_text(ranks: &[u64]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j == i { ranks[i].to_string() } else { format!("{}-{}", ranks[i], ranks[j]) });
        i = j + 1;
    }
    parts.join(",")
}

fn who(ranks: &[u64]) -> String {
    if ranks.len() == 1 {
        format!("rank {}", ranks[0])
    } else {
        format!("ranks {}", ranks_text(ranks))
    }
}

/// A launch as one line: `#3 all_reduce(8 x f32, sum)` (a group lists its calls).
pub fn entry_text(e: &EntryRecord) -> String {
    let calls: Vec<String> = e.calls.iter().map(|c| c.signature()).collect();
    match e.seq() {
        Some(s) => format!("#{s} {}", calls.join(" + ")),
        None => calls.join(" + "),
    }
}

/// What a member's ring says about the collective at `seq`: its call text and state.
struct AtSeq<'a> {
    call: String,
    entry: &'a EntryRecord,
}

struct Member<'a> {
    rank: u64,
    record: &'a CommRecord,
    /// Collective calls by sequence number.
    by_seq: BTreeMap<u64, AtSeq<'a>>,
}

impl<'a> Member<'a> {
    fn new(rank: u64, record: &'a CommRecord) -> Member<'a> {
        let mut by_seq = BTreeMap::new();
        for entry in &record.entries {
            for c in entry.calls.iter().filter(|c| c.seq.is_some()) {
                by_seq.insert(c.seq.unwrap_or_default(), AtSeq { call: c.signature(), entry });
            }
        }
        Member { rank, record, by_seq }
    }

    fn high(&self) -> Option<u64> {
        self.by_seq.keys().next_back().copied()
    }

    fn last_text(&self) -> Option<String> {
        self.record.entries.last().map(|e| format!("{} {}", entry_text(e), e.state.name()))
    }
}

fn analyse_comm(id: &str, members: &[Member<'_>]) -> CommReport {
    let size = members.first().map_or(0, |m| m.record.size);
    let seqs: BTreeSet<u64> = members.iter().flat_map(|m| m.by_seq.keys().copied()).collect();

    let mut mismatch = None;
    for &seq in &seqs {
        let mut groups: Vec<CallGroup> = Vec::new();
        for m in members {
            if let Some(at) = m.by_seq.get(&seq) {
                match groups.iter_mut().find(|g| g.call == at.call) {
                    Some(g) => g.ranks.push(m.rank),
                    None => groups.push(CallGroup { call: at.call.clone(), ranks: vec![m.rank] }),
                }
            }
        }
        if groups.len() > 1 {
            groups.sort_by_key(|g| (g.ranks.len(), g.ranks.first().copied()));
            mismatch = Some(Mismatch { seq, groups });
            break;
        }
    }

    let unfinished_at =
        |m: &Member<'_>, seq: u64| m.by_seq.get(&seq).is_some_and(|a| a.entry.state != CallState::Completed);
    let mut missing = None;
    for &seq in &seqs {
        let blocked: Vec<u64> = members.iter().filter(|m| unfinished_at(m, seq)).map(|m| m.rank).collect();
        if blocked.is_empty() {
            continue;
        }
        let absent: Vec<Absent> = members
            .iter()
            .filter(|m| m.high().is_none_or(|h| h < seq))
            .map(|m| Absent { rank: m.rank, last: m.last_text() })
            .collect();
        if !absent.is_empty() {
            let call = members.iter().find_map(|m| m.by_seq.get(&seq)).map(|a| a.call.clone()).unwrap_or_default();
            missing = Some(Missing { seq, call, blocked, absent });
        }
        break;
    }

    // Only rings that record starts can tell a stalled stream from a blocked rank.
    let mut not_started = None;
    for &seq in seqs.iter().filter(|_| members.iter().all(|m| m.record.tracks_starts)) {
        let states: Vec<(u64, CallState)> =
            members.iter().filter_map(|m| m.by_seq.get(&seq).map(|a| (m.rank, a.entry.state))).collect();
        if states.iter().all(|(_, s)| *s == CallState::Completed) {
            continue;
        }
        let ranks: Vec<u64> = states.iter().filter(|(_, s)| *s == CallState::Enqueued).map(|(r, _)| *r).collect();
        let others: Vec<u64> = states
            .iter()
            .filter(|(_, s)| matches!(s, CallState::Started | CallState::Failed))
            .map(|(r, _)| *r)
            .collect();
        if !ranks.is_empty() && !others.is_empty() {
            let call = members.iter().find_map(|m| m.by_seq.get(&seq)).map(|a| a.call.clone()).unwrap_or_default();
            not_started = Some(NotStarted { seq, call, ranks, others });
        }
        break;
    }

    let unfinished = members
        .iter()
        .filter_map(|m| {
            m.record.entries.iter().find(|e| e.state != CallState::Completed).map(|e| Unfinished {
                rank: m.rank,
                call: entry_text(e),
                state: e.state,
                error: e.error.clone(),
            })
        })
        .collect();

    CommReport {
        id: id.to_string(),
        size,
        members: members.iter().map(|m| m.rank).collect(),
        mismatch,
        missing,
        not_started,
        unfinished,
    }
}

/// Analyses the dumps of one job (one per rank; the caller checks that).
pub fn analyse(dumps: &[RankDump]) -> Report {
    let world_size = dumps.iter().map(|d| d.world_size).max().unwrap_or(0);
    let present: BTreeSet<u64> = dumps.iter().map(|d| d.rank).collect();
    let missing_dumps: Vec<u64> = (0..world_size).filter(|r| !present.contains(r)).collect();
    // Communicator names in the order the lowest rank's dump lists them.
    let mut ids: Vec<&str> = Vec::new();
    let mut sorted: Vec<&RankDump> = dumps.iter().collect();
    sorted.sort_by_key(|d| d.rank);
    for d in &sorted {
        for c in &d.communicators {
            if !ids.contains(&c.id.as_str()) {
                ids.push(&c.id);
            }
        }
    }
    let mut communicators = Vec::new();
    for id in ids {
        let mut members: Vec<Member<'_>> = sorted
            .iter()
            .filter_map(|d| d.communicators.iter().find(|c| c.id == id).map(|c| Member::new(d.rank, c)))
            .collect();
        members.sort_by_key(|m| m.record.rank);
        communicators.push(analyse_comm(id, &members));
    }
    let snapshot = !dumps.is_empty() && dumps.iter().all(RankDump::is_snapshot);
    let mut verdict = verdict(&communicators, &missing_dumps, snapshot);
    if snapshot {
        let mut signals: Vec<&str> = dumps.iter().map(|d| d.reason.as_str()).collect();
        signals.sort_unstable();
        signals.dedup();
        verdict.insert(
            0,
            format!(
                "SNAPSHOT: every dump was taken on a signal ({}), none for a failure: the calls below were in \
                 flight at that moment, not necessarily stuck",
                signals.join(", ")
            ),
        );
    }
    let dumps = sorted
        .iter()
        .map(|d| DumpSummary { rank: d.rank, host: d.host.clone(), pid: d.pid, reason: d.reason.clone() })
        .collect();
    Report { world_size, dumps, missing_dumps, communicators, snapshot, verdict, run: None, other_runs: Vec::new() }
}

fn verdict(comms: &[CommReport], missing_dumps: &[u64], snapshot: bool) -> Vec<String> {
    let mut lines = Vec::new();
    for c in comms {
        let on = if c.id == "root" { String::new() } else { format!(" of communicator {}", c.id) };
        if let Some(m) = &c.mismatch {
            let groups: Vec<String> = m.groups.iter().map(|g| format!("{} called {}", who(&g.ranks), g.call)).collect();
            lines.push(format!("MISMATCH at #{}{on}: {}", m.seq, groups.join("; ")));
        }
        if let Some(m) = &c.missing {
            let absent: Vec<u64> = m.absent.iter().map(|a| a.rank).collect();
            let lasts: Vec<String> = m
                .absent
                .iter()
                .map(|a| format!("rank {}'s last call: {}", a.rank, a.last.as_deref().unwrap_or("none")))
                .collect();
            let are = if m.blocked.len() == 1 { "is" } else { "are" };
            let (absent, seq, call, blocked, lasts) = (who(&absent), m.seq, &m.call, who(&m.blocked), lasts.join("; "));
            lines.push(if snapshot {
                format!("NOT YET REACHED: {absent} had not issued #{seq} {call}{on}, which {blocked} {are} in ({lasts})")
            } else {
                format!("NEVER REACHED: {absent} never issued #{seq} {call}{on}, which {blocked} {are} blocked in ({lasts})")
            });
        }
        if let Some(n) = &c.not_started {
            lines.push(format!(
                "STALLED: {} issued #{} {}{on} but {} stream never reached it (stalled by earlier work); {} {} in it",
                who(&n.ranks),
                n.seq,
                n.call,
                if n.ranks.len() == 1 { "its" } else { "their" },
                who(&n.others),
                if n.others.len() == 1 { "is" } else { "are" },
            ));
        }
        // The calls that never completed, grouped by call and state.
        let mut groups: Vec<(String, CallState, Vec<u64>, Option<String>)> = Vec::new();
        for u in &c.unfinished {
            match groups.iter_mut().find(|g| g.0 == u.call && g.1 == u.state) {
                Some(g) => g.2.push(u.rank),
                None => groups.push((u.call.clone(), u.state, vec![u.rank], u.error.clone())),
            }
        }
        for (call, state, ranks, error) in groups {
            let error = error.map(|e| format!(": {e}")).unwrap_or_default();
            lines.push(format!("NOT COMPLETED{on}: {call} {} on {}{error}", state.name(), who(&ranks)));
        }
    }
    if !missing_dumps.is_empty() {
        lines.push(format!("NO DUMP from {} (killed, stopped, or never got to write one)", who(missing_dumps)));
    }
    if lines.is_empty() {
        lines.push("no divergence: every recorded call completed on every rank".into());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_collectives::recorder::{CallRecord, FORMAT_VERSION};

    fn call(op: &str, seq: u64, count: u64) -> CallRecord {
        CallRecord {
            op: op.into(),
            seq: Some(seq),
            dtype: "f32".into(),
            count,
            bytes: count * 4,
            reduce: (op == "all_reduce").then(|| "sum".into()),
            root: None,
            peer: None,
        }
    }

    fn entry(id: u64, c: CallRecord, state: CallState) -> EntryRecord {
        let error = (state == CallState::Failed).then(|| "timed out".to_string());
        EntryRecord { id, calls: vec![c], state, enqueued_us: 1, started_us: None, finished_us: None, error }
    }

    /// Rank `rank` of `size` whose root ring holds `entries`.
    fn dump(rank: u64, size: u64, entries: Vec<EntryRecord>) -> RankDump {
        RankDump {
            version: FORMAT_VERSION,
            rank,
            world_size: size,
            host: "h".into(),
            pid: 1,
            reason: "test".into(),
            dumped_us: 2,
            run_id: None,
            run_started_us: None,
            communicators: vec![CommRecord {
                id: "root".into(),
                rank,
                size,
                backend: "sim".into(),
                device: "cpu".into(),
                capacity: 16,
                tracks_starts: true,
                launches: entries.len() as u64,
                aborted: None,
                entries,
            }],
        }
    }

    /// Three completed all-reduces #0..#2 of 8 elements.
    fn done() -> Vec<EntryRecord> {
        (0..3).map(|s| entry(s, call("all_reduce", s, 8), CallState::Completed)).collect()
    }

    fn with(mut v: Vec<EntryRecord>, e: EntryRecord) -> Vec<EntryRecord> {
        v.push(e);
        v
    }

    #[test]
    fn rank_lists_are_compact() {
        assert_eq!(ranks_text(&[0, 2, 3, 4, 7]), "0,2-4,7");
        assert_eq!(ranks_text(&[]), "");
    }

    #[test]
    fn the_first_disagreement_names_each_rank_and_call() {
        let dumps = vec![
            dump(0, 3, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Failed))),
            dump(1, 3, with(done(), entry(3, call("all_gather", 3, 8), CallState::Failed))),
            dump(2, 3, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Failed))),
        ];
        let r = analyse(&dumps);
        let m = r.communicators[0].mismatch.as_ref().unwrap();
        assert_eq!(m.seq, 3);
        assert_eq!(
            m.groups,
            [
                CallGroup { call: "all_gather(8 x f32)".into(), ranks: vec![1] },
                CallGroup { call: "all_reduce(8 x f32, sum)".into(), ranks: vec![0, 2] }
            ]
        );
        assert_eq!(
            r.verdict[0],
            "MISMATCH at #3: rank 1 called all_gather(8 x f32); ranks 0,2 called all_reduce(8 x f32, sum)"
        );
        assert!(r.communicators[0].missing.is_none() && r.missing_dumps.is_empty());
    }

    #[test]
    fn a_rank_that_never_issued_the_call_is_named_with_its_last_call() {
        let dumps = vec![
            dump(0, 3, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Failed))),
            dump(1, 3, done()),
            dump(2, 3, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Started))),
        ];
        let r = analyse(&dumps);
        let m = r.communicators[0].missing.as_ref().unwrap();
        assert_eq!((m.seq, m.blocked.as_slice()), (3, &[0u64, 2][..]));
        assert_eq!(m.absent.len(), 1);
        assert_eq!(m.absent[0].rank, 1);
        assert_eq!(r.verdict[0], "NEVER REACHED: rank 1 never issued #3 all_reduce(8 x f32, sum), which ranks 0,2 are blocked in (rank 1's last call: #2 all_reduce(8 x f32, sum) completed)");
        assert!(r.communicators[0].mismatch.is_none());
        // The calls that never completed, by state.
        assert!(r
            .verdict
            .contains(&"NOT COMPLETED: #3 all_reduce(8 x f32, sum) failed on rank 0: timed out".to_string()));
        assert!(r.verdict.contains(&"NOT COMPLETED: #3 all_reduce(8 x f32, sum) started on rank 2".to_string()));
    }

    #[test]
    fn a_rank_whose_stream_never_reached_the_call_is_stalled() {
        let dumps = vec![
            dump(0, 2, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Failed))),
            dump(1, 2, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Enqueued))),
        ];
        let r = analyse(&dumps);
        let n = r.communicators[0].not_started.as_ref().unwrap();
        assert_eq!((n.seq, n.ranks.as_slice(), n.others.as_slice()), (3, &[1u64][..], &[0u64][..]));
        assert!(
            r.verdict[0].starts_with("STALLED: rank 1 issued #3 all_reduce(8 x f32, sum) but its stream"),
            "{:?}",
            r.verdict
        );
        assert!(r.communicators[0].missing.is_none() && r.communicators[0].mismatch.is_none());
        // Rings that do not track starts cannot tell a stalled stream from a blocked rank.
        let mut dumps = dumps;
        for d in &mut dumps {
            d.communicators[0].tracks_starts = false;
        }
        assert!(analyse(&dumps).communicators[0].not_started.is_none());
    }

    #[test]
    fn ranks_without_a_dump_are_named_and_a_clean_run_says_so() {
        let r = analyse(&[dump(0, 3, done()), dump(2, 3, done())]);
        assert_eq!(r.missing_dumps, [1]);
        assert_eq!(r.verdict, ["NO DUMP from rank 1 (killed, stopped, or never got to write one)"]);
        let r = analyse(&[dump(0, 2, done()), dump(1, 2, done())]);
        assert_eq!(r.verdict, ["no divergence: every recorded call completed on every rank"]);
    }

    #[test]
    fn dumps_taken_on_a_signal_are_a_snapshot_not_a_hang() {
        let mut dumps =
            vec![dump(0, 2, with(done(), entry(3, call("all_reduce", 3, 8), CallState::Started))), dump(1, 2, done())];
        for d in &mut dumps {
            d.reason = "signal SIGTERM".into();
        }
        let r = analyse(&dumps);
        assert!(r.snapshot);
        assert!(
            r.verdict[0].starts_with("SNAPSHOT: every dump was taken on a signal (signal SIGTERM)"),
            "{:?}",
            r.verdict
        );
        assert!(r.verdict[1].starts_with("NOT YET REACHED: rank 1 had not issued #3"), "{:?}", r.verdict);
        assert!(!r.verdict.iter().any(|l| l.contains("NEVER REACHED")), "{:?}", r.verdict);
        // One dump taken for a failure: not a snapshot, the hang is named as such.
        dumps[0].reason = "all_reduce #3 of communicator root failed: timed out".into();
        let r = analyse(&dumps);
        assert!(!r.snapshot && r.verdict[0].starts_with("NEVER REACHED: rank 1 never issued #3"), "{:?}", r.verdict);
    }
}
