//! Which algorithm a call takes: the direct messages of a small call, the
//! flat rings of a large one (`algorithms.rs`), or the hierarchical
//! schedules of a large one whose communicator spans hosts (`hierarchy.rs`).

use chorus_devices::cpu::RawRange;

use super::algorithms::Own;
use super::exec::{missing, Exec, Prepared};
use super::hierarchy;
use super::layout::Ring;
use super::region::{self, Region};
use crate::backend::OpKind;
use crate::{CommError, Result};

impl<'a> Exec<'a> {
    fn small(&self, bytes: usize) -> bool {
        bytes <= self.core.job.config.small_bytes
    }

    pub(crate) fn run(&self, c: &Prepared) -> Result<()> {
        self.post_hello(&c.fingerprint)?;
        self.run_algorithm(c)?;
        // A call whose algorithm never waited still checks its hello.
        self.check_hello()
    }

    fn run_algorithm(&self, c: &Prepared) -> Result<()> {
        let es = c.dtype.size();
        let both = || -> Result<(&RawRange, &RawRange)> {
            Ok((c.send.as_ref().ok_or_else(|| missing("send"))?, c.recv.as_ref().ok_or_else(|| missing("recv"))?))
        };
        match c.op {
            OpKind::AllReduce => {
                let (send, recv) = both()?;
                if self.small(c.count * es) {
                    self.all_reduce_direct(c, send, recv)
                } else if let Some(lay) = &self.core.layout {
                    hierarchy::all_reduce(self, lay, c, send, recv)
                } else {
                    self.all_reduce_ring(c, send, recv)
                }
            }
            OpKind::ReduceScatter => {
                let (send, recv) = both()?;
                let chunks: Vec<(usize, usize)> = (0..self.n()).map(|j| (j * c.count, (j + 1) * c.count)).collect();
                if self.small(c.count * self.n() * es) {
                    self.reduce_scatter_direct(c, send, recv)
                } else if let Some(lay) = &self.core.layout {
                    hierarchy::reduce_scatter(self, lay, c, send, recv)
                } else {
                    let bytes = c.count * es;
                    let out = self.core.scratch(bytes);
                    let out_region = Region::scratch(&out, 0, bytes)?;
                    let own = Own::Input { send: &Region::user_all(send), chunks: &chunks };
                    let ring = Ring::all(self.n(), self.me());
                    self.ring_reduce_scatter(c, &ring, c.reduce, Some(self.n()), own, &out_region)?;
                    region::copy(&out_region, &Region::user(recv, 0, bytes)?)?;
                    drop(out_region);
                    self.core.give_back(out);
                    Ok(())
                }
            }
            OpKind::AllGather => {
                let (send, recv) = both()?;
                let chunks: Vec<(usize, usize)> = (0..self.n()).map(|j| (j * c.count, (j + 1) * c.count)).collect();
                let own = c.count * es;
                region::copy(&Region::user(send, 0, own)?, &Region::user(recv, self.me() * own, own)?)?;
                if self.small(c.count * self.n() * es) {
                    self.all_gather_direct(c, recv, &chunks)
                } else if let Some(lay) = &self.core.layout {
                    hierarchy::all_gather(self, lay, c, recv)
                } else {
                    self.ring_all_gather(c, &Ring::all(self.n(), self.me()), &Region::user_all(recv), &chunks)
                }
            }
            OpKind::Broadcast => {
                let recv = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
                let bytes = c.count * es;
                if self.me() == c.root {
                    let send = c.send.as_ref().ok_or_else(|| missing("send"))?;
                    region::copy(&Region::user(send, 0, bytes)?, &Region::user(recv, 0, bytes)?)?;
                }
                if self.small(bytes) {
                    self.broadcast_direct(c, recv)
                } else {
                    self.broadcast_chain(c, recv)
                }
            }
            OpKind::Reduce => {
                let send = c.send.as_ref().ok_or_else(|| missing("send"))?;
                if self.small(c.count * es) {
                    self.reduce_direct(c, send)
                } else {
                    self.reduce_ring(c, send)
                }
            }
            OpKind::AllToAll => {
                let (send, recv) = both()?;
                self.all_to_all_pairwise(c, send, recv)
            }
            OpKind::Barrier => self.barrier(),
            OpKind::Send | OpKind::Recv => Err(CommError::invalid("ucx", "a send or receive run as a collective")),
        }
    }
}
