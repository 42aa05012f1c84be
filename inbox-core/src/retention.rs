//! How long markers must be kept, and a purge that deletes older ones in bounded batches.

use crate::backend::{
    latest_received_at_or_before_sql, newest_received_at_sql, oldest_received_at_sql,
    purge_batch_sql, timestamp_value,
};
use crate::claim::now_micros;
use crate::clock::truncate_to_micros;
use crate::inbox::checked_partition_timeout;
use crate::metrics::facade;
use crate::pooler::in_own_transaction;
use crate::silence::answered_within;
use crate::{Inbox, InboxError};
use chrono::{DateTime, TimeDelta, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr, Statement, Value};
use std::time::{Duration, Instant};
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
/// **Retention clock.** A marker ages from the last moment it was in use: a completed
/// two-phase claim from its completion (`processed_at`; a lease may complete hours after
/// its first claim, and its delivery's ack may still be lost), every other marker from its
/// claim (`received_at`, written in the transaction that commits it with its work: keep
/// such transactions far shorter than the window). A marker goes once one window of
/// receiving time has passed since then. Unfinished and parked two-phase claims never go.
///
/// **Downtime rule.** The window is *receiving time*, not wall-clock time. The purge walks
/// back from the newest marker (or now, if the clock is behind it) through the markers'
/// own timeline of `received_at` and counts the stretches where markers are never further
/// apart than the [downtime gap](Self::with_downtime_gap) (by default an eighth of the
/// window). A longer silence counts as downtime, however long it lasted: the process was
/// down (or the queue idle, which only keeps markers longer). So after an outage longer
/// than the window, the markers of the last window before it survive, and they age out
/// only as new traffic accumulates receiving time: a broker that redelivers the in-flight
/// messages when the service comes back still meets their markers. (A wall-clock cutoff
/// would delete them all on the first purge after the outage; one measured from the
/// newest marker would delete them as soon as the first new message arrived.) The walk
/// reads at most 64 timestamps per purge, each one index probe: the newest, at most
/// [`MAX_GAPS_PER_WINDOW`](Self::MAX_GAPS_PER_WINDOW) steps back of
/// [`finest_downtime_gap`](Self::finest_downtime_gap) each, and the oldest. A silence
/// shorter than a step cannot be told apart, so the downtime gap is never finer than one.
/// The cutoff is cut to whole microseconds, the precision of the timestamps, on every
/// backend.
///
/// **Clock rule:** `received_at` and `processed_at` come from the writing process's clock
/// in UTC (the same clock the [lease rule](crate::LeaseOptions) reads), and the purge
/// walks back from the newest `received_at` or from the purging process's clock if that
/// is behind it. Keep replicas' clocks synchronised (NTP): a replica whose clock runs `s`
/// ahead writes markers that look `s` younger, so they are kept `s` longer (safe); one
/// whose clock runs `s` behind writes markers that go `s` early, so add the skew you
/// tolerate to the window.
///
/// **Pacing:** each purge statement deletes at most
/// [`batch_size`](Self::with_batch_size) rows; the [`PurgePacing`] (paced by default)
/// shrinks the batches to a time budget and rests between them, so claimers sharing the
/// database keep their latency. See [`PurgePacing`] for the trade-off.
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
    pacing: PurgePacing,
    partition_timeout: Duration,
}

impl RetentionPolicy {
    /// Rows one purge statement deletes unless [`with_batch_size`](Self::with_batch_size)
    /// says otherwise.
    pub const DEFAULT_BATCH_SIZE: u32 = 1_000;
    /// The default downtime gap is the window divided by this.
    pub const DEFAULT_GAPS_PER_WINDOW: u32 = 8;
    /// The downtime gap is at least the window divided by this, rounded up to a whole
    /// microsecond: the step of the purge's walk, which takes at most this many steps so
    /// that a purge reads at most 64 timestamps (see the downtime rule above).
    pub const MAX_GAPS_PER_WINDOW: u32 = 62;
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

