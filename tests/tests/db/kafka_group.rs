//! The Kafka consumer loop (`sea_orm_inbox::kafka::KafkaGroupConsumer`, issue 31) against
//! a real Kafka-protocol broker (Tansu, `tests/cluster/kafka.sh`): two consumer processes
//! in one group, one SIGKILLed mid-handler, and a database cut while consuming.
//!
//! Each test has a topic and a group of its own; they need `INBOX_TEST_KAFKA_BOOTSTRAP`
//! at build time.

use inbox_tests::kafka::{
    KafkaMigrator, create_topic, end_offset, end_offsets, kafka_config, kafka_consumer_config,
    produce_twice, stored_offsets,
};
use inbox_tests::{
    Backend, ProxiedDb, TestDb, connect_url, run, scalar_i64, stmt, with_migrated_db,
    with_proxied_db,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::{Message, Offset, TopicPartitionList};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::kafka::{self, KafkaGroupConsumer, KafkaInbox, stored_offset};
use sea_orm_inbox::{ConsumerOptions, ConsumerSummary, HandlerFuture, Inbox, ObservedTransaction};
use sea_orm_migration::MigratorTrait;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const PARTITIONS: i32 = 4;
/// The name of the child consumer test, which the two-process test runs in processes of
/// their own.
const CHILD_TEST: &str = "kafka_group::child_consumer";
/// The child's settings, in its environment.
const CHILD_DB_URL: &str = "INBOX_KAFKA_CHILD_DB_URL";
const CHILD_TOPIC: &str = "INBOX_KAFKA_CHILD_TOPIC";
/// How many records the doomed child handles before its handler hangs.
const CHILD_HANG_AFTER: &str = "INBOX_KAFKA_CHILD_HANG_AFTER";
/// The line the doomed child prints when its handler hangs, mid-transaction.
const HUNG: &str = "kafka child: handler hung";
/// The line the child prints when it stops: its summary follows.
const SUMMARY: &str = "kafka child summary: ";

/// The offset table and an `effect` table the handler appends to (no unique key: a record
/// applied twice shows as two rows).
async fn prepare(conn: &DatabaseConnection) {
    KafkaMigrator::up(conn, None)
        .await
        .expect("run CreateKafkaOffsets");
    run(
        conn,
        "CREATE TABLE effect (message_key VARCHAR(100) NOT NULL, kafka_offset BIGINT NOT NULL)",
    )
    .await;
}

/// The high watermark of each partition, once they add up to `records`: right after the
/// producer's last delivery report Tansu may still answer with an older one.
async fn end_offsets_of(topic: &str, records: i64) -> Vec<i64> {
    let started = Instant::now();
    loop {
        let ends = end_offsets(topic, PARTITIONS);
        if ends.iter().sum::<i64>() == records {
            return ends;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the partitions' ends {ends:?} do not add up to the {records} records produced"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The offsets the group committed to Kafka (0 where none), read by a client that does not
/// join the group.
fn committed_offsets(group: &str, topic: &str) -> Vec<i64> {
    let reader: BaseConsumer = kafka_config()
        .set("group.id", group)
        .create()
        .expect("reader");
    let mut wanted = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        wanted.add_partition(topic, partition);
    }
    let committed = reader
        .committed_offsets(wanted, Duration::from_secs(10))
        .expect("the group's committed offsets");
    (0..PARTITIONS)
        .map(|partition| {
            match committed
                .find_partition(topic, partition)
                .map(|element| element.offset())
            {
                Some(Offset::Offset(offset)) => offset,
                _ => 0,
            }
        })
        .collect()
}

/// Waits until the stored offsets reach `ends`; panics after `limit`.
async fn wait_for_ends(
    conn: &DatabaseConnection,
    group: &str,
    topic: &str,
    ends: &[i64],
    limit: Duration,
) {
    let started = Instant::now();
    loop {
        let stored = stored_offsets(conn, group, topic, PARTITIONS).await;
        if stored == ends {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "the stored offsets {stored:?} did not reach the ends {ends:?} within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The record's id header, as the producer set it.
fn message_key(record: &OwnedMessage) -> String {
    record
        .headers()
        .and_then(|headers| {
            headers
                .iter()
                .find(|header| header.key == kafka::DEFAULT_ID_HEADER)
        })
        .and_then(|header| header.value)
        .map(|value| String::from_utf8_lossy(value).into_owned())
        .unwrap_or_default()
}

/// Inserts the record's `effect` row through the transaction.
async fn insert_effect(txn: &ObservedTransaction, record: &OwnedMessage) -> Result<(), BoxError> {
    txn.execute_raw(stmt(
        txn.get_database_backend(),
        "INSERT INTO effect (message_key, kafka_offset) VALUES (?, ?)",
        vec![message_key(record).into(), record.offset().into()],
    ))
    .await?;
    Ok(())
}

/// The handler: one `effect` row per record, keyed by its id header, then a pause inside
/// the transaction (the handler's work). With `hang_after`, the handler of that many-th
/// record prints [`HUNG`] after its insert and never returns: a kill then lands mid-handler.
fn effect_then_pause(
    pause: Duration,
    hang_after: Option<u64>,
) -> impl for<'t> Fn(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError>
+ Send
+ Sync
+ 'static {
    let handled = Arc::new(AtomicU64::new(0));
    move |txn, record| {
        let handled = Arc::clone(&handled);
        Box::pin(async move {
            insert_effect(txn, &record).await?;
            if hang_after == Some(handled.fetch_add(1, Ordering::SeqCst) + 1) {
                {
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "{HUNG}")?;
                    out.flush()?;
                }
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(pause).await;
            Ok(())
        })
    }
}

/// Every produced message applied exactly once: as many effect rows as messages, each
/// message among them once.
async fn assert_each_once(conn: &DatabaseConnection, messages: u32) {
    let rows = scalar_i64(conn, "SELECT COUNT(*) FROM effect").await;
    let distinct = scalar_i64(conn, "SELECT COUNT(DISTINCT message_key) FROM effect").await;
    let twice = scalar_i64(
        conn,
        "SELECT COUNT(*) FROM (SELECT message_key FROM effect GROUP BY message_key HAVING COUNT(*) > 1) twice",
    )
    .await;
    let messages = i64::from(messages);
    assert_eq!(
        (distinct, twice),
        (messages, 0),
        "lost {} message(s), applied {twice} twice",
        messages - distinct
    );
    assert_eq!(rows, messages, "effect rows");
}

/// The child consumer process of [`two_consumers_one_killed`]: runs the loop on the database
/// and topic its environment names until its stdin closes, then prints its summary. Only
/// that test runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the Kafka group test's child consumer: that test runs it in a process of its own"]
async fn child_consumer() {
    let (url, topic) = match (std::env::var(CHILD_DB_URL), std::env::var(CHILD_TOPIC)) {
        (Ok(url), Ok(topic)) => (url, topic),
        _ => panic!("{CHILD_TEST} is a child process of the Kafka group test: only it runs it"),
    };
    let hang_after = std::env::var(CHILD_HANG_AFTER)
        .ok()
        .map(|count| count.parse().expect("a record count"));
    let db = connect_url(&url, 8).await;
    let (closed, stdin_closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        // The parent closes our stdin to stop us gracefully.
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = closed.send(());
    });
    let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), group_of(&topic))
        .unwrap()
        .with_retry_delay(Duration::from_millis(100));
    let summary = KafkaGroupConsumer::new(kafka, &kafka_consumer_config(), [topic.as_str()])
        .run(
            db,
            effect_then_pause(Duration::from_millis(2), hang_after),
            stdin_closed,
        )
        .await
        .expect("the consumer loop");
    let mut out = std::io::stdout().lock();
    writeln!(out, "{SUMMARY}{summary}").expect("print the summary");
}

fn group_of(topic: &str) -> String {
    format!("g-{topic}")
}

/// A child consumer process in the group of `topic` on `db`, its handler hanging after
/// `hang_after` records if set.
fn spawn_child(db: &TestDb, topic: &str, hang_after: Option<u64>) -> std::process::Child {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = std::process::Command::new(exe);
    command
        .args([CHILD_TEST, "--exact", "--ignored", "--nocapture"])
        .env(CHILD_DB_URL, db.url())
        .env(CHILD_TOPIC, topic)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if let Some(count) = hang_after {
        command.env(CHILD_HANG_AFTER, count.to_string());
    }
    command.spawn().expect("start a child consumer")
}

/// Waits until the child's handler hung (it printed [`HUNG`]); panics after `limit`.
async fn wait_until_hung(child: &mut std::process::Child, limit: Duration) {
    let stdout = child.stdout.take().expect("the child's stdout");
    let (hung, hung_seen) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok);
        if lines.any(|line| line == HUNG) {
            let _ = hung.send(());
        }
        lines.for_each(drop); // keep reading until the kill: a closed pipe fails the child
    });
    tokio::time::timeout(limit, hung_seen)
        .await
        .unwrap_or_else(|_| panic!("the doomed consumer's handler did not hang within {limit:?}"))
        .expect("the doomed consumer ended before its handler hung");
}

