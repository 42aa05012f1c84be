//! Amazon SQS through the official [`aws_sdk_sqs`] client (feature `aws-sdk-sqs`): a
//! received message to a [`Delivery`], a [`Settlement`] to `DeleteMessage`,
//! `ChangeMessageVisibility` or a move to the dead-letter queue, a visibility heartbeat
//! while a handler runs, the outbox's [`SqsPublisher`] (standard and FIFO queues) and a
//! ready consumer loop, [`SqsConsumer`].
//!
//! The feature brings the client without an HTTP client or TLS stack: build the
//! `aws_sdk_sqs::Client` as the rest of the application does (`aws-config`, or a
//! [`Config`](aws_sdk_sqs::Config) with the HTTP client of your choice). The guide's SQS
//! chapter ([`crate::guide`]) says what each SQS behaviour means for the inbox.
//!
//! By hand, over `ReceiveMessage`:
//!
//! ```no_run
//! use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
//! use sea_orm_inbox::{Inbox, ProcessError, Settlement, sqs};
//!
//! # async fn consume(client: aws_sdk_sqs::Client, db: DatabaseConnection, inbox: Inbox) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let queue = sqs::SqsQueue::new(client.clone(), "http://127.0.0.1:4566/000000000000/payments");
//! let mut receive = client
//!     .receive_message()
//!     .queue_url(queue.url())
//!     .wait_time_seconds(20)
//!     .message_attribute_names("All");
//! for name in sqs::SYSTEM_ATTRIBUTES {
//!     receive = receive.message_system_attribute_names(name);
//! }
//! for message in receive.send().await?.messages() {
//!     let result = match queue.delivery(message) {
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
//!         Err(err) => Err(ProcessError::Inbox(err)),
//!     };
//!     let settlement = Settlement::for_delivery(&result, sqs::delivery_count(message));
//!     queue.settle(message, settlement).await?;
//! }
//! # Ok(()) }
//! ```

use super::consume::{self, Connect, Incoming, Session};
use crate::{
    BoxError, ConsumerError, ConsumerOptions, ConsumerSummary, Delivery, HandlerFuture, Inbox,
    InboxError, MessageId, ObservedTransaction, OutboxMessage, PublishError, Publisher, Received,
    Settlement,
};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, Message, MessageAttributeValue, MessageSystemAttributeName,
    QueueAttributeName, SendMessageBatchRequestEntry,
};
use chrono::{DateTime, SecondsFormat, Utc};
use sea_orm::DatabaseConnection;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The message attribute a producer sets to name its message, read when no other is
/// configured ([`SqsQueue::with_id_attribute`]); [`SqsPublisher`] sets it.
pub const DEFAULT_ID_ATTRIBUTE: &str = "message-id";

/// The message attribute carrying an outbox message's send time, its
/// [first publish time](OutboxMessage::first_published_at) in RFC 3339 with microseconds,
/// which [`delivery`] prefers to SQS's `SentTimestamp`: a republished row gets a new
/// `SentTimestamp`, and the admission floor must see every copy as sent when the first was.
pub const SENT_AT_ATTRIBUTE: &str = "Outbox-Sent-At";

/// The message attribute carrying an outbox message's ordering key (on a FIFO queue it is
/// also the `MessageGroupId`).
pub const KEY_ATTRIBUTE: &str = "Outbox-Key";

/// The longest a message can stay invisible: SQS refuses a visibility timeout above
/// 12 hours from the receive.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// The most entries one `SendMessageBatch` (and one `ReceiveMessage`) takes.
pub const MAX_BATCH: usize = 10;

/// The most message attributes SQS takes on one message.
pub const MAX_ATTRIBUTES: usize = 10;

/// The system attributes [`delivery`] and [`delivery_count`] read: ask for them on
/// `ReceiveMessage` (`message_system_attribute_names`), together with the message
/// attributes (`message_attribute_names("All")`).
pub const SYSTEM_ATTRIBUTES: [MessageSystemAttributeName; 3] = [
    MessageSystemAttributeName::ApproximateReceiveCount,
    MessageSystemAttributeName::SentTimestamp,
    MessageSystemAttributeName::MessageGroupId,
];

