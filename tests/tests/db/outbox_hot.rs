//! On PostgreSQL the relay's lease of a row is a HOT update: it changes no indexed column,
//! and `OutboxFillfactor` leaves room on the row's page for the new version, so the lease
//! writes no index entry (with full pages most leases moved their row to another page and
//! added an entry to each of the table's four indexes). Counted from
//! `pg_stat_user_tables`, after the relay's connections closed and flushed their counters.

use inbox_tests::{Backend, scalar_i64, with_migrated_outbox_db};
use sea_orm::{DatabaseConnection, TransactionTrait};
use sea_orm_inbox::{OutboxExt, OutboxMessage, OutgoingMessage, PublishError, Publisher, Relay};
use sea_orm_inbox_migration::{MigratorTrait, MigratorWithOutbox, OUTBOX_FILLFACTOR};
use std::time::{Duration, Instant};

const ROWS: i64 = 1_000;

struct Discard;

impl Publisher for Discard {
    async fn publish(&self, _: &OutboxMessage) -> Result<(), PublishError> {
        Ok(())
    }
}

/// `outbox`'s updates and HOT updates as the statistics have them.
async fn updates(conn: &DatabaseConnection) -> (i64, i64) {
    let count = |column: &str| {
        format!("SELECT {column} FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass")
    };
    (
        scalar_i64(conn, &count("n_tup_upd")).await,
        scalar_i64(conn, &count("n_tup_hot_upd")).await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_drain_leases_its_rows_in_place() {
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let relaying = db.connect().await;
        let txn = relaying.begin().await.expect("begin");
        for n in 0..ROWS {
            txn.enqueue(OutgoingMessage::new("hot", format!("event {n}")))
                .await
                .expect("enqueue");
        }
        txn.commit().await.expect("commit");
        let report = Relay::new(Discard).drain(&relaying).await.expect("drain");
        assert_eq!(report.published, ROWS as u64);
        // A backend flushes its counters when it exits.
        relaying.close().await.expect("close the relay's pool");

        let observer = db.connect().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        let (all, hot) = loop {
            let (all, hot) = updates(&observer).await;
            if all >= 2 * ROWS || Instant::now() > deadline {
                break (all, hot);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        eprintln!("{hot} of {all} updates HOT");
        assert_eq!(all, 2 * ROWS, "a lease and a sent mark per row");
        assert!(
            hot >= ROWS * 95 / 100,
            "{hot} of {all} updates were HOT; the {ROWS} leases should be"
        );
        observer.close().await.ok();
    })
    .await;
}

/// The table's fillfactor: `None` for PostgreSQL's default.
async fn fillfactor(conn: &DatabaseConnection) -> Option<i64> {
    let set = scalar_i64(
        conn,
        "SELECT COUNT(*) FROM pg_class WHERE oid = 'outbox'::regclass AND reloptions IS NOT NULL",
    )
    .await;
    if set == 0 {
        return None;
    }
    Some(
        scalar_i64(
            conn,
            "SELECT substring(option FROM 12)::bigint FROM pg_class, unnest(reloptions) AS option \
             WHERE oid = 'outbox'::regclass AND option LIKE 'fillfactor=%'",
        )
        .await,
    )
}

/// An install migrated before `OutboxFillfactor` gets it with its rows kept, and `down`
/// puts the default back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn an_existing_outbox_gets_its_fillfactor_and_keeps_its_rows() {
    with_migrated_outbox_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        assert_eq!(fillfactor(&conn).await, Some(i64::from(OUTBOX_FILLFACTOR)));
        MigratorWithOutbox::down(&conn, Some(2))
            .await
            .expect("roll back OutboxDueIndex and OutboxFillfactor");
        assert_eq!(fillfactor(&conn).await, None);
        let txn = conn.begin().await.expect("begin");
        txn.enqueue(OutgoingMessage::new("hot", "kept"))
            .await
            .expect("enqueue");
        txn.commit().await.expect("commit");
        MigratorWithOutbox::up(&conn, None)
            .await
            .expect("OutboxFillfactor on an existing table");
        assert_eq!(fillfactor(&conn).await, Some(i64::from(OUTBOX_FILLFACTOR)));
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL").await,
            1
        );
        conn.close().await.ok();
    })
    .await;
}
