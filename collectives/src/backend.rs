//! What a communication backend implements.
//!
//! The user-facing [`Communicator`](crate::Communicator) validates every call
//! once, numbers it, and hands the backend a batch of [`Call`]s (one call, or
//! all the calls of a group) with the stream to enqueue them on. A backend
//! therefore never sees a length, dtype, root or peer that is out of range,
//! a buffer or stream of another device, or a lone send or receive with
//! itself; and only validation can make a [`Call`].

use chorus_devices::{Backend, DType, View};
use std::fmt;

use crate::{ReduceOp, Result};

/// The kind of a call, for fingerprints and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `all_reduce`.
    AllReduce,
    /// `all_gather`.
    AllGather,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `broadcast`.
    Broadcast,
    /// `reduce`.
    Reduce,
    /// `all_to_all`.
    AllToAll,
    /// `send`.
    Send,
    /// `recv`.
    Recv,
    /// `barrier`.
    Barrier,
}

impl OpKind {
    /// The operation's name.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
        }
    }
}

/// What every rank must agree on for a collective: the operation, dtype,
/// count, root and reduce operator (but not a pre-multiplied sum's scalar,
/// which is per rank, as in NCCL).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fingerprint {
    /// The operation.
    pub op: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Elements: per rank for `all_gather` (the send count), the receive count
    /// for `reduce_scatter`, the buffer length otherwise.
    pub count: usize,
    /// Root of `broadcast`/`reduce`, peer of `send`/`recv`.
    pub root: Option<usize>,
    /// The reduce operator's name, for reducing collectives.
    pub reduce: Option<&'static str>,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({} x {}", self.op.name(), self.count, self.dtype)?;
        if let Some(r) = self.root {
            write!(f, ", root/peer {r}")?;
        }
        if let Some(op) = self.reduce {
            write!(f, ", {op}")?;
        }
        f.write_str(")")
    }
}

/// One validated call. In-place calls pass overlapping views exactly as NCCL
/// defines them (`send == recv` for all-reduce, broadcast and reduce; `send`
/// is chunk `rank` of `recv` for all-gather; `recv` is chunk `rank` of `send`
/// for reduce-scatter).
pub enum CallKind<'a, B: Backend> {
    /// `recv = reduce(send over ranks)`.
    AllReduce {
        /// Input.
        send: View<'a, B>,
        /// Output, same length.
        recv: View<'a, B>,
        /// Operator.
        op: ReduceOp,
    },
    /// `recv = concat(send of rank 0, .., rank n-1)`.
    AllGather {
        /// Input, `count` elements.
        send: View<'a, B>,
        /// Output, `n * count` elements.
        recv: View<'a, B>,
    },
    /// `recv = chunk rank of reduce(send over ranks)`.
    ReduceScatter {
        /// Input, `n * count` elements.
        send: View<'a, B>,
        /// Output, `count` elements.
        recv: View<'a, B>,
        /// Operator.
        op: ReduceOp,
    },
    /// `recv = send of root`.
    Broadcast {
        /// Input (read on the root only).
        send: View<'a, B>,
        /// Output.
        recv: View<'a, B>,
        /// The root.
        root: usize,
    },
    /// `recv of root = reduce(send over ranks)`; other ranks' `recv` is untouched.
    Reduce {
        /// Input.
        send: View<'a, B>,
        /// Output (written on the root only).
        recv: View<'a, B>,
        /// Operator.
        op: ReduceOp,
        /// The root.
        root: usize,
    },
    /// Chunk `j` of `recv` on rank `r` = chunk `r` of `send` on rank `j`.
    AllToAll {
        /// Input, `n * count` elements.
        send: View<'a, B>,
        /// Output, `n * count` elements, not overlapping `send`.
        recv: View<'a, B>,
    },
    /// Send `buf` to `peer`.
    Send {
        /// Data.
        buf: View<'a, B>,
        /// Destination rank.
        peer: usize,
    },
    /// Receive into `buf` from `peer`.
    Recv {
        /// Destination buffer.
        buf: View<'a, B>,
        /// Source rank.
        peer: usize,
    },
    /// All ranks reach this point of their streams before any continues.
    Barrier,
}

impl<B: Backend> fmt::Debug for CallKind<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind().name())
    }
}

impl<'a, B: Backend> CallKind<'a, B> {
    /// The kind of operation.
    pub fn kind(&self) -> OpKind {
        match self {
            CallKind::AllReduce { .. } => OpKind::AllReduce,
            CallKind::AllGather { .. } => OpKind::AllGather,
            CallKind::ReduceScatter { .. } => OpKind::ReduceScatter,
            CallKind::Broadcast { .. } => OpKind::Broadcast,
            CallKind::Reduce { .. } => OpKind::Reduce,
            CallKind::AllToAll { .. } => OpKind::AllToAll,
            CallKind::Send { .. } => OpKind::Send,
            CallKind::Recv { .. } => OpKind::Recv,
            CallKind::Barrier => OpKind::Barrier,
        }
    }

