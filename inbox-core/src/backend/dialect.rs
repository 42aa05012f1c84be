//! The trait each backend file implements, and the few writing aids they share.
//!
//! Every statement the crate runs is a method here, and every backend writes each one out
//! in its own dialect, with no defaults: a reader diffs `postgres.rs` against `mysql.rs`
//! and sees all that differs. Statements take their binds in the order each method's
//! documentation gives, the same on every backend.
//!
//! Every inbox statement is written for the default table (`inbox`, its indexes
//! `ix_inbox_message_id_consumer` and `ix_inbox_received_at`); [`retarget`] rewrites it
//! for an [`InboxTable`] of the application's choice.

use super::{AfterFailure, BatchClaimSql, ProcessMarker};
use crate::{InboxMigration, MessageId};
use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::{DbErr, TransactionOptions, Value};
use sea_orm_inbox_entity::{INDEX_NAME, InboxTable, RECEIVED_AT_INDEX_NAME, TABLE_NAME};
use std::time::Duration;

/// How one database speaks: the statements the crate runs on it, and the rules for reading
/// its errors and its catalog.
pub(super) trait Dialect: Sync {
    // The claims.

    /// The character that quotes an identifier.
    fn identifier_quote(&self) -> char;

    /// The marker INSERT of one claim and its binds. A committed marker of the same
    /// message and consumer either makes it return no row (where
    /// [`marker_insert_returns_id`](Self::marker_insert_returns_id)) or raises a
    /// violation of the inbox index.
    fn claim_marker(&self, marker: Marker<'_>) -> (&'static str, Vec<Value>);

    /// Whether the marker INSERT ends in `RETURNING "id"`, and returns no row when the
    /// marker exists (its conflict clause on the inbox index skipped it); otherwise the
    /// driver reports the new row's auto-increment id and a duplicate raises.
    fn marker_insert_returns_id(&self) -> bool;

