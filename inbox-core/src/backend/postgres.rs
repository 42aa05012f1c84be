//! PostgreSQL: `$n` placeholders, `ON CONFLICT (message_id, consumer) DO NOTHING`, and the
//! classifier that reads SQLSTATE codes and the violated constraint's name.

use super::dialect::{
    BoundsProbe, ConnectionBounds, Dialect, Marker, OutboxClaimSql, migration_of_column_named_in,
    names_identifier,
};
use super::{AfterFailure, BatchClaimSql, DbErrorKind};
use crate::InboxMigration;
use crate::claim::MAX_CLAIM_BATCH;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::postgres::PgDatabaseError;
use sea_orm::{ColumnTrait, DbErr, TransactionOptions, Value};
use sea_orm_inbox_entity::{InboxTable, inbox};
use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::LazyLock;
use std::time::Duration;

pub(super) struct Postgres;

impl Dialect for Postgres {
    /// A duplicate conflicts on the inbox's unique key and returns no row instead of
    /// raising 23505, which the server would log as an ERROR for every duplicate delivery
    /// (and which would abort the transaction). It still waits for a transaction holding
    /// the same marker and learns its outcome: committed, no row; rolled back, inserted.
    /// The arbiter is inferred from the columns, `(message_id, consumer)`: the unique index
    /// [`CreateInbox`](crate::InboxMigration::CreateInbox) makes, and the constraint
    /// [`InboxUniqueConstraint`](crate::InboxMigration::InboxUniqueConstraint) makes of it
    /// alike, so a claim runs on the first migration's table as on the other backends.
    /// Naming the constraint (`ON CONFLICT ON CONSTRAINT`) took a constraint only, and a
    /// table without the third migration failed every claim. Only a unique key on exactly
    /// those two columns is an arbiter: any other unique violation still raises, and is
    /// told apart by its constraint's name.
    ///
    /// The INSERT also bounds its transaction with `set_config(.., true)`, i.e. `SET
    /// LOCAL`: the settings end with the transaction, so this is safe behind PgBouncer's
    /// transaction pooling, and they ride on the INSERT instead of costing a round trip.
    /// The WHERE runs before the row is inserted, so the settings hold for the INSERT's own
    /// waits too.
    ///
    /// `claim_message`'s marker sets `idle_in_transaction_session_timeout` (the server ends
    /// the session when the client sends nothing for that long inside the transaction,
    /// which releases the marker of a replica cut off by a partition), keeping a shorter
    /// non-zero one the transaction already has, and `tcp_user_timeout` (the kernel drops
    /// the connection when data the server sent stays unacknowledged that long: the server
    /// blocked sending a reply into the partition is not idle; it reads back as bare
    /// milliseconds, which `::interval` would take for seconds, so it is set as `process`
    /// sets it). Binds after the marker's: the silence bound as text (`"20000ms"`).
    ///
    /// `Inbox::process`'s marker sets `lock_timeout` the same way (a shorter one the
    /// session already has is kept), which bounds the INSERT's wait on another
    /// transaction's index entry and its wait for a transaction holding the same marker
    /// before the conflict clause decides, and both silence settings. Binds after the
    /// marker's: the lock-wait bound and the silence bound as text.
    ///
    /// On a connection that carries both bounds for its whole life (see
    /// [`connection_bounds`](Dialect::connection_bounds)) `Inbox::process`'s marker is the
    /// plain INSERT with its conflict clause: no `set_config`, no bind past the token.
    fn identifier_quote(&self) -> char {
        '"'
    }

