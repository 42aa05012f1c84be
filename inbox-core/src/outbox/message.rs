use super::OutboxError;
use crate::MessageId;
use chrono::{DateTime, Utc};
use sea_orm::{DbErr, QueryResult};
use sea_orm_inbox_entity::{DESTINATION_MAX_CHARS, PARTITION_KEY_MAX_CHARS};
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

/// A message to publish, built by the caller and written with
/// [`OutboxExt::enqueue`](crate::OutboxExt::enqueue) in the caller's transaction.
///
/// ```
/// use sea_orm_inbox::{MessageId, OutgoingMessage};
/// use std::time::Duration;
///
/// let incoming = MessageId::from_broker_id("order-42")?;
/// let message = OutgoingMessage::new("orders.shipped", br#"{"order":42}"#.to_vec())
///     .message_id(incoming.outgoing("shipping", 0))
///     .key("order-42")
///     .header("content-type", "application/json")
///     .deliver_after(Duration::from_secs(5));
/// assert_eq!(message.destination(), "orders.shipped");
/// # Ok::<(), sea_orm_inbox::InboxError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutgoingMessage {
    message_id: MessageId,
    destination: String,
    key: Option<String>,
    payload: Vec<u8>,
    headers: BTreeMap<String, String>,
    delay: Duration,
}

impl OutgoingMessage {
    /// A message for `destination` (a topic, queue, subject or routing key, as the
    /// [`Publisher`](crate::Publisher) reads it) with a random message id: give it a
    /// derived one with [`message_id`](Self::message_id) when the enqueueing code may run
    /// again for the same logical message.
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            message_id: MessageId::from_uuid(Uuid::new_v4()),
            destination: destination.into(),
            key: None,
            payload: payload.into(),
            headers: BTreeMap::new(),
            delay: Duration::ZERO,
        }
    }

    /// Sets the message id: the broker message's id, and the outbox's unique key. An id
    /// already in the outbox makes the enqueue a no-op, so a handler that derives its ids
    /// (see [`MessageId::outgoing`]) can run any number of times and leave one row per
    /// message.
    pub fn message_id(mut self, message_id: impl Into<MessageId>) -> Self {
        self.message_id = message_id.into();
        self
    }

    /// Sets the ordering key: the relay publishes the messages of one key one at a time,
    /// in the order they were enqueued (Kafka's record key, a RabbitMQ header).
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header (a later one of the same name replaces it).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Publishes no earlier than `delay` after the enqueue (measured on the enqueuer's
    /// clock, as the relay compares it with its own).
    pub fn deliver_after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The message id.
    pub fn id(&self) -> MessageId {
        self.message_id
    }

    /// The destination.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Checks what the outbox columns can hold, before any SQL runs.
    pub(crate) fn validate(&self) -> Result<(), OutboxError> {
        let invalid = |field, problem: String| Err(OutboxError::InvalidMessage { field, problem });
        if self.message_id.is_nil() {
            return invalid("message id", "is the nil UUID".to_owned());
        }
        if self.destination.trim().is_empty() {
            return invalid("destination", "is empty".to_owned());
        }
        let checks = [
            (
                "destination",
                Some(&self.destination),
                DESTINATION_MAX_CHARS,
            ),
            ("key", self.key.as_ref(), PARTITION_KEY_MAX_CHARS),
        ];
        for (field, value, max) in checks {
            let Some(value) = value else { continue };
            let chars = value.chars().count();
            if chars > max {
                return invalid(field, format!("is {chars} characters long (at most {max})"));
            }
            if value.contains('\0') {
                return invalid(field, "holds a NUL character".to_owned());
            }
        }
        Ok(())
    }

    /// Splits the message into what the outbox row stores.
    pub(crate) fn into_parts(self) -> OutgoingParts {
        OutgoingParts {
            message_id: self.message_id,
            destination: self.destination,
            key: self.key,
            payload: self.payload,
            headers: encode_headers(&self.headers),
            delay: self.delay,
        }
    }
}

/// The stored form of an [`OutgoingMessage`].
pub(crate) struct OutgoingParts {
    pub(crate) message_id: MessageId,
    pub(crate) destination: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) delay: Duration,
}

/// The headers as the JSON object the `headers` column holds.
fn encode_headers(headers: &BTreeMap<String, String>) -> String {
    // A map of strings always serializes; the fallback is never taken.
    serde_json::to_string(headers).unwrap_or_else(|_| "{}".to_owned())
}

