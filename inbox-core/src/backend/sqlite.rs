//! SQLite: `?` placeholders, `ON CONFLICT DO NOTHING`, and the classifier that reads
//! extended result codes and the failed constraint's column list.

use super::{AfterFailure, DbErrorKind, Dialect, migration_of_column_named_in};
use crate::InboxMigration;
use sea_orm::DbErr;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;
use sea_orm::{SqliteTransactionMode, TransactionOptions};
use std::time::Duration;

pub(super) struct Sqlite;

impl Dialect for Sqlite {
    /// SQLite rolls back only the failed statement, except where it ends the whole
    /// transaction (a trigger's `RAISE(ROLLBACK)`, SQLITE_FULL, IOERR, NOMEM), which the
    /// error code alone does not tell apart: ask.
    fn after_failure(&self, _err: &DbErr, _savepoint_depth: u32) -> AfterFailure {
        AfterFailure::Ask
    }

    /// A repeated `message_id` leaves the row as it is, raising nothing.
    fn outbox_insert(&self) -> &'static str {
        r#"INSERT INTO "outbox" ("message_id", "destination", "partition_key", "payload", "headers", "created_at", "available_at") VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT ("message_id") DO NOTHING"#
    }

    fn outbox_purge_batch(&self) -> &'static str {
        "DELETE FROM outbox WHERE id IN \
         (SELECT id FROM outbox WHERE sent_at < ? ORDER BY sent_at LIMIT ?)"
    }

    /// IMMEDIATE: the claim takes the write lock at BEGIN, so two relays' claims queue in
    /// the busy handler instead of one failing with "database is locked" when its SELECT
    /// is followed by the UPDATE.
    fn outbox_claim_transaction(&self) -> TransactionOptions {
        TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..TransactionOptions::default()
        }
    }

    /// The claim transaction is IMMEDIATE: it holds SQLite's one write lock from BEGIN,
    /// so no other relay reads between this claim's SELECT and its UPDATE.
    fn outbox_claim_lock(&self) -> &'static str {
        ""
    }

    fn insert_marker(&self) -> &'static str {
        r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (?, ?, ?)"#
    }

    fn insert_process_marker(&self) -> &'static str {
        r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") VALUES (?, ?, ?, ?)"#
    }

    /// `SAVEPOINT` nests inside an open transaction and starts one outside it, so the
    /// ROLLBACK that follows ends a transaction in both cases (SQLite refuses ROLLBACK
    /// outside one, and sqlx then keeps counting the connection as inside it).
    fn before_rollback(&self) -> Option<&'static str> {
        Some("SAVEPOINT inbox_before_rollback")
    }

    /// `BEGIN` inside a transaction fails ("cannot start a transaction within a
    /// transaction") and changes nothing.
    fn ended_transaction_probe(&self) -> Option<&'static str> {
        Some("BEGIN")
    }

    fn refuses_probe(&self, db: &dyn DatabaseError) -> Option<bool> {
        let err = db.try_downcast_ref::<SqliteError>()?;
        Some(err.message() == "cannot start a transaction within a transaction")
    }

    fn over_network(&self) -> bool {
        false
    }

    /// Embedded: no client can vanish while the database holds its transaction.
    fn bound_silence(&self, _silence: Duration) -> Option<String> {
        None
    }

    fn columns_catalog(&self, table: &str) -> String {
        format!("SELECT name, NULL FROM pragma_table_info('{table}') ORDER BY cid")
    }

    /// An expression key has no column name.
    fn index_catalog(&self, table: &str, index: &str) -> String {
        format!(
            "SELECT COALESCE(ii.name, '(expression)'), il.\"unique\", il.partial, 1 \
             FROM pragma_index_list('{table}') AS il \
             JOIN pragma_index_info('{index}') AS ii \
             WHERE il.name = '{index}' ORDER BY ii.seqno"
        )
    }

    fn missing_migration(&self, db: &dyn DatabaseError) -> Option<InboxMigration> {
        let err = db.try_downcast_ref::<SqliteError>()?;
        migration_of_column_named_in(missing_column(err.message())?)
    }

    /// SQLite looks the ids of `id IN (subquery)` up by rowid.
    fn purge_batch(&self, purgeable: &str) -> String {
        format!(
            "DELETE FROM inbox WHERE id IN \
             (SELECT id FROM inbox WHERE {purgeable} ORDER BY received_at LIMIT ?)"
        )
    }
}

/// SQLite's error for a column the table lacks: an INSERT's `table inbox has no column
/// named claim_token`, a query's `no such column: claim_token`.
fn missing_column(message: &str) -> Option<&str> {
    message
        .strip_prefix("table inbox has no column named ")
        .or_else(|| message.strip_prefix("no such column: "))
}

/// Classifies a SQLite error, or returns `None` when `db` comes from another driver.
///
/// SQLite names the columns, not the index: `UNIQUE constraint failed: inbox.message_id,
/// inbox.consumer`. Only that exact list is the inbox index.
pub(super) fn classify(db: &dyn DatabaseError) -> Option<DbErrorKind> {
    const SQLITE_CONSTRAINT_UNIQUE: &str = "2067";
    const SQLITE_CONSTRAINT_PRIMARYKEY: &str = "1555";
    const INBOX_COLUMNS: &str = "UNIQUE constraint failed: inbox.message_id, inbox.consumer";
    let err = db.try_downcast_ref::<SqliteError>()?;
    let Some(code) = err.code() else {
        return Some(DbErrorKind::Other);
    };
    Some(match code.as_ref() {
        SQLITE_CONSTRAINT_UNIQUE if err.message() == INBOX_COLUMNS => DbErrorKind::InboxDuplicate,
        SQLITE_CONSTRAINT_UNIQUE | SQLITE_CONSTRAINT_PRIMARYKEY => {
            DbErrorKind::OtherUniqueViolation
        }
        // BUSY, LOCKED and their extended codes (BUSY_RECOVERY 261, BUSY_SNAPSHOT 517,
        // BUSY_TIMEOUT 773, LOCKED_SHAREDCACHE 262, LOCKED_VTAB 518).
        "5" | "6" | "261" | "517" | "773" | "262" | "518" => DbErrorKind::Transient,
        "1" if err.message() == "no such table: inbox" => DbErrorKind::MissingInboxTable,
        // SQLite's messages are English only: "no such column: x" for reads and updates,
        // "table t has no column named x" for inserts.
        "1" if err.message().starts_with("no such column: ")
            || (err.message().starts_with("table ")
                && err.message().contains(" has no column named ")) =>
        {
            DbErrorKind::MissingColumn
        }
        _ => DbErrorKind::Other,
    })
}
