//! candle's CUDA device (feature `candle-cuda`) on a machine without a GPU:
//! a typed error naming what is missing, never cudarc's panic.
#![cfg(feature = "candle-cuda")]

use chorus_devices::DeviceError;
use chorus_fsdp::FsdpError;
use chorus_fsdp_candle::{cuda_device, Error};

#[test]
fn candle_cuda_device_is_a_typed_error_where_cuda_is_missing() {
    // cudarc panics on a library it cannot load; the adapter probes first.
    let made = std::panic::catch_unwind(|| cuda_device(0)).expect("cuda_device panicked");
    match chorus_devices::cuda::driver_library() {
        Err(_) => match made {
            Err(Error::Fsdp(FsdpError::Device(DeviceError::LibraryUnavailable { library, variable, .. }))) => {
                assert_eq!(library, "libcuda");
                assert!(variable.contains("CHORUS_CUDA_LIB"), "{variable}");
            }
            other => panic!("expected libcuda's LibraryUnavailable, got {other:?}"),
        },
        // A driver: a GPU gives a device; a driver without a GPU or cuRAND a typed error.
        Ok(_) => {
            if let Err(e) = made {
                assert!(matches!(e, Error::Fsdp(FsdpError::Device(_))), "{e}");
            }
        }
    }
}
