//! The host-function rule on the cpu device: device API calls made inside a
//! host function (and drops there) are refused exactly as CUDA refuses them,
//! so CI catches what a GPU would.

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use chorus_devices::cpu::CpuStream;
use chorus_devices::{Buffer, DType, Device, DeviceError, Event, Priority, Scalar, Stream, StreamExt};
use common::{device, stream};

/// Runs `probe` inside a host function on `s` and returns what it returned.
fn inside_host_fn<T: Send + 'static>(s: &CpuStream, probe: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let (tx, rx) = mpsc::channel();
    s.launch_host_fn(Box::new(move |_| {
        let _ = tx.send(probe());
    }))?;
    Ok(rx.recv_timeout(Duration::from_secs(20))?)
}

fn assert_refused<T: std::fmt::Debug>(r: chorus_devices::Result<T>, op: &str) {
    match r {
        Err(DeviceError::InHostFunction { op: refused }) => assert!(refused.contains(op), "{refused} vs {op}"),
        other => panic!("expected {op} to be refused inside a host function, got {other:?}"),
    }
}

#[test]
fn every_device_api_call_inside_a_host_function_is_refused() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    let other = Arc::new(stream(&dev)?);
    let buf = Arc::new(dev.alloc(DType::F32, 8)?);
    let event = Arc::new(dev.create_event()?);
    other.record(&event)?;

    let d = dev.clone();
    assert_refused(inside_host_fn(&s, move || d.create_stream(Priority::Normal).map(|_| ()))?, "create_stream");
    let d = dev.clone();
    assert_refused(inside_host_fn(&s, move || d.create_event().map(|_| ()))?, "create_event");
    let d = dev.clone();
    assert_refused(inside_host_fn(&s, move || d.alloc(DType::F32, 4).map(|_| ()))?, "alloc");
    let d = dev.clone();
    assert_refused(inside_host_fn(&s, move || d.synchronize())?, "synchronize");
    let (o, b) = (other.clone(), buf.clone());
    assert_refused(inside_host_fn(&s, move || o.fill(b.view(), Scalar::Float(1.0)))?, "fill");
    let (o, b) = (other.clone(), buf.clone());
    assert_refused(inside_host_fn(&s, move || o.copy_to_host(b.view()).map(|_| ()))?, "copy_to_host");
    let (o, e) = (other.clone(), event.clone());
    assert_refused(inside_host_fn(&s, move || o.record(&e))?, "record");
    let (o, e) = (other.clone(), event.clone());
    assert_refused(inside_host_fn(&s, move || o.wait(&e))?, "wait");
    let o = other.clone();
    assert_refused(inside_host_fn(&s, move || o.synchronize())?, "synchronize");
    let e = event.clone();
    assert_refused(inside_host_fn(&s, move || e.query())?, "query");
    let e = event.clone();
    assert_refused(inside_host_fn(&s, move || e.synchronize())?, "synchronize");
    let o = other.clone();
    assert_refused(inside_host_fn(&s, move || o.launch_host_fn(Box::new(|_| {})))?, "host_fn");

    // Nothing was done, and the device is healthy afterwards.
    s.synchronize()?;
    other.fill(buf.view(), Scalar::Float(3.0))?;
    assert_eq!(other.read_vec::<f32>(buf.view())?, vec![3.0; 8]);
    dev.synchronize()?;
    Ok(())
}

#[test]
fn a_handle_dropped_inside_a_host_function_is_reported_by_the_next_synchronize() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    let buf = dev.alloc(DType::U8, 4)?;
    let extra_stream = stream(&dev)?;
    let event = dev.create_event()?;
    inside_host_fn(&s, move || {
        drop(buf);
        drop(extra_stream);
        drop(event);
    })?;
    let parked: Vec<String> = dev.take_parked_errors().iter().map(|e| e.to_string()).collect();
    assert_eq!(parked.len(), 3, "{parked:?}");
    for what in ["a cpu buffer", "a cpu stream", "a cpu event"] {
        assert!(parked.iter().any(|p| p.contains(what)), "{what} not in {parked:?}");
    }
    // The next device synchronize reports such a drop, then the device is clean.
    let buf = dev.alloc(DType::U8, 4)?;
    inside_host_fn(&s, move || drop(buf))?;
    let e = dev.synchronize().unwrap_err();
    assert!(matches!(e, DeviceError::InHostFunction { ref op } if op.starts_with("dropping")), "{e}");
    dev.synchronize()?;
    Ok(())
}

#[test]
fn a_host_function_runs_in_stream_order_and_is_told_of_earlier_failures() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    let buf = s.buffer_from(&[1.0f32; 4])?;
    s.fill(buf.view(), Scalar::Float(2.0))?;
    // In stream order: after the fill, the value it sees through the host is 2.
    let raw = chorus_devices::cpu::raw(buf.view());
    let addr = raw.ptr() as usize;
    let seen = inside_host_fn(&s, move || {
        let _keep = raw;
        // SAFETY: in stream order after the fill and before any later write.
        unsafe { std::slice::from_raw_parts(addr as *const f32, 4).to_vec() }
    })?;
    assert_eq!(seen, vec![2.0; 4]);

    s.enqueue("fails", &[], |_| Err(DeviceError::Backend { library: "test", code: 5, message: "boom".into() }))?;
    let (tx, rx) = mpsc::channel();
    s.launch_host_fn(Box::new(move |r| {
        let _ = tx.send(r);
    }))?;
    let told = rx.recv_timeout(Duration::from_secs(20))?;
    assert!(matches!(told, Err(DeviceError::Poisoned { .. })), "{told:?}");
    assert!(s.synchronize().is_err());
    Ok(())
}

#[test]
fn a_panicking_host_function_fails_its_stream_and_nothing_else() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    s.launch_host_fn(Box::new(|_| panic!("inside a host function")))?;
    let e = s.synchronize().unwrap_err();
    assert!(e.to_string().contains("inside a host function"), "{e}");
    let healthy = stream(&dev)?;
    let buf = healthy.buffer_from(&[7u8; 3])?;
    assert_eq!(healthy.read_vec::<u8>(buf.view())?, vec![7; 3]);
    assert_eq!(buf.len(), 3);
    Ok(())
}
