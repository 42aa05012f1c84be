//! Runs a mode on N workers at once and checks, when they stop, that the database holds
//! exactly the effects the workers reported.

use crate::BoxError;
use crate::db::{Sql, scalar};
use crate::modes::{Deliveries, Done, Mode, Worker};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, Value};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What N workers did in one run of one mode.
#[derive(Debug, Default)]
pub struct Tally {
    pub txns: u64,
    pub done: Done,
    /// Latency of each transaction, BEGIN to COMMIT/ROLLBACK, in microseconds.
    pub latencies_us: Vec<u32>,
    pub elapsed: Duration,
}

impl Tally {
    /// Messages per second over the run.
    pub fn rate(&self) -> f64 {
        self.done.messages as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    fn add(&mut self, worker: WorkerTally) {
        self.txns += worker.txns;
        self.done.messages += worker.done.messages;
        self.done.claimed += worker.done.claimed;
        self.done.credited += worker.done.credited;
        self.done.duplicates += worker.done.duplicates;
        self.latencies_us.extend(worker.latencies_us);
    }
}

#[derive(Default)]
struct WorkerTally {
    txns: u64,
    done: Done,
    latencies_us: Vec<u32>,
}

/// A flag the workers poll between transactions.
#[derive(Clone, Default)]
pub struct Stop(Arc<AtomicBool>);

impl Stop {
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Sets the flag once `after` has passed.
    pub fn after(after: Duration) -> Self {
        let stop = Stop::default();
        let timer = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            timer.set();
        });
        stop
    }
}

/// Runs `mode` on the first `concurrency` workers until `stop` is set, then checks the
/// effects against `check` (the state taken just before).
pub async fn run_mode(
    workers: &[Arc<Worker>],
    mode: Mode,
    deliveries: Deliveries,
    concurrency: usize,
    stop: Stop,
) -> Result<Tally, BoxError> {
    let workers = workers
        .get(..concurrency)
        .ok_or_else(|| format!("{concurrency} workers asked, {} opened", workers.len()))?;
    if let Some(first) = workers.first() {
        first.mixer.reset(workers)?;
    }
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in workers {
        let (worker, stop) = (Arc::clone(worker), stop.clone());
        tasks.spawn(async move { work(&worker, mode, deliveries, &stop).await });
    }
    let mut tally = Tally::default();
    while let Some(joined) = tasks.join_next().await {
        tally.add(joined??);
    }
    tally.elapsed = start.elapsed();
    Ok(tally)
}

async fn work(
    worker: &Worker,
    mode: Mode,
    deliveries: Deliveries,
    stop: &Stop,
) -> Result<WorkerTally, BoxError> {
    let mut tally = WorkerTally::default();
    while !stop.is_set() {
        let start = Instant::now();
        let done = worker
            .run(mode, deliveries)
            .await
            .map_err(|e| format!("{} on account {}: {e}", mode.name(), worker.account))?;
        let micros = start.elapsed().as_micros();
        tally
            .latencies_us
            .push(u32::try_from(micros).unwrap_or(u32::MAX));
        tally.txns += 1;
        tally.done.messages += done.messages;
        tally.done.claimed += done.claimed;
        tally.done.credited += done.credited;
        tally.done.duplicates += done.duplicates;
    }
    Ok(tally)
}

/// The database state a run's effects are checked against.
#[derive(Clone, Copy, Debug)]
pub struct Snapshot {
    balance: i64,
    max_inbox_id: i64,
}

impl Snapshot {
    pub async fn take(conn: &DatabaseConnection) -> Result<Self, BoxError> {
        Ok(Self {
            balance: total_balance(conn).await?,
            max_inbox_id: scalar(conn, "SELECT COALESCE(MAX(id), 0) FROM inbox", vec![]).await?,
        })
    }

    /// Fails loudly unless the credits applied since this snapshot equal the messages
    /// the workers claimed, the new inbox rows are exactly those messages, each once, and
    /// the effects equal the distinct messages (one credit each).
    pub async fn verify(
        &self,
        conn: &DatabaseConnection,
        sql: &Sql,
        label: &str,
        done: &Done,
    ) -> Result<(), BoxError> {
        let credited = total_balance(conn).await? - self.balance;
        let statement = Statement::from_sql_and_values(
            conn.get_database_backend(),
            sql.rows_since,
            [Value::from(self.max_inbox_id)],
        );
        let row = conn
            .query_one_raw(statement)
            .await?
            .ok_or("no row from the inbox count")?;
        let (rows, distinct): (i64, i64) = (row.try_get_by_index(0)?, row.try_get_by_index(1)?);
        let claimed = i64::try_from(done.claimed)?;
        // `base` credits without claiming: only the claiming modes owe one credit a message.
        let claims = done.claimed > 0 || done.duplicates > 0;
        if credited != done.credited
            || rows != claimed
            || distinct != rows
            || (claims && credited != rows)
        {
            return Err(format!(
                "CORRECTNESS FAILURE in {label}: workers claimed {claimed} and credited {}, \
                 the database holds {credited} credits and {rows} new inbox rows \
                 ({distinct} distinct ids)",
                done.credited
            )
            .into());
        }
        Ok(())
    }
}

async fn total_balance(conn: &DatabaseConnection) -> Result<i64, BoxError> {
    // Summed here, not in SQL: SUM(bigint) is numeric on Postgres and decimal on MySQL.
    let rows = conn
        .query_all_raw(Statement::from_string(
            conn.get_database_backend(),
            "SELECT balance FROM bench_account",
        ))
        .await?;
    rows.iter()
        .map(|row| row.try_get_by_index::<i64>(0).map_err(BoxError::from))
        .sum()
}

/// `items` in a fresh random order. Rotating a fixed order would keep every mode behind
/// the same predecessor (and its WAL, checkpoint or vacuum debt) in every round.
pub fn shuffled<T: Clone>(items: &[T]) -> Vec<T> {
    let mut out = items.to_vec();
    for i in (1..out.len()).rev() {
        // A v4 UUID is 122 random bits: plenty for one index, and no extra crate.
        let j = (uuid::Uuid::new_v4().as_u128() % (i as u128 + 1)) as usize;
        out.swap(i, j);
    }
    out
}
