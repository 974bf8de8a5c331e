//! The cpu device's two memory spaces: counted apart, both usable by every
//! stream operation, and copies between them exact.

use chorus_devices::cpu::{CpuConfig, CpuDevice};
use chorus_devices::{Buffer, Device, MemorySpace, Priority, Stream, StreamExt};

#[test]
fn host_buffers_are_counted_in_the_host_space_only() {
    let d = CpuDevice::new(CpuConfig::default());
    let dev = d.alloc(chorus_devices::DType::F32, 10).unwrap();
    let host = d.alloc_host(chorus_devices::DType::F32, 25, true).unwrap();
    assert_eq!(dev.space(), MemorySpace::Device);
    assert_eq!(host.space(), MemorySpace::Host);
    assert_eq!(d.memory_stats().bytes_in_use, 40);
    assert_eq!(d.memory_stats().live_allocations, 1);
    assert_eq!(d.host_memory_stats().bytes_in_use, 100);
    assert_eq!(d.host_memory_stats().live_allocations, 1);
    drop(host);
    let h = d.host_memory_stats();
    assert_eq!((h.bytes_in_use, h.peak_bytes, h.live_allocations), (0, 100, 0));
    assert_eq!(d.memory_stats().bytes_in_use, 40);
    d.reset_peak_host_memory();
    assert_eq!(d.host_memory_stats().peak_bytes, 0);
    assert_eq!(d.memory_stats().peak_bytes, 40, "resetting the host peak leaves the device's");
    drop(dev);
}

#[test]
fn copies_between_the_spaces_are_exact_and_kernels_reach_host_buffers() {
    let d = CpuDevice::new(CpuConfig::default());
    assert!(d.kernels_reach_host());
    let s = d.create_stream(Priority::Normal).unwrap();
    let values: Vec<f32> = (0..17).map(|i| i as f32 * 0.37 - 2.0).collect();
    let host = d.alloc_host(chorus_devices::DType::F32, values.len(), false).unwrap();
    assert_eq!(s.read_vec::<f32>(host.view()).unwrap(), vec![0.0; 17], "host buffers start zeroed");
    s.upload(&values, host.view()).unwrap();
    let dev = s.alloc(chorus_devices::DType::F32, values.len()).unwrap();
    s.copy(host.view(), dev.view()).unwrap();
    s.scale(host.view(), 2.0).unwrap();
    s.copy(dev.view(), host.slice(0, 17).unwrap()).unwrap();
    assert_eq!(s.read_vec::<f32>(host.view()).unwrap(), values);
}

#[test]
fn with_kernels_off_host_only_copies_reach_host_buffers_as_on_a_gpu() {
    let d = CpuDevice::new(CpuConfig::default().with_kernels_off_host());
    assert!(!d.kernels_reach_host());
    let s = d.create_stream(Priority::Normal).unwrap();
    let values: Vec<f32> = (0..9).map(|i| i as f32 - 4.5).collect();
    let host = d.alloc_host(chorus_devices::DType::F32, values.len(), true).unwrap();
    s.upload(&values, host.view()).unwrap();
    let dev = s.alloc(chorus_devices::DType::F32, values.len()).unwrap();
    s.copy(host.view(), dev.view()).unwrap();
    let refused = s.scale(host.view(), 2.0).unwrap_err();
    assert!(matches!(refused, chorus_devices::DeviceError::InvalidArgument { op: "scale", .. }), "{refused}");
    let refused = s.accumulate(dev.view(), host.view()).unwrap_err();
    assert!(matches!(refused, chorus_devices::DeviceError::InvalidArgument { op: "accumulate", .. }), "{refused}");
    s.scale(dev.view(), 2.0).unwrap();
    s.copy(dev.view(), host.view()).unwrap();
    assert_eq!(s.read_vec::<f32>(host.view()).unwrap(), values.iter().map(|v| v * 2.0).collect::<Vec<_>>());
}
