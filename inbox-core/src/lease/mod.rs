//! Two-phase claims for side effects that cannot join a transaction (an e-mail, a card
//! charge, a blob write): claim and commit, call the side effect, then complete.

mod decide;
mod store;
mod sweep;

pub use sweep::{
    ExpiredLease, list_dead_claims, list_dead_claims_in, list_expired_leases,
    list_expired_leases_in,
};

use crate::clock::truncate_to_micros;
use crate::consumer::validate_claim;
use crate::inbox::checked_partition_timeout;
use crate::{Delivery, Inbox, InboxError, MessageId, Refusal, RetryPolicy};
use chrono::{DateTime, TimeDelta, Utc};
use decide::attempts_of;
use sea_orm::DatabaseConnection;
use sea_orm_inbox_entity::{InboxTable, inbox};
use std::time::Duration;
use store::LeaseUpdate;
use uuid::Uuid;

/// How long a two-phase claim holds a message, and how many attempts it gets.
///
/// **Clock rule:** every lease time (`lease_until`, the expiry check, `dead_at`) is read
/// from the clock of the process that claims, in UTC, the same clock that writes
/// `received_at`. Replicas must keep their clocks synchronised (NTP); a skew of `s` makes a
/// lease look up to `s` shorter to a fast-clocked replica, so choose a lease well above the
/// side effect's worst duration plus the skew you tolerate.
///
/// ```
/// use sea_orm_inbox::LeaseOptions;
/// use std::time::Duration;
///
/// let options = LeaseOptions::new(Duration::from_secs(30))?.with_max_attempts(3)?;
/// assert_eq!(options.max_attempts(), 3);
/// assert!(LeaseOptions::new(Duration::ZERO).is_err());
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseOptions {
    lease: Duration,
    max_attempts: u32,
    partition_timeout: Duration,
    retry: RetryPolicy,
}

impl LeaseOptions {
    /// The shortest lease accepted (tests use leases of tens of milliseconds).
    pub const MIN_LEASE: Duration = Duration::from_millis(1);
    /// The longest lease accepted: a year.
    pub const MAX_LEASE: Duration = Duration::from_secs(366 * 24 * 3600);
    /// Attempts a claim gets unless [`with_max_attempts`](Self::with_max_attempts) says
    /// otherwise.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
    /// The most attempts accepted: what the 32-bit `attempts` column holds.
    pub const MAX_ATTEMPTS: u32 = i32::MAX as u32;
    /// The retry policy unless [`with_retry`](Self::with_retry) says otherwise: 5
    /// attempts, backing off up to 5, 10, 20 and 20 ms. A lease call's transaction is a
    /// statement or two, so the conflict it lost clears sooner than a handler's.
    pub const DEFAULT_RETRY: RetryPolicy = RetryPolicy::SHORT_TRANSACTIONS;

