//! Element types that buffers hold, and the host types that correspond to them.

use half::{bf16, f16};
use std::fmt;

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the upper half of a binary32).
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// OCP float8 e4m3 "fn" (torch's `float8_e4m3fn`): 4 exponent bits (bias
    /// 7), 3 mantissa bits, no infinities, largest finite ±448, NaN 0x7f/0xff.
    /// A storage format: copies and data-moving collectives take it;
    /// arithmetic and reductions do not. Values get in and out through the
    /// scaled casts ([`Stream::quantize_f8`](crate::Stream::quantize_f8),
    /// [`Stream::dequantize_f8`](crate::Stream::dequantize_f8)).
    F8E4M3,
}

impl DType {
    /// Every dtype with arithmetic, in a fixed order (used by the conformance
    /// suite and the CLI): all but the storage-only [`DType::F8E4M3`].
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::I8, DType::U8];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::F8E4M3 => 1,
        }
    }

    /// The short name used on the command line and in reports (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::F8E4M3 => "f8e4m3",
        }
    }

    /// Whether this is a floating-point dtype with arithmetic (the float8
    /// storage format is not: see [`DType::F8E4M3`]).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether collectives may reduce (sum, max, ...) buffers of this dtype.
    pub const fn is_reducible(self) -> bool {
        !matches!(self, DType::F8E4M3)
    }

    /// Parses a name as printed by [`DType::name`].
    pub fn parse(name: &str) -> Option<DType> {
        DType::ALL.into_iter().chain([DType::F8E4M3]).find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::parse(s).ok_or_else(|| {
            let names: Vec<_> = DType::ALL.iter().map(|d| d.name()).collect();
            format!("unknown dtype `{s}` (expected one of {}, f8e4m3)", names.join(", "))
        })
    }
}

/// A host type that is the element of a buffer of dtype [`Element::DTYPE`].
///
/// `to_f64`/`from_f64` give exact conversions for floats and integers within
/// range; `from_f64` rounds to nearest even for narrower floats.
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The dtype of buffers holding this type.
    const DTYPE: DType;
    /// Widens to f64 (exact for every type except i64 beyond 2^53).
    fn to_f64(self) -> f64;
    /// Converts from f64: round to nearest even for floats, saturating truncation for integers.
    fn from_f64(v: f64) -> Self;
}

/// Evaluates `$body` with `$t` the [`Element`] type of `$dtype`, a [`DType`]
/// known only at run time: the one table from dtypes to host types.
///
/// ```
/// use chorus_devices::{with_element, DType, Element};
/// let width = |d: DType| with_element!(d, T => std::mem::size_of::<T>());
/// assert_eq!(width(DType::BF16), 2);
/// assert_eq!(with_element!(DType::I8, T => T::from_f64(300.0).to_f64()), 127.0);
/// ```
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        $crate::with_element!(@table $dtype, $t => $body;
            F32 f32, F64 f64, F16 $crate::f16, BF16 $crate::bf16, I32 i32, I64 i64, I8 i8, U8 u8,
            F8E4M3 $crate::Float8E4M3)
    };
    (@table $dtype:expr, $t:ident => $body:expr; $($name:ident $ty:ty),*) => {
        match $dtype {
            $($crate::DType::$name => {
                type $t = $ty;
                $body
            })*
        }
    };
}

