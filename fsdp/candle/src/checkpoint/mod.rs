//! Sharded safetensors checkpoints that reshard on load, and their
//! consolidation into plain safetensors files.
//!
//! # Layout (PyTorch distributed checkpoint's, for safetensors)
//! [`save`] writes, under a root directory, one directory per checkpoint:
//!
//! ```text
//! root/step-00000040/
//!     shard-00000-model-00001-of-00001.safetensors   this shard rank's parameter boxes
//!     shard-00000-optim-00001-of-00001.safetensors   its optimizer state (exp_avg, exp_avg_sq, step; momentum_buffer)
//!     shard-00001-model-00001-of-00001.safetensors   ...one pair per shard rank
//!     model.safetensors.index.json                   {"metadata": {"total_size"}, "weight_map": {name: file}}
//!     training_state.json                            step, data seed, losses, the model's configuration
//!     chorus_checkpoint.json                         manifest: tensors, world, optimizer, every file's size and CRC-32
//! root/latest                                        "step-00000040": the last complete checkpoint
//! ```
//!
//! Every file records the identity of the save that wrote it
//! (`chorus_save_id`: a random 64-bit id the first rank draws and every rank
//! receives), in a safetensors file's `__metadata__`, the index's `metadata`
//! and the JSON files; a load refuses a checkpoint whose files come from two
//! saves ([`CheckpointError::Mixed`](crate::CheckpointError::Mixed)).
//!
//! Each shard file is a plain safetensors file holding, for every parameter
//! of which this rank holds real rows, the unpadded box of the full tensor
//! it holds; the file's `__metadata__` records where each box starts in the
//! full tensor as PyTorch's Hugging Face storage writer does
//! (`DCP_SHARDING_INFO`: `{name: {"saved_offsets": [...]}}`, with
//! `DCP_VERSION` and `format: pt`). Replicated parameters are written whole
//! by the first shard rank; with HSDP only the first replica writes.
//!
//! # Loading at any world size and mesh
//! [`load`] lets every rank compute the box its *new* shard covers (FSDP's
//! layout over the new shard world), memory-map the shard files, and copy
//! the intersection of each saved box with its own: a checkpoint saved at 4
//! ranks loads at 3, at 2 × 2 HSDP or at 1.
//!
//! A load uses every saved tensor: a checkpoint with tensors the model lacks
//! (saved with more layers) is refused, as is one saved with another
//! optimizer, or with other optimizer settings unless
//! [`LoadOptions::allow_optimizer_change`]; the optimizer's state must be
//! complete (every moment of every parameter).
//!
//! # Nothing lost
//! A save writes into a temporary directory beside the destination named
//! after the save's identity (`.tmp-step-00000040-<id>`, so two writers never
//! share one), syncs every file and the directory, moves it into place, and
//! only then replaces `latest` (written to a temporary name, synced,
//! renamed). A checkpoint of the same step already there is exchanged with
//! the new one in one step (`renameat2(RENAME_EXCHANGE)`), so `latest` never
//! names a missing directory; where the file system cannot exchange, the old
//! one is renamed aside first ([`replace_dir`]), and [`recover`], which the
//! next writer runs holding the root's lock, puts a copy a crash left aside
//! back (never deleting the only complete copy of a step). A crash at any
//! point leaves the previous checkpoint and `latest` intact, or recoverable. With [`SaveOptions::keep_last`], older
//! `step-*` checkpoints are then removed (each renamed away first, so none is
//! ever seen half-deleted), never the one `latest` names nor those in
//! [`SaveOptions::keep`]. The manifest records each file's size and CRC-32,
//! checked before a file is used; a missing, truncated, corrupt, mixed or
//! mismatched (another model, shape or dtype) file is a
//! [`CheckpointError`](crate::CheckpointError) naming the file and the tensor.
//!
//! # Saves that do not hold the step
//! [`save_async`] copies each rank's shards and optimizer state to host
//! memory (the only part the step waits for: one copy of the rank's share
//! of the state, [`PendingSave::staged_bytes`]) and writes them from a
//! thread of its own, which also makes the pass over its files (size,
//! CRC-32, header) that the first rank's commit would otherwise make;
//! [`PendingSave::commit`], a collective every rank calls at the same step,
//! completes the checkpoint exactly as [`save`] does, so a checkpoint
//! written either way is the same, and one interrupted before its commit
//! leaves `latest` on the previous one. One save at a time: `chorus train
//! --async-save` commits a save once every rank's writer is done
//! ([`PendingSave::written_everywhere`], asked at every step while one is
//! in flight), or before the next save, or at the end.
//!
//! One writer per checkpoint root: the save does not lock the root (`chorus
//! train` does, as it locks its out-dir); two writers into one root each
//! write complete checkpoints, the last rename of each step wins.
//!
//! # Files
//! `geometry.rs`: which box of which tensor a rank holds, and copying the
//! part two boxes share; `files.rs`: the file names, the manifest, writing
//! durably and reading through checked memory maps; `place.rs`: putting a
//! directory in place of another and recovering an interrupted replacement
//! (`chorus train`'s out-dir uses it too); `save.rs`: every rank's
//! shards (streamed, or staged and written by a thread), then the first
//! rank's index, manifest and renames; `load.rs`:
//! resuming at any world size, and consolidating into full tensors.

use chorus_fsdp::OptimizerKind;
use serde::{Deserialize, Serialize};

mod files;
mod geometry;
mod load;
mod place;
mod save;

pub use files::resolve;
pub use load::{
    consolidate, consolidate_stage, inspect, load, optimizer_changes, read_training_state, FullTensors, Inspected,
    LoadOptions,
};
pub use place::{exchange, recover, recover_aside, replace_dir, Recovered};
pub use save::{save, save_async, PendingSave, SaveOptions};

/// Version string of [`chorus_checkpoint.json`](self).
pub const FORMAT: &str = "chorus-fsdp-checkpoint/1";

/// What a training loop needs to continue where it stopped (`training_state.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Steps completed: the next step to run.
    pub step: u64,
    /// The seed the data's windows are drawn from (the data RNG).
    pub data_seed: u64,
    /// The losses of the steps so far, as the loop reported them.
    #[serde(default)]
    pub losses: Vec<f64>,
    /// The model's configuration as the training loop describes it (for the
    /// transformer, its sizes), which a resume checks: some settings (the
    /// number of attention heads) change the model without changing any
    /// tensor's shape. `null` where none was recorded.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub model: serde_json::Value,
}

/// The optimizer and its settings as JSON (`{"kind": "adamw", "lr": ...}`):
/// the manifest's `optimizer`, which a load checks the run's against, and
/// the same object `chorus train` reports in its summary.
pub fn optimizer_json(kind: OptimizerKind) -> serde_json::Value {
    match kind {
        OptimizerKind::Sgd { lr, momentum, dampening, weight_decay, nesterov } => serde_json::json!({
            "kind": "sgd", "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov,
        }),
        OptimizerKind::AdamW { lr, beta1, beta2, eps, weight_decay } => serde_json::json!({
            "kind": "adamw", "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        }),
    }
}
