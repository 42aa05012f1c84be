//! The transactional outbox: enqueue commits and rolls back with the caller's transaction,
//! and relays on separate pools publish every row once, in order per key, parking poison
//! rows without holding back other keys.

use inbox_tests::{
    Backend, LostReplyProxy, TestDb, on_every_backend, on_pgbouncer, on_server_backends,
    poll_then_drop, scalar, scalar_i64, with_migrated_db, with_migrated_outbox_db,
};
use sea_orm::{ConnAcquireErr, ConnectionTrait, DatabaseConnection, DbErr, TransactionTrait};
use sea_orm_inbox::{
    Inbox, MessageId, OutboxError, OutboxExt, OutboxMessage, Outcome, OutgoingMessage,
    PublishError, Publisher, Relay, RelayOptions, SchemaError, list_dead_messages, outbox_backlog,
    purge_sent_messages, requeue_dead_message, verify_outbox_schema,
};
use sea_orm_inbox_migration::MigratorTrait;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

/// What a handler does: one business write and one outgoing message, through whatever
/// connection it is given.
async fn place_order<C: ConnectionTrait>(
    conn: &C,
    message: OutgoingMessage,
) -> Result<MessageId, OutboxError> {
    conn.execute_unprepared("INSERT INTO orders (note) VALUES ('placed')")
        .await
        .map_err(|source| OutboxError::Database {
            operation: "the order insert",
            source,
        })?;
    conn.enqueue(message).await
}

async fn create_orders(conn: &impl ConnectionTrait) {
    let sql = match conn.get_database_backend() {
        sea_orm::DbBackend::MySql => {
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, note VARCHAR(20) NOT NULL)"
        }
        sea_orm::DbBackend::Postgres => {
            "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, note VARCHAR(20) NOT NULL)"
        }
        _ => {
            "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, note VARCHAR(20) NOT NULL)"
        }
    };
    conn.execute_unprepared(sql).await.expect("create orders");
}

/// A stand-in broker: records every publish in order; refuses payloads in `poison` (until
/// `cured`); takes `latency` to confirm; and, while `hang` is set, records and then never
/// confirms (a relay killed after the broker took the message).
#[derive(Default)]
struct Recorder {
    published: Mutex<Vec<OutboxMessage>>,
    poison: Vec<Vec<u8>>,
    cured: AtomicBool,
    hang: AtomicBool,
    latency: Duration,
}

impl Recorder {
    fn ids(&self) -> Vec<MessageId> {
        self.published
            .lock()
            .expect("recorder lock")
            .iter()
            .map(|message| message.message_id)
            .collect()
    }

    fn payloads(&self) -> Vec<Vec<u8>> {
        self.published
            .lock()
            .expect("recorder lock")
            .iter()
            .map(|message| message.payload.clone())
            .collect()
    }
}

impl Publisher for Recorder {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        if self.poison.contains(&message.payload) && !self.cured.load(Ordering::SeqCst) {
            return Err(PublishError::Transient("the broker choked on it".into()));
        }
        self.published
            .lock()
            .expect("recorder lock")
            .push(message.clone());
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.latency).await;
        Ok(())
    }
}

fn quick_options() -> RelayOptions {
    RelayOptions {
        batch_size: 20,
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(5),
        max_attempts: 3,
        backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        poll_interval: Duration::from_millis(20),
    }
}

async fn outbox_rows(conn: &DatabaseConnection) -> i64 {
    scalar_i64(conn, "SELECT COUNT(*) FROM outbox").await
}

async fn enqueue_commits_and_rolls_back_with_the_transaction(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        create_orders(&conn).await;

        let txn = conn.begin().await.expect("begin");
        place_order(&txn, OutgoingMessage::new("orders", b"1".to_vec()))
            .await
            .expect("enqueue");
        txn.rollback().await.expect("rollback");
        assert_eq!(outbox_rows(&conn).await, 0, "rolled back with the order");
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM orders").await, 0);

        let txn = conn.begin().await.expect("begin");
        let id = place_order(
            &txn,
            OutgoingMessage::new("orders", b"2".to_vec())
                .key("order-2")
                .header("content-type", "text/plain"),
        )
        .await
        .expect("enqueue");
        txn.commit().await.expect("commit");
        assert_eq!(outbox_rows(&conn).await, 1, "committed with the order");

        // Inside Inbox::process: a failing handler takes its message with it.
        let inbox = Inbox::new("orders.placer").expect("valid name");
        let incoming = MessageId::from_uuid(Uuid::new_v4());
        let failed = inbox
            .process(&conn, incoming, |txn| {
                Box::pin(async move {
                    place_order(txn, OutgoingMessage::new("orders", b"3".to_vec())).await?;
                    Err::<(), Box<dyn std::error::Error + Send + Sync>>("card declined".into())
                })
            })
            .await;
        assert!(failed.is_err(), "{failed:?}");
        assert_eq!(
            outbox_rows(&conn).await,
            1,
            "the failed handler's message is gone"
        );

        let relay = Relay::new(Arc::new(Recorder::default()))
            .with_options(quick_options())
            .expect("options");
        let report = relay.relay_once(&conn).await.expect("relay");
        assert_eq!(report.published, 1);
        let published = relay.publisher().published.lock().expect("lock").clone();
        assert_eq!(published[0].message_id, id);
        assert_eq!(published[0].key.as_deref(), Some("order-2"));
        assert_eq!(published[0].headers["content-type"], "text/plain");
        assert_eq!(published[0].attempt, 1);
    })
    .await;
}

