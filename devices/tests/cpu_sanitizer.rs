//! The stream sanitizer of the cpu device: unordered cross-stream accesses to
//! one buffer range are refused at enqueue time with a report naming both
//! operations, both streams and the buffer; ordered ones (event waits, host
//! synchronization, transitively) and non-conflicting ones (disjoint ranges,
//! read/read) pass.

use crate::common;

use anyhow::Result;
use chorus_devices::cpu::{Access, CpuStream};
use chorus_devices::{
    AccessKind, Buffer, ComputeStream, DType, Device, DeviceError, Event, MatmulSpec, RaceReport, Scalar, Stream,
    StreamExt,
};
use common::{device, device_without_sanitizer, stream, Gate};

fn race(e: DeviceError) -> Box<RaceReport> {
    match e {
        DeviceError::Race(report) => report,
        other => panic!("expected a race report, got {other:?}"),
    }
}

fn streams<const N: usize>(dev: &chorus_devices::cpu::CpuDevice) -> Result<[CpuStream; N]> {
    let v: Vec<CpuStream> = (0..N).map(|_| stream(dev)).collect::<Result<_>>()?;
    v.try_into().map_err(|_| anyhow::anyhow!("stream count"))
}

#[test]
fn a_missing_wait_is_reported_with_both_operations_streams_and_the_buffer() -> Result<()> {
    let dev = device();
    assert!(dev.sanitizer_enabled());
    let [a, b] = streams(&dev)?;
    let buf = dev.alloc(DType::F32, 64)?;
    a.fill(buf.view(), Scalar::Float(1.0))?;
    let report = race(b.copy_to_host(buf.slice(8, 8)?).unwrap_err());

    assert!(report.buffer.contains(&format!("#{}", buf.id())), "{}", report.buffer);
    assert_eq!(report.previous.op, "fill");
    assert_eq!(report.previous.stream, a.name());
    assert_eq!(report.previous.kind, AccessKind::Write);
    assert_eq!(report.previous.bytes, 0..256);
    assert_eq!(report.previous.position, 1);
    assert_eq!(report.current.op, "copy_to_host");
    assert_eq!(report.current.stream, b.name());
    assert_eq!(report.current.kind, AccessKind::Read);
    assert_eq!(report.current.bytes, 32..64);
    let text = report.to_string();
    for needle in ["fill", "copy_to_host", &a.name(), &b.name(), &format!("#{}", buf.id())] {
        assert!(text.contains(needle), "the report does not name `{needle}`: {text}");
    }

    // The refused read was not enqueued; with the wait, the same read passes
    // and sees the data.
    b.synchronize()?;
    let event = dev.create_event()?;
    a.record(&event)?;
    b.wait(&event)?;
    assert_eq!(b.read_vec::<f32>(buf.slice(8, 8)?)?, vec![1.0; 8]);
    Ok(())
}

#[test]
fn write_after_read_and_write_after_write_are_reported() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let (buf, other) = (dev.alloc(DType::F64, 16)?, dev.alloc(DType::F64, 16)?);
    a.copy(buf.view(), other.view())?;
    let report = race(b.fill(buf.slice(4, 4)?, Scalar::Float(2.0)).unwrap_err());
    assert_eq!((report.previous.op.as_str(), report.previous.kind), ("copy", AccessKind::Read));
    assert_eq!((report.current.op.as_str(), report.current.kind), ("fill", AccessKind::Write));
    assert_eq!((report.previous.stream.clone(), report.current.stream.clone()), (a.name(), b.name()));

    let report = race(b.scale(other.view(), 2.0).unwrap_err());
    assert_eq!((report.previous.op.as_str(), report.previous.kind), ("copy", AccessKind::Write));
    assert_eq!((report.current.op.as_str(), report.current.kind), ("scale", AccessKind::Write));
    assert!(report.buffer.contains(&format!("#{}", other.id())), "{}", report.buffer);
    Ok(())
}

#[test]
fn a_stream_ordered_allocation_used_on_another_stream_needs_a_wait() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let buf = a.alloc(DType::I32, 16)?;
    let report = race(b.fill(buf.view(), Scalar::Int(1)).unwrap_err());
    assert_eq!(report.previous.op, "alloc");
    assert_eq!(report.previous.stream, a.name());
    // Its own stream may use it at once; another after an event.
    a.fill(buf.view(), Scalar::Int(2))?;
    let event = dev.create_event()?;
    a.record(&event)?;
    b.wait(&event)?;
    b.accumulate(buf.view(), buf.view())?;
    assert_eq!(b.read_vec::<i32>(buf.view())?, vec![4; 16]);

    // A device allocation is usable on any stream at once.
    let shared = dev.alloc(DType::I32, 4)?;
    b.fill(shared.slice(0, 2)?, Scalar::Int(1))?;
    a.fill(shared.slice(2, 2)?, Scalar::Int(1))?;
    Ok(())
}