/// Closes the child's stdin (it stops gracefully) and returns its summary line.
fn stop_child(mut child: std::process::Child) -> String {
    drop(child.stdin.take());
    let stdout = child.stdout.take().expect("the child's stdout");
    // Read to the end: a closed pipe would fail the child's last lines.
    let lines: Vec<String> = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .collect();
    let summary = lines
        .iter()
        .find_map(|line| line.strip_prefix(SUMMARY).map(str::to_owned));
    let status = child.wait().expect("reap the child consumer");
    assert!(status.success(), "the child consumer failed: {status}");
    summary.unwrap_or_else(|| panic!("the child consumer printed no summary ({status})"))
}

/// The messages of the two-process test, each produced twice over 4 partitions.
const GROUP_MESSAGES: u32 = 1_000;
/// The records the doomed consumer's handler runs for before it hangs, mid-transaction.
const DOOMED_HANGS_AFTER: u64 = 150;

/// Two consumer processes in one group (separate pools, as two replicas), every message
/// produced twice; one process is SIGKILLed mid-handler (its 150th handler hangs after its
/// write, inside the transaction, until the kill), and a third process joins: every message applied once, none lost, the stored
/// offsets at the partitions' ends.
async fn two_consumers_one_killed(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        prepare(&conn).await;
        let topic = format!("grp-{}", uuid::Uuid::new_v4().simple());
        let group = group_of(&topic);
        create_topic(&topic, PARTITIONS).await;
        produce_twice(&topic, 0..GROUP_MESSAGES).await;
        let total = i64::from(GROUP_MESSAGES) * 2;
        let ends = end_offsets_of(&topic, total).await;

        let started = Instant::now();
        let mut doomed = spawn_child(db, &topic, Some(DOOMED_HANGS_AFTER));
        let survivor = spawn_child(db, &topic, None);
        wait_until_hung(&mut doomed, Duration::from_secs(90)).await;
        doomed.kill().expect("SIGKILL a consumer");
        doomed.wait().expect("reap the killed consumer");
        let killed_at = started.elapsed();
        let joiner = spawn_child(db, &topic, None);

        wait_for_ends(&conn, &group, &topic, &ends, Duration::from_secs(120)).await;
        let finished = started.elapsed();
        let summaries = [stop_child(survivor), stop_child(joiner)];
        eprintln!(
            "{backend:?}: {total} records, killed at {killed_at:?}, all stored at {finished:?}; {summaries:?}"
        );
        assert_each_once(&conn, GROUP_MESSAGES).await;
        assert_eq!(stored_offsets(&conn, &group, &topic, PARTITIONS).await, ends);
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            i64::from(GROUP_MESSAGES),
            "inbox markers"
        );
        conn.close().await.ok();
    })
    .await
}

