//! Small helpers the cases share: buffers from host bytes, readbacks, error expectations.

use anyhow::{anyhow, bail};
use chorus_collectives::{CommBackend, CommError};
use chorus_devices::{Backend, Buffer, DType, Scalar, Stream, View};

use crate::expected::SENTINEL;
use crate::{Buf, Failure, Strm};

/// A seed per case family, so inputs of different cases differ.
pub(crate) fn seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// A buffer allocated in `s`'s order and filled from `bytes` (elements of `dtype`).
pub(crate) fn upload<C: CommBackend>(s: &Strm<C>, dtype: DType, bytes: &[u8]) -> Result<Buf<C>, Failure> {
    let buf = s.alloc(dtype, bytes.len() / dtype.size())?;
    s.copy_from_host(bytes, buf.view())?;
    Ok(buf)
}

/// A buffer of `len` elements filled with [`SENTINEL`].
pub(crate) fn sentinel<C: CommBackend>(s: &Strm<C>, dtype: DType, len: usize) -> Result<Buf<C>, Failure> {
    let buf = s.alloc(dtype, len)?;
    s.fill(buf.view(), Scalar::Int(SENTINEL))?;
    Ok(buf)
}

/// Reads `v` back to the host (blocking). A collective that failed on the
/// stream surfaces here as its `CommError`.
pub(crate) fn read<C: CommBackend>(s: &Strm<C>, v: View<'_, C::B>) -> Result<Vec<u8>, Failure> {
    let rb = s.copy_to_host(v).map_err(CommError::from)?;
    Ok(rb.wait().map_err(CommError::from)?)
}

/// Synchronizes `s`, recovering a collective's own error from the stream's.
pub(crate) fn sync<S: Stream>(s: &S) -> Result<(), CommError> {
    s.synchronize().map_err(CommError::from)
}

/// A view of `len` elements from `offset` of `buf`.
pub(crate) fn part<B: Backend>(buf: &B::Buffer, offset: usize, len: usize) -> Result<View<'_, B>, Failure> {
    Ok(View::whole(buf).slice(offset, len)?)
}

/// Expects `result` to be an error that `matches` accepts (`expected` names it).
pub(crate) fn expect_err<T>(
    what: &str,
    expected: &str,
    result: Result<T, CommError>,
    matches: impl FnOnce(&CommError) -> bool,
) -> Result<CommError, Failure> {
    match result {
        Ok(_) => bail!("{what}: expected {expected}, but it succeeded"),
        Err(e) if matches(&e) => Ok(e),
        Err(e) => Err(anyhow!("{what}: expected {expected}, got a {} error: {e}", e.kind())),
    }
}

/// Expects a synchronous `InvalidArgument`.
pub(crate) fn expect_invalid<T>(what: &str, result: Result<T, CommError>) -> Result<(), Failure> {
    expect_err(what, "InvalidArgument", result, |e| matches!(e, CommError::InvalidArgument { .. })).map(|_| ())
}
