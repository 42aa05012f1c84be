//! The outbox end to end: a relay publishes through RabbitMQ (publisher confirms) and
//! NATS JetStream (publish acks); a downstream consumer with its own inbox applies each
//! message's effect once, although every message was published twice (a relay that lost
//! its marks).

use futures_util::StreamExt;
use inbox_tests::{Backend, TestDb, create_accounts, credit, scalar_i64, with_migrated_outbox_db};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::jetstream::JetStreamPublisher;
use sea_orm_inbox::rabbitmq::RabbitMqPublisher;
use sea_orm_inbox::{
    Inbox, OutboxExt, OutgoingMessage, ProcessError, Publisher, Relay, Settlement, jetstream,
    rabbitmq,
};
use std::time::Duration;

const MESSAGES: usize = 10;
const DEADLINE: Duration = Duration::from_secs(30);

fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| panic!("set {var} to run this test"))
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
    use lapin::options::{BasicConsumeOptions, ConfirmSelectOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let properties = lapin::ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let amqp = lapin::Connection::connect(&env("INBOX_TEST_AMQP_URL"), properties)
            .await
            .expect("connect to RabbitMQ");
        let queue = format!("outbox-e2e-{}", uuid::Uuid::new_v4().simple());
        let channel = amqp.create_channel().await.expect("channel");
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongUInt(60_000));
        channel
            .queue_declare(&queue, QueueDeclareOptions::default(), arguments)
            .await
            .expect("declare the queue");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        publish_twice(
            db,
            &conn,
            Relay::new(RabbitMqPublisher::new(channel, "")),
            &queue,
        )
        .await;

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
    inbox_tests::on_every_backend!(needs(inbox_amqp, "set INBOX_TEST_AMQP_URL"); rabbitmq_end_to_end);
}

mod jetstream_suite {
    use super::*;
    inbox_tests::on_every_backend!(needs(inbox_nats, "set INBOX_TEST_NATS_URL"); jetstream_end_to_end);
}
