//! The one place that knows how each database speaks: the marker SQL per dialect and how
//! each driver reports a duplicate, a transient failure or a missing table.
//!
//! Everything else in the crate asks this module instead of matching on the backend.

use crate::InboxError;
use chrono::{DateTime, Utc};
use sea_orm::sqlx;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::mysql::MySqlDatabaseError;
use sea_orm::sqlx::postgres::PgDatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;
use sea_orm::{DbBackend, DbErr, RuntimeErr, SqliteTransactionMode, TransactionOptions, Value};
use sea_orm_inbox_entity::{INDEX_NAME, TABLE_NAME};

/// Options for a transaction that claims a message: pass them to
/// [`TransactionTrait::begin_with_options`](sea_orm::TransactionTrait::begin_with_options).
///
/// On SQLite the transaction starts IMMEDIATE, taking the write lock at `BEGIN`, so a
/// second claimer waits in the busy handler instead of failing at once with "database is
/// locked" when its read-then-write transaction meets another writer. Other backends
/// ignore the setting.
///
/// ```no_run
/// use sea_orm_inbox::prelude::*;
/// use sea_orm::{DatabaseConnection, TransactionTrait};
///
/// # async fn run(db: &DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
/// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
/// let _claim = txn.claim_message(uuid::Uuid::new_v4(), "billing").await?;
/// # Ok(()) }
/// ```
pub const CLAIM_TRANSACTION: TransactionOptions = TransactionOptions {
    isolation_level: None,
    access_mode: None,
    sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
};

/// The marker INSERT, written once per dialect so the hot path builds no SQL and every
/// call reuses the driver's cached prepared statement.
pub(crate) fn insert_marker_sql(backend: DbBackend) -> Result<&'static str, InboxError> {
    match backend {
        DbBackend::Postgres => Ok(
            r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES ($1, $2, $3)"#,
        ),
        DbBackend::MySql => {
            Ok("INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`) VALUES (?, ?, ?)")
        }
        DbBackend::Sqlite => {
            Ok(r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (?, ?, ?)"#)
        }
        other => Err(InboxError::UnsupportedBackend {
            backend: format!("{other:?}"),
        }),
    }
}

/// Fails for backends other than PostgreSQL, MySQL/MariaDB and SQLite.
fn supported(backend: DbBackend) -> Result<(), InboxError> {
    match backend {
        DbBackend::Postgres | DbBackend::MySql | DbBackend::Sqlite => Ok(()),
        other => Err(InboxError::UnsupportedBackend {
            backend: format!("{other:?}"),
        }),
    }
}

/// Writes `template` for `backend`: its `?` placeholders become `$1, $2, ...` on
/// PostgreSQL. Templates use unquoted identifiers and hold no `?` inside literals.
fn dialect_sql(backend: DbBackend, template: &str) -> Result<String, InboxError> {
    supported(backend)?;
    if backend != DbBackend::Postgres {
        return Ok(template.to_owned());
    }
    let mut out = String::with_capacity(template.len() + 16);
    let mut n = 0u32;
    for ch in template.chars() {
        if ch == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(ch);
        }
    }
    Ok(out)
}

/// Turns an INSERT into one that leaves a row conflicting on the inbox index untouched and
/// raises nothing, so the transaction stays usable on PostgreSQL.
///
/// MySQL has no DO NOTHING, so it gets a no-op `ON DUPLICATE KEY UPDATE consumer =
/// consumer` (never count its affected rows: sqlx reports found rows). Not `id = id`:
/// assigning the auto-increment key in the update clause made MariaDB 10.11 hand a
/// concurrent multi-row insert auto-increment values that collide with another
/// transaction's rows, and ON DUPLICATE KEY then silently merged new messages into those
/// rows (measured: 6 of 15 runs of the two-replica batch race lost ids; 0 of 20 with
/// this clause). `INSERT IGNORE` is not used either: it would also swallow every other
/// error (a NOT NULL or a foreign key violation) as a warning.
fn on_inbox_conflict_do_nothing(backend: DbBackend) -> &'static str {
    match backend {
        DbBackend::MySql => " ON DUPLICATE KEY UPDATE consumer = consumer",
        _ => " ON CONFLICT (message_id, consumer) DO NOTHING",
    }
}

