//! Claiming messages on a SeaORM transaction: the sealed [`InboxTransactionExt`] and the
//! [`Claim`] it answers; one message ([`single`]), many ([`batch`]), and the one proof
//! before COMMIT that both commit through ([`held`]).

use crate::backend::ProcessMarker;
use crate::consumer::validate_claim;
use crate::silence::{StepTimer, answered_on};
use crate::{Delivery, Inbox, InboxError, Refusal};
use chrono::Utc;
use sea_orm::{ConnectionTrait, DatabaseTransaction};
use sea_orm_inbox_entity::InboxTable;
use std::future::Future;

mod batch;
mod binding;
mod held;
mod single;

pub(crate) use batch::sorted_batch;
pub use batch::{BatchClaim, MAX_CLAIM_BATCH};
pub use binding::ClaimingTransaction;
pub(crate) use held::Held;
pub use single::ClaimedMessage;
pub(crate) use single::{insert_marker, marker_token};

use crate::observed::{Binding, ObservedTransaction};
use batch::{admit_batch, insert_batch};
use binding::ClaimBinding;
use single::unresponsive_within;

/// The outcome of [`InboxTransactionExt::claim_message`].
///
/// Only [`Claimed`](Claim::Claimed) carries the [`ClaimedMessage`] that commits the work
/// ([`ClaimedMessage::commit`]), so the duplicate branch has nothing to commit with: match
/// on the claim, never ignore it.
///
/// After [`Duplicate`](Claim::Duplicate) the transaction must be rolled back (or dropped,
/// which rolls it back). The claim raised nothing into it (PostgreSQL's claim detects the
/// duplicate with `ON CONFLICT (message_id, consumer) DO NOTHING`; MySQL/MariaDB and SQLite keep a transaction
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

mod sealed {
    pub trait Sealed {}
    impl Sealed for sea_orm::DatabaseTransaction {}
    impl Sealed for crate::ObservedTransaction {}
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
    /// `delivery` is the message's [`MessageId`](crate::MessageId) (or a `Uuid`), or a [`Delivery`] with the
    /// time the message was sent and an [`AdmissionFloor`](crate::AdmissionFloor)
    /// ([`Delivery::with_floor`]): a delivery sent before the floor is [`Claim::Refused`]
    /// before any SQL runs.
    ///
    /// Returns [`Claim::Claimed`] when this transaction now holds it, and
    /// [`Claim::Duplicate`] only when the insert met the marker on the inbox index
    /// `ix_inbox_message_id_consumer` (on PostgreSQL through `ON CONFLICT (message_id,
    /// consumer)`, which infers that index, so the server logs no error for a duplicate; elsewhere as the unique violation the
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
    /// most [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT) for the database (PostgreSQL,
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
    /// - [`InboxError::MissingTable`] when the migration has not run (the claim needs only
    ///   [`CreateInbox`](crate::InboxMigration::CreateInbox), on every backend);
    ///   [`crate::verify_schema`] finds it at startup;
    /// - [`InboxError::DatabaseUnresponsive`] (step `the claim`) when the database did not
    ///   answer within [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT);
    /// - [`InboxError::Database`] for every other failure, including a unique violation on
    ///   any other index, with the original [`DbErr`](sea_orm::DbErr).
    fn claim_message(
        &self,
        delivery: impl Into<Delivery>,
        consumer: &str,
    ) -> impl Future<Output = Result<Claim, InboxError>> + Send;

