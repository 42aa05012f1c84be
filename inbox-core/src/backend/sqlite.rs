//! SQLite: `?` placeholders, `ON CONFLICT DO NOTHING`, and the classifier that reads
//! extended result codes and the failed constraint's column list.

use super::dialect::{
    BoundsProbe, ConnectionBounds, Dialect, Marker, OutboxClaimSql, migration_of_column_named_in,
    repeat_list,
};
use super::{AfterFailure, BatchClaimSql, CLAIM_TRANSACTION, DbErrorKind};
use crate::InboxMigration;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;
use sea_orm::{ColumnTrait, DbErr, Value};
use sea_orm_inbox_entity::{InboxTable, inbox};
use std::time::Duration;

pub(super) struct Sqlite;

impl Dialect for Sqlite {
    /// A duplicate raises SQLITE_CONSTRAINT_UNIQUE, which [`classify`] reads; the driver
    /// reports the new rowid.
    fn identifier_quote(&self) -> char {
        '"'
    }

    fn claim_marker(&self, marker: Marker<'_>) -> (&'static str, Vec<Value>) {
        let sql = match marker.process {
            None => {
                r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (?, ?, ?)"#
            }
            Some(_) => {
                r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") VALUES (?, ?, ?, ?)"#
            }
        };
        (sql, marker.binds(self.timestamp_value(marker.received_at)))
    }

    fn marker_insert_returns_id(&self) -> bool {
        false
    }

    /// Embedded: no client can vanish while the database holds its transaction.
    fn claim_marker_with_silence_bound(&self, _marker: &Marker<'_>) -> Option<String> {
        None
    }

    /// Embedded: no client can vanish while the database holds its transaction.
    fn connection_bounds(&self, _lock_wait: Duration, _silence: Duration) -> ConnectionBounds {
        ConnectionBounds::None
    }

    fn connection_bounds_probe(
        &self,
        _lock_wait: Duration,
        _silence: Duration,
    ) -> Option<BoundsProbe> {
        None
    }

    /// Embedded: no client can vanish while the database holds its transaction.
    fn silence_bound(&self, _silence: Duration) -> Option<String> {
        None
    }

