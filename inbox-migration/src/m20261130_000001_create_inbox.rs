use sea_orm_inbox_entity::{CONSUMER_MAX_CHARS, INDEX_NAME, inbox};
use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::{big_pk_auto, string_len, uuid};
use sea_orm_migration::sea_orm::DatabaseBackend;

/// Creates the `inbox` table and its UNIQUE index `ix_inbox_message_id_consumer`.
///
/// Its name, `m20261130_000001_create_inbox`, never changes: SeaORM records it in
/// `seaql_migrations`, so the migration runs once per database.
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