async fn a_retried_handler_leaves_one_row_per_message(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        create_orders(&conn).await;
        let inbox = Inbox::new("orders.placer").expect("valid name");
        let incoming = MessageId::from_uuid(Uuid::new_v4());
        let runs = AtomicU32::new(0);

        // The first attempt enqueues, then meets a transient failure: process retries the
        // whole transaction, and the derived ids make the retry write the same two rows.
        let outcome = inbox
            .process(&conn, incoming, |txn| {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    for sequence in 0..2 {
                        let message = OutgoingMessage::new("orders", vec![sequence as u8])
                            .message_id(incoming.outgoing("orders.placer", sequence));
                        place_order(txn, message).await?;
                    }
                    if run == 0 {
                        return Err(
                            DbErr::ConnectionAcquire(ConnAcquireErr::ConnectionClosed).into()
                        );
                    }
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
                })
            })
            .await;
        assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "retried once");
        assert_eq!(outbox_rows(&conn).await, 2);

        // The same handler run again outside the inbox (or enqueueing twice in one
        // transaction) writes nothing new and raises nothing into the transaction.
        let txn = conn.begin().await.expect("begin");
        for _ in 0..2 {
            let again = OutgoingMessage::new("orders", vec![0])
                .message_id(incoming.outgoing("orders.placer", 0));
            place_order(&txn, again).await.expect("a repeat is a no-op");
        }
        txn.commit().await.expect("commit after the repeats");
        assert_eq!(outbox_rows(&conn).await, 2, "one row per derived id");
    })
    .await;
}

/// Enqueues `keys` x `per_key` messages, interleaved by key; each payload is
/// `"{key}:{n}"`.
async fn enqueue_keyed(conn: &DatabaseConnection, keys: usize, per_key: usize) {
    for n in 0..per_key {
        let txn = conn.begin().await.expect("begin");
        for key in 0..keys {
            let message = OutgoingMessage::new("events", format!("k{key}:{n}").into_bytes())
                .key(format!("k{key}"));
            txn.enqueue(message).await.expect("enqueue");
        }
        txn.commit().await.expect("commit");
    }
}

/// Runs two relays on their own pools, started together, until the backlog is empty.
async fn drain_with_two_relays(db: &TestDb, recorder: &Arc<Recorder>) {
    let mut tasks = Vec::new();
    let start = Arc::new(tokio::sync::Barrier::new(2));
    for _ in 0..2 {
        let pool = db.connect().await;
        let relay = Relay::new(Arc::clone(recorder))
            .with_options(quick_options())
            .expect("options");
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            for _ in 0..2_000 {
                relay.relay_once(&pool).await.expect("relay");
                if outbox_backlog(&pool).await.expect("backlog").pending == 0 {
                    break;
                }
            }
            pool.close().await.ok();
        }));
    }
    for task in tasks {
        task.await.expect("relay task");
    }
}

async fn two_relays_publish_every_row_exactly_once(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        const ROWS: usize = 120;
        let txn = conn.begin().await.expect("begin");
        for n in 0..ROWS {
            txn.enqueue(OutgoingMessage::new("events", n.to_string().into_bytes()))
                .await
                .expect("enqueue");
        }
        txn.commit().await.expect("commit");
        let recorder = Arc::new(Recorder::default());
        drain_with_two_relays(db, &recorder).await;

        let ids = recorder.ids();
        let mut counts: HashMap<MessageId, u32> = HashMap::new();
        for id in &ids {
            *counts.entry(*id).or_default() += 1;
        }
        assert_eq!(counts.len(), ROWS, "every row published");
        assert!(
            counts.values().all(|&n| n == 1),
            "no row published twice: {} publishes for {ROWS} rows",
            ids.len()
        );
        assert_eq!(
            scalar_i64(
                &conn,
                "SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL"
            )
            .await,
            ROWS as i64
        );
    })
    .await;
}

async fn a_key_goes_out_in_order_under_two_relays(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        const KEYS: usize = 4;
        const PER_KEY: usize = 12;
        enqueue_keyed(&conn, KEYS, PER_KEY).await;
        let recorder = Arc::new(Recorder::default());
        drain_with_two_relays(db, &recorder).await;

        let mut seen: HashMap<String, Vec<usize>> = HashMap::new();
        for payload in recorder.payloads() {
            let text = String::from_utf8(payload).expect("utf-8 payload");
            let (key, n) = text.split_once(':').expect("key:n");
            seen.entry(key.to_owned())
                .or_default()
                .push(n.parse().expect("n"));
        }
        assert_eq!(seen.len(), KEYS);
        for (key, order) in seen {
            assert_eq!(order, (0..PER_KEY).collect::<Vec<_>>(), "key {key}");
        }
    })
    .await;
}

async fn a_relay_killed_after_publishing_leaves_the_row_to_be_republished_with_its_id(
    backend: Backend,
) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let id = conn
            .enqueue(OutgoingMessage::new("events", b"once".to_vec()))
            .await
            .expect("enqueue");
        let recorder = Arc::new(Recorder::default());
        recorder.hang.store(true, Ordering::SeqCst);
        let options = RelayOptions {
            lease: Duration::from_secs(2),
            publish_timeout: Duration::from_secs(1),
            ..quick_options()
        };
        let dying = Relay::new(Arc::clone(&recorder))
            .with_options(options.clone())
            .expect("options");
        // The broker has the message; the relay dies before it marks the row sent.
        let killed =
            tokio::time::timeout(Duration::from_millis(300), dying.relay_once(&conn)).await;
        assert!(killed.is_err(), "the relay was cut off mid-publish");
        assert_eq!(recorder.ids(), [id]);

        recorder.hang.store(false, Ordering::SeqCst);
        let survivor_pool = db.connect().await;
        let survivor = Relay::new(Arc::clone(&recorder))
            .with_options(options)
            .expect("options");
        let early = survivor.relay_once(&survivor_pool).await.expect("relay");
        assert_eq!(
            early.claimed, 0,
            "the dead relay's lease still holds the row"
        );

        tokio::time::sleep(Duration::from_millis(2_100)).await;
        let late = survivor.relay_once(&survivor_pool).await.expect("relay");
        assert_eq!(late.published, 1, "republished once the lease ended");
        assert_eq!(recorder.ids(), [id, id], "the same message id both times");
        let attempts = recorder.published.lock().expect("lock")[1].attempt;
        assert_eq!(attempts, 2);
    })
    .await;
}

