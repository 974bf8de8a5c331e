//! Batched operations: `Stream::copy_2d_batch` and `Stream::fill_batch`
//! against the same work done on the host, their all-or-nothing argument
//! checking, and (where the device counts its calls) that a batch is a few
//! device calls rather than one per piece.

use anyhow::{ensure, Result};
use chorus_devices::{bf16, Buffer, ComputeBackend, Copy2d, DType, Device, DeviceError, Scalar, Stream, StreamExt};

use crate::common::{stream, Lcg};

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

/// The calls a device counted while `f` ran, less the context binds of the
/// cuda device (which are not work): `None` where the device does not count.
fn calls_during<D: Device>(dev: &D, f: impl FnOnce() -> Result<()>) -> Result<Option<u64>> {
    let counting = dev.count_calls(true);
    let ran = f();
    dev.count_calls(false);
    ran?;
    let work = dev.call_counts().iter().filter(|(name, _)| !name.starts_with("cuCtx")).map(|(_, n)| n).sum();
    Ok(counting.then_some(work))
}

/// Bytes per element of the dtypes the many-piece cases use (1, 2, 4 and 8).
const WIDTHS: [DType; 4] = [DType::U8, DType::BF16, DType::F32, DType::I64];

/// A case of the device suite: a batch of 150 strided copies over four
/// element sizes at unaligned offsets, some continuing one another and some
/// reading what earlier copies of the batch wrote, equals the copies done
/// one after the other on the host; and it is a few device calls, not one
/// per copy (on a device that counts its calls).
pub fn copy_2d_batch_of_many_pieces_equals_the_copies_in_order<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    const LEN: usize = 16384;
    let dev = make()?;
    let s = stream(&dev)?;
    let mut rng = Lcg::new(7);
    // Per element size: a source, a destination, and `later`, which copies
    // read back out of the destination; host copies of all three.
    let mut host: Vec<[Vec<u8>; 3]> = Vec::new();
    let mut bufs = Vec::new();
    for dtype in WIDTHS {
        let fresh = |rng: &mut Lcg| (0..LEN * dtype.size()).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>();
        let sides = [fresh(&mut rng), fresh(&mut rng), fresh(&mut rng)];
        let made = [s.alloc(dtype, LEN)?, s.alloc(dtype, LEN)?, s.alloc(dtype, LEN)?];
        for (b, bytes) in made.iter().zip(&sides) {
            s.copy_from_host(bytes, b.view())?;
        }
        host.push(sides);
        bufs.push(made);
    }
    // (element size index, side: 0 copies source -> destination, 1 destination -> later, layout).
    // Destinations advance through each buffer, so only the copies that read
    // a destination depend on earlier ones.
    let mut pieces: Vec<(usize, usize, Copy2d)> = Vec::new();
    let mut cursor = [[0usize; 2]; 4];
    let mut dependent = 0;
    for i in 0..150 {
        let k = (rng.next_u64() % 4) as usize;
        if let Some((pk, 0, prev)) =
            pieces.last().copied().filter(|(_, side, l)| i % 10 == 9 && *side == 0 && l.rows == 1)
        {
            // Continues the previous copy on both sides: the two merge.
            let next = Copy2d { src_offset: prev.src_offset + prev.row_len, dst_offset: cursor[pk][0], ..prev };
            if next.src_offset + next.row_len <= LEN && next.dst_offset == prev.dst_offset + prev.row_len {
                cursor[pk][0] += next.row_len;
                pieces.push((pk, 0, next));
                continue;
            }
        }
        let rows = 1 + (rng.next_u64() % 6) as usize;
        let row_len = 1 + (rng.next_u64() % 40) as usize;
        let mut stride = || row_len + (rng.next_u64() % 3) as usize * (rng.next_u64() % 5) as usize;
        let (src_stride, dst_stride) = (stride(), stride());
        let span = |stride: usize| (rows - 1) * stride + row_len;
        let side = usize::from(i % 25 == 24);
        let src_offset = match side {
            // Read from what the batch has written so far.
            1 if cursor[k][0] >= span(src_stride) => (rng.next_u64() as usize) % (cursor[k][0] - span(src_stride) + 1),
            1 => continue,
            _ => (rng.next_u64() as usize) % (LEN - span(src_stride)),
        };
        let dst_offset = cursor[k][side] + (rng.next_u64() % 3) as usize;
        cursor[k][side] = dst_offset + span(dst_stride);
        dependent += side;
        pieces.push((k, side, Copy2d { rows, row_len, src_offset, src_stride, dst_offset, dst_stride }));
    }
    ensure!(cursor.iter().flatten().all(|c| *c <= LEN), "the test's pieces overran its buffers");
    let views: Vec<_> =
        pieces.iter().map(|&(k, side, l)| (bufs[k][side].view(), bufs[k][side + 1].view(), l)).collect();
    let calls = calls_during(&dev, || Ok(s.copy_2d_batch(&views)?))?;
    for &(k, side, l) in &pieces {
        let e = WIDTHS[k].size();
        for r in 0..l.rows {
            let from = (l.src_offset + r * l.src_stride) * e;
            let to = (l.dst_offset + r * l.dst_stride) * e;
            let block = host[k][side][from..from + l.row_len * e].to_vec();
            host[k][side + 1][to..to + l.row_len * e].copy_from_slice(&block);
        }
    }
    for (k, made) in bufs.iter().enumerate() {
        for (j, b) in made.iter().enumerate() {
            let got = s.copy_to_host(b.view())?.wait()?;
            ensure!(
                got == host[k][j],
                "buffer {j} of element size {} differs from the in-order copies",
                WIDTHS[k].size()
            );
        }
    }
    if let Some(calls) = calls {
        // Launches of up to 64 pieces; a copy reading what the batch wrote starts a new one.
        let bound = (pieces.len() as u64).div_ceil(64) + 2 * dependent as u64;
        ensure!(dependent > 0, "the batch has no dependent copies");
        ensure!((1..=bound).contains(&calls), "{calls} device calls for {} pieces (at most {bound})", pieces.len());
    }
    s.synchronize()?;
    Ok(())
}

