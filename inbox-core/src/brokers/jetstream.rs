//! NATS JetStream through [`async_nats`] (feature `async-nats`): a message's `Nats-Msg-Id`
//! header and metadata to a [`Delivery`], a [`Settlement`] to `ack`, `nak` with a delay or
//! `term`.
//!
//! The consumer loop over a pull consumer with explicit acks:
//!
//! ```no_run
//! use futures_util::StreamExt;
//! use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
//! use sea_orm_inbox::{Inbox, ProcessError, Settlement, jetstream};
//!
//! # async fn consume(consumer: async_nats::jetstream::consumer::PullConsumer, db: DatabaseConnection, inbox: Inbox) -> Result<(), async_nats::Error> {
//! let mut messages = consumer.messages().await?;
//! while let Some(message) = messages.next().await {
//!     let message = message?;
//!     let result = match jetstream::delivery(&message) {
//!         Ok(delivery) => {
//!             inbox
//!                 .process(&db, delivery, |txn| {
//!                     Box::pin(async move {
//!                         txn.execute_unprepared("UPDATE account SET balance = balance + 10").await?;
//!                         Ok::<_, DbErr>(())
//!                     })
//!                 })
//!                 .await
//!         }
//!         // No Nats-Msg-Id header, or a nil one: terminated below.
//!         Err(err) => Err(ProcessError::Inbox(err)),
//!     };
//!     let settlement = Settlement::for_delivery(&result, jetstream::delivery_count(&message));
//!     jetstream::settle(&message, settlement).await?;
//! }
//! # Ok(()) }
//! ```

use crate::{Delivery, InboxError, MessageId, OutboxMessage, PublishError, Publisher, Settlement};
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{AckKind, Message};
use chrono::{DateTime, SecondsFormat, Utc};

/// The [`Delivery`] of a JetStream message: its key from the `Nats-Msg-Id` header
/// ([`MessageId::from_broker_id`]; the header JetStream itself deduplicates publishes by),
/// its send time from the [`SENT_AT_HEADER`] when the producer set one (as
/// [`JetStreamPublisher`] does: the same on every publish of an outbox row, also one the
/// stream stored again after its duplicate window), else from the message metadata (the
/// time the stream stored it, the same on every redelivery). A message with neither (not
/// from a consumer with acks) gets no send time.
///
/// # Errors
/// [`InboxError::EmptyKeyField`] when the message has no `Nats-Msg-Id` (or an empty one),
/// [`InboxError::NilMessageId`] when it is the nil UUID, [`InboxError::OutOfRange`] for a
/// [`SENT_AT_HEADER`] that is not an RFC 3339 time. All of them are
/// [permanent](InboxError::is_permanent): terminate the message
/// (`Err(ProcessError::Inbox(err))` settles as [`Settlement::DeadLetter`]).
pub fn delivery(message: &Message) -> Result<Delivery, InboxError> {
    let headers = message.headers.as_ref();
    let id = headers
        .and_then(|headers| headers.get(NATS_MESSAGE_ID))
        .map_or("", |id| id.as_str());
    let delivery = Delivery::new(MessageId::from_broker_id(id)?);
    if let Some(sent) = headers
        .and_then(|headers| headers.get(SENT_AT_HEADER))
        .map(|sent| sent.as_str())
    {
        let sent_at = DateTime::parse_from_rfc3339(sent).map_err(|_| InboxError::OutOfRange {
            what: "the Outbox-Sent-At header",
            value: sent.to_owned(),
            accepted: "an RFC 3339 time, e.g. 2026-12-04T12:00:00.000000Z".to_owned(),
            advice: "set it to the time the message was first sent, or leave it out",
        })?;
        return Ok(delivery.sent_at(sent_at.with_timezone(&Utc)));
    }
    let published = message.info().ok().and_then(|info| {
        let nanos = i64::try_from(info.published.unix_timestamp_nanos()).ok()?;
        Some(DateTime::from_timestamp_nanos(nanos))
    });
    Ok(match published {
        Some(sent_at) => delivery.sent_at(sent_at),
        None => delivery,
    })
}

