//! The batched copies and fills of the GPU devices, planned once for both:
//! a [`Stream::copy_2d_batch`](crate::Stream::copy_2d_batch) or
//! [`Stream::fill_batch`](crate::Stream::fill_batch) becomes as few driver
//! calls as its pieces allow, instead of one per piece.
//!
//! The pieces are turned into byte ranges; a strided piece whose blocks
//! touch end to end becomes one contiguous piece, and contiguous pieces that
//! continue one another (a group's parameters laid out back to back) merge.
//! What is left goes to the batch kernels of [`crate::gpu_kernels`]
//! (`chorus_copy_batch`, `chorus_fill_batch`), [`BATCH`] pieces per launch,
//! passed by value as the launch's one parameter, so no descriptor array
//! lives in device memory. A launch runs its pieces concurrently, while the
//! trait runs a batch's pieces in order: a piece that reads or writes bytes
//! an earlier piece of the same launch writes (or writes what it reads)
//! starts a new launch, so the result is the in-order one. A launch of a
//! single contiguous piece is a plain copy or memset instead, which the
//! device does with its copy engines or its own memset.

use crate::gpu_kernels::BLOCK;
use crate::Copy2d;

/// Pieces per launch of `chorus_copy_batch` and `chorus_fill_batch`
/// (`CHORUS_BATCH` in the kernel source): the parameter block of the copy
/// batch is 8 + 64 · 56 = 3592 bytes, under the 4 KiB that `cuLaunchKernel`
/// and `hipModuleLaunchKernel` take on every architecture.
pub const BATCH: usize = 64;

/// Blocks per piece of a batch launch at most (`gridDim.x`; the grid-stride
/// loops cover longer pieces): 1024 blocks of [`BLOCK`] threads fill an
/// H100's 132 multiprocessors.
pub const MAX_BATCH_BLOCKS: u64 = 1024;

/// Words of the copy kernel's parameter block: the count, then 7 per piece.
const COPY_WORDS: usize = 1 + 7 * BATCH;
/// Words of the fill kernel's parameter block: the count, then 4 per piece.
const FILL_WORDS: usize = 1 + 4 * BATCH;

/// A byte range `[start, end)` of device addresses.
type Extent = (u64, u64);

fn intersects(a: Extent, b: Extent) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// One strided copy in bytes: `rows` blocks of `row_bytes`, block `i` from
/// `src + i·src_pitch` to `dst + i·dst_pitch`. A contiguous copy has one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyPiece {
    /// Address of the first byte read.
    pub src: u64,
    /// Address of the first byte written.
    pub dst: u64,
    /// Number of blocks (1 when contiguous).
    pub rows: u64,
    /// Bytes per block.
    pub row_bytes: u64,
    /// Bytes between the starts of consecutive source blocks.
    pub src_pitch: u64,
    /// Bytes between the starts of consecutive destination blocks.
    pub dst_pitch: u64,
}

impl CopyPiece {
    /// The bytes of `layout` (elements of `elem` bytes) between views whose
    /// first elements are at `src` and `dst`; `None` when it copies nothing.
    /// Blocks that touch end to end on both sides become one block.
    pub fn new(src: u64, dst: u64, layout: &Copy2d, elem: usize) -> Option<CopyPiece> {
        let e = elem as u64;
        let (rows, row_bytes) = (layout.rows as u64, layout.row_len as u64 * e);
        if rows == 0 || row_bytes == 0 {
            return None;
        }
        let (src_pitch, dst_pitch) = (layout.src_stride as u64 * e, layout.dst_stride as u64 * e);
        let (src, dst) = (src + layout.src_offset as u64 * e, dst + layout.dst_offset as u64 * e);
        if rows == 1 || (src_pitch == row_bytes && dst_pitch == row_bytes) {
            let bytes = rows * row_bytes;
            return Some(CopyPiece { src, dst, rows: 1, row_bytes: bytes, src_pitch: bytes, dst_pitch: bytes });
        }
        Some(CopyPiece { src, dst, rows, row_bytes, src_pitch, dst_pitch })
    }

    fn src_extent(&self) -> Extent {
        (self.src, self.src + (self.rows - 1) * self.src_pitch + self.row_bytes)
    }