    /// The marker INSERT of [`Inbox::process`](crate::Inbox::process) (`marker.process` is
    /// set) as one unprepared statement that first makes the server end the transaction
    /// once its client has been silent for the marker's `silence`, where the INSERT cannot
    /// carry that bound itself: the session variables and the INSERT in one round trip,
    /// its values written in as literals that need no escaping. `None` where the INSERT
    /// carries the bound (see [`claim_marker`](Self::claim_marker)) or there is no server.
    fn claim_marker_with_silence_bound(&self, marker: &Marker<'_>) -> Option<String>;

    /// How a pool's connections carry `Inbox::process`'s bounds for their whole life: a
    /// claim's lock wait at most `lock_wait`, and the server ending a transaction whose
    /// client has been silent for `silence` (the settings the marker INSERT of
    /// [`claim_marker`](Self::claim_marker) or
    /// [`claim_marker_with_silence_bound`](Self::claim_marker_with_silence_bound) sets per
    /// transaction otherwise).
    fn connection_bounds(&self, lock_wait: Duration, silence: Duration) -> ConnectionBounds;

    /// A read, run on a connection of a pool, telling whether the pool's connections
    /// carry the bounds of [`connection_bounds`](Self::connection_bounds) as a marker
    /// INSERT would set them (a lock wait of at most `lock_wait` where the INSERT bounds
    /// it, the silence bound exactly). No binds. `None` where there is nothing to bound
    /// (an embedded database).
    fn connection_bounds_probe(
        &self,
        lock_wait: Duration,
        silence: Duration,
    ) -> Option<BoundsProbe>;

    /// A statement that makes the server end the current transaction, releasing its
    /// locks, once its client has been silent for `silence` (waiting for the next
    /// statement, or not reading a reply the server is sending). `None`: nothing to bound
    /// (an embedded database has no client to lose).
    fn silence_bound(&self, silence: Duration) -> Option<String>;

    /// The proof that a transaction still holds the marker of `claim_message`. Binds:
    /// id, message_id, consumer.
    fn marker_held(&self) -> &'static str;

    /// The proof that a transaction still holds the marker of `Inbox::process`, which
    /// carries its call's token. Binds: id, message_id, consumer, claim_token.
    fn process_marker_held(&self) -> &'static str;

    /// A read of the marker of `(message_id, consumer)` (binds: message_id, consumer) that
    /// confirms a violation the classifier put on the inbox index, where the database's
    /// error names the index but not its table; `None` where it names the table too.
    fn confirm_inbox_duplicate(&self) -> Option<&'static str>;

    /// The statements of a batch claim of `rows` distinct ids of `consumer`.
    fn batch_claim(&self, rows: usize, consumer: &str) -> BatchClaimSql;

    /// A batch's proof that it still holds one of its markers. Binds: message_id,
    /// consumer, tag.
    fn batch_marker_held(&self) -> &'static str;

    // The leases.

    /// The lease row for attempt 1, unless a row for the pair exists (then nothing, and no
    /// error). Binds: message_id, consumer, received_at, lease_until, claim_token.
    fn insert_lease(&self) -> &'static str;

    /// Takes over an expired lease. Binds: lease_until, new token, message_id, consumer,
    /// old token.
    fn take_over_lease(&self) -> &'static str;

    /// Parks a lease. Binds: dead_at, message_id, consumer, token.
    fn park_lease(&self) -> &'static str;

    /// Ends a lease early. Binds: lease_until, message_id, consumer, token.
    fn release_lease(&self) -> &'static str;

    /// Completes a lease. Binds: processed_at, message_id, consumer, token.
    fn complete_lease(&self) -> &'static str;

    // The purge.

    /// One purge batch, oldest first, walking `ix_inbox_received_at`. Binds: cutoff,
    /// cutoff again, batch size.
    fn purge_batch(&self) -> &'static str;

    /// The newest `received_at` in the inbox.
    fn newest_received_at(&self) -> &'static str;

    /// The oldest `received_at` in the inbox.
    fn oldest_received_at(&self) -> &'static str;

    /// The newest `received_at` at or before the bind.
    fn latest_received_at_or_before(&self) -> &'static str;

    // Values and conditions.

    /// `at` as a bind value the database stores without loss.
    fn timestamp_value(&self, at: DateTime<Utc>) -> Value;

    /// The condition "the row's consumer is exactly `consumer`".
    fn consumer_is(&self, consumer: &str) -> Expr;

    // The schema check.

    /// A catalog read of `table`'s columns, in order: name (text), collation (text, NULL
    /// where it does not matter). No rows when the table does not exist. `table` is one of
    /// the crate's own table names or a checked [`InboxTable`] (`schema.table` with a
    /// schema), never unchecked input.
    fn columns_catalog(&self, table: &str) -> String;

    /// A catalog read of the key columns of `table`'s index named `index`, in key order:
    /// column name (text), unique, partial (a WHERE clause or a column prefix) (each a
    /// bigint, 0 or 1). No rows when there is no such index. Both names are the crate's
    /// own, never input.
    fn index_catalog(&self, table: &str, index: &str) -> String;

    /// Whether a `consumer` column of `collation` compares names byte for byte.
    fn is_exact_consumer_collation(&self, collation: &str) -> bool;

    // Errors and the transaction's state.

    /// The inbox migration a failed statement on the inbox shows missing: a column it
    /// adds. `None` for any other error of this driver, or one of another driver.
    fn missing_migration(&self, db: &dyn DatabaseError) -> Option<InboxMigration>;

    /// What a failed statement (`err`, a database's error) did to its transaction, seen
    /// `savepoint_depth` savepoints deep.
    fn after_failure(&self, err: &DbErr, savepoint_depth: u32) -> AfterFailure;

    /// A statement that leaves the connection inside a transaction whether or not the
    /// database already ended the one the driver counts, sent before ROLLBACK so that the
    /// ROLLBACK always has a transaction to end. `None` where ROLLBACK outside a
    /// transaction succeeds anyway.
    fn before_rollback(&self) -> Option<&'static str>;

    /// A read answering 1 when the server can end a transaction without failing any
    /// statement (a Galera node), so that a transaction whose statements all succeeded
    /// must still prove its marker before COMMIT, and 0 when it cannot. `None` where no
    /// server of the backend can.
    fn silent_end_capability_probe(&self) -> Option<&'static str>;

    /// A read answering 1 when the server has already ended the session's transaction
    /// while the statements after the end ran on their own (autocommit), 0 otherwise.
    /// `None` where no server ends a transaction without an error on the statement.
    fn silently_ended_probe(&self) -> Option<&'static str>;

    /// A statement that fails while a transaction is open and succeeds (opening one) only
    /// when the database already ended it. `None` where COMMIT outside a transaction
    /// succeeds, so no COMMIT needs to know.
    fn ended_transaction_probe(&self) -> Option<&'static str>;

    /// Whether `db` is this database's refusal of the
    /// [`ended_transaction_probe`](Self::ended_transaction_probe) inside an open
    /// transaction, or `None` when `db` comes from another driver.
    fn refuses_probe(&self, db: &dyn DatabaseError) -> Option<bool>;

    /// Whether `db`, the failure of `RELEASE SAVEPOINT`, says for certain that the
    /// transaction is open and simply has no such savepoint (it is not the one that made
    /// it). `false` where the error cannot tell that from a transaction the database
    /// ended: the caller then asks otherwise.
    fn savepoint_missing_in_open_transaction(&self, db: &dyn DatabaseError) -> bool;

    /// The statement that recreates the driver's savepoint of nesting `level` (1 for the
    /// first savepoint inside the transaction) after the database ended the transaction
    /// under nested SeaORM transactions, so that the driver's own `ROLLBACK TO SAVEPOINT`
    /// of each level succeeds and its count of open levels goes back to zero. `None` where
    /// no such end leaves the driver counting levels the database no longer has.
    fn restore_driver_savepoint(&self, level: usize) -> Option<String>;

    /// A statement that succeeds inside an open transaction and outside one, sent until it
    /// does to take the replies of the savepoint rollbacks the driver queued (a dropped
    /// SeaORM savepoint queues its `ROLLBACK TO SAVEPOINT` unsent) after the handler may
    /// have ended the transaction under them: each of those fails, and the pool must not
    /// receive a connection still owing their replies (see
    /// [`drain_queued_rollbacks`](super::drain_queued_rollbacks)). `None` where no such
    /// rollback is left queued: the level is stranded instead, or the driver takes the
    /// failure itself.
    fn queued_rollbacks_drain(&self) -> Option<&'static str>;

    /// Whether a client reaches the database over a network, which a partition can
    /// silence (an embedded database cannot go silent: its waits end in its busy timeout).
    fn over_network(&self) -> bool;

    // The outbox.

    /// The outbox INSERT, which leaves a row whose `message_id` exists untouched and
    /// raises nothing (the transaction stays usable). Binds: message_id, destination,
    /// partition_key, payload, headers, created_at, available_at.
    fn outbox_insert(&self) -> &'static str;

    /// The relay's claim of the due rows, oldest first (see [`OutboxClaimSql`]).
    fn outbox_claim(&self) -> OutboxClaimSql;

    /// Whether the relay sends a settle that is one statement (the common batch: every row
    /// confirmed) on its own, in autocommit, rather than in a transaction of its own.
    fn outbox_settle_alone(&self) -> bool;

    /// Marks `ids` rows sent, fenced by the claim's token. Binds: sent_at, token, then the
    /// ids.
    fn outbox_mark_sent(&self, ids: usize) -> String;

    /// Records a failed publish, fenced by the claim's token. Binds: available_at,
    /// last_error, dead_at, id, token.
    fn outbox_mark_failed(&self) -> &'static str;

    /// Gives `ids` unpublished rows of a claim back. Binds: token, then the ids.
    fn outbox_release(&self, ids: usize) -> String;

    /// Puts a dead row back in line, its `first_published_at` cleared (its next claim
    /// stamps a new one). Binds: available_at, message_id.
    fn outbox_requeue(&self) -> &'static str;

    /// One purge batch of the outbox: at most `?` rows sent before `?`, oldest first, in
    /// one statement walking `ix_outbox_pending`. Binds: cutoff, batch size.
    fn outbox_purge_batch(&self) -> &'static str;

    /// The statement that tells relays listening on `channel` in other processes that rows
    /// were committed, run on its own outside any transaction in the simple protocol
    /// (`execute_unprepared`); `None` where the database has no such channel. No binds:
    /// behind a transaction pooler a statement with bound values fails outside a
    /// transaction.
    fn outbox_notify(&self, channel: &str) -> Option<String>;

    /// The count of rows waiting to be published and the count of dead rows.
    fn outbox_backlog(&self) -> &'static str;
}

/// How [`Dialect::connection_bounds_probe`] answers.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BoundsProbe {
    /// A text query (no prepared statement: one round trip, and nothing a transaction
    /// pooler could split over two server connections) whose count of rows, read from
    /// its reply's command tag, is `carried` when the bounds are carried.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    RowCount { sql: String, carried: u64 },
    /// A read answering 1 in its first column when the bounds are carried, 0 otherwise.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    Flag(String),
}

