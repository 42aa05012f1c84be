//! The cost curve: how `claim`, `process` and `raw` and the purge fare as the inbox grows,
//! at the points `--growth-points` lists, in one run. Each point seeds only the markers it
//! adds to the last (set-based SQL in the server), measures, and purges one day of them.
//!
//! Every point holds its markers in two ages: the bulk, received [`BULK_AGE_DAYS`] ago,
//! and one day's worth (a hundredth of the point, at least [`MIN_DAY_ROWS`]) received
//! [`DAY_AGE_DAYS`] ago, which the point's purge deletes while the claimers run: the day
//! a retention of a hundred days drops each day.

use crate::BoxError;
use crate::growth::{seed_rows, settle};
use crate::modes::{Mode, TIME_ORDERED_IDS};
use crate::report::{Cell, Report};
use crate::{Bench, db::scalar};
use chrono::{TimeDelta, Utc};
use plotters::prelude::*;
use sea_orm::{DatabaseConnection, DbBackend};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Age in days of every point's bulk of markers: younger than the purge's cutoff.
const BULK_AGE_DAYS: u64 = 2;
/// Age in days of the day each point purges: older than the cutoff.
const DAY_AGE_DAYS: u64 = 10;
/// The purge's cutoff, between the two ages.
const CUTOFF_AGE_DAYS: i64 = 5;
/// The smallest day a point purges, so small points still time a purge.
const MIN_DAY_ROWS: u64 = 100_000;
/// The modes measured at each point, in the CSV's column order.
const MODES: [Mode; 3] = [Mode::Claim, Mode::Process, Mode::Raw];

/// One measured point of the curve.
#[derive(Clone, Debug, Default)]
pub struct Point {
    pub backend: String,
    /// Markers in the inbox when the modes ran (the point's day included).
    pub markers: u64,
    pub concurrency: usize,
    /// Seconds spent inserting the markers this point added to the last.
    pub seed_s: f64,
    /// Seconds of VACUUM ANALYZE (PostgreSQL) or ANALYZE TABLE (MariaDB) after seeding.
    pub settle_s: f64,
    /// The 1-minute load average when the point was measured.
    pub load: f64,
    pub table_bytes: i64,
    pub index_bytes: i64,
    /// Per mode of [`MODES`]: median messages/s over the rounds and p99 in ms, with
    /// random (v4) message ids.
    pub rates: Vec<(f64, f64)>,
    /// The same with time-ordered (v7) message ids, measured right after.
    pub rates_v7: Vec<(f64, f64)>,
    /// Blocks read from outside the buffer pool per message over the modes' rounds: index
    /// and heap on PostgreSQL (pg_statio); on MariaDB the server-wide buffer pool misses,
    /// in the index column, other databases' included.
    pub index_reads_per_msg: f64,
    pub heap_reads_per_msg: f64,
    /// Index blocks read per message with time-ordered ids.
    pub index_reads_per_msg_v7: f64,
    pub purge_rows: u64,
    pub purge_per_s: f64,
    pub claim_during_purge_per_s: f64,
    pub claim_during_purge_p99_ms: f64,
}

pub const CSV_HEADER: &str = "backend,markers,concurrency,seed_s,settle_s,load1,table_mb,index_mb,\
table_mb_per_m,index_mb_per_m,claim_per_s,claim_p99_ms,process_per_s,process_p99_ms,raw_per_s,\
raw_p99_ms,claim_v7_per_s,claim_v7_p99_ms,process_v7_per_s,process_v7_p99_ms,raw_v7_per_s,\
raw_v7_p99_ms,index_reads_per_msg,heap_reads_per_msg,index_reads_per_msg_v7,purge_rows,\
purge_per_s,claim_during_purge_per_s,claim_during_purge_p99_ms\n";

const MB: f64 = 1024.0 * 1024.0;

