//! The startup check `verify_schema`: one typed error per gap, naming the migration (or the
//! index, or the collation) to fix, on every backend; and the per-message error for a
//! migration that has not run names it too, instead of generic advice.

use inbox_tests::{Backend, on_every_backend, run, with_fresh_db, with_migrated_db};
use sea_orm::{ConnectionTrait, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{InboxMigration, ProcessError, SchemaError, verify_schema};
use sea_orm_inbox_entity::INDEX_NAME;
use sea_orm_inbox_migration::Migrator;
use sea_orm_migration::MigratorTrait;
use uuid::Uuid;

/// Drops the inbox index (on PostgreSQL the constraint that owns it).
async fn drop_inbox_index(backend: Backend, conn: &sea_orm::DatabaseConnection) {
    let sql = match backend {
        Backend::Postgres | Backend::PgBouncer => {
            format!("ALTER TABLE inbox DROP CONSTRAINT {INDEX_NAME}")
        }
        Backend::MySql => format!("DROP INDEX {INDEX_NAME} ON inbox"),
        Backend::Sqlite => format!("DROP INDEX {INDEX_NAME}"),
    };
    run(conn, &sql).await;
}

async fn accepts_a_migrated_database(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        verify_schema(&conn)
            .await
            .expect("a migrated database passes");
    })
    .await;
}

async fn names_create_inbox_without_the_table(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        let err = verify_schema(&conn).await.expect_err("no table");
        assert!(matches!(err, SchemaError::MissingTable), "{err:?}");
        assert!(err.to_string().contains("CreateInbox"), "{err}");
    })
    .await;
}

async fn names_add_inbox_leases_after_create_inbox_only(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, Some(1))
            .await
            .expect("CreateInbox only");
        let err = verify_schema(&conn).await.expect_err("columns missing");
        assert!(
            matches!(
                err,
                SchemaError::MissingMigration {
                    migration: InboxMigration::AddInboxLeases,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("claim_token"), "{err}");
    })
    .await;
}

/// The per-message error of `process` on a database with only `CreateInbox` names the
/// migration to add (it said "check the database error above" before).
async fn process_names_the_missing_migration(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, Some(1))
            .await
            .expect("CreateInbox only");
        let result = Inbox::new("schema.process")
            .unwrap()
            .process(&conn, Uuid::new_v4(), |_txn| {
                Box::pin(async { Ok::<_, DbErr>(()) })
            })
            .await;
        let Err(ProcessError::Inbox(err)) = result else {
            panic!("process fails on the missing column: {result:?}")
        };
        let message = err.to_string();
        assert!(
            message.contains("sea_orm_inbox_migration::AddInboxLeases"),
            "the error names the migration to add: {message}"
        );
    })
    .await;
}

async fn names_the_missing_index(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        drop_inbox_index(backend, &conn).await;
        let err = verify_schema(&conn).await.expect_err("no index");
        assert!(matches!(err, SchemaError::MissingIndex), "{err:?}");
    })
    .await;
}

async fn refuses_an_index_on_other_columns(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        drop_inbox_index(backend, &conn).await;
        run(
            &conn,
            &format!("CREATE UNIQUE INDEX {INDEX_NAME} ON inbox (message_id)"),
        )
        .await;
        let err = verify_schema(&conn).await.expect_err("wrong columns");
        let SchemaError::WrongIndex { found } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(found, "on (message_id)");
    })
    .await;
}

async fn refuses_a_non_unique_index(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        drop_inbox_index(backend, &conn).await;
        run(
            &conn,
            &format!("CREATE INDEX {INDEX_NAME} ON inbox (message_id, consumer)"),
        )
        .await;
        let err = verify_schema(&conn).await.expect_err("not unique");
        let SchemaError::WrongIndex { found } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(found, "not unique");
    })
    .await;
}

on_every_backend!(
    accepts_a_migrated_database,
    names_create_inbox_without_the_table,
    names_add_inbox_leases_after_create_inbox_only,
    process_names_the_missing_migration,
    names_the_missing_index,
    refuses_an_index_on_other_columns,
    refuses_a_non_unique_index,
    needs_no_third_migration,
);

/// The startup check demands the same migrations on every backend, the first two: without
/// the third (PostgreSQL's constraint; a no-op elsewhere) it passes, and the claims work
/// on the first migration's index: a new message is claimed, a duplicate is `Duplicate`
/// with the transaction still usable. Before, on PostgreSQL: `MissingMigration
/// (InboxUniqueConstraint)` from the check and from every claim.
async fn needs_no_third_migration(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, Some(2)).await.expect("two migrations");
        verify_schema(&conn)
            .await
            .expect("the first two migrations are what the claims need");

        let id = Uuid::new_v4();
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let Claim::Claimed(claimed) = txn.claim_message(id, "schema.claim").await.expect("claim")
        else {
            panic!("a new message is claimed")
        };
        claimed.commit(txn).await.expect("commit");
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let again = txn.claim_message(id, "schema.claim").await.expect("claim");
        assert!(again.is_duplicate(), "{again:?}");
        txn.execute_unprepared("SELECT 1")
            .await
            .expect("the duplicate raised nothing into the transaction");
        txn.rollback().await.expect("roll back");
        let inbox = Inbox::new("schema.process").expect("a valid consumer");
        for expected in [Outcome::Processed(()), Outcome::Duplicate] {
            let outcome = inbox
                .process(&conn, id, |_txn| Box::pin(async { Ok::<_, DbErr>(()) }))
                .await
                .expect("process");
            assert_eq!(outcome, expected);
        }

        Migrator::up(&conn, None)
            .await
            .expect("the third migration");
        verify_schema(&conn).await.expect("migrated");
    })
    .await;
}

/// A `consumer` column that ignores case would merge "Billing" and "billing" into one
/// consumer on MariaDB.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mariadb_refuses_a_consumer_collation_that_ignores_case() {
    with_migrated_db(Backend::MySql, async |db| {
        let conn = db.connect().await;
        run(
            &conn,
            "ALTER TABLE inbox MODIFY consumer varchar(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL",
        )
        .await;
        let err = verify_schema(&conn).await.expect_err("case-insensitive");
        let SchemaError::ConsumerCollation { collation } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(collation, "utf8mb4_general_ci");
    })
    .await;
}

#[test]
fn migration_names_match_the_migration_crate() {
    let migrations = Migrator::migrations();
    let names: Vec<&str> = migrations.iter().map(|m| m.name()).collect();
    assert_eq!(
        names,
        [
            InboxMigration::CreateInbox,
            InboxMigration::AddInboxLeases,
            InboxMigration::InboxUniqueConstraint
        ]
        .map(InboxMigration::name)
    );
}
