//! The memory a transfer or a reduction touches: [`Region`]s (bounds-checked
//! views that keep their memory alive) of user buffers, scratch buffers
//! ([`Scratch`]) and owned bytes, and the element-wise operations the
//! algorithms run on them between transfers.
//!
//! Who touches a region's bytes when is ordered by the completions: a
//! request reads or writes its region from its start until it ends (see
//! `engine.rs`), and the algorithms run the operations below on bytes only
//! once every request on them has ended (each step's requests are waited
//! for before its result is combined). Everything else is checked where it
//! is used: a region is in bounds of its memory when it is made, and an
//! operation checks that its regions are of equal length, hold whole
//! aligned elements and, where one is written, do not overlap.

use std::sync::Arc;

use chorus_devices::cpu::RawRange;
use chorus_devices::{DType, MemCounters};

use crate::arith::{self, partial_op, with_element};
use crate::{CommError, ReduceOp, Result};

/// Memory a transfer or an operation reads or writes, kept alive as long as
/// the region is (a request holds its region until UCX is done with it).
#[derive(Clone)]
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
    _keep: Keep,
}

// SAFETY: the pointer is into memory the keep-alive owns; who accesses it
// when is ordered by the completions (see the module doc).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

#[derive(Clone)]
enum Keep {
    User(#[allow(dead_code)] RawRange),
    Scratch(#[allow(dead_code)] Arc<Scratch>),
    Bytes(#[allow(dead_code)] Arc<Vec<u8>>),
}

fn out_of_bounds(len: usize, offset: usize, of: &str, total: usize) -> CommError {
    CommError::invalid("ucx", format!("{len} bytes at {offset} of {total} {of} bytes"))
}

impl Region {
    /// `len` bytes from byte `offset` of a user buffer's range.
    pub(crate) fn user(range: &RawRange, offset: usize, len: usize) -> Result<Region> {
        if offset.checked_add(len).is_none_or(|end| end > range.bytes()) {
            return Err(out_of_bounds(len, offset, "user-buffer", range.bytes()));
        }
        // SAFETY: in bounds (checked above).
        let ptr = unsafe { range.ptr().add(offset) };
        Ok(Region { ptr, len, _keep: Keep::User(range.clone()) })
    }
    /// The whole of a user buffer's range.
    pub(crate) fn user_all(range: &RawRange) -> Region {
        Region { ptr: range.ptr(), len: range.bytes(), _keep: Keep::User(range.clone()) }
    }
    /// `len` bytes from byte `offset` of a scratch buffer.
    pub(crate) fn scratch(s: &Arc<Scratch>, offset: usize, len: usize) -> Result<Region> {
        if offset.checked_add(len).is_none_or(|end| end > s.bytes) {
            return Err(out_of_bounds(len, offset, "scratch", s.bytes));
        }
        // SAFETY: in bounds (checked above).
        let ptr = unsafe { s.ptr().add(offset) };
        Ok(Region { ptr, len, _keep: Keep::Scratch(s.clone()) })
    }
    /// The whole of a scratch buffer.
    pub(crate) fn whole(s: &Arc<Scratch>) -> Region {
        Region { ptr: s.ptr(), len: s.bytes, _keep: Keep::Scratch(s.clone()) }
    }
    /// Owned bytes (a small message).
    pub(crate) fn bytes(bytes: Vec<u8>) -> Region {
        let keep = Arc::new(bytes);
        Region { ptr: keep.as_ptr() as *mut u8, len: keep.len(), _keep: Keep::Bytes(keep) }
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// `len` bytes from byte `offset` of this region, kept alive as it is.
    pub(crate) fn part(&self, offset: usize, len: usize) -> Result<Region> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(out_of_bounds(len, offset, "region", self.len));
        }
        // SAFETY: in bounds (checked above).
        let ptr = unsafe { self.ptr.add(offset) };
        Ok(Region { ptr, len, _keep: self._keep.clone() })
    }
    /// The first byte (for UCX, which reads or writes `len` bytes from it
    /// while the request that holds this region lives).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// The bytes, read (a message that has arrived).
    ///
    /// # Safety
    /// No request in flight writes them while the slice lives.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: in bounds and alive (the region's invariant); nothing
        // writes them (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn overlaps(&self, other: &Region) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        self.len > 0 && other.len > 0 && a < b + other.len && b < a + self.len
    }
}

/// Host memory for partial results and staged messages, 8-byte aligned
/// (enough for every dtype).
pub(crate) struct Scratch {
    words: Box<[std::cell::UnsafeCell<u64>]>,
    bytes: usize,
    /// The communicator's count this buffer is in (see `pool.rs`).
    counters: Option<Arc<MemCounters>>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(c) = &self.counters {
            c.sub(self.bytes);
        }
    }
}

