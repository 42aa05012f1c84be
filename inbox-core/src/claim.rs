use crate::backend::{
    DbErrorKind, ProcessMarker, claim_marker_statement, claim_silence_statement, classify,
    inbox_duplicate_confirmation, marker_held_statement, marker_insert_returns_id, roll_back,
    transaction_ended,
};
use crate::batch::{BatchClaim, admit_batch, insert_batch};
use crate::consumer::validate_claim;
use crate::silence::{answered_on, within};
use crate::{Delivery, Inbox, InboxError, MessageId, Refusal};
use chrono::Utc;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, EntityTrait, QueryFilter,
    QuerySelect,
};
use sea_orm_inbox_entity::inbox;
use std::future::Future;
use uuid::Uuid;

/// The outcome of [`InboxTransactionExt::claim_message`].
///
/// Only [`Claimed`](Claim::Claimed) carries the [`ClaimedMessage`] that commits the work
/// ([`ClaimedMessage::commit`]), so the duplicate branch has nothing to commit with: match
/// on the claim, never ignore it.
///
/// After [`Duplicate`](Claim::Duplicate) the transaction must be rolled back (or dropped,
/// which rolls it back). The claim raised nothing into it (PostgreSQL's claim detects the
/// duplicate with `ON CONFLICT ON CONSTRAINT`; MySQL/MariaDB and SQLite keep a transaction
/// usable after a unique violation), so it is still usable: a caller who ignores
/// `Duplicate` and commits applies the work a second time. Acknowledge the message to the
/// broker either way: a duplicate is a success.
#[must_use = "a Duplicate claim means the work was already done: skip it and roll back"]
#[derive(Debug, PartialEq, Eq, Hash)]
pub enum Claim {
    /// This transaction holds the marker: do the work through it, then commit with
    /// [`ClaimedMessage::commit`].
    Claimed(ClaimedMessage),
    /// A committed transaction already claimed this message for this consumer: do nothing,
    /// roll back, acknowledge the message.
    Duplicate,
    /// The delivery's [admission floor](crate::AdmissionFloor) refused it before any SQL
    /// ran: its marker may already be purged. Do nothing, roll back, dead-letter the
    /// message ([`Settlement::DeadLetter`](crate::Settlement::DeadLetter)).
    Refused(Refusal),
}

impl Claim {
    /// Whether this transaction won the claim and must do the work.
    pub fn is_claimed(&self) -> bool {
        matches!(self, Claim::Claimed(_))
    }

    /// Whether the message was already processed by this consumer.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Claim::Duplicate)
    }

    /// Why the admission floor refused the delivery, if it did.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Claim::Refused(refusal) => Some(*refusal),
            Claim::Claimed(_) | Claim::Duplicate => None,
        }
    }
}

