//! Kafka through [rdkafka](https://docs.rs/rdkafka) (feature `rdkafka`): a record's
//! [`Delivery`], and a consumer whose offsets live in the application's database, advanced
//! in the same transaction as the inbox marker and the business change.
//!
//! Why the offsets are not (only) Kafka's: a consumer that commits to Kafka before its
//! database commit loses the record when the database then fails; one that commits after
//! it processes the record again when it dies in between (the inbox catches that, but only
//! while the marker is kept). With the next offset stored by the handler's transaction the
//! database alone says how far a partition got: the marker, the business change and the
//! offset commit together or not at all.
//!
//! - The offset table comes from the opt-in migration `CreateKafkaOffsets` of
//!   `sea-orm-inbox-migration` (add it to your migrator).
//! - The advance is a compare-and-set on the offset this consumer last read or wrote: a
//!   consumer that lost the partition in a rebalance (another took it and moved on) fails
//!   it, and its transaction, marker and business change included, rolls back.
//! - A duplicate (its marker exists: the producer sent it twice) still advances the offset,
//!   in a transaction of its own, so no partition stalls on it.
//! - On the first record of a partition after an assignment, the consumer reads the stored
//!   offset and seeks there. Kafka's own offset commit comes after the database commit and
//!   is only a hint (for lag monitoring, and where no stored offset exists yet).
//!
//! - [`KafkaGroupConsumer`] is the loop to run: partitions in parallel, each in order, the
//!   records already fetched of a partition committed in one transaction, with
//!   back-pressure, revocations and a graceful shutdown. [`KafkaInbox::run`], one record
//!   at a time, is deprecated.
//!
//! See the guide's Kafka chapter ([`crate::guide`]) for what a rebalance does and where
//! Tansu, the broker the tests run on, differs from Apache Kafka.
//!
//! ```no_run
//! # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
//! use rdkafka::ClientConfig;
//! use sea_orm_inbox::Inbox;
//! use sea_orm_inbox::kafka::{KafkaGroupConsumer, KafkaInbox};
//!
//! let kafka = KafkaInbox::new(Inbox::new("billing")?, "billing-group")?;
//! let mut config = ClientConfig::new();
//! config
//!     .set("bootstrap.servers", "127.0.0.1:9092")
//!     .set("auto.offset.reset", "earliest");
//! let summary = KafkaGroupConsumer::new(kafka, &config, ["payments"])
//!     .run(
//!         db,
//!         |txn, record| {
//!             Box::pin(async move {
//!                 // business writes through `txn`, reading `record.payload()` (`record` is
//!                 // an `Arc<OwnedMessage>`: each attempt of a retried transaction gets it
//!                 // again)
//!                 let _ = (txn, record);
//!                 Ok(())
//!             })
//!         },
//!         std::future::pending::<()>(), // your shutdown signal
//!     )
//!     .await?;
//! println!("{summary}");
//! # Ok(()) }
//! ```

mod consumer;

pub use consumer::{DEFAULT_KAFKA_BATCH, DEFAULT_KAFKA_PREFETCH, GroupContext, KafkaGroupConsumer};
mod dead_letter;
mod publisher;

pub use dead_letter::{
    DEAD_LETTER_ERROR_HEADER, DEAD_LETTER_MESSAGE_ID_HEADER, DEAD_LETTER_OFFSET_HEADER,
    DEAD_LETTER_PARTITION_HEADER, DEAD_LETTER_SUFFIX, DEAD_LETTER_TOPIC_HEADER, DeadLetterTopic,
};
use publisher::idempotent_producer;
pub use publisher::{KafkaPublisher, SENT_AT_HEADER};

use super::BoxError;
use crate::{BatchOutcome, ErrorKind, HandlerFuture, Outcome, ProcessError, Settlement};
use crate::{CLAIM_TRANSACTION, Delivery, Inbox, InboxError, MessageId, ObservedTransaction};
use chrono::DateTime;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, SqlErr, TransactionTrait};
use sea_orm_inbox_entity::{KAFKA_GROUP_MAX_CHARS, KAFKA_OFFSET_TABLE_NAME};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The header a producer sets to name its message, read when no other is configured.
pub const DEFAULT_ID_HEADER: &str = "message-id";

