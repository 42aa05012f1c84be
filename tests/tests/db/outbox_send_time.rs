//! The send time an outbox message carries to its consumer, through the real RabbitMQ and
//! NATS JetStream: when a relay first published the row, not when it was enqueued, and the
//! same on every publish of that row. A message held back two days (`deliver_after`, or
//! parked and requeued) reaches a consumer whose inbox refuses what was sent more than a
//! day ago: it is processed, and its republish is a duplicate with the same send time.
//!
//! Time is simulated: the row's columns are written as if it was enqueued two days ago and
//! became due now.

use chrono::Utc;
use futures_util::StreamExt;
use inbox_tests::{Backend, TestDb, create_accounts, credit, stmt, with_migrated_outbox_db};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::jetstream::JetStreamPublisher;
use sea_orm_inbox::rabbitmq::RabbitMqPublisher;
use sea_orm_inbox::{
    AdmissionFloor, Delivery, Inbox, InboxError, MessageId, OutboxExt, OutboxMessage, Outcome,
    OutgoingMessage, ProcessError, PublishError, Publisher, Relay, RelayOptions, RetentionPolicy,
    Settlement, jetstream, rabbitmq, requeue_dead_message, timestamp_value,
};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("set {var} to run this test"))
}

/// The consumer: an inbox whose markers live a day, refusing what was sent before the day
/// (minus 5 minutes for clock skew).
fn floored_inbox() -> Inbox {
    let retention = RetentionPolicy::with_window(DAY).expect("a day's window");
    let floor = AdmissionFloor::new(&retention, Duration::from_secs(300)).expect("a floor");
    Inbox::new("downstream.held-back")
        .expect("valid name")
        .with_admission_floor(floor)
}

/// Enqueues one message held back two days, then writes its row as if it was enqueued two
/// days ago and became due now.
async fn enqueue_held_back(conn: &DatabaseConnection, destination: &str) -> MessageId {
    let txn = conn.begin().await.expect("begin");
    let id = txn
        .enqueue(
            OutgoingMessage::new(destination, b"held back".to_vec())
                .deliver_after(Duration::from_secs(2 * 86_400)),
        )
        .await
        .expect("enqueue");
    txn.commit().await.expect("commit");
    let backend = conn.get_database_backend();
    let now = Utc::now();
    conn.execute_raw(stmt(
        backend,
        "UPDATE outbox SET created_at = ?, available_at = ?",
        vec![
            timestamp_value(backend, now - chrono::Duration::days(2)),
            timestamp_value(backend, now),
        ],
    ))
    .await
    .expect("age the row");
    id
}

/// Publishes the due row, waits past a second (RabbitMQ's timestamps are whole seconds),
/// forgets the mark (a relay that died before writing it) and publishes it again.
async fn publish_twice<P: Publisher>(db: &TestDb, conn: &DatabaseConnection, relay: Relay<P>) {
    let relay_pool = db.connect().await;
    for round in 0..2 {
        if round == 1 {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            conn.execute_unprepared("UPDATE outbox SET sent_at = NULL")
                .await
                .expect("forget the mark");
        }
        let report = relay.relay_once(&relay_pool).await.expect("relay");
        assert_eq!(report.published, 1, "round {round}: {report:?}");
    }
    relay_pool.close().await.ok();
}

/// Processes one delivery through the floored inbox; returns its send time and outcome.
async fn consume(
    inbox: &Inbox,
    conn: &DatabaseConnection,
    id: MessageId,
    delivery: Result<Delivery, InboxError>,
) -> (chrono::DateTime<Utc>, Outcome<()>) {
    let delivery = delivery.expect("a readable delivery");
    assert_eq!(
        delivery.message_id(),
        MessageId::from_broker_id(&id.to_string()).expect("a broker id")
    );
    let sent_at = delivery
        .sent_time()
        .expect("the broker carries a send time");
    let result: Result<Outcome<()>, ProcessError<sea_orm::DbErr>> = inbox
        .process(conn, delivery, |txn| {
            Box::pin(async move { credit(txn, 1).await })
        })
        .await;
    (sent_at, result.expect("processed, duplicate or refused"))
}