/// The marker this transaction inserted: proof of a won claim, and the way to commit it.
///
/// A transaction can lose its marker before COMMIT without the caller noticing: on
/// PostgreSQL any failed statement aborts the transaction, and a later `COMMIT` answers
/// `ROLLBACK` without an error; on MySQL/MariaDB a deadlock (1213) rolls the whole
/// transaction back, marker included, and the statements after it run outside it. (A lock
/// wait timeout, 1205, rolls back only the statement that waited, unless the server runs
/// with `innodb_rollback_on_timeout = ON`: the marker and the earlier writes stay.) A
/// handler that swallows such an error and commits has committed nothing of the claim,
/// and acking the message then loses it. [`commit`](Self::commit) first proves that the
/// transaction still holds the marker (one primary-key read through the transaction), and
/// fails with [`InboxError::ClaimLost`] (nack) instead of committing otherwise.
///
/// What the check cannot undo: statements that ran *outside* the transaction after the
/// database ended it. On MySQL/MariaDB with the default `autocommit = 1`, the statements
/// the handler runs after InnoDB rolled its transaction back on a deadlock commit one by
/// one, and stay committed although the message is nacked (measured on MariaDB 10.11).
/// On a pool whose connections run with `autocommit = 0` (for example `SET SESSION
/// autocommit = 0` in an after-connect hook of a pool used only for handlers) they start a
/// new transaction instead, which the rollback after the failed check undoes; the library
/// does not switch autocommit itself, as that costs two round trips per message on a
/// shared pool. Return database errors from the handler instead of swallowing them.
///
/// ```
/// use sea_orm_inbox::prelude::*;
/// use sea_orm::{ConnectionTrait, TransactionTrait};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
/// match txn.claim_message(uuid::Uuid::new_v4(), "billing.credit").await? {
///     Claim::Claimed(claimed) => {
///         // business writes through `txn`
///         claimed.commit(txn).await?; // proves the marker is still held, then commits
///     }
///     Claim::Duplicate => txn.rollback().await?,
///     Claim::Refused(_) => txn.rollback().await?, // dead-letter: sent before the floor
/// }
/// # Ok(()) }
/// ```
///
/// The claim must be matched: a [`Claim`] is not a `ClaimedMessage`, so ignoring the
/// duplicate case does not compile.
///
/// ```compile_fail
/// use sea_orm_inbox::prelude::*;
/// # async fn handler(txn: sea_orm::DatabaseTransaction) -> Result<(), InboxError> {
/// let claimed: ClaimedMessage = txn.claim_message(uuid::Uuid::new_v4(), "billing").await?;
/// claimed.commit(txn).await
/// # }
/// ```
///
/// A `ClaimedMessage` is the proof of one transaction's claim: only a claim makes one and
/// [`commit`](Self::commit) consumes it. It is not `Clone` (nor is [`Claim`]): a committed
/// marker is visible to every later transaction, so a copy would let a second transaction
/// pass the check and apply its writes under the marker the first one committed.
///
/// ```compile_fail
/// use sea_orm_inbox::prelude::*;
/// # async fn twice(claimed: ClaimedMessage, a: sea_orm::DatabaseTransaction, b: sea_orm::DatabaseTransaction) {
/// let copy = claimed.clone();
/// claimed.commit(a).await;
/// copy.commit(b).await; // would apply b's writes under the marker a committed
/// # }
/// ```
#[must_use = "commit the work with ClaimedMessage::commit, which proves the marker is still held"]
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct ClaimedMessage {
    message_id: MessageId,
    consumer: String,
    marker_id: i64,
    /// The `claim_token` the marker was written with (by `Inbox::process` only), which the
    /// proof checks too.
    token: Option<Uuid>,
}

impl ClaimedMessage {
    /// The claimed message.
    pub fn message_id(&self) -> MessageId {
        self.message_id
    }

    /// The consumer that claimed it.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The `id` of the marker row this transaction inserted.
    pub fn marker_id(&self) -> i64 {
        self.marker_id
    }

    /// Proves that `txn` still holds this marker: call it last before committing when you
    /// commit yourself ([`commit`](Self::commit) calls it for you).
    ///
    /// On SQLite it also asks whether the transaction is still open (a `BEGIN`, which fails
    /// inside one): SQLite gives a rolled-back marker's id to the next insert, so after the
    /// database ended this transaction another replica's marker for the same message can
    /// carry the same id.
    ///
    /// # Errors
    /// [`InboxError::ClaimLost`] when the database ended the transaction (PostgreSQL
    /// aborted it after a failed statement; InnoDB rolled it back on a deadlock): roll
    /// back and nack. [`InboxError::Database`] when the check itself failed (a lost
    /// connection: transient, nack).
    ///
    /// It waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT)
    /// for the database (PostgreSQL, MySQL/MariaDB), then fails with
    /// [`InboxError::DatabaseUnresponsive`] (step `the claim check`): drop the transaction
    /// and nack.
    pub async fn ensure_held(&self, txn: &DatabaseTransaction) -> Result<(), InboxError> {
        let check = ensure_marker_held(txn, self);
        self.bounded(txn.get_database_backend(), "the claim check", false, check)
            .await?
    }