/// How a pool's connections take the bounds of [`Dialect::connection_bounds`] when they
/// open.
pub(crate) enum ConnectionBounds {
    /// Settings sent in the connection's startup message (PostgreSQL's `options`, `-c
    /// name=value`): no statement at all.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    StartupOptions(Vec<(&'static str, String)>),
    /// A statement each new connection runs before the pool hands it out.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    AfterConnect(String),
    /// Nothing to bound.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    None,
}

/// How a backend claims a batch of due outbox rows for the relay.
pub(super) enum OutboxClaimSql {
    /// One UPDATE that leases the due rows and returns them as leased (`attempts` already
    /// counting this attempt, `first_published_at` stamped with the claim's time where it
    /// was NULL), in a transaction of its own begun with these options; it also bounds how
    /// long the server keeps that transaction once its client is silent. Binds:
    /// leased_until, token, now (the stamp), now, now again, limit, and the partition
    /// timeout as text in milliseconds.
    // Each variant is one backend's; a build without that backend never makes it.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    InTransaction(&'static str, TransactionOptions),
    /// For a database without `UPDATE ... RETURNING`, three statements, each on its own in
    /// autocommit (no transaction, so nothing stays locked when the relay is cut off): a
    /// plain read of the ids of the due rows (`candidates`; binds: now, now again, limit
    /// times two), then `lease(n)` over `n` of those ids, an UPDATE by primary key that
    /// checks again that each is due and leases at most `limit` of them in `id` order
    /// (binds: leased_until, token, now (the stamp), the ids, now, now again, limit), then
    /// `leased(n)`, a plain read of those ids' rows that the lease's token now holds, in
    /// `id` order, at most as many as the lease took (binds: the ids, token, that count).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    ReadLeaseReadBack {
        candidates: &'static str,
        lease: fn(usize) -> String,
        leased: fn(usize) -> String,
    },
    /// For a database with one writer at a time (SQLite), two statements in a
    /// transaction begun with `options`, which takes the write lock at its start: a read
    /// of the due rows as the lease leaves them (`read`: `attempts` counting this attempt,
    /// `first_published_at` as stored, NULL for the claim to stamp; binds: now, now again,
    /// limit), then `lease(n)`, an UPDATE of those `n` rows by primary key (binds:
    /// leased_until, token, now (the stamp), the ids). No other writer runs between them,
    /// so the lease takes every row read.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    ReadThenLease {
        read: &'static str,
        lease: fn(usize) -> String,
        options: TransactionOptions,
    },
}