    /// Keeps markers for `window` of receiving time (see the downtime rule above), with a
    /// downtime gap of an eighth of it.
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] for a zero window, one over
    /// [`MAX_WINDOW`](Self::MAX_WINDOW), or one under 8 µs, whose eighth is finer than
    /// the walk resolves (the rule of [`with_downtime_gap`](Self::with_downtime_gap)).
    pub fn with_window(window: Duration) -> Result<Self, InboxError> {
        if window.is_zero() || window > Self::MAX_WINDOW {
            return Err(InboxError::InvalidRetention {
                reason: format!(
                    "a window of {window:?} is outside (0, {:?}]: keep markers at least as long as the broker can redeliver",
                    Self::MAX_WINDOW
                ),
            });
        }
        let downtime_gap = window / Self::DEFAULT_GAPS_PER_WINDOW;
        check_downtime_gap(window, downtime_gap).map_err(|reason| {
            InboxError::InvalidRetention {
                reason: format!(
                    "{reason} (with_window takes an eighth of the window): give a window of at least 8µs, as long as the broker can redeliver"
                ),
            }
        })?;
        Ok(Self {
            window,
            downtime_gap,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            pacing: PurgePacing::default(),
            partition_timeout: Inbox::DEFAULT_PARTITION_TIMEOUT,
        })
    }

    /// A silence between markers longer than `gap` counts as downtime, not receiving time
    /// (see the downtime rule above). Shorter gaps keep markers a little longer after
    /// outages and idle stretches; longer ones let an outage shorter than `gap` count
    /// towards the window.
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] for a gap finer than
    /// [`finest_downtime_gap`](Self::finest_downtime_gap) (so never zero) or one over
    /// [`MAX_WINDOW`](Self::MAX_WINDOW).
    pub fn with_downtime_gap(self, gap: Duration) -> Result<Self, InboxError> {
        check_downtime_gap(self.window, gap).map_err(|reason| InboxError::InvalidRetention {
            reason: format!(
                "{reason}: give at least that, or a shorter window (a silence longer than the gap counts as downtime)"
            ),
        })?;
        Ok(Self {
            downtime_gap: gap,
            ..self
        })
    }

    /// Deletes at most `batch_size` rows per statement (each its own short transaction).
    /// With a [batch budget](PurgePacing::with_batch_budget) (the default) this is the
    /// ceiling the adaptive batch never exceeds.
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

    /// How the purge spaces its batches; [`PurgePacing::default`] unless set.
    ///
    /// ```
    /// use sea_orm_inbox::{PurgePacing, RetentionPolicy};
    /// use std::time::Duration;
    ///
    /// let unpaced = RetentionPolicy::with_window(Duration::from_secs(86_400))?
    ///     .with_pacing(PurgePacing::UNPACED);
    /// assert_eq!(unpaced.pacing(), PurgePacing::UNPACED);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn with_pacing(self, pacing: PurgePacing) -> Self {
        Self { pacing, ..self }
    }

    /// How the purge spaces its batches.
    pub fn pacing(&self) -> PurgePacing {
        self.pacing
    }

    /// Bounds how long the purge waits for each of its transactions (a DELETE batch, or
    /// the cutoff's walk: its at most 64 timestamp reads, in one) when the database
    /// stops answering (default [`Inbox::DEFAULT_PARTITION_TIMEOUT`]). A partition that
    /// drops packets without a reset would otherwise keep a [`purge`] (and a
    /// [`Purger`]'s run) waiting for as long as the kernel keeps the socket, hours by
    /// default. Past the bound the purge fails with [`InboxError::DatabaseSilent`]: the
    /// batches before it stay deleted, and a [`Purger`] counts the failure and tries
    /// again at its next run. Not applied on SQLite, which has no network to go silent.
    /// Choose it well above the slowest batch (see [`PurgePacing`]).
    ///
    /// ```
    /// use sea_orm_inbox::{InboxError, RetentionPolicy};
    /// use std::time::Duration;
    ///
    /// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?
    ///     .with_partition_timeout(Duration::from_secs(10))?;
    /// assert_eq!(policy.partition_timeout(), Duration::from_secs(10));
    /// assert!(matches!(
    ///     policy.with_partition_timeout(Duration::ZERO),
    ///     Err(InboxError::PartitionTimeoutOutOfRange { .. })
    /// ));
    /// # Ok::<(), InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`InboxError::PartitionTimeoutOutOfRange`] outside
    /// [`Inbox::MIN_PARTITION_TIMEOUT`]..=[`Inbox::MAX_PARTITION_TIMEOUT`].
    pub fn with_partition_timeout(self, timeout: Duration) -> Result<Self, InboxError> {
        Ok(Self {
            partition_timeout: checked_partition_timeout(timeout)?,
            ..self
        })
    }

    /// The bound on each purge statement against a silent database (see
    /// [`with_partition_timeout`](Self::with_partition_timeout)).
    pub fn partition_timeout(&self) -> Duration {
        self.partition_timeout
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

    /// The finest downtime gap this window accepts: the window divided by
    /// [`MAX_GAPS_PER_WINDOW`](Self::MAX_GAPS_PER_WINDOW), rounded up to a whole
    /// microsecond (the step of the purge's walk).
    ///
    /// ```
    /// use sea_orm_inbox::RetentionPolicy;
    /// use std::time::Duration;
    ///
    /// let hour = RetentionPolicy::with_window(Duration::from_secs(3_600))?;
    /// assert_eq!(hour.finest_downtime_gap(), Duration::from_micros(58_064_517));
    /// assert!(hour.with_downtime_gap(Duration::from_secs(1)).is_err());
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn finest_downtime_gap(&self) -> Duration {
        walk_step(self.window)
    }
}

