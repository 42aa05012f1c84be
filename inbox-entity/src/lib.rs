#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

/// Name of the inbox table.
pub const TABLE_NAME: &str = "inbox";

/// Name of the UNIQUE index on `(message_id, consumer)`.
///
/// A unique violation counts as "already processed" only when it names this index.
pub const INDEX_NAME: &str = "ix_inbox_message_id_consumer";

/// Name of the (non-unique) index on `(received_at)` that the retention purge scans.
pub const RECEIVED_AT_INDEX_NAME: &str = "ix_inbox_received_at";

/// Longest consumer name the `consumer` column holds, in characters.
pub const CONSUMER_MAX_CHARS: usize = 200;

pub mod inbox {
    //! The `inbox` table: one marker per `(message_id, consumer)`.
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
