//! Input no backend can take is refused with a typed error before any SQL runs, with nothing
//! written; names compare exactly on every backend; a lease reports what the database
//! stored.

use chrono::{TimeDelta, Utc};
use inbox_tests::{Backend, on_every_backend, scalar_i64, with_migrated_db};
use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, ConnectOptions, Database, DatabaseConnection,
    TransactionTrait,
};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{
    ClaimToken, LeaseClaim, LeaseOptions, claim_lease, claim_lease_with_token, list_dead_claims,
    list_expired_leases,
};
use sea_orm_inbox_entity::inbox;
use std::time::{Duration, Instant};
use uuid::Uuid;

const CONSUMER: &str = "mailer";

/// Every entry point that takes a consumer name refuses `name` with the error `refused`
/// accepts, and writes nothing.
async fn assert_name_refused(
    conn: &DatabaseConnection,
    name: &str,
    refused: fn(&InboxError) -> bool,
) {
    let options = LeaseOptions::new(Duration::from_secs(30)).expect("a valid lease");
    let rows_before = scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await;
    let inbox = Inbox::new(name);
    assert!(inbox.as_ref().is_err_and(refused), "Inbox::new({name:?})");
    let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    let claim = txn.claim_message(Uuid::new_v4(), name).await;
    assert!(
        claim.as_ref().is_err_and(refused),
        "claim_message({name:?})"
    );
    let batch = txn.claim_batch([Uuid::new_v4()], name).await;
    assert!(batch.as_ref().is_err_and(refused), "claim_batch({name:?})");
    txn.commit().await.unwrap();
    let lease = claim_lease(conn, Uuid::new_v4(), name, &options).await;
    assert!(lease.as_ref().is_err_and(refused), "claim_lease({name:?})");
    let expired = list_expired_leases(conn, Some(name), 10).await;
    assert!(
        expired.as_ref().is_err_and(refused),
        "{expired:?} for {name:?}"
    );
    let dead = list_dead_claims(conn, Some(name), 10).await;
    assert!(dead.as_ref().is_err_and(refused), "{dead:?} for {name:?}");
    assert_eq!(
        scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await,
        rows_before,
        "nothing written for {name:?}"
    );
}

async fn consumer_names_with_nul_are_refused_everywhere(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        for name in ["mail\0er", "mailer\0"] {
            assert_name_refused(&conn, name, |err| {
                matches!(err, InboxError::ConsumerContainsNul { .. })
            })
            .await;
        }
    })
    .await;
}

/// A row some other writer stored under `consumer`, with an expired lease, parked as dead
/// when `dead`.
async fn foreign_row(conn: &DatabaseConnection, consumer: &str, dead: bool) {
    let now = Utc::now() - TimeDelta::seconds(60);
    inbox::ActiveModel {
        message_id: Set(Uuid::new_v4()),
        consumer: Set(consumer.to_owned()),
        received_at: Set(now),
        processed_at: Set(None),
        attempts: Set(1),
        lease_until: Set(Some(now)),
        claim_token: Set(Some(Uuid::new_v4())),
        dead_at: Set(dead.then_some(now)),
        ..Default::default()
    }
    .insert(conn)
    .await
    .expect("insert a row as another writer would");
}

async fn listings_refuse_what_claims_refuse_and_compare_names_exactly(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        // Rows of "mailer " (with a space) that the library refuses to write, but another
        // writer could: MySQL/MariaDB's PAD SPACE collation holds 'mailer ' = 'mailer'.
        foreign_row(&conn, "mailer ", false).await;
        foreign_row(&conn, "mailer ", true).await;
        let options = LeaseOptions::new(Duration::from_secs(30)).expect("a valid lease");
        let id = Uuid::new_v4();
        let LeaseClaim::Claimed(lease) = claim_lease(&conn, id, CONSUMER, &options).await.unwrap()
        else {
            panic!("a new message is claimed")
        };
        lease.release(&conn).await.expect("release");
        tokio::time::sleep(Duration::from_millis(10)).await;

        let expired = list_expired_leases(&conn, Some(CONSUMER), 10)
            .await
            .unwrap();
        let expired: Vec<_> = expired
            .iter()
            .map(|lease| (lease.message_id.as_uuid(), lease.consumer.as_str()))
            .collect();
        assert_eq!(expired, [(id, CONSUMER)], "only mailer's own lease");
        assert!(
            list_dead_claims(&conn, Some(CONSUMER), 10)
                .await
                .unwrap()
                .is_empty(),
            "the dead row is \"mailer \"'s, not \"mailer\"'s"
        );
        assert_eq!(list_dead_claims(&conn, None, 10).await.unwrap().len(), 1);

        for name in ["mailer ", " mailer"] {
            assert_name_refused(&conn, name, |err| {
                matches!(err, InboxError::ConsumerNotTrimmed { .. })
            })
            .await;
        }
        for name in ["", " "] {
            assert_name_refused(&conn, name, |err| matches!(err, InboxError::EmptyConsumer)).await;
        }
        assert_name_refused(&conn, &"x".repeat(201), |err| {
            matches!(err, InboxError::ConsumerTooLong { chars: 201 })
        })
        .await;
    })
    .await;
}