    /// Proves that `txn` still holds this marker, then commits it.
    ///
    /// Each of the two statements waits at most
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT) for
    /// the database (PostgreSQL, MySQL/MariaDB; there is no option to change it), so a
    /// network partition cannot hang the caller.
    ///
    /// # Errors
    /// [`InboxError::ClaimLost`] (the transaction is rolled back; nothing was committed) or
    /// [`InboxError::Database`] (the check or the COMMIT failed): nack the message.
    /// [`InboxError::DatabaseUnresponsive`] when the database went silent: nack. With
    /// `commit_in_doubt` (step `COMMIT`) the COMMIT may have committed, its reply lost: the
    /// redelivery's claim tells, [`Claim::Duplicate`] if it did.
    pub async fn commit(self, txn: DatabaseTransaction) -> Result<(), InboxError> {
        let backend = txn.get_database_backend();
        if let Err(err) = self.ensure_held(&txn).await {
            // An unanswered check leaves a ROLLBACK the silent database would not answer
            // either: dropping the transaction gives its connection up instead.
            if !matches!(err, InboxError::DatabaseUnresponsive { .. }) {
                roll_back(txn).await;
            }
            return Err(err);
        }
        self.bounded(backend, "COMMIT", true, txn.commit())
            .await?
            .map_err(|source| InboxError::Database {
                message_id: self.message_id,
                consumer: self.consumer,
                source,
            })
    }

    /// Awaits `future`, a statement of this claim's transaction, within the default
    /// partition timeout.
    async fn bounded<F: Future>(
        &self,
        backend: DbBackend,
        step: &'static str,
        commit_in_doubt: bool,
        future: F,
    ) -> Result<F::Output, InboxError> {
        unresponsive_within(
            backend,
            self.message_id,
            &self.consumer,
            step,
            commit_in_doubt,
            future,
        )
        .await
    }
}

/// Awaits `future`, a statement of a claim of `message_id` for `consumer` in a caller's
/// transaction, at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`], and reports
/// [`InboxError::DatabaseUnresponsive`] for `step` past it.
async fn unresponsive_within<F: Future>(
    backend: DbBackend,
    message_id: MessageId,
    consumer: &str,
    step: &'static str,
    commit_in_doubt: bool,
    future: F,
) -> Result<F::Output, InboxError> {
    within(backend, Inbox::DEFAULT_PARTITION_TIMEOUT, future)
        .await
        .map_err(|waited| InboxError::DatabaseUnresponsive {
            message_id,
            consumer: consumer.to_owned(),
            step,
            waited,
            commit_in_doubt,
        })
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sea_orm::DatabaseTransaction {}
}