/// A publisher that panics on one payload (a bug in a broker client, a message it cannot
/// encode) and records every call.
struct PanicsOn {
    payload: Vec<u8>,
    calls: Mutex<Vec<Vec<u8>>>,
}

impl Publisher for PanicsOn {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.calls
            .lock()
            .expect("call log")
            .push(message.payload.clone());
        tokio::task::yield_now().await;
        assert!(
            message.payload != self.payload,
            "the broker client cannot encode this message"
        );
        Ok(())
    }
}

/// A publisher's panic on one message is a failed attempt of that message: the relay
/// publishes the rest of the batch, retries it with backoff, and parks it dead after
/// `max_attempts`, with the panic as its last error. (Before, the panic unwound through
/// `relay_once` with the batch leased and unmarked, and the relay met the same row first
/// again after every restart.)
async fn a_publisher_panic_fails_one_attempt_not_the_relay(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let txn = conn.begin().await.expect("begin");
        let poison = txn
            .enqueue(OutgoingMessage::new("events", b"kills".to_vec()))
            .await
            .expect("enqueue");
        txn.enqueue(OutgoingMessage::new("events", b"fine".to_vec()))
            .await
            .expect("enqueue");
        txn.commit().await.expect("commit");
        let publisher = Arc::new(PanicsOn {
            payload: b"kills".to_vec(),
            calls: Mutex::default(),
        });
        let relay = Relay::new(Arc::clone(&publisher))
            .with_options(quick_options())
            .expect("options");
        let mut total = sea_orm_inbox::RelayReport::default();
        for _ in 0..50 {
            let report = relay.relay_once(&conn).await.expect("relay");
            total.published += report.published;
            total.failed += report.failed;
            total.dead += report.dead;
            if total.dead > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            (total.published, total.failed, total.dead),
            (1, 3, 1),
            "the other row went out; 3 failed attempts, the last one parked"
        );
        let calls = publisher.calls.lock().expect("call log").clone();
        assert_eq!(
            calls.iter().filter(|payload| *payload == b"kills").count(),
            3
        );
        let dead = list_dead_messages(&conn, 10).await.expect("list");
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].message_id, poison);
        assert!(
            dead[0]
                .last_error
                .as_deref()
                .is_some_and(|error| error
                    .contains("the publisher panicked: the broker client cannot encode")),
            "{:?}",
            dead[0].last_error
        );
    })
    .await;
}

async fn a_poison_row_goes_dead_without_holding_back_other_keys(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let txn = conn.begin().await.expect("begin");
        let enqueue = async |key: Option<&str>, payload: &str| {
            let mut message = OutgoingMessage::new("events", payload.as_bytes().to_vec());
            if let Some(key) = key {
                message = message.key(key);
            }
            txn.enqueue(message).await.expect("enqueue")
        };
        let poison = enqueue(Some("a"), "poison").await;
        enqueue(Some("a"), "a2").await;
        enqueue(Some("b"), "b1").await;
        enqueue(Some("b"), "b2").await;
        enqueue(None, "loose").await;
        txn.commit().await.expect("commit");

        let recorder = Arc::new(Recorder {
            poison: vec![b"poison".to_vec()],
            ..Recorder::default()
        });
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(quick_options())
            .expect("options");
        let mut dead = 0;
        for _ in 0..50 {
            let report = relay.relay_once(&conn).await.expect("relay");
            dead += report.dead;
            if dead > 0 && recorder.ids().len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(dead, 1, "parked after its attempts ran out");
        let sent: Vec<Vec<u8>> = recorder.payloads();
        assert_eq!(sent.len(), 3, "b1, b2 and the unkeyed message went out");
        assert!(
            !sent.contains(&b"a2".to_vec()),
            "a2 waits behind its dead predecessor"
        );
        let backlog = outbox_backlog(&conn).await.expect("backlog");
        assert_eq!((backlog.pending, backlog.dead), (1, 1));

        let listed = list_dead_messages(&conn, 10).await.expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].message_id, poison);
        assert_eq!(listed[0].attempts, 3);
        assert_eq!(listed[0].key.as_deref(), Some("a"));
        assert!(
            listed[0]
                .last_error
                .as_deref()
                .is_some_and(|error| error.contains("choked")),
            "{:?}",
            listed[0].last_error
        );

        // The operator fixes the cause and requeues: the row, then its key's next, go out.
        recorder.cured.store(true, Ordering::SeqCst);
        assert!(requeue_dead_message(&conn, poison).await.expect("requeue"));
        assert!(
            !requeue_dead_message(&conn, poison).await.expect("requeue"),
            "no longer dead"
        );
        for _ in 0..3 {
            relay.relay_once(&conn).await.expect("relay");
        }
        let sent = recorder.payloads();
        assert_eq!(&sent[3..], [b"poison".to_vec(), b"a2".to_vec()]);
        assert_eq!(outbox_backlog(&conn).await.expect("backlog").pending, 0);

        // Sent rows are purged in batches; unsent ones never.
        let txn = conn.begin().await.expect("begin");
        txn.enqueue(OutgoingMessage::new("events", b"later".to_vec()))
            .await
            .expect("enqueue");
        txn.commit().await.expect("commit");
        let cutoff = chrono::Utc::now() + chrono::Duration::seconds(1);
        let purged = purge_sent_messages(&conn, cutoff, 2).await.expect("purge");
        assert_eq!(purged, 5);
        assert_eq!(outbox_rows(&conn).await, 1, "the unsent row stays");
    })
    .await;
}

