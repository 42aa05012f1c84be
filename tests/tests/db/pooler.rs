//! Every public function that talks to the database, called the way the README's
//! "PgBouncer" section says (pools from `for_transaction_pooler`, the migration in one
//! transaction). Through PgBouncer in transaction pooling mode, a statement with bound
//! values that the library sent outside a transaction fails with `26000 prepared statement
//! "sqlx_s_N" does not exist`, so this walk proves that the library sends none. The
//! lost-reply paths, where a retry reads back what a lost COMMIT may have written, run
//! through PgBouncer in `lost_reply` (`pgbouncer::`).
//!
//! The same walk runs on every backend, so it stays a plain use of the API.

use inbox_tests::{Backend, on_every_backend, on_pgbouncer, scalar_i64, with_migrated_db};
use sea_orm::{DbErr, TransactionTrait};
use sea_orm_inbox::{
    CLAIM_TRANSACTION, Claim, ClaimToken, Inbox, InboxTransactionExt, LeaseClaim, LeaseOptions,
    MessageId, Outcome, RetentionPolicy, claim_lease, claim_lease_with_token, list_dead_claims,
    list_expired_leases, purge, spawn_purger, verify_schema,
};
use std::time::Duration;
use uuid::Uuid;

async fn every_public_function_sends_its_statements_in_transactions(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;

        // The startup check reads the catalog.
        verify_schema(&conn).await.unwrap();

        // One-phase claim, its pre-commit proof, its commit, and the duplicate.
        let id = Uuid::new_v4();
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let Claim::Claimed(claimed) = txn.claim_message(id, "walk.claim").await.unwrap() else {
            panic!("a new message is claimed")
        };
        claimed.ensure_held(&txn).await.unwrap();
        claimed.commit(txn).await.unwrap();
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        assert_eq!(
            txn.claim_message(id, "walk.claim").await.unwrap(),
            Claim::Duplicate
        );
        txn.rollback().await.unwrap();

        // A batch with one id claimed before and one new.
        let new = Uuid::new_v4();
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        let batch = txn.claim_batch([id, new], "walk.claim").await.unwrap();
        assert_eq!(batch.claimed, vec![MessageId::from(new)]);
        assert_eq!(batch.duplicates, vec![MessageId::from(id)]);
        batch.commit(txn).await.unwrap();

        // The whole protocol, then a redelivery.
        let inbox = Inbox::new("walk.process").unwrap();
        for expected in [Outcome::Processed(()), Outcome::Duplicate] {
            let outcome = inbox
                .process(&conn, id, |_txn| Box::pin(async { Ok::<_, DbErr>(()) }))
                .await
                .unwrap();
            assert_eq!(outcome, expected);
        }

        // Later markers, so the purge below has older ones to delete.
        tokio::time::sleep(Duration::from_millis(50)).await;

        // Two-phase claims: release, list, take over with a kept token, park, list the dead.
        let options = LeaseOptions::new(Duration::from_secs(30))
            .and_then(|options| options.with_max_attempts(2))
            .unwrap();
        let mail = Uuid::new_v4();
        let LeaseClaim::Claimed(lease) = claim_lease(&conn, mail, "walk.mailer", &options)
            .await
            .unwrap()
        else {
            panic!("a new message is claimed")
        };
        lease.release(&conn).await.unwrap();
        let expired = list_expired_leases(&conn, Some("walk.mailer"), 10)
            .await
            .unwrap();
        assert_eq!(
            expired.iter().map(|e| e.message_id).collect::<Vec<_>>(),
            [MessageId::from(mail)]
        );
        let token = ClaimToken::new();
        let LeaseClaim::TakenOver(second) =
            claim_lease_with_token(&conn, mail, "walk.mailer", &options, token)
                .await
                .unwrap()
        else {
            panic!("a released lease is taken over")
        };
        assert_eq!(second.fencing_token(), token.as_uuid());
        second.release(&conn).await.unwrap();
        assert!(matches!(
            claim_lease(&conn, mail, "walk.mailer", &options)
                .await
                .unwrap(),
            LeaseClaim::Dead(_)
        ));
        let dead = list_dead_claims(&conn, Some("walk.mailer"), 10)
            .await
            .unwrap();
        assert_eq!(
            dead.iter().map(|d| d.message_id).collect::<Vec<_>>(),
            [MessageId::from(mail)]
        );
        let receipt = Uuid::new_v4();
        let LeaseClaim::Claimed(lease) = claim_lease(&conn, receipt, "walk.mailer", &options)
            .await
            .unwrap()
        else {
            panic!("a new message is claimed")
        };
        lease.complete(&conn).await.unwrap();
        assert_eq!(
            claim_lease(&conn, receipt, "walk.mailer", &options)
                .await
                .unwrap(),
            LeaseClaim::Duplicate
        );

        // The purge (its cutoff walk and a DELETE batch), then the background purger.
        let policy = RetentionPolicy::with_window(Duration::from_millis(20))
            .and_then(|policy| policy.with_downtime_gap(Duration::from_secs(3600)))
            .unwrap();
        let report = purge(&conn, &policy).await.unwrap();
        assert!(report.cutoff.is_some(), "{report:?}");
        assert_eq!(
            report.rows, 3,
            "the claim's, the batch's and process' markers"
        );
        let purger = spawn_purger(conn.clone(), policy, Duration::from_millis(50)).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let summary = purger.shutdown().await.unwrap();
        assert!(summary.runs >= 1, "{summary:?}");
        assert_eq!(summary.failures, 0, "{:?}", summary.last_error);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 2);
    })
    .await;
}

on_every_backend!(every_public_function_sends_its_statements_in_transactions);
on_pgbouncer!(every_public_function_sends_its_statements_in_transactions);
