//! The learning-rate schedule: a linear warmup, then a decay to a floor
//! over the remaining steps, as torchtitan's `linear_warmup_stable_decay`
//! computes its factor and PyTorch's `LambdaLR` applies it: the lr used AT
//! step `s` (0-based) is `base · λ(s)`.
//!
//! With `W` warmup steps of `T` in all, `D = T − W` decay steps and the
//! floor `m = min_lr / base`:
//! - `s < W`: `λ = (s + 1) / (W + 1)`;
//! - otherwise, without decay: `λ = 1`;
//! - otherwise `p = (s + 1 − W) / (D + 1)` and `λ = m + (1 − m)·f(p)`, with
//!   `f(p) = 1 − p` (linear) or `(1 + cos πp) / 2` (cosine);
//!
//! `s` past `T` counts as `T` (a resumed run asked for more steps keeps the
//! floor). The `+ 1`s keep the lr of the first and the last step above zero.

use std::fmt;
use std::str::FromStr;

/// How the lr falls after the warmup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// Constant at the base lr.
    #[default]
    None,
    /// Linearly to the floor.
    Linear,
    /// Along half a cosine to the floor.
    Cosine,
}

impl FromStr for Decay {
    type Err = String;
    fn from_str(s: &str) -> Result<Decay, String> {
        match s {
            "none" => Ok(Decay::None),
            "linear" => Ok(Decay::Linear),
            "cosine" => Ok(Decay::Cosine),
            _ => Err(format!("unknown lr decay `{s}` (none, linear, cosine)")),
        }
    }
}

impl fmt::Display for Decay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Decay::None => "none",
            Decay::Linear => "linear",
            Decay::Cosine => "cosine",
        })
    }
}

/// A learning-rate schedule (over a run's `--steps`, given when it is applied).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Schedule {
    /// Steps of linear warmup (at most `total_steps`).
    pub warmup_steps: u64,
    /// The decay after the warmup.
    pub decay: Decay,
    /// The lr the decay ends at (absolute; at most the base lr).
    pub min_lr: f64,
}

impl Schedule {
    /// Checks the schedule against the run: the warmup fits in its
    /// `total_steps`, the floor is finite, not negative and not above the base lr.
    pub fn validate(&self, total_steps: u64, base_lr: f64) -> Result<(), String> {
        if self.warmup_steps > total_steps {
            return Err(format!("--warmup-steps {} exceeds --steps {total_steps}", self.warmup_steps));
        }
        if !self.min_lr.is_finite() || self.min_lr < 0.0 || self.min_lr > base_lr {
            return Err(format!("--min-lr {} must be between 0 and the lr {base_lr}", self.min_lr));
        }
        Ok(())
    }

    /// The factor λ(`step`) the base lr is multiplied by at `step` of a
    /// run of `total_steps`.
    pub fn factor(&self, step: u64, total_steps: u64, base_lr: f64) -> f64 {
        let (w, t) = (self.warmup_steps, total_steps);
        let s = step.min(t);
        if s < w {
            return (s + 1) as f64 / (w + 1) as f64;
        }
        let d = t - w.min(t);
        if self.decay == Decay::None || d == 0 {
            return 1.0;
        }
        let p = (s + 1 - w) as f64 / (d + 1) as f64;
        let f = match self.decay {
            Decay::Linear => 1.0 - p,
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
            Decay::None => 1.0,
        };
        let m = if base_lr > 0.0 { self.min_lr / base_lr } else { 0.0 };
        m + (1.0 - m) * f
    }

    /// The lr used at `step` of a run of `total_steps` for the base lr `base_lr`.
    pub fn lr(&self, step: u64, total_steps: u64, base_lr: f64) -> f64 {
        base_lr * self.factor(step, total_steps, base_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the closed forms written out independently per phase.
    #[test]
    fn factors_follow_the_closed_forms() {
        let base = 0.1;
        let cos = Schedule { warmup_steps: 10, decay: Decay::Cosine, min_lr: 0.01 };
        // Warmup: 1/11, 2/11, ... 10/11.
        for s in 0..10 {
            assert!((cos.lr(s, 100, base) - base * (s as f64 + 1.0) / 11.0).abs() < 1e-15);
        }
        // Step 10 starts the decay at p = 1/91; the last step (99) ends at p = 90/91.
        let expect = |p: f64| 0.01 + 0.09 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
        assert!((cos.lr(10, 100, base) - expect(1.0 / 91.0)).abs() < 1e-15);
        assert!((cos.lr(99, 100, base) - expect(90.0 / 91.0)).abs() < 1e-15);
        // Where the cosine crosses its middle (T = 101 puts p = 1/2 at step 55):
        // the mean of base and floor.
        assert!((cos.lr(55, 101, base) - 0.055).abs() < 1e-15);
        // Past the end: the lr of step T (p = 1), the floor.
        assert!((cos.lr(500, 100, base) - 0.01).abs() < 1e-15);

        let lin = Schedule { decay: Decay::Linear, min_lr: 0.0, ..cos };
        assert!((lin.lr(10, 100, base) - base * (1.0 - 1.0 / 91.0)).abs() < 1e-15);
        assert!((lin.lr(54, 100, base) - base * (1.0 - 45.0 / 91.0)).abs() < 1e-15);

        let flat = Schedule { decay: Decay::None, ..cos };
        assert_eq!(flat.lr(9, 100, base), base * 10.0 / 11.0);
        assert_eq!(flat.lr(10, 100, base), base);
        assert_eq!(flat.lr(99, 100, base), base);
        assert_eq!(Schedule::default().lr(3, 5, base), base);
    }

    #[test]
    fn bad_schedules_are_refused() {
        let s = Schedule { warmup_steps: 11, decay: Decay::Cosine, min_lr: 0.0 };
        assert!(s.validate(10, 0.1).unwrap_err().contains("--warmup-steps 11"));
        assert!(s.validate(11, 0.1).is_ok());
        let s = Schedule { warmup_steps: 1, min_lr: 0.2, ..s };
        assert!(s.validate(10, 0.1).unwrap_err().contains("--min-lr"));
        assert!(Schedule { min_lr: f64::NAN, ..s }.validate(10, 0.1).is_err());
        assert!("cos".parse::<Decay>().is_err());
        assert_eq!("cosine".parse::<Decay>(), Ok(Decay::Cosine));
    }
}
