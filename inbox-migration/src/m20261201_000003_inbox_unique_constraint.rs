use sea_orm_inbox_entity::{INDEX_NAME, TABLE_NAME};
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DatabaseBackend;

/// Makes the inbox index `ix_inbox_message_id_consumer` a named UNIQUE constraint on
/// PostgreSQL; a no-op on MySQL/MariaDB and SQLite.
///
/// Its name, `m20261201_000003_inbox_unique_constraint`, never changes. It runs after
/// [`AddInboxLeases`](crate::AddInboxLeases).
///
/// With the constraint, a claim detects a duplicate with `INSERT ... ON CONFLICT ON
/// CONSTRAINT ix_inbox_message_id_consumer DO NOTHING` instead of a raised unique
/// violation, which PostgreSQL writes to its log as an `ERROR` (with `DETAIL` and
/// `STATEMENT`) for every duplicate delivery. `ON CONFLICT ON CONSTRAINT` takes a
/// constraint, not a bare unique index, so the existing index is attached as one
/// (`ADD CONSTRAINT ... UNIQUE USING INDEX`): no rebuild and no scan, only a brief ACCESS
/// EXCLUSIVE lock on the table. The constraint keeps the index's name, so errors name it as
/// before. `down` turns it back into the plain unique index (a rebuild).
///
/// The other databases raise nothing into a log on a duplicate with their default
/// settings (MariaDB writes no 1062 into its error log), and their claims keep their
/// statements.
pub struct InboxUniqueConstraint;

impl MigrationName for InboxUniqueConstraint {
    fn name(&self) -> &str {
        "m20261201_000003_inbox_unique_constraint"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for InboxUniqueConstraint {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DatabaseBackend::Postgres {
            return Ok(());
        }
        manager
            .get_connection()
            .execute_unprepared(&format!(
                r#"ALTER TABLE "{TABLE_NAME}" ADD CONSTRAINT "{INDEX_NAME}" UNIQUE USING INDEX "{INDEX_NAME}""#
            ))
            .await
            .map(|_| ())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DatabaseBackend::Postgres {
            return Ok(());
        }
        // Dropping the constraint drops its index: the index of `CreateInbox` comes back.
        let connection = manager.get_connection();
        connection
            .execute_unprepared(&format!(
                r#"ALTER TABLE "{TABLE_NAME}" DROP CONSTRAINT "{INDEX_NAME}""#
            ))
            .await?;
        connection
            .execute_unprepared(&format!(
                r#"CREATE UNIQUE INDEX "{INDEX_NAME}" ON "{TABLE_NAME}" ("message_id", "consumer")"#
            ))
            .await
            .map(|_| ())
    }
}
