//! Collects the measurements of a backend, computes the target ratios, and prints them.

use crate::modes::Mode;
use std::fmt::Write as _;

/// One measured series: a label at one concurrency, one rate per round.
#[derive(Clone, Debug)]
pub struct Cell {
    pub phase: &'static str,
    pub label: &'static str,
    pub concurrency: usize,
    /// Messages (or rows, for purges) per second, one value per round.
    pub rates: Vec<f64>,
    pub latencies_us: Vec<u32>,
    pub txns: u64,
}

impl Cell {
    pub fn median_rate(&self) -> f64 {
        median(&self.rates)
    }

    /// The `q` quantile of the latencies across all rounds, in milliseconds.
    pub fn latency_ms(&self, q: f64) -> f64 {
        let mut sorted = self.latencies_us.clone();
        sorted.sort_unstable();
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
        sorted
            .get(rank - 1)
            .map_or(f64::NAN, |&us| f64::from(us) / 1000.0)
    }
}

/// Everything measured on one backend.
#[derive(Debug)]
pub struct Report {
    pub backend: &'static str,
    pub cells: Vec<Cell>,
    pub growth_rows: u64,
    /// The cost curve's points, when `--growth-points` asked for them.
    pub curve: Vec<crate::curve::Point>,
}

impl Report {
    pub fn new(backend: &'static str) -> Self {
        Self {
            backend,
            cells: Vec::new(),
            growth_rows: 0,
            curve: Vec::new(),
        }
    }

    /// Creates an empty series, so tables list series in declaration order rather than
    /// in the random order of the first round.
    pub fn declare(&mut self, phase: &'static str, label: &'static str, concurrency: usize) {
        if self.cell(phase, label, concurrency).is_none() {
            self.cells.push(Cell {
                phase,
                label,
                concurrency,
                rates: Vec::new(),
                latencies_us: Vec::new(),
                txns: 0,
            });
        }
    }

    /// Adds one round's measurement to its series.
    pub fn record(
        &mut self,
        phase: &'static str,
        label: &'static str,
        concurrency: usize,
        rate: f64,
        latencies_us: Vec<u32>,
        txns: u64,
    ) {
        match self.cells.iter_mut().find(|cell| {
            cell.phase == phase && cell.label == label && cell.concurrency == concurrency
        }) {
            Some(cell) => {
                cell.rates.push(rate);
                cell.latencies_us.extend(latencies_us);
                cell.txns += txns;
            }
            None => self.cells.push(Cell {
                phase,
                label,
                concurrency,
                rates: vec![rate],
                latencies_us,
                txns,
            }),
        }
    }

    pub fn cell(&self, phase: &str, label: &str, concurrency: usize) -> Option<&Cell> {
        self.cells.iter().find(|cell| {
            cell.phase == phase && cell.label == label && cell.concurrency == concurrency
        })
    }

    /// The median over rounds of `a / b`, both measured in the same round of `phase`.
    fn paired_ratio(&self, phase: &str, a: &str, b: &str, concurrency: usize) -> Option<f64> {
        let (a, b) = (
            self.cell(phase, a, concurrency)?,
            self.cell(phase, b, concurrency)?,
        );
        let ratios: Vec<f64> = a.rates.iter().zip(&b.rates).map(|(x, y)| x / y).collect();
        (!ratios.is_empty()).then(|| median(&ratios))
    }

    /// The concurrencies measured in `phase`, ascending.
    pub fn concurrencies(&self, phase: &str) -> Vec<usize> {
        let mut levels: Vec<usize> = self
            .cells
            .iter()
            .filter(|cell| cell.phase == phase)
            .map(|cell| cell.concurrency)
            .collect();
        levels.sort_unstable();
        levels.dedup();
        levels
    }