async fn a_woken_relay_publishes_without_waiting_for_its_poll(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let recorder = Arc::new(Recorder::default());
        let options = RelayOptions {
            poll_interval: Duration::from_secs(600),
            ..quick_options()
        };
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(options)
            .expect("options");
        let waker = relay.waker();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let pool = db.connect().await;
        let running = tokio::spawn(async move {
            relay
                .run(&pool, async {
                    stopped.await.ok();
                })
                .await;
            pool.close().await.ok();
        });

        let txn = conn.begin().await.expect("begin");
        let id = txn
            .enqueue(OutgoingMessage::new("events", b"now".to_vec()))
            .await
            .expect("enqueue");
        txn.commit().await.expect("commit");
        waker.wake();
        let published = async {
            while recorder.ids().is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), published)
            .await
            .expect("published long before the 10-minute poll");
        assert_eq!(recorder.ids(), [id]);
        stop.send(()).ok();
        running.await.expect("the relay stops");
    })
    .await;
}

async fn the_startup_check_finds_a_missing_outbox_and_a_missing_unique_index(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        assert!(
            matches!(
                verify_outbox_schema(&conn).await,
                Err(SchemaError::MissingOutboxTable)
            ),
            "the inbox migrations alone make no outbox"
        );
        sea_orm_inbox_migration::MigratorWithOutbox::up(&conn, None)
            .await
            .expect("run CreateOutbox");
        verify_outbox_schema(&conn)
            .await
            .expect("the migrated outbox passes");
        let drop = match backend {
            Backend::MySql => "DROP INDEX ix_outbox_message_id ON outbox",
            _ => "DROP INDEX ix_outbox_message_id",
        };
        conn.execute_unprepared(drop).await.expect("drop the index");
        let found = verify_outbox_schema(&conn).await;
        assert!(
            matches!(&found, Err(SchemaError::OutboxIndex { found }) if found == "missing"),
            "{found:?}"
        );
    })
    .await;
}

async fn a_slow_broker_makes_the_relay_hand_back_what_its_lease_cannot_cover(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        for n in 0..6 {
            conn.enqueue(OutgoingMessage::new("events", vec![n]))
                .await
                .expect("enqueue");
        }
        // Each confirmation takes 400 ms; after two of them less than the publish timeout is
        // left of the 2-second lease, and the relay stops instead of publishing into another
        // relay's lease.
        let recorder = Arc::new(Recorder {
            latency: Duration::from_millis(400),
            ..Recorder::default()
        });
        let options = RelayOptions {
            lease: Duration::from_secs(2),
            publish_timeout: Duration::from_millis(1_100),
            ..quick_options()
        };
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(options)
            .expect("options");
        let first = relay.relay_once(&conn).await.expect("relay");
        assert_eq!(first.claimed, 6);
        assert!(first.published >= 1 && first.released >= 1, "{first:?}");
        assert_eq!(first.published + first.released, 6, "{first:?}");
        // The handed-back rows are due at once, their attempt not counted.
        let mut published = first.published;
        while published < 6 {
            published += relay.relay_once(&conn).await.expect("relay").published;
        }
        assert!(
            recorder
                .published
                .lock()
                .expect("lock")
                .iter()
                .all(|message| message.attempt == 1),
            "no attempt was counted for a handed-back row"
        );
        assert_eq!(recorder.ids().len(), 6, "each published once");

        // A broker that never confirms: the publish times out and counts as a failure.
        conn.enqueue(OutgoingMessage::new("events", b"silent".to_vec()))
            .await
            .expect("enqueue");
        recorder.hang.store(true, Ordering::SeqCst);
        let silent = relay.relay_once(&conn).await.expect("relay");
        assert_eq!(
            (silent.published, silent.failed, silent.dead),
            (0, 1, 0),
            "{silent:?}"
        );
    })
    .await;
}

/// A relay dropped at any of its await points (an aborted task, a `select!` that chose
/// shutdown) leaves no transaction or lock behind: another replica's relay publishes the
/// row once the dropped one's lease (if it took one) has ended, and the dropped relay's
/// pool keeps working. Dropped after 1, 2, ... polls until it had reached the broker.
async fn a_relay_dropped_at_any_await_point_leaves_nothing_locked(backend: Backend) {
    let mut polls = 1;
    loop {
        let reached_the_broker = with_migrated_outbox_db(backend, async |db| {
            let conn = db.connect().await;
            let id = conn
                .enqueue(OutgoingMessage::new("events", b"once".to_vec()))
                .await
                .expect("enqueue");
            let recorder = Arc::new(Recorder::default());
            recorder.hang.store(true, Ordering::SeqCst);
            let options = RelayOptions {
                lease: Duration::from_secs(1),
                publish_timeout: Duration::from_millis(500),
                ..quick_options()
            };
            let dropped = Relay::new(Arc::clone(&recorder))
                .with_options(options.clone())
                .expect("options");
            let finished = poll_then_drop(dropped.relay_once(&conn), polls).await;
            assert!(!finished, "a hanging broker keeps the relay from finishing");
            let reached_the_broker = !recorder.ids().is_empty();
            recorder.hang.store(false, Ordering::SeqCst);

            let survivor_pool = db.connect().await;
            let survivor = Relay::new(Arc::clone(&recorder))
                .with_options(options)
                .expect("options");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while outbox_backlog(&survivor_pool)
                .await
                .expect("backlog")
                .pending
                > 0
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "dropped after {polls} polls: the row was never published again"
                );
                tokio::time::timeout(Duration::from_secs(5), survivor.relay_once(&survivor_pool))
                    .await
                    .unwrap_or_else(|_| panic!("dropped after {polls} polls: the survivor hangs"))
                    .expect("the survivor relays");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let ids = recorder.ids();
            assert!(
                ids.iter().all(|published| *published == id) && (1..=2).contains(&ids.len()),
                "dropped after {polls} polls: {ids:?}"
            );
            tokio::time::timeout(Duration::from_secs(5), dropped.relay_once(&conn))
                .await
                .unwrap_or_else(|_| panic!("dropped after {polls} polls: its pool hangs"))
                .expect("the dropped relay's pool still works");
            reached_the_broker
        })
        .await;
        if reached_the_broker {
            break;
        }
        polls += 1;
        assert!(polls < 100, "the relay never reached the broker");
    }
}

