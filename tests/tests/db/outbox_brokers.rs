//! The outbox end to end: a relay publishes through RabbitMQ (publisher confirms) and
//! NATS JetStream (publish acks); a downstream consumer with its own inbox applies each
//! message's effect once, although every message was published twice (a relay that lost
//! its marks).

use futures_util::StreamExt;
use inbox_tests::{
    Backend, CutProxy, TestDb, create_accounts, credit, scalar_i64, with_migrated_outbox_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::jetstream::JetStreamPublisher;
use sea_orm_inbox::rabbitmq::RabbitMqPublisher;
use sea_orm_inbox::{
    Inbox, OutboxExt, OutgoingMessage, ProcessError, Publisher, Relay, RelayOptions, Settlement,
    jetstream, list_dead_messages, outbox_backlog, rabbitmq,
};
use std::time::Duration;

const MESSAGES: usize = 10;
const DEADLINE: Duration = Duration::from_secs(30);

fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("set {var} to run this test"))
}

/// lapin's connection properties on the test's tokio runtime.
fn amqp_properties() -> lapin::ConnectionProperties {
    lapin::ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// A connection to RabbitMQ, a channel, and a queue of the test's own named `prefix` and a
/// random suffix, which deletes itself a minute after the test left it.
async fn rabbitmq_queue(prefix: &str) -> (lapin::Connection, lapin::Channel, String) {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable};
    let amqp = lapin::Connection::connect(&env("INBOX_TEST_AMQP_URL"), amqp_properties())
        .await
        .expect("connect to RabbitMQ");
    let queue = format!("{prefix}{}", uuid::Uuid::new_v4().simple());
    let channel = amqp.create_channel().await.expect("channel");
    let mut arguments = FieldTable::default();
    arguments.insert("x-expires".into(), AMQPValue::LongUInt(60_000));
    channel
        .queue_declare(&queue, QueueDeclareOptions::default(), arguments)
        .await
        .expect("declare the queue");
    (amqp, channel, queue)
}

/// Enqueues the messages, relays them, then forgets they were sent (the marks a dying
/// relay never wrote) and relays them again: every message goes out twice, same id.
async fn publish_twice<P: Publisher>(
    db: &TestDb,
    conn: &DatabaseConnection,
    relay: Relay<P>,
    destination: &str,
) {
    let txn = conn.begin().await.expect("begin");
    for n in 0..MESSAGES {
        txn.enqueue(OutgoingMessage::new(destination, format!("credit {n}")))
            .await
            .expect("enqueue");
    }
    txn.commit().await.expect("commit");
    let relay_pool = db.connect().await;
    for round in 0..2 {
        let report = relay.relay_once(&relay_pool).await.expect("relay");
        assert_eq!(
            report.published, MESSAGES as u64,
            "round {round}: {report:?}"
        );
        conn.execute_unprepared("UPDATE outbox SET sent_at = NULL")
            .await
            .expect("forget the marks");
    }
    relay_pool.close().await.ok();
}

/// The downstream consumer: `Inbox::process` crediting account 1 once per message.
async fn handle(
    inbox: &Inbox,
    conn: &DatabaseConnection,
    delivery: Result<sea_orm_inbox::Delivery, sea_orm_inbox::InboxError>,
) -> Result<sea_orm_inbox::Outcome<()>, ProcessError<sea_orm::DbErr>> {
    match delivery {
        Ok(delivery) => {
            inbox
                .process(conn, delivery, |txn| {
                    Box::pin(async move { credit(txn, 1).await })
                })
                .await
        }
        Err(err) => Err(ProcessError::Inbox(err)),
    }
}

async fn rabbitmq_end_to_end(backend: Backend) {
    use lapin::options::BasicConsumeOptions;
    use lapin::types::FieldTable;
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let (amqp, _, queue) = rabbitmq_queue("outbox-e2e-").await;
        let url = env("INBOX_TEST_AMQP_URL");
        let publisher = RabbitMqPublisher::connect(&url, amqp_properties(), "")
            .await
            .expect("the publisher's connection");
        publish_twice(db, &conn, Relay::new(publisher), &queue).await;

        let inbox = Inbox::new("downstream.credit").expect("valid name");
        let consuming = amqp.create_channel().await.expect("channel");
        let mut consumer = consuming
            .basic_consume(
                &queue,
                "e2e",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let consumed = async {
            for _ in 0..2 * MESSAGES {
                let message = consumer
                    .next()
                    .await
                    .expect("a delivery")
                    .expect("delivered");
                let result = handle(&inbox, &conn, rabbitmq::delivery(&message)).await;
                assert_eq!(Settlement::of(&result), Settlement::Ack, "{result:?}");
                rabbitmq::settle(&message, Settlement::of(&result))
                    .await
                    .expect("ack");
            }
        };
        tokio::time::timeout(DEADLINE, consumed)
            .await
            .expect("every copy arrives");
        let metrics = inbox.metrics().snapshot();
        assert_eq!(
            (metrics.processed, metrics.duplicates),
            (MESSAGES as u64, MESSAGES as u64)
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            MESSAGES as i64,
            "one effect per message"
        );
        consuming
            .queue_delete(&queue, lapin::options::QueueDeleteOptions::default())
            .await
            .ok();
        amqp.close(200, "test over").await.ok();
    })
    .await;
}

