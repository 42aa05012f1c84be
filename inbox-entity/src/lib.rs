#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod table;

pub use table::{InboxTable, InvalidTableName, NameOf, SCHEMA_NAME_MAX_LEN, TABLE_NAME_MAX_LEN};

/// Name of the default inbox table (see [`InboxTable`] for another).
pub const TABLE_NAME: &str = "inbox";

/// Name of the default inbox table's UNIQUE index on `(message_id, consumer)`.
///
/// A unique violation counts as "already processed" only when it names this index.
pub const INDEX_NAME: &str = "ix_inbox_message_id_consumer";

/// Name of the default inbox table's (non-unique) index on `(received_at)` that the
/// retention purge scans.
pub const RECEIVED_AT_INDEX_NAME: &str = "ix_inbox_received_at";

/// Longest consumer name the `consumer` column holds, in characters.
pub const CONSUMER_MAX_CHARS: usize = 200;

pub mod inbox {
    //! The `inbox` table: one marker per `(message_id, consumer)`.
    //!
    //! The entity names the default table; an inbox in another [`InboxTable`](crate::InboxTable)
    //! has the same columns, so `Column` serves it in statements built for
    //! [`InboxTable::table_ref`](crate::InboxTable::table_ref).
    use sea_orm::entity::prelude::*;

    /// A marker row.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "inbox")]
    pub struct Model {
        /// Surrogate, append-only primary key.
        #[sea_orm(primary_key)]
        pub id: i64,
        /// The deduplication key of the message (stable across redeliveries).
        pub message_id: Uuid,
        /// The handler that consumed the message; several consumers may each claim one message.
        #[sea_orm(column_type = "String(StringLen::N(200))")]
        pub consumer: String,
        /// When the marker was written (UTC, microsecond precision).
        pub received_at: DateTimeUtc,
        /// When processing finished, if it has. Markers written by the one-phase
        /// `claim_message` leave it NULL: their commit is the proof of processing.
        pub processed_at: Option<DateTimeUtc>,
        /// How many two-phase attempts claimed this message (1 for every other marker).
        pub attempts: i32,
        /// When the current two-phase lease expires; NULL for markers that are not leases.
        /// A row with a lease and no `processed_at` is an unfinished claim.
        pub lease_until: Option<DateTimeUtc>,
        /// The token of the claim that last wrote the row: the fencing token of a
        /// two-phase lease (replaced on every takeover) or the tag of a batch claim.
        pub claim_token: Option<Uuid>,
        /// When a two-phase claim was parked as dead after its last allowed attempt.
        pub dead_at: Option<DateTimeUtc>,
    }

    /// The inbox has no relations.
    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// Name of the table of Kafka consumer offsets that the opt-in `CreateKafkaOffsets`
/// migration creates: the next offset per (consumer group, topic, partition), advanced in
/// the handler's transaction.
pub const KAFKA_OFFSET_TABLE_NAME: &str = "inbox_kafka_offset";

/// Longest Kafka topic name, in characters (Kafka's own limit).
pub const KAFKA_TOPIC_MAX_CHARS: usize = 249;

/// Longest consumer group id the offset table holds, in characters.
pub const KAFKA_GROUP_MAX_CHARS: usize = 200;

/// Name of the outbox table.
pub const OUTBOX_TABLE_NAME: &str = "outbox";

/// Name of the UNIQUE index on the outbox's `message_id`: one row per outgoing message,
/// however often the transaction that enqueued it ran.
pub const OUTBOX_MESSAGE_ID_INDEX_NAME: &str = "ix_outbox_message_id";

/// Name of the index on `(sent_at, id)` that the relay walks for unsent rows in enqueue
/// order, and that the purge of sent rows walks by sending time.
pub const OUTBOX_PENDING_INDEX_NAME: &str = "ix_outbox_pending";

/// Name of the PostgreSQL index on `(sent_at, id)` of the rows still due (`WHERE sent_at
/// IS NULL AND dead_at IS NULL`) that the relay's claim walks in enqueue order.
pub const OUTBOX_DUE_INDEX_NAME: &str = "ix_outbox_due";

/// Name of the index on `(partition_key, id)` that tells the relay whether an earlier row
/// of the same key is still unsent.
pub const OUTBOX_KEY_INDEX_NAME: &str = "ix_outbox_key";

/// Longest destination (topic, queue, subject, routing key) the `destination` column
/// holds, in characters.
pub const DESTINATION_MAX_CHARS: usize = 200;

/// Longest ordering key the `partition_key` column holds, in characters.
pub const PARTITION_KEY_MAX_CHARS: usize = 200;

/// Longest publish error the relay stores in the `last_error` column, in characters; a
/// longer one is cut on a character boundary and says so. The column is a `text`: on
/// MySQL/MariaDB that holds 65,535 bytes, which this many characters of 4 bytes each stay
/// well under; PostgreSQL and SQLite hold more.
pub const LAST_ERROR_MAX_CHARS: usize = 4000;

pub mod outbox {
    //! The `outbox` table: one row per message to publish, written in the transaction of
    //! the business change it announces, published by a relay after commit.
    use sea_orm::entity::prelude::*;

    /// An outgoing message.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "outbox")]
    pub struct Model {
        /// Surrogate, append-only primary key; the enqueue order the relay keeps per key.
        #[sea_orm(primary_key)]
        pub id: i64,
        /// The broker message's id (RabbitMQ `message_id`, `Nats-Msg-Id`): the same on
        /// every publish of this row, so consumers and brokers can deduplicate.
        pub message_id: Uuid,
        /// Where to publish: a topic, queue, subject or routing key.
        #[sea_orm(column_type = "String(StringLen::N(200))")]
        pub destination: String,
        /// The ordering key: rows of one key are published in `id` order. NULL: unordered.
        #[sea_orm(column_type = "String(StringLen::N(200))", nullable)]
        pub partition_key: Option<String>,
        /// The message body.
        pub payload: Vec<u8>,
        /// The message headers, a JSON object of strings (`{}` for none).
        #[sea_orm(column_type = "Text")]
        pub headers: String,
        /// When the row was enqueued (UTC, microsecond precision).
        pub created_at: DateTimeUtc,
        /// The earliest time the relay publishes it: `created_at`, later for a delayed
        /// message, or the next retry after a failed publish.
        pub available_at: DateTimeUtc,
        /// How many times a relay claimed the row to publish it.
        pub attempts: i32,
        /// When the current relay's lease ends; NULL when no relay holds the row.
        pub leased_until: Option<DateTimeUtc>,
        /// The fencing token of the claim that last leased the row: only that claim may
        /// mark it sent or failed.
        pub lease_token: Option<Uuid>,
        /// When the broker confirmed the publish. NULL: not (yet) sent.
        pub sent_at: Option<DateTimeUtc>,
        /// The error of the last failed publish.
        #[sea_orm(column_type = "Text", nullable)]
        pub last_error: Option<String>,
        /// When the row was parked as dead after its last allowed attempt (or a publish the
        /// broker refused for good). A dead row holds back the later rows of its key until
        /// an operator requeues or deletes it.
        pub dead_at: Option<DateTimeUtc>,
        /// When a relay first claimed the row to publish it: the send time publishers give
        /// the broker, the same on every publish of the row. NULL until the first claim,
        /// and again after a dead row is requeued (an operator's decision to send it anew).
        /// Added by `AddOutboxFirstPublished`.
        pub first_published_at: Option<DateTimeUtc>,
    }

    /// The outbox has no relations.
    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}
