//! The listings a sweeper and an operator read: leases that expired without completing,
//! and claims parked as dead.

use super::DeadClaim;
use super::decide::attempts_of;
use crate::backend::{consumer_is, entity_select_in, timestamp_value};
use crate::clock::now_micros;
use crate::consumer::validate_consumer;
use crate::pooler::in_own_transaction;
use crate::silence::answered_within;
use crate::{Inbox, InboxError, MessageId};
use chrono::{DateTime, Utc};
use sea_orm::sea_query::ExprTrait;
use sea_orm::{ColumnTrait, DatabaseConnection, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use sea_orm_inbox_entity::{InboxTable, inbox};

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
/// A sweeper re-runs each one's side effect by calling [`claim_lease`](crate::claim_lease)
/// for it (which takes it over, or parks it after the last attempt) when it can rebuild
/// the message; the
/// broker's redelivery does the same otherwise.
///
/// The consumer name is compared exactly on every backend (MySQL/MariaDB's PAD SPACE
/// collation does not make "mailer" list the rows of "mailer ").
///
/// # Errors
/// A consumer name every claim refuses, as for `claim_message`
/// ([`InboxError::EmptyConsumer`], [`InboxError::ConsumerNotTrimmed`],
/// [`InboxError::ConsumerContainsNul`], [`InboxError::ConsumerTooLong`]);
/// [`InboxError::OutOfRange`] for a `limit` above `i64::MAX`;
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
    list_expired_leases_in(db, &InboxTable::default(), consumer, limit).await
}

/// [`list_expired_leases`] of the inbox in `table`, an [`InboxTable`] of the
/// application's choice.
///
/// # Errors
/// As [`list_expired_leases`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::{MigrationTrait, SchemaManager};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// let table = sea_orm_inbox::InboxTable::named("app_inbox")?;
/// # for migration in sea_orm_inbox_migration::inbox_migrations(&table) {
/// #     migration.up(&SchemaManager::new(&db)).await?;
/// # }
/// let stuck = sea_orm_inbox::list_expired_leases_in(&db, &table, None, 100).await?;
/// assert!(stuck.is_empty());
/// # Ok(()) }
/// ```
pub async fn list_expired_leases_in(
    db: &DatabaseConnection,
    table: &InboxTable,
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
        table,
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
    list_dead_claims_in(db, &InboxTable::default(), consumer, limit).await
}

/// [`list_dead_claims`] of the inbox in `table`, an [`InboxTable`] of the application's
/// choice.
///
/// # Errors
/// As [`list_expired_leases`].
pub async fn list_dead_claims_in(
    db: &DatabaseConnection,
    table: &InboxTable,
    consumer: Option<&str>,
    limit: u64,
) -> Result<Vec<DeadClaim>, InboxError> {
    let dead = inbox::Column::DeadAt.is_not_null();
    let rows = list_rows(
        db,
        table,
        dead,
        inbox::Column::DeadAt,
        consumer,
        limit,
        "listing dead claims",
    )
    .await?;
    Ok(rows
        .iter()
        .filter_map(|row| row.dead_at.map(|dead_at| DeadClaim::of_row(row, dead_at)))
        .collect())
}

/// Rows matching `condition` (and `consumer`, if given), ordered by `order` then id;
/// a failure is reported as `operation`. The input is checked before any SQL runs, and
/// the read waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database.
async fn list_rows(
    db: &DatabaseConnection,
    table: &InboxTable,
    condition: sea_orm::sea_query::Expr,
    order: inbox::Column,
    consumer: Option<&str>,
    limit: u64,
    operation: &'static str,
) -> Result<Vec<inbox::Model>, InboxError> {
    if i64::try_from(limit).is_err() {
        return Err(InboxError::OutOfRange {
            what: "the listing limit",
            value: limit.to_string(),
            accepted: format!("0..={}", i64::MAX),
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
    let query = entity_select_in(db.get_database_backend(), table, query)?;
    let read = in_own_transaction(db, async |txn| query.all(txn).await);
    answered_within(db, Inbox::DEFAULT_PARTITION_TIMEOUT, operation, read)
        .await?
        .map_err(|source| InboxError::Query { operation, source })
}
