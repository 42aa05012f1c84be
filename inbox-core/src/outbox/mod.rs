//! The transactional outbox: messages written in the transaction of the change they
//! announce, published by a relay after commit (guide: [`crate::guide::outbox`]).

mod admin;
mod enqueue;
mod message;
mod purger;
mod relay;
mod wake;

pub use admin::{
    OutboxBacklog, list_dead_messages, outbox_backlog, purge_sent_messages, requeue_dead_message,
};
pub use enqueue::OutboxExt;
pub use message::{DeadMessage, OutboxMessage, OutgoingMessage};
pub use purger::{OutboxPurger, OutboxPurgerSummary, spawn_outbox_purger};
pub use relay::{OutboxMetrics, OutboxMetricsSnapshot, Relay, RelayOptions, RelayReport};
pub use wake::{OUTBOX_CHANNEL, OutboxWaker};

use crate::InboxError;
use sea_orm::DbErr;
use std::time::Duration;

/// What can go wrong writing to or relaying from the outbox.
///
/// ```
/// use sea_orm_inbox::{OutboxError, RelayOptions};
///
/// let options = RelayOptions { batch_size: 0, ..RelayOptions::default() };
/// assert!(matches!(options.validate(), Err(OutboxError::InvalidOptions { .. })));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The message cannot be stored as it is; nothing was written. Fix the message.
    #[error("the outgoing message's {field} {problem}: fix it before enqueueing")]
    InvalidMessage {
        /// The offending part of the message.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },

    /// Relay or purge options that cannot work.
    #[error("invalid outbox options: {what}; {advice}")]
    InvalidOptions {
        /// What is wrong.
        what: &'static str,
        /// What to do instead.
        advice: &'static str,
    },

    /// The connection's database is not one this build supports (see the message).
    #[error("{0}")]
    Backend(#[source] InboxError),

    /// A statement failed. The enqueue's transaction must not commit (return the error
    /// from the handler); a relay retries at its next poll. A missing `outbox` table or
    /// column means `CreateOutbox` or `AddOutboxFirstPublished` has not run: add them to
    /// your migrator.
    #[error(
        "{operation} failed: {source}. If the outbox table or one of its columns is missing, add sea_orm_inbox_migration::CreateOutbox and AddOutboxFirstPublished to your Migrator and run them (verify_outbox_schema names what is missing)"
    )]
    Database {
        /// The step that failed.
        operation: &'static str,
        /// The database's own error.
        #[source]
        source: DbErr,
    },

    /// The database did not answer within the partition timeout (a relay's
    /// [`with_partition_timeout`](crate::Relay::with_partition_timeout), otherwise
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT)): a
    /// network partition or a hung server. Retry later.
    #[error(
        "{operation} got no answer from the database within {waited:?} (a network partition or a hung database): retry later"
    )]
    DatabaseSilent {
        /// The step that waited.
        operation: &'static str,
        /// How long it waited.
        waited: Duration,
    },

    /// [`spawn_outbox_purger`] was called outside a tokio runtime.
    #[error(
        "spawn_outbox_purger needs a tokio runtime: call it from within one (e.g. inside #[tokio::main])"
    )]
    NoTokioRuntime,

    /// The outbox purger's task ended abnormally (it was aborted or panicked).
    #[error("the outbox purger stopped abnormally: {reason}")]
    PurgerStopped {
        /// What the task's join said.
        reason: String,
    },
}

impl From<InboxError> for OutboxError {
    fn from(err: InboxError) -> Self {
        Self::Backend(err)
    }
}