/// The messages of the database-cut test, each produced twice.
const CUT_MESSAGES: u32 = 300;
/// How long the database stays unreachable.
const CUT: Duration = Duration::from_secs(5);

/// The database unreachable for 5 s (a proxy between the consumer's pool and the server
/// drops everything, then cuts every connection) while the loop consumes: Kafka's committed
/// offsets never run ahead of the database's, and nothing is lost once it is back.
async fn database_cut_commits_nothing_ahead(backend: Backend) {
    with_proxied_db(backend, async |fixture: &ProxiedDb| {
        let conn = &fixture.direct;
        prepare(conn).await;
        let topic = format!("cut-{}", uuid::Uuid::new_v4().simple());
        let group = group_of(&topic);
        create_topic(&topic, PARTITIONS).await;
        produce_twice(&topic, 0..CUT_MESSAGES).await;
        let total = i64::from(CUT_MESSAGES) * 2;
        let ends = end_offsets_of(&topic, total).await;

        let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), &group)
            .unwrap()
            .with_retry_delay(Duration::from_millis(200));
        let options = ConsumerOptions::default()
            .with_prefetch(8)
            .expect("a prefetch above 0");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = tokio::spawn(
            KafkaGroupConsumer::new(kafka, &kafka_consumer_config(), [topic.as_str()])
                .with_options(options)
                .run(
                    fixture.through_proxy.clone(),
                    effect_then_pause(Duration::from_millis(10), None),
                    stopped,
                ),
        );
        let started = Instant::now();
        while stored_offsets(conn, &group, &topic, PARTITIONS).await.iter().sum::<i64>() < total / 4 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the consumer processed less than a quarter of {total} records in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        fixture.proxy.partition();
        let cut_at = Instant::now();
        let mut compared = 0;
        let mut stored_early_in_cut = None;
        while cut_at.elapsed() < CUT {
            let committed = committed_offsets(&group, &topic);
            let stored = stored_offsets(conn, &group, &topic, PARTITIONS).await;
            assert!(
                committed.iter().zip(&stored).all(|(kafka, db)| kafka <= db),
                "Kafka's committed offsets {committed:?} ran ahead of the database's {stored:?} while it was unreachable"
            );
            compared += u32::from(committed.iter().any(|offset| *offset > 0));
            if cut_at.elapsed() > Duration::from_secs(1) && stored_early_in_cut.is_none() {
                stored_early_in_cut = Some(stored);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let stored_during_cut = stored_offsets(conn, &group, &topic, PARTITIONS).await;
        fixture.proxy.heal();
        assert!(
            compared > 0,
            "no committed offset to compare during the cut"
        );

        wait_for_ends(conn, &group, &topic, &ends, Duration::from_secs(90)).await;
        stop.send(()).expect("the consumer runs");
        let summary: ConsumerSummary = consumer
            .await
            .expect("the consumer's task")
            .expect("the consumer loop");
        eprintln!(
            "{backend:?}: {total} records, stored {stored_during_cut:?} during the cut; {summary}"
        );
        // The inbox retried the transactions the heal cut; the cut showed as no progress.
        assert_eq!(
            stored_early_in_cut.as_ref(),
            Some(&stored_during_cut),
            "the stored offsets moved while the database was unreachable: the cut missed the consumer"
        );
        assert!(
            stored_during_cut.iter().sum::<i64>() < total,
            "the consumer was done before the cut"
        );
        assert_each_once(conn, CUT_MESSAGES).await;
        assert_eq!(stored_offsets(conn, &group, &topic, PARTITIONS).await, ends);
        let committed = committed_offsets(&group, &topic);
        assert!(
            committed.iter().zip(&ends).all(|(kafka, end)| kafka <= end),
            "committed {committed:?} beyond the ends {ends:?}"
        );
    })
    .await
}

