//! The device suite on the cuda device: every operation checked against
//! host-computed values on a real GPU. Without a GPU (or driver) each test
//! prints why it was skipped and passes; `ci/gpu-check.sh` runs it on GPU nodes.
#![cfg(feature = "cuda")]

mod common;
mod suite;

use chorus_devices::cuda::{Cuda, CudaDevice};

/// Why the suite cannot run here, if it cannot.
fn no_gpu() -> Option<String> {
    match chorus_devices::cuda::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("no CUDA device is visible".into()),
        Err(e) => Some(format!("no CUDA driver: {e}")),
    }
}

device_suite!(Cuda, || Ok(CudaDevice::new(0)?), no_gpu());
