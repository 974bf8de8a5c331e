//! A group's data movement (FSDP2's `_fsdp_collectives`): copy-in,
//! all-gather and copy-out of its parameters; the gradient path (pack
//! rank-major, reduce-scatter, HSDP all-reduce, views out into the f32
//! sharded gradients); and the all-gather of the masters for export.
//!
//! These functions only enqueue, on the streams named in each; which group
//! runs them when, and what the streams wait on between groups, is the param
//! group's and the root's business.

use chorus_collectives::{CommBackend, Communicator, ReduceOp};
use chorus_devices::{Buffer, Copy2d, DType, Device, Scalar, Stream, StreamExt, View};

use crate::comm_context::CommContext;
use crate::config::{gathers_as_float8, DataParallel};
use crate::layout::{GroupLayout, ParamLayout};
use crate::offload::{self, cast_or_copy};
use crate::param::Param;
use crate::storage::GroupStorage;
use crate::{Buf, Ev, FsdpError, Result, Strm};

/// An all-gather output and the event recorded after the all-gather.
pub(crate) struct AllGatherResult<C: CommBackend> {
    pub(crate) buffer: Buf<C>,
    pub(crate) event: Ev<C>,
    /// Gathered over the post-forward world (from the post-forward shard).
    pub(crate) post_forward: bool,
}