/// The messages of the round-trip count, each produced twice, on one partition.
const COUNTED_MESSAGES: u32 = 100;

/// What the loop costs on the wire per record, counted by the proxy between its pool and
/// the server: one partition of 100 messages each produced twice, already in the topic
/// when the loop starts. The hand-written at-least-once consumer pays three round trips
/// per record (BEGIN, its business write, COMMIT); the loop paid five per new record
/// (BEGIN, the marker, the business write, the offset's compare-and-set, COMMIT) and six
/// per duplicate (its offset advanced in a transaction of its own). Batched, the records
/// waiting share BEGIN, one INSERT of their markers, one offset advance and COMMIT.
async fn round_trips_per_record_below_the_hand_written(backend: Backend) {
    with_proxied_db(backend, async |fixture: &ProxiedDb| {
        let conn = &fixture.direct;
        prepare(conn).await;
        let topic = format!("trips-{}", uuid::Uuid::new_v4().simple());
        let group = group_of(&topic);
        create_topic(&topic, 1).await;
        produce_twice(&topic, 0..COUNTED_MESSAGES).await;
        let records = i64::from(COUNTED_MESSAGES) * 2;
        let started = Instant::now();
        while end_offset(&topic, 0) < records {
            assert!(started.elapsed() < Duration::from_secs(30), "the topic's end stayed below {records}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), &group).unwrap();
        fixture.proxy.reset_round_trips();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = tokio::spawn(
            KafkaGroupConsumer::new(kafka, &kafka_consumer_config(), [topic.as_str()]).run(
                fixture.through_proxy.clone(),
                effect_then_pause(Duration::ZERO, None),
                stopped,
            ),
        );
        while stored_offset(conn, &group, &topic, 0)
            .await
            .expect("read the stored offset")
            != Some(records)
        {
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "the loop did not reach the end of the partition within 90 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let round_trips = fixture.proxy.round_trips();
        stop.send(()).expect("the consumer runs");
        let summary = consumer
            .await
            .expect("the consumer's task")
            .expect("the consumer loop");
        assert_each_once(conn, COUNTED_MESSAGES).await;
        let per_record = f64::from(round_trips) / records as f64;
        eprintln!("{backend:?}: {round_trips} round trips for {records} records ({per_record:.2} a record); {summary}");
        assert!(
            per_record <= 1.5,
            "{backend:?}: {round_trips} round trips for {records} records ({per_record:.2} a record); the hand-written consumer pays 3 ({summary})"
        );
    })
    .await
}

/// The messages of the shutdown test, each produced twice.
const SHUTDOWN_MESSAGES: u32 = 20;

/// A handler whose first run inserts its effect, tells `entered` and then waits `hold`
/// (forever if `None`) inside the transaction; later runs just insert.
fn first_run_held(
    entered: Arc<tokio::sync::Notify>,
    hold: Option<Duration>,
) -> impl for<'t> Fn(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError>
+ Send
+ Sync
+ 'static {
    let runs = Arc::new(AtomicU64::new(0));
    move |txn, record| {
        let (runs, entered) = (Arc::clone(&runs), Arc::clone(&entered));
        Box::pin(async move {
            insert_effect(txn, &record).await?;
            if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                entered.notify_one();
                match hold {
                    Some(hold) => tokio::time::sleep(hold).await,
                    None => std::future::pending::<()>().await,
                }
            }
            Ok(())
        })
    }
}

/// Runs the loop with `handler` and `grace` until the handler's first run is inside its
/// transaction, then shuts it down.
async fn shut_down_mid_handler(
    kafka: &KafkaInbox,
    topic: &str,
    conn: &DatabaseConnection,
    grace: Duration,
    hold: Option<Duration>,
) -> ConsumerSummary {
    let entered = Arc::new(tokio::sync::Notify::new());
    let shutdown = {
        let entered = Arc::clone(&entered);
        async move {
            tokio::time::timeout(Duration::from_secs(60), entered.notified())
                .await
                .expect("the handler ran within 60 s");
        }
    };
    KafkaGroupConsumer::new(kafka.clone(), &kafka_consumer_config(), [topic])
        .with_options(ConsumerOptions::default().with_grace(grace))
        .run(conn.clone(), first_run_held(entered, hold), shutdown)
        .await
        .expect("the consumer loop")
}

/// A shutdown while a handler is in its transaction: past the grace period the record is
/// abandoned (rolled back: its effect gone with its marker and offset), within it the
/// record finishes and commits; a consumer started afterwards applies every message once.
async fn shutdown_finishes_or_abandons(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        prepare(&conn).await;
        let topic = format!("stop-{}", uuid::Uuid::new_v4().simple());
        let group = group_of(&topic);
        create_topic(&topic, PARTITIONS).await;
        produce_twice(&topic, 0..SHUTDOWN_MESSAGES).await;
        let ends = end_offsets_of(&topic, i64::from(SHUTDOWN_MESSAGES) * 2).await;
        let kafka = KafkaInbox::new(Inbox::new("billing").unwrap(), &group).unwrap();
        let markers = "SELECT COUNT(*) FROM inbox";
        let effects = "SELECT COUNT(*) FROM effect";

        let abandoned =
            shut_down_mid_handler(&kafka, &topic, &conn, Duration::from_millis(300), None).await;
        // At least the held record; on SQLite (one connection per pool) also the other
        // partitions' records, waiting for that connection.
        assert!(abandoned.abandoned >= 1, "{abandoned}");
        assert_eq!(
            scalar_i64(&conn, effects).await,
            scalar_i64(&conn, markers).await,
            "an effect without its marker, or a marker without its effect ({abandoned})"
        );
        assert_eq!(
            scalar_i64(&conn, effects).await,
            abandoned.processed as i64,
            "{abandoned}"
        );

        let finished = shut_down_mid_handler(
            &kafka,
            &topic,
            &conn,
            Duration::from_secs(30),
            Some(Duration::from_millis(500)),
        )
        .await;
        assert_eq!(finished.abandoned, 0, "{finished}");
        assert!(finished.processed >= 1, "{finished}");
        assert_eq!(
            scalar_i64(&conn, effects).await,
            (abandoned.processed + finished.processed) as i64,
            "{finished}"
        );

        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let rest = tokio::spawn(
            KafkaGroupConsumer::new(kafka.clone(), &kafka_consumer_config(), [topic.as_str()]).run(
                conn.clone(),
                effect_then_pause(Duration::ZERO, None),
                stopped,
            ),
        );
        wait_for_ends(&conn, &group, &topic, &ends, Duration::from_secs(60)).await;
        stop.send(()).expect("the consumer runs");
        rest.await
            .expect("the consumer's task")
            .expect("the consumer loop");
        assert_each_once(&conn, SHUTDOWN_MESSAGES).await;
        conn.close().await.ok();
    })
    .await
}

