//! Claiming many messages for one consumer in one statement (Kafka-style batches).

use super::binding::{ClaimBinding, ClaimingTransaction, commit_claim};
use super::held::{Held, Step};
use crate::backend::{BatchClaimSql, batch_claim_sql, silently_ended, timestamp_value};
use crate::clock::now_micros;
use crate::consumer::validate_consumer;
use crate::silence::{ClaimTimer, StepTimer};
use crate::{Delivery, InboxError, MessageId, Refusal};
use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, DbErr, QueryResult, Statement, Value};
use sea_orm_inbox_entity::InboxTable;
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

/// The most distinct message ids one [`claim_batch`](crate::InboxTransactionExt::claim_batch)
/// call accepts (4 bind values each keeps the statement under every backend's limit).
pub const MAX_CLAIM_BATCH: usize = 1000;

/// The outcome of [`claim_batch`](crate::InboxTransactionExt::claim_batch): which ids this
/// transaction claimed, which are duplicates (a committed transaction claimed them before),
/// and which the admission floor refused. Each list is sorted and holds every distinct id of the batch
/// exactly once between them.
///
/// Commit the work with [`commit`](Self::commit), which first proves the transaction still
/// holds the claimed markers.
///
/// A `BatchClaim` is the proof of one transaction's claim, so only `claim_batch` makes one
/// and [`commit`](Self::commit) consumes it: it is neither `Clone` nor `Default`, and it
/// commits only the transaction that claimed (the claim opens a savepoint for it, whose
/// `RELEASE` is the proof; another transaction gets
/// [`InboxError::NotTheClaimingTransaction`], rolled back).
///
/// ```compile_fail
/// # async fn twice(batch: sea_orm_inbox::BatchClaim, a: sea_orm::DatabaseTransaction, b: sea_orm::DatabaseTransaction) {
/// let copy = batch.clone();
/// batch.commit(a).await;
/// copy.commit(b).await; // would apply b's writes under the markers a committed
/// # }
/// ```
#[must_use = "process exactly the `claimed` ids, then commit with BatchClaim::commit"]
#[derive(Debug, PartialEq, Eq)]
pub struct BatchClaim {
    /// Newly claimed by this transaction: process these, then commit.
    pub claimed: Vec<MessageId>,
    /// Claimed before by a committed transaction: skip them (they are done), as for
    /// [`Claim::Duplicate`](crate::Claim::Duplicate).
    pub duplicates: Vec<MessageId>,
    /// Refused by their [admission floor](crate::AdmissionFloor) before any SQL ran, and
    /// not claimed: dead-letter them (their markers may already be purged).
    pub refused: Vec<(MessageId, Refusal)>,
    consumer: String,
    /// The table the markers are in.
    table: InboxTable,
    tag: Uuid,
    /// The ids whose markers this transaction inserted, kept apart from the public lists so
    /// a caller who changes them cannot turn the proof off.
    inserted: Vec<MessageId>,
    /// What ties the claim to the caller's transaction it was made on.
    binding: Option<ClaimBinding>,
    /// The timer the claim's steps ran on, for its commit's.
    timer: ClaimTimer,
}

impl BatchClaim {
    /// Whether `id` was newly claimed by this transaction.
    pub fn is_claimed(&self, id: MessageId) -> bool {
        self.claimed.binary_search(&id).is_ok()
    }