    /// Leases of `lease`, with [`DEFAULT_MAX_ATTEMPTS`](Self::DEFAULT_MAX_ATTEMPTS).
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] outside [`MIN_LEASE`](Self::MIN_LEASE)..=
    /// [`MAX_LEASE`](Self::MAX_LEASE).
    pub fn new(lease: Duration) -> Result<Self, InboxError> {
        if !(Self::MIN_LEASE..=Self::MAX_LEASE).contains(&lease) {
            return Err(InboxError::out_of_range(
                "a lease",
                lease,
                Self::MIN_LEASE..=Self::MAX_LEASE,
                "choose a lease longer than the side effect takes, with margin for clock skew",
            ));
        }
        Ok(Self {
            lease,
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            partition_timeout: Inbox::DEFAULT_PARTITION_TIMEOUT,
            retry: Self::DEFAULT_RETRY,
        })
    }

    /// Bounds each short transaction of the lease calls against a silent network, as
    /// [`Inbox::with_partition_timeout`] bounds a claim (default
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`]): the server ends the transaction of a holder
    /// cut off in the middle of it once it has been silent this long (one more statement
    /// per transaction on PostgreSQL and MySQL/MariaDB), so the row's lock does not keep
    /// a takeover waiting; and [`claim_lease`], [`Lease::complete`] and [`Lease::release`]
    /// (which take the bound from the [`Lease`]) give up after this long without an
    /// answer, with [`InboxError::DatabaseUnresponsive`] (not on SQLite, which has no
    /// network to go silent). A holder cut off for longer than
    /// its lease is taken over, and its later completion is refused
    /// ([`InboxError::StaleLease`]).
    ///
    /// ```
    /// use sea_orm_inbox::LeaseOptions;
    /// use std::time::Duration;
    ///
    /// let options = LeaseOptions::new(Duration::from_secs(60))?
    ///     .with_partition_timeout(Duration::from_secs(5))?;
    /// assert_eq!(options.partition_timeout(), Duration::from_secs(5));
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
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

    /// The bound on a silent network (see
    /// [`with_partition_timeout`](Self::with_partition_timeout)).
    pub fn partition_timeout(&self) -> Duration {
        self.partition_timeout
    }

    /// Parks a claim as dead when its lease expires on attempt `max_attempts`.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] for 0 or above [`MAX_ATTEMPTS`](Self::MAX_ATTEMPTS), a
    /// count the `attempts` column cannot hold.
    pub fn with_max_attempts(self, max_attempts: u32) -> Result<Self, InboxError> {
        if !(1..=Self::MAX_ATTEMPTS).contains(&max_attempts) {
            return Err(InboxError::out_of_range(
                "max_attempts",
                max_attempts,
                1..=Self::MAX_ATTEMPTS,
                "a claim needs one attempt before it can be parked, and the attempts column is 32-bit: park a claim after a handful of attempts",
            ));
        }
        Ok(Self {
            max_attempts,
            ..self
        })
    }

    /// Replaces the retry policy of the lease calls' short transactions (default
    /// [`DEFAULT_RETRY`](Self::DEFAULT_RETRY)): a transient failure (a deadlock, busy
    /// SQLite, a lost connection) runs the claim, completion or release again from the
    /// top, as [`Inbox::with_retry`] does for a handler's transaction. A try the database
    /// leaves unanswered past the [partition timeout](Self::with_partition_timeout) is
    /// not retried.
    ///
    /// ```
    /// use sea_orm_inbox::{LeaseOptions, RetryPolicy};
    /// use std::time::Duration;
    ///
    /// let options = LeaseOptions::new(Duration::from_secs(30))?
    ///     .with_retry(RetryPolicy::no_retry());
    /// assert_eq!(options.retry().attempts(), 1);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn with_retry(self, retry: RetryPolicy) -> Self {
        Self { retry, ..self }
    }

    /// The retry policy of the lease calls (see [`with_retry`](Self::with_retry)).
    pub fn retry(&self) -> RetryPolicy {
        self.retry
    }

    /// The lease duration.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The attempt after whose expiry the claim is parked.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// When a lease taken at `now` expires, as the `lease_until` column stores it: a lease
    /// that is not a whole number of microseconds would otherwise report an expiry the
    /// database never stored, and a retry with the same token a different `Lease`.
    fn expiry(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        // `new` bounds the lease to a year, so both conversions succeed.
        let lease = TimeDelta::from_std(self.lease).unwrap_or(TimeDelta::MAX);
        truncate_to_micros(
            now.checked_add_signed(lease)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
        )
    }
}

/// A live two-phase claim: the right to call the side effect and then
/// [`complete`](Self::complete) it, until `lease_until`.
///
/// ```
/// use sea_orm_inbox::{Lease, MessageId};
///
/// fn provider_key(lease: &Lease) -> uuid::Uuid {
///     lease.idempotency_key() // the same on every attempt, unlike the fencing token
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The table the lease's row is in.
    table: InboxTable,
    message_id: MessageId,
    consumer: String,
    token: Uuid,
    attempt: u32,
    lease_until: DateTime<Utc>,
    /// [`LeaseOptions::partition_timeout`] of the claim, for completing or releasing it.
    partition_timeout: Duration,
    /// [`LeaseOptions::retry`] of the claim, for completing or releasing it.
    retry: RetryPolicy,
}

impl Lease {
    /// The claimed message.
    pub fn message_id(&self) -> MessageId {
        self.message_id
    }

    /// The consumer holding the claim.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The key to pass to the downstream provider: [`MessageId::idempotency_key`] of this
    /// message and consumer, identical on every attempt and after every takeover, so the
    /// provider deduplicates a retry of a half-done attempt.
    pub fn idempotency_key(&self) -> Uuid {
        self.message_id.idempotency_key(&self.consumer)
    }

    /// The fencing token of this attempt (the row's `claim_token`): a takeover replaces
    /// it, and completion is a compare-and-set on it.
    pub fn fencing_token(&self) -> Uuid {
        self.token
    }

    /// Which attempt this is, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When the lease expires (claimant's clock, see [`LeaseOptions`]). Finish the side
    /// effect and complete before it, or expect a takeover.
    pub fn lease_until(&self) -> DateTime<Utc> {
        self.lease_until
    }

