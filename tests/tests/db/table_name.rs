//! The inbox table is the application's choice (issue 16, item 6): two inboxes of different
//! names (on PostgreSQL also one in another schema) live side by side in one database,
//! each deduplicating on its own; an application table already called `inbox` does not
//! stop the crate; bad names are typed errors before any SQL.

use inbox_tests::{Backend, on_every_backend, run, scalar_i64, stmt, with_fresh_db};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{
    DbErrorKind, ErrorKind, MessageId, NameOf, RetentionPolicy, TABLE_NAME_MAX_LEN, claim_lease_in,
    classify_in, is_inbox_duplicate, is_inbox_duplicate_in, list_expired_leases_in, purge_in,
    verify_schema_in,
};
use sea_orm_inbox_migration::{Migrator, inbox_migrations};
use sea_orm_migration::{MigrationTrait, MigratorTrait};
use std::time::Duration;
use uuid::Uuid;

/// The second inbox of every test.
fn app_inbox() -> InboxTable {
    InboxTable::named("app_inbox").expect("a valid table name")
}

/// PostgreSQL's third inbox, in a schema of its own (same table name as the second).
fn schema_inbox() -> InboxTable {
    app_inbox()
        .in_schema("messaging")
        .expect("a valid schema name")
}

/// The default inbox and `app_inbox`, each with its own records in `seaql_migrations`.
struct TwoInboxes;

impl MigratorTrait for TwoInboxes {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut migrations = Migrator::migrations();
        migrations.extend(inbox_migrations(&app_inbox()));
        migrations
    }
}

/// [`TwoInboxes`] and `messaging.app_inbox` (PostgreSQL only).
struct ThreeInboxes;

impl MigratorTrait for ThreeInboxes {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut migrations = TwoInboxes::migrations();
        migrations.extend(inbox_migrations(&schema_inbox()));
        migrations
    }
}

/// The inboxes of the side-by-side test on `backend`, migrated on `conn`.
async fn migrate_side_by_side(backend: Backend, conn: &DatabaseConnection) -> Vec<InboxTable> {
    if backend.is_postgres() {
        run(conn, "CREATE SCHEMA messaging").await;
        ThreeInboxes::up(conn, None)
            .await
            .expect("migrate three inboxes");
        vec![InboxTable::default(), app_inbox(), schema_inbox()]
    } else {
        TwoInboxes::up(conn, None)
            .await
            .expect("migrate two inboxes");
        vec![InboxTable::default(), app_inbox()]
    }
}

/// `table` as the statements of the test write it.
fn sql_name(backend: Backend, table: &InboxTable) -> String {
    let quote = if backend == Backend::MySql { '`' } else { '"' };
    match table.schema() {
        Some(schema) => format!("{quote}{schema}{quote}.{quote}{}{quote}", table.name()),
        None => format!("{quote}{}{quote}", table.name()),
    }
}

/// `count` bind placeholders in `backend`'s style.
fn placeholders(backend: Backend, count: usize) -> String {
    let each: Vec<String> = (1..=count)
        .map(|n| {
            if backend.is_postgres() {
                format!("${n}")
            } else {
                "?".to_owned()
            }
        })
        .collect();
    each.join(", ")
}

async fn rows_in(backend: Backend, conn: &DatabaseConnection, table: &InboxTable) -> i64 {
    scalar_i64(
        conn,
        &format!("SELECT COUNT(*) FROM {}", sql_name(backend, table)),
    )
    .await
}

