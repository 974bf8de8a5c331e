//! A device's two memory spaces (device memory and host memory from
//! `Device::alloc_host`, pinned or pageable), generic over the backend:
//! counted apart, copies between them exact and in stream order (behind a
//! gate, so a copy that ran early would be seen), a host buffer dropped with
//! copies queued freed after them, and kernels on host buffers either working
//! (the cpu device) or refused with a typed error that changes nothing.

use anyhow::Result;
use chorus_devices::{
    Buffer, ComputeBackend, Copy2d, DType, Device, DeviceError, MemorySpace, Scalar, Stream, StreamExt,
};

use crate::common::{stream, Gate};

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.37 - seed).collect()
}

/// A case of the device suite.
pub fn host_buffers_start_zeroed_and_are_counted_apart<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for pinned in [true, false] {
        let (device_before, host_before) = (dev.memory_stats(), dev.host_memory_stats());
        let h = dev.alloc_host(DType::F32, 25, pinned)?;
        assert_eq!(h.space(), MemorySpace::Host);
        assert_eq!(dev.memory_stats(), device_before, "a host buffer holds no device memory");
        let host = dev.host_memory_stats();
        assert_eq!(host.bytes_in_use, host_before.bytes_in_use + 100);
        assert_eq!(host.live_allocations, host_before.live_allocations + 1);
        assert!(host.peak_bytes >= 100);
        assert_eq!(s.read_vec::<f32>(h.view())?, vec![0.0; 25], "pinned: {pinned}");
        let d = dev.alloc(DType::F32, 10)?;
        assert_eq!(d.space(), MemorySpace::Device);
        assert_eq!(dev.host_memory_stats().bytes_in_use, host_before.bytes_in_use + 100);
        drop((h, d));
        s.synchronize()?;
        assert_eq!(dev.host_memory_stats().bytes_in_use, host_before.bytes_in_use);
        assert_eq!(dev.host_memory_stats().live_allocations, host_before.live_allocations);
    }
    dev.reset_peak_host_memory();
    assert_eq!(dev.host_memory_stats().peak_bytes, dev.host_memory_stats().bytes_in_use);
    let empty = dev.alloc_host(DType::F64, 0, true)?;
    assert_eq!((empty.space(), empty.bytes()), (MemorySpace::Host, 0));
    Ok(())
}

/// A case of the device suite.
pub fn copies_between_the_spaces_are_exact_and_in_stream_order<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let n = 1000;
    let (first, second) = (values(n, 2.0), values(n, -5.0));
    for pinned in [true, false] {
        for other_pinned in [true, false] {
            let gate = Gate::close(&s)?;
            let d = s.buffer_from(&first)?;
            let h = dev.alloc_host(DType::F32, n, pinned)?;
            let h2 = dev.alloc_host(DType::F32, n, other_pinned)?;
            let back = s.alloc(DType::F32, n)?;
            // device → host, then the device buffer changes: the host copy keeps the first values.
            s.copy(d.view(), h.view())?;
            s.upload(&second, d.view())?;
            // host → host, then host → device; then the host buffer changes.
            s.copy(h.view(), h2.view())?;
            s.copy(h2.view(), back.view())?;
            s.upload(&second, h2.view())?;
            let (r_back, r_h2) = (s.copy_to_host(back.view())?, s.copy_to_host(h2.view())?);
            assert!(!r_back.is_ready(), "nothing runs behind the gate");
            gate.open();
            let what = format!("pinned: {pinned}, other pinned: {other_pinned}");
            assert_eq!(r_back.wait_typed::<f32>()?, first, "{what}");
            assert_eq!(r_h2.wait_typed::<f32>()?, second, "{what}");
            assert_eq!(s.read_vec::<f32>(h.view())?, first, "{what}");
            // A sub-view round trip.
            s.copy(d.slice(100, 50)?, h.slice(900, 50)?)?;
            let mut expected = first.clone();
            expected[900..950].copy_from_slice(&second[100..150]);
            assert_eq!(s.read_vec::<f32>(h.view())?, expected, "{what}");
        }
    }
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn copy_2d_between_the_spaces_moves_the_blocks<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let (rows, cols) = (4, 6);
    let matrix = values(rows * cols, 1.0);
    for pinned in [true, false] {
        let h = dev.alloc_host(DType::F32, rows * cols, pinned)?;
        s.upload(&matrix, h.view())?;
        // Columns 1..4 of every row into a dense device block, then into a host buffer with stride 4.
        let layout = Copy2d { rows, row_len: 3, src_offset: 1, src_stride: cols, dst_offset: 0, dst_stride: 3 };
        let d = s.alloc(DType::F32, rows * 3)?;
        s.copy_2d(h.view(), d.view(), layout)?;
        let out = dev.alloc_host(DType::F32, rows * 4, !pinned)?;
        let back = Copy2d { rows, row_len: 3, src_offset: 0, src_stride: 3, dst_offset: 1, dst_stride: 4 };
        s.copy_2d(d.view(), out.view(), back)?;
        let mut expected = vec![0.0f32; rows * 4];
        let mut dense = Vec::new();
        for r in 0..rows {
            dense.extend_from_slice(&matrix[r * cols + 1..r * cols + 4]);
            expected[r * 4 + 1..r * 4 + 4].copy_from_slice(&matrix[r * cols + 1..r * cols + 4]);
        }
        assert_eq!(s.read_vec::<f32>(d.view())?, dense, "pinned: {pinned}");
        assert_eq!(s.read_vec::<f32>(out.view())?, expected, "pinned: {pinned}");
    }
    Ok(())
}

