//! The Kafka consumer (`sea_orm_inbox::kafka`, issue 31): the offset stored in the handler's
//! transaction with a compare-and-set, duplicates that still advance it, and the consumer
//! loop against a real Kafka-protocol broker (Tansu, `tests/cluster/kafka.sh`).
//!
//! The `offsets::` tests build records by hand and need no broker; the `broker::` tests
//! need `INBOX_TEST_KAFKA_BOOTSTRAP` (the address `tests/cluster/kafka.sh start` prints) at
//! build time.

use inbox_tests::{Backend, TestDb, run, scalar_i64, stmt, with_migrated_db};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::{Message, Timestamp};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::kafka::{self, KafkaInbox, RecordOutcome, advance_offset, stored_offset};
use sea_orm_inbox::{HandlerFuture, Inbox, MessageId, ObservedTransaction};
use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const GROUP: &str = "billing-group";

/// A migrator with the opt-in Kafka offset table, as an application adds it.
struct KafkaMigrator;

impl MigratorTrait for KafkaMigrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(sea_orm_inbox_migration::CreateKafkaOffsets)]
    }

    fn migration_table_name() -> DynIden {
        "seaql_migrations_kafka".into_iden()
    }
}

/// A pool to `db` with the offset table and an `effect` table the handler appends to
/// (no unique key: a record applied twice shows as two rows).
async fn prepared(db: &TestDb) -> DatabaseConnection {
    let conn = db.connect().await;
    KafkaMigrator::up(&conn, None)
        .await
        .expect("run CreateKafkaOffsets");
    run(
        &conn,
        "CREATE TABLE effect (message_key VARCHAR(100) NOT NULL, kafka_offset BIGINT NOT NULL)",
    )
    .await;
    conn
}

/// The handler: one `effect` row per record, keyed by its id header, through the
/// transaction.
fn append_effect<'t>(
    txn: &'t ObservedTransaction,
    record: Arc<OwnedMessage>,
) -> HandlerFuture<'t, (), BoxError> {
    Box::pin(async move {
        let key = header(&record, kafka::DEFAULT_ID_HEADER).unwrap_or_default();
        txn.execute_raw(stmt(
            txn.get_database_backend(),
            "INSERT INTO effect (message_key, kafka_offset) VALUES (?, ?)",
            vec![key.into(), record.offset().into()],
        ))
        .await?;
        Ok(())
    })
}

fn header(record: &OwnedMessage, name: &str) -> Option<String> {
    use rdkafka::message::Headers;
    record.headers()?.iter().find_map(|header| {
        (header.key == name)
            .then(|| {
                header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
            .flatten()
    })
}

fn record(topic: &str, partition: i32, offset: i64, id: &str) -> Arc<OwnedMessage> {
    let headers = OwnedHeaders::new().insert(Header {
        key: kafka::DEFAULT_ID_HEADER,
        value: Some(id),
    });
    Arc::new(OwnedMessage::new(
        Some(b"{}".to_vec()),
        None,
        topic.to_owned(),
        Timestamp::CreateTime(chrono::Utc::now().timestamp_millis()),
        partition,
        offset,
        Some(headers),
    ))
}

async fn effects(conn: &DatabaseConnection) -> (i64, i64) {
    (
        scalar_i64(conn, "SELECT COUNT(*) FROM effect").await,
        scalar_i64(conn, "SELECT COUNT(DISTINCT message_key) FROM effect").await,
    )
}

#[test]
fn the_id_header_then_cloud_events_then_the_position() {
    let plain = OwnedMessage::new(None, None, "t".into(), Timestamp::NotAvailable, 2, 7, None);
    assert_eq!(
        kafka::message_id(&plain, "message-id").unwrap(),
        MessageId::from_kafka("t", 2, 7).unwrap()
    );
    let cloud = OwnedMessage::new(
        None,
        None,
        "t".into(),
        Timestamp::CreateTime(1_700_000_000_000),
        2,
        7,
        Some(
            OwnedHeaders::new()
                .insert(Header {
                    key: "ce_id",
                    value: Some("e-1"),
                })
                .insert(Header {
                    key: "ce_source",
                    value: Some("/orders"),
                }),
        ),
    );
    assert_eq!(
        kafka::message_id(&cloud, "message-id").unwrap(),
        MessageId::from_cloud_event("/orders", "e-1").unwrap()
    );
    let delivery = kafka::delivery(&cloud, "message-id").unwrap();
    assert_eq!(
        delivery.sent_time().map(|at| at.timestamp_millis()),
        Some(1_700_000_000_000)
    );
    let named = record("t", 2, 7, "order-42");
    assert_eq!(
        kafka::message_id(named.as_ref(), "message-id").unwrap(),
        MessageId::from_broker_id("order-42").unwrap()
    );
    // A configured header other than the default one.
    assert_eq!(
        kafka::message_id(named.as_ref(), "x-id").unwrap(),
        MessageId::from_kafka("t", 2, 7).unwrap()
    );
}

/// A record sent twice (two offsets, one id): applied once, and the duplicate still
/// advances the stored offset, so the partition does not stall on it.
async fn duplicate_advances_the_offset(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = prepared(db).await;
        let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), GROUP).unwrap();
        let mut handler = append_effect;
        let first = kafka
            .process_record(&conn, &record("pay", 0, 0, "m-1"), None, &mut handler)
            .await
            .unwrap();
        assert_eq!(first, RecordOutcome::Processed);
        let second = kafka
            .process_record(&conn, &record("pay", 0, 1, "m-1"), Some(1), &mut handler)
            .await
            .unwrap();
        assert_eq!(second, RecordOutcome::Duplicate);
        assert_eq!(
            stored_offset(&conn, GROUP, "pay", 0).await.unwrap(),
            Some(2)
        );
        assert_eq!(effects(&conn).await, (1, 1));
    })
    .await
}

