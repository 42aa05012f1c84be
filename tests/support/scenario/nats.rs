//! The NATS JetStream half of the demo (with `async-nats`): a stream and a durable pull
//! consumer of the run's own, with a short ack wait; two replicas fetching from that one
//! consumer; the dying replica stops with deliveries committed but not acked, and
//! JetStream redelivers them once the ack wait has passed.
//!
//! Duplicate publishes and JetStream's own deduplication: a copy published again with the
//! same `Nats-Msg-Id` inside the stream's duplicate window is dropped by the server and
//! never delivered (the publisher below checks that). The duplicates that do reach a
//! consumer are the ones JetStream cannot recognise: a re-send after the window has
//! passed, or from a producer that sets no `Nats-Msg-Id` or a different one. The demo
//! publishes its re-sends without `Nats-Msg-Id` to stand for those; the inbox catches
//! them by the application's `Message-Id` header, which every copy carries.

use super::{BoxError, Demo, Fate, Plan, Publication, Report};
use async_nats::jetstream::consumer::{PullConsumer, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use sea_orm::DatabaseConnection;
use sea_orm_inbox::{Settlement, jetstream as adapter};
use std::time::Duration;
use tokio::sync::Notify;

/// The header that carries the message id: the dedup key of the inbox.
pub const MESSAGE_ID_HEADER: &str = "Message-Id";

/// How long JetStream waits for an ack before redelivering: short, so the dying replica's
/// deliveries come back quickly.
const ACK_WAIT: Duration = Duration::from_secs(1);

/// Messages per pull request, and how long a request waits for them.
const FETCH_BATCH: usize = 10;
const FETCH_EXPIRES: Duration = Duration::from_millis(300);

/// A stream left behind by a run that failed half-way keeps its messages this long.
const STREAM_MAX_AGE: Duration = Duration::from_secs(10 * 60);

/// Runs the whole scenario against the server at `nats_url`; `replicas` are the two
/// replicas' own database pools (the first one dies). Returns the counts; check them with
/// [`Report::check`].
pub async fn run(
    nats_url: &str,
    replicas: [&DatabaseConnection; 2],
    plan: &Plan,
) -> Result<Report, BoxError> {
    let demo = Demo::prepare(replicas[0], plan).await?;
    let names = Names::of(&demo);
    let admin = jetstream::new(connect(nats_url).await?);
    create_stream_and_consumer(&admin, &names).await?;

    // The healthy replica starts pulling only once the dying one has acked its share and
    // begun crashing: pulling from the start, it could take so much of the stream that the
    // dying one never got that far and withheld nothing (seen once in CI on SQLite: 0
    // withheld, so the run proved nothing about a crash).
    let crashing = Notify::new();
    let work = async {
        tokio::try_join!(
            publish(&admin, &names, &demo),
            consume(
                nats_url,
                &names,
                &demo,
                replicas[0],
                Fate::dying(plan),
                Start::Now(&crashing)
            ),
            consume(
                nats_url,
                &names,
                &demo,
                replicas[1],
                Fate::healthy(),
                Start::After(&crashing)
            ),
        )
    };
    let pending = async {
        demo.within_deadline(plan, work).await?;
        pending_messages(&admin, &names).await
    }
    .await;
    // Delete the stream (and its consumer) whatever happened; the first error wins.
    let deleted = admin.delete_stream(&names.stream).await;
    let pending = pending?;
    deleted.map_err(|e| format!("delete stream {}: {e}", names.stream))?;
    demo.report(replicas[0], pending).await
}

/// The run's own stream, subject and durable consumer.
struct Names {
    stream: String,
    subject: String,
    consumer: String,
}

impl Names {
    fn of(demo: &Demo) -> Self {
        Self {
            stream: format!("INBOX_DEMO_{}", demo.run_id()),
            subject: format!("inbox-demo.{}", demo.run_id()),
            consumer: format!("ledger-{}", demo.run_id()),
        }
    }
}

async fn connect(url: &str) -> Result<async_nats::Client, BoxError> {
    async_nats::connect(url)
        .await
        .map_err(|e| format!("connect to NATS at {url}: {e}").into())
}

async fn create_stream_and_consumer(
    js: &jetstream::Context,
    names: &Names,
) -> Result<(), BoxError> {
    let stream = js
        .create_stream(stream::Config {
            name: names.stream.clone(),
            subjects: vec![names.subject.clone()],
            max_age: STREAM_MAX_AGE,
            ..stream::Config::default()
        })
        .await
        .map_err(|e| format!("create stream {} (is JetStream on?): {e}", names.stream))?;
    stream
        .create_consumer(pull::Config {
            durable_name: Some(names.consumer.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            ..pull::Config::default()
        })
        .await
        .map_err(|e| format!("create consumer {}: {e}", names.consumer))?;
    Ok(())
}

/// One copy as the producer publishes it: the message id in the application header
/// always; `transport_id` as `Nats-Msg-Id` when given.
fn message(copy: &Publication, transport_id: Option<&str>) -> PublishMessage {
    let publish = PublishMessage::build()
        .payload(copy.payload().into())
        .header(MESSAGE_ID_HEADER, copy.id.to_string());
    match transport_id {
        Some(id) => publish.message_id(id),
        None => publish,
    }
}

/// Publishes every copy and waits for JetStream's ack of each. Originals carry
/// `Nats-Msg-Id`; before each re-send, an exact retry of the original shows JetStream
/// dropping it, then the re-send goes out without `Nats-Msg-Id` and is stored.
async fn publish(js: &jetstream::Context, names: &Names, demo: &Demo) -> Result<(), BoxError> {
    for copy in demo.publications() {
        let id = copy.id.to_string();
        if copy.attempt > 0 {
            let original = Publication {
                attempt: 0,
                ..*copy
            };
            let retry = message(&original, Some(&id));
            let ack = js.send_publish(names.subject.clone(), retry).await?.await?;
            if !ack.duplicate {
                return Err(format!("JetStream stored an exact retry of {id}").into());
            }
        }
        let transport_id = (copy.attempt == 0).then_some(id.as_str());
        let publish = message(copy, transport_id);
        let ack = js
            .send_publish(names.subject.clone(), publish)
            .await?
            .await?;
        if ack.duplicate {
            return Err(format!("JetStream dropped copy {} of {id}", copy.attempt).into());
        }
    }
    Ok(())
}

/// When a replica starts pulling.
enum Start<'a> {
    /// At once, signalling the other replica once its fate begins the crash.
    Now(&'a Notify),
    /// Once the other replica has signalled.
    After(&'a Notify),
}

/// One replica: its own connection to NATS, pulling from the shared durable consumer.
/// Delivery -> message id -> `Inbox::process` -> `Settlement::of` -> ack or nak. Returns
/// when every copy is acked, or when this replica dies.
async fn consume(
    url: &str,
    names: &Names,
    demo: &Demo,
    db: &DatabaseConnection,
    mut fate: Fate,
    start: Start<'_>,
) -> Result<(), BoxError> {
    let crashing = match start {
        Start::Now(crashing) => Some(crashing),
        Start::After(crashed) => {
            crashed.notified().await;
            None
        }
    };
    let client = connect(url).await?;
    let consumer: PullConsumer = jetstream::new(client.clone())
        .get_stream(&names.stream)
        .await?
        .get_consumer(&names.consumer)
        .await?;
    while !demo.is_done() {
        let mut batch = consumer
            .fetch()
            .max_messages(FETCH_BATCH)
            .expires(FETCH_EXPIRES)
            .messages()
            .await?;
        while let Some(message) = batch.next().await {
            let message = message?;
            let id = message
                .headers
                .as_ref()
                .and_then(|headers| headers.get(MESSAGE_ID_HEADER))
                .ok_or("a message without a Message-Id header")?;
            let copy = Publication::read(id.as_str(), &message.payload)?;
            let redelivered = message.info()?.delivered > 1;
            let result = demo.handle(db, copy, redelivered).await;
            if !fate.settles_next() {
                demo.withheld();
                if fate.is_dead() {
                    // The crash: the connection goes away with deliveries committed but
                    // not acked; JetStream redelivers them after the ack wait.
                    return Ok(());
                }
                continue;
            }
            let settlement = Settlement::of(&result);
            adapter::settle(&message, settlement).await?;
            demo.settled(copy, settlement);
            if let Some(crashing) = crashing.filter(|_| fate.is_crashing()) {
                crashing.notify_one();
            }
        }
    }
    // Acks are fire-and-forget publishes: push them out before reporting.
    client.flush().await?;
    Ok(())
}

/// Messages the consumer still has to deliver or is waiting to see acked.
async fn pending_messages(js: &jetstream::Context, names: &Names) -> Result<u64, BoxError> {
    let mut consumer: PullConsumer = js
        .get_stream(&names.stream)
        .await?
        .get_consumer(&names.consumer)
        .await?;
    // The server applies acks asynchronously: give the last ones a moment to land.
    let mut pending = 0;
    for _ in 0..20 {
        let info = consumer.info().await?;
        pending = info.num_pending + info.num_ack_pending as u64;
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(pending)
}
