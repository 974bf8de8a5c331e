//! Host memory that backs cpu buffers, with exact accounting.

use std::ptr::NonNull;
use std::sync::Arc;

use super::pool::{size_class, Pool, ALIGN};
use crate::DeviceError;

/// One allocation. Shared (`Arc`) between the buffer and the queued work that
/// uses it, so the bytes go back to the pool only after the last of them.
#[derive(Debug)]
pub(crate) struct Memory {
    ptr: NonNull<u8>,
    bytes: usize,
    /// The pool's block (and its size class) this memory is, freed to it on
    /// drop; `None` when borrowed from an owner that keeps it alive, or empty.
    block: Option<(Arc<Pool>, usize)>,
}

// SAFETY: the memory is plain bytes owned by this struct; concurrent access is
// governed by the stream model (and checked by the sanitizer), as on a GPU.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

/// What the bytes of a new allocation must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Contents {
    /// Zeros (`Device::alloc`'s promise).
    Zeroed,
    /// Whatever the block holds (`Stream::alloc`: unspecified contents);
    /// always initialized bytes, since every block was zeroed when new.
    Any,
    /// Every byte 0xFF (NaN in every float dtype): the sanitizer's way to make
    /// a read of unspecified contents show instead of reading stale zeros.
    Poisoned,
}

impl Memory {
    /// `bytes` from `pool`, holding `contents`.
    pub(crate) fn take(
        pool: &Arc<Pool>,
        bytes: usize,
        contents: Contents,
        device: &str,
    ) -> Result<Arc<Memory>, DeviceError> {
        if bytes == 0 {
            // A well-aligned dangling pointer: never dereferenced for zero bytes.
            let ptr = NonNull::new(ALIGN as *mut u8).ok_or_else(|| DeviceError::invalid("alloc", "null alignment"))?;
            return Ok(Arc::new(Memory { ptr, bytes, block: None }));
        }
        let class = size_class(bytes).ok_or_else(|| DeviceError::OutOfMemory { device: device.to_string(), bytes })?;
        let (ptr, class, reused) = pool.take(class, device)?;
        let fill = match contents {
            Contents::Zeroed if reused => Some(0),
            Contents::Poisoned => Some(0xFF),
            _ => None,
        };
        if let Some(byte) = fill {
            // SAFETY: the block is at least `bytes` long and nothing else uses it yet.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), byte, bytes) };
        }
        Ok(Arc::new(Memory { ptr, bytes, block: Some((pool.clone(), class)) }))
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Some((pool, class)) = self.block.take() {
            // SAFETY: taken from this pool with this class in `take`; this is
            // the last handle (the buffer and every job that used it are gone).
            unsafe { pool.put(self.ptr, class) };
        }
    }
}

/// A byte range of a cpu buffer's memory that stays allocated while this
/// handle lives. Queued work holds these, which is what makes dropping a
/// buffer with work in flight safe.
#[derive(Clone, Debug)]
pub struct RawRange {
    mem: Arc<Memory>,
    start: usize,
    len: usize,
    dtype: crate::DType,
}

impl RawRange {
    pub(crate) fn new(mem: Arc<Memory>, start: usize, len: usize, dtype: crate::DType) -> RawRange {
        debug_assert!(start + len <= mem.bytes());
        RawRange { mem, start, len, dtype }
    }
    /// A range of memory that something else owns and keeps alive: what a
    /// library that was handed raw addresses (the simulated NCCL ABI) works on.
    ///
    /// # Safety
    /// `ptr` is valid for `len` bytes, aligned for `dtype`, for as long as the
    /// range (and its clones) are used; access follows [`RawRange::as_bytes`]'s rules.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize, dtype: crate::DType) -> RawRange {
        let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
        RawRange { mem: Arc::new(Memory { ptr, bytes: len, block: None }), start: 0, len, dtype }
    }

    /// Number of bytes.
    pub fn bytes(&self) -> usize {
        self.len
    }
    /// The element type of the buffer.
    pub fn dtype(&self) -> crate::DType {
        self.dtype
    }
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.len / self.dtype.size()
    }
    /// Pointer to the first byte.
    pub fn ptr(&self) -> *mut u8 {
        // SAFETY: start is within the allocation (checked at construction).
        unsafe { self.mem.ptr().add(self.start) }
    }
    /// Whether two ranges share a byte (ranges of different allocations never do).
    pub fn overlaps(&self, other: &RawRange) -> bool {
        let (a, b) = (self.ptr() as usize, other.ptr() as usize);
        self.len > 0 && other.len > 0 && a < b + other.len && b < a + self.len
    }
    /// The bytes, shared.
    ///
    /// # Safety
    /// No operation may write this range while the slice lives: the caller
    /// runs in stream order after every write to it and before any later one.
    pub unsafe fn as_bytes(&self) -> &[u8] {
        // SAFETY: in bounds; aliasing per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }
    /// The bytes, exclusive.
    ///
    /// # Safety
    /// No other access to this range may happen while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_bytes_mut(&self) -> &mut [u8] {
        // SAFETY: in bounds; exclusivity per the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
    /// The elements as `T`, shared. Alignment holds because allocations are
    /// 64-byte aligned and offsets are whole elements.
    ///
    /// # Safety
    /// As [`RawRange::as_bytes`], and `T` must be the range's element type.
    pub unsafe fn as_slice<T: crate::Element>(&self) -> &[T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        // SAFETY: see above.
        unsafe { std::slice::from_raw_parts(self.ptr() as *const T, self.elements()) }
    }
    /// The elements as `T`, exclusive.
    ///
    /// # Safety
    /// As [`RawRange::as_bytes_mut`], and `T` must be the range's element type.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<T: crate::Element>(&self) -> &mut [T] {
        debug_assert_eq!(T::DTYPE, self.dtype);
        // SAFETY: see above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr() as *mut T, self.elements()) }
    }
}