#[test]
fn an_event_wait_orders_the_accesses_in_one_direction_only() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let buf = dev.alloc(DType::F32, 32)?;
    let event = dev.create_event()?;
    a.fill(buf.view(), Scalar::Float(3.0))?;
    a.record(&event)?;
    b.wait(&event)?;
    assert_eq!(b.read_vec::<f32>(buf.view())?, vec![3.0; 32]);
    b.fill(buf.view(), Scalar::Float(4.0))?;
    // A did not wait for B.
    let report = race(a.copy_to_host(buf.view()).unwrap_err());
    assert_eq!((report.previous.op.as_str(), report.previous.stream.clone()), ("fill", b.name()));
    assert_eq!(report.current.stream, a.name());
    Ok(())
}

#[test]
fn host_synchronization_of_the_producer_orders_later_work() -> Result<()> {
    let dev = device();
    let [a, b, c] = streams(&dev)?;
    let buf = dev.alloc(DType::BF16, 32)?;

    a.fill(buf.view(), Scalar::Float(1.0))?;
    a.synchronize()?;
    b.fill(buf.view(), Scalar::Float(2.0))?;

    let event = dev.create_event()?;
    b.record(&event)?;
    event.synchronize()?;
    c.scale(buf.view(), 2.0)?;

    c.synchronize()?;
    a.fill(buf.slice(0, 16)?, Scalar::Float(5.0))?;
    b.fill(buf.slice(16, 16)?, Scalar::Float(6.0))?;
    dev.synchronize()?;
    let got = c.read_vec::<chorus_devices::bf16>(buf.view())?;
    let want: Vec<f32> = (0..32).map(|i| if i < 16 { 5.0 } else { 6.0 }).collect();
    assert_eq!(got.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), want);
    Ok(())
}

#[test]
fn disjoint_byte_ranges_of_one_buffer_do_not_race() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let buf = dev.alloc(DType::F32, 64)?;
    a.fill(buf.slice(0, 32)?, Scalar::Float(1.0))?;
    b.fill(buf.slice(32, 32)?, Scalar::Float(2.0))?;
    let upper = b.copy_to_host(buf.slice(32, 32)?)?;
    // One element of overlap is a race.
    let report = race(b.fill(buf.slice(31, 2)?, Scalar::Float(3.0)).unwrap_err());
    assert_eq!(report.current.bytes, 124..132);
    assert_eq!(report.previous.bytes, 0..128);
    assert_eq!(report.previous.stream, a.name());
    assert_eq!(upper.wait_typed::<f32>()?, vec![2.0; 32]);
    a.synchronize()?;
    Ok(())
}

#[test]
fn reads_on_different_streams_do_not_race_but_a_later_write_does() -> Result<()> {
    let dev = device();
    let [a, b, c] = streams(&dev)?;
    let buf = dev.alloc(DType::U8, 100)?;
    let (x, y) = (dev.alloc(DType::U8, 100)?, dev.alloc(DType::U8, 100)?);
    a.copy(buf.view(), x.view())?;
    b.copy(buf.view(), y.view())?;
    let ra = a.copy_to_host(buf.view())?;
    let rb = b.copy_to_host(buf.slice(10, 10)?)?;
    assert_eq!((ra.wait()?.len(), rb.wait()?.len()), (100, 10));

    let report = race(c.fill(buf.slice(50, 1)?, Scalar::Int(1)).unwrap_err());
    assert_eq!(report.previous.kind, AccessKind::Read);
    assert_eq!(report.current.kind, AccessKind::Write);
    // Waiting for one reader is not enough; waiting for both is.
    let (ea, eb) = (dev.create_event()?, dev.create_event()?);
    a.record(&ea)?;
    b.record(&eb)?;
    c.wait(&ea)?;
    let report = race(c.fill(buf.view(), Scalar::Int(1)).unwrap_err());
    assert_eq!(report.previous.stream, b.name());
    c.wait(&eb)?;
    c.fill(buf.view(), Scalar::Int(1))?;
    c.synchronize()?;
    Ok(())
}