/// The marker row of one claim, for [`Dialect::claim_marker`].
#[derive(Clone, Copy)]
pub(super) struct Marker<'a> {
    pub(super) message_id: MessageId,
    pub(super) consumer: &'a str,
    pub(super) received_at: DateTime<Utc>,
    /// The server-side silence bound of `claim_message`'s marker, where the INSERT can
    /// carry it (a `process` marker carries its own).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) claim_silence: Duration,
    /// What `Inbox::process` adds to its marker.
    pub(super) process: Option<ProcessMarker>,
}

impl Marker<'_> {
    /// The binds every dialect's marker INSERT starts with: message_id, consumer,
    /// `received_at` (as the dialect stores it), then the token of a `process` marker.
    pub(super) fn binds(&self, received_at: Value) -> Vec<Value> {
        let mut values = Vec::with_capacity(6);
        values.extend([
            Value::from(self.message_id.as_uuid()),
            Value::from(self.consumer),
            received_at,
        ]);
        if let Some(process) = &self.process {
            values.push(Value::from(process.token));
        }
        values
    }
}

/// `sql`, written for the default inbox table, for `table`: every identifier naming the
/// default table or one of its two indexes, bare or quoted, becomes `table`'s (quoted with
/// `quote`, schema-qualified for a table with a schema); string literals and every other
/// identifier stay as they are. `table`'s names were checked to need no escaping.
pub(super) fn retarget(sql: &str, table: &InboxTable, quote: char) -> String {
    let qualified = match table.schema() {
        Some(schema) => format!("{quote}{schema}{quote}.{quote}{}{quote}", table.name()),
        None => format!("{quote}{}{quote}", table.name()),
    };
    let replacement = |identifier: &str| match identifier {
        TABLE_NAME => Some(qualified.clone()),
        INDEX_NAME => Some(format!("{quote}{}{quote}", table.unique_index())),
        RECEIVED_AT_INDEX_NAME => Some(format!("{quote}{}{quote}", table.received_at_index())),
        _ => None,
    };
    let is_identifier_char = |ch: char| ch.is_ascii_alphanumeric() || ch == '_' || ch == '$';
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    while let Some(ch) = rest.chars().next() {
        let token_len = if ch == '\'' || ch == '"' || ch == '`' {
            // A literal or a quoted identifier runs to its closing quote (a doubled quote
            // inside it reads as two tokens, which leaves it unchanged all the same).
            rest[1..].find(ch).map_or(rest.len(), |end| end + 2)
        } else if ch.is_ascii_alphabetic() || ch == '_' {
            rest.find(|c: char| !is_identifier_char(c))
                .unwrap_or(rest.len())
        } else {
            ch.len_utf8()
        };
        let (token, after) = rest.split_at(token_len);
        let identifier = match ch {
            '"' | '`' => token.get(1..token.len().saturating_sub(1)),
            '\'' => None,
            _ => Some(token),
        };
        match identifier.and_then(replacement) {
            Some(name) => out.push_str(&name),
            None => out.push_str(token),
        }
        rest = after;
    }
    out
}