    /// The labels measured in `phase`, in the order they were first recorded.
    pub fn labels(&self, phase: &str) -> Vec<&'static str> {
        let mut labels = Vec::new();
        for cell in self.cells.iter().filter(|cell| cell.phase == phase) {
            if !labels.contains(&cell.label) {
                labels.push(cell.label);
            }
        }
        labels
    }

    /// Every target of the issue that this run measured.
    pub fn targets(&self) -> Vec<TargetResult> {
        let mut out = Vec::new();
        for c in self.concurrencies("main") {
            let main = |a, b| self.paired_ratio("main", a, b, c);
            out.extend(TargetResult::at_least(
                "claim / raw",
                c,
                main("claim", "raw"),
                0.97,
            ));
            if let (Some(claim), Some(raw)) = (main("claim", "base"), main("raw", "base")) {
                out.push(TargetResult::new(
                    format!("claim/base - raw/base ({claim:.3} - {raw:.3})"),
                    c,
                    claim - raw,
                    ">= -0.05".to_owned(),
                    claim - raw >= -0.05,
                ));
            }
            out.extend(TargetResult::at_least(
                "process / claim",
                c,
                main("process", "claim"),
                0.95,
            ));
            out.extend(TargetResult::at_least(
                "duplicate / claim",
                c,
                main("duplicate", "claim"),
                2.0,
            ));
            out.extend(TargetResult::at_least(
                "batch / batch_raw (per id)",
                c,
                main("batch", "batch_raw"),
                0.95,
            ));
        }
        for phase in ["main", "mix"] {
            for c in self.concurrencies(phase) {
                for peer in Mode::PEERS {
                    let ratio = self.paired_ratio(phase, "process", peer.name(), c);
                    // `process` must beat a peer that commits twice per message by 1.3x at
                    // one worker on the servers, where a commit is a round trip and a log
                    // flush.
                    let floor = if peer.commits_twice() && c == 1 && self.backend != "sqlite" {
                        1.3
                    } else {
                        1.0
                    };
                    let name = format!("{phase}: process / {}", peer.name());
                    out.extend(TargetResult::at_least(&name, c, ratio, floor));
                }
            }
        }
        out.extend(self.growth_targets());
        out.extend(self.purge_targets());
        out
    }

    fn growth_targets(&self) -> Vec<TargetResult> {
        let mut out = Vec::new();
        for c in self.concurrencies("growth") {
            let held = |mode| {
                let grown = self.cell("growth", mode, c)?.median_rate();
                let empty = self.cell("main", mode, c)?.median_rate();
                Some(grown / empty)
            };
            if let (Some(claim), Some(raw)) = (held("claim"), held("raw")) {
                out.push(TargetResult::new(
                    format!(
                        "growth {}M: claim kept - raw kept ({claim:.3} - {raw:.3})",
                        self.growth_rows as f64 / 1e6
                    ),
                    c,
                    claim - raw,
                    ">= -0.05".to_owned(),
                    claim - raw >= -0.05,
                ));
            }
        }
        out
    }

    fn purge_targets(&self) -> Vec<TargetResult> {
        let mut out = Vec::new();
        for c in self.concurrencies("purge") {
            out.extend(TargetResult::at_least(
                "purge rows/s / hand DELETE rows/s",
                c,
                self.paired_ratio("purge", "purge rows", "hand delete rows", c),
                0.8,
            ));
            if let Some((during, alone)) = self.p99_during("claim + purge", c) {
                out.push(TargetResult::new(
                    format!("claim p99 during purge / alone ({during:.2} / {alone:.2} ms)"),
                    c,
                    during / alone,
                    "<= 2".to_owned(),
                    during / alone <= 2.0,
                ));
            }
        }
        out
    }

    /// The claimers' p99 during `label` and alone, at `c` workers, in milliseconds.
    fn p99_during(&self, label: &str, c: usize) -> Option<(f64, f64)> {
        let p99 = |label| Some(self.cell("purge", label, c)?.latency_ms(0.99));
        Some((p99(label)?, p99("claim alone")?))
    }

    /// The purge trade-off: each purger's rows/s (and its ratio to the hand-written
    /// DELETE) against the claimers' p99 during it (and its ratio to their p99 alone).
    pub fn purge_tradeoff_table(&self) -> String {
        let mut out = String::from(
            "| purger | c | rows/s | / hand DELETE | claim p99 ms | / alone |\n|---|---:|---:|---:|---:|---:|\n",
        );
        for c in self.concurrencies("purge") {
            let purges: Vec<(&str, &str)> = self
                .labels("purge")
                .into_iter()
                .filter_map(|label| {
                    let setting = label.strip_prefix("purge rows")?;
                    Some((label, setting))
                })
                .chain([("hand delete rows", " hand DELETE")])
                .collect();
            for (rows_label, setting) in purges {
                let claim_label = match rows_label {
                    "hand delete rows" => "claim + hand delete".to_owned(),
                    _ => format!("claim + purge{setting}"),
                };
                let Some(rows) = self.cell("purge", rows_label, c) else {
                    continue;
                };
                let vs_hand = self
                    .paired_ratio("purge", rows_label, "hand delete rows", c)
                    .unwrap_or(f64::NAN);
                let (during, alone) = self
                    .p99_during(&claim_label, c)
                    .unwrap_or((f64::NAN, f64::NAN));
                let name = match setting.trim() {
                    "" => default_pacing_name(self.backend),
                    other => other.to_owned(),
                };
                let _ = writeln!(
                    out,
                    "| {name} | {c} | {:.0} | {vs_hand:.2} | {during:.2} | {:.2} |",
                    rows.median_rate(),
                    during / alone
                );
            }
        }
        out
    }

    /// `process` over each peer's protocol, per phase and concurrency: the closing note.
    pub fn peers_table(&self) -> String {
        let mut out = String::from("| phase | c |");
        for peer in Mode::PEERS {
            let _ = write!(out, " process / {} |", peer.name());
        }
        out.push_str("\n|---|---:|");
        out.push_str(&"---:|".repeat(Mode::PEERS.len()));
        out.push('\n');
        for phase in ["main", "mix"] {
            for c in self.concurrencies(phase) {
                let _ = write!(out, "| {phase} | {c} |");
                for peer in Mode::PEERS {
                    match self.paired_ratio(phase, "process", peer.name(), c) {
                        Some(ratio) => {
                            let _ = write!(out, " {ratio:.2} |");
                        }
                        None => out.push_str(" - |"),
                    }
                }
                out.push('\n');
            }
        }
        out
    }

    /// Every table of this backend, as the BENCHMARKS.md section prints them.
    pub fn markdown(&self) -> String {
        let mut out = format!("### {}\n\n", self.backend);
        for (phase, title) in [
            ("main", "Main phase (per s; latency of one transaction)"),
            (
                "mix",
                "Duplicate-heavy mix (30 % duplicates, a third of them racing; deliveries per s)",
            ),
            ("growth", "Growth (old markers in the inbox)"),
            (
                "purge",
                "Purge (purge rows: rows/s; their latency is the whole purge of one cohort)",
            ),
        ] {
            if !self.labels(phase).is_empty() {
                let _ = write!(out, "#### {title}\n\n{}\n", self.table(phase));
            }
        }
        if !self.labels("mix").is_empty() {
            let _ = write!(
                out,
                "#### `process` over the peers' protocols (median of same-round ratios)\n\n{}\n",
                self.peers_table()
            );
        }
        if !self.labels("purge").is_empty() {
            let _ = write!(
                out,
                "#### Purge trade-off (median rows/s; claimers' p99 over all rounds)\n\n{}\n",
                self.purge_tradeoff_table()
            );
        }
        let _ = write!(out, "#### Targets\n\n{}\n", self.targets_table());
        out
    }

    /// The measurements as a Markdown table: one row per label, one column per concurrency.
    pub fn table(&self, phase: &str) -> String {
        let levels = self.concurrencies(phase);
        let mut out = String::from("| mode |");
        for c in &levels {
            let _ = write!(out, " c={c}: per s | p50 / p99 ms |");
        }
        out.push_str("\n|---|");
        out.push_str(&"---:|---:|".repeat(levels.len()));
        for label in self.labels(phase) {
            let _ = write!(out, "\n| {label} |");
            for &c in &levels {
                match self.cell(phase, label, c) {
                    Some(cell) => {
                        let _ = write!(
                            out,
                            " {:.0} | {:.2} / {:.2} |",
                            cell.median_rate(),
                            cell.latency_ms(0.5),
                            cell.latency_ms(0.99)
                        );
                    }
                    None => out.push_str(" - | - |"),
                }
            }
        }
        out.push('\n');
        out
    }

    /// The targets as a Markdown table.
    pub fn targets_table(&self) -> String {
        let mut out =
            String::from("| target | c | value | goal | met |\n|---|---:|---:|---|---|\n");
        for t in self.targets() {
            let _ = writeln!(
                out,
                "| {} | {} | {:.3} | {} | {} |",
                t.name,
                t.concurrency,
                t.value,
                t.goal,
                if t.met { "met" } else { "NOT MET" }
            );
        }
        out
    }

    /// Every series as CSV rows (no header).
    pub fn csv_rows(&self) -> String {
        let mut out = String::new();
        for cell in &self.cells {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{:.1},{:.3},{:.3},{}",
                self.backend,
                cell.phase,
                cell.label,
                cell.concurrency,
                cell.rates.len(),
                cell.median_rate(),
                cell.latency_ms(0.5),
                cell.latency_ms(0.99),
                cell.txns
            );
        }
        out
    }
}

