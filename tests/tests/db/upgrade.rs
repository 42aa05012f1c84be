//! Upgrades: a database created by the first migration, with markers in it,
//! upgrades in place through the later migrations without losing a row; they go down and
//! up again on their own; `claim_message` keeps working throughout, on every backend (on
//! PostgreSQL without the third migration too: its claims infer the unique index).

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use inbox_tests::{Backend, on_every_backend, scalar_i64, stmt, with_fresh_db};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, QueryOrder, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify, is_inbox_duplicate, timestamp_value, verify_schema};
use sea_orm_inbox_entity::{INDEX_NAME, RECEIVED_AT_INDEX_NAME, inbox};
use sea_orm_inbox_migration::Migrator;
use sea_orm_migration::MigratorTrait;
use std::time::Duration;
use uuid::Uuid;

async fn received_at_index_count(backend: Backend, conn: &DatabaseConnection) -> i64 {
    let sql = match backend {
        Backend::Postgres | Backend::PgBouncer => format!(
            "SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'inbox' AND indexname = '{RECEIVED_AT_INDEX_NAME}'"
        ),
        Backend::MySql => format!(
            "SELECT COUNT(DISTINCT index_name) FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name = 'inbox' AND index_name = '{RECEIVED_AT_INDEX_NAME}'"
        ),
        Backend::Sqlite => format!(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = 'inbox' AND name = '{RECEIVED_AT_INDEX_NAME}'"
        ),
    };
    scalar_i64(conn, &sql).await
}

/// Inserts a marker using only the first migration's columns.
async fn insert_v1(
    conn: &DatabaseConnection,
    id: Uuid,
    received_at: DateTime<Utc>,
    processed_at: Option<DateTime<Utc>>,
) {
    let backend = conn.get_database_backend();
    conn.execute_raw(stmt(
        backend,
        "INSERT INTO inbox (message_id, consumer, received_at, processed_at) VALUES (?, 'billing', ?, ?)",
        vec![
            id.into(),
            timestamp_value(backend, received_at),
            processed_at.map_or(sea_orm::Value::ChronoDateTimeUtc(None), |t| {
                timestamp_value(backend, t)
            }),
        ],
    ))
    .await
    .expect("insert a first-migration marker");
}

async fn claim(conn: &DatabaseConnection, id: Uuid) -> Claim {
    let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    let claim = txn.claim_message(id, "billing").await.unwrap();
    if claim.is_claimed() {
        txn.commit().await.unwrap();
    } else {
        txn.rollback().await.unwrap();
    }
    claim
}

async fn first_migration_data_survives_the_upgrade_and_down_up(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, Some(1))
            .await
            .expect("first migration only");
        assert_eq!(
            Migrator::get_applied_migrations(&conn).await.unwrap().len(),
            1
        );

        let base = (Utc::now() - TimeDelta::days(3))
            .duration_trunc(TimeDelta::microseconds(1))
            .unwrap();
        let old: Vec<(Uuid, DateTime<Utc>, Option<DateTime<Utc>>)> = (0..50)
            .map(|i| {
                let at = base + TimeDelta::milliseconds(i * 1_001);
                (
                    Uuid::new_v4(),
                    at,
                    (i % 2 == 0).then_some(at + TimeDelta::microseconds(7)),
                )
            })
            .collect();
        for (id, received_at, processed_at) in &old {
            insert_v1(&conn, *id, *received_at, *processed_at).await;
        }

        Migrator::up(&conn, None).await.expect("upgrade in place");
        assert_eq!(
            Migrator::get_applied_migrations(&conn).await.unwrap().len(),
            Migrator::migrations().len()
        );
        verify_schema(&conn)
            .await
            .expect("the upgraded schema passes the startup check");
        assert_eq!(received_at_index_count(backend, &conn).await, 1);
        let rows = inbox::Entity::find()
            .order_by_asc(inbox::Column::Id)
            .all(&conn)
            .await
            .expect("read through the new entity");
        assert_eq!(rows.len(), old.len(), "no row lost");
        for (row, (id, received_at, processed_at)) in rows.iter().zip(&old) {
            assert_eq!(
                (row.message_id, row.received_at, row.processed_at),
                (*id, *received_at, *processed_at)
            );
            assert_eq!(row.attempts, 1);
            assert_eq!(
                (row.lease_until, row.claim_token, row.dead_at),
                (None, None, None)
            );
        }

        // The plain one-phase INSERT still works, and old markers still deduplicate.
        assert!(claim(&conn, old[0].0).await.is_duplicate());
        assert!(claim(&conn, Uuid::new_v4()).await.is_claimed());
        let options = LeaseOptions::new(Duration::from_secs(30)).unwrap();
        assert_eq!(
            claim_lease(&conn, old[1].0, "billing", &options)
                .await
                .unwrap(),
            LeaseClaim::Duplicate,
            "a marker from before the upgrade counts as processed"
        );

        // Down undoes the third migration (PostgreSQL's constraint turns back into the plain
        // unique index, still deduplicating) and the second, and keeps the rows; up again
        // restores them.
        Migrator::down(&conn, Some(2))
            .await
            .expect("down two steps");
        assert_eq!(
            Migrator::get_applied_migrations(&conn).await.unwrap().len(),
            1
        );
        assert_eq!(received_at_index_count(backend, &conn).await, 0);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 51);
        insert_v1(&conn, Uuid::new_v4(), base, None).await;
        let txn = conn.begin().await.unwrap();
        let again = txn
            .execute_raw(stmt(
                conn.get_database_backend(),
                "INSERT INTO inbox (message_id, consumer, received_at) VALUES (?, 'billing', ?)",
                vec![
                    old[0].0.into(),
                    timestamp_value(conn.get_database_backend(), base),
                ],
            ))
            .await;
        txn.rollback().await.unwrap();
        let again = again.expect_err("the index still deduplicates");
        // MariaDB's error names the key, not its table: a possible duplicate, unproven.
        let expected = if backend == Backend::MySql {
            DbErrorKind::PossibleInboxDuplicate
        } else {
            DbErrorKind::InboxDuplicate
        };
        assert_eq!(
            classify(&again),
            expected,
            "a duplicate still violates {INDEX_NAME}"
        );
        assert_eq!(is_inbox_duplicate(&again), backend != Backend::MySql);
        // Every backend's claim runs on the first migration's table (before, PostgreSQL's
        // named the third migration's constraint and failed with MissingMigration).
        assert!(claim(&conn, Uuid::new_v4()).await.is_claimed());
        assert!(claim(&conn, old[2].0).await.is_duplicate());
        Migrator::up(&conn, None).await.expect("up again");
        verify_schema(&conn).await.expect("upgraded again");
        assert_eq!(received_at_index_count(backend, &conn).await, 1);
        assert!(claim(&conn, Uuid::new_v4()).await.is_claimed());
        assert!(claim(&conn, old[0].0).await.is_duplicate());
        // 51 rows, the one inserted while down, the claim after it, the claim after the
        // second upgrade.
        assert_eq!(inbox::Entity::find().all(&conn).await.unwrap().len(), 54);
    })
    .await;
}

on_every_backend!(first_migration_data_survives_the_upgrade_and_down_up);