/// The step of the receiving-time walk over `window`: a
/// [`RetentionPolicy::MAX_GAPS_PER_WINDOW`]th of it, rounded up to a whole microsecond,
/// so that the steps of one walk cover a window and land on the timestamps' precision.
fn walk_step(window: Duration) -> Duration {
    let per_step = window
        .as_nanos()
        .div_ceil(u128::from(RetentionPolicy::MAX_GAPS_PER_WINDOW));
    let micros = per_step.div_ceil(1_000).max(1);
    // A window of at most MAX_WINDOW makes at most 5e16 microseconds: it fits.
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
}

/// The one rule for a downtime gap, whether [`RetentionPolicy::with_window`] derives it or
/// [`RetentionPolicy::with_downtime_gap`] is given it; the error says what is wrong.
fn check_downtime_gap(window: Duration, gap: Duration) -> Result<(), String> {
    let finest = walk_step(window);
    if gap < finest || gap > RetentionPolicy::MAX_WINDOW {
        return Err(format!(
            "a downtime gap of {gap:?} is outside [{finest:?}, {:?}] for a window of {window:?}: the purge cannot tell apart silences shorter than the window / {} (or 1µs)",
            RetentionPolicy::MAX_WINDOW,
            RetentionPolicy::MAX_GAPS_PER_WINDOW,
        ));
    }
    Ok(())
}

/// How a purge spaces its DELETE statements so that claimers sharing the database keep
/// their latency: a budget of time per batch, and the share of time spent deleting.
///
/// Every batch holds locks (on SQLite, the one write lock) and competes for CPU and the
/// log with the claimers for as long as it runs, so a claimer that meets a batch waits up
/// to the batch's duration. With a **batch budget** the purge measures each DELETE and
/// sizes the next one to take about that long at the fastest rate seen so far, so time
/// spent waiting for a lock never shrinks it (never more rows than
/// [`RetentionPolicy::batch_size`], never fewer than [`MIN_BATCH`](Self::MIN_BATCH), at
/// most quadrupling or halving from one batch to the next, starting from 1,000 rows).
/// With a **busy share** below 100 %
/// it then rests in proportion to the work of the batch just run: at 80 % it rests a
/// quarter of each batch's duration, so claimers get the database to themselves a fifth
/// of the time. The budget bounds how long one claimer waits behind a batch (its p99);
/// the rest only shares the time, and costs the purge its rate one for one.
///
/// The default, a 20 ms budget and 90 % busy, keeps a batch shorter than a typical
/// claimer's worst wait and the purge near its unpaced rate (BENCHMARKS.md has the
/// trade-off curve measured on the three backends). [`UNPACED`](Self::UNPACED) runs
/// full batches back to back: the fastest purge, and the one claimers feel most.
///
/// ```
/// use sea_orm_inbox::{PurgePacing, RetentionPolicy};
/// use std::time::Duration;
///
/// // A nightly purge on a busy database: 10 ms batches, deleting half the time.
/// let pacing = PurgePacing::default()
///     .with_batch_budget(Duration::from_millis(10))?
///     .with_busy_percent(50)?;
/// let policy = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?
///     .with_batch_size(10_000)?
///     .with_pacing(pacing);
/// assert_eq!(policy.pacing().busy_percent(), 50);
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PurgePacing {
    batch_budget: Option<Duration>,
    busy_percent: u8,
}

