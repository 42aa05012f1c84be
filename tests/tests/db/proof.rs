//! The pre-commit proof of a batch rests on what the claim recorded, not on the public
//! lists a caller may change: emptying `BatchClaim::claimed` does not turn it off.

use inbox_tests::{
    Backend, begin_and_claim, committed, create_accounts, credit, on_every_backend, scalar_i64,
    with_migrated_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};
use sea_orm_inbox::prelude::*;
use uuid::Uuid;

const CONSUMER: &str = "projector";

/// The database ends the batch's transaction (a raw `ROLLBACK`), the caller empties the
/// public `claimed` list and commits: still `ClaimLost`, nothing committed.
async fn emptied_claimed_list_keeps_the_batch_proof(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let ids = [Uuid::new_v4(), Uuid::new_v4()];
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let mut batch = txn.claim_batch(ids, CONSUMER).await.expect("claim");
        assert_eq!(batch.claimed.len(), 2);
        txn.execute_unprepared("ROLLBACK").await.expect("ROLLBACK");
        let taken = std::mem::take(&mut batch.claimed);
        assert_eq!(taken.len(), 2);
        let result = batch.commit(txn).await;
        assert!(
            matches!(result, Err(InboxError::ClaimLost { .. })),
            "{result:?}"
        );
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 0);
    })
    .await;
}

/// A migrated database with account 1 (balance 0).
async fn accounts(db: &inbox_tests::TestDb) -> DatabaseConnection {
    let conn = db.connect().await;
    create_accounts(&conn).await;
    conn
}

/// Whether `result` is the refusal of a proof made in another transaction.
fn refused_as_another_transactions<T: std::fmt::Debug>(result: &Result<T, InboxError>) -> bool {
    matches!(result, Err(InboxError::NotTheClaimingTransaction { .. }))
}

/// Transaction A claims a message and commits without its proof; a fresh transaction B
/// writes and is committed through A's proof. The proof must refuse B before anything of
/// B commits: before, B's write committed under A's marker on every backend.
async fn a_claims_proof_cannot_commit_another_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = accounts(db).await;
        let (txn_a, claimed) = begin_and_claim(&conn, Uuid::new_v4(), CONSUMER).await;
        txn_a.commit().await.expect("A commits on its own");
        let txn_b = conn.begin().await.expect("begin B");
        credit(&txn_b, 1).await.expect("B's write");
        let result = claimed.commit(txn_b).await;
        assert!(refused_as_another_transactions(&result), "{result:?}");
        assert_eq!(committed(&conn).await, (1, 0), "B's write is not committed");
    })
    .await;
}

/// The same through `ensure_held`, which must refuse to vouch for B.
async fn a_claims_proof_does_not_vouch_for_another_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = accounts(db).await;
        let (txn_a, claimed) = begin_and_claim(&conn, Uuid::new_v4(), CONSUMER).await;
        txn_a.commit().await.expect("A commits on its own");
        let txn_b = conn.begin().await.expect("begin B");
        let result = claimed.ensure_held(&txn_b).await;
        assert!(refused_as_another_transactions(&result), "{result:?}");
        txn_b.rollback().await.expect("rollback B");
        // A transaction that claimed something else is not the claiming one either.
        let (txn_c, _other) = begin_and_claim(&conn, Uuid::new_v4(), CONSUMER).await;
        let result = claimed.ensure_held(&txn_c).await;
        assert!(refused_as_another_transactions(&result), "{result:?}");
        txn_c.rollback().await.expect("rollback C");
    })
    .await;
}

/// A batch claimed and committed on its own cannot commit another transaction either.
async fn a_batchs_proof_cannot_commit_another_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = accounts(db).await;
        let txn_a = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin A");
        let batch = txn_a
            .claim_batch([Uuid::new_v4(), Uuid::new_v4()], CONSUMER)
            .await
            .expect("claim");
        assert_eq!(batch.claimed.len(), 2);
        txn_a.commit().await.expect("A commits on its own");
        let txn_b = conn.begin().await.expect("begin B");
        credit(&txn_b, 1).await.expect("B's write");
        let result = batch.commit(txn_b).await;
        assert!(refused_as_another_transactions(&result), "{result:?}");
        assert_eq!(committed(&conn).await, (2, 0), "B's write is not committed");
    })
    .await;
}

/// The claiming transaction still commits through its proof, after `ensure_held` and
/// with savepoints of its own.
async fn the_claiming_transaction_commits_through_its_proof(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = accounts(db).await;
        let (txn, claimed) = begin_and_claim(&conn, Uuid::new_v4(), CONSUMER).await;
        let nested = txn.begin().await.expect("savepoint");
        credit(&nested, 1).await.expect("credit");
        nested.commit().await.expect("release");
        claimed.ensure_held(&txn).await.expect("held");
        claimed.commit(txn).await.expect("commit");
        assert_eq!(committed(&conn).await, (1, 1));
    })
    .await;
}

