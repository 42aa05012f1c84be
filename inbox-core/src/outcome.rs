use crate::cause::{app_verdict, db_cause};
use crate::{InboxError, LeaseClaim, Refusal, classify};
use chrono::{DateTime, Utc};
use std::fmt;
use std::time::Duration;

/// What [`Inbox::process`](crate::Inbox::process) did with a delivery. `Processed` and
/// `Duplicate` mean the message is done: acknowledge it. `Refused` means dead-letter it.
/// [`Settlement::of`] says which.
#[must_use = "settle the message: Processed and Duplicate mean ack, Refused means dead-letter"]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome<T> {
    /// This delivery claimed the message, the handler ran, and its transaction committed;
    /// the value is the one of the attempt that committed. That holds when a COMMIT's reply
    /// was lost too: the retry finds the marker carrying this call's token and returns
    /// that attempt's value without running the handler again.
    Processed(T),
    /// Another delivery (an earlier one, or another replica's) already processed the
    /// message for this consumer; the handler did not run in this call, or ran only in
    /// attempts that rolled back.
    Duplicate,
    /// The [admission floor](crate::AdmissionFloor) refused the delivery: it was sent so
    /// long ago that its marker may already be purged, so running it could apply it a
    /// second time. Nothing was written and the handler did not run. Dead-letter it
    /// ([`Settlement::DeadLetter`]); never requeue it.
    Refused(Refusal),
}

impl<T> Outcome<T> {
    /// The handler's value, if this delivery ran it.
    pub fn processed(self) -> Option<T> {
        match self {
            Outcome::Processed(value) => Some(value),
            Outcome::Duplicate | Outcome::Refused(_) => None,
        }
    }

    /// Whether the message had already been processed.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate)
    }

    /// Why the admission floor refused the delivery, if it did.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Outcome::Refused(refusal) => Some(*refusal),
            Outcome::Processed(_) | Outcome::Duplicate => None,
        }
    }
}

/// Why [`Inbox::process`](crate::Inbox::process) did not finish a delivery. Every variant
/// means: do not acknowledge. [`Settlement::for_delivery`] says what instead: dead-letter
/// what no redelivery can fix ([`is_permanent`](Self::is_permanent)), nack the rest with
/// a delay so the broker redelivers it (or dead-letters it after its own limit).
///
/// Nothing of this call committed, with one exception: when a COMMIT of the call failed
/// (its reply lost with the connection, or unanswered in a partition, so the client cannot
/// know) and no later attempt found out, the work may have committed
/// ([`InboxError::DatabaseUnresponsive`] then says `commit_in_doubt`). Nacking is still right: the redelivery then finds the marker
/// and reports [`Outcome::Duplicate`], and the effect stays applied once. (While attempts
/// remain, `process` settles that doubt itself and returns [`Outcome::Processed`].)
#[derive(Debug)]
#[non_exhaustive]
pub enum ProcessError<E> {
    /// The handler returned an error; its transaction rolled back. Not retried here (the
    /// broker's redelivery is the retry), unless it was a transient database error (see
    /// [`Inbox::process`](crate::Inbox::process)), which is returned here once the
    /// attempts run out.
    Handler(E),
    /// A database or input failure that retrying would not fix (a missing table, a unique
    /// violation on another index, a nil message id...).
    Inbox(InboxError),
    /// Every attempt met a transient database failure; `source` is the last one.
    RetriesExhausted {
        /// Attempts made, the first included.
        attempts: u32,
        /// The failure of the last attempt.
        source: InboxError,
    },
}

impl<E> ProcessError<E> {
    /// The handler's error, if the handler failed.
    pub fn handler_error(&self) -> Option<&E> {
        match self {
            ProcessError::Handler(err) => Some(err),
            ProcessError::Inbox(_) | ProcessError::RetriesExhausted { .. } => None,
        }
    }

