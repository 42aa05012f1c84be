//! Two-phase claims for side effects that cannot join a transaction (an e-mail, a card
//! charge, a blob write): claim and commit, call the side effect, then complete.

use crate::backend::{
    CLAIM_TRANSACTION, DbErrorKind, classify, complete_lease_sql, consumer_is, insert_lease_sql,
    park_lease_sql, release_lease_sql, roll_back, silence_statement, take_over_lease_sql,
    timestamp_value,
};
use crate::claim::now_micros;
use crate::clock::truncate_to_micros;
use crate::consumer::{validate_claim, validate_consumer};
use crate::inbox::checked_partition_timeout;
use crate::pooler::in_own_transaction;
use crate::silence::{answered_within, bound_for, within_bound};
use crate::{Delivery, Inbox, InboxError, MessageId, Refusal};
use chrono::{DateTime, TimeDelta, Utc};
use sea_orm::sea_query::ExprTrait;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait,
    QueryFilter, QueryOrder, QuerySelect, Statement, TransactionTrait, Value,
};
use sea_orm_inbox_entity::inbox;
use std::time::Duration;
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

    /// Leases of `lease`, with [`DEFAULT_MAX_ATTEMPTS`](Self::DEFAULT_MAX_ATTEMPTS).
    ///
    /// # Errors
    /// [`InboxError::LeaseOutOfRange`] outside [`MIN_LEASE`](Self::MIN_LEASE)..=
    /// [`MAX_LEASE`](Self::MAX_LEASE).
    pub fn new(lease: Duration) -> Result<Self, InboxError> {
        if !(Self::MIN_LEASE..=Self::MAX_LEASE).contains(&lease) {
            return Err(InboxError::LeaseOutOfRange {
                lease,
                min: Self::MIN_LEASE,
                max: Self::MAX_LEASE,
            });
        }
        Ok(Self {
            lease,
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            partition_timeout: Inbox::DEFAULT_PARTITION_TIMEOUT,
        })
    }

    /// Bounds each short transaction of the lease calls against a silent network, as
    /// [`Inbox::with_partition_timeout`] bounds a claim (default
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`]): the server ends the transaction of a holder
    /// cut off in the middle of it once it has been silent this long (one more statement
    /// per transaction on PostgreSQL and MySQL/MariaDB), so the row's lock does not keep
    /// a takeover waiting; and [`claim_lease`], [`complete_lease`] and [`release_lease`]
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
    /// [`InboxError::PartitionTimeoutOutOfRange`] outside
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
    /// [`InboxError::ZeroMaxAttempts`] for 0; [`InboxError::ValueOutOfRange`] above
    /// [`MAX_ATTEMPTS`](Self::MAX_ATTEMPTS), a count the `attempts` column cannot hold.
    pub fn with_max_attempts(self, max_attempts: u32) -> Result<Self, InboxError> {
        if max_attempts == 0 {
            return Err(InboxError::ZeroMaxAttempts);
        }
        if max_attempts > Self::MAX_ATTEMPTS {
            return Err(InboxError::ValueOutOfRange {
                what: "max_attempts",
                value: max_attempts.to_string(),
                max: Self::MAX_ATTEMPTS.to_string(),
                advice: "the inbox's attempts column is 32-bit; park a claim after a handful of attempts",
            });
        }
        Ok(Self {
            max_attempts,
            ..self
        })
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
/// [`complete_lease`] it, until `lease_until`.
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
    message_id: MessageId,
    consumer: String,
    token: Uuid,
    attempt: u32,
    lease_until: DateTime<Utc>,
    /// [`LeaseOptions::partition_timeout`] of the claim, for completing or releasing it.
    partition_timeout: Duration,
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

/// The outcome of [`claim_lease`]. Every variant but the two that carry a [`Lease`] means
/// "do not call the side effect now".
#[must_use = "only Claimed and TakenOver allow the side effect"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseClaim {
    /// First attempt: call the side effect, then [`complete_lease`]. Ack the message once
    /// completed.
    Claimed(Lease),
    /// A previous attempt's lease expired without completing (it crashed or hung): this is
    /// attempt 2 or later. The side effect may have been half done; call it again with
    /// the same [`Lease::idempotency_key`], then [`complete_lease`].
    TakenOver(Lease),
    /// Completed by an earlier attempt (or claimed by a one-phase `claim_message`):
    /// ack the message.
    AlreadyProcessed,
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

/// Attempts of one short transaction before a transient failure (deadlock, busy SQLite)
/// is returned to the caller.
const TRANSIENT_RETRIES: u32 = 5;

/// Runs `attempt` (one whole short transaction), again from the top on a transient
/// failure, and turns the final database error into an [`InboxError`]. An attempt the
/// database leaves unanswered for `bound` is given up and not retried: its abandoned
/// transaction may hold the row until the server ends it.
async fn retry_transient<T, F, Fut>(
    message_id: MessageId,
    consumer: &str,
    (bound, step): (Option<Duration>, &'static str),
    mut attempt: F,
) -> Result<T, InboxError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, DbErr>>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        let result = within_bound(bound, attempt()).await.map_err(|waited| {
            InboxError::DatabaseUnresponsive {
                message_id,
                consumer: consumer.to_owned(),
                step,
                waited,
                // The bound covers the whole short transaction, COMMIT included.
                commit_in_doubt: true,
            }
        })?;
        match result {
            Ok(value) => return Ok(value),
            Err(err) if classify(&err) == DbErrorKind::Transient && tries < TRANSIENT_RETRIES => {
                tokio::time::sleep(Duration::from_millis(5 * u64::from(tries))).await;
            }
            Err(err) => return Err(InboxError::from_claim(err, message_id, consumer)),
        }
    }
}

fn attempts_of(row: &inbox::Model) -> u32 {
    u32::try_from(row.attempts).unwrap_or(0)
}

fn dead_claim(row: &inbox::Model, dead_at: DateTime<Utc>) -> DeadClaim {
    DeadClaim {
        message_id: MessageId::from_uuid(row.message_id),
        consumer: row.consumer.clone(),
        attempts: attempts_of(row),
        received_at: row.received_at,
        dead_at,
    }
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
/// the transaction.
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
/// use sea_orm_inbox::{LeaseClaim, LeaseOptions, MessageId, Settlement, claim_lease, complete_lease};
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
///         complete_lease(&db, &lease).await?; // then ack
///     }
///     // Ack, dead-letter (refused), or nack until the holder's lease expires (held).
///     other => println!("{:?}", Settlement::of_lease(&other)),
/// }
/// assert_eq!(claim_lease(&db, id, "mailer", &options).await?, LeaseClaim::AlreadyProcessed);
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
    let delivery = message_id.into();
    let message_id = delivery.message_id();
    validate_claim(message_id, consumer)?;
    if let Err(refusal) = delivery.admit(None, Utc::now()) {
        return Ok(LeaseClaim::Refused(refusal));
    }
    let backend = db.get_database_backend();
    let sql = LeaseSql {
        insert: insert_lease_sql(backend)?,
        take_over: take_over_lease_sql(backend)?,
        park: park_lease_sql(backend)?,
        silence: silence_statement(backend, options.partition_timeout)?,
    };
    let bound = (
        bound_for(backend, options.partition_timeout),
        "the lease claim",
    );
    retry_transient(message_id, consumer, bound, || {
        claim_once(db, message_id, consumer, options, &sql, token.as_uuid())
    })
    .await
}

struct LeaseSql {
    insert: String,
    take_over: String,
    park: String,
    silence: Option<String>,
}

/// One claim transaction with the call's fencing `token`: insert-or-lock the row, decide,
/// commit; or roll back with [`roll_back`] after a failed statement.
async fn claim_once(
    db: &DatabaseConnection,
    message_id: MessageId,
    consumer: &str,
    options: &LeaseOptions,
    sql: &LeaseSql,
    token: Uuid,
) -> Result<LeaseClaim, DbErr> {
    let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    match claim_in(&txn, message_id, consumer, options, sql, token).await {
        Ok(outcome) => {
            txn.commit().await?;
            Ok(outcome)
        }
        Err(err) => {
            roll_back(txn).await;
            Err(err)
        }
    }
}

/// The statements and the decision of [`claim_once`], in its transaction `txn`.
async fn claim_in(
    txn: &DatabaseTransaction,
    message_id: MessageId,
    consumer: &str,
    options: &LeaseOptions,
    sql: &LeaseSql,
    token: Uuid,
) -> Result<LeaseClaim, DbErr> {
    bound_silence(txn, sql.silence.as_deref()).await?;
    let backend = txn.get_database_backend();
    let now = now_micros();
    let lease_until = options.expiry(now);
    let id = Value::from(message_id.as_uuid());
    txn.execute_raw(Statement::from_sql_and_values(
        backend,
        &sql.insert,
        [
            id.clone(),
            Value::from(consumer),
            timestamp_value(backend, now),
            timestamp_value(backend, lease_until),
            Value::from(token),
        ],
    ))
    .await?;
    let row = inbox::Entity::find()
        .filter(inbox::Column::MessageId.eq(message_id.as_uuid()))
        .filter(inbox::Column::Consumer.eq(consumer))
        .lock_exclusive()
        .one(txn)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("the inbox row just claimed".into()))?;
    let lease = |attempt| Lease {
        message_id,
        consumer: consumer.to_owned(),
        token,
        attempt,
        lease_until,
        partition_timeout: options.partition_timeout,
    };
    // This call's row: just inserted, or written by an earlier try of this call whose
    // COMMIT landed although its reply was lost.
    let own_lease_until = row
        .lease_until
        .filter(|_| row.claim_token == Some(token))
        .filter(|_| row.processed_at.is_none() && row.dead_at.is_none());
    let outcome = if let Some(own_lease_until) = own_lease_until {
        own_lease(&row, lease(1), own_lease_until)
    } else if let Some(dead_at) = row.dead_at {
        LeaseClaim::Dead(dead_claim(&row, dead_at))
    } else if let (None, Some(held_until), Some(old_token)) =
        (row.processed_at, row.lease_until, row.claim_token)
    {
        let attempts = attempts_of(&row);
        let current = [id, Value::from(consumer), Value::from(old_token)];
        if held_until > now {
            LeaseClaim::Held {
                attempts,
                lease_until: held_until,
            }
        } else if attempts >= options.max_attempts {
            let mut values = vec![timestamp_value(backend, now)];
            values.extend(current);
            txn.execute_raw(Statement::from_sql_and_values(backend, &sql.park, values))
                .await?;
            LeaseClaim::Dead(dead_claim(&row, now))
        } else {
            let mut values = vec![timestamp_value(backend, lease_until), Value::from(token)];
            values.extend(current);
            txn.execute_raw(Statement::from_sql_and_values(
                backend,
                &sql.take_over,
                values,
            ))
            .await?;
            LeaseClaim::TakenOver(lease(attempts.saturating_add(1)))
        }
    } else {
        // Completed; or a one-phase or batch marker, committed together with its work.
        LeaseClaim::AlreadyProcessed
    };
    Ok(outcome)
}

/// The lease a row written with this call's token grants: `lease` with the row's attempt
/// and expiry as stored, `Claimed` on attempt 1 and `TakenOver` after.
fn own_lease(row: &inbox::Model, lease: Lease, lease_until: DateTime<Utc>) -> LeaseClaim {
    let attempt = attempts_of(row);
    let lease = Lease {
        attempt,
        lease_until,
        ..lease
    };
    if attempt <= 1 {
        LeaseClaim::Claimed(lease)
    } else {
        LeaseClaim::TakenOver(lease)
    }
}

/// Phase two: marks the lease's message processed, if `lease` is still the current claim
/// (compare-and-set on its fencing token), in a short transaction of its own.
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
/// # use sea_orm_inbox::{LeaseClaim, LeaseOptions, claim_lease, complete_lease};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// # let options = LeaseOptions::new(std::time::Duration::from_secs(30))?;
/// let LeaseClaim::Claimed(lease) = claim_lease(&db, uuid::Uuid::new_v4(), "mailer", &options).await? else {
///     unreachable!("a new message")
/// };
/// complete_lease(&db, &lease).await?;
/// complete_lease(&db, &lease).await?; // a retry after a lost reply: still Ok
/// # Ok(()) }
/// ```
pub async fn complete_lease(db: &DatabaseConnection, lease: &Lease) -> Result<(), InboxError> {
    let backend = db.get_database_backend();
    compare_and_set(db, lease, complete_lease_sql(backend)?).await
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
/// # use sea_orm_inbox::{LeaseClaim, LeaseOptions, claim_lease, release_lease};
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
/// release_lease(&db, &lease).await?;
/// let again = claim_lease(&db, id, "mailer", &options).await?;
/// assert!(matches!(again, LeaseClaim::TakenOver(ref l) if l.attempt() == 2));
/// # Ok(()) }
/// ```
pub async fn release_lease(db: &DatabaseConnection, lease: &Lease) -> Result<(), InboxError> {
    let backend = db.get_database_backend();
    compare_and_set(db, lease, release_lease_sql(backend)?).await
}

/// Runs one of the lease's compare-and-set UPDATEs (binds: a timestamp of now, then the
/// current-lease conditions) as a statement of its own, and reports a stale lease.
///
/// Its affected-row count is exact on every backend: PostgreSQL and SQLite count the rows
/// the WHERE clause found, and on MySQL sqlx reports *found* rows too (so the idempotent
/// repeat of a completion, which finds its row without changing it, counts 1).
async fn compare_and_set(
    db: &DatabaseConnection,
    lease: &Lease,
    sql: String,
) -> Result<(), InboxError> {
    let backend = db.get_database_backend();
    let silence = silence_statement(backend, lease.partition_timeout)?;
    let bound = (
        bound_for(backend, lease.partition_timeout),
        "the lease update",
    );
    let updated = retry_transient(lease.message_id, &lease.consumer, bound, || async {
        let update = Statement::from_sql_and_values(
            backend,
            &sql,
            [
                timestamp_value(backend, now_micros()),
                Value::from(lease.message_id.as_uuid()),
                Value::from(lease.consumer.as_str()),
                Value::from(lease.token),
            ],
        );
        let result = in_own_transaction(db, async |txn| {
            bound_silence(txn, silence.as_deref()).await?;
            txn.execute_raw(update).await
        })
        .await?;
        Ok(result.rows_affected())
    })
    .await?;
    if updated == 1 {
        Ok(())
    } else {
        Err(InboxError::StaleLease {
            message_id: lease.message_id,
            consumer: lease.consumer.clone(),
            attempt: lease.attempt,
        })
    }
}

/// Runs `silence` (see [`silence_statement`]) in `txn` before the transaction takes a row
/// lock, which a holder cut off by a partition would otherwise keep for hours.
async fn bound_silence(txn: &DatabaseTransaction, silence: Option<&str>) -> Result<(), DbErr> {
    if let Some(sql) = silence {
        txn.execute_unprepared(sql).await?;
    }
    Ok(())
}

/// A two-phase claim whose lease expired without completing: a crashed or hung attempt,
/// listed by [`list_expired_leases`] for a sweeper.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpiredLease {
    /// The message.
    pub message_id: MessageId,
    /// The consumer.
    pub consumer: String,
    /// Attempts made so far.
    pub attempts: u32,
    /// When the last lease expired.
    pub lease_until: DateTime<Utc>,
}

