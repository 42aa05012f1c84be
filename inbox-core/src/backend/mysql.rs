//! MySQL and MariaDB: `?` placeholders, `ON DUPLICATE KEY UPDATE` in place of DO NOTHING,
//! naive UTC timestamps, and the classifier that reads error numbers and key names.

use super::dialect::{
    BoundsProbe, ConnectionBounds, Dialect, Marker, OutboxClaimSql, migration_of_column_named_in,
    repeat_list,
};
use super::{AfterFailure, BatchClaimSql, DbErrorKind};
use crate::InboxMigration;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::sqlx::mysql::MySqlDatabaseError;
use sea_orm::{DbErr, Value};
use sea_orm_inbox_entity::InboxTable;
use std::time::Duration;

pub(super) struct MySql;

impl Dialect for MySql {
    /// A duplicate raises 1062, which [`classify`] reads; the driver reports the new row's
    /// id. The silence bound goes before it, as session variables (see
    /// [`silence_bound`](Dialect::silence_bound)).
    fn identifier_quote(&self) -> char {
        '`'
    }

    fn claim_marker(&self, marker: Marker<'_>) -> (&'static str, Vec<Value>) {
        let sql = match marker.process {
            None => {
                "INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`) VALUES (?, ?, ?)"
            }
            Some(_) => {
                "INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`, `claim_token`) VALUES (?, ?, ?, ?)"
            }
        };
        (sql, marker.binds(self.timestamp_value(marker.received_at)))
    }

    fn marker_insert_returns_id(&self) -> bool {
        false
    }

    /// The INSERT cannot carry the bound: the session variables go first, in the same
    /// text query (sqlx opens every MySQL connection with `CLIENT_MULTI_STATEMENTS`), so
    /// the claim costs one round trip, not two. A text query takes no binds, so the values
    /// go in as literals no `sql_mode` reads differently: hex for the ids and the
    /// consumer's UTF-8 bytes (introduced as `utf8mb4`, whatever the connection's character
    /// set), digits and separators for the time. The driver reports the last statement's
    /// id, the marker's, and a duplicate raises 1062 from the INSERT as it does prepared.
    /// `None` on a connection that carries the bound for its whole life (see
    /// [`connection_bounds`](Dialect::connection_bounds)): the prepared INSERT alone.
    fn claim_marker_with_silence_bound(&self, marker: &Marker<'_>) -> Option<String> {
        let process = marker
            .process
            .as_ref()
            .filter(|process| !process.bounded_connection)?;
        let bound = self.silence_bound(process.silence)?;
        let (insert, _) = self.claim_marker(*marker);
        let literals = [
            hex_literal(marker.message_id.as_uuid().as_bytes()),
            format!("_utf8mb4 {}", hex_literal(marker.consumer.as_bytes())),
            format!(
                "'{}'",
                marker
                    .received_at
                    .naive_utc()
                    .format("%Y-%m-%d %H:%M:%S%.6f")
            ),
            hex_literal(process.token.as_bytes()),
        ];
        let mut literals = literals.iter();
        let mut inlined = String::with_capacity(bound.len() + insert.len() + 160);
        inlined.push_str(&bound);
        inlined.push_str("; ");
        for piece in insert.split_inclusive('?') {
            match piece.strip_suffix('?') {
                Some(before) => {
                    inlined.push_str(before);
                    inlined.push_str(literals.next()?);
                }
                None => inlined.push_str(piece),
            }
        }
        Some(inlined)
    }

    /// MariaDB ends a transaction whose client has been silent for
    /// `idle_transaction_timeout` seconds (10.3+; 0, the default, falls back to the 8 h
    /// `wait_timeout`) by closing the connection, which rolls it back and releases its
    /// locks; `net_write_timeout` (60 s by default) does the same when the server is
    /// blocked sending a reply. Both are session variables that the server reads when it
    /// starts waiting, so they must be set before the marker's lock is taken, and they stay
    /// on the pooled connection afterwards. Whole seconds, rounded up. MySQL 8 has no
    /// `idle_transaction_timeout`: it sits in a MariaDB executable comment (`/*M!100300`),
    /// which MySQL skips, so there only `net_write_timeout` applies and an idle partitioned
    /// transaction lasts until `wait_timeout`.
    fn silence_bound(&self, silence: Duration) -> Option<String> {
        let seconds = whole_seconds(silence);
        Some(format!(
            "SET SESSION net_write_timeout = {seconds} \
             /*M!100300 , idle_transaction_timeout = {seconds} */"
        ))
    }

    /// After connecting, the silence bound's session variables (as
    /// [`silence_bound`](Dialect::silence_bound) sets them), the lock wait
    /// (`innodb_lock_wait_timeout`, whole seconds rounded up, which no transaction can set
    /// for itself) and `@sea_orm_inbox_bounded`, which says that the pool set them: the
    /// per-transaction bound leaves the same session variables on the connections it ran
    /// on, so their values alone do not tell a pool that sets them on every connection.
    fn connection_bounds(&self, lock_wait: Duration, silence: Duration) -> ConnectionBounds {
        let (lock_wait, silence) = (whole_seconds(lock_wait), whole_seconds(silence));
        ConnectionBounds::AfterConnect(format!(
            "SET SESSION innodb_lock_wait_timeout = {lock_wait}, net_write_timeout = {silence} \
             /*M!100300 , idle_transaction_timeout = {silence} */, @sea_orm_inbox_bounded = 1"
        ))
    }

