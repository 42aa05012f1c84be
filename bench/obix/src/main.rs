//! obix (crates.io `obix` 0.16: a PostgreSQL-only transactional outbox on sqlx 0.8) for
//! `outbox-bench`'s comparison, in a child process that `outbox-bench --obix <this binary>`
//! starts and drives through lines on stdin and stdout.
//!
//! # Why a crate of its own
//!
//! obix is on sqlx 0.8, the library on sqlx 0.9. sqlx 0.8's SQLite driver enters any
//! Cargo.lock that holds sqlx 0.8 (through weak features, compiled or not) and pins
//! `libsqlite3-sys` to ^0.30; a build links one `sqlite3`, so in the library's workspace every
//! build, the library's SQLite tests and numbers included, would fall from libsqlite3-sys
//! 0.37 (SQLite 3.51) to 0.30 (SQLite 3.46). This crate is therefore outside that workspace,
//! with a `[workspace]` and a Cargo.lock of its own, and depends on nothing of it: the
//! benchmark and this binary share only the line protocol below and the database.
//!
//! ```text
//! cargo build --release --manifest-path bench/obix/Cargo.toml
//! cargo run --release -p inbox-bench --bin outbox-bench -- --latency \
//!     --postgres postgres://postgres@127.0.0.1:5432/test \
//!     --obix bench/obix/target/release/obix-bench
//! ```
//!
//! # obix as a new user sets it up
//!
//! Nothing is tuned: the migration its README has a user copy into their migrations
//! (`*_obix_setup.sql`), applied with sqlx's migrator straight from the obix package cargo
//! resolved (found with `cargo metadata`, so this repository holds no copy of obix's code
//! and an obix upgrade brings its own schema; the binary runs where cargo does), then
//! `Outbox::init(&pool, MailboxConfig::builder().build())`, every setting at its default
//! (the ones that shape the latency rows: `notify_debounce` 25 ms, `event_buffer_size` 100,
//! `event_cache_size` 1000, `backfill_page_size` 1000, `gap_fill_grace` 2 s). A publish
//! joins the business transaction through obix's operation: `outbox.begin_op()` opens the
//! transaction, the `UPDATE` runs on `op.as_executor()`, `publish_persisted_in_op` stages
//! the event and `op.commit()` inserts it and commits. A consumer is
//! `outbox.listen_persisted(None)`: in the publishing process fed from the commit, in
//! another woken by the publisher's debounced `NOTIFY` and then reading the table.
//!
//! # Commands
//!
//! `obix-bench publisher <postgres url>`: applies the migration and starts an outbox on a
//! pool of [`POOL_SIZE`], prints `ready`, then answers one line per command on stdin until
//! stdin closes:
//!
//! - `writers <writers> <seconds>`: `rate <transactions per second>`, `writers` writers
//!   committing for `seconds`, each transaction `UPDATE bench_writer SET balance = balance
//!   + 1 WHERE id = <writer>` (the table `outbox-bench` made) and one publish. The timed
//!   window holds only the writers' loop, as in `outbox_enqueue::rate`;
//! - `publish <account> <first> <transactions> <events>`: `committed <micros>`,
//!   `transactions` transactions back to back of `events` events each, numbered from
//!   `first`, and the wall-clock instant the last `COMMIT` returned;
//! - `listen`: `listening`, then `<message id> <micros>` per event this process's own
//!   listener delivers (the same-process row), until `unlisten`: `unlistened`, after the
//!   listener's last line.
//!
//! `obix-bench listen <postgres url>`: an outbox of its own (a pool as the README makes
//! it), prints `listening` once its listener exists, then `<message id> <micros>` per
//! delivered event (the other-process row), until stdin closes.
//!
//! An event is `{"account":…,"n":…}` (about 20 bytes of JSON, like the benchmark's
//! `credited {writer}.{n}`), and its message id `Uuid::from_u64_pair(account, n)`, which
//! `outbox-bench` computes for the events it asked for. A failure ends the process with the
//! error on stderr; the benchmark then reports the child's end.

