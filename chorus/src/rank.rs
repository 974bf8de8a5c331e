//! [`Rank`]: what a rank's function gets — its communicator, a stream on
//! its device, and collectives on host slices for the small values a
//! program exchanges outside its model (a loss, a count, a check).

use std::sync::Arc;

use chorus_collectives::{CommBackend, Communicator, ReduceOp};
use chorus_devices::{Backend, Buffer, Device, Element, Priority, Stream, StreamExt};

use crate::backend::SelectedBackend;
use crate::{Error, Result};

/// One rank of a world: its communicator and a stream of its device.
///
/// The collectives here take and return host slices: each uploads, runs
/// the collective on [`Rank::stream`] and reads the result back (blocking),
/// as `torch.distributed` does with CPU tensors. For device buffers, use
/// [`Rank::comm`]'s stream-ordered calls. Every rank must make the same
/// collective calls in the same order.
pub struct Rank<C: CommBackend = SelectedBackend> {
    comm: Arc<Communicator<C>>,
    stream: <C::B as Backend>::Stream,
}

impl<C: CommBackend> std::fmt::Debug for Rank<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rank({} of {}, {})", self.rank(), self.size(), self.comm.device().name())
    }
}

impl<C: CommBackend> Rank<C> {
    /// The rank of `comm`, with a new stream on its device.
    pub fn new(comm: Arc<Communicator<C>>) -> Result<Self> {
        let stream = comm.device().create_stream(Priority::Normal)?;
        Ok(Rank { comm, stream })
    }

    /// This rank's index, `0..size`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks in the world.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The communicator (shared: FSDP takes it as an `Arc`).
    pub fn comm(&self) -> &Arc<Communicator<C>> {
        &self.comm
    }

    /// The rank's device.
    pub fn device(&self) -> &<C::B as Backend>::Device {
        self.comm.device()
    }

    /// The stream the host-slice collectives run on.
    pub fn stream(&self) -> &<C::B as Backend>::Stream {
        &self.stream
    }

    /// The element-wise reduction of every rank's `values` (the same length on every rank).
    pub fn all_reduce<T: Element>(&self, values: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let buf = self.stream.buffer_from(values)?;
        self.comm.all_reduce_in_place(buf.view(), op, &self.stream)?;
        Ok(self.stream.read_vec(buf.view())?)
    }

    /// Every rank's `values` (the same length on every rank), concatenated in rank order.
    pub fn all_gather<T: Element>(&self, values: &[T]) -> Result<Vec<T>> {
        let send = self.stream.buffer_from(values)?;
        let len = values.len().checked_mul(self.size()).ok_or_else(|| too_long(values.len()))?;
        let recv = self.stream.alloc(T::DTYPE, len)?;
        self.comm.all_gather(send.view(), recv.view(), &self.stream)?;
        Ok(self.stream.read_vec(recv.view())?)
    }

    /// Rank `root`'s `values` on every rank (every rank passes a slice of the same length).
    pub fn broadcast<T: Element>(&self, values: &[T], root: usize) -> Result<Vec<T>> {
        let buf = self.stream.buffer_from(values)?;
        self.comm.broadcast_in_place(buf.view(), root, &self.stream)?;
        Ok(self.stream.read_vec(buf.view())?)
    }

    /// This rank's chunk of the reduction of every rank's `values`: `values`
    /// holds `size` equal chunks, and rank `r` gets the reduced chunk `r`.
    pub fn reduce_scatter<T: Element>(&self, values: &[T], op: ReduceOp) -> Result<Vec<T>> {
        if values.len() % self.size() != 0 {
            return Err(Error::InvalidArgument(format!(
                "reduce_scatter: {} values do not split into {} equal chunks",
                values.len(),
                self.size()
            )));
        }
        let send = self.stream.buffer_from(values)?;
        let recv = self.stream.alloc(T::DTYPE, values.len() / self.size())?;
        self.comm.reduce_scatter(send.view(), recv.view(), op, &self.stream)?;
        Ok(self.stream.read_vec(recv.view())?)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.comm.barrier(&self.stream)?;
        Ok(self.stream.synchronize()?)
    }
}

fn too_long(len: usize) -> Error {
    Error::InvalidArgument(format!("all_gather: {len} values per rank overflow the gathered length"))
}