/// Claims messages inside a SeaORM transaction.
///
/// Implemented for [`DatabaseTransaction`] only, so the marker always commits or rolls back
/// together with the handler's business writes. A claim on a bare connection would commit
/// on its own, and does not compile:
///
/// ```compile_fail
/// use sea_orm_inbox::prelude::*;
/// # async fn handler(db: &sea_orm::DatabaseConnection) -> Result<(), InboxError> {
/// let _ = db.claim_message(uuid::Uuid::new_v4(), "billing").await?;
/// # Ok(()) }
/// ```
///
/// A complete handler: claim first, then write through the same transaction, then commit.
///
/// ```
/// use sea_orm_inbox::prelude::*;
/// use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
///
/// async fn handle_payment(
///     db: &DatabaseConnection,
///     message_id: uuid::Uuid,
///     account: i64,
///     amount: i64,
/// ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     let txn = db.begin().await?;
///     match txn.claim_message(message_id, "billing.credit").await? {
///         Claim::Claimed(claimed) => {
///             txn.execute_raw(sea_orm::Statement::from_sql_and_values(
///                 txn.get_database_backend(),
///                 "UPDATE account SET balance = balance + ? WHERE id = ?",
///                 [amount.into(), account.into()],
///             ))
///             .await?;
///             claimed.commit(txn).await?; // proves the marker is still held, then commits
///         }
///         // Already done by another delivery: undo nothing, write nothing.
///         Claim::Duplicate => txn.rollback().await?,
///         // Sent before the admission floor (only with a `Delivery` carrying one).
///         Claim::Refused(refusal) => {
///             txn.rollback().await?;
///             return Err(refusal.to_string().into()); // dead-letter it
///         }
///     }
///     Ok(()) // ack the message in both cases
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// # db.execute_unprepared("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)").await?;
/// # db.execute_unprepared("INSERT INTO account VALUES (1, 0)").await?;
/// # let id = uuid::Uuid::new_v4();
/// # handle_payment(&db, id, 1, 10).await?;
/// # handle_payment(&db, id, 1, 10).await?;
/// # let row = db.query_one_raw(sea_orm::Statement::from_string(db.get_database_backend(), "SELECT balance FROM account")).await?.unwrap();
/// # assert_eq!(row.try_get_by_index::<i64>(0)?, 10);
/// # Ok(()) }
/// ```
pub trait InboxTransactionExt: sealed::Sealed {
    /// Inserts the marker for `(message_id, consumer)` in this transaction.
    ///
    /// `delivery` is the message's [`MessageId`] (or a `Uuid`), or a [`Delivery`] with the
    /// time the message was sent and an [`AdmissionFloor`](crate::AdmissionFloor)
    /// ([`Delivery::with_floor`]): a delivery sent before the floor is [`Claim::Refused`]
    /// before any SQL runs.
    ///
    /// Returns [`Claim::Claimed`] when this transaction now holds it, and
    /// [`Claim::Duplicate`] only when the insert met the marker on the inbox index
    /// `ix_inbox_message_id_consumer` (on PostgreSQL through `ON CONFLICT ON CONSTRAINT`,
    /// so the server logs no error for a duplicate; elsewhere as the unique violation the
    /// database raised on that index). On PostgreSQL under REPEATABLE READ or SERIALIZABLE,
    /// a marker committed after the transaction's snapshot was taken fails the claim with a
    /// serialization failure (40001, which [`crate::classify`] calls transient) instead:
    /// retry in a new transaction, which sees the marker and gets `Duplicate`. If another open transaction holds the same claim,
    /// this call waits until it ends: committed means `Duplicate`, rolled back means
    /// `Claimed`. The wait is bounded by the backend's own lock timeout (PostgreSQL:
    /// `lock_timeout`, unbounded by default, so consider `SET LOCAL lock_timeout` first;
    /// MySQL/MariaDB: `innodb_lock_wait_timeout`, 50 s by default; SQLite: the busy
    /// timeout); [`crate::Inbox::process`] bounds it for you.
    ///
    /// A silent network (a partition that drops packets) is bounded: the call waits at
    /// most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database (PostgreSQL,
    /// MySQL/MariaDB; no option changes it), then fails with
    /// [`InboxError::DatabaseUnresponsive`]: drop the transaction and nack. So the lock
    /// wait above also ends there. On PostgreSQL the INSERT also sets
    /// `idle_in_transaction_session_timeout` and `tcp_user_timeout` to that bound for this
    /// transaction (a shorter `idle_in_transaction_session_timeout` is kept): the server
    /// ends the transaction of a client cut off by a partition, releasing the marker,
    /// instead of holding it for hours. The transaction must therefore not sit idle longer than that between
    /// statements; `SET LOCAL idle_in_transaction_session_timeout` after the claim to allow
    /// more. MySQL/MariaDB get no such bound from the claim: the session statement it takes
    /// would cost a round trip per claim and outlive the transaction on the pooled
    /// connection; set `idle_transaction_timeout` (MariaDB) and `net_write_timeout` on the
    /// pool's connections instead (e.g. `SET SESSION idle_transaction_timeout = 20,
    /// net_write_timeout = 20` in an after-connect hook).
    ///
    /// Commit through [`ClaimedMessage::commit`]: it proves the transaction still holds
    /// the marker before COMMIT.
    ///
    /// One consumer name, one mode: a row that a two-phase [`crate::claim_lease`] wrote for
    /// the same consumer counts as claimed here too, finished or not, so an unfinished
    /// lease gives `Duplicate` (never a second run of the work beside the lease holder's
    /// side effect). Finishing that lease stays the lease protocol's job: its holder
    /// completes it, or after it expires a sweeper finds it with
    /// [`crate::list_expired_leases`] and takes it over. [`claim_batch`](Self::claim_batch)
    /// and [`crate::Inbox::process`] answer the same.
    ///
    /// # Errors
    /// - [`InboxError::EmptyConsumer`], [`InboxError::ConsumerNotTrimmed`],
    ///   [`InboxError::ConsumerContainsNul`], [`InboxError::ConsumerTooLong`],
    ///   [`InboxError::NilMessageId`] before any SQL runs;
    /// - [`InboxError::MissingTable`] when the migration has not run;
    /// - [`InboxError::MissingMigration`] when a later inbox migration has not run (on
    ///   PostgreSQL: [`InboxUniqueConstraint`](crate::InboxMigration::InboxUniqueConstraint));
    ///   [`crate::verify_schema`] finds it at startup;
    /// - [`InboxError::DatabaseUnresponsive`] (step `the claim`) when the database did not
    ///   answer within [`Inbox::DEFAULT_PARTITION_TIMEOUT`];
    /// - [`InboxError::Database`] for every other failure, including a unique violation on
    ///   any other index, with the original [`DbErr`].
    fn claim_message(
        &self,
        delivery: impl Into<Delivery>,
        consumer: &str,
    ) -> impl Future<Output = Result<Claim, InboxError>> + Send;

