//! The outbox benchmark: what an enqueue adds to `Inbox::process`, and the relay's
//! throughput next to two hand-written loops, each as a ratio against its baseline
//! measured in the same rounds (interleaved, in alternating order):
//!
//! - the hand-written loop it replaces (`hand_written_run`): one transaction per batch
//!   that locks the rows, publishes while holding them and marks them sent; each row
//!   written once, but an attempt is not counted when the process dies during the publish,
//!   and a transaction stays open across the broker;
//! - the hand-written leasing loop (`leasing_run`), which keeps what the relay's lease
//!   buys: a short transaction that locks and leases the batch (attempts + 1, lease end,
//!   token), the publish outside any transaction, then the sent mark fenced by the token;
//!   each row written twice, as by the relay. Two columns: the mark written on its own
//!   (two commits per batch) and the mark written in the next batch's lease transaction,
//!   as the relay's drain does (one commit per batch).
//!
//! `--counts` adds a table of what one drain of each way does per batch: the statements the
//! client sent, the server's commits and row writes (see `count_drains`); unlike the rates
//! these do not vary from run to run.
//!
//! ```text
//! cargo run --release -p inbox-bench --bin outbox-bench                     # SQLite
//! cargo run --release -p inbox-bench --bin outbox-bench -- \
//!     --postgres postgres://postgres@127.0.0.1:5432/test \
//!     --mysql mysql://root@127.0.0.1:3306/test --rounds 5 --messages 400
//! cargo run --release -p inbox-bench --bin outbox-bench -- --counts --enqueue-seconds 0 \
//!     --rounds 1 --postgres postgres://postgres@127.0.0.1:5432/test  # + statements per batch
//! cargo run --release -p inbox-bench --bin outbox-bench -- --latency     # + commit-to-publish
//! cargo run --release -p inbox-bench --bin outbox-bench -- --instructions 1000  # SQLite, per row
//! cargo run --release -p inbox-bench --bin outbox-bench --features kafka -- \
//!     --kafka 127.0.0.1:9092 --postgres postgres://postgres@127.0.0.1:5432/test  # Kafka only
//! cargo build --release --manifest-path bench/obix/Cargo.toml           # + obix beside ours:
//! cargo run --release -p inbox-bench --bin outbox-bench -- --latency \
//!     --postgres postgres://postgres@127.0.0.1:5432/test \
//!     --obix bench/obix/target/release/obix-bench
//! ```
//!
//! `--obix <path to obix-bench>` (PostgreSQL only) adds obix, set up with every default as
//! a new user would, to the PostgreSQL tables: "UPDATE + obix publish" in the writers'
//! table, its listener in the publishing process and in another in the latency table (see
//! `outbox_obix`). obix runs in that binary, a crate outside this workspace with its own
//! Cargo.lock, because its sqlx 0.8 would pin the workspace's libsqlite3-sys (and so the
//! library's SQLite) to an older release.
//!
//! A server URL names a database the user may create databases from: the benchmark
//! creates its own (`outbox_bench_<random>`), migrates it with `MigratorWithOutbox`, and
//! drops it at the end.

use sea_orm::sea_query::{
    Alias, Expr, ExprTrait, LockBehavior, LockType, Order, Query, SelectStatement,
};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, TransactionTrait,
};
use sea_orm_inbox::{
    CLAIM_TRANSACTION, Inbox, OutboxExt, OutboxMessage, Outcome, OutgoingMessage, PublishError,
    Publisher, Relay, RelayOptions,
};
use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
use std::time::{Duration, Instant};

mod callgrind;
mod outbox_enqueue;
mod outbox_instructions;
#[cfg(feature = "kafka")]
mod outbox_kafka;
mod outbox_latency;
mod outbox_obix;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Rows per claim, for the relay and the hand-written loop alike.
const BATCH: u32 = 100;

/// A broker that confirms at once: the benchmark measures the database side.
struct Instant0;

impl Publisher for Instant0 {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        std::hint::black_box(message.payload.len());
        Ok(())
    }
}

struct Args {
    postgres: Option<String>,
    mysql: Option<String>,
    rounds: usize,
    messages: usize,
    /// Also measure commit-to-publish latency (`--latency`).
    latency: bool,
    /// Seconds per mode and round of the writers' table (`--enqueue-seconds`; 0 skips it).
    enqueue_seconds: f64,
    /// The `obix-bench` binary, to measure obix beside ours on PostgreSQL (`--obix`).
    obix: Option<std::path::PathBuf>,
    /// A Kafka-protocol broker's bootstrap address: measure only the Kafka consumer
    /// (`--kafka`, see `outbox_kafka`).
    kafka: Option<String>,
    /// Also count what each drain does per batch (`--counts`, see `count_drains`).
    counts: bool,
}

