//! The outbox benchmark: what an enqueue adds to `Inbox::process`, and the relay's
//! throughput next to the hand-written loop it replaces, each as a ratio against its
//! baseline measured in the same rounds (interleaved, in alternating order).
//!
//! ```text
//! cargo run --release -p inbox-bench --bin outbox-bench                     # SQLite
//! cargo run --release -p inbox-bench --bin outbox-bench -- \
//!     --postgres postgres://postgres@127.0.0.1:5432/test \
//!     --mysql mysql://root@127.0.0.1:3306/test --rounds 5 --messages 400
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

use sea_orm::sea_query::{Alias, Expr, ExprTrait, LockBehavior, LockType, Order, Query};
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
    let outbox = Alias::new("outbox");
    let (id, sent_at) = (Alias::new("id"), Alias::new("sent_at"));
    let started = Instant::now();
    let mut published = 0;
    loop {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
        // What a broker needs of each row, and nothing a relay keeps for itself (attempts,
        // lease, times).
        let select = Query::select()
            .columns([
                id.clone(),
                Alias::new("message_id"),
                Alias::new("destination"),
                Alias::new("payload"),
                Alias::new("headers"),
            ])
            .from(outbox.clone())
            .and_where(Expr::col(sent_at.clone()).is_null())
            .order_by(id.clone(), Order::Asc)
            .limit(u64::from(BATCH))
            .lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
            .to_owned();
        let claimed = txn.query_all(&select).await?;
        if claimed.is_empty() {
            txn.commit().await?;
            break;
        }
        let mut ids = Vec::with_capacity(claimed.len());
        for row in &claimed {
            let message = OutboxMessage {
                message_id: row.try_get_by_index::<uuid::Uuid>(1)?.into(),
                destination: row.try_get_by_index(2)?,
                key: None,
                payload: row.try_get_by_index(3)?,
                headers: headers(&row.try_get_by_index::<String>(4)?)?,
                created_at: chrono::DateTime::UNIX_EPOCH,
                first_published_at: chrono::DateTime::UNIX_EPOCH,
                attempt: 1,
            };
            Instant0.publish(&message).await?;
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
    let took = started.elapsed().as_secs_f64();
    if published != rows {
        return Err(format!("the hand-written loop published {published} of {rows}").into());
    }
    Ok(rows as f64 / took)
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

async fn bench(target: &Target, args: &Args) -> Result<(), BoxError> {
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

    let (mut process, mut enqueue, mut enqueue_ratio) = (Vec::new(), Vec::new(), Vec::new());
    let (mut relayed, mut hand, mut relay_ratio) = (Vec::new(), Vec::new(), Vec::new());
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
        let (by_relay, by_hand) = if round % 2 == 0 {
            let by_relay = relay_run(&db, &relay, relay_rows).await?;
            (by_relay, hand_written_run(&db, relay_rows).await?)
        } else {
            let by_hand = hand_written_run(&db, relay_rows).await?;
            (relay_run(&db, &relay, relay_rows).await?, by_hand)
        };
        process.push(plain);
        enqueue.push(with_enqueue);
        enqueue_ratio.push(with_enqueue / plain);
        relayed.push(by_relay);
        hand.push(by_hand);
        relay_ratio.push(by_relay / by_hand);
    }
    println!(
        "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} |",
        target.name,
        median(process),
        median(enqueue),
        median(enqueue_ratio),
        median(relayed),
        median(hand),
        median(relay_ratio),
    );
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
    Ok(())
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
        "| backend | process msg/s | process + enqueue msg/s | ratio | relay rows/s | hand-written loop rows/s | ratio |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut targets = vec![Target::sqlite()?];
    if let Some(url) = &args.postgres {
        targets.push(Target::server("postgres", url).await?);
    }
    if let Some(url) = &args.mysql {
        targets.push(Target::server("mysql", url).await?);
    }
    for target in targets {
        let result = bench(&target, &args).await;
        target.drop_database().await?;
        result?;
    }
    Ok(())
}