/// A batch whose every row the broker confirmed costs the relay one statement per step
/// on PostgreSQL (the claim that leases and returns its rows, then the mark), three on
/// SQLite (the read of the due rows and the lease of those, in one IMMEDIATE transaction,
/// then the mark: SQLite's `UPDATE ... RETURNING` cost more than both, see
/// `a_drain_costs_sqlite_few_instructions_a_row`), and four statements on MySQL/MariaDB
/// (the plain read of the candidates, the lease of those by primary key, the read of the
/// rows it leased, the mark). Counted by SeaORM's metric callback; BEGIN and COMMIT are
/// not statements there. The rows go out
/// in `id` order with their first attempt, whatever order `RETURNING` gave them in. On
/// PostgreSQL the claim turns `synchronous_commit` off for its own transaction only: the
/// pool's one connection reads `on` afterwards.
async fn a_confirmed_batch_costs_the_relay_one_statement_per_step(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let mut conn = db.connect_with(1).await;
        let statements = count_outbox_statements(&mut conn);
        let ids = enqueue_many(&conn, 5).await;

        let recorder = Arc::new(Recorder::default());
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(quick_options())
            .expect("options");
        statements.store(0, Ordering::SeqCst);
        let report = relay.relay_once(&conn).await.expect("relay");
        assert_eq!((report.claimed, report.published), (5, 5), "{report:?}");
        let expected = match backend {
            Backend::MySql => 4,
            Backend::Sqlite => 3,
            _ => 2,
        };
        assert_eq!(statements.load(Ordering::SeqCst), expected, "{backend:?}");
        assert_eq!(recorder.ids(), ids, "in id order");
        assert!(
            recorder
                .published
                .lock()
                .expect("lock")
                .iter()
                .all(|message| message.attempt == 1),
            "the first attempt of each"
        );
        if backend == Backend::Postgres {
            let setting: String =
                scalar(&conn, "SELECT current_setting('synchronous_commit')").await;
            assert_eq!(
                setting, "on",
                "the claim's setting ended with its transaction"
            );
        }
    })
    .await;
}

/// A drain relays batch after batch until a claim comes back short, each full batch's
/// marks written with the next claim: 45 rows in batches of 20 cost three claims and three
/// marks (the claim, two marks each with the next claim, the last mark alone), each claim
/// one statement on PostgreSQL, two on SQLite (a read, the lease of what it read) and
/// three on MySQL/MariaDB (a plain read, the lease, a read of what it leased). Every row goes out once, in `id` order, and the
/// report and the metrics sum the three batches.
async fn a_drain_relays_every_full_batch_and_the_rest(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let mut conn = db.connect_with(1).await;
        let statements = count_outbox_statements(&mut conn);
        let ids = enqueue_many(&conn, 45).await;
        let recorder = Arc::new(Recorder::default());
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(quick_options())
            .expect("options");
        statements.store(0, Ordering::SeqCst);
        let report = relay.drain(&conn).await.expect("drain");
        assert_eq!(
            (report.claimed, report.published, report.failed),
            (45, 45, 0),
            "{report:?}"
        );
        let expected = match backend {
            Backend::MySql => 12,
            Backend::Sqlite => 9,
            _ => 6,
        };
        assert_eq!(statements.load(Ordering::SeqCst), expected, "{backend:?}");
        assert_eq!(recorder.ids(), ids, "each once, in id order");
        assert_eq!(relay.metrics().snapshot().published, 45);
        assert_eq!(outbox_backlog(&conn).await.expect("backlog").pending, 0);
        let again = relay.drain(&conn).await.expect("an empty drain");
        assert_eq!(again, sea_orm_inbox::RelayReport::default());
    })
    .await;
}