    /// Claims every id of `message_ids` for `consumer` in one statement in this
    /// transaction, and reports which ids it newly claimed.
    ///
    /// Each item is a [`MessageId`] (or a `Uuid`), or a [`Delivery`] with its send time and
    /// floor: the deliveries the floor refuses are listed in
    /// [`BatchClaim::refused`](crate::BatchClaim::refused) (dead-letter them) and not
    /// claimed; an id given twice is refused if either delivery is.
    ///
    /// The ids are deduplicated and sorted first, so replicas claiming overlapping batches
    /// lock index entries in the same order (no deadlock between them). A row that exists
    /// for an id leaves it unchanged and raises nothing (PostgreSQL: `ON CONFLICT ON
    /// CONSTRAINT ix_inbox_message_id_consumer DO NOTHING`; SQLite: `ON CONFLICT DO NOTHING`; MySQL:
    /// `ON DUPLICATE KEY UPDATE consumer = consumer`), so the transaction stays usable:
    /// process the `claimed` ids through this transaction, stopping at the first failed
    /// statement, then commit with [`BatchClaim::commit`](crate::BatchClaim::commit), which
    /// refuses a transaction the database has already ended. An id another open transaction
    /// holds makes the statement wait for it, as [`claim_message`](Self::claim_message) does.
    ///
    /// PostgreSQL and SQLite learn the inserted rows from `INSERT ... RETURNING`; MySQL 8 has
    /// no `RETURNING`, so the MySQL family (MariaDB too) reads this consumer's rows of the
    /// batch back in the same transaction (`SELECT ... FOR UPDATE`, one more round trip).
    /// Either way the batch fails rather than report an id as already claimed when its row
    /// conflicted on a unique key other than the inbox's.
    ///
    /// The hazard [`ClaimedMessage`] guards against applies here too, without a check: a
    /// statement that fails while processing the batch aborts the transaction on
    /// PostgreSQL (its COMMIT then silently rolls back) and a deadlock rolls it back on
    /// InnoDB. Return such errors and nack the batch; never commit after swallowing one.
    ///
    /// The statement waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database
    /// (PostgreSQL, MySQL/MariaDB; no option changes it), then fails with
    /// [`InboxError::DatabaseSilent`]: drop the transaction and nack the batch. It gets no
    /// server-side bound: set `idle_in_transaction_session_timeout` (PostgreSQL, `SET
    /// LOCAL` before claiming) or `idle_transaction_timeout` (MariaDB, per pool) so the
    /// server ends the transaction of a replica cut off by a partition.
    ///
    /// # Errors
    /// Before any SQL: [`InboxError::EmptyBatch`], [`InboxError::BatchTooLarge`] (more than
    /// [`crate::MAX_CLAIM_BATCH`] distinct ids), [`InboxError::NilMessageId`] for a nil id
    /// anywhere in the batch, and the consumer errors of `claim_message`. Then
    /// [`InboxError::MissingTable`], [`InboxError::MissingMigration`] or
    /// [`InboxError::Database`], which is also the error
    /// when a batch row conflicted on a unique index of the inbox table other than the
    /// inbox's own (roll back and drop that index).
    ///
    /// ```
    /// use sea_orm_inbox::prelude::*;
    /// use sea_orm::TransactionTrait;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_migration::MigratorTrait;
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
    /// let records = [("orders", 0, 41), ("orders", 0, 42)];
    /// let ids = records
    ///     .iter()
    ///     .map(|(topic, partition, offset)| MessageId::from_kafka(topic, *partition, *offset))
    ///     .collect::<Result<Vec<_>, _>>()?;
    ///
    /// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    /// let batch = txn.claim_batch(ids.clone(), "projector").await?;
    /// for id in &batch.claimed {
    ///     // apply record `id` through `txn`
    /// }
    /// assert_eq!(batch.claimed.len(), 2);
    /// batch.commit(txn).await?;
    ///
    /// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    /// let again = txn.claim_batch(ids, "projector").await?;
    /// assert!(again.claimed.is_empty() && again.already_claimed.len() == 2);
    /// again.commit(txn).await?; // nothing newly claimed: a plain commit
    /// # Ok(()) }
    /// ```
    fn claim_batch<I>(
        &self,
        message_ids: I,
        consumer: &str,
    ) -> impl Future<Output = Result<BatchClaim, InboxError>> + Send
    where
        I: IntoIterator,
        I::Item: Into<Delivery>;
}

