//! Error cases: each must give the right error on every rank, promptly.
//!
//! - Invalid arguments (sizes, dtypes, aliasing, roots, peers) are refused
//!   by the enqueuing call with `InvalidArgument` and enqueue nothing: a
//!   correct collective afterwards still lines up across ranks.
//! - Calls that differ across ranks (operation, count, root, dtype, reduce
//!   operator; a send and a receive that disagree) fail with `Mismatch` on
//!   every rank involved, naming the calls.
//! - A rank that never arrives makes the others fail with `Timeout` naming
//!   it; an abort fails every rank with `Aborted`; injected faults fail or
//!   delay a rank as declared.
//!
//! Every case gets a world of its own ([`Isolation::Fresh`](crate::Isolation)).

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use chorus_collectives::{CommBackend, CommError, ReduceOp};
use chorus_devices::{Buffer, DType};

use crate::expected::{check, check_untouched};
use crate::util::{expect_err, expect_invalid, part, read, sentinel, sync, upload};
use crate::{Case, Failure, FaultAction, FaultSpec, RankCtx, Requirements, Strm};

/// The error cases.
pub fn cases<C: CommBackend>(_n: usize) -> Vec<Case<C>> {
    let abort = Requirements { world_abort: true, ..Requirements::default() };
    let detects = Requirements { detects_mismatch: true, ..Requirements::default() };
    let faults = Requirements { fault_injection: true, ..Requirements::default() };
    let mut v = vec![
        Case::new("errors/invalid/wrong_sizes", wrong_sizes::<C>),
        Case::new("errors/invalid/overlapping_send_and_recv", overlapping::<C>),
        Case::new("errors/invalid/send_and_recv_dtypes_differ", dtypes_differ::<C>),
        Case::new("errors/invalid/root_or_peer_out_of_range", bad_root_or_peer::<C>),
        Case::new("errors/invalid/group_with_one_bad_call_enqueues_nothing", bad_group::<C>),
    ];
    for (name, how) in [
        ("operation", Differ::Operation),
        ("count", Differ::Count),
        ("root", Differ::Root),
        ("dtype", Differ::Dtype),
        ("reduce_op", Differ::ReduceOp),
    ] {
        v.push(
            Case::new(format!("errors/mismatch/different_{name}"), move |ctx| mismatch(ctx, how))
                .min_world(2)
                .needs(detects),
        );
    }
    v.extend([
        Case::new("errors/mismatch/send_and_recv_dtypes", |ctx| p2p_mismatch(ctx, true)).min_world(2).needs(detects),
        Case::new("errors/mismatch/send_and_recv_counts", |ctx| p2p_mismatch(ctx, false)).min_world(2).needs(detects),
        Case::new("errors/timeout/missing_rank", missing_rank::<C>).min_world(2),
        Case::new("errors/abort/every_rank_fails_after_an_abort", abort_then_call::<C>).needs(abort),
        Case::new("errors/abort/waiting_peers_fail_promptly", abort_while_waiting::<C>).min_world(2).needs(abort),
        Case::new("errors/fault/failing_rank_aborts_the_world", injected_failure::<C>).needs(faults).needs(abort),
        Case::new("errors/fault/short_stall_only_delays", short_stall::<C>).needs(faults),
        Case::new("errors/fault/stall_past_the_deadline_times_out", long_stall::<C>).min_world(2).needs(faults),
    ]);
    v.into_iter().map(Case::fresh).collect()
}

/// An all-reduce of `rank + 1` whose sum every rank checks: the communicator
/// is still in step (nothing was enqueued by the refused calls before it).
fn still_in_step<C: CommBackend>(ctx: &RankCtx<'_, C>, s: &Strm<C>) -> Result<(), Failure> {
    let n = ctx.size() as i32;
    let b = upload::<C>(s, DType::I32, bytemuck::cast_slice(&[ctx.rank() as i32 + 1; 3]))?;
    ctx.comm.all_reduce_in_place(b.view(), ReduceOp::Sum, s).context("a valid all_reduce after the refused calls")?;
    let want = n * (n + 1) / 2;
    check(
        "a valid all_reduce after the refused calls",
        DType::I32,
        &read::<C>(s, b.view())?,
        bytemuck::cast_slice(&[want]),
        0,
    )
}

