//! The GPU devices' host-memory allocation steps that do not touch a driver,
//! written once: the byte count of a host buffer and a zeroed pageable block.

use crate::{DType, DeviceError, Result};

/// The bytes of `len` elements of `dtype` in host memory of the device `label`.
pub(crate) fn host_bytes(label: &str, dtype: DType, len: usize) -> Result<usize> {
    len.checked_mul(dtype.size())
        .ok_or_else(|| DeviceError::OutOfMemory { device: format!("{label} (host)"), bytes: usize::MAX })
}

/// `bytes` zeroed bytes of pageable memory of the device `label`, in u64
/// words so that every element type is aligned.
pub(crate) fn pageable_block(label: &str, bytes: usize) -> Result<Vec<u64>> {
    let mut block: Vec<u64> = Vec::new();
    block
        .try_reserve_exact(bytes.div_ceil(8))
        .map_err(|_| DeviceError::OutOfMemory { device: format!("{label} (host)"), bytes })?;
    block.resize(bytes.div_ceil(8), 0);
    Ok(block)
}
