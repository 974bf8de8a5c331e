//! Stream ordering on the cpu device: events between streams, host
//! synchronization, real concurrency of streams, sticky asynchronous errors,
//! panics in jobs, and deadlines. In-flight states are made observable with
//! gates (a job that holds its stream until the test opens it), never with
//! timing assertions.

use crate::common;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Result;
use chorus_devices::cpu::{CpuStream, JobInput};
use chorus_devices::{Buffer, DType, Device, DeviceError, Event, Scalar, Stream, StreamExt};
use common::{device, device_with, device_without_sanitizer, stream, Gate, TEST_TIMEOUT};

/// An operation-level error, as a collective would report one.
#[derive(Debug, PartialEq)]
struct Injected(u32);

impl fmt::Display for Injected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "injected failure {}", self.0)
    }
}
impl std::error::Error for Injected {}

/// Enqueues a job that fails with [`Injected`]`(code)`.
fn inject_failure(s: &CpuStream, code: u32) -> Result<()> {
    let name = s.name();
    s.enqueue("inject", &[], move |_| {
        Err(DeviceError::OpFailed { op: "inject", stream: name, source: Arc::new(Injected(code)) })
    })?;
    Ok(())
}

/// Asserts `e` is an asynchronous failure whose root is `Injected(code)`.
fn assert_injected(e: &DeviceError, code: u32) {
    assert_eq!(e.op_source::<Injected>(), Some(&Injected(code)), "not the injected failure: {e:?}");
}

/// Enqueues a job that sleeps, then sets `flag`: a host wait that returned
/// early would see the flag unset.
fn slow_flag(s: &CpuStream, flag: &Arc<AtomicBool>) -> Result<()> {
    let flag = flag.clone();
    s.enqueue("slow_flag", &[], move |input| {
        if let JobInput::Run = input {
            std::thread::sleep(Duration::from_millis(30));
            flag.store(true, Ordering::SeqCst);
        }
        Ok(())
    })?;
    Ok(())
}

#[test]
fn an_event_never_recorded_is_complete() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    let event = dev.create_event()?;
    assert!(event.query()?);
    event.synchronize()?;
    s.wait(&event)?;
    s.synchronize()?;
    Ok(())
}

#[test]
fn a_wait_on_an_event_makes_the_other_stream_see_the_data() -> Result<()> {
    let dev = device();
    let (a, b) = (stream(&dev)?, stream(&dev)?);
    // Big enough that B would overtake A's copies without the wait.
    let n = 1 << 22;
    let src = dev.alloc(DType::F32, n)?;
    let dst = dev.alloc(DType::F32, n)?;
    let event = dev.create_event()?;
    for round in 0..3 {
        let host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + round as f32).collect();
        a.upload(&host, src.view())?;
        a.fill(dst.view(), Scalar::Float(-1.0))?;
        a.copy(src.view(), dst.view())?;
        a.scale(dst.view(), 2.0)?;
        a.record(&event)?;
        b.wait(&event)?;
        let got = b.read_vec::<f32>(dst.view())?;
        let first_wrong = got.iter().zip(&host).position(|(g, h)| *g != 2.0 * h);
        assert_eq!(first_wrong, None, "round {round}: stream B read data A had not finished writing");
        // B's read must be done before A overwrites in the next round.
        b.record(&event)?;
        a.wait(&event)?;
    }
    Ok(())
}