    fn claim_marker(&self, marker: Marker<'_>) -> (&'static str, Vec<Value>) {
        let mut values = marker.binds(self.timestamp_value(marker.received_at));
        let sql = match &marker.process {
            None => {
                values.push(Value::from(millis_text(marker.claim_silence)));
                r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") SELECT $1, $2, $3 WHERE set_config('idle_in_transaction_session_timeout', CASE WHEN current_setting('idle_in_transaction_session_timeout') = '0' OR current_setting('idle_in_transaction_session_timeout')::interval > $4::interval THEN $4 ELSE current_setting('idle_in_transaction_session_timeout') END, true) IS NOT NULL AND set_config('tcp_user_timeout', $4, true) IS NOT NULL ON CONFLICT ("message_id", "consumer") DO NOTHING RETURNING "id""#
            }
            Some(process) if process.bounded_connection => {
                r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") VALUES ($1, $2, $3, $4) ON CONFLICT ("message_id", "consumer") DO NOTHING RETURNING "id""#
            }
            Some(process) => {
                values.push(Value::from(millis_text(process.lock_wait)));
                values.push(Value::from(millis_text(process.silence)));
                r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at", "claim_token") SELECT $1, $2, $3, $4 WHERE set_config('lock_timeout', CASE WHEN current_setting('lock_timeout') = '0' OR current_setting('lock_timeout')::interval > $5::interval THEN $5 ELSE current_setting('lock_timeout') END, true) IS NOT NULL AND set_config('idle_in_transaction_session_timeout', $6, true) IS NOT NULL AND set_config('tcp_user_timeout', $6, true) IS NOT NULL ON CONFLICT ("message_id", "consumer") DO NOTHING RETURNING "id""#
            }
        };
        (sql, values)
    }

    fn marker_insert_returns_id(&self) -> bool {
        true
    }

    /// Startup options (`-c name=value`), which the server applies before the connection's
    /// first statement: no round trip, and no statement a transaction pooler could send to
    /// another server connection. `lock_timeout` as `process`'s marker sets it, and the
    /// silence bound's two settings; a handler's `SET LOCAL` still overrides them for its
    /// transaction.
    fn connection_bounds(&self, lock_wait: Duration, silence: Duration) -> ConnectionBounds {
        ConnectionBounds::StartupOptions(vec![
            ("lock_timeout", millis_text(lock_wait)),
            ("idle_in_transaction_session_timeout", millis_text(silence)),
            ("tcp_user_timeout", millis_text(silence)),
        ])
    }

    /// The session's values (`pg_settings`, in milliseconds): a `lock_timeout` of at most
    /// the bound (a shorter one is kept, as the marker keeps it), and both silence
    /// settings at exactly the bound, three rows when all hold. `tcp_user_timeout` reads 0
    /// on a Unix-domain socket, where no network can go silent. A simple query: a prepared
    /// one costs a second round trip on each new connection and, behind a transaction
    /// pooler, fails (its `Bind` reaches a server connection without the statement) with
    /// an ERROR in the server's log at every read.
    fn connection_bounds_probe(
        &self,
        lock_wait: Duration,
        silence: Duration,
    ) -> Option<BoundsProbe> {
        let (lock_wait, silence) = (lock_wait.as_millis(), silence.as_millis());
        let sql = format!(
            "SELECT 1 FROM pg_settings \
             WHERE (name = 'lock_timeout' AND setting::int8 BETWEEN 1 AND {lock_wait}) \
             OR (name = 'idle_in_transaction_session_timeout' AND setting::int8 = {silence}) \
             OR (name = 'tcp_user_timeout' \
             AND (setting::int8 = {silence} OR inet_server_addr() IS NULL))"
        );
        Some(BoundsProbe::RowCount { sql, carried: 3 })
    }

    /// The marker INSERT sets the bound itself.
    fn claim_marker_with_silence_bound(&self, _marker: &Marker<'_>) -> Option<String> {
        None
    }

    /// `SET LOCAL` of the two settings the marker INSERT sets, as a query of its own (a
    /// simple query: no prepared statement, safe behind a transaction pooler).
    fn silence_bound(&self, silence: Duration) -> Option<String> {
        let bound = millis_text(silence);
        Some(format!(
            "SELECT set_config('idle_in_transaction_session_timeout', '{bound}', true), \
             set_config('tcp_user_timeout', '{bound}', true)"
        ))
    }

