//! A launch's calls translated into the library's: each call's raw
//! arguments, the buffers the launch reads and writes (declared to the
//! stream, which keeps them alive in its order), the pre-multiplied sums to
//! create, and what to do on the stream afterwards where the library has a
//! known bug. Nothing here touches the communicator's handle.

use chorus_devices::{AccessKind, Backend, Buffer, DType, ForeignBackend, Scalar, Stream, View};

use super::abi::{DataType, RedOp, RedOpPlan, Version};
use super::result::{Lib, RawCall};
use super::VendorLib;
use crate::backend::{Call, CallKind};
use crate::{CommError, ReduceOp, Result};

/// What a launch does after the library's calls, on the same stream.
#[derive(Clone, Copy, Debug)]
enum Fixup {
    Scale(f64),
    Zero,
}

/// One library call, prepared: the raw arguments, the pre-multiplied sum to
/// create for it (scalar and dtype), and what to do to its output after.
pub(super) struct Prepared<'a, B: Backend> {
    pub(super) call: RawCall,
    pub(super) premul: Option<(f64, DataType)>,
    fixup: Option<(Fixup, View<'a, B>)>,
}

impl<B: Backend> Prepared<'_, B> {
    fn plain(call: RawCall) -> Self {
        Prepared { call, premul: None, fixup: None }
    }
}

/// A launch in the library's terms.
pub(super) struct LaunchPlan<'a, B: Backend> {
    /// Every buffer the library's calls read or write.
    pub(super) accesses: Vec<(View<'a, B>, AccessKind)>,
    /// The library's calls, in order, for one group.
    pub(super) calls: Vec<Prepared<'a, B>>,
}

/// What the translation needs to know of the communicator.
pub(super) struct Target {
    pub(super) lib: Lib,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) version: Version,
}

