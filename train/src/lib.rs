//! The reference models and the training loop that drive FSDP through its
//! public API: an example of using `chorus-fsdp`, not part of it.
//!
//! - [`mlp`]: an MLP whose forward and backward are device-layer operations,
//!   registered as one FSDP param group per layer, so the same model trains
//!   on every backend; with a deterministic initialisation.
//! - [`train`]: the loop behind `chorus train` — data, optimizer, clipping,
//!   losses, step times, peak memory and FSDP's host overhead per rank.
//! - [`npy`]: float32 `.npy` files, the interchange with PyTorch and NumPy
//!   users for initial weights, data and trained parameters.
//!
//! Everything here uses only what `chorus-fsdp` exports, and reports errors
//! as [`FsdpError`](chorus_fsdp::FsdpError) so a caller handles one error
//! type for a training step.
#![warn(missing_docs)]

pub mod mlp;
pub mod npy;
pub mod train;
