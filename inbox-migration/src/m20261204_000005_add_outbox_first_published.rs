use crate::m20261130_000001_create_inbox::utc_timestamp;
use sea_orm_inbox_entity::outbox;
use sea_orm_migration::prelude::*;

/// Adds `first_published_at` to `outbox`: when a relay first took the row to publish it,
/// the send time publishers give the broker (an inbox's admission floor compares it).
///
/// Its name, `m20261204_000005_add_outbox_first_published`, never changes. It runs after
/// [`CreateOutbox`](crate::CreateOutbox) and keeps every row.
///
/// | column | type | existing rows get |
/// | --- | --- | --- |
/// | `first_published_at` | UTC timestamp (µs), null | NULL: stamped by their next claim |
///
/// Rows that were published before it and are published again (a relay died before
/// marking them) carry the time of that next claim. `down` drops the column (rows kept).
pub struct AddOutboxFirstPublished;

impl MigrationName for AddOutboxFirstPublished {
    fn name(&self) -> &str {
        "m20261204_000005_add_outbox_first_published"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for AddOutboxFirstPublished {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let mut column = utc_timestamp(
            manager.get_database_backend(),
            outbox::Column::FirstPublishedAt,
        );
        column.null();
        manager
            .alter_table(
                Table::alter()
                    .table(outbox::Entity)
                    .add_column(&mut column)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(outbox::Entity)
                    .drop_column(outbox::Column::FirstPublishedAt)
                    .to_owned(),
            )
            .await
    }
}
