//! Value cases: every operation × dtype × reduce operator × count, out of
//! place and in place; send/recv patterns; groups; barriers.
//!
//! Counts follow NCCL: the buffer length for all-reduce, broadcast and
//! reduce; the per-rank send count for all-gather; the per-rank receive
//! count for reduce-scatter; the per-peer count for all-to-all. For the
//! largest count the last three use `⌈count / n⌉`, so that every rank's
//! largest buffer stays near `count` elements on any world size (a
//! megabyte count still splits unevenly across ranks).
//!
//! Every output buffer starts as [`SENTINEL`](crate::expected::SENTINEL), so
//! an element a backend forgets to write is caught, and every out-of-place
//! input is read back to check that it was left alone.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use chorus_collectives::{CommBackend, ReduceOp};
use chorus_devices::{Buffer, DType, Stream, View};

use crate::expected::{self, check, check_untouched, repeat, table, OpSpec, Pattern};
use crate::util::{part, read, seed, sentinel, upload};
use crate::{Buf, Case, Failure, RankCtx, Requirements, Strm};

/// The counts every operation is run with.
pub const COUNTS: [usize; 5] = [0, 1, 7, 1023, (1 << 20) + 3];

/// Counts above this are split across ranks for the chunked operations.
const SPLIT_ABOVE: usize = 4096;

/// The per-rank chunk of a chunked operation (all-gather, reduce-scatter,
/// all-to-all) for `count` on `n` ranks; see the module documentation.
pub fn chunk(count: usize, n: usize) -> usize {
    if count > SPLIT_ABOVE {
        count.div_ceil(n.max(1))
    } else {
        count
    }
}

/// The roots rooted operations are run with: the first, middle and last rank.
pub fn roots(n: usize) -> Vec<usize> {
    let mut r = vec![0, n / 2, n.saturating_sub(1)];
    r.dedup();
    r
}

/// What a reduce operator needs from the backend.
pub fn op_needs(op: OpSpec) -> Requirements {
    match op.kind() {
        ReduceOp::Avg => Requirements { avg: true, ..Requirements::default() },
        ReduceOp::PreMulSum(_) => Requirements { premul_sum: true, ..Requirements::default() },
        _ => Requirements::default(),
    }
}

#[derive(Clone, Copy, Debug)]
struct Spec {
    dtype: DType,
    op: OpSpec,
    count: usize,
    in_place: bool,
    root: usize,
    seed: u64,
}

fn variant(base: &str, in_place: bool) -> String {
    if in_place {
        format!("{base}_in_place")
    } else {
        base.to_string()
    }
}