/// The messages of the rebalance test (each produced twice): stored before the second
/// consumer joins, held in flight by the first when it does, and produced after.
const SETTLED_MESSAGES: u32 = 60;
const HELD_MESSAGES: u32 = 60;
const LATER_MESSAGES: u32 = 60;
/// The longest the rebalance test waits for any one step.
const REBALANCE_STEP: Duration = Duration::from_secs(90);

/// The first consumer's gate: once `closed`, each of its handlers writes its effect, notes
/// its partition in `held` and waits, inside its transaction, until the test opens it.
struct Gate {
    closed: std::sync::atomic::AtomicBool,
    open: tokio::sync::watch::Sender<bool>,
    held: std::sync::Mutex<std::collections::BTreeSet<i32>>,
}

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            closed: std::sync::atomic::AtomicBool::new(false),
            open: tokio::sync::watch::Sender::new(false),
            held: std::sync::Mutex::default(),
        })
    }

    fn held(&self) -> std::collections::BTreeSet<i32> {
        self.held.lock().expect("the gate's partitions").clone()
    }
}

/// The first consumer's handler: [`insert_effect`], then the gate.
fn effect_then_gate(
    gate: Arc<Gate>,
) -> impl for<'t> Fn(&'t ObservedTransaction, Arc<OwnedMessage>) -> HandlerFuture<'t, (), BoxError>
+ Send
+ Sync
+ 'static {
    move |txn, record| {
        let gate = Arc::clone(&gate);
        Box::pin(async move {
            insert_effect(txn, &record).await?;
            if gate.closed.load(Ordering::SeqCst) {
                gate.held
                    .lock()
                    .expect("the gate's partitions")
                    .insert(record.partition());
                let mut open = gate.open.subscribe();
                // The test opens the gate or fails first; this bound only ends the handler
                // of a test that failed.
                tokio::time::timeout(2 * REBALANCE_STEP, open.wait_for(|open| *open))
                    .await
                    .map_err(|_| "the rebalance test never opened the gate")??;
            }
            Ok(())
        })
    }
}

