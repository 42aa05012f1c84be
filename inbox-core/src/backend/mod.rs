//! The one place that knows how each database speaks: the SQL per dialect and how each
//! driver reports a duplicate, a transient failure or a missing table.
//!
//! Each database has its own file, compiled only with its cargo feature, holding every
//! statement the crate runs on it and its error classifier; [`Dialect`] names what each
//! must write. This module picks the file for a connection and binds the values; the rest
//! of the crate asks it instead of matching on the backend.

use crate::{Inbox, InboxError, InboxMigration, MessageId, PurgePacing};
use chrono::{DateTime, Utc};
use dialect::{Dialect, Marker};
use sea_orm::sea_query::Expr;
use sea_orm::sqlx;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::{
    ConnectionTrait, DbBackend, DbErr, EntityTrait, QueryTrait, RuntimeErr, Select, SelectModel,
    SelectorRaw, SqliteTransactionMode, Statement, TransactionOptions, Value,
};
use sea_orm_inbox_entity::{InboxTable, OUTBOX_MESSAGE_ID_INDEX_NAME, OUTBOX_TABLE_NAME, inbox};
use std::time::Duration;
use uuid::Uuid;

mod dialect;
#[cfg(feature = "mysql")]
mod mysql;
pub(crate) mod outbox;
#[cfg(feature = "postgres")]
mod postgres;
mod server;
#[cfg(feature = "sqlite")]
mod sqlite;
mod transaction;

pub(crate) use server::{ConnectionBoundsKnown, SilentEnds};
pub(crate) use transaction::{
    AfterFailure, after_failure, begin_to_completion, drain_queued_rollbacks, lost_a_conflict,
    refused_by_the_database, roll_back, roll_back_stranded, savepoint_missing_in_open_transaction,
    silently_ended, to_completion, transaction_ended,
};

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
/// match txn.claim_message(uuid::Uuid::new_v4(), "billing").await? {
///     Claim::Claimed(claimed) => {
///         // business writes through `txn`
///         claimed.commit(txn).await?;
///     }
///     Claim::Duplicate => txn.rollback().await?, // already done: ack
///     Claim::Refused(_) => txn.rollback().await?, // before the admission floor: dead-letter
/// }
/// # Ok(()) }
/// ```
pub const CLAIM_TRANSACTION: TransactionOptions = TransactionOptions {
    isolation_level: None,
    access_mode: None,
    sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
};

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

/// `sql`, a statement the dialect wrote for the default inbox table, for `table`: the
/// text itself for the default table, else its rewrite, made once per table and text.
fn for_table(dialect: &dyn Dialect, table: &InboxTable, sql: &'static str) -> String {
    if table.is_default() {
        return sql.to_owned();
    }
    let quote = dialect.identifier_quote();
    table
        .rewritten(quote, sql, |sql| dialect::retarget(sql, table, quote))
        .to_string()
}

/// The statement `pick` takes from `backend`'s dialect, for `table`.
fn statement_for(
    backend: DbBackend,
    table: &InboxTable,
    pick: impl FnOnce(&dyn Dialect) -> &'static str,
) -> Result<String, InboxError> {
    let dialect = dialect(backend)?;
    Ok(for_table(dialect, table, pick(dialect)))
}

/// `sql`, a statement made for the default inbox table on `backend`, rewritten for `table`
/// (not cached: for statements built per call, such as a batch claim's or a SeaQuery
/// select's).
pub(crate) fn retarget(
    backend: DbBackend,
    table: &InboxTable,
    sql: String,
) -> Result<String, InboxError> {
    if table.is_default() {
        return Ok(sql);
    }
    Ok(dialect::retarget(
        &sql,
        table,
        dialect(backend)?.identifier_quote(),
    ))
}

/// `select`, a query of the inbox entity (which names the default table), run on `table`
/// instead: its SQL for `backend`, rewritten, read back as the entity's models.
pub(crate) fn entity_select_in(
    backend: DbBackend,
    table: &InboxTable,
    select: Select<inbox::Entity>,
) -> Result<SelectorRaw<SelectModel<inbox::Model>>, InboxError> {
    let mut statement = select.build(backend);
    statement.sql = retarget(backend, table, statement.sql)?;
    Ok(inbox::Entity::find().from_raw_sql(statement))
}