/// What went wrong in the Kafka consumer; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    /// The consumer group id is empty or longer than the offset table's column.
    #[error(
        "the consumer group id {group:?} must be 1 to {KAFKA_GROUP_MAX_CHARS} characters: pick a shorter group.id"
    )]
    InvalidGroup {
        /// The rejected group id.
        group: String,
    },
    /// The id header's value is not UTF-8.
    #[error(
        "header {header:?} of {topic}[{partition}]@{offset} is not UTF-8: have the producer write the message id as text, or configure another header"
    )]
    HeaderNotUtf8 {
        /// The header.
        header: String,
        /// The record's topic.
        topic: String,
        /// The record's partition.
        partition: i32,
        /// The record's offset.
        offset: i64,
    },
    /// The record's key could not be made (an empty header, a nil id).
    #[error("the record {topic}[{partition}]@{offset} has no usable message id: {source}")]
    Key {
        /// The record's topic.
        topic: String,
        /// The record's partition.
        partition: i32,
        /// The record's offset.
        offset: i64,
        /// Why.
        source: Box<InboxError>,
    },
    /// The stored offset is not the one this consumer expected: another consumer took the
    /// partition (a rebalance) and moved it on. The record's transaction rolled back.
    #[error(
        "the stored offset of group {group:?} on {topic}[{partition}] is no longer {expected:?}: another consumer took the partition; the record's transaction rolled back (seek to the stored offset)"
    )]
    OffsetMoved {
        /// The consumer group.
        group: String,
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The stored offset the consumer expected (`None`: no row yet).
        expected: Option<i64>,
    },
    /// Reading or writing the offset table failed.
    #[error(
        "the Kafka offset table {KAFKA_OFFSET_TABLE_NAME} could not be read or written ({source}): is sea-orm-inbox-migration's CreateKafkaOffsets applied?"
    )]
    Database {
        /// The database's error.
        #[source]
        source: Box<DbErr>,
    },
    /// Processing a record failed and cannot be retried by the loop (the inbox's error).
    #[error("processing {topic}[{partition}]@{offset} failed: {error}")]
    Process {
        /// The record's topic.
        topic: String,
        /// The record's partition.
        partition: i32,
        /// The record's offset.
        offset: i64,
        /// What the inbox said.
        error: Box<ProcessError<BoxError>>,
    },
    /// The Kafka client failed (a seek, the subscription, the consumer's creation).
    #[error("the Kafka client failed: {0}")]
    Client(#[from] rdkafka::error::KafkaError),
    /// A record for the dead-letter topic got no delivery report: its offset did not
    /// advance, and the record is read again after the retry delay.
    #[error(
        "the dead-letter topic {topic:?} did not take the record ({source}): does the topic exist, and is the broker reachable?"
    )]
    DeadLetter {
        /// The dead-letter topic.
        topic: String,
        /// The producer's error.
        #[source]
        source: rdkafka::error::KafkaError,
    },
}

/// The key of `record`: the producer's id header `id_header` when present, else a
/// CloudEvents `ce_id` + `ce_source` pair (the Kafka protocol binding's headers), else
/// [`MessageId::from_kafka`] of its topic, partition and offset.
///
/// Prefer a producer header: `(topic, partition, offset)` tells a redelivery of one record
/// apart from nothing, but a record the producer sent twice sits at two offsets.
pub fn message_id<M: Message>(record: &M, id_header: &str) -> Result<MessageId, KafkaError> {
    let header = |name: &str| -> Result<Option<&str>, KafkaError> {
        let Some(headers) = record.headers() else {
            return Ok(None);
        };
        let Some(value) = headers
            .iter()
            .find(|header| header.key == name)
            .and_then(|header| header.value)
        else {
            return Ok(None);
        };
        std::str::from_utf8(value)
            .map(Some)
            .map_err(|_| KafkaError::HeaderNotUtf8 {
                header: name.to_owned(),
                topic: record.topic().to_owned(),
                partition: record.partition(),
                offset: record.offset(),
            })
    };
    let key_error = |source| KafkaError::Key {
        topic: record.topic().to_owned(),
        partition: record.partition(),
        offset: record.offset(),
        source: Box::new(source),
    };
    if let Some(id) = header(id_header)? {
        return MessageId::from_broker_id(id).map_err(key_error);
    }
    if let (Some(id), Some(source)) = (header("ce_id")?, header("ce_source")?) {
        return MessageId::from_cloud_event(source, id).map_err(key_error);
    }
    MessageId::from_kafka(record.topic(), record.partition(), record.offset()).map_err(key_error)
}

