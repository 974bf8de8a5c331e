//! Which box of which tensor a rank holds, and copying the part two boxes
//! share: how the shards of one world size map onto those of another.

use chorus_fsdp::layout::ParamLayout;

/// A box of a tensor: where it starts in the full tensor and its extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Region {
    pub(super) offsets: Vec<usize>,
    pub(super) shape: Vec<usize>,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub(super) fn whole(shape: &[usize]) -> Region {
        Region { offsets: vec![0; shape.len()], shape: shape.to_vec() }
    }

    pub(super) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The box this rank holds of a parameter with `layout` (rank `rank`),
    /// or the whole tensor when it is replicated.
    pub(super) fn of(shape: &[usize], layout: Option<&ParamLayout>, rank: usize) -> Region {
        let mut region = Region::whole(shape);
        if let Some(l) = layout {
            region.offsets[l.dim] = (rank * l.shard_rows).min(l.rows);
            region.shape[l.dim] = l.real_rows(rank);
        }
        region
    }

    pub(super) fn intersect(&self, other: &Region) -> Option<Region> {
        if self.offsets.len() != other.offsets.len() {
            return None;
        }
        let mut offsets = Vec::with_capacity(self.offsets.len());
        let mut shape = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = (self.offsets[d] + self.shape[d]).min(other.offsets[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            shape.push(hi - lo);
        }
        Some(Region { offsets, shape })
    }
}

/// Row-major strides of `shape`.
pub(super) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Copies the elements of `part` (a box inside both) from `src` (the
/// elements of box `src_box`, row-major) into `dst` (the elements of box
/// `dst_box`, row-major with strides `dst_strides`), one run along the last
/// dimension at a time. Returns the elements copied.
pub(super) fn copy_box(
    part: &Region,
    src_box: &Region,
    src: &[f32],
    dst_box: &Region,
    dst_strides: &[usize],
    dst: &mut [f32],
) -> usize {
    let nd = part.shape.len();
    if nd == 0 {
        if let (Some(s), Some(d)) = (src.first(), dst.first_mut()) {
            *d = *s;
            return 1;
        }
        return 0;
    }
    let src_strides = strides(&src_box.shape);
    let run = part.shape[nd - 1];
    let outer: usize = part.shape[..nd - 1].iter().product();
    let mut idx = vec![0usize; nd - 1];
    let mut copied = 0;
    for _ in 0..outer {
        let (mut s_off, mut d_off) = (0, 0);
        for d in 0..nd {
            let i = if d < nd - 1 { idx[d] } else { 0 } + part.offsets[d];
            s_off += (i - src_box.offsets[d]) * src_strides[d];
            d_off += (i - dst_box.offsets[d]) * dst_strides[d];
        }
        if let (Some(s), Some(t)) = (src.get(s_off..s_off + run), dst.get_mut(d_off..d_off + run)) {
            t.copy_from_slice(s);
            copied += run;
        }
        for d in (0..nd - 1).rev() {
            idx[d] += 1;
            if idx[d] < part.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    copied
}

/// Cuts the unpadded box of `layout`'s rank `rank` out of its padded shard
/// (`[outer, shard_rows, inner]`).
pub(super) fn unpad(shard: &[f32], layout: &ParamLayout, rank: usize) -> Vec<f32> {
    let len = layout.real_rows(rank) * layout.inner;
    let mut out = Vec::with_capacity(layout.outer * len);
    for o in 0..layout.outer {
        let start = o * layout.shard_rows * layout.inner;
        out.extend_from_slice(&shard[start..start + len]);
    }
    out
}

/// The padded-shard strides of a box (the padded shard is the box with
/// `shard_rows` instead of its real rows on the sharded dim).
pub(super) fn padded_strides(region: &Region, layout: Option<&ParamLayout>) -> Vec<usize> {
    let mut shape = region.shape.clone();
    if let Some(l) = layout {
        shape[l.dim] = l.shard_rows;
    }
    strides(&shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host reference: element (idx) of the full tensor.
    fn full(shape: &[usize]) -> Vec<f32> {
        (0..shape.iter().product::<usize>()).map(|i| i as f32).collect()
    }

    #[test]
    fn boxes_of_any_world_reassemble_the_tensor() {
        for (shape, dim) in [(vec![7usize, 3], 0usize), (vec![4, 5, 3], 1), (vec![5], 0), (vec![3, 10], 1)] {
            let values = full(&shape);
            for saved_world in 1..=4 {
                let saved = ParamLayout::new(&shape, dim, saved_world, 0).unwrap();
                let boxes: Vec<(Region, Vec<f32>)> = (0..saved_world)
                    .map(|r| (Region::of(&shape, Some(&saved), r), unpad(&saved.shard_of(&values, r), &saved, r)))
                    .filter(|(b, _)| b.numel() > 0)
                    .collect();
                for new_world in 1..=4 {
                    let new = ParamLayout::new(&shape, dim, new_world, 0).unwrap();
                    for r in 0..new_world {
                        let want = Region::of(&shape, Some(&new), r);
                        let strides = padded_strides(&want, Some(&new));
                        let mut out = vec![0.0; new.shard_numel];
                        let mut covered = 0;
                        for (b, data) in &boxes {
                            if let Some(part) = b.intersect(&want) {
                                covered += copy_box(&part, b, data, &want, &strides, &mut out);
                            }
                        }
                        assert_eq!(covered, want.numel());
                        // The independent path: FSDP's own shard_of on the full tensor.
                        assert_eq!(
                            out,
                            new.shard_of(&values, r),
                            "{shape:?} dim {dim}: {saved_world} -> {new_world} rank {r}"
                        );
                    }
                }
            }
        }
    }
}
