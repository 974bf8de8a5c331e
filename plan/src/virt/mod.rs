//! A device and a communicator that keep virtual time instead of data.
//!
//! How the device contract ([`chorus_devices::api`]) maps onto virtual time:
//! - a **buffer** holds a dtype and a length, never bytes; allocation counts
//!   in [`MemCounters`](chorus_devices::MemCounters) exactly as the cpu device does (from allocation until
//!   the handle is dropped), so a peak here means what the cpu device's
//!   peak means;
//! - a **stream** is a clock: an operation starts at the later of the
//!   stream's clock and the host's (see below), lasts what the
//!   [`CostModel`](crate::cost::CostModel) says, and moves the clock to its
//!   end; it is appended to the device's trace while tracing is on;
//! - an **event** is a time: a record takes the stream's clock, a wait moves
//!   the waiting stream's clock to at least it — so overlap between streams
//!   comes from the events FSDP records, as on a GPU;
//! - the **host** has a clock too: a synchronize (or a readback) returns at
//!   once but moves the host clock to the time the work it waits for ends,
//!   and no later operation starts before it, as when the host really blocked;
//! - **readbacks** return zeros (a plan computes no values; FSDP reads back
//!   only the loss, the gradient norm and checkpoint shards).
//!
//! The communicator is in [`comm`].

pub mod comm;
mod device;
mod stream;

use std::sync::atomic::{AtomicU64, Ordering};

/// Replaces the f64 held in `cell` as bits by `f(old)`; returns (old, new).
/// Atomic, so that two host threads moving one clock cannot lose time.
pub(crate) fn update(cell: &AtomicU64, f: impl Fn(f64) -> f64) -> (f64, f64) {
    let mut cur = cell.load(Ordering::Acquire);
    loop {
        let new = f(f64::from_bits(cur));
        match cell.compare_exchange_weak(cur, new.to_bits(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return (f64::from_bits(cur), new),
            Err(now) => cur = now,
        }
    }
}

pub use device::{ActivationBuf, TraceOp, VirtBuffer, VirtConfig, VirtDevice, VirtEvent, MAX_TRACE_OPS};
pub use stream::VirtStream;

chorus_devices::backend! {
    /// The virtual backend's types.
    Virt = "virtual": VirtDevice, VirtStream, VirtEvent, VirtBuffer
}

#[cfg(test)]
mod tests;
