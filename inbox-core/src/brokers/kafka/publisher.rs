//! The outbox to Kafka: [`KafkaPublisher`], a [`Publisher`] on rdkafka's idempotent
//! producer.

use super::{DEFAULT_ID_HEADER, KafkaError};
use crate::{OutboxMessage, PublishError, Publisher};
use chrono::SecondsFormat;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError as ClientError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::fmt;
use std::time::Duration;

/// The header carrying an outbox message's send time, its
/// [first publish time](OutboxMessage::first_published_at) in RFC 3339 with microseconds
/// (the record's timestamp holds it too, in milliseconds, unless the topic stamps records
/// with the broker's append time). The same name as JetStream's.
pub const SENT_AT_HEADER: &str = "Outbox-Sent-At";

/// A producer of `config` with `enable.idempotence=true` and `acks=all`, whatever `config`
/// says of them: a retry inside librdkafka cannot write a record twice or out of order,
/// and a delivery report means every in-sync replica has the record.
pub(super) fn idempotent_producer(config: &ClientConfig) -> Result<FutureProducer, KafkaError> {
    let mut config = config.clone();
    config.set("enable.idempotence", "true").set("acks", "all");
    Ok(config.create()?)
}

/// Publishes outbox messages to Kafka and waits for each delivery report: a [`Publisher`]
/// for a [`Relay`](crate::Relay), so a row is marked sent only once the broker has the
/// record on every in-sync replica.
///
/// The destination is the topic; the message's key is the record key (Kafka picks the
/// partition by it, so the per-key order the relay keeps becomes the partition's order);
/// the message id goes out as the header [`DEFAULT_ID_HEADER`] (the one
/// [`KafkaInbox`](super::KafkaInbox) reads), the send time as the record's timestamp and
/// the header [`SENT_AT_HEADER`], the message's headers as record headers.
///
/// The producer is idempotent (`enable.idempotence=true`, `acks=all`): librdkafka's own
/// retries never duplicate or reorder a record. A relay that dies between the delivery
/// report and marking its row sent publishes the row again, with the same message id: the
/// consumer's inbox drops it. Keep librdkafka's `message.timeout.ms` below the relay's
/// `publish_timeout`, so a record the relay gave up on is not delivered after it.
///
/// ```no_run
/// use rdkafka::ClientConfig;
/// use sea_orm_inbox::Relay;
/// use sea_orm_inbox::kafka::KafkaPublisher;
///
/// # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), sea_orm_inbox::kafka::KafkaError> {
/// let publisher = KafkaPublisher::new(
///     ClientConfig::new()
///         .set("bootstrap.servers", "127.0.0.1:9092")
///         .set("message.timeout.ms", "20000"),
/// )?;
/// Relay::new(publisher).run(&db, std::future::pending()).await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    id_header: String,
    queue_timeout: Duration,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("id_header", &self.id_header)
            .field("queue_timeout", &self.queue_timeout)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher through an idempotent producer of `config` (`enable.idempotence=true`
    /// and `acks=all`, whatever `config` says of them).
    ///
    /// # Errors
    /// [`KafkaError::Client`] when rdkafka refuses the configuration.
    pub fn new(config: &ClientConfig) -> Result<Self, KafkaError> {
        Ok(Self {
            producer: idempotent_producer(config)?,
            id_header: DEFAULT_ID_HEADER.to_owned(),
            queue_timeout: Duration::from_secs(10),
        })
    }

    /// Writes the message id to header `name` instead of [`DEFAULT_ID_HEADER`] (match the
    /// consumer's [`KafkaInbox::with_id_header`](super::KafkaInbox::with_id_header)).
    pub fn with_id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// The producer, to flush it before the process exits.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }
}

/// What the relay does after the client's `error`: park the row only for what no retry can
/// fix (a record larger than the broker takes, a topic name Kafka cannot have); retry the
/// rest (a broker down, a timed-out delivery, a leader election, a topic not created yet).
fn publish_error(error: ClientError) -> PublishError {
    let rejected = matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidTopic
        )
    );
    if rejected {
        PublishError::Rejected(Box::new(error))
    } else {
        PublishError::Transient(Box::new(error))
    }
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let message_id = message.message_id.to_string();
        let sent_at = message
            .first_published_at
            .to_rfc3339_opts(SecondsFormat::Micros, true);
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len() + 2);
        for (key, value) in &message.headers {
            if key != &self.id_header && key != SENT_AT_HEADER {
                headers = headers.insert(Header {
                    key: key.as_str(),
                    value: Some(value.as_str()),
                });
            }
        }
        headers = headers
            .insert(Header {
                key: self.id_header.as_str(),
                value: Some(message_id.as_str()),
            })
            .insert(Header {
                key: SENT_AT_HEADER,
                value: Some(sent_at.as_str()),
            });
        let mut record = FutureRecord::<str, [u8]>::to(&message.destination)
            .payload(&message.payload)
            .headers(headers)
            .timestamp(message.first_published_at.timestamp_millis());
        if let Some(key) = &message.key {
            record = record.key(key.as_str());
        }
        self.producer
            .send(record, self.queue_timeout)
            .await
            .map(drop)
            .map_err(|(error, _)| publish_error(error))
    }
}
