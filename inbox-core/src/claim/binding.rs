//! What ties a claim to the transaction that made it, so that its commit proves it is
//! given back that transaction: a savepoint on a caller's [`DatabaseTransaction`] (its
//! `RELEASE` is the proof, one round trip after the INSERT and one before COMMIT), or,
//! on an [`ObservedTransaction`] begun with [`ObservedTransaction::begin_on`], the
//! transaction's identity, checked in memory. Such a transaction also sees every
//! statement's result, so a commit after statements that all succeeded runs COMMIT alone.

use super::held::{ClaimSavepoint, Held, Step};
use crate::backend::{
    CLAIM_TRANSACTION, ConnectionBoundsKnown, SilentEnds, begin_to_completion, roll_back,
};
use crate::observed::{Binding, ObservedTransaction, Verdict};
use crate::silence::{StepTimer, bound_for};
use crate::{Inbox, InboxError};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr};
use std::sync::LazyLock;
use std::time::Duration;

/// How a claim proves, at its commit, that it is given the transaction that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ClaimBinding {
    /// The savepoint the claim opened in a caller's [`DatabaseTransaction`].
    Savepoint(ClaimSavepoint),
    /// The identity of the [`ObservedTransaction`] the claim was made on.
    Observed(Binding),
}

impl ClaimBinding {
    /// Binds a claim just made on `conn`: to `observed`, the identity of the transaction,
    /// when it has one (no statement), otherwise to a new savepoint.
    pub(crate) async fn make<C: ConnectionTrait>(
        conn: &C,
        observed: Option<Binding>,
    ) -> Result<Self, DbErr> {
        Ok(match observed {
            Some(binding) => Self::Observed(binding),
            None => Self::Savepoint(ClaimSavepoint::open(conn).await?),
        })
    }

    /// The savepoint whose release proves the claim, if that is how it is bound.
    pub(crate) fn savepoint(binding: Option<Self>) -> Option<ClaimSavepoint> {
        match binding {
            Some(Self::Savepoint(savepoint)) => Some(savepoint),
            Some(Self::Observed(_)) | None => None,
        }
    }
}

/// The transaction a [`ClaimedMessage`](crate::ClaimedMessage) or
/// [`BatchClaim`](crate::BatchClaim) commits: the one its claim was made on, a
/// [`DatabaseTransaction`] or an [`ObservedTransaction`] (both convert into it, so
/// `claimed.commit(txn)` takes either).
#[derive(Debug)]
pub struct ClaimingTransaction(Given);

#[derive(Debug)]
enum Given {
    Plain(DatabaseTransaction),
    Observed(ObservedTransaction),
}

impl From<DatabaseTransaction> for ClaimingTransaction {
    fn from(txn: DatabaseTransaction) -> Self {
        Self(Given::Plain(txn))
    }
}

impl From<ObservedTransaction> for ClaimingTransaction {
    fn from(txn: ObservedTransaction) -> Self {
        Self(Given::Observed(txn))
    }
}

/// Whether a pool's server can end a transaction silently, for every transaction begun
/// with [`ObservedTransaction::begin_on`] (remembered per pool, as for `Inbox::process`).
static SILENT_ENDS: LazyLock<SilentEnds> = LazyLock::new(SilentEnds::default);

/// Whether a pool's connections carry the bounds of an [`Inbox`] with the default
/// timeouts ([`crate::bound_connections`]), for the same transactions.
static CONNECTION_BOUNDS: LazyLock<ConnectionBoundsKnown> =
    LazyLock::new(ConnectionBoundsKnown::default);