/// The [`Delivery`] of `record`: its [`message_id`], sent at the record's timestamp (the
/// producer's create time, or the broker's log-append time, whichever the topic keeps) for
/// the admission floor.
pub fn delivery<M: Message>(record: &M, id_header: &str) -> Result<Delivery, KafkaError> {
    let delivery = Delivery::new(message_id(record, id_header)?);
    Ok(
        match record
            .timestamp()
            .to_millis()
            .and_then(DateTime::from_timestamp_millis)
        {
            Some(sent_at) => delivery.sent_at(sent_at),
            None => delivery,
        },
    )
}

fn offset_table() -> Alias {
    Alias::new(KAFKA_OFFSET_TABLE_NAME)
}

fn partition_is(group: &str, topic: &str, partition: i32) -> sea_orm::sea_query::Condition {
    sea_orm::sea_query::Condition::all()
        .add(Expr::col(Alias::new("consumer_group")).eq(group))
        .add(Expr::col(Alias::new("topic")).eq(topic))
        .add(Expr::col(Alias::new("partition_id")).eq(partition))
}

/// The next offset stored for `group` on `topic`'s `partition`; `None` before the first
/// record of it was processed.
pub async fn stored_offset<C: ConnectionTrait>(
    db: &C,
    group: &str,
    topic: &str,
    partition: i32,
) -> Result<Option<i64>, KafkaError> {
    let select = Query::select()
        .column(Alias::new("next_offset"))
        .from(offset_table())
        .cond_where(partition_is(group, topic, partition))
        .to_owned();
    let row = db
        .query_one(&select)
        .await
        .map_err(|source| KafkaError::Database {
            source: Box::new(source),
        })?;
    row.map(|row| row.try_get::<i64>("", "next_offset"))
        .transpose()
        .map_err(|source| KafkaError::Database {
            source: Box::new(source),
        })
}

/// Sets the stored offset of `group` on `topic`'s `partition` to `next`, if it is still
/// `expected` (`None`: no row yet), through `txn`: the record's transaction. Fails with
/// [`KafkaError::OffsetMoved`] otherwise, which must roll the transaction back.
///
/// The compare-and-set is what fences a consumer that lost the partition: the new owner
/// has moved the stored offset on (or holds the row's lock until it does, and then the
/// update matches nothing), so the stale consumer's transaction cannot commit.
pub async fn advance_offset<C: ConnectionTrait>(
    txn: &C,
    group: &str,
    topic: &str,
    partition: i32,
    expected: Option<i64>,
    next: i64,
) -> Result<(), KafkaError> {
    let moved = || KafkaError::OffsetMoved {
        group: group.to_owned(),
        topic: topic.to_owned(),
        partition,
        expected,
    };
    match expected {
        Some(expected) => {
            let update = Query::update()
                .table(offset_table())
                .value(Alias::new("next_offset"), next)
                .cond_where(partition_is(group, topic, partition))
                .and_where(Expr::col(Alias::new("next_offset")).eq(expected))
                .to_owned();
            let result = txn
                .execute(&update)
                .await
                .map_err(|source| KafkaError::Database {
                    source: Box::new(source),
                })?;
            // Matched rows, not changed ones, on every backend (sqlx asks MySQL for found
            // rows); `next` differs from `expected` anyway.
            if result.rows_affected() == 1 {
                Ok(())
            } else {
                Err(moved())
            }
        }
        None => {
            let insert = Query::insert()
                .into_table(offset_table())
                .columns([
                    Alias::new("consumer_group"),
                    Alias::new("topic"),
                    Alias::new("partition_id"),
                    Alias::new("next_offset"),
                ])
                .values_panic([group.into(), topic.into(), partition.into(), next.into()])
                .to_owned();
            match txn.execute(&insert).await {
                Ok(_) => Ok(()),
                // The primary key is the table's only unique index: another consumer wrote
                // the partition's first offset.
                Err(err) if matches!(err.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) => {
                    Err(moved())
                }
                Err(source) => Err(KafkaError::Database {
                    source: Box::new(source),
                }),
            }
        }
    }
}