    /// Phase two: marks the lease's message processed, if this lease is still the current
    /// claim (compare-and-set on its fencing token), in a short transaction of its own.
    ///
    /// A lease that expired is still completed when nobody took it over in the meantime.
    ///
    /// Idempotent for the lease's holder: completing the same lease again is `Ok` and keeps
    /// the first `processed_at`. So when the connection dies after the completion committed
    /// but before its reply arrived, the retry (inside this call, or yours) reports success
    /// instead of a stale lease.
    ///
    /// # Errors
    /// [`InboxError::StaleLease`] when another claimant took the message over after this
    /// lease expired, or it was parked as dead: do not ack as if this attempt had recorded
    /// the outcome; the current holder (or a human) finishes it. [`InboxError::Database`] for
    /// database failures.
    ///
    /// ```
    /// # use sea_orm_inbox::{LeaseClaim, LeaseOptions, claim_lease};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_migration::MigratorTrait;
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
    /// # let options = LeaseOptions::new(std::time::Duration::from_secs(30))?;
    /// let LeaseClaim::Claimed(lease) = claim_lease(&db, uuid::Uuid::new_v4(), "mailer", &options).await? else {
    ///     unreachable!("a new message")
    /// };
    /// lease.complete(&db).await?;
    /// lease.complete(&db).await?; // a retry after a lost reply: still Ok
    /// # Ok(()) }
    /// ```
    pub async fn complete(&self, db: &DatabaseConnection) -> Result<(), InboxError> {
        store::compare_and_set(db, self, LeaseUpdate::Complete).await
    }

    /// Gives a lease up early, after a side effect failed in a way worth retrying: the lease
    /// expires now, so the next delivery takes over at once (as attempt + 1) instead of
    /// waiting for `lease_until`. The attempt still counts towards
    /// [`LeaseOptions::max_attempts`].
    ///
    /// # Errors
    /// [`InboxError::StaleLease`] when the lease is no longer the current claim;
    /// [`InboxError::Database`] for database failures.
    ///
    /// ```
    /// # use sea_orm_inbox::{LeaseClaim, LeaseOptions, claim_lease};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_migration::MigratorTrait;
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
    /// # let options = LeaseOptions::new(std::time::Duration::from_secs(30))?;
    /// let id = uuid::Uuid::new_v4();
    /// let LeaseClaim::Claimed(lease) = claim_lease(&db, id, "mailer", &options).await? else {
    ///     unreachable!("a new message")
    /// };
    /// // the mail provider answered 503: give the message back
    /// lease.release(&db).await?;
    /// let again = claim_lease(&db, id, "mailer", &options).await?;
    /// assert!(matches!(again, LeaseClaim::TakenOver(ref l) if l.attempt() == 2));
    /// # Ok(()) }
    /// ```
    pub async fn release(&self, db: &DatabaseConnection) -> Result<(), InboxError> {
        store::compare_and_set(db, self, LeaseUpdate::Release).await
    }
}

/// A claim parked as dead after its last allowed attempt, for a human to look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadClaim {
    /// The message.
    pub message_id: MessageId,
    /// The consumer.
    pub consumer: String,
    /// Attempts made.
    pub attempts: u32,
    /// When the first attempt claimed it.
    pub received_at: DateTime<Utc>,
    /// When it was parked.
    pub dead_at: DateTime<Utc>,
}

impl DeadClaim {
    /// The claim of `row`, parked at `dead_at`.
    fn of_row(row: &inbox::Model, dead_at: DateTime<Utc>) -> Self {
        Self {
            message_id: MessageId::from_uuid(row.message_id),
            consumer: row.consumer.clone(),
            attempts: attempts_of(row),
            received_at: row.received_at,
            dead_at,
        }
    }
}

/// The outcome of [`claim_lease`]. Every variant but the two that carry a [`Lease`] means
/// "do not call the side effect now".
#[must_use = "only Claimed and TakenOver allow the side effect"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseClaim {
    /// First attempt: call the side effect, then [`Lease::complete`]. Ack the message once
    /// completed.
    Claimed(Lease),
    /// A previous attempt's lease expired without completing (it crashed or hung): this is
    /// attempt 2 or later. The side effect may have been half done; call it again with
    /// the same [`Lease::idempotency_key`], then [`Lease::complete`].
    TakenOver(Lease),
    /// Completed by an earlier attempt (or claimed by a one-phase `claim_message`):
    /// ack the message. The same fact as [`Claim::Duplicate`](crate::Claim::Duplicate).
    Duplicate,
    /// Another claimant holds a live lease: do not call the side effect. Let the broker
    /// redeliver later ([`Settlement::of_lease`](crate::Settlement::of_lease): a nack
    /// delayed until `lease_until`, or leave it to the visibility timeout); a delivery
    /// after `lease_until` takes over if the holder never completes.
    Held {
        /// Attempts made so far.
        attempts: u32,
        /// When the holder's lease expires.
        lease_until: DateTime<Utc>,
    },
    /// Parked as dead (now or earlier) after its last allowed attempt: ack the message
    /// and alert a human ([`list_dead_claims`]).
    Dead(DeadClaim),
    /// The delivery's [admission floor](crate::AdmissionFloor) refused it before any SQL
    /// ran: its marker may already be purged. Do not call the side effect; dead-letter
    /// the message.
    Refused(Refusal),
}