/// What both brokers must show: the first copy processed (not refused as sent two days
/// ago), the republish a duplicate, both with one send time, taken at the first publish.
fn assert_first_publish_time(
    copies: &[(chrono::DateTime<Utc>, Outcome<()>)],
    before_first_publish: chrono::DateTime<Utc>,
) {
    assert_eq!(copies.len(), 2);
    assert_eq!(
        copies[0].1,
        Outcome::Processed(()),
        "a message due now is not refused for its enqueue time"
    );
    assert_eq!(copies[1].1, Outcome::Duplicate);
    assert_eq!(
        copies[0].0, copies[1].0,
        "the republish carries the first publish's send time"
    );
    // RabbitMQ's timestamp is whole seconds.
    assert!(
        copies[0].0 >= before_first_publish - chrono::Duration::seconds(1),
        "sent at {}, first published after {before_first_publish}",
        copies[0].0
    );
}

async fn rabbitmq_held_back_message_is_processed_with_its_first_publish_time(backend: Backend) {
    use lapin::options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::{AMQPValue, FieldTable};
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let url = env("INBOX_TEST_AMQP_URL");
        let properties = || {
            lapin::ConnectionProperties::default()
                .with_executor(tokio_executor_trait::Tokio::current())
                .with_reactor(tokio_reactor_trait::Tokio::current())
        };
        let amqp = lapin::Connection::connect(&url, properties())
            .await
            .expect("connect to RabbitMQ");
        let channel = amqp.create_channel().await.expect("channel");
        let queue = format!("outbox-sent-at-{}", uuid::Uuid::new_v4().simple());
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongUInt(60_000));
        channel
            .queue_declare(&queue, QueueDeclareOptions::default(), arguments)
            .await
            .expect("declare the queue");

        let id = enqueue_held_back(&conn, &queue).await;
        let before_first_publish = Utc::now();
        let publisher = RabbitMqPublisher::connect(&url, properties(), "")
            .await
            .expect("the publisher's connection");
        publish_twice(db, &conn, Relay::new(publisher)).await;

        let inbox = floored_inbox();
        let mut consumer = channel
            .basic_consume(
                &queue,
                "sent-at",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let consumed = async {
            let mut copies = Vec::new();
            for _ in 0..2 {
                let message = consumer
                    .next()
                    .await
                    .expect("a delivery")
                    .expect("delivered");
                let copy = consume(&inbox, &conn, id, rabbitmq::delivery(&message)).await;
                rabbitmq::settle(
                    &message,
                    Settlement::of(&Ok::<_, ProcessError<sea_orm::DbErr>>(copy.1)),
                )
                .await
                .expect("settle");
                copies.push(copy);
            }
            copies
        };
        let copies = tokio::time::timeout(DEADLINE, consumed)
            .await
            .expect("both copies arrive");
        assert_first_publish_time(&copies, before_first_publish);
        channel
            .queue_delete(&queue, QueueDeleteOptions::default())
            .await
            .ok();
        amqp.close(200, "test over").await.ok();
    })
    .await;
}

async fn jetstream_held_back_message_is_processed_with_its_first_publish_time(backend: Backend) {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use async_nats::jetstream::stream;
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let client = async_nats::connect(env("INBOX_TEST_NATS_URL"))
            .await
            .expect("connect to NATS");
        let js = async_nats::jetstream::new(client);
        let run = uuid::Uuid::new_v4().simple().to_string();
        let (name, subject) = (
            format!("OUTBOX_SENT_AT_{run}"),
            format!("outbox-sent-at.{run}"),
        );
        // A duplicate window shorter than the wait between the publishes: the republish
        // is stored again, at a later stream time, as one after a longer outage would be.
        let created = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                max_age: Duration::from_secs(600),
                duplicate_window: Duration::from_secs(1),
                ..stream::Config::default()
            })
            .await
            .expect("create the stream");

        let id = enqueue_held_back(&conn, &subject).await;
        let before_first_publish = Utc::now();
        publish_twice(db, &conn, Relay::new(JetStreamPublisher::new(js.clone()))).await;

        let inbox = floored_inbox();
        let consumer = created
            .create_consumer(pull::Config {
                durable_name: Some("sent-at".into()),
                ack_policy: AckPolicy::Explicit,
                ..pull::Config::default()
            })
            .await
            .expect("consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let consumed = async {
            let mut copies = Vec::new();
            for _ in 0..2 {
                let message = messages
                    .next()
                    .await
                    .expect("a delivery")
                    .expect("delivered");
                let copy = consume(&inbox, &conn, id, jetstream::delivery(&message)).await;
                jetstream::settle(
                    &message,
                    Settlement::of(&Ok::<_, ProcessError<sea_orm::DbErr>>(copy.1)),
                )
                .await
                .expect("settle");
                copies.push(copy);
            }
            copies
        };
        let copies = tokio::time::timeout(DEADLINE, consumed)
            .await
            .expect("both copies arrive (the republish was stored again)");
        assert_first_publish_time(&copies, before_first_publish);
        js.delete_stream(&name).await.ok();
    })
    .await;
}