/// The same message and consumer in every inbox of one database: claimed once in each
/// (one inbox's marker is no duplicate in another), a duplicate the second time in each,
/// through every claim path, the schema check, the lease listing and the purge.
async fn two_inboxes_side_by_side(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        let tables = migrate_side_by_side(backend, &conn).await;
        let id = Uuid::new_v4();

        for table in &tables {
            verify_schema_in(&conn, table)
                .await
                .unwrap_or_else(|err| panic!("{table}: {err}"));

            // claim_message_in
            let txn = conn
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("begin");
            let Claim::Claimed(claimed) = txn
                .claim_message_in(table, id, "billing")
                .await
                .expect("claim")
            else {
                panic!("{table}: the message is new in this inbox");
            };
            claimed.commit(txn).await.expect("commit the claim");
            let txn = conn
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("begin");
            let again = txn
                .claim_message_in(table, id, "billing")
                .await
                .expect("claim again");
            assert_eq!(again, Claim::Duplicate, "{table}");
            txn.rollback().await.expect("roll back");

            // Inbox::process
            let inbox = Inbox::new("billing.process")
                .expect("valid name")
                .with_table(table.clone());
            for expected_duplicate in [false, true] {
                let outcome = inbox
                    .process(&conn, id, |_txn| Box::pin(async { Ok::<_, String>(()) }))
                    .await
                    .expect("process");
                assert_eq!(outcome.is_duplicate(), expected_duplicate, "{table}");
            }

            // claim_batch_in: one new id, one done
            let fresh = Uuid::new_v4();
            let txn = conn
                .begin_with_options(CLAIM_TRANSACTION)
                .await
                .expect("begin");
            let batch = txn
                .claim_batch_in(table, [fresh, id], "billing")
                .await
                .expect("batch claim");
            assert_eq!(batch.claimed, vec![MessageId::from_uuid(fresh)], "{table}");
            assert_eq!(batch.duplicates, vec![MessageId::from_uuid(id)], "{table}");
            batch.commit(txn).await.expect("commit the batch");

            // claim_lease_in, completed in the same table
            let options = LeaseOptions::new(Duration::from_secs(30)).expect("a lease");
            let LeaseClaim::Claimed(lease) =
                claim_lease_in(&conn, table, id, "mailer", &options, ClaimToken::new())
                    .await
                    .expect("lease")
            else {
                panic!("{table}: the lease is new in this inbox");
            };
            lease.complete(&conn).await.expect("complete the lease");
            let again = claim_lease_in(&conn, table, id, "mailer", &options, ClaimToken::new())
                .await
                .expect("lease again");
            assert_eq!(again, LeaseClaim::Duplicate, "{table}");
            let expired = list_expired_leases_in(&conn, table, None, 10)
                .await
                .expect("list expired leases");
            assert!(expired.is_empty(), "{table}: {expired:?}");
        }
        for table in &tables {
            // billing: id and fresh; billing.process: id; mailer: id.
            assert_eq!(rows_in(backend, &conn, table).await, 4, "{table}");
        }

        // The purge deletes in its table only. Age one inbox's markers past an hour of
        // steady receiving (markers 40 and 80 minutes apart, within the downtime gap).
        let old = app_inbox();
        let now = chrono::Utc::now();
        let at = |minutes_ago| {
            sea_orm_inbox::timestamp_value(
                conn.get_database_backend(),
                now - chrono::TimeDelta::minutes(minutes_ago),
            )
        };
        let age = format!(
            "UPDATE {} SET received_at = {}, processed_at = NULL, lease_until = NULL",
            sql_name(backend, &old),
            placeholders(backend, 1)
        );
        conn.execute_raw(stmt(conn.get_database_backend(), &age, vec![at(80)]))
            .await
            .expect("age the markers");
        let insert = format!(
            "INSERT INTO {} (message_id, consumer, received_at) VALUES ({})",
            sql_name(backend, &old),
            placeholders(backend, 3)
        );
        for minutes_ago in [40, 0] {
            let values = vec![Uuid::new_v4().into(), "walk".into(), at(minutes_ago)];
            conn.execute_raw(stmt(conn.get_database_backend(), &insert, values))
                .await
                .expect("a later marker");
        }
        let policy = RetentionPolicy::with_window(Duration::from_secs(3600))
            .and_then(|policy| policy.with_downtime_gap(Duration::from_secs(3600)))
            .expect("policy");
        let report = purge_in(&conn, &old, &policy).await.expect("purge");
        assert_eq!(report.rows, 4, "{report:?}");
        for table in &tables {
            let left = if *table == old { 2 } else { 4 };
            assert_eq!(rows_in(backend, &conn, table).await, left, "{table}");
        }
    })
    .await;
}

