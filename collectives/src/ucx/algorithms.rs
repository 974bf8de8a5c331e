//! The collectives as sequences of tagged sends and receives, run by one
//! rank on its stream's executor thread.
//!
//! - **Small** calls (every rank's buffer at most [`UcxConfig::small_bytes`](super::UcxConfig))
//!   take one round of direct messages: all-reduce sends every rank's vector
//!   to every other rank, reduce-scatter sends chunk `j` to rank `j`,
//!   all-gather and broadcast send the input to every rank, reduce sends to
//!   the root; the receiver reduces **in rank order** 0..n−1 — the sim
//!   backend's order, so the results are bitwise the sim's.
//! - **Large** calls take the bandwidth-optimal ring: reduce-scatter in
//!   n−1 steps (chunk `j` is reduced starting at rank j+1 and going round
//!   to rank j, each rank adding its own input), all-gather in n−1 steps,
//!   all-reduce as both (chunks of `count/n`), reduce as the ring
//!   reduce-scatter and a gather to the root; broadcast is a pipelined chain
//!   from the root in segments. The ring's order is fixed, so every rank
//!   gets bitwise the same result, run after run, but float results can
//!   differ from the rank-order ones in the last bits.
//! - all-to-all is pairwise (round `k` sends to `rank + k` and receives
//!   from `rank − k`); a barrier is a dissemination barrier (⌈log2 n⌉
//!   rounds of empty messages).

use std::sync::Arc;

use chorus_devices::cpu::RawRange;

use super::exec::{missing, Exec, Prepared, SEGMENT};
use super::layout::Ring;
use super::region::{self, Region, Scratch};
use super::wire::Kind;
use crate::arith::share;
use crate::{CommError, ReduceOp, Result};

/// Where a ring reduce-scatter's own contribution to each chunk comes from.
pub(crate) enum Own<'s> {
    /// Chunk `j` is the element range `chunks[j]` of this rank's input
    /// `send` (combined with the ring's operator, scaled for a
    /// pre-multiplied sum).
    Input { send: &'s Region, chunks: &'s [(usize, usize)] },
    /// Chunk `j` (`len` elements, a partial result) is made by `make(j)`
    /// when the ring first needs it: the first before the ring starts, each
    /// later one while the step before it is in flight.
    Produced { len: usize, make: &'s mut dyn FnMut(usize) -> Result<Arc<Scratch>> },
}

/// One own chunk, and the scratch it was made in (returned to the pool after use).
struct OwnChunk {
    region: Region,
    made: Option<Arc<Scratch>>,
}

impl Own<'_> {
    fn elements(&self, j: usize) -> usize {
        match self {
            Own::Input { chunks, .. } => chunks.get(j).map_or(0, |(lo, hi)| hi - lo),
            Own::Produced { len, .. } => *len,
        }
    }

    fn max_elements(&self) -> usize {
        match self {
            Own::Input { chunks, .. } => chunks.iter().map(|(lo, hi)| hi - lo).max().unwrap_or(0),
            Own::Produced { len, .. } => *len,
        }
    }

    fn get(&mut self, j: usize, es: usize) -> Result<OwnChunk> {
        match self {
            Own::Input { send, chunks } => {
                let (lo, hi) = *chunks
                    .get(j)
                    .ok_or_else(|| CommError::invalid("ucx", format!("no chunk {j} of {}", chunks.len())))?;
                Ok(OwnChunk { region: send.part(lo * es, (hi - lo) * es)?, made: None })
            }
            Own::Produced { len, make } => {
                let s = make(j)?;
                Ok(OwnChunk { region: Region::scratch(&s, 0, *len * es)?, made: Some(s) })
            }
        }
    }
}

impl<'a> Exec<'a> {
    /// This rank's contribution `x` (a region of its input), scaled for a
    /// pre-multiplied sum, in a scratch of its size.
    fn own_contribution(&self, c: &Prepared, x: &Region) -> Result<Arc<Scratch>> {
        let s = self.core.scratch(x.len());
        region::start(c.dtype, &Region::scratch(&s, 0, x.len())?, x, c.reduce)?;
        Ok(s)
    }

