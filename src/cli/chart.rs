//! Line charts as SVG, for sweeps and timelines.

use std::path::Path;

use anyhow::{Context, bail};
use plotters::prelude::*;

/// One named line.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points, x ascending.
    pub points: Vec<(f64, f64)>,
}

/// Draws `series` as lines on a log2 x axis (when `log2_x`) into an SVG file.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log2_x: bool,
) -> anyhow::Result<()> {
    if path.extension().and_then(|e| e.to_str()) != Some("svg") {
        bail!(
            "charts are written as SVG: give --plot a file name ending in .svg (got {})",
            path.display()
        );
    }
    let all = series.iter().flat_map(|s| s.points.iter());
    let (x_min, x_max) = all.clone().fold((f64::MAX, f64::MIN), |(lo, hi), &(x, _)| {
        (lo.min(x), hi.max(x))
    });
    let y_max = all.fold(0.0f64, |hi, &(_, y)| hi.max(y)) * 1.1;
    if series.is_empty() || x_min > x_max {
        bail!("nothing to draw");
    }
    let transform = |x: f64| if log2_x { x.log2() } else { x };
    let (lo, hi) = (
        transform(x_min),
        transform(x_max).max(transform(x_min) + 1.0),
    );
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(lo..hi, 0.0..y_max.max(1e-9))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|x| {
            if log2_x {
                format!("{}", x.exp2().round())
            } else {
                format!("{x}")
            }
        })
        .draw()?;
    for (index, line) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        let points: Vec<(f64, f64)> = line
            .points
            .iter()
            .map(|&(x, y)| (transform(x), y))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(&line.name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
