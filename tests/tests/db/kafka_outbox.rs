//! The outbox to Kafka (`sea_orm_inbox::kafka::KafkaPublisher`): rows go out on the
//! idempotent producer with the row's key as the record key (one key, one partition, in
//! the order enqueued), the message id and send time as headers, and a row is marked sent
//! only after its delivery report.

use chrono::{DateTime, Utc};
use inbox_tests::kafka::{create_topic, header, kafka_config, read_topic, unique_topic};
use inbox_tests::{Backend, on_every_backend, scalar_i64, with_migrated_outbox_db};
use rdkafka::Message;
use sea_orm::TransactionTrait;
use sea_orm_inbox::kafka::{self, KafkaPublisher};
use sea_orm_inbox::{MessageId, OutboxExt, OutgoingMessage, Relay, RelayOptions};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

const KEYS: usize = 3;
const PER_KEY: usize = 5;
const PARTITIONS: i32 = 4;

async fn rows_go_out_keyed_with_id_and_send_time(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let topic = unique_topic("outbox");
        create_topic(&topic, PARTITIONS).await;
        let mut ids = BTreeMap::new();
        // Interleaved keys, one transaction per message: the outbox's order per key.
        for n in 0..PER_KEY {
            for key in 0..KEYS {
                let message = OutgoingMessage::new(&topic, format!("{key}:{n}"))
                    .key(format!("key-{key}"))
                    .header("content-type", "text/plain");
                ids.insert(format!("{key}:{n}"), message.id());
                let txn = conn.begin().await.unwrap();
                txn.enqueue(message).await.unwrap();
                txn.commit().await.unwrap();
            }
        }
        let relay = Relay::new(KafkaPublisher::new(&kafka_config()).unwrap());
        // A claim takes the oldest unsent row of each key: one round per message of a key.
        let mut published = 0;
        for _ in 0..PER_KEY {
            published += relay.drain(&conn).await.expect("relay").published;
        }
        assert_eq!(published, (KEYS * PER_KEY) as u64);
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL").await,
            0
        );

        let records = read_topic(&topic, PARTITIONS).await;
        assert_eq!(records.len(), KEYS * PER_KEY);
        let mut partitions: HashMap<String, i32> = HashMap::new();
        let mut order: HashMap<String, Vec<usize>> = HashMap::new();
        for record in &records {
            let payload = std::str::from_utf8(record.payload().unwrap()).unwrap();
            let (key, n) = payload.split_once(':').unwrap();
            let record_key = std::str::from_utf8(record.key().unwrap()).unwrap();
            assert_eq!(record_key, format!("key-{key}"));
            let partition = *partitions
                .entry(record_key.to_owned())
                .or_insert(record.partition());
            assert_eq!(
                partition,
                record.partition(),
                "{record_key} on two partitions"
            );
            order
                .entry(record_key.to_owned())
                .or_default()
                .push(n.parse().unwrap());
            assert_eq!(
                header(record, kafka::DEFAULT_ID_HEADER),
                Some(ids[payload].to_string())
            );
            assert_eq!(
                header(record, "content-type").as_deref(),
                Some("text/plain")
            );
            let sent_at: DateTime<Utc> = header(record, kafka::SENT_AT_HEADER)
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(
                record.timestamp().to_millis(),
                Some(sent_at.timestamp_millis()),
                "the record's timestamp is the send time"
            );
            // What the consumer's inbox reads: its key from the id header (the same on
            // every publish of the row), the send time from the timestamp.
            let delivery = kafka::delivery(record, kafka::DEFAULT_ID_HEADER).unwrap();
            assert_eq!(
                delivery.message_id(),
                MessageId::from_broker_id(&ids[payload].to_string()).unwrap()
            );
            assert_eq!(
                delivery.sent_time().map(|at| at.timestamp_millis()),
                Some(sent_at.timestamp_millis())
            );
        }
        for (key, ns) in order {
            assert_eq!(ns, (0..PER_KEY).collect::<Vec<_>>(), "{key} out of order");
        }
    })
    .await
}