    /// The pool's mark, and the silence bound's session variables at exactly the bound.
    /// The lock wait is not read: a marker INSERT cannot bound it on this backend.
    fn connection_bounds_probe(
        &self,
        _lock_wait: Duration,
        silence: Duration,
    ) -> Option<BoundsProbe> {
        let silence = whole_seconds(silence);
        Some(BoundsProbe::Flag(format!(
            "SELECT CAST(COALESCE(@sea_orm_inbox_bounded = 1, 0) \
             AND @@session.net_write_timeout = {silence} \
             /*M!100300 AND @@session.idle_transaction_timeout = {silence} */ AS SIGNED)"
        )))
    }

    fn marker_held(&self) -> &'static str {
        "SELECT 1 FROM inbox WHERE id = ? AND message_id = ? AND consumer = ?"
    }

    fn process_marker_held(&self) -> &'static str {
        "SELECT 1 FROM inbox WHERE id = ? AND message_id = ? AND consumer = ? AND claim_token = ?"
    }

    /// MariaDB's 1062 names the violated index but not its table (`for key
    /// 'ix_inbox_message_id_consumer'`), and index names are per table, so a trigger's
    /// write into a table made with `CREATE TABLE ... LIKE inbox` fails with the same text.
    /// Only the marker tells them apart. A locking read, because the transaction's snapshot
    /// may predate the marker: InnoDB answers 1062 only once the marker's transaction has
    /// committed, and the read then sees it. In shared mode, which the INSERT's duplicate
    /// check already holds on that entry: claimers that met the same marker never wait for
    /// each other. (MySQL 8 qualifies the key, `'inbox.ix_...'`, so the read only repeats
    /// what the classifier knows; one index probe, only after a duplicate.)
    fn confirm_inbox_duplicate(&self) -> Option<&'static str> {
        Some("SELECT 1 FROM `inbox` WHERE `message_id` = ? AND `consumer` = ? LOCK IN SHARE MODE")
    }

    /// MySQL has no DO NOTHING, so the INSERT gets a no-op `ON DUPLICATE KEY UPDATE
    /// consumer = consumer`, as the lease INSERT does.
    ///
    /// MySQL 8 has no `INSERT ... RETURNING`; MariaDB has it since 10.5, in an executable
    /// comment that only MariaDB 10.5+ runs (MySQL and older MariaDB skip it, return
    /// nothing, and read every id's row back after the INSERT, the statements audited for
    /// MySQL 8). MariaDB's form returns, for each row of the INSERT, the row it wrote or
    /// the row its conflict met on any unique key, with that row's own values (its
    /// `claim_token` tells ours from a committed one). That is what the read-back returns,
    /// and the caller checks it the same way: exactly one row per id, of this consumer and
    /// this batch. A conflict on another unique key returns another message's row, or one
    /// id's row twice, and fails that check; so it cannot pass for "claimed before". One
    /// statement instead of two saves MariaDB a round trip and a second index probe per id.
    ///
    /// The consumer comes back NULL where it is `consumer`, byte for byte (every row the
    /// INSERT wrote): the server then sends no copy of it per row, and the client decodes
    /// none (13 bytes an id for a 12-byte name, a quarter of what the batch received per
    /// id). It goes into the text as a hex literal, which needs no escaping and reads the
    /// same under every `sql_mode`; the text stays the same from call to call of one
    /// consumer, so its prepared statement is reused. (A bind would do too on MariaDB, but
    /// MySQL 8 skips the comment and would then get one bind more than placeholders.)
    fn batch_claim(&self, rows: usize, consumer: &str) -> BatchClaimSql {
        BatchClaimSql::InsertThenRead {
            insert: format!(
                "INSERT INTO inbox (message_id, consumer, received_at, claim_token) VALUES {} \
                 ON DUPLICATE KEY UPDATE consumer = consumer \
                 /*M!100500 RETURNING message_id, \
                 IF(CAST(consumer AS BINARY) = {}, NULL, consumer) AS consumer, claim_token */",
                repeat_list("(?, ?, ?, ?)", rows),
                hex_literal(consumer.as_bytes())
            ),
            read: format!(
                "SELECT message_id, consumer, claim_token FROM inbox \
                 WHERE consumer = ? AND message_id IN ({}) FOR UPDATE",
                repeat_list("?", rows)
            ),
        }
    }

    fn batch_marker_held(&self) -> &'static str {
        "SELECT COUNT(*) FROM inbox WHERE message_id = ? AND consumer = ? AND claim_token = ?"
    }

    /// MySQL has no DO NOTHING, so it gets a no-op `ON DUPLICATE KEY UPDATE consumer =
    /// consumer` (never count its affected rows: sqlx reports found rows). Not `id = id`:
    /// assigning the auto-increment key in the update clause made MariaDB 10.11 hand a
    /// concurrent multi-row insert auto-increment values that collide with another
    /// transaction's rows, and ON DUPLICATE KEY then silently merged new messages into those
    /// rows (measured: 6 of 15 runs of the two-replica batch race lost ids; 0 of 20 with
    /// this clause). `INSERT IGNORE` is not used either: it would also swallow every other
    /// error (a NOT NULL or a foreign key violation) as a warning.
    fn insert_lease(&self) -> &'static str {
        "INSERT INTO inbox (message_id, consumer, received_at, attempts, lease_until, claim_token) \
         VALUES (?, ?, ?, 1, ?, ?) ON DUPLICATE KEY UPDATE consumer = consumer"
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

    /// MySQL/MariaDB cannot use LIMIT in an `IN (subquery)`, but its single-table DELETE
    /// takes ORDER BY and LIMIT itself (a range scan of the index).
    fn purge_batch(&self) -> &'static str {
        "DELETE FROM inbox WHERE received_at < ? \
         AND (processed_at < ? OR (processed_at IS NULL AND lease_until IS NULL)) \
         ORDER BY received_at LIMIT ?"
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

    /// sqlx sends `DateTime<Utc>` to MySQL/MariaDB typed as TIMESTAMP, which MariaDB turns
    /// into NULL past 2038 even for a `datetime(6)` column; the same instant as a naive UTC
    /// DATETIME is stored exactly.
    fn timestamp_value(&self, at: DateTime<Utc>) -> Value {
        Value::from(at.naive_utc())
    }

    /// The `consumer` column's `utf8mb4_bin` collation is PAD SPACE: `'mailer ' =
    /// 'mailer'` holds. Compared as binary strings, trailing spaces count, as they do on
    /// PostgreSQL and SQLite.
    fn consumer_is(&self, consumer: &str) -> Expr {
        Expr::cust_with_values("CAST(`consumer` AS BINARY) = ?", [consumer])
    }

    fn columns_catalog(&self, table: &str) -> String {
        format!(
            "SELECT CAST(column_name AS CHAR), CAST(collation_name AS CHAR) FROM information_schema.columns \
             WHERE table_schema = DATABASE() AND table_name = '{table}' ORDER BY ordinal_position"
        )
    }

    /// A prefix key (`consumer(10)`) counts as partial; a functional key (MySQL 8) has no
    /// column name.
    fn index_catalog(&self, table: &str, index: &str) -> String {
        format!(
            "SELECT CAST(COALESCE(column_name, '(expression)') AS CHAR), CAST(1 - non_unique AS SIGNED), \
             CAST(sub_part IS NOT NULL AS SIGNED) FROM information_schema.statistics \
             WHERE table_schema = DATABASE() AND table_name = '{table}' \
             AND index_name = '{index}' ORDER BY seq_in_index"
        )
    }

    /// Binary collations end in `_bin` (`utf8mb4_bin`, `utf8mb4_nopad_bin`), or are
    /// `binary`; the others ignore case or accents, or both.
    fn is_exact_consumer_collation(&self, collation: &str) -> bool {
        collation == "binary" || collation.ends_with("_bin")
    }

    /// 1054 quotes the unknown column first (`Unknown column 'claim_token' in 'field
    /// list'`), in every language.
    fn missing_migration(&self, db: &dyn DatabaseError) -> Option<InboxMigration> {
        const ER_BAD_FIELD_ERROR: u16 = 1054;
        let err = db.try_downcast_ref::<MySqlDatabaseError>()?;
        if err.number() != ER_BAD_FIELD_ERROR {
            return None;
        }
        let (_, after_open) = err.message().split_once('\'')?;
        let (column, _) = after_open.split_once('\'')?;
        migration_of_column_named_in(column)
    }

    /// InnoDB rolls the whole transaction back on a deadlock (1213, also Galera's
    /// certification failure and brute-force abort) and on a lost connection; after a lock
    /// wait timeout (1205) only with `innodb_rollback_on_timeout`, which the client cannot
    /// see, so every transient failure counts as an end. Any other error rolls back only
    /// its statement, inside a savepoint or not.
    fn after_failure(&self, err: &DbErr, _savepoint_depth: u32) -> AfterFailure {
        if super::classify(err) == DbErrorKind::Transient {
            AfterFailure::Ended
        } else {
            AfterFailure::WentOn
        }
    }

    /// ROLLBACK outside a transaction is a no-op.
    fn before_rollback(&self) -> Option<&'static str> {
        None
    }

    /// A Galera brute-force abort can end the transaction between two statements without
    /// failing the next one, which then runs on its own: `wsrep_on` is on for a Galera
    /// node (MariaDB 10.1+ reads it in the executable comment). MySQL 8 skips the comment
    /// and reads 0, as [`silently_ended_probe`](Dialect::silently_ended_probe) does there.
    fn silent_end_capability_probe(&self) -> Option<&'static str> {
        Some("SELECT CAST(/*M!100100 @@global.wsrep_on + */ 0 AS SIGNED)")
    }

    /// MariaDB's `@@in_transaction` (10.3+) is 0 once a Galera brute-force abort ended the
    /// transaction and the statements after it ran in autocommit. MySQL 8 skips the
    /// executable comment and reads 0: without Galera it ends no transaction silently.
    fn silently_ended_probe(&self) -> Option<&'static str> {
        Some("SELECT CAST(/*M!100300 1 - @@in_transaction + */ 0 AS SIGNED)")
    }

    /// COMMIT outside a transaction succeeds.
    fn ended_transaction_probe(&self) -> Option<&'static str> {
        None
    }

    fn refuses_probe(&self, _db: &dyn DatabaseError) -> Option<bool> {
        None
    }

    /// 1305 comes both from another transaction and from one InnoDB rolled back: the
    /// caller asks whether the marker is still there.
    fn savepoint_missing_in_open_transaction(&self, _db: &dyn DatabaseError) -> bool {
        false
    }

    /// A lock wait timeout ends only the statement, a deadlock the whole transaction, and
    /// reopening one after the first would commit the work: never guessed here.
    fn restore_driver_savepoint(&self, _level: usize) -> Option<String> {
        None
    }

    /// Left to the driver: the MariaDB suite runs these ends clean, over a connection
    /// without TLS, where closing a connection that owes replies does not wait (see
    /// [`drain_queued_rollbacks`](super::drain_queued_rollbacks)); unverified over TLS.
    fn queued_rollbacks_drain(&self) -> Option<&'static str> {
        None
    }

    fn over_network(&self) -> bool {
        true
    }

    /// MySQL has no DO NOTHING: a no-op update of a non-key column, as for the inbox
    /// (assigning a key column in that clause is what lost rows on MariaDB). The outbox has
    /// no unique key but the primary key and `ix_outbox_message_id`, so it fires only for a
    /// repeated message id.
    fn outbox_insert(&self) -> &'static str {
        "INSERT INTO `outbox` (`message_id`, `destination`, `partition_key`, `payload`, `headers`, `created_at`, `available_at`) VALUES (?, ?, ?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE `destination` = `destination`"
    }

    /// MySQL and MariaDB have no `UPDATE ... RETURNING`: a read, the lease, then a read of
    /// what it leased, each on its own in autocommit. The candidates are read without
    /// locks, walking `ix_outbox_pending` from the first unsent row (`FORCE INDEX`: with
    /// the relay's conditions MariaDB would walk the primary key from the oldest sent row,
    /// 1,600 rows read instead of 100 with 1,500 of 2,000 rows sent). The lease takes them
    /// by primary key, checks again that each is still due, and leases at most a batch of
    /// them in `id` order; the read after it returns the rows that carry the claim's token.
    /// Twice the batch in candidates lets a claim pass over a batch that another relay
    /// leased in the same instant and still fill its own.
    ///
    /// The lease walks the primary key's ranges of the ids (`FORCE INDEX (PRIMARY)`), which
    /// visits them in `id` order, so `LIMIT` alone keeps the oldest; with `ORDER BY id`
    /// MariaDB buffered every row before writing it ("Using buffer": per batch of 100, 100
    /// more row reads by position, `Handler_read_rnd`, and 579 pages visited against 379).
    /// The read after it stops at the count the lease took (`LIMIT`): without it, it
    /// looked up every candidate, twice the batch (`Handler_read_key` 200 against 100).
    ///
    /// No transaction: the lease is one statement, which commits on its own, and the two
    /// reads lock nothing. What a claim in a transaction cost here (measured per batch of
    /// 100 on MariaDB 10.11 through the test proxy): `SET TRANSACTION ISOLATION LEVEL`
    /// (its own round trip), BEGIN, the silence bound's `SET SESSION` (without it, a claim
    /// cut off from the database kept its rows locked for hours), a locking read (which
    /// kept the locks of rows its WHERE rejected) and COMMIT: 4 round trips more than
    /// these three statements. An autocommit statement holds its row locks only while it
    /// runs, whether its client is still there or not: a relay cut off leaves at most a
    /// lease, which ends as a crashed relay's does. Two relays' leases over the same
    /// candidates meet at the row locks: the second waits for the first statement to
    /// commit (the rows are locked in `id` order by both, so they cannot deadlock), then
    /// skips the rows it leased, which are no longer due.
    ///
    /// A drain's claim after a full batch is the exception: it runs in one transaction
    /// with that batch's marks (BEGIN, the silence bound, the marks, these three, COMMIT),
    /// so that the batch costs one commit, one wait for the redo log's flush, where the
    /// marks and the lease in autocommit cost two. There the lease's locks, and those of
    /// the rows its WHERE rejected, last until the COMMIT; a deadlock with another relay's
    /// marks (possible only when a claim's candidates were read before that relay's lease
    /// committed) ends the transaction, and the drain writes the marks on their own.
    fn outbox_claim(&self) -> OutboxClaimSql {
        OutboxClaimSql::ReadLeaseReadBack {
            candidates: "SELECT o.id FROM outbox o FORCE INDEX (ix_outbox_pending) \
             WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.available_at <= ? \
             AND (o.leased_until IS NULL OR o.leased_until <= ?) \
             AND (o.partition_key IS NULL OR NOT EXISTS (SELECT 1 FROM outbox e \
             WHERE e.partition_key = o.partition_key AND e.id < o.id AND e.sent_at IS NULL)) \
             ORDER BY o.id LIMIT ?",
            lease: |ids| {
                format!(
                    "UPDATE outbox FORCE INDEX (PRIMARY) SET attempts = attempts + 1, \
                     leased_until = ?, lease_token = ?, \
                     first_published_at = COALESCE(first_published_at, ?) \
                     WHERE id IN ({}) AND sent_at IS NULL AND dead_at IS NULL \
                     AND available_at <= ? AND (leased_until IS NULL OR leased_until <= ?) \
                     LIMIT ?",
                    repeat_list("?", ids)
                )
            },
            leased: |ids| {
                format!(
                    "SELECT o.* FROM outbox o WHERE o.id IN ({}) AND o.lease_token = ? \
                     ORDER BY o.id LIMIT ?",
                    repeat_list("?", ids)
                )
            },
        }
    }

    /// No transaction pooler of PgBouncer's kind splits a MySQL statement from its
    /// transaction.
    fn outbox_settle_alone(&self) -> bool {
        true
    }

    /// `FORCE INDEX (PRIMARY)`: MariaDB otherwise finds the rows through
    /// `ix_outbox_pending` (`sent_at IS NULL AND id IN (..)` is a precise range there), the
    /// index whose key the mark changes, so it buffers every row before writing it ("Using
    /// buffer"): the mark of a batch of 100 took 23 ms there against 1.5 ms by primary key.
    fn outbox_mark_sent(&self, ids: usize) -> String {
        format!(
            "UPDATE outbox FORCE INDEX (PRIMARY) SET sent_at = ?, leased_until = NULL \
             WHERE lease_token = ? AND sent_at IS NULL AND id IN ({})",
            repeat_list("?", ids)
        )
    }

    fn outbox_mark_failed(&self) -> &'static str {
        "UPDATE outbox SET leased_until = NULL, available_at = ?, last_error = ?, dead_at = ? \
         WHERE id = ? AND lease_token = ? AND sent_at IS NULL"
    }

    /// By primary key, as the mark.
    fn outbox_release(&self, ids: usize) -> String {
        format!(
            "UPDATE outbox FORCE INDEX (PRIMARY) SET leased_until = NULL, attempts = attempts - 1 \
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

    /// MySQL/MariaDB cannot use LIMIT in an `IN (subquery)`; the single-table DELETE takes
    /// ORDER BY and LIMIT itself.
    fn outbox_purge_batch(&self) -> &'static str {
        "DELETE FROM outbox WHERE sent_at < ? ORDER BY sent_at LIMIT ?"
    }

    fn outbox_backlog(&self) -> &'static str {
        "SELECT (SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NULL), \
         (SELECT COUNT(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NOT NULL)"
    }
}