    fn dst_extent(&self) -> Extent {
        (self.dst, self.dst + (self.rows - 1) * self.dst_pitch + self.row_bytes)
    }

    /// The widest unit (16, 8, 4, 2 or 1 bytes) dividing every address and length the kernel computes.
    fn unit(&self) -> u64 {
        let mut bits = self.src | self.dst | self.row_bytes;
        if self.rows > 1 {
            bits |= self.src_pitch | self.dst_pitch;
        }
        1 << bits.trailing_zeros().min(4)
    }

    /// This piece as pieces a launch may run at once: itself, or, when its
    /// destination blocks overlap one another (a pitch below the block, which
    /// the trait allows: later blocks win), each block alone, in order.
    fn in_order(self) -> Vec<CopyPiece> {
        if self.rows == 1 || self.dst_pitch >= self.row_bytes {
            return vec![self];
        }
        let block = |i: u64| CopyPiece {
            src: self.src + i * self.src_pitch,
            dst: self.dst + i * self.dst_pitch,
            rows: 1,
            row_bytes: self.row_bytes,
            src_pitch: self.row_bytes,
            dst_pitch: self.row_bytes,
        };
        (0..self.rows).map(block).collect()
    }

    /// `next` continues this contiguous piece on both sides.
    fn continued_by(&self, next: &CopyPiece) -> bool {
        self.rows == 1
            && next.rows == 1
            && self.src + self.row_bytes == next.src
            && self.dst + self.row_bytes == next.dst
    }
}

/// One fill in bytes: `n` elements of `width` bytes (1, 2, 4 or 8), each
/// `pattern`'s low `width` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillPiece {
    /// Address of the first element.
    pub dst: u64,
    /// Number of elements.
    pub n: u64,
    /// Bytes per element.
    pub width: u64,
    /// The element's bytes, little-endian.
    pub pattern: u64,
}

impl FillPiece {
    /// A fill of `n` elements at `dst` with `pattern` (the element's 1, 2, 4
    /// or 8 bytes); `None` when it fills nothing.
    pub fn new(dst: u64, n: usize, pattern: &[u8]) -> Option<FillPiece> {
        if n == 0 || pattern.is_empty() || pattern.len() > 8 {
            return None;
        }
        let mut word = [0u8; 8];
        word[..pattern.len()].copy_from_slice(pattern);
        Some(FillPiece { dst, n: n as u64, width: pattern.len() as u64, pattern: u64::from_le_bytes(word) })
    }

    fn extent(&self) -> Extent {
        (self.dst, self.dst + self.n * self.width)
    }
}

/// What a planned batch enqueues, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step<P> {
    /// One piece alone: a plain copy (contiguous) or fill, the device's own call.
    Single(P),
    /// A launch of the batch kernel: its parameter block (the piece count,
    /// then the pieces, padded to the kernel's whole parameter) and its grid
    /// (`gridDim.x` blocks per piece, `gridDim.y` the piece count).
    Launch {
        /// The kernel's parameter, word by word.
        block: Vec<u64>,
        /// `(gridDim.x, gridDim.y)`.
        grid: (u32, u32),
    },
}

/// Groups pieces into launches: at most [`BATCH`] each, and none holding a
/// piece whose bytes meet what an earlier piece of the launch writes
/// (`conflicts(new, earlier)`), so running a launch's pieces at once gives
/// the in-order result.
fn group<P: Copy>(pieces: Vec<P>, conflicts: impl Fn(&P, &P) -> bool) -> Vec<Vec<P>> {
    let mut launches: Vec<Vec<P>> = Vec::new();
    let mut current: Vec<P> = Vec::new();
    for p in pieces {
        if current.len() == BATCH || current.iter().any(|earlier| conflicts(&p, earlier)) {
            launches.push(std::mem::take(&mut current));
        }
        current.push(p);
    }
    if !current.is_empty() {
        launches.push(current);
    }
    launches
}

/// Blocks per piece for pieces of at most `units` units each.
fn grid_x(units: u64) -> u32 {
    units.div_ceil(BLOCK as u64).clamp(1, MAX_BATCH_BLOCKS) as u32
}

