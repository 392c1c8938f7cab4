//! SVG plots (plotters' SVG backend: text is left to the viewer's fonts, so nothing
//! here needs a font on the machine that runs the bench).

use std::path::Path;

use plotters::prelude::*;

use crate::BoxError;

/// A named line of `(x, y)` points.
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

/// Lines with markers; `log_x` for sizes that double.
pub(crate) fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    log_x: bool,
) -> Result<(), BoxError> {
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return Ok(());
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(72);
    let y_range = 0f64..y1 * 1.12;
    if log_x {
        let mut chart = builder.build_cartesian_2d((x0 * 0.9..x1 * 1.1).log_scale(), y_range)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        draw(&mut chart, series)?;
    } else {
        let pad = (x1 - x0) * 0.05;
        let mut chart = builder.build_cartesian_2d(x0 - pad..x1 + pad, y_range)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        draw(&mut chart, series)?;
    }
    root.present()?;
    Ok(())
}

fn draw<'a, DB: DrawingBackend + 'a, X>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    series: &[Series],
) -> Result<(), BoxError>
where
    X: Ranged<ValueType = f64>,
    DB::ErrorType: 'static,
{
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// The distribution of `sorted` latencies (ms) as a CDF, up to their 99.9th percentile,
/// with the p50 and p99 marked.
pub(crate) fn latency_cdf(path: &Path, title: &str, sorted: &[f64]) -> Result<(), BoxError> {
    if sorted.is_empty() {
        return Ok(());
    }
    let pct = |p: f64| sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)];
    let x_max = (pct(0.999) * 1.2).max(0.5);
    let n = sorted.len() as f64;
    let points: Vec<(f64, f64)> = sorted
        .iter()
        .enumerate()
        .filter(|&(_, &x)| x <= x_max)
        .map(|(i, &x)| (x, (i + 1) as f64 / n * 100.0))
        .collect();
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..100f64)?;
    chart
        .configure_mesh()
        .x_desc("commit → XADD (ms)")
        .y_desc("messages at or below (%)")
        .draw()?;
    chart
        .draw_series(LineSeries::new(points, COLORS[0].stroke_width(2)))?
        .label(format!("{} messages", sorted.len()))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], COLORS[0].stroke_width(2)));
    for (p, name, color) in [(0.5, "p50", COLORS[2]), (0.99, "p99", COLORS[1])] {
        let x = pct(p);
        chart
            .draw_series(LineSeries::new(
                [(x, 0.0), (x, 100.0)],
                color.stroke_width(1),
            ))?
            .label(format!("{name} {x:.2} ms"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