/// Classifies a MySQL/MariaDB error, or returns `None` when `db` comes from another driver.
///
/// It reads error numbers and quoted names only, never the words around them, which
/// follow the server's `lc_messages` (German: `Doppelter Eintrag '...' für Schlüssel
/// '...'`; Japanese puts the key mid-sentence).
/// A bound in whole seconds, rounded up: what MySQL's timeout variables take.
fn whole_seconds(bound: Duration) -> u64 {
    bound.as_secs() + u64::from(bound.subsec_nanos() > 0)
}

pub(super) fn classify(db: &dyn DatabaseError, table: &InboxTable) -> Option<DbErrorKind> {
    let err = db.try_downcast_ref::<MySqlDatabaseError>()?;
    Some(kind_of(err.number(), err.code(), err.message(), table))
}

/// What the error `number` (SQLSTATE `sqlstate`, text `message`) means for the inbox in
/// `table`.
fn kind_of(number: u16, sqlstate: Option<&str>, message: &str, table: &InboxTable) -> DbErrorKind {
    const ER_DUP_ENTRY: u16 = 1062;
    const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
    const ER_LOCK_DEADLOCK: u16 = 1213;
    const ER_NO_SUCH_TABLE: u16 = 1146;
    const ER_BAD_FIELD_ERROR: u16 = 1054;
    const ER_SERVER_SHUTDOWN: u16 = 1053;
    const ER_CONNECTION_KILLED: u16 = 1927;
    const ER_QUERY_INTERRUPTED: u16 = 1317;
    // Galera: "WSREP has not yet prepared node for application use", SQLSTATE 08S01. The
    // node is outside the primary component (it lost quorum, is joining, or rejects
    // queries); it serves again once it rejoins. 1047 without 08S01 is "unknown command".
    const ER_UNKNOWN_COM_ERROR: u16 = 1047;
    // "Got error during COMMIT": the server rolled the transaction back. On Galera a node
    // that lost the primary component mid-transaction answers it ("Not connected to
    // Primary Component"), seen in the Galera soak when node 3 was killed; a fresh
    // transaction on a node of the primary component succeeds.
    const ER_ERROR_DURING_COMMIT: u16 = 1180;
    // A server that no longer takes writes, met while a node is demoted during a
    // failover: `--read-only` (1290, whose option name is in the text in every language;
    // the same number names other options too), read-only mode (1836), or a READ ONLY
    // transaction (1792, SQLSTATE 25006, PostgreSQL's code for a standby). A fresh
    // transaction on a fresh connection reaches the new primary.
    const ER_OPTION_PREVENTS_STATEMENT: u16 = 1290;
    const ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: u16 = 1792;
    const ER_READ_ONLY_MODE: u16 = 1836;
    match number {
        ER_UNKNOWN_COM_ERROR if sqlstate == Some("08S01") => DbErrorKind::Transient,
        ER_DUP_ENTRY => match inbox_key(message, table) {
            Some(InboxKey::OnTable) => DbErrorKind::InboxDuplicate,
            Some(InboxKey::TableUnknown) => DbErrorKind::PossibleInboxDuplicate,
            None => DbErrorKind::OtherUniqueViolation,
        },
        ER_LOCK_WAIT_TIMEOUT | ER_LOCK_DEADLOCK => DbErrorKind::Transient,
        ER_SERVER_SHUTDOWN | ER_CONNECTION_KILLED | ER_QUERY_INTERRUPTED => DbErrorKind::Transient,
        ER_ERROR_DURING_COMMIT => DbErrorKind::Transient,
        ER_OPTION_PREVENTS_STATEMENT if names_read_only_option(message) => DbErrorKind::Transient,
        ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION | ER_READ_ONLY_MODE => DbErrorKind::Transient,
        ER_NO_SUCH_TABLE if names_inbox_table(message, table) => DbErrorKind::MissingInboxTable,
        ER_BAD_FIELD_ERROR => DbErrorKind::MissingColumn,
        _ => DbErrorKind::Other,
    }
}

