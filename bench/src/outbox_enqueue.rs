//! What an enqueue costs a business transaction, in the shape a team measures it: writers
//! that each commit transactions of one business `UPDATE` (of their own row), alone and
//! with one outgoing message, at 1 and 8 writers. Each mode runs for the same time in every
//! round, in rotating order, and is reported as a median of same-round ratios over the
//! `UPDATE` alone. Another outbox that the workspace does not build (obix, on sqlx 0.8) has
//! its writers in a child process that times the same loop and reports the rate
//! ([`Mode::External`]).

use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{OutboxExt, OutgoingMessage};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One committed transaction of a writer.
pub type Step<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// One way for a writer to commit its business change.
pub trait WriterMode: Send + Sync {
    /// The mode's row label in the table.
    fn name(&self) -> &str;

    /// Commits the `n`th transaction of writer `writer` (0-based): one `UPDATE` of
    /// `bench_writer` row `writer`, and whatever the mode adds.
    fn transaction(&self, writer: usize, n: u64) -> Step<'_>;
}

/// A mode whose writers run in another process, which runs [`rate`]'s loop there when
/// asked: obix's (see `outbox_obix`), on a sqlx the workspace does not build.
pub trait ExternalWriters: Send + Sync {
    /// The mode's row label in the table.
    fn name(&self) -> &str;

    /// Runs `writers` writers for `seconds` there; returns their committed transactions per
    /// second, timed there around the writers' loop only.
    fn rate(&self, writers: usize, seconds: f64) -> RateStep<'_>;
}

/// A rate measured by [`ExternalWriters::rate`].
pub type RateStep<'a> = Pin<Box<dyn Future<Output = Result<f64, BoxError>> + Send + 'a>>;

/// A row of the writers' table: writers in this process, or in another.
pub enum Mode<'a> {
    /// Writers here, each committing the mode's transactions ([`rate`]).
    Local(Arc<dyn WriterMode>),
    /// Writers in another process, which reports their rate.
    External(&'a dyn ExternalWriters),
}

impl Mode<'_> {
    fn name(&self) -> &str {
        match self {
            Mode::Local(mode) => mode.name(),
            Mode::External(mode) => mode.name(),
        }
    }

    /// Committed transactions per second of `writers` writers over `seconds`.
    async fn rate(&self, writers: usize, seconds: f64) -> Result<f64, BoxError> {
        match self {
            Mode::Local(mode) => rate(mode, writers, seconds).await,
            Mode::External(mode) => mode.rate(writers, seconds).await,
        }
    }
}

/// The writer counts of the table.
pub const WRITERS: [usize; 2] = [1, 8];

/// The business table: one row per writer, so writers do not wait for each other's row
/// locks (different aggregates), only for the database.
pub async fn create_business_table(db: &DatabaseConnection) -> Result<(), BoxError> {
    db.execute_unprepared(
        "CREATE TABLE bench_writer (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
    )
    .await?;
    let max = WRITERS.iter().copied().max().unwrap_or(1);
    let mut insert = Query::insert()
        .into_table(Alias::new("bench_writer"))
        .columns([Alias::new("id"), Alias::new("balance")])
        .to_owned();
    for id in 0..max {
        insert.values([Expr::val(id as i64), Expr::val(0i64)])?;
    }
    db.execute(&insert).await?;
    Ok(())
}

fn business_update(writer: usize) -> sea_orm::sea_query::UpdateStatement {
    Query::update()
        .table(Alias::new("bench_writer"))
        .value(
            Alias::new("balance"),
            Expr::col(Alias::new("balance")).add(1),
        )
        .and_where(Expr::col(Alias::new("id")).eq(writer as i64))
        .to_owned()
}

/// `BEGIN; UPDATE; COMMIT`: the baseline.
pub struct UpdateOnly(pub DatabaseConnection);

impl WriterMode for UpdateOnly {
    fn name(&self) -> &str {
        "UPDATE alone"
    }