/// How one record ended, for [`KafkaInbox::process_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordOutcome {
    /// The handler ran and committed with the marker and the offset advance.
    Processed,
    /// The marker existed; the offset was advanced in a transaction of its own.
    Duplicate,
    /// The admission floor refused it and no dead-letter topic is configured; the offset
    /// was advanced past it (logged at WARN).
    Refused,
    /// No redelivery can fix it (the handler's [`Permanent`](crate::Permanent) error, an
    /// input error, the admission floor's refusal, an id header that is not text): it was
    /// produced to the [`DeadLetterTopic`], then the offset was advanced past it.
    DeadLettered,
    /// The stored offset had moved: nothing was applied; seek to the stored offset.
    OffsetMoved,
}

/// How a batch of [`KafkaInbox::process_batch`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BatchResult {
    /// Committed: the handler ran for `processed` records, `duplicates` were skipped, and
    /// the stored offset is past the batch.
    Done { processed: u64, duplicates: u64 },
    /// The stored offset had moved: nothing was applied; seek to the stored offset.
    OffsetMoved,
    /// Not batched, or rolled back: process the records one by one.
    Failed,
}

/// What [`KafkaInbox::run`] did until its shutdown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunReport {
    /// Records processed.
    pub processed: u64,
    /// Duplicates skipped (their offsets advanced).
    pub duplicates: u64,
    /// Records the admission floor refused (their offsets advanced).
    pub refused: u64,
    /// Records sent to the dead-letter topic (their offsets advanced).
    pub dead_lettered: u64,
    /// Records whose offset advance found the stored offset moved (nothing applied).
    pub offsets_moved: u64,
    /// Failed attempts, each followed by a seek back to the record.
    pub failures: u64,
    /// Seeks to a stored offset after an assignment or a moved offset.
    pub seeks: u64,
}

/// The rdkafka context of [`KafkaInbox::consumer`]: counts rebalances, so the loop forgets
/// the offsets it expected and reads them from the database again.
#[derive(Debug, Default)]
pub struct OffsetContext {
    rebalances: AtomicU64,
}

impl ClientContext for OffsetContext {}

impl ConsumerContext for OffsetContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, _rebalance: &Rebalance<'_>) {
        self.rebalances.fetch_add(1, Ordering::SeqCst);
    }
}

/// The handler [`KafkaInbox::process_record`] (and the deprecated [`KafkaInbox::run`])
/// takes: given the record's transaction and the record, the future of its business
/// writes. Every closure or function of that shape implements it; one caller calls it at a
/// time, so it may keep state (`FnMut`). The loop's handler ([`KafkaGroupConsumer::run`])
/// is shared by its partitions' tasks instead (`Fn + Sync + 'static`).
pub trait RecordHandlerMut:
    for<'t> FnMut(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError> + Send
{
}

impl<F> RecordHandlerMut for F where
    F: for<'t> FnMut(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError>
        + Send
{
}

/// The consumer [`KafkaInbox::run`] reads from.
pub type KafkaConsumer = StreamConsumer<OffsetContext>;

/// A Kafka consumer group's inbox: the [`Inbox`], the group whose offsets it stores, and
/// the header that names a message.
#[derive(Debug, Clone)]
pub struct KafkaInbox {
    inbox: Inbox,
    group: String,
    id_header: String,
    retry_delay: Duration,
    dead_letter: Option<DeadLetterTopic>,
}

