//! The library's one error type: what a layer below reported, kept typed,
//! and what only a world of ranks can say (which rank failed, and how).

use chorus_collectives::bootstrap::{EnvError, JobError};
use chorus_collectives::CommError;
use chorus_devices::DeviceError;
use chorus_fsdp::FsdpError;

/// A result with [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong when starting a world, running ranks or sharding a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective, a split or the rendezvous failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A device, stream or buffer operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// FSDP refused or failed.
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// The launcher's variables are incomplete or contradict each other.
    #[error("reading the launcher's variables: {0}")]
    Launcher(#[from] EnvError),
    /// The candle adapter failed (a stage, a checkpoint, a conversion).
    #[cfg(feature = "candle")]
    #[error(transparent)]
    Model(#[from] chorus_fsdp_candle::Error),
    /// candle failed.
    #[cfg(feature = "candle")]
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A rank's function returned an error: the rank, and the error as it
    /// was returned ([`Error::rank_error`] gives it back typed).
    #[error("rank {rank} failed: {}", chain(error.as_ref()))]
    Rank {
        /// The rank.
        rank: usize,
        /// What its function returned.
        error: BoxError,
    },
    /// A rank's function panicked.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic's message.
        message: String,
    },
    /// Ranks were still running when the world's deadline passed.
    #[error("ranks {ranks:?} had not finished after {seconds:.1} s (the world's deadline); the world was aborted")]
    Deadline {
        /// The ranks still running.
        ranks: Vec<usize>,
        /// The deadline, in seconds.
        seconds: f64,
    },
    /// Ranks hold different values of a parameter before training: FSDP
    /// would train a mix of them.
    #[error(
        "initial weights differ across ranks: `{param}` on rank {rank} is not rank 0's; give every rank the same \
         weights (a seed: `ShardBuilder::seed`, or `ShardBuilder::broadcast_from_rank0`)"
    )]
    WeightsDiffer {
        /// The first parameter (in group order) that differs.
        param: String,
        /// The lowest rank whose values differ from rank 0's.
        rank: usize,
    },
    /// An argument the caller gave cannot work.
    #[error("{0}")]
    InvalidArgument(String),
    /// This build cannot do what was asked (a backend or feature not built).
    #[error("{0}")]
    Unsupported(String),
}

/// What a rank's function may fail with: any error (`chorus::Error`,
/// `anyhow::Error`, `std::io::Error`, a `String`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl Error {
    /// The rank that failed, where a rank's function failed or panicked.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Error::Rank { rank, .. } | Error::Panicked { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// The error a rank's function returned, as its own type `E` (a
    /// `chorus::Error` to match on, an `std::io::Error`, ...).
    pub fn rank_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Error::Rank { error, .. } => error.downcast_ref::<E>(),
            _ => None,
        }
    }
}

impl From<JobError> for Error {
    fn from(e: JobError) -> Error {
        match e {
            JobError::Launcher(e) => Error::Launcher(e),
            JobError::Store(e) => Error::Comm(e),
            e => Error::InvalidArgument(e.to_string()),
        }
    }
}

/// An error's message with its causes, `: `-separated.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        message.push_str(&format!(": {c}"));
        cause = c.source();
    }
    message
}
