//! The inputs: a deterministic generator and the values that stress rounding.

/// A deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Values spread over many binades, both signs, with exact zeros.
    pub fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| match i % 17 {
                0 => 0.0,
                1 => -0.0,
                _ => {
                    let sign = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
                    sign * (1.0 + self.unit()) * 2f64.powi((self.next() % 24) as i32 - 12)
                }
            })
            .collect()
    }
}

/// Values whose every product and sum is exact in f32 (multiples of 1/8, |v| ≤ 1).
pub fn dyadic(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| (rng.next() % 17) as f64 / 8.0 - 1.0).collect()
}

/// NaN (two payloads), infinities, zeros, the f32/f16 subnormal ranges, huge values.
pub fn specials() -> Vec<f64> {
    vec![
        f64::NAN,
        f64::from_bits(0x7ff0_0000_0000_0001),
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        -3e-42,
        6e-8,
        -3e-8,
        65504.0,
        65520.0,
        -1e300,
        3.5e38,
        1.0 + 1.0 / 2048.0,
        1.0 + 1.0 / 256.0 + 1e-12,
    ]
}
