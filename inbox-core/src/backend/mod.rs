//! The one place that knows how each database speaks: the SQL per dialect and how each
//! driver reports a duplicate, a transient failure or a missing table.
//!
//! Each database has its own module, compiled only with its cargo feature: its statements
//! (a [`Dialect`]) and its classifier. This module holds what the three share and picks the
//! module for a connection; everything else in the crate asks it instead of matching on
//! the backend.

use crate::InboxError;
use chrono::{DateTime, Utc};
use sea_orm::sqlx;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::{DbBackend, DbErr, RuntimeErr, SqliteTransactionMode, TransactionOptions, Value};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

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

/// What differs between the databases in the statements the crate runs. Each backend
/// module implements it; the defaults are the SQL standard's forms.
trait Dialect: Sync {
    /// The marker INSERT, written once per dialect so the hot path builds no SQL and every
    /// call reuses the driver's cached prepared statement. Binds: message_id, consumer,
    /// received_at.
    fn insert_marker(&self) -> &'static str;

    /// Whether placeholders are `$1, $2, ...` rather than `?`.
    fn numbered_placeholders(&self) -> bool {
        false
    }

    /// The clause that leaves a row conflicting on the inbox index untouched and raises
    /// nothing, so the transaction stays usable on PostgreSQL.
    fn on_inbox_conflict_do_nothing(&self) -> &'static str {
        " ON CONFLICT (message_id, consumer) DO NOTHING"
    }

    /// One purge batch deleting at most `?` rows meeting `purgeable`, oldest first.
    fn purge_batch(&self, purgeable: &str) -> String;

    /// `at` as a bind value the database stores without loss.
    fn timestamp_value(&self, at: DateTime<Utc>) -> Value {
        Value::from(at)
    }
}

/// The dialect of `backend`, or why the inbox cannot use it: not a backend it supports, or
/// one whose cargo feature is off.
fn dialect(backend: DbBackend) -> Result<&'static dyn Dialect, InboxError> {
    match backend {
        #[cfg(feature = "postgres")]
        DbBackend::Postgres => Ok(&postgres::Postgres),
        #[cfg(feature = "mysql")]
        DbBackend::MySql => Ok(&mysql::MySql),
        #[cfg(feature = "sqlite")]
        DbBackend::Sqlite => Ok(&sqlite::Sqlite),
        #[cfg(not(feature = "postgres"))]
        DbBackend::Postgres => Err(InboxError::BackendNotEnabled {
            backend: "PostgreSQL",
            feature: "postgres",
        }),
        #[cfg(not(feature = "mysql"))]
        DbBackend::MySql => Err(InboxError::BackendNotEnabled {
            backend: "MySQL/MariaDB",
            feature: "mysql",
        }),
        #[cfg(not(feature = "sqlite"))]
        DbBackend::Sqlite => Err(InboxError::BackendNotEnabled {
            backend: "SQLite",
            feature: "sqlite",
        }),
        other => Err(InboxError::UnsupportedBackend {
            backend: format!("{other:?}"),
        }),
    }
}

/// The marker INSERT of `backend`'s dialect.
pub(crate) fn insert_marker_sql(backend: DbBackend) -> Result<&'static str, InboxError> {
    Ok(dialect(backend)?.insert_marker())
}

/// Writes `template` for `backend`: its `?` placeholders become `$1, $2, ...` where the
/// dialect numbers them. Templates use unquoted identifiers and hold no `?` inside literals.
fn dialect_sql(backend: DbBackend, template: &str) -> Result<String, InboxError> {
    if !dialect(backend)?.numbered_placeholders() {
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

/// `backend`'s clause that makes an INSERT leave a row conflicting on the inbox index
/// untouched (see [`Dialect::on_inbox_conflict_do_nothing`]).
fn on_inbox_conflict_do_nothing(backend: DbBackend) -> Result<&'static str, InboxError> {
    Ok(dialect(backend)?.on_inbox_conflict_do_nothing())
}

/// First phase of a two-phase claim: the lease row for attempt 1, unless a row for the
/// pair exists. Binds: message_id, consumer, received_at, lease_until, claim_token.
pub(crate) fn insert_lease_sql(backend: DbBackend) -> Result<String, InboxError> {
    let insert = dialect_sql(
        backend,
        "INSERT INTO inbox (message_id, consumer, received_at, attempts, lease_until, claim_token) \
         VALUES (?, ?, ?, 1, ?, ?)",
    )?;
    Ok(insert + on_inbox_conflict_do_nothing(backend)?)
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
    Ok(insert + on_inbox_conflict_do_nothing(backend)? + " RETURNING message_id, claim_token")
}

/// Reads, through a batch's transaction, one marker it inserted: the proof before COMMIT
/// that the transaction still holds its markers (a rollback takes all of them or none).
/// One probe of the inbox index. Binds: message_id, consumer, tag.
pub(crate) fn batch_marker_held_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(
        backend,
        "SELECT COUNT(*) FROM inbox WHERE message_id = ? AND consumer = ? AND claim_token = ?",
    )
}

/// Rows the purge may delete: finished, i.e. not an unfinished two-phase claim (a lease
/// without `processed_at`, parked or not).
const PURGEABLE: &str = "received_at < ? AND (processed_at IS NOT NULL OR lease_until IS NULL)";

/// One purge batch: at most `?` purgeable rows received before `?`, oldest first, in one
/// statement that walks `ix_inbox_received_at` (each dialect picks the form its planner
/// runs as an index walk). Binds: cutoff, batch size.
pub(crate) fn purge_batch_sql(backend: DbBackend) -> Result<String, InboxError> {
    dialect_sql(backend, &dialect(backend)?.purge_batch(PURGEABLE))
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
/// NULL past 2038 even for a `datetime(6)` column; there the same instant goes as a naive
/// UTC DATETIME and is stored exactly. Other backends take the UTC value as it is.
///
/// ```
/// use sea_orm::{DbBackend, Value};
/// use sea_orm_inbox::timestamp_value;
///
/// let at = chrono::Utc::now();
/// assert_eq!(timestamp_value(DbBackend::Postgres, at), Value::from(at));
/// ```
pub fn timestamp_value(backend: DbBackend, at: DateTime<Utc>) -> Value {
    match dialect(backend) {
        Ok(dialect) => dialect.timestamp_value(at),
        Err(_) => Value::from(at),
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

/// Asks each enabled driver's classifier; the one whose error type `db` is answers.
fn classify_database(db: &dyn DatabaseError) -> DbErrorKind {
    let classifiers: &[fn(&dyn DatabaseError) -> Option<DbErrorKind>] = &[
        #[cfg(feature = "postgres")]
        postgres::classify,
        #[cfg(feature = "mysql")]
        mysql::classify,
        #[cfg(feature = "sqlite")]
        sqlite::classify,
    ];
    classifiers
        .iter()
        .find_map(|classify| classify(db))
        .unwrap_or(DbErrorKind::Other)
}
