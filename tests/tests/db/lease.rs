//! Leases: two-phase claims with leases, fencing tokens, takeover after
//! expiry and dead-parking, raced by replicas with their own pools.

use chrono::{DateTime, Utc};
use inbox_tests::{Backend, on_every_backend, on_pgbouncer, scalar_i64, with_migrated_db};
use sea_orm::{ColumnTrait, DatabaseConnection, EntityTrait, QueryFilter, TransactionTrait};
use sea_orm_inbox::{
    ClaimToken, InboxError, Lease, LeaseClaim, LeaseOptions, MessageId, Settlement, claim_lease,
    claim_lease_with_token, list_dead_claims, list_expired_leases,
};
use sea_orm_inbox_entity::inbox;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Barrier;
use uuid::Uuid;

const CONSUMER: &str = "mailer.welcome";

/// Sleeps until `t` has passed by a generous margin (leases here are hundreds of ms).
async fn wait_past(t: DateTime<Utc>) {
    let left = (t - Utc::now()).to_std().unwrap_or(Duration::ZERO);
    tokio::time::sleep(left + Duration::from_millis(150)).await;
}

async fn row(db: &DatabaseConnection, id: MessageId) -> inbox::Model {
    // In a transaction: a transaction pooler runs prepared statements only inside one.
    let txn = db.begin().await.expect("begin the read");
    inbox::Entity::find()
        .filter(inbox::Column::MessageId.eq(id.as_uuid()))
        .filter(inbox::Column::Consumer.eq(CONSUMER))
        .one(&txn)
        .await
        .expect("read the inbox row")
        .expect("the inbox row exists")
}