/// Reports rebuilt from CSV rows [`Report::csv_rows`] wrote: one rate per series (the
/// median), no latencies; enough to redraw the chart.
pub fn from_csv(csv: &str, growth_rows: u64) -> Result<Vec<Report>, String> {
    let mut reports: Vec<Report> = Vec::new();
    for (n, line) in csv.lines().enumerate().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let [backend, phase, label, concurrency, _, rate, ..] = fields[..] else {
            return Err(format!("line {}: expected the bench's CSV columns", n + 1));
        };
        let bad = |what: &str| format!("line {}: bad {what}", n + 1);
        let concurrency = concurrency.parse().map_err(|_| bad("concurrency"))?;
        let rate = rate.parse().map_err(|_| bad("rate"))?;
        // Labels are `&'static` in a report; a replot ends right after, so leak the few.
        let leak = |text: &str| -> &'static str { Box::leak(text.to_owned().into_boxed_str()) };
        if reports.last().is_none_or(|r| r.backend != backend) {
            let mut report = Report::new(leak(backend));
            report.growth_rows = growth_rows;
            reports.push(report);
        }
        if let Some(report) = reports.last_mut() {
            report.record(leak(phase), leak(label), concurrency, rate, Vec::new(), 0);
        }
    }
    Ok(reports)
}

