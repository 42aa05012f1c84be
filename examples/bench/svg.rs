//! A plain SVG bar chart of throughput by mode and concurrency, one panel per backend.
//! Hand-written: a few rectangles do not need a plotting crate in the build.

use crate::report::Report;
use std::fmt::Write as _;

const WIDTH: f64 = 960.0;
const PANEL_HEIGHT: f64 = 300.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 130.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 6] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1",
];

/// One bar group: a label and the median rate per concurrency.
struct Group {
    label: String,
    rates: Vec<(usize, f64)>,
}

/// The chart for all backends, stacked.
pub fn chart(reports: &[Report]) -> String {
    let height = PANEL_HEIGHT * reports.len() as f64;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">
<rect width="100%" height="100%" fill="white"/>
"#
    );
    for (i, report) in reports.iter().enumerate() {
        panel(&mut svg, report, PANEL_HEIGHT * i as f64);
    }
    svg.push_str("</svg>\n");
    svg
}

/// Main-phase modes, then the growth modes marked with the row count. Purge rates are
/// rows, not messages, and stay in the table.
fn groups(report: &Report) -> Vec<Group> {
    let mut groups = Vec::new();
    for (phase, suffix) in [
        ("main", String::new()),
        ("growth", format!(" @{}M", report.growth_rows as f64 / 1e6)),
    ] {
        for label in report.labels(phase) {
            let rates = report
                .concurrencies(phase)
                .into_iter()
                .filter_map(|c| Some((c, report.cell(phase, label, c)?.median_rate())))
                .collect();
            groups.push(Group {
                label: format!("{label}{suffix}"),
                rates,
            });
        }
    }
    groups
}

fn panel(svg: &mut String, report: &Report, y0: f64) {
    let groups = groups(report);
    let levels = report.concurrencies("main");
    let rates = groups.iter().flat_map(|g| g.rates.iter().map(|&(_, r)| r));
    let (lo, hi) = rates.fold((f64::MAX, 0.0_f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
    if groups.is_empty() || hi <= 0.0 {
        return;
    }
    // Log scale: batch claims run tens of times faster than single ones.
    let (lo_exp, hi_exp) = (lo.max(1.0).log10().floor(), hi.log10().ceil().max(1.0));
    let plot_h = PANEL_HEIGHT - TOP - BOTTOM;
    let plot_w = WIDTH - LEFT - RIGHT;
    let y = |rate: f64| {
        let frac = (rate.max(1.0).log10() - lo_exp) / (hi_exp - lo_exp).max(1.0);
        y0 + TOP + plot_h * (1.0 - frac.clamp(0.0, 1.0))
    };
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="{}" font-size="14" font-weight="bold">{}: messages/s by mode and concurrency (log scale)</text>"#,
        y0 + 18.0,
        report.backend
    );
    for exp in (lo_exp as i32)..=(hi_exp as i32) {
        let rate = 10_f64.powi(exp);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{rate}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            y(rate) + 4.0,
            yy = y(rate),
        );
    }
    let group_w = plot_w / groups.len() as f64;
    let bar_w = group_w * 0.8 / levels.len().max(1) as f64;
    for (g, group) in groups.iter().enumerate() {
        let x0 = LEFT + group_w * g as f64 + group_w * 0.1;
        for &(c, rate) in &group.rates {
            let slot = levels.iter().position(|&l| l == c).unwrap_or(0);
            let color = COLORS[slot % COLORS.len()];
            let (top, bottom) = (y(rate), y0 + TOP + plot_h);
            let _ = writeln!(
                svg,
                r#"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{} c={c}: {rate:.0}/s</title></rect>"#,
                x0 + bar_w * slot as f64,
                bar_w * 0.95,
                (bottom - top).max(0.0),
                group.label,
            );
        }
        // Every other label one line lower: long mode names would overlap their neighbours.
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x0 + group_w * 0.4,
            y0 + TOP + plot_h + 16.0 + 13.0 * (g % 2) as f64,
            group.label
        );
    }
    for (slot, c) in levels.iter().enumerate() {
        let ly = y0 + TOP + 16.0 * slot as f64;
        let _ = writeln!(
            svg,
            r#"<rect x="{:.1}" y="{ly:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}">{c} worker{}</text>"#,
            WIDTH - RIGHT + 15.0,
            COLORS[slot % COLORS.len()],
            WIDTH - RIGHT + 32.0,
            ly + 10.0,
            if *c == 1 { "" } else { "s" }
        );
    }
}