fn leased(claim: LeaseClaim) -> Lease {
    match claim {
        LeaseClaim::Claimed(lease) | LeaseClaim::TakenOver(lease) => lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

async fn two_replicas_race_a_two_phase_claim_and_call_once(backend: Backend) {
    const ROUNDS: u32 = 20;
    with_migrated_db(backend, async |db| {
        let replicas = [Arc::new(db.connect().await), Arc::new(db.connect().await)];
        let options = LeaseOptions::new(Duration::from_secs(30)).unwrap();

        for round in 0..ROUNDS {
            let id = MessageId::from_uuid(Uuid::new_v4());
            let calls = Arc::new(AtomicU32::new(0));
            let barrier = Arc::new(Barrier::new(2));
            let tasks: Vec<_> = replicas
                .iter()
                .map(|replica| {
                    let (replica, calls, barrier) = (
                        Arc::clone(replica),
                        Arc::clone(&calls),
                        Arc::clone(&barrier),
                    );
                    tokio::spawn(async move {
                        barrier.wait().await;
                        let claim = claim_lease(&replica, id, CONSUMER, &options)
                            .await
                            .expect("claim");
                        match claim {
                            LeaseClaim::Claimed(lease) => {
                                calls.fetch_add(1, Ordering::SeqCst); // the external call
                                lease.complete(&replica).await.expect("complete");
                                true
                            }
                            LeaseClaim::Held { .. } | LeaseClaim::Duplicate => false,
                            other => panic!("round {round}: unexpected {other:?}"),
                        }
                    })
                })
                .collect();
            let mut winners = 0;
            for task in tasks {
                winners += u32::from(task.await.expect("replica task"));
            }
            assert_eq!(winners, 1, "round {round} on {backend:?}: one claimant");
            assert_eq!(
                calls.load(Ordering::SeqCst),
                1,
                "round {round} on {backend:?}: the side effect ran once"
            );
            assert_eq!(
                claim_lease(&replicas[0], id, CONSUMER, &options)
                    .await
                    .expect("claim after completion"),
                LeaseClaim::Duplicate
            );
        }
        assert_eq!(
            scalar_i64(replicas[0].as_ref(), "SELECT COUNT(*) FROM inbox").await,
            i64::from(ROUNDS)
        );
        for replica in replicas {
            replica.as_ref().clone().close().await.ok();
        }
    })
    .await;
}

async fn crashed_claimant_is_taken_over_and_its_late_completion_rejected(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (a, b) = (db.connect().await, db.connect().await);
        // Long enough that the Held check below runs well inside it on a loaded machine.
        let options = LeaseOptions::new(Duration::from_secs(1)).unwrap();
        let id = MessageId::from_broker_id("welcome-mail-for-user-7").unwrap();
        let provider_keys = Mutex::new(Vec::new());

        // Replica A claims, calls the provider, and crashes before completing.
        let lease_a = match claim_lease(&a, id, CONSUMER, &options).await.unwrap() {
            LeaseClaim::Claimed(lease) => lease,
            other => panic!("expected Claimed, got {other:?}"),
        };
        assert_eq!(lease_a.attempt(), 1);
        provider_keys
            .lock()
            .unwrap()
            .push(lease_a.idempotency_key());

        // Redelivered to B while A's lease is live: B must not call the provider, and nacks
        // the message with a delay that ends when A's lease does.
        let held = claim_lease(&b, id, CONSUMER, &options).await.unwrap();
        match held {
            LeaseClaim::Held {
                attempts,
                lease_until,
            } => {
                assert_eq!(attempts, 1);
                assert_eq!(lease_until, lease_a.lease_until());
            }
            ref other => panic!("expected Held, got {other:?}"),
        }
        let Some(Settlement::Nack(Some(delay))) = Settlement::of_lease(&held) else {
            panic!("a held lease is nacked with a delay");
        };
        assert!(
            Duration::ZERO < delay && delay <= options.lease(),
            "{delay:?}"
        );

        // After the lease expires, B takes over as attempt 2 with the same idempotency key.
        wait_past(lease_a.lease_until()).await;
        let lease_b = match claim_lease(&b, id, CONSUMER, &options).await.unwrap() {
            LeaseClaim::TakenOver(lease) => lease,
            other => panic!("expected TakenOver, got {other:?}"),
        };
        assert_eq!(lease_b.attempt(), 2);
        assert_ne!(lease_b.fencing_token(), lease_a.fencing_token());
        provider_keys
            .lock()
            .unwrap()
            .push(lease_b.idempotency_key());
        lease_b.complete(&b).await.expect("B completes");

        // A wakes up and tries to record its outcome: fenced off.
        match lease_a.complete(&a).await {
            Err(InboxError::StaleLease {
                message_id,
                attempt,
                ..
            }) => {
                assert_eq!((message_id, attempt), (id, 1));
            }
            other => panic!("expected StaleLease, got {other:?}"),
        }

        let keys = provider_keys.into_inner().unwrap();
        assert_eq!(keys[0], keys[1], "one idempotency key across attempts");
        assert_eq!(keys[0], id.idempotency_key(CONSUMER));
        let saved = row(&a, id).await;
        assert_eq!(saved.attempts, 2);
        assert!(saved.processed_at.is_some());
        assert_eq!(saved.claim_token, Some(lease_b.fencing_token()));
        assert_eq!(
            claim_lease(&a, id, CONSUMER, &options).await.unwrap(),
            LeaseClaim::Duplicate
        );
    })
    .await;
}

async fn expired_lease_nobody_took_over_still_completes(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let options = LeaseOptions::new(Duration::from_millis(50)).unwrap();
        let id = MessageId::from_uuid(Uuid::new_v4());
        let lease = leased(claim_lease(&conn, id, CONSUMER, &options).await.unwrap());
        wait_past(lease.lease_until()).await;
        lease
            .complete(&conn)
            .await
            .expect("no takeover happened: the token still holds");
        lease
            .complete(&conn)
            .await
            .expect("a repeated completion by the holder is idempotent");
    })
    .await;
}

