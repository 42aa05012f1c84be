//! The SQS adapter (`sea_orm_inbox::sqs`, issue 32) against moto's SQS-compatible server
//! (`tests/cluster/sqs.sh`): the delivery's id, count and send time; settlement by delete,
//! visibility change and dead-letter move; an expired receipt handle reported as such; two
//! replicas whose slow handlers outlive the visibility timeout, with the heartbeat off and
//! on; a nack after a beat that was still out; the outbox to a FIFO queue.
//!
//! The `mapping` tests build messages by hand and need no endpoint; the others need
//! `INBOX_TEST_SQS_ENDPOINT` (the URL `tests/cluster/sqs.sh start` prints) at build time,
//! and PostgreSQL for the loops.

use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::{RuntimeComponents, SharedHttpClient};
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::HttpRequest;
use aws_smithy_runtime_api::client::result::ConnectorError;
use inbox_tests::{
    Backend, committed, create_accounts, credit, with_migrated_db, with_migrated_outbox_db,
};
use sea_orm::{DatabaseConnection, DbErr, TransactionTrait};
use sea_orm_inbox::sqs::{self, SettleError, SqsConsumer, SqsPublisher, SqsQueue};
use sea_orm_inbox::{
    ConsumerOptions, ConsumerSummary, Inbox, MessageHandler, MessageId, NackDelay, OutboxExt,
    OutboxMessage, OutgoingMessage, Permanent, PublishError, Publisher, Relay, Settlement,
};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client of the moto endpoint: static test credentials, a plain-HTTP connector.
fn client() -> Client {
    Client::from_conf(client_config().build())
}

/// [`client`]'s configuration, for a client with an interceptor or a connection of its
/// own.
fn client_config() -> aws_sdk_sqs::config::Builder {
    let endpoint = std::env::var("INBOX_TEST_SQS_ENDPOINT")
        .expect("set INBOX_TEST_SQS_ENDPOINT (tests/cluster/sqs.sh start)");
    aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "test", "test", None, None, "static",
        ))
        .endpoint_url(endpoint)
        .http_client(http_client())
}

/// The plain-HTTP client of [`client_config`].
fn http_client() -> SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

/// A queue name of the test's own.
fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

async fn create_queue(
    client: &Client,
    name: &str,
    attributes: &[(QueueAttributeName, String)],
) -> String {
    let mut create = client.create_queue().queue_name(name);
    for (attribute, value) in attributes {
        create = create.attributes(attribute.clone(), value);
    }
    create
        .send()
        .await
        .expect("create the queue")
        .queue_url()
        .expect("a queue URL")
        .to_owned()
}

async fn queue_arn(client: &Client, url: &str) -> String {
    client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .expect("read the queue's ARN")
        .attributes()
        .and_then(|attributes| attributes.get(&QueueAttributeName::QueueArn).cloned())
        .expect("an ARN")
}

async fn delete_queue(client: &Client, url: &str) {
    client
        .delete_queue()
        .queue_url(url)
        .send()
        .await
        .expect("delete the queue");
}

/// The ordering key a message carries (its `Outbox-Key` attribute).
fn key_of(message: &Message) -> Option<&str> {
    message
        .message_attributes()
        .and_then(|attributes| attributes.get(sqs::KEY_ATTRIBUTE))
        .and_then(|value| value.string_value())
}

/// A queue and its dead-letter queue, whose redrive policy moves a message after
/// `max_receive_count` receives.
async fn queue_with_redrive(client: &Client, max_receive_count: u32) -> (String, String) {
    let dead = create_queue(client, &unique("dlq"), &[]).await;
    let policy = serde_json::json!({
        "deadLetterTargetArn": queue_arn(client, &dead).await,
        "maxReceiveCount": max_receive_count,
    });
    let url = create_queue(
        client,
        &unique("payments"),
        &[(QueueAttributeName::RedrivePolicy, policy.to_string())],
    )
    .await;
    (url, dead)
}

fn string_value(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("a string attribute")
}

/// Sends each id of `ids` once, as the message attribute `message-id`, in batches of 10.
async fn send_ids(client: &Client, url: &str, ids: &[String]) {
    for chunk in ids.chunks(sqs::MAX_BATCH) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(n, id)| {
                SendMessageBatchRequestEntry::builder()
                    .id(n.to_string())
                    .message_body(format!("credit {id}"))
                    .message_attributes(sqs::DEFAULT_ID_ATTRIBUTE, string_value(id))
                    .build()
                    .expect("an entry")
            })
            .collect();
        let sent = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .expect("send a batch");
        assert!(sent.failed().is_empty(), "{:?}", sent.failed());
    }
}

/// Every message a receive finds in `url` until two polls in a row come back empty, with
/// its attributes and system attributes, in the order received; each left invisible for a
/// minute, and deleted as it comes when `delete` (a FIFO queue holds back a group's next
/// message while one is in flight).
async fn receive_all(client: &Client, url: &str, delete: bool) -> Vec<Message> {
    let queue = SqsQueue::new(client.clone(), url);
    let mut found = Vec::new();
    let mut empty = 0;
    while empty < 2 {
        let mut receive = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(60)
            .wait_time_seconds(1)
            .message_attribute_names("All");
        for name in sqs::SYSTEM_ATTRIBUTES {
            receive = receive.message_system_attribute_names(name);
        }
        let messages = receive.send().await.expect("receive").messages().to_vec();
        if messages.is_empty() {
            empty += 1;
        }
        for message in messages {
            if delete {
                queue
                    .settle(&message, Settlement::Ack)
                    .await
                    .expect("delete");
            }
            found.push(message);
        }
    }
    found
}

/// Every message in `url`, left in the queue (invisible for a minute).
async fn drain(client: &Client, url: &str) -> Vec<Message> {
    receive_all(client, url, false).await
}

/// Every message in `url`, deleted.
async fn drain_deleting(client: &Client, url: &str) -> Vec<Message> {
    receive_all(client, url, true).await
}

mod mapping {
    use super::*;

    fn message(attributes: &[(&str, &str)], count: &str, sent_millis: &str) -> Message {
        let mut message = Message::builder()
            .message_id("6f1c2d1e-sqs-own-id")
            .receipt_handle("handle")
            .body("{}")
            .attributes(MessageSystemAttributeName::ApproximateReceiveCount, count)
            .attributes(MessageSystemAttributeName::SentTimestamp, sent_millis);
        for (name, value) in attributes {
            message = message.message_attributes(*name, string_value(value));
        }
        message.build()
    }

