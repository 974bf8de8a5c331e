//! Where each element of a parameter lives when it is sharded: pure index math.
//!
//! A parameter of shape `[..., rows, ...]` sharded on dimension `dim` over
//! `world` ranks is seen as `[outer, rows, inner]` (`outer` the product of
//! the dimensions before `dim`, `inner` of those after). Rows are padded to
//! `world · shard_rows` with `shard_rows = ceil(rows / world)`; rank `r` holds
//! rows `r·shard_rows ..` of them, of which `real_rows(r)` are real (trailing
//! ranks may hold fewer, or none). A shard is stored contiguously as
//! `[outer, shard_rows, inner]`, padding zero.
//!
//! A group's shards are concatenated (the all-gather input); the all-gather
//! output and the reduce-scatter input are `world` such concatenations in
//! rank order.

use chorus_devices::Copy2d;

use crate::FsdpError;

/// One parameter's sharding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    /// The unsharded shape.
    pub shape: Vec<usize>,
    /// The (non-negative) dimension sharded on.
    pub dim: usize,
    /// Product of the dimensions before `dim`.
    pub outer: usize,
    /// Size of `dim`.
    pub rows: usize,
    /// Product of the dimensions after `dim`.
    pub inner: usize,
    /// Ranks sharded over.
    pub world: usize,
    /// Padded rows per rank: `ceil(rows / world)`.
    pub shard_rows: usize,
    /// Elements per rank's shard, padding included.
    pub shard_numel: usize,
    /// Offset of this parameter's shard within its group's concatenated shard.
    pub offset: usize,
}

/// Resolves a possibly negative dimension against `ndim`.
pub fn normalize_dim(dim: isize, ndim: usize) -> Result<usize, FsdpError> {
    let n = ndim as isize;
    let d = if dim < 0 { dim + n } else { dim };
    if ndim == 0 || d < 0 || d >= n {
        return Err(FsdpError::InvalidArgument(format!("shard dim {dim} is out of range for a {ndim}-d parameter")));
    }
    Ok(d as usize)
}

impl ParamLayout {
    /// The layout of `shape` sharded on `dim` over `world` ranks, placed at `offset` in its group.
    pub fn new(shape: &[usize], dim: usize, world: usize, offset: usize) -> Result<ParamLayout, FsdpError> {
        if world == 0 || dim >= shape.len() {
            return Err(FsdpError::InvalidArgument(format!("cannot shard {shape:?} on dim {dim} over {world} ranks")));
        }
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let rows = shape[dim];
        let shard_rows = rows.div_ceil(world);
        Ok(ParamLayout {
            shape: shape.to_vec(),
            dim,
            outer,
            rows,
            inner,
            world,
            shard_rows,
            shard_numel: outer * shard_rows * inner,
            offset,
        })
    }

    /// Number of elements of the unsharded parameter.
    pub fn numel(&self) -> usize {
        self.outer * self.rows * self.inner
    }

    /// Real (unpadded) rows held by `rank`.
    pub fn real_rows(&self, rank: usize) -> usize {
        self.rows.saturating_sub(rank * self.shard_rows).min(self.shard_rows)
    }

    /// Real elements held by `rank`.
    pub fn real_numel(&self, rank: usize) -> usize {
        self.outer * self.real_rows(rank) * self.inner
    }

    /// Copies rank `rank`'s rows from a group's rank-major buffer (chunk
    /// `rank` starts at `rank · group_shard`) into the unsharded parameter.
    pub fn chunk_to_full(&self, rank: usize, group_shard: usize) -> Copy2d {
        Copy2d {
            rows: self.outer,
            row_len: self.real_rows(rank) * self.inner,
            src_offset: rank * group_shard + self.offset,
            src_stride: self.shard_rows * self.inner,
            dst_offset: rank * self.shard_rows * self.inner,
            dst_stride: self.rows * self.inner,
        }
    }

    /// The inverse: rank `rank`'s rows of the unsharded parameter into chunk
    /// `rank` of a rank-major buffer (`base` is the chunk's start).
    pub fn full_to_chunk(&self, rank: usize, base: usize) -> Copy2d {
        Copy2d {
            rows: self.outer,
            row_len: self.real_rows(rank) * self.inner,
            src_offset: rank * self.shard_rows * self.inner,
            src_stride: self.rows * self.inner,
            dst_offset: base + self.offset,
            dst_stride: self.shard_rows * self.inner,
        }
    }

