//! The loss curve of a run as an SVG (plotters), beside `summary.json`.

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
/// average into an SVG at `path`.
/// Non-finite losses are left out of the lines and marked by red crosses
/// along the top of the plot; finite ones are clamped to +-1e30 so the
/// axis range and its padding stay finite (plotters loops forever on an
/// infinite range).
pub fn loss_curve(path: &Path, title: &str, first_step: u64, losses: &[f64], window: usize) -> anyhow::Result<()> {
    let losses: Vec<f64> = losses.iter().map(|v| if v.is_finite() { v.clamp(-LIMIT, LIMIT) } else { *v }).collect();
    let losses = &losses[..];
    let (lo, hi) = losses
        .iter()
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(*v), b.max(*v)));
    let (lo, hi) = match (lo.is_finite(), hi > lo) {
        (true, true) => (lo, hi),
        (true, false) => (lo - 1.0, lo + 1.0),
        (false, _) => (0.0, 1.0),
    };
    let pad = (hi - lo) * 0.05;
    let x_end = first_step + losses.len().max(1) as u64;
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(first_step as f64..x_end as f64, (lo - pad)..(hi + pad))?;
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
