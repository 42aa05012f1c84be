//! How long markers must be kept, and a purge that deletes older ones in bounded batches.

use crate::InboxError;
use crate::backend::{
    latest_received_at_or_before_sql, newest_received_at_sql, oldest_received_at_sql,
    purge_batch_sql, timestamp_value,
};
use crate::claim::now_micros;
use crate::metrics::facade;
use chrono::{DateTime, TimeDelta, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, Value};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the broker may still redeliver, in its own terms; the inputs of
/// [`RetentionPolicy::from_broker`].
///
/// ```
/// use sea_orm_inbox::BrokerRedelivery;
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
/// **Downtime rule.** The window is *receiving time*, not wall-clock time. The purge walks
/// back from the newest marker (or now, if the clock is behind it) through the markers'
/// own timeline and counts the stretches where markers are never further apart than the
/// [downtime gap](Self::with_downtime_gap) (by default an eighth of the window). A longer
/// silence counts as downtime, however long it lasted: the process was down (or the queue
/// idle, which only keeps markers longer). Markers older than one window of receiving
/// time go. So after an outage longer than the window, the markers of the last window
/// before it survive, and they age out only as new traffic accumulates receiving time:
/// a broker that redelivers the in-flight messages when the service comes back still
/// meets their markers. (A wall-clock cutoff would delete them all on the first purge
/// after the outage; one measured from the newest marker would delete them as soon as
/// the first new message arrived.) The walk costs at most 64 index probes per purge.
///
/// ```
/// use sea_orm_inbox::{BrokerRedelivery, RetentionPolicy};
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
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    window: Duration,
    downtime_gap: Duration,
    batch_size: u32,
}

impl RetentionPolicy {
    /// Rows one purge statement deletes unless [`with_batch_size`](Self::with_batch_size)
    /// says otherwise.
    pub const DEFAULT_BATCH_SIZE: u32 = 1_000;
    /// The default downtime gap is the window divided by this.
    pub const DEFAULT_GAPS_PER_WINDOW: u32 = 8;
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
            downtime_gap: window / Self::DEFAULT_GAPS_PER_WINDOW,
            batch_size: Self::DEFAULT_BATCH_SIZE,
        })
    }

    /// A silence between markers longer than `gap` counts as downtime, not receiving time
    /// (see the downtime rule above). Shorter gaps keep markers a little longer after
    /// outages and idle stretches; longer ones let an outage shorter than `gap` count
    /// towards the window.
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] for a zero gap or one over
    /// [`MAX_WINDOW`](Self::MAX_WINDOW).
    pub fn with_downtime_gap(self, gap: Duration) -> Result<Self, InboxError> {
        if gap.is_zero() || gap > Self::MAX_WINDOW {
            return Err(InboxError::InvalidRetention {
                reason: format!(
                    "a downtime gap of {gap:?} is outside (0, {:?}]: a silence longer than the gap counts as downtime",
                    Self::MAX_WINDOW
                ),
            });
        }
        Ok(Self {
            downtime_gap: gap,
            ..self
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

    /// The longest silence between markers still counted as receiving time.
    pub fn downtime_gap(&self) -> Duration {
        self.downtime_gap
    }
}

/// The receiving-time walk of the downtime rule, one probe at a time, free of I/O.
///
/// Each probe asks for the newest marker at or before `at - step`; the stretch back to it
/// counts in full when it is no longer than the downtime gap, and as one `step` otherwise
/// (the probe cannot see into the last `step` before `at`, so that much may have been
/// receiving). Every probe adds at least `step` = window / 64, so a walk makes at most 64.
#[derive(Clone, Copy, Debug)]
struct ReceivingWalk {
    window: TimeDelta,
    gap: TimeDelta,
    step: TimeDelta,
    at: DateTime<Utc>,
    receiving: TimeDelta,
}

/// Where a walk goes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WalkStep {
    /// Probe for the newest marker at or before this instant.
    Probe(DateTime<Utc>),
    /// Markers received strictly before this instant are past the window.
    Cutoff(DateTime<Utc>),
    /// The walk left the range of representable time: nothing is old enough to delete.
    Exhausted,
}

impl ReceivingWalk {
    const PROBES_PER_WINDOW: i32 = 64;

    fn start(
        policy: &RetentionPolicy,
        newest: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> (Self, WalkStep) {
        // `with_window` bounds both durations to a hundred years: the conversions succeed.
        let window = TimeDelta::from_std(policy.window).unwrap_or(TimeDelta::MAX);
        let gap = TimeDelta::from_std(policy.downtime_gap).unwrap_or(window);
        let step = (window / Self::PROBES_PER_WINDOW)
            .min(gap)
            .max(TimeDelta::microseconds(1));
        let walk = Self {
            window,
            gap,
            step,
            at: newest.min(now),
            receiving: TimeDelta::zero(),
        };
        (walk, walk.probe_before(walk.at))
    }

    /// Takes the answer to the last probe: the newest marker at or before it.
    fn advance(&mut self, earlier: DateTime<Utc>) -> WalkStep {
        let span = self.at - earlier;
        let counted = if span <= self.gap { span } else { self.step };
        let missing = self.window - self.receiving;
        if counted >= missing {
            return self
                .at
                .checked_sub_signed(missing)
                .map_or(WalkStep::Exhausted, WalkStep::Cutoff);
        }
        self.receiving += counted;
        self.at = earlier;
        self.probe_before(earlier)
    }

    /// Takes the oldest marker when no marker is at or before the last probe: every marker
    /// left lies within one step of where the walk stands, a silence no longer than the
    /// gap, so it all counts. `None` when that is still short of a window.
    fn finish(&self, oldest: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let missing = self.window - self.receiving;
        if self.at - oldest < missing {
            return None;
        }
        self.at.checked_sub_signed(missing)
    }

    fn probe_before(&self, at: DateTime<Utc>) -> WalkStep {
        at.checked_sub_signed(self.step)
            .map_or(WalkStep::Exhausted, WalkStep::Probe)
    }
}

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
}

/// Deletes the markers received before the policy's cutoff, in batches of at most
/// [`RetentionPolicy::batch_size`] rows, each one DELETE statement committed on its own,
/// until a batch comes back short.
///
/// Never deletes an unfinished two-phase claim (a lease without `processed_at`, parked
/// or not). The cutoff follows the downtime rule of [`RetentionPolicy`] and is computed
/// once, before the first batch, with at most 64 index probes.
///
/// # Errors
/// [`InboxError::Query`] when a statement fails; batches before it stay deleted.
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
    let Some(cutoff) = receiving_time_cutoff(db, policy).await? else {
        return Ok(PurgeReport::default());
    };
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
            facade::purged(deleted);
        }
        if deleted < batch_size || stop() {
            return Ok(report);
        }
    }
}