    #[test]
    fn the_id_attribute_then_the_sqs_message_id() {
        let plain = message(&[], "3", "1700000000000");
        assert_eq!(sqs::broker_id(&plain, "message-id"), "6f1c2d1e-sqs-own-id");
        let delivery = sqs::delivery(&plain, "message-id").unwrap();
        assert_eq!(
            delivery.message_id(),
            MessageId::from_broker_id("6f1c2d1e-sqs-own-id").unwrap()
        );
        assert_eq!(
            delivery.sent_time().map(|at| at.timestamp_millis()),
            Some(1_700_000_000_000)
        );
        assert_eq!(sqs::delivery_count(&plain), 3);

        let named = message(&[("order-id", "order-42")], "1", "1700000000000");
        assert_eq!(sqs::broker_id(&named, "order-id"), "order-42");
        assert_eq!(
            sqs::delivery(&named, "order-id").unwrap().message_id(),
            MessageId::from_broker_id("order-42").unwrap()
        );
        // Another attribute name configured: the SQS id again.
        assert_eq!(sqs::broker_id(&named, "message-id"), "6f1c2d1e-sqs-own-id");
    }

    #[test]
    fn the_outbox_send_time_wins_over_sent_timestamp() {
        let republished = message(
            &[(sqs::SENT_AT_ATTRIBUTE, "2026-12-04T12:00:00.000000Z")],
            "1",
            "1800000000000",
        );
        let delivery = sqs::delivery(&republished, "message-id").unwrap();
        assert_eq!(
            delivery.sent_time().map(|at| at.to_rfc3339()),
            Some("2026-12-04T12:00:00+00:00".to_owned())
        );
        let garbled = message(&[(sqs::SENT_AT_ATTRIBUTE, "yesterday")], "1", "1");
        let err = sqs::delivery(&garbled, "message-id").expect_err("not a time");
        assert!(err.is_permanent(), "{err}");
    }

    #[test]
    fn a_missing_count_is_a_first_delivery() {
        let bare = Message::builder().message_id("m").build();
        assert_eq!(sqs::delivery_count(&bare), 1);
        assert!(
            sqs::delivery(&bare, "message-id")
                .unwrap()
                .sent_time()
                .is_none()
        );
    }
}

/// A receipt handle superseded by a later receive, whose message the later receiver then
/// deleted: settling with it is [`SettleError::ReceiptExpired`], not a client failure.
#[tokio::test]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
async fn an_expired_receipt_handle_is_reported_as_such() {
    let client = client();
    let url = create_queue(&client, &unique("expiry"), &[]).await;
    send_ids(&client, &url, &["order-1".to_owned()]).await;
    let receive = async || {
        client
            .receive_message()
            .queue_url(&url)
            .visibility_timeout(1)
            .wait_time_seconds(5)
            .send()
            .await
            .expect("receive")
            .messages()
            .first()
            .cloned()
            .expect("the message")
    };
    let first = receive().await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let second = receive().await;
    let queue = SqsQueue::new(client.clone(), &url);
    queue
        .settle(&second, Settlement::Ack)
        .await
        .expect("the current handle deletes");
    let err = queue
        .settle(&first, Settlement::Nack(None))
        .await
        .expect_err("the first receipt handle is stale");
    assert!(matches!(err, SettleError::ReceiptExpired { .. }), "{err}");
    delete_queue(&client, &url).await;
}

// --- The consumer loop ------------------------------------------------------------------------

/// One SQS call a client made, as [`Recorder`] saw it: when it started and ended, in
/// milliseconds from the recorder's start.
#[derive(Clone, Debug)]
struct Call {
    /// Which client: a replica's number, or `None` for the test's sender.
    client: Option<usize>,
    what: Called,
    started: u64,
    ended: u64,
    /// Attempts of the call (the client retries some failures).
    attempts: u32,
    ok: bool,
}

#[derive(Clone, Debug)]
enum Called {
    /// A receive and what it returned: (SQS message id, receipt handle, receive count).
    Receive(Vec<(String, String, u32)>),
    Delete {
        receipt: String,
    },
    ChangeVisibility {
        receipt: String,
        seconds: i32,
    },
    SendBatch,
    Other,
}

/// What a call's start leaves for its end, in the call's configuration bag.
#[derive(Clone, Debug)]
struct Started {
    what: Called,
    at: u64,
    attempts: Arc<AtomicU32>,
}

impl aws_smithy_types::config_bag::Storable for Started {
    type Storer = aws_smithy_types::config_bag::StoreReplace<Self>;
}

