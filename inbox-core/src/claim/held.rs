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

use crate::backend::{
    batch_marker_held_sql, marker_held_statement, roll_back, savepoint_missing_in_open_transaction,
    transaction_ended,
};
use crate::silence::StepTimer;
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
    /// The [`ClaimSavepoint`] a claim on the caller's transaction opened: its release is
    /// the proof.
    savepoint: Option<ClaimSavepoint>,
}

/// The savepoint a claim on a caller's transaction opens right after its INSERT, named
/// uniquely for that claim. Only the transaction that opened it can release it, and it is
/// gone once the database ended that transaction (or rolled it back past the claim), so
/// its `RELEASE` proves in one statement that the transaction being committed is the
/// claiming one and still holds the marker. A proof that only read the marker passed in
/// any later transaction once the claiming one had committed on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ClaimSavepoint(Uuid);

impl ClaimSavepoint {
    /// Opens a new claim savepoint in `conn`, the claim's transaction.
    pub(crate) async fn open<C: ConnectionTrait>(conn: &C) -> Result<Self, DbErr> {
        let savepoint = Self(Uuid::new_v4());
        savepoint.reopen(conn).await?;
        Ok(savepoint)
    }

    async fn reopen<C: ConnectionTrait>(&self, conn: &C) -> Result<(), DbErr> {
        conn.execute_unprepared(&format!("SAVEPOINT {}", self.name()))
            .await
            .map(|_| ())
    }

    async fn release<C: ConnectionTrait>(&self, conn: &C) -> Result<(), DbErr> {
        conn.execute_unprepared(&format!("RELEASE SAVEPOINT {}", self.name()))
            .await
            .map(|_| ())
    }

    /// Letters, digits and underscores only: a valid unquoted identifier everywhere.
    fn name(&self) -> String {
        format!("inbox_claim_{}", self.0.simple())
    }
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
            savepoint: None,
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
            savepoint: None,
        }
    }

    /// The same claim, proven by releasing `savepoint` (`None`: by reading its marker).
    pub(crate) fn with_savepoint(self, savepoint: Option<ClaimSavepoint>) -> Self {
        Self { savepoint, ..self }
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
        if let Some(savepoint) = self.savepoint {
            return match savepoint.release(conn).await {
                Ok(()) => Ok(()),
                Err(refused) => Err(self.unreleased(conn, refused).await?),
            };
        }
        match self.visible(conn).await? {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.lost(None)),
            Err(err) => Err(self.lost(Some(err))),
        }
    }

    /// [`prove`](Self::prove), and then the claim savepoint opened again, so that the claim
    /// can be proven once more (by its commit).
    pub(crate) async fn vouch<C: ConnectionTrait>(&self, conn: &C) -> Result<(), InboxError> {
        self.prove(conn).await?;
        match self.savepoint {
            Some(savepoint) => savepoint
                .reopen(conn)
                .await
                .map_err(|err| self.lost(Some(err))),
            None => Ok(()),
        }
    }

    /// Why `conn` could not release the claim savepoint (`refused`): another transaction
    /// than the claiming one when it is open and sees the claim's marker; otherwise the
    /// database ended the claiming transaction, or rolled it back past the claim.
    async fn unreleased<C: ConnectionTrait>(
        &self,
        conn: &C,
        refused: DbErr,
    ) -> Result<InboxError, InboxError> {
        if savepoint_missing_in_open_transaction(conn.get_database_backend(), &refused) {
            return Ok(self.not_claiming());
        }
        if let Marker::Tagged { inserted: [], .. } = self.marker {
            // No marker to tell the claiming transaction by.
            return Ok(self.lost(Some(refused)));
        }
        Ok(match self.visible(conn).await? {
            Ok(true) => self.not_claiming(),
            Ok(false) => self.lost(None),
            Err(err) => self.lost(Some(err)),
        })
    }

    /// The error of a proof given another transaction than the claiming one.
    pub(crate) fn not_claiming(&self) -> InboxError {
        InboxError::NotTheClaimingTransaction {
            message_ids: self.message_ids(),
            consumer: self.consumer.to_owned(),
        }
    }

    fn message_ids(&self) -> Vec<MessageId> {
        match self.marker {
            Marker::Row { message_id, .. } => vec![message_id],
            Marker::Tagged { inserted, .. } => inserted.to_vec(),
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
        InboxError::ClaimLost {
            message_ids: self.message_ids(),
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
        timer: &mut StepTimer,
        silent: impl Fn(Step, Duration) -> InboxError,
        failed: impl FnOnce(DbErr) -> InboxError,
    ) -> Result<(), InboxError> {
        let proven = timer
            .within(
                txn.get_database_backend(),
                Inbox::DEFAULT_PARTITION_TIMEOUT,
                self.prove(&txn),
            )
            .await
            .map_err(|waited| silent(Step::Proof, waited))?;
        if let Err(lost) = proven {
            roll_back(txn).await;
            return Err(lost);
        }
        Self::commit_unproven(txn, timer, silent, failed).await
    }

    /// Commits `txn`, whose claim is already known to be held, waiting at most
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`] on `timer`, the one the commit's earlier steps
    /// used (past which `silent` makes the error; a COMMIT that failed, `failed`).
    pub(crate) async fn commit_unproven(
        txn: DatabaseTransaction,
        timer: &mut StepTimer,
        silent: impl Fn(Step, Duration) -> InboxError,
        failed: impl FnOnce(DbErr) -> InboxError,
    ) -> Result<(), InboxError> {
        timer
            .within(
                txn.get_database_backend(),
                Inbox::DEFAULT_PARTITION_TIMEOUT,
                txn.commit(),
            )
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
