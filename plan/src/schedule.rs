//! The schedule check: every rank's collective sequence compared, per
//! communicator, and the first divergence named as `chorus trace` names it
//! (the rank, the communicator, the call and what each side called).

use std::collections::BTreeMap;

use crate::virt::comm::{CollectiveRecord, Divergence};

/// The first divergence among `sequences` (each rank's collectives in issue
/// order, indexed by global rank): for each communicator (by name), the
/// members' calls are compared position by position against the lowest
/// rank's; the earliest position that differs (or that one rank lacks) wins,
/// ties going to the lower rank. Communicators are compared by name, so
/// split communicators of different colors are different communicators.
pub fn first_divergence(sequences: &[Vec<CollectiveRecord>]) -> Option<Divergence> {
    // communicator -> rank -> its calls there, in order.
    let mut by_comm: BTreeMap<&str, BTreeMap<usize, Vec<&CollectiveRecord>>> = BTreeMap::new();
    for (rank, seq) in sequences.iter().enumerate() {
        // Every rank is a member of the world's communicator, calls or none.
        by_comm.entry("root").or_default().entry(rank).or_default();
        for c in seq {
            by_comm.entry(c.group.as_str()).or_default().entry(rank).or_default().push(c);
        }
    }
    let mut best: Option<Divergence> = None;
    for (comm, ranks) in &by_comm {
        let mut it = ranks.iter();
        let Some((&first, reference)) = it.next() else { continue };
        for (&rank, calls) in it {
            let n = reference.len().max(calls.len());
            let Some(i) =
                (0..n).find(|&i| reference.get(i).map(|c| c.signature()) != calls.get(i).map(|c| c.signature()))
            else {
                continue;
            };
            let d = Divergence {
                group: comm.to_string(),
                seq: i as u64,
                rank,
                called: calls.get(i).map(|c| c.signature()),
                other_rank: first,
                other_called: reference.get(i).map(|c| c.signature()),
            };
            if best.as_ref().is_none_or(|b| (d.seq, d.rank) < (b.seq, b.rank)) {
                best = Some(d);
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(group: &str, seq: u64, op: &str, count: u64) -> CollectiveRecord {
        CollectiveRecord { group: group.into(), seq, op: op.into(), dtype: "f32".into(), count, bytes: 4 * count }
    }

    #[test]
    fn identical_sequences_have_no_divergence() {
        let s = vec![call("root", 0, "all_gather", 8), call("root", 1, "reduce_scatter", 8)];
        assert_eq!(first_divergence(&[s.clone(), s.clone(), s]), None);
    }

    #[test]
    fn the_earliest_differing_call_is_named_with_both_sides() {
        let a = vec![call("root", 0, "all_gather", 8), call("root", 1, "reduce_scatter", 8)];
        let mut b = a.clone();
        b[1].count = 16;
        let mut c = a.clone();
        c.truncate(1);
        let d = first_divergence(&[a, b, c]).unwrap();
        assert_eq!((d.group.as_str(), d.seq, d.rank, d.other_rank), ("root", 1, 1, 0));
        assert_eq!(d.called.as_deref(), Some("reduce_scatter(16 x f32)"));
        assert_eq!(d.other_called.as_deref(), Some("reduce_scatter(8 x f32)"));
    }

    #[test]
    fn a_missing_call_is_a_divergence() {
        let a = vec![call("root", 0, "all_gather", 8)];
        let d = first_divergence(&[a, Vec::new()]).unwrap();
        assert_eq!((d.seq, d.rank, d.called), (0, 1, None));
        let b = vec![call("root", 0, "all_gather", 8), call("root", 1, "all_gather", 8)];
        let d = first_divergence(&[b, vec![call("root", 0, "all_gather", 8)]]).unwrap();
        assert_eq!((d.seq, d.rank, d.called), (1, 1, None));
    }
}
