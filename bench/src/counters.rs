//! What the server does per message of each mode, from its own counters: `SHOW SESSION
//! STATUS` on the one connection of a worker's pool, read before and after a run of the
//! mode, less what the two reads themselves add. Statements (`Com_*`), index and row work
//! (`Handler_*`), InnoDB's rows and pages. These repeat from run to run where rates do not.
//!
//! MariaDB keeps `Handler_*` and `Com_*` per session; most `Innodb_*` counters are global
//! only (the session read returns the server's totals), so they count every other
//! session's work too: on a shared server they are hints, marked `(global)`.
//!
//! PostgreSQL without `pg_stat_statements` has no such per-session counters: there the CPU
//! of the workers' backends (by `pg_backend_pid()`, read from `/proc`, so the server must
//! run on this machine) and of this client, and the WAL written, stand in for them.

use crate::BoxError;
use crate::modes::{Deliveries, Mode, Worker};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Messages each mode runs before the counted run: statements get prepared, the inbox
/// reads what the pool's connections carry.
const WARM_UP: u64 = 20;

/// The counters printed, by prefix.
const PREFIXES: [&str; 12] = [
    "Com_",
    "Innodb_row_lock_",
    "Innodb_deadlocks",
    "Innodb_data_fsyncs",
    "Innodb_os_log_fsyncs",
    "Handler_",
    "Innodb_rows_",
    "Innodb_buffer_pool_read_requests",
    "Innodb_buffer_pool_write_requests",
    "Innodb_log_write_requests",
    "Innodb_data_written",
    "Bytes_",
];

/// Counters that are per session on MariaDB (the rest are the server's totals).
fn per_session(name: &str) -> bool {
    name.starts_with("Com_") || name.starts_with("Handler_") || name.starts_with("Bytes_")
}

/// Runs `messages` messages of every mode in `modes`, shared among `workers` running at
/// once, and prints, per mode, each counter that moved, per message: the per-session ones
/// summed over the workers' sessions.
pub async fn measure(
    workers: &[Arc<Worker>],
    modes: &[Mode],
    messages: u64,
) -> Result<(), BoxError> {
    if workers
        .iter()
        .all(|worker| worker.backend() == DbBackend::Postgres)
    {
        return pg_measure(workers, modes, messages).await;
    }
    if workers
        .iter()
        .any(|worker| worker.backend() != DbBackend::MySql)
    {
        return Err("--server-counters reads MySQL/MariaDB status counters".into());
    }
    let mut table: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let each = messages.div_ceil(workers.len().max(1) as u64);
    for (column, &mode) in modes.iter().enumerate() {
        warm_up(workers, mode).await?;
        let mut reads = Vec::with_capacity(workers.len());
        for worker in workers {
            let first = status(worker).await?;
            let second = status(worker).await?;
            reads.push((first, second));
        }
        let done = run_all(workers, mode, each).await?;
        let mut moved: BTreeMap<String, i128> = BTreeMap::new();
        for (index, (worker, (first, second))) in workers.iter().zip(&reads).enumerate() {
            let third = status(worker).await?;
            for (name, after) in &third {
                // The server's totals count once, off the first worker's reads.
                if !per_session(name) && index > 0 {
                    continue;
                }
                let before = second.get(name).copied().unwrap_or(0);
                let read = before - first.get(name).copied().unwrap_or(0);
                *moved.entry(name.clone()).or_default() += after - before - read;
            }
        }
        for (name, total) in moved {
            let row = table.entry(name).or_insert_with(|| vec![0.0; modes.len()]);
            row[column] = total as f64 / done as f64;
        }
    }
    print!("| counter per message |");
    for mode in modes {
        print!(" {} |", mode.name());
    }
    print!("\n|---|");
    for _ in modes {
        print!("---:|");
    }
    println!();
    for (name, row) in &table {
        if row.iter().all(|v| v.abs() < 0.005) {
            continue;
        }
        let scope = if per_session(name) { "" } else { " (global)" };
        print!("| {name}{scope} |");
        for value in row {
            print!(" {value:.2} |");
        }
        println!();
    }
    println!(
        "\n({messages} messages per mode over {} workers at once, after {WARM_UP} unmeasured each)",
        workers.len()
    );
    Ok(())
}

/// The counters of [`PREFIXES`] as the worker's session sees them.
async fn status(worker: &Worker) -> Result<BTreeMap<String, i128>, BoxError> {
    let rows = worker
        .db
        .query_all_raw(Statement::from_string(
            DbBackend::MySql,
            "SHOW SESSION STATUS",
        ))
        .await?;
    let mut counters = BTreeMap::new();
    for row in rows {
        let name: String = row.try_get_by_index(0)?;
        if !PREFIXES.iter().any(|prefix| name.starts_with(prefix)) {
            continue;
        }
        let value: String = row.try_get_by_index(1)?;
        if let Ok(value) = value.parse::<i128>() {
            counters.insert(name, value);
        }
    }
    Ok(counters)
}

/// CPU nanoseconds (`/proc/PID/schedstat`, summed over the threads) of one process.
fn cpu_ns(pid: &str) -> u64 {
    let mut total = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) {
                total += text
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    total
}

