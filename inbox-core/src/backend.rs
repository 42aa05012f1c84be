//! The one place that knows how each database speaks: the marker SQL per dialect and how
//! each driver reports a duplicate, a transient failure or a missing table.
//!
//! Everything else in the crate asks this module instead of matching on the backend.

use crate::InboxError;
use chrono::{DateTime, Utc};
use inbox_entity::{INDEX_NAME, TABLE_NAME};
use sea_orm::sqlx;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::mysql::MySqlDatabaseError;
use sea_orm::sqlx::postgres::PgDatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;
use sea_orm::{DbBackend, DbErr, RuntimeErr, SqliteTransactionMode, TransactionOptions, Value};

/// Options for a transaction that claims a message: pass them to
/// [`TransactionTrait::begin_with_options`](sea_orm::TransactionTrait::begin_with_options).
///
/// On SQLite the transaction starts IMMEDIATE, taking the write lock at `BEGIN`, so a
/// second claimer waits in the busy handler instead of failing at once with "database is
/// locked" when its read-then-write transaction meets another writer. Other backends
/// ignore the setting.
///
/// ```no_run
/// use inbox_core::prelude::*;
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
/// use inbox_core::{classify, DbErrorKind};
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
    /// deadlock, lock wait timeout, SQLite busy/locked, or a lost connection.
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
/// use inbox_core::is_inbox_duplicate;
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
    match err.number() {
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