fn args() -> Result<Args, BoxError> {
    let mut args = Args {
        postgres: None,
        mysql: None,
        rounds: 5,
        messages: 400,
        latency: false,
        enqueue_seconds: 1.0,
        obix: None,
        kafka: None,
        counts: false,
    };
    let mut iter = std::env::args().skip(1);
    while let Some(flag) = iter.next() {
        let mut value = || iter.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--postgres" => args.postgres = Some(value()?),
            "--mysql" => args.mysql = Some(value()?),
            "--rounds" => args.rounds = value()?.parse()?,
            "--messages" => args.messages = value()?.parse()?,
            "--latency" => args.latency = true,
            "--enqueue-seconds" => args.enqueue_seconds = value()?.parse()?,
            "--obix" => args.obix = Some(outbox_obix::binary(&value()?)?),
            "--kafka" => args.kafka = Some(value()?),
            "--counts" => args.counts = true,
            other => return Err(format!("unknown flag {other}; see the module docs").into()),
        }
    }
    if !(args.enqueue_seconds >= 0.0 && args.enqueue_seconds.is_finite()) {
        return Err("--enqueue-seconds must be a number of seconds, 0 or more".into());
    }
    if args.obix.is_some() && args.postgres.is_none() {
        return Err("--obix needs --postgres: obix runs on PostgreSQL only".into());
    }
    if args.rounds == 0 || args.messages == 0 {
        return Err("--rounds and --messages must be at least 1".into());
    }
    Ok(args)
}