/// CPU of PostgreSQL's auxiliary processes (WAL writer, checkpointer, background writer).
fn aux_ns() -> u64 {
    let mut total = 0;
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for entry in procs.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let cmd = std::fs::read_to_string(entry.path().join("cmdline")).unwrap_or_default();
            if cmd.starts_with("postgres: ")
                && (cmd.contains("walwriter")
                    || cmd.contains("checkpointer")
                    || cmd.contains("background writer"))
            {
                total += cpu_ns(&name);
            }
        }
    }
    total
}

async fn pg_scalar(worker: &Worker, sql: &str) -> Result<i64, BoxError> {
    let row = worker
        .db
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await?
        .ok_or("no row")?;
    Ok(row.try_get_by_index::<i64>(0)?)
}

/// PostgreSQL: CPU of the workers' backends (exact, by pid), of the auxiliary processes
/// and of this client, and WAL bytes, per message of each mode.
async fn pg_measure(
    workers: &[Arc<Worker>],
    modes: &[Mode],
    messages: u64,
) -> Result<(), BoxError> {
    let each = messages.div_ceil(workers.len().max(1) as u64);
    let mut pids = Vec::new();
    for worker in workers {
        pids.push(
            pg_scalar(worker, "SELECT pg_backend_pid()::bigint")
                .await?
                .to_string(),
        );
    }
    let backends = |pids: &[String]| pids.iter().map(|p| cpu_ns(p)).sum::<u64>();
    let first = workers.first().ok_or("no worker")?;
    let lsn = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint";
    println!(
        "| mode | messages | client CPU us/msg | backends CPU us/msg | aux CPU us/msg | WAL bytes/msg | wall s | rate/s |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &mode in modes {
        warm_up(workers, mode).await?;
        let wal0 = pg_scalar(first, lsn).await?;
        let (b0, a0, c0) = (backends(&pids), aux_ns(), cpu_ns("self"));
        let started = std::time::Instant::now();
        let done = run_all(workers, mode, each).await?;
        let wall = started.elapsed().as_secs_f64();
        let (b1, a1, c1) = (backends(&pids), aux_ns(), cpu_ns("self"));
        let wal1 = pg_scalar(first, lsn).await?;
        let per = |a: u64, b: u64| (b.saturating_sub(a)) as f64 / 1000.0 / done as f64;
        println!(
            "| {} | {done} | {:.1} | {:.1} | {:.1} | {:.0} | {wall:.2} | {:.0} |",
            mode.name(),
            per(c0, c1),
            per(b0, b1),
            per(a0, a1),
            (wal1 - wal0) as f64 / done as f64,
            done as f64 / wall
        );
    }
    let rows = first
        .db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT (claim_token IS NOT NULL)::text || ' processed=' || (processed_at IS NOT NULL)::text || ' rows=' || count(*)::text || ' avg pg_column_size=' || avg(pg_column_size(i.*))::numeric(10,1)::text FROM inbox i GROUP BY claim_token IS NOT NULL, processed_at IS NOT NULL",
        ))
        .await?;
    for row in rows {
        println!(
            "row width (claim_token set?): {}",
            row.try_get_by_index::<String>(0)?
        );
    }
    let forms = [
        (
            "raw",
            r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (gen_random_uuid(), 'bench.credit', now())"#,
        ),
        (
            "on_conflict",
            r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (gen_random_uuid(), 'bench.credit', now()) ON CONFLICT ("message_id", "consumer") DO NOTHING"#,
        ),
        (
            "claim",
            r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") VALUES (gen_random_uuid(), 'bench.credit', now(), gen_random_uuid()) ON CONFLICT ("message_id", "consumer") DO NOTHING RETURNING "id""#,
        ),
    ];
    for (name, sql) in forms {
        let mut last = Vec::new();
        for _ in 0..5 {
            let txn = sea_orm::TransactionTrait::begin(&first.db).await?;
            let rows = txn
                .query_all_raw(Statement::from_string(
                    DbBackend::Postgres,
                    format!("EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF, TIMING OFF) {sql}"),
                ))
                .await?;
            last = rows
                .iter()
                .map(|row| row.try_get_by_index::<String>(0))
                .collect::<Result<Vec<_>, _>>()?;
            txn.rollback().await?;
        }
        println!("EXPLAIN {name}:\n{}", last.join("\n"));
    }
    Ok(())
}

/// [`WARM_UP`] unmeasured messages of `mode` on each worker.
async fn warm_up(workers: &[Arc<Worker>], mode: Mode) -> Result<(), BoxError> {
    for worker in workers {
        for _ in 0..WARM_UP {
            worker.run(mode, Deliveries::Fresh).await?;
        }
    }
    Ok(())
}

/// At least `each` messages of `mode` on every worker at once; the messages done.
async fn run_all(workers: &[Arc<Worker>], mode: Mode, each: u64) -> Result<u64, BoxError> {
    let runs: Vec<_> = workers
        .iter()
        .map(|worker| {
            let worker = Arc::clone(worker);
            tokio::spawn(async move {
                let mut done = 0_u64;
                while done < each {
                    done += worker.run(mode, Deliveries::Fresh).await?.messages;
                }
                Ok::<u64, BoxError>(done)
            })
        })
        .collect();
    let mut done = 0_u64;
    for run in runs {
        done += run.await??;
    }
    Ok(done)
}
