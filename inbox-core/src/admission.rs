//! The admission floor: refusing a delivery so old that its marker may already be purged.
//!
//! The inbox deduplicates only while a message's marker exists, and the retention purge
//! deletes markers once they are older than its window. A redelivery that arrives after
//! that (a dead-letter queue replayed too late, a consumer group reset to an old offset)
//! finds no marker and would run the handler a second time. Brokers stamp every message
//! with the time it was first sent; given that time, the floor refuses a delivery whose
//! marker the purge may have deleted, before any SQL runs, and the caller dead-letters it.

use crate::{InboxError, MessageId, RetentionPolicy};
use chrono::{DateTime, TimeDelta, Utc};
use std::fmt;
use std::time::Duration;
use uuid::Uuid;

/// One delivery of a message: its key, and optionally the time its sender first sent it.
///
/// Every function that admits a delivery ([`Inbox::process`](crate::Inbox::process),
/// [`claim_message`](crate::InboxTransactionExt::claim_message),
/// [`claim_batch`](crate::InboxTransactionExt::claim_batch), [`claim_lease`](crate::claim_lease))
/// takes `impl Into<Delivery>`, so a bare [`MessageId`] or [`Uuid`] still works and is
/// admitted as before. With a send time and an [`AdmissionFloor`] (the inbox's, or one the
/// delivery carries), a delivery too old to deduplicate safely is refused.
///
/// Take the send time from the broker, never from when this process received the message:
/// RabbitMQ's `timestamp` property, a CloudEvent's `time`, a Kafka record's timestamp, a
/// JetStream message's metadata timestamp, or a time your producer writes once. It must be
/// the same on every redelivery.
///
/// ```
/// use sea_orm_inbox::{Delivery, MessageId};
/// use chrono::{DateTime, Utc};
///
/// let id = MessageId::from_broker_id("order-42")?;
/// // A Kafka record's timestamp, in milliseconds since the epoch.
/// let sent: DateTime<Utc> = DateTime::from_timestamp_millis(1_767_225_600_000).unwrap_or_default();
/// let delivery = Delivery::new(id).sent_at(sent);
/// assert_eq!(delivery.message_id(), id);
/// assert_eq!(delivery.sent_time(), Some(sent));
/// assert_eq!(Delivery::from(id).sent_time(), None);
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivery {
    message_id: MessageId,
    sent_at: Option<DateTime<Utc>>,
    floor: Option<AdmissionFloor>,
}

impl Delivery {
    /// A delivery of `message_id` with no send time: admitted as before the floor existed.
    pub fn new(message_id: impl Into<MessageId>) -> Self {
        Self {
            message_id: message_id.into(),
            sent_at: None,
            floor: None,
        }
    }

    /// The time the message was first sent, by the sender's clock (a `SystemTime` or any
    /// `DateTime` converts).
    pub fn sent_at(self, sent_at: impl Into<DateTime<Utc>>) -> Self {
        Self {
            sent_at: Some(sent_at.into()),
            ..self
        }
    }

    /// Checks this delivery against `floor` as well, wherever it is admitted: the way to
    /// give the claim functions, which have no [`Inbox`](crate::Inbox) to configure, a
    /// floor.
    pub fn with_floor(self, floor: AdmissionFloor) -> Self {
        Self {
            floor: Some(floor),
            ..self
        }
    }

    /// The message's key.
    pub fn message_id(&self) -> MessageId {
        self.message_id
    }

    /// The send time, if one was given.
    pub fn sent_time(&self) -> Option<DateTime<Utc>> {
        self.sent_at
    }

    /// The floor this delivery carries, if any.
    pub fn floor(&self) -> Option<AdmissionFloor> {
        self.floor
    }

    /// Admits or refuses this delivery at `now` by its own floor and `also` (the inbox's).
    /// A delivery without a send time, or with no floor, is admitted.
    pub(crate) fn admit(
        &self,
        also: Option<AdmissionFloor>,
        now: DateTime<Utc>,
    ) -> Result<(), Refusal> {
        let Some(sent_at) = self.sent_at else {
            return Ok(());
        };
        [self.floor, also]
            .into_iter()
            .flatten()
            .try_for_each(|floor| floor.check(sent_at, now))
    }
}

impl From<MessageId> for Delivery {
    fn from(message_id: MessageId) -> Self {
        Self::new(message_id)
    }
}

impl From<Uuid> for Delivery {
    fn from(uuid: Uuid) -> Self {
        Self::new(uuid)
    }
}

