//! The inbox benchmark: what a message costs through `claim_message` next to the SQL it
//! must run anyway, on SQLite, PostgreSQL and MySQL/MariaDB, in one command.
//!
//! ```text
//! cargo run --release -p inbox-bench                 # SQLite, no setup
//! cargo run --release -p inbox-bench -- --quick      # smoke run
//! cargo run --release -p inbox-bench -- \
//!     --postgres postgres://postgres@127.0.0.1:5432/test \
//!     --mysql mysql://root@127.0.0.1:3306/test \
//!     --csv bench.csv --svg docs/bench.svg
//! ```
//!
//! Every mode of a phase runs in the same rounds, interleaved and in a rotating order, so
//! the noise of a shared machine hits them alike; rates are medians over rounds and the
//! ratios are medians of per-round ratios. See BENCHMARKS.md for what each mode is.

mod args;
mod callgrind;
mod counters;
mod curve;
mod db;
mod growth;
mod instructions;
mod modes;
mod peers;
mod purge;
mod report;
mod run;
mod svg;

use args::{Args, USAGE};
use db::{BenchDb, CONSUMER, Target};
use growth::Cohorts;
use modes::{Deliveries, Mode, Worker};
use peers::Mixer;
use report::Report;
use run::{Snapshot, Stop, run_mode, shuffled};
use sea_orm::{DatabaseConnection, TransactionTrait};
use sea_orm_inbox::prelude::*;
use std::sync::Arc;
use std::time::Instant;
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Processed messages each worker replays in `duplicate`.
const PROCESSED_PER_WORKER: usize = 256;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let Some(args) = Args::from_env()? else {
        print!("{USAGE}");
        return Ok(());
    };
    if let Some(run) = &args.count_only {
        return instructions::count_only(run).await;
    }
    let counts = match args.instructions {
        Some(messages) => {
            let counts = instructions::measure(messages)?;
            println!("instructions:\n\n{counts}");
            Some(counts)
        }
        None => None,
    };
    if args.replot.is_some() || !args.curve_from.is_empty() {
        let reports = match &args.replot {
            Some(csv) => report::from_csv(&std::fs::read_to_string(csv)?, args.growth_rows)?,
            None => Vec::new(),
        };
        return write_outputs(
            &Args {
                csv: None,
                ..args.clone()
            },
            &reports,
            None,
        );
    }
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for target in targets(&args) {
        // One backend's failure is reported at the end; the others still run.
        match bench_backend(&args, &target).await {
            Ok(report) => {
                print_report(&report);
                reports.push(report);
                // Written after each backend, so a later failure keeps what was measured.
                write_outputs(&args, &reports, counts.as_ref())?;
            }
            Err(err) => {
                eprintln!("[{}] FAILED: {err}", target.name);
                failures.push(format!("{}: {err}", target.name));
            }
        }
    }
    if reports.is_empty() && failures.is_empty() {
        write_outputs(&args, &reports, counts.as_ref())?;
    }
    if !failures.is_empty() {
        return Err(failures.join("\n").into());
    }
    Ok(())
}

/// Writes the CSV, the chart and the tables the flags ask for, for the backends measured
/// so far.
fn write_outputs(
    args: &Args,
    reports: &[Report],
    counts: Option<&instructions::Counts>,
) -> Result<(), BoxError> {
    if let Some(path) = &args.tables {
        let mut tables: String = reports.iter().map(Report::markdown).collect();
        if let Some(counts) = counts {
            tables.push_str(&format!("### Instructions per message\n\n{counts}\n"));
        }
        std::fs::write(path, tables)?;
        eprintln!("wrote {path}");
    }
    if let Some(path) = &args.csv {
        let rows: String = reports.iter().map(Report::csv_rows).collect();
        std::fs::write(path, format!("{}{rows}", report::CSV_HEADER))?;
        eprintln!("wrote {path}");
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, svg::chart(reports)?)?;
        eprintln!("wrote {path}");
    }
    let mut points: Vec<curve::Point> = reports.iter().flat_map(|r| r.curve.clone()).collect();
    for csv in &args.curve_from {
        points.extend(curve::from_csv(&std::fs::read_to_string(csv)?)?);
    }
    if let Some(path) = &args.curve_csv {
        std::fs::write(path, curve::csv(&points))?;
        eprintln!("wrote {path}");
    }
    if let Some(path) = &args.curve_svg {
        std::fs::write(path, curve::chart(&points)?)?;
        eprintln!("wrote {path}");
    }
    Ok(())
}

