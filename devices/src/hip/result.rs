//! One function per HIP / hipRTC call: the status becomes a typed error.
//!
//! A failing `hipError_t` becomes [`DeviceError::Backend`] with library
//! `libamdhip64`, the native code, and a message naming the call, the
//! status (`hipGetErrorName`) and its text (`hipGetErrorString`).
//! `hipErrorOutOfMemory` from an allocation becomes
//! [`DeviceError::OutOfMemory`]; `hipErrorNoDevice` / `hipErrorInvalidDevice`
//! from device selection become [`DeviceError::NoDevice`]. hipRTC failures
//! carry the compiler log.
//!
//! Functions that take raw handles are `unsafe`: the handle must be live
//! and belong to the current device.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::Mutex;

use super::sys::{self, hipError_t, hipEvent_t, hipFunction_t, hipModule_t, hipStream_t, HipLib};
use crate::DeviceError;

/// The library name in HIP errors.
pub const LIBRARY: &str = "libamdhip64";

fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: HIP returns pointers to static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The status's name and message, as HIP words them (`hipErrorNoDevice: no ROCm-capable device is detected`).
pub fn describe(lib: &HipLib, code: hipError_t) -> String {
    // SAFETY: both functions accept any status value.
    let (name, message) = unsafe { (text((lib.hipGetErrorName)(code)), text((lib.hipGetErrorString)(code))) };
    if name == message || message.is_empty() {
        name
    } else {
        format!("{name}: {message}")
    }
}

/// `Ok` for `hipSuccess`, else the typed error of `call`.
pub fn check(lib: &HipLib, code: hipError_t, call: &str) -> Result<(), DeviceError> {
    if code == sys::hipSuccess {
        return Ok(());
    }
    Err(DeviceError::Backend {
        library: LIBRARY,
        code: code as i64,
        message: format!("{call}: {}", describe(lib, code)),
    })
}

/// The loaded runtime.
pub fn lib() -> Result<&'static HipLib, DeviceError> {
    // Every HIP call goes through here: the host-function rule is enforced once.
    crate::host_fn::check("a HIP runtime call")?;
    sys::hip()
}

/// `hipGetDeviceCount`; a runtime with no device (`hipErrorNoDevice`) counts 0.
pub fn device_count() -> Result<usize, DeviceError> {
    let lib = lib()?;
    let mut n: c_int = 0;
    // SAFETY: out-pointer to a local.
    let code = unsafe { (lib.hipGetDeviceCount)(&mut n) };
    if code == sys::hipErrorNoDevice {
        return Ok(0);
    }
    check(lib, code, "hipGetDeviceCount")?;
    Ok(n.max(0) as usize)
}

/// `hipSetDevice`: makes `ordinal` the calling thread's current device.
/// A missing device is [`DeviceError::NoDevice`].
pub fn set_device(ordinal: usize) -> Result<(), DeviceError> {
    let lib = lib()?;
    let raw = c_int::try_from(ordinal).map_err(|_| DeviceError::invalid("hipSetDevice", "ordinal too large"))?;
    // SAFETY: plain value argument.
    let code = unsafe { (lib.hipSetDevice)(raw) };
    if code == sys::hipErrorNoDevice || code == sys::hipErrorInvalidDevice {
        let visible = device_count().unwrap_or(0);
        return Err(DeviceError::NoDevice { backend: "hip", ordinal, visible, reason: describe(lib, code) });
    }
    check(lib, code, "hipSetDevice")
}

/// `hipDeviceSynchronize`: blocks until the current device has finished all its work.
pub fn device_synchronize() -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: no arguments.
    check(lib, unsafe { (lib.hipDeviceSynchronize)() }, "hipDeviceSynchronize")
}

/// `hipInit(0)`. No usable device (`hipErrorNoDevice`, or `hipErrorInvalidDevice`
/// as ROCm 5 reports a missing driver) is [`DeviceError::NoDevice`].
pub fn init() -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: plain value argument.
    let code = unsafe { (lib.hipInit)(0) };
    if code == sys::hipErrorNoDevice || code == sys::hipErrorInvalidDevice {
        return Err(DeviceError::NoDevice { backend: "hip", ordinal: 0, visible: 0, reason: describe(lib, code) });
    }
    check(lib, code, "hipInit")
}