/// The scratch element a barrier all-reduces, allocated in `stream`'s order
/// (so it lives until the all-reduce has run), if `calls` has a barrier.
pub(super) fn barrier_scratch<B: Backend>(calls: &[Call<'_, B>], stream: &B::Stream) -> Result<Option<B::Buffer>> {
    if calls.iter().any(|c| matches!(c.kind(), CallKind::Barrier)) {
        Ok(Some(stream.alloc(DType::F32, 1).map_err(CommError::Device)?))
    } else {
        Ok(None)
    }
}

/// The operator to issue for `op`, and the fix-up to apply afterwards when
/// the library's one-rank scaling is broken (NVIDIA/nccl#1950).
fn plan_op<L: VendorLib>(t: &Target, op: ReduceOp, dtype: DType) -> Result<(ReduceOp, Option<Fixup>)> {
    let broken = t.size == 1 && L::one_rank_scaling_broken(t.version);
    if !broken {
        return Ok((op, None));
    }
    match op {
        // Over one rank the average is the value itself: a sum, exactly.
        ReduceOp::Avg => Ok((ReduceOp::Sum, None)),
        ReduceOp::PreMulSum(s) if dtype.is_float() => Ok((ReduceOp::Sum, Some(Fixup::Scale(s)))),
        ReduceOp::PreMulSum(s) => match s.trunc() as i64 {
            // The library converts the scalar to the integer dtype first.
            1 => Ok((ReduceOp::Sum, None)),
            0 => Ok((ReduceOp::Sum, Some(Fixup::Zero))),
            _ => Err(CommError::Unsupported {
                backend: L::NAME,
                what: format!(
                    "an integer PreMulSum by {s} on one rank with {} {} (NVIDIA/nccl#1950)",
                    L::NAME,
                    t.version
                ),
            }),
        },
        other => Ok((other, None)),
    }
}

/// Translates `calls` (validated by the [`Communicator`](crate::Communicator))
/// for the library; `scratch` is [`barrier_scratch`]'s.
pub(super) fn translate<'a, L: VendorLib>(
    t: &Target,
    calls: &'a [Call<'a, L::B>],
    scratch: Option<&'a <L::B as Backend>::Buffer>,
) -> Result<LaunchPlan<'a, L::B>> {
    let me = t.rank;
    let mut plan = LaunchPlan { accesses: Vec::new(), calls: Vec::new() };
    let addr = |v: &View<'_, L::B>| L::B::address(v);
    let reduce = |op: ReduceOp, dtype: DType| -> Result<_> {
        let (op, fixup) = plan_op::<L>(t, op, dtype)?;
        let (raw, premul) = match RedOpPlan::of(op) {
            RedOpPlan::Builtin(b) => (b.raw(), None),
            RedOpPlan::PreMulSum(s) => (RedOp::Sum.raw(), Some((s, DataType::of(dtype)))),
        };
        Ok((raw, premul, fixup))
    };
    for c in calls {
        let p = match c.kind() {
            CallKind::AllReduce { send, recv, op } => {
                plan.accesses.extend([(*send, AccessKind::Read), (*recv, AccessKind::Write)]);
                let (op, premul, fixup) = reduce(*op, send.dtype())?;
                let (count, dtype) = (send.len(), DataType::of(send.dtype()));
                let call = RawCall::AllReduce { send: addr(send), recv: addr(recv), count, dtype, op };
                Prepared { call, premul, fixup: fixup.map(|f| (f, *recv)) }
            }
            CallKind::ReduceScatter { send, recv, op } => {
                plan.accesses.extend([(*send, AccessKind::Read), (*recv, AccessKind::Write)]);
                let (op, premul, fixup) = reduce(*op, send.dtype())?;
                let (count, dtype) = (recv.len(), DataType::of(send.dtype()));
                let call = RawCall::ReduceScatter { send: addr(send), recv: addr(recv), count, dtype, op };
                Prepared { call, premul, fixup: fixup.map(|f| (f, *recv)) }
            }
            CallKind::Reduce { send, recv, op, root } => {
                plan.accesses.push((*send, AccessKind::Read));
                if me == *root {
                    plan.accesses.push((*recv, AccessKind::Write));
                }
                let (op, premul, fixup) = reduce(*op, send.dtype())?;
                let fixup = fixup.filter(|_| me == *root).map(|f| (f, *recv));
                let (count, dtype) = (send.len(), DataType::of(send.dtype()));
                let call = RawCall::Reduce { send: addr(send), recv: addr(recv), count, dtype, op, root: *root };
                Prepared { call, premul, fixup }
            }
            CallKind::AllGather { send, recv } => {
                plan.accesses.extend([(*send, AccessKind::Read), (*recv, AccessKind::Write)]);
                let (count, dtype) = (send.len(), DataType::of(send.dtype()));
                Prepared::plain(RawCall::AllGather { send: addr(send), recv: addr(recv), count, dtype })
            }
            CallKind::Broadcast { send, recv, root } => {
                if me == *root {
                    plan.accesses.push((*send, AccessKind::Read));
                }
                plan.accesses.push((*recv, AccessKind::Write));
                let (count, dtype) = (send.len(), DataType::of(send.dtype()));
                Prepared::plain(RawCall::Broadcast { send: addr(send), recv: addr(recv), count, dtype, root: *root })
            }
            CallKind::AllToAll { send, recv } => {
                plan.accesses.extend([(*send, AccessKind::Read), (*recv, AccessKind::Write)]);
                let (chunk, dtype) = (send.len() / t.size, DataType::of(send.dtype()));
                match t.lib.all_to_all_fn() {
                    Some(f) => plan.calls.push(Prepared::plain(RawCall::AllToAll {
                        send: addr(send),
                        recv: addr(recv),
                        count: chunk,
                        dtype,
                        f,
                    })),
                    None => {
                        // Without a native all-to-all: a send and a receive per peer, grouped.
                        let bytes = (chunk * send.dtype().size()) as u64;
                        for peer in 0..t.size {
                            let off = peer as u64 * bytes;
                            plan.calls.push(Prepared::plain(RawCall::Send {
                                buf: addr(send) + off,
                                count: chunk,
                                dtype,
                                peer,
                            }));
                            plan.calls.push(Prepared::plain(RawCall::Recv {
                                buf: addr(recv) + off,
                                count: chunk,
                                dtype,
                                peer,
                            }));
                        }
                    }
                }
                continue;
            }
            CallKind::Send { buf, peer } => {
                plan.accesses.push((*buf, AccessKind::Read));
                let (count, dtype) = (buf.len(), DataType::of(buf.dtype()));
                Prepared::plain(RawCall::Send { buf: addr(buf), count, dtype, peer: *peer })
            }
            CallKind::Recv { buf, peer } => {
                plan.accesses.push((*buf, AccessKind::Write));
                let (count, dtype) = (buf.len(), DataType::of(buf.dtype()));
                Prepared::plain(RawCall::Recv { buf: addr(buf), count, dtype, peer: *peer })
            }
            CallKind::Barrier => {
                let Some(s) = scratch else { continue };
                let v = s.view();
                plan.accesses.push((v, AccessKind::Write));
                let a = addr(&v);
                let op = RedOp::Sum.raw();
                Prepared::plain(RawCall::AllReduce { send: a, recv: a, count: 1, dtype: DataType::Float32, op })
            }
        };
        plan.calls.push(p);
    }
    Ok(plan)
}

impl<B: Backend> LaunchPlan<'_, B> {
    /// Enqueues the fix-ups of a broken one-rank reduction after the
    /// library's calls on `stream`.
    pub(super) fn enqueue_fixups(&self, stream: &B::Stream) -> Result<()> {
        for p in &self.calls {
            match p.fixup {
                Some((Fixup::Scale(s), v)) => stream.scale(v, s).map_err(CommError::Device)?,
                Some((Fixup::Zero, v)) => stream.fill(v, Scalar::Int(0)).map_err(CommError::Device)?,
                None => {}
            }
        }
        Ok(())
    }
}
