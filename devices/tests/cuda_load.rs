//! Loading the cuda backend: without a driver it must fail with a typed
//! error that names the library and the variable, never panic. With a GPU the
//! same test runs a smoke check of the operations against the cpu device.
#![cfg(feature = "cuda")]

use chorus_devices::cpu::CpuDevice;
use chorus_devices::cuda::{self, CudaDevice};
use chorus_devices::{
    Buffer, ComputeStream, DType, Device, DeviceError, Event, MatmulSpec, Priority, Scalar, Stream, StreamExt,
};

#[test]
fn probing_never_panics_and_names_the_variable() {
    match cuda::driver_library() {
        Ok(info) => assert_eq!(info.library, "libcuda"),
        Err(DeviceError::LibraryUnavailable { library, tried, variable }) => {
            assert_eq!(library, "libcuda");
            assert!(tried.contains("libcuda.so.1"), "{tried}");
            assert!(variable.contains("CHORUS_CUDA_LIB") && variable.contains("LD_LIBRARY_PATH"), "{variable}");
        }
        Err(other) => panic!("unexpected error: {other}"),
    }
    // NVRTC and cuBLAS probes answer the same way, whatever is installed.
    for probe in [cuda::nvrtc_library(), cuda::cublas_library()] {
        if let Err(e) = probe {
            assert!(matches!(e, DeviceError::LibraryUnavailable { .. }), "{e}");
        }
    }
}

#[test]
fn creating_a_device_without_a_driver_is_a_typed_error() {
    match CudaDevice::new(0) {
        Err(DeviceError::LibraryUnavailable { library, variable, .. }) => {
            assert_eq!(library, "libcuda");
            assert!(variable.contains("CHORUS_CUDA_LIB"));
            assert!(cuda::device_count().is_err());
        }
        // A driver without a GPU (CUDA_ERROR_NO_DEVICE and the like).
        Err(DeviceError::Backend { library, .. }) => assert_eq!(library, "libcuda"),
        Err(other) => panic!("unexpected error: {other}"),
        Ok(device) => smoke(&device).expect("cuda smoke test"),
    }
}

/// Runs each operation on the GPU and on the cpu device and compares.
fn smoke(gpu: &CudaDevice) -> anyhow::Result<()> {
    let cpu = CpuDevice::with_ordinal(0);
    let gs = gpu.create_stream(Priority::High)?;
    let cs = cpu.create_stream(Priority::Normal)?;
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 37.0).collect();
    let y: Vec<f32> = (0..1000).map(|i| (i as f32) / 91.0).collect();

    let gx = gs.buffer_from(&x)?;
    let gy = gs.buffer_from(&y)?;
    let cx = cs.buffer_from(&x)?;
    let cy = cs.buffer_from(&y)?;
    gs.axpy(0.5, gx.view(), gy.view())?;
    cs.axpy(0.5, cx.view(), cy.view())?;
    assert_eq!(gs.read_vec::<f32>(gy.view())?, cs.read_vec::<f32>(cy.view())?);

    for dtype in [DType::F16, DType::BF16, DType::F64] {
        let gh = gs.alloc(dtype, x.len())?;
        let ch = cs.alloc(dtype, x.len())?;
        gs.cast(gx.view(), gh.view())?;
        cs.cast(cx.view(), ch.view())?;
        gs.relu(gh.view(), gh.view())?;
        cs.relu(ch.view(), ch.view())?;
        gs.accumulate(gh.view(), gy.view())?;
        cs.accumulate(ch.view(), cy.view())?;
    }
    assert_eq!(gs.read_vec::<f32>(gy.view())?, cs.read_vec::<f32>(cy.view())?);

    let gi = gs.alloc(DType::I64, 10)?;
    gs.fill(gi.view(), Scalar::Int(-3))?;
    gs.accumulate(gi.view(), gi.view())?;
    assert_eq!(gs.read_vec::<i64>(gi.view())?, vec![-6i64; 10]);

    let spec = MatmulSpec { m: 20, n: 30, k: 50, trans_a: false, trans_b: true, accumulate: false };
    let b: Vec<f32> = (0..1500).map(|i| ((i * 7) % 13) as f32 / 13.0).collect();
    let (ga, gb, gc) = (gs.buffer_from(&x)?, gs.buffer_from(&b)?, gs.alloc(DType::F32, 600)?);
    let (ca, cb, cc) = (cs.buffer_from(&x)?, cs.buffer_from(&b)?, cs.alloc(DType::F32, 600)?);
    gs.matmul(spec, ga.view(), gb.view(), gc.view())?;
    cs.matmul(spec, ca.view(), cb.view(), cc.view())?;
    let (g, c) = (gs.read_vec::<f32>(gc.view())?, cs.read_vec::<f32>(cc.view())?);
    for (g, c) in g.iter().zip(&c) {
        assert!((g - c).abs() <= 1e-4 * c.abs().max(1.0), "{g} vs {c}");
    }

    let ev = gpu.create_event()?;
    let other = gpu.create_stream(Priority::Normal)?;
    gs.record(&ev)?;
    other.wait(&ev)?;
    let z = other.alloc(DType::F32, 1000)?;
    other.copy(gy.view(), z.view())?;
    other.synchronize()?;
    assert!(ev.query()?);
    let stats = gpu.memory_stats();
    assert!(stats.live_allocations >= 4 && stats.bytes_in_use >= 4000);
    drop(z);
    gpu.synchronize()?;
    Ok(())
}
