use super::OutboxError;
use super::message::DeadMessage;
use super::relay::bounded;
use crate::MessageId;
use crate::backend::outbox::{backlog_statement, purge_sent_statement, requeue_statement};
use crate::clock::now_micros;
use chrono::{DateTime, Utc};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbErr, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect, TransactionTrait,
};
use sea_orm_inbox_entity::outbox;

/// The outbox's waiting rows, for a backlog gauge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutboxBacklog {
    /// Rows not yet sent and not dead: due now, delayed, leased or waiting for a retry.
    pub pending: u64,
    /// Dead rows waiting for an operator ([`requeue_dead_message`] or a DELETE).
    pub dead: u64,
}

/// Counts the outbox's unsent rows, in a transaction of its own (so it works behind a
/// transaction pooler). One scan of the unsent rows (`ix_outbox_pending`).
///
/// # Errors
/// [`OutboxError::Database`] or [`OutboxError::DatabaseSilent`].
pub async fn outbox_backlog(db: &DatabaseConnection) -> Result<OutboxBacklog, OutboxError> {
    let statement = backlog_statement(db.get_database_backend())?;
    let read = async {
        let txn = db.begin().await?;
        let row = txn.query_one_raw(statement).await?;
        txn.rollback().await?;
        let counts = match row {
            Some(row) => (
                row.try_get_by_index::<i64>(0)?,
                row.try_get_by_index::<i64>(1)?,
            ),
            None => (0, 0),
        };
        Ok::<_, DbErr>(counts)
    };
    let (pending, dead) = bounded(db.get_database_backend(), "reading the backlog", read).await?;
    Ok(OutboxBacklog {
        pending: u64::try_from(pending).unwrap_or(0),
        dead: u64::try_from(dead).unwrap_or(0),
    })
}

/// The dead messages, oldest parking first, at most `limit`.
///
/// # Errors
/// [`OutboxError::Database`] or [`OutboxError::DatabaseSilent`].
pub async fn list_dead_messages(
    db: &DatabaseConnection,
    limit: u64,
) -> Result<Vec<DeadMessage>, OutboxError> {
    let read = async {
        let txn = db.begin().await?;
        let rows = outbox::Entity::find()
            .filter(outbox::Column::DeadAt.is_not_null())
            .filter(outbox::Column::SentAt.is_null())
            .order_by_asc(outbox::Column::DeadAt)
            .order_by_asc(outbox::Column::Id)
            .limit(limit)
            .all(&txn)
            .await?;
        txn.rollback().await?;
        Ok::<_, DbErr>(rows)
    };
    let rows = bounded(db.get_database_backend(), "listing dead messages", read).await?;
    Ok(rows
        .into_iter()
        .filter_map(|row| {
            Some(DeadMessage {
                dead_at: row.dead_at?,
                message_id: MessageId::from_uuid(row.message_id),
                destination: row.destination,
                key: row.partition_key,
                attempts: u32::try_from(row.attempts).unwrap_or(0),
                last_error: row.last_error,
                created_at: row.created_at,
            })
        })
        .collect())
}

/// Puts a dead message back in line, with a fresh attempt count: the next relay batch
/// publishes it (and then the later messages of its key). Returns whether a dead message
/// with this id existed.
///
/// # Errors
/// [`OutboxError::Database`] or [`OutboxError::DatabaseSilent`].
pub async fn requeue_dead_message(
    db: &DatabaseConnection,
    message_id: MessageId,
) -> Result<bool, OutboxError> {
    let statement = requeue_statement(
        db.get_database_backend(),
        message_id.as_uuid(),
        now_micros(),
    )?;
    let write = async {
        let txn = db.begin().await?;
        let done = txn.execute_raw(statement).await?;
        txn.commit().await?;
        Ok::<_, DbErr>(done.rows_affected())
    };
    Ok(bounded(
        db.get_database_backend(),
        "requeueing a dead message",
        write,
    )
    .await?
        > 0)
}

/// Deletes the rows sent before `cutoff`, in batches of at most `batch` rows, each its own
/// short transaction (a long DELETE would hold locks the relay's claims wait for). Returns
/// how many rows it deleted. Unsent and dead rows are never deleted.
///
/// Keep sent rows as long as you want to look up what was published (a day is plenty for
/// most); the outbox does not need them to deduplicate: an enqueue of a purged id writes a
/// new row, which is published again.
///
/// # Errors
/// [`OutboxError::InvalidOptions`] for a zero `batch`; [`OutboxError::Database`] or
/// [`OutboxError::DatabaseSilent`] (the batches before it stay deleted).
pub async fn purge_sent_messages(
    db: &DatabaseConnection,
    cutoff: DateTime<Utc>,
    batch: u32,
) -> Result<u64, OutboxError> {
    if batch == 0 {
        return Err(OutboxError::InvalidOptions {
            what: "the purge batch is 0",
            advice: "delete at least 1 row per batch (a few thousand is typical)",
        });
    }
    let mut deleted = 0;
    loop {
        let rows = purge_sent_batch(db, cutoff, batch).await?;
        deleted += rows;
        if rows < u64::from(batch) {
            return Ok(deleted);
        }
    }
}

/// One batch of [`purge_sent_messages`]: at most `batch` rows sent before `cutoff`, in a
/// transaction of its own. Returns how many it deleted.
pub(super) async fn purge_sent_batch(
    db: &DatabaseConnection,
    cutoff: DateTime<Utc>,
    batch: u32,
) -> Result<u64, OutboxError> {
    let backend = db.get_database_backend();
    let statement = purge_sent_statement(backend, cutoff, i64::from(batch))?;
    let delete = async {
        let txn = db.begin().await?;
        let done = txn.execute_raw(statement).await?;
        txn.commit().await?;
        Ok::<_, DbErr>(done.rows_affected())
    };
    bounded(backend, "purging sent messages", delete).await
}