/// Records each publish's attempt and send time; fails every publish while `failing`.
struct Stamps {
    failing: AtomicBool,
    seen: Mutex<Vec<(u32, chrono::DateTime<Utc>)>>,
}

impl Publisher for Stamps {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.seen
            .lock()
            .expect("stamps")
            .push((message.attempt, message.first_published_at));
        if self.failing.load(Ordering::SeqCst) {
            return Err(PublishError::Transient("the broker is down".into()));
        }
        Ok(())
    }
}

/// Without a broker, on every backend: the send time is stamped at the first claim, kept
/// by every retry, never the enqueue time, and renewed when an operator requeues the row
/// after it was parked.
async fn the_send_time_is_the_first_claim_kept_by_retries_and_renewed_by_a_requeue(
    backend: Backend,
) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let id = enqueue_held_back(&conn, "held.back").await;
        let publisher = Stamps {
            failing: AtomicBool::new(true),
            seen: Mutex::default(),
        };
        let relay = Relay::new(publisher)
            .with_options(RelayOptions {
                max_attempts: 2,
                backoff: Duration::from_millis(1),
                max_backoff: Duration::from_millis(1),
                ..RelayOptions::default()
            })
            .expect("options");
        let first_claim = Utc::now();
        for _ in 0..2 {
            relay.relay_once(&conn).await.expect("relay");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let seen = relay.publisher().seen.lock().expect("stamps").clone();
        assert_eq!(seen.len(), 2, "two attempts, then parked: {seen:?}");
        assert_eq!(seen[0].1, seen[1].1, "the retry keeps the first send time");
        assert!(
            seen[0].1 >= first_claim - chrono::Duration::milliseconds(1),
            "stamped at the first claim ({first_claim}), not the enqueue: {}",
            seen[0].1
        );

        // Parked for two days, then requeued by an operator: a fresh send time.
        let backend_kind = conn.get_database_backend();
        conn.execute_raw(stmt(
            backend_kind,
            "UPDATE outbox SET first_published_at = ?",
            vec![timestamp_value(
                backend_kind,
                Utc::now() - chrono::Duration::days(2),
            )],
        ))
        .await
        .expect("age the stamp");
        relay.publisher().failing.store(false, Ordering::SeqCst);
        let requeued = Utc::now();
        assert!(requeue_dead_message(&conn, id).await.expect("requeue"));
        let report = relay.relay_once(&conn).await.expect("relay");
        assert_eq!(report.published, 1);
        let seen = relay.publisher().seen.lock().expect("stamps").clone();
        assert!(
            seen[2].1 >= requeued - chrono::Duration::milliseconds(1),
            "a requeued row is stamped again at its next claim: {}",
            seen[2].1
        );
        conn.close().await.ok();
    })
    .await;
}

