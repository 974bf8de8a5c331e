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
    #[error("{op} #{seq} timed out after {waited:?}{}", never_arrived(.missing))]
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
    /// A rendezvous store failed for a reason other than a deadline (that is
    /// [`CommError::Timeout`]): it cannot be reached, its address is taken,
    /// the peer broke the protocol, a request exceeds the store's limits.
    #[error("store {address}: {failure}: {reason}")]
    Store {
        /// Where the store is: `host:port` for TCP, the directory of a file
        /// store, `memory` for the in-process one.
        address: String,
        /// What kind of failure.
        failure: StoreFailure,
        /// The details (the OS error, what the peer sent).
        reason: String,
    },
}

/// The kinds of [`CommError::Store`] failures, for callers that react to
/// them (retry on [`StoreFailure::AddressInUse`] with another port, say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreFailure {
    /// No connection could be made before the deadline (refused,
    /// unreachable, the name did not resolve).
    Unreachable,
    /// The address a server was asked to listen on is already taken.
    AddressInUse,
    /// The peer broke the protocol or closed the connection mid-request.
    Protocol,
    /// The request exceeds a limit of the store (key or value size, key
    /// count); nothing was sent.
    Limit,
    /// The stored value cannot serve the request (`add` on a value that is
    /// not a decimal integer, or an overflow).
    BadValue,
    /// A local I/O error (socket, file, directory).
    Io,
}

impl std::fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StoreFailure::Unreachable => "unreachable",
            StoreFailure::AddressInUse => "address in use",
            StoreFailure::Protocol => "protocol error",
            StoreFailure::Limit => "over a limit",
            StoreFailure::BadValue => "bad value",
            StoreFailure::Io => "i/o error",
        })
    }
}

impl CommError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument { op, reason: reason.into() }
    }

    /// Refuses a rank outside a world of `size` ranks (or an empty world)
    /// as an invalid argument of `op`.
    pub(crate) fn check_rank(op: &'static str, rank: usize, size: usize) -> Result<(), Self> {
        if size == 0 || rank >= size {
            return Err(CommError::invalid(op, format!("rank {rank} of {size} ranks")));
        }
        Ok(())
    }

    pub(crate) fn store(address: impl Into<String>, failure: StoreFailure, reason: impl Into<String>) -> Self {
        CommError::Store { address: address.into(), failure, reason: reason.into() }
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
            CommError::Store { .. } => "store",
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

/// "; ranks [1, 3] never arrived", or nothing when the backend cannot tell
/// which ranks are missing (UCX and the vendor libraries).
fn never_arrived(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!("; ranks {missing:?} never arrived")
    }
}
