//! The purge phase: `claim` runs at 8 and 32 workers alone, during the library's purge
//! of one seeded cohort at each pacing setting, and during a hand-written batched DELETE
//! of another, in a random order each round. Each purge must delete exactly its cohort;
//! as many new markers take its place before the next step, so every step purges a table
//! of the same size (otherwise the table shrank by a cohort a step, and the order of a
//! round's shuffle decided more than the purger did).

use crate::Bench;
use crate::BoxError;
use crate::db::{Sql, timestamp};
use crate::growth::{self, Cohorts, REFILL_AGE_DAYS};
use crate::modes::Mode;
use crate::run::{Stop, Tally, run_mode, shuffled};
use chrono::{TimeDelta, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, TransactionTrait, Value};
use sea_orm_inbox::{PurgePacing, RetentionPolicy, purge};
use std::time::{Duration, Instant};

/// What one purge did.
#[derive(Debug, Default)]
pub struct Purged {
    pub rows: u64,
    pub elapsed: Duration,
    /// How long the whole purge took, in microseconds (one sample per purge).
    pub latencies_us: Vec<u32>,
    /// Where the time went, for `--purge-detail`.
    pub detail: String,
}

impl Purged {
    fn rate(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }
}

/// A pacing of the library's purge measured in the purge phase: the default, and the
/// points of the trade-off curve around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// `PurgePacing::default()`: the setting the targets judge.
    Default,
    /// `PurgePacing::UNPACED`: full batches back to back, as before pacing.
    Unpaced,
    /// A 100 ms batch budget, busy 90 % of the time: the servers' faster choice.
    MidBatches,
    /// The default's budget, never resting: what the rest buys the claimers.
    NoRest,
    /// A 250 ms batch budget, busy 90 % of the time.
    LongBatches,
    /// The default's budget, busy 70 % of the time (PostgreSQL only).
    Busy70,
    /// The default's budget, busy 50 % of the time (PostgreSQL only).
    Busy50,
}

impl Setting {
    const ALL: [Setting; 5] = [
        Setting::Default,
        Setting::Unpaced,
        Setting::MidBatches,
        Setting::NoRest,
        Setting::LongBatches,
    ];

    /// Lower busy shares than the default's, measured on PostgreSQL only: whether one
    /// brings the claimers' p99 under a purge within 2x of their p99 alone while the
    /// purge keeps 0.9x the hand DELETE's rate (MariaDB meets both with the default).
    const POSTGRES_ONLY: [Setting; 2] = [Setting::Busy70, Setting::Busy50];

    /// The settings measured on `backend`.
    fn on(backend: DbBackend) -> impl Iterator<Item = Setting> {
        let lower_busy: &[Setting] = match backend {
            DbBackend::Postgres => &Self::POSTGRES_ONLY,
            _ => &[],
        };
        Self::ALL.into_iter().chain(lower_busy.iter().copied())
    }

    fn pacing(self) -> Result<PurgePacing, BoxError> {
        Ok(match self {
            Setting::Default => PurgePacing::default(),
            Setting::Unpaced => PurgePacing::UNPACED,
            Setting::MidBatches => PurgePacing::default()
                .with_batch_budget(Duration::from_millis(100))?
                .with_busy_percent(90)?,
            Setting::NoRest => PurgePacing::default().with_busy_percent(100)?,
            Setting::LongBatches => PurgePacing::default()
                .with_batch_budget(Duration::from_millis(250))?
                .with_busy_percent(90)?,
            Setting::Busy70 => PurgePacing::default().with_busy_percent(70)?,
            Setting::Busy50 => PurgePacing::default().with_busy_percent(50)?,
        })
    }

    /// The purge's row label and the claimers' label.
    fn labels(self) -> (&'static str, &'static str) {
        match self {
            Setting::Default => ("purge rows", "claim + purge"),
            Setting::Unpaced => ("purge rows unpaced", "claim + purge unpaced"),
            Setting::MidBatches => ("purge rows 100ms/90%", "claim + purge 100ms/90%"),
            Setting::NoRest => ("purge rows default/100%", "claim + purge default/100%"),
            Setting::LongBatches => ("purge rows 250ms/90%", "claim + purge 250ms/90%"),
            Setting::Busy70 => ("purge rows default/70%", "claim + purge default/70%"),
            Setting::Busy50 => ("purge rows default/50%", "claim + purge default/50%"),
        }
    }
}

/// A way to purge: the library's at one pacing, or the hand-written DELETE it is
/// compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purger {
    /// `sea_orm_inbox::purge`, the library's batched purge.
    Library(Setting),
    /// The hand-written batched DELETE: the floor.
    HandDelete,
    /// That many hand-written streams at once, each batch locking the oldest rows no other
    /// stream holds (`FOR UPDATE SKIP LOCKED`) and deleting them by primary key, unpaced:
    /// whether a purge that waits on several index pages at a time keeps up where one
    /// statement, waiting on one at a time, does not (PostgreSQL and MariaDB; the cost
    /// curve's `--curve-purger streams:N`).
    Streams(usize),
}