/// Claims in this database waiting on the server: the second consumer's claim of a record
/// whose marker the first consumer's transaction, held at the gate, inserted (A's own
/// connections sit idle in their transactions meanwhile). MariaDB's INNODB_TRX did not
/// list such a waiting INSERT for seconds at a time; its process list shows it at once.
async fn claims_waiting(conn: &DatabaseConnection, backend: Backend) -> i64 {
    let sql = match backend {
        Backend::Postgres => {
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'"
        }
        _ => {
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO inbox%' AND TIME >= 1"
        }
    };
    scalar_i64(conn, sql).await
}

/// Kafka's committed offsets are no further than the database's stored ones.
async fn assert_committed_within_stored(
    conn: &DatabaseConnection,
    group: &str,
    topic: &str,
    when: &str,
) {
    let committed = committed_offsets(group, topic);
    let stored = stored_offsets(conn, group, topic, PARTITIONS).await;
    assert!(
        committed.iter().zip(&stored).all(|(kafka, db)| kafka <= db),
        "{when}: Kafka's committed offsets {committed:?} ran ahead of the database's {stored:?}"
    );
}

/// Issue 31's rebalance through two live loops, driven at known points rather than by
/// timing: consumer A alone stores the first messages; then its gate closes and the next
/// messages' handlers wait inside their transactions (effect and marker written, offset
/// not yet advanced) on every partition; consumer B joins the group. The group revokes
/// A's partitions and gives B its share, and B's claim of the first record A holds waits
/// for A's transaction: that wait, seen on the server, shows the rebalance happened
/// with records in flight. Then the gate opens, more messages arrive, and both loops run
/// to the partitions' ends: every message applied once (effect rows and inbox markers),
/// the stored offsets at the ends, Kafka's committed offsets never past the database's.
async fn rebalance_mid_stream_applies_each_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        prepare(&conn).await;
        let topic = format!("reb-{}", uuid::Uuid::new_v4().simple());
        let group = group_of(&topic);
        create_topic(&topic, PARTITIONS).await;
        let settled_end = SETTLED_MESSAGES;
        let held_end = settled_end + HELD_MESSAGES;
        let later_end = held_end + LATER_MESSAGES;
        // A's held transactions stay open until the gate opens: the handler's (and the
        // server's) silence bound, 20 s by default, would end them first on a slow join.
        let inbox = Inbox::new("billing")
            .unwrap()
            .with_partition_timeout(Duration::from_secs(600))
            .unwrap();
        let kafka = KafkaInbox::new(inbox, &group)
            .unwrap()
            .with_retry_delay(Duration::from_millis(100));
        let loop_of = |client: &str| {
            let mut config = kafka_consumer_config();
            config.set("client.id", client);
            KafkaGroupConsumer::new(kafka.clone(), &config, [topic.as_str()])
        };

        // A alone: the first messages stored and hinted to Kafka.
        produce_twice(&topic, 0..settled_end).await;
        let settled = end_offsets_of(&topic, i64::from(settled_end) * 2).await;
        let gate = Gate::new();
        let (stop_a, a_stopped) = tokio::sync::oneshot::channel::<()>();
        let a = tokio::spawn(loop_of("rebalance-a").run(
            db.connect_with(8).await,
            effect_then_gate(Arc::clone(&gate)),
            a_stopped,
        ));
        wait_for_ends(&conn, &group, &topic, &settled, REBALANCE_STEP).await;

        // A mid-stream: a transaction held open on every partition.
        gate.closed.store(true, Ordering::SeqCst);
        produce_twice(&topic, settled_end..held_end).await;
        let held_ends = end_offsets_of(&topic, i64::from(held_end) * 2).await;
        let fed: std::collections::BTreeSet<i32> = (0..PARTITIONS)
            .filter(|&partition| held_ends[partition as usize] > settled[partition as usize])
            .collect();
        assert_eq!(
            fed.len(),
            PARTITIONS as usize,
            "the held messages reached partitions {fed:?} only: the test needs records in flight on every one"
        );
        let started = Instant::now();
        while gate.held() != fed {
            assert!(
                started.elapsed() < REBALANCE_STEP,
                "A's handlers reached the gate on partitions {:?} of {fed:?} within {REBALANCE_STEP:?}",
                gate.held()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            stored_offsets(&conn, &group, &topic, PARTITIONS).await,
            settled,
            "nothing held at the gate is stored"
        );
        assert_committed_within_stored(&conn, &group, &topic, "A at the gate").await;

        // B joins; the rebalance moves partitions A holds records of to B.
        let (stop_b, b_stopped) = tokio::sync::oneshot::channel::<()>();
        let b = tokio::spawn(loop_of("rebalance-b").run(
            db.connect_with(8).await,
            effect_then_pause(Duration::ZERO, None),
            b_stopped,
        ));
        let started = Instant::now();
        while claims_waiting(&conn, backend).await == 0 {
            assert!(
                started.elapsed() < REBALANCE_STEP,
                "B never waited on a record A holds within {REBALANCE_STEP:?}: no rebalance gave it a partition (stored {:?}, committed {:?})",
                stored_offsets(&conn, &group, &topic, PARTITIONS).await,
                committed_offsets(&group, &topic)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let joined_after = started.elapsed();
        assert_eq!(
            stored_offsets(&conn, &group, &topic, PARTITIONS).await,
            settled,
            "B waits for A's transactions: nothing more is stored"
        );
        assert_committed_within_stored(&conn, &group, &topic, "B waiting on A").await;

        // The gate opens; more messages for both to share.
        gate.open.send_replace(true);
        produce_twice(&topic, held_end..later_end).await;
        let total = i64::from(later_end) * 2;
        let ends = end_offsets_of(&topic, total).await;
        wait_for_ends(&conn, &group, &topic, &ends, REBALANCE_STEP).await;
        assert_committed_within_stored(&conn, &group, &topic, "both at the ends").await;
        stop_a.send(()).expect("A runs");
        stop_b.send(()).expect("B runs");
        let a = a.await.expect("A's task").expect("A's loop");
        let b = b.await.expect("B's task").expect("B's loop");
        eprintln!(
            "{backend:?}: {total} records; B reached A's held records {joined_after:?} after it started; A: {a}; B: {b}"
        );
        assert_each_once(&conn, later_end).await;
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            i64::from(later_end),
            "inbox markers"
        );
        assert_eq!(stored_offsets(&conn, &group, &topic, PARTITIONS).await, ends);
        assert_committed_within_stored(&conn, &group, &topic, "after both stopped").await;
        assert!(b.processed > 0, "B processed nothing after the rebalance: {b}");
        conn.close().await.ok();
    })
    .await
}

mod shutdown {
    use super::shutdown_finishes_or_abandons;
    inbox_tests::on_every_backend!(
        needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
        shutdown_finishes_or_abandons
    );
}

mod group {
    use super::two_consumers_one_killed;
    inbox_tests::on_every_backend!(
        needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
        two_consumers_one_killed
    );
}

mod round_trips {
    use super::round_trips_per_record_below_the_hand_written;
    inbox_tests::on_server_backends!(
        needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
        round_trips_per_record_below_the_hand_written
    );
}

mod rebalance {
    use super::rebalance_mid_stream_applies_each_once;
    inbox_tests::on_server_backends!(
        needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
        rebalance_mid_stream_applies_each_once
    );
}

mod cut {
    use super::database_cut_commits_nothing_ahead;
    inbox_tests::on_server_backends!(
        needs(inbox_kafka, "set INBOX_TEST_KAFKA_BOOTSTRAP (tests/cluster/kafka.sh start)");
        database_cut_commits_nothing_ahead
    );
}