on_every_backend!(
    emptied_claimed_list_keeps_the_batch_proof,
    a_claims_proof_cannot_commit_another_transaction,
    a_claims_proof_does_not_vouch_for_another_transaction,
    a_batchs_proof_cannot_commit_another_transaction,
    the_claiming_transaction_commits_through_its_proof,
);

/// The manual path on an [`ObservedTransaction::begin_on`]: its claim is bound to the
/// transaction in memory (no savepoint), and its commit runs no proof query after
/// statements that all succeeded. These show that it still commits only the claiming
/// transaction, and nothing of one the database ended.
mod observed {
    use super::*;
    use sea_orm::TransactionSession;

    /// A fresh id claimed on a new observed transaction.
    async fn begin_observed_and_claim(
        conn: &DatabaseConnection,
    ) -> (ObservedTransaction, ClaimedMessage) {
        let txn = ObservedTransaction::begin_on(conn).await.expect("begin");
        match txn.claim_message(Uuid::new_v4(), CONSUMER).await {
            Ok(Claim::Claimed(claimed)) => (txn, claimed),
            other => panic!("a fresh id: {other:?}"),
        }
    }

    /// A claim made on observed transaction A, which commits on its own, cannot commit
    /// transaction B (observed or plain) through its proof.
    async fn an_observed_claim_cannot_commit_another_transaction(backend: Backend) {
        with_migrated_db(backend, async |db| {
            let conn = accounts(db).await;
            let (txn_a, claimed) = begin_observed_and_claim(&conn).await;
            let batch = txn_a
                .claim_batch([Uuid::new_v4(), Uuid::new_v4()], CONSUMER)
                .await
                .expect("batch");
            txn_a.commit().await.expect("A commits on its own");
            let txn_b = ObservedTransaction::begin_on(&conn).await.expect("begin B");
            credit(&txn_b, 1).await.expect("B's write");
            let result = claimed.commit(txn_b).await;
            assert!(refused_as_another_transactions(&result), "{result:?}");
            let txn_c = conn.begin().await.expect("begin C");
            credit(&txn_c, 1).await.expect("C's write");
            let result = batch.commit(txn_c).await;
            assert!(refused_as_another_transactions(&result), "{result:?}");
            assert_eq!(committed(&conn).await, (3, 0), "B's and C's writes");
        })
        .await;
    }

    /// The database ends the claim's transaction (a raw `ROLLBACK`): the commit of its
    /// single claim and of its batch (public list emptied) fail with `ClaimLost`, and
    /// nothing commits.
    async fn an_observed_claim_in_an_ended_transaction_is_lost(backend: Backend) {
        with_migrated_db(backend, async |db| {
            let conn = accounts(db).await;
            let (txn, claimed) = begin_observed_and_claim(&conn).await;
            credit(&txn, 1).await.expect("credit");
            txn.execute_unprepared("ROLLBACK").await.ok();
            let result = claimed.commit(txn).await;
            assert!(
                matches!(result, Err(InboxError::ClaimLost { .. })),
                "{result:?}"
            );
            let txn = ObservedTransaction::begin_on(&conn).await.expect("begin");
            let mut batch = txn
                .claim_batch([Uuid::new_v4(), Uuid::new_v4()], CONSUMER)
                .await
                .expect("batch");
            txn.execute_unprepared("ROLLBACK").await.ok();
            batch.claimed.clear();
            let result = batch.commit(txn).await;
            assert!(
                matches!(result, Err(InboxError::ClaimLost { .. })),
                "{result:?}"
            );
            assert_eq!(committed(&conn).await, (0, 0));
        })
        .await;
    }

    /// A failed statement the handler swallowed: on PostgreSQL it aborted the transaction
    /// (`ClaimLost`, nothing committed); elsewhere the transaction went on, and the
    /// commit proves the marker (one query) before committing the claim and the write.
    async fn a_swallowed_failure_is_proven_or_lost(backend: Backend) {
        with_migrated_db(backend, async |db| {
            let conn = accounts(db).await;
            let (txn, claimed) = begin_observed_and_claim(&conn).await;
            credit(&txn, 1).await.expect("credit");
            let failed = txn
                .execute_unprepared("UPDATE no_such_table SET x = 1")
                .await;
            assert!(failed.is_err(), "{failed:?}");
            let result = claimed.commit(txn).await;
            if backend.is_postgres() {
                assert!(
                    matches!(result, Err(InboxError::ClaimLost { .. })),
                    "{result:?}"
                );
                assert_eq!(committed(&conn).await, (0, 0));
            } else {
                result.expect("the proof holds, the commit lands");
                assert_eq!(committed(&conn).await, (1, 1));
            }
        })
        .await;
    }

    on_every_backend!(
        an_observed_claim_cannot_commit_another_transaction,
        an_observed_claim_in_an_ended_transaction_is_lost,
        a_swallowed_failure_is_proven_or_lost,
    );
}
