//! The outbox's statements with their binds; each backend file writes their SQL (see
//! [`Dialect`](super::dialect::Dialect)'s outbox methods).

use super::dialect;
use super::dialect::OutboxClaimSql;
use crate::InboxError;
use chrono::{DateTime, Utc};
use sea_orm::{DbBackend, Statement, TransactionOptions, Value};
use sea_orm_inbox_entity::LAST_ERROR_MAX_CHARS;
use std::borrow::Cow;
use std::time::Duration;
use uuid::Uuid;

/// The columns of a row to enqueue, in the order of the outbox INSERT's binds.
pub(crate) struct OutboxRow {
    pub(crate) message_id: Uuid,
    pub(crate) destination: String,
    pub(crate) partition_key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: String,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) available_at: DateTime<Utc>,
}

/// The INSERT of one outgoing message; a row with the same `message_id` stays as it is.
pub(crate) fn insert_statement(
    backend: DbBackend,
    row: OutboxRow,
) -> Result<Statement, InboxError> {
    let dialect = dialect(backend)?;
    let values = vec![
        Value::from(row.message_id),
        Value::from(row.destination),
        Value::from(row.partition_key),
        Value::from(row.payload),
        Value::from(row.headers),
        dialect.timestamp_value(row.created_at),
        dialect.timestamp_value(row.available_at),
    ];
    Ok(Statement::from_sql_and_values(
        backend,
        dialect.outbox_insert(),
        values,
    ))
}

/// How the relay claims a batch on a backend, with the statement's binds.
pub(crate) enum ClaimPlan {
    /// One statement that leases the due rows and returns them as leased, in a
    /// transaction of its own begun with these options; the statement bounds how long the
    /// server keeps the transaction for a silent client.
    InTransaction(Statement, TransactionOptions),
    /// A read of the due rows' ids, a lease of some of them by primary key, then a read of
    /// the rows the lease took, each statement on its own.
    ReadLeaseReadBack(ReadLeaseReadBack),
    /// A read of the due rows as the lease leaves them, then the lease of exactly those,
    /// in a transaction begun with these options that holds the only write lock.
    ReadThenLease(ReadThenLease),
}

/// The statements of [`ClaimPlan::ReadThenLease`].
pub(crate) struct ReadThenLease {
    pub(crate) read: Statement,
    lease: fn(usize) -> String,
    /// The lease's binds before the ids: leased_until, token, the claim's time.
    leasing: [Value; 3],
    options: TransactionOptions,
}

impl ReadThenLease {
    /// The lease of the rows `ids` that the read returned.
    pub(crate) fn lease(&self, ids: &[i64]) -> Statement {
        let mut values = Vec::with_capacity(self.leasing.len() + ids.len());
        values.extend(self.leasing.iter().cloned());
        values.extend(ids.iter().map(|id| Value::from(*id)));
        Statement::from_sql_and_values(self.read.db_backend, (self.lease)(ids.len()), values)
    }
}

/// The statements of [`ClaimPlan::ReadLeaseReadBack`].
pub(crate) struct ReadLeaseReadBack {
    pub(crate) candidates: Statement,
    lease: fn(usize) -> String,
    leased: fn(usize) -> String,
    /// The lease's binds before the ids: leased_until, token, the claim's time.
    leasing: [Value; 3],
    due: [Value; 2],
    limit: i64,
    token: Uuid,
}

impl ReadLeaseReadBack {
    /// The lease of the candidate rows `ids`: at most the claim's limit of them, each
    /// checked again to be due.
    pub(crate) fn lease(&self, ids: &[i64]) -> Statement {
        let mut values = self.leasing.to_vec();
        values.extend(ids.iter().map(|id| Value::from(*id)));
        values.extend(self.due.iter().cloned());
        values.push(Value::from(self.limit));
        Statement::from_sql_and_values(self.candidates.db_backend, (self.lease)(ids.len()), values)
    }

    /// The read of the `took` rows among `ids` that the lease took, in `id` order: it
    /// stops at the last of them instead of looking up every candidate.
    pub(crate) fn leased(&self, ids: &[i64], took: u64) -> Statement {
        let mut values: Vec<Value> = ids.iter().map(|id| Value::from(*id)).collect();
        values.push(Value::from(self.token));
        values.push(Value::from(took));
        Statement::from_sql_and_values(self.candidates.db_backend, (self.leased)(ids.len()), values)
    }
}

impl ClaimPlan {
    /// The options of the transaction the claim needs, `None` for a claim sent on its own.
    pub(crate) fn transaction_options(&self) -> Option<TransactionOptions> {
        match self {
            Self::ReadLeaseReadBack(_) => None,
            Self::InTransaction(_, options) => Some(*options),
            Self::ReadThenLease(plan) => Some(plan.options),
        }
    }

    /// Whether the claim's own statement bounds how long the server keeps its transaction
    /// for a silent client; otherwise a transaction that holds the claim (with the marks
    /// of the batch before) sends the backend's silence bound first.
    pub(crate) fn bounds_its_silence(&self) -> bool {
        matches!(self, Self::InTransaction(..))
    }
}

