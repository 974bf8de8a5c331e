//! Helpers shared by the device tests: cpu devices with known settings, a
//! gate that holds a stream at a point of its queue (on any device), host-side
//! reference rounding, and typed uploads and downloads through f64.
#![allow(dead_code)]

use std::sync::mpsc;
use std::time::Duration;

use anyhow::{ensure, Context};
use chorus_devices::cpu::{CpuConfig, CpuDevice};
use chorus_devices::{with_element, Backend, DType, Device, Element, Priority, Stream, View};

/// The deadline of test devices: long enough never to fire on a loaded
/// machine, short enough that a broken wait fails the test instead of hanging CI.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a gate job waits to be opened before failing its stream.
const GATE_LIMIT: Duration = Duration::from_secs(20);

/// A device with the sanitizer on.
pub fn device() -> CpuDevice {
    device_with(TEST_TIMEOUT)
}

/// A device with the sanitizer on and the given deadline.
pub fn device_with(timeout: Duration) -> CpuDevice {
    CpuDevice::new(CpuConfig::default().with_timeout(timeout))
}

/// A device with the sanitizer off.
///
/// # Safety
/// As [`CpuConfig::without_sanitizer`]: the test must never let two streams
/// touch one buffer at the same time (it holds one back with a [`Gate`], or
/// the other's work is skipped).
pub unsafe fn device_without_sanitizer() -> CpuDevice {
    // SAFETY: the caller's obligation.
    CpuDevice::new(unsafe { CpuConfig::default().with_timeout(TEST_TIMEOUT).without_sanitizer() })
}

/// A normal-priority stream.
pub fn stream<D: Device>(device: &D) -> anyhow::Result<<D::B as Backend>::Stream> {
    Ok(device.create_stream(Priority::Normal)?)
}

/// Holds a stream at the point where it was closed: a host function blocks
/// the stream until [`Gate::open`] (or drop, or a time limit). Lets tests
/// observe in-flight states deterministically, without timing assumptions,
/// on every device.
pub struct Gate {
    tx: Option<mpsc::Sender<()>>,
}

impl Gate {
    /// Enqueues the blocking host function on `stream`.
    pub fn close<S: Stream>(stream: &S) -> anyhow::Result<Gate> {
        let (tx, rx) = mpsc::channel::<()>();
        stream.launch_host_fn(Box::new(move |_| {
            let _ = rx.recv_timeout(GATE_LIMIT);
        }))?;
        Ok(Gate { tx: Some(tx) })
    }

    /// Lets the stream go on.
    pub fn open(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.release();
    }
}

/// A small deterministic generator (64-bit LCG, high bits), so tests need no `rand`.
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Lcg {
        Lcg(seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * unit
    }
    /// `n` values uniform in `[lo, hi)`, rounded to `dtype` so they upload exactly.
    pub fn values(&mut self, dtype: DType, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| round_to(dtype, self.uniform(lo, hi))).collect()
    }
}

/// Significand bits (with the implicit one), minimum normal exponent and
/// maximum exponent of a binary float format.
fn format(dtype: DType) -> Option<(i32, i32, i32)> {
    match dtype {
        DType::F32 => Some((24, -126, 127)),
        DType::F16 => Some((11, -14, 15)),
        DType::BF16 => Some((8, -126, 127)),
        _ => None,
    }
}

/// `v` rounded to the nearest value of float `dtype`, ties to even, with
/// gradual underflow and overflow to infinity: IEEE 754 written out on the
/// exact f64 value (every narrower format's values are exact f64s, and
/// dividing by a power of two is exact).
pub fn round_to(dtype: DType, v: f64) -> f64 {
    let Some((precision, emin, emax)) = format(dtype) else {
        assert_eq!(dtype, DType::F64, "round_to is for float dtypes");
        return v;
    };
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    let biased = ((v.abs().to_bits() >> 52) & 0x7ff) as i32;
    let exponent = if biased == 0 { -1023 } else { biased - 1023 }.max(emin);
    let ulp = 2f64.powi(exponent - (precision - 1));
    let rounded = (v / ulp).round_ties_even() * ulp;
    let max = (2.0 - 2f64.powi(1 - precision)) * 2f64.powi(emax);
    if rounded.abs() > max {
        f64::INFINITY.copysign(v)
    } else {
        rounded
    }
}

/// Whether two results are the same value, bit for bit (signed zeros apart), or both NaN.
pub fn same_value(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

/// Encodes values of a float or integer dtype, little-endian. Each value must
/// be exactly representable (tests build inputs with [`round_to`]).
pub fn encode(dtype: DType, values: &[f64]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        let exact = with_element!(dtype, T => {
            let e = T::from_f64(v);
            out.extend_from_slice(bytemuck::bytes_of(&e));
            e.to_f64()
        });
        ensure!(same_value(exact, v), "{v} is not exactly representable in {dtype}");
    }
    Ok(out)
}

/// Decodes little-endian elements of `dtype` to f64 (exact for every dtype used here).
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let element = |c: &[u8]| with_element!(dtype, T => bytemuck::pod_read_unaligned::<T>(c).to_f64());
    bytes.chunks_exact(dtype.size()).map(element).collect()
}

/// Uploads exactly representable values into `dst` (any dtype).
pub fn put<S: Stream>(stream: &S, dst: View<'_, S::B>, values: &[f64]) -> anyhow::Result<()> {
    let bytes = encode(dst.dtype(), values)?;
    stream.copy_from_host(&bytes, dst)?;
    Ok(())
}

/// Reads `src` back as f64 values (blocks until the copy has run).
pub fn get<S: Stream>(stream: &S, src: View<'_, S::B>) -> anyhow::Result<Vec<f64>> {
    let dtype = src.dtype();
    let bytes = stream.copy_to_host(src)?.wait().context("readback")?;
    Ok(decode(dtype, &bytes))
}

/// Asserts `got[i]` is within `tol[i]` of `want[i]`, naming the first miss.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let t = tol(i);
        assert!((g - w).abs() <= t, "{what}[{i}]: got {g}, expected {w} (tolerance {t:e}, off by {:e})", (g - w).abs());
    }
}

/// Asserts two value lists are identical (bitwise, NaN equal to NaN).
pub fn assert_same(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(same_value(*g, *w), "{what}[{i}]: got {g:e} ({:#x}), expected {w:e} ({:#x})", g.to_bits(), w.to_bits());
    }
}

/// The machine epsilon (half an ulp of 1.0 relative, i.e. the unit roundoff) of a float dtype.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 2f64.powi(-53),
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
