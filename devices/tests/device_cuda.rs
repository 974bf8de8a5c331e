//! The device suite on the cuda device: every operation checked against
//! host-computed values on a real GPU. Ignored by a plain `cargo test`;
//! `ci/gpu-check.sh` runs it on GPU nodes with `--include-ignored` (without a
//! GPU or driver, a run with `--ignored` fails).
#![cfg(feature = "cuda")]

mod common;
mod suite;

use chorus_devices::cuda::{Cuda, CudaDevice};

device_suite!(
    #[ignore = "needs a CUDA GPU (ci/gpu-check.sh runs it)"]
    Cuda,
    || Ok(CudaDevice::new(0)?)
);