#[test]
fn ordering_through_events_is_transitive() -> Result<()> {
    let dev = device();
    let [a, b, c, d, e] = streams(&dev)?;
    let (first, second, scratch) = (dev.alloc(DType::F32, 16)?, dev.alloc(DType::F32, 16)?, dev.alloc(DType::F32, 4)?);
    let [ea, eb_early, eb_bare, eb, ed] = [(); 5].map(|_| dev.create_event());
    let (ea, eb_early, eb_bare, eb, ed) = (ea?, eb_early?, eb_bare?, eb?, ed?);

    // B records before it waits for A: that record does not carry A's work.
    b.record(&eb_early)?;
    a.fill(first.view(), Scalar::Float(8.0))?;
    a.fill(second.view(), Scalar::Float(8.0))?;
    a.record(&ea)?;
    b.wait(&ea)?;
    // A record right after the wait, with no work of B's own between, carries A's work.
    b.record(&eb_bare)?;
    b.fill(scratch.view(), Scalar::Float(0.0))?;
    b.record(&eb)?;

    // A → B → C.
    c.wait(&eb)?;
    assert_eq!(c.read_vec::<f32>(first.view())?, vec![8.0; 16]);
    // A → B → D → E.
    d.wait(&eb_bare)?;
    d.scale(second.view(), 0.5)?;
    d.record(&ed)?;
    e.wait(&ed)?;
    assert_eq!(e.read_vec::<f32>(second.view())?, vec![4.0; 16]);

    // A stream that only waited on B's early record is ordered after neither A nor D.
    let f = stream(&dev)?;
    f.wait(&eb_early)?;
    let report = race(f.copy_to_host(first.view()).unwrap_err());
    assert_eq!(report.previous.stream, a.name());
    let report = race(f.copy_to_host(second.view()).unwrap_err());
    assert_eq!(report.previous.stream, d.name());
    Ok(())
}

#[test]
fn compute_operations_and_custom_jobs_are_checked_too() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let (x, w, y) = (dev.alloc(DType::F32, 6)?, dev.alloc(DType::F32, 6)?, dev.alloc(DType::F32, 4)?);
    let spec = MatmulSpec { m: 2, n: 2, k: 3, trans_a: false, trans_b: true, accumulate: false };
    a.matmul(spec, x.view(), w.view(), y.view())?;
    let report = race(b.relu(y.view(), y.view()).unwrap_err());
    assert_eq!((report.previous.op.as_str(), report.current.op.as_str()), ("matmul", "relu"));

    // Jobs enqueued by other crates declare their accesses the same way.
    a.enqueue("producer", &[Access::write(x.slice(0, 3)?)], |_| Ok(()))?;
    let e = b.enqueue("consumer", &[Access::read(x.view())], |_| Ok(())).unwrap_err();
    let report = race(e);
    assert_eq!((report.previous.op.as_str(), report.current.op.as_str()), ("producer", "consumer"));
    b.enqueue("consumer", &[Access::read(x.slice(3, 3)?)], |_| Ok(()))?;
    Ok(())
}

#[test]
fn a_refused_operation_leaves_no_trace() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let buf = dev.alloc(DType::I64, 8)?;
    a.fill(buf.view(), Scalar::Int(1))?;
    race(b.fill(buf.view(), Scalar::Int(2)).unwrap_err());
    // Had B's fill been recorded, A's next write would race with it.
    a.fill(buf.view(), Scalar::Int(3))?;
    assert_eq!(a.read_vec::<i64>(buf.view())?, vec![3; 8]);
    // Nor did it run.
    b.synchronize()?;
    assert_eq!(a.read_vec::<i64>(buf.view())?, vec![3; 8]);
    Ok(())
}

#[test]
fn with_the_sanitizer_off_no_race_is_reported() -> Result<()> {
    // SAFETY: the gate keeps stream `a`'s fill from running until `b`'s work has finished.
    let dev = unsafe { device_without_sanitizer() };
    assert!(!dev.sanitizer_enabled());
    let [a, b] = streams(&dev)?;
    let buf = dev.alloc(DType::F32, 64)?;
    let gate = Gate::close(&a)?;
    a.fill(buf.view(), Scalar::Float(1.0))?;
    let readback = b.copy_to_host(buf.view())?;
    b.fill(buf.view(), Scalar::Float(2.0))?;
    assert_eq!(readback.wait_typed::<f32>()?, vec![0.0; 64]);
    b.synchronize()?;
    gate.open();
    dev.synchronize()?;
    let _ = dev.create_event()?.query()?;
    Ok(())
}

#[test]
fn every_copy_of_a_batch_is_checked_and_a_race_refuses_the_whole_batch() -> Result<()> {
    let dev = device();
    let [a, b] = streams(&dev)?;
    let (src, x, y) = (dev.alloc(DType::F32, 8)?, dev.alloc(DType::F32, 8)?, dev.alloc(DType::F32, 8)?);
    a.fill(y.view(), Scalar::Float(2.0))?;
    let whole = chorus_devices::Copy2d { rows: 1, row_len: 8, ..Default::default() };
    // The batch's second copy writes `y`, which `a` wrote with no event between.
    let report = race(b.copy_2d_batch(&[(src.view(), x.view(), whole), (src.view(), y.view(), whole)]).unwrap_err());
    assert_eq!((report.previous.op.as_str(), report.current.op.as_str()), ("fill", "copy_2d_batch"));
    assert!(report.buffer.contains(&format!("#{}", y.id())), "{}", report.buffer);
    // Nothing of it was enqueued: `x` may be written by `a` without a wait.
    a.fill(x.view(), Scalar::Float(1.0))?;
    assert_eq!(a.read_vec::<f32>(x.view())?, vec![1.0; 8]);
    Ok(())
}