// SAFETY: accesses are ordered by completions (one writer at a time).
unsafe impl Send for Scratch {}
unsafe impl Sync for Scratch {}

impl Scratch {
    pub(crate) fn new(bytes: usize) -> Arc<Scratch> {
        let words = (0..bytes.div_ceil(8).max(1)).map(|_| std::cell::UnsafeCell::new(0u64)).collect();
        Arc::new(Scratch { words, bytes, counters: None })
    }
    /// A buffer counted in `counters` until it is dropped.
    pub(crate) fn counted(bytes: usize, counters: Arc<MemCounters>) -> Arc<Scratch> {
        let words = (0..bytes.div_ceil(8).max(1)).map(|_| std::cell::UnsafeCell::new(0u64)).collect();
        counters.add(bytes);
        Arc::new(Scratch { words, bytes, counters: Some(counters) })
    }
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// `r`'s elements of type `T`: its first element and their number; an
/// error unless it holds whole elements, aligned.
fn elements<T>(r: &Region, what: &str) -> Result<(*mut T, usize)> {
    let es = std::mem::size_of::<T>();
    if r.len % es != 0 || (r.ptr as usize) % std::mem::align_of::<T>() != 0 {
        return Err(CommError::invalid(
            "ucx",
            format!("{what}: {} bytes at {:p} are not whole aligned {es}-byte elements", r.len, r.ptr),
        ));
    }
    Ok((r.ptr as *mut T, r.len / es))
}

/// Checks that `acc` (written) and `x` (read) are of equal length and do
/// not overlap.
fn pair(acc: &Region, x: &Region, what: &str) -> Result<()> {
    if acc.len != x.len {
        return Err(CommError::invalid("ucx", format!("{what}: {} bytes into {}", x.len, acc.len)));
    }
    if acc.overlaps(x) {
        return Err(CommError::invalid("ucx", format!("{what}: the two {}-byte regions overlap", acc.len)));
    }
    Ok(())
}

/// Runs `f` on `acc`'s elements (written) and `x`'s (read), after the
/// checks of [`pair`] and [`elements`]; nothing when they are empty.
fn on_pair<T>(acc: &Region, x: &Region, what: &str, f: impl FnOnce(&mut [T], &[T])) -> Result<()> {
    pair(acc, x, what)?;
    if acc.len == 0 {
        return Ok(());
    }
    let ((a, n), (b, _)) = (elements::<T>(acc, what)?, elements::<T>(x, what)?);
    // SAFETY: both in bounds of memory their keep-alives hold, aligned,
    // whole elements, equal lengths and disjoint (checked above); no
    // request touches them now (the module doc's ordering).
    let (a, b) = unsafe { (std::slice::from_raw_parts_mut(a, n), std::slice::from_raw_parts(b as *const T, n)) };
    f(a, b);
    Ok(())
}

fn scalar_of(op: ReduceOp) -> f64 {
    match op {
        ReduceOp::PreMulSum(s) => s,
        _ => 1.0,
    }
}

/// `dst = src` (nothing when they are the same bytes).
pub(crate) fn copy(src: &Region, dst: &Region) -> Result<()> {
    if src.len == dst.len && src.ptr == dst.ptr {
        return Ok(());
    }
    on_pair::<u8>(dst, src, "copy", |d, s| d.copy_from_slice(s))
}

/// `acc = x`, this rank's own contribution (scaled for a pre-multiplied sum).
pub(crate) fn start(dtype: DType, acc: &Region, x: &Region, op: ReduceOp) -> Result<()> {
    with_element!(dtype, T => on_pair::<T>(acc, x, "start", |a, x| arith::start(a, x, op, scalar_of(op))))
}

/// `acc = acc ⊕ x` where `x` is this rank's own input (scaled for a pre-multiplied sum).
pub(crate) fn combine_own(dtype: DType, acc: &Region, x: &Region, op: ReduceOp) -> Result<()> {
    with_element!(dtype, T => on_pair::<T>(acc, x, "combine", |a, x| arith::combine(a, x, op, scalar_of(op))))
}

/// `acc = acc ⊕ partial` where `partial` is a partial result (already scaled).
pub(crate) fn combine_partial(dtype: DType, acc: &Region, partial: &Region, op: ReduceOp) -> Result<()> {
    with_element!(dtype, T => on_pair::<T>(acc, partial, "combine", |a, x| arith::combine(a, x, partial_op(op), 1.0)))
}

/// The last step of a reduction over `n` ranks (`Avg` divided).
pub(crate) fn finish(dtype: DType, acc: &Region, op: ReduceOp, n: usize) -> Result<()> {
    if acc.len == 0 {
        return Ok(());
    }
    with_element!(dtype, T => {
        let (a, len) = elements::<T>(acc, "finish")?;
        // SAFETY: in bounds of memory its keep-alive holds, aligned, whole
        // elements (checked above); no request touches it now (the module
        // doc's ordering).
        arith::finish::<T>(unsafe { std::slice::from_raw_parts_mut(a, len) }, op, n);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(r: &Region) -> Vec<f32> {
        // SAFETY: no request uses the region.
        unsafe { r.as_slice() }.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn filled(values: &[f32]) -> Region {
        let s = Scratch::new(values.len() * 4);
        let r = Region::whole(&s);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        copy(&Region::bytes(bytes), &r).unwrap();
        r
    }

    #[test]
    fn regions_are_bounded_by_their_memory() {
        let s = Scratch::new(16);
        assert!(Region::scratch(&s, 8, 8).is_ok());
        assert!(Region::scratch(&s, 8, 9).is_err());
        assert!(Region::scratch(&s, usize::MAX, 2).is_err());
        let r = Region::scratch(&s, 4, 8).unwrap();
        assert!(r.part(4, 4).is_ok());
        assert!(r.part(5, 4).is_err(), "a part is bounded by its region, not by the memory under it");
    }

    #[test]
    fn operations_check_lengths_alignment_and_overlap_before_they_touch_memory() {
        let s = Scratch::new(32);
        let (a, b) = (Region::scratch(&s, 0, 8).unwrap(), Region::scratch(&s, 8, 12).unwrap());
        assert!(copy(&a, &b).is_err(), "8 bytes into 12");
        let overlapping = Region::scratch(&s, 4, 8).unwrap();
        assert!(combine_own(DType::F32, &a, &overlapping, ReduceOp::Sum).is_err());
        let odd = Region::scratch(&s, 1, 8).unwrap();
        let other = Region::scratch(&s, 16, 8).unwrap();
        assert!(start(DType::F32, &odd, &other, ReduceOp::Sum).is_err(), "misaligned");
        assert!(finish(DType::F32, &Region::scratch(&s, 0, 6).unwrap(), ReduceOp::Avg, 2).is_err(), "1.5 elements");
        // The same bytes: a copy that does nothing.
        assert!(copy(&a, &a.clone()).is_ok());
    }

    #[test]
    fn operations_compute_the_reduction() {
        let acc = filled(&[0.0; 3]);
        let (x, y) = (filled(&[1.0, 2.0, 3.0]), filled(&[10.0, 20.0, 30.0]));
        start(DType::F32, &acc, &x, ReduceOp::PreMulSum(2.0)).unwrap();
        assert_eq!(f32s(&acc), [2.0, 4.0, 6.0]);
        combine_own(DType::F32, &acc, &y, ReduceOp::PreMulSum(2.0)).unwrap();
        assert_eq!(f32s(&acc), [22.0, 44.0, 66.0]);
        combine_partial(DType::F32, &acc, &x, ReduceOp::Avg).unwrap();
        finish(DType::F32, &acc, ReduceOp::Avg, 2).unwrap();
        assert_eq!(f32s(&acc), [11.5, 23.0, 34.5]);
    }
}
