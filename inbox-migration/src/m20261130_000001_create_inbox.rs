use crate::ForTable;
use sea_orm_inbox_entity::{CONSUMER_MAX_CHARS, InboxTable, inbox};
use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::{big_pk_auto, string_len, uuid};
use sea_orm_migration::sea_orm::DatabaseBackend;

/// Creates the `inbox` table and its UNIQUE index `ix_inbox_message_id_consumer`.
///
/// Its name, `m20261130_000001_create_inbox`, never changes: SeaORM records it in
/// `seaql_migrations`, so the migration runs once per database.
///
/// `down` drops the table only while it is empty. Its rows are the markers of processed
/// messages: dropping them would make every redelivery of those messages apply its effect
/// again. A rollback (`migrate down`, `refresh`, `reset`) meeting a marker fails with
/// [`DbErr::Migration`] and leaves the table, its rows and the migration's record as they
/// were; deleting the markers first (`DELETE FROM inbox`) is the explicit opt-in.
/// (`migrate fresh` runs no `down`: it drops every table, this one included.) SeaORM rolls
/// back newest first, so this refusal comes after the migrations listed after it were
/// undone; a migrator that runs [`rollback::guard`](crate::rollback::guard) (this crate's
/// do) refuses before it changes anything.
///
/// [`CreateInbox::for_table`] creates an inbox in a table of the application's choice.
pub struct CreateInbox;

impl CreateInbox {
    /// This migration for the inbox in `table`, named after it
    /// (`m20261130_000001_create_inbox:app_inbox`, or `...:messaging.app_inbox` with a
    /// schema) so that two inboxes in one database each have their record in
    /// `seaql_migrations`; for the default table it is [`CreateInbox`] itself, name
    /// included. Its `down` refuses to drop a table holding markers, as [`CreateInbox`]'s.
    ///
    /// ```
    /// use sea_orm_inbox_entity::InboxTable;
    /// use sea_orm_inbox_migration::CreateInbox;
    /// use sea_orm_migration::MigrationName;
    ///
    /// let app = CreateInbox::for_table(InboxTable::named("app_inbox")?);
    /// assert_eq!(app.name(), "m20261130_000001_create_inbox:app_inbox");
    /// # Ok::<(), sea_orm_inbox_entity::InvalidTableName>(())
    /// ```
    pub fn for_table(table: InboxTable) -> ForTable<Self> {
        ForTable::new(Self, table)
    }
}

impl MigrationName for CreateInbox {
    fn name(&self) -> &str {
        "m20261130_000001_create_inbox"
    }
}

/// A UTC timestamp that keeps microseconds and has no year-2038 limit on every backend.
///
/// MySQL's `timestamp` (what SeaQuery emits for "timestamp with time zone" there) keeps
/// whole seconds and ends in 2038, so MySQL/MariaDB get `datetime(6)` holding UTC.
pub(crate) fn utc_timestamp(backend: DatabaseBackend, column: impl IntoIden) -> ColumnDef {
    let mut def = ColumnDef::new(column);
    match backend {
        DatabaseBackend::MySql => def.custom(Alias::new("datetime(6)")),
        _ => def.timestamp_with_time_zone(),
    };
    def
}

/// The consumer name, compared byte for byte on every backend.
///
/// MySQL/MariaDB's default collations ignore case (`utf8mb4_general_ci`), so "Billing" and
/// "billing" would share one marker and one of the two consumers would skip every message
/// as a duplicate. The binary collation compares like PostgreSQL and SQLite do.
fn consumer_column(backend: DatabaseBackend, column: impl IntoIden, chars: u32) -> ColumnDef {
    if backend != DatabaseBackend::MySql {
        return string_len(column, chars);
    }
    let mut def = ColumnDef::new(column);
    def.custom(Alias::new(format!(
        "varchar({chars}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    )))
    .not_null();
    def
}

#[async_trait::async_trait]
impl MigrationTrait for CreateInbox {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        up(manager, &InboxTable::default()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        down(manager, &InboxTable::default(), self.name()).await
    }
}

#[async_trait::async_trait]
impl MigrationTrait for ForTable<CreateInbox> {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        up(manager, self.table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        down(manager, self.table(), self.name()).await
    }
}

async fn up(manager: &SchemaManager<'_>, table: &InboxTable) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    let consumer_len = CONSUMER_MAX_CHARS as u32;
    manager
        .create_table(
            Table::create()
                .table(table.table_ref())
                .col(big_pk_auto(inbox::Column::Id))
                .col(uuid(inbox::Column::MessageId))
                .col(consumer_column(
                    backend,
                    inbox::Column::Consumer,
                    consumer_len,
                ))
                .col(utc_timestamp(backend, inbox::Column::ReceivedAt).not_null())
                .col(utc_timestamp(backend, inbox::Column::ProcessedAt).null())
                .to_owned(),
        )
        .await?;
    manager
        .create_index(
            Index::create()
                .name(table.unique_index())
                .table(table.table_ref())
                .col(inbox::Column::MessageId)
                .col(inbox::Column::Consumer)
                .unique()
                .to_owned(),
        )
        .await
}

async fn down(manager: &SchemaManager<'_>, table: &InboxTable, name: &str) -> Result<(), DbErr> {
    refuse_to_drop_markers(manager.get_connection(), table, name).await?;
    manager
        .drop_index(
            Index::drop()
                .name(table.unique_index())
                .table(table.table_ref())
                .to_owned(),
        )
        .await?;
    manager
        .drop_table(Table::drop().table(table.table_ref()).to_owned())
        .await
}

/// Fails while `table` holds a row: the rows are what keeps redeliveries from being
/// applied twice, so only the operator may throw them away, by deleting them. `name` is
/// the migration that would drop it, which the refusal names.
pub(crate) async fn refuse_to_drop_markers<C: ConnectionTrait>(
    db: &C,
    table: &InboxTable,
    name: &str,
) -> Result<(), DbErr> {
    let any_marker = Query::select()
        .expr(Expr::val(1))
        .from(table.table_ref())
        .limit(1)
        .to_owned();
    if db.query_one(&any_marker).await?.is_some() {
        return Err(DbErr::Migration(format!(
            "{name}: refusing to drop the inbox table {table} while it holds markers; every \
             message they record as processed would be applied again when redelivered. To \
             drop them anyway, delete them first (DELETE FROM {table}) and roll back again"
        )));
    }
    Ok(())
}
