//! The data movement of each collective, as one rank's share of the work.
//!
//! Every rank sees every rank's buffers (one address space), so nothing is
//! staged: each rank reads its inputs and writes the outputs directly, in
//! chunks small enough to stay in cache. The shares are disjoint, which is
//! what makes the in-place layouts safe: a rank reads a range of every input
//! before it writes the same range of the outputs, and no other rank touches
//! that range.

use chorus_devices::cpu::RawRange;
use chorus_devices::DType;

use super::reduce::{combine, finish, share, start, with_element, Reducible};
use crate::{CommError, ReduceOp, Result};

/// Elements per step of a reduction: the accumulator (and the slices read)
/// stay in the core's L2.
const CHUNK_BYTES: usize = 64 * 1024;

/// Rank `me`'s view of one collective: every rank's buffers (None where a
/// rank has none for this call).
pub(crate) struct Work<'a> {
    pub(crate) me: usize,
    pub(crate) n: usize,
    pub(crate) count: usize,
    pub(crate) dtype: DType,
    pub(crate) op: ReduceOp,
    pub(crate) scalars: &'a [f64],
    pub(crate) sends: &'a [Option<&'a RawRange>],
    pub(crate) recvs: &'a [Option<&'a RawRange>],
}

fn missing(what: &str) -> CommError {
    CommError::invalid("collective", format!("a rank arrived without its {what} buffer"))
}

/// Copies `src` to `dst` (same byte length); nothing if they are the same memory.
pub(crate) fn copy(src: &RawRange, dst: &RawRange) {
    copy_bytes(src.ptr(), dst.ptr(), src.bytes().min(dst.bytes()));
}

fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    if len == 0 || std::ptr::eq(src, dst) {
        return;
    }
    // SAFETY: callers pass ranges inside live allocations that no other rank
    // touches during this collective (see the module doc); distinct ranges of
    // a collective never partially overlap (validated before launch).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Reduces `len` elements starting at element `in_off` of every input into
/// element `out_off` of every output, chunk by chunk.
fn reduce_range<T: Reducible>(
    inputs: &[*const T],
    scalars: &[f64],
    outputs: &[*mut T],
    in_off: usize,
    out_off: usize,
    len: usize,
    op: ReduceOp,
) {
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    let mut acc = vec![T::zeroed(); chunk.min(len)];
    let mut done = 0;
    while done < len {
        let m = chunk.min(len - done);
        let acc = &mut acc[..m];
        for (j, input) in inputs.iter().enumerate() {
            // SAFETY: inside the input, which no rank writes while this share is read
            // (in-place outputs of this share are written below, after the reads).
            let x = unsafe { std::slice::from_raw_parts(input.add(in_off + done), m) };
            if j == 0 {
                start(acc, x, op, scalars[0]);
            } else {
                combine(acc, x, op, scalars[j]);
            }
        }
        finish(acc, op, inputs.len());
        for out in outputs {
            // SAFETY: this share of each output is written by this rank alone.
            unsafe { std::slice::from_raw_parts_mut(out.add(out_off + done), m) }.copy_from_slice(acc);
        }
        done += m;
    }
}

impl Work<'_> {
    fn all_sends(&self) -> Result<Vec<&RawRange>> {
        self.sends.iter().map(|s| s.ok_or_else(|| missing("send"))).collect()
    }
    fn all_recvs(&self) -> Result<Vec<&RawRange>> {
        self.recvs.iter().map(|s| s.ok_or_else(|| missing("recv"))).collect()
    }
    fn recv_of(&self, rank: usize) -> Result<&RawRange> {
        self.recvs.get(rank).copied().flatten().ok_or_else(|| missing("recv"))
    }
    fn send_of(&self, rank: usize) -> Result<&RawRange> {
        self.sends.get(rank).copied().flatten().ok_or_else(|| missing("send"))
    }

    fn reduce_into<T: Reducible>(
        &self,
        inputs: &[&RawRange],
        outputs: &[&RawRange],
        in_off: usize,
        out_off: usize,
        len: usize,
    ) {
        let ins: Vec<*const T> = inputs.iter().map(|r| r.ptr() as *const T).collect();
        let outs: Vec<*mut T> = outputs.iter().map(|r| r.ptr() as *mut T).collect();
        reduce_range::<T>(&ins, self.scalars, &outs, in_off, out_off, len, self.op);
    }

    /// Rank `me` reduces its share of the elements and writes it to every rank.
    pub(crate) fn all_reduce(&self) -> Result<()> {
        let (sends, recvs) = (self.all_sends()?, self.all_recvs()?);
        let (lo, hi) = share(self.count, self.n, self.me);
        with_element!(self.dtype, T => self.reduce_into::<T>(&sends, &recvs, lo, lo, hi - lo));
        Ok(())
    }

    /// Rank `me` reduces chunk `me` of every input into its own output.
    pub(crate) fn reduce_scatter(&self) -> Result<()> {
        let sends = self.all_sends()?;
        let out = self.recv_of(self.me)?;
        let off = self.me * self.count;
        with_element!(self.dtype, T => self.reduce_into::<T>(&sends, &[out], off, 0, self.count));
        Ok(())
    }

    /// Rank `me` reduces its share of the elements into the root's output.
    pub(crate) fn reduce(&self, root: usize) -> Result<()> {
        let sends = self.all_sends()?;
        let out = self.recv_of(root)?;
        let (lo, hi) = share(self.count, self.n, self.me);
        with_element!(self.dtype, T => self.reduce_into::<T>(&sends, &[out], lo, lo, hi - lo));
        Ok(())
    }

    /// Rank `me` pushes its input into chunk `me` of every rank's output,
    /// a cache-sized piece at a time so the input is read from memory once.
    pub(crate) fn all_gather(&self) -> Result<()> {
        let src = self.send_of(self.me)?;
        let recvs = self.all_recvs()?;
        let bytes = self.count * self.dtype.size();
        let mut done = 0;
        while done < bytes {
            let m = CHUNK_BYTES.min(bytes - done);
            for r in &recvs {
                // SAFETY: offsets are inside the buffers (lengths validated before launch).
                let (s, d) = unsafe { (src.ptr().add(done), r.ptr().add(self.me * bytes + done)) };
                copy_bytes(s, d, m);
            }
            done += m;
        }
        Ok(())
    }

    /// Rank `me` copies the root's input into its own output.
    pub(crate) fn broadcast(&self, root: usize) -> Result<()> {
        copy(self.send_of(root)?, self.recv_of(self.me)?);
        Ok(())
    }

    /// Rank `me` pulls chunk `me` of every rank's input into chunk j of its output.
    pub(crate) fn all_to_all(&self) -> Result<()> {
        let out = self.recv_of(self.me)?;
        let bytes = self.count / self.n * self.dtype.size();
        for (j, s) in self.all_sends()?.iter().enumerate() {
            // SAFETY: offsets are inside the buffers (lengths validated before launch).
            let (src, dst) = unsafe { (s.ptr().add(self.me * bytes), out.ptr().add(j * bytes)) };
            copy_bytes(src, dst, bytes);
        }
        Ok(())
    }
}