fn wrong_sizes<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (n, c) = (ctx.size(), 8);
    let s = ctx.stream()?;
    let buf = |len| sentinel::<C>(&s, DType::F32, len);
    let (a, longer, nc, ncp) = (buf(c)?, buf(c + 1)?, buf(n * c)?, buf(n * c + 1)?);
    let cm = ctx.comm;
    expect_invalid("all_reduce with recv longer than send", cm.all_reduce(a.view(), longer.view(), ReduceOp::Sum, &s))?;
    expect_invalid("all_gather with recv not n × send", cm.all_gather(a.view(), ncp.view(), &s))?;
    expect_invalid(
        "reduce_scatter with send not n × recv",
        cm.reduce_scatter(ncp.view(), a.view(), ReduceOp::Sum, &s),
    )?;
    expect_invalid("broadcast with recv shorter than send", cm.broadcast(longer.view(), a.view(), 0, &s))?;
    expect_invalid("reduce with recv longer than send", cm.reduce(a.view(), longer.view(), ReduceOp::Max, 0, &s))?;
    expect_invalid("all_to_all with recv longer than send", cm.all_to_all(nc.view(), ncp.view(), &s))?;
    if n > 1 {
        let other = buf(n * c + 1)?;
        expect_invalid("all_to_all of a length that is not n chunks", cm.all_to_all(ncp.view(), other.view(), &s))?;
        expect_invalid("all_gather_in_place of a length that is not n chunks", cm.all_gather_in_place(ncp.view(), &s))?;
        expect_invalid(
            "reduce_scatter_in_place of a length that is not n chunks",
            cm.reduce_scatter_in_place(ncp.view(), ReduceOp::Sum, &s),
        )?;
    }
    sync(&s).context("the stream after the refused calls")?;
    still_in_step(ctx, &s)
}

fn overlapping<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n, c) = (ctx.rank(), ctx.size(), 4);
    let s = ctx.stream()?;
    let buf = sentinel::<C>(&s, DType::F32, 2 * n * c + 1)?;
    let cm = ctx.comm;
    let at = |off, len| part::<C::B>(&buf, off, len);
    expect_invalid(
        "all_reduce with send and recv overlapping but not equal",
        cm.all_reduce(at(0, c)?, at(1, c)?, ReduceOp::Sum, &s),
    )?;
    expect_invalid(
        "broadcast with send and recv overlapping but not equal",
        cm.broadcast(at(0, c)?, at(2, c)?, 0, &s),
    )?;
    expect_invalid("all_to_all with send and recv the same buffer", cm.all_to_all(at(0, n * c)?, at(0, n * c)?, &s))?;
    if n > 1 {
        let other = (r + 1) % n;
        expect_invalid(
            "all_gather whose send is another rank's chunk of recv",
            cm.all_gather(at(other * c, c)?, at(0, n * c)?, &s),
        )?;
        expect_invalid(
            "reduce_scatter whose recv is another rank's chunk of send",
            cm.reduce_scatter(at(0, n * c)?, at(other * c, c)?, ReduceOp::Sum, &s),
        )?;
    }
    sync(&s).context("the stream after the refused calls")?;
    still_in_step(ctx, &s)
}

fn dtypes_differ<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (n, c) = (ctx.size(), 6);
    let s = ctx.stream()?;
    let cm = ctx.comm;
    let b = |d, len| sentinel::<C>(&s, d, len);
    expect_invalid(
        "all_reduce f32 into f64",
        cm.all_reduce(b(DType::F32, c)?.view(), b(DType::F64, c)?.view(), ReduceOp::Sum, &s),
    )?;
    expect_invalid(
        "all_gather i32 into i64",
        cm.all_gather(b(DType::I32, c)?.view(), b(DType::I64, n * c)?.view(), &s),
    )?;
    expect_invalid(
        "reduce_scatter f32 into bf16",
        cm.reduce_scatter(b(DType::F32, n * c)?.view(), b(DType::BF16, c)?.view(), ReduceOp::Sum, &s),
    )?;
    expect_invalid(
        "broadcast f16 into bf16",
        cm.broadcast(b(DType::F16, c)?.view(), b(DType::BF16, c)?.view(), 0, &s),
    )?;
    expect_invalid(
        "reduce u8 into i8",
        cm.reduce(b(DType::U8, c)?.view(), b(DType::I8, c)?.view(), ReduceOp::Max, 0, &s),
    )?;
    expect_invalid(
        "all_to_all i32 into f32",
        cm.all_to_all(b(DType::I32, n * c)?.view(), b(DType::F32, n * c)?.view(), &s),
    )?;
    sync(&s).context("the stream after the refused calls")?;
    still_in_step(ctx, &s)
}