    /// Commits `txn`, the transaction that claimed this batch, after proving it is that
    /// transaction and still holds the markers it claimed: the `RELEASE` of the savepoint
    /// the claim opened, which fails in any other transaction and once the database ended
    /// this one (then one read of the inbox index tells which). The proof rests on what
    /// the claim recorded, not on the public lists: changing `claimed` does not turn it off.
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
    /// A batch that claimed nothing new is proven by its savepoint alone.
    ///
    /// Each statement waits at most
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT) for
    /// the database (PostgreSQL, MySQL/MariaDB; no option changes it).
    ///
    /// # Errors
    /// [`InboxError::DatabaseSilent`] when the database went silent: nack the batch. After
    /// the COMMIT (operation `the batch's COMMIT, in doubt...`) the batch may have
    /// committed, its reply lost: the redelivery's claim tells, its committed ids coming
    /// back as `duplicates`.
    /// [`InboxError::NotTheClaimingTransaction`] (rolled back) when `txn` is not the
    /// transaction that claimed. [`InboxError::ClaimLost`] (rolled back; nothing of the
    /// batch committed) when the marker is missing or the check itself fails, or when the
    /// database already ended the transaction of a batch that claimed nothing; [`InboxError::Database`] when
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
    pub async fn commit(mut self, txn: impl Into<ClaimingTransaction>) -> Result<(), InboxError> {
        let mut timer = std::mem::take(&mut self.timer.0);
        let named = self
            .claimed
            .first()
            .or(self.duplicates.first())
            .copied()
            .unwrap_or_else(|| MessageId::from_uuid(Uuid::nil()));
        let failed = |err| InboxError::from_claim(err, &self.table, named, &self.consumer);
        let held = self.held();
        commit_claim(held, self.binding, txn.into(), &mut timer, silent, failed).await
    }

    /// What the proof reads: one of the markers this transaction inserted, or without one,
    /// whether the transaction is still open.
    pub(crate) fn held(&self) -> Held<'_> {
        Held::tagged(&self.table, &self.consumer, &self.inserted, self.tag)
            .with_savepoint(ClaimBinding::savepoint(self.binding))
    }

    /// This claim, tied to its transaction by `binding`.
    pub(super) fn bound_to(self, binding: ClaimBinding) -> Self {
        Self {
            binding: Some(binding),
            ..self
        }
    }

    /// This claim, with `timer`, the one its steps ran on, for its commit's.
    pub(super) fn timed_by(self, timer: StepTimer) -> Self {
        Self {
            timer: ClaimTimer(timer),
            ..self
        }
    }
}

/// The error of a step of [`BatchClaim::commit`] that got no answer within `waited`.
fn silent(step: Step, waited: Duration) -> InboxError {
    let operation = match step {
        Step::Proof => "the batch's claim check",
        Step::Commit => IN_DOUBT_COMMIT,
    };
    InboxError::DatabaseSilent { operation, waited }
}

/// The operation of a batch's COMMIT that went unanswered: it may have committed.
const IN_DOUBT_COMMIT: &str = "the batch's COMMIT, in doubt (the batch may have committed: its redelivery's claim tells, committed ids come back as duplicates),";

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
    let mut distinct = ids;
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() > MAX_CLAIM_BATCH {
        return Err(InboxError::BatchTooLarge {
            len: distinct.len(),
            max: MAX_CLAIM_BATCH,
        });
    }
    Ok(distinct)
}

/// A checked batch, split by the admission floor.
#[derive(Debug)]
pub(crate) struct AdmittedBatch {
    /// The admitted ids, distinct and ascending.
    ids: Vec<MessageId>,
    /// The refused ids, ascending, each with why.
    refused: Vec<(MessageId, Refusal)>,
}

/// Checks the batch as [`sorted_batch`] does, then splits it by each delivery's floor at
/// `now`; an id given twice is refused if either delivery is.
pub(crate) fn admit_batch(
    deliveries: Vec<Delivery>,
    consumer: &str,
    now: DateTime<Utc>,
) -> Result<AdmittedBatch, InboxError> {
    let ids = sorted_batch(
        deliveries.iter().map(Delivery::message_id).collect(),
        consumer,
    )?;
    let mut refused = BTreeMap::new();
    for delivery in &deliveries {
        if let Err(refusal) = delivery.admit(None, now) {
            refused.entry(delivery.message_id()).or_insert(refusal);
        }
    }
    Ok(AdmittedBatch {
        ids: ids
            .into_iter()
            .filter(|id| !refused.contains_key(id))
            .collect(),
        refused: refused.into_iter().collect(),
    })
}