/// The partition was taken (another consumer moved the stored offset on): the stale
/// consumer's record applies nothing, marker and business write included.
async fn stale_consumer_applies_nothing(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = prepared(db).await;
        let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), GROUP).unwrap();
        let mut handler = append_effect;
        kafka
            .process_record(&conn, &record("pay", 0, 0, "m-1"), None, &mut handler)
            .await
            .unwrap();
        // The new owner, on another connection, processed offsets 1..5.
        let other = db.connect().await;
        advance_offset(&other, GROUP, "pay", 0, Some(1), 5)
            .await
            .unwrap();
        let stale = kafka
            .process_record(&conn, &record("pay", 0, 1, "m-2"), Some(1), &mut handler)
            .await
            .unwrap();
        assert_eq!(stale, RecordOutcome::OffsetMoved);
        assert_eq!(
            effects(&conn).await,
            (1, 1),
            "the stale record applied its effect"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            1,
            "the stale record left its marker"
        );
        assert_eq!(
            stored_offset(&conn, GROUP, "pay", 0).await.unwrap(),
            Some(5)
        );
        // Two consumers both seeing no row yet: the second first write is fenced too.
        kafka
            .process_record(&conn, &record("pay", 1, 0, "m-3"), None, &mut handler)
            .await
            .unwrap();
        let racing = kafka
            .process_record(&conn, &record("pay", 1, 1, "m-4"), None, &mut handler)
            .await
            .unwrap();
        assert_eq!(racing, RecordOutcome::OffsetMoved);
        assert_eq!(effects(&conn).await, (2, 2));
        other.close().await.ok();
    })
    .await
}

inbox_tests::on_every_backend!(
    duplicate_advances_the_offset,
    stale_consumer_applies_nothing
);

mod broker {
    use super::*;
    use inbox_tests::kafka::{
        create_topic, end_offsets, kafka_consumer_config, produce_twice, stored_offsets,
    };
    use rdkafka::consumer::Consumer;
    use sea_orm_inbox::kafka::{KafkaConsumer, RunReport};
    use std::time::{Duration, Instant};

    const PARTITIONS: i32 = 2;

    fn consumer(kafka: &KafkaInbox, topic: &str) -> KafkaConsumer {
        let consumer = kafka.consumer(&kafka_consumer_config()).expect("consumer");
        consumer.subscribe(&[topic]).expect("subscribe");
        consumer
    }

    /// Runs the loop until the stored offsets reach the ends (or 60 s pass).
    async fn consume_to_the_end(
        kafka: &KafkaInbox,
        conn: &DatabaseConnection,
        topic: &str,
    ) -> RunReport {
        let ends = end_offsets(topic, PARTITIONS);
        let consumer = consumer(kafka, topic);
        let watcher = conn.clone();
        let watched = topic.to_owned();
        let group = kafka.group().to_owned();
        // A task of its own: the loop polls its shutdown future only while waiting for a
        // record, and a watcher suspended mid-query would hold SQLite's one connection.
        let watch = tokio::spawn(async move {
            let started = Instant::now();
            while stored_offsets(&watcher, &group, &watched, PARTITIONS).await != ends
                && started.elapsed() < Duration::from_secs(90)
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        // The deprecated one-record loop on purpose: it stays supported until it is removed,
        // and this suite is its proof (kafka_group.rs proves KafkaGroupConsumer).
        #[allow(deprecated)]
        let report = kafka
            .run(&consumer, conn, append_effect, watch)
            .await
            .expect("the consumer loop");
        report
    }

    /// Every record produced twice: effects == distinct messages on each backend, the
    /// stored offsets at the ends; a restarted consumer resumes from the stored offsets
    /// and applies nothing twice.
    pub(super) async fn every_record_twice_applies_once(backend: Backend) {
        with_migrated_db(backend, async |db| {
            let conn = prepared(db).await;
            let topic = format!("pay-{}", uuid::Uuid::new_v4().simple());
            create_topic(&topic, PARTITIONS).await;
            // A group of its own: the backends' tests run at once, and one group over
            // several topics would rebalance each time another test's consumer joins.
            let group = format!("g-{topic}");
            let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), &group).unwrap();

            produce_twice(&topic, 0..40).await;
            let report = consume_to_the_end(&kafka, &conn, &topic).await;
            assert_eq!(
                stored_offsets(&conn, &group, &topic, PARTITIONS).await,
                end_offsets(&topic, PARTITIONS),
                "{report:?}"
            );
            assert_eq!(effects(&conn).await, (40, 40), "{report:?}");
            assert_eq!((report.processed, report.duplicates), (40, 40));

            // A restarted consumer (a new client in the same group) resumes from the
            // database's offsets, whatever Kafka's committed ones say.
            produce_twice(&topic, 40..60).await;
            let report = consume_to_the_end(&kafka, &conn, &topic).await;
            assert_eq!(
                stored_offsets(&conn, &group, &topic, PARTITIONS).await,
                end_offsets(&topic, PARTITIONS),
                "{report:?}"
            );
            assert_eq!(effects(&conn).await, (60, 60), "{report:?}");
            assert_eq!((report.processed, report.duplicates), (20, 20));
        })
        .await
    }
}

mod with_broker {
    use super::broker::every_record_twice_applies_once;
    inbox_tests::on_every_backend!(
        needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
        every_record_twice_applies_once
    );
}