fn bad_root_or_peer<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let n = ctx.size();
    let s = ctx.stream()?;
    let cm = ctx.comm;
    let x = sentinel::<C>(&s, DType::F32, 5)?;
    let y = sentinel::<C>(&s, DType::F32, 5)?;
    expect_invalid("broadcast from root n", cm.broadcast(x.view(), y.view(), n, &s))?;
    expect_invalid("broadcast_in_place from root usize::MAX", cm.broadcast_in_place(x.view(), usize::MAX, &s))?;
    expect_invalid("reduce to root n + 3", cm.reduce(x.view(), y.view(), ReduceOp::Sum, n + 3, &s))?;
    expect_invalid("send to peer n", cm.send(x.view(), n, &s))?;
    expect_invalid("recv from peer n", cm.recv(y.view(), n, &s))?;
    expect_invalid("a group with a send to peer n", cm.group(&s, |g| g.send(x.view(), n)))?;
    sync(&s).context("the stream after the refused calls")?;
    still_in_step(ctx, &s)
}

/// A group whose second call is invalid is refused whole: its valid first
/// call must not run either.
fn bad_group<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (n, c) = (ctx.size(), 9);
    let s = ctx.stream()?;
    let x = upload::<C>(&s, DType::I32, bytemuck::cast_slice(&[1i32; 9]))?;
    let y = sentinel::<C>(&s, DType::I32, c)?;
    let a = sentinel::<C>(&s, DType::I32, c)?;
    let wrong = sentinel::<C>(&s, DType::I32, n * c + 1)?;
    let refused = ctx.comm.group(&s, |g| {
        g.all_reduce(x.view(), y.view(), ReduceOp::Sum)?;
        g.all_gather(a.view(), wrong.view())
    });
    expect_invalid("a group with a valid all_reduce and an all_gather of the wrong size", refused)?;
    check_untouched("the valid call's output in the refused group", DType::I32, &read::<C>(&s, y.view())?)?;
    still_in_step(ctx, &s)
}

#[derive(Clone, Copy, Debug)]
enum Differ {
    Operation,
    Count,
    Root,
    Dtype,
    ReduceOp,
}

/// Rank 0 issues a call that differs from the others' in one respect; every
/// rank must get `Mismatch`, and the message must name both calls.
fn mismatch<C: CommBackend>(ctx: &RankCtx<'_, C>, how: Differ) -> Result<(), Failure> {
    let odd = ctx.rank() == 0;
    let s = ctx.stream()?;
    let f32s = sentinel::<C>(&s, DType::F32, 64)?;
    let f32s_longer = sentinel::<C>(&s, DType::F32, 65)?;
    let f64s = sentinel::<C>(&s, DType::F64, 64)?;
    ctx.host_barrier()?;
    let cm = ctx.comm;
    let (issued, names): (_, [&str; 2]) = match how {
        Differ::Operation if odd => (cm.broadcast_in_place(f32s.view(), 0, &s), ["broadcast", "all_reduce"]),
        Differ::Count if odd => (cm.all_reduce_in_place(f32s_longer.view(), ReduceOp::Sum, &s), ["65", "64"]),
        Differ::Root if odd => (cm.broadcast_in_place(f32s.view(), 0, &s), ["broadcast", "broadcast"]),
        Differ::Root => (cm.broadcast_in_place(f32s.view(), 1, &s), ["broadcast", "broadcast"]),
        Differ::Dtype if odd => (cm.all_reduce_in_place(f64s.view(), ReduceOp::Sum, &s), ["f64", "f32"]),
        Differ::ReduceOp if odd => (cm.all_reduce_in_place(f32s.view(), ReduceOp::Max, &s), ["max", "sum"]),
        _ => (cm.all_reduce_in_place(f32s.view(), ReduceOp::Sum, &s), ["all_reduce", "all_reduce"]),
    };
    issued.context("the call is valid on this rank and must be accepted")?;
    let e = expect_err("calls that differ across ranks", "Mismatch", sync(&s), |e| {
        matches!(e, CommError::Mismatch { .. })
    })?;
    let text = e.to_string();
    for name in names {
        ensure!(text.contains(name), "the mismatch error should name both calls (`{}` missing): {text}", name);
    }
    Ok(())
}