/// The value cases for a world of `n` ranks.
pub fn cases<C: CommBackend>(n: usize) -> Vec<Case<C>> {
    let mut v: Vec<Case<C>> = Vec::new();
    let spec =
        |name: &str, dtype, op, count, in_place, root| Spec { dtype, op, count, in_place, root, seed: seed(name) };

    for (base, run) in [("all_reduce", all_reduce::<C> as Body<C>), ("reduce_scatter", reduce_scatter::<C>)] {
        for in_place in [false, true] {
            for dtype in DType::ALL {
                for op in OpSpec::all() {
                    for count in COUNTS {
                        let count = if base == "reduce_scatter" { chunk(count, n) } else { count };
                        let name = format!("{}/{dtype}/{}/count={count}", variant(base, in_place), op.name());
                        let sp = spec(&name, dtype, op, count, in_place, 0);
                        v.push(Case::new(name, move |ctx| run(ctx, sp)).needs(op_needs(op)));
                    }
                }
            }
        }
    }
    for in_place in [false, true] {
        for dtype in DType::ALL {
            for count in COUNTS {
                let count = chunk(count, n);
                let name = format!("{}/{dtype}/count={count}", variant("all_gather", in_place));
                let sp = spec(&name, dtype, OpSpec::Uniform(ReduceOp::Sum), count, in_place, 0);
                v.push(Case::new(name, move |ctx| all_gather(ctx, sp)));
            }
        }
    }
    for in_place in [false, true] {
        for dtype in DType::ALL {
            for root in roots(n) {
                for count in COUNTS {
                    let name = format!("{}/{dtype}/root={root}/count={count}", variant("broadcast", in_place));
                    let sp = spec(&name, dtype, OpSpec::Uniform(ReduceOp::Sum), count, in_place, root);
                    v.push(Case::new(name, move |ctx| broadcast(ctx, sp)));
                }
            }
        }
    }
    // Reduce: every operator at the last rank, and the other roots with a sum.
    for in_place in [false, true] {
        for dtype in DType::ALL {
            for op in OpSpec::all() {
                for root in roots(n) {
                    if root != n.saturating_sub(1) && op != OpSpec::Uniform(ReduceOp::Sum) {
                        continue;
                    }
                    for count in COUNTS {
                        let name =
                            format!("{}/{dtype}/{}/root={root}/count={count}", variant("reduce", in_place), op.name());
                        let sp = spec(&name, dtype, op, count, in_place, root);
                        v.push(Case::new(name, move |ctx| reduce(ctx, sp)).needs(op_needs(op)));
                    }
                }
            }
        }
    }
    for dtype in DType::ALL {
        for count in COUNTS {
            let count = chunk(count, n);
            let name = format!("all_to_all/{dtype}/count={count}");
            let sp = spec(&name, dtype, OpSpec::Uniform(ReduceOp::Sum), count, false, 0);
            v.push(Case::new(name, move |ctx| all_to_all(ctx, sp)));
        }
    }
    for dtype in DType::ALL {
        for count in COUNTS {
            let name = format!("send_recv/ring_group/{dtype}/count={count}");
            let sp = spec(&name, dtype, OpSpec::Uniform(ReduceOp::Sum), count, false, 0);
            v.push(Case::new(name, move |ctx| ring(ctx, sp)));
            let name = format!("send_recv/pairwise_group/{dtype}/count={count}");
            let sp = spec(&name, dtype, OpSpec::Uniform(ReduceOp::Sum), count, false, 0);
            v.push(Case::new(name, move |ctx| pairwise(ctx, sp, true)).min_world(2));
        }
        let count = 1023;
        let name = format!("send_recv/pairwise_blocking/{dtype}/count={count}");
        let sp = spec(&name, dtype, OpSpec::Uniform(ReduceOp::Sum), count, false, 0);
        v.push(Case::new(name, move |ctx| pairwise(ctx, sp, false)).min_world(2));
    }
    v.push(Case::new("barrier/waits_for_every_rank", barrier::<C>));
    v.push(Case::new("group/every_operation_in_one_group", group_of_everything::<C>));
    v.push(Case::new("sequence/back_to_back_without_host_sync", back_to_back::<C>));
    v
}