/// First phase of a two-phase claim: the lease row for attempt 1, unless a row for the
/// pair exists. Binds: message_id, consumer, received_at, lease_until, claim_token.
pub(crate) fn insert_lease_sql(backend: DbBackend) -> Result<String, InboxError> {
    let insert = dialect_sql(
        backend,
        "INSERT INTO inbox (message_id, consumer, received_at, attempts, lease_until, claim_token) \
         VALUES (?, ?, ?, 1, ?, ?)",
    )?;
    Ok(insert + on_inbox_conflict_do_nothing(backend))
}

/// The conditions a row must meet for its lease holder to act on it: still this token,
/// not processed, not parked. Binds after the SET values: message_id, consumer, token.
const CURRENT_LEASE: &str = "WHERE message_id = ? AND consumer = ? AND claim_token = ? \
     AND processed_at IS NULL AND dead_at IS NULL";

/// Takes over an expired lease: next attempt, new expiry, new fencing token, compared and
/// set on the old token. Binds: lease_until, new token, message_id, consumer, old token.
pub(crate) fn take_over_lease_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(
        backend,
        &format!(
            "UPDATE inbox SET attempts = attempts + 1, lease_until = ?, claim_token = ? {CURRENT_LEASE}"
        ),
    )
}

/// Parks an expired lease that used its last attempt. Binds: dead_at, message_id,
/// consumer, token.
pub(crate) fn park_lease_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(
        backend,
        &format!("UPDATE inbox SET dead_at = ? {CURRENT_LEASE}"),
    )
}

/// Ends a lease early so the next claim takes over at once. Binds: lease_until (now),
/// message_id, consumer, token.
pub(crate) fn release_lease_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(
        backend,
        &format!("UPDATE inbox SET lease_until = ? {CURRENT_LEASE}"),
    )
}

/// Second phase: marks the message processed if the token still holds the lease. Binds:
/// processed_at, message_id, consumer, token.
pub(crate) fn complete_lease_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(
        backend,
        &format!("UPDATE inbox SET processed_at = ? {CURRENT_LEASE}"),
    )
}

/// One multi-row INSERT claiming `rows` message ids for one consumer, returning the rows
/// it inserted with their tag. Binds per row: message_id, consumer, received_at, tag.
///
/// PostgreSQL and SQLite return only inserted rows (`ON CONFLICT DO NOTHING RETURNING`).
/// MariaDB (10.5+) returns the conflicting rows too, unchanged, so the caller keeps only
/// rows carrying its own tag, and fails if a returned row is not one of the batch's ids
/// (a conflict on another key, which ON DUPLICATE KEY would otherwise hide). MySQL 8 has no `INSERT ... RETURNING`: there this statement
/// is a syntax error, surfaced as [`InboxError::Database`].
pub(crate) fn insert_batch_sql(backend: DbBackend, rows: usize) -> Result<String, InboxError> {
    let mut template = String::with_capacity(96 + rows * 16);
    template.push_str("INSERT INTO inbox (message_id, consumer, received_at, claim_token) VALUES ");
    for row in 0..rows {
        if row > 0 {
            template.push_str(", ");
        }
        template.push_str("(?, ?, ?, ?)");
    }
    let insert = dialect_sql(backend, &template)?;
    Ok(insert + on_inbox_conflict_do_nothing(backend) + " RETURNING message_id, claim_token")
}

/// Counts, through the batch's transaction, the markers it inserted for `rows` ids: the
/// proof before COMMIT that the transaction still holds them. Walks the inbox index.
/// Binds: consumer, tag, then the ids.
pub(crate) fn held_batch_markers_sql(
    backend: DbBackend,
    rows: usize,
) -> Result<String, InboxError> {
    let mut template = String::with_capacity(96 + rows * 3);
    template.push_str(
        "SELECT COUNT(*) FROM inbox WHERE consumer = ? AND claim_token = ? AND message_id IN (",
    );
    for row in 0..rows {
        template.push_str(if row == 0 { "?" } else { ", ?" });
    }
    template.push(')');
    dialect_sql(backend, &template)
}