macro_rules! element {
    ($t:ty, $d:expr, |$s:ident| $to:expr, |$v:ident| $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_f64(self) -> f64 {
                let $s = self;
                $to
            }
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}

element!(f32, DType::F32, |s| s as f64, |v| v as f32);
element!(f64, DType::F64, |s| s, |v| v);
element!(f16, DType::F16, |s| s.to_f64(), |v| f16::from_f32(f32_round_to_odd(v)));
element!(bf16, DType::BF16, |s| s.to_f64(), |v| bf16::from_f32(f32_round_to_odd(v)));

/// `v` rounded to f32 *to odd*: truncated toward zero, with the lowest bit set
/// when that lost anything. Rounding the result to nearest even in a format
/// at least two bits narrower (f16, bf16) then rounds `v` correctly, once.
/// `half`'s own f64 conversions do not: they drop the low 32 bits of the
/// significand (or go through f32 rounded to nearest), so values just above
/// a tie round down.
fn f32_round_to_odd(v: f64) -> f32 {
    let nearest = v as f32;
    if nearest.is_nan() || nearest as f64 == v {
        return nearest;
    }
    // Inexact, so `nearest` is not zero when it is the larger in magnitude,
    // and one step down in magnitude is one step down in the bit pattern.
    let toward_zero = if (nearest as f64).abs() > v.abs() { f32::from_bits(nearest.to_bits() - 1) } else { nearest };
    f32::from_bits(toward_zero.to_bits() | 1)
}
element!(i32, DType::I32, |s| s as f64, |v| v as i32);
element!(i64, DType::I64, |s| s as f64, |v| v as i64);
element!(i8, DType::I8, |s| s as f64, |v| v as i8);
element!(u8, DType::U8, |s| s as f64, |v| v as u8);
element!(Float8E4M3, DType::F8E4M3, |s| s.to_f32() as f64, |v| Float8E4M3::from_f64(v));

/// One float8 e4m3fn value ([`DType::F8E4M3`]) as its bit pattern.
///
/// Conversions into it round to nearest even and saturate: finite values
/// beyond ±448 and infinities become ±448 (what torch's
/// `x.clamp(-448, 448).to(torch.float8_e4m3fn)` gives, torchao's cast); NaN
/// stays NaN (0x7f, or 0xff when negative).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Float8E4M3(pub u8);

impl Float8E4M3 {
    /// The largest finite value, 448.
    pub const MAX: f32 = 448.0;

    /// `v` rounded to nearest even, saturated to ±[`MAX`](Self::MAX).
    pub fn from_f64(v: f64) -> Float8E4M3 {
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        if v.is_nan() {
            return Float8E4M3(sign | 0x7f);
        }
        let a = v.abs().min(Self::MAX as f64);
        // Below 2^-6 the format is fixed-point in steps of 2^-9, and the code
        // is the step count: 8 steps is 2^-6, the smallest normal, code 0x08.
        if a < 1.0 / 64.0 {
            return Float8E4M3(sign | (a * 512.0).round_ties_even() as u8);
        }
        // Normal: keep 3 of f64's 52 mantissa bits, rounding to nearest even
        // on the bit pattern (a carry moves into the exponent, as it should);
        // then rebias the exponent from 1023 to 7. `a` ≤ 448 cannot round past 448.
        let bits = a.to_bits();
        let rounded = (bits + (1 << 48) - 1 + ((bits >> 49) & 1)) >> 49;
        Float8E4M3(sign | (rounded - ((1023 - 7) << 3)) as u8)
    }

    /// The smallest amax a scale is computed from (torchao's `EPS`), so an
    /// all-zero tensor gets a finite scale.
    pub const SCALE_EPS: f64 = 1e-12;

    /// The tensorwise scale of a tensor whose largest magnitude is `amax`:
    /// `448 / max(amax, 1e-12)` computed in f64 and rounded to f32, as
    /// torchao's `amax_to_scale` (no rounding to a power of two, its
    /// default). A NaN `amax` gives a NaN scale, as `torch.clamp` does.
    /// Every device's scaled-cast kernels compute the scale so.
    pub fn scale_for(amax: f32) -> f32 {
        let a = amax as f64;
        let a = if a < Self::SCALE_EPS { Self::SCALE_EPS } else { a };
        (Self::MAX as f64 / a) as f32
    }

    /// `v` rounded to nearest even, saturated (f32 widens to f64 exactly).
    pub fn from_f32(v: f32) -> Float8E4M3 {
        Float8E4M3::from_f64(v as f64)
    }

    /// The value (exact: every e4m3 value is an f32).
    pub fn to_f32(self) -> f32 {
        let magnitude = self.0 & 0x7f;
        let (exponent, mantissa) = ((magnitude >> 3) as i32, (magnitude & 7) as f32);
        let a = match (magnitude, exponent) {
            (0x7f, _) => f32::NAN,
            (_, 0) => mantissa * (1.0 / 512.0),
            _ => (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7),
        };
        if self.0 & 0x80 != 0 {
            -a
        } else {
            a
        }
    }
}

impl fmt::Debug for Float8E4M3 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (0x{:02x})", self.to_f32(), self.0)
    }
}

/// A scalar for `fill`: floats and integers kept apart so i64 values stay exact.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// A floating-point value, rounded to the buffer's dtype.
    Float(f64),
    /// An integer value; must fit the buffer's dtype.
    Int(i64),
}

