//! Sub-communicators: splits by color and key, and both dimensions of a 2-D mesh.
//!
//! Inputs are drawn per *world* rank, so a sub-communicator that mixes in a
//! rank of another group, or orders its ranks wrongly, produces values the
//! host expectation (computed over the world ranks the group should hold,
//! in the order it should hold them) does not match.

use anyhow::{ensure, Context};
use chorus_collectives::{CommBackend, Communicator, Mesh, ReduceOp};
use chorus_devices::{Buffer, DType};

use crate::expected::{self, check, repeat, table, OpSpec, Pattern};
use crate::util::{read, seed, sentinel, upload};
use crate::{Case, Failure, RankCtx, Requirements, Strm};

/// The subgroup cases for a world of `n` ranks.
pub fn cases<C: CommBackend>(_n: usize) -> Vec<Case<C>> {
    let even = Requirements { even_world: true, ..Requirements::default() };
    vec![
        Case::new("split/even_and_odd_ranks", even_and_odd::<C>),
        Case::new("split/opted_out_rank_and_reversed_keys", opted_out_and_reversed::<C>).min_world(2),
        Case::new("mesh/replicate_x_shard/both_dims", mesh_dims::<C>).min_world(2).needs(even),
        Case::new("mesh/replicate_x_shard/hsdp_reduce_scatter_then_all_reduce", hsdp::<C>).min_world(2).needs(even),
    ]
}

/// Checks `sub`'s rank and size, then runs an all-reduce, an all-gather, a
/// reduce-scatter, a broadcast and a send/recv ring on it. `members` are the
/// world ranks `sub` must hold, in sub-rank order.
fn exercise<C: CommBackend>(
    ctx: &RankCtx<'_, C>,
    s: &Strm<C>,
    sub: &Communicator<C>,
    members: &[usize],
    label: &str,
) -> Result<(), Failure> {
    let me = ctx.rank();
    let m = members.len();
    let Some(sr) = members.iter().position(|w| *w == me) else {
        anyhow::bail!("{label}: world rank {me} should not be in this group");
    };
    ensure!(sub.size() == m, "{label}: size {} but the group has {m} ranks ({members:?})", sub.size());
    ensure!(sub.rank() == sr, "{label}: rank {} but world rank {me} is number {sr} of {members:?}", sub.rank());
    let sum = OpSpec::Uniform(ReduceOp::Sum);

    let pat = Pattern::additive(seed(&format!("{label}.all_reduce")));
    let x = upload::<C>(s, DType::BF16, &expected::input(DType::BF16, &pat, me, 0, 1023))?;
    sub.all_reduce_in_place(x.view(), ReduceOp::Sum, s)?;
    let want = expected::reduced(DType::BF16, &pat, members, &sum.ops(members));
    check(&format!("{label}: all_reduce"), DType::BF16, &read::<C>(s, x.view())?, &want, 0)?;

    let pat = Pattern::additive(seed(&format!("{label}.all_gather")));
    let c = 7;
    let send = upload::<C>(s, DType::I32, &expected::input(DType::I32, &pat, me, 0, c))?;
    let recv = sentinel::<C>(s, DType::I32, m * c)?;
    sub.all_gather(send.view(), recv.view(), s)?;
    let got = read::<C>(s, recv.view())?;
    for (j, w) in members.iter().enumerate() {
        let part = &got[j * c * 4..(j + 1) * c * 4];
        check(
            &format!("{label}: all_gather chunk {j} (world rank {w})"),
            DType::I32,
            part,
            &table(DType::I32, &pat, *w),
            0,
        )?;
    }

    let pat = Pattern::additive(seed(&format!("{label}.reduce_scatter")));
    let c = 5;
    let send = upload::<C>(s, DType::I64, &expected::input(DType::I64, &pat, me, 0, m * c))?;
    let recv = sentinel::<C>(s, DType::I64, c)?;
    sub.reduce_scatter(send.view(), recv.view(), ReduceOp::Sum, s)?;
    let want = expected::reduced(DType::I64, &pat, members, &sum.ops(members));
    check(&format!("{label}: reduce_scatter"), DType::I64, &read::<C>(s, recv.view())?, &want, sr * c)?;

    let pat = Pattern::additive(seed(&format!("{label}.broadcast")));
    let root = m - 1;
    let buf = if sr == root {
        upload::<C>(s, DType::U8, &expected::input(DType::U8, &pat, me, 0, 100))?
    } else {
        sentinel::<C>(s, DType::U8, 100)?
    };
    sub.broadcast_in_place(buf.view(), root, s)?;
    let want = table(DType::U8, &pat, members[root]);
    check(&format!("{label}: broadcast from group rank {root}"), DType::U8, &read::<C>(s, buf.view())?, &want, 0)?;

    let pat = Pattern::additive(seed(&format!("{label}.ring")));
    let (next, prev) = ((sr + 1) % m, (sr + m - 1) % m);
    let send = upload::<C>(s, DType::F64, &expected::input(DType::F64, &pat, me, 0, 31))?;
    let recv = sentinel::<C>(s, DType::F64, 31)?;
    sub.group(s, |g| {
        g.send(send.view(), next)?;
        g.recv(recv.view(), prev)
    })?;
    let want = table(DType::F64, &pat, members[prev]);
    check(&format!("{label}: recv from group rank {prev}"), DType::F64, &read::<C>(s, recv.view())?, &want, 0)
}