/// Why SQS could not be told a settlement.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettleError {
    /// The receipt handle is no longer valid: the visibility timeout ran out and the
    /// message was delivered again (to this consumer or another), or it was deleted
    /// meanwhile. Not a failure of the handler: the later delivery settles the message
    /// (the inbox makes it a duplicate if this one committed). Raise the visibility
    /// timeout, or keep the heartbeat on, if it happens often.
    #[error(
        "the receipt handle of SQS message {message_id} expired ({source}): it was delivered again meanwhile, and that delivery settles it; raise the visibility timeout or keep the heartbeat on if this is frequent"
    )]
    ReceiptExpired {
        /// SQS's `MessageId`.
        message_id: String,
        /// What SQS answered.
        #[source]
        source: BoxError,
    },
    /// The message carries no receipt handle: it did not come from `ReceiveMessage`.
    #[error(
        "SQS message {message_id} has no receipt handle: settle only messages from ReceiveMessage"
    )]
    NoReceiptHandle {
        /// SQS's `MessageId`.
        message_id: String,
    },
    /// SQS could not be reached or refused the call.
    #[error("SQS could not {action} message {message_id}: {source}")]
    Client {
        /// The call: delete, change the visibility of, move to the dead-letter queue.
        action: &'static str,
        /// SQS's `MessageId`.
        message_id: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

/// SQS's `MessageId` of `message` ("" when absent).
fn sqs_id(message: &Message) -> &str {
    message.message_id().unwrap_or_default()
}

fn system_attribute<'m>(
    message: &'m Message,
    name: &MessageSystemAttributeName,
) -> Option<&'m str> {
    message
        .attributes()
        .and_then(|attributes| attributes.get(name))
        .map(String::as_str)
}

fn string_attribute<'m>(message: &'m Message, name: &str) -> Option<&'m str> {
    message
        .message_attributes()
        .and_then(|attributes| attributes.get(name))
        .and_then(MessageAttributeValue::string_value)
}

/// The producer's id of `message`: the message attribute `id_attribute` when present (as
/// [`SqsPublisher`] sets it), else SQS's own `MessageId`.
///
/// SQS gives every `SendMessage` a new `MessageId`, a producer's own retry included: only
/// the attribute, or a FIFO queue's deduplication id, makes the retry the same message.
pub fn broker_id<'m>(message: &'m Message, id_attribute: &str) -> &'m str {
    string_attribute(message, id_attribute).unwrap_or_else(|| sqs_id(message))
}

/// The [`Delivery`] of `message`: its key from [`broker_id`]
/// ([`MessageId::from_broker_id`]), its send time from the [`SENT_AT_ATTRIBUTE`] when the
/// producer set one, else from SQS's `SentTimestamp` (when the receive asked for it, see
/// [`SYSTEM_ATTRIBUTES`]).
///
/// # Errors
/// [`InboxError::EmptyKeyField`] when the message has no id, [`InboxError::NilMessageId`]
/// for the nil UUID, [`InboxError::OutOfRange`] for a [`SENT_AT_ATTRIBUTE`] that is not an
/// RFC 3339 time. All of them are [permanent](InboxError::is_permanent).
pub fn delivery(message: &Message, id_attribute: &str) -> Result<Delivery, InboxError> {
    let delivery = Delivery::new(MessageId::from_broker_id(broker_id(message, id_attribute))?);
    if let Some(sent) = string_attribute(message, SENT_AT_ATTRIBUTE) {
        let sent_at = DateTime::parse_from_rfc3339(sent).map_err(|_| InboxError::OutOfRange {
            what: "the Outbox-Sent-At message attribute",
            value: sent.to_owned(),
            accepted: "an RFC 3339 time, e.g. 2026-12-04T12:00:00.000000Z".to_owned(),
            advice: "set it to the time the message was first sent, or leave it out",
        })?;
        return Ok(delivery.sent_at(sent_at.with_timezone(&Utc)));
    }
    let sent_at = system_attribute(message, &MessageSystemAttributeName::SentTimestamp)
        .and_then(|millis| millis.parse::<i64>().ok())
        .and_then(DateTime::from_timestamp_millis);
    Ok(match sent_at {
        Some(sent_at) => delivery.sent_at(sent_at),
        None => delivery,
    })
}

/// How often SQS has delivered `message`, this delivery included: its
/// `ApproximateReceiveCount` (1 when the receive did not ask for it). Approximate as SQS
/// says: a receive whose response was lost still counts.
pub fn delivery_count(message: &Message) -> u32 {
    system_attribute(
        message,
        &MessageSystemAttributeName::ApproximateReceiveCount,
    )
    .and_then(|count| count.parse::<u32>().ok())
    .unwrap_or(1)
    .max(1)
}

/// Whether an SQS error says the receipt handle is no longer valid (SQS's codes
/// `ReceiptHandleIsInvalid` and `MessageNotInflight`, or an `InvalidParameterValue` about
/// an expired receipt handle).
fn receipt_expired(error: &impl ProvideErrorMetadata) -> bool {
    match error.code() {
        Some("ReceiptHandleIsInvalid" | "MessageNotInflight") => true,
        Some("InvalidParameterValue") => error
            .message()
            .is_some_and(|text| text.contains("receipt handle has expired")),
        _ => false,
    }
}

/// Whole seconds for SQS, rounded up (a 500 ms nack waits 1 s), at most `cap`.
fn whole_seconds(delay: Duration, cap: Duration) -> i32 {
    let capped = delay.min(cap);
    let seconds = capped.as_secs() + u64::from(capped.subsec_nanos() > 0);
    i32::try_from(seconds.min(cap.as_secs())).unwrap_or(i32::MAX)
}

