//! Exactly once end to end over Kafka, with the relay SIGKILLed twice:
//!
//! consume `<run>` (a [`KafkaInbox`], offsets in the handler's transaction) -> one business
//! row and one outbox event (`txn.enqueue`, its id derived from the input's) in the
//! handler's transaction -> a relay ([`KafkaPublisher`]) publishes the events to
//! `<run>-out` -> a downstream consumer with its own inbox and offsets writes one effect
//! row per event.
//!
//! The relay runs in child processes (this test binary again, on [`child_relay`]) that
//! stop inside their publisher after a few delivery reports, before marking anything
//! sent, and are killed there with SIGKILL, twice; a relay in the test's process then
//! publishes what is left, the killed children's leased rows again (same message ids)
//! once their leases end. Every input has one business row, one sent outbox row and one
//! downstream effect, however many copies `<run>-out` holds.

use inbox_tests::kafka::{
    connect_with_offsets, create_topic, end_offset, header, kafka_config, kafka_consumer_config,
    unique_topic,
};
use inbox_tests::{
    Backend, StopsAfterConfirms, TestDb, connect_url, on_every_backend, run,
    run_and_kill_child_relay, scalar_i64, stmt, with_migrated_outbox_db,
};
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::kafka::{self, KafkaConsumer, KafkaInbox, KafkaPublisher, stored_offset};
use sea_orm_inbox::{
    HandlerFuture, Inbox, ObservedTransaction, OutboxExt, OutgoingMessage, Relay, RelayOptions,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Input records: enough that both kills land mid-stream.
const RECORDS: usize = 200;
const PARTITIONS: i32 = 2;
/// Delivery reports a child relay gets before it stops, unmarked, and is killed.
const CHILD_CONFIRMS: usize = 8;
/// The relays' lease: how long a killed child's rows wait before they are published again.
const LEASE: Duration = Duration::from_secs(3);
const DEADLINE: Duration = Duration::from_secs(90);
/// The child relay's database URL, set only for the child process.
const CHILD_DB_URL: &str = "INBOX_KAFKA_E2E_CHILD_DB_URL";
const CHILD_TEST: &str = "kafka_end_to_end::child_relay";
const UPSTREAM: &str = "e2e.orders";
const DOWNSTREAM: &str = "e2e.downstream";

/// The output topic of input topic `topic`.
fn output_of(topic: &str) -> String {
    format!("{topic}-out")
}

/// The upstream handler: a business row, and the event for the output topic, keyed as the
/// input, its id derived from the input's, in the handler's transaction.
fn order_and_event<'t>(
    txn: &'t ObservedTransaction,
    record: Arc<OwnedMessage>,
) -> HandlerFuture<'t, (), BoxError> {
    Box::pin(async move {
        let id = header(&record, kafka::DEFAULT_ID_HEADER).unwrap_or_default();
        txn.execute_raw(stmt(
            txn.get_database_backend(),
            "INSERT INTO e2e_order (input_id) VALUES (?)",
            vec![id.clone().into()],
        ))
        .await?;
        let incoming = kafka::message_id(record.as_ref(), kafka::DEFAULT_ID_HEADER)?;
        let mut event = OutgoingMessage::new(output_of(record.topic()), id.clone())
            .message_id(incoming.outgoing(UPSTREAM, 0));
        if let Some(key) = record.key() {
            event = event.key(String::from_utf8_lossy(key));
        }
        txn.enqueue(event).await?;
        Ok(())
    })
}

/// The downstream handler: one effect row per event (no unique key: an event applied
/// twice shows as two rows).
fn effect<'t>(
    txn: &'t ObservedTransaction,
    record: Arc<OwnedMessage>,
) -> HandlerFuture<'t, (), BoxError> {
    Box::pin(async move {
        let input = String::from_utf8_lossy(record.payload().unwrap_or_default()).into_owned();
        txn.execute_raw(stmt(
            txn.get_database_backend(),
            "INSERT INTO e2e_effect (input_id) VALUES (?)",
            vec![input.into()],
        ))
        .await?;
        Ok(())
    })
}