/// The steps of a copy batch: contiguous continuations merged, then
/// launches of `chorus_copy_batch` (a launch of one contiguous piece is a
/// plain copy).
pub fn plan_copies(pieces: impl IntoIterator<Item = CopyPiece>) -> Vec<Step<CopyPiece>> {
    let mut merged: Vec<CopyPiece> = Vec::new();
    for p in pieces.into_iter().flat_map(CopyPiece::in_order) {
        match merged.last_mut() {
            Some(last) if last.continued_by(&p) => {
                last.row_bytes += p.row_bytes;
                (last.src_pitch, last.dst_pitch) = (last.row_bytes, last.row_bytes);
            }
            _ => merged.push(p),
        }
    }
    let conflicts = |new: &CopyPiece, earlier: &CopyPiece| {
        let written = earlier.dst_extent();
        intersects(new.src_extent(), written)
            || intersects(new.dst_extent(), written)
            || intersects(new.dst_extent(), earlier.src_extent())
    };
    group(merged, conflicts)
        .into_iter()
        .map(|launch| match launch.as_slice() {
            [one] if one.rows == 1 => Step::Single(*one),
            _ => {
                let mut block = vec![0u64; COPY_WORDS];
                block[0] = launch.len() as u64;
                let mut units = 0;
                for (i, p) in launch.iter().enumerate() {
                    let unit = p.unit();
                    let row_units = p.row_bytes / unit;
                    units = units.max(p.rows * row_units);
                    block[1 + 7 * i..8 + 7 * i].copy_from_slice(&[
                        p.src,
                        p.dst,
                        p.rows,
                        row_units,
                        p.src_pitch,
                        p.dst_pitch,
                        unit,
                    ]);
                }
                Step::Launch { block, grid: (grid_x(units), launch.len() as u32) }
            }
        })
        .collect()
}