type Body<C> = fn(&RankCtx<'_, C>, Spec) -> Result<(), Failure>;

/// Runs an out-of-place `call` from `send` (which holds `mine`) into a new
/// [`SENTINEL`](crate::expected::SENTINEL) buffer of `len` elements, checks
/// that `send` was left alone, and reads the output back.
fn out_of_place<C: CommBackend>(
    s: &Strm<C>,
    dtype: DType,
    send: &Buf<C>,
    mine: &[u8],
    len: usize,
    call: impl FnOnce(View<'_, C::B>) -> chorus_collectives::Result<()>,
) -> Result<Vec<u8>, Failure> {
    let recv = sentinel::<C>(s, dtype, len)?;
    call(recv.view())?;
    check("the send buffer (must be left alone)", dtype, &read::<C>(s, send.view())?, mine, 0)?;
    read::<C>(s, recv.view())
}

/// Checks a gathered output: chunk `j` (`len` elements) of `got` must hold
/// rank `j`'s table from element `first`, for each of the `n` ranks.
fn check_chunks(
    what: impl Fn(usize) -> String,
    dtype: DType,
    got: &[u8],
    pattern: &Pattern,
    n: usize,
    len: usize,
    first: usize,
) -> Result<(), Failure> {
    let bytes = len * dtype.size();
    for j in 0..n {
        check(&what(j), dtype, &got[j * bytes..(j + 1) * bytes], &table(dtype, pattern, j), first)?;
    }
    Ok(())
}

/// One rank's side of a reducing case: its stream, the case's pattern, the
/// rank's table of it, and a send buffer repeating that table.
struct ReduceInputs<C: CommBackend> {
    s: Strm<C>,
    pattern: Pattern,
    mine: Vec<u8>,
    send: Buf<C>,
}

impl<C: CommBackend> ReduceInputs<C> {
    /// The inputs with a send buffer of `len` elements.
    fn new(ctx: &RankCtx<'_, C>, sp: Spec, len: usize) -> Result<Self, Failure> {
        let s = ctx.stream()?;
        let pattern = Pattern::for_op(sp.op, ctx.size(), sp.seed);
        let mine = table(sp.dtype, &pattern, ctx.rank());
        let send = upload::<C>(&s, sp.dtype, &repeat(sp.dtype, &mine, 0, len))?;
        Ok(ReduceInputs { s, pattern, mine, send })
    }
}

/// `pattern`'s table reduced over all `n` ranks with the case's operators.
fn reduced(sp: Spec, pattern: &Pattern, n: usize) -> Vec<u8> {
    let ids: Vec<usize> = (0..n).collect();
    expected::reduced(sp.dtype, pattern, &ids, &sp.op.ops(&ids))
}

fn all_reduce<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, n, dtype, count) = (ctx.rank(), ctx.size(), sp.dtype, sp.count);
    let ReduceInputs { s, pattern, mine, send } = ReduceInputs::new(ctx, sp, count)?;
    let op = sp.op.for_rank(r);
    let got = if sp.in_place {
        ctx.comm.all_reduce_in_place(send.view(), op, &s)?;
        read::<C>(&s, send.view())?
    } else {
        out_of_place::<C>(&s, dtype, &send, &mine, count, |recv| ctx.comm.all_reduce(send.view(), recv, op, &s))?
    };
    check("the result", dtype, &got, &reduced(sp, &pattern, n), 0)
}

fn reduce_scatter<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, n, dtype, c) = (ctx.rank(), ctx.size(), sp.dtype, sp.count);
    let ReduceInputs { s, pattern, mine, send } = ReduceInputs::new(ctx, sp, n * c)?;
    let op = sp.op.for_rank(r);
    let got = if sp.in_place {
        ctx.comm.reduce_scatter_in_place(send.view(), op, &s)?;
        read::<C>(&s, part::<C::B>(&send, r * c, c)?)?
    } else {
        out_of_place::<C>(&s, dtype, &send, &mine, c, |recv| ctx.comm.reduce_scatter(send.view(), recv, op, &s))?
    };
    check(&format!("the result (reduced chunk {r})"), dtype, &got, &reduced(sp, &pattern, n), r * c)
}

fn all_gather<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, n, dtype, c) = (ctx.rank(), ctx.size(), sp.dtype, sp.count);
    let s = ctx.stream()?;
    let pattern = Pattern::additive(sp.seed);
    let mine = table(dtype, &pattern, r);
    let input = repeat(dtype, &mine, 0, c);
    let got = if sp.in_place {
        let buf = sentinel::<C>(&s, dtype, n * c)?;
        s.copy_from_host(&input, part::<C::B>(&buf, r * c, c)?)?;
        ctx.comm.all_gather_in_place(buf.view(), &s)?;
        read::<C>(&s, buf.view())?
    } else {
        let send = upload::<C>(&s, dtype, &input)?;
        out_of_place::<C>(&s, dtype, &send, &mine, n * c, |recv| ctx.comm.all_gather(send.view(), recv, &s))?
    };
    check_chunks(|j| format!("chunk {j} (rank {j}'s input)"), dtype, &got, &pattern, n, c, 0)
}

fn broadcast<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, dtype, count, root) = (ctx.rank(), sp.dtype, sp.count, sp.root);
    let s = ctx.stream()?;
    let pattern = Pattern::additive(sp.seed);
    let mine = table(dtype, &pattern, r);
    let got = if sp.in_place {
        let buf = if r == root {
            upload::<C>(&s, dtype, &repeat(dtype, &mine, 0, count))?
        } else {
            sentinel::<C>(&s, dtype, count)?
        };
        ctx.comm.broadcast_in_place(buf.view(), root, &s)?;
        read::<C>(&s, buf.view())?
    } else {
        // Every rank passes a send buffer with its own data; only the root's may be read.
        let send = upload::<C>(&s, dtype, &repeat(dtype, &mine, 0, count))?;
        out_of_place::<C>(&s, dtype, &send, &mine, count, |recv| ctx.comm.broadcast(send.view(), recv, root, &s))?
    };
    check(&format!("the result (root {root}'s data)"), dtype, &got, &table(dtype, &pattern, root), 0)
}