/// Notes every call of the clients it is given to: the evidence of where a redelivery came
/// from (which receive, after which beat, while which delete was in flight).
#[derive(Clone, Debug)]
struct Recorder {
    client: Option<usize>,
    epoch: Instant,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Recorder {
    fn new() -> Self {
        Self {
            client: None,
            epoch: Instant::now(),
            calls: Arc::default(),
        }
    }

    /// A client of the moto endpoint whose calls this recorder notes as `client`'s.
    fn client(&self, client: Option<usize>) -> Client {
        let recorder = Self {
            client,
            ..self.clone()
        };
        Client::from_conf(client_config().interceptor(recorder).build())
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn calls(&self) -> Vec<Call> {
        self.calls
            .lock()
            .map(|calls| calls.clone())
            .unwrap_or_default()
    }
}

impl aws_sdk_sqs::config::Intercept for Recorder {
    fn name(&self) -> &'static str {
        "Recorder"
    }

    fn read_before_execution(
        &self,
        context: &aws_sdk_sqs::config::interceptors::BeforeSerializationInterceptorContextRef<'_>,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), BoxError> {
        use aws_sdk_sqs::operation::{
            change_message_visibility::ChangeMessageVisibilityInput,
            delete_message::DeleteMessageInput, receive_message::ReceiveMessageInput,
            send_message_batch::SendMessageBatchInput,
        };
        let input = context.input();
        let what = if input.downcast_ref::<ReceiveMessageInput>().is_some() {
            Called::Receive(Vec::new())
        } else if let Some(delete) = input.downcast_ref::<DeleteMessageInput>() {
            Called::Delete {
                receipt: delete.receipt_handle().unwrap_or_default().to_owned(),
            }
        } else if let Some(change) = input.downcast_ref::<ChangeMessageVisibilityInput>() {
            Called::ChangeVisibility {
                receipt: change.receipt_handle().unwrap_or_default().to_owned(),
                seconds: change.visibility_timeout().unwrap_or_default(),
            }
        } else if input.downcast_ref::<SendMessageBatchInput>().is_some() {
            Called::SendBatch
        } else {
            Called::Other
        };
        cfg.interceptor_state().store_put(Started {
            what,
            at: self.now(),
            attempts: Arc::default(),
        });
        Ok(())
    }

    fn read_before_attempt(
        &self,
        _context: &aws_sdk_sqs::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &aws_sdk_sqs::config::RuntimeComponents,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), BoxError> {
        if let Some(started) = cfg.load::<Started>() {
            started.attempts.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    fn read_after_execution(
        &self,
        context: &aws_sdk_sqs::config::interceptors::FinalizerInterceptorContextRef<'_>,
        _runtime_components: &aws_sdk_sqs::config::RuntimeComponents,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(started) = cfg.load::<Started>() else {
            return Ok(());
        };
        let output = context.output_or_error().and_then(Result::ok);
        let mut what = started.what.clone();
        if let (Called::Receive(found), Some(output)) = (&mut what, output) {
            let received = output
                .downcast_ref::<aws_sdk_sqs::operation::receive_message::ReceiveMessageOutput>();
            for message in received
                .map(|received| received.messages())
                .unwrap_or_default()
            {
                found.push((
                    message.message_id().unwrap_or_default().to_owned(),
                    message.receipt_handle().unwrap_or_default().to_owned(),
                    sqs::delivery_count(message),
                ));
            }
        }
        let call = Call {
            client: self.client,
            what,
            started: started.at,
            ended: self.now(),
            attempts: started.attempts.load(Ordering::SeqCst),
            ok: output.is_some(),
        };
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(call);
        }
        Ok(())
    }
}

/// One delivery of an SQS message: its receipt handle, its receive count, the receive.
#[derive(Clone, Copy)]
struct Delivered<'c> {
    receipt: &'c str,
    count: u32,
    call: &'c Call,
}

/// What the calls of a two-replica run say about its deliveries: the latencies of the
/// settlements and beats, the sends the client retried, and for each SQS message delivered
/// more than once, why: every call on it, and where its second delivery came from.
fn explain(calls: &[Call], visibility: Duration) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write;
    let visibility = u64::try_from(visibility.as_millis()).unwrap_or(u64::MAX);
    let mut out = String::new();
    let latency = |pick: fn(&Called) -> bool| {
        let mut took: Vec<u64> = calls
            .iter()
            .filter(|call| pick(&call.what) && call.client.is_some())
            .map(|call| call.ended - call.started)
            .collect();
        took.sort_unstable();
        let at = |share: usize| {
            took.get(took.len().saturating_sub(1) * share / 100)
                .copied()
        };
        format!(
            "{} calls, median {:?} ms, p99 {:?} ms, max {:?} ms, {} failed",
            took.len(),
            at(50).unwrap_or_default(),
            at(99).unwrap_or_default(),
            took.last().copied().unwrap_or_default(),
            calls
                .iter()
                .filter(|call| pick(&call.what) && call.client.is_some() && !call.ok)
                .count()
        )
    };
    let _ = writeln!(
        out,
        "deletes: {}; beats (ChangeMessageVisibility): {}",
        latency(|what| matches!(what, Called::Delete { .. })),
        latency(|what| matches!(what, Called::ChangeVisibility { .. }))
    );
    let retried: Vec<&Call> = calls.iter().filter(|call| call.attempts > 1).collect();
    let _ = writeln!(
        out,
        "calls the client retried: {} ({} of them the test's SendMessageBatch: a retried send can make a third copy of an id)",
        retried.len(),
        retried
            .iter()
            .filter(|call| matches!(call.what, Called::SendBatch))
            .count()
    );
    // Each SQS message's deliveries, in the order received.
    let mut deliveries: BTreeMap<&str, Vec<Delivered<'_>>> = BTreeMap::new();
    let mut message_of: BTreeMap<&str, &str> = BTreeMap::new();
    for call in calls {
        if let Called::Receive(found) = &call.what {
            for (id, receipt, count) in found {
                deliveries.entry(id).or_default().push(Delivered {
                    receipt,
                    count: *count,
                    call,
                });
                message_of.insert(receipt, id);
            }
        }
    }
    // A message seen once with a receive count above 1 had a receive this run never saw
    // (an answer lost, and the client's retry got other messages).
    let unseen: Vec<_> = deliveries
        .iter()
        .filter(|(_, seen)| seen.first().is_some_and(|first| first.count > 1))
        .map(|(id, _)| *id)
        .collect();
    let _ = writeln!(
        out,
        "SQS messages whose first delivery here had a receive count above 1 (an earlier receive's answer lost): {unseen:?}"
    );
    let again: Vec<_> = deliveries
        .iter()
        .filter(|(_, seen)| seen.len() > 1)
        .collect();
    let _ = writeln!(
        out,
        "SQS messages delivered more than once: {} (of {} delivered)",
        again.len(),
        deliveries.len()
    );
    for (id, seen) in again {
        let _ = writeln!(out, "message {id}:");
        let mut on_it: Vec<&Call> = calls
            .iter()
            .filter(|call| match &call.what {
                Called::Receive(found) => found.iter().any(|(found, _, _)| found == id),
                Called::Delete { receipt } | Called::ChangeVisibility { receipt, .. } => {
                    message_of.get(receipt.as_str()) == Some(id)
                }
                _ => false,
            })
            .collect();
        on_it.sort_by_key(|call| call.started);
        for call in &on_it {
            let what = match &call.what {
                Called::Receive(found) => {
                    let count = found
                        .iter()
                        .find(|(found, _, _)| found == id)
                        .map_or(0, |(_, _, count)| *count);
                    format!("received (receive count {count})")
                }
                Called::Delete { .. } => "DeleteMessage".to_owned(),
                Called::ChangeVisibility { seconds, .. } => {
                    format!("ChangeMessageVisibility {seconds} s")
                }
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "  replica {:?}: {what}, sent at {} ms, answered at {} ms{}{}",
                call.client,
                call.started,
                call.ended,
                if call.ok { "" } else { ", failed" },
                if call.attempts > 1 {
                    format!(", {} attempts", call.attempts)
                } else {
                    String::new()
                }
            );
        }
        // Where each later delivery came from: the last call that set the message's
        // visibility before it (a receive or a beat: the visibility runs from SQS's handling
        // of it, after it was sent), and the earlier delivery's delete.
        for pair in seen.windows(2) {
            let (before, received) = (pair[0].receipt, pair[0].call);
            let (count, again) = (pair[1].count, pair[1].call);
            let last_set = on_it
                .iter()
                .filter(|call| {
                    call.started < again.started
                        && call.ok
                        && match &call.what {
                            Called::Receive(found) => {
                                found.iter().any(|(_, receipt, _)| receipt == before)
                            }
                            Called::ChangeVisibility { receipt, .. } => receipt == before,
                            _ => false,
                        }
                })
                .map(|call| call.started)
                .max()
                .unwrap_or(received.started);
            let delete = on_it
                .iter()
                .find(|call| matches!(&call.what, Called::Delete { receipt } if receipt == before));
            let runs_out = last_set + visibility;
            let verdict = match delete {
                _ if again.ended < runs_out => "delivered again before the visibility the last beat (or the receive) set could have run out: not a lapse of the heartbeat, but SQS (moto) handing out a message in flight".to_owned(),
                Some(delete) if delete.ok && delete.ended < runs_out => format!(
                    "the earlier delivery's delete was answered OK {} ms before the visibility ran out, and the message came back: SQS (moto) lost the delete",
                    runs_out - delete.ended
                ),
                Some(delete) if delete.started < runs_out => format!(
                    "the delete was sent {} ms before the visibility ran out and answered {} ms after it was sent: a delete slower than the visibility the last beat left",
                    runs_out - delete.started,
                    delete.ended - delete.started
                ),
                Some(delete) => format!(
                    "the delete was sent {} ms after the visibility ran out: nothing beat between the last call that set it and the delete",
                    delete.started - runs_out
                ),
                None => "no delete of the earlier delivery: its visibility ran out with nothing beating".to_owned(),
            };
            let _ = writeln!(
                out,
                "  delivery with receive count {count}: its visibility was last set by a call sent at {last_set} ms; {verdict}"
            );
        }
    }
    out
}