fn relay_options() -> RelayOptions {
    RelayOptions {
        batch_size: 10,
        lease: LEASE,
        publish_timeout: Duration::from_secs(2),
        backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        poll_interval: Duration::from_millis(100),
        ..RelayOptions::default()
    }
}

fn publisher() -> KafkaPublisher {
    KafkaPublisher::new(kafka_config().set("message.timeout.ms", "1500")).expect("Kafka publisher")
}

/// The child relay process: relays the test's outbox until it stops in its publisher
/// (see [`StopsAfterConfirms`]) and is killed there. Only the end-to-end test runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the Kafka end-to-end test's child relay: that test runs it in a process of its own and kills it"]
async fn child_relay() {
    let url = std::env::var(CHILD_DB_URL).unwrap_or_else(|_| {
        panic!("{CHILD_TEST} is the Kafka end-to-end test's child relay: only that test runs it")
    });
    let db = connect_url(&url, 2).await;
    let relay = Relay::new(StopsAfterConfirms::new(publisher(), CHILD_CONFIRMS))
        .with_options(relay_options())
        .expect("valid options");
    relay.run(&db, std::future::pending()).await;
}

fn consumer(kafka: &KafkaInbox, topic: &str) -> KafkaConsumer {
    let consumer = kafka.consumer(&kafka_consumer_config()).expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    consumer
}