/// `hipDeviceGetName`.
pub fn device_name(ordinal: usize) -> Result<String, DeviceError> {
    let lib = lib()?;
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer holds `len` bytes; HIP NUL-terminates within it.
    check(
        lib,
        unsafe { (lib.hipDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, ordinal as c_int) },
        "hipDeviceGetName",
    )?;
    Ok(text(buf.as_ptr()))
}

/// `hipDeviceTotalMem`.
pub fn device_total_mem(ordinal: usize) -> Result<usize, DeviceError> {
    let lib = lib()?;
    let mut bytes = 0usize;
    // SAFETY: out-pointer to a local.
    check(lib, unsafe { (lib.hipDeviceTotalMem)(&mut bytes, ordinal as c_int) }, "hipDeviceTotalMem")?;
    Ok(bytes)
}

/// `hipRuntimeGetVersion` (HIP's encoding: `major * 10_000_000 + minor * 100_000 + patch`).
pub fn runtime_version() -> Result<i32, DeviceError> {
    let lib = lib()?;
    let mut v: c_int = 0;
    // SAFETY: out-pointer to a local.
    check(lib, unsafe { (lib.hipRuntimeGetVersion)(&mut v) }, "hipRuntimeGetVersion")?;
    Ok(v)
}

/// `hipDeviceGetStreamPriorityRange`: `(least, greatest)`; greater priority is a smaller number.
pub fn stream_priority_range() -> Result<(i32, i32), DeviceError> {
    let lib = lib()?;
    let (mut least, mut greatest): (c_int, c_int) = (0, 0);
    // SAFETY: out-pointers to locals.
    check(
        lib,
        unsafe { (lib.hipDeviceGetStreamPriorityRange)(&mut least, &mut greatest) },
        "hipDeviceGetStreamPriorityRange",
    )?;
    Ok((least, greatest))
}

/// `hipStreamCreateWithPriority(hipStreamNonBlocking, priority)` on the current device.
pub fn stream_create(priority: i32) -> Result<hipStream_t, DeviceError> {
    let lib = lib()?;
    let mut s: hipStream_t = ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check(
        lib,
        unsafe { (lib.hipStreamCreateWithPriority)(&mut s, sys::hipStreamNonBlocking, priority) },
        "hipStreamCreateWithPriority",
    )?;
    Ok(s)
}

/// `hipStreamDestroy`: returns at once; queued work still runs.
///
/// # Safety
/// `stream` is live and not used afterwards.
pub unsafe fn stream_destroy(stream: hipStream_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipStreamDestroy)(stream) }, "hipStreamDestroy")
}

/// `hipStreamWaitEvent(stream, event, 0)`.
///
/// # Safety
/// Both handles are live.
pub unsafe fn stream_wait_event(stream: hipStream_t, event: hipEvent_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipStreamWaitEvent)(stream, event, 0) }, "hipStreamWaitEvent")
}

/// `hipEventCreateWithFlags(hipEventDisableTiming)` on the current device.
pub fn event_create() -> Result<hipEvent_t, DeviceError> {
    let lib = lib()?;
    let mut e: hipEvent_t = ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check(
        lib,
        unsafe { (lib.hipEventCreateWithFlags)(&mut e, sys::hipEventDisableTiming) },
        "hipEventCreateWithFlags",
    )?;
    Ok(e)
}

/// `hipEventRecord`.
///
/// # Safety
/// Both handles are live and of one device.
pub unsafe fn event_record(event: hipEvent_t, stream: hipStream_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipEventRecord)(event, stream) }, "hipEventRecord")
}

/// `hipEventQuery`: `true` when the recorded work has finished, `false` while pending.
///
/// # Safety
/// `event` is live.
pub unsafe fn event_query(event: hipEvent_t) -> Result<bool, DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    match unsafe { (lib.hipEventQuery)(event) } {
        sys::hipSuccess => Ok(true),
        sys::hipErrorNotReady => Ok(false),
        code => check(lib, code, "hipEventQuery").map(|_| false),
    }
}

