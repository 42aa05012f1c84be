//! What the server does per message of each mode, from its own counters: `SHOW SESSION
//! STATUS` on the one connection of a worker's pool, read before and after a run of the
//! mode, less what the two reads themselves add. Statements (`Com_*`), index and row work
//! (`Handler_*`), InnoDB's rows and pages. These repeat from run to run where rates do not.
//!
//! MariaDB keeps `Handler_*` and `Com_*` per session; most `Innodb_*` counters are global
//! only (the session read returns the server's totals), so they count every other
//! session's work too: on a shared server they are hints, marked `(global)`.

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
        .any(|worker| worker.backend() != DbBackend::MySql)
    {
        return Err("--server-counters reads MySQL/MariaDB status counters".into());
    }
    let mut table: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let each = messages.div_ceil(workers.len().max(1) as u64);
    for (column, &mode) in modes.iter().enumerate() {
        for worker in workers {
            for _ in 0..WARM_UP {
                worker.run(mode, Deliveries::Fresh).await?;
            }
        }
        let mut reads = Vec::with_capacity(workers.len());
        for worker in workers {
            let first = status(worker).await?;
            let second = status(worker).await?;
            reads.push((first, second));
        }
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