fn targets(args: &Args) -> Vec<Target> {
    let mut targets = Vec::new();
    if args.sqlite {
        targets.push(Target {
            name: "sqlite",
            admin_url: None,
            database: String::new(),
        });
    }
    if let Some(url) = &args.postgres {
        targets.push(Target {
            name: "postgres",
            admin_url: Some(url.clone()),
            database: args.database.clone(),
        });
    }
    if let Some(url) = &args.mysql {
        targets.push(Target {
            name: "mysql",
            admin_url: Some(url.clone()),
            database: args.database.clone(),
        });
    }
    targets
}

fn print_report(report: &Report) {
    println!("{}", report.markdown());
}

/// Everything one backend needs during a run.
struct Bench<'a> {
    args: &'a Args,
    db: BenchDb,
    /// A connection of its own for setup and for the checks between runs.
    control: DatabaseConnection,
    workers: Vec<Arc<Worker>>,
    report: Report,
}

async fn bench_backend(args: &Args, target: &Target) -> Result<Report, BoxError> {
    let mut bench = Bench::open(args, target).await?;
    match args.server_counters {
        Some(messages) => bench.counters_phase(messages).await?,
        None => bench.phases().await?,
    }
    let Bench {
        db,
        control,
        workers,
        report,
        ..
    } = bench;
    drop(workers);
    control.close().await?;
    db.drop_database().await?;
    Ok(report)
}

impl<'a> Bench<'a> {
    async fn open(args: &'a Args, target: &Target) -> Result<Self, BoxError> {
        let db = BenchDb::create(target).await?;
        let control = db.connect().await?;
        let max_workers = args.concurrency.iter().copied().max().unwrap_or(1);
        db::create_accounts(&control, max_workers).await?;
        let sql = db::sql(db.backend)?;
        let mixer = Arc::new(Mixer::default());
        let mut workers = Vec::with_capacity(max_workers);
        for account in 1..=max_workers {
            let conn = db.connect().await?;
            let processed = process_some(&conn, PROCESSED_PER_WORKER).await?;
            workers.push(Arc::new(Worker::new(
                conn,
                account as i64,
                sql,
                processed,
                Arc::clone(&mixer),
            )?));
        }
        Ok(Self {
            args,
            db,
            control,
            workers,
            report: Report::new(target.name),
        })
    }

    /// The phases `--phases` names.
    async fn phases(&mut self) -> Result<(), BoxError> {
        self.main_phase().await?;
        if !self.args.growth_points.is_empty() && self.args.runs("growth") {
            self.report.curve = self.curve_phase().await?;
        } else if self.args.growth_rows > 0 && (self.args.runs("growth") || self.args.runs("purge"))
        {
            let cohorts = self.growth_phase().await?;
            if self.args.runs("purge") {
                self.purge_phase(cohorts).await?;
            }
        }
        Ok(())
    }

    /// The server's counters per message of each `--modes` mode, on the most workers
    /// `--concurrency` names, instead of the phases.
    async fn counters_phase(&self, messages: u64) -> Result<(), BoxError> {
        let modes = self.modes()?;
        let workers = self.args.concurrency.iter().copied().max().unwrap_or(1);
        let workers = self
            .workers
            .get(..workers)
            .ok_or("fewer workers than asked")?;
        counters::measure(workers, &modes, messages).await
    }

    /// Every mode at every concurrency, in interleaved rounds; then ours and the peers'
    /// protocols again in the duplicate-heavy mix (as far as `--phases` and `--modes`
    /// keep them).
    async fn main_phase(&mut self) -> Result<(), BoxError> {
        let named = self.modes()?;
        let modes: Vec<Mode> = Mode::ALL
            .into_iter()
            .filter(|mode| named.contains(mode))
            .collect();
        if self.args.runs("main") {
            self.rounds("main", &modes).await?;
        }
        if self.args.runs("mix") {
            self.rounds("mix", &Mode::MIX).await?;
        }
        Ok(())
    }

