//! The device suite on the cpu device, and what only the cpu device has.

use crate::common;
use crate::device_suite;
use crate::suite;

use anyhow::Result;
use chorus_devices::cpu::{Cpu, CpuDevice};
use chorus_devices::{Buffer, DType, Device, Priority, Stream};

device_suite!(Cpu, || Ok(common::device()));

#[test]
fn devices_streams_and_buffers_describe_themselves() -> Result<()> {
    let dev = CpuDevice::with_ordinal(3);
    assert_eq!((dev.name(), dev.ordinal(), dev.config().ordinal), ("cpu:3".to_string(), 3, 3));
    let (normal, high) = (dev.create_stream(Priority::Normal)?, dev.create_stream(Priority::High)?);
    assert_eq!((normal.priority(), high.priority()), (Priority::Normal, Priority::High));
    assert!(normal.name().starts_with("cpu:3/stream"), "{}", normal.name());
    assert!(!normal.name().contains("high"), "{}", normal.name());
    assert!(high.name().starts_with("cpu:3/stream") && high.name().contains("high"), "{}", high.name());
    assert_ne!(normal.name(), high.name());
    assert_ne!(normal.id(), high.id());
    assert_eq!(normal.device().name(), "cpu:3");

    let (a, b) = (dev.alloc(DType::BF16, 6)?, dev.alloc(DType::I64, 0)?);
    assert_eq!((a.dtype(), a.len(), a.bytes(), a.is_empty()), (DType::BF16, 6, 12, false));
    assert_eq!((b.len(), b.bytes(), b.is_empty()), (0, 0, true));
    assert_ne!(a.id(), b.id());
    let v = a.slice(2, 3)?;
    assert_eq!((v.dtype(), v.bytes(), v.byte_range()), (DType::BF16, 6, 4..10));
    assert!(v.overlaps(&a.slice(4, 2)?) && !v.overlaps(&a.slice(5, 1)?));
    assert!(v.same_range(&a.view().slice(2, 3)?) && !v.same_range(&a.slice(2, 2)?));
    Ok(())
}