/// What a copy-in reads.
pub(crate) enum CopyInSource<'a, C: CommBackend> {
    /// The group's f32 masters (their sharded part is laid out as the
    /// all-gather input's chunk), cast to the param dtype.
    Masters(&'a Buf<C>),
    /// The group's post-forward shard, already in the param dtype.
    PostForward(&'a Buf<C>),
}

/// Copies this rank's shards into chunk `comm.rank()` of a new flat buffer on
/// the copy-in stream — one copy or cast of the whole shard, since the
/// masters are laid out as that chunk — then all-gathers it in place on the
/// all-gather stream. With `float8` (and some parameter that
/// [`gathers_as_float8`]), the gather from the masters goes through
/// [`float8_all_gather`] instead; the result is the same flat buffer in `dtype`.
pub(crate) fn all_gather<C: CommBackend>(
    ctx: &mut CommContext<C>,
    comm: &Communicator<C>,
    layout: &GroupLayout,
    dtype: DType,
    source: CopyInSource<'_, C>,
    float8: bool,
) -> Result<AllGatherResult<C>> {
    let s = &ctx.streams;
    let n = layout.shard_numel;
    let out = s.copy_in.alloc(dtype, comm.size() * n)?;
    let own = out.slice(comm.rank() * n, n)?;
    let split = float8.then(|| Float8Split::new(layout)).flatten();
    let (post_forward, float8_masters) = match source {
        CopyInSource::PostForward(src) => {
            s.copy_in.copy(src.view(), own)?;
            (true, None)
        }
        CopyInSource::Masters(master) if split.is_some() => (false, Some(master)),
        CopyInSource::Masters(master) => {
            cast_or_copy(&s.copy_in, master.slice(0, n)?, own)?;
            (false, None)
        }
    };
    ctx.events.order(&ctx.device, &s.copy_in, &[&s.all_gather])?;
    match (split, float8_masters) {
        (Some(split), Some(master)) => float8_all_gather(ctx, comm, layout, &split, master, &out)?,
        _ => {
            comm.all_gather_in_place(out.view(), &ctx.streams.all_gather)?;
            ctx.counts.all_gathers += 1;
        }
    }
    let event = ctx.events.record(&ctx.device, &ctx.streams.all_gather)?;
    Ok(AllGatherResult { buffer: out, event, post_forward })
}

/// A group's sharded parameters split for the float8 all-gather: each part
/// laid out on its own (indices into the group's layout), so each travels
/// as one flat buffer of one dtype.
struct Float8Split {
    /// Gathered as float8, and their layout.
    float8: Vec<usize>,
    float8_layout: GroupLayout,
    /// Gathered in the param dtype, and their layout.
    rest: Vec<usize>,
    rest_layout: GroupLayout,
}

impl Float8Split {
    /// The split of `layout`, or `None` when no parameter is gathered as float8.
    fn new(layout: &GroupLayout) -> Option<Float8Split> {
        let (float8, rest): (Vec<usize>, Vec<usize>) =
            (0..layout.params.len()).partition(|&i| gathers_as_float8(&layout.params[i].shape));
        if float8.is_empty() {
            return None;
        }
        let part = |ids: &[usize]| {
            let mut offset = 0;
            let params = ids
                .iter()
                .map(|&i| {
                    let l = ParamLayout { offset, ..layout.params[i].clone() };
                    offset += l.shard_numel;
                    l
                })
                .collect();
            GroupLayout { world: layout.world, params, shard_numel: offset }
        };
        Some(Float8Split { float8_layout: part(&float8), rest_layout: part(&rest), float8, rest })
    }
}

/// torchao's float8 all-gather of one group into `out` (the group's flat
/// buffer in the param dtype, chunk `r` rank `r`'s shards), all on the
/// all-gather stream:
/// 1. each float8 parameter's local amax (`max |x|` of this rank's f32
///    master shard, padding zero) into one f32 buffer, all-reduced with MAX:
///    one all-reduce for the group gives every parameter's global amax
///    (torchao's `precompute_float8_dynamic_scale_for_fsdp`);
/// 2. each master shard quantized with its parameter's scale
///    ([`Float8E4M3::scale_for`](chorus_devices::Float8E4M3::scale_for)) into
///    a flat float8 buffer, all-gathered (one byte per element);
/// 3. the other parameters cast into a flat buffer of the param dtype and
///    all-gathered (skipped when there are none);
/// 4. both unpacked into `out`: float8 chunks dequantized, the rest copied.
///
/// Every rank issues the same collectives in the same order: the split
/// depends only on the parameters' shapes.
fn float8_all_gather<C: CommBackend>(
    ctx: &mut CommContext<C>,
    comm: &Communicator<C>,
    layout: &GroupLayout,
    split: &Float8Split,
    masters: &Buf<C>,
    out: &Buf<C>,
) -> Result<()> {
    let g = &ctx.streams.all_gather;
    let (world, rank, n) = (comm.size(), comm.rank(), layout.shard_numel);
    let master = |i: usize| -> Result<View<'_, C::B>> {
        let l = &layout.params[i];
        Ok(masters.slice(l.offset, l.shard_numel)?)
    };

    let amax = g.alloc(DType::F32, split.float8.len())?;
    for (j, &i) in split.float8.iter().enumerate() {
        let out = amax.slice(j, 1)?;
        offload::on_kernel_view(g, master(i)?, false, |m| g.abs_max(m, out, false))?;
    }
    comm.all_reduce_in_place(amax.view(), ReduceOp::Max, g)?;

    let f8n = split.float8_layout.shard_numel;
    let f8 = g.alloc(DType::F8E4M3, world * f8n)?;
    for (j, &i) in split.float8.iter().enumerate() {
        let l = &split.float8_layout.params[j];
        let dst = f8.slice(rank * f8n + l.offset, l.shard_numel)?;
        offload::on_kernel_view(g, master(i)?, false, |m| g.quantize_f8(m, amax.slice(j, 1)?, dst))?;
    }
    comm.all_gather_in_place(f8.view(), g)?;
    ctx.counts.all_gathers += 1;

    let rest_n = split.rest_layout.shard_numel;
    if rest_n > 0 {
        let rest = g.alloc(out.dtype(), world * rest_n)?;
        for (j, &i) in split.rest.iter().enumerate() {
            let l = &split.rest_layout.params[j];
            cast_or_copy(g, master(i)?, rest.slice(rank * rest_n + l.offset, l.shard_numel)?)?;
        }
        comm.all_gather_in_place(rest.view(), g)?;
        ctx.counts.all_gathers += 1;
        for (j, &i) in split.rest.iter().enumerate() {
            let l = &split.rest_layout.params[j];
            // Each rank's piece, from its chunk of the rest to its chunk of `out`.
            let rows = Copy2d {
                rows: world,
                row_len: l.shard_numel,
                src_offset: l.offset,
                src_stride: rest_n,
                dst_offset: layout.params[i].offset,
                dst_stride: n,
            };
            g.copy_2d(rest.view(), out.view(), rows)?;
        }
    }
    for (j, &i) in split.float8.iter().enumerate() {
        let (l, full) = (&split.float8_layout.params[j], &layout.params[i]);
        for r in 0..world {
            let src = f8.slice(r * f8n + l.offset, l.shard_numel)?;
            g.dequantize_f8(src, amax.slice(j, 1)?, out.slice(r * n + full.offset, full.shard_numel)?)?;
        }
    }
    // The temporaries are freed in the all-gather stream's order, after this work.
    Ok(())
}