/// The world communicator is still in step after work on sub-communicators.
fn world_still_works<C: CommBackend>(ctx: &RankCtx<'_, C>, s: &Strm<C>) -> Result<(), Failure> {
    let n = ctx.size();
    let ids: Vec<usize> = (0..n).collect();
    let pat = Pattern::additive(seed("world after split"));
    let x = upload::<C>(s, DType::F32, &expected::input(DType::F32, &pat, ctx.rank(), 0, 64))?;
    ctx.comm.all_reduce_in_place(x.view(), ReduceOp::Sum, s)?;
    let want = expected::reduced(DType::F32, &pat, &ids, &OpSpec::Uniform(ReduceOp::Sum).ops(&ids));
    check("a world all_reduce after the split", DType::F32, &read::<C>(s, x.view())?, &want, 0)
}

fn even_and_odd<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let s = ctx.stream()?;
    let sub = ctx.comm.split(Some((r % 2) as u32), r as i64)?.context("split with a color returned no communicator")?;
    let members: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
    let label = if r % 2 == 0 { "even ranks" } else { "odd ranks" };
    exercise(ctx, &s, &sub, &members, label)?;
    world_still_works(ctx, &s)
}

/// The last rank opts out (no color); the others are ordered by a key that
/// reverses them.
fn opted_out_and_reversed<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let s = ctx.stream()?;
    let last = n - 1;
    let color = (r != last).then_some(7);
    let sub = ctx.comm.split(color, -(r as i64))?;
    match sub {
        Some(_) if r == last => anyhow::bail!("the rank that passed no color got a communicator"),
        None if r != last => anyhow::bail!("a rank that passed a color got no communicator"),
        Some(sub) => {
            let members: Vec<usize> = (0..last).rev().collect();
            exercise(ctx, &s, &sub, &members, "ranks but the last, reversed")?;
        }
        None => {}
    }
    world_still_works(ctx, &s)
}

fn mesh_dims<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let half = n / 2;
    let s = ctx.stream()?;
    let mesh = Mesh::new(ctx.comm, &[("replicate", 2), ("shard", half)])?;
    let (rep, sh) = (r / half, r % half);
    ensure!(
        mesh.coord("replicate")? == rep && mesh.coord("shard")? == sh,
        "rank {r} has coordinates {:?}",
        mesh.coords()
    );
    ensure!(mesh.dim_size("replicate")? == 2 && mesh.dim_size("shard")? == half, "dims {:?}", mesh.dims());
    let shard_members: Vec<usize> = (0..half).map(|j| rep * half + j).collect();
    let replicate_members: Vec<usize> = (0..2).map(|i| i * half + sh).collect();
    exercise(ctx, &s, mesh.comm("shard")?, &shard_members, "mesh dim shard")?;
    exercise(ctx, &s, mesh.comm("replicate")?, &replicate_members, "mesh dim replicate")?;
    world_still_works(ctx, &s)
}

/// HSDP's gradient path: reduce-scatter over the shard dimension, then
/// all-reduce of the shard over the replicate dimension, equals chunk
/// `shard` of the sum over the whole world.
fn hsdp<C: CommBackend>(ctx: &RankCtx<'_, C>) -> Result<(), Failure> {
    let (r, n) = (ctx.rank(), ctx.size());
    let half = n / 2;
    let sh = r % half;
    let s = ctx.stream()?;
    let mesh = Mesh::new(ctx.comm, &[("replicate", 2), ("shard", half)])?;
    let ids: Vec<usize> = (0..n).collect();
    for (dtype, c) in [(DType::F32, 1023), (DType::BF16, 4097)] {
        let pat = Pattern::additive(seed(&format!("hsdp.{dtype}")));
        let mine = table(dtype, &pat, r);
        let grads = upload::<C>(&s, dtype, &repeat(dtype, &mine, 0, half * c))?;
        let shard = sentinel::<C>(&s, dtype, c)?;
        mesh.comm("shard")?.reduce_scatter(grads.view(), shard.view(), ReduceOp::Sum, &s)?;
        mesh.comm("replicate")?.all_reduce_in_place(shard.view(), ReduceOp::Sum, &s)?;
        // The world's sum of element k of every rank's gradients.
        let want = expected::reduced(dtype, &pat, &ids, &OpSpec::Uniform(ReduceOp::Sum).ops(&ids));
        check(
            &format!("{dtype} shard {sh} after both reductions"),
            dtype,
            &read::<C>(&s, shard.view())?,
            &want,
            sh * c,
        )?;
    }
    Ok(())
}