    fn marker_held(&self) -> &'static str {
        "SELECT 1 FROM inbox WHERE id = ? AND message_id = ? AND consumer = ?"
    }

    fn process_marker_held(&self) -> &'static str {
        "SELECT 1 FROM inbox WHERE id = ? AND message_id = ? AND consumer = ? AND claim_token = ?"
    }

    /// The error names the table's columns, which only the inbox index covers.
    fn confirm_inbox_duplicate(&self) -> Option<&'static str> {
        None
    }

    /// DO NOTHING skips the rows that meet a committed marker, so RETURNING lists exactly
    /// the rows this INSERT wrote. The consumer, the time and the tag are bound once
    /// (`?1` to `?3`), each id after them.
    fn batch_claim(&self, rows: usize, _consumer: &str) -> BatchClaimSql {
        let values: Vec<String> = (4..rows + 4)
            .map(|id| format!("(?{id}, ?1, ?2, ?3)"))
            .collect();
        BatchClaimSql::Returning(format!(
            "INSERT INTO inbox (message_id, consumer, received_at, claim_token) VALUES {} \
             ON CONFLICT (message_id, consumer) DO NOTHING RETURNING message_id",
            values.join(", ")
        ))
    }

    fn batch_marker_held(&self) -> &'static str {
        "SELECT COUNT(*) FROM inbox WHERE message_id = ? AND consumer = ? AND claim_token = ?"
    }

    fn insert_lease(&self) -> &'static str {
        "INSERT INTO inbox (message_id, consumer, received_at, attempts, lease_until, claim_token) \
         VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (message_id, consumer) DO NOTHING"
    }

    fn take_over_lease(&self) -> &'static str {
        "UPDATE inbox SET attempts = attempts + 1, lease_until = ?, claim_token = ? \
         WHERE message_id = ? AND consumer = ? AND claim_token = ? \
         AND processed_at IS NULL AND dead_at IS NULL"
    }

    fn park_lease(&self) -> &'static str {
        "UPDATE inbox SET dead_at = ? \
         WHERE message_id = ? AND consumer = ? AND claim_token = ? \
         AND processed_at IS NULL AND dead_at IS NULL"
    }

    fn release_lease(&self) -> &'static str {
        "UPDATE inbox SET lease_until = ? \
         WHERE message_id = ? AND consumer = ? AND claim_token = ? \
         AND processed_at IS NULL AND dead_at IS NULL"
    }

    fn complete_lease(&self) -> &'static str {
        "UPDATE inbox SET processed_at = COALESCE(processed_at, ?) \
         WHERE message_id = ? AND consumer = ? AND claim_token = ? AND dead_at IS NULL"
    }

    /// SQLite looks the ids of `id IN (subquery)` up by rowid. The limit is an expression,
    /// not a bare parameter: SQLite parses and plans a statement again at each run after a
    /// bare `LIMIT ?` was bound (the value might change the plan), so every batch paid for
    /// a fresh prepare (as the relay's claim did).
    fn purge_batch(&self) -> &'static str {
        "DELETE FROM inbox WHERE id IN \
         (SELECT id FROM inbox WHERE received_at < ? \
         AND (processed_at < ? OR (processed_at IS NULL AND lease_until IS NULL)) \
         ORDER BY received_at LIMIT ? + 0)"
    }

    fn newest_received_at(&self) -> &'static str {
        "SELECT MAX(received_at) FROM inbox"
    }

    fn oldest_received_at(&self) -> &'static str {
        "SELECT MIN(received_at) FROM inbox"
    }

    fn latest_received_at_or_before(&self) -> &'static str {
        "SELECT MAX(received_at) FROM inbox WHERE received_at <= ?"
    }

    fn timestamp_value(&self, at: DateTime<Utc>) -> Value {
        Value::from(at)
    }

    fn consumer_is(&self, consumer: &str) -> Expr {
        inbox::Column::Consumer.eq(consumer)
    }

    fn columns_catalog(&self, table: &str) -> String {
        format!("SELECT name, NULL FROM pragma_table_info('{table}') ORDER BY cid")
    }

    /// An expression key has no column name.
    fn index_catalog(&self, table: &str, index: &str) -> String {
        format!(
            "SELECT COALESCE(ii.name, '(expression)'), il.\"unique\", il.partial \
             FROM pragma_index_list('{table}') AS il \
             JOIN pragma_index_info('{index}') AS ii \
             WHERE il.name = '{index}' ORDER BY ii.seqno"
        )
    }

    fn is_exact_consumer_collation(&self, _collation: &str) -> bool {
        true
    }

    fn missing_migration(&self, db: &dyn DatabaseError) -> Option<InboxMigration> {
        let err = db.try_downcast_ref::<SqliteError>()?;
        migration_of_column_named_in(missing_column(err.message())?)
    }

    /// SQLite rolls back only the failed statement, except where it ends the whole
    /// transaction (a trigger's `RAISE(ROLLBACK)`, SQLITE_FULL, IOERR, NOMEM), which the
    /// error code alone does not tell apart: ask.
    fn after_failure(&self, _err: &DbErr, _savepoint_depth: u32) -> AfterFailure {
        AfterFailure::Ask
    }

    /// `SAVEPOINT` nests inside an open transaction and starts one outside it, so the
    /// ROLLBACK that follows ends a transaction in both cases (SQLite refuses ROLLBACK
    /// outside one, and sqlx then keeps counting the connection as inside it).
    fn before_rollback(&self) -> Option<&'static str> {
        Some("SAVEPOINT inbox_before_rollback")
    }

    fn silent_end_capability_probe(&self) -> Option<&'static str> {
        None
    }

    fn silently_ended_probe(&self) -> Option<&'static str> {
        None
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

    /// SQLite says "no such savepoint" both inside another transaction and outside any:
    /// the caller asks whether the transaction is open.
    fn savepoint_missing_in_open_transaction(&self, _db: &dyn DatabaseError) -> bool {
        false
    }

    /// sqlx names its savepoints `_sqlx_savepoint_N` (`sqlx_core::transaction`). A
    /// `SAVEPOINT` outside a transaction opens one, so this also reopens the transaction
    /// the levels nest in.
    fn restore_driver_savepoint(&self, level: usize) -> Option<String> {
        Some(format!("SAVEPOINT _sqlx_savepoint_{level}"))
    }

    /// The transaction's end is asked at once after each statement that may end it, and
    /// the levels dropped after it are stranded, never queued.
    fn queued_rollbacks_drain(&self) -> Option<&'static str> {
        None
    }

    fn over_network(&self) -> bool {
        false
    }

    /// A repeated `message_id` leaves the row as it is, raising nothing.
    fn outbox_insert(&self) -> &'static str {
        r#"INSERT INTO "outbox" ("message_id", "destination", "partition_key", "payload", "headers", "created_at", "available_at") VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT ("message_id") DO NOTHING"#
    }

    /// A read, then the lease by primary key, in an IMMEDIATE transaction: it takes
    /// SQLite's write lock at BEGIN, so two relays' claims queue in the busy handler and no
    /// other writer runs between the read and the lease, which therefore takes every row
    /// read. No locking clause: the write lock is the lock. The read returns only what a
    /// publish reads, as the lease leaves it. What one `UPDATE ... RETURNING` cost instead
    /// (SQLite 3.40's `.stats`, 100 due rows of 2,000): 8,731 virtual machine steps, where
    /// this read and lease take 2,316 and 3,114; RETURNING runs a trigger program per row
    /// and stores each returned row in a temporary table before the first is handed out.
    /// The limit is an expression, not a bare parameter: SQLite parses and plans a
    /// statement again at each run after its bare `LIMIT ?` was bound (the value might
    /// change the plan), about 4,000 instructions a row for a batch of 100.
    fn outbox_claim(&self) -> OutboxClaimSql {
        OutboxClaimSql::ReadThenLease {
            read: "SELECT o.id, o.message_id, o.destination, o.partition_key, o.payload, \
                   o.headers, o.created_at, o.attempts + 1 AS attempts, o.first_published_at \
                   FROM outbox o \
                   WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.available_at <= ? \
                   AND (o.leased_until IS NULL OR o.leased_until <= ?) \
                   AND (o.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM outbox e \
                   WHERE e.partition_key = o.partition_key AND e.id < o.id AND e.sent_at IS NULL)) \
                   ORDER BY o.id LIMIT ? + 0",
            lease: |ids| {
                format!(
                    "UPDATE outbox SET attempts = attempts + 1, leased_until = ?, \
                     lease_token = ?, first_published_at = COALESCE(first_published_at, ?) \
                     WHERE id IN ({})",
                    repeat_list("?", ids)
                )
            },
            options: CLAIM_TRANSACTION,
        }
    }

    /// No transaction pooler stands in front of SQLite.
    fn outbox_settle_alone(&self) -> bool {
        true
    }

    fn outbox_mark_sent(&self, ids: usize) -> String {
        format!(
            "UPDATE outbox SET sent_at = ?, leased_until = NULL \
             WHERE lease_token = ? AND sent_at IS NULL AND id IN ({})",
            repeat_list("?", ids)
        )
    }

    fn outbox_mark_failed(&self) -> &'static str {
        "UPDATE outbox SET leased_until = NULL, available_at = ?, last_error = ?, dead_at = ? \
         WHERE id = ? AND lease_token = ? AND sent_at IS NULL"
    }

    fn outbox_release(&self, ids: usize) -> String {
        format!(
            "UPDATE outbox SET leased_until = NULL, attempts = attempts - 1 \
             WHERE lease_token = ? AND sent_at IS NULL AND id IN ({})",
            repeat_list("?", ids)
        )
    }

    fn outbox_requeue(&self) -> &'static str {
        "UPDATE outbox SET dead_at = NULL, attempts = 0, available_at = ?, \
         leased_until = NULL, lease_token = NULL, first_published_at = NULL \
         WHERE message_id = ? AND dead_at IS NOT NULL AND sent_at IS NULL"
    }

    fn outbox_notify(&self, _channel: &str) -> Option<String> {
        None
    }

    /// As the inbox's purge: `id IN (subquery)` by rowid, its limit no bare parameter.
    fn outbox_purge_batch(&self) -> &'static str {
        "DELETE FROM outbox WHERE id IN \
         (SELECT id FROM outbox WHERE sent_at < ? ORDER BY sent_at LIMIT ? + 0)"
    }

    fn outbox_backlog(&self) -> &'static str {
        "SELECT (SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NULL), \
         (SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NOT NULL)"
    }
}

