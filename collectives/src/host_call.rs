//! A validated call's buffers on cpu devices, resolved to raw memory, with
//! the reads and writes it declares to the device's sanitizer: the part of
//! launching that the host-memory backends (sim, ucx) share.

use chorus_devices::cpu::{self, Access, Cpu, RawRange};

use crate::backend::{Call, CallKind};
use crate::ReduceOp;

/// What one rank's part of a call reads and writes.
pub(crate) struct HostBuffers {
    /// The reduction (`Sum` for calls without one).
    pub(crate) reduce: ReduceOp,
    /// Root of broadcast/reduce, peer of send/recv (communicator ranks).
    pub(crate) root: usize,
    /// What this rank reads (none for a broadcast off the root, a receive or a barrier).
    pub(crate) send: Option<RawRange>,
    /// What this rank writes (none for a reduce off the root, a send or a barrier).
    pub(crate) recv: Option<RawRange>,
}

/// Resolves `call` on rank `me`, pushing its accesses onto `accesses`.
pub(crate) fn resolve(call: &Call<'_, Cpu>, me: usize, accesses: &mut Vec<Access>) -> HostBuffers {
    let mut b = HostBuffers { reduce: ReduceOp::Sum, root: 0, send: None, recv: None };
    let mut read = |v: chorus_devices::View<'_, Cpu>| {
        accesses.push(Access::read(v));
        Some(cpu::raw(v))
    };
    let mut write_to = Vec::with_capacity(1);
    match call.kind() {
        CallKind::AllReduce { send, recv, op } | CallKind::ReduceScatter { send, recv, op } => {
            b.reduce = *op;
            b.send = read(*send);
            write_to.push(*recv);
        }
        CallKind::AllGather { send, recv } | CallKind::AllToAll { send, recv } => {
            b.send = read(*send);
            write_to.push(*recv);
        }
        CallKind::Broadcast { send, recv, root } => {
            b.root = *root;
            if me == *root {
                b.send = read(*send);
            }
            write_to.push(*recv);
        }
        CallKind::Reduce { send, recv, op, root } => {
            b.reduce = *op;
            b.root = *root;
            b.send = read(*send);
            if me == *root {
                write_to.push(*recv);
            }
        }
        CallKind::Send { buf, peer } => {
            b.root = *peer;
            b.send = read(*buf);
        }
        CallKind::Recv { buf, peer } => {
            b.root = *peer;
            write_to.push(*buf);
        }
        CallKind::Barrier => {}
    }
    for v in write_to {
        accesses.push(Access::write(v));
        b.recv = Some(cpu::raw(v));
    }
    b
}