impl PurgePacing {
    /// Full batches back to back, no budget, no rest: the purge before pacing existed.
    pub const UNPACED: Self = Self {
        batch_budget: None,
        busy_percent: 100,
    };
    /// The default time budget of one batch.
    pub const DEFAULT_BATCH_BUDGET: Duration = Duration::from_millis(20);
    /// The default share of time spent deleting, in percent.
    pub const DEFAULT_BUSY_PERCENT: u8 = 90;
    /// The smallest batch the budget shrinks to: below it, the statement's fixed cost
    /// dominates and the purge would fall behind the inflow.
    pub const MIN_BATCH: u32 = 10;
    /// The longest batch budget accepted.
    pub const MAX_BATCH_BUDGET: Duration = Duration::from_secs(60);

    /// Sizes each batch to take about `budget` (see above).
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] for a zero budget or one over
    /// [`MAX_BATCH_BUDGET`](Self::MAX_BATCH_BUDGET).
    pub fn with_batch_budget(self, budget: Duration) -> Result<Self, InboxError> {
        if budget.is_zero() || budget > Self::MAX_BATCH_BUDGET {
            return Err(InboxError::InvalidRetention {
                reason: format!(
                    "a batch budget of {budget:?} is outside (0, {:?}]: give the longest a claimer may wait behind one purge batch",
                    Self::MAX_BATCH_BUDGET
                ),
            });
        }
        Ok(Self {
            batch_budget: Some(budget),
            ..self
        })
    }

    /// Every batch takes [`RetentionPolicy::batch_size`] rows, however long it runs.
    pub fn without_batch_budget(self) -> Self {
        Self {
            batch_budget: None,
            ..self
        }
    }

    /// Spends `percent` of the purge's time deleting and rests the remainder.
    ///
    /// # Errors
    /// [`InboxError::InvalidRetention`] outside `1..=100`.
    pub fn with_busy_percent(self, percent: u8) -> Result<Self, InboxError> {
        if !(1..=100).contains(&percent) {
            return Err(InboxError::InvalidRetention {
                reason: format!(
                    "a busy share of {percent} % is outside 1..=100: 100 never rests, lower values rest longer between batches"
                ),
            });
        }
        Ok(Self {
            busy_percent: percent,
            ..self
        })
    }

    /// The time budget of one batch, if the batch size adapts to one.
    pub fn batch_budget(&self) -> Option<Duration> {
        self.batch_budget
    }

    /// The share of time spent deleting, in percent.
    pub fn busy_percent(&self) -> u8 {
        self.busy_percent
    }
}

impl Default for PurgePacing {
    /// A [`DEFAULT_BATCH_BUDGET`](Self::DEFAULT_BATCH_BUDGET) per batch,
    /// [`DEFAULT_BUSY_PERCENT`](Self::DEFAULT_BUSY_PERCENT) busy.
    fn default() -> Self {
        Self {
            batch_budget: Some(Self::DEFAULT_BATCH_BUDGET),
            busy_percent: Self::DEFAULT_BUSY_PERCENT,
        }
    }
}

/// The pacing of one purge, free of I/O: the size of the next batch, and the rest after
/// the last one.
///
/// Batches are sized from the fastest rate this purge has seen (seconds per row), not
/// from the last batch's duration: a DELETE that spent most of its time waiting for a
/// lock (on SQLite, for the claimers' write lock) held nothing meanwhile, and shrinking
/// the next batch for it would only add statements that wait again.
#[derive(Clone, Copy, Debug)]
struct Pacer {
    pacing: PurgePacing,
    ceiling: u64,
    next: u64,
    /// The least time per row measured so far, in seconds.
    fastest_row: Option<f64>,
}

impl Pacer {
    fn new(policy: &RetentionPolicy) -> Self {
        let ceiling = u64::from(policy.batch_size);
        let next = match policy.pacing.batch_budget {
            // Start below most budgets and grow: the first batch of a cold purge is its
            // slowest. (At 100 rows, seven batches of doubling went by before a purge on
            // PostgreSQL deleted at its rate: most of a 40,000-row purge, measured.)
            Some(_) => ceiling.min(u64::from(PurgePacing::MIN_BATCH) * 100),
            None => ceiling,
        };
        Self {
            pacing: policy.pacing,
            ceiling,
            next,
            fastest_row: None,
        }
    }

