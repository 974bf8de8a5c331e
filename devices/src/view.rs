//! Cheap views into buffers.
//!
//! A view is of a backend's buffer, and the traits (`api.rs`) take views:
//! the two depend on each other, as wgpu-hal's `Api` and its resources do.

use crate::api::{Backend, Buffer};
use crate::{DType, DeviceError};
use std::fmt;
use std::ops::Range;

/// A range of elements of a buffer: a borrowed buffer, an offset and a length
/// (in elements). Copying a view is free; it never owns memory.
pub struct View<'a, B: Backend> {
    buffer: &'a B::Buffer,
    offset: usize,
    len: usize,
}

impl<B: Backend> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for View<'_, B> {}

impl<B: Backend> fmt::Debug for View<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "View(buffer #{} {}[{}..{}])",
            self.buffer.id(),
            self.buffer.dtype(),
            self.offset,
            self.offset + self.len
        )
    }
}

impl<'a, B: Backend> View<'a, B> {
    /// The whole of `buffer`.
    pub fn whole(buffer: &'a B::Buffer) -> Self {
        View { buffer, offset: 0, len: buffer.len() }
    }

    /// A sub-range of this view: `len` elements from `offset` (relative to this view).
    pub fn slice(&self, offset: usize, len: usize) -> Result<View<'a, B>, DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(View { buffer: self.buffer, offset: self.offset + offset, len }),
            _ => Err(DeviceError::invalid(
                "slice",
                format!("range {offset}..{offset}+{len} is outside a view of {} elements", self.len),
            )),
        }
    }

    /// The `index`-th of `parts` equal chunks of this view (its length must divide evenly).
    pub fn chunk(&self, index: usize, parts: usize) -> Result<View<'a, B>, DeviceError> {
        if parts == 0 || self.len % parts != 0 || index >= parts {
            return Err(DeviceError::invalid(
                "chunk",
                format!("cannot take chunk {index} of {parts} from a view of {} elements", self.len),
            ));
        }
        let n = self.len / parts;
        self.slice(index * n, n)
    }

    /// The buffer this view is into.
    pub fn buffer(&self) -> &'a B::Buffer {
        self.buffer
    }
    /// First element, counted from the buffer's start.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buffer.dtype()
    }
    /// Length in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype().size()
    }
    /// The byte range within the buffer.
    pub fn byte_range(&self) -> Range<usize> {
        let s = self.dtype().size();
        self.offset * s..(self.offset + self.len) * s
    }
    /// Whether two views are of the same buffer and their ranges intersect.
    pub fn overlaps(&self, other: &View<'_, B>) -> bool {
        if self.buffer.id() != other.buffer.id() || self.is_empty() || other.is_empty() {
            return false;
        }
        let (a, b) = (self.byte_range(), other.byte_range());
        a.start < b.end && b.start < a.end
    }
    /// Whether two views are exactly the same range of the same buffer.
    pub fn same_range(&self, other: &View<'_, B>) -> bool {
        self.buffer.id() == other.buffer.id() && self.offset == other.offset && self.len == other.len
    }
}