/// A gathered buffer to copy out of: the buffer, its layout and the world it was gathered over.
pub(crate) type Gathered<'a, C> = (&'a Buf<C>, &'a GroupLayout, usize);

/// A copy of `n` contiguous elements as a [`Copy2d`] (for a batch).
fn contiguous(n: usize) -> Copy2d {
    Copy2d { rows: 1, row_len: n, ..Copy2d::default() }
}

/// Whether the sharded parameters `present` (indices into `layout.params`)
/// fill every rank's chunk of a rank-major buffer, leaving no padding to zero:
/// every parameter present and its rows divisible by the world.
fn fills_chunks(layout: &GroupLayout, present: usize) -> bool {
    present == layout.params.len() && layout.params.iter().all(|l| l.rows % l.world == 0)
}

/// Allocates the group's unsharded parameters in `dtype` on `stream` (one
/// buffer) and fills them: sharded parameters from each rank's chunk of
/// `gathered` (2-D copies that skip the padding, a few per parameter, all in
/// one batch), replicated ones from their master.
pub(crate) fn copy_out<C: CommBackend>(
    stream: &Strm<C>,
    gathered: Option<Gathered<'_, C>>,
    params: &[Param],
    storage: &mut GroupStorage<C>,
    dtype: DType,
) -> Result<()> {
    let full = stream.alloc(dtype, storage.full_numel)?;
    let mut copies = Vec::new();
    for p in params {
        let dst = full.slice(p.full, p.numel)?;
        match (p.layout, gathered) {
            (Some(i), Some((buffer, layout, world))) => {
                let l = &layout.params[i];
                copies.extend(l.chunks_to_full(world, layout.shard_numel).map(|c| (buffer.view(), dst, c)));
            }
            (None, _) => cast_or_copy(stream, storage.master.slice(p.shard.start, p.numel)?, dst)?,
            (Some(_), None) => {
                return Err(FsdpError::InvalidArgument(format!("{}: no all-gather output to copy out of", p.name)))
            }
        }
    }
    stream.copy_2d_batch(&copies)?;
    drop(copies);
    storage.unsharded = Some(full);
    Ok(())
}

/// Reshard-after-forward to a smaller world: cuts chunk `rank` of the
/// post-forward `layout` out of the unsharded parameters into a new zeroed
/// buffer on the compute stream, and records an event after it.
pub(crate) fn post_forward_shard<C: CommBackend>(
    ctx: &CommContext<C>,
    rank: usize,
    layout: &GroupLayout,
    params: &[Param],
    unsharded: &Buf<C>,
    dtype: DType,
) -> Result<(Buf<C>, Ev<C>)> {
    let s = &ctx.streams.compute;
    let buf = s.alloc(dtype, layout.shard_numel)?;
    let mut copies = Vec::with_capacity(params.len());
    for p in params {
        if let Some(i) = p.layout {
            copies.push((unsharded.slice(p.full, p.numel)?, buf.view(), layout.params[i].full_to_chunk(rank, 0)));
        }
    }
    if !fills_chunks(layout, copies.len()) {
        s.fill(buf.view(), Scalar::Float(0.0))?;
    }
    s.copy_2d_batch(&copies)?;
    let e = ctx.events.record(&ctx.device, s)?;
    Ok((buf, e))
}

/// How gradients are reduced: the dtype, the ops on the shard and replicate
/// groups, and a scale applied afterwards.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReducePlan {
    pub(crate) dtype: DType,
    shard_op: ReduceOp,
    replicate_op: ReduceOp,
    post_scale: Option<f64>,
}