/// The oldest send time a delivery may have and still be admitted: the retention window
/// minus a clock-skew margin, counted back from now.
///
/// **Why.** A marker protects its message only until the purge deletes it, one
/// [retention window](RetentionPolicy) after it was written. A redelivery sent earlier
/// than the window may find its marker gone and run the handler again; the floor refuses
/// it instead ([`Outcome::Refused`](crate::Outcome::Refused),
/// [`Settlement::DeadLetter`](crate::Settlement::DeadLetter)): dead-letter it and let a
/// human decide. Nothing is written and the handler does not run.
///
/// **The margin** absorbs clock skew: a delivery is refused when its send time is more
/// than `window - margin` before this process's clock, or more than `margin` after it
/// (a sender clock that far ahead would let its late redeliveries past the floor). Choose
/// it at least the total skew between the senders' clocks and this process's plus the
/// skew between the purging process and the claiming replicas (NTP keeps each well under
/// a second; a few seconds to minutes is typical). It must be above zero and below the
/// window.
///
/// **Relation to retention.** The floor refuses what the broker could still legitimately
/// redeliver in the last `margin` of the window, so size the window with the margin on
/// top: e.g. add it to [`BrokerRedelivery::dead_letter_replay_margin`](crate::BrokerRedelivery).
/// The purge counts its window in receiving time (downtime does not count), so markers
/// live at least a window of wall-clock time, never less: a floor counted in wall-clock
/// time refuses conservatively.
///
/// ```
/// use sea_orm_inbox::{AdmissionFloor, Inbox, InboxError, RetentionPolicy};
/// use std::time::Duration;
///
/// let retention = RetentionPolicy::with_window(Duration::from_secs(7 * 86_400))?;
/// let floor = AdmissionFloor::new(&retention, Duration::from_secs(300))?;
/// let inbox = Inbox::new("billing.credit")?.with_admission_floor(floor);
/// assert_eq!(inbox.admission_floor(), Some(floor));
/// assert!(matches!(
///     AdmissionFloor::new(&retention, Duration::from_secs(8 * 86_400)),
///     Err(InboxError::InvalidAdmissionFloor { .. })
/// ));
/// # Ok::<(), InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AdmissionFloor {
    /// `window - margin`: the oldest age admitted.
    oldest: TimeDelta,
    /// How far ahead of this clock a send time may be.
    ahead: TimeDelta,
    window: Duration,
    margin: Duration,
}

impl AdmissionFloor {
    /// The floor for markers kept by `retention`, with `margin` for clock skew.
    ///
    /// # Errors
    /// [`InboxError::InvalidAdmissionFloor`] when `margin` is zero or not below the
    /// retention window.
    pub fn new(retention: &RetentionPolicy, margin: Duration) -> Result<Self, InboxError> {
        let window = retention.window();
        let invalid = || InboxError::InvalidAdmissionFloor { margin, window };
        if margin.is_zero() || margin >= window {
            return Err(invalid());
        }
        // `RetentionPolicy` bounds the window to a hundred years: both conversions succeed.
        let oldest = TimeDelta::from_std(window - margin).map_err(|_| invalid())?;
        let ahead = TimeDelta::from_std(margin).map_err(|_| invalid())?;
        Ok(Self {
            oldest,
            ahead,
            window,
            margin,
        })
    }

    /// The retention window the floor protects.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The clock-skew margin.
    pub fn margin(&self) -> Duration {
        self.margin
    }

    /// Whether a message sent at `sent_at` may be admitted at `now` (both UTC).
    ///
    /// ```
    /// use sea_orm_inbox::{AdmissionFloor, Refusal, RetentionPolicy};
    /// use chrono::{TimeDelta, Utc};
    /// use std::time::Duration;
    ///
    /// let retention = RetentionPolicy::with_window(Duration::from_secs(3_600))?;
    /// let floor = AdmissionFloor::new(&retention, Duration::from_secs(60))?;
    /// let now = Utc::now();
    /// assert!(floor.check(now - TimeDelta::minutes(58), now).is_ok());
    /// assert!(matches!(
    ///     floor.check(now - TimeDelta::minutes(60), now),
    ///     Err(Refusal::BeforeFloor { .. })
    /// ));
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`Refusal::BeforeFloor`] when `sent_at` is more than `window - margin` before
    /// `now`; [`Refusal::AheadOfClock`] when it is more than `margin` after `now`.
    pub fn check(&self, sent_at: DateTime<Utc>, now: DateTime<Utc>) -> Result<(), Refusal> {
        // An instant beyond chrono's range has no floor (or no ceiling) to cross.
        if let Some(floor) = now.checked_sub_signed(self.oldest)
            && sent_at < floor
        {
            return Err(Refusal::BeforeFloor { sent_at, floor });
        }
        if let Some(latest) = now.checked_add_signed(self.ahead)
            && sent_at > latest
        {
            return Err(Refusal::AheadOfClock { sent_at, latest });
        }
        Ok(())
    }
}