/// One queue as a consumer settles its messages: the client, the queue's URL, the id
/// attribute, and where dead letters go.
///
/// | settlement | SQS |
/// | --- | --- |
/// | `Ack` | `DeleteMessage` |
/// | `Nack(delay)` | `ChangeMessageVisibility` to the delay in whole seconds (rounded up, at most 12 h from the receive; `None`: 0, visible at once) |
/// | `DeadLetter` | with a dead-letter queue ([`with_dead_letter_queue`](Self::with_dead_letter_queue), or the queue's redrive policy target [`SqsConsumer`] looks up): `SendMessage` of a copy to it (body, attributes, and the id attribute set to the message's [`broker_id`], so a replay keeps its inbox key), then `DeleteMessage`; with none: `ChangeMessageVisibility` to 12 h, logged at ERROR, and the message returns twice a day until the queue's retention period drops it |
///
/// A nack leaves a failing message to the queue's redrive policy: SQS moves it to the
/// dead-letter queue on the receive after `maxReceiveCount`.
#[derive(Clone, Debug)]
pub struct SqsQueue {
    client: Client,
    url: String,
    id_attribute: String,
    dead_letter_url: Option<String>,
}

impl SqsQueue {
    /// The queue at `url` through `client`, reading the id from [`DEFAULT_ID_ATTRIBUTE`],
    /// without a dead-letter queue.
    pub fn new(client: Client, url: impl Into<String>) -> Self {
        Self {
            client,
            url: url.into(),
            id_attribute: DEFAULT_ID_ATTRIBUTE.to_owned(),
            dead_letter_url: None,
        }
    }

    /// Reads the message id from the message attribute `name` (a string attribute).
    pub fn with_id_attribute(mut self, name: impl Into<String>) -> Self {
        self.id_attribute = name.into();
        self
    }

    /// Moves dead letters to the queue at `url` (a FIFO queue's must be FIFO too).
    pub fn with_dead_letter_queue(mut self, url: impl Into<String>) -> Self {
        self.dead_letter_url = Some(url.into());
        self
    }

    /// The queue's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The dead-letter queue's URL, if there is one.
    pub fn dead_letter_queue(&self) -> Option<&str> {
        self.dead_letter_url.as_deref()
    }

    /// The message attribute the id is read from.
    pub fn id_attribute(&self) -> &str {
        &self.id_attribute
    }

    /// [`delivery`] with this queue's id attribute.
    ///
    /// # Errors
    /// As [`delivery`].
    pub fn delivery(&self, message: &Message) -> Result<Delivery, InboxError> {
        delivery(message, &self.id_attribute)
    }

    /// Sets the dead-letter queue to the target of the queue's redrive policy, unless one
    /// is set already; returns the policy's `maxReceiveCount` when the queue has one.
    ///
    /// # Errors
    /// SQS's error when the queue's attributes, or the target's URL, cannot be read (a
    /// wrong URL, a missing queue, credentials).
    pub async fn use_redrive_policy(&mut self) -> Result<Option<u32>, BoxError> {
        let attributes = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(|err| BoxError::from(DisplayErrorContext(err).to_string()))?;
        let Some(policy) = attributes
            .attributes()
            .and_then(|attributes| attributes.get(&QueueAttributeName::RedrivePolicy))
        else {
            return Ok(None);
        };
        let policy: serde_json::Value = serde_json::from_str(policy)
            .map_err(|err| format!("the queue's RedrivePolicy is not JSON: {err}"))?;
        let max_receive_count = match &policy["maxReceiveCount"] {
            serde_json::Value::Number(count) => count.as_u64(),
            serde_json::Value::String(count) => count.parse().ok(),
            _ => None,
        }
        .and_then(|count| u32::try_from(count).ok());
        if self.dead_letter_url.is_none()
            && let Some(arn) = policy["deadLetterTargetArn"].as_str()
        {
            // arn:aws:sqs:<region>:<account>:<name>
            let mut parts = arn.rsplitn(3, ':');
            let (Some(name), Some(account)) = (parts.next(), parts.next()) else {
                return Err(
                    format!("the redrive policy's target {arn:?} is not a queue ARN").into(),
                );
            };
            let found = self
                .client
                .get_queue_url()
                .queue_name(name)
                .queue_owner_aws_account_id(account)
                .send()
                .await
                .map_err(|err| BoxError::from(DisplayErrorContext(err).to_string()))?;
            self.dead_letter_url = found.queue_url().map(str::to_owned);
        }
        Ok(max_receive_count)
    }

    /// Tells SQS what became of `message` (see the table on [`SqsQueue`]).
    ///
    /// # Errors
    /// [`SettleError::ReceiptExpired`] when the message was delivered again meanwhile,
    /// [`SettleError::Client`] when SQS cannot be reached or refuses,
    /// [`SettleError::NoReceiptHandle`] for a message not from `ReceiveMessage`.
    pub async fn settle(
        &self,
        message: &Message,
        settlement: Settlement,
    ) -> Result<(), SettleError> {
        self.settle_received(message, settlement, Instant::now())
            .await
    }