#[test]
fn cross_stream_waits_hold_only_the_waiting_work() -> Result<()> {
    let dev = device();
    let (a, b) = (stream(&dev)?, stream(&dev)?);
    let (buf, out, other) = (dev.alloc(DType::I32, 64)?, dev.alloc(DType::I32, 64)?, dev.alloc(DType::I32, 8)?);
    let (produced, before_wait, consumed) = (dev.create_event()?, dev.create_event()?, dev.create_event()?);

    let gate = Gate::close(&a)?;
    a.fill(buf.view(), Scalar::Int(7))?;
    a.record(&produced)?;
    b.fill(other.view(), Scalar::Int(3))?;
    b.record(&before_wait)?;
    b.wait(&produced)?;
    b.copy(buf.view(), out.view())?;
    b.record(&consumed)?;
    let readback = b.copy_to_host(out.view())?;

    // B's work before the wait does not depend on A: it completes while A is held.
    before_wait.synchronize()?;
    // Queries never block, and report the held work as not done.
    assert!(!produced.query()?);
    assert!(!consumed.query()?);
    assert!(!readback.is_ready());

    gate.open();
    consumed.synchronize()?;
    assert!(produced.query()? && consumed.query()?);
    assert_eq!(readback.wait_typed::<i32>()?, vec![7; 64]);
    Ok(())
}

