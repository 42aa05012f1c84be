//! The migrations go up, down and up again on every backend, create the index under its
//! exact name (on PostgreSQL as a UNIQUE constraint of that name), are a no-op the second
//! time, keep microseconds, and refuse to drop markers.

use chrono::{DateTime, TimeZone, Utc};
use inbox_tests::stmt;
use inbox_tests::{Backend, on_every_backend, scalar_i64, with_fresh_db};
use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter,
    TransactionTrait,
};
use sea_orm_inbox::{InboxTable, timestamp_value, verify_schema, verify_schema_in};
use sea_orm_inbox_entity::{INDEX_NAME, inbox};
use sea_orm_inbox_migration::{Migrator, MigratorWithOutbox, inbox_migrations};
use sea_orm_migration::MigratorTrait;

async fn inbox_table_count(
    backend: Backend,
    conn: &(impl ConnectionTrait + TransactionTrait),
) -> i64 {
    let sql = match backend {
        Backend::Postgres | Backend::PgBouncer => {
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = current_schema() AND table_name = 'inbox'"
        }
        Backend::MySql => {
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'inbox'"
        }
        Backend::Sqlite => {
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'inbox'"
        }
    };
    scalar_i64(conn, sql).await
}

/// Counts unique indexes on `inbox` named exactly `ix_inbox_message_id_consumer` over
/// exactly the columns `(message_id, consumer)`, in that order.
async fn inbox_index_count(
    backend: Backend,
    conn: &(impl ConnectionTrait + TransactionTrait),
) -> i64 {
    let sql = match backend {
        Backend::Postgres | Backend::PgBouncer => format!(
            "SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND tablename = 'inbox' \
             AND indexname = '{INDEX_NAME}' AND indexdef LIKE 'CREATE UNIQUE INDEX%(message_id, consumer)'"
        ),
        Backend::MySql => format!(
            "SELECT COUNT(*) FROM (SELECT index_name, GROUP_CONCAT(column_name ORDER BY seq_in_index) AS cols, MAX(non_unique) AS nu \
             FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name = 'inbox' \
             AND index_name = '{INDEX_NAME}' GROUP BY index_name) i WHERE cols = 'message_id,consumer' AND nu = 0"
        ),
        Backend::Sqlite => format!(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = 'inbox' AND name = '{INDEX_NAME}' \
             AND sql LIKE 'CREATE UNIQUE INDEX%(%message_id%, %consumer%)'"
        ),
    };
    scalar_i64(conn, &sql).await
}

async fn up_down_up_keeps_the_exact_index(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;

        Migrator::up(&conn, None).await.expect("first up");
        assert_eq!(inbox_table_count(backend, &conn).await, 1);
        assert_eq!(
            inbox_index_count(backend, &conn).await,
            1,
            "unique index {INDEX_NAME} on (message_id, consumer)"
        );

        Migrator::down(&conn, None).await.expect("down");
        assert_eq!(
            inbox_table_count(backend, &conn).await,
            0,
            "down drops the table"
        );

        Migrator::up(&conn, None)
            .await
            .expect("second up after down");
        assert_eq!(inbox_table_count(backend, &conn).await, 1);
        assert_eq!(inbox_index_count(backend, &conn).await, 1);
        if backend.is_postgres() {
            assert_eq!(
                scalar_i64(
                    &conn,
                    &format!(
                        "SELECT COUNT(*) FROM pg_constraint WHERE conname = '{INDEX_NAME}' \
                     AND contype = 'u' AND conrelid = 'inbox'::regclass"
                    ),
                )
                .await,
                1,
                "the index is the UNIQUE constraint {INDEX_NAME} the claims' ON CONFLICT names"
            );
        }
        verify_schema(&conn)
            .await
            .expect("the startup check passes");
    })
    .await;
}

async fn second_up_is_a_no_op(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, None).await.expect("first up");
        inbox::ActiveModel {
            message_id: Set(uuid::Uuid::new_v4()),
            consumer: Set("kept".into()),
            received_at: Set(Utc::now()),
            ..Default::default()
        }
        .insert(&conn)
        .await
        .expect("insert a marker");

        Migrator::up(&conn, None).await.expect("second up");
        let applied = Migrator::get_applied_migrations(&conn)
            .await
            .expect("applied");
        assert_eq!(applied.len(), Migrator::migrations().len());
        assert_eq!(
            inbox::Entity::find().all(&conn).await.expect("read").len(),
            1,
            "data kept"
        );
    })
    .await;
}