/// A lease completion whose reply was lost is retried (by `Lease::complete`'s
/// own transient retry, or by the caller) after it committed. The holder's repeat must be
/// `Ok` and keep the first `processed_at`; a stale token stays `StaleLease` before and
/// after the holder completes, and a release after completion stays refused.
async fn completion_is_idempotent_for_its_holder_only(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let options = LeaseOptions::new(Duration::from_millis(50)).unwrap();
        let id = MessageId::from_uuid(Uuid::new_v4());
        let stale = leased(claim_lease(&conn, id, CONSUMER, &options).await.unwrap());
        wait_past(stale.lease_until()).await;
        let holder = match claim_lease(&conn, id, CONSUMER, &options).await.unwrap() {
            LeaseClaim::TakenOver(lease) => lease,
            other => panic!("expected TakenOver, got {other:?}"),
        };
        let is_stale = |result: Result<(), InboxError>| {
            matches!(result, Err(InboxError::StaleLease { attempt: 1, .. }))
        };
        assert!(is_stale(stale.complete(&conn).await), "before");

        holder.complete(&conn).await.expect("the holder completes");
        let first = row(&conn, id).await.processed_at;
        assert!(first.is_some());
        holder
            .complete(&conn)
            .await
            .expect("the holder's repeated completion (after a lost reply) is Ok");
        assert_eq!(row(&conn, id).await.processed_at, first, "kept the first");

        assert!(is_stale(stale.complete(&conn).await), "after");
        assert!(
            matches!(
                holder.release(&conn).await,
                Err(InboxError::StaleLease { attempt: 2, .. })
            ),
            "a completed lease cannot be given back"
        );
    })
    .await;
}

async fn claims_are_parked_dead_after_max_attempts_and_listed(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let options = LeaseOptions::new(Duration::from_millis(200))
            .unwrap()
            .with_max_attempts(2)
            .unwrap();
        let id = MessageId::from_uuid(Uuid::new_v4());
        let healthy = MessageId::from_uuid(Uuid::new_v4());

        let first = leased(claim_lease(&conn, id, CONSUMER, &options).await.unwrap());
        let _healthy = leased(
            claim_lease(&conn, healthy, CONSUMER, &options)
                .await
                .unwrap(),
        );
        wait_past(first.lease_until()).await;
        let second = match claim_lease(&conn, id, CONSUMER, &options).await.unwrap() {
            LeaseClaim::TakenOver(lease) => lease,
            other => panic!("expected TakenOver, got {other:?}"),
        };
        assert_eq!(second.attempt(), 2);
        wait_past(second.lease_until()).await;

        let dead = match claim_lease(&conn, id, CONSUMER, &options).await.unwrap() {
            LeaseClaim::Dead(dead) => dead,
            other => panic!("expected Dead after 2 attempts, got {other:?}"),
        };
        assert_eq!((dead.message_id, dead.attempts), (id, 2));
        assert_eq!(
            claim_lease(&conn, id, CONSUMER, &options).await.unwrap(),
            LeaseClaim::Dead(dead.clone()),
            "stays parked"
        );
        assert!(matches!(
            second.complete(&conn).await,
            Err(InboxError::StaleLease { attempt: 2, .. })
        ));

        let listed = list_dead_claims(&conn, Some(CONSUMER), 10).await.unwrap();
        assert_eq!(listed, std::slice::from_ref(&dead));
        assert_eq!(list_dead_claims(&conn, None, 10).await.unwrap(), [dead]);
        assert!(
            list_dead_claims(&conn, Some("another.consumer"), 10)
                .await
                .unwrap()
                .is_empty()
        );
        let saved = row(&conn, id).await;
        assert_eq!(saved.attempts, 2);
        assert!(saved.dead_at.is_some() && saved.processed_at.is_none());
    })
    .await;
}

async fn one_phase_markers_count_as_processed_and_bad_input_is_refused(backend: Backend) {
    use sea_orm::TransactionTrait;
    use sea_orm_inbox::prelude::*;
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let options = LeaseOptions::new(Duration::from_secs(30)).unwrap();
        let id = Uuid::new_v4();
        let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
        assert!(txn.claim_message(id, CONSUMER).await.unwrap().is_claimed());
        txn.commit().await.unwrap();
        assert_eq!(
            claim_lease(&conn, id, CONSUMER, &options).await.unwrap(),
            LeaseClaim::Duplicate
        );
        assert!(matches!(
            claim_lease(&conn, Uuid::nil(), CONSUMER, &options).await,
            Err(InboxError::NilMessageId)
        ));
        assert!(matches!(
            claim_lease(&conn, Uuid::new_v4(), "", &options).await,
            Err(InboxError::EmptyConsumer)
        ));
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
    })
    .await;
}