/// What a 1062 message proves about the violated key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InboxKey {
    /// The table's name qualifies the key (MySQL 8.0.19+: `'inbox.ix_...'`).
    OnTable,
    /// The key alone (MariaDB: `'ix_...'`): any table's index of that name.
    TableUnknown,
}

/// Whether a 1062 message names the inbox index, and whether it names its table too. In
/// every language of the server's message catalogue the key name is the last quoted text
/// of the message (MariaDB: `'ix_inbox_message_id_consumer'`; MySQL 8.0.19+:
/// `'inbox.ix_inbox_message_id_consumer'`), after the duplicate entry, whose raw UUID
/// bytes may hold quotes themselves.
fn inbox_key(message: &str, table: &InboxTable) -> Option<InboxKey> {
    let key = last_quoted(message)?;
    let index = table.unique_index();
    if key == index {
        return Some(InboxKey::TableUnknown);
    }
    let qualified = key
        .strip_prefix(table.name())
        .and_then(|key| key.strip_prefix('.'));
    (qualified == Some(index)).then_some(InboxKey::OnTable)
}

/// Whether a 1290 message names the option that makes the server refuse writes.
fn names_read_only_option(message: &str) -> bool {
    message.contains("--read-only") || message.contains("--super-read-only")
}

/// The text between the last two single quotes of `message`.
fn last_quoted(message: &str) -> Option<&str> {
    let (before_close, _) = message.rsplit_once('\'')?;
    let (_, quoted) = before_close.rsplit_once('\'')?;
    Some(quoted)
}

