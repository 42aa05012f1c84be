use crate::InboxError;
use std::fmt;
use uuid::Uuid;

/// The deduplication key of a message: stable across every redelivery of it.
///
/// Use the broker's message id or a business id the producer sets once, never a
/// correlation id, a delivery counter or a receive timestamp (those change between
/// deliveries and let duplicates through).
///
/// ```
/// use sea_orm_inbox::MessageId;
/// use uuid::Uuid;
///
/// let raw = Uuid::parse_str("0b8f6a2e-5d3c-4f1a-9e7b-2c4d6e8f0a1b").unwrap();
/// let id = MessageId::from(raw);
/// assert_eq!(id.as_uuid(), raw);
/// assert_eq!(id.to_string(), "0b8f6a2e-5d3c-4f1a-9e7b-2c4d6e8f0a1b");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Uuid);

impl MessageId {
    /// Wraps a UUID as it is.
    pub const fn from_uuid(uuid: Uuid) -> Self {
        Self(uuid)
    }

    /// The UUID stored in the inbox.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// Whether this is the nil UUID, which the inbox refuses: it is what an unset id
    /// usually looks like, and every such message would deduplicate against every other.
    pub fn is_nil(&self) -> bool {
        self.0.is_nil()
    }
}

impl From<Uuid> for MessageId {
    fn from(uuid: Uuid) -> Self {
        Self(uuid)
    }
}

impl From<MessageId> for Uuid {
    fn from(id: MessageId) -> Self {
        id.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The fixed UUIDv5 namespace of every key this crate derives.
///
/// Part of the stable format: changing it would give every redelivery after an upgrade a
/// new key and let it through. Golden vectors in the tests pin it.
pub const MESSAGE_ID_NAMESPACE: Uuid = Uuid::from_u128(0x709d3c4c_2471_40b1_9e0d_6e29544bb19f);

/// Builds the unambiguous name hashed under [`MESSAGE_ID_NAMESPACE`]: a kind label, then
/// every field as a big-endian `u64` length followed by its bytes, so no two different
/// field lists (`("ab", "c")` and `("a", "bc")`) share an encoding.
struct KeyName(Vec<u8>);

impl KeyName {
    fn new(kind: &str) -> Self {
        let mut name = Self(Vec::with_capacity(64));
        name.field(kind.as_bytes());
        name
    }

    fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.0
            .extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        self.0.extend_from_slice(bytes);
        self
    }

    fn uuid(&self) -> Uuid {
        Uuid::new_v5(&MESSAGE_ID_NAMESPACE, &self.0)
    }
}

/// Trims the field and refuses it when nothing is left.
fn key_field<'a>(field: &'static str, value: &'a str) -> Result<&'a str, InboxError> {
    let trimmed = value.trim();
    if trimmed.is_empty() {
        return Err(InboxError::EmptyKeyField { field });
    }
    Ok(trimmed)
}

impl MessageId {
    /// The key of a message identified by the broker's own string message id (RabbitMQ
    /// `message_id`, SQS `MessageId`, Service Bus `MessageId`, a NATS `Nats-Msg-Id`).
    ///
    /// Deterministic across processes and versions: UUIDv5 under
    /// [`MESSAGE_ID_NAMESPACE`] of the id with surrounding white space trimmed; the rest
    /// is taken byte for byte (case matters).
    ///
    /// # Errors
    /// [`InboxError::EmptyKeyField`] when the id is empty or only white space;
    /// [`InboxError::NilMessageId`] when it is the nil UUID written out
    /// (`00000000-0000-0000-0000-000000000000`), what a producer that never set its id
    /// sends: every such message would deduplicate against every other.
    ///
    /// ```
    /// use sea_orm_inbox::{InboxError, MessageId};
    ///
    /// assert!(matches!(
    ///     MessageId::from_broker_id("00000000-0000-0000-0000-000000000000"),
    ///     Err(InboxError::NilMessageId)
    /// ));
    /// let a = MessageId::from_broker_id("order-42")?;
    /// assert_eq!(a, MessageId::from_broker_id("  order-42\n")?);
    /// assert_ne!(a, MessageId::from_broker_id("order-43")?);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn from_broker_id(broker_message_id: &str) -> Result<Self, InboxError> {
        let id = key_field("broker message id", broker_message_id)?;
        if Uuid::try_parse(id).is_ok_and(|uuid| uuid.is_nil()) {
            return Err(InboxError::NilMessageId);
        }
        Ok(Self(KeyName::new("broker").field(id.as_bytes()).uuid()))
    }