/// What a drain costs on the wire, counted by the proxy (issue 33 item 4's first
/// measurement): 60 rows in batches of 20 on a pool of one connection, its statements
/// printed for the record. PostgreSQL: BEGIN, the claim, COMMIT, then per full batch BEGIN,
/// the previous batch's mark, the next claim, COMMIT (4, the hand-written loop's count:
/// BEGIN, `SELECT ... FOR UPDATE SKIP LOCKED`, `UPDATE`, COMMIT): 3 + 3 x 4 = 15. MariaDB,
/// per full batch, every statement on its own in autocommit: the previous batch's mark,
/// the plain read of the candidates, the lease `UPDATE`, the read of the leased rows (4,
/// the loop's count); 3 for the first (no mark), 2 for the last (the mark, an empty read):
/// 13 while each of its writes committed on its own; now, per full batch, BEGIN, the
/// silence bound's `SET SESSION`, the mark, the plain read of the candidates, the lease
/// `UPDATE`, the read of the leased rows, COMMIT (7), 3 for the first claim (in autocommit)
/// and 5 for the last (no lease after an empty read): 22, for one commit per batch instead
/// of two, each of which waits for the redo log's flush (about 3.4 ms on the benchmark's
/// disk, a round trip about 0.1 ms). Everywhere the commits are the first claim's and
/// one per full batch: 4. (29 while the claim was a transaction of its own: `SET
/// TRANSACTION ISOLATION LEVEL READ COMMITTED`, which SeaORM sends on its own, BEGIN, the
/// silence bound's `SET SESSION`, the mark, the read, a locking read, the lease, COMMIT: 8
/// per full batch.)
async fn a_drain_costs_its_round_trips_per_full_batch(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let proxy = LostReplyProxy::start(db).await;
        let conn = proxy.connect_with(1).await;
        enqueue_many(&conn, 60).await;
        let relay = Relay::new(Arc::new(Recorder::default()))
            .with_options(quick_options())
            .expect("options");
        proxy.reset_round_trips();
        let report = relay.drain(&conn).await.expect("drain");
        assert_eq!(report.published, 60, "{report:?}");
        let statements = proxy.statements();
        for statement in &statements {
            eprintln!("{backend:?}: {}", statement.sql());
        }
        // Three full batches, then the claim that comes back empty with the last mark.
        let round_trips = match backend {
            Backend::MySql => 3 + 7 + 7 + 5,
            _ => 3 + 4 + 4 + 4,
        };
        assert_eq!(proxy.round_trips(), round_trips, "{backend:?}");
        assert_eq!(
            commits(statements.iter().map(|statement| statement.sql())),
            1 + 3,
            "{backend:?}: the first claim's, then one per full batch"
        );
        conn.close().await.ok();
    })
    .await;
}

/// The commits among `statements` as a connection sent them: each COMMIT, and each write
/// sent outside a transaction (autocommit).
fn commits<'a>(statements: impl Iterator<Item = &'a str>) -> usize {
    let mut in_transaction = false;
    let mut commits = 0;
    for sql in statements {
        let verb = sql
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_ascii_uppercase();
        match verb.as_str() {
            "BEGIN" | "START" => in_transaction = true,
            "COMMIT" => {
                in_transaction = false;
                commits += 1;
            }
            "ROLLBACK" => in_transaction = false,
            "UPDATE" | "INSERT" | "DELETE" if !in_transaction => commits += 1,
            _ => {}
        }
    }
    commits
}

/// Counts the statements on `conn` that name the outbox, from now on.
fn count_outbox_statements(conn: &mut DatabaseConnection) -> Arc<AtomicU32> {
    let statements = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&statements);
    conn.set_metric_callback(move |info| {
        if info.statement.sql.contains("outbox") {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    statements
}

/// Enqueues `count` messages in one transaction; their ids in `id` order.
async fn enqueue_many(conn: &DatabaseConnection, count: u8) -> Vec<MessageId> {
    let txn = conn.begin().await.expect("begin");
    let mut ids = Vec::new();
    for n in 0..count {
        ids.push(
            txn.enqueue(OutgoingMessage::new("events", vec![n]))
                .await
                .expect("enqueue"),
        );
    }
    txn.commit().await.expect("commit");
    ids
}

/// Makes every lease of the outbox row `id` fail, as a claim that loses a conflict does.
async fn refuse_leasing(conn: &DatabaseConnection, id: i64) {
    let statements = match conn.get_database_backend() {
        sea_orm::DbBackend::Postgres => vec![
            "CREATE FUNCTION refuse_lease() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             IF NEW.lease_token IS DISTINCT FROM OLD.lease_token THEN \
             RAISE EXCEPTION 'the lease is refused'; END IF; RETURN NEW; END $$"
                .to_owned(),
            format!(
                "CREATE TRIGGER refuse_lease BEFORE UPDATE ON outbox FOR EACH ROW \
                 WHEN (OLD.id = {id}) EXECUTE FUNCTION refuse_lease()"
            ),
        ],
        sea_orm::DbBackend::MySql => vec![format!(
            "CREATE TRIGGER refuse_lease BEFORE UPDATE ON outbox FOR EACH ROW BEGIN \
             IF OLD.id = {id} AND NOT (NEW.lease_token <=> OLD.lease_token) THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'the lease is refused'; END IF; END"
        )],
        _ => vec![format!(
            "CREATE TRIGGER refuse_lease BEFORE UPDATE OF lease_token ON outbox \
             WHEN OLD.id = {id} BEGIN SELECT RAISE(ABORT, 'the lease is refused'); END"
        )],
    };
    for statement in statements {
        conn.execute_unprepared(&statement)
            .await
            .expect("create the trigger");
    }
}

/// When the transaction that marks a full batch and claims the next fails, the drain
/// writes the marks on their own before it gives up: nothing it published is left
/// unmarked to be published again. The next claim fails at the 21st row (a trigger
/// refuses its lease); the first 20 are marked sent, published once, and the rest go out
/// once when the lease is allowed again.
async fn a_drain_whose_next_claim_fails_still_marks_its_batch(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        let ids = enqueue_many(&conn, 45).await;
        let twenty_first =
            scalar_i64(&conn, "SELECT id FROM outbox ORDER BY id LIMIT 1 OFFSET 20").await;
        refuse_leasing(&conn, twenty_first).await;
        let recorder = Arc::new(Recorder::default());
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(quick_options())
            .expect("options");

        let failed = relay.drain(&conn).await;
        assert!(
            matches!(failed, Err(OutboxError::Database { .. })),
            "the refused claim fails the drain: {failed:?}"
        );
        assert_eq!(recorder.ids(), ids[..20], "the first batch, once");
        assert_eq!(
            scalar_i64(
                &conn,
                "SELECT COUNT(*) FROM outbox WHERE sent_at IS NOT NULL"
            )
            .await,
            20,
            "the first batch is marked sent"
        );
        assert_eq!(relay.metrics().snapshot().published, 20);

        let drop_trigger = match backend {
            Backend::Postgres => "DROP TRIGGER refuse_lease ON outbox",
            _ => "DROP TRIGGER refuse_lease",
        };
        conn.execute_unprepared(drop_trigger)
            .await
            .expect("drop the trigger");
        let report = relay.drain(&conn).await.expect("drain the rest");
        assert_eq!(report.published, 25, "{report:?}");
        assert_eq!(recorder.ids(), ids, "every row once, in id order");
    })
    .await;
}

