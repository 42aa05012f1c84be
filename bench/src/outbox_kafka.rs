//! `--kafka <bootstrap>`: records per second through `KafkaInbox::run` (the inbox marker,
//! the business write and the offset advance in one transaction) against the consumer a
//! team writes by hand: the same business write in a transaction of its own, then the
//! offset committed to Kafka (asynchronously) after each database commit: at least once,
//! no marker, no offset table.
//!
//! Each round reads the same topic of `--messages` records (one partition) once per mode
//! under a consumer group of its own, the modes in alternating order; a rate is timed from
//! the first record handed to the code to the last database commit, so the group join
//! (seconds on Tansu) is left out.

use super::{BoxError, Target, median};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message};
use sea_orm::sea_query::{Alias, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::Inbox;
use sea_orm_inbox::kafka::{self, KafkaInbox, stored_offset};
use sea_orm_inbox_migration::{CreateKafkaOffsets, MigratorTrait};
use sea_orm_migration::{MigrationTrait, SchemaManager};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A round's wait for the consumers, group join included, before it gives up.
const DEADLINE: Duration = Duration::from_secs(300);

fn config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("auto.offset.reset", "earliest")
        // librdkafka's default session timeout kept a Tansu subscriber idle for 20 s.
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500");
    config
}

/// The business write both modes make: one row per record.
async fn business_write(conn: &impl ConnectionTrait, offset: i64) -> Result<(), BoxError> {
    let insert = Query::insert()
        .into_table(Alias::new("bench_kafka_effect"))
        .columns([Alias::new("kafka_offset")])
        .values([offset.into()])?
        .to_owned();
    conn.execute(&insert).await?;
    Ok(())
}

/// A topic of `records` records with ids, on one partition.
async fn produce(bootstrap: &str, records: usize) -> Result<String, BoxError> {
    let topic = format!("kafka-bench-{}", uuid::Uuid::new_v4().simple());
    let producer: FutureProducer = config(bootstrap).create()?;
    let mut deliveries = Vec::with_capacity(records);
    for n in 0..records {
        let id = uuid::Uuid::new_v4().to_string();
        let record = FutureRecord::to(&topic)
            .partition(0)
            .key("bench")
            .payload("{}")
            .headers(OwnedHeaders::new().insert(Header {
                key: kafka::DEFAULT_ID_HEADER,
                value: Some(&id),
            }));
        deliveries.push(producer.send_result(record).map_err(|(err, _)| {
            format!("record {n} could not be queued for the bench topic: {err}")
        })?);
    }
    for delivery in deliveries {
        delivery
            .await?
            .map_err(|(err, _)| format!("the bench topic did not take a record: {err}"))?;
    }
    Ok(topic)
}

/// Records per second through `KafkaInbox::run`, until the stored offset reaches the end.
async fn library_run(
    db: &DatabaseConnection,
    bootstrap: &str,
    topic: &str,
    records: usize,
) -> Result<f64, BoxError> {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let group = format!("lib-{run}");
    let kafka = KafkaInbox::new(Inbox::new(format!("bench.kafka.{run}"))?, &group)?;
    let consumer = kafka.consumer(&config(bootstrap))?;
    consumer.subscribe(&[topic])?;
    let first = Arc::new(OnceLock::new());
    let started = Arc::clone(&first);
    // Counted by the handler, so the watcher reads the database only at the end: a query
    // every few milliseconds through the run would slow the loop it measures.
    let handled = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&handled);
    let (watcher, watched_topic) = (db.clone(), topic.to_owned());
    let end = records as i64;
    let done = tokio::spawn(async move {
        let begun = Instant::now();
        while handled.load(Ordering::SeqCst) < records && begun.elapsed() < DEADLINE {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        loop {
            let stored = stored_offset(&watcher, &group, &watched_topic, 0).await;
            if matches!(stored, Ok(Some(stored)) if stored == end) || begun.elapsed() > DEADLINE {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let finished = Arc::new(OnceLock::new());
    let finished_at = Arc::clone(&finished);
    let report = kafka
        .run(
            &consumer,
            db,
            move |txn, record| {
                started.get_or_init(Instant::now);
                let counted = Arc::clone(&counted);
                Box::pin(async move {
                    business_write(txn, record.offset()).await?;
                    counted.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
            },
            async move {
                if let Ok(at) = done.await {
                    finished_at.get_or_init(|| at);
                }
            },
        )
        .await?;
    if report.processed != records as u64 {
        return Err(format!("the library's loop processed {report:?} of {records}").into());
    }
    match (first.get(), finished.get()) {
        (Some(first), Some(last)) => Ok(records as f64 / (*last - *first).as_secs_f64()),
        _ => Err("the library's loop was not timed".into()),
    }
}

/// Records per second through the hand-written consumer: business write, COMMIT, then
/// the offset committed to Kafka.
async fn hand_written_run(
    db: &DatabaseConnection,
    bootstrap: &str,
    topic: &str,
    records: usize,
) -> Result<f64, BoxError> {
    let consumer: StreamConsumer = config(bootstrap)
        .set(
            "group.id",
            format!("hand-{}", uuid::Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .create()?;
    consumer.subscribe(&[topic])?;
    let mut first = None;
    for _ in 0..records {
        let record = tokio::time::timeout(DEADLINE, consumer.recv()).await??;
        first.get_or_insert_with(Instant::now);
        let txn = db.begin().await?;
        business_write(&txn, record.offset()).await?;
        txn.commit().await?;
        consumer.commit_message(&record, CommitMode::Async)?;
    }
    let first = first.ok_or("the hand-written consumer read nothing")?;
    Ok(records as f64 / first.elapsed().as_secs_f64())
}

/// The Kafka table's row for `target`.
pub async fn bench(
    target: &Target,
    bootstrap: &str,
    rounds: usize,
    records: usize,
) -> Result<String, BoxError> {
    let db = target.connect().await?;
    sea_orm_inbox_migration::Migrator::up(&db, None).await?;
    CreateKafkaOffsets
        .up(&SchemaManager::new(&db))
        .await
        .map_err(|err| format!("CreateKafkaOffsets: {err}"))?;
    db.execute_unprepared("CREATE TABLE bench_kafka_effect (kafka_offset BIGINT NOT NULL)")
        .await?;
    let topic = produce(bootstrap, records).await?;
    let (mut library, mut hand, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (by_library, by_hand) = if round % 2 == 0 {
            let by_library = library_run(&db, bootstrap, &topic, records).await?;
            (
                by_library,
                hand_written_run(&db, bootstrap, &topic, records).await?,
            )
        } else {
            let by_hand = hand_written_run(&db, bootstrap, &topic, records).await?;
            (library_run(&db, bootstrap, &topic, records).await?, by_hand)
        };
        println!(
            "  round {round}: library {by_library:.0} records/s, hand-written {by_hand:.0} records/s"
        );
        library.push(by_library);
        hand.push(by_hand);
        ratio.push(by_library / by_hand);
    }
    db.close().await?;
    Ok(format!(
        "| {} | {records} | {:.0} | {:.0} | {:.2} |",
        target.name,
        median(library),
        median(hand),
        median(ratio),
    ))
}
