use crate::MessageId;
use crate::backend::{DbErrorKind, classify};
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
        "the inbox supports PostgreSQL, MySQL/MariaDB and SQLite; this connection's backend is {backend}: connect the inbox to one of those"
    )]
    UnsupportedBackend {
        /// The backend SeaORM reported.
        backend: String,
    },

    /// The database failed for another reason: a connection problem, a lock timeout, or a
    /// unique violation on an index other than the inbox's (a real bug, never a duplicate).
    /// The message says which, and what to do.
    #[error(
        "handling message {message_id} for consumer {consumer:?}, the database failed: {source}. {}",
        advice(.source)
    )]
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

/// What to do about a database failure, by its kind.
fn advice(err: &DbErr) -> &'static str {
    match classify(err) {
        DbErrorKind::Transient => {
            "This failure is transient (lost connection, deadlock, lock timeout or busy database): nack the message so the broker redelivers it (Inbox::process already retried it per its RetryPolicy)"
        }
        DbErrorKind::OtherUniqueViolation => {
            "This unique violation is on another index than the inbox's, so it is not a duplicate delivery: fix the handler's data or writes, and dead-letter the message meanwhile"
        }
        DbErrorKind::MissingInboxTable => {
            "Add inbox_migration::CreateInbox to your Migrator (or run inbox_migration::Migrator::up)"
        }
        DbErrorKind::InboxDuplicate => "The message was already processed by this consumer: ack it",
        _ => {
            "Nack the message so the broker redelivers it; if it keeps failing, check the database error above (permissions, schema, server state)"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::{ConnAcquireErr, DbErr};

    fn database(source: DbErr) -> String {
        InboxError::Database {
            message_id: MessageId::from(uuid::Uuid::from_u128(7)),
            consumer: "billing".into(),
            source,
        }
        .to_string()
    }

    /// Every error message says what to do, not only what went wrong.
    #[test]
    fn every_message_tells_the_user_what_to_do() {
        let cases = [
            (InboxError::EmptyConsumer.to_string(), "give each handler"),
            (
                InboxError::ConsumerTooLong { chars: 201 }.to_string(),
                "use a shorter",
            ),
            (InboxError::NilMessageId.to_string(), "derive it from"),
            (
                InboxError::MissingTable {
                    source: DbErr::Custom("no such table: inbox".into()),
                }
                .to_string(),
                "add inbox_migration::CreateInbox",
            ),
            (
                InboxError::UnsupportedBackend {
                    backend: "Oracle".into(),
                }
                .to_string(),
                "connect the inbox to one of those",
            ),
            (
                database(DbErr::ConnectionAcquire(ConnAcquireErr::Timeout)),
                "nack the message so the broker redelivers it",
            ),
            (
                database(DbErr::Custom("permission denied".into())),
                "Nack the message",
            ),
        ];
        for (message, instruction) in cases {
            assert!(
                message.contains(instruction),
                "{message:?} should say {instruction:?}"
            );
        }
    }

    #[test]
    fn database_errors_name_the_message_and_consumer() {
        let message = database(DbErr::Custom("boom".into()));
        assert!(
            message.contains("00000000-0000-0000-0000-000000000007"),
            "{message}"
        );
        assert!(message.contains("\"billing\""), "{message}");
        assert!(message.contains("boom"), "{message}");
    }
}
