//! The `nccl` backend: NVIDIA's NCCL on `cuda` devices (feature `nccl`).
//!
//! The communicator is the NCCL family's [`VendorComm`] (see
//! [`crate::nccl_family`] for how the contract maps onto the library); this
//! module is only where NCCL comes from and its quirks:
//! - **loading**: `$CHORUS_NCCL_LIB` (a full path), then `libnccl.so.2` (the
//!   only name pip's `nvidia-nccl-cu12` ships), `libnccl.so`, then cudarc's
//!   names, through the shared loader; a missing library is
//!   `DeviceError::LibraryUnavailable` naming the files tried;
//! - **versions**: one-rank `Avg`/`PreMulSum` are wrong before 2.29.7
//!   (NVIDIA/nccl#1950) and worked around; `ncclAlltoAll` is used from 2.28.

use std::sync::OnceLock;

use chorus_devices::cuda::{Cuda, CudaDevice};
use chorus_devices::loader::open_first;
use chorus_devices::DeviceError;

use crate::bootstrap::Store;
use crate::nccl_family::abi::Version;
use crate::nccl_family::result::Lib;
use crate::nccl_family::sys::Api;
use crate::nccl_family::{VendorComm, VendorConfig, VendorLib};
use crate::{CommError, Communicator, Result};

/// The variable that may name the library by full path.
pub const LIBRARY_VARIABLE: &str = "CHORUS_NCCL_LIB";

/// NCCL as a library of the family.
#[derive(Debug)]
pub enum Nccl {}

/// One rank's endpoint of an NCCL communicator on a cuda device.
pub type NcclComm = VendorComm<Nccl>;
/// Settings of an NCCL communicator.
pub type NcclConfig = VendorConfig;

/// The names tried, in order: `$CHORUS_NCCL_LIB`, pip's `libnccl.so.2`,
/// `libnccl.so`, then cudarc's candidates.
pub fn candidates() -> Vec<String> {
    let mut names = Vec::new();
    for n in ["libnccl.so.2".to_string(), "libnccl.so".to_string()]
        .into_iter()
        .chain(cudarc::get_lib_name_candidates("nccl"))
    {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

fn api() -> std::result::Result<&'static Api, DeviceError> {
    static API: OnceLock<std::result::Result<Api, DeviceError>> = OnceLock::new();
    API.get_or_init(|| {
        let names = candidates();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        Api::resolve(open_first("libnccl", LIBRARY_VARIABLE, &names)?, "libnccl", "NCCL 2.12 or newer")
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl VendorLib for Nccl {
    const NAME: &'static str = "nccl";
    type B = Cuda;

    fn lib() -> Result<Lib> {
        Ok(Lib { api: api().map_err(CommError::Device)?, name: "nccl" })
    }

    fn one_rank_scaling_broken(version: Version) -> bool {
        crate::nccl_family::abi::nccl_one_rank_scaling_broken(version)
    }
}

/// Where the library was found (the path or name it was opened by).
pub fn library_path() -> Result<String> {
    Ok(Nccl::lib()?.api.path.clone())
}

/// The loaded library's version.
pub fn version() -> Result<Version> {
    Nccl::lib()?.version()
}

impl VendorComm<Nccl> {
    /// Creates the device `ordinal` and the communicator on it (see
    /// [`VendorComm::init`]). Without a CUDA driver this is
    /// `CommError::Device(LibraryUnavailable)`.
    pub fn init_on_ordinal(
        store: &dyn Store,
        rank: usize,
        world_size: usize,
        ordinal: usize,
        config: NcclConfig,
    ) -> Result<Communicator<NcclComm>> {
        let device = CudaDevice::new(ordinal).map_err(CommError::Device)?;
        NcclComm::init(store, rank, world_size, device, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_rank_scaling_bug_is_gated_on_2_29_7() {
        let v = |major, minor, patch| Version { major, minor, patch };
        assert!(Nccl::one_rank_scaling_broken(v(2, 28, 3)));
        assert!(Nccl::one_rank_scaling_broken(v(2, 29, 6)));
        assert!(!Nccl::one_rank_scaling_broken(v(2, 29, 7)));
        assert!(!Nccl::one_rank_scaling_broken(v(2, 30, 0)));
        assert!(Nccl::one_rank_scaling_broken(Version::decode(22803)));
    }
}