/// How many candidates a claim of `limit` rows reads before leasing: twice the batch, so
/// that a claim passes over a batch another relay leases in the same instant and still
/// fills its own.
const CANDIDATES_PER_ROW: i64 = 2;

/// The relay's claim of at most `limit` due rows at `now`, oldest first, leased to `token`
/// until `leased_until`, counting the attempt and stamping `now` as the first publish time
/// of rows that have none; rows another relay's claim holds are skipped. Where the claim
/// holds a transaction open, the server ends it when its client has been silent for
/// `silence` (a relay cut off from the database), releasing what it holds.
///
/// A row is due when it is unsent, not dead, available, and not leased (or its lease has
/// ended). A row with a key is due only when no earlier row of its key is unsent, whatever
/// that row's state (leased by another relay, waiting for a retry, dead): so a key's rows
/// go out one at a time, in `id` order. There is no cursor: a row whose transaction
/// commits after later ids were published is found by the next claim all the same.
pub(crate) fn claim_plan(
    backend: DbBackend,
    now: DateTime<Utc>,
    leased_until: DateTime<Utc>,
    token: Uuid,
    limit: i64,
    silence: Duration,
) -> Result<ClaimPlan, InboxError> {
    let dialect = dialect(backend)?;
    let due = [dialect.timestamp_value(now), dialect.timestamp_value(now)];
    let leasing = [
        dialect.timestamp_value(leased_until),
        Value::from(token),
        dialect.timestamp_value(now),
    ];
    let one_statement = |sql: &str, bound: Option<Value>| {
        let mut values = leasing.to_vec();
        values.extend(due.iter().cloned());
        values.push(Value::from(limit));
        values.extend(bound);
        Statement::from_sql_and_values(backend, sql, values)
    };
    Ok(match dialect.outbox_claim() {
        OutboxClaimSql::InTransaction(sql, options) => {
            let bound = Value::from(format!("{}ms", silence.as_millis()));
            ClaimPlan::InTransaction(one_statement(sql, Some(bound)), options)
        }
        OutboxClaimSql::ReadLeaseReadBack {
            candidates,
            lease,
            leased,
        } => {
            let mut values = due.to_vec();
            values.push(Value::from(limit.saturating_mul(CANDIDATES_PER_ROW)));
            ClaimPlan::ReadLeaseReadBack(ReadLeaseReadBack {
                candidates: Statement::from_sql_and_values(backend, candidates, values),
                lease,
                leased,
                leasing,
                due,
                limit,
                token,
            })
        }
        OutboxClaimSql::ReadThenLease {
            read,
            lease,
            options,
        } => {
            let mut values = due.to_vec();
            values.push(Value::from(limit));
            ClaimPlan::ReadThenLease(ReadThenLease {
                read: Statement::from_sql_and_values(backend, read, values),
                lease,
                leasing,
                options,
            })
        }
    })
}

/// Whether the relay sends a settle of one statement on its own on `backend` (see
/// [`Dialect::outbox_settle_alone`](super::dialect::Dialect::outbox_settle_alone)).
pub(crate) fn settle_alone(backend: DbBackend) -> Result<bool, InboxError> {
    Ok(dialect(backend)?.outbox_settle_alone())
}

/// Marks the rows `ids` sent at `sent_at`, fenced by the claim `token`: a row another
/// relay has claimed since (this lease ended) is not touched, and the rows-affected count
/// says how many were still this claim's.
pub(crate) fn mark_sent_statement(
    backend: DbBackend,
    ids: &[i64],
    sent_at: DateTime<Utc>,
    token: Uuid,
) -> Result<Statement, InboxError> {
    let dialect = dialect(backend)?;
    let mut values = vec![dialect.timestamp_value(sent_at), Value::from(token)];
    values.extend(ids.iter().map(|id| Value::from(*id)));
    Ok(Statement::from_sql_and_values(
        backend,
        dialect.outbox_mark_sent(ids.len()),
        values,
    ))
}

/// What a failed publish writes into its row.
#[derive(Clone, Copy)]
pub(crate) struct Failure<'a> {
    pub(crate) id: i64,
    pub(crate) token: Uuid,
    pub(crate) retry_at: DateTime<Utc>,
    pub(crate) error: &'a str,
    /// Set when the row used its last attempt (or the broker refused it for good).
    pub(crate) dead_at: Option<DateTime<Utc>>,
}

/// What the relay stores for a failed publish whose own error text the database refused
/// even as [`storable_error`] made it (a trigger, a column changed by hand): plain ASCII,
/// short, so that the row's attempt is still counted and the row parked in time.
pub(crate) const UNSTORABLE_ERROR: &str = "the publish failed, but the database refused to store its error text; the relay logged it (tracing warning)";