/// The batch claim, for a connection the crate has proven is a transaction.
pub(crate) async fn insert_batch<C: ConnectionTrait>(
    conn: &C,
    table: &InboxTable,
    batch: Result<AdmittedBatch, InboxError>,
    consumer: &str,
) -> Result<BatchClaim, InboxError> {
    let AdmittedBatch { ids, refused } = batch?;
    // The tag tells this call's rows from the ones a committed transaction wrote before.
    let tag = Uuid::new_v4();
    let Some(&first) = ids.first() else {
        // Every delivery was refused: nothing to insert.
        return Ok(BatchClaim {
            claimed: Vec::new(),
            duplicates: Vec::new(),
            refused,
            consumer: consumer.to_owned(),
            table: table.clone(),
            tag,
            inserted: Vec::new(),
            binding: None,
            timer: ClaimTimer::default(),
        });
    };
    let backend = conn.get_database_backend();
    let fail = |err: DbErr| InboxError::from_claim(err, table, first, consumer);
    let received_at = timestamp_value(backend, now_micros());
    let (rows, read) = match batch_claim_sql(backend, table, ids.len(), consumer)? {
        BatchClaimSql::Returning(insert) => {
            let mut values = Vec::with_capacity(ids.len() + 3);
            values.extend([Value::from(consumer), received_at, Value::from(tag)]);
            values.extend(ids.iter().map(|id| Value::from(id.as_uuid())));
            let statement = Statement::from_sql_and_values(backend, insert, values);
            let rows = conn.query_all_raw(statement).await.map_err(fail)?;
            (rows, RowsRead::InsertedOnly)
        }
        BatchClaimSql::InsertThenRead { insert, read } => {
            let mut values = Vec::with_capacity(ids.len() * 4);
            for id in &ids {
                values.extend([
                    Value::from(id.as_uuid()),
                    Value::from(consumer),
                    received_at.clone(),
                    Value::from(tag),
                ]);
            }
            let rows = insert_then_read_back(conn, &ids, consumer, values, insert, read)
                .await
                .map_err(fail)?;
            (rows, RowsRead::EveryId)
        }
    };
    let rows = rows
        .iter()
        .map(|row| BatchRow::read(row, read, tag))
        .collect::<Result<Vec<_>, _>>()
        .map_err(fail)?;
    let claim = match sort_out(&ids, consumer, tag, &rows, read) {
        Ok(claim) => claim,
        // A row missing from the read-back: either another unique key took it, or the
        // server ended the transaction between the INSERT and the read, which then ran on
        // its own and saw none of the INSERT's rows (a Galera brute-force abort).
        Err(problem) => {
            return Err(match silently_ended(conn).await {
                Ok(true) => Held::tagged(table, consumer, &ids, tag).lost(None),
                Ok(false) => fail(DbErr::Custom(format!(
                    "{problem}: a batch row conflicted on a unique key other than {}, so the message was not claimed. Roll back; a unique index on the inbox table {table} besides the inbox's own must go",
                    table.unique_index()
                ))),
                Err(err) => fail(err),
            });
        }
    };
    Ok(BatchClaim {
        refused,
        table: table.clone(),
        ..claim
    })
}

/// The claim of the MySQL family: the tagged INSERT, whose conflict clause leaves existing
/// rows as they were and which returns every id's row where the server supports it
/// (MariaDB 10.5+); where it returned nothing (MySQL 8), a locking read, in the same
/// transaction, of this consumer's row for every id through the inbox index.
///
/// The read locks nothing new (the INSERT holds every row it wrote or met) and, being a
/// locking read, sees the latest committed rows even when the transaction's snapshot is
/// older, as the INSERT's conflict clause does. Either way every id's row comes back, so
/// the caller can check that each id has exactly one.
async fn insert_then_read_back<C: ConnectionTrait>(
    conn: &C,
    ids: &[MessageId],
    consumer: &str,
    insert_values: Vec<Value>,
    insert: String,
    read: String,
) -> Result<Vec<QueryResult>, DbErr> {
    let backend = conn.get_database_backend();
    let returned = conn
        .query_all_raw(Statement::from_sql_and_values(
            backend,
            insert,
            insert_values,
        ))
        .await?;
    // A non-empty batch returns at least one row wherever the server runs RETURNING.
    if !returned.is_empty() {
        return Ok(returned);
    }
    let mut read_values = Vec::with_capacity(ids.len() + 1);
    read_values.push(Value::from(consumer));
    read_values.extend(ids.iter().map(|id| Value::from(id.as_uuid())));
    conn.query_all_raw(Statement::from_sql_and_values(backend, read, read_values))
        .await
}

/// Which rows a batch statement gave back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowsRead {
    /// Only the rows the INSERT wrote (RETURNING with DO NOTHING).
    InsertedOnly,
    /// The consumer's row of every id of the batch, written now or before.
    EveryId,
}

