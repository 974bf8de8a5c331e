//! Loading NCCL without a GPU: the library answers `ncclGetVersion` and
//! `ncclGetUniqueId` (CI installs pip's `nvidia-nccl-cu12` and points
//! `CHORUS_NCCL_LIB` at it); creating a communicator without a CUDA driver is
//! a typed error, never a panic. With a GPU, a one-rank world runs for real.
//!
//! Each test that needs what a machine may lack (NCCL, a GPU, or no CUDA
//! driver) is `#[ignore]`d with its prerequisite, so a plain `cargo test`
//! reports it as not run; where the prerequisite is provided it runs with
//! `--include-ignored` (ci/test.sh, ci/gpu-check.sh) and fails if it is
//! missing after all. None passes without checking its subject.
#![cfg(feature = "nccl")]

use std::time::Duration;

use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl::{self, NcclComm, NcclConfig, LIBRARY_VARIABLE};
use chorus_collectives::nccl_abi::{UniqueId, Version};
use chorus_collectives::{CommError, ReduceOp};
use chorus_devices::{Buffer, DType, Device, DeviceError, Priority, StreamExt};

#[test]
fn pip_name_is_tried_first_after_the_variable() {
    // The loader tries the variable before every name (chorus_devices::loader).
    let names = nccl::candidates();
    assert_eq!(names.first().map(String::as_str), Some("libnccl.so.2"), "{names:?}");
}

/// NCCL, loaded; a test that needs it and does not find it fails (it is
/// run only where its prerequisite is provided: `--include-ignored`).
fn nccl() -> Version {
    nccl::version().unwrap_or_else(|e| {
        panic!("NCCL must load here ({LIBRARY_VARIABLE}, set by ci/vendor-libs.sh, or the system's libnccl.so.2): {e}")
    })
}

#[test]
#[ignore = "needs NCCL (CHORUS_NCCL_LIB; ci/vendor-libs.sh installs pip's and ci/test.sh runs this with --include-ignored)"]
fn version_and_unique_id_without_a_gpu() {
    let v = nccl();
    assert!(v.at_least(2, 18), "NCCL {v} is older than chorus needs");
    let id = NcclComm::unique_id().expect("ncclGetUniqueId");
    assert_ne!(id, UniqueId::from_bytes([0; 128]));
    assert_ne!(id, NcclComm::unique_id().expect("a second id"));
    println!("NCCL {v} from {}", nccl::library_path().unwrap_or_default());
}

#[test]
#[ignore = "needs NCCL and no CUDA driver (ci/test.sh provides both and runs this with --include-ignored)"]
fn a_communicator_without_a_cuda_driver_is_a_typed_error() {
    nccl();
    let store = MemStore::new();
    let config = NcclConfig { timeout: Duration::from_secs(30), ..NcclConfig::default() };
    match NcclComm::init_on_ordinal(&store, 0, 1, 0, config) {
        Err(CommError::Device(DeviceError::LibraryUnavailable { library, variable, .. })) => {
            assert_eq!(library, "libcuda");
            assert!(variable.contains("CHORUS_CUDA_LIB"), "{variable}");
        }
        Err(other) => panic!("expected the missing CUDA driver as a typed error, got: {other}"),
        Ok(_) => panic!("a CUDA driver and GPU are here: run a_one_rank_world_runs_on_a_gpu instead"),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (ci/gpu-check.sh runs it with --include-ignored)"]
fn a_one_rank_world_runs_on_a_gpu() {
    nccl();
    let store = MemStore::new();
    let config = NcclConfig { timeout: Duration::from_secs(30), ..NcclConfig::default() };
    let comm = NcclComm::init_on_ordinal(&store, 0, 1, 0, config).expect("a one-rank NCCL world on GPU 0");
    let s = comm.device().create_stream(Priority::Normal).expect("stream");
    let b = s.buffer_from(&[1.0f32, 2.0, 3.0]).expect("upload");
    comm.all_reduce_in_place(b.view(), ReduceOp::PreMulSum(2.0), &s).expect("all_reduce");
    comm.barrier(&s).expect("barrier");
    assert_eq!(s.read_vec::<f32>(b.view()).expect("readback"), vec![2.0, 4.0, 6.0]);
    assert_eq!(b.dtype(), DType::F32);
}