    fn marker_held(&self) -> &'static str {
        "SELECT 1 FROM inbox WHERE id = $1 AND message_id = $2 AND consumer = $3"
    }

    fn process_marker_held(&self) -> &'static str {
        "SELECT 1 FROM inbox WHERE id = $1 AND message_id = $2 AND consumer = $3 AND claim_token = $4"
    }

    /// 23505 names the table as well as the constraint.
    fn confirm_inbox_duplicate(&self) -> Option<&'static str> {
        None
    }

    /// DO NOTHING skips the rows that meet a committed marker, so RETURNING lists exactly
    /// the rows this INSERT wrote. The consumer, the time and the tag are bound once
    /// (`$1` to `$3`), each id after them: a quarter of the binds a row each takes, whose
    /// conversions were most of the claim's client work.
    fn batch_claim(&self, rows: usize, _consumer: &str) -> BatchClaimSql {
        let values = batch_values(rows);
        let mut sql = String::with_capacity(200 + values.len());
        sql.push_str("INSERT INTO inbox (message_id, consumer, received_at, claim_token) VALUES ");
        sql.push_str(&values);
        sql.push_str(r#" ON CONFLICT ("message_id", "consumer") DO NOTHING RETURNING message_id"#);
        BatchClaimSql::Returning(sql)
    }

    fn batch_marker_held(&self) -> &'static str {
        "SELECT COUNT(*) FROM inbox WHERE message_id = $1 AND consumer = $2 AND claim_token = $3"
    }

    fn insert_lease(&self) -> &'static str {
        r#"INSERT INTO inbox (message_id, consumer, received_at, attempts, lease_until, claim_token) VALUES ($1, $2, $3, 1, $4, $5) ON CONFLICT ("message_id", "consumer") DO NOTHING"#
    }

    fn take_over_lease(&self) -> &'static str {
        "UPDATE inbox SET attempts = attempts + 1, lease_until = $1, claim_token = $2 \
         WHERE message_id = $3 AND consumer = $4 AND claim_token = $5 \
         AND processed_at IS NULL AND dead_at IS NULL"
    }

    fn park_lease(&self) -> &'static str {
        "UPDATE inbox SET dead_at = $1 \
         WHERE message_id = $2 AND consumer = $3 AND claim_token = $4 \
         AND processed_at IS NULL AND dead_at IS NULL"
    }

    fn release_lease(&self) -> &'static str {
        "UPDATE inbox SET lease_until = $1 \
         WHERE message_id = $2 AND consumer = $3 AND claim_token = $4 \
         AND processed_at IS NULL AND dead_at IS NULL"
    }

    fn complete_lease(&self) -> &'static str {
        "UPDATE inbox SET processed_at = COALESCE(processed_at, $1) \
         WHERE message_id = $2 AND consumer = $3 AND claim_token = $4 AND dead_at IS NULL"
    }

    /// PostgreSQL plans `id IN (subquery)` as a hash semi-join over a sequential scan of
    /// the whole table (61 ms per 1000-row batch at 200k rows, measured), so the purge
    /// collects its rows in an init plan on `ix_inbox_received_at` (`= ANY(ARRAY(...))`).
    /// It collects their `ctid`s, not their ids: the DELETE then fetches each row by its
    /// place (a TID scan) instead of descending the primary key once per row, which was
    /// half of each batch's buffer touches (20,144 against 40,203 for 10,000 rows, 29 ms
    /// against 47, measured). A `ctid` means one row of one table only within the
    /// statement that read it, and an inbox that is a partitioned table repeats `ctid`s
    /// across partitions: the DELETE therefore repeats the purge's condition, so every row
    /// it removes is one the purge may remove, and a row a concurrent transaction changed
    /// since the init plan read it (a new lease) is checked again and spared.
    fn purge_batch(&self) -> &'static str {
        "DELETE FROM inbox WHERE ctid = ANY(ARRAY(\
         SELECT ctid FROM inbox WHERE received_at < $1 \
         AND (processed_at < $2 OR (processed_at IS NULL AND lease_until IS NULL)) \
         ORDER BY received_at LIMIT $3)) \
         AND received_at < $1 \
         AND (processed_at < $2 OR (processed_at IS NULL AND lease_until IS NULL))"
    }

    fn newest_received_at(&self) -> &'static str {
        "SELECT MAX(received_at) FROM inbox"
    }

    fn oldest_received_at(&self) -> &'static str {
        "SELECT MIN(received_at) FROM inbox"
    }

    fn latest_received_at_or_before(&self) -> &'static str {
        "SELECT MAX(received_at) FROM inbox WHERE received_at <= $1"
    }

    fn timestamp_value(&self, at: DateTime<Utc>) -> Value {
        Value::from(at)
    }

    fn consumer_is(&self, consumer: &str) -> Expr {
        inbox::Column::Consumer.eq(consumer)
    }

    /// Resolved like the claims' table: through the `search_path` unless `table` names its
    /// schema (`schema.table`).
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
             (i.indpred IS NOT NULL)::int::int8 \
             FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid \
             CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
             LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
             WHERE i.indrelid = to_regclass('{table}') AND ic.relname = '{index}' \
             ORDER BY k.ord"
        )
    }

    fn is_exact_consumer_collation(&self, _collation: &str) -> bool {
        true
    }

    /// 42703 names the missing column (`column "claim_token" of relation "inbox" does not
    /// exist`; the quotes follow `lc_messages`, so it is found as a whole identifier).
    fn missing_migration(&self, db: &dyn DatabaseError) -> Option<InboxMigration> {
        let err = db.try_downcast_ref::<PgDatabaseError>()?;
        match err.code() {
            "42703" => migration_of_column_named_in(err.message()),
            _ => None,
        }
    }

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

    /// ROLLBACK outside a transaction is a warning.
    fn before_rollback(&self) -> Option<&'static str> {
        None
    }

    fn silent_end_capability_probe(&self) -> Option<&'static str> {
        None
    }

    fn silently_ended_probe(&self) -> Option<&'static str> {
        None
    }

    fn ended_transaction_probe(&self) -> Option<&'static str> {
        None
    }

    fn refuses_probe(&self, _db: &dyn DatabaseError) -> Option<bool> {
        None
    }

    /// 3B001 (invalid_savepoint_specification) comes only from an open transaction: one
    /// the database ended answers 25P01 (no transaction) or 25P02 (aborted).
    fn savepoint_missing_in_open_transaction(&self, db: &dyn DatabaseError) -> bool {
        db.code().is_some_and(|code| code == "3B001")
    }

    /// A failed statement aborts the transaction without ending it, and the driver's
    /// `ROLLBACK TO SAVEPOINT` restores it.
    fn restore_driver_savepoint(&self, _level: usize) -> Option<String> {
        None
    }

    /// A raw `ROLLBACK` ends the transaction without a failed statement the wrapper sees,
    /// and the `ROLLBACK TO SAVEPOINT` each savepoint dropped after it queues then fails.
    fn queued_rollbacks_drain(&self) -> Option<&'static str> {
        Some("SELECT 1")
    }

    fn over_network(&self) -> bool {
        true
    }

    /// `ON CONFLICT (message_id)` infers the unique index `ix_outbox_message_id` (no
    /// constraint needed, unlike `ON CONFLICT ON CONSTRAINT`) and raises nothing.
    fn outbox_insert(&self) -> &'static str {
        r#"INSERT INTO "outbox" ("message_id", "destination", "partition_key", "payload", "headers", "created_at", "available_at") VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT ("message_id") DO NOTHING"#
    }

    /// One UPDATE: the inner SELECT locks the due rows (`SKIP LOCKED` passes over those
    /// another relay's open claim holds) and the UPDATE leases exactly those, returning
    /// them. `= ANY(ARRAY(..))` rather than `IN (..)`: an init plan that runs once, then
    /// primary-key lookups (`IN` may become a semi-join over a scan of the table).
    /// `ORDER BY sent_at, id` rather than `ORDER BY id`, the same order among unsent rows,
    /// is the order of `ix_outbox_due` (`OutboxDueIndex`), whose predicate is the claim's
    /// `sent_at IS NULL AND dead_at IS NULL`: the planner walks it from its first row and
    /// stops after the batch whatever the table's statistics say. Without it (a database
    /// not migrated that far), the order of `ix_outbox_pending`, which the planner walks
    /// the same way when the statistics show unsent rows, instead of the primary key from
    /// the oldest sent one (measured with 1,500 of 2,000 rows sent: 0.25 ms against 1.3
    /// ms); but on a table never analyzed it read and sorted every unsent row at each
    /// claim (40 ms against 0.5 ms on `ix_outbox_due` at 20,000 unsent rows).
    ///
    /// In a transaction of its own: behind PgBouncer's transaction pooling a statement
    /// with bound values sent outside one can fail (see `pooler.rs`). The transaction sets
    /// `synchronous_commit = off` for itself (`set_config(.., true)`, i.e. `SET LOCAL`,
    /// riding on the statement): its COMMIT does not wait for the WAL flush, which was
    /// half of the relay's time per batch (a flush costs about 4 ms on this machine).
    /// What that risks is a lease lost when the server crashes within a fraction of a
    /// second of the claim; the row is then unleased and published again after the
    /// restart, with the same message id, as after any crash between publish and mark.
    /// A settle on its own (`relay_once`, a drain's last batch) commits synchronously, and
    /// its flush makes the claim's WAL records durable too. In a drain, the marks of a full
    /// batch commit with the next claim, in this transaction: a server crash within that
    /// fraction of a second can lose them as well, and their rows are then published
    /// again after the restart (same message id), the duplicate the consumers' inbox
    /// absorbs. READ COMMITTED, the server's default isolation.
    ///
    /// The same way, for the transaction only, the partition bound of
    /// [`silence_bound`](Dialect::silence_bound): a relay cut off before its COMMIT reaches
    /// the server would otherwise keep the rows it leased locked until TCP keepalive gives
    /// up (hours), and no other relay could take them.
    fn outbox_claim(&self) -> OutboxClaimSql {
        OutboxClaimSql::InTransaction(
            "UPDATE outbox SET attempts = attempts + 1, leased_until = $1, lease_token = $2, \
             first_published_at = COALESCE(first_published_at, $3) \
             WHERE id = ANY(ARRAY(SELECT o.id FROM outbox o \
             WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.available_at <= $4 \
             AND (o.leased_until IS NULL OR o.leased_until <= $5) \
             AND (o.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM outbox e \
             WHERE e.partition_key = o.partition_key AND e.id < o.id AND e.sent_at IS NULL)) \
             AND set_config('synchronous_commit', 'off', true) IS NOT NULL \
             AND set_config('idle_in_transaction_session_timeout', $7, true) IS NOT NULL \
             AND set_config('tcp_user_timeout', $7, true) IS NOT NULL \
             ORDER BY o.sent_at, o.id LIMIT $6 FOR UPDATE OF o SKIP LOCKED)) \
             RETURNING *",
            TransactionOptions::default(),
        )
    }

    /// In a transaction, for PgBouncer, as the claim.
    fn outbox_settle_alone(&self) -> bool {
        false
    }

    /// `(sent_at IS NULL) IS TRUE`, the same test as `sent_at IS NULL` (never unknown) but
    /// not one an index can take, so the rows are found by primary key whatever the
    /// table's statistics say. As a plain `sent_at IS NULL` it was an index condition on
    /// `ix_outbox_pending`, and on a table without statistics (a new one; autovacuum
    /// off) the plan was a bitmap of every unsent row: at 20,000 rows unsent each mark of
    /// 100 read 20,000 index entries and 667 heap pages, 6-11 ms against 1.5 ms by key.
    /// Below about 12,000 rows and without statistics the planner reads the table instead,
    /// fewer pages than that bitmap visited. An `id = ANY(array)` instead of the list
    /// changes none of this.
    fn outbox_mark_sent(&self, ids: usize) -> String {
        format!(
            "UPDATE outbox SET sent_at = $1, leased_until = NULL \
             WHERE lease_token = $2 AND (sent_at IS NULL) IS TRUE AND id IN ({})",
            numbered(3, ids)
        )
    }

    fn outbox_mark_failed(&self) -> &'static str {
        "UPDATE outbox SET leased_until = NULL, available_at = $1, last_error = $2, dead_at = $3 \
         WHERE id = $4 AND lease_token = $5 AND sent_at IS NULL"
    }

    /// By primary key, as the mark.
    fn outbox_release(&self, ids: usize) -> String {
        format!(
            "UPDATE outbox SET leased_until = NULL, attempts = attempts - 1 \
             WHERE lease_token = $1 AND (sent_at IS NULL) IS TRUE AND id IN ({})",
            numbered(2, ids)
        )
    }

    fn outbox_requeue(&self) -> &'static str {
        "UPDATE outbox SET dead_at = NULL, attempts = 0, available_at = $1, \
         leased_until = NULL, lease_token = NULL, first_published_at = NULL \
         WHERE message_id = $2 AND dead_at IS NOT NULL AND sent_at IS NULL"
    }

    /// The channel written in as a string literal (quotes doubled;
    /// `standard_conforming_strings` has been on by default since PostgreSQL 9.1), not a
    /// bind: behind PgBouncer's transaction pooling a bound `pg_notify($1, '')` sent
    /// outside a transaction fails with 26000, and the wake was lost. Sent on its own,
    /// never in the business transaction: a transaction that notified takes a global lock
    /// at its commit.
    fn outbox_notify(&self, channel: &str) -> Option<String> {
        Some(format!(
            "SELECT pg_notify('{}', '')",
            channel.replace('\'', "''")
        ))
    }

    /// As the inbox's purge: `= ANY(ARRAY(..))` walks the index.
    fn outbox_purge_batch(&self) -> &'static str {
        "DELETE FROM outbox WHERE id = ANY(ARRAY(\
         SELECT id FROM outbox WHERE sent_at < $1 ORDER BY sent_at LIMIT $2))"
    }

    fn outbox_backlog(&self) -> &'static str {
        "SELECT (SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NULL), \
         (SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NOT NULL)"
    }
}