/// Ranks 0 and 1: a send and a receive that disagree on dtype or count both fail with `Mismatch`.
fn p2p_mismatch<C: CommBackend>(ctx: &RankCtx<'_, C>, dtype_differs: bool) -> Result<(), Failure> {
    let r = ctx.rank();
    if r > 1 {
        return Ok(());
    }
    let s = ctx.stream()?;
    let peer = 1 - r;
    let (dtype, len) = match (r, dtype_differs) {
        (0, _) => (DType::F32, 16),
        (_, true) => (DType::F64, 16),
        (_, false) => (DType::F32, 15),
    };
    let buf = sentinel::<C>(&s, dtype, len)?;
    if r == 0 {
        ctx.comm.send(buf.view(), peer, &s)?;
    } else {
        ctx.comm.recv(buf.view(), peer, &s)?;
    }
    let what = if dtype_differs { "a send of f32 received as f64" } else { "a send of 16 received into 15" };
    expect_err(what, "Mismatch", sync(&s), |e| matches!(e, CommError::Mismatch { .. })).map(|_| ())
}

/// The last rank skips a collective: the others time out naming it; when it
/// issues the call later, it fails too instead of hanging.
fn missing_rank<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let last = n - 1;
    let s = ctx.stream()?;
    let x = upload::<C>(&s, DType::F32, bytemuck::cast_slice(&[1.0f32; 4]))?;
    ctx.host_barrier()?;
    if r != last {
        let start = Instant::now();
        ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
        // Where the backend cannot tell which rank is missing, a Timeout is all
        // it can say; and a peer whose own deadline passed first may have
        // aborted, which the others see as a remote error (NCCL's
        // ncclRemoteError, code 6).
        let names = ctx.support.capabilities.names_missing_ranks;
        let e = expect_err(
            "an all_reduce that one rank never issues",
            if names { "Timeout naming the missing rank" } else { "Timeout, or a peer's abort as a remote error" },
            sync(&s),
            |e| match e {
                CommError::Timeout { missing, .. } => !names || missing.contains(&last),
                CommError::Backend { code: 6, .. } => !names,
                _ => false,
            },
        );
        let e = e.with_context(|| format!("(rank {last} was missing)"))?;
        within_deadline(ctx, start, &e)?;
    }
    ctx.host_barrier()?;
    if r == last {
        let late = ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s).and_then(|_| sync(&s));
        let remote = !ctx.support.capabilities.names_missing_ranks;
        expect_err(
            "the late rank's all_reduce after the others timed out",
            "Timeout, Aborted or a remote error",
            late,
            |e| {
                matches!(e, CommError::Timeout { .. } | CommError::Aborted { .. })
                    || (remote && matches!(e, CommError::Backend { code: 6, .. }))
            },
        )?;
    }
    Ok(())
}

/// A failure must come within a few deadlines, not at some much later time.
fn within_deadline<C: CommBackend>(ctx: &RankCtx<'_, C>, start: Instant, e: &CommError) -> Result<(), Failure> {
    let waited = start.elapsed();
    let limit = ctx.comm_timeout * 4 + Duration::from_secs(2);
    ensure!(
        waited <= limit,
        "the error came after {waited:?}, more than {limit:?} (deadline {:?}): {e}",
        ctx.comm_timeout
    );
    Ok(())
}

/// Rank 0 aborts; every rank's next call fails with `Aborted`, and the
/// communicator reports the abort as its asynchronous error.
fn abort_then_call<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let s = ctx.stream()?;
    let x = upload::<C>(&s, DType::F32, bytemuck::cast_slice(&[1.0f32; 4]))?;
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
    sync(&s).context("an all_reduce before the abort")?;
    ctx.host_barrier()?;
    if ctx.rank() == 0 {
        ctx.comm.abort("the conformance suite aborts on purpose");
    }
    ctx.host_barrier()?;
    let after = ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s).and_then(|_| sync(&s));
    expect_err("an all_reduce after rank 0 aborted", "Aborted", after, |e| matches!(e, CommError::Aborted { .. }))?;
    match ctx.comm.async_error() {
        Some(CommError::Aborted { .. }) => Ok(()),
        other => anyhow::bail!("after the abort, async_error() should be Aborted, got {other:?}"),
    }
}

