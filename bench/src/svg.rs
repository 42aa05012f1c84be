//! The chart: per backend, each mode's throughput as a fraction of `base` (the business
//! transaction alone) at every concurrency, ours and the peers' protocols side by side,
//! with the floor (`raw`, the marker INSERT written by hand) marked. Drawn with
//! `plotters`' SVG backend, which writes text as SVG text: no fonts needed to build it.

use crate::BoxError;
use crate::report::Report;
use plotters::prelude::*;

const WIDTH: u32 = 960;
const PANEL_HEIGHT: u32 = 340;
/// Width of the legend beside each panel's plot.
const LEGEND_WIDTH: u32 = 140;

/// The bars of each concurrency group: label and colour (ours blue, the peers warm).
const SERIES: [(&str, RGBColor); 6] = [
    ("claim", RGBColor(0x1f, 0x4e, 0x99)),
    ("process", RGBColor(0x4e, 0x79, 0xa7)),
    ("masstransit", RGBColor(0xf2, 0x8e, 0x2b)),
    ("nservicebus", RGBColor(0xe1, 0x57, 0x59)),
    ("wolverine", RGBColor(0xb0, 0x7a, 0xa1)),
    ("seed", RGBColor(0x9c, 0x75, 0x5f)),
];

/// The floor the bars are judged against.
const FLOOR: &str = "raw";

/// The chart for all backends, one panel each, as an SVG document.
pub fn chart(reports: &[Report]) -> Result<String, BoxError> {
    let mut svg = String::new();
    {
        let height = PANEL_HEIGHT * u32::try_from(reports.len().max(1))?;
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let panels = root.split_evenly((reports.len().max(1), 1));
        for (report, area) in reports.iter().zip(&panels) {
            panel(report, area)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// `label`'s median rate over `base`'s at `c` workers, in the main phase.
fn of_base(report: &Report, label: &str, c: usize) -> Option<f64> {
    let rate = report.cell("main", label, c)?.median_rate();
    let base = report.cell("main", "base", c)?.median_rate();
    (base > 0.0).then(|| rate / base)
}

fn panel<DB: DrawingBackend>(
    report: &Report,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), BoxError>
where
    DB::ErrorType: 'static,
{
    let levels = report.concurrencies("main");
    let groups = levels.len().max(1) as f64;
    let highest = levels
        .iter()
        .flat_map(|&c| {
            SERIES
                .iter()
                .map(|(label, _)| *label)
                .chain([FLOOR])
                .filter_map(move |label| of_base(report, label, c))
        })
        .fold(1.0_f64, f64::max);
    let top = (highest * 1.15).max(1.2);
    let (plot, legend) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    let mut chart = ChartBuilder::on(&plot)
        .caption(
            format!(
                "{}: throughput as a fraction of base (the business write alone); black line: the floor, raw",
                report.backend
            ),
            ("sans-serif", 15),
        )
        .margin(10)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..groups, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(0)
        .y_desc("per s / base per s")
        .x_desc("workers (each its own connection)")
        .draw()?;
    let width = 0.8 / SERIES.len() as f64;
    for (k, (label, colour)) in SERIES.iter().enumerate() {
        let bars: Vec<Rectangle<(f64, f64)>> = levels
            .iter()
            .enumerate()
            .filter_map(|(g, &c)| {
                let ratio = of_base(report, label, c)?;
                let x0 = g as f64 + 0.1 + width * k as f64;
                Some(Rectangle::new(
                    [(x0, 0.0), (x0 + width * 0.9, ratio)],
                    colour.filled(),
                ))
            })
            .collect();
        chart.draw_series(bars)?;
        let y = 40 + 18 * i32::try_from(k)?;
        legend.draw(&Rectangle::new([(4, y), (16, y + 12)], colour.filled()))?;
        legend.draw(&Text::new(*label, (22, y), ("sans-serif", 13)))?;
    }
    // The floor across each group, and the concurrency above it.
    let floors: Vec<PathElement<(f64, f64)>> = levels
        .iter()
        .enumerate()
        .filter_map(|(g, &c)| {
            let floor = of_base(report, FLOOR, c)?;
            let g = g as f64;
            Some(PathElement::new(
                vec![(g + 0.05, floor), (g + 0.95, floor)],
                BLACK.stroke_width(2),
            ))
        })
        .collect();
    chart.draw_series(floors)?;
    let y = 40 + 18 * i32::try_from(SERIES.len())?;
    legend.draw(&PathElement::new(
        vec![(4, y + 6), (16, y + 6)],
        BLACK.stroke_width(2),
    ))?;
    legend.draw(&Text::new("raw (the floor)", (22, y), ("sans-serif", 13)))?;
    chart.draw_series(levels.iter().enumerate().map(|(g, c)| {
        Text::new(
            format!("{c} worker{}", if *c == 1 { "" } else { "s" }),
            (g as f64 + 0.42, top * 0.97),
            ("sans-serif", 13),
        )
    }))?;
    Ok(())
}
