use sea_orm_inbox_entity::{CONSUMER_MAX_CHARS, INDEX_NAME, inbox};
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
/// (`migrate fresh` runs no `down`: it drops every table, this one included.)
pub struct CreateInbox;

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
        let backend = manager.get_database_backend();
        let consumer_len = CONSUMER_MAX_CHARS as u32;
        manager
            .create_table(
                Table::create()
                    .table(inbox::Entity)
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
                    .name(INDEX_NAME)
                    .table(inbox::Entity)
                    .col(inbox::Column::MessageId)
                    .col(inbox::Column::Consumer)
                    .unique()
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        refuse_to_drop_markers(manager).await?;
        manager
            .drop_index(
                Index::drop()
                    .name(INDEX_NAME)
                    .table(inbox::Entity)
                    .to_owned(),
            )
            .await?;
        manager
            .drop_table(Table::drop().table(inbox::Entity).to_owned())
            .await
    }
}

/// Fails while `inbox` holds a row: the rows are what keeps redeliveries from being
/// applied twice, so only the operator may throw them away, by deleting them.
async fn refuse_to_drop_markers(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    let any_marker = Query::select()
        .expr(Expr::val(1))
        .from(inbox::Entity)
        .limit(1)
        .to_owned();
    if manager
        .get_connection()
        .query_one(&any_marker)
        .await?
        .is_some()
    {
        return Err(DbErr::Migration(format!(
            "{}: refusing to drop the inbox table while it holds markers; every message \
             they record as processed would be applied again when redelivered. To drop \
             them anyway, delete them first (DELETE FROM inbox) and roll back again",
            CreateInbox.name()
        )));
    }
    Ok(())
}