impl KafkaInbox {
    /// The inbox of consumer group `group` (its Kafka `group.id`, also the offset table's
    /// key).
    pub fn new(inbox: Inbox, group: impl Into<String>) -> Result<Self, KafkaError> {
        let group = group.into();
        if group.is_empty() || group.chars().count() > KAFKA_GROUP_MAX_CHARS {
            return Err(KafkaError::InvalidGroup { group });
        }
        Ok(Self {
            inbox,
            group,
            id_header: DEFAULT_ID_HEADER.to_owned(),
            retry_delay: Duration::from_secs(1),
            dead_letter: None,
        })
    }

    /// Reads the message id from header `name` instead of [`DEFAULT_ID_HEADER`].
    pub fn with_id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Sends a record no redelivery can fix to `topic` (see [`RecordOutcome::DeadLettered`])
    /// and moves on, instead of reading it again after the retry delay, which holds up its
    /// partition until someone fixes it (without a dead-letter topic, a refused record is
    /// skipped with a WARN event).
    pub fn with_dead_letter(mut self, topic: DeadLetterTopic) -> Self {
        self.dead_letter = Some(topic);
        self
    }

    /// The pause before a failed record is read again (default 1 s).
    pub fn with_retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// A consumer of `config` for [`run`](Self::run): this group's `group.id`, and neither
    /// automatic offset commits nor stores (the loop commits to Kafka itself, after the
    /// database).
    pub fn consumer(&self, config: &ClientConfig) -> Result<KafkaConsumer, KafkaError> {
        let mut config = config.clone();
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        Ok(config.create_with_context(OffsetContext::default())?)
    }

    /// Processes `record` once: claims it in the inbox, runs `handler` and advances the
    /// stored offset from `expected` past the record, all in one transaction (with the
    /// inbox's retries of transient failures). A duplicate or a refused record only
    /// advances the offset; with a [`DeadLetterTopic`], a record no redelivery can fix is
    /// produced there first (see [`RecordOutcome::DeadLettered`]).
    pub async fn process_record<F: RecordHandlerMut>(
        &self,
        db: &DatabaseConnection,
        record: &Arc<OwnedMessage>,
        expected: Option<i64>,
        handler: &mut F,
    ) -> Result<RecordOutcome, KafkaError> {
        let (topic, partition, next) = (record.topic(), record.partition(), record.offset() + 1);
        let delivery =
            match delivery(record.as_ref(), &self.id_header) {
                Ok(delivery) => delivery,
                // An id header that is not text, or empty, stays so on every read.
                Err(err @ (KafkaError::HeaderNotUtf8 { .. } | KafkaError::Key { .. })) => {
                    let Some(dead_letter) = &self.dead_letter else {
                        return Err(err);
                    };
                    let position = MessageId::from_kafka(topic, partition, record.offset())
                        .map_err(|source| KafkaError::Key {
                            topic: topic.to_owned(),
                            partition,
                            offset: record.offset(),
                            source: Box::new(source),
                        })?;
                    let reason = err.to_string();
                    return self
                        .dead_letter(db, dead_letter, record, position, &reason, expected)
                        .await;
                }
                Err(err) => return Err(err),
            };
        let message_id = delivery.message_id();
        let result = self
            .inbox
            .process(db, delivery, |txn| {
                let business = handler(txn, Arc::clone(record));
                let (group, topic) = (self.group.clone(), topic.to_owned());
                Box::pin(async move {
                    business.await?;
                    advance_offset(txn, &group, &topic, partition, expected, next).await?;
                    Ok::<(), BoxError>(())
                })
            })
            .await;
        if let Some(dead_letter) = &self.dead_letter
            && let Some(reason) = dead_letter_reason(&result)
        {
            return self
                .dead_letter(db, dead_letter, record, message_id, &reason, expected)
                .await;
        }
        let outcome = match result {
            Ok(Outcome::Processed(())) => return Ok(RecordOutcome::Processed),
            Ok(Outcome::Duplicate) => RecordOutcome::Duplicate,
            Ok(Outcome::Refused(refusal)) => {
                tracing::warn!(topic, partition, offset = record.offset(), %refusal, "record refused by the admission floor: skipped");
                RecordOutcome::Refused
            }
            Err(ProcessError::Handler(err)) if offset_moved(&err) => {
                return Ok(RecordOutcome::OffsetMoved);
            }
            Err(error) => {
                return Err(KafkaError::Process {
                    topic: topic.to_owned(),
                    partition,
                    offset: record.offset(),
                    error: Box::new(error),
                });
            }
        };
        self.advance_past(db, record, expected, outcome).await
    }