fn reduce<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, n, dtype, count, root) = (ctx.rank(), ctx.size(), sp.dtype, sp.count, sp.root);
    let ReduceInputs { s, pattern, mine, send } = ReduceInputs::new(ctx, sp, count)?;
    let op = sp.op.for_rank(r);
    let want = || reduced(sp, &pattern, n);
    if sp.in_place {
        ctx.comm.reduce_in_place(send.view(), op, root, &s)?;
        let got = read::<C>(&s, send.view())?;
        if r == root {
            check("the result at the root", dtype, &got, &want(), 0)
        } else {
            check("a non-root's buffer (must be left alone)", dtype, &got, &mine, 0)
        }
    } else {
        let got =
            out_of_place::<C>(&s, dtype, &send, &mine, count, |recv| ctx.comm.reduce(send.view(), recv, op, root, &s))?;
        if r == root {
            check("the result at the root", dtype, &got, &want(), 0)
        } else {
            check_untouched("a non-root's recv buffer (must not be written)", dtype, &got)
        }
    }
}

fn all_to_all<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, n, dtype, c) = (ctx.rank(), ctx.size(), sp.dtype, sp.count);
    let s = ctx.stream()?;
    let pattern = Pattern::additive(sp.seed);
    let mine = table(dtype, &pattern, r);
    let send = upload::<C>(&s, dtype, &repeat(dtype, &mine, 0, n * c))?;
    let got = out_of_place::<C>(&s, dtype, &send, &mine, n * c, |recv| ctx.comm.all_to_all(send.view(), recv, &s))?;
    check_chunks(|j| format!("chunk {j} (chunk {r} of rank {j})"), dtype, &got, &pattern, n, c, r * c)
}

/// Each rank sends to the next and receives from the previous, in one group.
fn ring<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec) -> Result<(), Failure> {
    let (r, n, dtype, count) = (ctx.rank(), ctx.size(), sp.dtype, sp.count);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let s = ctx.stream()?;
    let pattern = Pattern::additive(sp.seed);
    let mine = table(dtype, &pattern, r);
    let send = upload::<C>(&s, dtype, &repeat(dtype, &mine, 0, count))?;
    let got = out_of_place::<C>(&s, dtype, &send, &mine, count, |recv| {
        ctx.comm.group(&s, |g| {
            g.send(send.view(), next)?;
            g.recv(recv, prev)
        })
    })?;
    check(&format!("the data received from rank {prev}"), dtype, &got, &table(dtype, &pattern, prev), 0)
}

/// Ranks 2k and 2k+1 exchange buffers, in one group or as blocking calls in
/// opposite orders (the even rank sends first). A last rank without a
/// partner (odd world) takes no part.
fn pairwise<C: CommBackend>(ctx: &RankCtx<'_, C>, sp: Spec, grouped: bool) -> Result<(), Failure> {
    let (r, n, dtype, count) = (ctx.rank(), ctx.size(), sp.dtype, sp.count);
    let partner = r ^ 1;
    if partner >= n {
        return Ok(());
    }
    let s = ctx.stream()?;
    let pattern = Pattern::additive(sp.seed);
    let send = upload::<C>(&s, dtype, &input_of(dtype, &pattern, r, count))?;
    let recv = sentinel::<C>(&s, dtype, count)?;
    if grouped {
        ctx.comm.group(&s, |g| {
            g.recv(recv.view(), partner)?;
            g.send(send.view(), partner)
        })?;
    } else if r % 2 == 0 {
        ctx.comm.send(send.view(), partner, &s)?;
        ctx.comm.recv(recv.view(), partner, &s)?;
    } else {
        ctx.comm.recv(recv.view(), partner, &s)?;
        ctx.comm.send(send.view(), partner, &s)?;
    }
    check(
        &format!("the data received from rank {partner}"),
        dtype,
        &read::<C>(&s, recv.view())?,
        &table(dtype, &pattern, partner),
        0,
    )
}