/// How to read `backend`'s catalog for [`verify_schema`](crate::verify_schema) of the
/// inbox in `table`, or why the inbox cannot use the backend.
pub(crate) fn schema_catalog(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<SchemaCatalog, InboxError> {
    let dialect = dialect(backend)?;
    let name = table.to_string();
    Ok(SchemaCatalog {
        columns_sql: dialect.columns_catalog(&name),
        index_sql: dialect.index_catalog(&name, table.unique_index()),
        dialect,
    })
}

/// `backend`'s catalog reads of the outbox table's columns and of its unique index on
/// `message_id`, or why the crate cannot use the backend.
pub(crate) fn outbox_schema_catalog(backend: DbBackend) -> Result<SchemaCatalog, InboxError> {
    let dialect = dialect(backend)?;
    Ok(SchemaCatalog {
        columns_sql: dialect.columns_catalog(OUTBOX_TABLE_NAME),
        index_sql: dialect.index_catalog(OUTBOX_TABLE_NAME, OUTBOX_MESSAGE_ID_INDEX_NAME),
        dialect,
    })
}

/// One backend's catalog reads and rules for the startup check (see
/// [`Dialect::columns_catalog`] and [`Dialect::index_catalog`] for the rows).
pub(crate) struct SchemaCatalog {
    /// The table's columns.
    pub(crate) columns_sql: String,
    /// The key columns of the checked index.
    pub(crate) index_sql: String,
    dialect: &'static dyn Dialect,
}

impl SchemaCatalog {
    /// Whether the `consumer` column's collation compares names byte for byte.
    pub(crate) fn is_exact_consumer_collation(&self, collation: &str) -> bool {
        self.dialect.is_exact_consumer_collation(collation)
    }
}

/// The inbox migration whose absence made a statement on the inbox fail (a column it
/// adds), if that is why it failed.
pub(crate) fn missing_migration(err: &DbErr) -> Option<InboxMigration> {
    let (DbErr::Exec(RuntimeErr::SqlxError(sqlx_err))
    | DbErr::Query(RuntimeErr::SqlxError(sqlx_err))) = err
    else {
        return None;
    };
    let sqlx::Error::Database(db) = sqlx_err.as_ref() else {
        return None;
    };
    let dialects: &[&dyn Dialect] = &[
        #[cfg(feature = "postgres")]
        &postgres::Postgres,
        #[cfg(feature = "mysql")]
        &mysql::MySql,
        #[cfg(feature = "sqlite")]
        &sqlite::Sqlite,
    ];
    dialects
        .iter()
        .find_map(|dialect| dialect.missing_migration(db.as_ref()))
}

/// What `Inbox::process` adds to its marker: the call's token and the transaction's
/// bounds.
#[derive(Clone, Copy)]
pub(crate) struct ProcessMarker {
    /// Written into `claim_token`, the same for every attempt of one call.
    pub(crate) token: Uuid,
    /// Bounds the INSERT's (and its transaction's) lock waits where the dialect can bound
    /// them for one transaction (PostgreSQL); elsewhere the database's own setting applies
    /// (MySQL/MariaDB: `innodb_lock_wait_timeout`; SQLite: the busy timeout).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) lock_wait: Duration,
    /// How long the server keeps the transaction (and the marker's lock) while its client
    /// is silent: set by the INSERT (PostgreSQL), or by session variables sent with it in
    /// one text query (MySQL/MariaDB, see [`MarkerInsert::Unprepared`]).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) silence: Duration,
    /// The connection already carries both bounds (see [`ConnectionBoundsKnown`]): the
    /// marker is the plain INSERT, and sets nothing.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) bounded_connection: bool,
}

/// Whether a client of `backend` reaches its database over a network, so that a partition
/// can leave it waiting: the library bounds its waits there (`false` for a backend the
/// inbox cannot use, whose first statement fails anyway).
pub(crate) fn over_network(backend: DbBackend) -> bool {
    dialect(backend).is_ok_and(|dialect| dialect.over_network())
}

/// The batch budget of [`PurgePacing::default`](crate::PurgePacing::default) on `backend`.
///
/// On SQLite a batch holds the database's one write lock, so the budget is the longest a
/// claimer waits behind it (20 ms). On a server a batch locks only the rows it deletes,
/// which no claimer touches: 100,000 rows deleted in 10,000-row batches of about 300 ms
/// each beside 1,200 claiming INSERTs left MariaDB's `Innodb_row_lock_waits` unchanged
/// (measured). There the budget only sets how many batches a purge pays for: at 20 ms,
/// MariaDB's batches stopped at 1,700-2,400 rows (23-34 batches for 50,000 rows, against
/// the hand-written DELETE's 6, the same handler reads and deletes per row), while
/// PostgreSQL's reached the 10,000-row ceiling within either budget.
pub(crate) fn default_purge_batch_budget(backend: DbBackend) -> Duration {
    if over_network(backend) {
        PurgePacing::DEFAULT_SERVER_BATCH_BUDGET
    } else {
        PurgePacing::DEFAULT_BATCH_BUDGET
    }
}

/// How a pool's connections of `backend` take [`Inbox::process`]'s bounds (a claim's lock
/// wait at most `lock_wait`, a transaction silent for `silence` ended by the server) when
/// they open, for [`bound_connections`](crate::bound_connections).
pub(crate) fn connection_bounds(
    backend: DbBackend,
    lock_wait: Duration,
    silence: Duration,
) -> Result<dialect::ConnectionBounds, InboxError> {
    Ok(dialect(backend)?.connection_bounds(lock_wait, silence))
}

pub(crate) use dialect::ConnectionBounds;

/// The statement that makes the server end the current transaction once its client has
/// been silent for `silence` (`None` on SQLite): the first statement of a short
/// transaction whose own statements cannot carry the bound (the lease transactions).
pub(crate) fn silence_statement(
    backend: DbBackend,
    silence: Duration,
) -> Result<Option<String>, InboxError> {
    Ok(dialect(backend)?.silence_bound(silence))
}

/// The marker INSERT of one claim, as the backend sends it.
pub(crate) enum MarkerInsert {
    /// A prepared statement with its binds.
    Prepared(Statement),
    /// `Inbox::process`'s marker on a backend whose INSERT cannot carry the silence bound:
    /// the bound's session variables and the INSERT in one text query, its values written
    /// in, so that the claim costs one round trip.
    Unprepared(String),
}

/// The marker INSERT for one claim: `claim_message`'s plain marker (with the server-side
/// silence bound of [`Inbox::DEFAULT_PARTITION_TIMEOUT`] where the INSERT can carry it), or
/// with `process`, `Inbox::process`'s marker carrying its token, lock-wait bound and
/// silence bound.
pub(crate) fn claim_marker_statement(
    backend: DbBackend,
    table: &InboxTable,
    message_id: MessageId,
    consumer: &str,
    received_at: DateTime<Utc>,
    process: Option<ProcessMarker>,
) -> Result<MarkerInsert, InboxError> {
    let dialect = dialect(backend)?;
    let marker = Marker {
        message_id,
        consumer,
        received_at,
        claim_silence: Inbox::DEFAULT_PARTITION_TIMEOUT,
        process,
    };
    if let Some(sql) = dialect.claim_marker_with_silence_bound(&marker) {
        return Ok(MarkerInsert::Unprepared(retarget(backend, table, sql)?));
    }
    let (sql, values) = dialect.claim_marker(marker);
    Ok(MarkerInsert::Prepared(Statement::from_sql_and_values(
        backend,
        for_table(dialect, table, sql),
        values,
    )))
}

/// Runs the marker INSERT `insert` through `conn`: the new marker's id, or `None` when
/// the INSERT's conflict clause met a committed marker. Where the INSERT returns the id
/// (`RETURNING "id"`) it runs as a query and no row means the marker exists; elsewhere the
/// driver reports the id (MySQL's `LAST_INSERT_ID`, SQLite's rowid) and a duplicate raises.
pub(crate) async fn run_marker_insert<C: ConnectionTrait>(
    conn: &C,
    insert: MarkerInsert,
) -> Result<Option<i64>, DbErr> {
    let inserted = match insert {
        MarkerInsert::Unprepared(sql) => conn.execute_unprepared(&sql).await?.last_insert_id(),
        MarkerInsert::Prepared(statement) => {
            let returns_id = dialect(conn.get_database_backend())
                .map_err(|err| DbErr::Custom(err.to_string()))?
                .marker_insert_returns_id();
            if returns_id {
                return match conn.query_one_raw(statement).await? {
                    Some(row) => row.try_get_by_index::<i64>(0).map(Some),
                    None => Ok(None),
                };
            }
            conn.execute_raw(statement).await?.last_insert_id()
        }
    };
    i64::try_from(inserted)
        .map(Some)
        .map_err(|_| DbErr::Custom(format!("the marker id {inserted} does not fit a bigint")))
}

/// The proof, before COMMIT, that the transaction still holds the marker it inserted: the
/// row with that id, message and consumer is visible through the transaction. It fails
/// with 25P02 on a PostgreSQL transaction a failed statement aborted, and finds no row on
/// MySQL/MariaDB after InnoDB rolled the transaction back on a deadlock, or on a lock wait
/// timeout with `innodb_rollback_on_timeout = ON` (by default a timeout rolls back only its
/// statement, and the marker stays); a later statement may then see another replica's
/// marker for the same message: the id tells them apart. One primary-key lookup.
///
/// With `token` (the marker of [`Inbox::process`](crate::Inbox::process), which carries its
/// call's token) the row must carry it too: SQLite hands a rolled-back marker's id to the
/// next insert, so after the database ended this transaction another replica's committed
/// marker for the same message can have the same id.
pub(crate) fn marker_held_statement(
    backend: DbBackend,
    table: &InboxTable,
    marker_id: i64,
    message_id: MessageId,
    consumer: &str,
    token: Option<Uuid>,
) -> Result<Statement, InboxError> {
    let dialect = dialect(backend)?;
    let mut values = vec![
        Value::from(marker_id),
        Value::from(message_id.as_uuid()),
        Value::from(consumer),
    ];
    let sql = match token {
        Some(token) => {
            values.push(Value::from(token));
            dialect.process_marker_held()
        }
        None => dialect.marker_held(),
    };
    Ok(Statement::from_sql_and_values(
        backend,
        for_table(dialect, table, sql),
        values,
    ))
}

/// The read that tells a violation of the inbox index from one of a namesake index on
/// another table, for a claim whose marker INSERT failed with what [`classify`] calls
/// [`DbErrorKind::InboxDuplicate`]: it finds the marker of `(message_id, consumer)` that
/// made the INSERT fail, or nothing when the violated index was a namesake. `None` where
/// the error itself is certain (PostgreSQL and SQLite name the table).
pub(crate) fn inbox_duplicate_confirmation(
    backend: DbBackend,
    table: &InboxTable,
    message_id: MessageId,
    consumer: &str,
) -> Result<Option<Statement>, InboxError> {
    let dialect = dialect(backend)?;
    let Some(sql) = dialect.confirm_inbox_duplicate() else {
        return Ok(None);
    };
    Ok(Some(Statement::from_sql_and_values(
        backend,
        for_table(dialect, table, sql),
        [Value::from(message_id.as_uuid()), Value::from(consumer)],
    )))
}

/// The statements of one [`claim_batch`](crate::InboxTransactionExt::claim_batch) call.
pub(crate) enum BatchClaimSql {
    /// One multi-row INSERT whose RETURNING lists the message_id of exactly the rows it
    /// inserted (PostgreSQL, SQLite: `ON CONFLICT DO NOTHING RETURNING`), which carry the
    /// batch's consumer and tag as bound. Binds: consumer, received_at, tag, then each id.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    Returning(String),
    /// A multi-row INSERT that returns message_id, consumer, claim_token of every id's row
    /// (written now or met on a unique key) where the server supports it (MariaDB 10.5+;
    /// the consumer NULL where it is the batch's own), and nothing elsewhere (MySQL 8,
    /// older MariaDB): then `read`, a locking read of the consumer's rows for every id of
    /// the batch, through the inbox index, returning the same columns. Binds of `insert`
    /// per row: message_id, consumer, received_at, tag; of `read`: consumer, then the ids
    /// in batch order.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    InsertThenRead { insert: String, read: String },
}

/// The batch claim for `rows` distinct ids of `consumer`; its binds: see [`BatchClaimSql`].
///
/// Every row carries this call's tag in `claim_token`, so the caller tells its own rows
/// from those a committed transaction wrote before (which the conflict clause leaves as
/// they were).
pub(crate) fn batch_claim_sql(
    backend: DbBackend,
    table: &InboxTable,
    rows: usize,
    consumer: &str,
) -> Result<BatchClaimSql, InboxError> {
    Ok(match dialect(backend)?.batch_claim(rows, consumer) {
        BatchClaimSql::Returning(insert) => {
            BatchClaimSql::Returning(retarget(backend, table, insert)?)
        }
        BatchClaimSql::InsertThenRead { insert, read } => BatchClaimSql::InsertThenRead {
            insert: retarget(backend, table, insert)?,
            read: retarget(backend, table, read)?,
        },
    })
}

/// Reads, through a batch's transaction, one marker it inserted: the proof before COMMIT
/// that the transaction still holds its markers (a rollback takes all of them or none).
/// One probe of the inbox index. Binds: message_id, consumer, tag.
pub(crate) fn batch_marker_held_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.batch_marker_held())
}