impl Point {
    fn per_million(&self, bytes: i64) -> f64 {
        if self.markers == 0 {
            return 0.0;
        }
        bytes as f64 / MB / (self.markers as f64 / 1e6)
    }

    /// The rate of `mode` at this point, with time-ordered ids if `v7`.
    fn rate(&self, mode: Mode, v7: bool) -> Option<f64> {
        let k = MODES.iter().position(|m| *m == mode)?;
        let rates = if v7 { &self.rates_v7 } else { &self.rates };
        rates.get(k).map(|(rate, _)| *rate)
    }

    pub fn csv_row(&self) -> String {
        let mut row = format!(
            "{},{},{},{:.1},{:.1},{:.2},{:.1},{:.1},{:.2},{:.2}",
            self.backend,
            self.markers,
            self.concurrency,
            self.seed_s,
            self.settle_s,
            self.load,
            self.table_bytes as f64 / MB,
            self.index_bytes as f64 / MB,
            self.per_million(self.table_bytes),
            self.per_million(self.index_bytes),
        );
        for rates in [&self.rates, &self.rates_v7] {
            for k in 0..MODES.len() {
                let (rate, p99) = rates.get(k).copied().unwrap_or((f64::NAN, f64::NAN));
                let _ = write!(row, ",{rate:.1},{p99:.3}");
            }
        }
        let _ = writeln!(
            row,
            ",{:.3},{:.3},{:.3},{},{:.1},{:.1},{:.3}",
            self.index_reads_per_msg,
            self.heap_reads_per_msg,
            self.index_reads_per_msg_v7,
            self.purge_rows,
            self.purge_per_s,
            self.claim_during_purge_per_s,
            self.claim_during_purge_p99_ms
        );
        row
    }

    /// A row [`Self::csv_row`] wrote (sizes per million are recomputed, not read).
    pub fn from_csv_row(line: &str) -> Result<Self, String> {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != CSV_HEADER.split(',').count() {
            return Err(format!("not a cost-curve row: {line}"));
        }
        let num = |i: usize| -> Result<f64, String> {
            fields[i]
                .parse::<f64>()
                .map_err(|_| format!("column {} of {line} is not a number", i + 1))
        };
        Ok(Point {
            backend: fields[0].to_owned(),
            markers: num(1)? as u64,
            concurrency: num(2)? as usize,
            seed_s: num(3)?,
            settle_s: num(4)?,
            load: num(5)?,
            table_bytes: (num(6)? * MB) as i64,
            index_bytes: (num(7)? * MB) as i64,
            rates: vec![
                (num(10)?, num(11)?),
                (num(12)?, num(13)?),
                (num(14)?, num(15)?),
            ],
            rates_v7: vec![
                (num(16)?, num(17)?),
                (num(18)?, num(19)?),
                (num(20)?, num(21)?),
            ],
            index_reads_per_msg: num(22)?,
            heap_reads_per_msg: num(23)?,
            index_reads_per_msg_v7: num(24)?,
            purge_rows: num(25)? as u64,
            purge_per_s: num(26)?,
            claim_during_purge_per_s: num(27)?,
            claim_during_purge_p99_ms: num(28)?,
        })
    }
}

/// Every point as CSV, header included.
pub fn csv(points: &[Point]) -> String {
    let rows: String = points.iter().map(Point::csv_row).collect();
    format!("{CSV_HEADER}{rows}")
}

/// The points of CSV files [`csv`] wrote, in order.
pub fn from_csv(text: &str) -> Result<Vec<Point>, String> {
    text.lines()
        .skip(1)
        .filter(|line| !line.trim().is_empty())
        .map(Point::from_csv_row)
        .collect()
}

/// The day a point of `markers` purges.
fn day_rows(markers: u64) -> u64 {
    (markers / 100).max(MIN_DAY_ROWS).min(markers / 2)
}