fn input_of(dtype: DType, pattern: &Pattern, id: usize, count: usize) -> Vec<u8> {
    expected::input(dtype, pattern, id, 0, count)
}

/// Rank 0 reaches the barrier late (its host sleeps first); every other
/// rank's stream must not get past the barrier before rank 0 has issued it.
fn barrier<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    const LATE: Duration = Duration::from_millis(200);
    let s = ctx.stream()?;
    ctx.host_barrier()?;
    let start = Instant::now();
    if ctx.rank() == 0 {
        std::thread::sleep(LATE);
    }
    ctx.comm.barrier(&s)?;
    crate::util::sync(&s).context("barrier")?;
    let waited = start.elapsed();
    // Half the delay: ranks leave the host barrier at slightly different times.
    ensure!(
        ctx.rank() == 0 || waited >= LATE / 2,
        "the barrier completed after {waited:?}, before rank 0 (late by {LATE:?}) had issued it"
    );
    // The communicator is still in step: an all-reduce after the barrier is right.
    let b = upload::<C>(&s, DType::I32, bytemuck::cast_slice(&[ctx.rank() as i32 + 1]))?;
    ctx.comm.all_reduce_in_place(b.view(), ReduceOp::Sum, &s)?;
    let n = ctx.size() as i32;
    check(
        "an all-reduce after the barrier",
        DType::I32,
        &read::<C>(&s, b.view())?,
        bytemuck::cast_slice(&[n * (n + 1) / 2]),
        0,
    )
}

/// One group holding one call of every kind, each with its own dtype.
fn group_of_everything<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let ids: Vec<usize> = (0..n).collect();
    let (next, prev, root) = ((r + 1) % n, (r + n - 1) % n, n - 1);
    let s = ctx.stream()?;
    let p = |name: &str, op| Pattern::for_op(op, n, seed(name));
    let max = OpSpec::Uniform(ReduceOp::Max);
    let sum = OpSpec::Uniform(ReduceOp::Sum);
    let (ar, ag, rs, bc, rd, a2a, p2p) = (
        p("g.ar", sum),
        p("g.ag", sum),
        p("g.rs", max),
        p("g.bc", sum),
        p("g.rd", sum),
        p("g.a2a", sum),
        p("g.p2p", sum),
    );
    let t = |pat: &Pattern, d, id| table(d, pat, id);

    let ar_send = upload::<C>(&s, DType::F32, &input_of(DType::F32, &ar, r, 1023))?;
    let ar_recv = sentinel::<C>(&s, DType::F32, 1023)?;
    let ag_send = upload::<C>(&s, DType::I32, &input_of(DType::I32, &ag, r, 7))?;
    let ag_recv = sentinel::<C>(&s, DType::I32, 7 * n)?;
    let rs_send = upload::<C>(&s, DType::BF16, &input_of(DType::BF16, &rs, r, 33 * n))?;
    let rs_recv = sentinel::<C>(&s, DType::BF16, 33)?;
    let bc_send = upload::<C>(&s, DType::U8, &input_of(DType::U8, &bc, r, 100))?;
    let bc_recv = sentinel::<C>(&s, DType::U8, 100)?;
    let rd_send = upload::<C>(&s, DType::I64, &input_of(DType::I64, &rd, r, 65))?;
    let rd_recv = sentinel::<C>(&s, DType::I64, 65)?;
    let a2a_send = upload::<C>(&s, DType::F16, &input_of(DType::F16, &a2a, r, 5 * n))?;
    let a2a_recv = sentinel::<C>(&s, DType::F16, 5 * n)?;
    let p2p_send = upload::<C>(&s, DType::F64, &input_of(DType::F64, &p2p, r, 50))?;
    let p2p_recv = sentinel::<C>(&s, DType::F64, 50)?;
    ctx.comm.group(&s, |g| {
        g.all_reduce(ar_send.view(), ar_recv.view(), ReduceOp::Sum)?;
        g.all_gather(ag_send.view(), ag_recv.view())?;
        g.reduce_scatter(rs_send.view(), rs_recv.view(), ReduceOp::Max)?;
        g.broadcast(bc_send.view(), bc_recv.view(), root)?;
        g.reduce(rd_send.view(), rd_recv.view(), ReduceOp::Sum, root)?;
        g.all_to_all(a2a_send.view(), a2a_recv.view())?;
        g.send(p2p_send.view(), next)?;
        g.recv(p2p_recv.view(), prev)
    })?;

    let want = expected::reduced(DType::F32, &ar, &ids, &sum.ops(&ids));
    check("all_reduce in the group", DType::F32, &read::<C>(&s, ar_recv.view())?, &want, 0)?;
    let got = read::<C>(&s, ag_recv.view())?;
    check_chunks(|j| format!("all_gather chunk {j} in the group"), DType::I32, &got, &ag, n, 7, 0)?;
    let want = expected::reduced(DType::BF16, &rs, &ids, &max.ops(&ids));
    check("reduce_scatter in the group", DType::BF16, &read::<C>(&s, rs_recv.view())?, &want, 33 * r)?;
    check("broadcast in the group", DType::U8, &read::<C>(&s, bc_recv.view())?, &t(&bc, DType::U8, root), 0)?;
    let got = read::<C>(&s, rd_recv.view())?;
    if r == root {
        let want = expected::reduced(DType::I64, &rd, &ids, &sum.ops(&ids));
        check("reduce in the group", DType::I64, &got, &want, 0)?;
    } else {
        check_untouched("reduce in the group (non-root recv)", DType::I64, &got)?;
    }
    let got = read::<C>(&s, a2a_recv.view())?;
    check_chunks(|j| format!("all_to_all chunk {j} in the group"), DType::F16, &got, &a2a, n, 5, 5 * r)?;
    check("recv in the group", DType::F64, &read::<C>(&s, p2p_recv.view())?, &t(&p2p, DType::F64, prev), 0)
}