    /// Processes `records`, consecutive records of one partition fetched in order, in ONE
    /// transaction: their markers claimed by one statement, `handler` run for each new one
    /// in offset order, and the stored offset advanced once, from `expected` past the last.
    /// A record given twice (the same id header) runs once; duplicates of committed
    /// markers are skipped and their offsets advance with the batch.
    ///
    /// Only for an inbox without an admission floor (a refused record must reach the
    /// dead-letter topic before its offset advances) and records whose ids all read;
    /// [`BatchResult::Failed`] otherwise, and on any failure of the batch's transaction
    /// (rolled back, nothing of it applied): the caller then processes the records one by
    /// one with [`process_record`](Self::process_record), so a failing record is retried
    /// or dead-lettered alone and the others still commit.
    pub(crate) async fn process_batch<F: RecordHandlerMut>(
        &self,
        db: &DatabaseConnection,
        records: &[Arc<OwnedMessage>],
        expected: Option<i64>,
        handler: &mut F,
    ) -> BatchResult {
        let (Some(first), Some(last)) = (records.first(), records.last()) else {
            return BatchResult::Failed;
        };
        if self.inbox.admission_floor().is_some() {
            return BatchResult::Failed;
        }
        let Ok(deliveries) = records
            .iter()
            .map(|record| delivery(record.as_ref(), &self.id_header))
            .collect::<Result<Vec<Delivery>, KafkaError>>()
        else {
            return BatchResult::Failed;
        };
        let ids: Vec<MessageId> = deliveries.iter().map(Delivery::message_id).collect();
        let (topic, partition, next) = (first.topic(), first.partition(), last.offset() + 1);
        let result = self
            .inbox
            .process_batch(db, deliveries, |txn, claimed| {
                let mut new: std::collections::HashSet<MessageId> =
                    claimed.iter().copied().collect();
                // Made before any runs (each future starts when awaited), in offset order.
                let business: Vec<_> = records
                    .iter()
                    .zip(&ids)
                    .filter(|(_, id)| new.remove(id))
                    .map(|(record, _)| handler(txn, Arc::clone(record)))
                    .collect();
                let (group, topic) = (self.group.clone(), topic.to_owned());
                Box::pin(async move {
                    let applied = business.len();
                    for record in business {
                        record.await?;
                    }
                    advance_offset(txn, &group, &topic, partition, expected, next).await?;
                    Ok::<usize, BoxError>(applied)
                })
            })
            .await;
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        let total = count(records.len());
        match result {
            Ok(BatchOutcome {
                value: Some(applied),
                ..
            }) => BatchResult::Done {
                processed: count(applied),
                duplicates: total.saturating_sub(count(applied)),
            },
            // Every record's marker existed: nothing ran, so advance past them alone.
            Ok(BatchOutcome { value: None, .. }) => {
                match self
                    .advance_alone(db, topic, partition, expected, next)
                    .await
                {
                    Ok(()) => BatchResult::Done {
                        processed: 0,
                        duplicates: total,
                    },
                    Err(KafkaError::OffsetMoved { .. }) => BatchResult::OffsetMoved,
                    Err(err) => {
                        tracing::debug!(error = %err, "advancing past a batch of duplicates failed: processing its records one by one");
                        BatchResult::Failed
                    }
                }
            }
            Err(ProcessError::Handler(err)) if offset_moved(&err) => BatchResult::OffsetMoved,
            Err(err) => {
                tracing::debug!(error = %err, records = records.len(), "a batch of Kafka records failed and rolled back: processing them one by one");
                BatchResult::Failed
            }
        }
    }