/// The 1-minute load average, NaN where /proc does not say.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The inbox's table and index sizes in bytes.
async fn sizes(conn: &DatabaseConnection) -> Result<(i64, i64), BoxError> {
    let (table, index) = match conn.get_database_backend() {
        DbBackend::Postgres => (
            "SELECT pg_table_size('inbox')::bigint",
            "SELECT pg_indexes_size('inbox')::bigint",
        ),
        DbBackend::MySql => (
            "SELECT CAST(data_length AS SIGNED) FROM information_schema.TABLES \
             WHERE table_schema = DATABASE() AND table_name = 'inbox'",
            "SELECT CAST(index_length AS SIGNED) FROM information_schema.TABLES \
             WHERE table_schema = DATABASE() AND table_name = 'inbox'",
        ),
        _ => return Ok((0, 0)),
    };
    Ok((
        scalar(conn, table, vec![]).await?,
        scalar(conn, index, vec![]).await?,
    ))
}

/// Blocks read from outside the buffer pool so far: (index, heap).
async fn block_reads(conn: &DatabaseConnection) -> Result<(i64, i64), BoxError> {
    match conn.get_database_backend() {
        DbBackend::Postgres => Ok((
            scalar(
                conn,
                "SELECT COALESCE(SUM(idx_blks_read), 0)::bigint FROM pg_statio_user_tables WHERE relname = 'inbox'",
                vec![],
            )
            .await?,
            scalar(
                conn,
                "SELECT COALESCE(SUM(heap_blks_read), 0)::bigint FROM pg_statio_user_tables WHERE relname = 'inbox'",
                vec![],
            )
            .await?,
        )),
        DbBackend::MySql => Ok((
            scalar(
                conn,
                "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME = 'INNODB_BUFFER_POOL_READS'",
                vec![],
            )
            .await?,
            0,
        )),
        _ => Ok((0, 0)),
    }
}

/// The server-wide InnoDB counters read around a point's purge, in this order (nothing
/// on the other backends, whose purge leaves index entries to VACUUM).
const PURGE_COUNTERS: [&str; 5] = [
    "INNODB_BUFFER_POOL_READS",
    "INNODB_BUFFER_POOL_READ_REQUESTS",
    "INNODB_BUFFER_POOL_WRITE_REQUESTS",
    "INNODB_BUFFER_POOL_PAGES_FLUSHED",
    "INNODB_DATA_WRITTEN",
];

/// [`PURGE_COUNTERS`] now, on MariaDB; empty elsewhere.
async fn purge_counters(conn: &DatabaseConnection) -> Result<Vec<i64>, BoxError> {
    if conn.get_database_backend() != DbBackend::MySql {
        return Ok(Vec::new());
    }
    let mut values = Vec::with_capacity(PURGE_COUNTERS.len());
    for name in PURGE_COUNTERS {
        let sql = format!(
            "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS \
             WHERE VARIABLE_NAME = '{name}'"
        );
        values.push(scalar(conn, &sql, vec![]).await?);
    }
    Ok(values)
}

