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
}

impl DType {
    /// Every dtype, in a fixed order (used by the conformance suite and the CLI).
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::I8, DType::U8];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 => 1,
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
        }
    }

    /// Whether this is a floating-point dtype.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Parses a name as printed by [`DType::name`].
    pub fn parse(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
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
            format!("unknown dtype `{s}` (expected one of {})", names.join(", "))
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
            F32 f32, F64 f64, F16 $crate::f16, BF16 $crate::bf16, I32 i32, I64 i64, I8 i8, U8 u8)
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
            (Scalar::Int(v), DType::F32 | DType::F64 | DType::F16 | DType::BF16) => {
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
    }

    #[test]
    fn scalar_encoding_checks_range() {
        assert_eq!(Scalar::Int(-1).encode(DType::I8).unwrap(), vec![0xff]);
        assert!(Scalar::Int(300).encode(DType::U8).is_err());
        assert!(Scalar::Float(0.5).encode(DType::I32).is_err());
        assert_eq!(Scalar::Float(1.0).encode(DType::BF16).unwrap(), vec![0x80, 0x3f]);
    }
}