/// A database of the benchmark's own: a temporary SQLite file, or a fresh database on a
/// server (dropped by [`Target::drop_database`]).
struct Target {
    name: &'static str,
    url: String,
    server: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl Target {
    fn sqlite() -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("bench.sqlite").display()
        );
        Ok(Self {
            name: "sqlite",
            url,
            server: None,
            _dir: Some(dir),
        })
    }

    async fn server(name: &'static str, admin_url: &str) -> Result<Self, BoxError> {
        let database = format!("outbox_bench_{}", uuid::Uuid::new_v4().simple());
        let admin = Database::connect(admin_url).await?;
        admin
            .execute_unprepared(&format!("CREATE DATABASE {database}"))
            .await?;
        admin.close().await?;
        let base = admin_url
            .rsplit_once('/')
            .map_or(admin_url, |(base, _)| base);
        Ok(Self {
            name,
            url: format!("{base}/{database}"),
            server: Some((admin_url.to_owned(), database)),
            _dir: None,
        })
    }

    async fn connect(&self) -> Result<DatabaseConnection, BoxError> {
        let mut options = ConnectOptions::new(self.url.clone());
        // One connection per writer of the enqueue table, and the relay's.
        let writers = outbox_enqueue::WRITERS.iter().copied().max().unwrap_or(1);
        options
            .max_connections(writers as u32 + 2)
            .sqlx_logging(false);
        let db = Database::connect(options).await?;
        if db.get_database_backend() == DbBackend::Sqlite {
            db.execute_unprepared("PRAGMA journal_mode = WAL").await?;
            db.execute_unprepared("PRAGMA busy_timeout = 30000").await?;
        }
        Ok(db)
    }

    async fn drop_database(self) -> Result<(), BoxError> {
        if let Some((admin_url, database)) = &self.server {
            let admin = Database::connect(admin_url.as_str()).await?;
            admin
                .execute_unprepared(&format!("DROP DATABASE IF EXISTS {database}"))
                .await?;
            admin.close().await?;
        }
        Ok(())
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `messages` deliveries through `Inbox::process`, each crediting one account, with one
/// enqueue each when `enqueue`. Returns messages per second.
async fn process_run(
    db: &DatabaseConnection,
    inbox: &Inbox,
    messages: usize,
    enqueue: bool,
) -> Result<f64, BoxError> {
    let started = Instant::now();
    for n in 0..messages {
        let id = uuid::Uuid::new_v4();
        let outcome = inbox
            .process(db, id, |txn| {
                Box::pin(async move {
                    txn.execute_unprepared("UPDATE bench_account SET balance = balance + 1")
                        .await?;
                    if enqueue {
                        let event = OutgoingMessage::new("bench", format!("credited {n}"))
                            .message_id(sea_orm_inbox::MessageId::from(id).outgoing("bench", 0));
                        txn.enqueue(event).await?;
                    }
                    Ok::<_, BoxError>(())
                })
            })
            .await
            .map_err(|err| format!("process: {err:?}"))?;
        if !matches!(outcome, Outcome::Processed(())) {
            return Err(format!("a fresh message was not processed: {outcome:?}").into());
        }
    }
    Ok(messages as f64 / started.elapsed().as_secs_f64())
}

/// Empties the outbox (the process modes' events included) and fills it with `rows` unsent
/// messages (untimed).
async fn fill(db: &DatabaseConnection, rows: usize) -> Result<(), BoxError> {
    db.execute_unprepared("DELETE FROM outbox").await?;
    let txn = db.begin().await?;
    for n in 0..rows {
        txn.enqueue(OutgoingMessage::new("bench", format!("event {n}")))
            .await?;
    }
    txn.commit().await?;
    Ok(())
}

/// Drains the outbox with the relay, as `Relay::run` does when woken. Returns rows per
/// second.
async fn relay_run(
    db: &DatabaseConnection,
    relay: &Relay<Instant0>,
    rows: usize,
) -> Result<f64, BoxError> {
    fill(db, rows).await?;
    let started = Instant::now();
    let published = relay.drain(db).await?.published;
    let took = started.elapsed().as_secs_f64();
    if published != rows as u64 {
        return Err(format!("the relay published {published} of {rows}").into());
    }
    Ok(rows as f64 / took)
}

/// The loop a team writes by hand: one transaction per batch that locks unsent rows
/// (`FOR UPDATE SKIP LOCKED`; SQLite drops the clause, its IMMEDIATE transaction is the
/// lock), publishes them while holding the locks, marks them sent and commits. No lease,
/// no fencing, no per-key order, no retry bookkeeping. Returns rows per second.
async fn hand_written_run(db: &DatabaseConnection, rows: usize) -> Result<f64, BoxError> {
    fill(db, rows).await?;
    let started = Instant::now();
    let published = hand_written_drain(db).await?;
    let took = started.elapsed().as_secs_f64();
    if published != rows {
        return Err(format!("the hand-written loop published {published} of {rows}").into());
    }
    Ok(rows as f64 / took)
}

/// A hand-written loop's read of a batch of unsent rows, oldest first, locked (`FOR
/// UPDATE SKIP LOCKED`; SQLite drops the clause, its IMMEDIATE transaction is the lock):
/// what a broker needs of each row (id, message_id, destination, payload, headers), then
/// the columns `more`.
fn batch_read(more: &[Alias]) -> SelectStatement {
    let id = Alias::new("id");
    Query::select()
        .columns([
            id.clone(),
            Alias::new("message_id"),
            Alias::new("destination"),
            Alias::new("payload"),
            Alias::new("headers"),
        ])
        .columns(more.iter().cloned())
        .from(Alias::new("outbox"))
        .and_where(Expr::col(Alias::new("sent_at")).is_null())
        .order_by(id, Order::Asc)
        .limit(u64::from(BATCH))
        .lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
        .to_owned()
}

/// The hand-written loop's drain (see [`hand_written_run`]); returns the rows published.
async fn hand_written_drain(db: &DatabaseConnection) -> Result<usize, BoxError> {
    let outbox = Alias::new("outbox");
    let (id, sent_at) = (Alias::new("id"), Alias::new("sent_at"));
    let mut published = 0;
    loop {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
        // What a broker needs of each row, and nothing a relay keeps for itself (attempts,
        // lease, times).
        let select = batch_read(&[]);
        let claimed = txn.query_all(&select).await?;
        if claimed.is_empty() {
            txn.commit().await?;
            break;
        }
        let mut ids = Vec::with_capacity(claimed.len());
        for row in &claimed {
            Instant0.publish(&message(row, 1)?).await?;
            ids.push(row.try_get_by_index::<i64>(0)?);
        }
        let mark = Query::update()
            .table(outbox.clone())
            .value(sent_at.clone(), Expr::current_timestamp())
            .and_where(Expr::col(id.clone()).is_in(ids.iter().copied()))
            .to_owned();
        txn.execute(&mark).await?;
        txn.commit().await?;
        published += ids.len();
    }
    Ok(published)
}

/// How the hand-written leasing loop writes a batch's sent mark.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MarkWay {
    /// One UPDATE on its own after the publish: a transaction (autocommit) of its own.
    Alone,
    /// Held back and written first in the transaction that leases the next batch, as the
    /// relay's drain does: one commit per batch instead of two.
    WithNextLease,
}