impl Scalar {
    /// Encodes this scalar as one element of `dtype`, little-endian, or says why it cannot.
    pub fn encode(self, dtype: DType) -> Result<Vec<u8>, String> {
        fn int_in<T: TryFrom<i64> + bytemuck::Pod>(v: i64, dtype: DType) -> Result<Vec<u8>, String> {
            T::try_from(v).map(|x| bytemuck::bytes_of(&x).to_vec()).map_err(|_| format!("{v} does not fit in {dtype}"))
        }
        match (self, dtype) {
            (Scalar::Float(v), DType::F32) => Ok((v as f32).to_le_bytes().to_vec()),
            (Scalar::Float(v), DType::F64) => Ok(v.to_le_bytes().to_vec()),
            (Scalar::Float(v), DType::F16) => Ok(<f16 as Element>::from_f64(v).to_le_bytes().to_vec()),
            (Scalar::Float(v), DType::BF16) => Ok(<bf16 as Element>::from_f64(v).to_le_bytes().to_vec()),
            (Scalar::Float(v), DType::F8E4M3) => Ok(vec![Float8E4M3::from_f64(v).0]),
            (Scalar::Int(v), DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3) => {
                Scalar::Float(v as f64).encode(dtype)
            }
            (Scalar::Int(v), DType::I32) => int_in::<i32>(v, dtype),
            (Scalar::Int(v), DType::I64) => int_in::<i64>(v, dtype),
            (Scalar::Int(v), DType::I8) => int_in::<i8>(v, dtype),
            (Scalar::Int(v), DType::U8) => int_in::<u8>(v, dtype),
            (Scalar::Float(v), d) => {
                if v.fract() == 0.0 && v.abs() < 9.0e15 {
                    Scalar::Int(v as i64).encode(d)
                } else {
                    Err(format!("{v} is not an integer; cannot fill a {d} buffer with it"))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::I64.size(), 8);
        assert!("f8".parse::<DType>().is_err());
        assert_eq!(DType::parse("f8e4m3"), Some(DType::F8E4M3));
        assert_eq!(DType::F8E4M3.size(), 1);
        assert!(!DType::F8E4M3.is_reducible() && !DType::F8E4M3.is_float());
    }

    /// Hand-checked e4m3fn encodings: value in, bit pattern out, value back.
    #[test]
    fn float8_e4m3_encodes_a_table_of_hand_checked_values() {
        let table: &[(f64, u8, f32)] = &[
            (0.0, 0x00, 0.0),
            (-0.0, 0x80, -0.0),
            (1.0 / 512.0, 0x01, 1.0 / 512.0),  // smallest subnormal, 2^-9
            (7.0 / 512.0, 0x07, 7.0 / 512.0),  // largest subnormal
            (0.5 / 512.0, 0x00, 0.0),          // half the smallest: tie to even (0)
            (1.5 / 512.0, 0x02, 2.0 / 512.0),  // tie between 1 and 2 steps: even (2)
            (0.75 / 512.0, 0x01, 1.0 / 512.0), // above the tie: up
            (7.5 / 512.0, 0x08, 1.0 / 64.0),   // rounds up into the smallest normal
            (1.0 / 64.0, 0x08, 1.0 / 64.0),    // 2^-6
            (0.0625, 0x18, 0.0625),            // 2^-4: exponent field 3
            (1.0, 0x38, 1.0),
            (1.0625, 0x38, 1.0),  // tie between 1 and 1.125: even (1)
            (1.1875, 0x3a, 1.25), // tie between 1.125 and 1.25: even (1.25)
            (1.07, 0x39, 1.125),  // above the tie: up
            (-3.0, 0xc4, -3.0),
            (15.5, 0x58, 16.0), // tie 15 / 16: even mantissa (16)
            (240.0, 0x77, 240.0),
            (416.0, 0x7d, 416.0),
            (432.0, 0x7e, 448.0), // tie 416 / 448: even (448)
            (448.0, 0x7e, 448.0),
            (449.0, 0x7e, 448.0), // saturates, not NaN
            (1.0e6, 0x7e, 448.0),
            (f64::INFINITY, 0x7e, 448.0),
            (-449.0, 0xfe, -448.0),
            (f64::NEG_INFINITY, 0xfe, -448.0),
        ];
        for &(v, code, back) in table {
            let q = Float8E4M3::from_f64(v);
            assert_eq!(q.0, code, "{v} encodes to 0x{:02x}, expected 0x{code:02x}", q.0);
            assert_eq!(q.to_f32().to_bits(), back.to_bits(), "0x{code:02x} decodes to {}", q.to_f32());
        }
        assert_eq!(Float8E4M3::from_f64(f64::NAN).0 & 0x7f, 0x7f);
        assert!(Float8E4M3(0x7f).to_f32().is_nan() && Float8E4M3(0xff).to_f32().is_nan());
    }

    #[test]
    fn float8_scale_follows_torchaos_amax_to_scale() {
        assert_eq!(Float8E4M3::scale_for(448.0), 1.0);
        assert_eq!(Float8E4M3::scale_for(2.0), 224.0);
        assert_eq!(Float8E4M3::scale_for(0.0), (448.0f64 / 1e-12) as f32);
        assert_eq!(Float8E4M3::scale_for(3.0), (448.0f64 / 3.0) as f32);
        assert!(Float8E4M3::scale_for(f32::NAN).is_nan());
    }

    /// Every code decodes to a value that encodes back to that code (NaN
    /// aside), and the decoded values increase with the code.
    #[test]
    fn float8_e4m3_round_trips_every_code() {
        let mut last = -1.0f32;
        for code in 0u8..0x7f {
            let v = Float8E4M3(code).to_f32();
            assert!(v > last || code == 0, "0x{code:02x}");
            last = v;
            assert_eq!(Float8E4M3::from_f32(v).0, code);
            assert_eq!(Float8E4M3::from_f32(-v).0, code | 0x80);
        }
        assert_eq!(last, 448.0);
    }

    #[test]
    fn scalar_encoding_checks_range() {
        assert_eq!(Scalar::Int(-1).encode(DType::I8).unwrap(), vec![0xff]);
        assert!(Scalar::Int(300).encode(DType::U8).is_err());
        assert!(Scalar::Float(0.5).encode(DType::I32).is_err());
        assert_eq!(Scalar::Float(1.0).encode(DType::BF16).unwrap(), vec![0x80, 0x3f]);
        assert_eq!(Scalar::Float(1.0).encode(DType::F8E4M3).unwrap(), vec![0x38]);
        assert_eq!(Scalar::Int(-2).encode(DType::F8E4M3).unwrap(), vec![0xc0]);
    }
}
