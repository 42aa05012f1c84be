//! One purge: the cutoff of the downtime rule, then paced DELETE batches.

use super::RetentionPolicy;
use super::pacer::Pacer;
use super::walk::{ReceivingWalk, WalkStep};
use crate::InboxError;
use crate::backend::{
    CLAIM_TRANSACTION, latest_received_at_or_before_sql, newest_received_at_sql,
    oldest_received_at_sql, purge_batch_sql, timestamp_value,
};
use crate::clock::now_micros;
use crate::metrics::facade;
use crate::pooler::{in_own_transaction, in_own_transaction_with};
use crate::silence::answered_within;
use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr, Statement, Value};
use sea_orm_inbox_entity::InboxTable;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What one [`purge`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// The cutoff used; `None` when no marker is a window of receiving time old (an empty
    /// inbox, or one that has not yet received for a whole window).
    pub cutoff: Option<DateTime<Utc>>,
    /// Rows deleted.
    pub rows: u64,
    /// DELETE statements that removed at least one row.
    pub batches: u32,
    /// Rows the largest batch removed (never above the policy's batch size).
    pub largest_batch: u64,
    /// Time spent in DELETE statements.
    pub deleting: Duration,
    /// Time spent resting between batches, as the [`PurgePacing`](crate::PurgePacing) asked.
    pub resting: Duration,
}

/// Deletes the markers last used before the policy's cutoff (a completed two-phase claim
/// at its completion, every other marker at its claim: the retention clock of
/// [`RetentionPolicy`]), in batches of at most [`RetentionPolicy::batch_size`] rows, each
/// one DELETE statement committed on its own, spaced as the policy's
/// [`PurgePacing`](crate::PurgePacing) says, until a batch comes back short.
///
/// Never deletes an unfinished two-phase claim (a lease without `processed_at`, parked
/// or not). The cutoff follows the downtime rule of [`RetentionPolicy`] and is computed
/// once, before the first batch, from at most 64 timestamps read off the index in one
/// short transaction.
///
/// Each batch, and the walk, waits at most the policy's
/// [partition timeout](RetentionPolicy::with_partition_timeout) for the database to
/// answer (not on SQLite).
///
/// # Errors
/// [`InboxError::Query`] when a statement fails; [`InboxError::DatabaseSilent`] when one
/// goes unanswered past the partition timeout (retry later). Batches before it stay
/// deleted.
///
/// ```
/// use sea_orm_inbox::{RetentionPolicy, purge};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?;
/// let report = purge(&db, &policy).await?;
/// assert_eq!((report.rows, report.cutoff), (0, None)); // an empty inbox
/// # Ok(()) }
/// ```
pub async fn purge(
    db: &DatabaseConnection,
    policy: &RetentionPolicy,
) -> Result<PurgeReport, InboxError> {
    purge_in(db, &InboxTable::default(), policy).await
}

/// [`purge`] of the inbox in `table`, an [`InboxTable`] of the application's choice.
///
/// # Errors
/// As [`purge`].
///
/// ```
/// use sea_orm_inbox::{InboxTable, RetentionPolicy, purge_in};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::{MigrationTrait, SchemaManager};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// let table = InboxTable::named("app_inbox")?;
/// # for migration in sea_orm_inbox_migration::inbox_migrations(&table) {
/// #     migration.up(&SchemaManager::new(&db)).await?;
/// # }
/// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?;
/// let report = purge_in(&db, &table, &policy).await?;
/// assert_eq!(report.rows, 0);
/// # Ok(()) }
/// ```
pub async fn purge_in(
    db: &DatabaseConnection,
    table: &InboxTable,
    policy: &RetentionPolicy,
) -> Result<PurgeReport, InboxError> {
    purge_until(db, table, policy, &mut StopSignal::Never).await
}

/// Whether a purge should stop between batches: never for [`purge`], on request (or when
/// its [`Purger`](crate::Purger) is dropped) for a background purger.
pub(super) enum StopSignal<'a> {
    Never,
    Watch(&'a mut watch::Receiver<bool>),
}

impl StopSignal<'_> {
    pub(super) fn requested(&self) -> bool {
        match self {
            Self::Never => false,
            // `has_changed` fails once the sender is gone: the `Purger` was dropped.
            Self::Watch(stopped) => *stopped.borrow() || stopped.has_changed().is_err(),
        }
    }

    /// Sleeps `rest`, cut short by a stop request.
    async fn rest(&mut self, rest: Duration) {
        match self {
            Self::Never => tokio::time::sleep(rest).await,
            Self::Watch(stopped) => {
                tokio::select! {
                    _ = tokio::time::sleep(rest) => {}
                    _ = stopped.changed() => {}
                }
            }
        }
    }
}