    /// Produces `record` to `dead_letter` and waits for its delivery report, then advances
    /// the stored offset past it: produce before commit, so a crash in between produces it
    /// again (a repeat with the same [`DEAD_LETTER_MESSAGE_ID_HEADER`]), never loses it.
    async fn dead_letter(
        &self,
        db: &DatabaseConnection,
        dead_letter: &DeadLetterTopic,
        record: &OwnedMessage,
        message_id: MessageId,
        reason: &str,
        expected: Option<i64>,
    ) -> Result<RecordOutcome, KafkaError> {
        dead_letter.send(record, message_id, reason).await?;
        tracing::warn!(
            topic = record.topic(),
            partition = record.partition(),
            offset = record.offset(),
            dead_letter_topic = dead_letter.topic_for(record.topic()),
            error = reason,
            "record dead-lettered: no redelivery can fix it"
        );
        self.advance_past(db, record, expected, RecordOutcome::DeadLettered)
            .await
    }

    /// Advances the stored offset past `record` in a transaction of its own: `outcome`,
    /// or [`RecordOutcome::OffsetMoved`] when another consumer moved it first.
    async fn advance_past(
        &self,
        db: &DatabaseConnection,
        record: &OwnedMessage,
        expected: Option<i64>,
        outcome: RecordOutcome,
    ) -> Result<RecordOutcome, KafkaError> {
        let next = record.offset() + 1;
        match self
            .advance_alone(db, record.topic(), record.partition(), expected, next)
            .await
        {
            Ok(()) => Ok(outcome),
            Err(KafkaError::OffsetMoved { .. }) => Ok(RecordOutcome::OffsetMoved),
            Err(err) => Err(err),
        }
    }

    async fn advance_alone(
        &self,
        db: &DatabaseConnection,
        topic: &str,
        partition: i32,
        expected: Option<i64>,
        next: i64,
    ) -> Result<(), KafkaError> {
        let txn = db
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .map_err(|source| KafkaError::Database {
                source: Box::new(source),
            })?;
        advance_offset(&txn, &self.group, topic, partition, expected, next).await?;
        txn.commit().await.map_err(|source| KafkaError::Database {
            source: Box::new(source),
        })
    }