/// Runs `kafka`'s loop on `topic` with `handler` in a task until `stop` fires.
fn consume(
    kafka: KafkaInbox,
    conn: DatabaseConnection,
    topic: String,
    handler: fn(&ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'_, (), BoxError>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<kafka::RunReport> {
    tokio::spawn(async move {
        let consumer = consumer(&kafka, &topic);
        let mut stop = stop;
        // The deprecated one-record loop on purpose: the end-to-end proof of the loop that
        // stays supported until it is removed (kafka_group.rs proves KafkaGroupConsumer).
        #[allow(deprecated)]
        let report = kafka
            .run(&consumer, &conn, handler, async move {
                stop.wait_for(|stop| *stop).await.ok();
            })
            .await
            .expect("the consumer loop");
        report
    })
}

async fn produce_inputs(topic: &str) {
    let producer: FutureProducer = kafka_config().create().expect("producer");
    for n in 0..RECORDS {
        let id = format!("in-{n}");
        producer
            .send(
                FutureRecord::to(topic)
                    .key(&format!("customer-{}", n % 7))
                    .payload("{}")
                    .headers(OwnedHeaders::new().insert(Header {
                        key: kafka::DEFAULT_ID_HEADER,
                        value: Some(&id),
                    })),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(err, _)| err)
            .expect("produce an input");
    }
}

/// Whether every stored offset of `group` on `topic` is at the partition's end.
async fn consumed_to_the_end(conn: &DatabaseConnection, group: &str, topic: &str) -> bool {
    for partition in 0..PARTITIONS {
        let stored = stored_offset(conn, group, topic, partition)
            .await
            .expect("stored offset")
            .unwrap_or(0);
        if stored != end_offset(topic, partition) {
            return false;
        }
    }
    true
}

async fn until(conn: &DatabaseConnection, what: &str, sql: &str, at_least: i64) {
    let started = Instant::now();
    while scalar_i64(conn, sql).await < at_least {
        assert!(
            started.elapsed() < DEADLINE,
            "{what}: not reached in {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn kill_child_relay(db: &TestDb) {
    run_and_kill_child_relay(CHILD_TEST, &[(CHILD_DB_URL, db.url())], CHILD_CONFIRMS).await;
}

async fn exactly_once_through_a_killed_relay(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = connect_with_offsets(db).await;
        run(&conn, "CREATE TABLE e2e_order (input_id VARCHAR(40) NOT NULL)").await;
        run(&conn, "CREATE TABLE e2e_effect (input_id VARCHAR(40) NOT NULL)").await;
        let input = unique_topic("e2e");
        let output = output_of(&input);
        create_topic(&input, PARTITIONS).await;
        create_topic(&output, PARTITIONS).await;
        produce_inputs(&input).await;
        let started = Instant::now();

        let (stop, stopped) = tokio::sync::watch::channel(false);
        let upstream = KafkaInbox::new(Inbox::new(UPSTREAM).unwrap(), format!("up-{input}"))
            .unwrap();
        let downstream =
            KafkaInbox::new(Inbox::new(DOWNSTREAM).unwrap(), format!("down-{input}")).unwrap();
        let upstream_task = consume(
            upstream.clone(),
            db.connect().await,
            input.clone(),
            order_and_event,
            stopped.clone(),
        );
        let downstream_task = consume(
            downstream.clone(),
            db.connect().await,
            output.clone(),
            effect,
            stopped,
        );

        // Two relays killed between a delivery report and their marks, mid-stream.
        until(&conn, "events enqueued", "SELECT COUNT(*) FROM outbox", 40).await;
        kill_child_relay(db).await;
        kill_child_relay(db).await;
        let relay = Relay::new(publisher())
            .with_options(relay_options())
            .expect("valid options");
        let relay_pool = db.connect().await;
        let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
        let relay_task = tokio::spawn(async move {
            relay
                .run(&relay_pool, async move {
                    relay_stopped.await.ok();
                })
                .await;
        });

        let records = RECORDS as i64;
        until(&conn, "events sent", "SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL", records).await;
        until(&conn, "effects", "SELECT COUNT(DISTINCT input_id) FROM e2e_effect", records).await;
        let settled = Instant::now();
        while !(consumed_to_the_end(&conn, upstream.group(), &input).await
            && consumed_to_the_end(&conn, downstream.group(), &output).await)
        {
            assert!(settled.elapsed() < DEADLINE, "the consumers did not reach the ends");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop_relay.send(()).ok();
        stop.send(true).ok();
        relay_task.await.expect("the relay task");
        let up = upstream_task.await.expect("the upstream task");
        let down = downstream_task.await.expect("the downstream task");

        let copies: i64 = (0..PARTITIONS).map(|p| end_offset(&output, p)).sum();
        let line = format!(
            "kafka end to end ({backend:?}): {RECORDS} inputs, 2 relays SIGKILLed after {CHILD_CONFIRMS} delivery reports each, \
             {copies} records in the output topic, downstream {} processed / {} duplicates, upstream {:?}, in {:.1} s",
            down.processed, down.duplicates, up, started.elapsed().as_secs_f64()
        );
        println!("{line}");
        let count = |sql: &'static str| scalar_i64(&conn, sql);
        assert_eq!(count("SELECT COUNT(*) FROM e2e_order").await, records, "{line}");
        assert_eq!(count("SELECT COUNT(DISTINCT input_id) FROM e2e_order").await, records, "{line}");
        assert_eq!(count("SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL").await, records, "{line}");
        assert_eq!(count("SELECT COUNT(*) FROM outbox").await, records, "{line}");
        assert_eq!(count("SELECT COUNT(*) FROM e2e_effect").await, records, "an event applied twice: {line}");
        assert_eq!(count("SELECT COUNT(DISTINCT input_id) FROM e2e_effect").await, records, "{line}");
        // Each child's last delivery report at least was never marked.
        assert!(
            copies >= records + 2,
            "the killed relays' confirmed rows were not published again: {line}"
        );
        assert_eq!(down.processed, RECORDS as u64, "{line}");
        assert_eq!(down.duplicates, (copies - records) as u64, "{line}");
    })
    .await
}

on_every_backend!(
    needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
    exactly_once_through_a_killed_relay
);