/// Lists claims whose lease expired before now (the caller's clock) without completing
/// and that are not parked, oldest expiry first, at most `limit`, for one consumer or
/// (with `None`) for all.
///
/// A sweeper re-runs each one's side effect by calling [`claim_lease`] for it (which takes
/// it over, or parks it after the last attempt) when it can rebuild the message; the
/// broker's redelivery does the same otherwise.
///
/// The consumer name is compared exactly on every backend (MySQL/MariaDB's PAD SPACE
/// collation does not make "mailer" list the rows of "mailer ").
///
/// # Errors
/// A consumer name every claim refuses, as for `claim_message`
/// ([`InboxError::EmptyConsumer`], [`InboxError::ConsumerNotTrimmed`],
/// [`InboxError::ConsumerContainsNul`], [`InboxError::ConsumerTooLong`]);
/// [`InboxError::ValueOutOfRange`] for a `limit` above `i64::MAX`;
/// [`InboxError::Query`] when the database fails; [`InboxError::DatabaseSilent`] when it
/// leaves the read unanswered for [`Inbox::DEFAULT_PARTITION_TIMEOUT`] (a network
/// partition or a hung server, not on SQLite): poll again later.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// for stuck in sea_orm_inbox::list_expired_leases(&db, Some("mailer"), 100).await? {
///     eprintln!("{} stuck after attempt {}", stuck.message_id, stuck.attempts);
/// }
/// # Ok(()) }
/// ```
pub async fn list_expired_leases(
    db: &DatabaseConnection,
    consumer: Option<&str>,
    limit: u64,
) -> Result<Vec<ExpiredLease>, InboxError> {
    let now = timestamp_value(db.get_database_backend(), now_micros());
    let expired = inbox::Column::ProcessedAt
        .is_null()
        .and(inbox::Column::DeadAt.is_null())
        .and(inbox::Column::LeaseUntil.lt(now));
    let rows = list_rows(
        db,
        expired,
        inbox::Column::LeaseUntil,
        consumer,
        limit,
        "listing expired leases",
    )
    .await?;
    Ok(rows
        .iter()
        .filter_map(|row| {
            row.lease_until.map(|lease_until| ExpiredLease {
                message_id: MessageId::from_uuid(row.message_id),
                consumer: row.consumer.clone(),
                attempts: attempts_of(row),
                lease_until,
            })
        })
        .collect())
}

