//! What every `chorus train` run says: lines on stdout, medians, and the
//! honest summary of a loss curve.

use std::io::Write;

use anyhow::Context;

/// The median of `values` (0 for none).
pub(super) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Writes a line to stdout; a closed pipe or a full disk is an error the
/// caller returns (main ends a broken pipe quietly), never a panic.
pub(super) fn say(line: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(line).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush()).context("writing to stdout")
}

/// The honest summary of a loss curve: the mean of the first and of the
/// last `window` steps (a tenth of the run, at least one step).
pub(super) struct LossSummary {
    pub(super) window: usize,
    pub(super) start: f64,
    pub(super) end: f64,
}

/// `n` steps from `first`, as a closing line names them: "step 7" or "steps 7-9".
pub(super) fn span(first: u64, n: usize) -> String {
    match n {
        0 | 1 => format!("step {first}"),
        n => format!("steps {first}-{}", first + n as u64 - 1),
    }
}

/// The [`LossSummary`] of `losses`.
pub(super) fn summarize(losses: &[f64]) -> LossSummary {
    let window = (losses.len() / 10).max(1);
    LossSummary {
        window,
        start: mean(&losses[..window.min(losses.len())]),
        end: mean(&losses[losses.len().saturating_sub(window)..]),
    }
}