impl Purger {
    /// Every purger of the phase on `backend`.
    pub fn all(backend: DbBackend) -> Vec<Purger> {
        let mut all: Vec<Purger> = Setting::on(backend).map(Purger::Library).collect();
        all.push(Purger::HandDelete);
        all
    }

    /// The purge's row label and the claimers' label.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            Purger::Library(setting) => setting.labels(),
            Purger::HandDelete => ("hand delete rows", "claim + hand delete"),
            Purger::Streams(_) => ("hand delete streams rows", "claim + hand delete streams"),
        }
    }

    /// The flag's value: `library` (the default pacing), `hand`, or `streams:N`.
    pub fn parse(value: &str) -> Result<Self, BoxError> {
        let streams = value
            .strip_prefix("streams:")
            .map(|n| n.parse::<usize>())
            .transpose()?;
        match (value, streams) {
            ("library", _) => Ok(Purger::Library(Setting::Default)),
            ("hand", _) => Ok(Purger::HandDelete),
            (_, Some(n)) if n > 0 => Ok(Purger::Streams(n)),
            _ => {
                Err(format!("--curve-purger takes library, hand or streams:N, not {value}").into())
            }
        }
    }

    /// Connections the purge takes: one, or one per stream.
    pub fn connections(self) -> usize {
        match self {
            Purger::Streams(n) => n,
            _ => 1,
        }
    }

    /// Purges on `conns`: the first, or one stream on each.
    async fn purge(
        self,
        conns: &[DatabaseConnection],
        sql: &Sql,
        cutoff: chrono::DateTime<Utc>,
        batch: u64,
    ) -> Result<Purged, BoxError> {
        let conn = conns.first().ok_or("a purge needs a connection")?;
        match self {
            Purger::Library(setting) => library_purge(conn, cutoff, batch, setting.pacing()?).await,
            Purger::HandDelete => hand_delete(conn, sql, cutoff, batch).await,
            Purger::Streams(_) => streams_delete(conns, cutoff, batch).await,
        }
    }
}

/// The library's purge, with a window that puts its cutoff at `cutoff`: it measures the
/// window back from the newest marker, which the running claimers keep at "now". The
/// seeded cohorts are synthetic history days apart, so every silence between them counts
/// as receiving time (the longest downtime gap): the cutoff then lands exactly between
/// two cohorts and the benchmark measures the deletes, with the walk's probes included.
async fn library_purge(
    conn: &DatabaseConnection,
    cutoff: chrono::DateTime<Utc>,
    batch: u64,
    pacing: PurgePacing,
) -> Result<Purged, BoxError> {
    let window = (Utc::now() - cutoff).to_std()?;
    let policy = RetentionPolicy::with_window(window)?
        .with_downtime_gap(RetentionPolicy::MAX_WINDOW)?
        .with_batch_size(u32::try_from(batch)?)?
        .with_pacing(pacing);
    let start = Instant::now();
    let report = purge(conn, &policy).await?;
    let elapsed = start.elapsed();
    // The cutoff's walk is what the purge spends outside its batches and rests.
    let walk = elapsed.saturating_sub(report.deleting + report.resting);
    Ok(Purged {
        rows: report.rows,
        elapsed,
        latencies_us: vec![micros(elapsed)],
        detail: format!(
            "{} batches (largest {}), deleting {:.1} ms, resting {:.1} ms, walk {:.1} ms",
            report.batches,
            report.largest_batch,
            ms(report.deleting),
            ms(report.resting),
            ms(walk)
        ),
    })
}

/// The floor: `DELETE ... LIMIT batch` until a batch comes back short, each statement its
/// own short transaction.
async fn hand_delete(
    conn: &DatabaseConnection,
    sql: &Sql,
    cutoff: chrono::DateTime<Utc>,
    batch: u64,
) -> Result<Purged, BoxError> {
    let backend = conn.get_database_backend();
    let mut purged = Purged::default();
    let mut batches = 0;
    let start = Instant::now();
    loop {
        batches += 1;
        let statement = Statement::from_sql_and_values(
            backend,
            sql.delete_batch,
            [
                timestamp(backend, cutoff),
                Value::from(i64::try_from(batch)?),
            ],
        );
        let deleted = conn.execute_raw(statement).await?.rows_affected();
        purged.rows += deleted;
        if deleted < batch {
            break;
        }
    }
    purged.elapsed = start.elapsed();
    purged.detail = format!("{batches} statements");
    purged.latencies_us.push(micros(purged.elapsed));
    Ok(purged)
}