    /// [`ParamLayout::chunk_to_full`] for ranks `0..world`, in as few copies
    /// as the layout allows: sharded on its outermost dim (`outer` 1) the
    /// ranks that hold a whole chunk are one 2-D copy (a block per rank),
    /// the one with a shorter chunk a second, the ranks with no rows none.
    /// Otherwise one copy per rank. A group's copy-out at 1,024 ranks is
    /// then a few copies per parameter, not a thousand.
    pub fn chunks_to_full(&self, world: usize, group_shard: usize) -> impl Iterator<Item = Copy2d> + '_ {
        self.per_chunk(
            world,
            move |r| self.chunk_to_full(r, group_shard),
            move |full| Copy2d {
                rows: full,
                row_len: self.shard_rows * self.inner,
                src_offset: self.offset,
                src_stride: group_shard,
                dst_offset: 0,
                dst_stride: self.shard_rows * self.inner,
            },
        )
    }

    /// [`ParamLayout::full_to_chunk`] for ranks `0..world` into a rank-major
    /// buffer whose chunk `r` starts at `r · group_shard`, merged as
    /// [`ParamLayout::chunks_to_full`] merges.
    pub fn full_to_chunks(&self, world: usize, group_shard: usize) -> impl Iterator<Item = Copy2d> + '_ {
        self.per_chunk(
            world,
            move |r| self.full_to_chunk(r, r * group_shard),
            move |full| Copy2d {
                rows: full,
                row_len: self.shard_rows * self.inner,
                src_offset: 0,
                src_stride: self.shard_rows * self.inner,
                dst_offset: self.offset,
                dst_stride: group_shard,
            },
        )
    }

    /// The copies of ranks `0..world`, without allocating (FSDP builds them
    /// per parameter per gather): `merged(k)` for the first `k` ranks when
    /// they hold whole chunks and the dim is outermost, `one(r)` for each
    /// other rank that holds rows.
    fn per_chunk<'a>(
        &'a self,
        world: usize,
        one: impl Fn(usize) -> Copy2d + 'a,
        merged: impl Fn(usize) -> Copy2d,
    ) -> impl Iterator<Item = Copy2d> + 'a {
        let whole = match self.outer == 1 && self.shard_rows > 0 {
            true => (self.rows / self.shard_rows).min(world),
            false => 0,
        };
        let merged = (whole > 0).then(|| merged(whole));
        merged.into_iter().chain((whole..world).filter(move |&r| self.real_rows(r) > 0).map(one))
    }

    /// Rank `rank`'s shard (padded, zeros in the padding) cut from the full
    /// tensor on the host.
    pub fn shard_of(&self, full: &[f32], rank: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.shard_numel];
        let len = self.real_rows(rank) * self.inner;
        if len == 0 {
            return out;
        }
        for o in 0..self.outer {
            let src = o * self.rows * self.inner + rank * self.shard_rows * self.inner;
            let dst = o * self.shard_rows * self.inner;
            out[dst..dst + len].copy_from_slice(&full[src..src + len]);
        }
        out
    }
}

/// The layouts of a group's sharded parameters over one world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupLayout {
    /// Ranks sharded over.
    pub world: usize,
    /// One per sharded parameter, in group order.
    pub params: Vec<ParamLayout>,
    /// Elements of one rank's concatenated shards.
    pub shard_numel: usize,
}