/// Why an [`AdmissionFloor`] refused a delivery. Either way: dead-letter it
/// ([`Settlement::DeadLetter`](crate::Settlement::DeadLetter)), do not run it and do not
/// requeue it; nothing was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// Sent before the floor: its marker may already be purged, so running it could apply
    /// it a second time.
    BeforeFloor {
        /// The delivery's send time.
        sent_at: DateTime<Utc>,
        /// The oldest send time admitted when it arrived.
        floor: DateTime<Utc>,
    },
    /// Sent, by its sender's clock, further in the future than the margin allows: the
    /// floor cannot judge its age, so a late redelivery of it could slip past.
    AheadOfClock {
        /// The delivery's send time.
        sent_at: DateTime<Utc>,
        /// The latest send time admitted when it arrived.
        latest: DateTime<Utc>,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::BeforeFloor { sent_at, floor } => write!(
                f,
                "sent at {sent_at}, before the admission floor {floor}: its marker may already be purged, so running it could apply it twice. Dead-letter it and check by hand whether it was applied"
            ),
            Refusal::AheadOfClock { sent_at, latest } => write!(
                f,
                "sent at {sent_at}, after {latest}: the sender's clock is ahead of this process's by more than the admission floor's margin. Dead-letter it and fix the clocks (NTP) or widen the margin"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3_600);
    const MINUTE: Duration = Duration::from_secs(60);

    fn floor(window: Duration, margin: Duration) -> AdmissionFloor {
        AdmissionFloor::new(&RetentionPolicy::with_window(window).unwrap(), margin).unwrap()
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_767_225_600 + seconds, 0).unwrap()
    }

    #[test]
    fn refuses_older_than_window_minus_margin() {
        let floor = floor(HOUR, MINUTE);
        let now = at(0);
        assert_eq!(floor.check(now, now), Ok(()));
        assert_eq!(floor.check(at(-3_540), now), Ok(()), "exactly on the floor");
        assert_eq!(
            floor.check(at(-3_541), now),
            Err(Refusal::BeforeFloor {
                sent_at: at(-3_541),
                floor: at(-3_540)
            })
        );
        assert!(floor.check(at(-10 * 3_600), now).is_err());
    }

    #[test]
    fn admits_a_sender_ahead_within_the_margin_only() {
        let floor = floor(HOUR, MINUTE);
        let now = at(0);
        assert_eq!(floor.check(at(60), now), Ok(()));
        assert_eq!(
            floor.check(at(61), now),
            Err(Refusal::AheadOfClock {
                sent_at: at(61),
                latest: at(60)
            })
        );
    }

    #[test]
    fn margin_must_be_positive_and_below_the_window() {
        let retention = RetentionPolicy::with_window(HOUR).unwrap();
        for margin in [Duration::ZERO, HOUR, 2 * HOUR] {
            assert!(matches!(
                AdmissionFloor::new(&retention, margin),
                Err(InboxError::InvalidAdmissionFloor { .. })
            ));
        }
        assert!(AdmissionFloor::new(&retention, HOUR - Duration::from_nanos(1)).is_ok());
    }

    #[test]
    fn extreme_windows_and_instants_do_not_panic() {
        let huge = floor(RetentionPolicy::MAX_WINDOW, MINUTE);
        for now in [DateTime::<Utc>::MIN_UTC, DateTime::<Utc>::MAX_UTC] {
            assert_eq!(huge.check(now, now), Ok(()));
        }
        assert!(huge.check(DateTime::<Utc>::MIN_UTC, at(0)).is_err());
    }

    #[test]
    fn a_delivery_without_a_time_or_floor_is_admitted() {
        let strict = floor(HOUR, MINUTE);
        let id = MessageId::from_uuid(Uuid::from_u128(1));
        let ancient = at(-100 * 3_600);
        assert_eq!(Delivery::new(id).admit(Some(strict), at(0)), Ok(()));
        assert_eq!(
            Delivery::new(id).sent_at(ancient).admit(None, at(0)),
            Ok(())
        );
        let carried = Delivery::new(id).sent_at(ancient).with_floor(strict);
        assert!(carried.admit(None, at(0)).is_err());
        assert!(
            Delivery::new(id)
                .sent_at(ancient)
                .admit(Some(strict), at(0))
                .is_err()
        );
    }

    #[test]
    fn refusals_say_to_dead_letter() {
        let floor = floor(HOUR, MINUTE);
        for sent_at in [at(-2 * 3_600), at(2 * 3_600)] {
            let refusal = floor.check(sent_at, at(0)).unwrap_err();
            assert!(refusal.to_string().contains("Dead-letter it"), "{refusal}");
        }
    }

    #[test]
    fn both_floors_apply() {
        let loose = floor(10 * HOUR, MINUTE);
        let strict = floor(HOUR, MINUTE);
        let id = MessageId::from_uuid(Uuid::from_u128(1));
        let delivery = Delivery::new(id).sent_at(at(-2 * 3_600)).with_floor(loose);
        assert_eq!(delivery.admit(None, at(0)), Ok(()));
        assert!(delivery.admit(Some(strict), at(0)).is_err());
    }
}
