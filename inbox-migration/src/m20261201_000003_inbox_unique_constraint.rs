use crate::ForTable;
use sea_orm_inbox_entity::InboxTable;
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DatabaseBackend;

/// Makes the inbox index `ix_inbox_message_id_consumer` a named UNIQUE constraint on
/// PostgreSQL; a no-op on MySQL/MariaDB and SQLite.
///
/// Its name, `m20261201_000003_inbox_unique_constraint`, never changes. It runs after
/// [`AddInboxLeases`](crate::AddInboxLeases).
///
/// No claim needs it: `sea-orm-inbox`'s PostgreSQL claims detect a duplicate with
/// `INSERT ... ON CONFLICT (message_id, consumer) DO NOTHING`, which infers the unique
/// index [`CreateInbox`](crate::CreateInbox) makes as well as this constraint, and raises
/// nothing into the server log either way. (Claims once named the constraint, `ON CONFLICT
/// ON CONSTRAINT`, which takes a constraint only; this migration made one of the index.) It
/// stays in the list, under its stable name, for the databases that recorded it. The
/// existing index is attached (`ADD CONSTRAINT ... UNIQUE USING INDEX`): no rebuild and no
/// scan, only a brief ACCESS EXCLUSIVE lock on the table; the constraint keeps the index's
/// name, so errors name it as before. `down` turns it back into the plain unique index (a
/// rebuild).
///
/// [`InboxUniqueConstraint::for_table`] runs it on an inbox in another table.
pub struct InboxUniqueConstraint;

impl InboxUniqueConstraint {
    /// This migration for the inbox in `table` (its constraint
    /// `ix_<table>_message_id_consumer`), named
    /// `m20261201_000003_inbox_unique_constraint:<table>`; for the default table it is
    /// [`InboxUniqueConstraint`] itself. Run it after
    /// [`AddInboxLeases::for_table`](crate::AddInboxLeases::for_table) of the same table.
    pub fn for_table(table: InboxTable) -> ForTable<Self> {
        ForTable::new(Self, table)
    }
}

impl MigrationName for InboxUniqueConstraint {
    fn name(&self) -> &str {
        "m20261201_000003_inbox_unique_constraint"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for InboxUniqueConstraint {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        up(manager, &InboxTable::default()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        down(manager, &InboxTable::default()).await
    }
}

#[async_trait::async_trait]
impl MigrationTrait for ForTable<InboxUniqueConstraint> {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        up(manager, self.table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        down(manager, self.table()).await
    }
}

/// `"schema"."table"` or `"table"`: the names are [`InboxTable`]'s, checked to need no
/// escaping.
fn quoted(table: &InboxTable) -> String {
    match table.schema() {
        Some(schema) => format!(r#""{schema}"."{}""#, table.name()),
        None => format!(r#""{}""#, table.name()),
    }
}

async fn up(manager: &SchemaManager<'_>, table: &InboxTable) -> Result<(), DbErr> {
    if manager.get_database_backend() != DatabaseBackend::Postgres {
        return Ok(());
    }
    // USING INDEX looks the index up in the table's schema.
    let index = table.unique_index();
    manager
        .get_connection()
        .execute_unprepared(&format!(
            r#"ALTER TABLE {} ADD CONSTRAINT "{index}" UNIQUE USING INDEX "{index}""#,
            quoted(table)
        ))
        .await
        .map(|_| ())
}

async fn down(manager: &SchemaManager<'_>, table: &InboxTable) -> Result<(), DbErr> {
    if manager.get_database_backend() != DatabaseBackend::Postgres {
        return Ok(());
    }
    // Dropping the constraint drops its index: the index of `CreateInbox` comes back (in
    // the table's schema, where CREATE INDEX puts it).
    let index = table.unique_index();
    let connection = manager.get_connection();
    connection
        .execute_unprepared(&format!(
            r#"ALTER TABLE {} DROP CONSTRAINT "{index}""#,
            quoted(table)
        ))
        .await?;
    connection
        .execute_unprepared(&format!(
            r#"CREATE UNIQUE INDEX "{index}" ON {} ("message_id", "consumer")"#,
            quoted(table)
        ))
        .await
        .map(|_| ())
}
