//! The communication layer's typed errors.

use chorus_devices::DeviceError;
use std::time::Duration;

/// Everything a collective call can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// The call's arguments are wrong on this rank (checked before any
    /// backend sees the call; nothing was enqueued).
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Ranks issued different calls at the same position of the call sequence.
    #[error("mismatched collective #{seq}: {details}")]
    Mismatch {
        /// The position in the communicator's call sequence (0-based).
        seq: u64,
        /// Each rank and the call it issued, for the ranks that differ.
        details: String,
    },
    /// Some ranks did not arrive at a call before the deadline.
    #[error("{op} #{seq} timed out after {waited:?}; ranks {missing:?} never arrived")]
    Timeout {
        /// The operation.
        op: String,
        /// The position in the call sequence.
        seq: u64,
        /// The deadline.
        waited: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// The communicator was aborted (by a call to `abort`, or because a rank failed).
    #[error("communicator aborted: {reason}")]
    Aborted {
        /// Why.
        reason: String,
    },
    /// The backend does not offer this capability.
    #[error("{backend} does not support {what}")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// The capability.
        what: String,
    },
    /// A vendor library call failed.
    #[error("{library} error {code}: {message}")]
    Backend {
        /// The library (`nccl`, `rccl`, `sim`).
        library: &'static str,
        /// The native status code.
        code: i64,
        /// The native message.
        message: String,
    },
    /// The device layer failed (a stream error, a race, a device timeout).
    #[error(transparent)]
    Device(DeviceError),
}

impl CommError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument { op, reason: reason.into() }
    }

    /// A short name of the variant (`timeout`, `mismatch`, ...), for reports.
    pub fn kind(&self) -> &'static str {
        match self {
            CommError::InvalidArgument { .. } => "invalid-argument",
            CommError::Mismatch { .. } => "mismatch",
            CommError::Timeout { .. } => "timeout",
            CommError::Aborted { .. } => "aborted",
            CommError::Unsupported { .. } => "unsupported",
            CommError::Backend { .. } => "backend",
            CommError::Device(_) => "device",
        }
    }
}

/// Recovers the collective's own error from an asynchronous stream failure:
/// a collective that fails while running fails its stream with
/// [`DeviceError::OpFailed`] carrying the `CommError`.
impl From<DeviceError> for CommError {
    fn from(e: DeviceError) -> Self {
        match e.op_source::<CommError>() {
            Some(c) => c.clone(),
            None => CommError::Device(e),
        }
    }
}

/// Result of communication calls.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