    /// [`settle`](Self::settle) of a message received at `received_at` (the nack delay is
    /// capped at 12 h from it).
    async fn settle_received(
        &self,
        message: &Message,
        settlement: Settlement,
        received_at: Instant,
    ) -> Result<(), SettleError> {
        match settlement {
            Settlement::Ack => self.delete(message).await,
            Settlement::Nack(delay) => {
                let left = MAX_VISIBILITY.saturating_sub(received_at.elapsed());
                self.change_visibility(message, delay.unwrap_or_default(), left)
                    .await
            }
            Settlement::DeadLetter => match &self.dead_letter_url {
                Some(dead_letter_url) => {
                    self.send_to_dead_letter_queue(message, dead_letter_url)
                        .await?;
                    self.delete(message).await
                }
                None => {
                    tracing::error!(
                        sqs_message_id = sqs_id(message),
                        queue = self.url,
                        "a dead letter, but the queue has no dead-letter queue (no redrive policy, none configured): hidden for 12 h, it returns until the queue's retention period drops it; give the queue a redrive policy"
                    );
                    let left = MAX_VISIBILITY.saturating_sub(received_at.elapsed());
                    self.change_visibility(message, MAX_VISIBILITY, left).await
                }
            },
        }
    }

    fn receipt<'m>(&self, message: &'m Message) -> Result<&'m str, SettleError> {
        message
            .receipt_handle()
            .ok_or_else(|| SettleError::NoReceiptHandle {
                message_id: sqs_id(message).to_owned(),
            })
    }

    fn client_error<E>(action: &'static str, message: &Message, err: E) -> SettleError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let message_id = sqs_id(message).to_owned();
        let expired = receipt_expired(&err);
        let source = BoxError::from(DisplayErrorContext(err).to_string());
        if expired {
            SettleError::ReceiptExpired { message_id, source }
        } else {
            SettleError::Client {
                action,
                message_id,
                source,
            }
        }
    }

    async fn delete(&self, message: &Message) -> Result<(), SettleError> {
        self.client
            .delete_message()
            .queue_url(&self.url)
            .receipt_handle(self.receipt(message)?)
            .send()
            .await
            .map_err(|err| Self::client_error("delete", message, err))?;
        Ok(())
    }

    /// Makes `message` visible again after `delay` (whole seconds, rounded up, at most
    /// `cap`).
    async fn change_visibility(
        &self,
        message: &Message,
        delay: Duration,
        cap: Duration,
    ) -> Result<(), SettleError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(self.receipt(message)?)
            .visibility_timeout(whole_seconds(delay, cap))
            .send()
            .await
            .map_err(|err| Self::client_error("change the visibility of", message, err))?;
        Ok(())
    }

    async fn send_to_dead_letter_queue(
        &self,
        message: &Message,
        dead_letter_url: &str,
    ) -> Result<(), SettleError> {
        let mut send = self
            .client
            .send_message()
            .queue_url(dead_letter_url)
            .message_body(message.body().unwrap_or_default())
            .set_message_attributes(message.message_attributes().cloned());
        if string_attribute(message, &self.id_attribute).is_none() {
            send = send.message_attributes(
                &self.id_attribute,
                string_value(broker_id(message, &self.id_attribute)).map_err(|err| {
                    SettleError::Client {
                        action: "move to the dead-letter queue",
                        message_id: sqs_id(message).to_owned(),
                        source: err.into(),
                    }
                })?,
            );
        }
        if is_fifo(dead_letter_url) {
            let group = system_attribute(message, &MessageSystemAttributeName::MessageGroupId)
                .unwrap_or("dead-letters");
            send = send
                .message_group_id(group)
                .message_deduplication_id(sqs_id(message));
        }
        send.send()
            .await
            .map_err(|err| Self::client_error("move to the dead-letter queue", message, err))?;
        Ok(())
    }
}

fn is_fifo(queue_url: &str) -> bool {
    queue_url.ends_with(".fifo")
}

fn string_value(value: &str) -> Result<MessageAttributeValue, aws_sdk_sqs::error::BuildError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
}

// --- The outbox publisher --------------------------------------------------------------------

/// Publishes outbox messages to SQS queues: a [`Publisher`] for a
/// [`Relay`](crate::Relay), and [`publish_batch`](Self::publish_batch) for up to
/// [`MAX_BATCH`] messages in one `SendMessageBatch`.
///
/// The destination is the queue's URL. The message id goes out as the
/// [`DEFAULT_ID_ATTRIBUTE`] message attribute, the send time as [`SENT_AT_ATTRIBUTE`], the
/// ordering key as [`KEY_ATTRIBUTE`], the headers as string attributes (SQS takes at most
/// [`MAX_ATTRIBUTES`] in all: a message with more is rejected, as is a body that is not
/// UTF-8). To a FIFO queue (a URL ending in `.fifo`) the key is also the
/// `MessageGroupId` (a message without a key is a group of its own) and the message id the
/// `MessageDeduplicationId`, so SQS itself drops a republish within its 5-minute window;
/// the consumer's inbox drops one after it.
///
/// ```no_run
/// use sea_orm_inbox::{Relay, sqs::SqsPublisher};
///
/// # async fn run(client: aws_sdk_sqs::Client, db: sea_orm::DatabaseConnection) {
/// let relay = Relay::new(SqsPublisher::new(client));
/// relay.run(&db, std::future::pending()).await;
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct SqsPublisher {
    client: Client,
}