/// `error` as the `last_error` column can hold it on every backend: NUL (which
/// PostgreSQL's text refuses) replaced by U+FFFD, and a text longer than
/// [`LAST_ERROR_MAX_CHARS`] (MariaDB's TEXT stops at 65,535 bytes) cut on a character
/// boundary, ending with a note of how much was cut.
pub(crate) fn storable_error(error: &str) -> Cow<'_, str> {
    let total = error.chars().count();
    let cut = total > LAST_ERROR_MAX_CHARS;
    if !cut && !error.contains('\0') {
        return Cow::Borrowed(error);
    }
    let mut stored: String = if cut {
        let note = format!(" ... (cut: {total} characters, stored up to {LAST_ERROR_MAX_CHARS})");
        let kept = LAST_ERROR_MAX_CHARS.saturating_sub(note.chars().count());
        let mut head: String = error.chars().take(kept).collect();
        head.push_str(&note);
        head
    } else {
        error.to_owned()
    };
    if stored.contains('\0') {
        stored = stored.replace('\0', "\u{FFFD}");
    }
    Cow::Owned(stored)
}

/// Records a failed publish, fenced by the claim's token: the error (as
/// [`storable_error`] makes it), the next retry time, and the parking of a row that used
/// its last attempt. The lease ends.
pub(crate) fn mark_failed_statement(
    backend: DbBackend,
    failure: Failure<'_>,
) -> Result<Statement, InboxError> {
    let dialect = dialect(backend)?;
    Ok(Statement::from_sql_and_values(
        backend,
        dialect.outbox_mark_failed(),
        [
            dialect.timestamp_value(failure.retry_at),
            Value::from(storable_error(failure.error).into_owned()),
            failure
                .dead_at
                .map_or(Value::ChronoDateTimeUtc(None), |at| {
                    dialect.timestamp_value(at)
                }),
            Value::from(failure.id),
            Value::from(failure.token),
        ],
    ))
}

/// Gives the rows `ids` that the claim `token` did not get to publish back at once: lease
/// ended, attempt not counted.
pub(crate) fn release_statement(
    backend: DbBackend,
    ids: &[i64],
    token: Uuid,
) -> Result<Statement, InboxError> {
    let sql = dialect(backend)?.outbox_release(ids.len());
    let mut values = vec![Value::from(token)];
    values.extend(ids.iter().map(|id| Value::from(*id)));
    Ok(Statement::from_sql_and_values(backend, sql, values))
}

/// Puts the dead row of `message_id` back in line: not dead, attempts from zero, due at
/// `now`, its first publish time cleared (sending it again is the operator's decision, so
/// its next publish carries a fresh send time). Its last error stays for the record until
/// the next publish.
pub(crate) fn requeue_statement(
    backend: DbBackend,
    message_id: Uuid,
    now: DateTime<Utc>,
) -> Result<Statement, InboxError> {
    let dialect = dialect(backend)?;
    Ok(Statement::from_sql_and_values(
        backend,
        dialect.outbox_requeue(),
        [dialect.timestamp_value(now), Value::from(message_id)],
    ))
}

/// One purge batch: at most `batch` rows sent before `cutoff`.
pub(crate) fn purge_sent_statement(
    backend: DbBackend,
    cutoff: DateTime<Utc>,
    batch: i64,
) -> Result<Statement, InboxError> {
    let dialect = dialect(backend)?;
    Ok(Statement::from_sql_and_values(
        backend,
        dialect.outbox_purge_batch(),
        [dialect.timestamp_value(cutoff), Value::from(batch)],
    ))
}

/// Counts the rows waiting to be published (unsent, not dead) and the dead rows.
pub(crate) fn backlog_statement(backend: DbBackend) -> Result<Statement, InboxError> {
    Ok(Statement::from_string(
        backend,
        dialect(backend)?.outbox_backlog(),
    ))
}

/// The SQL that wakes relays listening on `channel` in other processes, to send with
/// `execute_unprepared` (it has no binds); `None` where `backend` has no notification
/// channel.
pub(crate) fn notify_sql(backend: DbBackend, channel: &str) -> Result<Option<String>, InboxError> {
    Ok(dialect(backend)?.outbox_notify(channel))
}

#[cfg(test)]
mod tests {
    use super::{LAST_ERROR_MAX_CHARS, storable_error};

    #[test]
    fn a_storable_error_is_cut_on_a_character_boundary_and_says_so() {
        let error = "€".repeat(LAST_ERROR_MAX_CHARS + 1);
        let stored = storable_error(&error);
        assert_eq!(stored.chars().count(), LAST_ERROR_MAX_CHARS);
        assert!(stored.starts_with('€'));
        assert!(
            stored.ends_with(&format!(
                " ... (cut: {} characters, stored up to {LAST_ERROR_MAX_CHARS})",
                LAST_ERROR_MAX_CHARS + 1
            )),
            "{stored}"
        );
    }

    #[test]
    fn a_storable_error_holds_no_nul_and_is_left_alone_otherwise() {
        assert_eq!(storable_error("a\0b"), "a\u{FFFD}b");
        let exact = "x".repeat(LAST_ERROR_MAX_CHARS);
        assert_eq!(storable_error(&exact), exact.as_str());
    }
}
