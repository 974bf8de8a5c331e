//! The batch kernels (`chorus_copy_batch`, `chorus_fill_batch`) as the GPU
//! devices plan them (`chorus_devices::gpu_batch`), run on the CPU over host
//! memory, against the cpu device's `copy_2d_batch` and `fill_batch`: many
//! pieces of every element size at unaligned offsets, strided and
//! contiguous, merged and split as a GPU would launch them.

use chorus_devices::gpu_batch::{plan_copies, plan_fills, CopyPiece, FillPiece, Step, BATCH};
use chorus_devices::{Buffer, Copy2d, DType, Scalar, Stream};

use crate::compare::sides;
use crate::inputs::Rng;

/// The parameter block of `chorus_copy_batch` (`chorus_copy_batch_t`: all 8-byte words).
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyBatch([u64; 1 + 7 * BATCH]);

/// The parameter block of `chorus_fill_batch` (`chorus_fill_batch_t`).
#[repr(C)]
#[derive(Clone, Copy)]
struct FillBatch([u64; 1 + 4 * BATCH]);

/// Blocks per piece and threads per block on the host: the kernels stride
/// over any grid, and a lane is an OS thread here.
const HOST_GRID: (u32, u32) = (2, 4);

/// Runs a planned launch on the host: `gridDim.y` is the piece count, as on a GPU.
fn run<P>(steps: Vec<Step<P>>, single: impl Fn(P), launch_one: impl Fn(&[u64], (u32, u32))) {
    for step in steps {
        match step {
            Step::Single(p) => single(p),
            Step::Launch { block, grid } => launch_one(&block, grid),
        }
    }
}

#[test]
fn copy_batches_as_a_gpu_plans_them_equal_the_cpu_devices_copy_2d_batch() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    type Kernel = unsafe extern "C" fn(CopyBatch);
    let kernel: Kernel = k.get("chorus_copy_batch");
    let mut rng = Rng(21);
    for dtype in [DType::U8, DType::BF16, DType::F32, DType::I64] {
        const LEN: usize = 4096;
        let e = dtype.size();
        let src_bytes: Vec<u8> = (0..LEN * e).map(|_| rng.next() as u8).collect();
        let dst_bytes: Vec<u8> = (0..LEN * e).map(|_| rng.next() as u8).collect();
        // Up to 3 blocks per piece over disjoint destination spans; every
        // fifth continues the previous piece on both sides (they merge).
        let mut layouts = Vec::new();
        let mut cursor = 0;
        for i in 0..150usize {
            let rows = 1 + (rng.next() % 3) as usize;
            let row_len = 1 + (rng.next() % 9) as usize;
            let src_stride = row_len + (rng.next() % 2) as usize * (rng.next() % 4) as usize;
            let dst_stride = row_len + (rng.next() % 2) as usize * (rng.next() % 4) as usize;
            let span = |stride: usize| (rows - 1) * stride + row_len;
            let last: Option<&Copy2d> = layouts.last();
            let layout = match last.filter(|l| i % 5 == 4 && l.rows == 1 && l.src_offset + 2 * l.row_len <= LEN) {
                Some(l) => Copy2d { src_offset: l.src_offset + l.row_len, dst_offset: cursor, ..*l },
                None => {
                    let src_offset = rng.next() as usize % (LEN - span(src_stride));
                    let dst_offset = cursor + (rng.next() % 2) as usize;
                    Copy2d { rows, row_len, src_offset, src_stride, dst_offset, dst_stride }
                }
            };
            cursor = layout.dst_offset + span(layout.dst_stride).max(layout.row_len);
            if cursor > LEN {
                break;
            }
            layouts.push(layout);
        }
        // Blocks written over one another (a destination stride of 0): the last wins.
        let rows = Copy2d { rows: 3, row_len: 5, src_offset: 7, src_stride: 6, dst_offset: cursor, dst_stride: 0 };
        if cursor + 5 <= LEN {
            layouts.push(rows);
        }
        // The cpu device's result.
        let (cs, cd) = (s.alloc(dtype, LEN).unwrap(), s.alloc(dtype, LEN).unwrap());
        s.copy_from_host(&src_bytes, cs.view()).unwrap();
        s.copy_from_host(&dst_bytes, cd.view()).unwrap();
        let pieces: Vec<_> = layouts.iter().map(|l| (cs.view(), cd.view(), *l)).collect();
        s.copy_2d_batch(&pieces).unwrap();
        let want = s.copy_to_host(cd.view()).unwrap().wait().unwrap();
        // The kernel's, on host copies at 8-byte-aligned addresses.
        let (mut src_words, mut dst_words) = (vec![0u64; LEN * e / 8 + 1], vec![0u64; LEN * e / 8 + 1]);
        bytemuck::cast_slice_mut::<u64, u8>(&mut src_words)[..LEN * e].copy_from_slice(&src_bytes);
        bytemuck::cast_slice_mut::<u64, u8>(&mut dst_words)[..LEN * e].copy_from_slice(&dst_bytes);
        let (src, dst) = (src_words.as_ptr() as u64, dst_words.as_mut_ptr() as u64);
        let steps = plan_copies(layouts.iter().filter_map(|l| CopyPiece::new(src, dst, l, e)));
        let launches = steps.iter().filter(|s| matches!(s, Step::Launch { .. })).count();
        assert!(launches >= 2, "{dtype}: the plan should need several launches, got {launches}");
        run(
            steps,
            // SAFETY: a contiguous range inside both host arrays.
            |p| unsafe { std::ptr::copy_nonoverlapping(p.src as *const u8, p.dst as *mut u8, p.row_bytes as usize) },
            |block, grid| {
                let batch = CopyBatch(block.try_into().expect("the copy block's size"));
                // SAFETY: the planner's parameter block over ranges inside the host arrays.
                k.launch(((HOST_GRID.0, grid.1), (HOST_GRID.1, 1)), || unsafe { kernel(batch) });
            },
        );
        let got = &bytemuck::cast_slice::<u64, u8>(&dst_words)[..LEN * e];
        assert!(got == want.as_slice(), "{dtype}: the kernel's copies differ from the cpu device's");
    }
}