/// Phase one: claims `message_id` for `consumer` as a lease, in a short transaction of
/// its own that commits before this returns.
///
/// `message_id` may be a [`Delivery`] with the message's send time and an
/// [`AdmissionFloor`](crate::AdmissionFloor) ([`Delivery::with_floor`]): a delivery sent
/// before the floor is [`LeaseClaim::Refused`] before any SQL runs.
///
/// Inserts the lease row (attempt 1) unless the pair has a row; otherwise locks that row
/// and decides: processed, parked, held by a live lease, or expired. An expired lease is
/// taken over (attempt + 1, a new fencing token) or, if it was the last allowed attempt,
/// parked as dead. A transient failure (deadlock, busy SQLite, a lost connection) retries
/// the transaction as the options' [`RetryPolicy`] says ([`LeaseOptions::with_retry`]).
///
/// One call writes one fencing token, whatever its retries: when a COMMIT lands but its
/// reply is lost (the connection dies in the middle of it), the retry finds the row
/// carrying the call's own token and returns that lease ([`LeaseClaim::Claimed`] for
/// attempt 1, [`LeaseClaim::TakenOver`] after), with the row's attempt and expiry, instead
/// of mistaking it for another claimant's ([`LeaseClaim::Held`]). An error returned after
/// the call's last retry may still hide a committed claim: the next call (a new token)
/// then sees it `Held` until its lease expires, and takes it over as the next attempt. To
/// retry such a call yourself without that wait, use [`claim_lease_with_token`].
///
/// # Errors
/// Bad input as for `claim_message` ([`InboxError::EmptyConsumer`],
/// [`InboxError::ConsumerTooLong`], [`InboxError::NilMessageId`]);
/// [`InboxError::MissingTable`]; [`InboxError::MissingMigration`] for a database that
/// lacks a later inbox migration (the second's columns; on PostgreSQL the third's
/// constraint); [`InboxError::Database`] for other failures.
///
/// ```
/// use sea_orm_inbox::{LeaseClaim, LeaseOptions, MessageId, Settlement, claim_lease};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// let options = LeaseOptions::new(Duration::from_secs(30))?;
/// let id = MessageId::from_broker_id("welcome-mail-7")?;
/// match claim_lease(&db, id, "mailer", &options).await? {
///     LeaseClaim::Claimed(lease) | LeaseClaim::TakenOver(lease) => {
///         // send_mail(idempotency_key = lease.idempotency_key()) ...
///         lease.complete(&db).await?; // then ack
///     }
///     // Ack, dead-letter (refused), or nack until the holder's lease expires (held).
///     other => println!("{:?}", Settlement::of_lease(&other)),
/// }
/// assert_eq!(claim_lease(&db, id, "mailer", &options).await?, LeaseClaim::Duplicate);
/// # Ok(()) }
/// ```
pub async fn claim_lease(
    db: &DatabaseConnection,
    message_id: impl Into<Delivery>,
    consumer: &str,
    options: &LeaseOptions,
) -> Result<LeaseClaim, InboxError> {
    claim_lease_with_token(db, message_id, consumer, options, ClaimToken::new()).await
}

/// The fencing token one claim writes, kept by the caller so that retrying a failed
/// [`claim_lease_with_token`] call recognises a claim that committed although its reply
/// was lost. Always random: make a new one for every delivery, and reuse it only to
/// retry that delivery's claim.
///
/// ```
/// use sea_orm_inbox::ClaimToken;
///
/// assert_ne!(ClaimToken::new(), ClaimToken::new());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClaimToken(Uuid);

impl ClaimToken {
    /// A new random token.
    #[allow(clippy::new_without_default)] // `Default` reads as a fixed value; this is fresh
    pub fn new() -> Self {
        Self(Uuid::new_v4())
    }