    /// The inbox's own error, if the failure was not the handler's.
    pub fn inbox_error(&self) -> Option<&InboxError> {
        match self {
            ProcessError::Inbox(err) | ProcessError::RetriesExhausted { source: err, .. } => {
                Some(err)
            }
            ProcessError::Handler(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for ProcessError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProcessError::Handler(err) => {
                write!(
                    f,
                    "the handler failed and its transaction was rolled back: {err}. Nack the message so the broker redelivers it (or dead-letters it after its delivery limit)"
                )
            }
            ProcessError::Inbox(err) => err.fmt(f),
            ProcessError::RetriesExhausted { attempts, source } => write!(
                f,
                "gave up after {attempts} attempts on transient database failures; nack the message so the broker redelivers it later. Last failure: {source}"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ProcessError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProcessError::Handler(err) => Some(err),
            ProcessError::Inbox(err) | ProcessError::RetriesExhausted { source: err, .. } => {
                Some(err)
            }
        }
    }
}

/// What to tell the broker about a delivery, with its parameters: the one place that maps
/// results to acks. It reads like the brokers' own verbs (async-nats' `AckKind`).
///
/// ```
/// use sea_orm_inbox::{InboxError, Outcome, ProcessError, Settlement};
/// use std::time::Duration;
///
/// type Result = std::result::Result<Outcome<()>, ProcessError<String>>;
/// let done: Result = Ok(Outcome::Duplicate);
/// assert_eq!(Settlement::of(&done), Settlement::Ack);
/// let failed: Result = Err(ProcessError::Handler("card declined".into()));
/// assert_eq!(Settlement::of(&failed), Settlement::Nack(None));
/// // The third delivery of a failing message waits 4 s before the broker tries again.
/// assert_eq!(Settlement::for_delivery(&failed, 3), Settlement::Nack(Some(Duration::from_secs(4))));
/// // A retry cannot fix a nil message id: never redeliver it.
/// let nil: Result = Err(ProcessError::Inbox(InboxError::NilMessageId));
/// assert_eq!(Settlement::for_delivery(&nil, 1), Settlement::DeadLetter);
/// ```
///
/// Map it to the broker's verbs once, in the consumer loop (the `rabbitmq` and `jetstream`
/// modules, behind the `lapin` and `async-nats` features, do it for you):
///
/// | settlement | RabbitMQ (lapin) | JetStream (async-nats) | Kafka |
/// | --- | --- | --- | --- |
/// | `Ack` | `basic_ack` | `ack()` | commit the offset |
/// | `Nack(delay)` | wait `delay`, then `basic_nack`, `requeue: true` | `ack_with(AckKind::Nak(delay))` | pause the partition for `delay`, seek back |
/// | `DeadLetter` | `basic_reject`, `requeue: false` (routes to the dead-letter exchange) | `ack_with(AckKind::Term)` | produce to a dead-letter topic, commit the offset |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Settlement {
    /// Acknowledge: the message was processed now or before ([`Outcome::Processed`],
    /// [`Outcome::Duplicate`]). Never nack a duplicate: it would bounce to the dead-letter
    /// queue.
    Ack,
    /// Negative-acknowledge: let the broker redeliver, after the delay if there is one.
    /// Nothing committed, or (a lost COMMIT reply on the last attempt) the redelivery will
    /// find it committed and be a duplicate: see [`ProcessError`]. Also the answer to a
    /// lease another claimant holds ([`Settlement::of_lease`]).
    Nack(Option<Duration>),
    /// Reject without requeueing: the dead-letter queue keeps the message and a human
    /// decides. Either running it could do harm ([`Outcome::Refused`]), or no redelivery
    /// can succeed ([`InboxError::is_permanent`]: a nil message id, a missing table, a
    /// unique violation on another index...). Nothing was written; replay it from the
    /// dead-letter queue once the cause is fixed.
    DeadLetter,
}

impl Settlement {
    /// The settlement for the result of [`Inbox::process`](crate::Inbox::process), with
    /// no redelivery delay: [`Settlement::Nack`]`(None)` for a failure worth a retry.
    /// Prefer [`for_delivery`](Self::for_delivery) when the broker tells how often it
    /// delivered the message: a failure that lasts (a database down for minutes) is then
    /// not redelivered in a tight loop.
    pub fn of<T, E: 'static>(result: &Result<Outcome<T>, ProcessError<E>>) -> Self {
        match result {
            Ok(Outcome::Processed(_) | Outcome::Duplicate) => Settlement::Ack,
            Ok(Outcome::Refused(_)) => Settlement::DeadLetter,
            Err(err) if err.is_permanent() => Settlement::DeadLetter,
            Err(_) => Settlement::Nack(None),
        }
    }

