//! Claiming many messages for one consumer in one statement (Kafka-style batches).

use crate::backend::{batch_marker_held_sql, insert_batch_sql, timestamp_value};
use crate::claim::now_micros;
use crate::consumer::validate_consumer;
use crate::{InboxError, MessageId};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbErr, Statement, Value};
use sea_orm_inbox_entity::INDEX_NAME;
use std::collections::BTreeSet;
use uuid::Uuid;

/// The most distinct message ids one [`claim_batch`](crate::InboxTransactionExt::claim_batch)
/// call accepts (4 bind values each keeps the statement under every backend's limit).
pub const MAX_CLAIM_BATCH: usize = 1000;

/// The outcome of [`claim_batch`](crate::InboxTransactionExt::claim_batch): which ids this
/// transaction claimed and which a committed transaction had claimed before. Each list is
/// sorted and holds every distinct id of the batch exactly once between them.
///
/// Commit the work with [`commit`](Self::commit), which first proves the transaction still
/// holds the claimed markers.
#[must_use = "process exactly the `claimed` ids, then commit with BatchClaim::commit"]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchClaim {
    /// Newly claimed by this transaction: process these, then commit.
    pub claimed: Vec<MessageId>,
    /// Claimed before by a committed transaction: skip them (they are done).
    pub already_claimed: Vec<MessageId>,
    consumer: String,
    tag: Uuid,
}

impl BatchClaim {
    /// Whether `id` was newly claimed by this transaction.
    pub fn is_claimed(&self, id: MessageId) -> bool {
        self.claimed.binary_search(&id).is_ok()
    }

    /// Commits `txn`, the transaction that claimed this batch, after proving it still holds
    /// the markers it claimed (one read of the inbox index through the transaction: a
    /// rollback takes all of them or none).
    ///
    /// The database can end a transaction under its caller: MySQL/MariaDB roll it back on
    /// a deadlock or, on Galera, when another node's write set wins a conflict, and then
    /// run the connection's next statements outside it, each committing on its own;
    /// PostgreSQL aborts it after any failed statement and answers COMMIT with ROLLBACK.
    /// A plain `txn.commit()` then succeeds with none of the batch's markers committed,
    /// and acking the batch would lose it. This check fails instead. It cannot undo
    /// statements that already ran outside the transaction: stop at the first failed
    /// statement, never go on after one.
    ///
    /// # Errors
    /// [`InboxError::BatchClaimLost`] (rolled back; nothing of the batch committed) when
    /// the marker is missing or the check itself fails; [`InboxError::Database`] when
    /// COMMIT fails (a 1213 from a Galera certification conflict is transient: re-run the
    /// batch).
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
    /// let ids = [uuid::Uuid::new_v4(), uuid::Uuid::new_v4()];
    /// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    /// let batch = txn.claim_batch(ids, "projector").await?;
    /// for id in &batch.claimed {
    ///     // apply record `id` through `txn`, returning at the first error
    /// }
    /// batch.commit(txn).await?; // proves the markers are held, then commits
    /// # Ok(()) }
    /// ```
    pub async fn commit(self, txn: DatabaseTransaction) -> Result<(), InboxError> {
        let named = self
            .claimed
            .first()
            .or(self.already_claimed.first())
            .copied()
            .unwrap_or_else(|| MessageId::from_uuid(Uuid::nil()));
        if let Some(&marker) = self.claimed.first() {
            let sql = batch_marker_held_sql(txn.get_database_backend())?;
            let lost = match self.marker_count(&txn, sql, marker).await {
                Ok(1) => None,
                Ok(_) => Some(None),
                Err(err) => Some(Some(err)),
            };
            if let Some(source) = lost {
                txn.rollback().await.ok();
                return Err(InboxError::BatchClaimLost {
                    consumer: self.consumer,
                    claimed: self.claimed.len(),
                    source,
                });
            }
        }
        txn.commit()
            .await
            .map_err(|err| InboxError::from_claim(err, named, &self.consumer))
    }

    async fn marker_count(
        &self,
        txn: &DatabaseTransaction,
        sql: String,
        marker: MessageId,
    ) -> Result<i64, DbErr> {
        let values = [
            Value::from(marker.as_uuid()),
            Value::from(self.consumer.as_str()),
            Value::from(self.tag),
        ];
        let backend = txn.get_database_backend();
        txn.query_one_raw(Statement::from_sql_and_values(backend, sql, values))
            .await?
            .ok_or_else(|| DbErr::RecordNotFound("the count of the batch's marker".into()))?
            .try_get_by_index(0)
    }
}

