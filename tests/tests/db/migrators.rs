//! The two ready migrators on one database: the plain `Migrator` after `MigratorWithOutbox`
//! runs (before: SeaORM refused it, "Migration file of version
//! 'm20261201_000004_create_outbox' is missing", with no hint), and the outbox stays.

use inbox_tests::{Backend, on_every_backend, scalar_i64, with_fresh_db};
use sea_orm_inbox_migration::{Migrator, MigratorTrait, MigratorWithOutbox};

async fn the_inbox_migrator_runs_after_the_one_with_the_outbox(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        MigratorWithOutbox::up(&conn, None)
            .await
            .expect("inbox and outbox");
        Migrator::up(&conn, None)
            .await
            .expect("the inbox migrator on a database the outbox migrator ran");
        Migrator::status(&conn).await.expect("status");
        assert!(
            Migrator::get_pending_migrations(&conn)
                .await
                .expect("pending")
                .is_empty()
        );
        MigratorWithOutbox::up(&conn, None).await.expect("again");
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM outbox").await, 0);
    })
    .await;
}

on_every_backend!(the_inbox_migrator_runs_after_the_one_with_the_outbox);