impl Bench<'_> {
    /// Prints what the server did per deleted row during a point's purge of `rows` rows:
    /// the counters' growth, with the claimers' share in it (they insert markers with
    /// random ids all along, so their misses count here too).
    fn print_purge_counters(&self, before: &[i64], after: &[i64], rows: u64, c: usize) {
        let (purge_label, claim_label) = self.args.curve_purger.labels();
        let claims = self
            .report
            .cell("purge", claim_label, c)
            .map_or(0, |cell| cell.txns);
        let per_row: Vec<String> = PURGE_COUNTERS
            .iter()
            .zip(before.iter().zip(after))
            .map(|(name, (b, a))| {
                format!(
                    "{} {:.3}",
                    name.to_ascii_lowercase(),
                    (a - b) as f64 / rows.max(1) as f64
                )
            })
            .collect();
        if per_row.is_empty() {
            return;
        }
        eprintln!(
            "[{}] curve {purge_label}: {rows} rows, {claims} claims during it; per deleted row: {}",
            self.report.backend,
            per_row.join(", ")
        );
    }

    /// The cost curve at every point of `--growth-points`, at the largest `--concurrency`.
    pub(crate) async fn curve_phase(&mut self) -> Result<Vec<Point>, BoxError> {
        let concurrency = self
            .args
            .concurrency
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .min(self.workers.len());
        let mut purger_conns = Vec::new();
        for _ in 0..self.args.curve_purger.connections() {
            purger_conns.push(self.db.connect().await?);
        }
        let mut points = Vec::new();
        // Seeded markers still in the inbox, and the number the next seeded one takes.
        let (mut present, mut next_row) = (0_u64, 1_u64);
        for &markers in &self.args.growth_points.clone() {
            let day = if markers == 0 { 0 } else { day_rows(markers) };
            let bulk = markers.saturating_sub(present + day);
            let started = Instant::now();
            eprintln!(
                "[{}] curve: seeding {} markers ({} ids) to reach {markers}",
                self.report.backend,
                bulk + day,
                self.args.growth_ids.name()
            );
            if day > 0 {
                seed_rows(
                    &self.control,
                    next_row,
                    next_row + day - 1,
                    DAY_AGE_DAYS,
                    self.args.growth_ids,
                )
                .await?;
            }
            if bulk > 0 {
                let first = next_row + day;
                seed_rows(
                    &self.control,
                    first,
                    first + bulk - 1,
                    BULK_AGE_DAYS,
                    self.args.growth_ids,
                )
                .await?;
            }
            next_row += day + bulk;
            present += day + bulk;
            let seed_s = started.elapsed().as_secs_f64();
            let started = Instant::now();
            settle(&self.control).await?;
            let settle_s = started.elapsed().as_secs_f64();
            let (table_bytes, index_bytes) = sizes(&self.control).await?;
            let mut point = Point {
                backend: self.report.backend.to_owned(),
                markers: present,
                concurrency,
                seed_s,
                settle_s,
                load: load_average(),
                table_bytes,
                index_bytes,
                purge_rows: day,
                ..Point::default()
            };
            let measured = self.measure_point(&purger_conns, &mut point, day).await;
            measured?;
            present -= day;
            eprintln!(
                "[{}] curve point: {}",
                self.report.backend,
                point.csv_row().trim_end()
            );
            points.push(point);
        }
        for conn in purger_conns {
            conn.close().await?;
        }
        Ok(points)
    }

    /// The modes' rounds and the purge of `day` rows at one point, each in a report of
    /// its own so the points do not pool their rounds.
    async fn measure_point(
        &mut self,
        purger_conns: &[DatabaseConnection],
        point: &mut Point,
        day: u64,
    ) -> Result<(), BoxError> {
        let c = point.concurrency;
        let backend = self.report.backend;
        let outer = std::mem::replace(&mut self.report, Report::new(backend));
        let measured = async {
            let reads_before = block_reads(&self.control).await?;
            self.rounds_at("growth", &MODES, &[c]).await?;
            let reads_after = block_reads(&self.control).await?;
            TIME_ORDERED_IDS.store(true, Ordering::Relaxed);
            let v7 = self.rounds_at("growth v7", &MODES, &[c]).await;
            TIME_ORDERED_IDS.store(false, Ordering::Relaxed);
            v7?;
            let reads_v7 = block_reads(&self.control).await?;
            if day > 0 {
                let cutoff = Utc::now() - TimeDelta::days(CUTOFF_AGE_DAYS);
                let purger = self.args.curve_purger;
                let counters_before = purge_counters(&self.control).await?;
                self.purge_while_claiming(purger_conns, purger, cutoff, day, c)
                    .await?;
                let counters_after = purge_counters(&self.control).await?;
                self.print_purge_counters(&counters_before, &counters_after, day, c);
            }
            Ok::<_, BoxError>((reads_before, reads_after, reads_v7))
        }
        .await;
        let report = std::mem::replace(&mut self.report, outer);
        let ((index_before, heap_before), (index_after, heap_after), (index_v7, _)) = measured?;
        let cell = |phase: &str, label: &str| -> Result<&Cell, BoxError> {
            report
                .cell(phase, label, c)
                .ok_or_else(|| format!("no {phase} {label} measured at c={c}").into())
        };
        // Each layout's rates and p99s, and the messages its rounds handled.
        let layout = |phase: &str| -> Result<(Vec<(f64, f64)>, f64), BoxError> {
            let mut rates = Vec::new();
            let mut messages = 0;
            for mode in MODES {
                let cell = cell(phase, mode.name())?;
                messages += cell.txns;
                rates.push((cell.median_rate(), cell.latency_ms(0.99)));
            }
            Ok((rates, messages.max(1) as f64))
        };
        let (rates, messages) = layout("growth")?;
        point.rates = rates;
        point.index_reads_per_msg = (index_after - index_before) as f64 / messages;
        point.heap_reads_per_msg = (heap_after - heap_before) as f64 / messages;
        let (rates_v7, messages_v7) = layout("growth v7")?;
        point.rates_v7 = rates_v7;
        point.index_reads_per_msg_v7 = (index_v7 - index_after) as f64 / messages_v7;
        if day > 0 {
            let (purge_label, claim_label) = self.args.curve_purger.labels();
            point.purge_per_s = cell("purge", purge_label)?.median_rate();
            let claims = cell("purge", claim_label)?;
            point.claim_during_purge_per_s = claims.median_rate();
            point.claim_during_purge_p99_ms = claims.latency_ms(0.99);
        }
        Ok(())
    }
}

