//! The outbox's purge on a timer (`spawn_outbox_purger`), as the inbox's (`spawn_purger`):
//! sent rows older than the window go in batches, unsent and recent ones stay, and a
//! shutdown returns the totals.

use inbox_tests::{
    Backend, RecordingPublisher, on_every_backend, scalar_i64, sqlite_reprepares, stmt,
    with_migrated_outbox_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{
    OutboxError, OutboxExt, OutgoingMessage, Relay, RelayOptions, purge_sent_messages,
    spawn_outbox_purger, timestamp_value,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Enqueues `count` messages to `events` in one transaction.
async fn enqueue_events(conn: &DatabaseConnection, count: u8) {
    let txn = conn.begin().await.expect("begin");
    for n in 0..count {
        txn.enqueue(OutgoingMessage::new("events", vec![n]))
            .await
            .expect("enqueue");
    }
    txn.commit().await.expect("commit");
}

async fn the_timer_purges_sent_rows_and_keeps_the_rest(backend: Backend) {
    with_migrated_outbox_db(backend, async |db| {
        let conn = db.connect().await;
        enqueue_events(&conn, 7).await;
        let relay = Relay::new(Arc::new(RecordingPublisher::default()))
            .with_options(RelayOptions::default())
            .expect("options");
        relay.drain(&conn).await.expect("relay");
        // Five of the seven were sent two days ago; the other two an instant ago.
        let two_days_ago = chrono::Utc::now() - chrono::Duration::days(2);
        let backend = conn.get_database_backend();
        conn.execute_raw(stmt(
            backend,
            "UPDATE outbox SET sent_at = ? \
             WHERE id IN (SELECT id FROM (SELECT id FROM outbox ORDER BY id LIMIT 5) AS oldest)",
            vec![timestamp_value(backend, two_days_ago)],
        ))
        .await
        .expect("age five rows");
        let txn = conn.begin().await.expect("begin");
        txn.enqueue(OutgoingMessage::new("events", b"unsent".to_vec()))
            .await
            .expect("enqueue");
        txn.commit().await.expect("commit");

        let day = Duration::from_secs(86_400);
        let purger =
            spawn_outbox_purger(conn.clone(), day, Duration::from_millis(50), 2).expect("spawn");
        let deadline = Instant::now() + Duration::from_secs(30);
        while scalar_i64(&conn, "SELECT COUNT(*) FROM outbox").await > 3 {
            assert!(Instant::now() < deadline, "the purger did not purge");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let summary = purger.shutdown().await.expect("shutdown");
        assert_eq!(summary.rows, 5, "{summary:?}");
        assert_eq!(summary.failures, 0, "{summary:?}");
        assert!(summary.runs >= 1);
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL").await,
            1,
            "the unsent row stays"
        );
    })
    .await;
}

on_every_backend!(the_timer_purges_sent_rows_and_keeps_the_rest);

/// The outbox's purge on SQLite prepares its DELETE once: with a bare `LIMIT ?` SQLite
/// prepared it again at every batch (a bound limit may change the plan).
#[tokio::test]
async fn a_purge_on_sqlite_prepares_its_batch_once() {
    with_migrated_outbox_db(Backend::Sqlite, async |db| {
        let conn = db.connect_with(1).await;
        enqueue_events(&conn, 7).await;
        let two_days_ago = chrono::Utc::now() - chrono::Duration::days(2);
        let backend = conn.get_database_backend();
        conn.execute_raw(stmt(
            backend,
            "UPDATE outbox SET sent_at = ?",
            vec![timestamp_value(backend, two_days_ago)],
        ))
        .await
        .expect("send the rows two days ago");
        let cutoff = chrono::Utc::now() - chrono::Duration::days(1);
        let purged = purge_sent_messages(&conn, cutoff, 2).await.expect("purge");
        assert_eq!(purged, 7, "in four batches");
        assert_eq!(sqlite_reprepares(&conn, "DELETE FROM outbox").await, 0);
    })
    .await;
}

#[tokio::test]
async fn bad_settings_are_refused() {
    let db = sea_orm::Database::connect("sqlite::memory:")
        .await
        .expect("connect");
    for (keep, every, batch) in [
        (Duration::from_secs(60), Duration::ZERO, 10),
        (Duration::from_secs(60), Duration::from_secs(1), 0),
        (Duration::MAX, Duration::from_secs(1), 10),
    ] {
        let refused = spawn_outbox_purger(db.clone(), keep, every, batch);
        assert!(
            matches!(refused, Err(OutboxError::InvalidOptions { .. })),
            "{keep:?} {every:?} {batch}"
        );
    }
}
