//! Mixing modes on one consumer: a message with an unfinished two-phase lease meets
//! `claim_message`, `claim_batch` and `Inbox::process` for the same consumer.
//!
//! The answer is `Duplicate` / already claimed, by design: a row for (message, consumer)
//! means some path owns the message, and treating it as anything else could apply the
//! effect twice (the lease holder's side effect and the handler's). The unfinished lease
//! stays the lease protocol's job: its holder completes it, and once it expires a sweeper
//! finds it with `list_expired_leases` and takes it over with `claim_lease`. Nothing of it
//! is lost to the other modes' acks.

use inbox_tests::{Backend, on_every_backend, scalar_i64, with_migrated_db};
use sea_orm::{DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{LeaseClaim, list_expired_leases};
use std::time::Duration;
use uuid::Uuid;

const CONSUMER: &str = "mailer.welcome";

async fn unfinished_lease_is_claimed_for_every_mode(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let id = MessageId::from_uuid(Uuid::new_v4());
        let options = LeaseOptions::new(Duration::from_millis(400)).expect("lease");
        let LeaseClaim::Claimed(lease) = claim_lease(&conn, id, CONSUMER, &options)
            .await
            .expect("claim lease")
        else {
            panic!("a fresh message is leased");
        };

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let claim = txn.claim_message(id, CONSUMER).await.expect("claim");
        assert!(claim.is_duplicate(), "{claim:?}");
        txn.rollback().await.expect("rollback");

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let fresh = MessageId::from_uuid(Uuid::new_v4());
        let batch = txn.claim_batch([id, fresh], CONSUMER).await.expect("batch");
        assert_eq!((batch.claimed, batch.duplicates), (vec![fresh], vec![id]));
        txn.rollback().await.expect("rollback");

        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let result = inbox
            .process(&conn, id, |_txn| {
                Box::pin(async move { Err::<(), _>(DbErr::Custom("must not run".into())) })
            })
            .await;
        assert!(matches!(result, Ok(Outcome::Duplicate)), "{result:?}");

        // The lease is untouched by the other modes: its holder could still complete it. Let
        // it expire instead (a crashed holder): the sweeper finds it and takes it over.
        let row_count = scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await;
        assert_eq!(row_count, 1, "only the lease's row");
        tokio::time::sleep(options.lease() + Duration::from_millis(300)).await;
        let expired = list_expired_leases(&conn, Some(CONSUMER), 10)
            .await
            .expect("list");
        assert_eq!(
            expired.iter().map(|e| e.message_id).collect::<Vec<_>>(),
            [id]
        );
        match claim_lease(&conn, id, CONSUMER, &options)
            .await
            .expect("take over")
        {
            LeaseClaim::TakenOver(taken) => {
                assert_eq!(taken.attempt(), 2);
                assert_eq!(taken.idempotency_key(), lease.idempotency_key());
                taken.complete(&conn).await.expect("complete");
            }
            other => panic!("expected TakenOver, got {other:?}"),
        }
        assert!(
            matches!(
                claim_lease(&conn, id, CONSUMER, &options).await,
                Ok(LeaseClaim::Duplicate)
            ),
            "completed once"
        );
    })
    .await;
}

on_every_backend!(unfinished_lease_is_claimed_for_every_mode);