    /// Consumes from `consumer` (made by [`consumer`](Self::consumer), subscribed by the
    /// caller) until `shutdown` completes, one record at a time, in order within each
    /// partition.
    ///
    /// Deprecated: [`KafkaGroupConsumer`] is the loop to run. It processes partitions in
    /// parallel, handles revocations, and commits the records already fetched of a
    /// partition in one transaction ([`KafkaGroupConsumer::with_max_batch`]), where this
    /// loop pays five round trips per record (0.6 of a hand-written at-least-once
    /// consumer's rate in `outbox-bench --kafka`). A handler in flight when `shutdown` completes finishes (commits or rolls
    /// back) before `run` returns; nothing is half done either way.
    ///
    /// A failed record is read again after the retry delay (a seek back to it), so its
    /// partition waits for it, unless no redelivery can fix it and a dead-letter topic is
    /// configured ([`with_dead_letter`](Self::with_dead_letter)).
    #[deprecated(
        note = "run KafkaGroupConsumer instead: partitions in parallel, revocations handled, and the records already fetched of a partition committed in one transaction"
    )]
    pub async fn run<F: RecordHandlerMut, S>(
        &self,
        consumer: &KafkaConsumer,
        db: &DatabaseConnection,
        mut handler: F,
        shutdown: S,
    ) -> Result<RunReport, KafkaError>
    where
        S: Future,
    {
        let mut report = RunReport::default();
        // The stored offset each partition's next advance expects, as read or last written.
        let mut expected: HashMap<(String, i32), Option<i64>> = HashMap::new();
        let mut rebalances = consumer.context().rebalances.load(Ordering::SeqCst);
        let shutdown = std::pin::pin!(shutdown);
        let mut shutdown = shutdown;
        loop {
            let received = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                received = consumer.recv() => received,
            };
            let record = Arc::new(received?.detach());
            let now = consumer.context().rebalances.load(Ordering::SeqCst);
            if now != rebalances {
                // Another consumer may have moved any partition on since: read them again.
                expected.clear();
                rebalances = now;
            }
            let key = (record.topic().to_owned(), record.partition());
            let expects = match expected.get(&key) {
                Some(expects) => *expects,
                None => {
                    let stored =
                        stored_offset(db, &self.group, record.topic(), record.partition()).await?;
                    expected.insert(key.clone(), stored);
                    if let Some(stored) = stored.filter(|stored| *stored != record.offset()) {
                        self.seek(consumer, &record, stored)?;
                        report.seeks += 1;
                        continue;
                    }
                    stored
                }
            };
            // A record fetched before the seek to a later stored offset.
            if expects.is_some_and(|expects| record.offset() < expects) {
                continue;
            }
            match self
                .process_record(db, &record, expects, &mut handler)
                .await
            {
                Ok(RecordOutcome::OffsetMoved) => {
                    report.offsets_moved += 1;
                    // The next record of the partition reads the stored offset and seeks.
                    expected.remove(&key);
                }
                Ok(outcome) => {
                    match outcome {
                        RecordOutcome::Processed => report.processed += 1,
                        RecordOutcome::Duplicate => report.duplicates += 1,
                        RecordOutcome::DeadLettered => report.dead_lettered += 1,
                        _ => report.refused += 1,
                    }
                    expected.insert(key, Some(record.offset() + 1));
                    commit_hint(consumer, &record);
                }
                Err(err) => {
                    report.failures += 1;
                    tracing::warn!(error = %err, "Kafka record failed: reading it again after the retry delay");
                    self.seek(consumer, &record, record.offset())?;
                    tokio::time::sleep(self.retry_delay).await;
                }
            }
        }
        Ok(report)
    }

    fn seek(
        &self,
        consumer: &KafkaConsumer,
        record: &OwnedMessage,
        offset: i64,
    ) -> Result<(), KafkaError> {
        consumer.seek(
            record.topic(),
            record.partition(),
            Offset::Offset(offset),
            Duration::from_secs(10),
        )?;
        Ok(())
    }
}

/// Commits the record's next offset to Kafka, after the database did: a hint for lag
/// monitoring and for a partition without a stored offset; a failure loses nothing.
fn commit_hint<X: ConsumerContext>(consumer: &impl Consumer<X>, record: &OwnedMessage) {
    let mut offsets = TopicPartitionList::new();
    let added = offsets.add_partition_offset(
        record.topic(),
        record.partition(),
        Offset::Offset(record.offset() + 1),
    );
    if let Err(err) = added.and_then(|()| consumer.commit(&offsets, CommitMode::Async)) {
        tracing::debug!(error = %err, "Kafka offset commit (a hint) failed");
    }
}

/// Whether a handler's error is the offset advance's [`KafkaError::OffsetMoved`].
fn offset_moved(err: &BoxError) -> bool {
    matches!(
        err.downcast_ref::<KafkaError>(),
        Some(KafkaError::OffsetMoved { .. })
    )
}

/// Why the record of `result` goes to the dead-letter topic, or `None` when it does not:
/// what [`Settlement::of`] dead-letters, except a failure of the setup (a missing
/// migration, the offset table unreadable), which would send every record there; those
/// are read again until the setup is fixed.
fn dead_letter_reason(result: &Result<Outcome<()>, ProcessError<BoxError>>) -> Option<String> {
    if Settlement::of(result) != Settlement::DeadLetter {
        return None;
    }
    match result {
        Ok(Outcome::Refused(refusal)) => Some(format!("refused by the admission floor: {refusal}")),
        Err(ProcessError::Handler(err)) if err.downcast_ref::<KafkaError>().is_some() => None,
        Err(ProcessError::Handler(err)) => Some(crate::cause::reported_text(err)),
        Err(ProcessError::Inbox(err)) if err.kind() == ErrorKind::Configuration => None,
        Err(err) => Some(err.to_string()),
        Ok(_) => None,
    }
}
