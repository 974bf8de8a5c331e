//! The timeline of one rank's measured step as an SVG: each stream a lane,
//! each operation a bar from its start to its end.

use std::path::Path;

use chorus_plan::virt::TraceOp;
use plotters::prelude::*;

const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// Draws `ops` (times in seconds) into `path`, one lane per name of `lanes`
/// (an op's `stream` indexes it; streams beyond are drawn in a last lane).
pub fn draw(path: &Path, ops: &[TraceOp], lanes: &[&str]) -> anyhow::Result<()> {
    let t0 = ops.iter().map(|o| o.start).fold(f64::INFINITY, f64::min);
    let t1 = ops.iter().map(|o| o.end).fold(f64::NEG_INFINITY, f64::max);
    let (t0, t1) = if t0.is_finite() && t1 > t0 { (t0, t1) } else { (0.0, 1.0) };
    // Milliseconds from the step's start.
    let ms = |t: f64| (t - t0) * 1e3;
    let n = lanes.len().max(1);
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1200, 80 + 60 * n as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("one step of rank 0, by stream", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(120)
            .build_cartesian_2d(0.0..ms(t1), 0.0..n as f64)?;
        let label = |y: &f64| {
            let i = y.floor() as usize;
            if (*y - i as f64 - 0.5).abs() < 1e-9 {
                lanes.get(n - 1 - i.min(n - 1)).map(|s| s.to_string()).unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart.configure_mesh().x_desc("ms").y_labels(2 * n + 1).y_label_formatter(&label).disable_y_mesh().draw()?;
        let bars = ops.iter().map(|o| {
            let lane = o.stream.min(n - 1);
            let y = (n - 1 - lane) as f64;
            let color = COLORS[lane % COLORS.len()];
            Rectangle::new([(ms(o.start), y + 0.15), (ms(o.end).max(ms(o.start)), y + 0.85)], color.mix(0.8).filled())
        });
        chart.draw_series(bars)?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))
}