    /// The main-phase modes `--modes` names, in its order (all of them without it).
    fn modes(&self) -> Result<Vec<Mode>, BoxError> {
        if self.args.modes.is_empty() {
            return Ok(Mode::ALL.to_vec());
        }
        self.args
            .modes
            .iter()
            .map(|name| {
                Mode::ALL
                    .into_iter()
                    .find(|mode| mode.name() == name.as_str())
                    .ok_or_else(|| format!("unknown mode {name} in --modes").into())
            })
            .collect()
    }

    /// `claim` and `raw` again with `--growth-rows` old markers in the inbox, seeded in
    /// the cohorts it returns for the purge phase.
    async fn growth_phase(&mut self) -> Result<Cohorts, BoxError> {
        let rows = self.args.growth_rows;
        let started = Instant::now();
        eprintln!("[{}] seeding {rows} inbox rows", self.report.backend);
        // Enough cohorts that each purge run takes one of its own, with some left over.
        let purges = (purge::Purger::all(self.db.backend).len()
            * self.args.rounds
            * self.args.purge_concurrency.len()) as u64;
        let cohorts = Cohorts::new(rows, purges + 2);
        growth::seed(&self.control, rows, cohorts, self.args.growth_ids).await?;
        eprintln!(
            "[{}] seeded in {:.1} s",
            self.report.backend,
            started.elapsed().as_secs_f64()
        );
        self.report.growth_rows = rows;
        if self.args.runs("growth") {
            self.rounds("growth", &[Mode::Claim, Mode::Raw]).await?;
        }
        Ok(cohorts)
    }

    async fn rounds(&mut self, phase: &'static str, modes: &[Mode]) -> Result<(), BoxError> {
        let levels = self.args.concurrency.clone();
        self.rounds_at(phase, modes, &levels).await
    }

    /// [`Self::rounds`] at the worker counts `levels`.
    async fn rounds_at(
        &mut self,
        phase: &'static str,
        modes: &[Mode],
        levels: &[usize],
    ) -> Result<(), BoxError> {
        for &concurrency in levels {
            for mode in modes {
                self.report.declare(phase, mode.name(), concurrency);
            }
        }
        for round in 0..self.args.rounds {
            for &concurrency in levels {
                for mode in shuffled(modes) {
                    self.measure(phase, mode, concurrency).await?;
                }
            }
            eprintln!(
                "[{}] {phase}: round {}/{} done",
                self.report.backend,
                round + 1,
                self.args.rounds
            );
        }
        Ok(())
    }

    /// One run of `mode`, checked for correctness, recorded in the report.
    async fn measure(
        &mut self,
        phase: &'static str,
        mode: Mode,
        concurrency: usize,
    ) -> Result<(), BoxError> {
        self.measure_as(phase, mode.name(), mode, concurrency).await
    }

    /// [`Self::measure`], recorded under `label`.
    async fn measure_as(
        &mut self,
        phase: &'static str,
        label: &'static str,
        mode: Mode,
        concurrency: usize,
    ) -> Result<(), BoxError> {
        let before = Snapshot::take(&self.control).await?;
        let deliveries = if phase == "mix" {
            Deliveries::Mixed
        } else {
            Deliveries::Fresh
        };
        let tally = run_mode(
            &self.workers,
            mode,
            deliveries,
            concurrency,
            Stop::after(self.args.round_time),
        )
        .await?;
        let context = format!("{phase} {label} c={concurrency}");
        before
            .verify(
                &self.control,
                db::sql(self.db.backend)?,
                &context,
                &tally.done,
            )
            .await?;
        self.report.record(
            phase,
            label,
            concurrency,
            tally.rate(),
            tally.latencies_us,
            tally.txns,
        );
        Ok(())
    }
}

/// Claims and commits `count` fresh messages on `conn`, for `duplicate` to replay.
async fn process_some(conn: &DatabaseConnection, count: usize) -> Result<Vec<Uuid>, BoxError> {
    let ids: Vec<Uuid> = (0..count).map(|_| Uuid::new_v4()).collect();
    let txn = conn.begin_with_options(CLAIM_TRANSACTION).await?;
    for &id in &ids {
        if txn.claim_message(id, CONSUMER).await?.is_duplicate() {
            return Err("a fresh message id was reported as a duplicate".into());
        }
    }
    txn.commit().await?;
    Ok(ids)
}