impl SqsPublisher {
    /// A publisher through `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// Sends `messages` (all to one queue, at most [`MAX_BATCH`]) in one
    /// `SendMessageBatch` and returns each one's result, in order: an entry SQS refused
    /// fails alone, [`PublishError::Rejected`] when SQS says the sender is at fault (a
    /// message that can never be sent as it is), else [`PublishError::Transient`]; a call
    /// that fails as a whole fails every entry transiently.
    pub async fn publish_batch(
        &self,
        messages: &[&OutboxMessage],
    ) -> Vec<Result<(), PublishError>> {
        let mut results: Vec<Result<(), PublishError>> = Vec::with_capacity(messages.len());
        let mut entries = Vec::with_capacity(messages.len());
        let mut sent = Vec::with_capacity(messages.len());
        let mut destination = None;
        for (index, message) in messages.iter().enumerate() {
            let entry = match destination {
                Some(url) if url != message.destination.as_str() => Err(PublishError::Transient(
                    "a batch for SQS holds messages of one queue: publish the others apart".into(),
                )),
                _ if entries.len() >= MAX_BATCH => Err(PublishError::Transient(
                    format!("a batch for SQS holds at most {MAX_BATCH} messages").into(),
                )),
                _ => entry(message, index),
            };
            match entry {
                Ok(entry) => {
                    destination = Some(message.destination.as_str());
                    entries.push(entry);
                    sent.push(index);
                    results.push(Ok(()));
                }
                Err(err) => results.push(Err(err)),
            }
        }
        let Some(queue_url) = destination else {
            return results;
        };
        let answer = self
            .client
            .send_message_batch()
            .queue_url(queue_url)
            .set_entries(Some(entries))
            .send()
            .await;
        match answer {
            Err(err) => {
                let text = DisplayErrorContext(err).to_string();
                for index in sent {
                    results[index] = Err(PublishError::Transient(text.clone().into()));
                }
            }
            Ok(answer) => settle_entries(&mut results, answer.failed()),
        }
        results
    }
}

/// Fails each entry SQS refused alone, by its id (its index in `results`):
/// [`PublishError::Rejected`] when SQS says the sender is at fault, else transiently.
fn settle_entries(results: &mut [Result<(), PublishError>], failed: &[BatchResultErrorEntry]) {
    for failed in failed {
        let Some(result) = failed
            .id()
            .parse::<usize>()
            .ok()
            .and_then(|index| results.get_mut(index))
        else {
            continue;
        };
        let error: BoxError = format!(
            "SQS refused the entry ({}): {}",
            failed.code(),
            failed.message().unwrap_or_default()
        )
        .into();
        *result = Err(if failed.sender_fault() {
            PublishError::Rejected(error)
        } else {
            PublishError::Transient(error)
        });
    }
}

/// The `SendMessageBatch` entry of `message`, with id `index`.
fn entry(
    message: &OutboxMessage,
    index: usize,
) -> Result<SendMessageBatchRequestEntry, PublishError> {
    let rejected = |what: String| PublishError::Rejected(what.into());
    let body = std::str::from_utf8(&message.payload).map_err(|_| {
        rejected(
            "an SQS message body is text: the payload is not UTF-8 (encode it, e.g. base64)"
                .to_owned(),
        )
    })?;
    let id = message.message_id.to_string();
    let sent_at = message
        .first_published_at
        .to_rfc3339_opts(SecondsFormat::Micros, true);
    let mut attributes: Vec<(&str, &str)> = vec![
        (DEFAULT_ID_ATTRIBUTE, id.as_str()),
        (SENT_AT_ATTRIBUTE, sent_at.as_str()),
    ];
    if let Some(key) = &message.key {
        attributes.push((KEY_ATTRIBUTE, key.as_str()));
    }
    attributes.extend(
        message
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str())),
    );
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(rejected(format!(
            "SQS takes at most {MAX_ATTRIBUTES} message attributes; this message needs {} (its headers, the id, the send time and the key): send fewer headers",
            attributes.len()
        )));
    }
    let mut entry = SendMessageBatchRequestEntry::builder()
        .id(index.to_string())
        .message_body(body);
    for (name, value) in attributes {
        let value = string_value(value).map_err(|err| rejected(err.to_string()))?;
        entry = entry.message_attributes(name, value);
    }
    if is_fifo(&message.destination) {
        entry = entry
            .message_group_id(message.key.as_deref().unwrap_or(id.as_str()))
            .message_deduplication_id(id.as_str());
    }
    entry.build().map_err(|err| rejected(err.to_string()))
}

