//! The outbox's [`SqsPublisher`]: standard and FIFO queues, `SendMessageBatch`.

use super::{
    DEFAULT_ID_ATTRIBUTE, KEY_ATTRIBUTE, MAX_ATTRIBUTES, MAX_BATCH, SENT_AT_ATTRIBUTE, is_fifo,
    string_value,
};
use crate::{BoxError, OutboxMessage, PublishError, Publisher};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{BatchResultErrorEntry, SendMessageBatchRequestEntry};
use chrono::SecondsFormat;

/// Publishes outbox messages to SQS queues: a [`Publisher`] for a
/// [`Relay`](crate::Relay), which hands it up to [`MAX_BATCH`] messages at once
/// ([`Publisher::batch_limit`]), sent in one `SendMessageBatch` per queue
/// ([`publish_batch`](Self::publish_batch)).
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

    /// Sends `messages` in `SendMessageBatch` calls, one per queue and [`MAX_BATCH`]
    /// messages, and returns each one's result, in order: an entry SQS refused fails
    /// alone, [`PublishError::Rejected`] when SQS says the sender is at fault (a message
    /// that can never be sent as it is), else [`PublishError::Transient`]; a call that
    /// fails as a whole fails its entries transiently.
    pub async fn publish_batch(
        &self,
        messages: &[&OutboxMessage],
    ) -> Vec<Result<(), PublishError>> {
        let mut results: Vec<Result<(), PublishError>> = messages.iter().map(|_| Ok(())).collect();
        let mut queues: Vec<&str> = Vec::new();
        for message in messages {
            if !queues.contains(&message.destination.as_str()) {
                queues.push(&message.destination);
            }
        }
        for queue_url in queues {
            let of_queue: Vec<usize> = (0..messages.len())
                .filter(|&index| messages[index].destination == queue_url)
                .collect();
            for chunk in of_queue.chunks(MAX_BATCH) {
                self.send_batch(queue_url, chunk, messages, &mut results)
                    .await;
            }
        }
        results
    }

    /// One `SendMessageBatch` to `queue_url` of the `messages` at `indices`, whose entry
    /// ids are those indices.
    async fn send_batch(
        &self,
        queue_url: &str,
        indices: &[usize],
        messages: &[&OutboxMessage],
        results: &mut [Result<(), PublishError>],
    ) {
        let mut entries = Vec::with_capacity(indices.len());
        let mut sent = Vec::with_capacity(indices.len());
        for &index in indices {
            match entry(messages[index], index) {
                Ok(entry) => {
                    entries.push(entry);
                    sent.push(index);
                }
                Err(err) => results[index] = Err(err),
            }
        }
        if entries.is_empty() {
            return;
        }
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
            Ok(answer) => settle_entries(results, answer.failed()),
        }
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
        SqsPublisher::publish_batch(self, &[message])
            .await
            .pop()
            .unwrap_or_else(|| Err(PublishError::Transient("SQS gave no result".into())))
    }

    fn batch_limit(&self) -> usize {
        MAX_BATCH
    }

    async fn publish_batch(&self, messages: &[&OutboxMessage]) -> Vec<Result<(), PublishError>> {
        SqsPublisher::publish_batch(self, messages).await
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
}