impl MarkWay {
    const ALL: [MarkWay; 2] = [MarkWay::Alone, MarkWay::WithNextLease];

    fn name(self) -> &'static str {
        match self {
            MarkWay::Alone => "leasing loop, mark alone",
            MarkWay::WithNextLease => "leasing loop, mark with next lease",
        }
    }
}

/// How long the leasing loop's lease lasts: longer than a batch's publishing takes.
const HAND_LEASE: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

/// A time bound as the outbox's columns hold it: MySQL's DATETIME takes no zone.
fn at(backend: DbBackend, time: chrono::DateTime<chrono::Utc>) -> sea_orm::Value {
    match backend {
        DbBackend::MySql => time.naive_utc().into(),
        _ => time.into(),
    }
}

/// The loop a careful team writes by hand to keep what the relay's lease buys, in bare
/// SQL: per batch, a short transaction that locks the due rows (`FOR UPDATE SKIP LOCKED`;
/// SQLite's IMMEDIATE transaction is the lock), leases them (attempts + 1, lease end, a
/// fresh token) and commits; the publish outside any transaction, so an attempt counts
/// even when the process dies during it and no transaction stays open across the broker;
/// then the sent mark, fenced by the token, written as `mark` says. A row is due when it
/// is unsent, not dead, available and not leased (or its lease ended), as for the relay;
/// no per-key order (no row of the benchmark has a key), no first-publish time, no
/// failure bookkeeping (every publish succeeds). It stops after a batch shorter than
/// [`BATCH`], as the relay's drain does. Returns rows per second.
async fn leasing_run(db: &DatabaseConnection, rows: usize, mark: MarkWay) -> Result<f64, BoxError> {
    fill(db, rows).await?;
    let started = Instant::now();
    let published = leasing_drain(db, mark).await?;
    let took = started.elapsed().as_secs_f64();
    if published != rows {
        return Err(format!("the {} published {published} of {rows}", mark.name()).into());
    }
    Ok(rows as f64 / took)
}

/// The leasing loop's drain (see [`leasing_run`]); returns the rows published.
async fn leasing_drain(db: &DatabaseConnection, mark: MarkWay) -> Result<usize, BoxError> {
    let backend = db.get_database_backend();
    let outbox = Alias::new("outbox");
    let [
        id,
        sent_at,
        dead_at,
        available_at,
        leased_until,
        lease_token,
        attempts,
    ] = [
        "id",
        "sent_at",
        "dead_at",
        "available_at",
        "leased_until",
        "lease_token",
        "attempts",
    ]
    .map(Alias::new);
    // The sent mark of the rows `ids` leased to `token`: a row whose lease ended and
    // passed to another relay keeps that relay's token and is not touched.
    let mark_sent = |token: uuid::Uuid, ids: &[i64]| {
        Query::update()
            .table(outbox.clone())
            .value(sent_at.clone(), Expr::current_timestamp())
            .value(leased_until.clone(), Option::<chrono::NaiveDateTime>::None)
            .and_where(Expr::col(lease_token.clone()).eq(token))
            .and_where(Expr::col(id.clone()).is_in(ids.iter().copied()))
            .to_owned()
    };
    let mut published = 0;
    // With `MarkWay::WithNextLease`, the marks the next lease's transaction writes first.
    let mut unmarked: Option<(uuid::Uuid, Vec<i64>)> = None;
    loop {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
        if let Some((token, ids)) = unmarked.take() {
            let marked = txn.execute(&mark_sent(token, &ids)).await?.rows_affected();
            if marked != ids.len() as u64 {
                return Err(format!("the sent mark took {marked} of {} rows", ids.len()).into());
            }
        }
        let now = chrono::Utc::now();
        // Due: also not dead, available, and not leased or its lease ended.
        let select = batch_read(std::slice::from_ref(&attempts))
            .and_where(Expr::col(dead_at.clone()).is_null())
            .and_where(Expr::col(available_at.clone()).lte(at(backend, now)))
            .and_where(
                Expr::col(leased_until.clone())
                    .is_null()
                    .or(Expr::col(leased_until.clone()).lte(at(backend, now))),
            )
            .to_owned();
        let claimed = txn.query_all(&select).await?;
        let ids = claimed
            .iter()
            .map(|row| row.try_get_by_index::<i64>(0))
            .collect::<Result<Vec<_>, _>>()?;
        let token = uuid::Uuid::new_v4();
        if !ids.is_empty() {
            let lease = Query::update()
                .table(outbox.clone())
                .value(attempts.clone(), Expr::col(attempts.clone()).add(1))
                .value(leased_until.clone(), at(backend, now + HAND_LEASE))
                .value(lease_token.clone(), token)
                .and_where(Expr::col(id.clone()).is_in(ids.iter().copied()))
                .to_owned();
            txn.execute(&lease).await?;
        }
        txn.commit().await?;
        for row in &claimed {
            // As leased: the attempt this publish is.
            let attempt = row.try_get_by_index::<i32>(5)?.saturating_add(1);
            Instant0
                .publish(&message(row, attempt.try_into()?)?)
                .await?;
        }
        published += ids.len();
        let full = ids.len() >= BATCH as usize;
        if ids.is_empty() {
            break;
        }
        if mark == MarkWay::WithNextLease && full {
            unmarked = Some((token, ids));
            continue;
        }
        let marked = db.execute(&mark_sent(token, &ids)).await?.rows_affected();
        if marked != ids.len() as u64 {
            return Err(format!("the sent mark took {marked} of {} rows", ids.len()).into());
        }
        if !full {
            break;
        }
    }
    Ok(published)
}

