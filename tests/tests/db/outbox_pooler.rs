//! The outbox the way an application behind a transaction pooler uses it: two replicas
//! consume through `Inbox::process`, each handler writing a business row and enqueueing one
//! message; two relays (a pool each, no `LISTEN`) poll and publish; an operator lists the
//! dead row, requeues it, reads the backlog and the relays' counters, and purges the sent
//! rows. Through PgBouncer in transaction mode (pools from `for_transaction_pooler`), a
//! statement with bound values sent outside a transaction fails with `26000 prepared
//! statement "sqlx_s_N" does not exist`: every call here must succeed, so the library
//! sends none. The same walk runs on every backend.

use inbox_tests::{
    Backend, RecordingPublisher, on_every_backend, on_pgbouncer, run, scalar_i64, stmt,
    with_migrated_outbox_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use sea_orm_inbox::{
    Inbox, MessageId, OutboxError, OutboxExt, Outcome, OutgoingMessage, Relay, RelayOptions,
    list_dead_messages, outbox_backlog, purge_sent_messages, requeue_dead_message,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

const CONSUMER: &str = "orders.placer";
const MESSAGES: usize = 60;
const POISON: &[u8] = b"poison";

fn options() -> RelayOptions {
    RelayOptions {
        batch_size: 10,
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(5),
        max_attempts: 3,
        backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        poll_interval: Duration::from_millis(20),
    }
}

/// The handler: one order, one outgoing message whose id derives from the incoming one
/// (a retried attempt writes the same row). Message 0 carries the poison payload.
async fn place_order(
    txn: &impl ConnectionTrait,
    incoming: MessageId,
    n: usize,
) -> Result<(), OutboxError> {
    txn.execute_raw(stmt(
        txn.get_database_backend(),
        "INSERT INTO orders (message_id) VALUES (?)",
        vec![incoming.as_uuid().to_string().into()],
    ))
    .await
    .map_err(|source| OutboxError::Database {
        operation: "the order insert",
        source,
    })?;
    let payload = if n == 0 {
        POISON.to_vec()
    } else {
        n.to_string().into_bytes()
    };
    txn.enqueue(
        OutgoingMessage::new("orders.placed", payload).message_id(incoming.outgoing(CONSUMER, 0)),
    )
    .await
    .map(|_| ())
}

/// Polls with `relay_once` (what `run` does without wake-ups), failing the test on any
/// error, until `done` says the outbox is drained.
async fn poll_until(
    relays: &[(Relay<Arc<RecordingPublisher>>, DatabaseConnection)],
    admin: &DatabaseConnection,
    done: impl Fn(u64, u64) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for (relay, pool) in relays {
            relay.relay_once(pool).await.expect("a relay batch");
        }
        let backlog = outbox_backlog(admin).await.expect("the backlog");
        if done(backlog.pending, backlog.dead) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not drained in 30 s: {backlog:?}"
        );
        tokio::time::sleep(options().poll_interval).await;
    }
}

async fn consume_enqueue_relay_and_administer(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let admin = db.connect().await;
        let orders = match backend {
            Backend::MySql => {
                "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(36) NOT NULL)"
            }
            Backend::Sqlite => {
                "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id VARCHAR(36) NOT NULL)"
            }
            _ => "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, message_id VARCHAR(36) NOT NULL)",
        };
        run(&admin, orders).await;

        // Two replicas consume every message, a third of them delivered twice.
        let inbox = Inbox::new(CONSUMER).expect("valid consumer");
        let incoming: Vec<MessageId> = (0..MESSAGES)
            .map(|_| MessageId::from_uuid(Uuid::new_v4()))
            .collect();
        let replicas = [db.connect().await, db.connect().await];
        let mut duplicates = 0;
        for (n, &id) in incoming.iter().enumerate() {
            let deliveries = if n % 3 == 0 { 2 } else { 1 };
            for delivery in 0..deliveries {
                let outcome = inbox
                    .process(&replicas[(n + delivery) % 2], id, |txn| {
                        Box::pin(async move { place_order(txn, id, n).await })
                    })
                    .await
                    .unwrap_or_else(|err| panic!("message {n}: {err}"));
                match outcome {
                    Outcome::Processed(()) => {}
                    Outcome::Duplicate => duplicates += 1,
                    other => panic!("message {n}: {other:?}"),
                }
            }
        }
        assert_eq!(duplicates, MESSAGES.div_ceil(3));

        // Two relays on pools of their own poll until only the poison is left, dead.
        let recorder = Arc::new(RecordingPublisher::refusing(POISON));
        let mut relays = Vec::new();
        for _ in 0..2 {
            let relay = Relay::new(Arc::clone(&recorder))
                .with_options(options())
                .expect("options");
            relays.push((relay, db.connect().await));
        }
        poll_until(&relays, &admin, |pending, dead| pending == 0 && dead == 1).await;

        // The operator: the dead row, its requeue, the backlog, the counters, the purge.
        let dead = list_dead_messages(&admin, 10).await.expect("list the dead");
        assert_eq!(dead.len(), 1, "{dead:?}");
        let poison = incoming[0].outgoing(CONSUMER, 0);
        assert_eq!(dead[0].message_id, poison);
        assert_eq!(dead[0].attempts, options().max_attempts);
        recorder.cure();
        assert!(requeue_dead_message(&admin, poison).await.expect("requeue"));
        poll_until(&relays, &admin, |pending, dead| pending == 0 && dead == 0).await;
        let metrics = relays
            .iter()
            .map(|(relay, _)| relay.metrics().snapshot())
            .fold((0, 0, 0, 0), |sum, m| {
                (
                    sum.0 + m.published,
                    sum.1 + m.failed,
                    sum.2 + m.dead,
                    sum.3 + m.lost_leases,
                )
            });
        let max_attempts = u64::from(options().max_attempts);
        assert_eq!(
            metrics,
            (MESSAGES as u64, max_attempts, 1, 0),
            "(published, failed, dead, lost leases)"
        );
        let counts = recorder.counts();
        assert_eq!(counts.len(), MESSAGES, "every message published");
        assert!(
            counts.values().all(|&n| n == 1),
            "each published once: {} publishes",
            recorder.published().len()
        );
        for id in &incoming {
            assert_eq!(counts.get(&id.outgoing(CONSUMER, 0)), Some(&1));
        }
        assert_eq!(
            scalar_i64(&admin, "SELECT COUNT(*) FROM orders").await,
            MESSAGES as i64,
            "one order per message"
        );
        let cutoff = chrono::Utc::now() + chrono::Duration::seconds(1);
        let purged = purge_sent_messages(&admin, cutoff, 7)
            .await
            .expect("purge the sent rows");
        assert_eq!(purged, MESSAGES as u64);
        assert_eq!(scalar_i64(&admin, "SELECT COUNT(*) FROM outbox").await, 0);
        println!(
            "outbox through {backend:?}: {MESSAGES} messages consumed by 2 replicas \
             ({duplicates} redeliveries acked as duplicates), {} publishes by 2 polling \
             relays, {} failed attempts of the poison, 1 dead row listed and requeued, \
             {purged} sent rows purged in batches of 7, 0 lost leases",
            recorder.published().len(),
            metrics.1,
        );
        for (_, pool) in relays {
            pool.close().await.ok();
        }
        for replica in replicas {
            replica.close().await.ok();
        }
        admin.close().await.ok();
    })
    .await;
}

on_every_backend!(consume_enqueue_relay_and_administer);
on_pgbouncer!(consume_enqueue_relay_and_administer);