/// First phase of a two-phase claim: the lease row for attempt 1, unless a row for the
/// pair exists. Binds: message_id, consumer, received_at, lease_until, claim_token.
pub(crate) fn insert_lease_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.insert_lease())
}

/// Takes over an expired lease: next attempt, new expiry, new fencing token, compared and
/// set on the old token, on a row still not processed and not parked. Binds: lease_until,
/// new token, message_id, consumer, old token.
pub(crate) fn take_over_lease_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.take_over_lease())
}

/// Parks an expired lease that used its last attempt, if the token still holds it. Binds:
/// dead_at, message_id, consumer, token.
pub(crate) fn park_lease_sql(backend: DbBackend, table: &InboxTable) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.park_lease())
}

/// Ends a lease early so the next claim takes over at once, if the token still holds it.
/// Binds: lease_until (now), message_id, consumer, token.
pub(crate) fn release_lease_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.release_lease())
}

/// Second phase: marks the message processed if the token holds the lease, or already
/// completed it. Binds: processed_at, message_id, consumer, token.
///
/// Idempotent for the holder: a completion repeated by the same token (its first reply
/// was lost, and the retry runs it again) finds the row again and keeps the first
/// `processed_at`, so it reports one row like the first. Any other token finds none. The
/// count is exact on every backend: PostgreSQL and SQLite count the rows the WHERE clause
/// found, and sqlx asks MySQL/MariaDB for found rows too (`CLIENT_FOUND_ROWS`).
pub(crate) fn complete_lease_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.complete_lease())
}