on_every_backend!(
    a_drain_relays_every_full_batch_and_the_rest,
    a_drain_whose_next_claim_fails_still_marks_its_batch,
    a_confirmed_batch_costs_the_relay_one_statement_per_step,
    a_slow_broker_makes_the_relay_hand_back_what_its_lease_cannot_cover,
    the_startup_check_finds_a_missing_outbox_and_a_missing_unique_index,
    a_woken_relay_publishes_without_waiting_for_its_poll,
    enqueue_commits_and_rolls_back_with_the_transaction,
    a_retried_handler_leaves_one_row_per_message,
    two_relays_publish_every_row_exactly_once,
    a_key_goes_out_in_order_under_two_relays,
    a_relay_killed_after_publishing_leaves_the_row_to_be_republished_with_its_id,
    a_poison_row_goes_dead_without_holding_back_other_keys,
    a_publisher_panic_fails_one_attempt_not_the_relay,
    a_relay_dropped_at_any_await_point_leaves_nothing_locked,
);

/// SQLite's claim returns only what a publish reads of each row: a row whose bookkeeping
/// holds a value in a type the relay would not decode (a last error stored as bytes by a
/// hand-written tool; SQLite keeps whatever type it is given) is published like any other,
/// where a claim that decoded whole rows failed every batch it was in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_on_sqlite_reads_only_what_a_publish_needs() {
    with_migrated_outbox_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let ids = enqueue_many(&conn, 3).await;
        conn.execute_unprepared(
            "UPDATE outbox SET last_error = X'00FF' WHERE id = (SELECT MIN(id) FROM outbox)",
        )
        .await
        .expect("store an error as bytes");
        let recorder = Arc::new(Recorder::default());
        let relay = Relay::new(Arc::clone(&recorder))
            .with_options(quick_options())
            .expect("options");
        let report = relay.drain(&conn).await.expect("drain");
        assert_eq!(report.published, 3, "{report:?}");
        assert_eq!(recorder.ids(), ids);
    })
    .await;
}

/// Enqueues `count` messages numbered from 0, in one transaction.
async fn enqueue_numbered(conn: &DatabaseConnection, count: u32) {
    let txn = conn.begin().await.expect("begin");
    for n in 0..count {
        txn.enqueue(OutgoingMessage::new("events", format!("{n}")))
            .await
            .expect("enqueue");
    }
    txn.commit().await.expect("commit");
}

/// A relay of batches of 100 that records what it publishes.
fn relay_in_batches_of_100() -> Relay<Arc<Recorder>> {
    Relay::new(Arc::new(Recorder::default()))
        .with_options(RelayOptions {
            batch_size: 100,
            ..quick_options()
        })
        .expect("options")
}

/// What a drain costs SQLite itself, in virtual machine instructions (counted by a
/// progress handler called at each one; the same count on every run): 400 rows in
/// batches of 100, at most 115 a row. 135 while the claim was one `UPDATE ... RETURNING`
/// (its RETURNING runs a trigger program per row and stores each returned row in a
/// temporary table); 103 with a read, then the lease of the rows read, in an IMMEDIATE
/// transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_costs_sqlite_few_instructions_a_row() {
    with_migrated_outbox_db(Backend::Sqlite, async |db| {
        let conn = db.connect_with(1).await;
        enqueue_numbered(&conn, 400).await;
        let relay = relay_in_batches_of_100();
        let steps = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&steps);
        let mut handle = conn
            .get_sqlite_connection_pool()
            .acquire()
            .await
            .expect("the pool's connection");
        handle
            .lock_handle()
            .await
            .expect("its handle")
            .set_progress_handler(1, move || {
                counter.fetch_add(1, Ordering::Relaxed);
                true
            });
        drop(handle);
        let report = relay.drain(&conn).await.expect("drain");
        assert_eq!(report.published, 400, "{report:?}");
        let per_row = steps.load(Ordering::Relaxed) / 400;
        eprintln!("SQLite instructions per row: {per_row}");
        assert!(per_row <= 115, "{per_row} a row");
    })
    .await;
}

