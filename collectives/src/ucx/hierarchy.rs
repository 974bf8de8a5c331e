//! The topology-aware schedules of the large all-reduce, reduce-scatter and
//! all-gather when a communicator spans several hosts with several ranks on
//! each: the ranks of one host talk over shared memory, and only ~1/m of
//! the data (m ranks per host) crosses the host boundary per rank.
//!
//! - **all-reduce** = a ring reduce-scatter inside the host (rank `i` of the
//!   host ends with the host's partial of share `i`), a ring all-reduce of
//!   that share across hosts among the ranks with the same local index
//!   (reduce-scatter + all-gather), a ring all-gather inside the host. Each
//!   host sends 2(H−1)/H of the buffer over its link (H hosts), the
//!   bandwidth lower bound of any all-reduce between H hosts; the flat ring
//!   sends 2(n−1)/n of it across each host boundary (n ranks).
//! - **reduce-scatter**: a ring reduce-scatter across hosts of H partials,
//!   where the partial of host p (made by a ring reduce-scatter inside the
//!   host of the chunks of host p's ranks: rank `i` of the host ends with
//!   this host's partial of the chunk of host p's rank `i`) is made when
//!   the cross ring needs it, while the step before it is on the link.
//! - **all-gather**: a ring all-gather across hosts among the ranks with the
//!   same local index, then, for each host p, a ring all-gather inside the
//!   host of host p's ranks' chunks.
//!
//! The order of every reduction is fixed by the layout (the same on every
//! rank, run after run), so every rank gets bitwise the same all-reduce
//! result; float results can differ from the flat ring's in the last bits.
//!
//! A rank's host is its **host key** ([`host_key`]), exchanged with the
//! worker addresses when the world is made; a split communicator takes its
//! members' keys from the world's. The schedule applies when every host of
//! the communicator has the same number (> 1) of its ranks and there are
//! at least two hosts ([`Layout::of`]); otherwise the flat rings run.

use std::sync::Arc;

use chorus_devices::cpu::RawRange;

use super::algorithms::Own;
use super::exec::{Exec, Prepared};
use super::region::{self, Region, Scratch};
use crate::arith::{partial_op, share};
use crate::Result;

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
    hosts: Vec<Vec<usize>>,
    /// This rank's host's ranks.
    local: Ring,
    /// The ranks with this rank's local index, one per host.
    cross: Ring,
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
    fn chunks_of_host(&self, p: usize, count: usize) -> Vec<(usize, usize)> {
        self.hosts[p].iter().map(|r| (r * count, (r + 1) * count)).collect()
    }

    /// Element ranges, one per host, of the chunks of the ranks with this rank's local index.
    fn chunks_across(&self, count: usize) -> Vec<(usize, usize)> {
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

/// The hierarchical all-reduce of `c` (see the module documentation).
pub(crate) fn all_reduce(x: &Exec<'_>, lay: &Layout, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
    let (es, n) = (c.dtype.size(), lay.local.len() * lay.cross.len());
    let local: Vec<(usize, usize)> = (0..lay.local.len()).map(|j| share(c.count, lay.local.len(), j)).collect();
    let (lo, hi) = local[lay.local.pos];
    let len = hi - lo;
    // This host's partial of share `pos`, then the job's reduction of it.
    let shard = x.core().scratch(len * es);
    let shard_region = Region::scratch(&shard, 0, len * es)?;
    let own = Own::Input { send: &Region::user_all(send), chunks: &local };
    x.ring_reduce_scatter(c, &lay.local, c.reduce, None, own, &shard_region)?;
    let across: Vec<(usize, usize)> = (0..lay.cross.len()).map(|p| share(len, lay.cross.len(), p)).collect();
    let (clo, chi) = across[lay.cross.pos];
    let out = x.core().scratch((chi - clo) * es);
    let out_region = Region::scratch(&out, 0, (chi - clo) * es)?;
    let own = Own::Input { send: &shard_region, chunks: &across };
    x.ring_reduce_scatter(c, &lay.cross, partial_op(c.reduce), Some(n), own, &out_region)?;
    region::copy(&out_region, &shard_region.part(clo * es, (chi - clo) * es)?)?;
    drop(out_region);
    x.core().give_back(out);
    x.ring_all_gather(c, &lay.cross, &shard_region, &across)?;
    // Every input chunk has been read (all steps waited): the in-place output can be written.
    region::copy(&shard_region, &Region::user(recv, lo * es, len * es)?)?;
    drop(shard_region);
    x.core().give_back(shard);
    x.ring_all_gather(c, &lay.local, &Region::user_all(recv), &local)
}

/// The hierarchical reduce-scatter of `c` (`c.count` elements per rank).
pub(crate) fn reduce_scatter(x: &Exec<'_>, lay: &Layout, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
    let (es, count, n) = (c.dtype.size(), c.count, lay.local.len() * lay.cross.len());
    let bytes = count * es;
    let input = Region::user_all(send);
    // This host's partial of the chunk of host p's rank with this rank's
    // local index, made by the ring across hosts when it needs it: while the
    // link carries one host's partial, the host reduces the next.
    let mut partial = |p: usize| -> Result<Arc<Scratch>> {
        let s = x.core().scratch(bytes);
        let own = Own::Input { send: &input, chunks: &lay.chunks_of_host(p, count) };
        x.ring_reduce_scatter(c, &lay.local, c.reduce, None, own, &Region::scratch(&s, 0, bytes)?)?;
        Ok(s)
    };
    let out = x.core().scratch(bytes);
    let out_region = Region::scratch(&out, 0, bytes)?;
    let own = Own::Produced { len: count, make: &mut partial };
    x.ring_reduce_scatter(c, &lay.cross, partial_op(c.reduce), Some(n), own, &out_region)?;
    region::copy(&out_region, &Region::user(recv, 0, bytes)?)?;
    drop(out_region);
    x.core().give_back(out);
    Ok(())
}

/// The hierarchical all-gather of `c` in place in `recv` (this rank's chunk already there).
pub(crate) fn all_gather(x: &Exec<'_>, lay: &Layout, c: &Prepared, recv: &RawRange) -> Result<()> {
    let recv = Region::user_all(recv);
    x.ring_all_gather(c, &lay.cross, &recv, &lay.chunks_across(c.count))?;
    for p in 0..lay.cross.len() {
        x.ring_all_gather(c, &lay.local, &recv, &lay.chunks_of_host(p, c.count))?;
    }
    Ok(())
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
