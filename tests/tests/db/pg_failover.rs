//! PostgreSQL failover: 4 replicas consume a stream through HAProxy (the stable address)
//! while the primary is killed (`pg_ctl stop -m immediate`) and the standby promoted. The
//! pools reconnect through the same address, `Inbox::process` retries what the failover
//! broke, the broker redelivers what was nacked, and the redeliveries land on the new
//! primary.
//!
//! - Synchronous standby (`synchronous_commit = remote_apply`): what a replica saw
//!   committed is on the standby, so after the failover every message is applied exactly
//!   once and acked.
//! - Asynchronous standby, made to lag (it stops receiving WAL 200 acks before the kill):
//!   the commits it never received are lost. A marker and its effect commit together, so
//!   they are lost together: never applied twice, but a message acked before the loss is
//!   not redelivered and its effect is gone. The run reports how many.
//! - Standby down: a COMMIT waits; cancelling the wait commits locally anyway (a warning,
//!   no error), so the client sees `Processed` for a commit the standby never got, and a
//!   redelivery is a `Duplicate`.
//!
//! Each test builds its own cluster with `tests/cluster/pg-failover.sh` (ports 5433-5435,
//! data under /tmp/inbox-pgfailover, needs root for `runuser`, HAProxy and PostgreSQL 15)
//! and stops it at the end, so they are ignored unless asked for, and then run one at a
//! time:
//!
//! ```sh
//! INBOX_TEST_PG_FAILOVER=1 cargo test -p inbox-tests --test db pg_failover:: -- --ignored --nocapture
//! ```

use inbox_tests::{
    Backend, Broker, Plan, Report, assert_exactly_once, cluster_script, create_effects,
    fresh_db_at, run, run_replicas, scalar_i64,
};
use sea_orm::{DatabaseConnection, DbErr};
use sea_orm_inbox::{Inbox, Outcome, RetryPolicy};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

const REPLICAS: usize = 4;
const MESSAGES: usize = 2_000;
const CLUSTER_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/pg-failover.sh");
/// Acks the asynchronous primary gives while its standby receives nothing.
const LAG: u64 = 200;
const STABLE_URL: &str = "postgres://postgres@127.0.0.1:5435/test";

/// One cluster on fixed ports: the tests of this file take turns.
static CLUSTER: Mutex<()> = Mutex::const_new(());

/// Runs `pg-failover.sh <args>`, failing the test if it fails; returns its stdout.
async fn cluster(args: &[&str]) -> String {
    cluster_script(CLUSTER_SCRIPT, args).await
}

/// A fresh cluster in `mode` (`sync` or `async`).
async fn fresh_cluster(mode: &str) {
    cluster(&["stop"]).await;
    cluster(&["start", mode]).await;
}

/// What the failover task saw.
struct Failover {
    acks_before: u64,
    pending_after: u64,
    took: Duration,
}

/// Runs the stream through the stable address and fails the primary over once a quarter
/// of the messages are acked. With `lag` acks, the standby first stops receiving WAL and
/// the primary goes on for that many acks before it is killed.
async fn consume_through_a_failover(
    mode: &str,
    lag: u64,
) -> (Plan, Report, Failover, DatabaseConnection) {
    fresh_cluster(mode).await;
    let db = fresh_db_at(Backend::Postgres, STABLE_URL).await;
    db.migrate().await;
    let conn = db.connect().await;
    create_effects(&conn).await;
    conn.close().await.ok();
    let plan = Plan::new(MESSAGES, 30, 5, 0xfa170);
    let broker = Broker::new(&plan.deliveries);
    let failover = {
        let broker = broker.clone();
        tokio::spawn(async move {
            let quarter = MESSAGES as u64 / 4;
            broker
                .wait_for_acks(quarter, Duration::from_secs(300))
                .await;
            if lag > 0 {
                cluster(&["pause-replication"]).await;
                broker
                    .wait_for_acks(quarter + lag, Duration::from_secs(300))
                    .await;
            }
            let acks_before = broker.stats().acks;
            let started = Instant::now();
            cluster(&["kill-primary"]).await;
            cluster(&["promote"]).await;
            Failover {
                acks_before,
                pending_after: broker.stats().pending,
                took: started.elapsed(),
            }
        })
    };
    let report = run_replicas(&db, &broker, &plan, REPLICAS, Duration::from_secs(600)).await;
    let failover = failover.await.expect("the failover ran");
    println!(
        "{mode} failover after {} acks (kill + promote took {:.1?}; {} pending then); \
         {REPLICAS} replicas: {report}",
        failover.acks_before, failover.took, failover.pending_after
    );
    assert!(
        failover.pending_after > 0,
        "the failover must land in the middle of the run"
    );
    let conn = db.connect().await;
    (plan, report, failover, conn)
}

