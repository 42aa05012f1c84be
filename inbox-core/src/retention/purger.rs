//! A background task purging at an interval.

use super::RetentionPolicy;
use super::purge::{StopSignal, purge_until};
use crate::InboxError;
use sea_orm::DatabaseConnection;
use sea_orm_inbox_entity::InboxTable;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Totals of a background purger, returned by [`Purger::shutdown`].
#[derive(Debug, Default)]
pub struct PurgerSummary {
    /// Purges run.
    pub runs: u64,
    /// Rows deleted over all runs.
    pub rows: u64,
    /// Batches over all runs.
    pub batches: u64,
    /// Purges that failed.
    pub failures: u64,
    /// The latest failure, if any (the purger keeps running after one).
    pub last_error: Option<InboxError>,
}

/// A background task running [`purge`](crate::purge) at an interval; see [`spawn_purger`].
///
/// Dropping it without [`shutdown`](Self::shutdown) also stops the task, after its
/// current batch (or at once, when it is resting between batches or waiting for the
/// next tick).
#[derive(Debug)]
pub struct Purger {
    stop: watch::Sender<bool>,
    task: JoinHandle<PurgerSummary>,
}

impl Purger {
    /// Stops the task after its current batch (never mid-statement; a rest between
    /// batches is cut short) and returns its totals.
    ///
    /// # Errors
    /// [`InboxError::PurgerStopped`] if the task ended abnormally (it was aborted or
    /// panicked).
    pub async fn shutdown(self) -> Result<PurgerSummary, InboxError> {
        // An Err means the task has already ended; the join below reports how.
        let _ = self.stop.send(true);
        self.task.await.map_err(|err| InboxError::PurgerStopped {
            reason: err.to_string(),
        })
    }
}

/// Spawns a tokio task that runs [`purge`](crate::purge) now and then every `every`, until
/// [`Purger::shutdown`]. A failed purge is counted and retried at the next tick, one the
/// database left unanswered past the policy's
/// [partition timeout](RetentionPolicy::with_partition_timeout) too
/// ([`InboxError::DatabaseSilent`] in [`PurgerSummary::last_error`]).
///
/// # Errors
/// [`InboxError::InvalidRetention`] for a zero interval; [`InboxError::NoTokioRuntime`]
/// when called outside a tokio runtime.
///
/// ```
/// use sea_orm_inbox::{RetentionPolicy, spawn_purger};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?;
/// let purger = spawn_purger(db.clone(), policy, Duration::from_secs(600))?;
/// // ... serve messages ...
/// let summary = purger.shutdown().await?;
/// assert_eq!(summary.failures, 0);
/// # Ok(()) }
/// ```
pub fn spawn_purger(
    db: DatabaseConnection,
    policy: RetentionPolicy,
    every: Duration,
) -> Result<Purger, InboxError> {
    spawn_purger_in(db, InboxTable::default(), policy, every)
}

/// [`spawn_purger`] for the inbox in `table`, an [`InboxTable`] of the application's
/// choice.
///
/// # Errors
/// As [`spawn_purger`].
///
/// ```
/// use sea_orm_inbox::{InboxTable, RetentionPolicy, spawn_purger_in};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// let table = InboxTable::named("app_inbox")?;
/// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?;
/// let purger = spawn_purger_in(db.clone(), table, policy, Duration::from_secs(600))?;
/// purger.shutdown().await?;
/// # Ok(()) }
/// ```
pub fn spawn_purger_in(
    db: DatabaseConnection,
    table: InboxTable,
    policy: RetentionPolicy,
    every: Duration,
) -> Result<Purger, InboxError> {
    if every.is_zero() {
        return Err(InboxError::InvalidRetention {
            reason: "the purge interval is zero: purge every few minutes".into(),
        });
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| InboxError::NoTokioRuntime)?;
    let (stop, mut stopped) = watch::channel(false);
    let task = runtime.spawn(async move {
        let mut summary = PurgerSummary::default();
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // A send of `true`, or the Purger dropped.
                _ = stopped.changed() => break,
                _ = ticker.tick() => {}
            }
            let mut stop = StopSignal::Watch(&mut stopped);
            if stop.requested() {
                break;
            }
            summary.runs += 1;
            match purge_until(&db, &table, &policy, &mut stop).await {
                Ok(report) => {
                    summary.rows += report.rows;
                    summary.batches += u64::from(report.batches);
                }
                Err(err) => {
                    summary.failures += 1;
                    summary.last_error = Some(err);
                }
            }
            // A stop seen during the purge was consumed there: `changed()` would not
            // fire for it again.
            if stop.requested() {
                break;
            }
        }
        summary
    });
    Ok(Purger { stop, task })
}