impl InboxTransactionExt for DatabaseTransaction {
    fn claim_message(
        &self,
        delivery: impl Into<Delivery>,
        consumer: &str,
    ) -> impl Future<Output = Result<Claim, InboxError>> + Send {
        let delivery = delivery.into();
        let admitted = delivery.admit(None, Utc::now());
        async move {
            match admitted {
                Ok(()) => {
                    let claim = insert_marker(self, delivery.message_id(), consumer, None);
                    let backend = self.get_database_backend();
                    let message_id = delivery.message_id();
                    unresponsive_within(backend, message_id, consumer, "the claim", false, claim)
                        .await?
                }
                Err(refusal) => {
                    // Bad input is still reported first, as for an admitted delivery.
                    validate_claim(delivery.message_id(), consumer)?;
                    Ok(Claim::Refused(refusal))
                }
            }
        }
    }

    fn claim_batch<I>(
        &self,
        message_ids: I,
        consumer: &str,
    ) -> impl Future<Output = Result<BatchClaim, InboxError>> + Send
    where
        I: IntoIterator,
        I::Item: Into<Delivery>,
    {
        // Collected before the future, which must not hold a possibly non-Send iterator.
        let deliveries = message_ids.into_iter().map(Into::into).collect();
        let admitted = admit_batch(deliveries, consumer, Utc::now());
        let claim = insert_batch(self, admitted, consumer);
        let backend = self.get_database_backend();
        async move { answered_on(backend, "the batch claim", claim).await? }
    }
}

/// The claim itself, for any connection the crate has already proven is a transaction.
/// With `process` (from `Inbox::process`) the marker carries the call's token in
/// `claim_token` (see [`marker_token`]), bounds its lock wait where the backend allows it
/// per transaction (see [`claim_marker_statement`]), and makes the server end the
/// transaction once the client goes silent (see [`claim_silence_statement`]).
pub(crate) async fn insert_marker<C: ConnectionTrait>(
    conn: &C,
    message_id: MessageId,
    consumer: &str,
    process: Option<ProcessMarker>,
) -> Result<Claim, InboxError> {
    validate_claim(message_id, consumer)?;
    let backend = conn.get_database_backend();
    let token = process.as_ref().map(|process| process.token);
    let claimed = |marker_id| {
        Claim::Claimed(ClaimedMessage {
            message_id,
            consumer: consumer.to_owned(),
            marker_id,
            token,
        })
    };
    if let Some(process) = &process {
        // Before the INSERT: the server reads the bound when it starts waiting for the
        // client, and from the INSERT on the transaction holds the marker's lock.
        if let Some(sql) = claim_silence_statement(backend, process.silence)? {
            conn.execute_unprepared(&sql)
                .await
                .map_err(|err| InboxError::from_claim(err, message_id, consumer))?;
        }
    }
    let statement = claim_marker_statement(backend, message_id, consumer, now_micros(), process)?;
    let marker_id = if marker_insert_returns_id(backend)? {
        match conn.query_one_raw(statement).await {
            Ok(Some(row)) => row.try_get_by_index::<i64>(0),
            // The conflict clause met the marker of a committed claim.
            Ok(None) => return Ok(Claim::Duplicate),
            Err(err) => return claim_failure(conn, err, message_id, consumer).await,
        }
    } else {
        match conn.execute_raw(statement).await {
            Ok(done) => {
                return Ok(claimed(marker_id_of(
                    done.last_insert_id(),
                    message_id,
                    consumer,
                )?));
            }
            Err(err) => return claim_failure(conn, err, message_id, consumer).await,
        }
    }
    .map_err(|err| InboxError::from_claim(err, message_id, consumer))?;
    Ok(claimed(marker_id))
}

