//! The device layer's typed errors.

use crate::DType;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Everything a device, stream, event or buffer operation can fail with.
///
/// Errors are `Clone` because an asynchronous failure is sticky: it is
/// reported by every later synchronize on the failed stream and by every
/// event recorded after it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    /// The caller passed something the operation cannot accept.
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Buffers of the wrong dtype were passed.
    #[error("{op}: dtype mismatch: expected {expected}, found {found}")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// What the operation needs.
        expected: DType,
        /// What was passed.
        found: DType,
    },
    /// The stream sanitizer found two accesses to one buffer range from
    /// different streams with no event ordering them. The operation was not
    /// enqueued.
    #[error("{0}")]
    Race(Box<RaceReport>),
    /// A host wait (or an executor's wait on an event) passed its deadline.
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long it waited.
        waited: Duration,
    },
    /// Memory could not be allocated.
    #[error("out of memory allocating {bytes} bytes on {device}")]
    OutOfMemory {
        /// The device.
        device: String,
        /// The request.
        bytes: usize,
    },
    /// A vendor library call failed.
    #[error("{library} error {code}: {message}")]
    Backend {
        /// The library (`libcuda`, `libamdhip64`, ...).
        library: &'static str,
        /// The native status code.
        code: i64,
        /// The native message.
        message: String,
    },
    /// The backend's library loaded, but it sees no device with this ordinal
    /// (no GPU at all, a driver that is not running, or an ordinal past the count).
    #[error("no {backend} device {ordinal}: {visible} visible ({reason})")]
    NoDevice {
        /// The backend (`hip`, `cuda`).
        backend: &'static str,
        /// The ordinal that was asked for.
        ordinal: usize,
        /// How many devices the library reports.
        visible: usize,
        /// The library's own words (its status name and message).
        reason: String,
    },
    /// A vendor library could not be loaded.
    #[error("{library} could not be loaded (tried {tried}); install it or point {variable} at it")]
    LibraryUnavailable {
        /// The library's common name.
        library: &'static str,
        /// The file names tried, comma-separated.
        tried: String,
        /// The environment variable that points to it.
        variable: &'static str,
    },
    /// An enqueued operation failed when it ran; `source` is the operation's
    /// own error (a collective's error, for example), kept whole so the layer
    /// that enqueued it can recover its type.
    #[error("{op} failed on {stream}: {source}")]
    OpFailed {
        /// The operation.
        op: &'static str,
        /// The stream it ran on.
        stream: String,
        /// The operation's error.
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A device API call was made inside a host function (or from something
    /// a host function dropped), which CUDA and HIP forbid
    /// (`CUDA_ERROR_NOT_PERMITTED`); see [`crate::host_fn`]. Nothing was done.
    #[error(
        "{op} was called inside a host function, where device API calls are not permitted (CUDA_ERROR_NOT_PERMITTED)"
    )]
    InHostFunction {
        /// The refused operation.
        op: String,
    },
    /// The operation was skipped because an earlier operation on its stream
    /// (or on a stream it waited for) failed; `cause` is that failure.
    #[error("skipped because an earlier operation failed: {cause}")]
    Poisoned {
        /// The first failure.
        cause: Box<DeviceError>,
    },
}

impl DeviceError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        DeviceError::InvalidArgument { op, reason: reason.into() }
    }

    /// The first failure behind this error, looking through `Poisoned`.
    pub fn root_cause(&self) -> &DeviceError {
        match self {
            DeviceError::Poisoned { cause } => cause.root_cause(),
            other => other,
        }
    }

    /// The operation-level error carried by an asynchronous failure, if it is of type `E`.
    pub fn op_source<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self.root_cause() {
            DeviceError::OpFailed { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessKind {
    /// The operation reads the range.
    Read,
    /// The operation writes the range.
    Write,
}

impl fmt::Display for AccessKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccessKind::Read => "reads",
            AccessKind::Write => "writes",
        })
    }
}

/// One side of a race: an operation, its stream and what it did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceAccess {
    /// The operation's name (`copy`, `all_reduce`, ...).
    pub op: String,
    /// The stream's name.
    pub stream: String,
    /// Its position on that stream (1-based).
    pub position: u64,
    /// Read or write.
    pub kind: AccessKind,
    /// The byte range it touches.
    pub bytes: std::ops::Range<usize>,
}

/// What the stream sanitizer reports: two unordered accesses to one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceReport {
    /// The buffer (id and dtype/length).
    pub buffer: String,
    /// The earlier access, already enqueued.
    pub previous: RaceAccess,
    /// The access being enqueued, which was refused.
    pub current: RaceAccess,
}

impl fmt::Display for RaceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, c) = (&self.previous, &self.current);
        write!(
            f,
            "stream race on {}: `{}` on {} {} bytes {:?}, but `{}` (#{}) on {} {} bytes {:?} and no event orders them",
            self.buffer, c.op, c.stream, c.kind, c.bytes, p.op, p.position, p.stream, p.kind, p.bytes
        )
    }
}