impl ReducePlan {
    /// The plan for reducing in `dtype` over `dp`: divide by `divide_factor`
    /// (default: the data-parallel world) with the backend's `PreMulSum` or
    /// `Avg` where it has them, else (or with `force_sum`) a sum and a scale.
    pub(crate) fn new<C: CommBackend>(
        dp: &DataParallel<C>,
        dtype: DType,
        force_sum: bool,
        divide_factor: Option<f64>,
    ) -> Self {
        let caps = dp.shard.capabilities();
        let world = dp.world_size() as f64;
        let (shard_op, replicate_op, post_scale) = match (force_sum, divide_factor) {
            (true, f) => (ReduceOp::Sum, ReduceOp::Sum, Some(1.0 / f.unwrap_or(world))),
            (false, Some(f)) if caps.premul_sum => (ReduceOp::PreMulSum(1.0 / f), ReduceOp::Sum, None),
            (false, Some(f)) => (ReduceOp::Sum, ReduceOp::Sum, Some(1.0 / f)),
            (false, None) if caps.avg => (ReduceOp::Avg, ReduceOp::Avg, None),
            (false, None) => (ReduceOp::Sum, ReduceOp::Sum, Some(1.0 / world)),
        };
        ReducePlan { dtype, shard_op, replicate_op, post_scale }
    }
}

/// What a reduction leaves for the group to keep until the root finalizes backward.
pub(crate) struct Reduced<C: CommBackend> {
    /// Recorded after the sharded gradients were written.
    pub(crate) post_reduce_event: Ev<C>,
    /// Reduce-scatter outputs and replicated flat buffers not kept as the
    /// gradient: freed only at finalize, so their stream-ordered release
    /// follows the streams that use them.
    pub(crate) outputs: Vec<Buf<C>>,
}

