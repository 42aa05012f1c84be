//! A background task deleting sent outbox rows at an interval, as [`crate::spawn_purger`]
//! does for the inbox.

use super::OutboxError;
use super::admin::purge_sent_batch;
use chrono::Utc;
use sea_orm::DatabaseConnection;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Totals of an outbox purger, returned by [`OutboxPurger::shutdown`].
#[derive(Debug, Default)]
pub struct OutboxPurgerSummary {
    /// Purges run.
    pub runs: u64,
    /// Sent rows deleted over all runs.
    pub rows: u64,
    /// Purges that failed.
    pub failures: u64,
    /// The latest failure, if any (the purger keeps running after one).
    pub last_error: Option<OutboxError>,
}

/// A background task deleting the outbox's sent rows at an interval; see
/// [`spawn_outbox_purger`].
///
/// Dropping it without [`shutdown`](Self::shutdown) also stops the task, after its
/// current batch.
#[derive(Debug)]
pub struct OutboxPurger {
    stop: watch::Sender<bool>,
    task: JoinHandle<OutboxPurgerSummary>,
}

impl OutboxPurger {
    /// Stops the task after its current batch (never mid-statement) and returns its
    /// totals.
    ///
    /// # Errors
    /// [`OutboxError::PurgerStopped`] if the task ended abnormally (it was aborted or
    /// panicked).
    pub async fn shutdown(self) -> Result<OutboxPurgerSummary, OutboxError> {
        // An Err means the task has already ended; the join below reports how.
        let _ = self.stop.send(true);
        self.task.await.map_err(|err| OutboxError::PurgerStopped {
            reason: err.to_string(),
        })
    }
}

/// Spawns a tokio task that deletes the rows sent more than `keep` ago, now and then
/// every `every`, in batches of at most `batch` rows, each its own short transaction
/// ([`purge_sent_messages`](crate::purge_sent_messages)), until
/// [`OutboxPurger::shutdown`]. Unsent and dead rows are never deleted. A failed purge is
/// counted and retried at the next tick; a stop is seen between batches.
///
/// # Errors
/// [`OutboxError::InvalidOptions`] for a zero interval or batch, or a `keep` too long to
/// subtract from now; [`OutboxError::NoTokioRuntime`] outside a tokio runtime.
///
/// ```
/// use sea_orm_inbox::spawn_outbox_purger;
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::MigratorWithOutbox::up(&db, None).await?;
/// let keep = Duration::from_secs(86_400); // what was published stays a day to look up
/// let purger = spawn_outbox_purger(db.clone(), keep, Duration::from_secs(600), 5_000)?;
/// // ... relay messages ...
/// let summary = purger.shutdown().await?;
/// assert_eq!(summary.failures, 0);
/// # Ok(()) }
/// ```
pub fn spawn_outbox_purger(
    db: DatabaseConnection,
    keep: Duration,
    every: Duration,
    batch: u32,
) -> Result<OutboxPurger, OutboxError> {
    if every.is_zero() {
        return Err(OutboxError::InvalidOptions {
            what: "the outbox purge interval is zero",
            advice: "purge every few minutes",
        });
    }
    if batch == 0 {
        return Err(OutboxError::InvalidOptions {
            what: "the purge batch is 0",
            advice: "delete at least 1 row per batch (a few thousand is typical)",
        });
    }
    let keep = chrono::Duration::from_std(keep)
        .ok()
        .filter(|keep| Utc::now().checked_sub_signed(*keep).is_some())
        .ok_or(OutboxError::InvalidOptions {
            what: "the time to keep sent rows is too long to subtract from now",
            advice: "keep sent rows for days or weeks",
        })?;
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| OutboxError::NoTokioRuntime)?;
    let (stop, mut stopped) = watch::channel(false);
    let task = runtime.spawn(async move {
        let mut summary = OutboxPurgerSummary::default();
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        'ticks: loop {
            tokio::select! {
                // A send of `true`, or the purger dropped.
                _ = stopped.changed() => break,
                _ = ticker.tick() => {}
            }
            summary.runs += 1;
            let cutoff = Utc::now() - keep;
            loop {
                match purge_sent_batch(&db, cutoff, batch).await {
                    Ok(rows) => {
                        summary.rows += rows;
                        if rows < u64::from(batch) {
                            break;
                        }
                    }
                    Err(err) => {
                        summary.failures += 1;
                        summary.last_error = Some(err);
                        break;
                    }
                }
                if *stopped.borrow() || stopped.has_changed().unwrap_or(true) {
                    break 'ticks;
                }
            }
        }
        summary
    });
    Ok(OutboxPurger { stop, task })
}