    /// Rows the next DELETE may remove.
    fn batch(&self) -> u64 {
        self.next
    }

    /// Takes a full batch that ran for `took`; returns how long to rest before the next.
    fn full_batch(&mut self, took: Duration) -> Duration {
        let rows = self.next.max(1) as f64;
        let per_row = took.as_secs_f64() / rows;
        let fastest = self.fastest_row.map_or(per_row, |best| best.min(per_row));
        self.fastest_row = Some(fastest);
        if let Some(budget) = self.pacing.batch_budget {
            let floor = u64::from(PurgePacing::MIN_BATCH).min(self.ceiling);
            let fitting = if fastest > 0.0 {
                (budget.as_secs_f64() / fastest)
                    .round()
                    .clamp(0.0, u64::MAX as f64) as u64
            } else {
                u64::MAX
            };
            self.next = fitting
                .clamp(self.next / 2, self.next.saturating_mul(4))
                .clamp(floor, self.ceiling);
        }
        // The rest follows the work the batch did, not the time it waited for locks.
        let worked = took.min(Duration::from_secs_f64(fastest * rows));
        let busy = u32::from(self.pacing.busy_percent.clamp(1, 100));
        worked * (100 - busy) / busy
    }
}

/// The receiving-time walk of the downtime rule, one probe at a time, free of I/O.
///
/// Each probe asks for the newest marker at or before `at - step`; the stretch back to it
/// counts in full when it is no longer than the downtime gap, and as one `step` otherwise
/// (the probe cannot see into the last `step` before `at`, so that much may have been
/// receiving). Every probe but the last adds at least `step`, and
/// [`MAX_GAPS_PER_WINDOW`](RetentionPolicy::MAX_GAPS_PER_WINDOW) steps cover the window,
/// so a walk makes at most that many probes, whatever the gap (which the policy keeps no
/// finer than a step: a finer one would count every silence as a step all the same).
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
    fn start(
        policy: &RetentionPolicy,
        newest: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> (Self, WalkStep) {
        // `with_window` bounds all three durations to a hundred years: they convert.
        let window = TimeDelta::from_std(policy.window).unwrap_or(TimeDelta::MAX);
        let gap = TimeDelta::from_std(policy.downtime_gap).unwrap_or(window);
        let step = TimeDelta::from_std(walk_step(policy.window)).unwrap_or(window);
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
                .map(truncate_to_micros)
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
        self.at.checked_sub_signed(missing).map(truncate_to_micros)
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
    /// Time spent in DELETE statements.
    pub deleting: Duration,
    /// Time spent resting between batches, as the [`PurgePacing`] asked.
    pub resting: Duration,
}

/// Deletes the markers last used before the policy's cutoff (a completed two-phase claim
/// at its completion, every other marker at its claim: the retention clock of
/// [`RetentionPolicy`]), in batches of at most [`RetentionPolicy::batch_size`] rows, each
/// one DELETE statement committed on its own, spaced as the policy's [`PurgePacing`] says,
/// until a batch comes back short.
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
    purge_until(db, policy, &mut StopSignal::Never).await
}

/// Whether a purge should stop between batches: never for [`purge`], on request (or when
/// its [`Purger`] is dropped) for a background purger.
enum StopSignal<'a> {
    Never,
    Watch(&'a mut watch::Receiver<bool>),
}