use futures_util::StreamExt;
use obix::MailboxConfig;
use obix::out::{Outbox, PersistentOutboxListener};
use obix::prelude::es_entity::AtomicOperation;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The publisher's pool: the 8 writers of the benchmark's writers' table, plus what obix
/// holds or borrows beside them (its `LISTEN` connection, the notifier's `pg_notify`, the
/// cache's reads), so the writers never wait for obix's own connections.
const POOL_SIZE: u32 = 12;

const USAGE: &str = "usage: obix-bench publisher <postgres url> | obix-bench listen <postgres url> \
                     (the commands are in bench/obix/src/main.rs's docs)";

/// obix's event, the counterpart of the benchmark's `credited {writer}.{n}` message.
#[derive(Serialize, Deserialize)]
struct Credited {
    account: u64,
    n: u64,
}

impl Credited {
    /// The event's message id on the line protocol.
    fn id(&self) -> Uuid {
        Uuid::from_u64_pair(self.account, self.n)
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next(), args.next()) {
        (Some("publisher"), Some(url), None) => publisher(&url).await,
        (Some("listen"), Some(url), None) => listen(&url).await,
        _ => Err(USAGE.into()),
    }
}

/// Wall-clock microseconds, the clock `outbox-bench` compares them with.
fn micros_now() -> u128 {
    // A clock before 1970 is a broken machine; zero makes its numbers visibly wrong.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

/// Writes one line of the protocol; an error when stdout is closed (the benchmark is gone).
fn say(line: &str) -> Result<(), BoxError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|err| format!("writing {line:?} to stdout: {err}"))?;
    Ok(())
}

/// Prints a delivery as `<message id> <micros>`.
fn print_delivery(id: Uuid) {
    let micros = micros_now();
    let mut out = std::io::stdout().lock();
    // A closed stdout means the benchmark is gone: nothing left to measure.
    let _ = writeln!(out, "{id} {micros}").and_then(|()| out.flush());
}

/// Stdin's lines, read on a thread of their own; the channel closes with stdin.
fn stdin_lines() -> tokio::sync::mpsc::UnboundedReceiver<Result<String, std::io::Error>> {
    let (lines, received) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    received
}

/// A migrated database and an outbox with every default, as the README sets them up.
async fn setup(url: &str) -> Result<(PgPool, Outbox<Credited>), BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect(url)
        .await
        .map_err(|err| format!("connecting to {url}: {err}"))?;
    let migration = obix_migration()?;
    let migrator = sqlx::migrate::Migrator::new(migration.as_path())
        .await
        .map_err(|err| format!("reading obix's migration in {}: {err}", migration.display()))?;
    // The migrator holds the file's contents now.
    std::fs::remove_dir_all(&migration)?;
    migrator
        .run(&pool)
        .await
        .map_err(|err| format!("applying obix's migration: {err}"))?;
    let outbox = Outbox::init(&pool, MailboxConfig::builder().build())
        .await
        .map_err(|err| format!("Outbox::init: {err}"))?;
    Ok((pool, outbox))
}

/// Stops obix's background tasks and closes the pool, so the benchmark can drop its
/// database (PostgreSQL refuses while a connection is open).
async fn close(pool: PgPool, outbox: Outbox<Credited>) -> Result<(), BoxError> {
    // Dropping the last handle aborts the listener, notifier and cache tasks, which hand
    // their connections back.
    drop(outbox);
    tokio::time::timeout(Duration::from_secs(10), pool.close())
        .await
        .map_err(|_| "obix's pool did not close in 10 s")?;
    Ok(())
}

/// Parses a command's number, naming it in the error.
fn number<T: std::str::FromStr>(word: &str, what: &str) -> Result<T, BoxError>
where
    T::Err: std::fmt::Display,
{
    word.parse()
        .map_err(|err| format!("{what} {word:?}: {err}").into())
}