/// How often JetStream has delivered this message, this delivery included (its metadata's
/// `delivered`; 1 without metadata). For [`Settlement::for_delivery`].
pub fn delivery_count(message: &Message) -> u32 {
    message
        .info()
        .ok()
        .and_then(|info| u32::try_from(info.delivered).ok())
        .unwrap_or(1)
        .max(1)
}

/// Tells JetStream what became of `message`:
///
/// | settlement | call |
/// | --- | --- |
/// | `Ack` | `ack()` |
/// | `Nack(delay)` | `ack_with(AckKind::Nak(delay))`: redelivered after the delay |
/// | `DeadLetter` | `ack_with(AckKind::Term)`: never redelivered; the server publishes a `MSG_TERMINATED` advisory, which a dead-letter stream can capture |
///
/// Acks are published without waiting for the server's reply: flush the client
/// (`client.flush()`) before the process exits.
///
/// # Errors
/// The client's error when the ack cannot be published.
pub async fn settle(message: &Message, settlement: Settlement) -> Result<(), async_nats::Error> {
    match settlement {
        Settlement::Ack => message.ack().await,
        Settlement::Nack(delay) => message.ack_with(AckKind::Nak(delay)).await,
        Settlement::DeadLetter => message.ack_with(AckKind::Term).await,
    }
}

/// Publishes outbox messages to JetStream and waits for each publish ack: a [`Publisher`]
/// for a [`Relay`](crate::Relay).
///
/// The destination is the subject; the outbox message id goes out as `Nats-Msg-Id`, so
/// JetStream itself drops a republish (after a relay died before marking its row sent)
/// within the stream's duplicate window, and the ack of such a repeat counts as success.
/// The headers go as headers, the ordering key as the header [`KEY_HEADER`], the send time
/// as the header [`SENT_AT_HEADER`].
///
/// ```no_run
/// use sea_orm_inbox::{Relay, jetstream::JetStreamPublisher};
///
/// # async fn run(client: async_nats::Client, db: sea_orm::DatabaseConnection) {
/// let relay = Relay::new(JetStreamPublisher::new(async_nats::jetstream::new(client)));
/// relay.run(&db, std::future::pending()).await;
/// # }
/// ```
pub struct JetStreamPublisher {
    context: async_nats::jetstream::Context,
}

/// The header carrying an outbox message's ordering key to NATS consumers.
pub const KEY_HEADER: &str = "Outbox-Key";

/// The header carrying an outbox message's send time, its
/// [first publish time](OutboxMessage::first_published_at) in RFC 3339 with microseconds,
/// which [`delivery`] reads back. JetStream's own stored time would not do: a republish
/// the stream stores again (after its duplicate window) gets a later one.
pub const SENT_AT_HEADER: &str = "Outbox-Sent-At";

impl JetStreamPublisher {
    /// A publisher through `context`.
    pub fn new(context: async_nats::jetstream::Context) -> Self {
        Self { context }
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let mut publish = PublishMessage::build()
            .payload(message.payload.clone().into())
            .message_id(message.message_id.to_string());
        for (name, value) in &message.headers {
            publish = publish.header(name.as_str(), value.as_str());
        }
        if let Some(key) = &message.key {
            publish = publish.header(KEY_HEADER, key.as_str());
        }
        publish = publish.header(
            SENT_AT_HEADER,
            message
                .first_published_at
                .to_rfc3339_opts(SecondsFormat::Micros, true)
                .as_str(),
        );
        let transient = |err: async_nats::jetstream::context::PublishError| {
            PublishError::Transient(Box::new(err))
        };
        // A duplicate ack (JetStream already stored this id) is a success too.
        self.context
            .send_publish(message.destination.clone(), publish)
            .await
            .map_err(transient)?
            .await
            .map_err(transient)?;
        Ok(())
    }
}
