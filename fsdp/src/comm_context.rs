//! What every param group of one [`Fsdp`](crate::Fsdp) shares (FSDP2's
//! `FSDPCommContext`): the streams, the events they order themselves with,
//! the data-parallel communicators, the buffers in flight between groups,
//! and the count of collectives issued.

use chorus_collectives::CommBackend;
use chorus_devices::Backend;

use crate::config::DataParallel;
use crate::events::EventPool;
use crate::{Buf, Ev, Result, Strm};

/// Collectives issued, by kind (FSDP's own count; tests also count at the communicator).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommCounts {
    /// All-gathers of parameters.
    pub all_gathers: usize,
    /// Reduce-scatters of gradients. At one rank a group without replicated
    /// parameters issues none (its gradients are the result already); each
    /// such reduction still counts, as FSDP2 issues one there.
    pub reduce_scatters: usize,
    /// All-reduces of gradients (HSDP, replicated parameters).
    pub all_reduces: usize,
}

/// The four communication streams and the compute stream (FSDP2's comm context).
pub(crate) struct Streams<C: CommBackend> {
    pub(crate) compute: Strm<C>,
    pub(crate) copy_in: Strm<C>,
    pub(crate) all_gather: Strm<C>,
    pub(crate) reduce_scatter: Strm<C>,
    pub(crate) all_reduce: Strm<C>,
}

/// What every group of one [`Fsdp`](crate::Fsdp) shares (FSDP2's
/// `FSDPCommContext`): the device, the streams, the events they order
/// themselves with, the data-parallel communicators, the buffers in flight
/// between groups and the counts.
pub(crate) struct CommContext<C: CommBackend> {
    pub(crate) dp: DataParallel<C>,
    pub(crate) device: <C::B as Backend>::Device,
    pub(crate) streams: Streams<C>,
    pub(crate) events: EventPool<C>,
    /// The last forward all-gather output and the event after its copy-out,
    /// kept until the next group's copy-out is enqueued (implicit prefetch).
    pub(crate) all_gather_state: Option<(Buf<C>, Ev<C>)>,
    /// The last reduce-scatter input and the event after its reduce-scatter.
    pub(crate) reduce_scatter_state: Option<(Buf<C>, Ev<C>)>,
    pub(crate) counts: CommCounts,
}

impl<C: CommBackend> CommContext<C> {
    /// Frees the kept forward all-gather output once both all-gather streams
    /// have waited for its copy-out (the stream-ordered free follows them).
    pub(crate) fn release_all_gather_output(&mut self) -> Result<()> {
        if let Some((_, e)) = self.all_gather_state.take() {
            self.events.wait_and_give(e, &[&self.streams.copy_in, &self.streams.all_gather])?;
        }
        Ok(())
    }

    /// Makes the all-gather streams wait for the compute stream, so copy-ins
    /// see the shards as the optimizer (or the initial upload) left them.
    pub(crate) fn all_gather_streams_follow_compute(&self) -> Result<()> {
        let s = &self.streams;
        self.events.order(&self.device, &s.compute, &[&s.copy_in, &s.all_gather])
    }
}
