//! The dead-letter topic of [`KafkaInbox`](super::KafkaInbox): where a record goes that no
//! redelivery can fix, so that its partition keeps flowing.
//!
//! The order is produce, then commit: the record is produced to the dead-letter topic and
//! its delivery report awaited, and only then does the partition's stored offset advance
//! past it, in a transaction of its own (compare-and-set, as for any record). A crash
//! between the two leaves the offset before the record: the next owner fails it again and
//! produces it again. So the dead-letter topic holds a record at least once, never zero
//! times; its consumer drops a repeat by [`DEAD_LETTER_MESSAGE_ID_HEADER`] (the same on
//! every copy).

use super::{KafkaError, idempotent_producer};
use crate::MessageId;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::fmt;
use std::time::Duration;

/// The suffix [`DeadLetterTopic::new`] appends to a record's topic: records of `payments`
/// go to `payments.dead-letter`.
pub const DEAD_LETTER_SUFFIX: &str = ".dead-letter";
/// The header holding why the record was dead-lettered (the handler's error with its
/// chain of sources, or the admission floor's refusal).
pub const DEAD_LETTER_ERROR_HEADER: &str = "dead-letter-error";
/// The header holding the record's original topic.
pub const DEAD_LETTER_TOPIC_HEADER: &str = "dead-letter-topic";
/// The header holding the record's original partition, in decimal.
pub const DEAD_LETTER_PARTITION_HEADER: &str = "dead-letter-partition";
/// The header holding the record's original offset, in decimal.
pub const DEAD_LETTER_OFFSET_HEADER: &str = "dead-letter-offset";
/// The header holding the inbox key of the record (a UUID): the same on every copy a
/// crash between produce and commit leaves in the dead-letter topic, so its consumer can
/// drop repeats.
pub const DEAD_LETTER_MESSAGE_ID_HEADER: &str = "dead-letter-message-id";

/// Where dead-lettered records go, and the idempotent producer (`acks=all`) that takes
/// them there.
///
/// ```no_run
/// # fn make(inbox: sea_orm_inbox::Inbox) -> Result<(), sea_orm_inbox::kafka::KafkaError> {
/// use rdkafka::ClientConfig;
/// use sea_orm_inbox::kafka::{DeadLetterTopic, KafkaInbox};
///
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092");
/// let kafka = KafkaInbox::new(inbox, "billing-group")?
///     // `payments` records that fail permanently go to `payments.dead-letter`.
///     .with_dead_letter(DeadLetterTopic::new(&config)?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DeadLetterTopic {
    producer: FutureProducer,
    topic: DeadLetterName,
    queue_timeout: Duration,
}

#[derive(Clone, Debug)]
enum DeadLetterName {
    Suffix(String),
    Fixed(String),
}

impl fmt::Debug for DeadLetterTopic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetterTopic")
            .field("topic", &self.topic)
            .field("queue_timeout", &self.queue_timeout)
            .finish_non_exhaustive()
    }
}

impl DeadLetterTopic {
    /// Dead letters to `<topic>`[`DEAD_LETTER_SUFFIX`], through a producer of `config` with
    /// `enable.idempotence=true` and `acks=all` (whatever `config` says of them). The
    /// topics must exist unless the broker creates topics on first use.
    ///
    /// # Errors
    /// [`KafkaError::Client`] when rdkafka refuses the configuration.
    pub fn new(config: &ClientConfig) -> Result<Self, KafkaError> {
        Ok(Self {
            producer: idempotent_producer(config)?,
            topic: DeadLetterName::Suffix(DEAD_LETTER_SUFFIX.to_owned()),
            queue_timeout: Duration::from_secs(10),
        })
    }

    /// Sends the dead letters of every topic to `topic`.
    pub fn to_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = DeadLetterName::Fixed(topic.into());
        self
    }

    /// Sends the dead letters of topic `t` to `t` + `suffix` instead of
    /// [`DEAD_LETTER_SUFFIX`].
    pub fn with_suffix(mut self, suffix: impl Into<String>) -> Self {
        self.topic = DeadLetterName::Suffix(suffix.into());
        self
    }

    /// The dead-letter topic of records from `topic`.
    pub fn topic_for(&self, topic: &str) -> String {
        match &self.topic {
            DeadLetterName::Suffix(suffix) => format!("{topic}{suffix}"),
            DeadLetterName::Fixed(fixed) => fixed.clone(),
        }
    }

    /// Produces `record` (its key, payload, timestamp and headers) to its dead-letter
    /// topic with the headers naming `error`, its original position and `message_id`, and
    /// waits for the delivery report.
    pub(super) async fn send(
        &self,
        record: &OwnedMessage,
        message_id: MessageId,
        error: &str,
    ) -> Result<(), KafkaError> {
        let topic = self.topic_for(record.topic());
        let (partition, offset) = (record.partition().to_string(), record.offset().to_string());
        let message_id = message_id.to_string();
        let ours = [
            (DEAD_LETTER_ERROR_HEADER, error),
            (DEAD_LETTER_TOPIC_HEADER, record.topic()),
            (DEAD_LETTER_PARTITION_HEADER, partition.as_str()),
            (DEAD_LETTER_OFFSET_HEADER, offset.as_str()),
            (DEAD_LETTER_MESSAGE_ID_HEADER, message_id.as_str()),
        ];
        let mut headers = OwnedHeaders::new();
        if let Some(original) = record.headers() {
            for header in original.iter() {
                if !ours.iter().any(|(name, _)| *name == header.key) {
                    headers = headers.insert(header);
                }
            }
        }
        for (key, value) in ours {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut dead = FutureRecord::<[u8], [u8]>::to(&topic).headers(headers);
        if let Some(payload) = record.payload() {
            dead = dead.payload(payload);
        }
        if let Some(key) = record.key() {
            dead = dead.key(key);
        }
        if let Some(millis) = record.timestamp().to_millis() {
            dead = dead.timestamp(millis);
        }
        self.producer
            .send(dead, self.queue_timeout)
            .await
            .map(drop)
            .map_err(|(source, _)| KafkaError::DeadLetter { topic, source })
    }
}