    fn transaction(&self, writer: usize, _n: u64) -> Step<'_> {
        Box::pin(async move {
            let txn = self.0.begin().await?;
            txn.execute(&business_update(writer)).await?;
            txn.commit().await?;
            Ok(())
        })
    }
}

/// The `UPDATE` and one `txn.enqueue` in the same transaction.
pub struct UpdateEnqueue(pub DatabaseConnection);

impl WriterMode for UpdateEnqueue {
    fn name(&self) -> &str {
        "UPDATE + enqueue (this crate)"
    }

    fn transaction(&self, writer: usize, n: u64) -> Step<'_> {
        Box::pin(async move {
            let txn = self.0.begin().await?;
            txn.execute(&business_update(writer)).await?;
            txn.enqueue(
                OutgoingMessage::new("bench.credited", format!("credited {writer}.{n}"))
                    .key(format!("account-{writer}")),
            )
            .await?;
            txn.commit().await?;
            Ok(())
        })
    }
}

/// The `UPDATE` and a plain hand-written `INSERT` into the same `outbox` table (no
/// conflict clause, no validation): the floor of an outbox row.
pub struct UpdateHandInsert(pub DatabaseConnection);

impl WriterMode for UpdateHandInsert {
    fn name(&self) -> &str {
        "UPDATE + hand-written INSERT"
    }

    fn transaction(&self, writer: usize, n: u64) -> Step<'_> {
        Box::pin(async move {
            let now = chrono::Utc::now();
            let mut insert = Query::insert()
                .into_table(Alias::new("outbox"))
                .columns(
                    [
                        "message_id",
                        "destination",
                        "partition_key",
                        "payload",
                        "headers",
                        "created_at",
                        "available_at",
                    ]
                    .map(Alias::new),
                )
                .to_owned();
            insert.values([
                Expr::val(uuid::Uuid::new_v4()),
                Expr::val("bench.credited"),
                Expr::val(format!("account-{writer}")),
                Expr::val(format!("credited {writer}.{n}").into_bytes()),
                Expr::val("{}"),
                Expr::val(now),
                Expr::val(now),
            ])?;
            let txn = self.0.begin().await?;
            txn.execute(&business_update(writer)).await?;
            txn.execute(&insert).await?;
            txn.commit().await?;
            Ok(())
        })
    }
}

/// Runs `writers` writers of `mode` for `seconds`; returns committed transactions per
/// second.
async fn rate(mode: &Arc<dyn WriterMode>, writers: usize, seconds: f64) -> Result<f64, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for writer in 0..writers {
        let (mode, stop, committed) = (Arc::clone(mode), Arc::clone(&stop), Arc::clone(&committed));
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                mode.transaction(writer, n).await?;
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

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Measures `modes` (the first is the baseline) at each of [`WRITERS`] over `rounds`, and
/// prints one table row per writer count and mode: median rate and median same-round
/// ratio over the baseline.
pub async fn report(
    backend: &str,
    modes: &[Mode<'_>],
    rounds: usize,
    seconds: f64,
) -> Result<(), BoxError> {
    println!();
    println!(
        "| {backend}: one business UPDATE per transaction | writers | tx/s | / UPDATE alone |"
    );
    println!("| --- | ---: | ---: | ---: |");
    for writers in WRITERS {
        let mut rates: Vec<Vec<f64>> = modes.iter().map(|_| Vec::new()).collect();
        let mut ratios: Vec<Vec<f64>> = modes.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            let mut this_round = vec![0.0; modes.len()];
            for k in 0..modes.len() {
                let index = (round + k) % modes.len();
                this_round[index] = modes[index].rate(writers, seconds).await?;
            }
            for (index, value) in this_round.iter().enumerate() {
                rates[index].push(*value);
                ratios[index].push(value / this_round[0]);
            }
        }
        for ((mode, rates), ratios) in modes.iter().zip(rates).zip(ratios) {
            println!(
                "| {} | {writers} | {:.0} | {:.2} |",
                mode.name(),
                median(rates),
                median(ratios)
            );
        }
    }
    Ok(())
}
