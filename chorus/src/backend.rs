//! The communication backend a build selected: one cargo feature per
//! backend, the most specific one enabled wins, so flipping a feature moves
//! the same program from the simulator to GPUs.

/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(feature = "nccl")]
pub type SelectedBackend = chorus_collectives::nccl::NcclComm;
/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(all(feature = "rccl", not(feature = "nccl")))]
pub type SelectedBackend = chorus_collectives::rccl::RcclComm;
/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(all(feature = "ucx", not(any(feature = "nccl", feature = "rccl"))))]
pub type SelectedBackend = chorus_collectives::ucx::UcxComm;
/// The communication backend this build selected: the most specific
/// backend feature enabled (`nccl`, then `rccl`, then `ucx`, then `sim`).
#[cfg(all(feature = "sim", not(any(feature = "nccl", feature = "rccl", feature = "ucx"))))]
pub type SelectedBackend = chorus_collectives::sim::SimComm;

#[cfg(not(any(feature = "sim", feature = "ucx", feature = "nccl", feature = "rccl")))]
compile_error!("chorus needs a backend feature: `sim` (the default), `ucx`, `nccl` or `rccl`");

/// The name of [`SelectedBackend`]: `"nccl"`, `"rccl"`, `"ucx"` or `"sim"`.
pub const SELECTED_BACKEND: &str = if cfg!(feature = "nccl") {
    "nccl"
} else if cfg!(feature = "rccl") {
    "rccl"
} else if cfg!(feature = "ucx") {
    "ucx"
} else {
    "sim"
};