/// The steps of a fill batch: contiguous continuations with the same
/// pattern merged, then launches of `chorus_fill_batch` (a launch of one
/// piece is the device's own fill); only fills of different bytes that
/// overlap keep their order by going to different launches.
pub fn plan_fills(pieces: impl IntoIterator<Item = FillPiece>) -> Vec<Step<FillPiece>> {
    let mut merged: Vec<FillPiece> = Vec::new();
    for p in pieces {
        match merged.last_mut() {
            Some(last) if last.width == p.width && last.pattern == p.pattern && last.extent().1 == p.dst => {
                last.n += p.n;
            }
            _ => merged.push(p),
        }
    }
    // Overlapping fills with the same bytes give the same result in any order.
    let conflicts = |new: &FillPiece, earlier: &FillPiece| {
        (new.width, new.pattern) != (earlier.width, earlier.pattern) && intersects(new.extent(), earlier.extent())
    };
    group(merged, conflicts)
        .into_iter()
        .map(|launch| match launch.as_slice() {
            [one] => Step::Single(*one),
            _ => {
                let mut block = vec![0u64; FILL_WORDS];
                block[0] = launch.len() as u64;
                for (i, p) in launch.iter().enumerate() {
                    block[1 + 4 * i..5 + 4 * i].copy_from_slice(&[p.dst, p.n, p.width, p.pattern]);
                }
                let n = launch.iter().map(|p| p.n).max().unwrap_or(1);
                Step::Launch { block, grid: (grid_x(n), launch.len() as u32) }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contiguous(src: u64, dst: u64, bytes: u64) -> CopyPiece {
        CopyPiece { src, dst, rows: 1, row_bytes: bytes, src_pitch: bytes, dst_pitch: bytes }
    }

    #[test]
    fn back_to_back_pieces_merge_into_one_plain_copy() {
        // A group's parameters laid out alike on both sides: one copy.
        let steps = plan_copies([contiguous(0, 1000, 16), contiguous(16, 1016, 8), contiguous(24, 1024, 40)]);
        assert_eq!(steps, vec![Step::Single(contiguous(0, 1000, 64))]);
        // A gap on one side keeps them apart: one launch of two pieces.
        let steps = plan_copies([contiguous(0, 1024, 16), contiguous(16, 1056, 8)]);
        match steps.as_slice() {
            [Step::Launch { block, grid }] => {
                assert_eq!(block.len(), COPY_WORDS);
                assert_eq!((block[0], grid.1), (2, 2));
                // src, dst, rows, row units, pitches, unit: 16-byte units where everything is 16-aligned.
                assert_eq!(&block[1..8], &[0, 1024, 1, 1, 16, 16, 16]);
                assert_eq!(&block[8..15], &[16, 1056, 1, 1, 8, 8, 8]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn strided_blocks_that_touch_become_contiguous() {
        let layout = Copy2d { rows: 3, row_len: 4, src_offset: 1, src_stride: 4, dst_offset: 2, dst_stride: 4 };
        let p = CopyPiece::new(100, 200, &layout, 2).unwrap();
        assert_eq!(p, contiguous(102, 204, 24));
        let layout = Copy2d { rows: 3, row_len: 4, src_offset: 0, src_stride: 6, dst_offset: 0, dst_stride: 4 };
        let p = CopyPiece::new(0, 64, &layout, 4).unwrap();
        assert_eq!((p.rows, p.row_bytes, p.src_pitch, p.dst_pitch, p.unit()), (3, 16, 24, 16, 8));
        assert_eq!(CopyPiece::new(0, 0, &Copy2d { rows: 2, ..Copy2d::default() }, 4), None);
    }

    #[test]
    fn a_piece_that_meets_an_earlier_write_starts_a_new_launch() {
        // The second reads what the first writes, the third writes what the second reads.
        let steps = plan_copies([contiguous(0, 64, 8), contiguous(64, 128, 8), contiguous(200, 64, 8)]);
        assert_eq!(steps.len(), 3, "{steps:?}");
        assert!(steps.iter().all(|s| matches!(s, Step::Single(_))));
        // Independent pieces share launches of at most BATCH.
        let many: Vec<CopyPiece> = (0..BATCH as u64 + 1).map(|i| contiguous(i * 32, 10_000 + i * 64, 16)).collect();
        let steps = plan_copies(many);
        assert_eq!(steps.len(), 2);
        assert!(matches!(&steps[0], Step::Launch { grid: (1, 64), .. }));
        assert!(matches!(&steps[1], Step::Single(_)));
    }

    #[test]
    fn destination_blocks_that_overlap_go_one_by_one_in_order() {
        // Three blocks written to the same place: the last must win.
        let layout = Copy2d { rows: 3, row_len: 4, src_offset: 0, src_stride: 4, dst_offset: 0, dst_stride: 0 };
        let steps = plan_copies(CopyPiece::new(0, 1024, &layout, 4));
        let blocks: Vec<CopyPiece> = (0..3).map(|i| contiguous(16 * i, 1024, 16)).collect();
        assert_eq!(steps, blocks.into_iter().map(Step::Single).collect::<Vec<_>>());
        // Blocks that only touch stay one piece.
        let layout = Copy2d { dst_stride: 4, ..layout };
        assert_eq!(plan_copies(CopyPiece::new(0, 1024, &layout, 4)), vec![Step::Single(contiguous(0, 1024, 48))]);
    }

    #[test]
    fn fills_merge_by_pattern_and_split_on_overlap() {
        let f = |dst, n, p: &[u8]| FillPiece::new(dst, n, p).unwrap();
        let steps = plan_fills([f(0, 4, &[0, 0, 0, 0]), f(16, 2, &[0, 0, 0, 0])]);
        assert_eq!(steps, vec![Step::Single(f(0, 6, &[0, 0, 0, 0]))]);
        let steps = plan_fills([f(0, 4, &[1, 0]), f(8, 4, &[2, 0]), f(4, 2, &[3, 0]), f(2, 1, &[1, 0])]);
        // The third overlaps the first with other bytes; the fourth overlaps the first with its own.
        assert_eq!(steps.len(), 2, "{steps:?}");
        match &steps[0] {
            Step::Launch { block, grid } => {
                assert_eq!(*grid, (1, 2));
                assert_eq!(&block[..9], &[2, 0, 4, 2, 1, 8, 4, 2, 2]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(FillPiece::new(0, 0, &[1]), None);
    }
}
