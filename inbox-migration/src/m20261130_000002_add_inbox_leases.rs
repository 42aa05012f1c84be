use crate::ForTable;
use crate::m20261130_000001_create_inbox::utc_timestamp;
use sea_orm_inbox_entity::{InboxTable, inbox};
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DatabaseBackend;

/// Adds the two-phase claim columns to `inbox` in place, and the index the purge uses.
///
/// Its name, `m20261130_000002_add_inbox_leases`, never changes. It runs after
/// [`CreateInbox`](crate::CreateInbox) and keeps every existing row: the new columns are
/// nullable or have a default, so markers written before it (and markers that
/// `claim_message` still writes with its plain INSERT) stay valid.
///
/// | column | type | existing rows get |
/// | --- | --- | --- |
/// | `attempts` | integer, not null, default 1 | 1 |
/// | `lease_until` | UTC timestamp (µs), null | NULL (not a lease) |
/// | `claim_token` | uuid, null | NULL |
/// | `dead_at` | UTC timestamp (µs), null | NULL (not parked) |
///
/// plus the index `ix_inbox_received_at` on `(received_at)`. `down` drops the index and
/// the four columns, leaving the table as the first migration made it (rows kept).
///
/// [`AddInboxLeases::for_table`] runs it on an inbox in another table.
pub struct AddInboxLeases;

impl AddInboxLeases {
    /// This migration for the inbox in `table` (its index `ix_<table>_received_at`),
    /// named `m20261130_000002_add_inbox_leases:<table>`; for the default table it is
    /// [`AddInboxLeases`] itself. Run it after [`CreateInbox::for_table`](crate::CreateInbox::for_table)
    /// of the same table.
    pub fn for_table(table: InboxTable) -> ForTable<Self> {
        ForTable::new(Self, table)
    }
}

impl MigrationName for AddInboxLeases {
    fn name(&self) -> &str {
        "m20261130_000002_add_inbox_leases"
    }
}

fn new_columns(backend: DatabaseBackend) -> Vec<ColumnDef> {
    let mut attempts = ColumnDef::new(inbox::Column::Attempts);
    attempts.integer().not_null().default(1);
    let mut claim_token = ColumnDef::new(inbox::Column::ClaimToken);
    claim_token.uuid().null();
    let mut lease_until = utc_timestamp(backend, inbox::Column::LeaseUntil);
    lease_until.null();
    let mut dead_at = utc_timestamp(backend, inbox::Column::DeadAt);
    dead_at.null();
    vec![attempts, lease_until, claim_token, dead_at]
}

const NEW_COLUMNS: [inbox::Column; 4] = [
    inbox::Column::Attempts,
    inbox::Column::LeaseUntil,
    inbox::Column::ClaimToken,
    inbox::Column::DeadAt,
];

#[async_trait::async_trait]
impl MigrationTrait for AddInboxLeases {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        up(manager, &InboxTable::default()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        down(manager, &InboxTable::default()).await
    }
}

#[async_trait::async_trait]
impl MigrationTrait for ForTable<AddInboxLeases> {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        up(manager, self.table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        down(manager, self.table()).await
    }
}

async fn up(manager: &SchemaManager<'_>, table: &InboxTable) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    if backend == DatabaseBackend::Sqlite {
        // SQLite takes one alteration per ALTER TABLE.
        for mut column in new_columns(backend) {
            manager
                .alter_table(
                    Table::alter()
                        .table(table.table_ref())
                        .add_column(&mut column)
                        .to_owned(),
                )
                .await?;
        }
    } else {
        // One ALTER, so a large table is rewritten (if at all) once.
        let mut alter = Table::alter();
        alter.table(table.table_ref());
        for mut column in new_columns(backend) {
            alter.add_column(&mut column);
        }
        manager.alter_table(alter.to_owned()).await?;
    }
    manager
        .create_index(
            Index::create()
                .name(table.received_at_index())
                .table(table.table_ref())
                .col(inbox::Column::ReceivedAt)
                .to_owned(),
        )
        .await
}

async fn down(manager: &SchemaManager<'_>, table: &InboxTable) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    manager
        .drop_index(
            Index::drop()
                .name(table.received_at_index())
                .table(table.table_ref())
                .to_owned(),
        )
        .await?;
    if backend == DatabaseBackend::Sqlite {
        for column in NEW_COLUMNS {
            manager
                .alter_table(
                    Table::alter()
                        .table(table.table_ref())
                        .drop_column(column)
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    } else {
        let mut alter = Table::alter();
        alter.table(table.table_ref());
        for column in NEW_COLUMNS {
            alter.drop_column(column);
        }
        manager.alter_table(alter.to_owned()).await
    }
}