/// Lists claims parked as dead, oldest parking first, at most `limit`, for one consumer or
/// (with `None`) for all.
///
/// # Errors
/// As [`list_expired_leases`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// for dead in sea_orm_inbox::list_dead_claims(&db, Some("mailer"), 100).await? {
///     eprintln!("{} failed {} times", dead.message_id, dead.attempts);
/// }
/// # Ok(()) }
/// ```
pub async fn list_dead_claims(
    db: &DatabaseConnection,
    consumer: Option<&str>,
    limit: u64,
) -> Result<Vec<DeadClaim>, InboxError> {
    let dead = inbox::Column::DeadAt.is_not_null();
    let rows = list_rows(
        db,
        dead,
        inbox::Column::DeadAt,
        consumer,
        limit,
        "listing dead claims",
    )
    .await?;
    Ok(rows
        .iter()
        .filter_map(|row| row.dead_at.map(|dead_at| dead_claim(row, dead_at)))
        .collect())
}

/// Rows matching `condition` (and `consumer`, if given), ordered by `order` then id;
/// a failure is reported as `operation`. The input is checked before any SQL runs, and
/// the read waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database.
async fn list_rows(
    db: &DatabaseConnection,
    condition: sea_orm::sea_query::Expr,
    order: inbox::Column,
    consumer: Option<&str>,
    limit: u64,
    operation: &'static str,
) -> Result<Vec<inbox::Model>, InboxError> {
    if i64::try_from(limit).is_err() {
        return Err(InboxError::ValueOutOfRange {
            what: "the listing limit",
            value: limit.to_string(),
            max: i64::MAX.to_string(),
            advice: "list in pages of at most a few thousand rows",
        });
    }
    let mut query = inbox::Entity::find().filter(condition);
    if let Some(consumer) = consumer {
        validate_consumer(consumer)?;
        query = query.filter(consumer_is(db.get_database_backend(), consumer)?);
    }
    let query = query
        .order_by_asc(order)
        .order_by_asc(inbox::Column::Id)
        .limit(limit);
    let read = in_own_transaction(db, async |txn| query.all(txn).await);
    answered_within(db, Inbox::DEFAULT_PARTITION_TIMEOUT, operation, read)
        .await?
        .map_err(|source| InboxError::Query { operation, source })
}

#[cfg(test)]
mod tests {
    use super::*;
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
                Err(InboxError::ValueOutOfRange { what: "max_attempts", value, .. })
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
