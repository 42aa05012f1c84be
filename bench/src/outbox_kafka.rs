//! `--kafka <bootstrap>`: records per second through the consumer loop
//! `KafkaGroupConsumer`, one record a transaction (`with_max_batch(1)`: BEGIN, the inbox
//! marker, the business write, the offset advance, COMMIT) and with its default batch (the
//! records waiting of the partition in one transaction), against the consumer a team
//! writes by hand: the same business write in a transaction of its own, then the
//! offset committed to Kafka (asynchronously) after each database commit: at least once,
//! no marker, no offset table.
//!
//! Each round reads the same topic of `--messages` records (one partition) once per mode
//! under a consumer group of its own, the modes in rotating order; a rate is timed from
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
use sea_orm_inbox::kafka::{self, KafkaGroupConsumer, KafkaInbox, stored_offset};
use sea_orm_inbox_migration::{CreateKafkaOffsets, MigratorTrait};
use sea_orm_migration::{MigrationTrait, SchemaManager};
use std::num::NonZeroU16;
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

/// Waits until the handlers counted `records` and the stored offset reached the end, and
/// returns when that was seen. Counted by the handler, so the database is read only at the
/// end: a query every few milliseconds through the run would slow the loop it measures.
fn watch_until_stored(
    db: &DatabaseConnection,
    group: &str,
    topic: &str,
    records: usize,
    handled: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<Instant> {
    let (watcher, group, topic) = (db.clone(), group.to_owned(), topic.to_owned());
    let end = records as i64;
    tokio::spawn(async move {
        let begun = Instant::now();
        while handled.load(Ordering::SeqCst) < records && begun.elapsed() < DEADLINE {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        loop {
            let stored = stored_offset(&watcher, &group, &topic, 0).await;
            if matches!(stored, Ok(Some(stored)) if stored == end) || begun.elapsed() > DEADLINE {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
}

/// The library's handler: the business write, timed from the first record, counted.
fn timed_handler(
    first: &Arc<OnceLock<Instant>>,
    handled: &Arc<AtomicUsize>,
) -> impl for<'t> Fn(
    &'t sea_orm_inbox::ObservedTransaction,
    Arc<rdkafka::message::OwnedMessage>,
) -> sea_orm_inbox::HandlerFuture<'t, (), BoxError>
+ Send
+ Sync
+ 'static {
    let (first, handled) = (Arc::clone(first), Arc::clone(handled));
    move |txn, record| {
        first.get_or_init(Instant::now);
        let handled = Arc::clone(&handled);
        Box::pin(async move {
            business_write(txn, record.offset()).await?;
            handled.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

/// Records per second from the first record handed to the handler to the moment the
/// watcher saw the last offset stored.
fn rate(
    records: usize,
    first: &OnceLock<Instant>,
    finished: Option<Instant>,
) -> Result<f64, BoxError> {
    match (first.get(), finished) {
        (Some(first), Some(last)) => Ok(records as f64 / (last - *first).as_secs_f64()),
        _ => Err("the library's loop was not timed".into()),
    }
}

/// Records per second through `KafkaGroupConsumer`, the consumer loop users run (its
/// partition task, semaphore and post-commit Kafka commit included), committing up to
/// `max_batch` waiting records of the partition in one transaction (the default when
/// `None`).
async fn group_run(
    db: &DatabaseConnection,
    bootstrap: &str,
    topic: &str,
    records: usize,
    max_batch: Option<NonZeroU16>,
) -> Result<f64, BoxError> {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let group = format!("loop-{run}");
    let kafka = KafkaInbox::new(Inbox::new(format!("bench.kafka.{run}"))?, &group)?;
    let (first, handled) = (Arc::new(OnceLock::new()), Arc::new(AtomicUsize::new(0)));
    let done = watch_until_stored(db, &group, topic, records, Arc::clone(&handled));
    let finished = Arc::new(OnceLock::new());
    let finished_at = Arc::clone(&finished);
    let mut consumer = KafkaGroupConsumer::new(kafka, &config(bootstrap), [topic]);
    if let Some(max_batch) = max_batch {
        consumer = consumer.with_max_batch(max_batch);
    }
    let summary = consumer
        .run(db.clone(), timed_handler(&first, &handled), async move {
            if let Ok(at) = done.await {
                finished_at.get_or_init(|| at);
            }
        })
        .await?;
    if summary.processed != records as u64 {
        return Err(format!("the consumer loop processed {summary} of {records}").into());
    }
    rate(records, &first, finished.get().copied())
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
    let (mut one_record, mut group, mut hand) = (Vec::new(), Vec::new(), Vec::new());
    let (mut one_record_ratio, mut group_ratio) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // The order rotates, so no mode always runs first (on a cold cache) or last.
        let mut rates = [0.0; 3];
        for step in 0..3 {
            let mode = (round + step) % 3;
            rates[mode] = match mode {
                0 => group_run(&db, bootstrap, &topic, records, Some(NonZeroU16::MIN)).await?,
                1 => group_run(&db, bootstrap, &topic, records, None).await?,
                _ => hand_written_run(&db, bootstrap, &topic, records).await?,
            };
        }
        let [by_one, by_group, by_hand] = rates;
        println!(
            "  round {round}: KafkaGroupConsumer one record a transaction {by_one:.0} records/s, batched (the default) {by_group:.0} records/s, hand-written {by_hand:.0} records/s"
        );
        one_record.push(by_one);
        group.push(by_group);
        hand.push(by_hand);
        one_record_ratio.push(by_one / by_hand);
        group_ratio.push(by_group / by_hand);
    }
    db.close().await?;
    Ok(format!(
        "| {} | {records} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
        target.name,
        median(one_record),
        median(group),
        median(hand),
        median(one_record_ratio),
        median(group_ratio),
    ))
}