    /// [`of`](Self::of), with the redelivery delay of [`NackDelay::default`] for the
    /// `delivery`-th delivery of the message (1 for the first): 1 s, 2 s, 4 s ... up to a
    /// minute.
    pub fn for_delivery<T, E: 'static>(
        result: &Result<Outcome<T>, ProcessError<E>>,
        delivery: u32,
    ) -> Self {
        NackDelay::default().settle(result, delivery)
    }

    /// The settlement for a [`claim_lease`](crate::claim_lease) that did not give this
    /// delivery the side effect, or `None` when it did ([`LeaseClaim::Claimed`],
    /// [`LeaseClaim::TakenOver`]: call the side effect, [`Lease::complete`](crate::Lease::complete),
    /// then ack).
    ///
    /// A lease another claimant holds ([`LeaseClaim::Held`]) is nacked with a delay until
    /// the lease expires: by then the holder has completed (the redelivery is acked as
    /// already processed) or crashed (the redelivery takes over).
    pub fn of_lease(claim: &LeaseClaim) -> Option<Self> {
        Self::of_lease_at(claim, Utc::now())
    }

    fn of_lease_at(claim: &LeaseClaim, now: DateTime<Utc>) -> Option<Self> {
        match claim {
            LeaseClaim::Claimed(_) | LeaseClaim::TakenOver(_) => None,
            LeaseClaim::Duplicate | LeaseClaim::Dead(_) => Some(Settlement::Ack),
            LeaseClaim::Held { lease_until, .. } => {
                let left = (*lease_until - now).to_std().unwrap_or(Duration::ZERO);
                Some(Settlement::Nack(Some(left)))
            }
            LeaseClaim::Refused(_) => Some(Settlement::DeadLetter),
        }
    }
}

impl<E: 'static> ProcessError<E> {
    /// Whether no redelivery can succeed: an [`InboxError::is_permanent`] error; a handler
    /// error the application marked [`Permanent`](crate::Permanent) (and not one it marked
    /// [`Transient`](crate::Transient)), itself or in its chain of sources; otherwise a
    /// handler error that is (or wraps, see [`Inbox::process`](crate::Inbox::process)) a
    /// [`DbErr`](sea_orm::DbErr) whose [kind](crate::DbErrorKind::is_permanent) is
    /// permanent, such as a unique violation in the handler's own insert. Exhausted
    /// retries are not: the failures were transient.
    pub fn is_permanent(&self) -> bool {
        match self {
            ProcessError::Handler(err) => app_verdict(err).unwrap_or_else(|| {
                db_cause(err).is_some_and(|cause| classify(cause).is_permanent())
            }),
            ProcessError::Inbox(err) => err.is_permanent(),
            ProcessError::RetriesExhausted { .. } => false,
        }
    }
}

/// How long the broker should wait before redelivering a message that failed: doubling
/// with each delivery from `first` up to `max`, so one that keeps failing (a database
/// down for minutes) is not redelivered in a tight loop. No jitter: the broker spreads
/// redeliveries of different messages by their own delivery times.
///
/// ```
/// use sea_orm_inbox::{NackDelay, Outcome, ProcessError, Settlement};
/// use std::time::Duration;
///
/// let delay = NackDelay::new(Duration::from_millis(500), Duration::from_secs(30))?;
/// assert_eq!(delay.for_delivery(1), Duration::from_millis(500));
/// assert_eq!(delay.for_delivery(3), Duration::from_secs(2));
/// assert_eq!(delay.for_delivery(100), Duration::from_secs(30));
/// let failed: Result<Outcome<()>, ProcessError<String>> = Err(ProcessError::Handler("boom".into()));
/// assert_eq!(delay.settle(&failed, 2), Settlement::Nack(Some(Duration::from_secs(1))));
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NackDelay {
    first: Duration,
    max: Duration,
}

impl Default for NackDelay {
    /// 1 s after the first delivery, doubling up to a minute.
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

impl NackDelay {
    /// The longest delay accepted: an hour. A message that should wait longer belongs in
    /// the dead-letter queue; and RabbitMQ closes a channel that holds a delivery unacked
    /// longer than its `consumer_timeout` (30 minutes by default).
    pub const MAX: Duration = Duration::from_secs(3600);

    /// A delay of `first` after the first delivery, doubling per delivery up to `max`.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] when `first` or `max` exceeds [`MAX`](Self::MAX),
    /// or `first` is above `max`.
    pub fn new(first: Duration, max: Duration) -> Result<Self, InboxError> {
        if max > Self::MAX {
            return Err(InboxError::out_of_range(
                "the longest nack delay",
                max,
                Duration::ZERO..=Self::MAX,
                "dead-letter a message that should wait longer",
            ));
        }
        if first > max {
            return Err(InboxError::out_of_range(
                "the first nack delay",
                first,
                Duration::ZERO..=max,
                "choose a first delay no longer than the longest one",
            ));
        }
        Ok(Self { first, max })
    }