/// Asked for with `--ignored`, a test still needs the permission to build a cluster.
fn require_permission() {
    assert_eq!(
        std::env::var("INBOX_TEST_PG_FAILOVER").as_deref(),
        Ok("1"),
        "this test builds a PostgreSQL cluster on ports 5433-5435: set INBOX_TEST_PG_FAILOVER=1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-pg.sh runs it (--ignored, with INBOX_TEST_PG_FAILOVER=1); it builds a primary + standby behind HAProxy on ports 5433-5435"]
async fn synchronous_failover_applies_every_message_once() {
    require_permission();
    let _turn = CLUSTER.lock().await;
    let (plan, report, _, conn) = consume_through_a_failover("sync", 0).await;
    assert!(
        report.broker.nacks + report.transient_retries > plan.failing.len() as u64,
        "the failover disrupted some deliveries: {report}"
    );
    assert_exactly_once(&conn, &plan, &report).await;
    conn.close().await.ok();
    cluster(&["stop"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-pg.sh runs it (--ignored, with INBOX_TEST_PG_FAILOVER=1); it builds a primary + standby behind HAProxy on ports 5433-5435"]
async fn asynchronous_failover_never_applies_twice_and_reports_what_it_lost() {
    require_permission();
    let _turn = CLUSTER.lock().await;
    let (plan, report, _, conn) = consume_through_a_failover("async", LAG).await;
    let messages = plan.ids.len() as i64;
    let effects = scalar_i64(&conn, "SELECT COUNT(*) FROM effect").await;
    let distinct = scalar_i64(&conn, "SELECT COUNT(DISTINCT message_id) FROM effect").await;
    let markers = scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await;
    let lost = messages - distinct;
    println!(
        "async failover, the standby {LAG} acks behind: {messages} messages, {effects} \
         effects, {markers} markers on the new primary: {lost} acked messages lost with their \
         markers, 0 applied twice"
    );
    assert!(
        lost > 0,
        "the commits the standby never received are gone, though acked: {report}"
    );
    assert_eq!(effects, distinct, "never applied twice: {report}");
    assert_eq!(
        markers, effects,
        "a marker and its effect are kept or lost together: {report}"
    );
    assert_eq!(
        report.broker.acked_messages, messages as u64,
        "every message acked: {report}"
    );
    conn.close().await.ok();
    cluster(&["stop"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-pg.sh runs it (--ignored, with INBOX_TEST_PG_FAILOVER=1); it builds a primary + standby behind HAProxy on ports 5433-5435"]
async fn standby_down_commit_waits_and_a_cancelled_wait_has_committed() {
    require_permission();
    let _turn = CLUSTER.lock().await;
    fresh_cluster("sync").await;
    let db = fresh_db_at(Backend::Postgres, STABLE_URL).await;
    db.migrate().await;
    let conn = db.connect().await;
    create_effects(&conn).await;
    cluster(&["stop-standby"]).await;

    let id = uuid::Uuid::new_v4();
    let inbox = Inbox::new("failover.ambiguous")
        .expect("valid consumer")
        .with_retry(RetryPolicy::no_retry());
    let waiting = {
        let (conn, inbox) = (conn.clone(), inbox.clone());
        tokio::spawn(async move { process_once(&inbox, &conn, id).await })
    };
    let admin = db.connect_with(1).await;
    let waiting_for_standby = "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
    let deadline = Instant::now() + Duration::from_secs(60);
    while scalar_i64(&admin, waiting_for_standby).await == 0 {
        assert!(
            !waiting.is_finished(),
            "the COMMIT returned without the standby"
        );
        assert!(Instant::now() < deadline, "the COMMIT never waited");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Still waiting a second later: without a standby it would wait forever.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "the COMMIT waits for the standby");
    run(
        &admin,
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
    )
    .await;
    let first = waiting.await.expect("the waiting task");
    assert!(
        matches!(first, Ok(Outcome::Processed(()))),
        "a cancelled wait has committed locally, and says so only in a warning: {first:?}"
    );
    let redelivery = process_once(&inbox, &conn, id).await;
    assert!(
        matches!(redelivery, Ok(Outcome::Duplicate)),
        "the redelivery finds the marker: {redelivery:?}"
    );
    assert_eq!(scalar_i64(&admin, "SELECT COUNT(*) FROM effect").await, 1);
    println!(
        "standby down: the COMMIT waited until cancelled, then reported success; \
         the redelivery was a Duplicate; 1 effect"
    );
    // Every later commit would wait too: tear the cluster down instead of dropping the
    // database.
    admin.close().await.ok();
    conn.close().await.ok();
    cluster(&["stop"]).await;
}

/// Messages the outbox test's writers consume, each enqueueing one outgoing message.
const OUTBOX_MESSAGES: usize = 600;
const OUTBOX_CONSUMER: &str = "failover.outbox";

/// Synchronous standby, writers and relays through HAProxy while the primary fails over:
/// two writers consume messages through `Inbox::process`, each handler writing an effect
/// and enqueueing one message (id derived from the incoming one, so a retried or
/// redelivered attempt writes the same row); a message whose `process` failed is
/// redelivered. Two relays (a pool each) publish and mark with `relay_once` and a short
/// lease, riding out the failed batches. After the run every committed message's outbox
/// row is on the new primary, marked sent and published at least once, with its own id
/// every time (a row published before the kill and marked too late is published again
/// once its lease ends): 0 lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "cluster suite: bash tests/cluster/ci-pg.sh runs it (--ignored, with INBOX_TEST_PG_FAILOVER=1); it builds a primary + standby behind HAProxy on ports 5433-5435"]
async fn synchronous_failover_publishes_every_committed_outbox_row() {
    use inbox_tests::RecordingPublisher;
    use sea_orm::ConnectionTrait;
    use sea_orm_inbox::{
        MessageId, OutboxExt, OutgoingMessage, Relay, RelayOptions, outbox_backlog,
    };
    use sea_orm_inbox_migration::MigratorTrait;
    use std::collections::HashSet;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    require_permission();
    let _turn = CLUSTER.lock().await;
    fresh_cluster("sync").await;
    let db = fresh_db_at(Backend::Postgres, STABLE_URL).await;
    db.migrate().await;
    let conn = db.connect().await;
    sea_orm_inbox_migration::MigratorWithOutbox::up(&conn, None)
        .await
        .expect("run CreateOutbox");
    create_effects(&conn).await;
    conn.close().await.ok();

    let incoming: Arc<Vec<MessageId>> = Arc::new(
        (0..OUTBOX_MESSAGES)
            .map(|_| MessageId::from_uuid(uuid::Uuid::new_v4()))
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let committed = Arc::new(AtomicU64::new(0));
    let redeliveries = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut writers = Vec::new();
    for writer in 0..2i32 {
        let pool = db.connect().await;
        let (incoming, next) = (Arc::clone(&incoming), Arc::clone(&next));
        let (committed, redeliveries) = (Arc::clone(&committed), Arc::clone(&redeliveries));
        writers.push(tokio::spawn(async move {
            let inbox = Inbox::new(OUTBOX_CONSUMER)
                .expect("valid consumer")
                .with_retry(RetryPolicy::default().max_attempts(5));
            loop {
                let n = next.fetch_add(1, Ordering::SeqCst);
                let Some(&id) = incoming.get(n) else { break };
                // Redelivered until `process` says the message is in (Processed, or
                // Duplicate when an earlier attempt's COMMIT landed unanswered).
                loop {
                    let outcome = inbox
                        .process(&pool, id, |txn| {
                            Box::pin(async move {
                                txn.execute_raw(inbox_tests::stmt(
                                    txn.get_database_backend(),
                                    "INSERT INTO effect (message_id, replica) VALUES (?, ?)",
                                    vec![id.as_uuid().to_string().into(), writer.into()],
                                ))
                                .await
                                .map_err(|source| {
                                    sea_orm_inbox::OutboxError::Database {
                                        operation: "the effect",
                                        source,
                                    }
                                })?;
                                txn.enqueue(
                                    OutgoingMessage::new("events", n.to_string().into_bytes())
                                        .message_id(id.outgoing(OUTBOX_CONSUMER, 0)),
                                )
                                .await
                                .map(|_| ())
                            })
                        })
                        .await;
                    match outcome {
                        Ok(Outcome::Processed(()) | Outcome::Duplicate) => break,
                        Ok(other) => panic!("message {n}: {other:?}"),
                        Err(_) => {
                            redeliveries.fetch_add(1, Ordering::SeqCst);
                            assert!(Instant::now() < deadline, "message {n} never committed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
                committed.fetch_add(1, Ordering::SeqCst);
            }
            pool.close().await.ok();
        }));
    }

    let recorder = Arc::new(RecordingPublisher::default());
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let options = RelayOptions {
        batch_size: 20,
        // Short, so a row published before the kill and not marked goes out again within
        // the test; still several publish timeouts long.
        lease: Duration::from_secs(3),
        publish_timeout: Duration::from_millis(500),
        max_attempts: 10,
        backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
        poll_interval: Duration::from_millis(50),
    };
    let mut relays = Vec::new();
    for _ in 0..2 {
        let pool = db.connect().await;
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(options.clone())
            .expect("options");
        let writing = Arc::clone(&writing);
        relays.push(tokio::spawn(async move {
            let mut failed_batches = 0u64;
            loop {
                if relay.relay_once(&pool).await.is_err() {
                    failed_batches += 1;
                }
                if !writing.load(Ordering::SeqCst)
                    && outbox_backlog(&pool).await.is_ok_and(|b| b.pending == 0)
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the relays never drained the outbox"
                );
                tokio::time::sleep(options.poll_interval).await;
            }
            pool.close().await.ok();
            (failed_batches, relay.metrics().snapshot())
        }));
    }

    while committed.load(Ordering::SeqCst) < OUTBOX_MESSAGES as u64 / 4 {
        assert!(
            Instant::now() < deadline,
            "the writers stalled before the failover"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let committed_at_kill = committed.load(Ordering::SeqCst);
    let published_at_kill = recorder.published().len();
    let started = Instant::now();
    cluster(&["kill-primary"]).await;
    cluster(&["promote"]).await;
    let took = started.elapsed();
    for writer in writers {
        writer.await.expect("a writer");
    }
    writing.store(false, Ordering::SeqCst);
    let (mut failed_batches, mut lost_leases, mut marked) = (0, 0, 0);
    for relay in relays {
        let (failed, metrics) = relay.await.expect("a relay");
        failed_batches += failed;
        lost_leases += metrics.lost_leases;
        marked += metrics.published;
    }

    let conn = db.connect().await;
    let rows = scalar_i64(&conn, "SELECT COUNT(*) FROM outbox").await;
    let sent = scalar_i64(
        &conn,
        "SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL",
    )
    .await;
    let effects = scalar_i64(&conn, "SELECT COUNT(*) FROM effect").await;
    let publishes = recorder.published().len();
    let counts = recorder.counts();
    let expected: HashSet<MessageId> = incoming
        .iter()
        .map(|id| id.outgoing(OUTBOX_CONSUMER, 0))
        .collect();
    let lost = expected
        .iter()
        .filter(|id| !counts.contains_key(id))
        .count();
    let strangers = counts.keys().filter(|id| !expected.contains(id)).count();
    let republished = publishes - counts.len();
    println!(
        "sync failover with the outbox after {committed_at_kill} commits and \
         {published_at_kill} publishes (kill + promote took {took:.1?}): {OUTBOX_MESSAGES} \
         messages committed by 2 writers ({} redeliveries), {rows} outbox rows, {sent} sent, \
         {effects} effects; 2 relays: {publishes} publishes of {} ids, {republished} \
         republished with their own id, {marked} marked, {failed_batches} failed batches, \
         {lost_leases} lost leases; {lost} lost",
        redeliveries.load(Ordering::SeqCst),
        counts.len(),
    );
    assert!(
        published_at_kill > 0 && committed_at_kill < OUTBOX_MESSAGES as u64,
        "the failover must land while rows are written and published"
    );
    assert_eq!(
        (rows, sent, effects),
        (
            OUTBOX_MESSAGES as i64,
            OUTBOX_MESSAGES as i64,
            OUTBOX_MESSAGES as i64
        ),
        "(outbox rows, sent rows, effects): one of each per committed message survived"
    );
    assert_eq!((lost, strangers), (0, 0), "(never published, unknown ids)");
    conn.close().await.ok();
    cluster(&["stop"]).await;
}

async fn process_once(
    inbox: &Inbox,
    conn: &DatabaseConnection,
    id: uuid::Uuid,
) -> Result<Outcome<()>, sea_orm_inbox::ProcessError<DbErr>> {
    inbox
        .process(conn, id, |txn| {
            Box::pin(async move {
                run_effect(txn, id).await?;
                Ok(())
            })
        })
        .await
}

async fn run_effect(txn: &impl sea_orm::ConnectionTrait, id: uuid::Uuid) -> Result<(), DbErr> {
    txn.execute_raw(inbox_tests::stmt(
        txn.get_database_backend(),
        "INSERT INTO effect (message_id, replica) VALUES (?, 0)",
        vec![id.to_string().into()],
    ))
    .await
    .map(|_| ())
}