/// The messages (each sent twice) of the run without the heartbeat, the number.
const MESSAGES: usize = 1_000;
/// The messages of the run with the heartbeat: fewer, as moto serves some 60 calls a
/// second on a loaded 2-core machine (each walks the whole queue); the same share is slow.
const HEARTBEAT_MESSAGES: usize = 300;
/// Every `SLOW_EVERY`-th id's handler outlives the visibility timeout.
const SLOW_EVERY: usize = 50;
const VISIBILITY: Duration = Duration::from_secs(3);
const SLOW_HANDLER: Duration = Duration::from_millis(4_500);
/// The most copies sent and not yet settled.
const BACKLOG: u64 = 100;

struct Running {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<ConsumerSummary, sea_orm_inbox::ConsumerError>>,
}

impl Running {
    async fn stop(self) -> ConsumerSummary {
        let _ = self.stop.send(());
        self.task
            .await
            .expect("the consumer task")
            .expect("the consumer started")
    }
}

/// Credits account 1, pausing first when the message is one of the slow ones (counted in
/// `slow_runs`).
fn credit_handler(
    receive_counts: Arc<Mutex<Vec<u32>>>,
    slow_runs: Arc<AtomicU64>,
) -> impl MessageHandler<(), BoxError> {
    move |txn, message| {
        if let Ok(mut counts) = receive_counts.lock() {
            counts.push(message.delivery_count);
        }
        let slow_runs = Arc::clone(&slow_runs);
        Box::pin(async move {
            let n: usize = message
                .header(sqs::DEFAULT_ID_ATTRIBUTE)
                .and_then(|id| id.strip_prefix("order-"))
                .and_then(|n| n.parse().ok())
                .unwrap_or(1);
            if n.is_multiple_of(SLOW_EVERY) {
                slow_runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(SLOW_HANDLER).await;
            }
            credit(txn, 1).await.map_err(BoxError::from)
        })
    }
}

/// A consumer of `url` with `options` and a long poll of a second (the tests' queues are
/// short; a stop waits for the poll in progress).
fn consumer(client: &Client, url: &str, options: ConsumerOptions) -> SqsConsumer {
    SqsConsumer::new(client.clone(), url)
        .with_options(options)
        .with_wait_time(Duration::from_secs(1))
        .expect("a long poll")
}

fn start(
    consumer: SqsConsumer,
    inbox: &Inbox,
    db: &DatabaseConnection,
    handler: impl MessageHandler<(), BoxError>,
) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(inbox.clone(), db.clone(), handler, stopped));
    Running { stop, task }
}