/// A message a relay claimed and hands to its [`Publisher`](crate::Publisher).
///
/// Every field a broker needs: Kafka takes `destination` as the topic, `key` as the record
/// key and `headers` as record headers; RabbitMQ and NATS take the `message_id` as the
/// broker's message id, which stays the same on every publish of this row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The broker message's id, the same on every publish of this row.
    pub message_id: MessageId,
    /// The topic, queue, subject or routing key.
    pub destination: String,
    /// The ordering key, if the message has one.
    pub key: Option<String>,
    /// The body.
    pub payload: Vec<u8>,
    /// The headers.
    pub headers: BTreeMap<String, String>,
    /// When the message was enqueued.
    pub created_at: DateTime<Utc>,
    /// When a relay first took this row to publish it: the send time to give the broker
    /// (RabbitMQ's `timestamp`, JetStream's `Outbox-Sent-At` header), which a consumer's
    /// [admission floor](crate::AdmissionFloor) compares. The same on every publish of
    /// this row, and never earlier than the row became due, so a message held back
    /// (`deliver_after`) or waiting out an outage is not refused as too old; a dead row
    /// requeued gets a new one.
    pub first_published_at: DateTime<Utc>,
    /// Which publish attempt this is, from 1.
    pub attempt: u32,
}

impl OutboxMessage {
    /// The message of a claimed row, read as leased (its `attempts` counting this
    /// attempt), by a claim at `claimed_at`. Headers the column holds in another form than
    /// a JSON object of strings (written by hand) are reported, not guessed.
    pub(crate) fn from_row(
        row: ClaimedRow,
        claimed_at: DateTime<Utc>,
    ) -> Result<(i64, Self), String> {
        let headers = serde_json::from_str(&row.headers)
            .map_err(|err| format!("the headers column is not a JSON object of strings: {err}"))?;
        Ok((
            row.id,
            Self {
                message_id: MessageId::from_uuid(row.message_id),
                destination: row.destination,
                key: row.partition_key,
                payload: row.payload,
                headers,
                created_at: row.created_at,
                // NULL where the claim read the row before its lease stamped it (SQLite):
                // the claim's own time, which the lease wrote.
                first_published_at: row.first_published_at.unwrap_or(claimed_at),
                attempt: u32::try_from(row.attempts).unwrap_or(0).max(1),
            },
        ))
    }
}

/// The columns of a claimed row that a publish needs: a claim returns these (or all of
/// the row's), and nothing it reads of the others (lease, times, last error) is decoded
/// for each row of every batch.
pub(crate) struct ClaimedRow {
    id: i64,
    message_id: Uuid,
    destination: String,
    partition_key: Option<String>,
    payload: Vec<u8>,
    headers: String,
    created_at: DateTime<Utc>,
    attempts: i32,
    /// NULL where the claim read the row before its lease stamped it (SQLite).
    first_published_at: Option<DateTime<Utc>>,
}

/// The columns [`ClaimedRow`] reads, by name, in its fields' order.
const CLAIMED_COLUMNS: [&str; 9] = [
    "id",
    "message_id",
    "destination",
    "partition_key",
    "payload",
    "headers",
    "created_at",
    "attempts",
    "first_published_at",
];

impl ClaimedRow {
    /// The row's `id`.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// The rows of one claim's result. The columns are found by name once, in the first
    /// row (every row of a result has the same), and read by position in each: a lookup
    /// by name costs the driver a search of the column names per value (about 1,500
    /// instructions a row on SQLite, measured with callgrind).
    pub(crate) fn decode_all(rows: &[QueryResult]) -> Result<Vec<Self>, DbErr> {
        let Some(first) = rows.first() else {
            return Ok(Vec::new());
        };
        let names = first.column_names();
        let mut at = [0_usize; CLAIMED_COLUMNS.len()];
        for (position, column) in at.iter_mut().zip(CLAIMED_COLUMNS) {
            *position = names
                .iter()
                .position(|name| name == column)
                .ok_or_else(|| {
                    DbErr::Type(format!("the relay's claim returned no `{column}` column"))
                })?;
        }
        rows.iter().map(|row| Self::decode(row, &at)).collect()
    }

    /// One row, its columns at the positions `at` (in [`CLAIMED_COLUMNS`]' order).
    fn decode(row: &QueryResult, at: &[usize; CLAIMED_COLUMNS.len()]) -> Result<Self, DbErr> {
        let [
            id,
            message_id,
            destination,
            partition_key,
            payload,
            headers,
            created_at,
            attempts,
            first_published_at,
        ] = *at;
        Ok(Self {
            id: row.try_get_by_index(id)?,
            message_id: row.try_get_by_index(message_id)?,
            destination: row.try_get_by_index(destination)?,
            partition_key: row.try_get_by_index(partition_key)?,
            payload: row.try_get_by_index(payload)?,
            headers: row.try_get_by_index(headers)?,
            created_at: row.try_get_by_index(created_at)?,
            attempts: row.try_get_by_index(attempts)?,
            first_published_at: row.try_get_by_index(first_published_at)?,
        })
    }
}

/// A row an operator looks at: a dead message, with why it died.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadMessage {
    /// The message id (what [`requeue_dead_message`](crate::requeue_dead_message) takes).
    pub message_id: MessageId,
    /// The destination.
    pub destination: String,
    /// The ordering key: the later messages of this key wait until this one is requeued
    /// and sent, or deleted.
    pub key: Option<String>,
    /// How many times a relay tried to publish it.
    pub attempts: u32,
    /// The error of the last attempt.
    pub last_error: Option<String>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When it was parked.
    pub dead_at: DateTime<Utc>,
}
