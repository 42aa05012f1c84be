//! The claim of one message: the marker INSERT and the [`ClaimedMessage`] that commits it.

use super::Claim;
use super::binding::{ClaimBinding, ClaimingTransaction, commit_claim};
use super::held::{Held, Step};
use crate::backend::{
    DbErrorKind, ProcessMarker, claim_marker_statement, classify_in, inbox_duplicate_confirmation,
    run_marker_insert,
};
use crate::clock::now_micros;
use crate::consumer::validate_claim;
use crate::silence::{ClaimTimer, StepTimer, within};
use crate::{Inbox, InboxError, MessageId};
use sea_orm::sea_query::{Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, DbErr};
use sea_orm_inbox_entity::{InboxTable, inbox};
use std::future::Future;
use std::time::Duration;
use uuid::Uuid;

/// The marker this transaction inserted: proof of a won claim, and the way to commit it.
///
/// A transaction can lose its marker before COMMIT without the caller noticing: on
/// PostgreSQL any failed statement aborts the transaction, and a later `COMMIT` answers
/// `ROLLBACK` without an error; on MySQL/MariaDB a deadlock (1213) rolls the whole
/// transaction back, marker included, and the statements after it run outside it. (A lock
/// wait timeout, 1205, rolls back only the statement that waited, unless the server runs
/// with `innodb_rollback_on_timeout = ON`: the marker and the earlier writes stay.) A
/// handler that swallows such an error and commits has committed nothing of the claim,
/// and acking the message then loses it. [`commit`](Self::commit) first proves that the
/// transaction still holds the marker (the `RELEASE` of the savepoint the claim opened,
/// one statement), and fails with [`InboxError::ClaimLost`] (nack) instead of committing
/// otherwise.
///
/// What the check cannot undo: statements that ran *outside* the transaction after the
/// database ended it. On MySQL/MariaDB with the default `autocommit = 1`, the statements
/// the handler runs after InnoDB rolled its transaction back on a deadlock commit one by
/// one, and stay committed although the message is nacked (measured on MariaDB 10.11).
/// On a pool whose connections run with `autocommit = 0` (for example `SET SESSION
/// autocommit = 0` in an after-connect hook of a pool used only for handlers) they start a
/// new transaction instead, which the rollback after the failed check undoes; the library
/// does not switch autocommit itself, as that costs two round trips per message on a
/// shared pool. Return database errors from the handler instead of swallowing them.
///
/// ```
/// use sea_orm_inbox::prelude::*;
/// use sea_orm::{ConnectionTrait, TransactionTrait};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_migration::MigratorTrait;
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
/// let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
/// match txn.claim_message(uuid::Uuid::new_v4(), "billing.credit").await? {
///     Claim::Claimed(claimed) => {
///         // business writes through `txn`
///         claimed.commit(txn).await?; // proves the marker is still held, then commits
///     }
///     Claim::Duplicate => txn.rollback().await?,
///     Claim::Refused(_) => txn.rollback().await?, // dead-letter: sent before the floor
/// }
/// # Ok(()) }
/// ```
///
/// The claim must be matched: a [`Claim`] is not a `ClaimedMessage`, so ignoring the
/// duplicate case does not compile.
///
/// ```compile_fail
/// use sea_orm_inbox::prelude::*;
/// # async fn handler(txn: sea_orm::DatabaseTransaction) -> Result<(), InboxError> {
/// let claimed: ClaimedMessage = txn.claim_message(uuid::Uuid::new_v4(), "billing").await?;
/// claimed.commit(txn).await
/// # }
/// ```
///
/// A `ClaimedMessage` is the proof of one transaction's claim: only a claim makes one and
/// [`commit`](Self::commit) consumes it. It proves only the transaction that made it: the
/// claim opens a savepoint named for it right after the marker INSERT (one more round
/// trip), and the proof is that savepoint's `RELEASE`, which no other transaction can do
/// (and which fails once the database ended the claiming transaction). Given another
/// transaction (one begun after the claiming one committed on its own, or one that claimed
/// something else), `commit` rolls it back and fails with
/// [`InboxError::NotTheClaimingTransaction`]: a marker committed earlier is visible to
/// every later transaction, so reading it proved nothing. A claim made on an
/// [`ObservedTransaction::begin_on`](crate::ObservedTransaction::begin_on) opens no
/// savepoint: it is bound to that transaction in memory, and its commit runs COMMIT alone
/// when every statement succeeded. It is not `Clone` (nor is
/// [`Claim`]) either:
///
/// ```compile_fail
/// use sea_orm_inbox::prelude::*;
/// # async fn twice(claimed: ClaimedMessage, a: sea_orm::DatabaseTransaction, b: sea_orm::DatabaseTransaction) {
/// let copy = claimed.clone();
/// claimed.commit(a).await;
/// copy.commit(b).await; // would apply b's writes under the marker a committed
/// # }
/// ```
#[must_use = "commit the work with ClaimedMessage::commit, which proves the marker is still held"]
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct ClaimedMessage {
    /// The table the marker is in.
    table: InboxTable,
    message_id: MessageId,
    consumer: String,
    marker_id: i64,
    /// The `claim_token` the marker was written with (by `Inbox::process` only), which the
    /// proof checks too.
    token: Option<Uuid>,
    /// What ties the claim to the caller's transaction it was made on (not
    /// `Inbox::process`'s, which owns its transaction).
    binding: Option<ClaimBinding>,
    /// The timer the claim's steps ran on, for its commit's.
    timer: ClaimTimer,
}