#[test]
fn event_query_becomes_true_without_a_host_wait() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    let event = dev.create_event()?;
    let gate = Gate::close(&s)?;
    s.record(&event)?;
    assert!(!event.query()?);
    gate.open();
    let deadline = std::time::Instant::now() + TEST_TIMEOUT;
    while !event.query()? {
        assert!(std::time::Instant::now() < deadline, "the event never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A record behind finished work costs no executor round trip: the flight
/// recorder records after every collective, so this is on every call's path.
#[test]
fn a_record_on_an_idle_stream_is_complete_when_it_returns() -> Result<()> {
    let dev = device();
    let s = stream(&dev)?;
    let flag = Arc::new(AtomicBool::new(false));
    slow_flag(&s, &flag)?;
    s.synchronize()?;
    let event = dev.create_event()?;
    s.record(&event)?;
    assert!(event.query()?, "a record on an idle stream waited for the executor");
    // Behind a job it still completes only after the job.
    let gate = Gate::close(&s)?;
    s.record(&event)?;
    assert!(!event.query()?);
    gate.open();
    event.synchronize()?;
    // On a failed idle stream the record carries the failure, as before.
    inject_failure(&s, 7)?;
    assert!(s.synchronize().is_err());
    s.record(&event)?;
    let e = event.synchronize().expect_err("an event recorded on a failed stream succeeded");
    assert_injected(&e, 7);
    Ok(())
}

#[test]
fn a_later_record_replaces_the_earlier_one() -> Result<()> {
    let dev = device_with(Duration::from_secs(10));
    let (a, b) = (stream(&dev)?, stream(&dev)?);
    let event = dev.create_event()?;
    let gate = Gate::close(&a)?;
    a.record(&event)?;
    assert!(!event.query()?);
    b.record(&event)?;
    // Waits for B's record only; A is still held.
    event.synchronize()?;
    assert!(event.query()?);
    gate.open();
    a.synchronize()?;
    Ok(())
}

#[test]
fn host_synchronization_waits_for_all_enqueued_work() -> Result<()> {
    let dev = device();
    let streams = [stream(&dev)?, stream(&dev)?, stream(&dev)?];
    let flags: Vec<Arc<AtomicBool>> = (0..6).map(|_| Arc::new(AtomicBool::new(false))).collect();

    slow_flag(&streams[0], &flags[0])?;
    streams[0].synchronize()?;
    assert!(flags[0].load(Ordering::SeqCst), "Stream::synchronize returned before the work ran");

    let event = dev.create_event()?;
    slow_flag(&streams[1], &flags[1])?;
    streams[1].record(&event)?;
    event.synchronize()?;
    assert!(flags[1].load(Ordering::SeqCst), "Event::synchronize returned before the work ran");

    for (s, f) in streams.iter().zip(&flags[2..]) {
        slow_flag(s, f)?;
    }
    dev.synchronize()?;
    assert!(flags[2..5].iter().all(|f| f.load(Ordering::SeqCst)), "Device::synchronize returned early");
    Ok(())
}

#[test]
fn streams_run_concurrently() -> Result<()> {
    // Each job waits for the other to start: only concurrent executors can
    // finish both. A serial executor fails both jobs at the limit instead of hanging.
    let dev = device();
    let (a, b) = (stream(&dev)?, stream(&dev)?);
    let limit = Duration::from_secs(20);
    let (to_b, from_a) = mpsc::channel::<()>();
    let (to_a, from_b) = mpsc::channel::<()>();
    let stuck = move |what: &str| DeviceError::Timeout { what: what.to_string(), waited: limit };
    a.enqueue("meet_b", &[], move |_| {
        to_b.send(()).map_err(|_| stuck("B to listen"))?;
        from_b.recv_timeout(limit).map_err(|_| stuck("B to start"))
    })?;
    b.enqueue("meet_a", &[], move |_| {
        to_a.send(()).map_err(|_| stuck("A to listen"))?;
        from_a.recv_timeout(limit).map_err(|_| stuck("A to start"))
    })?;
    a.synchronize()?;
    b.synchronize()?;
    Ok(())
}

#[test]
fn without_a_wait_another_stream_really_sees_stale_data() -> Result<()> {
    // With the sanitizer off the missing wait is not refused; the reader
    // deterministically runs ahead of the held writer.
    // SAFETY: the gate holds the writer until the reader has finished.
    let dev = unsafe { device_without_sanitizer() };
    let (a, b) = (stream(&dev)?, stream(&dev)?);
    let buf = dev.alloc(DType::F32, 1024)?;
    let gate = Gate::close(&a)?;
    a.fill(buf.view(), Scalar::Float(1.0))?;
    assert_eq!(b.read_vec::<f32>(buf.view())?, vec![0.0; 1024]);
    gate.open();
    a.synchronize()?;
    assert_eq!(b.read_vec::<f32>(buf.view())?, vec![1.0; 1024]);
    Ok(())
}

#[test]
fn a_failed_job_poisons_its_stream_and_everything_ordered_after_it() -> Result<()> {
    let dev = device();
    let (s, waiter, healthy) = (stream(&dev)?, stream(&dev)?, stream(&dev)?);
    let buf = s.buffer_from(&[1.0f32; 4])?;
    let before = dev.create_event()?;
    s.record(&before)?;

    inject_failure(&s, 7)?;
    // Later work is still accepted, but skipped and told why.
    let (tx, rx) = mpsc::channel();
    let ran = Arc::new(AtomicUsize::new(0));
    let ran_in_job = ran.clone();
    s.enqueue("later", &[], move |input| {
        if let JobInput::Skip(e) = input {
            let _ = tx.send(e.clone());
        } else {
            ran_in_job.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    })?;
    s.fill(buf.view(), Scalar::Float(9.0))?;
    let after = dev.create_event()?;
    s.record(&after)?;
    let readback = s.copy_to_host(buf.view())?;

    let e = s.synchronize().unwrap_err();
    assert_injected(&e, 7);
    let skip = rx.recv_timeout(TEST_TIMEOUT)?;
    assert!(matches!(skip, DeviceError::Poisoned { .. }), "{skip:?}");
    assert_injected(&skip, 7);
    assert_eq!(ran.load(Ordering::SeqCst), 0, "a job after the failure ran");
    // Sticky: reported again.
    assert_injected(&s.synchronize().unwrap_err(), 7);

    // The readback fails instead of hanging.
    let e = readback.wait().unwrap_err();
    assert!(!matches!(e.root_cause(), DeviceError::Timeout { .. }), "{e:?}");
    assert_injected(&e, 7);

    // An event recorded before the failure completed; one recorded after it fails.
    before.synchronize()?;
    assert!(before.query()?);
    assert_injected(&after.synchronize().unwrap_err(), 7);
    assert_injected(&after.query().unwrap_err(), 7);

    // A stream that waits on the failed event fails too, and skips its later work.
    waiter.wait(&before)?;
    waiter.wait(&after)?;
    let late = waiter.copy_to_host(buf.view())?;
    assert_injected(&waiter.synchronize().unwrap_err(), 7);
    assert_injected(&late.wait().unwrap_err(), 7);

    // The device reports the failure; an unrelated stream is unaffected.
    assert_injected(&dev.synchronize().unwrap_err(), 7);
    let fresh = healthy.buffer_from(&[2.0f64; 3])?;
    assert_eq!(healthy.read_vec::<f64>(fresh.view())?, vec![2.0; 3]);
    healthy.synchronize()?;
    Ok(())
}

#[test]
fn skipped_work_leaves_buffers_untouched() -> Result<()> {
    // Sanitizer off: the check reads the buffer from another stream without
    // an event, because no event recorded after the failure can complete.
    // SAFETY: the writes are skipped (their stream has failed) and the first
    // write is synchronized before the read.
    let dev = unsafe { device_without_sanitizer() };
    let (s, reader) = (stream(&dev)?, stream(&dev)?);
    let buf = s.buffer_from(&[1i64, 2, 3])?;
    s.synchronize()?;
    inject_failure(&s, 3)?;
    s.fill(buf.view(), Scalar::Int(-5))?;
    s.copy_from_host(&[0u8; 24], buf.view())?;
    assert_injected(&s.synchronize().unwrap_err(), 3);
    assert_eq!(reader.read_vec::<i64>(buf.view())?, vec![1, 2, 3]);
    Ok(())
}

#[test]
fn a_panicking_job_becomes_an_error_not_a_crash() -> Result<()> {
    let dev = device();
    let (s, other) = (stream(&dev)?, stream(&dev)?);
    let buf = s.buffer_from(&[4u8; 8])?;
    s.enqueue("explode", &[], |_| panic!("kaboom"))?;
    let readback = s.copy_to_host(buf.view())?;
    let e = s.synchronize().unwrap_err();
    match &e {
        DeviceError::InvalidArgument { op: "explode", reason } => assert!(reason.contains("kaboom"), "{reason}"),
        other => panic!("expected the panic as an error of `explode`, got {other:?}"),
    }
    assert!(readback.wait().is_err());
    // The process and the device go on.
    let fresh = other.buffer_from(&[5u8; 2])?;
    assert_eq!(other.read_vec::<u8>(fresh.view())?, vec![5, 5]);
    Ok(())
}

#[test]
fn a_stuck_wait_times_out_instead_of_hanging() -> Result<()> {
    let timeout = Duration::from_millis(200);
    let dev = device_with(timeout);
    let (s, waiter) = (stream(&dev)?, stream(&dev)?);
    let (release, blocked) = mpsc::channel::<()>();
    // Blocks far longer than the device's deadline, until released.
    s.enqueue("stuck", &[], move |_| {
        let _ = blocked.recv_timeout(Duration::from_secs(20));
        Ok(())
    })?;
    let buf = s.buffer_from(&[1.0f32; 4])?;
    let event = dev.create_event()?;
    s.record(&event)?;

    let e = s.synchronize().unwrap_err();
    assert!(matches!(&e, DeviceError::Timeout { waited, .. } if *waited == timeout), "{e:?}");
    let e = event.synchronize().unwrap_err();
    assert!(matches!(e, DeviceError::Timeout { .. }), "{e:?}");
    let e = s.copy_to_host(buf.view())?.wait().unwrap_err();
    assert!(matches!(e, DeviceError::Timeout { .. }), "{e:?}");

    // An executor waiting on the event gives up at the deadline too, and
    // the host learns it (as its own deadline or the waiter's failure).
    waiter.wait(&event)?;
    let e = waiter.synchronize().unwrap_err();
    assert!(matches!(e.root_cause(), DeviceError::Timeout { .. }), "{e:?}");

    // A host deadline is not a failure of the stream: once the job is
    // released, the stream finishes its work normally.
    release.send(())?;
    let deadline = std::time::Instant::now() + TEST_TIMEOUT;
    loop {
        match s.synchronize() {
            Ok(()) => break,
            Err(DeviceError::Timeout { .. }) if std::time::Instant::now() < deadline => continue,
            Err(e) => return Err(e.into()),
        }
    }
    assert!(event.query()?);
    Ok(())
}