/// Reduces one group's unsharded gradients (`grads`: every parameter whole,
/// in the plan's dtype, laid out as the group's unsharded gradients) into
/// the group's f32 sharded gradient.
///
/// Sharded gradients are packed rank-major on the compute stream and
/// reduce-scattered on the reduce-scatter stream; replicated ones are
/// flattened and all-reduced there. With HSDP, the all-reduce stream then
/// all-reduces over the replicate group, adding `partial_reduce` (the
/// reduce-scatter sums of backwards whose all-reduce was deferred) first; if
/// `all_reduce_now` is false the sharded result goes back into
/// `partial_reduce` instead. The compute stream first waits on the previous
/// reduce-scatter, and this one's input is left in `ctx` for the next.
///
/// The group's first gradient since `zero_grad`, reduced in f32 into device
/// memory with no replicated parameter, is the reduce-scatter output itself
/// (FSDP2 does the same); otherwise the output is cast or added into it. A
/// group sharded over one rank with no replicated parameter is not packed or
/// reduce-scattered: its unsharded gradients are that output already.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_gradients<C: CommBackend>(
    ctx: &mut CommContext<C>,
    plan: ReducePlan,
    layout: &GroupLayout,
    params: &[Param],
    storage: &mut GroupStorage<C>,
    grads: Buf<C>,
    partial_reduce: &mut Option<Buf<C>>,
    all_reduce_now: bool,
) -> Result<Reduced<C>> {
    let s = &ctx.streams;
    // The compute stream waits for the previous reduce-scatter, bounding
    // memory to one reduce-scatter input in flight.
    if let Some((_, e)) = ctx.reduce_scatter_state.take() {
        ctx.events.wait_and_give(e, &[&s.compute])?;
    }
    let reduce_dtype = plan.dtype;
    let world = ctx.dp.shard.size();
    let n = layout.shard_numel;
    let sharded: Vec<&Param> = params.iter().filter(|p| p.layout.is_some()).collect();
    let replicated: Vec<&Param> = params.iter().filter(|p| p.layout.is_none()).collect();

    // One rank holding a group of sharded parameters alone: the unsharded
    // gradients are laid out as the packed input would be (no padding, the
    // same order), and the reduce-scatter would copy that input to its
    // output, so they are the output as they are, neither packed nor copied.
    // A pre-multiplied sum is then a scale, the same product in f32 or f64.
    let one_rank = world == 1
        && !sharded.is_empty()
        && replicated.is_empty()
        && n == grads.len()
        && sharded.iter().all(|p| p.layout.map(|i| layout.params[i].offset) == Some(p.full))
        && (!matches!(plan.shard_op, ReduceOp::PreMulSum(_)) || matches!(reduce_dtype, DType::F32 | DType::F64));
    // Pack on the compute stream, where the gradients were produced (FSDP2 does the same).
    let packed = if sharded.is_empty() || one_rank {
        None
    } else {
        let input = s.compute.alloc(reduce_dtype, world * n)?;
        // The padding must read as zeros.
        if !fills_chunks(layout, sharded.len()) {
            s.compute.fill(input.view(), Scalar::Float(0.0))?;
        }
        let mut copies = Vec::with_capacity(sharded.len() * 2);
        for p in &sharded {
            let (l, src) = (&layout.params[p.layout.unwrap_or_default()], grads.slice(p.full, p.numel)?);
            copies.extend(l.full_to_chunks(world, n).map(|c| (src, input.view(), c)));
        }
        s.compute.copy_2d_batch(&copies)?;
        Some(input)
    };
    let replicated_numel: usize = replicated.iter().map(|p| p.numel).sum();
    let flat_replicated = if replicated.is_empty() {
        None
    } else {
        let flat = s.compute.alloc(reduce_dtype, replicated_numel)?;
        let mut copies = Vec::with_capacity(replicated.len());
        let mut off = 0;
        for p in &replicated {
            copies.push((
                grads.slice(p.full, p.numel)?,
                flat.view(),
                Copy2d { dst_offset: off, ..contiguous(p.numel) },
            ));
            off += p.numel;
        }
        s.compute.copy_2d_batch(&copies)?;
        Some(flat)
    };
    // The unsharded gradients are freed in the compute stream's order after
    // the packing, unless they are the output.
    let unpacked = one_rank.then_some(grads);
    ctx.events.order(&ctx.device, &s.compute, &[&s.reduce_scatter])?;

    let mut out = None;
    if let Some(g) = unpacked {
        if let ReduceOp::PreMulSum(f) = plan.shard_op {
            s.reduce_scatter.scale(g.view(), f)?;
        }
        // Counted as the reduce-scatter it stands for (FSDP2 issues one at one rank too).
        ctx.counts.reduce_scatters += 1;
        out = Some(g);
    } else if let Some(input) = &packed {
        let o = s.reduce_scatter.alloc(reduce_dtype, n)?;
        ctx.dp.shard.reduce_scatter(input.view(), o.view(), plan.shard_op, &s.reduce_scatter)?;
        ctx.counts.reduce_scatters += 1;
        out = Some(o);
    }
    if let Some(flat) = &flat_replicated {
        ctx.dp.shard.all_reduce_in_place(flat.view(), plan.shard_op, &s.reduce_scatter)?;
        ctx.counts.all_reduces += 1;
    }
    let rs_done = ctx.events.record(&ctx.device, &s.reduce_scatter)?;

    let mut post = &s.reduce_scatter;
    if let Some(replicate) = &ctx.dp.replicate {
        if let (Some(partial), Some(o)) = (partial_reduce.take(), &out) {
            s.reduce_scatter.accumulate(partial.view(), o.view())?;
        }
        if !all_reduce_now {
            // Keep the sharded partial sums; their all-reduce happens on a
            // later backward. Replicated parameters are all-reduced anyway.
            *partial_reduce = out.take();
        }
        ctx.events.order(&ctx.device, &s.reduce_scatter, &[&s.all_reduce])?;
        if let Some(o) = &out {
            replicate.all_reduce_in_place(o.view(), plan.replicate_op, &s.all_reduce)?;
            ctx.counts.all_reduces += 1;
        }
        if let Some(flat) = &flat_replicated {
            replicate.all_reduce_in_place(flat.view(), plan.replicate_op, &s.all_reduce)?;
            ctx.counts.all_reduces += 1;
        }
        post = &s.all_reduce;
    }
    if let Some(f) = plan.post_scale {
        for buf in out.iter().chain(&flat_replicated) {
            post.scale(buf.view(), f)?;
        }
    }
    let mut outputs: Vec<Buf<C>> = Vec::new();
    let whole = out.is_some() || sharded.is_empty();
    let keep_as_gradient = storage.grad.is_none()
        && storage.offload.is_none()
        && reduce_dtype == DType::F32
        && flat_replicated.is_none()
        && whole;
    match (keep_as_gradient, out) {
        (true, out) => storage.grad = out,
        // Only a deferred all-reduce's partial sums: nothing reaches the gradient yet.
        (false, None) if flat_replicated.is_none() => {}
        (false, out) => {
            // The sharded part (unless its all-reduce is deferred), then the replicated part.
            let parts = out.iter().map(|o| (o, 0)).chain(flat_replicated.iter().map(|f| (f, n)));
            let parts: Vec<(&Buf<C>, usize)> = parts.collect();
            let grad = match storage.grad.take() {
                Some(g) => {
                    for (src, at) in &parts {
                        offload::accumulate(post, src.view(), g.slice(*at, src.len())?)?;
                    }
                    g
                }
                None => {
                    let g = match storage.offload {
                        // Host memory comes zeroed.
                        Some(o) => post.device().alloc_host(DType::F32, storage.master.len(), o.pin_memory)?,
                        None => {
                            let g = post.alloc(DType::F32, storage.master.len())?;
                            if !whole {
                                post.fill(g.view(), Scalar::Float(0.0))?;
                            }
                            g
                        }
                    };
                    for (src, at) in &parts {
                        cast_or_copy(post, src.view(), g.slice(*at, src.len())?)?;
                    }
                    g
                }
            };
            storage.grad = Some(grad);
            outputs.extend(out);
        }
    }
    let post_reduce_event = ctx.events.record(&ctx.device, post)?;
    outputs.extend(flat_replicated);
    ctx.reduce_scatter_state = packed.map(|b| (b, rs_done));
    Ok(Reduced { post_reduce_event, outputs })
}

