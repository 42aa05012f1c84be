//! Claiming many messages for one consumer in one statement (Kafka-style batches).

use crate::backend::{insert_batch_sql, timestamp_value};
use crate::claim::now_micros;
use crate::consumer::validate_consumer;
use crate::{InboxError, MessageId};
use sea_orm::{ConnectionTrait, DbErr, Statement, Value};
use sea_orm_inbox_entity::INDEX_NAME;
use std::collections::BTreeSet;
use uuid::Uuid;

/// The most distinct message ids one [`claim_batch`](crate::InboxTransactionExt::claim_batch)
/// call accepts (4 bind values each keeps the statement under every backend's limit).
pub const MAX_CLAIM_BATCH: usize = 1000;

/// The outcome of [`claim_batch`](crate::InboxTransactionExt::claim_batch): which ids this
/// transaction claimed and which a committed transaction had claimed before. Each list is
/// sorted and holds every distinct id of the batch exactly once between them.
#[must_use = "process exactly the `claimed` ids, then commit"]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchClaim {
    /// Newly claimed by this transaction: process these, then commit.
    pub claimed: Vec<MessageId>,
    /// Claimed before by a committed transaction: skip them (they are done).
    pub already_claimed: Vec<MessageId>,
}

impl BatchClaim {
    /// Whether `id` was newly claimed by this transaction.
    pub fn is_claimed(&self, id: MessageId) -> bool {
        self.claimed.binary_search(&id).is_ok()
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