impl GroupLayout {
    /// Lays out `params` (shape and normalized dim) over `world` ranks.
    pub fn new(params: &[(Vec<usize>, usize)], world: usize) -> Result<GroupLayout, FsdpError> {
        let mut offset = 0;
        let mut layouts = Vec::with_capacity(params.len());
        for (shape, dim) in params {
            let l = ParamLayout::new(shape, *dim, world, offset)?;
            offset += l.shard_numel;
            layouts.push(l);
        }
        Ok(GroupLayout { world, params: layouts, shard_numel: offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies a Copy2d on the host.
    fn apply(c: Copy2d, src: &[f32], dst: &mut [f32]) {
        for i in (0..c.rows).filter(|_| c.row_len > 0) {
            let s = c.src_offset + i * c.src_stride;
            let d = c.dst_offset + i * c.dst_stride;
            dst[d..d + c.row_len].copy_from_slice(&src[s..s + c.row_len]);
        }
    }

    #[test]
    fn uneven_rows_pad_and_trailing_ranks_hold_fewer() {
        let l = ParamLayout::new(&[5, 3], 0, 4, 0).unwrap();
        assert_eq!((l.shard_rows, l.shard_numel), (2, 6));
        assert_eq!((0..4).map(|r| l.real_rows(r)).collect::<Vec<_>>(), vec![2, 2, 1, 0]);
        let l = ParamLayout::new(&[2, 3], 0, 8, 0).unwrap();
        assert_eq!((0..8).map(|r| l.real_rows(r)).sum::<usize>(), 2);
    }

    #[test]
    fn shards_reassemble_on_any_dim() {
        for (shape, dim, world) in [(vec![5, 3], 0, 4), (vec![4, 7], 1, 3), (vec![2, 3, 5], 1, 2), (vec![3, 2], 1, 8)] {
            let l = ParamLayout::new(&shape, dim, world, 0).unwrap();
            let full: Vec<f32> = (0..l.numel()).map(|i| i as f32 + 1.0).collect();
            // all-gather of the shards, then copy-out
            let gathered: Vec<f32> = (0..world).flat_map(|r| l.shard_of(&full, r)).collect();
            let mut out = vec![0.0; l.numel()];
            for r in 0..world {
                apply(l.chunk_to_full(r, l.shard_numel), &gathered, &mut out);
            }
            assert_eq!(out, full, "{shape:?} dim {dim} world {world}");
            // packing the full tensor rank-major gives the shards back
            let mut packed = vec![0.0; world * l.shard_numel];
            for r in 0..world {
                apply(l.full_to_chunk(r, r * l.shard_numel), &full, &mut packed);
            }
            assert_eq!(packed, gathered);
        }
    }

    /// The merged copies move exactly what the per-rank copies move, on
    /// every dim, with padding, empty ranks, and a parameter that is not
    /// first in its group (so the offset and the group stride matter).
    #[test]
    fn merged_copies_equal_the_per_rank_copies() {
        let cases = [
            (vec![5, 3], 0, 4),
            (vec![8, 3], 0, 4),
            (vec![2, 3], 0, 8),
            (vec![7], 0, 3),
            (vec![1, 4], 0, 1),
            (vec![4, 7], 1, 3),
            (vec![2, 3, 5], 1, 2),
            (vec![9, 2], 0, 16),
        ];
        for (shape, dim, world) in cases {
            let group = GroupLayout::new(&[(vec![3, 1], 0), (shape.clone(), dim)], world).unwrap();
            let l = &group.params[1];
            let n = group.shard_numel;
            let full: Vec<f32> = (0..l.numel()).map(|i| i as f32 + 1.0).collect();
            let gathered: Vec<f32> = (0..world * n).map(|i| -(i as f32) - 1.0).collect();
            let (mut by_rank, mut merged) = (vec![0.0; l.numel()], vec![0.0; l.numel()]);
            (0..world).for_each(|r| apply(l.chunk_to_full(r, n), &gathered, &mut by_rank));
            l.chunks_to_full(world, n).for_each(|c| apply(c, &gathered, &mut merged));
            assert_eq!(merged, by_rank, "copy-out {shape:?} dim {dim} world {world}");
            let (mut by_rank, mut merged) = (vec![0.0; world * n], vec![0.0; world * n]);
            (0..world).for_each(|r| apply(l.full_to_chunk(r, r * n), &full, &mut by_rank));
            l.full_to_chunks(world, n).for_each(|c| apply(c, &full, &mut merged));
            assert_eq!(merged, by_rank, "packing {shape:?} dim {dim} world {world}");
            let most = if l.outer == 1 { 2 } else { world };
            assert!(l.chunks_to_full(world, n).count() <= most, "{shape:?} dim {dim} world {world}");
        }
    }

    #[test]
    fn negative_dims_resolve() {
        assert_eq!(normalize_dim(-1, 2).unwrap(), 1);
        assert!(normalize_dim(2, 2).is_err());
        assert!(normalize_dim(-3, 2).is_err());
    }
}