/// Many collectives enqueued on one stream before the host looks at any
/// result: each must see its own inputs, in issue order.
fn back_to_back<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    const CALLS: usize = 48;
    const COUNT: usize = 257;
    const ACC_EVERY: usize = 6;
    let (r, n) = (ctx.rank(), ctx.size());
    let ids: Vec<usize> = (0..n).collect();
    let s = ctx.stream()?;
    let sum = OpSpec::Uniform(ReduceOp::Sum);
    let mut pending = Vec::with_capacity(CALLS);
    // One accumulator updated by every other call: an out-of-order run would change it.
    let acc = upload::<C>(&s, DType::I64, &input_of(DType::I64, &Pattern::additive(0), r, COUNT))?;
    for i in 0..CALLS {
        let dtype = DType::ALL[i % DType::ALL.len()];
        let pattern = Pattern::additive(seed(&format!("b2b.{i}")));
        let buf = upload::<C>(&s, dtype, &input_of(dtype, &pattern, r, COUNT))?;
        ctx.comm.all_reduce_in_place(buf.view(), ReduceOp::Sum, &s)?;
        if i % ACC_EVERY == 0 {
            ctx.comm.all_reduce_in_place(acc.view(), ReduceOp::Sum, &s)?;
        }
        pending.push((dtype, pattern, buf));
    }
    for (i, (dtype, pattern, buf)) in pending.iter().enumerate() {
        let want = expected::reduced(*dtype, pattern, &ids, &sum.ops(&ids));
        check(&format!("all-reduce #{i}"), *dtype, &read::<C>(&s, buf.view())?, &want, 0)?;
    }
    // The first reduction sums the ranks' inputs; each later one multiplies by n.
    let base = expected::reduced(DType::I64, &Pattern::additive(0), &ids, &sum.ops(&ids));
    let factor = (n as i64).wrapping_pow((CALLS.div_ceil(ACC_EVERY) - 1) as u32);
    let want: Vec<i64> = expected::decode::<i64>(&base).iter().map(|v| v.wrapping_mul(factor)).collect();
    check("the repeatedly reduced accumulator", DType::I64, &read::<C>(&s, acc.view())?, bytemuck::cast_slice(&want), 0)
}