/// Ranks other than 0 wait in an all-reduce; rank 0 aborts instead of
/// joining. They must fail with `Aborted` long before their deadline.
fn abort_while_waiting<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let s = ctx.stream()?;
    let x = upload::<C>(&s, DType::F32, bytemuck::cast_slice(&[1.0f32; 4]))?;
    ctx.host_barrier()?;
    if ctx.rank() == 0 {
        std::thread::sleep(ctx.comm_timeout / 5);
        ctx.comm.abort("the conformance suite aborts while peers wait");
        let mine = ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s).and_then(|_| sync(&s));
        expect_err("rank 0's all_reduce after its own abort", "Aborted", mine, |e| {
            matches!(e, CommError::Aborted { .. })
        })?;
        return Ok(());
    }
    let start = Instant::now();
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
    let e = expect_err("an all_reduce waiting for a rank that aborts", "Aborted", sync(&s), |e| {
        matches!(e, CommError::Aborted { .. })
    })?;
    let waited = start.elapsed();
    ensure!(
        waited < ctx.comm_timeout,
        "the abort took {waited:?} to reach a waiting rank (deadline {:?}): {e}",
        ctx.comm_timeout
    );
    Ok(())
}

/// The last rank's collective #1 fails: it gets an error, every other rank
/// gets `Aborted`, and later calls (on fresh streams) fail everywhere.
fn injected_failure<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let victim = n - 1;
    if r == 0 {
        ctx.faults()?.inject(FaultSpec { rank: victim, call: 1, action: FaultAction::Fail })?;
    }
    ctx.host_barrier()?;
    let s = ctx.stream()?;
    let x = upload::<C>(&s, DType::I32, bytemuck::cast_slice(&[1i32; 4]))?;
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
    sync(&s).context("collective #0, before the fault")?;
    check(
        "collective #0, before the fault",
        DType::I32,
        &read::<C>(&s, x.view())?,
        bytemuck::cast_slice(&[n as i32]),
        0,
    )?;
    // Every rank has finished #0 before the victim can fail #1.
    ctx.host_barrier()?;
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
    let failed = sync(&s);
    if r == victim {
        expect_err("the collective with the injected failure", "an error", failed, |_| true)?;
    } else {
        expect_err("a collective a peer failed", "Aborted", failed, |e| matches!(e, CommError::Aborted { .. }))?;
    }
    let fresh = ctx.stream()?;
    let later = ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &fresh).and_then(|_| sync(&fresh));
    expect_err("a collective after the failure, on a new stream", "an error", later, |_| true).map(|_| ())
}

/// The last rank stalls for a fifth of the deadline before collective #0:
/// the call completes, correctly, only later.
fn short_stall<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let n = ctx.size();
    let stall = ctx.comm_timeout / 5;
    if ctx.rank() == 0 {
        ctx.faults()?.inject(FaultSpec { rank: n - 1, call: 0, action: FaultAction::Stall(stall) })?;
    }
    ctx.host_barrier()?;
    let s = ctx.stream()?;
    let start = Instant::now();
    let x = upload::<C>(&s, DType::F32, bytemuck::cast_slice(&[2.0f32; 5]))?;
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
    sync(&s).context("an all_reduce delayed by a stall shorter than the deadline")?;
    let waited = start.elapsed();
    check("the delayed all_reduce", DType::F32, &read::<C>(&s, x.view())?, bytemuck::cast_slice(&[2.0 * n as f32]), 0)?;
    ensure!(waited >= stall / 2, "the all_reduce finished after {waited:?}, so the {stall:?} stall did not happen");
    Ok(())
}

/// The last rank stalls for twice the deadline: the others time out naming
/// it, and it fails too when it finally arrives.
fn long_stall<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let victim = n - 1;
    if r == 0 {
        let stall = ctx.comm_timeout * 2;
        ctx.faults()?.inject(FaultSpec { rank: victim, call: 0, action: FaultAction::Stall(stall) })?;
    }
    ctx.host_barrier()?;
    let s = ctx.stream()?;
    let start = Instant::now();
    let x = upload::<C>(&s, DType::F32, bytemuck::cast_slice(&[1.0f32; 4]))?;
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, &s)?;
    let result = sync(&s);
    if r == victim {
        expect_err("the stalled rank's all_reduce", "Timeout or Aborted", result, |e| {
            matches!(e, CommError::Timeout { .. } | CommError::Aborted { .. })
        })?;
    } else {
        let e = expect_err(
            "an all_reduce waiting for a stalled rank",
            "Timeout naming it",
            result,
            |e| matches!(e, CommError::Timeout { missing, .. } if missing.contains(&victim)),
        )?;
        within_deadline(ctx, start, &e)?;
    }
    Ok(())
}