/// Statements sent through a connection, by their first word, as sea-orm's metric
/// callback sees them: every statement but BEGIN, COMMIT and those sent unprepared.
type Sent = std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>;

/// One way of draining the outbox, for `--counts`.
#[derive(Clone, Copy)]
enum Drain {
    Relay,
    Hand,
    Leasing(MarkWay),
}

impl Drain {
    fn name(self) -> &'static str {
        match self {
            Drain::Relay => "relay (drain)",
            Drain::Hand => "hand-written loop",
            Drain::Leasing(mark) => mark.name(),
        }
    }
}

/// The server's counters of what a drain did, on the counting connection: PostgreSQL's
/// transactions committed and rows updated in the benchmark's database, MariaDB's
/// session counters, SQLite's commits (a commit hook) and rows changed on the connection.
/// MariaDB's `Com_commit` counts COMMIT statements: a write in autocommit (the leasing
/// loop's mark alone, the relay's first claim) commits without one, and its statements
/// are in `Questions`.
async fn server_counters(
    db: &DatabaseConnection,
    commits: &std::sync::atomic::AtomicU64,
) -> Result<Vec<(&'static str, f64)>, BoxError> {
    let number = |row: &sea_orm::QueryResult, at: usize| row.try_get_by_index::<i64>(at);
    Ok(match db.get_database_backend() {
        DbBackend::Postgres => {
            // The backend's statistics reach the view when it goes idle, forced here.
            db.execute_unprepared("SELECT pg_stat_force_next_flush()")
                .await?;
            let row = db
                .query_one_raw(sea_orm::Statement::from_string(
                    DbBackend::Postgres,
                    "SELECT xact_commit, tup_updated FROM pg_stat_database \
                     WHERE datname = current_database()",
                ))
                .await?
                .ok_or("pg_stat_database has no row for the benchmark's database")?;
            vec![
                ("xact_commit", number(&row, 0)? as f64),
                ("tup_updated", number(&row, 1)? as f64),
            ]
        }
        DbBackend::MySql => {
            let names = [
                "Questions",
                "Com_begin",
                "Com_commit",
                "Com_set_option",
                "Handler_update",
                "Handler_read_key",
                "Handler_read_next",
            ];
            let rows = db
                .query_all_raw(sea_orm::Statement::from_string(
                    DbBackend::MySql,
                    format!(
                        "SHOW SESSION STATUS WHERE Variable_name IN ('{}')",
                        names.join("', '")
                    ),
                ))
                .await?;
            let mut values = Vec::with_capacity(names.len());
            for name in names {
                let value = rows
                    .iter()
                    .find(|row| {
                        row.try_get_by_index::<String>(0)
                            .is_ok_and(|got| got == name)
                    })
                    .ok_or(format!("no session counter {name}"))?
                    .try_get_by_index::<String>(1)?
                    .parse::<f64>()?;
                values.push((name, value));
            }
            values
        }
        _ => {
            let row = db
                .query_one_raw(sea_orm::Statement::from_string(
                    DbBackend::Sqlite,
                    "SELECT total_changes()",
                ))
                .await?
                .ok_or("SELECT total_changes() returned no row")?;
            vec![
                (
                    "commits",
                    commits.load(std::sync::atomic::Ordering::Relaxed) as f64,
                ),
                ("total_changes", number(&row, 0)? as f64),
            ]
        }
    })
}