/// A case of the device suite: fill batches of 100 views over element sizes
/// 1, 2, 4 and 8 (overlapping, unaligned) equal the fills on the host; a
/// few device calls each on a device that counts them.
pub fn fill_batch_of_many_views_equals_the_fills_one_by_one<B: ComputeBackend>(
    make: &dyn Fn() -> Result<B::Device>,
) -> Result<()> {
    const BYTES: usize = 2048;
    let dev = make()?;
    let s = stream(&dev)?;
    let mut rng = Lcg::new(9);
    for (dtypes, value) in [
        ([DType::I8, DType::I32, DType::I64], Scalar::Int(-5)),
        ([DType::BF16, DType::F32, DType::F64], Scalar::Float(-1.5)),
    ] {
        let mut host: Vec<Vec<u8>> = Vec::new();
        let mut bufs = Vec::new();
        for dtype in dtypes {
            let bytes: Vec<u8> = (0..BYTES).map(|_| rng.next_u64() as u8).collect();
            let b = s.alloc(dtype, BYTES / dtype.size())?;
            s.copy_from_host(&bytes, b.view())?;
            host.push(bytes);
            bufs.push(b);
        }
        let mut picks = Vec::new();
        for _ in 0..100 {
            let k = (rng.next_u64() % 3) as usize;
            let len = BYTES / dtypes[k].size();
            let n = 1 + (rng.next_u64() as usize) % 50;
            picks.push((k, (rng.next_u64() as usize) % (len - n), n));
        }
        let views = picks.iter().map(|&(k, at, n)| bufs[k].slice(at, n)).collect::<chorus_devices::Result<Vec<_>>>()?;
        let calls = calls_during(&dev, || Ok(s.fill_batch(&views, value)?))?;
        for &(k, at, n) in &picks {
            let pattern = value.encode(dtypes[k]).map_err(anyhow::Error::msg)?;
            let e = pattern.len();
            host[k][at * e..(at + n) * e].chunks_mut(e).for_each(|c| c.copy_from_slice(&pattern));
        }
        for (k, b) in bufs.iter().enumerate() {
            ensure!(s.copy_to_host(b.view())?.wait()? == host[k], "{} after the batch differs", dtypes[k]);
        }
        if let Some(calls) = calls {
            ensure!((1..=3).contains(&calls), "{calls} device calls for {} fills", picks.len());
        }
    }
    s.synchronize()?;
    Ok(())
}