    /// The delay before redelivering after the `delivery`-th delivery failed (1 for the
    /// first): `first * 2^(delivery - 1)`, at most `max`.
    pub fn for_delivery(&self, delivery: u32) -> Duration {
        let doublings = delivery.saturating_sub(1).min(31);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }

    /// [`Settlement::of`], with this delay for the `delivery`-th delivery on a nack.
    pub fn settle<T, E: 'static>(
        &self,
        result: &Result<Outcome<T>, ProcessError<E>>,
        delivery: u32,
    ) -> Settlement {
        match Settlement::of(result) {
            Settlement::Nack(_) => Settlement::Nack(Some(self.for_delivery(delivery))),
            settled => settled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MessageId;
    use chrono::TimeDelta;
    use sea_orm::{DbErr, RuntimeErr};

    type Processed = Result<Outcome<()>, ProcessError<DbErr>>;

    #[test]
    fn the_delay_grows_with_the_delivery_count_up_to_its_cap() {
        let failed: Processed = Err(ProcessError::RetriesExhausted {
            attempts: 5,
            source: InboxError::PurgerStopped {
                reason: "a stand-in for a transient failure".into(),
            },
        });
        let delays: Vec<_> = [0, 1, 2, 3, 6, 7, 8, u32::MAX]
            .into_iter()
            .map(|delivery| Settlement::for_delivery(&failed, delivery))
            .collect();
        let secs = |s| Settlement::Nack(Some(Duration::from_secs(s)));
        assert_eq!(
            delays,
            [
                secs(1),
                secs(1),
                secs(2),
                secs(4),
                secs(32),
                secs(60),
                secs(60),
                secs(60)
            ]
        );
    }

    #[test]
    fn nack_delay_refuses_what_it_cannot_honour() {
        let hour = NackDelay::MAX;
        assert!(NackDelay::new(Duration::ZERO, hour).is_ok());
        for (first, max) in [
            (Duration::from_secs(1), hour + Duration::from_nanos(1)),
            (Duration::from_secs(2), Duration::from_secs(1)),
        ] {
            let err = NackDelay::new(first, max).expect_err("out of range");
            assert!(matches!(err, InboxError::OutOfRange { .. }), "{err}");
        }
    }

    #[test]
    fn permanent_errors_are_dead_lettered_and_never_delayed() {
        let nil: Processed = Err(ProcessError::Inbox(InboxError::NilMessageId));
        let not_built: Processed = Err(ProcessError::Inbox(InboxError::BackendNotEnabled {
            backend: "SQLite",
            feature: "sqlite",
        }));
        for permanent in [nil, not_built] {
            assert_eq!(Settlement::of(&permanent), Settlement::DeadLetter);
            assert_eq!(
                Settlement::for_delivery(&permanent, 9),
                Settlement::DeadLetter
            );
        }
        let lost: Processed = Err(ProcessError::Inbox(InboxError::ClaimLost {
            message_ids: vec![MessageId::from_uuid(uuid::Uuid::from_u128(7))],
            consumer: "billing".into(),
            source: None,
        }));
        assert_eq!(Settlement::of(&lost), Settlement::Nack(None));
        let silent: Processed = Err(ProcessError::Inbox(InboxError::DatabaseSilent {
            operation: "listing expired leases",
            waited: Duration::from_secs(20),
        }));
        assert_eq!(Settlement::of(&silent), Settlement::Nack(None));
        assert_eq!(
            Settlement::for_delivery(&silent, 1),
            Settlement::Nack(Some(Duration::from_secs(1)))
        );
        let unknown: Processed = Err(ProcessError::Handler(DbErr::Exec(RuntimeErr::Internal(
            "permission denied".into(),
        ))));
        assert_eq!(
            Settlement::for_delivery(&unknown, 2),
            Settlement::Nack(Some(Duration::from_secs(2)))
        );
    }

    #[test]
    fn a_held_lease_waits_until_it_expires() {
        let now = Utc::now();
        let held = |left: TimeDelta| LeaseClaim::Held {
            attempts: 1,
            lease_until: now + left,
        };
        assert_eq!(
            Settlement::of_lease_at(&held(TimeDelta::seconds(30)), now),
            Some(Settlement::Nack(Some(Duration::from_secs(30))))
        );
        assert_eq!(
            Settlement::of_lease_at(&held(TimeDelta::seconds(-5)), now),
            Some(Settlement::Nack(Some(Duration::ZERO)))
        );
        assert_eq!(
            Settlement::of_lease_at(&LeaseClaim::Duplicate, now),
            Some(Settlement::Ack)
        );
    }
}