/// `obix-bench publisher <url>`: see the module docs.
async fn publisher(url: &str) -> Result<(), BoxError> {
    let (pool, outbox) = setup(url).await?;
    say("ready")?;
    let mut commands = stdin_lines();
    let mut listener = None;
    while let Some(line) = commands.recv().await {
        let line = line.map_err(|err| format!("reading a command from stdin: {err}"))?;
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["writers", writers, seconds] => {
                let writers = number(writers, "writers")?;
                let seconds: f64 = number(seconds, "seconds")?;
                if !(seconds > 0.0 && seconds.is_finite()) {
                    return Err(format!("seconds must be positive, not {seconds}").into());
                }
                let rate = rate(&outbox, writers, seconds).await?;
                say(&format!("rate {rate}"))?;
            }
            ["publish", account, first, transactions, events] => {
                let committed = publish(
                    &outbox,
                    number(account, "account")?,
                    number(first, "first")?,
                    number(transactions, "transactions")?,
                    number(events, "events")?,
                )
                .await?;
                say(&format!("committed {committed}"))?;
            }
            ["listen"] if listener.is_none() => {
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let stopped = async {
                    let _ = stopped.await;
                };
                let consumer = consume(outbox.listen_persisted(None), stopped, print_delivery);
                listener = Some((stop, tokio::spawn(consumer)));
                say("listening")?;
            }
            ["unlisten"] => {
                let (stop, task) = listener.take().ok_or("unlisten without a listen")?;
                let _ = stop.send(());
                task.await??;
                say("unlistened")?;
            }
            _ => return Err(format!("unknown command {line:?}; {USAGE}").into()),
        }
    }
    if let Some((stop, task)) = listener {
        let _ = stop.send(());
        task.await??;
    }
    close(pool, outbox).await
}

/// One transaction of a writer: the business `UPDATE` of its row and one publish, in
/// obix's operation.
async fn transaction(outbox: &Outbox<Credited>, writer: usize, n: u64) -> Result<(), BoxError> {
    let mut op = outbox.begin_op().await?;
    sqlx::query("UPDATE bench_writer SET balance = balance + 1 WHERE id = $1")
        .bind(writer as i64)
        .execute(op.as_executor())
        .await
        .map_err(|err| format!("UPDATE bench_writer (made by outbox-bench): {err}"))?;
    outbox
        .publish_persisted_in_op(
            &mut op,
            Credited {
                account: writer as u64,
                n,
            },
        )
        .await?;
    op.commit().await?;
    Ok(())
}

/// Runs `writers` writers for `seconds`; returns committed transactions per second. The
/// same loop as `outbox_enqueue::rate` in the benchmark, so the rows compare.
async fn rate(outbox: &Outbox<Credited>, writers: usize, seconds: f64) -> Result<f64, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for writer in 0..writers {
        let (outbox, stop, committed) = (outbox.clone(), Arc::clone(&stop), Arc::clone(&committed));
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                transaction(&outbox, writer, n).await?;
                committed.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<_, BoxError>(())
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    Ok(committed.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// `transactions` transactions back to back, of `events` events each numbered from
/// `first`; returns when the last `COMMIT` returned, in wall-clock microseconds.
async fn publish(
    outbox: &Outbox<Credited>,
    account: u64,
    first: u64,
    transactions: u64,
    events: u64,
) -> Result<u128, BoxError> {
    let mut committed = micros_now();
    for t in 0..transactions {
        let mut op = outbox.begin_op().await?;
        for e in 0..events {
            let n = first + t * events + e;
            outbox
                .publish_persisted_in_op(&mut op, Credited { account, n })
                .await?;
        }
        op.commit().await?;
        committed = micros_now();
    }
    Ok(committed)
}

/// Hands each delivery of `listener` to `deliver` until `stop`.
async fn consume(
    mut listener: PersistentOutboxListener<Credited>,
    stop: impl Future<Output = ()>,
    deliver: impl Fn(Uuid),
) -> Result<(), BoxError> {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return Ok(()),
            delivery = listener.next() => match delivery {
                // A `None` payload is obix's placeholder for a rolled-back sequence.
                Some(Ok(event)) => {
                    if let Some(credited) = &event.payload {
                        deliver(credited.id());
                    }
                }
                Some(Err(undecodable)) => {
                    return Err(format!("obix delivered an undecodable event: {undecodable}").into());
                }
                None => return Err("obix's listener ended".into()),
            },
        }
    }
}