fn at(year: i32, micros: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(year, 6, 30, 23, 59, 58).unwrap()
        + chrono::TimeDelta::microseconds(micros.into())
}

async fn timestamps_keep_microseconds_past_2038(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, None).await.expect("up");

        for (received_at, processed_at) in [
            (at(2026, 123_456), Some(at(2026, 999_999))),
            (at(2099, 1), Some(at(2150, 654_321))),
            (at(1999, 500_001), None),
        ] {
            // Written as the library writes (see `timestamp_value`), read back through the entity.
            let message_id = uuid::Uuid::new_v4();
            let sea_backend = conn.get_database_backend();
            conn.execute_raw(stmt(
                sea_backend,
                "INSERT INTO inbox (message_id, consumer, received_at, processed_at) VALUES (?, ?, ?, ?)",
                vec![
                    message_id.into(),
                    "clock".into(),
                    timestamp_value(sea_backend, received_at),
                    processed_at.map_or(sea_orm::Value::ChronoDateTimeUtc(None), |t| timestamp_value(sea_backend, t)),
                ],
            ))
            .await
            .expect("insert");
            let saved = inbox::Entity::find()
                .filter(inbox::Column::MessageId.eq(message_id))
                .one(&conn)
                .await
                .expect("find")
                .expect("row");
            let read = inbox::Entity::find_by_id(saved.id)
                .one(&conn)
                .await
                .expect("read")
                .expect("row");
            assert_eq!(
                read.received_at, received_at,
                "received_at round-trips on {backend:?}"
            );
            assert_eq!(
                read.processed_at, processed_at,
                "processed_at round-trips on {backend:?}"
            );
        }
    })
    .await;
}

async fn down_refuses_to_drop_markers_until_they_are_deleted(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, None).await.expect("up");
        inbox::ActiveModel {
            message_id: Set(uuid::Uuid::new_v4()),
            consumer: Set("kept".into()),
            received_at: Set(Utc::now()),
            ..Default::default()
        }
        .insert(&conn)
        .await
        .expect("insert a marker");

        let refused = Migrator::down(&conn, None)
            .await
            .expect_err("down must not drop the table while it holds a marker");
        assert!(
            matches!(&refused, sea_orm::DbErr::Migration(message) if message.contains("DELETE FROM inbox")),
            "the refusal says how to opt in: {refused:?}"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            1,
            "the marker is kept"
        );
        let applied = Migrator::get_applied_migrations(&conn)
            .await
            .expect("applied");
        assert!(
            applied
                .iter()
                .any(|m| m.name() == "m20261130_000001_create_inbox"),
            "CreateInbox is still recorded as applied"
        );

        // The explicit opt-in: the operator deletes the markers, then the rollback goes through.
        conn.execute_unprepared("DELETE FROM inbox")
            .await
            .expect("delete the markers");
        Migrator::down(&conn, None)
            .await
            .expect("down of an empty inbox");
        assert_eq!(inbox_table_count(backend, &conn).await, 0);
    })
    .await;
}

mod half_rollback {
    //! A rollback reaching `CreateInbox` while the inbox holds a marker (or `CreateOutbox`
    //! while the outbox holds an unsent row) refuses before it changes anything, through
    //! `down`, `reset` and `refresh`; one that stops short of them goes through, rows and
    //! all (the documented downgrade `upgrade::*` checks). Before (issue 29 item 10): the
    //! later migrations were rolled back one by one until `CreateInbox`'s own `down`
    //! refused, leaving the lease columns and PostgreSQL's constraint dropped.

    use super::*;
    use sea_orm_inbox_migration::rollback;
    use sea_orm_migration::{IntoSchemaManagerConnection, MigrationTrait};

    /// An application's own migrator: the library's migrations, then those of a second
    /// inbox in `app_inbox`; its rollbacks run the guard first, as the guide tells
    /// applications to write them.
    struct AppMigrator;

