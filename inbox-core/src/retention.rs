//! How long markers must be kept, and a purge that deletes older ones in bounded batches.

use crate::InboxError;
use crate::backend::{newest_received_at_sql, purge_batch_sql, timestamp_value};
use crate::claim::now_micros;
use chrono::{DateTime, TimeDelta, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, Value};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the broker may still redeliver, in its own terms; the inputs of
/// [`RetentionPolicy::from_broker`].
///
/// ```
/// use inbox_core::BrokerRedelivery;
/// use std::time::Duration;
///
/// // Azure Service Bus: 1-minute lock, 10 deliveries, 14-day TTL, replays within 7 days.
/// let service_bus = BrokerRedelivery {
///     lock_timeout: Duration::from_secs(60),
///     max_deliveries: 10,
///     message_ttl: Duration::from_secs(14 * 86_400),
///     dead_letter_replay_margin: Duration::from_secs(7 * 86_400),
/// };
/// # let _ = service_bus;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BrokerRedelivery {
    /// Lock / visibility / ack timeout: how long a delivery may stay unacknowledged before
    /// the broker hands it out again.
    pub lock_timeout: Duration,
    /// Maximum deliveries before the broker dead-letters the message.
    pub max_deliveries: u32,
    /// Time to live of a message waiting in the queue.
    pub message_ttl: Duration,
    /// How long after the fact operators may replay the dead-letter queue.
    pub dead_letter_replay_margin: Duration,
}

/// How long markers are kept, and how many rows one purge statement may delete.
///
/// **Downtime rule.** The cutoff is measured from the newest marker's `received_at`, not
/// from the wall clock: `cutoff = min(newest received_at, now) - window`. The window is
/// time the inbox spent *receiving*; while the process is down nothing arrives, so the
/// cutoff stands still and the markers of the last `window` before the outage survive
/// any length of downtime. A broker that redelivers those messages after the restart
/// still meets their markers. Once new messages have arrived for `window`, the old ones
/// age out as usual. (A wall-clock cutoff would delete them all on the first purge
/// after an outage longer than the window, reopening the duplicate window exactly when
/// the broker redelivers the backlog.)
///
/// ```
/// use inbox_core::{BrokerRedelivery, RetentionPolicy};
/// use std::time::Duration;
///
/// let policy = RetentionPolicy::from_broker(&BrokerRedelivery {
///     lock_timeout: Duration::from_secs(30),
///     max_deliveries: 10,
///     message_ttl: Duration::from_secs(86_400),
///     dead_letter_replay_margin: Duration::from_secs(6 * 86_400),
/// })?
/// .with_batch_size(5_000)?;
/// assert_eq!(policy.window(), Duration::from_secs(300 + 7 * 86_400));
/// # Ok::<(), inbox_core::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    window: Duration,
    batch_size: u32,
}

impl RetentionPolicy {
    /// Rows one purge statement deletes unless [`with_batch_size`](Self::with_batch_size)
    /// says otherwise.
    pub const DEFAULT_BATCH_SIZE: u32 = 1_000;
    /// The largest batch accepted: bigger deletes hold locks long enough to stall writers.
    pub const MAX_BATCH_SIZE: u32 = 100_000;
    /// The longest window accepted: a hundred years.
    pub const MAX_WINDOW: Duration = Duration::from_secs(100 * 366 * 86_400);

    /// `lock_timeout x max_deliveries + message_ttl + dead_letter_replay_margin`.
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] when `max_deliveries` is 0 or the sum overflows
    /// [`MAX_WINDOW`](Self::MAX_WINDOW).
    pub fn from_broker(broker: &BrokerRedelivery) -> Result<Self, InboxError> {
        if broker.max_deliveries == 0 {
            return Err(InboxError::InvalidRetention {
                reason:
                    "max_deliveries is 0: give the broker's maximum delivery count (at least 1)"
                        .into(),
            });
        }
        let window = broker
            .lock_timeout
            .checked_mul(broker.max_deliveries)
            .and_then(|redeliveries| redeliveries.checked_add(broker.message_ttl))
            .and_then(|total| total.checked_add(broker.dead_letter_replay_margin))
            .ok_or_else(|| InboxError::InvalidRetention {
                reason: "the broker parameters add up to more than a Duration holds".into(),
            })?;
        Self::with_window(window)
    }

    /// Keeps markers for `window` of receiving time (see the downtime rule above).
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] for a zero window or one over
    /// [`MAX_WINDOW`](Self::MAX_WINDOW).
    pub fn with_window(window: Duration) -> Result<Self, InboxError> {
        if window.is_zero() || window > Self::MAX_WINDOW {
            return Err(InboxError::InvalidRetention {
                reason: format!(
                    "a window of {window:?} is outside (0, {:?}]: keep markers at least as long as the broker can redeliver",
                    Self::MAX_WINDOW
                ),
            });
        }
        Ok(Self {
            window,
            batch_size: Self::DEFAULT_BATCH_SIZE,
        })
    }

    /// Deletes at most `batch_size` rows per statement (each its own short transaction).
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] outside `1..=`[`MAX_BATCH_SIZE`](Self::MAX_BATCH_SIZE).
    pub fn with_batch_size(self, batch_size: u32) -> Result<Self, InboxError> {
        if !(1..=Self::MAX_BATCH_SIZE).contains(&batch_size) {
            return Err(InboxError::InvalidRetention {
                reason: format!(
                    "a batch size of {batch_size} is outside 1..={}: bounded batches keep each delete short",
                    Self::MAX_BATCH_SIZE
                ),
            });
        }
        Ok(Self { batch_size, ..self })
    }

    /// How long markers are kept, in receiving time.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Rows per purge statement.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// The purge cutoff under the downtime rule: markers received strictly before it go.
    ///
    /// ```
    /// use chrono::{TimeDelta, Utc};
    /// use inbox_core::RetentionPolicy;
    /// use std::time::Duration;
    ///
    /// let policy = RetentionPolicy::with_window(Duration::from_secs(3_600))?;
    /// let now = Utc::now();
    /// let newest = now - TimeDelta::days(30); // the process was down for a month
    /// assert_eq!(policy.cutoff(newest, now), newest - TimeDelta::hours(1));
    /// # Ok::<(), inbox_core::InboxError>(())
    /// ```
    pub fn cutoff(&self, newest_received_at: DateTime<Utc>, now: DateTime<Utc>) -> DateTime<Utc> {
        // `with_window` bounds the window to a hundred years, so the conversion succeeds.
        let window = TimeDelta::from_std(self.window).unwrap_or(TimeDelta::MAX);
        newest_received_at
            .min(now)
            .checked_sub_signed(window)
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }
}

