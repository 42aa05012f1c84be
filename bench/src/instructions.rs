//! Client-side instructions per message, counted by callgrind: `claim` and `process`
//! against `raw` on an in-memory SQLite database, where nothing waits on a disk or a
//! network and the counts repeat from run to run.
//!
//! `--instructions N` runs this binary again under `valgrind --tool=callgrind` with
//! `--count-only MODE:M` for M = N and 2N; the difference divided by N is the cost of one
//! message with the start-up (runtime, connection, migration) cancelled out.

use crate::BoxError;
use crate::callgrind::collected;
use crate::db::{self, BenchDb, Target};
use crate::modes::{BATCH_IDS, Deliveries, Mode, Worker};
use crate::peers::Mixer;
use sea_orm::{ConnectOptions, Database};
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::fmt;
use std::process::Command;
use std::sync::Arc;

/// The modes counted, the floor first; the batches last, counted per transaction of
/// [`BATCH_IDS`] ids.
const MODES: [Mode; 7] = [
    Mode::Raw,
    Mode::OnConflict,
    Mode::ClaimUnchecked,
    Mode::Claim,
    Mode::Process,
    Mode::BatchRaw,
    Mode::Batch,
];

/// Instructions per message of each counted mode.
#[derive(Debug)]
pub struct Counts {
    pub messages: u64,
    pub per_message: Vec<(Mode, f64)>,
}

impl Counts {
    fn of(&self, mode: Mode) -> Option<f64> {
        self.per_message
            .iter()
            .find(|(m, _)| *m == mode)
            .map(|(_, n)| *n)
    }
}

impl fmt::Display for Counts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| mode | instructions per message | / raw |\n|---|---:|---:|"
        )?;
        let raw = self.of(Mode::Raw).unwrap_or(f64::NAN);
        let batch_raw = self.of(Mode::BatchRaw).unwrap_or(f64::NAN);
        for (mode, count) in &self.per_message {
            match mode {
                Mode::Batch | Mode::BatchRaw => writeln!(
                    f,
                    "| {} (per transaction of {BATCH_IDS} ids) | {count:.0} | / batch_raw {:.3} |",
                    mode.name(),
                    count / batch_raw
                )?,
                _ => writeln!(f, "| {} | {count:.0} | {:.3} |", mode.name(), count / raw)?,
            }
        }
        writeln!(
            f,
            "\n(callgrind, SQLite in memory, {} and {} messages per mode, one worker)",
            self.messages,
            2 * self.messages
        )
    }
}

/// Counts every mode of [`MODES`] under callgrind.
pub fn measure(messages: u64) -> Result<Counts, BoxError> {
    let exe = std::env::current_exe()?;
    let mut per_message = Vec::new();
    for mode in MODES {
        let mut totals = [0_u64; 2];
        for (total, count) in totals.iter_mut().zip([messages, 2 * messages]) {
            eprintln!("[instructions] {} x {count} under callgrind", mode.name());
            let output = Command::new("valgrind")
                .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
                .arg(&exe)
                .arg("--count-only")
                .arg(format!("{}:{count}", mode.name()))
                .output()
                .map_err(|e| format!("cannot run valgrind (apt-get install valgrind): {e}"))?;
            let stderr = String::from_utf8_lossy(&output.stderr);
            if !output.status.success() {
                return Err(format!("callgrind run of {} failed:\n{stderr}", mode.name()).into());
            }
            *total = collected(&stderr)
                .ok_or_else(|| format!("no `Collected :` line from callgrind:\n{stderr}"))?;
        }
        let extra = totals[1].saturating_sub(totals[0]);
        per_message.push((mode, extra as f64 / messages as f64));
    }
    Ok(Counts {
        messages,
        per_message,
    })
}

/// Runs `MODE:N` messages on one worker over an in-memory SQLite database (the child
/// process [`measure`] starts under callgrind), or `MODE:N:URL` over a database of its own
/// created through the server URL (dropped afterwards): the client's work on a server
/// backend, its dialect's statements and bounds included.
pub async fn count_only(run: &str) -> Result<(), BoxError> {
    let (name, rest) = run
        .split_once(':')
        .ok_or("--count-only takes MODE:N[:URL], for example claim:1000")?;
    let (count, url) = match rest.split_once(':') {
        Some((count, url)) => (count, Some(url)),
        None => (rest, None),
    };
    let mode = MODES
        .into_iter()
        .find(|mode| mode.name() == name)
        .ok_or_else(|| {
            format!(
                "--count-only counts raw, on_conflict, claim_unchecked, claim, process, batch_raw or \
                 batch, not {name}"
            )
        })?;
    let count: u64 = count.parse()?;
    let server = match url {
        Some(url) => Some(
            BenchDb::create(&Target {
                name: "server",
                admin_url: Some(url.to_owned()),
                database: format!("inbox_count_{}", std::process::id()),
            })
            .await?,
        ),
        None => None,
    };
    let conn = match &server {
        Some(server) => server.connect().await?,
        None => {
            let mut options = ConnectOptions::new("sqlite::memory:");
            options
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None::<std::time::Duration>)
                .max_lifetime(None::<std::time::Duration>)
                .test_before_acquire(false)
                .sqlx_logging(false);
            let conn = Database::connect(options).await?;
            Migrator::up(&conn, None).await?;
            conn
        }
    };
    db::create_accounts(&conn, 1).await?;
    let sql = db::sql(conn.get_database_backend())?;
    let worker = Worker::new(conn.clone(), 1, sql, Vec::new(), Arc::new(Mixer::default()))?;
    for _ in 0..count {
        worker.run(mode, Deliveries::Fresh).await?;
    }
    drop(worker);
    conn.close().await?;
    if let Some(server) = server {
        server.drop_database().await?;
    }
    Ok(())
}