/// Resolves when stdin closes: the benchmark's signal to stop.
async fn stdin_closed() {
    let mut lines = stdin_lines();
    while lines.recv().await.is_some() {}
}

/// `obix-bench listen <url>`: see the module docs.
async fn listen(url: &str) -> Result<(), BoxError> {
    let pool = PgPool::connect(url)
        .await
        .map_err(|err| format!("connecting to {url}: {err}"))?;
    warm_up(&pool).await?;
    let outbox = Outbox::<Credited>::init(&pool, MailboxConfig::builder().build())
        .await
        .map_err(|err| format!("Outbox::init: {err}"))?;
    let listener = outbox.listen_persisted(None);
    say("listening")?;
    let result = consume(listener, stdin_closed(), print_delivery).await;
    close(pool, outbox).await?;
    result
}

/// Connections opened in the listener's pool before it listens, as in a service that has
/// run a while: the benchmark's own relay child opens as many (`WARM_CONNECTIONS` in
/// `outbox_latency.rs`), so that neither pays sqlx's TLS connect (about 90 ms here)
/// inside the measured round.
const WARM_CONNECTIONS: usize = 4;

async fn warm_up(pool: &PgPool) -> Result<(), BoxError> {
    let holds: Vec<_> = (0..WARM_CONNECTIONS)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { sqlx::query("SELECT pg_sleep(0.05)").execute(&pool).await })
        })
        .collect();
    for hold in holds {
        hold.await??;
    }
    Ok(())
}

/// A directory holding only obix's own migration (`*_obix_setup.sql`, what its README has
/// a user copy), copied at run time from the obix package cargo resolved for this crate.
/// obix's `migrations/` also holds the `job` crate's tables, which only its job-run
/// subscribers use; the README's set-up leaves them out, and so does this.
fn obix_migration() -> Result<std::path::PathBuf, BoxError> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--manifest-path",
        ])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .output()
        .map_err(|err| format!("running cargo metadata to find obix's migration: {err}"))?;
    if !output.status.success() {
        return Err(format!(
            "cargo metadata (to find obix's migration) failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let manifest = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|package| package["name"] == "obix")
        .and_then(|package| package["manifest_path"].as_str())
        .ok_or("cargo metadata lists no obix package")?;
    let shipped = std::path::Path::new(manifest)
        .parent()
        .ok_or("obix's manifest path has no directory")?
        .join("migrations");
    let mut setup = Vec::new();
    for entry in std::fs::read_dir(&shipped)
        .map_err(|err| format!("reading obix's migrations in {}: {err}", shipped.display()))?
    {
        let entry = entry?;
        if entry
            .file_name()
            .to_string_lossy()
            .ends_with("_obix_setup.sql")
        {
            setup.push(entry.path());
        }
    }
    let [file] = setup.as_slice() else {
        return Err(format!(
            "expected one *_obix_setup.sql in {}, found {setup:?}",
            shipped.display()
        )
        .into());
    };
    let name = file
        .file_name()
        .ok_or("obix's migration has no file name")?;
    let dir = std::env::temp_dir().join(format!("obix-bench-migration-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(file, dir.join(name))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    type BoxError = Box<dyn std::error::Error + Send + Sync>;

    /// The resolved obix still ships exactly one setup migration where the benchmark looks.
    #[test]
    fn obix_migration_is_found() -> Result<(), BoxError> {
        let dir = super::obix_migration()?;
        let files = std::fs::read_dir(&dir)?.count();
        std::fs::remove_dir_all(&dir)?;
        if files != 1 {
            return Err(format!("{files} files in {}", dir.display()).into());
        }
        Ok(())
    }
}