/// One parameter whole, all-gathered from its shards over `comm` (every rank
/// of `comm` must call it for the same parameter, in the same order), handed
/// to `sink` in row-major pieces of at most `piece` elements. A rank holds
/// one gathered copy of this parameter (its padding included) and one piece
/// at a time; nothing else of the model is unsharded. `layout` is `None`
/// for a replicated parameter (`master` is then the whole of it).
pub(crate) fn gather_param_pieces<C: CommBackend>(
    s: &Strm<C>,
    comm: &Communicator<C>,
    layout: Option<&ParamLayout>,
    master: View<'_, C::B>,
    piece: usize,
    sink: &mut dyn FnMut(&[f32]) -> Result<()>,
) -> Result<()> {
    let piece = piece.max(1);
    let Some(l) = layout else {
        let mut at = 0;
        while at < master.len() {
            let n = piece.min(master.len() - at);
            sink(&s.read_vec::<f32>(master.slice(at, n)?)?)?;
            at += n;
        }
        return Ok(());
    };
    let sn = l.shard_numel;
    let gathered = s.alloc(DType::F32, comm.size() * sn)?;
    s.copy(master, gathered.slice(comm.rank() * sn, sn)?)?;
    comm.all_gather_in_place(gathered.view(), s)?;
    // Row `o` of the full `[outer, rows, inner]` is each rank's real rows of
    // its own row `o`, in rank order; pieces collect reads until full.
    let mut out: Vec<f32> = Vec::with_capacity(piece.min(l.numel()));
    for o in 0..l.outer {
        for j in 0..comm.size() {
            let mut at = j * sn + o * l.shard_rows * l.inner;
            let mut left = l.real_rows(j) * l.inner;
            while left > 0 {
                let n = left.min(piece - out.len());
                out.extend(s.read_vec::<f32>(gathered.slice(at, n)?)?);
                (at, left) = (at + n, left - n);
                if out.len() == piece {
                    sink(&out)?;
                    out.clear();
                }
            }
        }
    }
    if !out.is_empty() {
        sink(&out)?;
    }
    Ok(())
}