/// Waits until `done()` holds; fails the test with `what` after `deadline`.
async fn wait_for(what: &str, deadline: Duration, mut done: impl AsyncFnMut() -> bool) {
    let waited = tokio::time::timeout(deadline, async {
        while !done().await {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{what}: not within {deadline:?}");
}

/// What [`two_replicas`] saw.
struct TwoReplicas {
    /// The deliveries beyond the first of each SQS message.
    redeliveries: u64,
    /// The handler runs that paused [`SLOW_HANDLER`], longer than [`VISIBILITY`].
    slow_runs: u64,
    /// Why there were any: [`explain`] of every call the clients made.
    explained: String,
}

/// Two replicas on one queue receiving each of `messages` ids twice; a slow handler
/// outlives the [`VISIBILITY`] timeout. Returns the deliveries beyond the first of each
/// SQS message (the redeliveries) and their explanation, after checking: effects ==
/// messages, none lost, none applied twice.
async fn two_replicas(messages: usize, heartbeat: bool) -> TwoReplicas {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect_with(20).await;
        create_accounts(&conn).await;
        let recorder = Recorder::new();
        let client = recorder.client(None);
        let url = create_queue(&client, &unique("replicas"), &[]).await;
        let inbox = Inbox::new("sqs.credit").expect("a consumer name");
        let options = ConsumerOptions::default()
            .with_concurrency(8)
            .expect("a concurrency")
            .with_prefetch(10)
            .expect("a prefetch")
            .with_grace(Duration::from_secs(10));
        let receive_counts = Arc::new(Mutex::new(Vec::new()));
        let slow_runs = Arc::new(AtomicU64::new(0));
        let replicas: Vec<Running> = (0..2)
            .map(|replica| {
                let consumer = consumer(&recorder.client(Some(replica)), &url, options)
                    .with_visibility_timeout(VISIBILITY)
                    .expect("a visibility timeout");
                let consumer = if heartbeat {
                    consumer
                } else {
                    consumer.with_heartbeat(None).expect("no heartbeat")
                };
                start(consumer, &inbox, &conn, credit_handler(Arc::clone(&receive_counts), Arc::clone(&slow_runs)))
            })
            .collect();
        // Sent as the replicas consume, never more than BACKLOG ahead: moto's receive
        // and delete walk the whole queue, so a queue 2,000 deep makes each call slow.
        let ids: Vec<String> = (1..=messages).map(|n| format!("order-{n}")).collect();
        let mut sent = 0;
        for chunk in ids.chunks(sqs::MAX_BATCH) {
            send_ids(&client, &url, chunk).await;
            send_ids(&client, &url, chunk).await;
            sent += 2 * chunk.len();
            wait_for("the replicas keep up", Duration::from_secs(60), async || {
                let seen = inbox.metrics().snapshot();
                seen.processed + seen.duplicates + BACKLOG >= sent as u64
            })
            .await;
        }
        wait_for("every copy settled", Duration::from_secs(60), async || {
            let seen = inbox.metrics().snapshot();
            seen.processed + seen.duplicates >= (2 * messages) as u64
        })
        .await;
        // Redeliveries of the slow messages still in flight come back after the timeout.
        tokio::time::sleep(VISIBILITY + Duration::from_secs(1)).await;
        let mut total = ConsumerSummary::default();
        for replica in replicas {
            let summary = replica.stop().await;
            total.received += summary.received;
            total.acked += summary.acked;
            total.failed += summary.failed;
            total.settle_failures += summary.settle_failures;
            total.stale_settlements += summary.stale_settlements;
        }
        let effects = committed(&conn).await;
        assert_eq!(
            effects,
            (messages as i64, messages as i64),
            "markers and effects == messages (heartbeat {heartbeat}); received {}, acked {}, failed {}",
            total.received,
            total.acked,
            total.failed
        );
        assert!(
            drain(&client, &url).await.is_empty(),
            "a message left in the queue (heartbeat {heartbeat})"
        );
        delete_queue(&client, &url).await;
        let redeliveries = total.received - (2 * messages) as u64;
        let calls = recorder.calls();
        // A copy the sender made twice (a retried send) comes with receive count 1; a
        // message SQS delivered again, with 2 or more.
        let (mut first, mut again) = (0, 0);
        for call in calls.iter().filter(|call| call.client.is_some()) {
            if let Called::Receive(found) = &call.what {
                for (_, _, count) in found {
                    if *count > 1 {
                        again += 1;
                    } else {
                        first += 1;
                    }
                }
            }
        }
        let explained = format!(
            "deliveries with receive count 1 (a copy's first): {first} of {} copies sent; with receive count 2 or more (SQS delivering a message again): {again}\n{}",
            2 * messages,
            explain(&calls, VISIBILITY)
        );
        println!(
            "sqs two replicas, heartbeat {heartbeat}: {messages} messages x2, received {}, redeliveries {redeliveries}, acked {}, failed {}, settle failures {}, stale settlements {}\n{}",
            total.received,
            total.acked,
            total.failed,
            total.settle_failures,
            total.stale_settlements,
            if heartbeat { explained.as_str() } else { "" }
        );
        TwoReplicas {
            redeliveries,
            slow_runs: slow_runs.load(Ordering::SeqCst),
            explained,
        }
    })
    .await
}

/// Without the heartbeat every slow handler's message is delivered again mid-handler (to
/// the other replica, or this one's free slot): the inbox makes the copy a duplicate.
/// Counted per slow run, not per slow copy: the second copy of a slow id is a duplicate
/// that never runs the handler, and it outlives its visibility only when it arrives early
/// enough to wait out most of the first copy's pause on its marker (in one run on
/// 2026-12-05, 36 of the 40 copies did).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
#[cfg_attr(
    all(inbox_sqs, not(inbox_postgres)),
    ignore = "set INBOX_TEST_POSTGRES_URL"
)]
async fn two_replicas_without_the_heartbeat_see_mid_handler_redeliveries_and_apply_each_once() {
    let run = two_replicas(MESSAGES, false).await;
    let slow_ids = (MESSAGES / SLOW_EVERY) as u64;
    assert!(
        run.slow_runs >= slow_ids,
        "each of the {slow_ids} slow ids runs its slow handler at least once: {} runs",
        run.slow_runs
    );
    assert!(
        run.redeliveries >= run.slow_runs,
        "each of the {} slow handler runs outlives its visibility timeout: {} redeliveries",
        run.slow_runs,
        run.redeliveries
    );
}

/// With the heartbeat the same slow handlers keep their messages: no redelivery at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
#[cfg_attr(
    all(inbox_sqs, not(inbox_postgres)),
    ignore = "set INBOX_TEST_POSTGRES_URL"
)]
async fn two_replicas_with_the_heartbeat_see_no_redelivery_and_apply_each_once() {
    let run = two_replicas(HEARTBEAT_MESSAGES, true).await;
    assert_eq!(run.redeliveries, 0, "redeliveries; {}", run.explained);
}

/// The handler runs seen by [`failing_handler`]: the id, the receive count, when.
type Seen = Arc<Mutex<Vec<(String, u32, Instant)>>>;

/// Fails `order-permanent` permanently and every other message transiently, after
/// `pause`, noting each run in `seen`.
fn failing_handler(seen: Seen, pause: Duration) -> impl MessageHandler<(), BoxError> {
    move |_txn, message| {
        let id = message.broker_id.clone();
        if let Ok(mut seen) = seen.lock() {
            seen.push((id.clone(), message.delivery_count, Instant::now()));
        }
        Box::pin(async move {
            tokio::time::sleep(pause).await;
            if id == "order-permanent" {
                Err(Permanent::new("the order names no product").into())
            } else {
                Err(BoxError::from(DbErr::Custom("the provider is down".into())))
            }
        })
    }
}

/// Starts `consumer` with [`failing_handler`] pausing `pause`; the runs it sees are in the
/// returned [`Seen`].
fn start_failing(
    consumer: SqsConsumer,
    inbox: &Inbox,
    db: &DatabaseConnection,
    pause: Duration,
) -> (Running, Seen) {
    let seen: Seen = Arc::default();
    let running = start(
        consumer,
        inbox,
        db,
        failing_handler(Arc::clone(&seen), pause),
    );
    (running, seen)
}

