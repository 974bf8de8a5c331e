//! Batched operations: `Stream::copy_2d_batch` and `Stream::fill_batch`
//! against the same work done on the host, and their all-or-nothing
//! argument checking.

use anyhow::Result;
use chorus_devices::{bf16, Buffer, ComputeBackend, Copy2d, DType, DeviceError, Scalar, Stream, StreamExt};

use crate::common::stream;

/// A case of the device suite.
pub fn copy_2d_batch_runs_every_copy_in_order_and_checks_all_first<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let src: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let a = s.buffer_from(&src)?;
    let (x, y) = (s.buffer_from(&[-1.0f32; 12])?, s.buffer_from(&[-1.0f32; 8])?);
    // Rows 0 and 2 of `a` (as 4 × 6) into x as 2 × 6; then columns 1..3 of
    // `a`'s 4 rows into y; then a later copy overwriting part of an earlier one.
    let rows = Copy2d { rows: 2, row_len: 6, src_offset: 0, src_stride: 12, dst_offset: 0, dst_stride: 6 };
    let cols = Copy2d { rows: 4, row_len: 2, src_offset: 1, src_stride: 6, dst_offset: 0, dst_stride: 2 };
    let over = Copy2d { rows: 1, row_len: 3, src_offset: 20, ..Copy2d::default() };
    s.copy_2d_batch(&[(a.view(), x.view(), rows), (a.view(), y.view(), cols), (a.view(), x.view(), over)])?;
    let mut want_x: Vec<f32> = [&src[0..6], &src[12..18]].concat();
    want_x[..3].copy_from_slice(&src[20..23]);
    let want_y: Vec<f32> = (0..4).flat_map(|r| [src[r * 6 + 1], src[r * 6 + 2]]).collect();
    assert_eq!(s.read_vec::<f32>(x.view())?, want_x);
    assert_eq!(s.read_vec::<f32>(y.view())?, want_y);

    // One bad copy (out of range) refuses the whole batch: the good one before it did not run.
    let bad = Copy2d { rows: 3, ..rows };
    let e = s.copy_2d_batch(&[(a.view(), y.view(), over), (a.view(), x.view(), bad)]).unwrap_err();
    assert!(matches!(e, DeviceError::InvalidArgument { op: "copy_2d", .. }), "{e:?}");
    let wide = s.alloc(DType::F64, 8)?;
    let e = s.copy_2d_batch(&[(a.view(), y.view(), over), (a.view(), wide.view(), over)]).unwrap_err();
    assert!(matches!(e, DeviceError::DTypeMismatch { .. }), "{e:?}");
    assert_eq!(s.read_vec::<f32>(y.view())?, want_y);
    // An empty batch is nothing to do.
    s.copy_2d_batch(&[])?;
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite.
pub fn fill_batch_fills_every_view_and_checks_all_first<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    let dev = make()?;
    let s = stream(&dev)?;
    let a = s.buffer_from(&[1.0f32; 6])?;
    let b = s.alloc(DType::BF16, 3)?;
    let c = s.buffer_from(&[7i8; 4])?;
    s.fill_batch(&[a.slice(1, 3)?, b.view()], Scalar::Float(2.5))?;
    assert_eq!(s.read_vec::<f32>(a.view())?, vec![1.0, 2.5, 2.5, 2.5, 1.0, 1.0]);
    assert_eq!(s.read_vec::<bf16>(b.view())?, vec![bf16::from_f32(2.5); 3]);

    // 300 does not fit an i8: the whole batch is refused, `a` untouched.
    let e = s.fill_batch(&[a.view(), c.view()], Scalar::Int(300)).unwrap_err();
    assert!(matches!(e, DeviceError::InvalidArgument { op: "fill", .. }), "{e:?}");
    assert_eq!(s.read_vec::<f32>(a.view())?, vec![1.0, 2.5, 2.5, 2.5, 1.0, 1.0]);
    assert_eq!(s.read_vec::<i8>(c.view())?, vec![7; 4]);
    s.fill_batch(&[], Scalar::Float(0.0))?;
    Ok(())
}
