use super::OutboxError;
use super::message::OutgoingMessage;
use crate::Inbox;
use crate::MessageId;
use crate::backend::outbox::{OutboxRow, insert_statement};
use crate::clock::now_micros;
use crate::silence::within;
use sea_orm::ConnectionTrait;
use std::future::Future;

/// Writes outgoing messages into the outbox through any SeaORM connection: inside a
/// transaction, they commit or roll back with the business writes beside them.
///
/// Implemented for every [`ConnectionTrait`]: a [`DatabaseTransaction`](sea_orm::DatabaseTransaction),
/// the transaction [`Inbox::process`] hands its handler, or a connection (where the row
/// commits on its own, like any statement outside a transaction).
///
/// ```
/// use sea_orm::{DbErr, TransactionTrait};
/// use sea_orm_inbox::{MessageId, OutboxExt, OutgoingMessage};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_inbox_migration::{MigratorWithOutbox, MigratorTrait};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # MigratorWithOutbox::up(&db, None).await?;
/// let txn = db.begin().await?;
/// // ... the business writes through `txn` ...
/// txn.enqueue(OutgoingMessage::new("orders.placed", b"order 42".to_vec()).key("order-42"))
///     .await?;
/// txn.commit().await?; // the order and its message, or neither
/// # Ok(()) }
/// ```
pub trait OutboxExt: ConnectionTrait {
    /// Writes `message` into the outbox through this connection, and returns its id.
    ///
    /// A row with the same message id already in the outbox (committed, or written
    /// earlier in this transaction) is left as it is, and the call succeeds without
    /// raising anything into the transaction: enqueueing a derived id twice leaves one
    /// row. The message goes out once the transaction commits and a [`Relay`](crate::Relay)
    /// claims it; wake the relay with [`OutboxWaker::wake`](crate::OutboxWaker::wake)
    /// after the commit to skip its polling delay.
    ///
    /// The statement waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database
    /// (PostgreSQL, MySQL/MariaDB).
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] before any SQL runs (an empty or too long
    /// destination or key, a nil id); [`OutboxError::Database`] when the INSERT failed
    /// (the outbox table missing: add
    /// [`CreateOutbox`](https://docs.rs/sea-orm-inbox-migration) to your migrator);
    /// [`OutboxError::DatabaseSilent`] when the database did not answer. Return it from
    /// the handler: the transaction must not commit without its message.
    fn enqueue(
        &self,
        message: OutgoingMessage,
    ) -> impl Future<Output = Result<MessageId, OutboxError>> + Send;
}

impl<C: ConnectionTrait> OutboxExt for C {
    fn enqueue(
        &self,
        message: OutgoingMessage,
    ) -> impl Future<Output = Result<MessageId, OutboxError>> + Send {
        let backend = self.get_database_backend();
        let statement = message.validate().and_then(|()| {
            let parts = message.into_parts();
            let created_at = now_micros();
            let available_at = chrono::Duration::from_std(parts.delay)
                .ok()
                .and_then(|delay| created_at.checked_add_signed(delay))
                .ok_or(OutboxError::InvalidMessage {
                    field: "delay",
                    problem: format!("{:?} is past any date the database holds", parts.delay),
                })?;
            let message_id = parts.message_id;
            let row = OutboxRow {
                message_id: message_id.as_uuid(),
                destination: parts.destination,
                partition_key: parts.key,
                payload: parts.payload,
                headers: parts.headers,
                created_at,
                available_at,
            };
            Ok((message_id, insert_statement(backend, row)?))
        });
        async move {
            let (message_id, statement) = statement?;
            within(
                backend,
                Inbox::DEFAULT_PARTITION_TIMEOUT,
                self.execute_raw(statement),
            )
            .await
            .map_err(|waited| OutboxError::DatabaseSilent {
                operation: "the enqueue",
                waited,
            })?
            .map_err(|source| OutboxError::Database {
                operation: "the enqueue",
                source,
            })?;
            Ok(message_id)
        }
    }
}
