//! The deterministic generator chorus's initialisations, data sets and
//! tests draw from (the seeded weights of `chorus::model`, chorus-train's
//! models): SplitMix64, so a seed gives the same numbers on every machine,
//! version and rank.

/// SplitMix64 (Steele, Lea and Flood, 2014): a counter advanced by the
/// golden ratio, each output the counter through [`mix`].
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        finalize(self.0)
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
}

/// The step of SplitMix64's counter (2⁶⁴ / φ).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (Stafford's "Mix13"), a bijection.
fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A bijective mix of a 64-bit number: SplitMix64's first output seeded
/// with it (counter-based draws: any element computed alone).
pub fn mix(z: u64) -> u64 {
    SplitMix::new(z).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first outputs of Vigna's splitmix64.c seeded with 1234567 (the
    /// values Rosetta Code's SplitMix64 task lists).
    #[test]
    fn matches_the_reference_implementation() {
        let mut r = SplitMix::new(1234567);
        let want = [6457827717110365317u64, 3203168211198807973, 9817491932198370423, 4593380528125082431];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
        assert_eq!(mix(1234567), want[0]);
    }
}