/// `hipEventDestroy`: safe while recorded work is pending (released when it completes).
///
/// # Safety
/// `event` is live and not used afterwards.
pub unsafe fn event_destroy(event: hipEvent_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipEventDestroy)(event) }, "hipEventDestroy")
}

/// `hipMallocAsync`: `bytes` (> 0) of device memory, usable in `stream`'s order.
///
/// # Safety
/// `stream` is live and of the current device.
pub unsafe fn malloc_async(bytes: usize, stream: hipStream_t, device: &str) -> Result<*mut c_void, DeviceError> {
    let lib = lib()?;
    let mut p: *mut c_void = ptr::null_mut();
    // SAFETY: out-pointer to a local; stream per the caller's contract.
    let code = unsafe { (lib.hipMallocAsync)(&mut p, bytes, stream) };
    if code == sys::hipErrorOutOfMemory {
        return Err(DeviceError::OutOfMemory { device: device.to_string(), bytes });
    }
    check(lib, code, "hipMallocAsync")?;
    Ok(p)
}

/// `hipFreeAsync`.
///
/// # Safety
/// `ptr` came from `hipMallocAsync`, is freed once, and no work ordered after this uses it.
pub unsafe fn free_async(ptr: *mut c_void, stream: hipStream_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipFreeAsync)(ptr, stream) }, "hipFreeAsync")
}

/// `hipMemcpyAsync`.
///
/// # Safety
/// Both ranges are valid for `bytes` of the given kind until the copy has run in `stream`'s order.
pub unsafe fn memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: sys::hipMemcpyKind,
    stream: hipStream_t,
) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipMemcpyAsync)(dst, src, bytes, kind, stream) }, "hipMemcpyAsync")
}

/// `hipMemcpy2DAsync` (pitches and width in bytes; each pitch ≥ width).
///
/// # Safety
/// Every row is valid for the copy until it has run in `stream`'s order.
#[allow(clippy::too_many_arguments)]
pub unsafe fn memcpy_2d_async(
    dst: *mut c_void,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: sys::hipMemcpyKind,
    stream: hipStream_t,
) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(
        lib,
        unsafe { (lib.hipMemcpy2DAsync)(dst, dpitch, src, spitch, width, height, kind, stream) },
        "hipMemcpy2DAsync",
    )
}

/// `hipHostMalloc(hipHostMallocDefault)`: `bytes` (> 0) of page-locked host memory.
pub fn host_malloc(bytes: usize) -> Result<*mut c_void, DeviceError> {
    let lib = lib()?;
    let mut p: *mut c_void = ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let code = unsafe { (lib.hipHostMalloc)(&mut p, bytes, 0) };
    if code == sys::hipErrorOutOfMemory {
        return Err(DeviceError::OutOfMemory { device: "host (page-locked)".into(), bytes });
    }
    check(lib, code, "hipHostMalloc")?;
    Ok(p)
}

/// `hipHostFree`.
///
/// # Safety
/// `ptr` came from `hipHostMalloc`, is freed once, and no queued copy uses it.
pub unsafe fn host_free(ptr: *mut c_void) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipHostFree)(ptr) }, "hipHostFree")
}

/// `hipMemsetAsync` (byte value).
///
/// # Safety
/// `dst` is valid for `bytes` until the fill has run in `stream`'s order.
pub unsafe fn memset_async(dst: *mut c_void, value: u8, bytes: usize, stream: hipStream_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipMemsetAsync)(dst, value as c_int, bytes, stream) }, "hipMemsetAsync")
}

/// `hipModuleLoadData` on the current device.
pub fn module_load(image: &[u8]) -> Result<hipModule_t, DeviceError> {
    let lib = lib()?;
    let mut m: hipModule_t = ptr::null_mut();
    // SAFETY: the image is a complete code object that outlives the call.
    check(lib, unsafe { (lib.hipModuleLoadData)(&mut m, image.as_ptr().cast()) }, "hipModuleLoadData")?;
    Ok(m)
}