pub const CSV_HEADER: &str =
    "backend,phase,mode,concurrency,rounds,per_s_median,p50_ms,p99_ms,txns\n";

/// One target of the issue, evaluated.
#[derive(Clone, Debug)]
pub struct TargetResult {
    pub name: String,
    pub concurrency: usize,
    pub value: f64,
    pub goal: String,
    pub met: bool,
}

impl TargetResult {
    fn new(name: String, concurrency: usize, value: f64, goal: String, met: bool) -> Self {
        Self {
            name,
            concurrency,
            value,
            goal,
            met,
        }
    }

    /// `value >= floor`, when the value was measured.
    fn at_least(name: &str, concurrency: usize, value: Option<f64>, floor: f64) -> Option<Self> {
        let value = value?;
        Some(Self::new(
            name.to_owned(),
            concurrency,
            value,
            format!(">= {floor}"),
            value >= floor,
        ))
    }
}

/// The trade-off table's name of the library's default pacing on `backend`, from its
/// constants (the default budget follows the backend).
fn default_pacing_name(backend: &str) -> String {
    let backend = match backend {
        "postgres" => sea_orm::DbBackend::Postgres,
        "mysql" => sea_orm::DbBackend::MySql,
        _ => sea_orm::DbBackend::Sqlite,
    };
    let pacing = sea_orm_inbox::PurgePacing::default();
    let budget = pacing
        .batch_budget(backend)
        .map_or_else(|| "unpaced".to_owned(), |b| format!("{}ms", b.as_millis()));
    format!("library, default ({budget}/{}%)", pacing.busy_percent())
}

pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_quantiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut report = Report::new("test");
        report.record(
            "main",
            "claim",
            1,
            10.0,
            (1..=100).map(|ms| ms * 1000).collect(),
            100,
        );
        let cell = report
            .cell("main", "claim", 1)
            .map(|cell| cell.latency_ms(0.99));
        assert_eq!(cell, Some(99.0));
    }

    #[test]
    fn ratios_pair_the_rounds() {
        let mut report = Report::new("test");
        for (claim, raw) in [(90.0, 100.0), (200.0, 100.0), (99.0, 100.0)] {
            report.record("main", "claim", 8, claim, vec![], 1);
            report.record("main", "raw", 8, raw, vec![], 1);
        }
        let target = report
            .targets()
            .into_iter()
            .find(|t| t.name == "claim / raw")
            .map(|t| (t.value, t.met));
        assert_eq!(target, Some((0.99, true)));
    }
}
