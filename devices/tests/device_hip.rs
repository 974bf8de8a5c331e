//! The device suite on the hip device: every operation checked against
//! host-computed values on a real AMD GPU. Ignored by a plain `cargo test`;
//! run it with `--include-ignored` on an AMD GPU (without one it fails).
#![cfg(feature = "rocm")]

mod common;
mod suite;

use chorus_devices::hip::{Hip, HipDevice};

device_suite!(
    #[ignore = "needs an AMD GPU (run it there with --include-ignored)"]
    Hip,
    || Ok(HipDevice::with_ordinal(0)?)
);
