//! The Kafka dead-letter topic (`KafkaInbox::with_dead_letter`): a record no redelivery can
//! fix (the handler's `Permanent` error, the admission floor's refusal, an id header that
//! is not text) is produced once to
//! `<topic>.dead-letter` with its error and original position in headers, its offset
//! advances, and the records after it on its partition are processed.

use inbox_tests::kafka::{
    connect_with_offsets, create_topic, end_offset, header, kafka_config, kafka_consumer_config,
    read_topic, unique_topic,
};
use inbox_tests::{Backend, on_every_backend, run, scalar_i64, stmt, with_migrated_db};
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sea_orm::ConnectionTrait;
use sea_orm_inbox::kafka::{
    self, DEAD_LETTER_ERROR_HEADER, DEAD_LETTER_MESSAGE_ID_HEADER, DEAD_LETTER_OFFSET_HEADER,
    DEAD_LETTER_PARTITION_HEADER, DEAD_LETTER_TOPIC_HEADER, DeadLetterTopic, KafkaInbox,
    stored_offset,
};
use sea_orm_inbox::{
    AdmissionFloor, HandlerFuture, Inbox, MessageId, ObservedTransaction, Permanent,
    RetentionPolicy,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Records on the one partition; the poison and the stale one sit in the middle.
const RECORDS: i64 = 10;
/// The offset of the record whose handler fails with `Permanent`.
const POISON: i64 = 3;
/// The offset of the record sent before the admission floor.
const STALE: i64 = 6;
/// The offset of the record whose id header is not UTF-8.
const NOT_TEXT: i64 = 8;
/// The records that go to the dead-letter topic.
const DEAD: i64 = 3;

/// One `effect` row per record, or `Permanent` for the poison payload.
fn effect_or_poison<'t>(
    txn: &'t ObservedTransaction,
    record: Arc<OwnedMessage>,
) -> HandlerFuture<'t, (), BoxError> {
    Box::pin(async move {
        if record.payload() == Some(b"poison".as_slice()) {
            return Err(Permanent::new("the payload is poison: no amount in it").into());
        }
        txn.execute_raw(stmt(
            txn.get_database_backend(),
            "INSERT INTO effect (kafka_offset) VALUES (?)",
            vec![record.offset().into()],
        ))
        .await?;
        Ok(())
    })
}

/// Produces [`RECORDS`] records with ids `m-0..`: the poison payload at [`POISON`], a
/// timestamp from 2001 at [`STALE`], an id header of bytes that are not UTF-8 at
/// [`NOT_TEXT`].
async fn produce(topic: &str) {
    let producer: FutureProducer = kafka_config().create().expect("producer");
    for offset in 0..RECORDS {
        let id = format!("m-{offset}");
        let payload = if offset == POISON { "poison" } else { "{}" };
        let id_bytes: &[u8] = if offset == NOT_TEXT {
            &[0xff, 0xfe]
        } else {
            id.as_bytes()
        };
        let mut record =
            FutureRecord::to(topic)
                .key(&id)
                .payload(payload)
                .headers(OwnedHeaders::new().insert(Header {
                    key: kafka::DEFAULT_ID_HEADER,
                    value: Some(id_bytes),
                }));
        if offset == STALE {
            record = record.timestamp(1_000_000_000_000);
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(err, _)| err)
            .expect("produce");
    }
}