/// The marker id the driver reported for the INSERT (MySQL's `LAST_INSERT_ID`, SQLite's
/// rowid), as the bigint the table stores.
fn marker_id_of(
    last_insert_id: u64,
    message_id: MessageId,
    consumer: &str,
) -> Result<i64, InboxError> {
    i64::try_from(last_insert_id).map_err(|_| {
        InboxError::from_claim(
            DbErr::Custom(format!(
                "the marker id {last_insert_id} does not fit a bigint"
            )),
            message_id,
            consumer,
        )
    })
}

/// Fails unless `conn` (the claim's transaction) still sees the marker `claimed` inserted.
pub(crate) async fn ensure_marker_held<C: ConnectionTrait>(
    conn: &C,
    claimed: &ClaimedMessage,
) -> Result<(), InboxError> {
    let backend = conn.get_database_backend();
    let statement = marker_held_statement(
        backend,
        claimed.marker_id,
        claimed.message_id,
        &claimed.consumer,
        claimed.token,
    )?;
    let lost = |source| InboxError::ClaimLost {
        message_id: claimed.message_id,
        consumer: claimed.consumer.clone(),
        source,
    };
    let held = match conn.query_one_raw(statement).await {
        // Without a token the row may be another replica's marker that took the id of this
        // transaction's rolled-back one (SQLite reuses it): ask whether it is still open.
        Ok(Some(_)) if claimed.token.is_none() => transaction_ended(conn).await.map(|ended| !ended),
        Ok(found) => Ok(found.is_some()),
        Err(err) => Err(err),
    };
    match held {
        Ok(true) => Ok(()),
        Ok(false) => Err(lost(None)),
        Err(err) if classify(&err) == DbErrorKind::Transient => Err(InboxError::Database {
            message_id: claimed.message_id,
            consumer: claimed.consumer.clone(),
            source: err,
        }),
        Err(err) => Err(lost(Some(err))),
    }
}

/// The `claim_token` of the committed marker of `(message_id, consumer)`: `None` when there
/// is no marker or it carries no token. Who wrote a marker, for a caller that lost the
/// reply to its own COMMIT. It takes a transaction, never a pool: behind a transaction
/// pooler a statement with bound values outside one fails with 26000.
pub(crate) async fn marker_token(
    conn: &DatabaseTransaction,
    message_id: MessageId,
    consumer: &str,
) -> Result<Option<Uuid>, DbErr> {
    let token = inbox::Entity::find()
        .select_only()
        .column(inbox::Column::ClaimToken)
        .filter(inbox::Column::MessageId.eq(message_id.as_uuid()))
        .filter(inbox::Column::Consumer.eq(consumer))
        .into_tuple::<Option<Uuid>>()
        .one(conn)
        .await?;
    Ok(token.flatten())
}

/// What a failed marker INSERT means: `Duplicate` only when the violated index is the
/// inbox's, confirmed through `conn` (the claim's transaction, still usable after a
/// duplicate on the backends that need the check) where the error cannot tell.
async fn claim_failure<C: ConnectionTrait>(
    conn: &C,
    err: DbErr,
    message_id: MessageId,
    consumer: &str,
) -> Result<Claim, InboxError> {
    if classify(&err) != DbErrorKind::InboxDuplicate {
        return Err(InboxError::from_claim(err, message_id, consumer));
    }
    let backend = conn.get_database_backend();
    let Some(confirmation) = inbox_duplicate_confirmation(backend, message_id, consumer)? else {
        return Ok(Claim::Duplicate);
    };
    match conn.query_one_raw(confirmation).await {
        Ok(Some(_)) => Ok(Claim::Duplicate),
        // No marker: the index was a namesake on another table (the error's advice says so).
        Ok(None) => Err(InboxError::from_claim(err, message_id, consumer)),
        Err(read) => Err(InboxError::from_claim(read, message_id, consumer)),
    }
}

/// The current UTC time cut to microseconds, the precision every backend stores, so a
/// value read back equals the value written.
pub(crate) fn now_micros() -> chrono::DateTime<Utc> {
    crate::clock::truncate_to_micros(Utc::now())
}
