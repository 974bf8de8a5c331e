//! The loss curve of a run as an SVG (plotters), beside `summary.json`,
//! with the validation loss as a second curve where the run evaluated.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

/// Losses beyond this magnitude are drawn at it.
const LIMIT: f64 = 1e30;

/// A moving average of `values` over `window` steps (the mean of the last
/// `window` values at each step; fewer at the start).
pub fn smooth(values: &[f64], window: usize) -> Vec<f64> {
    let w = window.max(1);
    (0..values.len())
        .map(|i| {
            let lo = (i + 1).saturating_sub(w);
            values[lo..=i].iter().sum::<f64>() / (i + 1 - lo) as f64
        })
        .collect()
}

/// Draws `losses` (per step, starting at `first_step`) and their moving
/// average into an SVG at `path` ([`loss_curves`] without validation).
pub fn loss_curve(path: &Path, title: &str, first_step: u64, losses: &[f64], window: usize) -> anyhow::Result<()> {
    loss_curves(path, title, first_step, losses, window, &[])
}

/// Draws `losses` (per step, starting at `first_step`), their moving
/// average and the validation losses `val` (`[step, loss]` pairs, a second
/// curve with a marker at each evaluation) into an SVG at `path`.
/// Non-finite training losses are left out of the lines and marked by red
/// crosses along the top of the plot (non-finite validation losses are
/// left out); finite ones are clamped to +-1e30 so the axis range and its
/// padding stay finite (plotters loops forever on an infinite range).
pub fn loss_curves(
    path: &Path,
    title: &str,
    first_step: u64,
    losses: &[f64],
    window: usize,
    val: &[(u64, f64)],
) -> anyhow::Result<()> {
    let clamp = |v: f64| if v.is_finite() { v.clamp(-LIMIT, LIMIT) } else { v };
    let losses: Vec<f64> = losses.iter().map(|v| clamp(*v)).collect();
    let losses = &losses[..];
    let val: Vec<(f64, f64)> = val.iter().filter(|(_, v)| v.is_finite()).map(|(s, v)| (*s as f64, clamp(*v))).collect();
    let (lo, hi) = losses
        .iter()
        .chain(val.iter().map(|(_, v)| v))
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(*v), b.max(*v)));
    let (lo, hi) = match (lo.is_finite(), hi > lo) {
        (true, true) => (lo, hi),
        (true, false) => (lo - 1.0, lo + 1.0),
        (false, _) => (0.0, 1.0),
    };
    let pad = (hi - lo) * 0.05;
    let x_end = (first_step + losses.len().max(1) as u64) as f64;
    let x_end = val.iter().map(|(s, _)| s + 1.0).fold(x_end, f64::max);
    let x_start = val.iter().map(|(s, _)| *s).fold(first_step as f64, f64::min);
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x_start..x_end, (lo - pad)..(hi + pad))?;
        chart.configure_mesh().x_desc("step").y_desc("loss").draw()?;
        let points = |v: &[f64]| -> Vec<(f64, f64)> {
            v.iter()
                .enumerate()
                .filter(|(_, y)| y.is_finite())
                .map(|(i, y)| ((first_step + i as u64) as f64, *y))
                .collect()
        };
        chart
            .draw_series(LineSeries::new(points(losses), RGBColor(160, 180, 220)))?
            .label("loss per step")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RGBColor(160, 180, 220)));
        chart
            .draw_series(LineSeries::new(points(&smooth(losses, window)), BLUE.stroke_width(2)))?
            .label(format!("moving average ({window} steps)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        if !val.is_empty() {
            let orange = RGBColor(230, 120, 20);
            chart
                .draw_series(LineSeries::new(val.iter().copied(), orange.stroke_width(2)))?
                .label("validation loss")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], orange.stroke_width(2)));
            chart.draw_series(val.iter().map(|p| Circle::new(*p, 3, orange.filled())))?;
        }
        let nonfinite: Vec<(f64, f64)> = losses
            .iter()
            .enumerate()
            .filter(|(_, y)| !y.is_finite())
            .map(|(i, _)| ((first_step + i as u64) as f64, hi + pad * 0.5))
            .collect();
        if !nonfinite.is_empty() {
            chart
                .draw_series(nonfinite.into_iter().map(|p| Cross::new(p, 5, RED.stroke_width(2))))?
                .label("loss NaN or infinite")
                .legend(|(x, y)| Cross::new((x + 10, y), 5, RED.stroke_width(2)));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("drawing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moving_average_is_the_mean_of_the_last_window() {
        assert_eq!(smooth(&[1.0, 3.0, 5.0, 7.0], 2), vec![1.0, 2.0, 4.0, 6.0]);
        assert_eq!(smooth(&[2.0, 4.0], 10), vec![2.0, 3.0]);
        assert!(smooth(&[], 3).is_empty());
    }

    /// The `<polyline>`s of an SVG plotters drew, by their stroke colour.
    fn polylines(svg: &str) -> Vec<&str> {
        svg.split("<polyline").skip(1).filter_map(|p| p.split("stroke=\"").nth(1)?.split('"').next()).collect()
    }

    #[test]
    fn validation_losses_are_a_second_curve() {
        let dir = std::env::temp_dir().join(format!("chorus-plot-val-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.svg");
        let losses = [5.0, 4.0, 3.5, 3.0, 2.8, 2.6];
        loss_curves(&path, "t", 0, &losses, 2, &[]).unwrap();
        let without = std::fs::read_to_string(&path).unwrap();
        loss_curves(&path, "t", 0, &losses, 2, &[(0, 5.5), (3, 3.2), (5, f64::NAN), (6, 2.9)]).unwrap();
        let with = std::fs::read_to_string(&path).unwrap();
        let orange = "#E67814";
        // The loss, its average and the legend's samples; then the validation curve and its legend sample.
        assert!(!polylines(&without).contains(&orange), "{without}");
        assert_eq!(polylines(&with).iter().filter(|c| **c == orange).count(), 2, "{with}");
        assert!(with.contains("validation loss"));
        // One marker per finite validation point (the NaN left out).
        assert_eq!(with.matches("<circle").count() - without.matches("<circle").count(), 3);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn non_finite_and_huge_losses_draw_promptly() {
        let dir = std::env::temp_dir().join(format!("chorus-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.svg");
        for losses in
            [vec![f64::NAN, f64::NAN], vec![f64::INFINITY, 1.0], vec![f64::MAX, -f64::MAX, 0.5], vec![2.0, 2.0], vec![]]
        {
            let started = std::time::Instant::now();
            loss_curve(&path, "t", 0, &losses, 3).unwrap();
            assert!(started.elapsed() < std::time::Duration::from_secs(5), "{losses:?}");
            assert!(std::fs::read_to_string(&path).unwrap().starts_with("<svg"));
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