/// [`purge`] that also stops between batches once `stop` says so.
pub(super) async fn purge_until(
    db: &DatabaseConnection,
    table: &InboxTable,
    policy: &RetentionPolicy,
    stop: &mut StopSignal<'_>,
) -> Result<PurgeReport, InboxError> {
    let backend = db.get_database_backend();
    let failed = |operation| move |source| InboxError::Query { operation, source };
    let Some(cutoff) = receiving_time_cutoff(db, table, policy).await? else {
        return Ok(PurgeReport::default());
    };
    let delete = purge_batch_sql(backend, table)?;
    let mut report = PurgeReport {
        cutoff: Some(cutoff),
        ..PurgeReport::default()
    };
    let mut pacer = Pacer::new(policy, backend);
    loop {
        let batch = pacer.batch();
        let started = Instant::now();
        let statement = Statement::from_sql_and_values(
            backend,
            &delete,
            [
                timestamp_value(backend, cutoff),
                timestamp_value(backend, cutoff),
                Value::from(i64::try_from(batch).unwrap_or(i64::MAX)),
            ],
        );
        let operation = "deleting a purge batch";
        // On SQLite the batch takes the write lock at BEGIN (IMMEDIATE), so the DELETE's
        // own time is its work: measured with the wait behind the claimers, every batch
        // looked slow per row and the budget never let one grow (about 2,000 rows on
        // SQLite at 8 claimers, whatever the budget, measured).
        let delete = in_own_transaction_with(db, CLAIM_TRANSACTION, async |txn| {
            let working = Instant::now();
            let deleted = txn.execute_raw(statement).await?.rows_affected();
            Ok((deleted, working.elapsed()))
        });
        let (deleted, worked) = answered_within(db, policy.partition_timeout(), operation, delete)
            .await?
            .map_err(failed(operation))?;
        let took = started.elapsed();
        report.deleting += took;
        if deleted > 0 {
            report.rows += deleted;
            report.batches += 1;
            report.largest_batch = report.largest_batch.max(deleted);
            facade::purged(deleted);
        }
        if deleted < batch || stop.requested() {
            return Ok(report);
        }
        let rest = pacer.full_batch(worked);
        if !rest.is_zero() {
            let resting_since = Instant::now();
            stop.rest(rest).await;
            report.resting += resting_since.elapsed();
            if stop.requested() {
                return Ok(report);
            }
        }
    }
}

/// The cutoff of the downtime rule, walking the markers' timeline back from the newest.
///
/// Every read of the walk runs in one short transaction, bounded as a whole by the
/// partition timeout: a read is one index probe, so the walk's time is its round trips,
/// and a transaction per read would triple them (BEGIN and COMMIT around each).
async fn receiving_time_cutoff(
    db: &DatabaseConnection,
    table: &InboxTable,
    policy: &RetentionPolicy,
) -> Result<Option<DateTime<Utc>>, InboxError> {
    let backend = db.get_database_backend();
    let newest_sql = newest_received_at_sql(backend, table)?;
    let probe_sql = latest_received_at_or_before_sql(backend, table)?;
    let oldest_sql = oldest_received_at_sql(backend, table)?;
    let operation = "reading received_at for the retention cutoff";
    let walk = in_own_transaction(db, async |txn| {
        let Some(newest) = read_timestamp(txn, &newest_sql, None).await? else {
            return Ok(None);
        };
        let (mut walk, mut next) = ReceivingWalk::start(policy, newest, now_micros());
        loop {
            match next {
                WalkStep::Cutoff(cutoff) => return Ok(Some(cutoff)),
                WalkStep::Exhausted => return Ok(None),
                WalkStep::Probe(at) => match read_timestamp(txn, &probe_sql, Some(at)).await? {
                    Some(earlier) => next = walk.advance(earlier),
                    None => {
                        let oldest = read_timestamp(txn, &oldest_sql, None).await?;
                        return Ok(oldest.and_then(|oldest| walk.finish(oldest)));
                    }
                },
            }
        }
    });
    answered_within(db, policy.partition_timeout(), operation, walk)
        .await?
        .map_err(|source| InboxError::Query { operation, source })
}

/// Reads the one timestamp a `SELECT MAX(received_at) ...` returns, binding `at` if given.
async fn read_timestamp(
    txn: &DatabaseTransaction,
    sql: &str,
    at: Option<DateTime<Utc>>,
) -> Result<Option<DateTime<Utc>>, DbErr> {
    let backend = txn.get_database_backend();
    let values = at.map(|at| timestamp_value(backend, at)).into_iter();
    let read = Statement::from_sql_and_values(backend, sql, values);
    match txn.query_one_raw(read).await? {
        Some(row) => row.try_get_by_index::<Option<DateTime<Utc>>>(0),
        None => Ok(None),
    }
}