#[test]
fn fill_batches_as_a_gpu_plans_them_equal_the_cpu_devices_fill_batch() {
    let sides = sides();
    let (k, s) = (sides.k, &sides.s);
    type Kernel = unsafe extern "C" fn(FillBatch);
    let kernel: Kernel = k.get("chorus_fill_batch");
    let mut rng = Rng(23);
    for (dtype, value) in [
        (DType::U8, Scalar::Int(0xa5)),
        (DType::BF16, Scalar::Float(-1.5)),
        (DType::F32, Scalar::Float(0.1)),
        (DType::F64, Scalar::Float(-0.1)),
    ] {
        const LEN: usize = 2048;
        let e = dtype.size();
        let bytes: Vec<u8> = (0..LEN * e).map(|_| rng.next() as u8).collect();
        let views: Vec<(usize, usize)> = (0..100)
            .map(|_| {
                let n = 1 + rng.next() as usize % 30;
                (rng.next() as usize % (LEN - n), n)
            })
            .collect();
        let c = s.alloc(dtype, LEN).unwrap();
        s.copy_from_host(&bytes, c.view()).unwrap();
        let cpu_views: Vec<_> = views.iter().map(|&(at, n)| c.slice(at, n).unwrap()).collect();
        s.fill_batch(&cpu_views, value).unwrap();
        let want = s.copy_to_host(c.view()).unwrap().wait().unwrap();
        let mut words = vec![0u64; LEN * e / 8 + 1];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..LEN * e].copy_from_slice(&bytes);
        let base = words.as_mut_ptr() as u64;
        let pattern = value.encode(dtype).unwrap();
        let steps = plan_fills(views.iter().filter_map(|&(at, n)| FillPiece::new(base + (at * e) as u64, n, &pattern)));
        run(
            steps,
            |p| {
                for i in 0..p.n {
                    let at = (p.dst + i * p.width) as *mut u8;
                    // SAFETY: an element inside the host array.
                    unsafe { std::ptr::copy_nonoverlapping(p.pattern.to_le_bytes().as_ptr(), at, p.width as usize) };
                }
            },
            |block, grid| {
                let batch = FillBatch(block.try_into().expect("the fill block's size"));
                // SAFETY: the planner's parameter block over ranges inside the host array.
                k.launch(((HOST_GRID.0, grid.1), (HOST_GRID.1, 1)), || unsafe { kernel(batch) });
            },
        );
        let got = &bytemuck::cast_slice::<u64, u8>(&words)[..LEN * e];
        assert!(got == want.as_slice(), "{dtype}: the kernel's fills differ from the cpu device's");
    }
}