/// A unique violation of one inbox's index is that inbox's duplicate, and not the
/// other's (MySQL/MariaDB and SQLite name the index or the table's columns; PostgreSQL
/// the constraint, the table and its schema).
async fn a_duplicate_names_its_own_inbox(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        let tables = migrate_side_by_side(backend, &conn).await;
        let id = Uuid::new_v4();
        for table in &tables {
            let insert = format!(
                "INSERT INTO {} (message_id, consumer, received_at) VALUES ({})",
                sql_name(backend, table),
                placeholders(backend, 3)
            );
            let values = || {
                vec![
                    id.into(),
                    "billing".into(),
                    sea_orm_inbox::timestamp_value(conn.get_database_backend(), chrono::Utc::now()),
                ]
            };
            let backend_of = conn.get_database_backend();
            conn.execute_raw(stmt(backend_of, &insert, values()))
                .await
                .expect("the first marker");
            let err = conn
                .execute_raw(stmt(backend_of, &insert, values()))
                .await
                .expect_err("the second marker violates the index");
            // MariaDB names the violated key, not its table: its own inbox's violation is
            // possible, never proven.
            let proven = backend != Backend::MySql;
            for other in &tables {
                // A table without a schema is whichever the search_path finds, so on
                // PostgreSQL it takes its namesake's violation in any schema.
                let namesake = backend.is_postgres()
                    && other.schema().is_none()
                    && other.name() == table.name();
                let ours = other == table || namesake;
                assert_eq!(
                    is_inbox_duplicate_in(&err, other),
                    ours && proven,
                    "{table} vs {other}: {err}"
                );
                let expected = match (ours, proven) {
                    (true, true) => DbErrorKind::InboxDuplicate,
                    (true, false) => DbErrorKind::PossibleInboxDuplicate,
                    (false, _) => DbErrorKind::OtherUniqueViolation,
                };
                assert_eq!(
                    classify_in(&err, other),
                    expected,
                    "{table} vs {other}: {err}"
                );
            }
            assert_eq!(
                is_inbox_duplicate(&err),
                table.is_default() && proven,
                "{err}"
            );
        }
    })
    .await;
}

/// An application whose own table is called `inbox` (a mail feature): the default
/// migration cannot create ours (what every release did before the table became a
/// choice), and the inbox under another name migrates and works beside it.
async fn an_app_table_named_inbox_stays_untouched(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        run(
            &conn,
            "CREATE TABLE inbox (id INTEGER PRIMARY KEY, subject VARCHAR(100) NOT NULL)",
        )
        .await;
        run(&conn, "INSERT INTO inbox (id, subject) VALUES (1, 'hello')").await;
        let clash = Migrator::up(&conn, None)
            .await
            .expect_err("the default migration meets the mail table");
        assert!(clash.to_string().contains("already exists"), "{clash}");

        struct AppMigrator;
        impl MigratorTrait for AppMigrator {
            fn migrations() -> Vec<Box<dyn MigrationTrait>> {
                inbox_migrations(&app_inbox())
            }
        }
        // The failed migration left no record, so a migrator without it runs.
        AppMigrator::up(&conn, None)
            .await
            .expect("migrate app_inbox");
        verify_schema_in(&conn, &app_inbox())
            .await
            .expect("app_inbox is complete");

        let inbox = Inbox::new("billing")
            .expect("valid name")
            .with_table(app_inbox());
        let id = Uuid::new_v4();
        for expected_duplicate in [false, true] {
            let outcome = inbox
                .process(&conn, id, |_txn| Box::pin(async { Ok::<_, String>(()) }))
                .await
                .expect("process");
            assert_eq!(outcome.is_duplicate(), expected_duplicate);
        }
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
        assert_eq!(rows_in(backend, &conn, &app_inbox()).await, 1);
    })
    .await;
}

/// `app_inbox`'s migrations alone.
struct AppInboxOnly;

impl MigratorTrait for AppInboxOnly {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        inbox_migrations(&app_inbox())
    }
}

/// Whether `result` is the typed error of a missing inbox table (dead-letter: no retry
/// creates the table).
fn is_missing_table(err: &InboxError) -> bool {
    matches!(err, InboxError::MissingTable { .. }) && err.is_permanent()
}

