//! The settings of a purge: what the broker may redeliver, how long markers are kept,
//! and how the DELETE statements are paced.

use super::walk::walk_step;
use crate::backend::default_purge_batch_budget;
use crate::inbox::checked_partition_timeout;
use crate::{Inbox, InboxError};
use sea_orm::DbBackend;
use std::time::Duration;

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
    /// Rows one purge statement deletes at most unless
    /// [`with_batch_size`](Self::with_batch_size) says otherwise. With the default
    /// [`PurgePacing`] the batch budget sizes the batches below it; a ceiling of 1,000 (the
    /// default before) made a purge pay for ten times the batches a hand-written batched
    /// DELETE runs (each its commit; on SQLite, its wait for the write lock).
    pub const DEFAULT_BATCH_SIZE: u32 = 10_000;
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

    /// Bounds how long the purge waits for each of its transactions (a DELETE batch, or the
    /// cutoff's walk: its at most 64 timestamp reads, in one) when the database stops answering
    /// (default [`Inbox::DEFAULT_PARTITION_TIMEOUT`]). A partition that drops packets without a
    /// reset would otherwise keep a [`purge`](crate::purge) (and a [`Purger`](crate::Purger)'s
    /// run) waiting for as long as the kernel keeps the socket, hours by default. Past the
    /// bound the purge fails with [`InboxError::DatabaseSilent`]: the batches before it stay
    /// deleted, and a [`Purger`](crate::Purger) counts the failure and tries again at its next
    /// run. Not applied on SQLite, which has no network to go silent. Choose it well above the
    /// slowest batch (see [`PurgePacing`]).
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
    ///     Err(InboxError::OutOfRange { .. })
    /// ));
    /// # Ok::<(), InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] outside
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
/// The default budget depends on the backend. On SQLite, where a batch holds the
/// database's one write lock, it is [`DEFAULT_BATCH_BUDGET`](Self::DEFAULT_BATCH_BUDGET)
/// (20 ms), shorter than a claimer's typical worst wait: a 100 ms budget raised the SQLite
/// claimers' p99 from 1.1x to 2.8x of their p99 alone in the benchmark. On PostgreSQL and
/// MariaDB a batch locks only the rows it deletes, which no claimer touches (MariaDB
/// counted no row lock wait of a claimer beside 300 ms batches), so the budget there only
/// sets how many batches a purge pays for (each one commits):
/// [`DEFAULT_SERVER_BATCH_BUDGET`](Self::DEFAULT_SERVER_BATCH_BUDGET) (100 ms). At 20 ms,
/// MariaDB's batches stopped near 2,000 rows, five times the statements of a hand-written
/// batched DELETE of 10,000. On every backend batches grow up to
/// [`RetentionPolicy::batch_size`] (10,000 rows by default) where the database deletes
/// that many within the budget. The default busy share is 90 %: the rest after each batch
/// makes the purge queue for its next batch behind the claimers instead of taking the lock
/// again before they wake up (on SQLite, without a rest, their p99 rose four- to
/// sevenfold), and on a server it is what leaves the claimers a share of the CPU and the
/// log. BENCHMARKS.md has the trade-off curve measured on the three backends.
/// [`UNPACED`](Self::UNPACED) runs full batches back to back: the fastest purge, and the
/// one claimers feel most.
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
    batch_budget: Budget,
    busy_percent: u8,
}

/// The batch budget of a [`PurgePacing`]: the backend's default until one is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Budget {
    BackendDefault,
    Set(Duration),
    Unbounded,
}

impl PurgePacing {
    /// Full batches back to back, no budget, no rest: the purge before pacing existed.
    pub const UNPACED: Self = Self {
        batch_budget: Budget::Unbounded,
        busy_percent: 100,
    };
    /// The default time budget of one batch on SQLite (see above).
    pub const DEFAULT_BATCH_BUDGET: Duration = Duration::from_millis(20);
    /// The default time budget of one batch on PostgreSQL and MariaDB (see above).
    pub const DEFAULT_SERVER_BATCH_BUDGET: Duration = Duration::from_millis(100);
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
            batch_budget: Budget::Set(budget),
            ..self
        })
    }

    /// Every batch takes [`RetentionPolicy::batch_size`] rows, however long it runs.
    pub fn without_batch_budget(self) -> Self {
        Self {
            batch_budget: Budget::Unbounded,
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

    /// The time budget of one batch on `backend`, if the batch size adapts to one: the
    /// budget set, or the backend's default (see above). One getter for the one fact: a
    /// default pacing's budget exists only on a backend.
    ///
    /// ```
    /// use sea_orm::DbBackend;
    /// use sea_orm_inbox::PurgePacing;
    /// use std::time::Duration;
    ///
    /// let pacing = PurgePacing::default();
    /// assert_eq!(pacing.batch_budget(DbBackend::Sqlite), Some(Duration::from_millis(20)));
    /// assert_eq!(pacing.batch_budget(DbBackend::MySql), Some(Duration::from_millis(100)));
    /// let set = pacing.with_batch_budget(Duration::from_millis(10))?;
    /// assert_eq!(set.batch_budget(DbBackend::Postgres), Some(Duration::from_millis(10)));
    /// assert_eq!(pacing.without_batch_budget().batch_budget(DbBackend::Sqlite), None);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn batch_budget(&self, backend: DbBackend) -> Option<Duration> {
        match self.batch_budget {
            Budget::BackendDefault => Some(default_purge_batch_budget(backend)),
            Budget::Set(budget) => Some(budget),
            Budget::Unbounded => None,
        }
    }

    /// The share of time spent deleting, in percent.
    pub fn busy_percent(&self) -> u8 {
        self.busy_percent
    }
}

impl Default for PurgePacing {
    /// The backend's default budget per batch
    /// ([`DEFAULT_BATCH_BUDGET`](Self::DEFAULT_BATCH_BUDGET) on SQLite,
    /// [`DEFAULT_SERVER_BATCH_BUDGET`](Self::DEFAULT_SERVER_BATCH_BUDGET) on PostgreSQL and
    /// MariaDB), [`DEFAULT_BUSY_PERCENT`](Self::DEFAULT_BUSY_PERCENT) busy.
    fn default() -> Self {
        Self {
            batch_budget: Budget::BackendDefault,
            busy_percent: Self::DEFAULT_BUSY_PERCENT,
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::retention) fn hour_window() -> RetentionPolicy {
        RetentionPolicy::with_window(Duration::from_secs(3_600)).expect("valid window")
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
    fn pacing_settings_are_validated() {
        let pacing = PurgePacing::default();
        assert_eq!(
            pacing.batch_budget(DbBackend::Sqlite),
            Some(PurgePacing::DEFAULT_BATCH_BUDGET)
        );
        for server in [DbBackend::Postgres, DbBackend::MySql] {
            assert_eq!(
                pacing.batch_budget(server),
                Some(PurgePacing::DEFAULT_SERVER_BATCH_BUDGET)
            );
        }
        assert_eq!(pacing.busy_percent(), PurgePacing::DEFAULT_BUSY_PERCENT);
        assert!(pacing.with_batch_budget(Duration::ZERO).is_err());
        assert!(pacing.with_batch_budget(Duration::from_secs(61)).is_err());
        assert!(pacing.with_busy_percent(0).is_err());
        assert!(pacing.with_busy_percent(101).is_err());
        assert_eq!(
            pacing
                .without_batch_budget()
                .batch_budget(DbBackend::Postgres),
            None
        );
        assert_eq!(hour_window().pacing(), PurgePacing::default());
    }
}
