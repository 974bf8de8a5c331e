//! FSDP's typed errors.

use chorus_collectives::CommError;
use chorus_devices::DeviceError;

/// Everything FSDP can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FsdpError {
    /// Bad configuration or arguments.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A hook was called in a state that does not allow it.
    #[error("group `{group}`: {event} is not allowed in state {state:?}")]
    State {
        /// The group.
        group: String,
        /// The hook or access.
        event: &'static str,
        /// The group's training state.
        state: crate::TrainingState,
    },
    /// Communication failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The device failed.
    #[error(transparent)]
    Device(DeviceError),
}

/// An asynchronous device error that carries a collective's error becomes
/// [`FsdpError::Comm`]; anything else stays a device error.
impl From<DeviceError> for FsdpError {
    fn from(e: DeviceError) -> Self {
        match CommError::from(e) {
            CommError::Device(d) => FsdpError::Device(d),
            c => FsdpError::Comm(c),
        }
    }
}

/// Result of FSDP calls.
pub type Result<T, E = FsdpError> = std::result::Result<T, E>;
