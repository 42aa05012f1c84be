//! The Kafka suites' broker side: the bootstrap address `tests/cluster/kafka.sh start`
//! printed (`INBOX_TEST_KAFKA_BOOTSTRAP`), topics of a test's own, a reader of a whole
//! topic, and the migrator that adds the opt-in offset table.

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;
use std::time::{Duration, Instant};

/// The broker's address, as `tests/cluster/kafka.sh start` printed it.
pub fn kafka_bootstrap() -> String {
    std::env::var("INBOX_TEST_KAFKA_BOOTSTRAP")
        .expect("set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start prints it)")
}

/// A client configuration for the test broker.
pub fn kafka_config() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", kafka_bootstrap());
    config
}

/// [`kafka_config`] for a consumer of a group: from the earliest record when the group has
/// no offset, and a session timeout Tansu lets join within seconds (with librdkafka's
/// default a subscriber received nothing for 20 s).
pub fn kafka_consumer_config() -> ClientConfig {
    let mut config = kafka_config();
    config
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500");
    config
}

/// A pool to `db` with the opt-in offset table migrated.
pub async fn connect_with_offsets(db: &crate::TestDb) -> sea_orm::DatabaseConnection {
    let conn = db.connect().await;
    KafkaMigrator::up(&conn, None)
        .await
        .expect("run CreateKafkaOffsets");
    conn
}

/// A topic name no other test uses, starting with `prefix`.
pub fn unique_topic(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Creates `topic` with `partitions` partitions.
pub async fn create_topic(topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> =
        kafka_config().create().expect("Kafka admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .expect("create topic");
    for result in results {
        result.expect("topic created");
    }
}

/// The high watermark (the offset the next record gets) of `topic`'s `partition`.
pub fn end_offset(topic: &str, partition: i32) -> i64 {
    let reader: rdkafka::consumer::BaseConsumer = kafka_config()
        .set("group.id", "watermarks")
        .create()
        .expect("watermark reader");
    reader
        .fetch_watermarks(topic, partition, Duration::from_secs(10))
        .expect("watermarks")
        .1
}

/// The high watermark of each of `topic`'s partitions `0..partitions`.
pub fn end_offsets(topic: &str, partitions: i32) -> Vec<i64> {
    (0..partitions)
        .map(|partition| end_offset(topic, partition))
        .collect()
}

/// The offset `group` stored for each of `topic`'s partitions `0..partitions` (0 where
/// none is).
pub async fn stored_offsets(
    conn: &sea_orm::DatabaseConnection,
    group: &str,
    topic: &str,
    partitions: i32,
) -> Vec<i64> {
    let mut offsets = Vec::new();
    for partition in 0..partitions {
        offsets.push(
            sea_orm_inbox::kafka::stored_offset(conn, group, topic, partition)
                .await
                .expect("read the stored offset")
                .unwrap_or(0),
        );
    }
    offsets
}

/// Produces `m-{id}` for each of `ids` twice, as a producer without idempotence that
/// retried after a lost acknowledgement does, with the name as the id header; the key
/// spreads them over the partitions.
pub async fn produce_twice(topic: &str, ids: std::ops::Range<u32>) {
    let producer: FutureProducer = kafka_config()
        .set("enable.idempotence", "false")
        .set("acks", "all")
        // One record per batch: after multi-record batches Tansu 0.6.0 reported high
        // watermarks below the records it then delivered (125 for 150 records).
        .set("batch.num.messages", "1")
        .create()
        .expect("producer");
    for chunk in ids.collect::<Vec<_>>().chunks(250) {
        let sends = chunk.iter().flat_map(|id| {
            let name = format!("m-{id}");
            let producer = &producer;
            (0..2).map(move |_| {
                let name = name.clone();
                async move {
                    producer
                        .send(
                            FutureRecord::to(topic).key(&name).payload("{}").headers(
                                OwnedHeaders::new().insert(Header {
                                    key: sea_orm_inbox::kafka::DEFAULT_ID_HEADER,
                                    value: Some(&name),
                                }),
                            ),
                            Duration::from_secs(30),
                        )
                        .await
                        .map_err(|(err, _)| err)
                        .expect("produce");
                }
            })
        });
        futures_util::future::join_all(sends).await;
    }
}

/// Every record of `topic`'s partitions `0..partitions`, read from the beginning to the
/// high watermark without a consumer group, in partition order.
pub async fn read_topic(topic: &str, partitions: i32) -> Vec<OwnedMessage> {
    let ends: Vec<i64> = (0..partitions)
        .map(|partition| end_offset(topic, partition))
        .collect();
    let reader: StreamConsumer = kafka_config()
        .set(
            "group.id",
            format!("reader-{}", uuid::Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .create()
        .expect("topic reader");
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("assignment");
    }
    reader.assign(&assignment).expect("assign");
    let mut records: Vec<Vec<OwnedMessage>> = vec![Vec::new(); ends.len()];
    let started = Instant::now();
    while records
        .iter()
        .zip(&ends)
        .any(|(read, end)| (read.len() as i64) < *end)
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "read {:?} of {topic}'s {ends:?} records in 30 s",
            records.iter().map(Vec::len).collect::<Vec<_>>()
        );
        let received = tokio::time::timeout(Duration::from_secs(1), reader.recv()).await;
        if let Ok(record) = received {
            let record = record.expect("read a record").detach();
            let partition = usize::try_from(record.partition()).expect("a partition number");
            records[partition].push(record);
        }
    }
    records.into_iter().flatten().collect()
}

/// The value of `record`'s header `name`, as text.
pub fn header(record: &OwnedMessage, name: &str) -> Option<String> {
    record.headers()?.iter().find_map(|header| {
        (header.key == name)
            .then(|| {
                header
                    .value
                    .map(|value| String::from_utf8_lossy(value).into_owned())
            })
            .flatten()
    })
}

/// A migrator with the opt-in Kafka offset table, as an application adds it.
pub struct KafkaMigrator;

impl MigratorTrait for KafkaMigrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(sea_orm_inbox_migration::CreateKafkaOffsets)]
    }

    fn migration_table_name() -> DynIden {
        "seaql_migrations_kafka".into_iden()
    }
}