/// `--counts`: what one drain of `rows` rows does each way, per batch of [`BATCH`], from
/// counters that do not vary from run to run: the statements the client sent (sea-orm's
/// metric callback) and the server's own counts of commits and row writes, on a pool of
/// one connection, less what reading the counters adds. Returns the table's rows.
async fn count_drains(
    target: &Target,
    relay: &Relay<Instant0>,
    rows: usize,
) -> Result<Vec<String>, BoxError> {
    let mut options = ConnectOptions::new(target.url.clone());
    options.max_connections(1).sqlx_logging(false);
    let mut db = Database::connect(options).await?;
    let sent: Sent = Sent::default();
    let into = sent.clone();
    db.set_metric_callback(move |info| {
        let word = info
            .statement
            .sql
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_uppercase();
        if let Ok(mut sent) = into.lock() {
            *sent.entry(word).or_default() += 1;
        }
    });
    let commits = if db.get_database_backend() == DbBackend::Sqlite {
        db.execute_unprepared("PRAGMA busy_timeout = 30000").await?;
        outbox_instructions::count_commits(&db).await?
    } else {
        std::sync::Arc::default()
    };
    let batches = rows.div_ceil(BATCH as usize) as f64;
    let mut table = Vec::new();
    for drain in [
        Drain::Relay,
        Drain::Hand,
        Drain::Leasing(MarkWay::Alone),
        Drain::Leasing(MarkWay::WithNextLease),
    ] {
        let mut counted = (Vec::new(), Vec::new());
        // The first drain prepares the statements; the second is counted.
        for _ in 0..2 {
            fill(&db, rows).await?;
            let first = server_counters(&db, &commits).await?;
            let second = server_counters(&db, &commits).await?;
            let sent_before = sent
                .lock()
                .map_err(|_| "the statement count panicked")?
                .clone();
            let published = match drain {
                Drain::Relay => usize::try_from(relay.drain(&db).await?.published)?,
                Drain::Hand => hand_written_drain(&db).await?,
                Drain::Leasing(mark) => leasing_drain(&db, mark).await?,
            };
            if published != rows {
                return Err(format!("{} published {published} of {rows}", drain.name()).into());
            }
            let sent_after = sent
                .lock()
                .map_err(|_| "the statement count panicked")?
                .clone();
            let third = server_counters(&db, &commits).await?;
            // Less what one reading of the counters adds (second - first).
            let server: Vec<_> = first
                .iter()
                .zip(&second)
                .zip(&third)
                .map(|(((name, a), (_, b)), (_, c))| (*name, (c - b - (b - a)) / batches))
                .collect();
            let client: Vec<_> = sent_after
                .iter()
                .map(|(word, after)| {
                    let before = sent_before.get(word).copied().unwrap_or(0);
                    (word.clone(), after.saturating_sub(before) as f64 / batches)
                })
                .filter(|(_, per_batch)| *per_batch > 0.0)
                .collect();
            counted = (client, server);
        }
        let (client, server) = counted;
        let list = |items: Vec<String>| items.join(", ");
        table.push(format!(
            "| {} | {} | {} | {} |",
            target.name,
            drain.name(),
            list(
                client
                    .iter()
                    .map(|(word, n)| format!("{word} {n:.2}"))
                    .collect()
            ),
            list(
                server
                    .iter()
                    .map(|(name, n)| format!("{name} {n:.2}"))
                    .collect()
            ),
        ));
    }
    db.close().await?;
    Ok(table)
}

/// The message a hand-written loop hands to the broker from a row it read: id,
/// message_id, destination, payload, headers, in that order.
fn message(row: &sea_orm::QueryResult, attempt: u32) -> Result<OutboxMessage, BoxError> {
    Ok(OutboxMessage {
        message_id: row.try_get_by_index::<uuid::Uuid>(1)?.into(),
        destination: row.try_get_by_index(2)?,
        key: None,
        payload: row.try_get_by_index(3)?,
        headers: headers(&row.try_get_by_index::<String>(4)?)?,
        created_at: chrono::DateTime::UNIX_EPOCH,
        first_published_at: chrono::DateTime::UNIX_EPOCH,
        attempt,
    })
}

/// The headers column's JSON object of strings, as a hand-written loop hands them to the
/// broker.
fn headers(column: &str) -> Result<std::collections::BTreeMap<String, String>, BoxError> {
    Ok(serde_json::from_str(column)?)
}

