//! The one proof, before COMMIT, that a claim's transaction still holds what it claimed.
//!
//! The database can end a transaction under its caller: PostgreSQL aborts it after any
//! failed statement and answers COMMIT with ROLLBACK; MySQL/MariaDB roll it back on a
//! deadlock or, on Galera, when another node's write set wins a conflict, and run the
//! connection's next statements outside it. A plain COMMIT then "succeeds" with none of
//! the claim's markers committed, and acking the message would lose it. Every commit of a
//! claim ([`ClaimedMessage::commit`](crate::ClaimedMessage::commit),
//! [`BatchClaim::commit`](crate::BatchClaim::commit), `Inbox::process` and
//! `Inbox::process_batch` when they cannot tell) first reads one of its markers through
//! the transaction, here.

use crate::backend::{batch_marker_held_sql, marker_held_statement, roll_back, transaction_ended};
use crate::silence::within;
use crate::{Inbox, InboxError, MessageId};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbErr, Statement, Value};
use sea_orm_inbox_entity::InboxTable;
use std::time::Duration;
use uuid::Uuid;

/// What a claim's transaction must still see before its COMMIT, and what a lost claim
/// reports: borrowed from the [`ClaimedMessage`](crate::ClaimedMessage) or
/// [`BatchClaim`](crate::BatchClaim) that recorded it, never from a list the caller can
/// change.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Held<'a> {
    table: &'a InboxTable,
    consumer: &'a str,
    marker: Marker<'a>,
}

/// How the proof finds the claim's marker.
#[derive(Clone, Copy, Debug)]
enum Marker<'a> {
    /// The one row a message's claim inserted, by its id; with `Inbox::process`'s token,
    /// by that too.
    Row {
        id: i64,
        message_id: MessageId,
        token: Option<Uuid>,
    },
    /// The rows a batch inserted, each carrying the batch's tag: one of them stands for
    /// all, as a rollback takes every one or none. Empty when the batch inserted none.
    Tagged {
        inserted: &'a [MessageId],
        tag: Uuid,
    },
}

/// A step of [`Held::commit`] that went unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The proof: nothing was committed.
    Proof,
    /// The COMMIT after the proof: it may have landed.
    Commit,
}

impl<'a> Held<'a> {
    /// The marker row `id` that the claim of `message_id` inserted, with the token
    /// `Inbox::process` wrote into it.
    pub(crate) fn row(
        table: &'a InboxTable,
        consumer: &'a str,
        message_id: MessageId,
        id: i64,
        token: Option<Uuid>,
    ) -> Self {
        Self {
            table,
            consumer,
            marker: Marker::Row {
                id,
                message_id,
                token,
            },
        }
    }

    /// The markers a batch inserted for `inserted`, tagged with `tag`.
    pub(crate) fn tagged(
        table: &'a InboxTable,
        consumer: &'a str,
        inserted: &'a [MessageId],
        tag: Uuid,
    ) -> Self {
        Self {
            table,
            consumer,
            marker: Marker::Tagged { inserted, tag },
        }
    }

    /// Proves that `conn`, the claim's transaction, still holds the claim.
    ///
    /// One rule for every failure of the check, transient or not: [`InboxError::ClaimLost`]
    /// carrying it as `source`. Whatever failed, the caller rolls back and nothing of the
    /// claim commits, which `ClaimLost` says for certain, while `InboxError::Database` is
    /// also what a failed COMMIT returns, whose work may have landed. The source keeps
    /// what a retry needs: [`crate::classify`] still calls a lost connection transient
    /// through [`InboxError::db_err`], so `Inbox::process` retries it as before.
    ///
    /// # Errors
    /// [`InboxError::ClaimLost`], or the backend's error when the inbox cannot use it.
    pub(crate) async fn prove<C: ConnectionTrait>(&self, conn: &C) -> Result<(), InboxError> {
        match self.visible(conn).await? {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.lost(None)),
            Err(err) => Err(self.lost(Some(err))),
        }
    }

    /// Whether `conn` still sees the claim's marker and, where a marker can be mistaken for
    /// another's or there is none, whether its transaction is still open.
    async fn visible<C: ConnectionTrait>(
        &self,
        conn: &C,
    ) -> Result<Result<bool, DbErr>, InboxError> {
        let backend = conn.get_database_backend();
        let seen = match self.marker {
            Marker::Row {
                id,
                message_id,
                token,
            } => {
                let statement = marker_held_statement(
                    backend,
                    self.table,
                    id,
                    message_id,
                    self.consumer,
                    token,
                )?;
                conn.query_one_raw(statement).await.map(|row| row.is_some())
            }
            Marker::Tagged {
                inserted: [first, ..],
                tag,
            } => {
                let values = [
                    Value::from(first.as_uuid()),
                    Value::from(self.consumer),
                    Value::from(tag),
                ];
                let statement = Statement::from_sql_and_values(
                    backend,
                    batch_marker_held_sql(backend, self.table)?,
                    values,
                );
                count(conn, statement).await.map(|markers| markers == 1)
            }
            // No row to miss: whether the transaction is still open tells alone.
            Marker::Tagged { inserted: [], .. } => Ok(true),
        };
        let asks_if_open = matches!(
            self.marker,
            Marker::Row { token: None, .. } | Marker::Tagged { inserted: [], .. }
        );
        Ok(match seen {
            // A row without a token may be another replica's marker that took the id of
            // this transaction's rolled-back one (SQLite reuses it); a batch that inserted
            // nothing has no row to read, and SQLite's COMMIT outside a transaction fails,
            // stranding the connection inside sqlx's count. Either way: is it still open?
            Ok(true) if asks_if_open => transaction_ended(conn).await.map(|ended| !ended),
            seen => seen,
        })
    }

    /// The error of this claim lost, with what the check met.
    pub(crate) fn lost(&self, source: Option<DbErr>) -> InboxError {
        let message_ids = match self.marker {
            Marker::Row { message_id, .. } => vec![message_id],
            Marker::Tagged { inserted, .. } => inserted.to_vec(),
        };
        InboxError::ClaimLost {
            message_ids,
            consumer: self.consumer.to_owned(),
            source,
        }
    }

    /// Proves the claim through `txn`, the caller's transaction, then commits it: each
    /// step waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] for the database (no option
    /// changes it on a caller's transaction), past which `silent` makes the error. A lost
    /// claim rolls back; an unanswered proof drops the transaction instead, giving its
    /// connection up rather than awaiting a ROLLBACK the silent database would not answer
    /// either. `failed` makes the error of a COMMIT that failed.
    pub(crate) async fn commit(
        &self,
        txn: DatabaseTransaction,
        silent: impl Fn(Step, Duration) -> InboxError,
        failed: impl FnOnce(DbErr) -> InboxError,
    ) -> Result<(), InboxError> {
        let backend = txn.get_database_backend();
        let timeout = Inbox::DEFAULT_PARTITION_TIMEOUT;
        let proven = within(backend, timeout, self.prove(&txn))
            .await
            .map_err(|waited| silent(Step::Proof, waited))?;
        if let Err(lost) = proven {
            roll_back(txn).await;
            return Err(lost);
        }
        within(backend, timeout, txn.commit())
            .await
            .map_err(|waited| silent(Step::Commit, waited))?
            .map_err(failed)
    }
}

/// The one count `statement` reads.
async fn count<C: ConnectionTrait>(conn: &C, statement: Statement) -> Result<i64, DbErr> {
    conn.query_one_raw(statement)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("the count of the batch's marker".into()))?
        .try_get_by_index(0)
}