/// What one [`purge`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// The cutoff used; `None` when the inbox was empty (nothing to measure from).
    pub cutoff: Option<DateTime<Utc>>,
    /// Rows deleted.
    pub rows: u64,
    /// DELETE statements that removed at least one row.
    pub batches: u32,
    /// Rows the largest batch removed (never above the policy's batch size).
    pub largest_batch: u64,
}

/// Deletes the markers received before the policy's cutoff, in batches of at most
/// [`RetentionPolicy::batch_size`] rows, each one DELETE statement committed on its own,
/// until a batch comes back short.
///
/// Never deletes an unfinished two-phase claim (a lease without `processed_at`, parked
/// or not). The cutoff follows the downtime rule of [`RetentionPolicy`] and is computed
/// once, before the first batch.
///
/// # Errors
/// [`InboxError::Query`] when a statement fails; batches before it stay deleted.
///
/// ```
/// use inbox_core::{RetentionPolicy, purge};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # inbox_migration::Migrator::up(&db, None).await?;
/// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?;
/// let report = purge(&db, &policy).await?;
/// assert_eq!((report.rows, report.cutoff), (0, None)); // an empty inbox
/// # Ok(()) }
/// ```
pub async fn purge(
    db: &DatabaseConnection,
    policy: &RetentionPolicy,
) -> Result<PurgeReport, InboxError> {
    purge_until(db, policy, || false).await
}

/// [`purge`] that also stops between batches once `stop` says so.
async fn purge_until(
    db: &DatabaseConnection,
    policy: &RetentionPolicy,
    stop: impl Fn() -> bool,
) -> Result<PurgeReport, InboxError> {
    let backend = db.get_database_backend();
    let failed = |operation| move |source| InboxError::Query { operation, source };
    let newest = db
        .query_one_raw(Statement::from_string(
            backend,
            newest_received_at_sql(backend)?,
        ))
        .await
        .map_err(failed("reading the newest received_at"))?
        .map(|row| row.try_get_by_index::<Option<DateTime<Utc>>>(0))
        .transpose()
        .map_err(failed("reading the newest received_at"))?
        .flatten();
    let Some(newest) = newest else {
        return Ok(PurgeReport::default());
    };
    let cutoff = policy.cutoff(newest, now_micros());
    let delete = purge_batch_sql(backend)?;
    let mut report = PurgeReport {
        cutoff: Some(cutoff),
        ..PurgeReport::default()
    };
    let batch_size = u64::from(policy.batch_size);
    loop {
        let deleted = db
            .execute_raw(Statement::from_sql_and_values(
                backend,
                &delete,
                [
                    timestamp_value(backend, cutoff),
                    Value::from(i64::from(policy.batch_size)),
                ],
            ))
            .await
            .map_err(failed("deleting a purge batch"))?
            .rows_affected();
        if deleted > 0 {
            report.rows += deleted;
            report.batches += 1;
            report.largest_batch = report.largest_batch.max(deleted);
        }
        if deleted < batch_size || stop() {
            return Ok(report);
        }
    }
}

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

/// A background task running [`purge`] at an interval; see [`spawn_purger`].
///
/// Dropping it without [`shutdown`](Self::shutdown) also stops the task, after its
/// current batch.
#[derive(Debug)]
pub struct Purger {
    stop: watch::Sender<bool>,
    task: JoinHandle<PurgerSummary>,
}

impl Purger {
    /// Stops the task after its current batch (never mid-statement) and returns its
    /// totals.
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

/// Spawns a tokio task that runs [`purge`] now and then every `every`, until
/// [`Purger::shutdown`]. A failed purge is counted and retried at the next tick.
///
/// # Errors
/// [`InboxError::InvalidRetention`] for a zero interval; [`InboxError::NoTokioRuntime`]
/// when called outside a tokio runtime.
///
/// ```
/// use inbox_core::{RetentionPolicy, spawn_purger};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # inbox_migration::Migrator::up(&db, None).await?;
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
            let stop_now = || *stopped.borrow();
            if stop_now() {
                break;
            }
            summary.runs += 1;
            match purge_until(&db, &policy, stop_now).await {
                Ok(report) => {
                    summary.rows += report.rows;
                    summary.batches += u64::from(report.batches);
                }
                Err(err) => {
                    summary.failures += 1;
                    summary.last_error = Some(err);
                }
            }
        }
        summary
    });
    Ok(Purger { stop, task })
}