/// `count` copies of `item` separated by commas: `?, ?, ?` or `(?, ?), (?, ?)`. Written
/// into one string sized up front: a batch claim writes two such lists per call, and
/// joining a vector of copies cost a batch of 100 ids on MariaDB ~3,000 instructions more
/// (callgrind).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) fn repeat_list(item: &str, count: usize) -> String {
    let mut list = String::with_capacity(count * (item.len() + 2));
    for at in 0..count {
        if at > 0 {
            list.push_str(", ");
        }
        list.push_str(item);
    }
    list
}

/// Whether `message` names `name` as a whole identifier: not inside a longer one, however
/// the server's `lc_messages` quotes it.
pub(super) fn names_identifier(message: &str, name: &str) -> bool {
    let is_identifier_char = |ch: char| ch.is_alphanumeric() || ch == '_' || ch == '$';
    message.match_indices(name).any(|(at, found)| {
        let before = message[..at].chars().next_back();
        let after = message[at + found.len()..].chars().next();
        !before.is_some_and(is_identifier_char)
            && !after.is_some_and(|ch| is_identifier_char(ch) || ch == '.')
    })
}

/// The inbox migration that adds the column `message` names, if it names one.
pub(super) fn migration_of_column_named_in(message: &str) -> Option<InboxMigration> {
    crate::schema::MIGRATION_COLUMNS
        .iter()
        .find(|(_, columns)| {
            columns
                .iter()
                .any(|column| names_identifier(message, column))
        })
        .map(|(migration, _)| *migration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(feature = "mysql", feature = "sqlite"))]
    #[test]
    fn repeat_list_separates_its_copies_with_commas() {
        assert_eq!(repeat_list("?", 0), "");
        assert_eq!(repeat_list("?", 1), "?");
        assert_eq!(repeat_list("(?, ?)", 3), "(?, ?), (?, ?), (?, ?)");
    }

    /// The table and its indexes are renamed wherever they stand, bare or quoted; literals,
    /// longer identifiers and other names stay.
    #[test]
    fn retarget_renames_the_table_and_its_indexes_only() {
        let table = InboxTable::named("app_inbox")
            .and_then(|table| table.in_schema("messaging"))
            .expect("valid names");
        let sql = r#"INSERT INTO "inbox" (id) SELECT 1 FROM inbox i WHERE inbox.id = $1 AND 'inbox' <> inbox_x ON CONFLICT ON CONSTRAINT "ix_inbox_message_id_consumer" DO NOTHING FORCE INDEX (ix_inbox_received_at)"#;
        assert_eq!(
            retarget(sql, &table, '"'),
            r#"INSERT INTO "messaging"."app_inbox" (id) SELECT 1 FROM "messaging"."app_inbox" i WHERE "messaging"."app_inbox".id = $1 AND 'inbox' <> inbox_x ON CONFLICT ON CONSTRAINT "ix_app_inbox_message_id_consumer" DO NOTHING FORCE INDEX ("ix_app_inbox_received_at")"#
        );
        let mysql = InboxTable::named("app_inbox").expect("a valid name");
        assert_eq!(
            retarget("SELECT 1 FROM `inbox` WHERE x = ?", &mysql, '`'),
            "SELECT 1 FROM `app_inbox` WHERE x = ?"
        );
    }

    /// The missing-column texts of each server (PostgreSQL's 42703 in two languages,
    /// MySQL's 1054 column, SQLite's two forms after their prefix) lead to the migration
    /// that adds the column; other columns to none.
    #[test]
    fn a_missing_column_names_its_migration() {
        for message in [
            "column \"claim_token\" of relation \"inbox\" does not exist",
            "Spalte »lease_until« von Relation »inbox« existiert nicht",
            "attempts",
            "inbox.dead_at",
        ] {
            assert_eq!(
                migration_of_column_named_in(message),
                Some(InboxMigration::AddInboxLeases),
                "{message}"
            );
        }
        for message in [
            "column \"claim_tokens\" of relation \"orders\" does not exist",
            "order_attempts",
            "",
        ] {
            assert_eq!(migration_of_column_named_in(message), None, "{message}");
        }
    }
}
