//! The pre-commit proof of a batch rests on what the claim recorded, not on the public
//! lists a caller may change: emptying `BatchClaim::claimed` does not turn it off.

use inbox_tests::{Backend, on_every_backend, scalar_i64, with_migrated_db};
use sea_orm::{ConnectionTrait, TransactionTrait};
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

on_every_backend!(emptied_claimed_list_keeps_the_batch_proof);
