//! SQLite: `?` placeholders, `ON CONFLICT DO NOTHING`, and the classifier that reads
//! extended result codes and the failed constraint's column list.

use super::{DbErrorKind, Dialect};
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;
use std::time::Duration;

pub(super) struct Sqlite;

impl Dialect for Sqlite {
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

    /// SQLite looks the ids of `id IN (subquery)` up by rowid.
    fn purge_batch(&self, purgeable: &str) -> String {
        format!(
            "DELETE FROM inbox WHERE id IN \
             (SELECT id FROM inbox WHERE {purgeable} ORDER BY received_at LIMIT ?)"
        )
    }
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
        _ => DbErrorKind::Other,
    })
}