impl ObservedTransaction {
    /// Begins a transaction on `db` for the manual path (with [`CLAIM_TRANSACTION`]'s
    /// options), whose claims commit without a proof query when every statement
    /// succeeded: BEGIN, the marker INSERT, the handler's statements and COMMIT, nothing
    /// else. The claim on a plain [`DatabaseTransaction`] costs two statements more (a
    /// savepoint after the INSERT, its release before COMMIT), because nothing tells its
    /// commit whether a statement failed or which transaction it is given.
    ///
    /// The transaction sees each statement's result as it does in
    /// [`Inbox::process`]: once a failed statement made the database end the transaction,
    /// later statements fail instead of running outside it and the claim's commit fails
    /// with [`InboxError::ClaimLost`]; after a failed statement the transaction survived,
    /// or a statement it cannot see through (transaction control, several statements in
    /// one string), the commit proves the marker first. On a Galera node, which can end a
    /// transaction without failing a statement, it always proves (one read per pool
    /// every ten seconds tells, before BEGIN). On a pool whose connections carry the
    /// bounds of an [`Inbox`] with the default timeouts ([`crate::bound_connections`]),
    /// the marker INSERT sets none (PostgreSQL's carries two `set_config` calls
    /// otherwise). Roll it back with
    /// [`TransactionSession::rollback`](sea_orm::TransactionSession::rollback), or drop it.
    ///
    /// ```
    /// use sea_orm_inbox::prelude::*;
    /// use sea_orm::{ConnectionTrait, TransactionSession};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_migration::MigratorTrait;
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// # sea_orm_inbox_migration::Migrator::up(&db, None).await?;
    /// # db.execute_unprepared("CREATE TABLE account (balance INTEGER NOT NULL)").await?;
    /// let txn = ObservedTransaction::begin_on(&db).await?;
    /// match txn.claim_message(uuid::Uuid::new_v4(), "billing.credit").await? {
    ///     Claim::Claimed(claimed) => {
    ///         txn.execute_unprepared("UPDATE account SET balance = balance + 10").await?;
    ///         claimed.commit(txn).await?; // every statement succeeded: COMMIT alone
    ///     }
    ///     Claim::Duplicate | Claim::Refused(_) => txn.rollback().await?,
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The [`DbErr`] of a failed BEGIN.
    pub async fn begin_on(db: &DatabaseConnection) -> Result<Self, DbErr> {
        let bound = bound_for(db.get_database_backend(), Inbox::DEFAULT_PARTITION_TIMEOUT);
        let silent_end = SILENT_ENDS.possible(db, bound).await;
        let bounded_connection = CONNECTION_BOUNDS
            .carried(
                db,
                Inbox::DEFAULT_LOCK_TIMEOUT,
                Inbox::DEFAULT_PARTITION_TIMEOUT,
                bound,
            )
            .await;
        let txn = begin_to_completion(db, CLAIM_TRANSACTION).await?;
        let binding = Binding::new(silent_end, bounded_connection);
        Ok(Self::bound(txn, Some(binding)))
    }
}

/// Commits `given` for the claim `held`, bound by `binding`: COMMIT alone when it is the
/// observed transaction the claim was made on and every statement succeeded (on a server
/// that cannot end a transaction silently); otherwise the proof first, as on a plain
/// transaction. Another transaction than the claiming one is rolled back. Every step
/// (settling, which waits only for a statement the caller left in flight, the proof when
/// one is needed, and COMMIT) runs on `timer`, the one the claim ran on.
pub(crate) async fn commit_claim(
    held: Held<'_>,
    binding: Option<ClaimBinding>,
    given: ClaimingTransaction,
    timer: &mut StepTimer,
    silent: impl Fn(Step, Duration) -> InboxError,
    failed: impl FnOnce(DbErr) -> InboxError,
) -> Result<(), InboxError> {
    let observed = match given.0 {
        Given::Plain(txn) => {
            if let Some(ClaimBinding::Observed(_)) = binding {
                roll_back(txn).await;
                return Err(held.not_claiming());
            }
            return held.commit(txn, timer, silent, failed).await;
        }
        Given::Observed(observed) => observed,
    };
    let given = observed.binding();
    let (txn, verdict) = timer
        .within(
            observed.get_database_backend(),
            Inbox::DEFAULT_PARTITION_TIMEOUT,
            observed.settle(),
        )
        .await
        .map_err(|waited| silent(Step::Proof, waited))?
        .map_err(|err| held.lost(Some(err)))?;
    if let Verdict::Ended(ending) = verdict {
        roll_back(txn).await;
        return Err(held.lost(Some(ending)));
    }
    match binding {
        Some(ClaimBinding::Observed(claimed)) if given != Some(claimed) => {
            roll_back(txn).await;
            Err(held.not_claiming())
        }
        // The claiming transaction, every statement of which succeeded: it holds the marker.
        Some(ClaimBinding::Observed(claimed))
            if verdict == Verdict::Clean && !claimed.silent_end =>
        {
            Held::commit_unproven(txn, timer, silent, failed).await
        }
        _ => held.commit(txn, timer, silent, failed).await,
    }
}