/// One purge batch: at most `?` purgeable rows received before `?`, oldest first, in one
/// statement that walks `ix_inbox_received_at` (each dialect picks the form its planner
/// runs as an index walk). Binds: cutoff, cutoff again, batch size.
///
/// Purgeable rows are finished, and last used before the cutoff. A completed two-phase
/// claim was last used at its completion, `processed_at` (possibly hours after its first
/// claim, `received_at`; both must be before the cutoff, whatever the skew between the
/// clocks that wrote them), every other finished marker at `received_at`. An unfinished
/// claim (a lease without `processed_at`, parked or not) is never purgeable. The
/// `received_at` bound keeps the delete a range walk of `ix_inbox_received_at`; the rows it
/// walks past are the unfinished claims and the claims completed after the cutoff.
pub(crate) fn purge_batch_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.purge_batch())
}

/// The newest `received_at` in the inbox (NULL when it is empty), read off
/// `ix_inbox_received_at`.
pub(crate) fn newest_received_at_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.newest_received_at())
}

/// The oldest `received_at` in the inbox (NULL when it is empty).
pub(crate) fn oldest_received_at_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| dialect.oldest_received_at())
}

/// The newest `received_at` at or before `?` (NULL when there is none): one probe of
/// `ix_inbox_received_at` in the purge's receiving-time walk.
pub(crate) fn latest_received_at_or_before_sql(
    backend: DbBackend,
    table: &InboxTable,
) -> Result<String, InboxError> {
    statement_for(backend, table, |dialect| {
        dialect.latest_received_at_or_before()
    })
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

/// The condition "the row's consumer is exactly `consumer`" on `backend`: no two names
/// match each other, even where the column's collation pads trailing spaces.
pub(crate) fn consumer_is(backend: DbBackend, consumer: &str) -> Result<Expr, InboxError> {
    Ok(dialect(backend)?.consumer_is(consumer))
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
    /// A unique violation of the inbox index `ix_inbox_message_id_consumer` on the inbox
    /// table itself, as the error proves: this consumer already claimed this message in a
    /// committed transaction.
    ///
    /// Answered only where the error names the table (PostgreSQL, SQLite, MySQL 8.0.19+'s
    /// `'inbox.ix_...'`). MariaDB names the violated index but not its table, so an index
    /// of the same name on another table (`CREATE TABLE inbox_archive LIKE inbox` copies
    /// it) reads the same: that is [`PossibleInboxDuplicate`](Self::PossibleInboxDuplicate),
    /// never this.
    InboxDuplicate,
    /// A unique violation of an index named like the inbox's whose table the error does not
    /// name (MariaDB's 1062 names the key only): the inbox's duplicate, or a namesake index
    /// on another table (`CREATE TABLE inbox_archive LIKE inbox` copies the name, and a
    /// trigger or the handler writes there). Never called a duplicate unproven: read the
    /// marker of `(message_id, consumer)` back through the same transaction (a locking
    /// read) and acknowledge only if it is there; the library's claims do.
    PossibleInboxDuplicate,
    /// A unique violation of any other index or table. A real bug in the handler's data,
    /// never a duplicate delivery.
    OtherUniqueViolation,
    /// A failure that a fresh transaction may not meet again: serialization failure,
    /// deadlock (on Galera also a certification conflict), lock wait timeout, SQLite
    /// busy/locked, a lost connection, an error during COMMIT (MySQL's 1180), a Galera
    /// node outside the primary component, or a server that takes no writes (PostgreSQL's
    /// 25006 from a standby, met through a proxy while a standby is promoted; MySQL/MariaDB
    /// `--read-only` 1290, read-only mode 1836, a READ ONLY transaction 1792): after a
    /// failover a fresh connection reaches the new primary.
    /// Roll the failed transaction back before the retry: after MariaDB's lock wait timeout
    /// (1205) it is still open, with its locks and its earlier writes.
    Transient,
    /// The inbox table does not exist: the migration has not run.
    MissingInboxTable,
    /// A statement names a column its table does not have (the inbox's when a later
    /// migration has not run, or one of the handler's own): the schema is behind the code,
    /// and no retry fixes that.
    MissingColumn,
    /// Anything else.
    Other,
}

impl DbErrorKind {
    /// Whether no retry of the message can succeed while the database stays as it is: a
    /// unique violation of another index (or of a namesake of the inbox's), a missing
    /// inbox table or column. Dead-letter such a message and fix the data or the schema;
    /// a transient failure or an unknown one is worth a redelivery.
    pub fn is_permanent(self) -> bool {
        match self {
            Self::OtherUniqueViolation
            | Self::InboxDuplicate
            | Self::PossibleInboxDuplicate
            | Self::MissingInboxTable
            | Self::MissingColumn => true,
            Self::Transient | Self::Other => false,
        }
    }
}

/// Classifies a SeaORM error by what it means for a message handler.
///
/// This is the classifier [`crate::InboxTransactionExt::claim_message`] uses; call it when
/// you write markers yourself or decide whether to retry. It answers
/// [`DbErrorKind::InboxDuplicate`] only for a violation the error proves is on the inbox
/// table; on MariaDB, whose error names the index but not its table, a violation of an
/// index named like the inbox's is [`DbErrorKind::PossibleInboxDuplicate`]: read your
/// marker back (in the same transaction, with a locking read) before you acknowledge.
pub fn classify(err: &DbErr) -> DbErrorKind {
    classify_in(err, &InboxTable::default())
}

/// Classifies a SeaORM error by what it means for a handler of the inbox in `table`:
/// [`classify`] for an inbox in an [`InboxTable`] of the application's choice, whose
/// [`DbErrorKind::InboxDuplicate`] and [`DbErrorKind::MissingInboxTable`] name that table
/// and its index.
///
/// ```
/// use sea_orm_inbox::{DbErrorKind, InboxTable, classify_in};
/// use sea_orm::DbErr;
///
/// let table = InboxTable::named("app_inbox")?;
/// assert_eq!(classify_in(&DbErr::Custom("boom".into()), &table), DbErrorKind::Other);
/// # Ok::<(), sea_orm_inbox::InvalidTableName>(())
/// ```
pub fn classify_in(err: &DbErr, table: &InboxTable) -> DbErrorKind {
    match err {
        DbErr::ConnectionAcquire(_) => DbErrorKind::Transient,
        DbErr::Conn(runtime) | DbErr::Exec(runtime) | DbErr::Query(runtime) => match runtime {
            RuntimeErr::SqlxError(sqlx_err) => classify_sqlx(sqlx_err, table),
            RuntimeErr::Internal(_) => DbErrorKind::Other,
        },
        _ => DbErrorKind::Other,
    }
}

/// Whether `err` is, provably, a unique violation of the inbox index
/// `ix_inbox_message_id_consumer` on the inbox table, and nothing else.
///
/// For callers who insert the marker themselves. A violation of any other unique index
/// (an order number, an e-mail address) returns `false`: it is a bug to surface, not a
/// duplicate to acknowledge. So does one the error cannot tie to the inbox table: on
/// MariaDB every violation of an index of that name, since the error names no table and
/// another table may carry a namesake ([`DbErrorKind::PossibleInboxDuplicate`]); there,
/// read the marker back before you acknowledge.
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

/// Whether `err` is, provably, a unique violation of the UNIQUE index of the inbox in
/// `table` ([`InboxTable::unique_index`]) on that table, and nothing else:
/// [`is_inbox_duplicate`] for an inbox in a table of the application's choice (on
/// MariaDB `false` for every violation, as there).
///
/// ```
/// use sea_orm_inbox::{InboxTable, is_inbox_duplicate_in};
/// use sea_orm::DbErr;
///
/// let table = InboxTable::named("app_inbox")?;
/// assert!(!is_inbox_duplicate_in(&DbErr::RecordNotInserted, &table));
/// # Ok::<(), sea_orm_inbox::InvalidTableName>(())
/// ```
pub fn is_inbox_duplicate_in(err: &DbErr, table: &InboxTable) -> bool {
    classify_in(err, table) == DbErrorKind::InboxDuplicate
}

fn classify_sqlx(err: &sqlx::Error, table: &InboxTable) -> DbErrorKind {
    match err {
        sqlx::Error::Database(db) => classify_database(db.as_ref(), table),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => DbErrorKind::Transient,
        _ => DbErrorKind::Other,
    }
}

/// A driver's classifier: `None` when the error is another driver's.
type Classifier = fn(&dyn DatabaseError, &InboxTable) -> Option<DbErrorKind>;

/// Asks each enabled driver's classifier; the one whose error type `db` is answers.
fn classify_database(db: &dyn DatabaseError, table: &InboxTable) -> DbErrorKind {
    let classifiers: &[Classifier] = &[
        #[cfg(feature = "postgres")]
        postgres::classify,
        #[cfg(feature = "mysql")]
        mysql::classify,
        #[cfg(feature = "sqlite")]
        sqlite::classify,
    ];
    classifiers
        .iter()
        .find_map(|classify| classify(db, table))
        .unwrap_or(DbErrorKind::Other)
}