const WIDTH: u32 = 960;
const PANEL_HEIGHT: u32 = 320;
const LEGEND_WIDTH: u32 = 170;
const COLOURS: [RGBColor; 3] = [
    RGBColor(0x1f, 0x4e, 0x99),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0x33, 0x33, 0x33),
];
/// The arrival rate the purge must keep up with, rows/s.
const ARRIVALS_PER_S: f64 = 10_000.0;

/// The chart: per backend, each mode's messages/s against markers in the inbox; then the
/// purge's rows/s against markers for every backend, with the 10,000/s arrivals marked.
pub fn chart(points: &[Point]) -> Result<String, BoxError> {
    let mut backends: Vec<&str> = Vec::new();
    for point in points {
        if !backends.contains(&point.backend.as_str()) {
            backends.push(&point.backend);
        }
    }
    let panels = backends.len() + 1;
    let mut svg = String::new();
    {
        let height = PANEL_HEIGHT * u32::try_from(panels)?;
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((panels, 1));
        for (backend, area) in backends.iter().zip(&areas) {
            let series: Vec<(String, Vec<(f64, f64)>)> = [false, true]
                .into_iter()
                .flat_map(|v7| MODES.iter().map(move |mode| (v7, mode)))
                .map(|(v7, mode)| {
                    let line = points
                        .iter()
                        .filter(|p| p.backend == *backend)
                        .filter_map(|p| Some((p.markers as f64 / 1e6, p.rate(*mode, v7)?)))
                        .filter(|(_, rate)| rate.is_finite())
                        .collect();
                    let ids = if v7 { "v7 ids" } else { "v4 ids" };
                    (format!("{} ({ids})", mode.name()), line)
                })
                .collect();
            let c = points
                .iter()
                .find(|p| p.backend == *backend)
                .map_or(0, |p| p.concurrency);
            let caption =
                format!("{backend}: messages/s at {c} workers against markers in the inbox");
            lines(area, &caption, "messages/s", &series, None)?;
        }
        if let Some(area) = areas.last() {
            let series: Vec<(String, Vec<(f64, f64)>)> = backends
                .iter()
                .map(|backend| {
                    let line = points
                        .iter()
                        .filter(|p| p.backend == *backend && p.purge_rows > 0)
                        .map(|p| (p.markers as f64 / 1e6, p.purge_per_s))
                        .collect();
                    (format!("{backend} purge"), line)
                })
                .collect();
            let caption = "the purge of one day (a hundredth) during the claims: rows/s; line: 10,000 arrivals/s";
            lines(area, caption, "rows/s", &series, Some(ARRIVALS_PER_S))?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// One panel of lines against millions of markers, with an optional horizontal mark.
fn lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    unit: &str,
    series: &[(String, Vec<(f64, f64)>)],
    mark: Option<f64>,
) -> Result<(), BoxError>
where
    DB::ErrorType: 'static,
{
    let all = series.iter().flat_map(|(_, line)| line.iter());
    let right = all.clone().map(|(x, _)| *x).fold(1.0_f64, f64::max);
    let top = all.map(|(_, y)| *y).chain(mark).fold(1.0_f64, f64::max) * 1.15;
    let (plot, legend) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
    let mut chart = ChartBuilder::on(&plot)
        .caption(caption, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(32)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..right * 1.02, 0.0..top)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc("markers in the inbox (millions)")
        .y_desc(unit)
        .draw()?;
    for (k, (name, line)) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        // The second round of colours (time-ordered ids) is drawn thin.
        let width = if k < COLOURS.len() { 2 } else { 1 };
        chart.draw_series([PathElement::new(line.clone(), colour.stroke_width(width))])?;
        chart.draw_series(line.iter().map(|&xy| Circle::new(xy, 3, colour.filled())))?;
        let y = 40 + 18 * i32::try_from(k)?;
        let swatch = if k < COLOURS.len() {
            colour.filled()
        } else {
            colour.stroke_width(1)
        };
        legend.draw(&Rectangle::new([(4, y), (16, y + 12)], swatch))?;
        legend.draw(&Text::new(name.clone(), (22, y), ("sans-serif", 12)))?;
    }
    if let Some(mark) = mark {
        chart.draw_series([PathElement::new(
            vec![(0.0, mark), (right * 1.02, mark)],
            RED.stroke_width(1),
        )])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_survives_its_csv_row() -> Result<(), String> {
        let point = Point {
            backend: "postgres".into(),
            markers: 10_000_000,
            concurrency: 8,
            seed_s: 120.5,
            rates: vec![(4000.0, 5.0), (4100.0, 4.5), (6000.0, 3.0)],
            rates_v7: vec![(5000.0, 5.0), (5100.0, 4.5), (6500.0, 3.0)],
            purge_rows: 100_000,
            purge_per_s: 50_000.0,
            ..Point::default()
        };
        let back = from_csv(&csv(std::slice::from_ref(&point)))?;
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].csv_row(), point.csv_row());
        Ok(())
    }

    #[test]
    fn each_point_purges_a_hundredth() {
        assert_eq!(day_rows(100_000_000), 1_000_000);
        assert_eq!(day_rows(1_000_000), 100_000);
        assert_eq!(day_rows(50_000), 25_000);
    }

    #[test]
    fn the_chart_draws_a_panel_per_backend_and_the_purge() -> Result<(), BoxError> {
        let point = |backend: &str, markers| Point {
            backend: backend.into(),
            markers,
            concurrency: 8,
            rates: vec![(4000.0, 5.0), (4100.0, 4.5), (6000.0, 3.0)],
            purge_rows: 1,
            purge_per_s: 20_000.0,
            ..Point::default()
        };
        let svg = chart(&[
            point("postgres", 0),
            point("postgres", 1_000_000),
            point("mysql", 0),
        ])?;
        assert!(svg.contains("postgres: messages/s") && svg.contains("mysql purge"));
        Ok(())
    }
}