/// Rows the purge may delete: finished, i.e. not an unfinished two-phase claim (a lease
/// without `processed_at`, parked or not).
const PURGEABLE: &str = "received_at < ? AND (processed_at IS NOT NULL OR lease_until IS NULL)";

/// One purge batch: at most `?` purgeable rows received before `?`, oldest first, in one
/// statement that walks `ix_inbox_received_at`. Binds: cutoff, batch size.
///
/// MySQL/MariaDB cannot use LIMIT in an `IN (subquery)`, but its single-table DELETE takes
/// ORDER BY and LIMIT itself (a range scan of the index). PostgreSQL plans
/// `id IN (subquery)` as a hash semi-join over a sequential scan of the whole table (61 ms
/// per 1000-row batch at 200k rows, measured), so it gets `id = ANY(ARRAY(subquery))`: an
/// init plan on the index, then primary-key lookups (4 ms). SQLite already looks the ids
/// up by rowid.
pub(crate) fn purge_batch_sql(backend: DbBackend) -> Result<String, InboxError> {
    let template = match backend {
        DbBackend::Postgres => format!(
            "DELETE FROM inbox WHERE id = ANY(ARRAY(\
             SELECT id FROM inbox WHERE {PURGEABLE} ORDER BY received_at LIMIT ?))"
        ),
        DbBackend::MySql => {
            format!("DELETE FROM inbox WHERE {PURGEABLE} ORDER BY received_at LIMIT ?")
        }
        _ => format!(
            "DELETE FROM inbox WHERE id IN \
             (SELECT id FROM inbox WHERE {PURGEABLE} ORDER BY received_at LIMIT ?)"
        ),
    };
    dialect_sql(backend, &template)
}

/// The newest `received_at` in the inbox (NULL when it is empty), read off
/// `ix_inbox_received_at`.
pub(crate) fn newest_received_at_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(backend, "SELECT MAX(received_at) FROM inbox")
}

/// The oldest `received_at` in the inbox (NULL when it is empty).
pub(crate) fn oldest_received_at_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(backend, "SELECT MIN(received_at) FROM inbox")
}

/// The newest `received_at` at or before `?` (NULL when there is none): one probe of
/// `ix_inbox_received_at` in the purge's receiving-time walk.
pub(crate) fn latest_received_at_or_before_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(
        backend,
        "SELECT MAX(received_at) FROM inbox WHERE received_at <= ?",
    )
}

/// A UTC timestamp as a bind value the backend stores without loss.
///
/// sqlx sends `DateTime<Utc>` to MySQL/MariaDB typed as TIMESTAMP, which MariaDB turns into
/// NULL past 2038 even for a `datetime(6)` column; the same instant as a naive UTC DATETIME
/// is stored exactly. Other backends take the UTC value as it is.
pub fn timestamp_value(backend: DbBackend, at: DateTime<Utc>) -> Value {
    match backend {
        DbBackend::MySql => Value::from(at.naive_utc()),
        _ => Value::from(at),
    }
}

/// What a database error means for a message handler.
///
/// ```
/// use sea_orm_inbox::{classify, DbErrorKind};
/// use sea_orm::DbErr;
///
/// assert_eq!(classify(&DbErr::Custom("boom".into())), DbErrorKind::Other);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DbErrorKind {
    /// A unique violation of the inbox index `ix_inbox_message_id_consumer`: this consumer
    /// already claimed this message in a committed transaction.
    InboxDuplicate,
    /// A unique violation of any other index or table. A real bug in the handler's data,
    /// never a duplicate delivery.
    OtherUniqueViolation,
    /// A failure that a fresh transaction may not meet again: serialization failure,
    /// deadlock (on Galera also a certification conflict), lock wait timeout, SQLite
    /// busy/locked, a lost connection, or a Galera node outside the primary component.
    Transient,
    /// The inbox table does not exist: the migration has not run.
    MissingInboxTable,
    /// Anything else.
    Other,
}