/// `hipModuleGetFunction`.
///
/// # Safety
/// `module` is live.
pub unsafe fn module_get_function(module: hipModule_t, name: &str) -> Result<hipFunction_t, DeviceError> {
    let lib = lib()?;
    let c = CString::new(name).map_err(|_| DeviceError::invalid("hipModuleGetFunction", "NUL in kernel name"))?;
    let mut f: hipFunction_t = ptr::null_mut();
    // SAFETY: per the caller's contract; `c` outlives the call.
    check(lib, unsafe { (lib.hipModuleGetFunction)(&mut f, module, c.as_ptr()) }, "hipModuleGetFunction")?;
    Ok(f)
}

/// `hipModuleUnload`.
///
/// # Safety
/// `module` is live, and no queued launch of its functions remains.
pub unsafe fn module_unload(module: hipModule_t) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract.
    check(lib, unsafe { (lib.hipModuleUnload)(module) }, "hipModuleUnload")
}

/// `hipModuleLaunchKernel` with a 1-D or 2-D grid and `params` (one pointer per kernel argument).
///
/// # Safety
/// `function` and `stream` are live and of one device; `params` match the
/// kernel's signature; the memory the kernel touches stays valid until it has run.
pub unsafe fn launch_kernel(
    function: hipFunction_t,
    grid: (u32, u32),
    block: (u32, u32),
    shared_bytes: u32,
    stream: hipStream_t,
    params: &mut [*mut c_void],
) -> Result<(), DeviceError> {
    let lib = lib()?;
    // SAFETY: per the caller's contract; HIP copies the argument values during the call.
    check(
        lib,
        unsafe {
            (lib.hipModuleLaunchKernel)(
                function,
                grid.0,
                grid.1,
                1,
                block.0,
                block.1,
                1,
                shared_bytes,
                stream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        },
        "hipModuleLaunchKernel",
    )
}

/// Work for the host, run in stream order: called once with `Ok` when the
/// stream reaches it, or with the stream's error status.
pub type HostWork = Box<dyn FnOnce(Result<(), i32>) + Send>;

unsafe extern "C" fn host_fn_trampoline(user: *mut c_void) {
    // SAFETY: `user` is the `Box<HostWork>` leaked by `launch_host_work`, handed over once.
    let work = unsafe { Box::from_raw(user as *mut HostWork) };
    // Marked as a host function (HIP calls refused); a panic must not unwind into the runtime.
    let _ = crate::host_fn::run(move || work(Ok(())));
}

unsafe extern "C" fn callback_trampoline(_stream: hipStream_t, status: hipError_t, user: *mut c_void) {
    // SAFETY: as in `host_fn_trampoline`.
    let work = unsafe { Box::from_raw(user as *mut HostWork) };
    let outcome = if status == sys::hipSuccess { Ok(()) } else { Err(status) };
    let _ = crate::host_fn::run(move || work(outcome));
}

/// Enqueues `work` on `stream`: `hipLaunchHostFunc` where the runtime has it,
/// else `hipStreamAddCallback` (ROCm 5.2 and older). `work` must not call
/// HIP (the runtime forbids it in host functions). If enqueueing fails,
/// `work` comes back with the error, uncalled, so the caller decides when
/// the memory it owns may be released.
///
/// # Safety
/// `stream` is live.
pub unsafe fn launch_host_work(stream: hipStream_t, work: HostWork) -> Result<(), (DeviceError, HostWork)> {
    let lib = match lib() {
        Ok(l) => l,
        Err(e) => return Err((e, work)),
    };
    let user = Box::into_raw(Box::new(work)) as *mut c_void;
    // SAFETY: the trampolines take back exactly this box.
    let (code, call) = unsafe {
        match lib.hipLaunchHostFunc {
            Some(launch) => (launch(stream, host_fn_trampoline, user), "hipLaunchHostFunc"),
            None => ((lib.hipStreamAddCallback)(stream, callback_trampoline, user, 0), "hipStreamAddCallback"),
        }
    };
    match check(lib, code, call) {
        Ok(()) => Ok(()),
        // SAFETY: not enqueued, so the runtime did not take `user`.
        Err(e) => Err((e, *unsafe { Box::from_raw(user as *mut HostWork) })),
    }
}

/// The hipRTC error of `call`, with the compiler log when there is one.
fn rtc_check(lib: &sys::RtcLib, code: sys::hiprtcResult, call: &str, log: &str) -> Result<(), DeviceError> {
    if code == sys::HIPRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: accepts any status.
    let what = text(unsafe { (lib.hiprtcGetErrorString)(code) });
    let log = if log.is_empty() { String::new() } else { format!("\n{log}") };
    Err(DeviceError::Backend { library: "hiprtc", code: code as i64, message: format!("{call}: {what}{log}") })
}

/// `hiprtcVersion`: `(major, minor)`.
pub fn rtc_version() -> Result<(i32, i32), DeviceError> {
    let lib = sys::hiprtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: out-pointers to locals.
    rtc_check(lib, unsafe { (lib.hiprtcVersion)(&mut major, &mut minor) }, "hiprtcVersion", "")?;
    Ok((major, minor))
}

/// Compiles HIP C++ `source` with hipRTC and returns the code object.
/// `options` are compiler flags (`--offload-arch=gfx90a`, `-O3`, ...);
/// without `--offload-arch`, hipRTC compiles for the current device. A
/// compile error carries the compiler's log. Compiles are serialized
/// process-wide (hipRTC is not safe to call from two threads at once).
pub fn rtc_compile(source: &str, name: &str, options: &[String]) -> Result<Vec<u8>, DeviceError> {
    // hipRTC (ROCm 5.2's, at least) crashes when two threads compile at
    // once, so compiles are serialized process-wide; each runs once per
    // kernel and device, so this costs little.
    static COMPILER: Mutex<()> = Mutex::new(());
    let _one_at_a_time = COMPILER.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let lib = sys::hiprtc()?;
    let bad = |what: &str| DeviceError::invalid("hiprtcCreateProgram", format!("NUL byte in the {what}"));
    let src = CString::new(source).map_err(|_| bad("source"))?;
    let cname = CString::new(name).map_err(|_| bad("program name"))?;
    let opts: Vec<CString> =
        options.iter().map(|o| CString::new(o.as_str())).collect::<Result<_, _>>().map_err(|_| bad("options"))?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut prog: sys::hiprtcProgram = ptr::null_mut();
    // SAFETY: NUL-terminated strings that outlive the call; no headers.
    let code =
        unsafe { (lib.hiprtcCreateProgram)(&mut prog, src.as_ptr(), cname.as_ptr(), 0, ptr::null(), ptr::null()) };
    rtc_check(lib, code, "hiprtcCreateProgram", "")?;

    let result = (|| {
        // SAFETY: `prog` is live; the option array outlives the call.
        let code = unsafe { (lib.hiprtcCompileProgram)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        if code != sys::HIPRTC_SUCCESS {
            let log = program_log(lib, prog);
            return rtc_check(lib, code, &format!("hiprtcCompileProgram({name})"), &log).map(|_| Vec::new());
        }
        let mut size = 0usize;
        // SAFETY: `prog` is live.
        rtc_check(lib, unsafe { (lib.hiprtcGetCodeSize)(prog, &mut size) }, "hiprtcGetCodeSize", "")?;
        let mut code_object = vec![0u8; size];
        // SAFETY: the buffer holds `size` bytes.
        rtc_check(lib, unsafe { (lib.hiprtcGetCode)(prog, code_object.as_mut_ptr().cast()) }, "hiprtcGetCode", "")?;
        Ok(code_object)
    })();
    // SAFETY: created above, destroyed once.
    let _ = unsafe { (lib.hiprtcDestroyProgram)(&mut prog) };
    result
}

fn program_log(lib: &sys::RtcLib, prog: sys::hiprtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is live.
    if unsafe { (lib.hiprtcGetProgramLogSize)(prog, &mut size) } != sys::HIPRTC_SUCCESS || size == 0 {
        return String::new();
    }
    let mut log = vec![0u8; size + 1];
    // SAFETY: the buffer holds the log and its NUL.
    if unsafe { (lib.hiprtcGetProgramLog)(prog, log.as_mut_ptr().cast()) } != sys::HIPRTC_SUCCESS {
        return String::new();
    }
    String::from_utf8_lossy(&log).trim_end_matches('\0').trim_end().to_string()
}
