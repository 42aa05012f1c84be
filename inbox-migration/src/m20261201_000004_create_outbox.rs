use crate::m20261130_000001_create_inbox::utc_timestamp;
use sea_orm_inbox_entity::{
    DESTINATION_MAX_CHARS, OUTBOX_KEY_INDEX_NAME, OUTBOX_MESSAGE_ID_INDEX_NAME,
    OUTBOX_PENDING_INDEX_NAME, PARTITION_KEY_MAX_CHARS, outbox,
};
use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::{big_pk_auto, string_len, uuid};
use sea_orm_migration::sea_orm::DatabaseBackend;

/// Creates the `outbox` table of the transactional outbox, with its three indexes.
///
/// Its name, `m20261201_000004_create_outbox`, never changes. It does not depend on the
/// inbox migrations: an application that only publishes adds this one alone.
///
/// | column | type |
/// | --- | --- |
/// | `id` | bigint, auto-increment primary key |
/// | `message_id` | uuid, UNIQUE (`ix_outbox_message_id`) |
/// | `destination` | varchar(200) |
/// | `partition_key` | varchar(200), null (binary collation on MySQL/MariaDB) |
/// | `payload` | bytea / longblob / blob |
/// | `headers` | text (a JSON object) |
/// | `created_at`, `available_at` | UTC timestamp (µs) |
/// | `attempts` | integer, default 0 |
/// | `leased_until` | UTC timestamp (µs), null |
/// | `lease_token` | uuid, null |
/// | `sent_at` | UTC timestamp (µs), null |
/// | `last_error` | text, null |
/// | `dead_at` | UTC timestamp (µs), null |
///
/// plus `ix_outbox_pending` on `(sent_at, id)` (the relay's walk over unsent rows and the
/// purge's over sent ones) and `ix_outbox_key` on `(partition_key, id)` (the relay's check
/// for an earlier unsent row of a key).
///
/// `down` drops the table only while every row in it was sent: an unsent row is a
/// committed business change whose announcement would be lost. It fails with
/// [`DbErr::Migration`] otherwise and leaves everything as it was.
pub struct CreateOutbox;

impl MigrationName for CreateOutbox {
    fn name(&self) -> &str {
        "m20261201_000004_create_outbox"
    }
}

/// A varchar compared byte for byte on every backend (binary collation on MySQL/MariaDB,
/// whose default collations ignore case: two keys differing in case would share an order).
pub(crate) fn exact_varchar(
    backend: DatabaseBackend,
    column: impl IntoIden,
    chars: usize,
) -> ColumnDef {
    let chars = chars as u32;
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

/// The payload: PostgreSQL's `bytea`, SQLite's BLOB, and on MySQL/MariaDB `longblob`
/// (a plain `blob` stops at 64 KiB).
fn payload_column(backend: DatabaseBackend) -> ColumnDef {
    let mut def = ColumnDef::new(outbox::Column::Payload);
    match backend {
        DatabaseBackend::MySql => def.custom(Alias::new("longblob")),
        _ => def.blob(),
    };
    def.not_null();
    def
}

fn nullable_timestamp(backend: DatabaseBackend, column: outbox::Column) -> ColumnDef {
    let mut def = utc_timestamp(backend, column);
    def.null();
    def
}

#[async_trait::async_trait]
impl MigrationTrait for CreateOutbox {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let backend = manager.get_database_backend();
        let mut partition_key = exact_varchar(
            backend,
            outbox::Column::PartitionKey,
            PARTITION_KEY_MAX_CHARS,
        );
        partition_key.null();
        let mut headers = ColumnDef::new(outbox::Column::Headers);
        headers.text().not_null();
        let mut attempts = ColumnDef::new(outbox::Column::Attempts);
        attempts.integer().not_null().default(0);
        let mut lease_token = ColumnDef::new(outbox::Column::LeaseToken);
        lease_token.uuid().null();
        let mut last_error = ColumnDef::new(outbox::Column::LastError);
        last_error.text().null();
        manager
            .create_table(
                Table::create()
                    .table(outbox::Entity)
                    .col(big_pk_auto(outbox::Column::Id))
                    .col(uuid(outbox::Column::MessageId))
                    .col(exact_varchar(
                        backend,
                        outbox::Column::Destination,
                        DESTINATION_MAX_CHARS,
                    ))
                    .col(partition_key)
                    .col(payload_column(backend))
                    .col(headers)
                    .col(utc_timestamp(backend, outbox::Column::CreatedAt).not_null())
                    .col(utc_timestamp(backend, outbox::Column::AvailableAt).not_null())
                    .col(attempts)
                    .col(nullable_timestamp(backend, outbox::Column::LeasedUntil))
                    .col(lease_token)
                    .col(nullable_timestamp(backend, outbox::Column::SentAt))
                    .col(last_error)
                    .col(nullable_timestamp(backend, outbox::Column::DeadAt))
                    .to_owned(),
            )
            .await?;
        for index in [
            Index::create()
                .name(OUTBOX_MESSAGE_ID_INDEX_NAME)
                .table(outbox::Entity)
                .col(outbox::Column::MessageId)
                .unique()
                .to_owned(),
            Index::create()
                .name(OUTBOX_PENDING_INDEX_NAME)
                .table(outbox::Entity)
                .col(outbox::Column::SentAt)
                .col(outbox::Column::Id)
                .to_owned(),
            Index::create()
                .name(OUTBOX_KEY_INDEX_NAME)
                .table(outbox::Entity)
                .col(outbox::Column::PartitionKey)
                .col(outbox::Column::Id)
                .to_owned(),
        ] {
            manager.create_index(index).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        refuse_to_drop_unsent(manager.get_connection()).await?;
        manager
            .drop_table(Table::drop().table(outbox::Entity).to_owned())
            .await
    }
}

/// Fails while `outbox` holds a row not yet sent: each is a committed change whose message
/// would never go out.
pub(crate) async fn refuse_to_drop_unsent<C: ConnectionTrait>(db: &C) -> Result<(), DbErr> {
    let any_unsent = Query::select()
        .expr(Expr::val(1))
        .from(outbox::Entity)
        .and_where(Expr::col(outbox::Column::SentAt).is_null())
        .limit(1)
        .to_owned();
    if db.query_one(&any_unsent).await?.is_some() {
        return Err(DbErr::Migration(format!(
            "{}: refusing to drop the outbox table while it holds unsent messages; their \
             transactions committed, and their messages would never be published. Let the \
             relay send them, or delete them yourself (DELETE FROM outbox WHERE sent_at IS \
             NULL), and roll back again",
            CreateOutbox.name()
        )));
    }
    Ok(())
}