    /// The token as stored in `claim_token` (and returned by [`Lease::fencing_token`]).
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

/// [`claim_lease`] with a token the caller keeps: a retry of a failed call with the same
/// `token` finds the row it may have committed (its reply lost) and returns that lease,
/// as `claim_lease`'s own retries do, instead of seeing it [`LeaseClaim::Held`] until it
/// expires.
///
/// Use one token per delivery. Reusing it for another delivery of the same message would
/// let that delivery act as the holder of the earlier lease.
///
/// # Errors
/// As [`claim_lease`].
///
/// ```
/// use sea_orm_inbox::{ClaimToken, LeaseClaim, LeaseOptions, MessageId, claim_lease_with_token};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// let options = LeaseOptions::new(Duration::from_secs(30))?;
/// let id = MessageId::from_broker_id("invoice-mail-9")?;
/// let token = ClaimToken::new(); // one per delivery
/// let mut result = claim_lease_with_token(&db, id, "mailer", &options, token).await;
/// for _ in 0..3 {
///     if result.is_ok() {
///         break;
///     }
///     // e.g. the connection died during COMMIT: retry with the same token
///     result = claim_lease_with_token(&db, id, "mailer", &options, token).await;
/// }
/// let claim = result?;
/// assert!(matches!(claim, LeaseClaim::Claimed(ref lease) if lease.fencing_token() == token.as_uuid()));
/// // The same token again finds its own claim: still Claimed, not Held.
/// assert_eq!(claim_lease_with_token(&db, id, "mailer", &options, token).await?, claim);
/// # Ok(()) }
/// ```
pub async fn claim_lease_with_token(
    db: &DatabaseConnection,
    message_id: impl Into<Delivery>,
    consumer: &str,
    options: &LeaseOptions,
    token: ClaimToken,
) -> Result<LeaseClaim, InboxError> {
    claim_lease_in(
        db,
        &InboxTable::default(),
        message_id,
        consumer,
        options,
        token,
    )
    .await
}

/// [`claim_lease_with_token`] for the inbox in `table`, an [`InboxTable`] of the
/// application's choice; the [`Lease`] completes and releases in that table. Pass
/// [`ClaimToken::new`] for a claim without a token of your own.
///
/// # Errors
/// As [`claim_lease`].
///
/// ```
/// use sea_orm_inbox::{ClaimToken, InboxTable, LeaseClaim, LeaseOptions, claim_lease_in};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::{MigrationTrait, SchemaManager};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// let table = InboxTable::named("app_inbox")?;
/// # for migration in sea_orm_inbox_migration::inbox_migrations(&table) {
/// #     migration.up(&SchemaManager::new(&db)).await?;
/// # }
/// let options = LeaseOptions::new(std::time::Duration::from_secs(30))?;
/// let id = uuid::Uuid::new_v4();
/// let LeaseClaim::Claimed(lease) =
///     claim_lease_in(&db, &table, id, "mailer", &options, ClaimToken::new()).await?
/// else {
///     unreachable!("a new message")
/// };
/// lease.complete(&db).await?;
/// # Ok(()) }
/// ```
pub async fn claim_lease_in(
    db: &DatabaseConnection,
    table: &InboxTable,
    message_id: impl Into<Delivery>,
    consumer: &str,
    options: &LeaseOptions,
    token: ClaimToken,
) -> Result<LeaseClaim, InboxError> {
    let delivery = message_id.into();
    let message_id = delivery.message_id();
    validate_claim(message_id, consumer)?;
    if let Err(refusal) = delivery.admit(None, Utc::now()) {
        return Ok(LeaseClaim::Refused(refusal));
    }
    store::claim(db, table, message_id, consumer, options, token.as_uuid()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::now_micros;
    use chrono::Timelike;

    #[test]
    fn refuses_more_attempts_than_the_column_holds() {
        let options = LeaseOptions::new(Duration::from_secs(30)).expect("a valid lease");
        let most = options
            .with_max_attempts(LeaseOptions::MAX_ATTEMPTS)
            .expect("i32::MAX fits the column");
        assert_eq!(most.max_attempts(), 2_147_483_647);
        for over in [LeaseOptions::MAX_ATTEMPTS + 1, u32::MAX] {
            assert!(matches!(
                options.with_max_attempts(over),
                Err(InboxError::OutOfRange { what: "max_attempts", value, .. })
                    if value == over.to_string()
            ));
        }
    }

    #[test]
    fn expiry_is_cut_to_the_microseconds_the_column_stores() {
        let options = LeaseOptions::new(Duration::from_nanos(30_000_000_500)).expect("valid");
        let expiry = options.expiry(now_micros());
        assert_eq!(expiry.nanosecond() % 1_000, 0, "{expiry:?}");
    }
}