/// Classifies a SeaORM error by what it means for a message handler.
///
/// This is the classifier [`crate::InboxTransactionExt::claim_message`] uses; call it when
/// you write markers yourself or decide whether to retry.
pub fn classify(err: &DbErr) -> DbErrorKind {
    match err {
        DbErr::ConnectionAcquire(_) => DbErrorKind::Transient,
        DbErr::Conn(runtime) | DbErr::Exec(runtime) | DbErr::Query(runtime) => match runtime {
            RuntimeErr::SqlxError(sqlx_err) => classify_sqlx(sqlx_err),
            RuntimeErr::Internal(_) => DbErrorKind::Other,
        },
        _ => DbErrorKind::Other,
    }
}

/// Whether `err` is a unique violation of the inbox index `ix_inbox_message_id_consumer`
/// and nothing else.
///
/// For callers who insert the marker themselves. A violation of any other unique index
/// (an order number, an e-mail address) returns `false`: it is a bug to surface, not a
/// duplicate to acknowledge.
///
/// ```
/// use sea_orm_inbox::is_inbox_duplicate;
/// use sea_orm::DbErr;
///
/// assert!(!is_inbox_duplicate(&DbErr::RecordNotInserted));
/// ```
pub fn is_inbox_duplicate(err: &DbErr) -> bool {
    classify(err) == DbErrorKind::InboxDuplicate
}

