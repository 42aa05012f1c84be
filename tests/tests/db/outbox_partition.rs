//! A relay cut off from the database in the middle of its claim, as a NAT or load balancer
//! does when it silently drops a flow: the sockets stay open and nothing more arrives
//! either way. On PostgreSQL the cut comes before the claim's COMMIT reaches the server, so
//! the claim's transaction stays open there with its locks (the proxy's
//! `partition_before_commit`); on MySQL/MariaDB, whose claim is three statements in
//! autocommit with no transaction to leave open, as the first of them runs (its reply is
//! lost: `partition_at_next_execute`). What must hold, with a short partition timeout so
//! the suite stays fast: the claim locks at most the rows it claims; the cut-off relay's
//! call returns within its partition timeout; the server ends the abandoned claim within
//! the same bound; and the other relays keep publishing, every committed event once.
//!
//! PostgreSQL and MariaDB only: SQLite is embedded, with no network to lose.

use inbox_tests::{
    Backend, ProxiedDb, RecordingPublisher, connect_url, on_server_backends, stmt, with_proxied_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{
    MessageId, OutboxError, OutboxExt, OutgoingMessage, Relay, RelayOptions, outbox_backlog,
    timestamp_value,
};
use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::timeout;

/// The partition timeout of every relay in these tests.
const PARTITION_TIMEOUT: Duration = Duration::from_secs(2);

/// Scheduling slack on a loaded machine, added to every bound asserted.
const SLACK: Duration = Duration::from_secs(3);

/// How long a test waits for a call before it reports the call as hung.
const GIVE_UP: Duration = Duration::from_secs(40);

fn options(batch_size: u32) -> RelayOptions {
    RelayOptions {
        batch_size,
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(5),
        backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        poll_interval: Duration::from_millis(20),
        ..RelayOptions::default()
    }
}

fn relay(publisher: Arc<RecordingPublisher>, batch_size: u32) -> Relay<Arc<RecordingPublisher>> {
    Relay::new(publisher)
        .with_options(options(batch_size))
        .and_then(|relay| relay.with_partition_timeout(PARTITION_TIMEOUT))
        .expect("a valid relay")
}

/// [`with_proxied_db`] with the outbox's migration applied too.
async fn with_proxied_outbox(backend: Backend, body: impl AsyncFnOnce(&ProxiedDb)) {
    with_proxied_db(backend, async |fixture| {
        let txn = fixture.direct.begin().await.expect("begin CreateOutbox");
        MigratorWithOutbox::up(&txn, None)
            .await
            .expect("run CreateOutbox");
        txn.commit().await.expect("commit CreateOutbox");
        body(fixture).await;
    })
    .await;
}

/// Enqueues `count` messages, each in a transaction of its own, and returns their ids.
async fn enqueue(conn: &DatabaseConnection, count: usize) -> Vec<MessageId> {
    let mut ids = Vec::with_capacity(count);
    for n in 0..count {
        let id = conn
            .enqueue(OutgoingMessage::new("events", n.to_string().into_bytes()))
            .await
            .expect("enqueue");
        ids.push(id);
    }
    ids
}

/// Cuts the next relay off from the database in the middle of its claim (see the module
/// docs).
fn cut_off_at_the_claim(fixture: &ProxiedDb, backend: Backend) {
    match backend {
        Backend::MySql => fixture.proxy.partition_at_next_execute(),
        _ => fixture.proxy.partition_before_commit(),
    }
}

/// The first column of every row of `sql`, read in a transaction of its own.
async fn row_ids(conn: &DatabaseConnection, sql: &str) -> Vec<i64> {
    let txn = conn.begin().await.expect("begin");
    let rows = txn
        .query_all_raw(stmt(conn.get_database_backend(), sql, vec![]))
        .await
        .unwrap_or_else(|err| panic!("{sql}: {err}"));
    txn.rollback().await.expect("rollback");
    rows.iter()
        .map(|row| row.try_get_by_index::<i64>(0).expect("an id"))
        .collect()
}

/// The unsent rows no open transaction holds a lock on, as another relay's claim sees
/// them.
async fn unlocked_unsent_rows(conn: &DatabaseConnection) -> Vec<i64> {
    row_ids(
        conn,
        "SELECT id FROM outbox WHERE sent_at IS NULL ORDER BY id FOR UPDATE SKIP LOCKED",
    )
    .await
}

/// Rows 1-3 of six are leased to another relay (not due); a relay through the proxy claims
/// one row (row 4) and is cut off in its claim. While its transaction stays open on the
/// server (PostgreSQL), every other unsent row must be free for a second connection to
/// lock: the claim locks only what it claims; on MySQL/MariaDB no row is locked. (Before,
/// MariaDB's locking read kept the locks of rows 1-3, which it read and rejected; then,
/// while its claim was a transaction, row 4's.)
async fn a_claim_locks_only_the_rows_it_claims(backend: Backend) {
    with_proxied_outbox(backend, async |fixture| {
        enqueue(&fixture.direct, 6).await;
        let ids = row_ids(&fixture.direct, "SELECT id FROM outbox ORDER BY id").await;
        let leased_until = chrono::Utc::now() + chrono::Duration::hours(1);
        fixture
            .direct
            .execute_raw(stmt(
                fixture.direct.get_database_backend(),
                "UPDATE outbox SET leased_until = ? WHERE id <= ?",
                vec![
                    timestamp_value(fixture.direct.get_database_backend(), leased_until),
                    ids[2].into(),
                ],
            ))
            .await
            .expect("lease rows 1-3 to another relay");

        let cut_off = relay(Arc::default(), 1);
        cut_off_at_the_claim(fixture, backend);
        let claim = timeout(GIVE_UP, cut_off.relay_once(&fixture.through_proxy));
        let probe = async {
            fixture.partition_started().await;
            unlocked_unsent_rows(&fixture.direct).await
        };
        let (claim, unlocked) = tokio::join!(claim, probe);
        eprintln!("{backend:?}: claim {claim:?}; unlocked during the cut: {unlocked:?}");
        let claim = claim.expect("the cut-off relay is still waiting on the database");
        assert!(
            matches!(claim, Err(OutboxError::DatabaseSilent { .. })),
            "{claim:?}"
        );
        let free: Vec<i64> = match backend {
            // No claim statement outlives its own run: nothing stays locked.
            Backend::MySql => ids.clone(),
            _ => ids.iter().copied().filter(|&id| id != ids[3]).collect(),
        };
        assert_eq!(
            unlocked, free,
            "the open claim holds a lock on row {} at most",
            ids[3]
        );
    })
    .await;
}

/// A relay cut off in its claim (see the module docs): its call returns within its
/// partition timeout, and the server ends the abandoned claim within the same bound, so another relay then
/// claims and publishes the rows. (Before, the claim's transaction had no server-side
/// bound: the rows stayed locked until the server's keepalive or `wait_timeout`, hours.)
async fn a_relay_cut_off_at_its_claim_releases_the_rows_within_the_partition_timeout(
    backend: Backend,
) {
    with_proxied_outbox(backend, async |fixture| {
        let ids = enqueue(&fixture.direct, 5).await;
        let cut_off = relay(Arc::default(), 10);
        cut_off_at_the_claim(fixture, backend);
        let (claim, partitioned_at) = tokio::join!(
            timeout(GIVE_UP, cut_off.relay_once(&fixture.through_proxy)),
            fixture.partition_started()
        );
        let returned_after = partitioned_at.elapsed();
        assert!(
            returned_after < PARTITION_TIMEOUT + SLACK,
            "the cut-off relay returned after {returned_after:?}"
        );
        let claim = claim.expect("the cut-off relay is still waiting on the database");
        assert!(
            matches!(claim, Err(OutboxError::DatabaseSilent { .. })),
            "{claim:?}"
        );

        let mut released = Vec::new();
        while partitioned_at.elapsed() < PARTITION_TIMEOUT + SLACK {
            released = unlocked_unsent_rows(&fixture.direct).await;
            if released.len() == ids.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let after = partitioned_at.elapsed();
        eprintln!(
            "{backend:?}: {} rows free {after:?} into the cut",
            released.len()
        );
        assert_eq!(
            released.len(),
            ids.len(),
            "the server still holds the cut-off claim's rows {after:?} into the cut"
        );

        let recorder = Arc::new(RecordingPublisher::default());
        let report = relay(Arc::clone(&recorder), 10)
            .drain(&fixture.direct)
            .await
            .expect("drain");
        assert_eq!(report.published, ids.len() as u64, "{report:?}");
        assert_eq!(recorder.published(), ids, "each once, in order");
    })
    .await;
}

/// Three relays on pools of their own; one, through the proxy, is cut off for good at its
/// first claim (see the module docs), while 150 events wait and 60 more are committed
/// during the cut.
/// The other two keep publishing (some within the cut's first second) and publish every
/// committed event, each once; the cut-off one publishes nothing. (Before, on MariaDB the
/// cut-off claim kept every row its read had scanned locked, and on both servers its
/// rows stayed locked for hours.)
async fn three_relays_one_cut_off_the_others_publish_everything(backend: Backend) {
    with_proxied_outbox(backend, async |fixture| {
        let mut expected = enqueue(&fixture.direct, 150).await;
        let healthy = Arc::new(RecordingPublisher::default());
        let cut_off_publisher = Arc::new(RecordingPublisher::default());

        cut_off_at_the_claim(fixture, backend);
        let cut_off = relay(Arc::clone(&cut_off_publisher), 10);
        let through_proxy = fixture.through_proxy.clone();
        let cut_off_task = tokio::spawn(async move {
            cut_off.run(&through_proxy, std::future::pending()).await;
        });
        let partitioned_at = fixture.partition_started().await;

        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut healthy_tasks = Vec::new();
        for _ in 0..2 {
            let pool = connect_url(&fixture.direct_url, 5).await;
            let relay = relay(Arc::clone(&healthy), 10);
            let mut stopped = stopped.clone();
            healthy_tasks.push(tokio::spawn(async move {
                relay
                    .run(&pool, async move {
                        stopped.wait_for(|stop| *stop).await.ok();
                    })
                    .await;
                pool.close().await.ok();
            }));
        }

        let producer = async {
            let mut produced = Vec::new();
            for _ in 0..60 {
                produced.extend(enqueue(&fixture.direct, 1).await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            produced
        };
        let early = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            healthy.published().len()
        };
        let (produced, published_in_first_second) = tokio::join!(producer, early);
        expected.extend(produced);

        let deadline = PARTITION_TIMEOUT + SLACK + Duration::from_secs(10);
        while healthy.counts().len() < expected.len() && partitioned_at.elapsed() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let waited = partitioned_at.elapsed();
        stop.send(true).ok();
        for task in healthy_tasks {
            task.await.expect("a healthy relay");
        }
        cut_off_task.abort();

        let counts = healthy.counts();
        let published: HashSet<MessageId> = counts.keys().copied().collect();
        let missing = expected
            .iter()
            .filter(|id| !published.contains(id))
            .count();
        eprintln!(
            "{backend:?}: {} of {} published after {waited:?} ({published_in_first_second} in the cut's first second), {missing} missing",
            published.len(),
            expected.len()
        );
        assert_eq!(missing, 0, "every committed event published by the others");
        assert_eq!(published.len(), expected.len(), "nothing else published");
        assert!(
            counts.values().all(|&n| n == 1),
            "each event published once"
        );
        assert!(
            cut_off_publisher.published().is_empty(),
            "the cut-off relay never got its claim"
        );
        assert!(
            published_in_first_second > 0,
            "the healthy relays published within the cut's first second"
        );
        let backlog = outbox_backlog(&fixture.direct).await.expect("backlog");
        assert_eq!(backlog.pending, 0, "{backlog:?}");
    })
    .await;
}

on_server_backends!(
    a_claim_locks_only_the_rows_it_claims,
    a_relay_cut_off_at_its_claim_releases_the_rows_within_the_partition_timeout,
    three_relays_one_cut_off_the_others_publish_everything,
);