/// One stream of `conns` each: a batch locks up to `batch` of the oldest rows received
/// before `cutoff` that no other stream holds, then deletes them by primary key in the
/// same transaction, until a stream finds none left.
async fn streams_delete(
    conns: &[DatabaseConnection],
    cutoff: chrono::DateTime<Utc>,
    batch: u64,
) -> Result<Purged, BoxError> {
    let start = Instant::now();
    let mut streams = tokio::task::JoinSet::new();
    for conn in conns {
        streams.spawn(stream_delete(conn.clone(), cutoff, batch));
    }
    let (mut rows, mut batches) = (0, 0);
    while let Some(stream) = streams.join_next().await {
        let (stream_rows, stream_batches) = stream??;
        rows += stream_rows;
        batches += stream_batches;
    }
    let elapsed = start.elapsed();
    Ok(Purged {
        rows,
        elapsed,
        latencies_us: vec![micros(elapsed)],
        detail: format!("{} streams, {batches} batches", conns.len()),
    })
}

/// One stream of [`streams_delete`]: its rows and batches.
async fn stream_delete(
    conn: DatabaseConnection,
    cutoff: chrono::DateTime<Utc>,
    batch: u64,
) -> Result<(u64, u64), BoxError> {
    let backend = conn.get_database_backend();
    let pick = match backend {
        DbBackend::Postgres => {
            "SELECT id FROM inbox WHERE received_at < $1 ORDER BY received_at LIMIT $2 FOR UPDATE SKIP LOCKED"
        }
        DbBackend::MySql => {
            "SELECT id FROM inbox WHERE received_at < ? ORDER BY received_at LIMIT ? FOR UPDATE SKIP LOCKED"
        }
        other => return Err(format!("no SKIP LOCKED on {other:?}").into()),
    };
    let (mut rows, mut batches) = (0, 0);
    loop {
        let txn = conn.begin().await?;
        let picked = txn
            .query_all_raw(Statement::from_sql_and_values(
                backend,
                pick,
                [
                    timestamp(backend, cutoff),
                    Value::from(i64::try_from(batch)?),
                ],
            ))
            .await?;
        if picked.is_empty() {
            txn.commit().await?;
            return Ok((rows, batches));
        }
        let ids = picked
            .iter()
            .map(|row| row.try_get_by_index::<i64>(0).map(|id| id.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let delete = format!("DELETE FROM inbox WHERE id IN ({})", ids.join(","));
        rows += txn.execute_unprepared(&delete).await?.rows_affected();
        txn.commit().await?;
        batches += 1;
    }
}

fn ms(elapsed: Duration) -> f64 {
    elapsed.as_secs_f64() * 1e3
}

fn micros(elapsed: Duration) -> u32 {
    u32::try_from(elapsed.as_micros()).unwrap_or(u32::MAX)
}

/// The cutoff between cohort `k` and the next: half a day younger than cohort `k`.
fn cutoff_after(k: u64) -> chrono::DateTime<Utc> {
    let hours = i64::try_from(Cohorts::age_days(k) * 24).unwrap_or(i64::MAX) - 12;
    Utc::now() - TimeDelta::hours(hours)
}

impl Bench<'_> {
    /// Runs the purge phase on the cohorts `growth::seed` laid down: at each purge
    /// concurrency, claimers alone and during each purger, in a random order each round.
    pub(crate) async fn purge_phase(&mut self, cohorts: Cohorts) -> Result<(), BoxError> {
        let levels: Vec<usize> = self
            .args
            .purge_concurrency
            .iter()
            .map(|&c| c.min(self.workers.len()))
            .collect();
        let purger_conn = self.db.connect().await?;
        for &concurrency in &levels {
            self.report.declare("purge", "claim alone", concurrency);
            for purger in Purger::all(self.db.backend) {
                let (purge_label, claim_label) = purger.labels();
                self.report.declare("purge", claim_label, concurrency);
                self.report.declare("purge", purge_label, concurrency);
            }
        }
        let mut next_cohort = 0;
        for round in 0..self.args.rounds {
            for &concurrency in &levels {
                let mut steps: Vec<Option<Purger>> = vec![None];
                steps.extend(Purger::all(self.db.backend).into_iter().map(Some));
                for step in shuffled(&steps) {
                    match step {
                        None => {
                            self.measure_as("purge", "claim alone", Mode::Claim, concurrency)
                                .await?
                        }
                        Some(purger) => {
                            self.purge_during_claims(
                                &purger_conn,
                                purger,
                                cohorts,
                                next_cohort,
                                concurrency,
                            )
                            .await?;
                            next_cohort += 1;
                        }
                    }
                }
            }
            eprintln!(
                "[{}] purge: round {}/{} done",
                self.report.backend,
                round + 1,
                self.args.rounds
            );
        }
        purger_conn.close().await?;
        Ok(())
    }

    /// Purges cohort `k` while `concurrency` workers claim, and checks both; then puts as
    /// many markers back, younger than every cutoff, out of the measurement.
    async fn purge_during_claims(
        &mut self,
        purger_conn: &DatabaseConnection,
        purger: Purger,
        cohorts: Cohorts,
        k: u64,
        concurrency: usize,
    ) -> Result<(), BoxError> {
        let expected = cohorts.rows_in(k, self.report.growth_rows);
        let conns = std::slice::from_ref(purger_conn);
        self.purge_while_claiming(conns, purger, cutoff_after(k), expected, concurrency)
            .await?;
        let refill = cohorts.refill_range(k, self.report.growth_rows);
        let started = Instant::now();
        growth::seed_rows(
            &self.control,
            *refill.start(),
            *refill.end(),
            REFILL_AGE_DAYS,
            self.args.growth_ids,
        )
        .await?;
        if self.args.purge_detail {
            eprintln!(
                "[{}] refilled {expected} rows in {:.1} ms",
                self.report.backend,
                ms(started.elapsed())
            );
        }
        Ok(())
    }

    /// Purges what was received before `cutoff`, which must be `expected` rows, while
    /// `concurrency` workers claim; checks both and records both in the report.
    pub(crate) async fn purge_while_claiming(
        &mut self,
        purger_conns: &[DatabaseConnection],
        purger: Purger,
        cutoff: chrono::DateTime<Utc>,
        expected: u64,
        concurrency: usize,
    ) -> Result<(), BoxError> {
        let (purge_label, claim_label) = purger.labels();
        let sql = crate::db::sql(self.db.backend)?;
        let before = crate::run::Snapshot::take(&self.control).await?;
        let stop = Stop::default();
        let purge = async {
            let purged = purger
                .purge(purger_conns, sql, cutoff, self.args.purge_batch)
                .await;
            stop.set();
            purged
        };
        let (claims, purged): (Result<Tally, BoxError>, _) = tokio::join!(
            run_mode(
                &self.workers,
                Mode::Claim,
                crate::modes::Deliveries::Fresh,
                concurrency,
                stop.clone()
            ),
            purge
        );
        let (claims, purged) = (claims?, purged?);
        before
            .verify(
                &self.control,
                sql,
                &format!("purge {claim_label}"),
                &claims.done,
            )
            .await?;
        if self.args.purge_detail {
            eprintln!(
                "[{}] {purge_label} c={concurrency}: {} rows in {:.1} ms: {}",
                self.report.backend,
                purged.rows,
                ms(purged.elapsed),
                purged.detail
            );
        }
        if purged.rows != expected {
            return Err(format!(
                "CORRECTNESS FAILURE in {purge_label}: {expected} rows were older than the cutoff, {} deleted",
                purged.rows
            )
            .into());
        }
        self.report.record(
            "purge",
            claim_label,
            concurrency,
            claims.rate(),
            claims.latencies_us,
            claims.txns,
        );
        self.report.record(
            "purge",
            purge_label,
            concurrency,
            purged.rate(),
            purged.latencies_us,
            purged.rows,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::growth::SeedIds;
    use sea_orm_inbox_migration::{Migrator, MigratorTrait};

    async fn markers(db: &DatabaseConnection) -> Result<i64, BoxError> {
        let row = db
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "SELECT COUNT(*) FROM inbox",
            ))
            .await?
            .ok_or("a count")?;
        Ok(row.try_get_by_index(0)?)
    }

    /// A purged cohort's refill keeps the table at its seeded size, and no later purge
    /// deletes it: each purge still takes exactly its own cohort.
    #[tokio::test]
    async fn a_refill_keeps_the_size_and_outlives_every_cutoff() -> Result<(), BoxError> {
        let db = sea_orm::Database::connect("sqlite::memory:").await?;
        Migrator::up(&db, None).await?;
        let (total, cohorts) = (30, Cohorts::new(30, 3));
        growth::seed(&db, total, cohorts, SeedIds::Random).await?;
        let sql = crate::db::sql(DbBackend::Sqlite)?;
        for k in 0..cohorts.count {
            let purged = hand_delete(&db, sql, cutoff_after(k), 4).await?;
            assert_eq!(purged.rows, cohorts.rows_in(k, total), "cohort {k}");
            let refill = cohorts.refill_range(k, total);
            growth::seed_rows(
                &db,
                *refill.start(),
                *refill.end(),
                REFILL_AGE_DAYS,
                SeedIds::Random,
            )
            .await?;
            assert_eq!(markers(&db).await?, 30, "after cohort {k}'s refill");
        }
        Ok(())
    }
}
