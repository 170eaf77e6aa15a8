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

/// Charts are SVG files; say so before drawing anything.
fn require_svg(path: &Path) -> anyhow::Result<()> {
    if path.extension().and_then(|e| e.to_str()) != Some("svg") {
        bail!(
            "charts are written as SVG: give --plot a file name ending in .svg (got {})",
            path.display()
        );
    }
    Ok(())
}

/// Checks before any work that `--plot PATH` can be written: an `.svg`
/// name in an existing, writable directory (probed with a temporary file),
/// so a long sweep never ends in a chart that cannot be saved.
pub fn check_plot_path(path: &Path) -> anyhow::Result<()> {
    require_svg(path)?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        bail!(
            "--plot {}: the directory {} does not exist: create it or give another path",
            path.display(),
            dir.display()
        );
    }
    if path.is_dir() {
        bail!(
            "--plot {}: that is a directory: give a file name ending in .svg",
            path.display()
        );
    }
    let probe = dir.join(format!(".strata-plot-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| {
        format!(
            "--plot {}: cannot write in {}: fix its permissions or give another path",
            path.display(),
            dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The series legend, bottom right.
fn draw_legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    Ok(())
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
    require_svg(path)?;
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
    draw_legend(&mut chart)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// `strata plan --plot`: memory per tier over the step (as a share of each
/// tier's capacity) above the busy share of each resource.
pub fn plan_chart(path: &Path, estimate: &strata_scheduler::Estimate) -> anyhow::Result<()> {
    require_svg(path)?;
    if estimate.timeline.is_empty() {
        bail!(
            "the run does not fit, so there is no step to draw: {}",
            estimate.reason.as_deref().unwrap_or("no plan")
        );
    }
    let root = SVGBackend::new(path, (960, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(480);
    let end_s = estimate.timeline.last().map_or(1.0, |p| p.time_s).max(1e-9);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!("memory per tier over one step ({} policy)", estimate.policy),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..end_s, 0.0..105.0)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("% of capacity")
        .draw()?;
    let names = ["device per GPU", "host per node", "NVMe per node"];
    for (tier, name) in names.iter().enumerate() {
        let capacity = estimate.capacity_bytes[tier].max(1) as f64;
        let peak = estimate
            .timeline
            .iter()
            .map(|p| p.bytes[tier])
            .max()
            .unwrap_or(0);
        let color = Palette99::pick(tier).to_rgba();
        let points: Vec<(f64, f64)> = estimate
            .timeline
            .iter()
            .map(|p| (p.time_s, 100.0 * p.bytes[tier] as f64 / capacity))
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(format!(
                "{name} (peak {:.1} of {:.1} GB)",
                peak as f64 / 1e9,
                capacity / 1e9
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart)?;
    let rows = estimate.resources.len().max(1) as f64;
    let mut bars = ChartBuilder::on(&bottom)
        .caption(
            format!(
                "busy share of the {:.2} s step (bottleneck: {})",
                estimate.step_time_s.unwrap_or(0.0),
                estimate.bottleneck
            ),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(120)
        .build_cartesian_2d(0.0..100.0, 0.0..rows)?;
    let labels: Vec<String> = estimate.resources.iter().map(|r| r.name.clone()).collect();
    bars.configure_mesh()
        .disable_y_mesh()
        .y_labels(labels.len() * 2 + 1)
        .y_label_formatter(&|y| {
            let index = (y - 0.5).round();
            if (y - 0.5 - index).abs() < 1e-6 && index >= 0.0 {
                labels.get(index as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .x_desc("% of step time busy")
        .draw()?;
    bars.draw_series(estimate.resources.iter().enumerate().map(|(index, r)| {
        let y = index as f64;
        let color = if r.name == estimate.bottleneck {
            RED.mix(0.8)
        } else {
            BLUE.mix(0.6)
        };
        Rectangle::new(
            [
                (0.0, y + 0.15),
                ((100.0 * r.utilisation).min(100.0), y + 0.85),
            ],
            color.filled(),
        )
    }))?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