/// An inbox in a table of its own whose migrations have not run: every path that claims
/// in it answers `MissingTable` (dead-letter, with the migration to add), as the default
/// table does, not a generic database error nacked forever; with its first two migrations
/// it works on every backend (PostgreSQL's claims need no constraint).
async fn a_custom_table_without_its_migrations_is_a_typed_error(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        let table = app_inbox();
        let inbox = Inbox::new("billing")
            .expect("a valid consumer")
            .with_table(table.clone())
            .with_retry(RetryPolicy::no_retry());
        let processed = inbox
            .process(&conn, Uuid::new_v4(), |_| {
                Box::pin(async move { Ok::<_, sea_orm::DbErr>(()) })
            })
            .await;
        match &processed {
            Err(ProcessError::Inbox(err)) if is_missing_table(err) => {}
            other => panic!("process: {other:?}"),
        }
        assert_eq!(Settlement::of(&processed), Settlement::DeadLetter);
        let batch = inbox
            .process_batch(&conn, [Uuid::new_v4()], |_, _| {
                Box::pin(async move { Ok::<_, sea_orm::DbErr>(()) })
            })
            .await;
        match &batch {
            Err(ProcessError::Inbox(err)) if is_missing_table(err) => {}
            other => panic!("process_batch: {other:?}"),
        }

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let claim = txn
            .claim_message_in(&table, Uuid::new_v4(), "billing")
            .await;
        txn.rollback().await.expect("roll back");
        match &claim {
            Err(err) if is_missing_table(err) => {}
            other => panic!("claim_message_in: {other:?}"),
        }
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let claim = txn
            .claim_batch_in(&table, [Uuid::new_v4()], "billing")
            .await;
        txn.rollback().await.expect("roll back");
        match &claim {
            Err(err) if is_missing_table(err) => {}
            other => panic!("claim_batch_in: {other:?}"),
        }
        let options = LeaseOptions::new(Duration::from_secs(30)).expect("lease options");
        let lease = claim_lease_in(
            &conn,
            &table,
            Uuid::new_v4(),
            "mailer",
            &options,
            ClaimToken::new(),
        )
        .await;
        match &lease {
            Err(err) if is_missing_table(err) => {}
            other => panic!("claim_lease_in: {other:?}"),
        }

        // With its first two migrations (no PostgreSQL constraint) the claims work, as on
        // the default table: before, PostgreSQL's claims named the constraint and failed.
        AppInboxOnly::up(&conn, Some(2))
            .await
            .expect("the first two migrations of app_inbox");
        verify_schema_in(&conn, &table)
            .await
            .expect("what the claims need");
        let id = Uuid::new_v4();
        for expected in [Outcome::Processed(()), Outcome::Duplicate] {
            let processed = inbox
                .process(&conn, id, |_| {
                    Box::pin(async move { Ok::<_, sea_orm::DbErr>(()) })
                })
                .await;
            assert_eq!(processed.expect("process"), expected);
        }
    })
    .await;
}

on_every_backend!(
    two_inboxes_side_by_side,
    a_custom_table_without_its_migrations_is_a_typed_error,
    a_duplicate_names_its_own_inbox,
    an_app_table_named_inbox_stays_untouched
);

/// Names that would need escaping, or that no database takes, are refused with a typed
/// input error before any SQL runs.
#[test]
fn bad_names_are_typed_input_errors() {
    let too_long = "a".repeat(TABLE_NAME_MAX_LEN + 1);
    for bad in [
        "x; drop table inbox",
        "",
        too_long.as_str(),
        "Inbox",
        "9lives",
        "in box",
    ] {
        let err = InboxTable::named(bad).expect_err(bad);
        assert_eq!(err.of(), NameOf::Table, "{bad}");
        let err = InboxError::from(err);
        assert_eq!(err.kind(), ErrorKind::Input, "{bad}");
        assert!(err.to_string().contains("lowercase ASCII letters"), "{err}");
    }
    let err = app_inbox()
        .in_schema("messaging\"; --")
        .expect_err("a bad schema");
    assert_eq!(err.of(), NameOf::Schema);
}