/// A case of the device suite.
pub fn kernels_on_host_buffers_work_or_are_refused_as_the_device_declares<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let data = values(64, 3.0);
    let h = dev.alloc_host(DType::F32, data.len(), true)?;
    s.upload(&data, h.view())?;
    let d = s.buffer_from(&data)?;
    let attempts: [(&str, Result<(), DeviceError>); 3] = [
        ("fill", s.fill(h.view(), Scalar::Float(1.0))),
        ("scale", s.scale(h.view(), 2.0)),
        ("accumulate", s.accumulate(h.view(), d.view())),
    ];
    let device_now = s.read_vec::<f32>(d.view())?;
    let host_now = s.read_vec::<f32>(h.view())?;
    if dev.kernels_reach_host() {
        for (op, r) in attempts {
            r.map_err(|e| anyhow::anyhow!("{op}: {e}"))?;
        }
        assert_eq!(host_now, vec![2.0; 64]);
        assert_eq!(device_now, data.iter().map(|v| v + 2.0).collect::<Vec<_>>());
    } else {
        for (op, r) in attempts {
            let e = r.err().ok_or_else(|| anyhow::anyhow!("{op} on a host buffer was accepted"))?;
            assert!(matches!(e, DeviceError::InvalidArgument { op: o, .. } if o == op), "{op}: {e}");
        }
        assert_eq!(host_now, data, "a refused kernel changes nothing");
        assert_eq!(device_now, data);
    }
    Ok(())
}

/// A case of the device suite.
pub fn dropping_a_host_buffer_with_queued_copies_frees_it_after_them<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let n = 1 << 16;
    let data = values(n, 7.0);
    for pinned in [true, false] {
        let base = dev.host_memory_stats().bytes_in_use;
        let gate = Gate::close(&s)?;
        let src = s.buffer_from(&data)?;
        let h = dev.alloc_host(DType::F32, n, pinned)?;
        let dst = s.alloc(DType::F32, n)?;
        s.copy(src.view(), h.view())?;
        s.copy(h.view(), dst.view())?;
        let readback = s.copy_to_host(dst.view())?;
        drop(h);
        assert_eq!(dev.host_memory_stats().bytes_in_use, base, "counted as freed when dropped");
        gate.open();
        assert_eq!(readback.wait_typed::<f32>()?, data, "pinned: {pinned}");
        s.synchronize()?;
        dev.synchronize()?;
    }
    Ok(())
}

/// A case of the device suite: `update_on_host` gives host work the bytes of
/// host buffers in stream order — after a copy into them queued behind a
/// gate, before a copy out queued after it — and the written bytes are what
/// the work made of them; a device-memory view or a written view overlapping
/// another is refused and nothing runs; an error of the work fails the stream.
pub fn update_on_host_runs_in_stream_order_on_host_bytes<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    for pinned in [true, false] {
        let x = values(37, 1.0);
        let (src, out) = (s.buffer_from(&x)?, s.alloc(DType::F32, 37)?);
        let (a, b) = (dev.alloc_host(DType::F32, 37, pinned)?, dev.alloc_host(DType::F32, 40, pinned)?);
        s.upload(&[7.0f32; 40], b.view())?;
        let gate = Gate::close(&s)?;
        s.copy(src.view(), a.view())?;
        let work: chorus_devices::HostUpdate = Box::new(|reads, writes| {
            let (a, b) = (bytemuck::cast_slice::<u8, f32>(reads[0]), bytemuck::cast_slice_mut::<u8, f32>(writes[0]));
            b.iter_mut().zip(a).for_each(|(b, a)| *b = *b * 0.5 + 2.0 * a);
            Ok(())
        });
        s.update_on_host(&[a.view()], &[b.slice(3, 37)?], work)?;
        s.copy(b.slice(3, 37)?, out.view())?;
        gate.open();
        let want: Vec<f32> = x.iter().map(|a| 7.0 * 0.5 + 2.0 * a).collect();
        assert_eq!(s.read_vec::<f32>(out.view())?, want, "pinned: {pinned}");
        assert_eq!(s.read_vec::<f32>(b.slice(0, 3)?)?, vec![7.0; 3], "bytes outside the written view");

        let untouched =
            |_: &[&[u8]], _: &mut [&mut [u8]]| -> chorus_devices::Result<()> { panic!("ran after a refusal") };
        let refused = s.update_on_host(&[src.view()], &[b.view()], Box::new(untouched));
        assert!(matches!(refused, Err(DeviceError::InvalidArgument { op: "update_on_host", .. })), "{refused:?}");
        let refused = s.update_on_host(&[b.slice(0, 10)?], &[b.slice(5, 10)?], Box::new(untouched));
        assert!(matches!(refused, Err(DeviceError::InvalidArgument { op: "update_on_host", .. })), "{refused:?}");
        s.synchronize()?;
    }
    let h = dev.alloc_host(DType::F32, 4, true)?;
    let failing: chorus_devices::HostUpdate =
        Box::new(|_, _| Err(DeviceError::InvalidArgument { op: "test", reason: "the host work failed".into() }));
    s.update_on_host(&[], &[h.view()], failing)?;
    let e = s.synchronize().unwrap_err();
    assert!(e.to_string().contains("the host work failed"), "{e}");
    Ok(())
}
