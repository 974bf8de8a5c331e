//! The f16/bf16 conversions of the shared source against the `half` crate,
//! and f64's single rounding against the cpu device.

use std::ffi::c_void;

use chorus_devices::gpu_kernels::code;
use chorus_devices::{bf16, f16, Buffer, DType, Stream};

use crate::common::FLOATS;
use crate::compare::{assert_agree, assert_bits, sides, Agree, Data};
use crate::host_build::HostKernels;
use crate::inputs::{specials, Rng};
use crate::lanes::ELEMENTWISE;

type Widen = unsafe extern "C" fn(u16) -> u32;
type Narrow = unsafe extern "C" fn(u32) -> u16;

/// `chorus_cast` of `src` into `dt`, on the host build.
pub fn cast(k: &HostKernels, src: &Data, dt: DType) -> Data {
    type Cast = unsafe extern "C" fn(*const c_void, i32, *mut c_void, i32, u64);
    let f: Cast = k.get("chorus_cast");
    let mut dst = Data::from_bytes(dt, &vec![0u8; src.len * dt.size()]);
    let (s, d, n, st) = (src.ptr(), dst.ptr_mut(), src.len as u64, code(src.dtype));
    // SAFETY: `s` holds n elements of st, `d` n of dt.
    k.launch(ELEMENTWISE, || unsafe { f(s as *const c_void, st, d as *mut c_void, code(dt), n) });
    dst
}

#[test]
fn f16_and_bf16_widen_exactly_for_all_65536_patterns() {
    let sides = sides();
    let k = sides.k;
    let (h2f, b2f): (Widen, Widen) = (k.get("chorus_host_h2f"), k.get("chorus_host_b2f"));
    for bits in 0..=u16::MAX {
        // SAFETY: pure functions of their argument.
        let (h, b) = unsafe { (h2f(bits), b2f(bits)) };
        assert_eq!(h, f16::from_bits(bits).to_f32().to_bits(), "h2f({bits:#06x})");
        assert_eq!(b, bf16::from_bits(bits).to_f32().to_bits(), "b2f({bits:#06x})");
    }
    // And through chorus_cast (widened to f64 on the way); through f64 and
    // back, every value returns and every NaN comes back quieted.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let pats: Vec<u64> = all.iter().map(|b| *b as u64).collect();
    let halves: Vec<f16> = all.iter().map(|b| f16::from_bits(*b)).collect();
    let brains: Vec<bf16> = all.iter().map(|b| bf16::from_bits(*b)).collect();
    let (h, b) = (Data::of(&halves), Data::of(&brains));
    for (what, src, expected) in [
        ("f16 -> f32", &h, Data::map(&halves, |v| v.to_f32())),
        ("f16 -> f64", &h, Data::map(&halves, |v| v.to_f64())),
        ("bf16 -> f32", &b, Data::map(&brains, |v| v.to_f32())),
        ("bf16 -> f64", &b, Data::map(&brains, |v| v.to_f64())),
        ("f16 -> f16", &h, Data::map(&halves, |v| f16::from_f32(v.to_f32()))),
        ("bf16 -> bf16", &b, Data::map(&brains, |v| bf16::from_f32(v.to_f32()))),
    ] {
        assert_bits(what, &pats, &cast(k, src, expected.dtype), &expected);
    }
}

/// f32 patterns where rounding to f16 and bf16 is decided: every value of
/// each format, the midpoint to the next and their neighbours, NaNs with
/// every payload shape, and random patterns.
fn f32_patterns() -> Vec<u32> {
    let mut p = Vec::new();
    for h in 0..=u16::MAX {
        let v = f16::from_bits(h);
        if v.is_finite() && h & 0x7fff != 0x7bff {
            let (lo, hi) = (v.to_f32() as f64, f16::from_bits(h + 1).to_f32() as f64);
            let mid = ((lo + hi) / 2.0) as f32; // exact: f16 midpoints fit in f32
            let m = mid.to_bits();
            p.extend([v.to_f32().to_bits(), m.wrapping_sub(1), m, m.wrapping_add(1)]);
        }
        let hi = (h as u32) << 16;
        p.extend([hi, hi | 1, hi | 0x7fff, hi | 0x8000, hi | 0x8001, hi | 0xffff]);
    }
    p.extend([0x7f80_0000, 0xff80_0000, 0x7f80_0001, 0x7fc0_0000, 0xffff_ffff, 0x7f80_2000, 0x7fbf_ffff]);
    p.extend([
        0x477f_efff,
        0x477f_f000,
        0x477f_f001,
        0x7f7f_ffff,
        0x3300_0000,
        0x3300_0001,
        0x32ff_ffff,
        1,
        0x8000_0001,
    ]);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    p.extend((0..1_000_000).map(|_| rng.next() as u32));
    p
}

