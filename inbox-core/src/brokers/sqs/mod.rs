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

mod consumer;
mod publisher;

pub use consumer::SqsConsumer;
pub use publisher::SqsPublisher;

use crate::{BoxError, Delivery, InboxError, MessageId, Settlement};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use chrono::{DateTime, Utc};
use std::time::{Duration, Instant};

/// The message attribute a producer sets to name its message, read when no other is
/// configured ([`SqsQueue::with_id_attribute`]); [`SqsPublisher`] sets it.
pub const DEFAULT_ID_ATTRIBUTE: &str = "message-id";

/// The message attribute carrying an outbox message's send time, its
/// [first publish time](crate::OutboxMessage::first_published_at) in RFC 3339 with microseconds,
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

    /// Whether [`settle`](Self::settle) with `settlement` ends in a
    /// `ChangeMessageVisibility` (a nack; a dead letter without a dead-letter queue), which
    /// a heartbeat's own change must not follow.
    fn changes_visibility(&self, settlement: Settlement) -> bool {
        match settlement {
            Settlement::Ack => false,
            Settlement::Nack(_) => true,
            Settlement::DeadLetter => self.dead_letter_url.is_none(),
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

#[cfg(test)]
mod tests {
    use super::*;

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
