use crate::MessageId;
use sea_orm::DbErr;

/// Everything that can go wrong when claiming a message.
///
/// Input errors ([`EmptyConsumer`](Self::EmptyConsumer),
/// [`ConsumerTooLong`](Self::ConsumerTooLong), [`NilMessageId`](Self::NilMessageId)) are
/// returned before any SQL runs. Database failures keep the original [`DbErr`] so the
/// caller can inspect it; [`crate::classify`] tells transient ones from the rest.
///
/// ```
/// use inbox_core::InboxError;
///
/// let err = InboxError::ConsumerTooLong { chars: 201 };
/// assert!(err.to_string().contains("at most 200"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The consumer name is empty or only white space.
    #[error(
        "the consumer name is empty: give each handler a stable, non-empty name such as \"billing.credit-account\""
    )]
    EmptyConsumer,

    /// The consumer name does not fit the `consumer` column.
    #[error(
        "the consumer name is {chars} characters long; the inbox column holds at most 200: use a shorter, stable handler name"
    )]
    ConsumerTooLong {
        /// Length of the rejected name, in characters.
        chars: usize,
    },

    /// The message id is the nil UUID, which usually means an id that was never set.
    #[error(
        "the message id is the nil UUID: derive it from the broker's message id or a business key that stays the same across redeliveries"
    )]
    NilMessageId,

    /// The inbox table does not exist in the database the transaction runs on.
    #[error(
        "the inbox table does not exist: add inbox_migration::CreateInbox to your Migrator (or run inbox_migration::Migrator::up) before claiming messages ({source})"
    )]
    MissingTable {
        /// The database's own error.
        #[source]
        source: DbErr,
    },

    /// The connection's backend is none of PostgreSQL, MySQL/MariaDB and SQLite.
    #[error(
        "the inbox supports PostgreSQL, MySQL/MariaDB and SQLite; this connection's backend is {backend}"
    )]
    UnsupportedBackend {
        /// The backend SeaORM reported.
        backend: String,
    },

    /// The database failed for another reason: a connection problem, a lock timeout, or a
    /// unique violation on an index other than the inbox's (a real bug, never a duplicate).
    #[error("claiming message {message_id} for consumer {consumer:?} failed: {source}")]
    Database {
        /// The message being claimed.
        message_id: MessageId,
        /// The consumer claiming it.
        consumer: String,
        /// The database's own error.
        #[source]
        source: DbErr,
    },
}

impl InboxError {
    /// The underlying database error, if this error came from the database.
    pub fn db_err(&self) -> Option<&DbErr> {
        match self {
            Self::MissingTable { source } | Self::Database { source, .. } => Some(source),
            Self::EmptyConsumer
            | Self::ConsumerTooLong { .. }
            | Self::NilMessageId
            | Self::UnsupportedBackend { .. } => None,
        }
    }
}