    /// The key of a CloudEvent: its `source` and `id` attributes, which the CloudEvents
    /// spec makes unique together (the same `id` from two sources is two events).
    ///
    /// Both are trimmed; each is encoded with its length, so `("ab", "c")` and
    /// `("a", "bc")` give different keys.
    ///
    /// # Errors
    /// [`InboxError::EmptyKeyField`] when either attribute is empty or only white space.
    ///
    /// ```
    /// use sea_orm_inbox::MessageId;
    ///
    /// let a = MessageId::from_cloud_event("/orders", "e-1")?;
    /// assert_ne!(a, MessageId::from_cloud_event("/payments", "e-1")?);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn from_cloud_event(source: &str, id: &str) -> Result<Self, InboxError> {
        let source = key_field("CloudEvents source", source)?;
        let id = key_field("CloudEvents id", id)?;
        Ok(Self(
            KeyName::new("cloudevents")
                .field(source.as_bytes())
                .field(id.as_bytes())
                .uuid(),
        ))
    }

    /// The key of a Kafka record: its `(topic, partition, offset)`, which a redelivery
    /// (a consumer restarting from a committed offset) repeats exactly.
    ///
    /// A producer that retries writes a *new* record at a new offset; when producer
    /// retries matter, use a producer-set header with [`MessageId::from_broker_id`].
    ///
    /// **A topic deleted and recreated under the same name restarts its offsets at 0**, so
    /// its new records get the keys of the old topic's records and are taken for
    /// duplicates (acked, never processed) until the old markers are purged. Put the
    /// topic's identity into the key: Kafka 2.8+ gives every topic a topic ID (a UUID,
    /// from the admin client's describe-topics, which a recreated topic does not share), so
    /// pass `"{topic}/{topic_id}"` as `topic`; or key records by a producer-set header
    /// through [`MessageId::from_broker_id`]. When neither is possible, delete the
    /// consumer's markers when the topic is recreated, before consuming it again.
    ///
    /// ```
    /// use sea_orm_inbox::MessageId;
    ///
    /// // The topic ID read once at startup from the admin client (describe topics).
    /// let topic_id = "R8FsZD2gT2e7sBvDpWQ3cQ";
    /// let before = MessageId::from_kafka(&format!("payments/{topic_id}"), 0, 0)?;
    /// let recreated = MessageId::from_kafka("payments/Vd0yXqk1TnOlwzD3U5n6Ag", 0, 0)?;
    /// assert_ne!(before, recreated);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`InboxError::EmptyKeyField`] for an empty topic,
    /// [`InboxError::NegativeKafkaPosition`] for a negative partition or offset.
    ///
    /// ```
    /// use sea_orm_inbox::MessageId;
    ///
    /// let a = MessageId::from_kafka("payments", 3, 1_000)?;
    /// assert_eq!(a, MessageId::from_kafka("payments", 3, 1_000)?);
    /// assert_ne!(a, MessageId::from_kafka("payments", 3, 1_001)?);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn from_kafka(topic: &str, partition: i32, offset: i64) -> Result<Self, InboxError> {
        let topic = key_field("Kafka topic", topic)?;
        if partition < 0 || offset < 0 {
            return Err(InboxError::NegativeKafkaPosition { partition, offset });
        }
        Ok(Self(
            KeyName::new("kafka")
                .field(topic.as_bytes())
                .field(&partition.to_be_bytes())
                .field(&offset.to_be_bytes())
                .uuid(),
        ))
    }

    /// The idempotency key to hand a downstream provider (payment API, mail service) for
    /// this message and consumer.
    ///
    /// The same on every attempt, on every replica and after every takeover, so a provider
    /// that saw a half-done attempt deduplicates the retry. Distinct per consumer, and
    /// distinct from the message id itself.
    ///
    /// ```
    /// use sea_orm_inbox::MessageId;
    ///
    /// let id = MessageId::from_broker_id("order-42")?;
    /// assert_eq!(id.idempotency_key("mailer"), id.idempotency_key("mailer"));
    /// assert_ne!(id.idempotency_key("mailer"), id.idempotency_key("billing"));
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn idempotency_key(&self, consumer: &str) -> Uuid {
        KeyName::new("idempotency-key")
            .field(self.0.as_bytes())
            .field(consumer.as_bytes())
            .uuid()
    }

    /// The id of the `sequence`-th message that `consumer`'s handling of this message
    /// sends through the outbox ([`OutgoingMessage::message_id`](crate::OutgoingMessage::message_id)).
    ///
    /// The same for every attempt and every replica that handles this message, so a
    /// handler that runs again (a retry, a redelivery processed by code that skips the
    /// inbox) enqueues the same ids, and the outbox keeps one row per id. Distinct per
    /// consumer and per sequence number, and from [`idempotency_key`](Self::idempotency_key).
    ///
    /// ```
    /// use sea_orm_inbox::MessageId;
    ///
    /// let incoming = MessageId::from_broker_id("order-42")?;
    /// assert_eq!(incoming.outgoing("billing", 0), incoming.outgoing("billing", 0));
    /// assert_ne!(incoming.outgoing("billing", 0), incoming.outgoing("billing", 1));
    /// assert_ne!(incoming.outgoing("billing", 0), incoming.outgoing("mailer", 0));
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn outgoing(&self, consumer: &str, sequence: u32) -> MessageId {
        Self(
            KeyName::new("outbox")
                .field(self.0.as_bytes())
                .field(consumer.as_bytes())
                .field(&sequence.to_be_bytes())
                .uuid(),
        )
    }
}