/// SQLite's error for a column the table lacks: an INSERT's `table inbox has no column
/// named claim_token` (whatever the inbox's table), a query's `no such column:
/// claim_token`.
fn missing_column(message: &str) -> Option<&str> {
    message
        .strip_prefix("table ")
        .and_then(|rest| rest.split_once(" has no column named "))
        .map(|(_, column)| column)
        .or_else(|| message.strip_prefix("no such column: "))
}

/// Classifies a SQLite error, or returns `None` when `db` comes from another driver.
///
/// SQLite names the columns, not the index: `UNIQUE constraint failed: inbox.message_id,
/// inbox.consumer` (with the name of `table`). Only that exact list is the inbox index.
pub(super) fn classify(db: &dyn DatabaseError, table: &InboxTable) -> Option<DbErrorKind> {
    const SQLITE_CONSTRAINT_UNIQUE: &str = "2067";
    const SQLITE_CONSTRAINT_PRIMARYKEY: &str = "1555";
    let err = db.try_downcast_ref::<SqliteError>()?;
    let name = table.name();
    let is_inbox_index = || {
        err.message()
            .strip_prefix("UNIQUE constraint failed: ")
            .is_some_and(|columns| columns == format!("{name}.message_id, {name}.consumer"))
    };
    let is_inbox_table = || {
        err.message()
            .strip_prefix("no such table: ")
            .is_some_and(|missing| missing == name)
    };
    let Some(code) = err.code() else {
        return Some(DbErrorKind::Other);
    };
    Some(match code.as_ref() {
        SQLITE_CONSTRAINT_UNIQUE if is_inbox_index() => DbErrorKind::InboxDuplicate,
        SQLITE_CONSTRAINT_UNIQUE | SQLITE_CONSTRAINT_PRIMARYKEY => {
            DbErrorKind::OtherUniqueViolation
        }
        // BUSY, LOCKED and their extended codes (BUSY_RECOVERY 261, BUSY_SNAPSHOT 517,
        // BUSY_TIMEOUT 773, LOCKED_SHAREDCACHE 262, LOCKED_VTAB 518).
        "5" | "6" | "261" | "517" | "773" | "262" | "518" => DbErrorKind::Transient,
        "1" if is_inbox_table() => DbErrorKind::MissingInboxTable,
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