/// A failing message is nacked with [`NackDelay`]'s delay for its
/// `ApproximateReceiveCount`, until the redrive policy moves it to the dead-letter queue
/// after `maxReceiveCount` receives; a permanent failure goes there at its first delivery
/// (moved by the loop), with its id attribute.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
#[cfg_attr(
    all(inbox_sqs, not(inbox_postgres)),
    ignore = "set INBOX_TEST_POSTGRES_URL"
)]
async fn nack_delays_follow_the_receive_count_then_the_redrive_policy_dead_letters() {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        let client = client();
        let (url, dead) = queue_with_redrive(&client, 3).await;
        send_ids(&client, &url, &["order-transient".to_owned(), "order-permanent".to_owned()]).await;
        let inbox = Inbox::new("sqs.failing").expect("a consumer name");
        let delay = NackDelay::new(Duration::from_secs(1), Duration::from_secs(4)).expect("a delay");
        let options = ConsumerOptions::default().with_nack_delay(delay);
        let (running, seen) = start_failing(consumer(&client, &url, options), &inbox, &conn, Duration::ZERO);
        let dead_letters = Arc::new(Mutex::new(Vec::new()));
        wait_for("both messages dead-lettered", Duration::from_secs(40), async || {
            let found = drain(&client, &dead).await;
            let mut dead_letters = dead_letters.lock().expect("not poisoned");
            dead_letters.extend(found);
            dead_letters.len() >= 2
        })
        .await;
        let summary = running.stop().await;
        let seen = seen.lock().expect("not poisoned").clone();
        let transient: Vec<_> = seen.iter().filter(|(id, ..)| id == "order-transient").collect();
        let counts: Vec<u32> = transient.iter().map(|(_, count, _)| *count).collect();
        assert_eq!(counts, [1, 2, 3], "one handler run per receive up to maxReceiveCount; {summary}");
        for pair in transient.windows(2) {
            let (gap, count) = (pair[1].2 - pair[0].2, pair[0].1);
            let wanted = delay.for_delivery(count);
            assert!(
                gap >= wanted - Duration::from_millis(50) && gap < wanted + Duration::from_secs(3),
                "after receive {count} the nack delay is {wanted:?}, the next receive came after {gap:?}"
            );
        }
        let permanent: Vec<_> = seen.iter().filter(|(id, ..)| id == "order-permanent").collect();
        assert_eq!(permanent.len(), 1, "a permanent failure runs once: {seen:?}");
        let dead_letters = dead_letters.lock().expect("not poisoned").clone();
        let mut dead_ids: Vec<&str> = dead_letters
            .iter()
            .map(|message| sqs::broker_id(message, sqs::DEFAULT_ID_ATTRIBUTE))
            .collect();
        dead_ids.sort_unstable();
        assert_eq!(dead_ids, ["order-permanent", "order-transient"]);
        assert_eq!((summary.nacked, summary.dead_lettered), (3, 1), "{summary}");
        for queue in [&url, &dead] {
            delete_queue(&client, queue).await;
        }
    })
    .await;
}

/// The loop's nack of a message whose visibility ran out while its (slow, failing) handler
/// ran, and which another consumer received and deleted meanwhile, is a stale settlement,
/// not a settle failure: the summary says which.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
#[cfg_attr(
    all(inbox_sqs, not(inbox_postgres)),
    ignore = "set INBOX_TEST_POSTGRES_URL"
)]
async fn the_loop_counts_a_settlement_with_an_expired_receipt_as_stale() {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        let client = client();
        let url = create_queue(&client, &unique("stale"), &[]).await;
        send_ids(&client, &url, &["order-slow".to_owned()]).await;
        let inbox = Inbox::new("sqs.stale").expect("a consumer name");
        // One delivery at a time: this loop does not receive the message again itself.
        let one_at_a_time = ConsumerOptions::default()
            .with_concurrency(1)
            .expect("a concurrency");
        let consumer = consumer(&client, &url, one_at_a_time)
            .with_visibility_timeout(Duration::from_secs(1))
            .expect("a visibility timeout")
            .with_heartbeat(None)
            .expect("no heartbeat");
        let (running, seen) = start_failing(consumer, &inbox, &conn, Duration::from_secs(4));
        wait_for("the handler started", Duration::from_secs(20), async || {
            !seen.lock().expect("not poisoned").is_empty()
        })
        .await;
        // The visibility ends while the handler runs: another consumer takes the message.
        let taken = drain_deleting(&client, &url).await;
        assert_eq!(taken.len(), 1);
        wait_for("the handler failed", Duration::from_secs(20), async || {
            inbox.metrics().snapshot().handler_errors >= 1
        })
        .await;
        // The stop waits for the delivery's settlement.
        let summary = running.stop().await;
        assert_eq!(
            (
                summary.stale_settlements,
                summary.settle_failures,
                summary.nacked
            ),
            (1, 0, 0),
            "{summary}"
        );
        delete_queue(&client, &url).await;
    })
    .await;
}

/// How [`HoldBeats`] holds a beat: the `ChangeMessageVisibility` to [`FULL`] seconds.
const FULL: i64 = 30;
/// How long after the handler failed a held beat waits for a settlement's change before
/// it goes out anyway. The fixed loop's nack waits for the beat, so only this ends it;
/// before the fix, the nack went out at once, well within it, and released the beat.
const HOLD: Duration = Duration::from_secs(2);

/// What [`HoldBeats`] saw.
#[derive(Debug)]
struct HeldBeats {
    /// The visibility timeouts SQS set, in seconds, in the order it answered them.
    landed: Mutex<Vec<i64>>,
    /// How many beats are held right now.
    held: tokio::sync::watch::Sender<usize>,
    /// Whether the handler has failed.
    failed: tokio::sync::watch::Sender<bool>,
    settlement_landed: tokio::sync::Notify,
}

impl HeldBeats {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            landed: Mutex::default(),
            held: tokio::sync::watch::Sender::new(0),
            failed: tokio::sync::watch::Sender::new(false),
            settlement_landed: tokio::sync::Notify::new(),
        })
    }

    /// Waits until `held` says how many beats are held.
    async fn until_held(&self, held: impl FnMut(&usize) -> bool) {
        let mut beats = self.held.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(20), beats.wait_for(held)).await;
        assert!(
            matches!(waited, Ok(Ok(_))),
            "the beats held: not within 20 s"
        );
    }

    /// Waits until the handler has failed.
    async fn until_failed(&self) {
        let mut failed = self.failed.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(30), failed.wait_for(|f| *f)).await;
        assert!(
            matches!(waited, Ok(Ok(_))),
            "the handler's failure: not within 30 s"
        );
    }
}