async fn released_leases_are_listed_for_sweepers_and_taken_over_at_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let options = LeaseOptions::new(Duration::from_secs(30)).unwrap();
        let (x, y) = (
            MessageId::from_uuid(Uuid::new_v4()),
            MessageId::from_uuid(Uuid::new_v4()),
        );
        let lease_x = leased(claim_lease(&conn, x, CONSUMER, &options).await.unwrap());
        let _lease_y = leased(claim_lease(&conn, y, CONSUMER, &options).await.unwrap());
        assert!(
            list_expired_leases(&conn, None, 10)
                .await
                .unwrap()
                .is_empty()
        );

        // The provider failed: give x back instead of waiting 30 s.
        lease_x.release(&conn).await.expect("release");
        tokio::time::sleep(Duration::from_millis(10)).await;
        let expired = list_expired_leases(&conn, Some(CONSUMER), 10)
            .await
            .unwrap();
        assert_eq!(expired.len(), 1, "only x: y's lease is live");
        assert_eq!((expired[0].message_id, expired[0].attempts), (x, 1));
        assert!(
            list_expired_leases(&conn, Some("another.consumer"), 10)
                .await
                .unwrap()
                .is_empty()
        );

        let retry = match claim_lease(&conn, x, CONSUMER, &options).await.unwrap() {
            LeaseClaim::TakenOver(lease) => lease,
            other => panic!("expected TakenOver at once, got {other:?}"),
        };
        assert_eq!(retry.attempt(), 2);
        assert!(matches!(
            lease_x.release(&conn).await,
            Err(InboxError::StaleLease { attempt: 1, .. })
        ));
        assert!(
            list_expired_leases(&conn, None, 10)
                .await
                .unwrap()
                .is_empty()
        );
        retry.complete(&conn).await.unwrap();
    })
    .await;
}

/// A caller retrying a claim with its own token (after an error that may hide a committed
/// claim) gets its lease back; any other token sees it held.
async fn a_kept_token_recognises_its_own_claim(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let options = LeaseOptions::new(Duration::from_secs(30)).unwrap();
        let id = MessageId::from_uuid(Uuid::new_v4());
        let token = ClaimToken::new();
        let first = claim_lease_with_token(&conn, id, CONSUMER, &options, token)
            .await
            .unwrap();
        let lease = leased(first.clone());
        assert_eq!(lease.fencing_token(), token.as_uuid());
        assert_eq!(
            claim_lease_with_token(&conn, id, CONSUMER, &options, token)
                .await
                .unwrap(),
            first,
            "the same token gets the same lease back"
        );
        assert!(matches!(
            claim_lease(&conn, id, CONSUMER, &options).await.unwrap(),
            LeaseClaim::Held { attempts: 1, .. }
        ));
        assert_eq!(row(&conn, id).await.attempts, 1);
        lease.complete(&conn).await.unwrap();
        assert_eq!(
            claim_lease_with_token(&conn, id, CONSUMER, &options, token)
                .await
                .unwrap(),
            LeaseClaim::Duplicate
        );
    })
    .await;
}

on_every_backend!(
    a_kept_token_recognises_its_own_claim,
    released_leases_are_listed_for_sweepers_and_taken_over_at_once,
    two_replicas_race_a_two_phase_claim_and_call_once,
    crashed_claimant_is_taken_over_and_its_late_completion_rejected,
    expired_lease_nobody_took_over_still_completes,
    completion_is_idempotent_for_its_holder_only,
    claims_are_parked_dead_after_max_attempts_and_listed,
    one_phase_markers_count_as_processed_and_bad_input_is_refused,
);

on_pgbouncer!(
    released_leases_are_listed_for_sweepers_and_taken_over_at_once,
    two_replicas_race_a_two_phase_claim_and_call_once,
    crashed_claimant_is_taken_over_and_its_late_completion_rejected,
    expired_lease_nobody_took_over_still_completes,
    claims_are_parked_dead_after_max_attempts_and_listed,
    one_phase_markers_count_as_processed_and_bad_input_is_refused,
);