fn classify_sqlx(err: &sqlx::Error) -> DbErrorKind {
    match err {
        sqlx::Error::Database(db) => classify_database(db.as_ref()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => DbErrorKind::Transient,
        _ => DbErrorKind::Other,
    }
}

fn classify_database(db: &dyn DatabaseError) -> DbErrorKind {
    if let Some(pg) = db.try_downcast_ref::<PgDatabaseError>() {
        classify_postgres(pg)
    } else if let Some(mysql) = db.try_downcast_ref::<MySqlDatabaseError>() {
        classify_mysql(mysql)
    } else if let Some(sqlite) = db.try_downcast_ref::<SqliteError>() {
        classify_sqlite(sqlite)
    } else {
        DbErrorKind::Other
    }
}

fn classify_postgres(err: &PgDatabaseError) -> DbErrorKind {
    match err.code() {
        "23505" if err.constraint() == Some(INDEX_NAME) && err.table() == Some(TABLE_NAME) => {
            DbErrorKind::InboxDuplicate
        }
        "23505" => DbErrorKind::OtherUniqueViolation,
        // serialization_failure, deadlock_detected, lock_not_available
        "40001" | "40P01" | "55P03" => DbErrorKind::Transient,
        // admin_shutdown (pg_terminate_backend), crash_shutdown, cannot_connect_now
        "57P01" | "57P02" | "57P03" => DbErrorKind::Transient,
        code if code.starts_with("08") => DbErrorKind::Transient,
        "42P01" if names_inbox_table_pg(err.message()) => DbErrorKind::MissingInboxTable,
        _ => DbErrorKind::Other,
    }
}

fn names_inbox_table_pg(message: &str) -> bool {
    message.starts_with("relation \"inbox\"") || message.contains(".inbox\" does not exist")
}

/// MariaDB reports `... for key 'ix_inbox_message_id_consumer'`; MySQL 8.0.19+ writes
/// `... for key 'inbox.ix_inbox_message_id_consumer'`. The duplicate entry text before it
/// holds raw UUID bytes, so only the key name at the end is matched.
fn classify_mysql(err: &MySqlDatabaseError) -> DbErrorKind {
    const ER_DUP_ENTRY: u16 = 1062;
    const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
    const ER_LOCK_DEADLOCK: u16 = 1213;
    const ER_NO_SUCH_TABLE: u16 = 1146;
    const ER_SERVER_SHUTDOWN: u16 = 1053;
    const ER_CONNECTION_KILLED: u16 = 1927;
    const ER_QUERY_INTERRUPTED: u16 = 1317;
    // Galera: "WSREP has not yet prepared node for application use", SQLSTATE 08S01. The
    // node is outside the primary component (it lost quorum, is joining, or rejects
    // queries); it serves again once it rejoins. 1047 without 08S01 is "unknown command".
    const ER_UNKNOWN_COM_ERROR: u16 = 1047;
    match err.number() {
        ER_UNKNOWN_COM_ERROR if err.code() == Some("08S01") => DbErrorKind::Transient,
        ER_DUP_ENTRY if names_inbox_key_mysql(err.message()) => DbErrorKind::InboxDuplicate,
        ER_DUP_ENTRY => DbErrorKind::OtherUniqueViolation,
        ER_LOCK_WAIT_TIMEOUT | ER_LOCK_DEADLOCK => DbErrorKind::Transient,
        ER_SERVER_SHUTDOWN | ER_CONNECTION_KILLED | ER_QUERY_INTERRUPTED => DbErrorKind::Transient,
        ER_NO_SUCH_TABLE if names_inbox_table_mysql(err.message()) => {
            DbErrorKind::MissingInboxTable
        }
        _ => DbErrorKind::Other,
    }
}

fn names_inbox_key_mysql(message: &str) -> bool {
    let Some(key) = message
        .rsplit_once(" for key '")
        .and_then(|(_, rest)| rest.strip_suffix('\''))
    else {
        return false;
    };
    key == INDEX_NAME || key.strip_prefix("inbox.") == Some(INDEX_NAME)
}

fn names_inbox_table_mysql(message: &str) -> bool {
    message.starts_with("Table '") && message.ends_with(".inbox' doesn't exist")
}

/// SQLite names the columns, not the index: `UNIQUE constraint failed: inbox.message_id,
/// inbox.consumer`. Only that exact list is the inbox index.
fn classify_sqlite(err: &SqliteError) -> DbErrorKind {
    const SQLITE_CONSTRAINT_UNIQUE: &str = "2067";
    const SQLITE_CONSTRAINT_PRIMARYKEY: &str = "1555";
    const INBOX_COLUMNS: &str = "UNIQUE constraint failed: inbox.message_id, inbox.consumer";
    let Some(code) = err.code() else {
        return DbErrorKind::Other;
    };
    match code.as_ref() {
        SQLITE_CONSTRAINT_UNIQUE if err.message() == INBOX_COLUMNS => DbErrorKind::InboxDuplicate,
        SQLITE_CONSTRAINT_UNIQUE | SQLITE_CONSTRAINT_PRIMARYKEY => {
            DbErrorKind::OtherUniqueViolation
        }
        // BUSY, LOCKED and their extended codes (BUSY_RECOVERY 261, BUSY_SNAPSHOT 517,
        // BUSY_TIMEOUT 773, LOCKED_SHAREDCACHE 262, LOCKED_VTAB 518).
        "5" | "6" | "261" | "517" | "773" | "262" | "518" => DbErrorKind::Transient,
        "1" if err.message() == "no such table: inbox" => DbErrorKind::MissingInboxTable,
        _ => DbErrorKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mysql_key_matches_mariadb_and_mysql8_forms_only() {
        assert!(names_inbox_key_mysql(
            "Duplicate entry '\u{1}\u{2}-billing' for key 'ix_inbox_message_id_consumer'"
        ));
        assert!(names_inbox_key_mysql(
            "Duplicate entry 'x-billing' for key 'inbox.ix_inbox_message_id_consumer'"
        ));
        assert!(!names_inbox_key_mysql(
            "Duplicate entry 'x-billing' for key 'orders.ix_inbox_message_id_consumer'"
        ));
        assert!(!names_inbox_key_mysql(
            "Duplicate entry 'x' for key 'ix_inbox_message_id_consumer_2'"
        ));
        assert!(!names_inbox_key_mysql(
            "Duplicate entry ' for key 'ix_inbox_message_id_consumer'' for key 'uq_order_no'"
        ));
        assert!(!names_inbox_key_mysql(
            "Duplicate entry 'x' for key 'PRIMARY'"
        ));
    }

    #[test]
    fn missing_table_messages_name_the_inbox_table() {
        assert!(names_inbox_table_pg("relation \"inbox\" does not exist"));
        assert!(!names_inbox_table_pg(
            "relation \"inbox_archive\" does not exist"
        ));
        assert!(names_inbox_table_mysql("Table 'test.inbox' doesn't exist"));
        assert!(!names_inbox_table_mysql(
            "Table 'test.orders' doesn't exist"
        ));
    }
}