    #[sea_orm_migration::async_trait::async_trait]
    impl MigratorTrait for AppMigrator {
        fn migrations() -> Vec<Box<dyn MigrationTrait>> {
            let mut migrations = MigratorWithOutbox::migrations();
            migrations.extend(inbox_migrations(&app_inbox()));
            migrations
        }

        async fn down<'c, C>(db: C, steps: Option<u32>) -> Result<(), sea_orm::DbErr>
        where
            C: IntoSchemaManagerConnection<'c>,
        {
            rollback::down::<Self, C>(db, steps).await
        }

        async fn reset<'c, C>(db: C) -> Result<(), sea_orm::DbErr>
        where
            C: IntoSchemaManagerConnection<'c>,
        {
            rollback::reset::<Self, C>(db).await
        }

        async fn refresh<'c, C>(db: C) -> Result<(), sea_orm::DbErr>
        where
            C: IntoSchemaManagerConnection<'c>,
        {
            rollback::refresh::<Self, C>(db).await
        }
    }

    fn app_inbox() -> InboxTable {
        InboxTable::named("app_inbox").expect("a valid name")
    }

    async fn insert_marker(conn: &sea_orm::DatabaseConnection, table: &str) {
        let backend = conn.get_database_backend();
        conn.execute_raw(stmt(
            backend,
            &format!(
                "INSERT INTO {table} (message_id, consumer, received_at) VALUES (?, 'kept', ?)"
            ),
            vec![
                uuid::Uuid::new_v4().into(),
                timestamp_value(backend, Utc::now()),
            ],
        ))
        .await
        .expect("insert a marker");
    }

    async fn insert_unsent(conn: &sea_orm::DatabaseConnection) {
        let backend = conn.get_database_backend();
        conn.execute_raw(stmt(
            backend,
            "INSERT INTO outbox (message_id, destination, payload, headers, created_at, available_at) \
             VALUES (?, 'orders', ?, '{}', ?, ?)",
            vec![
                uuid::Uuid::new_v4().into(),
                b"unsent".to_vec().into(),
                timestamp_value(backend, Utc::now()),
                timestamp_value(backend, Utc::now()),
            ],
        ))
        .await
        .expect("insert an unsent outbox row");
    }

    async fn applied<M: MigratorTrait>(conn: &sea_orm::DatabaseConnection) -> Vec<String> {
        M::get_applied_migrations(conn)
            .await
            .expect("applied")
            .iter()
            .map(|migration| migration.name().to_owned())
            .collect()
    }

    /// Every migration of `MigratorWithOutbox` recorded, and the schema as they leave it:
    /// the inbox passes the startup check, the outbox has its last migration's column.
    async fn nothing_rolled_back(conn: &sea_orm::DatabaseConnection, after: &str) {
        let all: Vec<String> = MigratorWithOutbox::migrations()
            .iter()
            .map(|migration| migration.name().to_owned())
            .collect();
        assert_eq!(applied::<MigratorWithOutbox>(conn).await, all, "{after}");
        verify_schema(conn)
            .await
            .unwrap_or_else(|err| panic!("{after}: the inbox as its migrations left it: {err}"));
        assert_eq!(
            scalar_i64(
                conn,
                "SELECT COUNT(*) FROM outbox WHERE first_published_at IS NULL"
            )
            .await,
            1,
            "{after}: the outbox and its unsent row as they were"
        );
        assert_eq!(
            scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await,
            1,
            "{after}"
        );
    }

    fn refused_naming(refused: &sea_orm::DbErr, opt_ins: &[&str]) {
        assert!(
            matches!(refused, sea_orm::DbErr::Migration(message)
                if opt_ins.iter().all(|opt_in| message.contains(opt_in))),
            "{refused:?} names {opt_ins:?}"
        );
    }