async fn listing_limits_above_i64_max_are_refused(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        for limit in [i64::MAX as u64 + 1, u64::MAX] {
            let expired = list_expired_leases(&conn, None, limit).await;
            assert!(
                matches!(expired, Err(InboxError::OutOfRange { .. })),
                "{expired:?}"
            );
            let dead = list_dead_claims(&conn, Some(CONSUMER), limit).await;
            assert!(
                matches!(dead, Err(InboxError::OutOfRange { .. })),
                "{dead:?}"
            );
        }
        assert!(
            list_expired_leases(&conn, None, i64::MAX as u64)
                .await
                .unwrap()
                .is_empty()
        );
    })
    .await;
}

/// Claims with `token` twice: the retry reads the lease back from the row.
async fn claim_twice(
    conn: &DatabaseConnection,
    id: Uuid,
    options: &LeaseOptions,
    token: ClaimToken,
) -> (LeaseClaim, LeaseClaim) {
    let first = claim_lease_with_token(conn, id, CONSUMER, options, token)
        .await
        .unwrap();
    let again = claim_lease_with_token(conn, id, CONSUMER, options, token)
        .await
        .unwrap();
    (first, again)
}

async fn a_lease_reports_the_expiry_the_database_stored(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        // Not a whole number of microseconds.
        let options = LeaseOptions::new(Duration::from_nanos(200_000_500)).expect("a valid lease");
        let id = Uuid::new_v4();

        let (first, again) = claim_twice(&conn, id, &options, ClaimToken::new()).await;
        assert!(matches!(first, LeaseClaim::Claimed(_)), "{first:?}");
        assert_eq!(again, first, "the same token gets the same lease back");
        let LeaseClaim::Claimed(first) = first else {
            unreachable!()
        };
        let left = (first.lease_until() - Utc::now())
            .to_std()
            .unwrap_or_default();
        tokio::time::sleep(left + Duration::from_millis(100)).await;

        let (taken, again) = claim_twice(&conn, id, &options, ClaimToken::new()).await;
        assert!(matches!(taken, LeaseClaim::TakenOver(_)), "{taken:?}");
        assert_eq!(again, taken, "the same token gets the same lease back");
    })
    .await;
}

on_every_backend!(
    consumer_names_with_nul_are_refused_everywhere,
    listings_refuse_what_claims_refuse_and_compare_names_exactly,
    listing_limits_above_i64_max_are_refused,
    a_lease_reports_the_expiry_the_database_stored,
);

/// Nothing listens on port 1: connecting is refused at once, and every BEGIN would fail.
#[tokio::test]
async fn process_refuses_a_nil_id_before_it_touches_the_database() {
    for url in [
        "postgres://postgres@127.0.0.1:1/test",
        "mysql://root@127.0.0.1:1/test",
    ] {
        let mut options = ConnectOptions::new(url);
        options.connect_lazy(true);
        let db = Database::connect(options).await.expect("a lazy pool");
        let inbox = Inbox::new(CONSUMER).expect("a valid name");
        let started = Instant::now();
        let result = inbox
            .process(&db, Uuid::nil(), |_txn| {
                Box::pin(async { Ok::<_, InboxError>(()) })
            })
            .await;
        assert!(
            matches!(result, Err(ProcessError::Inbox(InboxError::NilMessageId))),
            "{url}: {result:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(1), "{url}: at once");
        assert_eq!(inbox.metrics().snapshot().failures, 1);
    }
}
