//! The device suite on the hip device: every operation checked against
//! host-computed values on a real AMD GPU. Without one each test prints why
//! it was skipped and passes.
#![cfg(feature = "rocm")]

mod common;
mod suite;

use chorus_devices::hip::{Hip, HipDevice};

/// Why the suite cannot run here, if it cannot.
fn no_gpu() -> Option<String> {
    match chorus_devices::hip::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("no HIP device is visible".into()),
        Err(e) => Some(format!("no HIP runtime: {e}")),
    }
}

device_suite!(Hip, || Ok(HipDevice::with_ordinal(0)?), no_gpu());