    pub(super) async fn down_with_markers_refuses_before_changing_the_inbox(backend: Backend) {
        with_fresh_db(backend, async |db| {
            let conn = db.connect().await;
            MigratorWithOutbox::up(&conn, None).await.expect("up");
            insert_marker(&conn, "inbox").await;
            insert_unsent(&conn).await;

            let both = [
                "DELETE FROM inbox",
                "DELETE FROM outbox WHERE sent_at IS NULL",
            ];
            let refused = MigratorWithOutbox::down(&conn, None)
                .await
                .expect_err("the rollback must refuse before the outbox and the inbox");
            refused_naming(&refused, &both);
            nothing_rolled_back(&conn, "down").await;
            let refused = MigratorWithOutbox::reset(&conn)
                .await
                .expect_err("reset must refuse");
            refused_naming(&refused, &both);
            nothing_rolled_back(&conn, "reset").await;
            let refused = MigratorWithOutbox::refresh(&conn)
                .await
                .expect_err("refresh must refuse");
            refused_naming(&refused, &both);
            nothing_rolled_back(&conn, "refresh").await;
            let refused = Migrator::down(&conn, None)
                .await
                .expect_err("the inbox's own migrator must refuse");
            refused_naming(&refused, &["DELETE FROM inbox"]);
            nothing_rolled_back(&conn, "Migrator::down").await;

            // Four steps reach CreateOutbox (its unsent row), three do not.
            let refused = MigratorWithOutbox::down(&conn, Some(4))
                .await
                .expect_err("four steps reach the outbox");
            refused_naming(&refused, &["DELETE FROM outbox WHERE sent_at IS NULL"]);
            nothing_rolled_back(&conn, "down -n 4").await;
            MigratorWithOutbox::down(&conn, Some(3))
                .await
                .expect("three steps stop short of CreateOutbox");
            MigratorWithOutbox::up(&conn, None).await.expect("up again");

            // With the row sent, six steps stop short of CreateInbox and go through.
            conn.execute_unprepared("UPDATE outbox SET sent_at = available_at")
                .await
                .expect("mark the row sent");
            MigratorWithOutbox::down(&conn, Some(6))
                .await
                .expect("six steps stop short of CreateInbox");
            assert_eq!(
                applied::<MigratorWithOutbox>(&conn).await,
                ["m20261130_000001_create_inbox"]
            );
            assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
            let refused = MigratorWithOutbox::down(&conn, Some(1))
                .await
                .expect_err("the last step reaches CreateInbox");
            refused_naming(&refused, &["DELETE FROM inbox"]);
            assert_eq!(inbox_table_count(backend, &conn).await, 1);
            MigratorWithOutbox::up(&conn, Some(2))
                .await
                .expect("the inbox upgraded again");

            // An inbox in a table of its own, through the application's own migrator.
            AppMigrator::up(&conn, None).await.expect("up app_inbox");
            insert_marker(&conn, "app_inbox").await;
            let app_inbox_opt_in = [
                "m20261130_000001_create_inbox:app_inbox",
                "DELETE FROM app_inbox",
            ];
            let refused = AppMigrator::down(&conn, Some(3))
                .await
                .expect_err("three steps reach app_inbox's CreateInbox");
            refused_naming(&refused, &app_inbox_opt_in);
            assert!(
                !matches!(&refused, sea_orm::DbErr::Migration(message)
                    if message.contains("DELETE FROM inbox")),
                "three steps do not reach the default inbox: {refused:?}"
            );
            for (what, refused) in [
                ("reset", AppMigrator::reset(&conn).await),
                ("refresh", AppMigrator::refresh(&conn).await),
            ] {
                let refused = refused.expect_err(what);
                refused_naming(&refused, &app_inbox_opt_in);
                refused_naming(&refused, &["DELETE FROM inbox"]);
            }
            assert_eq!(
                applied::<AppMigrator>(&conn).await.len(),
                AppMigrator::migrations().len()
            );
            verify_schema_in(&conn, &app_inbox())
                .await
                .expect("app_inbox as its migrations left it");
            verify_schema(&conn).await.expect("inbox as it was");
            AppMigrator::down(&conn, Some(2))
                .await
                .expect("two steps stop short of app_inbox's CreateInbox");
            assert_eq!(
                applied::<AppMigrator>(&conn).await.len(),
                AppMigrator::migrations().len() - 2
            );
            assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM app_inbox").await, 1);
        })
        .await;
    }

    on_every_backend!(down_with_markers_refuses_before_changing_the_inbox);
}

on_every_backend!(
    up_down_up_keeps_the_exact_index,
    down_refuses_to_drop_markers_until_they_are_deleted,
    second_up_is_a_no_op,
    timestamps_keep_microseconds_past_2038
);