/// Whether a 1146 message names the inbox table: in every language it quotes the missing
/// table once, as `'database.table'`.
fn names_inbox_table(message: &str, table: &InboxTable) -> bool {
    let Some((_, after_open)) = message.split_once('\'') else {
        return false;
    };
    let Some((qualified, _)) = after_open.split_once('\'') else {
        return false;
    };
    qualified.rsplit_once('.').map(|(_, name)| name) == Some(table.name())
}

/// `bytes` as a MySQL hex literal, `x'...'`: read the same under every `sql_mode`, with
/// nothing to escape.
fn hex_literal(bytes: &[u8]) -> String {
    let mut literal = String::with_capacity(3 + 2 * bytes.len());
    literal.push_str("x'");
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        literal.push(char::from(DIGITS[usize::from(byte >> 4)]));
        literal.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    literal.push('\'');
    literal
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MessageId;
    use crate::backend::ProcessMarker;
    use sea_orm_inbox_entity::INDEX_NAME;

    #[test]
    fn process_marker_goes_with_its_silence_bound_as_literals() {
        let at = DateTime::parse_from_rfc3339("2026-12-04T03:04:05.000006Z")
            .expect("a valid time")
            .with_timezone(&Utc);
        let marker = Marker {
            message_id: MessageId::from_uuid(uuid::Uuid::from_u128(0x0102)),
            consumer: "o'brien\\ ?",
            received_at: at,
            claim_silence: Duration::from_secs(20),
            process: Some(ProcessMarker {
                token: uuid::Uuid::from_u128(0xff),
                lock_wait: Duration::from_secs(5),
                silence: Duration::from_millis(1500),
                bounded_connection: false,
            }),
        };
        assert_eq!(
            MySql.claim_marker_with_silence_bound(&marker).as_deref(),
            Some(
                "SET SESSION net_write_timeout = 2 /*M!100300 , idle_transaction_timeout = 2 */; \
                 INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`, `claim_token`) \
                 VALUES (x'00000000000000000000000000000102', _utf8mb4 x'6f27627269656e5c203f', \
                 '2026-12-04 03:04:05.000006', x'000000000000000000000000000000ff')"
            )
        );
        let claim = Marker {
            process: None,
            ..marker
        };
        assert_eq!(MySql.claim_marker_with_silence_bound(&claim), None);
        let on_bounded_connection = Marker {
            process: marker.process.map(|process| ProcessMarker {
                bounded_connection: true,
                ..process
            }),
            ..marker
        };
        assert_eq!(
            MySql.claim_marker_with_silence_bound(&on_bounded_connection),
            None
        );
    }

    /// MariaDB's batch INSERT returns the consumer only where it is not the batch's own,
    /// byte for byte: a hex literal, whatever the name holds.
    #[test]
    fn batch_claim_returns_only_a_foreign_consumer() {
        let BatchClaimSql::InsertThenRead { insert, read } = MySql.batch_claim(2, "o'b\\ ?") else {
            panic!("MySQL reads the batch back where RETURNING is missing");
        };
        assert_eq!(
            insert,
            "INSERT INTO inbox (message_id, consumer, received_at, claim_token) \
             VALUES (?, ?, ?, ?), (?, ?, ?, ?) ON DUPLICATE KEY UPDATE consumer = consumer \
             /*M!100500 RETURNING message_id, \
             IF(CAST(consumer AS BINARY) = x'6f27625c203f', NULL, consumer) AS consumer, claim_token */"
        );
        assert_eq!(insert.matches('?').count(), 8, "no bind beyond the rows'");
        assert!(read.starts_with("SELECT message_id, consumer, claim_token"));
    }

    /// The pool's after-connect statement sets what the marker's text query would, in
    /// whole seconds rounded up, and the mark the probe looks for first.
    #[test]
    fn connection_bounds_set_the_marker_bounds_and_the_pools_mark() {
        let bounds = MySql.connection_bounds(Duration::from_millis(2500), Duration::from_secs(20));
        let ConnectionBounds::AfterConnect(set) = bounds else {
            panic!("MySQL sets its bounds after connecting");
        };
        assert_eq!(
            set,
            "SET SESSION innodb_lock_wait_timeout = 3, net_write_timeout = 20 \
             /*M!100300 , idle_transaction_timeout = 20 */, @sea_orm_inbox_bounded = 1"
        );
        let probe =
            MySql.connection_bounds_probe(Duration::from_secs(5), Duration::from_millis(1500));
        assert_eq!(
            probe,
            Some(BoundsProbe::Flag(
                "SELECT CAST(COALESCE(@sea_orm_inbox_bounded = 1, 0) \
                 AND @@session.net_write_timeout = 2 \
                 /*M!100300 AND @@session.idle_transaction_timeout = 2 */ AS SIGNED)"
                    .to_owned()
            ))
        );
    }

    #[test]
    fn key_matches_mariadb_and_mysql8_forms_only() {
        let ours = InboxTable::default();
        assert_eq!(
            inbox_key(
                "Duplicate entry '\u{1}\u{2}-billing' for key 'ix_inbox_message_id_consumer'",
                &ours
            ),
            Some(InboxKey::TableUnknown)
        );
        assert_eq!(
            inbox_key(
                "Duplicate entry 'x-billing' for key 'inbox.ix_inbox_message_id_consumer'",
                &ours
            ),
            Some(InboxKey::OnTable)
        );
        for other in [
            "Duplicate entry 'x-billing' for key 'orders.ix_inbox_message_id_consumer'",
            "Duplicate entry 'x' for key 'ix_inbox_message_id_consumer_2'",
            "Duplicate entry ' for key 'ix_inbox_message_id_consumer'' for key 'uq_order_no'",
            "Duplicate entry 'x' for key 'PRIMARY'",
            "Duplicate entry",
            "'",
        ] {
            assert_eq!(inbox_key(other, &ours), None, "{other}");
        }
    }

    /// The 1062 texts of MariaDB's message catalogue (errmsg-utf8.txt,
    /// ER_DUP_ENTRY_WITH_KEY_NAME) in several languages, with the MariaDB and the MySQL 8
    /// key forms; the entry holds raw UUID bytes, a quote among them.
    #[test]
    fn key_is_found_in_every_language() {
        let entry = "\u{7}'\u{1b}-billing";
        let languages = [
            "Duplicate entry '{entry}' for key '{key}'",
            "Doppelter Eintrag '{entry}' für Schlüssel '{key}'",
            "Duplicata du champ '{entry}' pour la clef '{key}'",
            "'{entry}' は索引 '{key}' で重複しています。",
            "Duplikalt bejegyzes '{entry}' a '{key}' kulcs szerint",
            "Дублирующаяся запись '{entry}' по ключу '{key}'",
            "重复条目'{entry}'键'{key}'",
            "Zvojený klíč '{entry}' (číslo klíče '{key}')",
        ];
        for template in languages {
            let message = |key: &str| template.replace("{entry}", entry).replace("{key}", key);
            for (ours, proof) in [
                (INDEX_NAME, InboxKey::TableUnknown),
                ("inbox.ix_inbox_message_id_consumer", InboxKey::OnTable),
            ] {
                assert_eq!(
                    inbox_key(&message(ours), &InboxTable::default()),
                    Some(proof),
                    "{}",
                    message(ours)
                );
            }
            for other in [
                "uq_order_no",
                "orders.ix_inbox_message_id_consumer",
                "PRIMARY",
            ] {
                assert_eq!(
                    inbox_key(&message(other), &InboxTable::default()),
                    None,
                    "{}",
                    message(other)
                );
            }
        }
    }

    /// Another table's index, in either key form, is that table's duplicate only.
    #[test]
    fn key_of_a_custom_table_names_that_table() {
        let app = InboxTable::named("app_inbox").expect("a valid name");
        for (key, proof) in [
            ("ix_app_inbox_message_id_consumer", InboxKey::TableUnknown),
            (
                "app_inbox.ix_app_inbox_message_id_consumer",
                InboxKey::OnTable,
            ),
        ] {
            let message = format!("Duplicate entry 'x-billing' for key '{key}'");
            assert_eq!(inbox_key(&message, &app), Some(proof), "{message}");
            assert_eq!(
                inbox_key(&message, &InboxTable::default()),
                None,
                "{message}"
            );
        }
        let ours = "Duplicate entry 'x' for key 'inbox.ix_inbox_message_id_consumer'";
        assert_eq!(inbox_key(ours, &app), None);
        assert!(names_inbox_table(
            "Table 'test.app_inbox' doesn't exist",
            &app
        ));
    }

    /// The public classifier answers `InboxDuplicate` only when the key names its table;
    /// MariaDB's bare key is `PossibleInboxDuplicate` (a namesake on another table gives
    /// the same text).
    #[test]
    fn only_a_key_naming_its_table_is_an_inbox_duplicate() {
        let ours = InboxTable::default();
        let dup = |key: &str| {
            kind_of(
                1062,
                Some("23000"),
                &format!("Duplicate entry 'x' for key '{key}'"),
                &ours,
            )
        };
        assert_eq!(
            dup("inbox.ix_inbox_message_id_consumer"),
            DbErrorKind::InboxDuplicate
        );
        assert_eq!(dup(INDEX_NAME), DbErrorKind::PossibleInboxDuplicate);
        assert_eq!(dup("uq_order_no"), DbErrorKind::OtherUniqueViolation);
    }

    /// A demoted or read-only server (the texts of MariaDB 10.11's catalogue; 1290's option
    /// name is never translated) is transient; 1290 for another option is not.
    #[test]
    fn read_only_servers_are_transient() {
        let table = InboxTable::default();
        for (number, sqlstate, message) in [
            (
                1290,
                "HY000",
                "The MariaDB server is running with the --read-only option so it cannot execute this statement",
            ),
            (
                1290,
                "HY000",
                "Der MariaDB-Server läuft mit der Option --read-only und kann diese Anweisung deswegen nicht ausführen",
            ),
            (
                1290,
                "HY000",
                "The MySQL server is running with the --super-read-only option so it cannot execute this statement",
            ),
            (1836, "HY000", "Running in read-only mode"),
            (
                1792,
                "25006",
                "Cannot execute statement in a READ ONLY transaction",
            ),
        ] {
            assert_eq!(
                kind_of(number, Some(sqlstate), message, &table),
                DbErrorKind::Transient,
                "{number}: {message}"
            );
        }
        assert_eq!(
            kind_of(
                1290,
                Some("HY000"),
                "The MariaDB server is running with the --secure-file-priv option so it cannot execute this statement",
                &table
            ),
            DbErrorKind::Other
        );
    }

    #[test]
    fn missing_table_messages_name_the_inbox_table_in_every_language() {
        for template in [
            "Table '{table}' doesn't exist",
            "Tabelle '{table}' existiert nicht",
            "La table '{table}' n'existe pas",
            "表 '{table}' は存在しません。",
            "A '{table}' tabla nem letezik",
            "Det finns ingen tabell som heter '{table}'",
        ] {
            let message = |table: &str| template.replace("{table}", table);
            assert!(
                names_inbox_table(&message("test.inbox"), &InboxTable::default()),
                "{template}"
            );
            for other in ["test.orders", "test.inbox_archive", "inbox.orders"] {
                assert!(
                    !names_inbox_table(&message(other), &InboxTable::default()),
                    "{}",
                    message(other)
                );
            }
        }
        assert!(!names_inbox_table(
            "Table doesn't exist",
            &InboxTable::default()
        ));
    }
}