/// `AddOutboxFirstPublished` runs after `CreateOutbox`, keeps the rows, and its absence is
/// what the startup check names.
async fn the_first_publish_column_comes_from_its_own_migration(backend: Backend) {
    use sea_orm_inbox::{SchemaError, verify_outbox_schema};
    use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        enqueue_held_back(&conn, "kept").await;
        verify_outbox_schema(&conn).await.expect("fully migrated");
        MigratorWithOutbox::down(&conn, Some(3))
            .await
            .expect("roll back OutboxDueIndex, OutboxFillfactor and AddOutboxFirstPublished");
        let found = verify_outbox_schema(&conn).await;
        assert!(
            matches!(&found, Err(SchemaError::OutboxColumns { missing }) if missing == "first_published_at"),
            "{found:?}"
        );
        let message = found.err().map(|err| err.to_string()).unwrap_or_default();
        assert!(message.contains("AddOutboxFirstPublished"), "{message}");
        MigratorWithOutbox::up(&conn, None)
            .await
            .expect("run AddOutboxFirstPublished again");
        verify_outbox_schema(&conn).await.expect("fully migrated again");
        assert_eq!(
            inbox_tests::scalar_i64(&conn, "SELECT COUNT(*) FROM outbox").await,
            1,
            "the row stayed"
        );
        conn.close().await.ok();
    })
    .await;
}

inbox_tests::on_every_backend!(
    the_send_time_is_the_first_claim_kept_by_retries_and_renewed_by_a_requeue,
    the_first_publish_column_comes_from_its_own_migration,
);

mod rabbitmq_suite {
    use super::*;
    inbox_tests::on_every_backend!(needs(inbox_amqp, "set INBOX_TEST_AMQP_URL");
        rabbitmq_held_back_message_is_processed_with_its_first_publish_time);
}

mod jetstream_suite {
    use super::*;
    inbox_tests::on_every_backend!(needs(inbox_nats, "set INBOX_TEST_NATS_URL");
        jetstream_held_back_message_is_processed_with_its_first_publish_time);
}

/// A send-time header no date can be read from is refused as permanent (terminated), not
/// guessed; a message without it keeps the stream's stored time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_nats), ignore = "set INBOX_TEST_NATS_URL")]
async fn jetstream_delivery_reads_the_send_time_header_or_refuses_it() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use async_nats::jetstream::message::PublishMessage;
    use async_nats::jetstream::stream;
    let client = async_nats::connect(env("INBOX_TEST_NATS_URL"))
        .await
        .expect("connect to NATS");
    let js = async_nats::jetstream::new(client);
    let run = uuid::Uuid::new_v4().simple().to_string();
    let (name, subject) = (
        format!("OUTBOX_SENT_AT_HDR_{run}"),
        format!("outbox-sent-at-hdr.{run}"),
    );
    let created = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            max_age: Duration::from_secs(600),
            ..stream::Config::default()
        })
        .await
        .expect("create the stream");
    for (id, sent_at) in [
        ("bad-time", Some("yesterday")),
        ("set-time", Some("2026-01-02T03:04:05.000006Z")),
        ("no-time", None),
    ] {
        let mut publish = PublishMessage::build().payload("x".into()).message_id(id);
        if let Some(sent_at) = sent_at {
            publish = publish.header(jetstream::SENT_AT_HEADER, sent_at);
        }
        js.send_publish(subject.clone(), publish)
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    let consumer = created
        .create_consumer(pull::Config {
            durable_name: Some("hdr".into()),
            ack_policy: AckPolicy::Explicit,
            ..pull::Config::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut next = async || {
        tokio::time::timeout(DEADLINE, messages.next())
            .await
            .expect("a delivery in time")
            .expect("a delivery")
            .expect("delivered")
    };
    let bad = jetstream::delivery(&next().await);
    assert!(
        matches!(&bad, Err(err @ InboxError::OutOfRange { .. }) if err.is_permanent()),
        "{bad:?}"
    );
    let set = jetstream::delivery(&next().await).expect("a delivery");
    assert_eq!(
        set.sent_time(),
        Some("2026-01-02T03:04:05.000006Z".parse().expect("a time"))
    );
    let before = Utc::now() - chrono::Duration::seconds(60);
    let stored = jetstream::delivery(&next().await).expect("a delivery");
    assert!(
        stored.sent_time().is_some_and(|at| at > before),
        "the stream's stored time: {:?}",
        stored.sent_time()
    );
    js.delete_stream(&name).await.ok();
}
