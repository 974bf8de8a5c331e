//! The library's one error type: what a layer below reported, kept typed,
//! and what only a world of ranks can say (which rank failed, and how).

use chorus_collectives::bootstrap::EnvError;
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
    /// A rank's function returned an error (its message, with its causes).
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What it returned, as text.
        message: String,
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

impl Error {
    /// The rank an error names, if it names one.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Error::Rank { rank, .. } | Error::Panicked { rank, .. } | Error::WeightsDiffer { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}
