//! Loading NCCL without a GPU: the library answers `ncclGetVersion` and
//! `ncclGetUniqueId` (CI installs pip's `nvidia-nccl-cu12` and points
//! `CHORUS_NCCL_LIB` at it); creating a communicator without a CUDA driver is
//! a typed error, never a panic. With a GPU, a one-rank world runs for real.
#![cfg(feature = "nccl")]

use std::time::Duration;

use chorus_collectives::bootstrap::MemStore;
use chorus_collectives::nccl::{self, NcclComm, NcclConfig, LIBRARY_VARIABLE};
use chorus_collectives::nccl_abi::UniqueId;
use chorus_collectives::{CommError, ReduceOp};
use chorus_devices::{Buffer, DType, Device, DeviceError, Priority, StreamExt};

fn library_expected() -> bool {
    std::env::var(LIBRARY_VARIABLE).is_ok_and(|v| !v.is_empty())
}

#[test]
fn pip_name_is_tried_first_after_the_variable() {
    // The loader tries the variable before every name (chorus_devices::loader).
    let names = nccl::candidates();
    assert_eq!(names.first().map(String::as_str), Some("libnccl.so.2"), "{names:?}");
}

#[test]
fn version_and_unique_id_without_a_gpu() {
    match nccl::version() {
        Ok(v) => {
            assert!(v.at_least(2, 18), "NCCL {v} is older than chorus needs");
            let id = NcclComm::unique_id().expect("ncclGetUniqueId");
            assert_ne!(id, UniqueId::from_bytes([0; 128]));
            assert_ne!(id, NcclComm::unique_id().expect("a second id"));
            println!("NCCL {v} from {}", nccl::library_path().unwrap_or_default());
        }
        Err(CommError::Device(DeviceError::LibraryUnavailable { library, tried, variable })) => {
            assert!(!library_expected(), "{LIBRARY_VARIABLE} is set but NCCL did not load: {tried}");
            assert_eq!(library, "libnccl");
            assert!(tried.contains("libnccl.so.2"), "{tried}");
            assert!(variable.contains("CHORUS_NCCL_LIB"));
            eprintln!("skipped: NCCL is not installed (run ci/vendor-libs.sh)");
        }
        Err(other) => panic!("unexpected error: {other}"),
    }
}

#[test]
fn a_communicator_without_a_driver_is_a_typed_error() {
    let store = MemStore::new();
    let config = NcclConfig { timeout: Duration::from_secs(30), ..NcclConfig::default() };
    match NcclComm::init_on_ordinal(&store, 0, 1, 0, config) {
        Err(CommError::Device(DeviceError::LibraryUnavailable { library, variable, .. })) => {
            assert!(library == "libcuda" || library == "libnccl", "{library}");
            assert!(variable.contains("CHORUS_"), "{variable}");
        }
        // A driver without a usable GPU.
        Err(CommError::Device(DeviceError::Backend { library: "libcuda", .. })) => {}
        Err(other) => panic!("unexpected error: {other}"),
        Ok(comm) => {
            // A GPU is here: a one-rank world must work.
            let s = comm.device().create_stream(Priority::Normal).expect("stream");
            let b = s.buffer_from(&[1.0f32, 2.0, 3.0]).expect("upload");
            comm.all_reduce_in_place(b.view(), ReduceOp::PreMulSum(2.0), &s).expect("all_reduce");
            comm.barrier(&s).expect("barrier");
            assert_eq!(s.read_vec::<f32>(b.view()).expect("readback"), vec![2.0, 4.0, 6.0]);
            assert_eq!(b.dtype(), DType::F32);
        }
    }
}
