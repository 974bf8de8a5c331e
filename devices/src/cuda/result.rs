//! Vendor status codes to [`DeviceError`]s, keeping the native code and message.

use cudarc::cublas::result::CublasError;
use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;
use cudarc::nvrtc::result::NvrtcError;

use crate::call_count::CallCounter;
use crate::DeviceError;

/// A driver call's failure. Out-of-memory keeps its own variant.
pub(crate) fn driver(call: &'static str, e: DriverError, device: &str, bytes: usize) -> DeviceError {
    if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return DeviceError::OutOfMemory { device: device.to_string(), bytes };
    }
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    DeviceError::Backend { library: "libcuda", code: e.0 as i64, message: format!("{call}: {name}: {text}") }
}

/// Driver calls of this process by entry point, while counting
/// ([`crate::Device::count_calls`] on a cuda device): every call made
/// through [`DriverResult`], which is every driver call chorus makes apart
/// from the polls of host waits.
pub(crate) static DRIVER_CALLS: CallCounter = CallCounter::new();

/// `?` for driver results: `.drv("cuMemAllocAsync", dev)?`. Counts the call.
pub(crate) trait DriverResult<T> {
    /// Converts a driver error, naming the call and the device.
    fn drv(self, call: &'static str, device: &str) -> Result<T, DeviceError>;
    /// Like `drv`, for an allocation of `bytes` (so out-of-memory says how much).
    fn drv_alloc(self, call: &'static str, device: &str, bytes: usize) -> Result<T, DeviceError>;
}

impl<T> DriverResult<T> for Result<T, DriverError> {
    fn drv(self, call: &'static str, device: &str) -> Result<T, DeviceError> {
        DRIVER_CALLS.note(call);
        self.map_err(|e| driver(call, e, device, 0))
    }
    fn drv_alloc(self, call: &'static str, device: &str, bytes: usize) -> Result<T, DeviceError> {
        DRIVER_CALLS.note(call);
        self.map_err(|e| driver(call, e, device, bytes))
    }
}

/// An NVRTC failure; `log` is the compiler's output, if any.
pub(crate) fn nvrtc(call: &'static str, e: NvrtcError, log: &str) -> DeviceError {
    let mut message = format!("{call}: {:?}", e.0);
    if !log.is_empty() {
        message.push_str(": ");
        message.push_str(log.trim());
    }
    DeviceError::Backend { library: "libnvrtc", code: e.0 as i64, message }
}

/// A cuBLAS failure.
pub(crate) fn cublas(call: &'static str, e: CublasError) -> DeviceError {
    DeviceError::Backend { library: "libcublas", code: e.0 as i64, message: format!("{call}: {:?}", e.0) }
}