impl Publisher for SqsPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.publish_batch(&[message])
            .await
            .pop()
            .unwrap_or_else(|| Err(PublishError::Transient("SQS gave no result".into())))
    }
}

// --- The consumer loop ----------------------------------------------------------------------

/// A running SQS consumer: the broker-neutral loop of [`ConsumerOptions`] (a task per
/// delivery behind a semaphore, [`delivery`], `Inbox::process`, [`SqsQueue::settle`]; a
/// message without a usable id is dead-lettered without running the handler) over long
/// polling `ReceiveMessage` calls.
///
/// - Each receive asks for no more messages than there are free task slots (at most the
///   [prefetch](ConsumerOptions::with_prefetch) and [`MAX_BATCH`]), so no message waits
///   unseen in memory while its visibility timeout runs.
/// - Receives use this consumer's [visibility timeout](Self::with_visibility_timeout)
///   (default 30 s). While a handler runs, a heartbeat extends the message's visibility by
///   the timeout again every [heartbeat interval](Self::with_heartbeat) (default a third of
///   the timeout), so a long handler does not see its message delivered to another replica
///   meanwhile. When that happens anyway (a stalled replica, the heartbeat off), the inbox
///   decides: the second delivery waits for the first's claim and becomes a duplicate.
/// - Dead letters go to the configured dead-letter queue, else to the target of the
///   queue's redrive policy, else are hidden for 12 h (see [`SqsQueue`]).
/// - A settlement whose receipt handle expired counts in
///   [`ConsumerSummary::stale_settlements`], not as a failure.
///
/// ```no_run
/// use sea_orm::{ConnectionTrait, DbErr};
/// use sea_orm_inbox::{Inbox, sqs::SqsConsumer};
///
/// # async fn run(client: aws_sdk_sqs::Client, db: sea_orm::DatabaseConnection, ctrl_c: std::future::Pending<()>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let summary = SqsConsumer::new(client, "https://sqs.eu-west-1.amazonaws.com/123456789012/payments")
///     .run(Inbox::new("billing.credit")?, db, |txn, message| {
///         let amount = message.payload.len() as i64; // parse the payload here
///         Box::pin(async move {
///             txn.execute_unprepared(&format!("UPDATE account SET balance = balance + {amount}")).await?;
///             Ok::<_, DbErr>(())
///         })
///     }, ctrl_c) // tokio::signal::ctrl_c() in a service
///     .await?;
/// println!("{summary}");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct SqsConsumer {
    queue: SqsQueue,
    options: ConsumerOptions,
    visibility_timeout: Duration,
    wait_time: Duration,
    heartbeat: Option<Duration>,
}

impl SqsConsumer {
    /// The longest long poll SQS allows.
    pub const MAX_WAIT_TIME: Duration = Duration::from_secs(20);

    /// A consumer of the queue at `url` through `client`, with the default
    /// [`ConsumerOptions`], a 30 s visibility timeout, the heartbeat every 10 s, and
    /// 20 s long polls.
    pub fn new(client: Client, url: impl Into<String>) -> Self {
        Self::of(SqsQueue::new(client, url))
    }

    /// A consumer of `queue` (its id attribute and dead-letter queue).
    pub fn of(queue: SqsQueue) -> Self {
        let visibility_timeout = Duration::from_secs(30);
        Self {
            queue,
            options: ConsumerOptions::default(),
            visibility_timeout,
            wait_time: Self::MAX_WAIT_TIME,
            heartbeat: Some(visibility_timeout / 3),
        }
    }

    /// Replaces the loop's settings; the prefetch caps one receive (with [`MAX_BATCH`]).
    pub fn with_options(mut self, options: ConsumerOptions) -> Self {
        self.options = options;
        self
    }