/// One row a batch statement gave back.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BatchRow {
    message_id: MessageId,
    /// `None` where the statement left out the batch's own consumer (MariaDB's RETURNING
    /// sends NULL for it; the INSERT's RETURNING of PostgreSQL and SQLite sends none).
    consumer: Option<String>,
    claim_token: Option<Uuid>,
}

impl BatchRow {
    /// The row `row` of a batch whose statement gave back `read`, tagged with `tag`.
    fn read(row: &QueryResult, read: RowsRead, tag: Uuid) -> Result<Self, DbErr> {
        let message_id = MessageId::from_uuid(row.try_get_by_index::<Uuid>(0)?);
        Ok(match read {
            // A row the INSERT wrote holds what it bound: the batch's consumer and tag.
            // Only its id is returned, as reading the rest cost more than the INSERT's
            // other client work.
            RowsRead::InsertedOnly => Self {
                message_id,
                consumer: None,
                claim_token: Some(tag),
            },
            RowsRead::EveryId => Self {
                message_id,
                consumer: nullable_text(row, 1)?,
                claim_token: row.try_get_by_index(2)?,
            },
        })
    }
}

/// The text at `index` of `row`, `None` for NULL. A MySQL row is read through sqlx
/// itself: SeaORM reads a NULL as an error whose message it formats, which cost more per
/// row (MariaDB's RETURNING sends NULL for the batch's own consumer, in every row the
/// INSERT wrote) than the rest of the row's reading. Anything sqlx cannot read there is
/// read again through SeaORM, for its error.
fn nullable_text(row: &QueryResult, index: usize) -> Result<Option<String>, DbErr> {
    #[cfg(feature = "mysql")]
    if let Some(Ok(text)) = row
        .try_as_mysql_row()
        .map(|mysql| sea_orm::sqlx::Row::try_get::<Option<String>, _>(mysql, index))
    {
        return Ok(text);
    }
    row.try_get_by_index(index)
}

