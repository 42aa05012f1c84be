//! PostgreSQL: `$n` placeholders, `ON CONFLICT ON CONSTRAINT ... DO NOTHING`, and the
//! classifier that reads SQLSTATE codes and the violated constraint's name.

use super::{AfterFailure, DbErrorKind, Dialect, migration_of_column_named_in, names_identifier};
use crate::InboxMigration;
use sea_orm::DbErr;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::postgres::PgDatabaseError;
use sea_orm_inbox_entity::{INDEX_NAME, TABLE_NAME};
use std::time::Duration;

pub(super) struct Postgres;

impl Dialect for Postgres {
    /// PostgreSQL aborts the whole transaction on any error outside a savepoint (every
    /// later statement fails with 25P02, and COMMIT answers ROLLBACK); inside one, only the
    /// savepoint, which the handler may roll back to.
    fn after_failure(&self, _err: &DbErr, savepoint_depth: u32) -> AfterFailure {
        if savepoint_depth == 0 {
            AfterFailure::Ended
        } else {
            AfterFailure::WentOn
        }
    }

    /// `ON CONFLICT (message_id)` infers the unique index `ix_outbox_message_id` (no
    /// constraint needed, unlike `ON CONFLICT ON CONSTRAINT`) and raises nothing.
    fn outbox_insert(&self) -> &'static str {
        r#"INSERT INTO "outbox" ("message_id", "destination", "partition_key", "payload", "headers", "created_at", "available_at") VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT ("message_id") DO NOTHING"#
    }

    fn outbox_purge_batch(&self) -> &'static str {
        "DELETE FROM outbox WHERE id = ANY(ARRAY(\
         SELECT id FROM outbox WHERE sent_at < $1 ORDER BY sent_at LIMIT $2))"
    }

    /// A duplicate conflicts on the inbox's constraint and returns no row instead of
    /// raising 23505, which the server would log as an ERROR for every duplicate delivery
    /// (and which would abort the transaction). It still waits for a transaction holding
    /// the same marker and learns its outcome: committed, no row; rolled back, inserted.
    /// Only that constraint is the arbiter: any other unique violation still raises.
    fn insert_marker(&self) -> &'static str {
        r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES ($1, $2, $3) ON CONFLICT ON CONSTRAINT "ix_inbox_message_id_consumer" DO NOTHING RETURNING "id""#
    }

    /// Sets `idle_in_transaction_session_timeout` and `tcp_user_timeout` for the caller's
    /// transaction as [`insert_process_marker_bounded`](Dialect::insert_process_marker_bounded)
    /// does (`set_config(.., true)`, riding on the INSERT), keeping a shorter non-zero
    /// `idle_in_transaction_session_timeout` the transaction already has (`tcp_user_timeout`
    /// reads back as bare milliseconds, which `::interval` would take for seconds, so it is
    /// set as `process` sets it). The conflict clause and RETURNING are
    /// `insert_marker`'s: a duplicate still returns no row.
    fn insert_marker_bounded(&self) -> Option<&'static str> {
        Some(
            r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") SELECT $1, $2, $3 WHERE set_config('idle_in_transaction_session_timeout', CASE WHEN current_setting('idle_in_transaction_session_timeout') = '0' OR current_setting('idle_in_transaction_session_timeout')::interval > $4::interval THEN $4 ELSE current_setting('idle_in_transaction_session_timeout') END, true) IS NOT NULL AND set_config('tcp_user_timeout', $4, true) IS NOT NULL ON CONFLICT ON CONSTRAINT "ix_inbox_message_id_consumer" DO NOTHING RETURNING "id""#,
        )
    }

    fn insert_process_marker(&self) -> &'static str {
        r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") VALUES ($1, $2, $3, $4) ON CONFLICT ON CONSTRAINT "ix_inbox_message_id_consumer" DO NOTHING RETURNING "id""#
    }

    /// Sets `lock_timeout` with `set_config(.., true)`, i.e. `SET LOCAL`: it ends with the
    /// transaction, so it is safe behind PgBouncer's transaction pooling, and it rides on
    /// the INSERT instead of costing a round trip. The WHERE runs before the row is
    /// inserted, so the INSERT's own wait on another transaction's index entry is bounded
    /// too, and so is its wait for a transaction holding the same marker before the
    /// conflict clause decides. A shorter `lock_timeout` the session already has is kept.
    ///
    /// The same way it sets `idle_in_transaction_session_timeout` (the server ends the
    /// session when the client sends nothing for that long inside the transaction, which
    /// releases the marker of a replica cut off by a partition) and `tcp_user_timeout`
    /// (the kernel drops the connection when data the server sent stays unacknowledged
    /// that long: the server blocked sending a reply into the partition is not idle).
    fn insert_process_marker_bounded(&self) -> Option<&'static str> {
        Some(
            r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") SELECT $1, $2, $3, $4 WHERE set_config('lock_timeout', CASE WHEN current_setting('lock_timeout') = '0' OR current_setting('lock_timeout')::interval > $5::interval THEN $5 ELSE current_setting('lock_timeout') END, true) IS NOT NULL AND set_config('idle_in_transaction_session_timeout', $6, true) IS NOT NULL AND set_config('tcp_user_timeout', $6, true) IS NOT NULL ON CONFLICT ON CONSTRAINT "ix_inbox_message_id_consumer" DO NOTHING RETURNING "id""#,
        )
    }

    /// `SET LOCAL` of the two settings the bounded marker INSERT sets, as a query of its
    /// own (a simple query: no prepared statement, safe behind a transaction pooler).
    fn bound_silence(&self, silence: Duration) -> Option<String> {
        let bound = super::millis_text(silence);
        Some(format!(
            "SELECT set_config('idle_in_transaction_session_timeout', '{bound}', true), \
             set_config('tcp_user_timeout', '{bound}', true)"
        ))
    }

    fn marker_insert_returns_id(&self) -> bool {
        true
    }

    /// The inbox's constraint, by name (`ON CONFLICT ON CONSTRAINT` takes a constraint, not
    /// a bare unique index: [`InboxUniqueConstraint`] attaches the index as one).
    ///
    /// [`InboxUniqueConstraint`]: crate::InboxMigration::InboxUniqueConstraint
    fn on_inbox_conflict_do_nothing(&self) -> &'static str {
        r#" ON CONFLICT ON CONSTRAINT "ix_inbox_message_id_consumer" DO NOTHING"#
    }

    fn numbered_placeholders(&self) -> bool {
        true
    }

    /// Resolved like the claims' unqualified `inbox`: through the `search_path`.
    fn columns_catalog(&self, table: &str) -> String {
        format!(
            "SELECT attname::text, NULL::text FROM pg_attribute \
             WHERE attrelid = to_regclass('{table}') AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        )
    }

    /// An expression key has no column (attnum 0) and reads as `(expression)`.
    fn index_catalog(&self, table: &str, index: &str) -> String {
        format!(
            "SELECT COALESCE(a.attname::text, '(expression)'), i.indisunique::int::int8, \
             (i.indpred IS NOT NULL)::int::int8, \
             EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid \
             AND c.contype = 'u' AND c.conname = '{index}')::int::int8 \
             FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid \
             CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
             LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
             WHERE i.indrelid = to_regclass('{table}') AND ic.relname = '{index}' \
             ORDER BY k.ord"
        )
    }

    fn conflict_needs_constraint(&self) -> bool {
        true
    }

    /// 42703 names the missing column (`column "claim_token" of relation "inbox" does not
    /// exist`); 42704 names the missing constraint of `ON CONFLICT ON CONSTRAINT`. The
    /// quotes follow `lc_messages`, so both are found as whole identifiers.
    fn missing_migration(&self, db: &dyn DatabaseError) -> Option<InboxMigration> {
        let err = db.try_downcast_ref::<PgDatabaseError>()?;
        match err.code() {
            "42703" => migration_of_column_named_in(err.message()),
            "42704" if names_identifier(err.message(), INDEX_NAME) => {
                Some(InboxMigration::InboxUniqueConstraint)
            }
            _ => None,
        }
    }

    /// PostgreSQL plans `id IN (subquery)` as a hash semi-join over a sequential scan of
    /// the whole table (61 ms per 1000-row batch at 200k rows, measured), so the purge uses
    /// `id = ANY(ARRAY(subquery))`: an init plan on the index, then primary-key lookups
    /// (4 ms).
    fn purge_batch(&self, purgeable: &str) -> String {
        format!(
            "DELETE FROM inbox WHERE id = ANY(ARRAY(\
             SELECT id FROM inbox WHERE {purgeable} ORDER BY received_at LIMIT ?))"
        )
    }
}

