use crate::backend::{DbErrorKind, classify, insert_marker_sql, timestamp_value};
use crate::batch::{BatchClaim, insert_batch, sorted_batch};
use crate::consumer::validate_claim;
use crate::{InboxError, MessageId};
use chrono::{DurationRound, TimeDelta, Utc};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbErr, Statement, Value};
use std::future::Future;

/// The outcome of [`InboxTransactionExt::claim_message`].
///
/// After [`Duplicate`](Claim::Duplicate) the transaction must be rolled back (or dropped,
/// which rolls it back): the claim statement failed inside it, and on PostgreSQL that
/// aborts the whole transaction, so any further statement fails with SQLSTATE 25P02.
/// Acknowledge the message to the broker either way: a duplicate is a success.
#[must_use = "a Duplicate claim means the work was already done: skip it and roll back"]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Claim {
    /// This transaction holds the marker: do the work, then commit.
    Claimed,
    /// A committed transaction already claimed this message for this consumer: do nothing,
    /// roll back, acknowledge the message.
    Duplicate,
}

impl Claim {
    /// Whether this transaction won the claim and must do the work.
    pub fn is_claimed(self) -> bool {
        self == Claim::Claimed
    }

    /// Whether the message was already processed by this consumer.
    pub fn is_duplicate(self) -> bool {
        self == Claim::Duplicate
    }
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
///         Claim::Claimed => {
///             txn.execute_raw(sea_orm::Statement::from_sql_and_values(
///                 txn.get_database_backend(),
///                 "UPDATE account SET balance = balance + ? WHERE id = ?",
///                 [amount.into(), account.into()],
///             ))
///             .await?;
///             txn.commit().await?;
///         }
///         // Already done by another delivery: undo nothing, write nothing.
///         Claim::Duplicate => txn.rollback().await?,
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
    /// Returns [`Claim::Claimed`] when this transaction now holds it, and
    /// [`Claim::Duplicate`] only when the database rejected the insert on the inbox index
    /// `ix_inbox_message_id_consumer`. If another open transaction holds the same claim,
    /// this call waits until it ends: committed means `Duplicate`, rolled back means
    /// `Claimed`.
    ///
    /// # Errors
    /// - [`InboxError::EmptyConsumer`], [`InboxError::ConsumerTooLong`],
    ///   [`InboxError::NilMessageId`] before any SQL runs;
    /// - [`InboxError::MissingTable`] when the migration has not run;
    /// - [`InboxError::Database`] for every other failure, including a unique violation on
    ///   any other index, with the original [`DbErr`].
    fn claim_message(
        &self,
        message_id: impl Into<MessageId>,
        consumer: &str,
    ) -> impl Future<Output = Result<Claim, InboxError>> + Send;

    /// Claims every id of `message_ids` for `consumer` in one statement in this
    /// transaction, and reports which ids it newly claimed.
    ///
    /// The ids are deduplicated and sorted first, so replicas claiming overlapping batches
    /// lock index entries in the same order (no deadlock between them). A row that exists
    /// for an id leaves it unchanged and raises nothing (`ON CONFLICT DO NOTHING`; MySQL:
    /// `ON DUPLICATE KEY UPDATE consumer = consumer`), so the transaction stays usable:
    /// process the `claimed` ids through this transaction, stopping at the first failed
    /// statement, then commit with [`BatchClaim::commit`](crate::BatchClaim::commit), which
    /// refuses a transaction the database has already ended. An id another open transaction
    /// holds makes the statement wait for it, as [`claim_message`](Self::claim_message) does.
    ///
    /// Needs PostgreSQL, SQLite, or MariaDB 10.5+ (`INSERT ... RETURNING`); MySQL 8 has no
    /// `RETURNING` and gets [`InboxError::Database`].
    ///
    /// # Errors
    /// Before any SQL: [`InboxError::EmptyBatch`], [`InboxError::BatchTooLarge`] (more than
    /// [`crate::MAX_CLAIM_BATCH`] distinct ids), [`InboxError::NilMessageId`] for a nil id
    /// anywhere in the batch, and the consumer errors of `claim_message`. Then
    /// [`InboxError::MissingTable`] or [`InboxError::Database`].
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
        I::Item: Into<MessageId>;
}

impl InboxTransactionExt for DatabaseTransaction {
    fn claim_message(
        &self,
        message_id: impl Into<MessageId>,
        consumer: &str,
    ) -> impl Future<Output = Result<Claim, InboxError>> + Send {
        insert_marker(self, message_id.into(), consumer)
    }

    fn claim_batch<I>(
        &self,
        message_ids: I,
        consumer: &str,
    ) -> impl Future<Output = Result<BatchClaim, InboxError>> + Send
    where
        I: IntoIterator,
        I::Item: Into<MessageId>,
    {
        // Collected before the future, which must not hold a possibly non-Send iterator.
        let ids = sorted_batch(message_ids.into_iter().map(Into::into).collect(), consumer);
        insert_batch(self, ids, consumer)
    }
}

/// The claim itself, for any connection the crate has already proven is a transaction.
pub(crate) async fn insert_marker<C: ConnectionTrait>(
    conn: &C,
    message_id: MessageId,
    consumer: &str,
) -> Result<Claim, InboxError> {
    validate_claim(message_id, consumer)?;
    let backend = conn.get_database_backend();
    let statement = Statement::from_sql_and_values(
        backend,
        insert_marker_sql(backend)?,
        [
            Value::from(message_id.as_uuid()),
            Value::from(consumer),
            timestamp_value(backend, now_micros()),
        ],
    );
    match conn.execute_raw(statement).await {
        Ok(_) => Ok(Claim::Claimed),
        Err(err) => claim_failure(err, message_id, consumer),
    }
}

fn claim_failure(err: DbErr, message_id: MessageId, consumer: &str) -> Result<Claim, InboxError> {
    match classify(&err) {
        DbErrorKind::InboxDuplicate => Ok(Claim::Duplicate),
        _ => Err(InboxError::from_claim(err, message_id, consumer)),
    }
}

/// The current UTC time cut to microseconds, the precision every backend stores, so a
/// value read back equals the value written.
pub(crate) fn now_micros() -> chrono::DateTime<Utc> {
    let now = Utc::now();
    now.duration_trunc(TimeDelta::microseconds(1))
        .unwrap_or(now)
}
