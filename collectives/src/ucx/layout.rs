//! Where a communicator's ranks sit: a ring over some of them ([`Ring`]),
//! how they sit on hosts ([`Layout`], which the hierarchical schedules
//! follow) and this process's host key ([`host_key`]).

/// The communicator ranks a ring runs over, in ring order, and this rank's
/// position among them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ring {
    pub(crate) peers: Vec<usize>,
    pub(crate) pos: usize,
}

impl Ring {
    /// Every rank of an `n`-rank communicator, in rank order.
    pub(crate) fn all(n: usize, me: usize) -> Ring {
        Ring { peers: (0..n).collect(), pos: me }
    }
    pub(crate) fn len(&self) -> usize {
        self.peers.len()
    }
    pub(crate) fn next(&self) -> usize {
        self.peers[(self.pos + 1) % self.len()]
    }
    pub(crate) fn prev(&self) -> usize {
        self.peers[(self.pos + self.len() - 1) % self.len()]
    }
}

/// How a communicator's ranks sit on hosts, as one rank sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The communicator ranks of each host (hosts in the order of their
    /// lowest rank, ranks ascending): `hosts[p][i]` is host p's local rank i.
    pub(super) hosts: Vec<Vec<usize>>,
    /// This rank's host's ranks.
    pub(super) local: Ring,
    /// The ranks with this rank's local index, one per host.
    pub(super) cross: Ring,
}

impl Layout {
    /// The layout of a communicator whose rank `r` has host key
    /// `keys[r]`, seen by rank `me`; `None` (the flat rings) unless there
    /// are at least two hosts, each with the same number (> 1) of ranks.
    pub(crate) fn of(keys: &[&str], me: usize) -> Option<Layout> {
        let mut names: Vec<&str> = Vec::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (r, k) in keys.iter().enumerate() {
            match names.iter().position(|n| n == k) {
                Some(p) => hosts[p].push(r),
                None => {
                    names.push(k);
                    hosts.push(vec![r]);
                }
            }
        }
        let m = hosts.first()?.len();
        if hosts.len() < 2 || m < 2 || hosts.iter().any(|h| h.len() != m) {
            return None;
        }
        let h = hosts.iter().position(|g| g.contains(&me))?;
        let i = hosts[h].iter().position(|r| *r == me)?;
        let local = Ring { peers: hosts[h].clone(), pos: i };
        let cross = Ring { peers: hosts.iter().map(|g| g[i]).collect(), pos: h };
        Some(Layout { hosts, local, cross })
    }

    /// Element ranges, one per local rank, of host `p`'s ranks' chunks of `count` elements.
    pub(super) fn chunks_of_host(&self, p: usize, count: usize) -> Vec<(usize, usize)> {
        self.hosts[p].iter().map(|r| (r * count, (r + 1) * count)).collect()
    }

    /// Element ranges, one per host, of the chunks of the ranks with this rank's local index.
    pub(super) fn chunks_across(&self, count: usize) -> Vec<(usize, usize)> {
        self.cross.peers.iter().map(|r| (r * count, (r + 1) * count)).collect()
    }
}

/// This process's host key: `config`'s when set, else the host name, the
/// kernel's boot id and the network namespace. Ranks with equal keys are
/// on one host: one kernel, one network stack (containers on one machine
/// with network namespaces of their own count as hosts of their own, as the
/// traffic between them goes through their links).
pub(crate) fn host_key(configured: Option<&str>) -> String {
    if let Some(k) = configured {
        return k.to_string();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let net = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{}/{}/{}", crate::recorder::host_name(), boot.trim(), net)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_hosts_of_two_pair_the_ranks_by_local_index() {
        // Ranks 0 and 2 on host a, 1 and 3 on host b (interleaved on purpose).
        let lay = Layout::of(&["a", "b", "a", "b"], 3).unwrap();
        assert_eq!(lay.hosts, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(lay.local, Ring { peers: vec![1, 3], pos: 1 });
        assert_eq!(lay.cross, Ring { peers: vec![2, 3], pos: 1 });
        assert_eq!(lay.chunks_of_host(0, 5), vec![(0, 5), (10, 15)]);
        assert_eq!(lay.chunks_across(5), vec![(10, 15), (15, 20)]);
    }

    #[test]
    fn one_host_single_rank_hosts_and_uneven_hosts_take_the_flat_rings() {
        assert_eq!(Layout::of(&["a", "a", "a", "a"], 0), None);
        assert_eq!(Layout::of(&["a", "b", "c"], 1), None);
        assert_eq!(Layout::of(&["a", "a", "b", "b", "b", "a"], 0).map(|l| l.cross.len()), Some(2));
        assert_eq!(Layout::of(&["a", "a", "a", "b", "b"], 0), None);
    }

    #[test]
    fn the_ring_wraps_around_its_peers() {
        let r = Ring { peers: vec![4, 6, 9], pos: 0 };
        assert_eq!((r.next(), r.prev()), (6, 9));
        let r = Ring::all(2, 1);
        assert_eq!((r.next(), r.prev()), (0, 0));
    }

    #[test]
    fn the_host_key_is_the_configured_one_or_names_kernel_and_network() {
        assert_eq!(host_key(Some("fake-host-1")), "fake-host-1");
        let k = host_key(None);
        assert!(k.contains("net:["), "{k}");
        assert_eq!(k, host_key(None));
    }
}