    /// Claims every id of `message_ids` for `consumer` in one statement in this
    /// transaction, and reports which ids it newly claimed.
    ///
    /// Each item is a [`MessageId`](crate::MessageId) (or a `Uuid`), or a [`Delivery`] with its send time and
    /// floor: the deliveries the floor refuses are listed in
    /// [`BatchClaim::refused`](crate::BatchClaim::refused) (dead-letter them) and not
    /// claimed; an id given twice is refused if either delivery is.
    ///
    /// The ids are deduplicated and sorted first, so replicas claiming overlapping batches
    /// lock index entries in the same order (no deadlock between them). A row that exists
    /// for an id leaves it unchanged and raises nothing (PostgreSQL: `ON CONFLICT
    /// (message_id, consumer) DO NOTHING`; SQLite: `ON CONFLICT DO NOTHING`; MySQL:
    /// `ON DUPLICATE KEY UPDATE consumer = consumer`), so the transaction stays usable:
    /// process the `claimed` ids through this transaction, stopping at the first failed
    /// statement, then commit with [`BatchClaim::commit`](crate::BatchClaim::commit), which
    /// refuses a transaction the database has already ended. An id another open transaction
    /// holds makes the statement wait for it, as [`claim_message`](Self::claim_message) does.
    ///
    /// PostgreSQL and SQLite learn the inserted rows from `INSERT ... RETURNING`; MySQL 8 has
    /// no `RETURNING`, so the MySQL family (MariaDB too) reads this consumer's rows of the
    /// batch back in the same transaction (`SELECT ... FOR UPDATE`, one more round trip).
    /// Either way the batch fails rather than report an id as a duplicate when its row
    /// conflicted on a unique key other than the inbox's.
    ///
    /// The hazard [`ClaimedMessage`] guards against applies here too: a statement that
    /// fails while processing the batch aborts the transaction on PostgreSQL (its COMMIT
    /// then silently rolls back) and a deadlock rolls it back on InnoDB.
    /// [`BatchClaim::commit`] proves the markers as [`ClaimedMessage::commit`] does, but
    /// cannot undo the statements that ran outside the ended transaction: return such
    /// errors and nack the batch; never go on after one.
    ///
    /// The statement waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT) for the database
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
    /// inbox's own (roll back and drop that index). [`InboxError::ClaimLost`] when the
    /// server ended the transaction between the INSERT and its read-back (a Galera
    /// brute-force abort): roll back and re-run the batch.
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
    /// assert!(again.claimed.is_empty() && again.duplicates.len() == 2);
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

    /// [`claim_message`](Self::claim_message) for the inbox in `table`, an
    /// [`InboxTable`] of the application's choice (migrated with
    /// `sea_orm_inbox_migration::inbox_migrations(&table)`).
    ///
    /// ```
    /// use sea_orm_inbox::prelude::*;
    /// use sea_orm::TransactionTrait;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_migration::{MigrationTrait, SchemaManager};
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// let table = InboxTable::named("app_inbox")?;
    /// # let manager = SchemaManager::new(&db);
    /// # for migration in sea_orm_inbox_migration::inbox_migrations(&table) {
    /// #     migration.up(&manager).await?;
    /// # }
    /// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    /// match txn.claim_message_in(&table, uuid::Uuid::new_v4(), "billing").await? {
    ///     Claim::Claimed(claimed) => claimed.commit(txn).await?,
    ///     Claim::Duplicate | Claim::Refused(_) => txn.rollback().await?,
    /// }
    /// # Ok(()) }
    /// ```
    fn claim_message_in(
        &self,
        table: &InboxTable,
        delivery: impl Into<Delivery>,
        consumer: &str,
    ) -> impl Future<Output = Result<Claim, InboxError>> + Send;

    /// [`claim_batch`](Self::claim_batch) for the inbox in `table`, an [`InboxTable`] of
    /// the application's choice.
    fn claim_batch_in<I>(
        &self,
        table: &InboxTable,
        message_ids: I,
        consumer: &str,
    ) -> impl Future<Output = Result<BatchClaim, InboxError>> + Send
    where
        I: IntoIterator,
        I::Item: Into<Delivery>;
}

/// The claims on each transaction type, which differ only in what a claim binds to.
macro_rules! claims_on {
    ($txn:ty) => {
        impl InboxTransactionExt for $txn {
            fn claim_message(
                &self,
                delivery: impl Into<Delivery>,
                consumer: &str,
            ) -> impl Future<Output = Result<Claim, InboxError>> + Send {
                claim_one(self, InboxTable::default(), delivery.into(), consumer)
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
                claim_many(self, InboxTable::default(), collect(message_ids), consumer)
            }

            fn claim_message_in(
                &self,
                table: &InboxTable,
                delivery: impl Into<Delivery>,
                consumer: &str,
            ) -> impl Future<Output = Result<Claim, InboxError>> + Send {
                claim_one(self, table.clone(), delivery.into(), consumer)
            }

            fn claim_batch_in<I>(
                &self,
                table: &InboxTable,
                message_ids: I,
                consumer: &str,
            ) -> impl Future<Output = Result<BatchClaim, InboxError>> + Send
            where
                I: IntoIterator,
                I::Item: Into<Delivery>,
            {
                claim_many(self, table.clone(), collect(message_ids), consumer)
            }
        }
    };
}