/// A client's connection that sends a heartbeat's `ChangeMessageVisibility` (to [`FULL`]
/// seconds) only once a settlement's own change has been answered, or [`HOLD`] after the
/// handler failed: a slow connection. Every request runs in a task of its own, as it
/// would on a connection already written to, so it reaches SQS whether the client still
/// polls its future or not.
#[derive(Clone, Debug)]
struct HoldBeats {
    inner: SharedHttpClient,
    held: Arc<HeldBeats>,
}

impl HttpClient for HoldBeats {
    fn http_connector(
        &self,
        settings: &HttpConnectorSettings,
        components: &RuntimeComponents,
    ) -> SharedHttpConnector {
        SharedHttpConnector::new(HoldingConnection {
            inner: self.inner.http_connector(settings, components),
            held: Arc::clone(&self.held),
        })
    }
}

#[derive(Clone, Debug)]
struct HoldingConnection {
    inner: SharedHttpConnector,
    held: Arc<HeldBeats>,
}

impl HttpConnector for HoldingConnection {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        // A ReceiveMessage has a VisibilityTimeout too.
        let changes_visibility =
            request.headers().get("x-amz-target") == Some("AmazonSQS.ChangeMessageVisibility");
        let visibility = request
            .body()
            .bytes()
            .filter(|_| changes_visibility)
            .and_then(|body| serde_json::from_slice::<serde_json::Value>(body).ok())
            .and_then(|body| body["VisibilityTimeout"].as_i64());
        let (inner, held) = (self.inner.clone(), Arc::clone(&self.held));
        let (answer, answered) = oneshot::channel();
        tokio::spawn(async move {
            let beat = visibility == Some(FULL);
            if beat {
                held.held.send_modify(|held| *held += 1);
                tokio::select! {
                    () = held.settlement_landed.notified() => {}
                    () = async {
                        held.until_failed().await;
                        tokio::time::sleep(HOLD).await;
                    } => {}
                }
            }
            let response = inner.call(request).await;
            if let Some(seconds) = visibility
                && response.is_ok()
            {
                held.landed.lock().expect("not poisoned").push(seconds);
                if !beat {
                    held.settlement_landed.notify_one();
                }
            }
            if beat {
                held.held.send_modify(|held| *held -= 1);
            }
            let _ = answer.send(response);
        });
        HttpConnectorFuture::new(async move {
            answered.await.unwrap_or_else(|_| {
                Err(ConnectorError::other(
                    "the connection's task ended".into(),
                    None,
                ))
            })
        })
    }
}

/// Fails once a beat is out (held by [`HoldBeats`]), and says so there.
fn fails_while_a_beat_is_out(held: Arc<HeldBeats>) -> impl MessageHandler<(), BoxError> {
    move |_txn, _message| {
        let held = Arc::clone(&held);
        Box::pin(async move {
            held.until_held(|held| *held > 0).await;
            held.failed.send_replace(true);
            Err(BoxError::from("the provider is down"))
        })
    }
}

/// A beat that is out when the handler fails lands before the nack's
/// `ChangeMessageVisibility`, so the message comes back after the nack's delay (1 s), not
/// after the visibility timeout (30 s): the client holds the beat until the nack is
/// answered (before the fix) or [`HOLD`] after the handler failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
#[cfg_attr(
    all(inbox_sqs, not(inbox_postgres)),
    ignore = "set INBOX_TEST_POSTGRES_URL"
)]
async fn a_nacked_message_returns_after_the_nack_delay_though_a_beat_was_out() {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        let client = client();
        let url = create_queue(&client, &unique("beat-nack"), &[]).await;
        send_ids(&client, &url, &["order-nacked".to_owned()]).await;
        let held = HeldBeats::new();
        let holding = Client::from_conf(
            client_config()
                .http_client(HoldBeats {
                    inner: http_client(),
                    held: Arc::clone(&held),
                })
                .build(),
        );
        let options = ConsumerOptions::default()
            .with_concurrency(1)
            .expect("a concurrency")
            .with_nack_delay(
                NackDelay::new(Duration::from_secs(1), Duration::from_secs(1)).expect("a delay"),
            );
        let consumer = consumer(&holding, &url, options)
            .with_visibility_timeout(Duration::from_secs(FULL.unsigned_abs()))
            .expect("a visibility timeout")
            .with_heartbeat(Some(Duration::from_millis(300)))
            .expect("a heartbeat");
        let inbox = Inbox::new("sqs.beat-nack").expect("a consumer name");
        let handler = fails_while_a_beat_is_out(Arc::clone(&held));
        let running = start(consumer, &inbox, &conn, handler);
        held.until_failed().await;
        // The stop waits for the delivery's settlement; the loop receives nothing more.
        let summary = running.stop().await;
        assert_eq!(
            (summary.nacked, summary.settle_failures),
            (1, 0),
            "{summary}"
        );
        let nacked_at = Instant::now();
        held.until_held(|held| *held == 0).await;
        let landed = held.landed.lock().expect("not poisoned").clone();
        assert!(
            landed == [FULL, 1],
            "visibility changes in the order SQS answered them ({FULL}: the beat, 1: the nack): {landed:?}"
        );
        let back = client
            .receive_message()
            .queue_url(&url)
            .wait_time_seconds(10)
            .send()
            .await
            .expect("receive");
        assert_eq!(
            back.messages().len(),
            1,
            "the nacked message was not back {:?} after the nack (1 s delay)",
            nacked_at.elapsed()
        );
        delete_queue(&client, &url).await;
    })
    .await;
}

// --- The outbox to SQS ------------------------------------------------------------------------

const KEYS: usize = 4;
const PER_KEY: usize = 15;