/// Classifies a PostgreSQL error, or returns `None` when `db` comes from another driver.
pub(super) fn classify(db: &dyn DatabaseError) -> Option<DbErrorKind> {
    let err = db.try_downcast_ref::<PgDatabaseError>()?;
    Some(match err.code() {
        "23505" if err.constraint() == Some(INDEX_NAME) && err.table() == Some(TABLE_NAME) => {
            DbErrorKind::InboxDuplicate
        }
        "23505" => DbErrorKind::OtherUniqueViolation,
        // serialization_failure, deadlock_detected, lock_not_available
        "40001" | "40P01" | "55P03" => DbErrorKind::Transient,
        // admin_shutdown (pg_terminate_backend), crash_shutdown, cannot_connect_now
        "57P01" | "57P02" | "57P03" => DbErrorKind::Transient,
        code if code.starts_with("08") => DbErrorKind::Transient,
        "42P01" if names_inbox_table(err.message()) => DbErrorKind::MissingInboxTable,
        // undefined_column
        "42703" => DbErrorKind::MissingColumn,
        _ => DbErrorKind::Other,
    })
}

/// Whether a 42P01 message names the inbox table. The words and the quotes around the
/// name follow the server's `lc_messages` (`relation "inbox"`, German `Relation »inbox«`,
/// French `la relation « inbox »`), so this looks for `inbox` as a whole identifier,
/// possibly schema-qualified (`public.inbox`), and nothing else.
fn names_inbox_table(message: &str) -> bool {
    names_identifier(message, TABLE_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement that may meet an existing marker arbitrates on the inbox's
    /// constraint, by the name the entity crate gives it, and on nothing else.
    #[test]
    fn every_marker_insert_arbitrates_on_the_inbox_constraint() {
        let clause = format!(r#" ON CONFLICT ON CONSTRAINT "{INDEX_NAME}" DO NOTHING"#);
        for sql in [
            Postgres.insert_marker(),
            Postgres.insert_marker_bounded().unwrap_or_default(),
            Postgres.insert_process_marker(),
            Postgres.insert_process_marker_bounded().unwrap_or_default(),
            Postgres.on_inbox_conflict_do_nothing(),
        ] {
            assert!(sql.contains(&clause), "{sql}");
        }
    }

    /// The 42P01 texts of PostgreSQL 15's message catalogues (`relation "%s" does not
    /// exist` and its translations).
    #[test]
    fn missing_table_messages_name_the_inbox_table_in_every_language() {
        for template in [
            "relation \"{table}\" does not exist",
            "Relation »{table}« existiert nicht",
            "la relation « {table} » n'existe pas",
            "リレーション\"{table}\"は存在しません",
            "отношение \"{table}\" не существует",
            "no existe la relación «{table}»",
            "关系 \"{table}\" 不存在",
            "\"{table}\" 이름의 릴레이션(relation)이 없습니다",
        ] {
            let message = |table: &str| template.replace("{table}", table);
            for ours in ["inbox", "public.inbox"] {
                assert!(names_inbox_table(&message(ours)), "{}", message(ours));
            }
            for other in ["inbox_archive", "my_inbox", "inbox.orders", "orders"] {
                assert!(!names_inbox_table(&message(other)), "{}", message(other));
            }
        }
    }
}
