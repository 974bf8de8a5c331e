//! The `rccl` backend: AMD GPUs through RCCL, on the `hip` device (feature `rccl`).
//!
//! RCCL is a port of NCCL and keeps its C ABI, so the communicator is the
//! NCCL family's [`VendorComm`] (see [`crate::nccl_family`] for how the contract
//! maps onto the library); this module is only where RCCL comes from and
//! its quirks:
//! - **loading**: `$CHORUS_RCCL_LIB` (a full path), then `librccl.so`,
//!   `librccl.so.1`, through the shared loader (there is no `rccl-sys`;
//!   nothing links against ROCm); a missing library is
//!   `DeviceError::LibraryUnavailable` naming the files tried and the
//!   variable;
//! - **versions**: RCCL spells all-to-all `ncclAllToAll`; `split` needs
//!   `ncclCommSplit` (ROCm 6.0's RCCL 2.18); older RCCLs lack the
//!   non-blocking config call and are initialized blocking; the fix of
//!   NVIDIA/nccl#1950 (one-rank `Avg`/`PreMulSum`) has no known RCCL release,
//!   so one-rank scaling is always worked around.

use std::sync::OnceLock;

use chorus_devices::hip::Hip;
use chorus_devices::loader::open_first;
use chorus_devices::DeviceError;

use crate::nccl_family::abi::{UniqueId, Version};
use crate::nccl_family::result::Lib;
use crate::nccl_family::sys::Api;
use crate::nccl_family::{VendorComm, VendorConfig, VendorLib};
use crate::{CommError, Result};

/// The variable that points to RCCL.
pub const RCCL_VARIABLE: &str = "CHORUS_RCCL_LIB";
/// File names tried for RCCL, in order, after the variable.
pub const RCCL_NAMES: [&str; 2] = ["librccl.so", "librccl.so.1"];

/// RCCL as a library of the family.
#[derive(Debug)]
pub enum Rccl {}

/// One rank's RCCL communicator on a hip device.
pub type RcclComm = VendorComm<Rccl>;
/// Settings of an RCCL communicator.
pub type RcclConfig = VendorConfig;

fn api() -> std::result::Result<&'static Api, DeviceError> {
    static API: OnceLock<std::result::Result<Api, DeviceError>> = OnceLock::new();
    API.get_or_init(|| {
        Api::resolve(open_first("librccl", RCCL_VARIABLE, &RCCL_NAMES)?, "librccl", "RCCL 2.12 or newer")
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl VendorLib for Rccl {
    const NAME: &'static str = "rccl";
    type B = Hip;

    fn lib() -> Result<Lib> {
        Ok(Lib { api: api().map_err(CommError::Device)?, name: "rccl" })
    }

    fn one_rank_scaling_broken(_version: Version) -> bool {
        true
    }
}

/// Where the library was found.
pub fn library_path() -> Result<String> {
    Ok(Rccl::lib()?.api.path.clone())
}

/// The loaded library's version.
pub fn version() -> Result<Version> {
    Rccl::lib()?.version()
}

/// A new unique id (`ncclGetUniqueId`), for rank 0 to hand to the others.
pub fn unique_id() -> Result<UniqueId> {
    RcclComm::unique_id()
}

/// Whether RCCL can be loaded (loads it if not yet loaded).
pub fn is_available() -> bool {
    api().is_ok()
}