/// Splits the sorted batch `ids` into claimed and duplicates from the rows read back,
/// or says which row does not fit: a row of another message or consumer, two rows of one
/// id, a row `read` cannot hold, or (when every id was read) an id with no row. Each means
/// a conflict on another key made the INSERT skip a row it never wrote.
fn sort_out(
    ids: &[MessageId],
    consumer: &str,
    tag: Uuid,
    rows: &[BatchRow],
    read: RowsRead,
) -> Result<BatchClaim, String> {
    // What was read of each id, by its position in the sorted `ids` (`Some(ours)` once a
    // row of it was read), not sets of ids: a set's node per row cost more than the rest
    // of the sorting out.
    let mut read_back: Vec<Option<bool>> = vec![None; ids.len()];
    for row in rows {
        let id = row.message_id;
        let Some(slot) = ids
            .binary_search(&id)
            .ok()
            .and_then(|at| read_back.get_mut(at))
        else {
            return Err(format!(
                "the batch met the row of message {id}, which is not in the batch"
            ));
        };
        if let Some(other) = row.consumer.as_deref().filter(|other| *other != consumer) {
            return Err(format!(
                "the batch met the row of message {id} for consumer {other:?}, not {consumer:?}"
            ));
        }
        let ours = row.claim_token == Some(tag);
        if slot.replace(ours).is_some() {
            return Err(format!("the batch read two rows for message {id}"));
        }
        if !ours && read == RowsRead::InsertedOnly {
            return Err(format!(
                "the batch insert returned a row of message {id} it did not write"
            ));
        }
    }
    if read == RowsRead::EveryId
        && let Some((missing, _)) = ids.iter().zip(&read_back).find(|(_, seen)| seen.is_none())
    {
        return Err(format!(
            "the batch found no row of message {missing} for consumer {consumer:?} after its insert"
        ));
    }
    let (mut claimed, mut duplicates) = (Vec::new(), Vec::new());
    for (&id, seen) in ids.iter().zip(read_back) {
        if seen == Some(true) {
            claimed.push(id);
        } else {
            duplicates.push(id);
        }
    }
    Ok(BatchClaim {
        inserted: claimed.clone(),
        binding: None,
        timer: ClaimTimer::default(),
        claimed,
        duplicates,
        refused: Vec::new(),
        consumer: consumer.to_owned(),
        // The caller puts its table in; sorting out rows needs none.
        table: InboxTable::default(),
        tag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> MessageId {
        MessageId::from_uuid(Uuid::from_u128(n))
    }

    fn row(n: u128, consumer: &str, token: Option<Uuid>) -> BatchRow {
        BatchRow {
            message_id: id(n),
            consumer: Some(consumer.to_owned()),
            claim_token: token,
        }
    }

    #[test]
    fn every_id_read_splits_by_tag() {
        let tag = Uuid::new_v4();
        let rows = [
            row(1, "c", Some(tag)),
            row(2, "c", None),
            row(3, "c", Some(Uuid::new_v4())),
        ];
        let batch = sort_out(&[id(1), id(2), id(3)], "c", tag, &rows, RowsRead::EveryId).unwrap();
        assert_eq!(batch.claimed, [id(1)]);
        assert_eq!(batch.duplicates, [id(2), id(3)]);
    }

    /// A row whose consumer the statement left out is the batch consumer's: sorted by its
    /// tag like any other.
    #[test]
    fn a_row_without_its_consumer_is_the_batch_consumers() {
        let tag = Uuid::new_v4();
        let bare = |n, token| BatchRow {
            consumer: None,
            ..row(n, "c", token)
        };
        let rows = [bare(1, Some(tag)), bare(2, Some(Uuid::new_v4()))];
        let batch = sort_out(&[id(1), id(2)], "c", tag, &rows, RowsRead::EveryId).unwrap();
        assert_eq!(batch.claimed, [id(1)]);
        assert_eq!(batch.duplicates, [id(2)]);
        let twice = [bare(1, Some(tag)), row(1, "c", Some(tag))];
        assert!(sort_out(&[id(1)], "c", tag, &twice, RowsRead::EveryId).is_err());
    }

    #[test]
    fn rows_that_do_not_fit_the_batch_fail_it() {
        let tag = Uuid::new_v4();
        let ids = || vec![id(1), id(2)];
        let ours = |n| row(n, "c", Some(tag));
        for read in [RowsRead::InsertedOnly, RowsRead::EveryId] {
            let other_consumer = [ours(1), row(2, "d", None)];
            assert!(sort_out(&ids(), "c", tag, &other_consumer, read).is_err());
            let other_message = [ours(1), ours(3)];
            assert!(sort_out(&ids(), "c", tag, &other_message, read).is_err());
            let twice = [ours(1), ours(1)];
            assert!(sort_out(&ids(), "c", tag, &twice, read).is_err());
        }
        let missing = [ours(1)];
        assert!(sort_out(&ids(), "c", tag, &missing, RowsRead::EveryId).is_err());
        assert_eq!(
            sort_out(&ids(), "c", tag, &missing, RowsRead::InsertedOnly)
                .unwrap()
                .duplicates,
            [id(2)]
        );
        let untagged = [row(1, "c", None)];
        assert!(sort_out(&ids(), "c", tag, &untagged, RowsRead::InsertedOnly).is_err());
    }

    #[test]
    fn the_floor_splits_a_batch_and_refuses_an_id_if_any_delivery_of_it_is_refused() {
        use crate::{AdmissionFloor, RetentionPolicy};
        use std::time::Duration;
        let hour = Duration::from_secs(3_600);
        let retention = RetentionPolicy::with_window(hour).unwrap();
        let floor = AdmissionFloor::new(&retention, Duration::from_secs(60)).unwrap();
        let now = Utc::now();
        let old = now - chrono::TimeDelta::hours(2);
        let deliveries = vec![
            Delivery::new(id(3)).sent_at(now).with_floor(floor),
            Delivery::new(id(2)).sent_at(old).with_floor(floor),
            Delivery::new(id(1)),
            Delivery::new(id(3)).sent_at(old).with_floor(floor),
        ];
        let batch = admit_batch(deliveries, "c", now).unwrap();
        assert_eq!(batch.ids, [id(1)]);
        let refused: Vec<_> = batch.refused.iter().map(|(id, _)| *id).collect();
        assert_eq!(refused, [id(2), id(3)]);
        assert!(matches!(
            admit_batch(
                vec![Delivery::new(id(0)).sent_at(old).with_floor(floor)],
                "c",
                now
            ),
            Err(InboxError::NilMessageId)
        ));
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