    /// The visibility timeout of each receive, in whole seconds; the heartbeat, if on,
    /// becomes a third of it.
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] below 1 s or above 12 h.
    pub fn with_visibility_timeout(mut self, timeout: Duration) -> Result<Self, InboxError> {
        if timeout < Duration::from_secs(1) || timeout > MAX_VISIBILITY {
            return Err(InboxError::out_of_range(
                "the SQS visibility timeout",
                timeout,
                Duration::from_secs(1)..=MAX_VISIBILITY,
                "choose one longer than most handlers run (the heartbeat covers the rest)",
            ));
        }
        self.visibility_timeout = timeout;
        self.heartbeat = self.heartbeat.map(|_| timeout / 3);
        Ok(self)
    }

    /// Extends a running handler's message visibility every `interval` (`None`: never).
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] for an interval of zero or not shorter than the
    /// visibility timeout (the extension would come too late).
    pub fn with_heartbeat(mut self, interval: Option<Duration>) -> Result<Self, InboxError> {
        if let Some(interval) = interval
            && (interval.is_zero() || interval >= self.visibility_timeout)
        {
            return Err(InboxError::out_of_range(
                "the SQS heartbeat interval",
                interval,
                Duration::from_millis(1)..=self.visibility_timeout,
                "choose an interval well below the visibility timeout (a third of it by default)",
            ));
        }
        self.heartbeat = interval;
        Ok(self)
    }

    /// How long one receive waits for messages (long polling; at most 20 s).
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] above [`MAX_WAIT_TIME`](Self::MAX_WAIT_TIME).
    pub fn with_wait_time(mut self, wait: Duration) -> Result<Self, InboxError> {
        if wait > Self::MAX_WAIT_TIME {
            return Err(InboxError::out_of_range(
                "the SQS long poll",
                wait,
                Duration::ZERO..=Self::MAX_WAIT_TIME,
                "SQS waits at most 20 s per receive",
            ));
        }
        self.wait_time = wait;
        Ok(self)
    }

    /// Consumes until `shutdown` completes, then stops receiving, waits for the deliveries
    /// in flight up to the [grace period](ConsumerOptions::with_grace) and returns what it
    /// did. A long poll in progress is dropped: messages it would have returned come back
    /// after their visibility timeout. `handler` gets the transaction and the
    /// [`Received`] message (headers: the message's string attributes).
    ///
    /// # Errors
    /// [`ConsumerError::Connect`] when the queue's attributes cannot be read (a wrong URL,
    /// credentials, an endpoint not answering). Later failures of a receive are retried
    /// after a pause, logged at WARN and counted in [`ConsumerSummary::reconnects`].
    pub async fn run<H, T, E>(
        self,
        inbox: Inbox,
        db: DatabaseConnection,
        handler: H,
        shutdown: impl Future + Send,
    ) -> Result<ConsumerSummary, ConsumerError>
    where
        H: for<'t> Fn(&'t ObservedTransaction, Arc<Received>) -> HandlerFuture<'t, T, E>
            + Send
            + Sync
            + 'static,
        T: Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let connector = SqsConnect {
            queue: self.queue,
            resolved: None,
            visibility_timeout: self.visibility_timeout,
            wait_time: self.wait_time,
            heartbeat: self.heartbeat,
            concurrency: self.options.concurrency(),
            prefetch: usize::from(self.options.prefetch()).min(MAX_BATCH),
            in_flight: Arc::default(),
        };
        consume::run(connector, self.options, inbox, db, handler, shutdown).await
    }
}

struct SqsConnect {
    queue: SqsQueue,
    /// The queue with its dead-letter queue looked up, after the first connect.
    resolved: Option<Arc<SqsQueue>>,
    visibility_timeout: Duration,
    wait_time: Duration,
    heartbeat: Option<Duration>,
    concurrency: usize,
    prefetch: usize,
    in_flight: Arc<AtomicUsize>,
}

impl Connect for SqsConnect {
    type Session = SqsSession;
    const BROKER: &'static str = "SQS";

    async fn connect(&mut self) -> Result<SqsSession, BoxError> {
        let queue = match &self.resolved {
            Some(queue) => Arc::clone(queue),
            None => {
                let mut queue = self.queue.clone();
                queue.use_redrive_policy().await?;
                let queue = Arc::new(queue);
                self.resolved = Some(Arc::clone(&queue));
                queue
            }
        };
        Ok(SqsSession {
            queue,
            buffered: VecDeque::new(),
            visibility_timeout: self.visibility_timeout,
            wait_time: self.wait_time,
            heartbeat: self.heartbeat,
            concurrency: self.concurrency,
            prefetch: self.prefetch,
            in_flight: Arc::clone(&self.in_flight),
        })
    }
}

struct SqsSession {
    queue: Arc<SqsQueue>,
    buffered: VecDeque<SqsMessage>,
    visibility_timeout: Duration,
    wait_time: Duration,
    heartbeat: Option<Duration>,
    concurrency: usize,
    prefetch: usize,
    /// Messages handed to the loop and not yet settled: a receive asks for no more than
    /// the slots left.
    in_flight: Arc<AtomicUsize>,
}

impl SqsSession {
    async fn receive(&mut self) -> Result<(), BoxError> {
        let free = self
            .concurrency
            .saturating_sub(self.in_flight.load(Ordering::Acquire))
            .clamp(1, self.prefetch.max(1));
        let mut receive = self
            .queue
            .client
            .receive_message()
            .queue_url(&self.queue.url)
            .max_number_of_messages(i32::try_from(free).unwrap_or(1))
            .wait_time_seconds(whole_seconds(self.wait_time, Self::wait_cap()))
            .visibility_timeout(whole_seconds(self.visibility_timeout, MAX_VISIBILITY))
            .message_attribute_names("All");
        for name in SYSTEM_ATTRIBUTES {
            receive = receive.message_system_attribute_names(name);
        }
        let answer = receive
            .send()
            .await
            .map_err(|err| BoxError::from(DisplayErrorContext(err).to_string()))?;
        let received_at = Instant::now();
        for message in answer.messages() {
            self.buffered.push_back(SqsMessage {
                message: message.clone(),
                queue: Arc::clone(&self.queue),
                received_at,
                visibility_timeout: self.visibility_timeout,
                heartbeat: self.heartbeat,
                in_flight: None,
            });
        }
        Ok(())
    }