async fn poison_goes_to_the_dead_letter_topic_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = connect_with_offsets(db).await;
        run(&conn, "CREATE TABLE effect (kafka_offset BIGINT NOT NULL)").await;
        let topic = unique_topic("dl");
        let dead_letters = format!("{topic}{}", kafka::DEAD_LETTER_SUFFIX);
        create_topic(&topic, 1).await;
        create_topic(&dead_letters, 1).await;
        produce(&topic).await;

        let retention = RetentionPolicy::with_window(Duration::from_secs(3_600)).unwrap();
        let floor = AdmissionFloor::new(&retention, Duration::from_secs(60)).unwrap();
        let group = format!("g-{topic}");
        let kafka = KafkaInbox::new(
            Inbox::new("billing").unwrap().with_admission_floor(floor),
            &group,
        )
        .unwrap()
        .with_retry_delay(Duration::from_millis(100))
        .with_dead_letter(DeadLetterTopic::new(&kafka_config()).unwrap());
        let consumer = kafka.consumer(&kafka_consumer_config()).unwrap();
        consumer.subscribe(&[topic.as_str()]).unwrap();
        let watcher = conn.clone();
        let (watched_group, watched_topic) = (group.clone(), topic.clone());
        // A task of its own: see kafka.rs (the loop polls it only between records).
        let done = tokio::spawn(async move {
            let started = Instant::now();
            while stored_offset(&watcher, &watched_group, &watched_topic, 0)
                .await
                .unwrap()
                != Some(RECORDS)
                && started.elapsed() < Duration::from_secs(60)
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        // The deprecated one-record loop on purpose: its dead-letter path stays supported
        // until it is removed (an inbox with an admission floor, as here, is processed one
        // record at a time by KafkaGroupConsumer as well).
        #[allow(deprecated)]
        let report = kafka
            .run(&consumer, &conn, effect_or_poison, done)
            .await
            .expect("the consumer loop");

        assert_eq!(
            stored_offset(&conn, &group, &topic, 0).await.unwrap(),
            Some(RECORDS),
            "the partition stopped at a record no redelivery can fix: {report:?}"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM effect").await,
            RECORDS - DEAD,
            "{report:?}"
        );
        assert_eq!(
            scalar_i64(
                &conn,
                &format!("SELECT COUNT(*) FROM effect WHERE kafka_offset > {POISON}")
            )
            .await,
            RECORDS - POISON - DEAD,
            "the records after the poison were not all processed: {report:?}"
        );
        assert_eq!(
            (report.processed, report.dead_lettered),
            ((RECORDS - DEAD) as u64, DEAD as u64),
            "{report:?}"
        );

        assert_eq!(end_offset(&dead_letters, 0), DEAD, "{report:?}");
        let dead = read_topic(&dead_letters, 1).await;
        let offsets: Vec<String> = dead
            .iter()
            .map(|record| header(record, DEAD_LETTER_OFFSET_HEADER).unwrap())
            .collect();
        assert_eq!(
            offsets,
            [POISON.to_string(), STALE.to_string(), NOT_TEXT.to_string()]
        );
        let poison = &dead[0];
        assert_eq!(poison.payload(), Some(b"poison".as_slice()));
        assert_eq!(poison.key(), Some(format!("m-{POISON}").as_bytes()));
        assert_eq!(
            header(poison, DEAD_LETTER_TOPIC_HEADER).as_deref(),
            Some(topic.as_str())
        );
        assert_eq!(
            header(poison, DEAD_LETTER_PARTITION_HEADER).as_deref(),
            Some("0")
        );
        assert_eq!(
            header(poison, DEAD_LETTER_MESSAGE_ID_HEADER),
            Some(
                MessageId::from_broker_id(&format!("m-{POISON}"))
                    .unwrap()
                    .to_string()
            )
        );
        assert_eq!(
            header(poison, kafka::DEFAULT_ID_HEADER),
            Some(format!("m-{POISON}")),
            "the original headers are kept"
        );
        let error = header(poison, DEAD_LETTER_ERROR_HEADER).unwrap();
        assert!(error.contains("the payload is poison"), "{error}");
        let refusal = header(&dead[1], DEAD_LETTER_ERROR_HEADER).unwrap();
        assert!(refusal.contains("admission floor"), "{refusal}");
        let not_text = header(&dead[2], DEAD_LETTER_ERROR_HEADER).unwrap();
        assert!(not_text.contains("not UTF-8"), "{not_text}");
        assert_eq!(
            header(&dead[2], DEAD_LETTER_MESSAGE_ID_HEADER),
            Some(
                MessageId::from_kafka(&topic, 0, NOT_TEXT)
                    .unwrap()
                    .to_string()
            ),
            "a record without a usable id is named by its position"
        );
    })
    .await
}

on_every_backend!(
    needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
    poison_goes_to_the_dead_letter_topic_once
);
