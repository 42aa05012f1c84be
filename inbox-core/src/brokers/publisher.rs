//! The [`Publisher`] every broker adapter implements for the outbox's relay, and the
//! errors a publish reports.

use crate::OutboxMessage;
use std::future::Future;
use std::sync::Arc;

/// A boxed error from a broker client.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a publish failed, split by what the relay does next.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker did not confirm the message (a lost connection, a negative
    /// acknowledgement, a timeout): the relay retries it after a backoff, up to
    /// [`RelayOptions::max_attempts`](crate::RelayOptions::max_attempts).
    #[error("the broker did not confirm the message: {0}")]
    Transient(#[source] BoxError),
    /// The message can never be published (larger than the broker accepts, for a
    /// destination the publisher knows cannot exist): the relay parks it as dead at once.
    /// For publishers that can tell; the shipped RabbitMQ and JetStream publishers never
    /// return it, as every refusal they see may heal (a queue bound later, a full queue
    /// drained, a connection reopened), and a message that keeps failing is parked after
    /// [`RelayOptions::max_attempts`](crate::RelayOptions::max_attempts).
    #[error("the broker refused the message: {0}")]
    Rejected(#[source] BoxError),
}

/// Sends a claimed [`OutboxMessage`] to a broker and returns once the broker has taken
/// responsibility for it (RabbitMQ's publisher confirm, JetStream's publish ack, Kafka's
/// acks).
///
/// The relay calls it at least once per message: again after a failure, and again when a
/// relay died between the broker's confirmation and marking the row sent. Send
/// [`OutboxMessage::message_id`] as the broker's message id every time, so the broker
/// (JetStream's `Nats-Msg-Id` window) or the consumer's inbox drops the repeat, and
/// [`OutboxMessage::first_published_at`] as its send time (a Kafka record's timestamp), so
/// a consumer's admission floor sees every copy as sent when the first one was.
///
/// Ready implementations: `rabbitmq::RabbitMqPublisher` (feature `lapin`),
/// `jetstream::JetStreamPublisher` (feature `async-nats`) and `kafka::KafkaPublisher`
/// (feature `rdkafka`: `destination` is the topic, `key` the record key, which picks the
/// partition, `headers` the record headers).
///
/// ```
/// use sea_orm_inbox::{OutboxMessage, PublishError, Publisher};
/// use std::sync::Mutex;
///
/// /// Keeps what it is given: a stand-in broker for tests.
/// #[derive(Default)]
/// struct Recorder(Mutex<Vec<OutboxMessage>>);
///
/// impl Publisher for Recorder {
///     async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
///         self.0
///             .lock()
///             .map_err(|_| PublishError::Transient("the recorder's lock is poisoned".into()))?
///             .push(message.clone());
///         Ok(())
///     }
/// }
/// ```
pub trait Publisher: Send + Sync {
    /// Publishes `message` and waits for the broker's confirmation.
    ///
    /// # Errors
    /// [`PublishError::Transient`] to retry later, [`PublishError::Rejected`] to park the
    /// message as dead.
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// The most messages [`publish_batch`](Self::publish_batch) takes in one call: 1 by
    /// default, more for a broker with a batch call (SQS's `SendMessageBatch`: 10). The
    /// relay hands it that many messages of a claimed batch at once.
    fn batch_limit(&self) -> usize {
        1
    }

    /// Publishes `messages` (at most [`batch_limit`](Self::batch_limit)) and returns one
    /// result per message, in their order: each succeeds or fails alone. By default one
    /// [`publish`](Self::publish) after the other.
    fn publish_batch(
        &self,
        messages: &[&OutboxMessage],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send {
        async move {
            let mut results = Vec::with_capacity(messages.len());
            for message in messages {
                results.push(self.publish(message).await);
            }
            results
        }
    }
}

/// A publisher shared by several relays (or kept by the caller to inspect) publishes as
/// itself.
impl<P: Publisher> Publisher for Arc<P> {
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        P::publish(self, message)
    }

    fn batch_limit(&self) -> usize {
        P::batch_limit(self)
    }

    fn publish_batch(
        &self,
        messages: &[&OutboxMessage],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send {
        P::publish_batch(self, messages)
    }
}
