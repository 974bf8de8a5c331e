//! The adapter's typed errors.

use std::path::PathBuf;

use chorus_fsdp::FsdpError;

/// Everything the candle adapter and its checkpoints can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// FSDP failed (a hook out of order, a collective, the device).
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// candle failed (shapes, dtypes, a module's own error).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// Bad arguments to the adapter.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A checkpoint problem, naming the file and, where it applies, the tensor.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// An output file (the trained model, its consolidation) could not be written.
    #[error("writing {0}")]
    Write(#[from] crate::safetensors_io::WriteError),
    /// The device computes off host memory (a GPU) but this build has no
    /// candle device for it: candle would compute on the CPU.
    #[error(
        "{device} is a GPU device, but candle has no device for it in this build: it would compute on the CPU. \
         Build with the `candle-cuda` feature (of the `chorus` crate; candle's CUDA device, NCCL), or, to compute on \
         the CPU deliberately, make the model with FsdpModel::new_computing_on_host"
    )]
    NoCandleDevice {
        /// The device's name.
        device: String,
    },
    /// The training loss stopped being a finite number.
    #[error("the loss became {loss} at step {step}: stopping (a NaN or infinity in the data, the weights or the learning rate)")]
    NonFinite {
        /// The step whose loss it was.
        step: u64,
        /// The loss.
        loss: f64,
    },
}

/// Why a checkpoint could not be written or read. Every variant names the
/// file, and the tensor where one is involved.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The operating system refused (missing file, permissions, full disk).
    /// The OS error is part of the message, not a separate source, so a
    /// chain of causes prints it once.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// The checkpoint directory given does not exist.
    #[error("{path}: no such checkpoint directory")]
    NotFound {
        /// The directory.
        path: PathBuf,
    },
    /// The directory exists but holds neither a checkpoint nor a `latest` pointer.
    #[error("{path}: not a checkpoint (no chorus_checkpoint.json, and no `latest` naming one)")]
    NotACheckpoint {
        /// The directory.
        path: PathBuf,
    },
    /// `latest` names a checkpoint that is not there (or is incomplete).
    #[error("{latest}: names `{target}`, which is not a complete checkpoint (no chorus_checkpoint.json in it)")]
    DanglingLatest {
        /// The `latest` file.
        latest: PathBuf,
        /// The name it holds.
        target: String,
    },
    /// A file of the checkpoint was written by another save than its
    /// manifest (two runs sharing a directory; files copied between checkpoints).
    #[error(
        "{path}: written by save {found}, but the checkpoint's manifest by save {expected} (files of two saves mixed)"
    )]
    Mixed {
        /// The file.
        path: PathBuf,
        /// The save identity the file records (or "none").
        found: String,
        /// The manifest's.
        expected: String,
    },
    /// The checkpoint holds tensors the model does not have: it was saved
    /// from another model configuration, and loading would drop them.
    #[error("{path}: the checkpoint holds {count} tensor(s) this model lacks ({names}): it was saved from another model configuration")]
    UnusedTensors {
        /// The manifest.
        path: PathBuf,
        /// How many.
        count: usize,
        /// The first few names.
        names: String,
    },
    /// The run's optimizer differs from the one the checkpoint was saved with.
    #[error("{path}: {message}")]
    Optimizer {
        /// The manifest.
        path: PathBuf,
        /// What differs.
        message: String,
    },
    /// A file listed in the manifest is not there.
    #[error("{path}: missing (the checkpoint lists it)")]
    MissingFile {
        /// The file.
        path: PathBuf,
    },
    /// A file is shorter or longer than when it was written.
    #[error("{path}: {found} bytes, the checkpoint recorded {expected} (truncated or replaced)")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes recorded at save time.
        expected: u64,
        /// Bytes found.
        found: u64,
    },
    /// A file's checksum does not match the one recorded at save time.
    #[error("{path}: checksum {found:08x}, the checkpoint recorded {expected:08x} (corrupt)")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// CRC-32 recorded at save time.
        expected: u32,
        /// CRC-32 of the file now.
        found: u32,
    },
    /// A file is not a valid safetensors or JSON file of this format.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The model has a tensor the checkpoint does not.
    #[error("{path}: no tensor `{tensor}` (is this checkpoint of another model?)")]
    MissingTensor {
        /// The checkpoint's index or file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A tensor's shape or dtype differs from the model's.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What differs.
        message: String,
    },
    /// The saved shards of a tensor do not cover the region a rank needs.
    #[error("{path}: tensor `{tensor}`: the saved shards cover {covered} of the {needed} elements this rank needs")]
    Coverage {
        /// The checkpoint directory.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Elements found.
        covered: usize,
        /// Elements needed.
        needed: usize,
    },
}

impl CheckpointError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        CheckpointError::Io { path: path.into(), error }
    }
    /// A format error in `path`.
    pub fn format(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        CheckpointError::Format { path: path.into(), message: message.to_string() }
    }
}

/// Result of adapter calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;