/// The cutoff of the downtime rule, walking the markers' timeline back from the newest.
async fn receiving_time_cutoff(
    db: &DatabaseConnection,
    policy: &RetentionPolicy,
) -> Result<Option<DateTime<Utc>>, InboxError> {
    let backend = db.get_database_backend();
    let Some(newest) = read_timestamp(db, newest_received_at_sql(backend)?, None).await? else {
        return Ok(None);
    };
    let probe_sql = latest_received_at_or_before_sql(backend)?;
    let (mut walk, mut next) = ReceivingWalk::start(policy, newest, now_micros());
    loop {
        match next {
            WalkStep::Cutoff(cutoff) => return Ok(Some(cutoff)),
            WalkStep::Exhausted => return Ok(None),
            WalkStep::Probe(at) => match read_timestamp(db, probe_sql.clone(), Some(at)).await? {
                Some(earlier) => next = walk.advance(earlier),
                None => {
                    let oldest = read_timestamp(db, oldest_received_at_sql(backend)?, None).await?;
                    return Ok(oldest.and_then(|oldest| walk.finish(oldest)));
                }
            },
        }
    }
}

/// Reads the one timestamp a `SELECT MAX(received_at) ...` returns, binding `at` if given.
async fn read_timestamp(
    db: &DatabaseConnection,
    sql: String,
    at: Option<DateTime<Utc>>,
) -> Result<Option<DateTime<Utc>>, InboxError> {
    let backend = db.get_database_backend();
    let values = at.map(|at| timestamp_value(backend, at)).into_iter();
    let failed = |source| InboxError::Query {
        operation: "reading received_at for the retention cutoff",
        source,
    };
    let row = db
        .query_one_raw(Statement::from_sql_and_values(backend, sql, values))
        .await
        .map_err(failed)?;
    match row {
        Some(row) => row
            .try_get_by_index::<Option<DateTime<Utc>>>(0)
            .map_err(failed),
        None => Ok(None),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a walk over an in-memory timeline; returns the cutoff and the probes it took.
    fn walk(
        markers: &[DateTime<Utc>],
        policy: &RetentionPolicy,
        now: DateTime<Utc>,
    ) -> (Option<DateTime<Utc>>, usize) {
        let mut sorted = markers.to_vec();
        sorted.sort();
        let newest = *sorted.last().expect("a marker");
        let (mut state, mut next) = ReceivingWalk::start(policy, newest, now);
        let mut probes = 0;
        loop {
            match next {
                WalkStep::Cutoff(cutoff) => return (Some(cutoff), probes),
                WalkStep::Exhausted => return (None, probes),
                WalkStep::Probe(at) => {
                    probes += 1;
                    match sorted.iter().rev().find(|m| **m <= at) {
                        Some(earlier) => next = state.advance(*earlier),
                        None => return (state.finish(sorted[0]), probes + 1),
                    }
                }
            }
        }
    }

    fn every_minute(from: DateTime<Utc>, minutes: i64) -> Vec<DateTime<Utc>> {
        (0..=minutes)
            .map(|m| from + TimeDelta::minutes(m))
            .collect()
    }

    fn hour_window() -> RetentionPolicy {
        RetentionPolicy::with_window(Duration::from_secs(3_600)).expect("valid window")
    }

    #[test]
    fn steady_traffic_keeps_exactly_one_window() {
        let end = Utc::now();
        let markers = every_minute(end - TimeDelta::hours(3), 180);
        let (cutoff, probes) = walk(&markers, &hour_window(), end);
        assert_eq!(cutoff, Some(end - TimeDelta::hours(1)));
        assert!(probes <= 64, "{probes} probes");
    }

    #[test]
    fn an_outage_does_not_count_towards_the_window() {
        let now = Utc::now();
        let outage_began = now - TimeDelta::days(30);
        let mut markers = every_minute(outage_began - TimeDelta::hours(3), 180);
        markers.extend(every_minute(now - TimeDelta::minutes(20), 20));
        let (cutoff, _) = walk(&markers, &hour_window(), now);
        let cutoff = cutoff.expect("a window of receiving time exists");
        // 20 minutes after the outage, one probe step for the silence, the rest before it.
        let step = TimeDelta::seconds(3_600) / 64;
        assert_eq!(cutoff, outage_began - (TimeDelta::minutes(40) - step));
    }

    #[test]
    fn less_than_a_window_of_receiving_deletes_nothing() {
        let now = Utc::now();
        let markers = every_minute(now - TimeDelta::minutes(50), 50);
        assert_eq!(walk(&markers, &hour_window(), now).0, None);
    }

    #[test]
    fn sparse_history_costs_at_most_64_probes() {
        let now = Utc::now();
        let markers: Vec<_> = (0..10_000).map(|d| now - TimeDelta::days(d)).collect();
        let (cutoff, probes) = walk(&markers, &hour_window(), now);
        assert!(probes <= 65, "{probes} probes");
        assert!(
            cutoff.is_some_and(|c| c < now - TimeDelta::days(60)),
            "{cutoff:?}"
        );
    }

    #[test]
    fn a_clock_behind_the_newest_marker_walks_from_the_clock() {
        let now = Utc::now();
        let markers = every_minute(now - TimeDelta::hours(2), 180); // an hour in the future
        assert_eq!(
            walk(&markers, &hour_window(), now).0,
            Some(now - TimeDelta::hours(1))
        );
    }

    /// Daily cohorts 93 to 100 days old and today's traffic: with every silence counted
    /// as receiving, the cutoff lands exactly one window back, even where the last coarse
    /// probe steps past the oldest cohort.
    #[test]
    fn markers_within_the_last_step_still_count() {
        let now = Utc::now();
        let mut markers: Vec<_> = (93..=100).map(|d| now - TimeDelta::days(d)).collect();
        markers.push(now);
        let window = TimeDelta::days(100) - TimeDelta::hours(12);
        let policy = RetentionPolicy::with_window(window.to_std().expect("positive"))
            .and_then(|p| p.with_downtime_gap(RetentionPolicy::MAX_WINDOW))
            .expect("valid policy");
        assert_eq!(walk(&markers, &policy, now).0, Some(now - window));
    }

    #[test]
    fn the_downtime_gap_is_validated() {
        let policy = hour_window();
        assert_eq!(policy.downtime_gap(), Duration::from_secs(450));
        assert!(policy.with_downtime_gap(Duration::ZERO).is_err());
        assert!(
            policy
                .with_downtime_gap(RetentionPolicy::MAX_WINDOW * 2)
                .is_err()
        );
        assert!(policy.with_downtime_gap(Duration::from_secs(7_200)).is_ok());
    }
}