/// `count` placeholders numbered from `$first`, separated by commas: `$3, $4, $5`.
/// The VALUES list of a batch claim of `rows` rows, `($id, $1, $2, $3)` a row: cut
/// from one list of [`MAX_CLAIM_BATCH`] rows written once, since formatting a number per
/// placeholder at every call cost more than the rest of the claim's client work.
fn batch_values(rows: usize) -> Cow<'static, str> {
    static LONGEST: LazyLock<(String, Vec<usize>)> = LazyLock::new(|| {
        let mut list = String::new();
        let mut ends = Vec::with_capacity(MAX_CLAIM_BATCH);
        write_batch_values(&mut list, &mut ends, MAX_CLAIM_BATCH);
        (list, ends)
    });
    let (list, ends) = &*LONGEST;
    match rows.checked_sub(1).and_then(|last| ends.get(last)) {
        Some(&end) => Cow::Borrowed(list.get(..end).unwrap_or(list)),
        None if rows == 0 => Cow::Borrowed(""),
        // Longer than any batch may be: written for this call.
        None => {
            let mut list = String::new();
            write_batch_values(&mut list, &mut Vec::new(), rows);
            Cow::Owned(list)
        }
    }
}

/// Writes `rows` rows of a batch's VALUES list to `list` (each its id's placeholder, from
/// `$4`, then the shared `$1, $2, $3`), and where each row ends to `ends`.
fn write_batch_values(list: &mut String, ends: &mut Vec<usize>, rows: usize) {
    for row in 0..rows {
        let id = row + 4;
        let separator = if row == 0 { "" } else { ", " };
        // Writing to a String cannot fail.
        let _ = write!(list, "{separator}(${id}, $1, $2, $3)");
        ends.push(list.len());
    }
}