    /// Every rank's (scaled) vector to every rank; each reduces in rank order.
    pub(super) fn all_reduce_direct(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me, bytes) = (self.n(), self.me(), c.count * c.dtype.size());
        let own = self.own_contribution(c, &Region::user(send, 0, bytes)?)?;
        let slots = self.core.scratch(n * bytes);
        let mut reqs = Vec::new();
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            reqs.push(self.recv(from, Kind::Data, Region::scratch(&slots, from * bytes, bytes)?)?);
            reqs.push(self.send(to, Kind::Data, Region::scratch(&own, 0, bytes)?)?);
        }
        self.wait(reqs)?;
        self.reduce_slots(c, own, 0, slots, bytes, &Region::user(recv, 0, bytes)?)
    }

    /// Puts this rank's scaled vector (`bytes` from `own_offset` of `own`)
    /// into its slot of `slots`, where the other ranks' have arrived,
    /// reduces every rank's slot in rank order into `out`, and returns both
    /// scratches to the pool.
    fn reduce_slots(
        &self,
        c: &Prepared,
        own: Arc<Scratch>,
        own_offset: usize,
        slots: Arc<Scratch>,
        bytes: usize,
        out: &Region,
    ) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        region::copy(&Region::scratch(&own, own_offset, bytes)?, &Region::scratch(&slots, me * bytes, bytes)?)?;
        let acc = Region::scratch(&slots, 0, bytes)?;
        for j in 1..n {
            region::combine_partial(c.dtype, &acc, &Region::scratch(&slots, j * bytes, bytes)?, c.reduce)?;
        }
        region::finish(c.dtype, &acc, c.reduce, n)?;
        region::copy(&acc, out)?;
        drop(acc);
        self.core.give_back(own);
        self.core.give_back(slots);
        Ok(())
    }

    /// Chunk `j` (scaled) to rank `j`; each reduces its chunk in rank order.
    pub(super) fn reduce_scatter_direct(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me, bytes) = (self.n(), self.me(), c.count * c.dtype.size());
        let own = self.own_contribution(c, &Region::user(send, 0, n * bytes)?)?;
        let slots = self.core.scratch(n * bytes);
        let mut reqs = Vec::new();
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            reqs.push(self.recv(from, Kind::Data, Region::scratch(&slots, from * bytes, bytes)?)?);
            reqs.push(self.send(to, Kind::Data, Region::scratch(&own, to * bytes, bytes)?)?);
        }
        self.wait(reqs)?;
        self.reduce_slots(c, own, me * bytes, slots, bytes, &Region::user(recv, 0, bytes)?)
    }

    /// The reduce-scatter over `ring`: chunk `j` (one per ring position) is
    /// reduced starting at position j+1 and going round to position j, each
    /// rank combining its own contribution (`own`) with `op` (`c.reduce`
    /// for own inputs, its partial operator for partial results); the
    /// chunk of this rank's position lands in `out` (its size), finished
    /// (`Avg` divided) over `finish` ranks when given.
    pub(crate) fn ring_reduce_scatter(
        &self,
        c: &Prepared,
        ring: &Ring,
        op: ReduceOp,
        finish: Option<usize>,
        mut own: Own<'_>,
        out: &Region,
    ) -> Result<()> {
        let (n, me, es) = (ring.len(), ring.pos, c.dtype.size());
        let first = own.get((me + n - 1) % n, es)?;
        if n == 1 {
            region::start(c.dtype, out, &first.region, op)?;
            if let Some(total) = finish {
                region::finish(c.dtype, out, c.reduce, total)?;
            }
            self.give_back_own(first);
            return Ok(());
        }
        let cmax = own.max_elements() * es;
        let bufs = [self.core.scratch(cmax), self.core.scratch(cmax)];
        // Step 0 sends this rank's own chunk `me − 1` (scaled: from scratch).
        let scaled = match op {
            ReduceOp::PreMulSum(_) => Some(self.own_contribution(c, &first.region)?),
            _ => None,
        };
        let mut outgoing = match &scaled {
            Some(s) => Region::scratch(s, 0, first.region.len())?,
            None => first.region.clone(),
        };
        for k in 0..n - 1 {
            let incoming = (me + 2 * n - 2 - k) % n;
            let into = Region::scratch(&bufs[k % 2], 0, own.elements(incoming) * es)?;
            let reqs = self.step(ring.next(), outgoing, ring.prev(), into.clone())?;
            // While the step is in flight (a produced chunk is a reduction
            // of its own); on an error its requests are cancelled as they
            // are dropped.
            let mine = own.get(incoming, es)?;
            self.wait(reqs)?;
            region::combine_own(c.dtype, &into, &mine.region, op)?;
            self.give_back_own(mine);
            outgoing = into;
        }
        // The last step's incoming chunk is this rank's own.
        let last = Region::scratch(&bufs[(n - 2) % 2], 0, own.elements(me) * es)?;
        if let Some(total) = finish {
            region::finish(c.dtype, &last, c.reduce, total)?;
        }
        region::copy(&last, out)?;
        drop((outgoing, last));
        self.give_back_own(first);
        if let Some(s) = scaled {
            self.core.give_back(s);
        }
        let [a, b] = bufs;
        self.core.give_back(a);
        self.core.give_back(b);
        Ok(())
    }

    fn give_back_own(&self, chunk: OwnChunk) {
        drop(chunk.region);
        if let Some(s) = chunk.made {
            self.core.give_back(s);
        }
    }

    /// The all-gather over `ring` in place over `chunks` (element ranges)
    /// of `recv`, one per ring position (the chunk of this rank's position
    /// already there).
    pub(crate) fn ring_all_gather(
        &self,
        c: &Prepared,
        ring: &Ring,
        recv: &Region,
        chunks: &[(usize, usize)],
    ) -> Result<()> {
        let (n, me, es) = (ring.len(), ring.pos, c.dtype.size());
        let (next, prev) = (ring.next(), ring.prev());
        let region = |j: usize| recv.part(chunks[j].0 * es, (chunks[j].1 - chunks[j].0) * es);
        for k in 0..n.saturating_sub(1) {
            let (out, inc) = ((me + n - k) % n, (me + 2 * n - k - 1) % n);
            self.wait(self.step(next, region(out)?, prev, region(inc)?)?)?;
        }
        Ok(())
    }

    pub(super) fn all_gather_direct(&self, c: &Prepared, recv: &RawRange, chunks: &[(usize, usize)]) -> Result<()> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let region = |j: usize| Region::user(recv, chunks[j].0 * es, (chunks[j].1 - chunks[j].0) * es);
        let mut reqs = Vec::new();
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            reqs.push(self.recv(from, Kind::Data, region(from)?)?);
            reqs.push(self.send(to, Kind::Data, region(me)?)?);
        }
        self.wait(reqs).map(|_| ())
    }

    /// This rank's share of a ring reduce-scatter of all of `send` over
    /// every rank (chunks of `count/n`), in scratch (the caller returns it).
    fn reduced_share(&self, c: &Prepared, send: &RawRange, chunks: &[(usize, usize)]) -> Result<Arc<Scratch>> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let bytes = (chunks[me].1 - chunks[me].0) * es;
        let out = self.core.scratch(bytes);
        let own = Own::Input { send: &Region::user_all(send), chunks };
        self.ring_reduce_scatter(c, &Ring::all(n, me), c.reduce, Some(n), own, &Region::scratch(&out, 0, bytes)?)?;
        Ok(out)
    }

    pub(super) fn all_reduce_ring(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let chunks: Vec<(usize, usize)> = (0..n).map(|j| share(c.count, n, j)).collect();
        let out = self.reduced_share(c, send, &chunks)?;
        // Every input chunk has been read (all steps waited): the in-place output can be written.
        let bytes = (chunks[me].1 - chunks[me].0) * es;
        region::copy(&Region::scratch(&out, 0, bytes)?, &Region::user(recv, chunks[me].0 * es, bytes)?)?;
        self.core.give_back(out);
        self.ring_all_gather(c, &Ring::all(n, me), &Region::user_all(recv), &chunks)
    }

    pub(super) fn broadcast_direct(&self, c: &Prepared, recv: &RawRange) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let bytes = c.count * c.dtype.size();
        let reqs = if me == c.root {
            (1..n)
                .map(|k| self.send((me + k) % n, Kind::Data, Region::user(recv, 0, bytes)?))
                .collect::<Result<Vec<_>>>()?
        } else {
            vec![self.recv(c.root, Kind::Data, Region::user(recv, 0, bytes)?)?]
        };
        self.wait(reqs).map(|_| ())
    }

    /// A chain from the root (root → root+1 → …), pipelined in segments:
    /// each rank forwards a segment as soon as it has it.
    pub(super) fn broadcast_chain(&self, c: &Prepared, recv: &RawRange) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let bytes = c.count * c.dtype.size();
        let pos = (me + n - c.root) % n;
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let segments: Vec<(usize, usize)> =
            (0..bytes.div_ceil(SEGMENT)).map(|i| (i * SEGMENT, ((i + 1) * SEGMENT).min(bytes))).collect();
        let forward = pos + 1 < n;
        if pos == 0 {
            let reqs = segments
                .iter()
                .map(|(lo, hi)| self.send(next, Kind::Data, Region::user(recv, *lo, hi - lo)?))
                .collect::<Result<Vec<_>>>()?;
            return self.wait(reqs).map(|_| ());
        }
        let incoming = segments
            .iter()
            .map(|(lo, hi)| self.recv(prev, Kind::Data, Region::user(recv, *lo, hi - lo)?))
            .collect::<Result<Vec<_>>>()?;
        let mut sends = Vec::new();
        for (r, (lo, hi)) in incoming.into_iter().zip(&segments) {
            self.wait(vec![r])?;
            if forward {
                sends.push(self.send(next, Kind::Data, Region::user(recv, *lo, hi - lo)?)?);
            }
        }
        self.wait(sends).map(|_| ())
    }

    pub(super) fn reduce_direct(&self, c: &Prepared, send: &RawRange) -> Result<()> {
        let (n, me, bytes) = (self.n(), self.me(), c.count * c.dtype.size());
        let own = self.own_contribution(c, &Region::user(send, 0, bytes)?)?;
        if me != c.root {
            self.wait(vec![self.send(c.root, Kind::Data, Region::scratch(&own, 0, bytes)?)?])?;
            self.core.give_back(own);
            return Ok(());
        }
        let recv = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
        let slots = self.core.scratch(n * bytes);
        let reqs = (0..n)
            .filter(|j| *j != me)
            .map(|j| self.recv(j, Kind::Data, Region::scratch(&slots, j * bytes, bytes)?))
            .collect::<Result<Vec<_>>>()?;
        self.wait(reqs)?;
        self.reduce_slots(c, own, 0, slots, bytes, &Region::user(recv, 0, bytes)?)
    }

    /// The ring reduce-scatter, then every rank sends its reduced chunk to the root.
    pub(super) fn reduce_ring(&self, c: &Prepared, send: &RawRange) -> Result<()> {
        let (n, me, es) = (self.n(), self.me(), c.dtype.size());
        let chunks: Vec<(usize, usize)> = (0..n).map(|j| share(c.count, n, j)).collect();
        let mine = (chunks[me].1 - chunks[me].0) * es;
        let out = self.reduced_share(c, send, &chunks)?;
        if me != c.root {
            self.wait(vec![self.send(c.root, Kind::Data, Region::scratch(&out, 0, mine)?)?])?;
            self.core.give_back(out);
            return Ok(());
        }
        let recv = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
        let reqs = (0..n)
            .filter(|j| *j != me)
            .map(|j| self.recv(j, Kind::Data, Region::user(recv, chunks[j].0 * es, (chunks[j].1 - chunks[j].0) * es)?))
            .collect::<Result<Vec<_>>>()?;
        self.wait(reqs)?;
        region::copy(&Region::scratch(&out, 0, mine)?, &Region::user(recv, chunks[me].0 * es, mine)?)?;
        self.core.give_back(out);
        Ok(())
    }

    pub(super) fn all_to_all_pairwise(&self, c: &Prepared, send: &RawRange, recv: &RawRange) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let bytes = c.count / n * c.dtype.size();
        region::copy(&Region::user(send, me * bytes, bytes)?, &Region::user(recv, me * bytes, bytes)?)?;
        for k in 1..n {
            let (to, from) = ((me + k) % n, (me + n - k) % n);
            let reqs = vec![
                self.recv(from, Kind::Data, Region::user(recv, from * bytes, bytes)?)?,
                self.send(to, Kind::Data, Region::user(send, to * bytes, bytes)?)?,
            ];
            self.wait(reqs)?;
        }
        Ok(())
    }

    /// Dissemination: round `k` sends to `rank + 2^k` and hears from `rank − 2^k`.
    pub(super) fn barrier(&self) -> Result<()> {
        let (n, me) = (self.n(), self.me());
        let mut d = 1;
        while d < n {
            let reqs = vec![
                self.recv((me + n - d) % n, Kind::Data, Region::bytes(Vec::new()))?,
                self.send((me + d) % n, Kind::Data, Region::bytes(Vec::new()))?,
            ];
            self.wait(reqs)?;
            d *= 2;
        }
        Ok(())
    }
}