impl ClaimedMessage {
    /// The claimed message.
    pub fn message_id(&self) -> MessageId {
        self.message_id
    }

    /// The consumer that claimed it.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The `id` of the marker row this transaction inserted.
    pub fn marker_id(&self) -> i64 {
        self.marker_id
    }

    /// Proves that `txn` is the transaction that claimed this message and still holds the
    /// marker: call it last before committing when you commit yourself
    /// ([`commit`](Self::commit) calls it for you). It releases the claim's savepoint and
    /// opens it again (two round trips), so the claim can still be committed through
    /// [`commit`](Self::commit).
    ///
    /// # Errors
    /// [`InboxError::NotTheClaimingTransaction`] when `txn` is not the transaction that
    /// claimed (always for a claim made on an [`ObservedTransaction`](crate::ObservedTransaction),
    /// whose commit needs no such call): commit nothing of it.
    /// [`InboxError::ClaimLost`] when the database ended the transaction (PostgreSQL
    /// aborted it after a failed statement; InnoDB rolled it back on a deadlock) or the
    /// check itself failed (its `source`: a lost connection is transient): roll back and
    /// nack.
    ///
    /// It waits at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT)
    /// for the database (PostgreSQL, MySQL/MariaDB), then fails with
    /// [`InboxError::DatabaseUnresponsive`] (step `the claim check`): drop the transaction
    /// and nack.
    pub async fn ensure_held(&self, txn: &DatabaseTransaction) -> Result<(), InboxError> {
        if let Some(ClaimBinding::Observed(_)) = self.binding {
            return Err(self.held().not_claiming());
        }
        let backend = txn.get_database_backend();
        within(
            backend,
            Inbox::DEFAULT_PARTITION_TIMEOUT,
            self.held().vouch(txn),
        )
        .await
        .map_err(|waited| self.unanswered(Step::Proof, waited))?
    }