    /// Every view the call reads or writes (`send` then `recv`, or `buf`;
    /// none for a barrier), e.g. to check that they are on the rank's device.
    pub fn views(&self) -> Vec<View<'a, B>> {
        match self {
            CallKind::AllReduce { send, recv, .. }
            | CallKind::AllGather { send, recv }
            | CallKind::ReduceScatter { send, recv, .. }
            | CallKind::Broadcast { send, recv, .. }
            | CallKind::Reduce { send, recv, .. }
            | CallKind::AllToAll { send, recv } => vec![*send, *recv],
            CallKind::Send { buf, .. } | CallKind::Recv { buf, .. } => vec![*buf],
            CallKind::Barrier => vec![],
        }
    }
}

/// A validated call with its place in the communicator's call sequence.
///
/// Only [`Communicator`](crate::Communicator)'s validation makes one (the
/// fields are private): a backend may rely on every length, dtype, root,
/// peer and device in it being checked, so its kernels never go out of
/// bounds. Wrapping backends pass calls on unchanged.
#[derive(Debug)]
pub struct Call<'a, B: Backend> {
    pub(crate) seq: u64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) kind: CallKind<'a, B>,
}

impl<'a, B: Backend> Call<'a, B> {
    /// Position among this communicator's collectives (send/recv are
    /// numbered per peer by the backend, not here).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// What all ranks must agree on.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
    /// The operation and its buffers.
    pub fn kind(&self) -> &CallKind<'a, B> {
        &self.kind
    }
}

/// Optional capabilities, declared so callers and the conformance suite can
/// skip what a backend cannot do instead of failing (or silently returning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `ReduceOp::Avg` is native.
    pub avg: bool,
    /// `ReduceOp::PreMulSum` is native.
    pub premul_sum: bool,
    /// Several ranks of one communicator may share a device.
    pub ranks_share_device: bool,
    /// `abort` of one rank makes every rank's pending and later calls fail
    /// (one process); otherwise only the local rank aborts and peers time out.
    pub world_abort: bool,
    /// Faults can be injected (`sim` only).
    pub fault_injection: bool,
    /// Ranks that issue different calls at the same position fail with
    /// `CommError::Mismatch` on every rank. A vendor library cannot see a
    /// peer's call (NCCL hangs or corrupts instead); the
    /// [`checked`](crate::checked) wrapper adds the check to any backend.
    pub detects_mismatch: bool,
    /// A `Timeout` names the ranks that never arrived. Vendor libraries
    /// cannot tell which peer is missing.
    pub names_missing_ranks: bool,
}

/// A communication backend: one rank's endpoint of a communicator.
///
/// Calls arrive validated and numbered from [`Communicator`](crate::Communicator).
/// Every rank issues the same collectives in the same order; a backend that
/// can detect a mismatch reports `CommError::Mismatch` on every rank.
pub trait CommBackend: Send + Sync + Sized + 'static {
    /// The device backend whose buffers and streams the calls use.
    type B: Backend;

    /// The backend's name (`sim`, `nccl`, `rccl`).
    const NAME: &'static str;

    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// The device this rank's buffers live on.
    fn device(&self) -> &<Self::B as Backend>::Device;
    /// What the backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Enqueues `calls` on `stream` as one group (NCCL group semantics: the
    /// calls may progress concurrently, so a send and a recv between two
    /// ranks in one group cannot deadlock). The calls and the stream are
    /// validated (see the module documentation). Returns at once. Failures found
    /// while running (mismatch, timeout, abort) fail the stream with the
    /// `CommError` inside `DeviceError::OpFailed`.
    fn launch(&self, calls: Vec<Call<'_, Self::B>>, stream: &<Self::B as Backend>::Stream) -> Result<()>;

    /// Splits the communicator: ranks passing the same `color` form a new
    /// communicator, ordered by `key` then by rank. `None` opts out (returns
    /// `None`). Every rank must call it; blocks the host until all have.
    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Self>>;

    /// Aborts: every pending and later call fails promptly (on every rank when
    /// [`Capabilities::world_abort`], else on this rank).
    fn abort(&self, reason: &str);

    /// The asynchronous error that has made this communicator unusable, if any.
    fn async_error(&self) -> Option<crate::CommError>;
}

/// Writes the [`CommBackend`] methods that a wrapping backend passes on
/// unchanged to its field `$inner`: `rank`, `size`, `device`, `abort` and
/// `async_error`. For use inside `impl CommBackend for Wrapper<C>` with
/// `type B = C::B`; the wrapper writes `capabilities`, `launch` and `split`,
/// the methods a wrapper exists to change.
#[macro_export]
macro_rules! forward_to_inner {
    ($inner:ident) => {
        fn rank(&self) -> usize {
            $crate::CommBackend::rank(&self.$inner)
        }
        fn size(&self) -> usize {
            $crate::CommBackend::size(&self.$inner)
        }
        fn device(&self) -> &<Self::B as $crate::__private::Backend>::Device {
            $crate::CommBackend::device(&self.$inner)
        }
        fn abort(&self, reason: &str) {
            $crate::CommBackend::abort(&self.$inner, reason)
        }
        fn async_error(&self) -> Option<$crate::CommError> {
            $crate::CommBackend::async_error(&self.$inner)
        }
    };
}