#[test]
fn f32_narrows_to_f16_and_bf16_as_half_does_on_ties_nans_and_subnormals() {
    let sides = sides();
    let k = sides.k;
    let pats = f32_patterns();
    let (f2h, f2b): (Narrow, Narrow) = (k.get("chorus_host_f2h"), k.get("chorus_host_f2b"));
    for bits in &pats {
        let v = f32::from_bits(*bits);
        // SAFETY: pure functions of their argument.
        let (h, b) = unsafe { (f2h(*bits), f2b(*bits)) };
        assert_eq!(h, f16::from_f32(v).to_bits(), "f2h({bits:#010x})");
        assert_eq!(b, bf16::from_f32(v).to_bits(), "f2b({bits:#010x})");
    }
    // And through chorus_cast (widened to f64 and rounded to odd on the way).
    let input: Vec<u64> = pats.iter().map(|b| *b as u64).collect();
    let values: Vec<f32> = pats.iter().map(|b| f32::from_bits(*b)).collect();
    let src = Data::of(&values);
    assert_bits("f32 -> f16", &input, &cast(k, &src, DType::F16), &Data::map(&values, |v| f16::from_f32(*v)));
    assert_bits("f32 -> bf16", &input, &cast(k, &src, DType::BF16), &Data::map(&values, |v| bf16::from_f32(*v)));
    // The f32 store path (`stf`, what arithmetic results take): scaling by one.
    type Scale = unsafe extern "C" fn(*mut c_void, i32, u64, f64);
    let scale: Scale = k.get("chorus_scale");
    for dt in [DType::F16, DType::BF16] {
        let mut x = cast(k, &src, dt);
        let expected = x.clone();
        let (p, n) = (x.ptr_mut(), x.len as u64);
        // SAFETY: n elements of dt.
        k.launch(ELEMENTWISE, || unsafe { scale(p as *mut c_void, code(dt), n, 1.0) });
        assert_agree(&format!("{dt} scaled by 1"), &x, &expected, Agree::Bits);
    }
}

#[test]
fn f64_narrows_once_like_the_cpu_device() {
    let sides = sides();
    // Just above and below every f16 and bf16 tie (where rounding through f32
    // to nearest would round twice), random values and the specials.
    let mut values: Vec<f64> = Vec::new();
    for h in 0..0x7bffu16 {
        let (lo, hi) = (f16::from_bits(h).to_f64(), f16::from_bits(h + 1).to_f64());
        let mid = (lo + hi) / 2.0;
        values.extend([mid, f64::from_bits(mid.to_bits() + 1), f64::from_bits(mid.to_bits() - 1), -mid]);
        let (blo, bhi) = (bf16::from_bits(h).to_f64(), bf16::from_bits(h + 1).to_f64());
        let bmid = (blo + bhi) / 2.0;
        values.extend([bmid, f64::from_bits(bmid.to_bits() + 1), f64::from_bits(bmid.to_bits() - 1)]);
    }
    let mut rng = Rng(7);
    values.extend((0..200_000).map(|_| f64::from_bits(rng.next())));
    values.extend(specials());
    let src = Data::of(&values);
    let (b, s) = (sides.upload(&src), &sides.s);
    for dt in FLOATS {
        let out = s.alloc(dt, values.len()).unwrap();
        s.cast(b.view(), out.view()).unwrap();
        assert_agree(&format!("f64 -> {dt}"), &cast(sides.k, &src, dt), &Data::from_cpu(s, &out), Agree::Bits);
    }
}