fn numbered(first: usize, count: usize) -> String {
    let placeholders: Vec<String> = (first..first + count).map(|n| format!("${n}")).collect();
    placeholders.join(", ")
}

/// What a bound travels as to `set_config`: milliseconds, as text.
fn millis_text(bound: Duration) -> String {
    format!("{}ms", bound.as_millis())
}

/// Classifies a PostgreSQL error, or returns `None` when `db` comes from another driver.
///
/// A 23505 is the inbox's duplicate only on `table`'s constraint on `table`, in `table`'s
/// schema when it names one; a table without a schema is whichever the `search_path`
/// finds, so its namesake's violation in any schema counts too.
pub(super) fn classify(db: &dyn DatabaseError, table: &InboxTable) -> Option<DbErrorKind> {
    let err = db.try_downcast_ref::<PgDatabaseError>()?;
    let on_our_table = || {
        err.constraint() == Some(table.unique_index())
            && err.table() == Some(table.name())
            && table
                .schema()
                .is_none_or(|schema| err.schema() == Some(schema))
    };
    Some(match err.code() {
        "23505" if on_our_table() => DbErrorKind::InboxDuplicate,
        "23505" => DbErrorKind::OtherUniqueViolation,
        // serialization_failure, deadlock_detected, lock_not_available
        "40001" | "40P01" | "55P03" => DbErrorKind::Transient,
        // read_only_sql_transaction: the connection reached a server that is not (or no
        // longer) the primary, as through HAProxy while a standby is promoted; a fresh
        // transaction on a fresh connection reaches the new one.
        "25006" => DbErrorKind::Transient,
        // admin_shutdown (pg_terminate_backend), crash_shutdown, cannot_connect_now
        "57P01" | "57P02" | "57P03" => DbErrorKind::Transient,
        code if code.starts_with("08") => DbErrorKind::Transient,
        "42P01" if names_inbox_table(err.message(), table.name()) => DbErrorKind::MissingInboxTable,
        // undefined_column
        "42703" => DbErrorKind::MissingColumn,
        _ => DbErrorKind::Other,
    })
}