/// The relay's sent mark on MySQL/MariaDB finds its rows by primary key: through
/// `ix_outbox_pending`, whose key (`sent_at`) it changes, the server buffered every row of
/// the batch before writing it ("Using buffer"), 23 ms for a batch of 100 against 1.5 ms.
/// The mark as the relay sent it (recorded by the proxy) is explained with the batch's ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn the_sent_mark_finds_its_rows_by_primary_key() {
    with_migrated_outbox_db(Backend::MySql, async |db| {
        let proxy = LostReplyProxy::start(db).await;
        let conn = proxy.connect_with(1).await;
        enqueue_numbered(&conn, 1_000).await;
        let relay = relay_in_batches_of_100();
        proxy.reset_round_trips();
        let report = relay.relay_once(&conn).await.expect("relay");
        assert_eq!(report.published, 100, "{report:?}");
        let mark = proxy
            .statements()
            .iter()
            .map(|statement| statement.sql().to_owned())
            .find(|sql| sql.contains("SET sent_at = ?"))
            .expect("the mark was sent");
        let ids = conn
            .query_all_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::MySql,
                "SELECT id FROM outbox ORDER BY id LIMIT 100",
            ))
            .await
            .expect("ids")
            .iter()
            .map(|row| row.try_get_by_index::<i64>(0).expect("id").to_string())
            .collect::<Vec<_>>();
        let mut values = vec!["NOW(6)".to_owned(), "x'00'".to_owned()];
        values.extend(ids);
        let mut explained = String::from("EXPLAIN ");
        for (part, value) in mark.split('?').zip(
            values
                .iter()
                .map(String::as_str)
                .chain([""].into_iter().cycle()),
        ) {
            explained.push_str(part);
            explained.push_str(value);
        }
        let plan = conn
            .query_one_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::MySql,
                explained,
            ))
            .await
            .expect("explain the mark")
            .expect("a plan row");
        let key: Option<String> = plan.try_get("", "key").expect("key");
        let extra: Option<String> = plan.try_get("", "Extra").expect("Extra");
        assert_eq!(key.as_deref(), Some("PRIMARY"), "{mark}: {extra:?}");
        assert!(
            !extra.unwrap_or_default().contains("Using buffer"),
            "{mark}"
        );
        conn.close().await.ok();
    })
    .await;
}

/// The storage engine's row operations on this session so far, from MariaDB's
/// `Handler_*` counters: key lookups, index walks, reads by position (of rows a statement
/// buffered) and row updates, in one read whose own cost is the same each time.
async fn handler_counts(conn: &DatabaseConnection) -> [i64; 4] {
    let row = conn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::MySql,
            "SELECT \
             CAST(SUM(IF(VARIABLE_NAME = 'HANDLER_READ_KEY', VARIABLE_VALUE, 0)) AS SIGNED), \
             CAST(SUM(IF(VARIABLE_NAME = 'HANDLER_READ_NEXT', VARIABLE_VALUE, 0)) AS SIGNED), \
             CAST(SUM(IF(VARIABLE_NAME = 'HANDLER_READ_RND', VARIABLE_VALUE, 0)) AS SIGNED), \
             CAST(SUM(IF(VARIABLE_NAME = 'HANDLER_UPDATE', VARIABLE_VALUE, 0)) AS SIGNED) \
             FROM information_schema.SESSION_STATUS",
        ))
        .await
        .expect("the session's counters")
        .expect("a row");
    [0, 1, 2, 3].map(|at| row.try_get_by_index::<i64>(at).expect("a counter"))
}

/// What a drain of 300 rows in batches of 100 costs MariaDB's storage engine (`Handler_*`
/// on the pool's one connection, the counters' own read taken off), per full batch after
/// the first claim: the mark by primary key (100 key lookups, 100 updates), the candidates'
/// walk of `ix_outbox_pending` (1 lookup, 199 next), the lease by primary key (100 lookups,
/// 100 updates) and the read of what it leased (100 lookups). The lease reads no row by
/// position and the read stops at the rows the lease took: with `ORDER BY id` the lease
/// buffered its rows (`Handler_read_rnd` 100 a claim, 300 in all) and the read looked up
/// every candidate (200 a claim; key lookups in the drain 1,104, now 904).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn a_drain_reads_each_row_of_a_batch_once_per_step_on_mysql() {
    with_migrated_outbox_db(Backend::MySql, async |db| {
        let conn = db.connect_with(1).await;
        enqueue_numbered(&conn, 300).await;
        let relay = relay_in_batches_of_100();
        let first = handler_counts(&conn).await;
        let second = handler_counts(&conn).await;
        let report = relay.drain(&conn).await.expect("drain");
        let after = handler_counts(&conn).await;
        assert_eq!(report.published, 300, "{report:?}");
        let used: Vec<i64> = (0..4)
            .map(|at| after[at] - second[at] - (second[at] - first[at]))
            .collect();
        eprintln!("Handler_read_key, _read_next, _read_rnd, _update in the drain: {used:?}");
        let [read_key, _, read_rnd, update] = [used[0], used[1], used[2], used[3]];
        assert_eq!(read_rnd, 0, "no row buffered and read again by position");
        assert_eq!(update, 600, "each row leased once and marked once");
        // Per claim: 1 for the walk, 100 for the lease, 100 for the read of what it
        // leased; per mark 100; the last claim finds nothing (1): 904 (1,104 before).
        assert!(read_key <= 3 * 201 + 3 * 100 + 1, "{read_key} key lookups");
        conn.close().await.ok();
    })
    .await;
}

mod wire {
    use super::*;
    on_server_backends!(a_drain_costs_its_round_trips_per_full_batch);
}

// Behind PgBouncer's transaction pooling every relay statement must run in a transaction
// (a lone one with bound values can fail with 26000): the claim, the mark, the retries'
// bookkeeping, the listing and the requeue.
on_pgbouncer!(
    a_confirmed_batch_costs_the_relay_one_statement_per_step,
    a_drain_relays_every_full_batch_and_the_rest,
    two_relays_publish_every_row_exactly_once,
    a_poison_row_goes_dead_without_holding_back_other_keys,
);