/// The broker is gone (nothing listens at its address): no delivery report within
/// `message.timeout.ms`, so the row stays unsent and is retried.
async fn a_failed_delivery_leaves_the_row_unsent(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let unreachable = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = unreachable.local_addr().unwrap();
        drop(unreachable);
        let txn = conn.begin().await.unwrap();
        txn.enqueue(OutgoingMessage::new("nowhere", "x").key("k"))
            .await
            .unwrap();
        txn.commit().await.unwrap();
        let publisher = KafkaPublisher::new(
            rdkafka::ClientConfig::new()
                .set("bootstrap.servers", address.to_string())
                .set("message.timeout.ms", "1500"),
        )
        .unwrap();
        let relay = Relay::new(publisher)
            .with_options(RelayOptions {
                publish_timeout: Duration::from_secs(5),
                ..RelayOptions::default()
            })
            .unwrap();
        let report = relay.relay_once(&conn).await.expect("relay");
        assert_eq!((report.published, report.failed), (0, 1), "{report:?}");
        assert_eq!(
            scalar_i64(
                &conn,
                "SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NULL"
            )
            .await,
            1,
            "the row was marked without a delivery report"
        );
    })
    .await
}

/// The producer's largest record: librdkafka's smallest allowed `message.max.bytes`
/// is 1,000.
const MAX_RECORD_BYTES: usize = 10_000;

/// A record the producer refuses (larger than its `message.max.bytes`: no retry can make
/// it fit) beside one it takes, in one relay pass against the live broker: the refused
/// row is parked dead (the publisher classifies the refusal as permanent) and never marked
/// sent, the other row goes out, and the broker holds only that one.
///
/// The refusal is the producer's own (its `message.max.bytes`): librdkafka reports it
/// with the code of a broker's `MESSAGE_TOO_LARGE`, which the publisher's classifier
/// maps to a permanent refusal either way. A refusal by Tansu itself (a broker-side size
/// limit) was not measured.
async fn a_refused_record_is_parked_and_the_rest_flows(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let topic = unique_topic("refused");
        create_topic(&topic, 1).await;
        let oversized = OutgoingMessage::new(&topic, vec![b'x'; MAX_RECORD_BYTES * 2]).key("big");
        let fits = OutgoingMessage::new(&topic, "fits").key("small");
        let (oversized_id, fits_id) = (oversized.id(), fits.id());
        let txn = conn.begin().await.unwrap();
        txn.enqueue(oversized).await.unwrap();
        txn.enqueue(fits).await.unwrap();
        txn.commit().await.unwrap();
        let publisher = KafkaPublisher::new(
            kafka_config().set("message.max.bytes", MAX_RECORD_BYTES.to_string()),
        )
        .unwrap();
        let report = Relay::new(publisher).drain(&conn).await.expect("relay");
        assert_eq!(
            (report.published, report.dead),
            (1, 1),
            "one row out, the refused one parked: {report:?}"
        );
        let row_state = |id: MessageId| {
            let conn = &conn;
            async move {
                scalar_i64(
                    conn,
                    &format!(
                        "SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NOT NULL AND message_id = {}",
                        id_literal(backend, id)
                    ),
                )
                .await
            }
        };
        assert_eq!(row_state(oversized_id).await, 1, "the refused row is not parked dead, or was marked sent");
        assert_eq!(row_state(fits_id).await, 0, "the row that fits was parked");
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL").await,
            1,
            "the row that fits is not marked sent"
        );
        let records = read_topic(&topic, 1).await;
        assert_eq!(records.len(), 1, "the broker holds {} records", records.len());
        assert_eq!(records[0].payload(), Some(&b"fits"[..]));
    })
    .await
}

/// `id` as a literal of the outbox's `message_id` column on `backend`.
fn id_literal(backend: Backend, id: MessageId) -> String {
    let hex = id.as_uuid().simple().to_string();
    match backend {
        Backend::Postgres | Backend::PgBouncer => format!("'{}'", id.as_uuid()),
        Backend::MySql => format!("UNHEX('{hex}')"),
        Backend::Sqlite => format!("X'{hex}'"),
    }
}

on_every_backend!(
    needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
    rows_go_out_keyed_with_id_and_send_time,
    a_failed_delivery_leaves_the_row_unsent,
    a_refused_record_is_parked_and_the_rest_flows
);