/// Whether a 42P01 message names the inbox table. The words and the quotes around the
/// name follow the server's `lc_messages` (`relation "inbox"`, German `Relation »inbox«`,
/// French `la relation « inbox »`), so this looks for the table's `name` as a whole
/// identifier, possibly schema-qualified (`public.inbox`), and nothing else.
fn names_inbox_table(message: &str, name: &str) -> bool {
    names_identifier(message, name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ProcessMarker;
    use sea_orm_inbox_entity::TABLE_NAME;

    /// A batch's INSERT binds the consumer, the time and the tag once, and numbers each
    /// row's id after them.
    #[test]
    fn the_batch_claim_binds_what_its_rows_share_once() {
        let BatchClaimSql::Returning(sql) = Postgres.batch_claim(2, "c") else {
            panic!("PostgreSQL returns the inserted rows");
        };
        assert_eq!(
            sql,
            r#"INSERT INTO inbox (message_id, consumer, received_at, claim_token) VALUES ($4, $1, $2, $3), ($5, $1, $2, $3) ON CONFLICT ("message_id", "consumer") DO NOTHING RETURNING message_id"#
        );
    }

    /// The cut list is the list written for that many rows, up to the longest batch and
    /// past it.
    #[test]
    fn batch_values_cut_from_the_longest_list_match_a_list_written_for_them() {
        for rows in [
            1,
            7,
            MAX_CLAIM_BATCH - 1,
            MAX_CLAIM_BATCH,
            MAX_CLAIM_BATCH + 1,
        ] {
            let mut written = String::new();
            write_batch_values(&mut written, &mut Vec::new(), rows);
            assert_eq!(batch_values(rows), written, "{rows} rows");
        }
        assert_eq!(batch_values(0), "");
    }

    /// The NOTIFY carries no bind (a transaction pooler cannot carry one outside a
    /// transaction), so the channel is a literal whose quotes cannot end it.
    #[test]
    fn the_notify_writes_its_channel_as_a_quoted_literal() {
        assert_eq!(
            Postgres.outbox_notify("sea_orm_inbox_outbox").as_deref(),
            Some("SELECT pg_notify('sea_orm_inbox_outbox', '')")
        );
        assert_eq!(
            Postgres.outbox_notify("a'b").as_deref(),
            Some("SELECT pg_notify('a''b', '')")
        );
    }

    /// Every statement that may meet an existing marker arbitrates on the inbox's unique
    /// key, inferred from its two columns (the first migration's index and the third's
    /// constraint alike), and on nothing else.
    #[test]
    fn every_marker_insert_arbitrates_on_the_inbox_key() {
        let clause = r#" ON CONFLICT ("message_id", "consumer") DO NOTHING"#;
        let marker = |process| {
            Postgres
                .claim_marker(Marker {
                    message_id: crate::MessageId::from_uuid(uuid::Uuid::nil()),
                    consumer: "billing",
                    received_at: Utc::now(),
                    claim_silence: Duration::from_secs(20),
                    process,
                })
                .0
                .to_owned()
        };
        let process = |bounded_connection| ProcessMarker {
            token: uuid::Uuid::nil(),
            lock_wait: Duration::from_secs(5),
            silence: Duration::from_secs(20),
            bounded_connection,
        };
        let BatchClaimSql::Returning(batch) = Postgres.batch_claim(2, "c") else {
            panic!("PostgreSQL's batch claim returns the rows it inserted");
        };
        for sql in [
            marker(None),
            marker(Some(process(false))),
            marker(Some(process(true))),
            Postgres.insert_lease().to_owned(),
            batch,
        ] {
            assert!(sql.contains(clause), "{sql}");
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
                assert!(
                    names_inbox_table(&message(ours), TABLE_NAME),
                    "{}",
                    message(ours)
                );
            }
            for other in ["inbox_archive", "my_inbox", "inbox.orders", "orders"] {
                assert!(
                    !names_inbox_table(&message(other), TABLE_NAME),
                    "{}",
                    message(other)
                );
            }
        }
    }
}
