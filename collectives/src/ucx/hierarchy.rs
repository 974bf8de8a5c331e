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
//! A rank's host is its **host key** ([`host_key`](super::layout::host_key)), exchanged with the
//! worker addresses when the world is made; a split communicator takes its
//! members' keys from the world's. The schedule applies when every host of
//! the communicator has the same number (> 1) of its ranks and there are
//! at least two hosts ([`Layout::of`]); otherwise the flat rings run.

use std::sync::Arc;

use chorus_devices::cpu::RawRange;

use super::algorithms::Own;
use super::exec::{Exec, Prepared};
use super::layout::Layout;
use super::region::{self, Region, Scratch};
use crate::arith::{partial_op, share};
use crate::Result;

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