/// The writers' table and, with `--latency`, the latency table; obix's rows too when its
/// child runs.
async fn writers_and_latency(
    db: &DatabaseConnection,
    target: &Target,
    args: &Args,
    obix: Option<&outbox_obix::Obix>,
) -> Result<(), BoxError> {
    if args.enqueue_seconds > 0.0 {
        use outbox_enqueue::{Mode, UpdateEnqueue, UpdateHandInsert, UpdateOnly};
        use std::sync::Arc;
        outbox_enqueue::create_business_table(db).await?;
        let mut modes = vec![
            Mode::Local(Arc::new(UpdateOnly(db.clone()))),
            Mode::Local(Arc::new(UpdateEnqueue(db.clone()))),
            Mode::Local(Arc::new(UpdateHandInsert(db.clone()))),
        ];
        if let Some(obix) = obix {
            modes.push(Mode::External(obix));
        }
        outbox_enqueue::report(target.name, &modes, args.rounds, args.enqueue_seconds).await?;
        db.execute_unprepared("DELETE FROM outbox").await?;
    }
    if args.latency {
        outbox_latency::report(db, target.name, &target.url, args.rounds).await?;
        if let Some(obix) = obix {
            outbox_obix::latency_report(obix, args.rounds).await?;
        }
    }
    Ok(())
}

/// The target's row of the main table, its writers' and latency tables; returns the rows
/// of the `--counts` table.
async fn bench(target: &Target, args: &Args) -> Result<Vec<String>, BoxError> {
    let db = target.connect().await?;
    MigratorWithOutbox::up(&db, None).await?;
    db.execute_unprepared(
        "CREATE TABLE bench_account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
    )
    .await?;
    db.execute_unprepared("INSERT INTO bench_account (id, balance) VALUES (1, 0)")
        .await?;
    let inbox = Inbox::new("bench.credit")?;
    let relay = Relay::new(Instant0).with_options(RelayOptions {
        batch_size: BATCH,
        poll_interval: Duration::from_millis(10),
        ..RelayOptions::default()
    })?;
    // Warm-up: connections, prepared statements, the tables' first pages.
    process_run(&db, &inbox, 20, true).await?;
    relay_run(&db, &relay, 50).await?;
    hand_written_run(&db, 50).await?;

    for mark in MarkWay::ALL {
        leasing_run(&db, 50, mark).await?;
    }

    let (mut process, mut enqueue, mut enqueue_ratio) = (Vec::new(), Vec::new(), Vec::new());
    let (mut relayed, mut hand, mut relay_ratio) = (Vec::new(), Vec::new(), Vec::new());
    // Per way of marking: the leasing loop's rows/s and the relay's ratio to it.
    let mut leasing: [(Vec<f64>, Vec<f64>); 2] = Default::default();
    for round in 0..args.rounds {
        let (plain, with_enqueue) = if round % 2 == 0 {
            let plain = process_run(&db, &inbox, args.messages, false).await?;
            (plain, process_run(&db, &inbox, args.messages, true).await?)
        } else {
            let with_enqueue = process_run(&db, &inbox, args.messages, true).await?;
            (
                process_run(&db, &inbox, args.messages, false).await?,
                with_enqueue,
            )
        };
        let relay_rows = args.messages * 5;
        // The four drains in alternating order: the relay and the hand-written loop as
        // before, the leasing loops after them in even rounds and before them in odd ones.
        let mut by_leasing = [0.0; 2];
        if round % 2 == 1 {
            for (way, mark) in MarkWay::ALL.into_iter().enumerate().rev() {
                by_leasing[way] = leasing_run(&db, relay_rows, mark).await?;
            }
        }
        let (by_relay, by_hand) = if round % 2 == 0 {
            let by_relay = relay_run(&db, &relay, relay_rows).await?;
            (by_relay, hand_written_run(&db, relay_rows).await?)
        } else {
            let by_hand = hand_written_run(&db, relay_rows).await?;
            (relay_run(&db, &relay, relay_rows).await?, by_hand)
        };
        if round % 2 == 0 {
            for (way, mark) in MarkWay::ALL.into_iter().enumerate() {
                by_leasing[way] = leasing_run(&db, relay_rows, mark).await?;
            }
        }
        process.push(plain);
        enqueue.push(with_enqueue);
        enqueue_ratio.push(with_enqueue / plain);
        relayed.push(by_relay);
        hand.push(by_hand);
        relay_ratio.push(by_relay / by_hand);
        for ((rates, ratios), by) in leasing.iter_mut().zip(by_leasing) {
            rates.push(by);
            ratios.push(by_relay / by);
        }
    }
    let [(alone, alone_ratio), (with_next, with_next_ratio)] = leasing;
    println!(
        "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2} |",
        target.name,
        median(process),
        median(enqueue),
        median(enqueue_ratio),
        median(relayed),
        median(hand),
        median(relay_ratio),
        median(alone),
        median(alone_ratio),
        median(with_next),
        median(with_next_ratio),
    );
    let counted = if args.counts {
        count_drains(target, &relay, args.messages * 5).await?
    } else {
        Vec::new()
    };
    // obix on the same database, in its child (PostgreSQL only, all it supports).
    let obix = match (&args.obix, target.name) {
        (Some(program), "postgres") if args.enqueue_seconds > 0.0 || args.latency => {
            Some(outbox_obix::Obix::start(program, &target.url).await?)
        }
        _ => None,
    };
    let measured = writers_and_latency(&db, target, args, obix.as_ref()).await;
    // Stopped whether the tables failed or not: its connections would keep the benchmark
    // from dropping its database.
    let stopped = match obix {
        Some(obix) => obix.close().await,
        None => Ok(()),
    };
    measured?;
    stopped?;
    db.close().await?;
    Ok(counted)
}

