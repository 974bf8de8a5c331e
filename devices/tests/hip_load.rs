//! The `rocm` feature on a machine without an AMD GPU: HIP loads from the
//! distribution's runtime (Debian's `libamdhip64-5`, installed by
//! `ci/vendor-hip.sh`), a device cannot be opened and says so with a typed
//! error, and the shared kernel source compiles with hipRTC for real AMD
//! architectures (compiling needs no GPU).
#![cfg(feature = "rocm")]

use chorus_devices::hip::{self, kernels, result, sys, HipDevice};
use chorus_devices::DeviceError;

fn runtime() -> &'static sys::HipLib {
    sys::hip().unwrap_or_else(|e| panic!("the HIP runtime must load here (run ci/vendor-hip.sh): {e}"))
}

#[test]
fn the_hip_runtime_loads_and_reports_its_version() {
    let lib = runtime();
    assert!(lib.path.contains("libamdhip64"), "{}", lib.path);
    let info = hip::info().unwrap();
    assert_eq!(info.library, lib.path);
    let major: u32 = info.runtime_version.split('.').next().unwrap().parse().unwrap();
    assert!(major >= 5, "{info:?}");
    println!(
        "HIP runtime {} from {}; devices: {} ({:?})",
        info.runtime_version, info.library, info.devices, info.no_device_reason
    );
}

#[test]
#[ignore = "needs the HIP runtime and no AMD GPU (ci/test.sh provides both and runs it with --include-ignored)"]
fn opening_a_device_without_a_gpu_is_a_typed_no_device_error() {
    runtime();
    let visible = hip::device_count().unwrap();
    assert_eq!(visible, 0, "this machine has {visible} AMD GPU(s): the no-device path cannot be shown here");
    match HipDevice::with_ordinal(0) {
        Err(DeviceError::NoDevice { backend: "hip", ordinal: 0, visible: 0, reason }) => {
            assert!(!reason.is_empty());
            println!("as expected: {}", DeviceError::NoDevice { backend: "hip", ordinal: 0, visible: 0, reason });
        }
        other => panic!("expected DeviceError::NoDevice, got {other:?}"),
    }
}

#[test]
fn an_ordinal_past_the_device_count_is_no_device() {
    runtime();
    let e = HipDevice::with_ordinal(10_000).unwrap_err();
    assert!(matches!(e, DeviceError::NoDevice { backend: "hip", ordinal: 10_000, .. }), "{e:?}");
    assert!(e.to_string().contains("no hip device 10000"), "{e}");
}

#[test]
fn a_missing_library_names_every_file_tried_and_the_variable() {
    let e = sys::open_first("libchorus-absent", "CHORUS_ABSENT_LIB", &["libchorus-absent.so", "libchorus-absent.so.1"])
        .unwrap_err();
    match &e {
        DeviceError::LibraryUnavailable { library: "libchorus-absent", tried, variable: "CHORUS_ABSENT_LIB" } => {
            assert_eq!(tried, "libchorus-absent.so, libchorus-absent.so.1");
        }
        other => panic!("expected LibraryUnavailable, got {other:?}"),
    }
    assert!(e.to_string().contains("CHORUS_ABSENT_LIB"), "{e}");
}

#[test]
fn hip_errors_keep_the_native_code_and_name() {
    let lib = runtime();
    let e = result::check(lib, sys::hipErrorNoDevice, "hipSetDevice").unwrap_err();
    match e {
        DeviceError::Backend { library: "libamdhip64", code: 100, message } => {
            assert!(message.starts_with("hipSetDevice: hipErrorNoDevice"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// hipRTC compiles for an explicit architecture without a GPU, so the shared
/// kernel source (the one NVRTC compiles for the cuda device) is compiled
/// here for a CDNA and an RDNA part, and every kernel the hip stream launches
/// is in the code object.
#[test]
fn the_shared_kernel_source_compiles_with_hiprtc() {
    runtime();
    let (major, minor) = result::rtc_version().unwrap_or_else(|e| panic!("hipRTC must load: {e}"));
    for arch in ["gfx90a", "gfx1030"] {
        let image = kernels::compile(Some(arch)).unwrap_or_else(|e| panic!("hipRTC {major}.{minor} for {arch}: {e}"));
        assert!(image.len() > 1000, "{arch}: {} bytes", image.len());
        for name in kernels::NAMES {
            // The code object's symbol table names each kernel.
            let found =
                image.windows(name.len() + 1).any(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0);
            assert!(found, "{arch}: {name} missing from the code object");
        }
        println!(
            "hipRTC {major}.{minor}: {} kernels for {arch}, {} bytes of code object",
            kernels::NAMES.len(),
            image.len()
        );
    }
}

#[test]
fn a_compile_error_is_typed_and_carries_the_log() {
    runtime();
    let e =
        result::rtc_compile("this is not C++", "broken.hip", &kernels::compile_options(Some("gfx90a"))).unwrap_err();
    match e {
        DeviceError::Backend { library: "hiprtc", message, .. } => assert!(message.contains("broken.hip"), "{message}"),
        other => panic!("{other:?}"),
    }
}

/// hipRTC crashes when two threads compile at once; chorus serializes compiles.
#[test]
fn concurrent_compiles_are_serialized_not_crashed() {
    runtime();
    let threads: Vec<_> = (0..3).map(|_| std::thread::spawn(|| kernels::compile(Some("gfx90a")))).collect();
    for t in threads {
        assert!(t.join().unwrap().unwrap().len() > 1000);
    }
}