/// Issue 19: the relay's RabbitMQ connection is cut (a broker restart, a load balancer
/// forgetting its flows) between two batches. The publisher opens a new connection and
/// channel, in confirm mode, and the rows enqueued after the cut go out: at most the one
/// publish that found the channel dead fails, and no row is parked.
async fn rabbitmq_publisher_reconnects_after_a_cut(backend: Backend) {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let (admin, channel, queue) = rabbitmq_queue("outbox-cut-").await;
        let proxy = CutProxy::start(&env("INBOX_TEST_AMQP_URL")).await;
        let publisher = RabbitMqPublisher::connect(proxy.url(), amqp_properties(), "")
            .await
            .expect("connect to RabbitMQ through the proxy");
        let relay = Relay::new(publisher)
            .with_options(RelayOptions {
                max_attempts: 3,
                backoff: Duration::from_millis(50),
                max_backoff: Duration::from_millis(100),
                ..RelayOptions::default()
            })
            .expect("valid options");
        let enqueue = async |count: usize| {
            let txn = conn.begin().await.expect("begin");
            for n in 0..count {
                txn.enqueue(OutgoingMessage::new(&queue, format!("credit {n}")))
                    .await
                    .expect("enqueue");
            }
            txn.commit().await.expect("commit");
        };
        enqueue(MESSAGES).await;
        let report = relay.relay_once(&conn).await.expect("relay");
        assert_eq!(report.published, MESSAGES as u64, "{report:?}");

        assert_eq!(proxy.cut(), 1, "the relay's one connection was cut");
        enqueue(MESSAGES).await;
        // Rounds until nothing is pending: the rows are sent, or parked after their
        // attempts (3, 50 + 100 ms apart).
        let started = std::time::Instant::now();
        while outbox_backlog(&conn).await.expect("backlog").pending > 0 {
            assert!(started.elapsed() < DEADLINE, "rows still pending");
            relay.relay_once(&conn).await.expect("relay");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let metrics = relay.metrics().snapshot();
        let dead = list_dead_messages(&conn, 1).await.expect("dead rows");
        assert!(
            dead.is_empty(),
            "no row parked after the cut: {metrics:?}, first dead row {dead:?}"
        );
        assert_eq!(metrics.published, 2 * MESSAGES as u64, "{metrics:?}");
        assert!(
            metrics.failed <= 1,
            "at most the publish that found the channel dead failed: {metrics:?}"
        );
        let queued = channel
            .queue_declare(
                &queue,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("the queue's state")
            .message_count();
        assert_eq!(
            queued,
            2 * MESSAGES as u32,
            "every message reached the queue"
        );
        channel
            .queue_delete(&queue, QueueDeleteOptions::default())
            .await
            .ok();
        admin.close(200, "test over").await.ok();
    })
    .await;
}

async fn jetstream_end_to_end(backend: Backend) {
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
        let (name, subject) = (format!("OUTBOX_E2E_{run}"), format!("outbox-e2e.{run}"));
        let mut created = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                max_age: Duration::from_secs(600),
                duplicate_window: Duration::from_secs(120),
                ..stream::Config::default()
            })
            .await
            .expect("create the stream");
        publish_twice(
            db,
            &conn,
            Relay::new(JetStreamPublisher::new(js.clone())),
            &subject,
        )
        .await;
        let stored = created.info().await.expect("stream info").state.messages;
        assert_eq!(
            stored, MESSAGES as u64,
            "JetStream dropped the republished copies by Nats-Msg-Id"
        );

        let inbox = Inbox::new("downstream.credit").expect("valid name");
        let consumer = created
            .create_consumer(pull::Config {
                durable_name: Some("e2e".into()),
                ack_policy: AckPolicy::Explicit,
                ..pull::Config::default()
            })
            .await
            .expect("consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let consumed = async {
            for _ in 0..MESSAGES {
                let message = messages
                    .next()
                    .await
                    .expect("a delivery")
                    .expect("delivered");
                let result = handle(&inbox, &conn, jetstream::delivery(&message)).await;
                assert_eq!(Settlement::of(&result), Settlement::Ack, "{result:?}");
                jetstream::settle(&message, Settlement::of(&result))
                    .await
                    .expect("ack");
            }
        };
        tokio::time::timeout(DEADLINE, consumed)
            .await
            .expect("every message arrives");
        assert_eq!(inbox.metrics().snapshot().processed, MESSAGES as u64);
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            MESSAGES as i64,
            "one effect per message"
        );
        js.delete_stream(&name).await.ok();
    })
    .await;
}

mod rabbitmq_suite {
    use super::*;
    inbox_tests::on_every_backend!(needs(inbox_amqp, "set INBOX_TEST_AMQP_URL");
        rabbitmq_end_to_end, rabbitmq_publisher_reconnects_after_a_cut);
}

mod jetstream_suite {
    use super::*;
    inbox_tests::on_every_backend!(needs(inbox_nats, "set INBOX_TEST_NATS_URL"); jetstream_end_to_end);
}
