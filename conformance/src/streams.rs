//! Stream ordering: collectives order with other streams' work only through
//! events (or a host synchronize), and a missing wait is a reported race.

use anyhow::{bail, Context};
use chorus_collectives::{CommBackend, CommError, ReduceOp};
use chorus_devices::{Buffer, DType, Device, DeviceError, Stream};

use crate::expected::{self, check, OpSpec, Pattern};
use crate::util::{read, seed, sentinel, sync, upload};
use crate::{Case, Failure, RankCtx, Requirements};

const COUNT: usize = (1 << 16) + 1;
const DTYPE: DType = DType::F32;

/// The stream-ordering cases.
pub fn cases<C: CommBackend>(_n: usize) -> Vec<Case<C>> {
    let sanitizer = Requirements { stream_sanitizer: true, ..Requirements::default() };
    vec![
        Case::new("streams/event_orders_a_copy_before_the_collective", copy_then_collective::<C>),
        Case::new("streams/event_orders_the_collective_before_a_copy", collective_then_copy::<C>),
        Case::new("streams/host_synchronize_orders_a_copy_before_the_collective", host_sync_then_collective::<C>),
        // Fresh: if a rank's race went unreported, its collective is enqueued
        // and the ranks fall out of step; a short deadline ends that quickly.
        Case::new("streams/missing_wait_is_reported_as_a_race", missing_wait::<C>).needs(sanitizer).fresh(),
    ]
}

/// This rank's input and the expected sum over the world.
fn inputs(name: &str, rank: usize, n: usize) -> (Vec<u8>, Vec<u8>) {
    let ids: Vec<usize> = (0..n).collect();
    let pattern = Pattern::additive(seed(name));
    let input = expected::input(DTYPE, &pattern, rank, 0, COUNT);
    let want = expected::reduced(DTYPE, &pattern, &ids, &OpSpec::Uniform(ReduceOp::Sum).ops(&ids));
    (input, want)
}

/// Stream A stages the input and copies it into `x`; A records an event,
/// B waits on it and all-reduces `x`: B's collective must see A's copy.
fn copy_then_collective<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (input, want) = inputs("streams.copy_then_collective", ctx.rank(), ctx.size());
    let (a, b) = (ctx.stream()?, ctx.stream()?);
    let staging = upload::<C>(&a, DTYPE, &input)?;
    let x = a.alloc(DTYPE, COUNT)?;
    a.copy(staging.view(), x.view())?;
    let copied = ctx.device().create_event()?;
    a.record(&copied)?;
    b.wait(&copied)?;
    let y = sentinel::<C>(&b, DTYPE, COUNT)?;
    ctx.comm.all_reduce(x.view(), y.view(), ReduceOp::Sum, &b)?;
    check("the all_reduce of data copied on another stream", DTYPE, &read::<C>(&b, y.view())?, &want, 0)
}

/// B all-reduces into `y` and records an event; A waits on it and copies
/// `y` away: the copy must see the collective's result.
fn collective_then_copy<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (input, want) = inputs("streams.collective_then_copy", ctx.rank(), ctx.size());
    let (a, b) = (ctx.stream()?, ctx.stream()?);
    let x = upload::<C>(&b, DTYPE, &input)?;
    let y = sentinel::<C>(&b, DTYPE, COUNT)?;
    ctx.comm.all_reduce(x.view(), y.view(), ReduceOp::Sum, &b)?;
    let reduced = ctx.device().create_event()?;
    b.record(&reduced)?;
    a.wait(&reduced)?;
    let z = a.alloc(DTYPE, COUNT)?;
    a.copy(y.view(), z.view())?;
    check("a copy, on another stream, of the all_reduce's result", DTYPE, &read::<C>(&a, z.view())?, &want, 0)
}

/// A host synchronize of A orders A's work before anything enqueued after it.
fn host_sync_then_collective<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (input, want) = inputs("streams.host_sync_then_collective", ctx.rank(), ctx.size());
    let (a, b) = (ctx.stream()?, ctx.stream()?);
    let x = upload::<C>(&a, DTYPE, &input)?;
    a.synchronize()?;
    let y = sentinel::<C>(&b, DTYPE, COUNT)?;
    ctx.comm.all_reduce(x.view(), y.view(), ReduceOp::Sum, &b)?;
    check("the all_reduce of data synchronized on another stream", DTYPE, &read::<C>(&b, y.view())?, &want, 0)
}

fn expect_race(what: &str, e: Result<(), CommError>) -> Result<(), Failure> {
    match e {
        Err(CommError::Device(DeviceError::Race(_))) => Ok(()),
        Err(e) => bail!("{what}: expected a race report (DeviceError::Race), got a {} error: {e}", e.kind()),
        Ok(()) => bail!("{what}: expected a race report (DeviceError::Race), but it was accepted"),
    }
}

/// Without the event, the collective reading A's data on B is refused with
/// a race report, and nothing is enqueued (the communicator stays in step);
/// likewise a copy on A of the collective's output without waiting for B.
fn missing_wait<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (input, want) = inputs("streams.missing_wait", ctx.rank(), ctx.size());
    let (a, b) = (ctx.stream()?, ctx.stream()?);
    let x = upload::<C>(&a, DTYPE, &input)?;
    let y = sentinel::<C>(&b, DTYPE, COUNT)?;
    expect_race(
        "an all_reduce on B of data written on A with no event between",
        ctx.comm.all_reduce(x.view(), y.view(), ReduceOp::Sum, &b),
    )?;

    let copied = ctx.device().create_event()?;
    a.record(&copied)?;
    b.wait(&copied)?;
    ctx.comm.all_reduce(x.view(), y.view(), ReduceOp::Sum, &b).context("the same all_reduce after the wait")?;
    let z = a.alloc(DTYPE, COUNT)?;
    expect_race(
        "a copy on A of the all_reduce's output written on B with no event between",
        a.copy(y.view(), z.view()).map_err(CommError::Device),
    )?;

    let reduced = ctx.device().create_event()?;
    b.record(&reduced)?;
    a.wait(&reduced)?;
    a.copy(y.view(), z.view())?;
    sync(&b).context("the stream of the all_reduce")?;
    check("the all_reduce after the race was refused", DTYPE, &read::<C>(&a, z.view())?, &want, 0)
}