/// Checks the input and returns the distinct ids in ascending order: every replica then
/// inserts, and so locks index entries, in the same order, which rules out the deadlock
/// two replicas inserting overlapping batches in different orders would meet.
pub(crate) fn sorted_batch(
    ids: Vec<MessageId>,
    consumer: &str,
) -> Result<Vec<MessageId>, InboxError> {
    validate_consumer(consumer)?;
    if ids.is_empty() {
        return Err(InboxError::EmptyBatch);
    }
    if ids.iter().any(MessageId::is_nil) {
        return Err(InboxError::NilMessageId);
    }
    let distinct: BTreeSet<MessageId> = ids.into_iter().collect();
    if distinct.len() > MAX_CLAIM_BATCH {
        return Err(InboxError::BatchTooLarge {
            len: distinct.len(),
            max: MAX_CLAIM_BATCH,
        });
    }
    Ok(distinct.into_iter().collect())
}

/// The batch claim, for a connection the crate has proven is a transaction.
pub(crate) async fn insert_batch<C: ConnectionTrait>(
    conn: &C,
    ids: Result<Vec<MessageId>, InboxError>,
    consumer: &str,
) -> Result<BatchClaim, InboxError> {
    let ids = ids?;
    let backend = conn.get_database_backend();
    let sql = insert_batch_sql(backend, ids.len())?;
    // The tag tells this statement's rows from conflicting ones where RETURNING reports
    // both (MariaDB).
    let tag = Uuid::new_v4();
    let received_at = timestamp_value(backend, now_micros());
    let mut values = Vec::with_capacity(ids.len() * 4);
    for id in &ids {
        values.extend([
            Value::from(id.as_uuid()),
            Value::from(consumer),
            received_at.clone(),
            Value::from(tag),
        ]);
    }
    let rows = conn
        .query_all_raw(Statement::from_sql_and_values(backend, sql, values))
        .await
        .map_err(|err| InboxError::from_claim(err, ids[0], consumer))?;
    let mut inserted = BTreeSet::new();
    for row in rows {
        let read = |index| row.try_get_by_index::<Option<Uuid>>(index);
        let (id, row_tag) = read(0)
            .and_then(|id| Ok((id, read(1)?)))
            .map_err(|err| InboxError::from_claim(err, ids[0], consumer))?;
        let Some(id) = id.map(MessageId::from_uuid) else {
            continue;
        };
        if ids.binary_search(&id).is_err() {
            // ON DUPLICATE KEY met a row of another message (a primary key collision):
            // the batch's own row was not written. Never report that as "already claimed".
            return Err(InboxError::from_claim(
                DbErr::Custom(format!(
                    "the batch insert met the row of message {id}, which is not in the batch (a conflict on a key other than {INDEX_NAME}): roll back and retry the batch"
                )),
                ids[0],
                consumer,
            ));
        }
        if row_tag == Some(tag) {
            inserted.insert(id);
        }
    }
    let (claimed, already_claimed) = ids.into_iter().partition(|id| inserted.contains(id));
    Ok(BatchClaim {
        claimed,
        already_claimed,
        consumer: consumer.to_owned(),
        tag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> MessageId {
        MessageId::from_uuid(Uuid::from_u128(n))
    }

    #[test]
    fn sorts_and_deduplicates() {
        let ids = sorted_batch(vec![id(3), id(1), id(3), id(2)], "c").unwrap();
        assert_eq!(ids, [id(1), id(2), id(3)]);
    }

    #[test]
    fn refuses_bad_batches_before_sql() {
        assert!(matches!(
            sorted_batch(vec![], "c"),
            Err(InboxError::EmptyBatch)
        ));
        assert!(matches!(
            sorted_batch(vec![id(1), id(0)], "c"),
            Err(InboxError::NilMessageId)
        ));
        assert!(matches!(
            sorted_batch(vec![id(1)], ""),
            Err(InboxError::EmptyConsumer)
        ));
        let too_many = (1..=MAX_CLAIM_BATCH as u128 + 1).map(id).collect();
        assert!(matches!(
            sorted_batch(too_many, "c"),
            Err(InboxError::BatchTooLarge {
                len: 1001,
                max: 1000
            })
        ));
        let duplicates_only = std::iter::repeat_n(id(1), MAX_CLAIM_BATCH + 5).collect();
        assert_eq!(sorted_batch(duplicates_only, "c").unwrap(), [id(1)]);
    }
}
