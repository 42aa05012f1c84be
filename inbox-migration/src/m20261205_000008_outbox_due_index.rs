use sea_orm_inbox_entity::{OUTBOX_DUE_INDEX_NAME, OUTBOX_TABLE_NAME};
use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DatabaseBackend;

/// On PostgreSQL, the index the relay's claim walks: `ix_outbox_due` on `outbox (sent_at,
/// id) WHERE sent_at IS NULL AND dead_at IS NULL`, the rows still due in enqueue order;
/// nothing on MySQL/MariaDB (no partial indexes) and SQLite.
///
/// Its name, `m20261205_000008_outbox_due_index`, never changes. It runs after
/// [`OutboxFillfactor`](crate::OutboxFillfactor) and keeps every row. Building it reads
/// the whole table and holds back writes to it (enqueues) until done: for a large outbox,
/// create it beforehand without blocking them, `CREATE INDEX CONCURRENTLY ix_outbox_due ON
/// outbox (sent_at, id) WHERE sent_at IS NULL AND dead_at IS NULL` (outside a
/// transaction), and this migration then finds it and does nothing.
///
/// Why: on `ix_outbox_pending` alone the claim's plan depended on the table's statistics.
/// On a table never analyzed (a new one, or one autovacuum has not reached yet) the
/// planner expected one due row, and chose to read every unsent row and sort them all (a
/// bitmap scan; `FOR UPDATE` keeps the sort from stopping at the batch): each claim cost
/// as much as the whole backlog, a drain the square of it (at 20,000 unsent rows a claim
/// read 20,000 rows and took 40 ms). This index holds only rows that match the claim's
/// `sent_at` and `dead_at` conditions, in the claim's order (`ORDER BY sent_at, id`), so
/// the planner walks it from its start and stops after the batch whatever the statistics
/// say (0.5 ms at 20,000 rows, with no statistics, stale ones and fresh ones alike). A
/// parked row leaves it, so the walk no longer passes over parked rows; the entry of a
/// sent row stays until vacuum, and is skipped without reading the table once a claim has
/// found it dead. The cost is one more index entry per enqueued row; the sent mark writes
/// none (its row version is not due).
///
/// `down` drops the index (rows kept).
pub struct OutboxDueIndex;

impl MigrationName for OutboxDueIndex {
    fn name(&self) -> &str {
        "m20261205_000008_outbox_due_index"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for OutboxDueIndex {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        on_postgres(
            manager,
            &format!(
                r#"CREATE INDEX IF NOT EXISTS "{OUTBOX_DUE_INDEX_NAME}" ON "{OUTBOX_TABLE_NAME}" ("sent_at", "id") WHERE "sent_at" IS NULL AND "dead_at" IS NULL"#
            ),
        )
        .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        on_postgres(
            manager,
            &format!(r#"DROP INDEX IF EXISTS "{OUTBOX_DUE_INDEX_NAME}""#),
        )
        .await
    }
}

/// Runs `sql` on PostgreSQL; the other backends have no use for the index.
async fn on_postgres(manager: &SchemaManager<'_>, sql: &str) -> Result<(), DbErr> {
    if manager.get_database_backend() != DatabaseBackend::Postgres {
        return Ok(());
    }
    manager
        .get_connection()
        .execute_unprepared(sql)
        .await
        .map(|_| ())
}