    /// Proves that `txn` still holds this marker, then commits it.
    ///
    /// Each of the two statements waits at most
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`](crate::Inbox::DEFAULT_PARTITION_TIMEOUT) for
    /// the database (PostgreSQL, MySQL/MariaDB; there is no option to change it), so a
    /// network partition cannot hang the caller.
    ///
    /// # Errors
    /// [`InboxError::ClaimLost`] (the transaction is rolled back; nothing was committed) or
    /// [`InboxError::Database`] (the COMMIT failed): nack the message.
    /// [`InboxError::DatabaseUnresponsive`] when the database went silent: nack. With
    /// `commit_in_doubt` (step `COMMIT`) the COMMIT may have committed, its reply lost: the
    /// redelivery's claim tells, [`Claim::Duplicate`] if it did.
    pub async fn commit(mut self, txn: impl Into<ClaimingTransaction>) -> Result<(), InboxError> {
        let mut timer = std::mem::take(&mut self.timer.0);
        let failed = |source| InboxError::Database {
            message_id: self.message_id,
            consumer: self.consumer.clone(),
            source,
        };
        let silent = |step, waited| self.unanswered(step, waited);
        let held = self.held();
        commit_claim(held, self.binding, txn.into(), &mut timer, silent, failed).await
    }

    /// What the proof reads: this claim's marker row.
    pub(crate) fn held(&self) -> Held<'_> {
        Held::row(
            &self.table,
            &self.consumer,
            self.message_id,
            self.marker_id,
            self.token,
        )
        .with_savepoint(ClaimBinding::savepoint(self.binding))
    }

    /// This claim, tied to its transaction by `binding`.
    pub(super) fn bound_to(self, binding: ClaimBinding) -> Self {
        Self {
            binding: Some(binding),
            ..self
        }
    }

    /// This claim, with `timer`, the one its steps ran on, for its commit's.
    pub(super) fn timed_by(self, timer: StepTimer) -> Self {
        Self {
            timer: ClaimTimer(timer),
            ..self
        }
    }

    /// The error of a step of the commit that got no answer within `waited`.
    fn unanswered(&self, step: Step, waited: Duration) -> InboxError {
        let (step, commit_in_doubt) = match step {
            Step::Proof => ("the claim check", false),
            Step::Commit => ("COMMIT", true),
        };
        unresponsive(
            self.message_id,
            &self.consumer,
            step,
            commit_in_doubt,
            waited,
        )
    }
}

/// Awaits `future`, a statement of a claim of `message_id` for `consumer` in a caller's
/// transaction, at most [`Inbox::DEFAULT_PARTITION_TIMEOUT`] on `timer`, and reports
/// [`InboxError::DatabaseUnresponsive`] for `step` past it.
pub(super) async fn unresponsive_within<F: Future>(
    timer: &mut StepTimer,
    backend: DbBackend,
    message_id: MessageId,
    consumer: &str,
    step: &'static str,
    future: F,
) -> Result<F::Output, InboxError> {
    timer
        .within(backend, Inbox::DEFAULT_PARTITION_TIMEOUT, future)
        .await
        .map_err(|waited| unresponsive(message_id, consumer, step, false, waited))
}

/// The error of `step` of a claim of `message_id` for `consumer` in a caller's
/// transaction that got no answer within `waited`.
fn unresponsive(
    message_id: MessageId,
    consumer: &str,
    step: &'static str,
    commit_in_doubt: bool,
    waited: Duration,
) -> InboxError {
    InboxError::DatabaseUnresponsive {
        message_id,
        consumer: consumer.to_owned(),
        step,
        waited,
        commit_in_doubt,
    }
}

/// The claim itself, for any connection the crate has already proven is a transaction.
/// With `process` (from `Inbox::process`) the marker carries the call's token in
/// `claim_token` (see [`marker_token`]), bounds its lock wait where the backend allows it
/// per transaction (see [`claim_marker_statement`]), and makes the server end the
/// transaction once the client goes silent (in the same round trip as the INSERT).
pub(crate) async fn insert_marker<C: ConnectionTrait>(
    conn: &C,
    table: &InboxTable,
    message_id: MessageId,
    consumer: &str,
    process: Option<ProcessMarker>,
) -> Result<Claim, InboxError> {
    if process.is_none() {
        // `Inbox::process` checked its id before its first attempt, and its consumer when
        // the inbox was made.
        validate_claim(message_id, consumer)?;
    }
    let backend = conn.get_database_backend();
    let token = process.as_ref().map(|process| process.token);
    // With `process`, the silence bound is set no later than the INSERT: the server reads
    // it when it starts waiting for the client, and from the INSERT on the transaction
    // holds the marker's lock.
    let insert =
        claim_marker_statement(backend, table, message_id, consumer, now_micros(), process)?;
    match run_marker_insert(conn, insert).await {
        Ok(Some(marker_id)) => Ok(Claim::Claimed(ClaimedMessage {
            table: table.clone(),
            message_id,
            consumer: consumer.to_owned(),
            marker_id,
            token,
            binding: None,
            timer: ClaimTimer::default(),
        })),
        // The conflict clause met the marker of a committed claim.
        Ok(None) => Ok(Claim::Duplicate),
        Err(err) => claim_failure(conn, table, err, message_id, consumer).await,
    }
}

/// The `claim_token` of the committed marker of `(message_id, consumer)`: `None` when there
/// is no marker or it carries no token. Who wrote a marker, for a caller that lost the
/// reply to its own COMMIT. It takes a transaction, never a pool: behind a transaction
/// pooler a statement with bound values outside one fails with 26000.
pub(crate) async fn marker_token(
    conn: &DatabaseTransaction,
    table: &InboxTable,
    message_id: MessageId,
    consumer: &str,
) -> Result<Option<Uuid>, DbErr> {
    let select = Query::select()
        .column(inbox::Column::ClaimToken)
        .from(table.table_ref())
        .and_where(Expr::col(inbox::Column::MessageId).eq(message_id.as_uuid()))
        .and_where(Expr::col(inbox::Column::Consumer).eq(consumer))
        .to_owned();
    let Some(row) = conn.query_one(&select).await? else {
        return Ok(None);
    };
    row.try_get_by_index::<Option<Uuid>>(0)
}

/// What a failed marker INSERT means: `Duplicate` only when the violated index is the
/// inbox's, confirmed through `conn` (the claim's transaction, still usable after a
/// duplicate on the backends that need the check) where the error cannot tell.
async fn claim_failure<C: ConnectionTrait>(
    conn: &C,
    table: &InboxTable,
    err: DbErr,
    message_id: MessageId,
    consumer: &str,
) -> Result<Claim, InboxError> {
    if !matches!(
        classify_in(&err, table),
        DbErrorKind::InboxDuplicate | DbErrorKind::PossibleInboxDuplicate
    ) {
        return Err(InboxError::from_claim(err, table, message_id, consumer));
    }
    let backend = conn.get_database_backend();
    let Some(confirmation) = inbox_duplicate_confirmation(backend, table, message_id, consumer)?
    else {
        return Ok(Claim::Duplicate);
    };
    match conn.query_one_raw(confirmation).await {
        Ok(Some(_)) => Ok(Claim::Duplicate),
        // No marker: the index was a namesake on another table (the error's advice says so).
        Ok(None) => Err(InboxError::from_claim(err, table, message_id, consumer)),
        Err(read) => Err(InboxError::from_claim(read, table, message_id, consumer)),
    }
}
