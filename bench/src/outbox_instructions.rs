//! What the relay and the hand-written loops cost per row on SQLite, counted where it does
//! not depend on how busy the machine is: client instructions (callgrind, SQLite's own
//! included, since it runs in the process), and the write transactions each commits
//! (SQLite's commit hook; each is an fsync of the WAL with `synchronous = FULL`) and the
//! statements it sends.
//!
//! `--instructions N` runs this binary again under `valgrind --tool=callgrind` with
//! `--count-only MODE:M` for M = N and 2N rows; the difference divided by N is the cost of
//! one row with the start-up (runtime, connection, migration) cancelled out. The `fill`
//! mode enqueues the rows and does nothing else: its cost per row is taken off the others.

use super::callgrind::collected;
use super::{BATCH, BoxError, Instant0, MarkWay, fill, hand_written_run, leasing_run, relay_run};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection};
use sea_orm_inbox::{Relay, RelayOptions};
use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The modes counted: the fill every run starts with, then the relay, the hand-written
/// loop, and the leasing loop with its mark alone and with the next lease.
const MODES: [&str; 5] = ["fill", "relay", "hand", "lease-alone", "lease-next"];

/// Counts each mode of [`MODES`] under callgrind and prints instructions, commits and
/// statements per row.
pub(super) fn measure(rows: u64) -> Result<(), BoxError> {
    let exe = std::env::current_exe()?;
    let mut per_row = Vec::new();
    for mode in MODES {
        let mut totals = [0_u64; 2];
        let mut counted = [String::new(), String::new()];
        for ((total, line), count) in totals.iter_mut().zip(&mut counted).zip([rows, 2 * rows]) {
            eprintln!("[instructions] {mode} x {count} under callgrind");
            let output = Command::new("valgrind")
                .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
                .arg(&exe)
                .arg("--count-only")
                .arg(format!("{mode}:{count}"))
                .output()
                .map_err(|e| format!("cannot run valgrind (apt-get install valgrind): {e}"))?;
            let stderr = String::from_utf8_lossy(&output.stderr);
            if !output.status.success() {
                return Err(format!("callgrind run of {mode} failed:\n{stderr}").into());
            }
            *total = collected(&stderr)
                .ok_or_else(|| format!("no `Collected :` line from callgrind:\n{stderr}"))?;
            *line = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        }
        let extra = totals[1].saturating_sub(totals[0]) as f64 / rows as f64;
        per_row.push((mode, extra, counted));
    }
    let fill = per_row.first().map_or(0.0, |(_, extra, _)| *extra);
    println!("| mode | instructions per row | without the fill | counted at N, 2N rows |");
    println!("|---|---:|---:|---|");
    for (mode, extra, counted) in &per_row {
        println!(
            "| {mode} | {extra:.0} | {:.0} | {} ; {} |",
            extra - fill,
            counted[0],
            counted[1]
        );
    }
    println!(
        "\n(callgrind, SQLite file in WAL with synchronous FULL, {rows} and {} rows, batches of {BATCH})",
        2 * rows
    );
    Ok(())
}

/// Runs `MODE:N` on a fresh SQLite file (the child process [`measure`] starts under
/// callgrind), and prints the write transactions committed and the statements sent
/// (BEGIN and COMMIT not among them) after the migration, the fill's included.
pub(super) async fn count_only(run: &str) -> Result<(), BoxError> {
    let (mode, count) = run
        .split_once(':')
        .ok_or("--count-only takes MODE:N, for example relay:1000")?;
    if !MODES.contains(&mode) {
        return Err(format!("--count-only counts one of {MODES:?}, not {mode}").into());
    }
    let rows: usize = count.parse()?;
    let dir = tempfile::tempdir()?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("count.sqlite").display()
    );
    let mut options = ConnectOptions::new(url);
    // One connection, which the commit hook watches; no ping before each use.
    options
        .max_connections(1)
        .test_before_acquire(false)
        .sqlx_logging(false);
    let mut db = Database::connect(options).await?;
    db.execute_unprepared("PRAGMA journal_mode = WAL").await?;
    db.execute_unprepared("PRAGMA synchronous = FULL").await?;
    MigratorWithOutbox::up(&db, None).await?;
    let commits = count_commits(&db).await?;
    let statements = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&statements);
    db.set_metric_callback(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
    });
    let relay = Relay::new(Instant0).with_options(RelayOptions {
        batch_size: BATCH,
        ..RelayOptions::default()
    })?;
    match mode {
        "fill" => fill(&db, rows).await?,
        "relay" => relay_run(&db, &relay, rows).await.map(|_rate| ())?,
        "lease-alone" => leasing_run(&db, rows, MarkWay::Alone)
            .await
            .map(|_rate| ())?,
        "lease-next" => leasing_run(&db, rows, MarkWay::WithNextLease)
            .await
            .map(|_rate| ())?,
        _ => hand_written_run(&db, rows).await.map(|_rate| ())?,
    }
    println!(
        "{} commits, {} statements",
        commits.load(Ordering::Relaxed),
        statements.load(Ordering::Relaxed)
    );
    db.close().await?;
    Ok(())
}

/// Counts the write transactions committed on `db`'s one connection from now on.
pub(super) async fn count_commits(db: &DatabaseConnection) -> Result<Arc<AtomicU64>, BoxError> {
    let commits = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&commits);
    let mut conn = db.get_sqlite_connection_pool().acquire().await?;
    conn.lock_handle().await?.set_commit_hook(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        true
    });
    Ok(commits)
}