impl StopSignal<'_> {
    fn requested(&self) -> bool {
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
async fn purge_until(
    db: &DatabaseConnection,
    policy: &RetentionPolicy,
    stop: &mut StopSignal<'_>,
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
    let mut pacer = Pacer::new(policy);
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
        let delete = in_own_transaction(db, async |txn| txn.execute_raw(statement).await);
        let deleted = answered_within(db, policy.partition_timeout, operation, delete)
            .await?
            .map_err(failed(operation))?
            .rows_affected();
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
        let rest = pacer.full_batch(took);
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
    policy: &RetentionPolicy,
) -> Result<Option<DateTime<Utc>>, InboxError> {
    let backend = db.get_database_backend();
    let newest_sql = newest_received_at_sql(backend)?;
    let probe_sql = latest_received_at_or_before_sql(backend)?;
    let oldest_sql = oldest_received_at_sql(backend)?;
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
    answered_within(db, policy.partition_timeout, operation, walk)
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

/// Spawns a tokio task that runs [`purge`] now and then every `every`, until
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
            match purge_until(&db, &policy, &mut stop).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a walk over an in-memory timeline as `receiving_time_cutoff` runs it over the
    /// index; returns the cutoff and the timestamps it read (the newest, the probes and
    /// the oldest, if asked for). The tests' instants are whole microseconds
    /// (`now_micros`), as the database returns them.
    fn walk(
        markers: &[DateTime<Utc>],
        policy: &RetentionPolicy,
        now: DateTime<Utc>,
    ) -> (Option<DateTime<Utc>>, usize) {
        let mut sorted = markers.to_vec();
        sorted.sort();
        let newest = *sorted.last().expect("a marker");
        let (mut state, mut next) = ReceivingWalk::start(policy, newest, now);
        let mut reads = 1;
        loop {
            match next {
                WalkStep::Cutoff(cutoff) => return (Some(cutoff), reads),
                WalkStep::Exhausted => return (None, reads),
                WalkStep::Probe(at) => {
                    reads += 1;
                    match sorted.iter().rev().find(|m| **m <= at) {
                        Some(earlier) => next = state.advance(*earlier),
                        None => return (state.finish(sorted[0]), reads + 1),
                    }
                }
            }
        }
    }

    fn step_of(policy: &RetentionPolicy) -> TimeDelta {
        TimeDelta::from_std(policy.finest_downtime_gap()).expect("a short step")
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
        let end = now_micros();
        let markers = every_minute(end - TimeDelta::hours(3), 180);
        let (cutoff, reads) = walk(&markers, &hour_window(), end);
        assert_eq!(cutoff, Some(end - TimeDelta::hours(1)));
        assert!(reads <= 64, "{reads} reads");
    }

    #[test]
    fn an_outage_does_not_count_towards_the_window() {
        let now = now_micros();
        let outage_began = now - TimeDelta::days(30);
        let mut markers = every_minute(outage_began - TimeDelta::hours(3), 180);
        markers.extend(every_minute(now - TimeDelta::minutes(20), 20));
        let (cutoff, _) = walk(&markers, &hour_window(), now);
        let cutoff = cutoff.expect("a window of receiving time exists");
        // 20 minutes after the outage, one probe step for the silence, the rest before it.
        let step = step_of(&hour_window());
        assert_eq!(cutoff, outage_began - (TimeDelta::minutes(40) - step));
    }

    #[test]
    fn less_than_a_window_of_receiving_deletes_nothing() {
        let now = now_micros();
        let markers = every_minute(now - TimeDelta::minutes(50), 50);
        assert_eq!(walk(&markers, &hour_window(), now).0, None);
    }

    #[test]
    fn sparse_history_costs_at_most_64_reads() {
        let now = now_micros();
        let markers: Vec<_> = (0..10_000).map(|d| now - TimeDelta::days(d)).collect();
        let (cutoff, reads) = walk(&markers, &hour_window(), now);
        assert!(reads <= 64, "{reads} reads");
        assert!(
            cutoff.is_some_and(|c| c < now - TimeDelta::days(60)),
            "{cutoff:?}"
        );
    }

    #[test]
    fn a_clock_behind_the_newest_marker_walks_from_the_clock() {
        let now = now_micros();
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
        let now = now_micros();
        let mut markers: Vec<_> = (93..=100).map(|d| now - TimeDelta::days(d)).collect();
        markers.push(now);
        let window = TimeDelta::days(100) - TimeDelta::hours(12);
        let policy = RetentionPolicy::with_window(window.to_std().expect("positive"))
            .and_then(|p| p.with_downtime_gap(RetentionPolicy::MAX_WINDOW))
            .expect("valid policy");
        assert_eq!(walk(&markers, &policy, now).0, Some(now - window));
    }

    /// Every window the policy accepts, with its finest, default and coarsest gaps, over
    /// timelines denser and sparser than a step: never more than 64 reads. (A 1 s gap on
    /// an hour made 3,601 when the step followed the gap.)
    #[test]
    fn every_accepted_window_and_gap_costs_at_most_64_reads() {
        let now = now_micros();
        let windows = [
            Duration::from_micros(8),
            Duration::from_nanos(9_500),
            Duration::from_micros(100),
            Duration::from_secs(1),
            Duration::from_secs(3_600),
            Duration::from_secs(3_600) + Duration::from_nanos(1),
            Duration::from_secs(7 * 86_400),
            RetentionPolicy::MAX_WINDOW,
        ];
        for window in windows {
            let policy = RetentionPolicy::with_window(window).expect("a valid window");
            let finest = policy.finest_downtime_gap();
            for gap in [
                finest,
                finest * 3 / 2,
                window / 8,
                RetentionPolicy::MAX_WINDOW,
            ] {
                let policy = policy.with_downtime_gap(gap).expect("a valid gap");
                let step = step_of(&policy);
                for spacing in [step / 3, step / 2, step, step * 3 / 2, step * 5] {
                    let spacing = spacing.max(TimeDelta::microseconds(1));
                    let markers: Vec<_> = (0..400).map(|n| now - spacing * n).collect();
                    let (_, reads) = walk(&markers, &policy, now);
                    assert!(
                        reads <= 64,
                        "{reads} reads: window {window:?}, gap {gap:?}, spacing {spacing:?}"
                    );
                }
            }
        }
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
        let finest = policy.finest_downtime_gap();
        assert_eq!(finest, Duration::from_micros(58_064_517), "3600 s / 62, up");
        assert!(policy.with_downtime_gap(finest).is_ok());
        assert!(
            policy
                .with_downtime_gap(finest - Duration::from_micros(1))
                .is_err()
        );
    }

    /// One rule for a derived gap and a given one: a window whose eighth is finer than
    /// the walk resolves (a microsecond) is refused like that gap would be.
    #[test]
    fn a_window_too_short_for_its_default_gap_is_refused() {
        for window in [
            Duration::from_nanos(1),
            Duration::from_nanos(7),
            Duration::from_nanos(7_999),
        ] {
            let Err(InboxError::InvalidRetention { reason }) = RetentionPolicy::with_window(window)
            else {
                panic!("a window of {window:?} has a default gap under 1 µs");
            };
            assert!(reason.contains("at least 8µs"), "{reason}");
        }
        let shortest = RetentionPolicy::with_window(Duration::from_micros(8)).expect("8 µs");
        assert_eq!(shortest.downtime_gap(), Duration::from_micros(1));
        assert_eq!(shortest.finest_downtime_gap(), Duration::from_micros(1));
    }

    #[test]
    fn cutoffs_are_cut_down_to_whole_microseconds() {
        let at = DateTime::from_timestamp(1_000, 123_456_789).expect("a valid instant");
        assert_eq!(
            Some(truncate_to_micros(at)),
            DateTime::from_timestamp(1_000, 123_456_000)
        );
        let before_1970 = DateTime::from_timestamp(-1, 999_999_500).expect("a valid instant");
        assert_eq!(
            Some(truncate_to_micros(before_1970)),
            DateTime::from_timestamp(-1, 999_999_000),
            "down, not towards zero"
        );
        // A window of an hour and 500 ns over steady traffic: the cutoff lands 1 µs lower.
        let end = DateTime::from_timestamp(1_800_000_000, 0).expect("a valid instant");
        let markers = every_minute(end - TimeDelta::hours(3), 180);
        let policy =
            RetentionPolicy::with_window(Duration::from_secs(3_600) + Duration::from_nanos(500))
                .expect("a valid window");
        assert_eq!(
            walk(&markers, &policy, end).0,
            Some(end - TimeDelta::hours(1) - TimeDelta::microseconds(1))
        );
    }

    fn paced(budget_ms: u64, busy: u8, ceiling: u32) -> Pacer {
        let pacing = PurgePacing::default()
            .with_batch_budget(Duration::from_millis(budget_ms))
            .and_then(|p| p.with_busy_percent(busy))
            .expect("valid pacing");
        let policy = hour_window()
            .with_batch_size(ceiling)
            .expect("valid batch size")
            .with_pacing(pacing);
        Pacer::new(&policy)
    }

    #[test]
    fn unpaced_purges_run_full_batches_back_to_back() {
        let policy = hour_window()
            .with_batch_size(5_000)
            .expect("valid batch size")
            .with_pacing(PurgePacing::UNPACED);
        let mut pacer = Pacer::new(&policy);
        assert_eq!(pacer.batch(), 5_000);
        assert_eq!(pacer.full_batch(Duration::from_secs(3)), Duration::ZERO);
        assert_eq!(pacer.batch(), 5_000);
    }

    #[test]
    fn the_batch_follows_its_time_budget_within_bounds() {
        let mut pacer = paced(20, 100, 100_000);
        assert_eq!(pacer.batch(), 1_000, "a paced purge starts at 1,000 rows");
        // 1,000 rows in 10 ms: 10 us a row, 2,000 fit the 20 ms budget.
        pacer.full_batch(Duration::from_millis(10));
        assert_eq!(pacer.batch(), 2_000);
        // 2,000 rows in 2 ms: 1 us a row, 20,000 fit, but a batch at most quadruples.
        pacer.full_batch(Duration::from_millis(2));
        assert_eq!(pacer.batch(), 8_000);
        // 8,000 rows in 8 ms: 20,000 fit.
        pacer.full_batch(Duration::from_millis(8));
        assert_eq!(pacer.batch(), 20_000);
        // A batch that waited a second for a lock does not shrink the next one.
        pacer.full_batch(Duration::from_secs(1));
        assert_eq!(pacer.batch(), 20_000);
        // 20,000 rows in 200 ms: 10 us a row is no faster than seen, the batch stays.
        pacer.full_batch(Duration::from_millis(200));
        assert_eq!(pacer.batch(), 20_000);
        for _ in 0..20 {
            pacer.full_batch(Duration::from_micros(1));
        }
        assert_eq!(
            pacer.batch(),
            100_000,
            "never above the policy's batch size"
        );
    }

    #[test]
    fn slow_rows_shrink_the_batch_to_at_least_min_batch() {
        let mut pacer = paced(20, 100, 10_000);
        // 1 ms a row: 20 rows fit, reached by halving at most.
        for (took_ms, next) in [(1_000, 500), (500, 250), (250, 125), (125, 62), (62, 31)] {
            pacer.full_batch(Duration::from_millis(took_ms));
            assert_eq!(pacer.batch(), next);
        }
        pacer.full_batch(Duration::from_millis(31));
        assert_eq!(pacer.batch(), 20);
        let mut tight = paced(1, 100, 10_000);
        for _ in 0..10 {
            tight.full_batch(Duration::from_secs(1));
        }
        assert_eq!(tight.batch(), u64::from(PurgePacing::MIN_BATCH));
    }

    #[test]
    fn the_rest_is_in_proportion_to_the_batch() {
        let mut pacer = paced(20, 80, 1_000);
        assert_eq!(
            pacer.full_batch(Duration::from_millis(100)),
            Duration::from_millis(25)
        );
        let mut half = paced(20, 50, 1_000);
        assert_eq!(
            half.full_batch(Duration::from_millis(30)),
            Duration::from_millis(30)
        );
        // The rest follows the work: 1,000 rows at 10 us, however long the lock wait was.
        let mut waited = paced(20, 50, 1_000);
        waited.full_batch(Duration::from_millis(10));
        assert_eq!(
            waited.full_batch(Duration::from_secs(1)),
            Duration::from_millis(10)
        );
        let mut tiny = paced(20, 100, 5);
        assert_eq!(tiny.batch(), 5, "a ceiling below the start wins");
        assert_eq!(tiny.full_batch(Duration::from_secs(1)), Duration::ZERO);
        assert_eq!(tiny.batch(), 5, "and below MIN_BATCH too");
    }

    #[test]
    fn pacing_settings_are_validated() {
        let pacing = PurgePacing::default();
        assert_eq!(
            pacing.batch_budget(),
            Some(PurgePacing::DEFAULT_BATCH_BUDGET)
        );
        assert_eq!(pacing.busy_percent(), PurgePacing::DEFAULT_BUSY_PERCENT);
        assert!(pacing.with_batch_budget(Duration::ZERO).is_err());
        assert!(pacing.with_batch_budget(Duration::from_secs(61)).is_err());
        assert!(pacing.with_busy_percent(0).is_err());
        assert!(pacing.with_busy_percent(101).is_err());
        assert_eq!(pacing.without_batch_budget().batch_budget(), None);
        assert_eq!(hour_window().pacing(), PurgePacing::default());
    }
}