    fn wait_cap() -> Duration {
        SqsConsumer::MAX_WAIT_TIME
    }
}

impl Session for SqsSession {
    type Message = SqsMessage;

    async fn next(&mut self) -> Option<Result<SqsMessage, BoxError>> {
        loop {
            if let Some(mut message) = self.buffered.pop_front() {
                message.in_flight = Some(InFlight::new(&self.in_flight));
                return Some(Ok(message));
            }
            if let Err(err) = self.receive().await {
                return Some(Err(err));
            }
        }
    }

    async fn close(self) {}
}

/// Counts a message in its session's in-flight messages until dropped.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct SqsMessage {
    message: Message,
    queue: Arc<SqsQueue>,
    received_at: Instant,
    visibility_timeout: Duration,
    heartbeat: Option<Duration>,
    in_flight: Option<InFlight>,
}

impl Incoming for SqsMessage {
    fn delivery(&self) -> Result<Delivery, InboxError> {
        self.queue.delivery(&self.message)
    }

    fn delivery_count(&self) -> u32 {
        delivery_count(&self.message)
    }

    fn last_delivery(&self) -> bool {
        // A nack never drops a message: the redrive policy moves it after its last
        // receive, and without one it stays until the retention period.
        false
    }

    fn received(&mut self, message_id: MessageId) -> Received {
        let headers = self
            .message
            .message_attributes()
            .map(|attributes| {
                attributes
                    .iter()
                    .filter_map(|(name, value)| {
                        Some((name.clone(), value.string_value()?.to_owned()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        Received {
            payload: self.message.body().unwrap_or_default().as_bytes().to_vec(),
            headers,
            broker_id: broker_id(&self.message, &self.queue.id_attribute).to_owned(),
            message_id,
            delivery_count: delivery_count(&self.message),
        }
    }

    async fn settle(&self, settlement: Settlement) -> Result<(), BoxError> {
        self.queue
            .settle_received(&self.message, settlement, self.received_at)
            .await
            .map_err(BoxError::from)
    }

    fn is_stale(&self, error: &BoxError) -> bool {
        matches!(
            error.downcast_ref::<SettleError>(),
            Some(SettleError::ReceiptExpired { .. })
        )
    }

    async fn keep_alive(&self) -> Infallible {
        let Some(interval) = self.heartbeat else {
            return std::future::pending().await;
        };
        let mut next = self.received_at + interval;
        loop {
            tokio::time::sleep_until(next.into()).await;
            next += interval;
            let left = MAX_VISIBILITY.saturating_sub(self.received_at.elapsed());
            match self
                .queue
                .change_visibility(&self.message, self.visibility_timeout, left)
                .await
            {
                Ok(()) => {
                    tracing::debug!(
                        sqs_message_id = sqs_id(&self.message),
                        "visibility extended while the handler runs"
                    );
                }
                Err(err @ SettleError::ReceiptExpired { .. }) => {
                    tracing::warn!(error = %err, "the visibility heartbeat came too late: the message was delivered again; the inbox decides which delivery applies it");
                    return std::future::pending().await;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "extending the visibility failed; trying again at the next beat");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(id: &str, sender_fault: bool) -> BatchResultErrorEntry {
        BatchResultErrorEntry::builder()
            .id(id)
            .sender_fault(sender_fault)
            .code("InvalidMessageContents")
            .build()
            .expect("an error entry")
    }

    #[test]
    fn each_refused_entry_fails_alone_by_whose_fault() {
        let mut results: Vec<Result<(), PublishError>> = (0..4).map(|_| Ok(())).collect();
        settle_entries(
            &mut results,
            &[refused("1", true), refused("3", false), refused("9", true)],
        );
        assert!(results[0].is_ok() && results[2].is_ok());
        assert!(matches!(results[1], Err(PublishError::Rejected(_))));
        assert!(matches!(results[3], Err(PublishError::Transient(_))));
    }

    #[test]
    fn delays_are_whole_seconds_rounded_up_and_capped() {
        let cap = Duration::from_secs(43_200);
        assert_eq!(whole_seconds(Duration::ZERO, cap), 0);
        assert_eq!(whole_seconds(Duration::from_millis(500), cap), 1);
        assert_eq!(whole_seconds(Duration::from_millis(2_001), cap), 3);
        assert_eq!(whole_seconds(Duration::from_secs(50_000), cap), 43_200);
        assert_eq!(
            whole_seconds(Duration::from_secs(60), Duration::from_millis(30_500)),
            30
        );
    }
}