/// `--kafka`: the Kafka consumer's table alone, on the server targets given (SQLite too
/// when none is).
async fn kafka_table(bootstrap: &str, args: &Args) -> Result<(), BoxError> {
    println!(
        "{} rounds of {} records per mode; medians\n",
        args.rounds, args.messages
    );
    let mut rows = Vec::new();
    let mut targets = Vec::new();
    if let Some(url) = &args.postgres {
        targets.push(Target::server("postgres", url).await?);
    }
    if let Some(url) = &args.mysql {
        targets.push(Target::server("mysql", url).await?);
    }
    if targets.is_empty() {
        targets.push(Target::sqlite()?);
    }
    for target in targets {
        #[cfg(feature = "kafka")]
        let result = outbox_kafka::bench(&target, bootstrap, args.rounds, args.messages).await;
        #[cfg(not(feature = "kafka"))]
        let result: Result<String, BoxError> = Err(format!(
            "--kafka {bootstrap} needs the Kafka consumer compiled in: build with --features kafka"
        )
        .into());
        target.drop_database().await?;
        rows.push(result?);
    }
    println!(
        "\n| backend | records | KafkaGroupConsumer, 1 record a transaction, records/s | KafkaGroupConsumer batched (default) records/s | hand-written consumer records/s | 1-record loop / hand | batched loop / hand |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for row in rows {
        println!("{row}");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // The cross-process latency mode re-executes this binary as its relay.
    let mut raw = std::env::args().skip(1);
    if raw.next().as_deref() == Some(outbox_latency::CHILD_FLAG) {
        let url = raw.next().ok_or("the relay child needs a URL")?;
        return outbox_latency::child(&url).await;
    }
    let mut raw = std::env::args().skip(1);
    match (raw.next().as_deref(), raw.next()) {
        (Some("--count-only"), Some(run)) => return outbox_instructions::count_only(&run).await,
        (Some("--instructions"), Some(rows)) => return outbox_instructions::measure(rows.parse()?),
        _ => {}
    }
    let args = args()?;
    if let Some(bootstrap) = &args.kafka {
        return kafka_table(bootstrap, &args).await;
    }
    println!(
        "{} rounds; {} messages per process mode, {} rows per relay mode; medians\n",
        args.rounds,
        args.messages,
        args.messages * 5
    );
    println!(
        "| backend | process msg/s | process + enqueue msg/s | ratio | relay rows/s | hand-written loop rows/s | ratio | leasing loop, mark alone rows/s | relay / it | leasing loop, mark with next lease rows/s | relay / it |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut targets = vec![Target::sqlite()?];
    if let Some(url) = &args.postgres {
        targets.push(Target::server("postgres", url).await?);
    }
    if let Some(url) = &args.mysql {
        targets.push(Target::server("mysql", url).await?);
    }
    let mut counted = Vec::new();
    for target in targets {
        let result = bench(&target, &args).await;
        target.drop_database().await?;
        counted.extend(result?);
    }
    if args.counts {
        println!(
            "\nPer batch of {BATCH} in one drain of {} rows, on a pool of one connection:\n",
            args.messages * 5
        );
        println!(
            "| backend | drain | statements sent (sea-orm; not BEGIN, COMMIT, unprepared) | server counters |"
        );
        println!("| --- | --- | --- | --- |");
        for row in counted {
            println!("{row}");
        }
    }
    Ok(())
}