claims_on!(DatabaseTransaction);
claims_on!(ObservedTransaction);

/// What a claim on a transaction binds to without a statement, if anything.
trait ClaimBound {
    fn claim_binding(&self) -> Option<Binding>;
}

impl ClaimBound for DatabaseTransaction {
    fn claim_binding(&self) -> Option<Binding> {
        None
    }
}

impl ClaimBound for ObservedTransaction {
    fn claim_binding(&self) -> Option<Binding> {
        self.binding()
    }
}

/// The deliveries of a batch, collected before its future, which must not hold a possibly
/// non-Send iterator.
fn collect<I>(message_ids: I) -> Vec<Delivery>
where
    I: IntoIterator,
    I::Item: Into<Delivery>,
{
    message_ids.into_iter().map(Into::into).collect()
}

/// One claim in `table` (owned: the future borrows only the transaction and the consumer).
fn claim_one<C: ConnectionTrait + ClaimBound + Sync>(
    txn: &C,
    table: InboxTable,
    delivery: Delivery,
    consumer: &str,
) -> impl Future<Output = Result<Claim, InboxError>> + Send {
    let admitted = delivery.admit(None, Utc::now());
    let binding = txn.claim_binding();
    async move {
        match admitted {
            Ok(()) => {
                let message_id = delivery.message_id();
                let claim = async {
                    let process = match binding {
                        Some(binding) if binding.bounded_connection => {
                            validate_claim(message_id, consumer)?;
                            Some(bounded_marker())
                        }
                        _ => None,
                    };
                    match insert_marker(txn, &table, message_id, consumer, process).await? {
                        Claim::Claimed(claimed) => {
                            let binding =
                                ClaimBinding::make(txn, binding).await.map_err(|err| {
                                    InboxError::from_claim(err, &table, message_id, consumer)
                                })?;
                            Ok::<_, InboxError>(Claim::Claimed(claimed.bound_to(binding)))
                        }
                        other => Ok(other),
                    }
                };
                let backend = txn.get_database_backend();
                // The claim's steps and its commit's run on one timer, which the claim
                // hands to its commit.
                let mut timer = StepTimer::default();
                let claimed = unresponsive_within(
                    &mut timer,
                    backend,
                    message_id,
                    consumer,
                    "the claim",
                    claim,
                )
                .await??;
                Ok(match claimed {
                    Claim::Claimed(claimed) => Claim::Claimed(claimed.timed_by(timer)),
                    other => other,
                })
            }
            Err(refusal) => {
                // Bad input is still reported first, as for an admitted delivery.
                validate_claim(delivery.message_id(), consumer)?;
                Ok(Claim::Refused(refusal))
            }
        }
    }
}

/// The marker of a claim on a connection that carries the bounds of an [`crate::Inbox`]
/// with the default timeouts: the plain INSERT, which sets none, with a token of its own
/// that the proof reads back when one is needed.
fn bounded_marker() -> ProcessMarker {
    ProcessMarker {
        token: uuid::Uuid::new_v4(),
        lock_wait: Inbox::DEFAULT_LOCK_TIMEOUT,
        silence: Inbox::DEFAULT_PARTITION_TIMEOUT,
        bounded_connection: true,
    }
}

/// One batch claim in `table`.
fn claim_many<C: ConnectionTrait + ClaimBound + Sync>(
    txn: &C,
    table: InboxTable,
    deliveries: Vec<Delivery>,
    consumer: &str,
) -> impl Future<Output = Result<BatchClaim, InboxError>> + Send {
    let admitted = admit_batch(deliveries, consumer, Utc::now());
    let backend = txn.get_database_backend();
    let binding = txn.claim_binding();
    async move {
        let claim = async {
            let batch = insert_batch(txn, &table, admitted, consumer).await?;
            let binding = ClaimBinding::make(txn, binding)
                .await
                .map_err(|err| batch.held().lost(Some(err)))?;
            Ok::<_, InboxError>(batch.bound_to(binding))
        };
        // As for one message: the claim hands its timer to its commit.
        let mut timer = StepTimer::default();
        let claimed = answered_on(&mut timer, backend, "the batch claim", claim).await??;
        Ok(claimed.timed_by(timer))
    }
}