/// The outbox rows of `destination` as a relay claims them: what one that died before
/// marking them sent publishes again.
async fn relay_again(
    conn: &DatabaseConnection,
    destination: &str,
) -> Vec<sea_orm_inbox::OutboxMessage> {
    use sea_orm::{ConnectionTrait, Statement};
    let rows = conn
        .query_all_raw(Statement::from_sql_and_values(
            conn.get_database_backend(),
            "SELECT message_id, partition_key, payload FROM outbox WHERE destination = ? ORDER BY id",
            vec![destination.into()],
        ))
        .await
        .expect("read the outbox");
    rows.iter()
        .map(|row| sea_orm_inbox::OutboxMessage {
            message_id: MessageId::from_uuid(row.try_get("", "message_id").expect("message_id")),
            destination: destination.to_owned(),
            key: row.try_get("", "partition_key").expect("partition_key"),
            payload: row.try_get("", "payload").expect("payload"),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
            first_published_at: chrono::Utc::now(),
            attempt: 2,
        })
        .collect()
}

/// The relay publishes keyed rows to a FIFO queue: each key's messages arrive in enqueue
/// order (the key is the `MessageGroupId`); publishing them all again (a relay that died
/// before marking) adds nothing (the message id is the `MessageDeduplicationId`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
async fn the_outbox_to_a_fifo_queue_keeps_key_order_and_deduplicates_resends() {
    with_migrated_outbox_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let client = client();
        let url = create_queue(
            &client,
            &format!("{}.fifo", unique("orders")),
            &[(QueueAttributeName::FifoQueue, "true".to_owned())],
        )
        .await;
        let txn = conn.begin().await.expect("begin");
        for n in 0..PER_KEY {
            for key in 0..KEYS {
                txn.enqueue(
                    OutgoingMessage::new(&url, format!("{{\"key\":{key},\"n\":{n}}}"))
                        .key(format!("customer-{key}")),
                )
                .await
                .expect("enqueue");
            }
        }
        txn.commit().await.expect("commit");
        let publisher = Arc::new(SqsPublisher::new(client.clone()));
        let relay = Relay::new(Arc::clone(&publisher));
        let mut published = 0;
        while published < KEYS * PER_KEY {
            let report = relay.drain(&conn).await.expect("relay");
            assert_eq!(report.failed, 0, "{report:?}");
            published += report.published as usize;
        }
        // The relay died before marking: every row goes out again, same ids, same keys.
        let resent = relay_again(&conn, &url).await;
        for chunk in resent.chunks(sqs::MAX_BATCH) {
            let batch: Vec<&sea_orm_inbox::OutboxMessage> = chunk.iter().collect();
            for result in publisher.publish_batch(&batch).await {
                result.expect("a resend is accepted");
            }
        }
        let received = drain_deleting(&client, &url).await;
        assert_eq!(
            received.len(),
            KEYS * PER_KEY,
            "the resends were deduplicated"
        );
        for key in 0..KEYS {
            let order: Vec<usize> = received
                .iter()
                .filter(|message| key_of(message) == Some(format!("customer-{key}").as_str()))
                .filter_map(|message| {
                    let body: serde_json::Value = serde_json::from_str(message.body()?).ok()?;
                    body["n"].as_u64().map(|n| n as usize)
                })
                .collect();
            assert_eq!(
                order,
                (0..PER_KEY).collect::<Vec<_>>(),
                "customer-{key}'s messages in enqueue order"
            );
        }
        delete_queue(&client, &url).await;
    })
    .await;
}

/// One entry that cannot be sent (a body that is not UTF-8) fails alone, rejected: the
/// others of its `SendMessageBatch` are sent.
#[tokio::test]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
async fn a_refused_batch_entry_fails_alone() {
    let client = client();
    let url = create_queue(&client, &unique("batch"), &[]).await;
    let message = |n: u32, payload: &str| sea_orm_inbox::OutboxMessage {
        message_id: MessageId::from_broker_id(&format!("order-{n}")).expect("an id"),
        destination: url.clone(),
        key: None,
        payload: payload.as_bytes().to_vec(),
        headers: Default::default(),
        created_at: chrono::Utc::now(),
        first_published_at: chrono::Utc::now(),
        attempt: 1,
    };
    let mut not_text = message(2, "");
    not_text.payload = vec![0xff, 0xfe];
    let batch = [message(1, "fine"), not_text, message(3, "also fine")];
    let refs: Vec<&sea_orm_inbox::OutboxMessage> = batch.iter().collect();
    let results = SqsPublisher::new(client.clone()).publish_batch(&refs).await;
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    assert!(
        matches!(results[1], Err(sea_orm_inbox::PublishError::Rejected(_))),
        "{results:?}"
    );
    assert_eq!(drain(&client, &url).await.len(), 2);
    delete_queue(&client, &url).await;
}

/// Records the size of each batch the relay hands the SQS publisher.
struct CountingBatches {
    publisher: SqsPublisher,
    batches: Mutex<Vec<usize>>,
}

impl Publisher for CountingBatches {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.publish_batch(&[message])
            .await
            .pop()
            .expect("one result")
    }

    fn batch_limit(&self) -> usize {
        self.publisher.batch_limit()
    }

    async fn publish_batch(&self, messages: &[&OutboxMessage]) -> Vec<Result<(), PublishError>> {
        if let Ok(mut batches) = self.batches.lock() {
            batches.push(messages.len());
        }
        self.publisher.publish_batch(messages).await
    }
}

/// The relay hands the SQS publisher up to 10 messages at once, and a message that cannot
/// be sent (not UTF-8) is parked as dead alone while the rest of its batch is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_sqs), ignore = "set INBOX_TEST_SQS_ENDPOINT")]
async fn the_relay_sends_batches_of_ten_and_parks_a_refused_message_alone() {
    with_migrated_outbox_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let client = client();
        let url = create_queue(&client, &unique("relayed"), &[]).await;
        let txn = conn.begin().await.expect("begin");
        for n in 0..25 {
            let payload: Vec<u8> = if n == 12 {
                vec![0xff, 0xfe]
            } else {
                format!("credit {n}").into_bytes()
            };
            txn.enqueue(OutgoingMessage::new(&url, payload))
                .await
                .expect("enqueue");
        }
        txn.commit().await.expect("commit");
        let publisher = Arc::new(CountingBatches {
            publisher: SqsPublisher::new(client.clone()),
            batches: Mutex::default(),
        });
        let report = Relay::new(Arc::clone(&publisher))
            .drain(&conn)
            .await
            .expect("relay");
        assert_eq!((report.published, report.dead), (24, 1), "{report:?}");
        let batches = publisher.batches.lock().expect("not poisoned").clone();
        assert_eq!(batches, [10, 10, 5]);
        assert_eq!(drain(&client, &url).await.len(), 24);
        delete_queue(&client, &url).await;
    })
    .await;
}
