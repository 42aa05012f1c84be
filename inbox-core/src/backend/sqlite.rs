//! SQLite: `?` placeholders, `ON CONFLICT DO NOTHING`, and the classifier that reads
//! extended result codes and the failed constraint's column list.

use super::{DbErrorKind, Dialect};
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;

pub(super) struct Sqlite;

impl Dialect for Sqlite {
    fn insert_marker(&self) -> &'static str {
        r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (?, ?, ?)"#
    }

    fn insert_process_marker(&self) -> &'static str {
        r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") VALUES (?, ?, ?, ?)"#
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
