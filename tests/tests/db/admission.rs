//! The admission floor: a redelivery sent before the retention window (minus the clock-skew
//! margin) is refused before any SQL, so a message whose marker was purged is never applied
//! twice; deliveries inside the window, from a sender clock ahead within the margin, or
//! without a send time are processed as before. Every function that admits a delivery
//! (`process`, `claim_message`, `claim_batch`, `claim_lease`) honours it.

use chrono::{DateTime, TimeDelta, Utc};
use inbox_tests::{
    Backend, create_accounts, credit, on_every_backend, scalar_i64, with_migrated_db,
};
use sea_orm::{DatabaseConnection, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{RetentionPolicy, purge};
use std::time::Duration;
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";
const WINDOW: Duration = Duration::from_secs(1);
const MARGIN: Duration = Duration::from_millis(250);
/// The floor of the tests that need no purge: wide enough that a slow machine's delays
/// between building a delivery and admitting it do not matter.
const WIDE_WINDOW: Duration = Duration::from_secs(3_600);
const WIDE_MARGIN: Duration = Duration::from_secs(60);

/// A one-second window in which any silence counts as receiving time, so a marker is
/// purged as soon as a newer one is a window younger.
fn retention() -> RetentionPolicy {
    RetentionPolicy::with_window(WINDOW)
        .and_then(|policy| policy.with_downtime_gap(Duration::from_secs(3_600)))
        .expect("a valid retention policy")
}

fn floor() -> AdmissionFloor {
    AdmissionFloor::new(&retention(), MARGIN).expect("a valid floor")
}

fn wide_floor() -> AdmissionFloor {
    let retention = RetentionPolicy::with_window(WIDE_WINDOW).expect("a valid window");
    AdmissionFloor::new(&retention, WIDE_MARGIN).expect("a valid floor")
}

/// One delivery through `inbox.process` whose handler credits account 1 by one.
async fn deliver(
    inbox: &Inbox,
    db: &DatabaseConnection,
    delivery: impl Into<Delivery>,
) -> Result<Outcome<()>, ProcessError<DbErr>> {
    inbox
        .process(db, delivery, |txn| {
            Box::pin(async move { credit(txn, 1).await })
        })
        .await
}

async fn balance(conn: &DatabaseConnection) -> i64 {
    scalar_i64(conn, "SELECT balance FROM account WHERE id = 1").await
}

async fn markers(conn: &DatabaseConnection) -> i64 {
    scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await
}

fn ago(duration: Duration) -> DateTime<Utc> {
    Utc::now() - TimeDelta::from_std(duration).expect("a short duration")
}

fn ahead(duration: Duration) -> DateTime<Utc> {
    Utc::now() + TimeDelta::from_std(duration).expect("a short duration")
}

async fn redelivery_after_the_purge_is_refused_not_applied_twice(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_admission_floor(floor());
        let id = Uuid::new_v4();
        let sent = Utc::now();

        let first = deliver(&inbox, &conn, Delivery::new(id).sent_at(sent)).await;
        assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");

        // A window later another message arrives, and the purge deletes the first's marker.
        tokio::time::sleep(WINDOW + Duration::from_millis(200)).await;
        let later = deliver(&inbox, &conn, Uuid::new_v4()).await;
        assert!(matches!(later, Ok(Outcome::Processed(()))), "{later:?}");
        let report = purge(&conn, &retention()).await.expect("purge");
        assert_eq!(report.rows, 1, "the first message's marker is purged");
        assert_eq!((markers(&conn).await, balance(&conn).await), (1, 2));

        // The broker redelivers the first message, with its original send time.
        let late = deliver(&inbox, &conn, Delivery::new(id).sent_at(sent)).await;
        assert!(
            matches!(late, Ok(Outcome::Refused(Refusal::BeforeFloor { sent_at, .. })) if sent_at == sent),
            "{late:?}"
        );
        assert_eq!(Settlement::of(&late), Settlement::DeadLetter);
        assert_eq!(
            (markers(&conn).await, balance(&conn).await),
            (1, 2),
            "nothing written, the effect not applied twice"
        );
        let counts = inbox.metrics().snapshot();
        assert_eq!((counts.processed, counts.refused), (2, 1), "{counts:?}");

        // The hazard the floor closes: without it, the same redelivery runs the handler again.
        let unguarded = Inbox::new(CONSUMER).expect("valid name");
        let again = deliver(&unguarded, &conn, Delivery::new(id).sent_at(sent)).await;
        assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
        assert_eq!(balance(&conn).await, 3, "applied twice without the floor");
    })
    .await;
}

async fn deliveries_inside_the_window_are_processed(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_admission_floor(wide_floor());

        for delivery in [
            // A sender whose clock runs ahead of this process's, within the margin.
            Delivery::new(Uuid::new_v4()).sent_at(ahead(WIDE_MARGIN / 2)),
            Delivery::new(Uuid::new_v4()).sent_at(ago(WIDE_WINDOW / 2)),
            Delivery::new(Uuid::new_v4()),
        ] {
            let result = deliver(&inbox, &conn, delivery).await;
            assert!(
                matches!(result, Ok(Outcome::Processed(()))),
                "{delivery:?}: {result:?}"
            );
            let redelivered = deliver(&inbox, &conn, delivery).await;
            assert!(
                matches!(redelivered, Ok(Outcome::Duplicate)),
                "{delivery:?}: {redelivered:?}"
            );
        }
        assert_eq!((markers(&conn).await, balance(&conn).await), (3, 3));

        // A sender clock further ahead than the margin: its age cannot be judged.
        let far_ahead = Delivery::new(Uuid::new_v4()).sent_at(ahead(WIDE_MARGIN * 2));
        let result = deliver(&inbox, &conn, far_ahead).await;
        assert!(
            matches!(result, Ok(Outcome::Refused(Refusal::AheadOfClock { .. }))),
            "{result:?}"
        );
        assert_eq!((markers(&conn).await, balance(&conn).await), (3, 3));
    })
    .await;
}

async fn claim_functions_refuse_before_the_floor(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        let stale = ago(WIDE_WINDOW * 2);
        let late = |id: Uuid| Delivery::new(id).sent_at(stale).with_floor(wide_floor());
        let fresh = |id: Uuid| {
            Delivery::new(id)
                .sent_at(Utc::now())
                .with_floor(wide_floor())
        };

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let claim = txn
            .claim_message(late(Uuid::new_v4()), CONSUMER)
            .await
            .expect("claim");
        assert!(
            matches!(claim, Claim::Refused(Refusal::BeforeFloor { .. })),
            "{claim:?}"
        );
        txn.commit().await.expect("commit an empty transaction");
        assert_eq!(markers(&conn).await, 0);

        let (old_id, new_id, plain_id) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let batch = txn
            .claim_batch(
                [late(old_id), fresh(new_id), Delivery::new(plain_id)],
                CONSUMER,
            )
            .await
            .expect("claim the batch");
        let mut admitted = vec![MessageId::from(new_id), MessageId::from(plain_id)];
        admitted.sort();
        assert_eq!(batch.claimed, admitted);
        assert_eq!(batch.refused.len(), 1);
        assert_eq!(batch.refused[0].0, MessageId::from(old_id));
        batch.commit(txn).await.expect("commit the batch");
        assert_eq!(markers(&conn).await, 2);

        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let all_refused = txn
            .claim_batch([late(Uuid::new_v4())], CONSUMER)
            .await
            .expect("claim the batch");
        assert!(all_refused.claimed.is_empty() && all_refused.duplicates.is_empty());
        assert_eq!(all_refused.refused.len(), 1);
        all_refused.commit(txn).await.expect("commit nothing");

        let options = LeaseOptions::new(Duration::from_secs(30)).expect("lease options");
        let lease = claim_lease(&conn, late(Uuid::new_v4()), "mailer", &options)
            .await
            .expect("claim a lease");
        assert!(
            matches!(lease, LeaseClaim::Refused(Refusal::BeforeFloor { .. })),
            "{lease:?}"
        );
        let lease = claim_lease(&conn, fresh(Uuid::new_v4()), "mailer", &options)
            .await
            .expect("claim a lease");
        assert!(matches!(lease, LeaseClaim::Claimed(_)), "{lease:?}");
        assert_eq!(markers(&conn).await, 3);
    })
    .await;
}

/// `process_batch` applies the inbox's floor exactly as `process` does, per delivery: one
/// sent before the floor and one stamped too far ahead are refused (their handler never
/// sees them, no marker is written), the rest of the batch is processed; a batch with only
/// refused deliveries runs no handler.
async fn process_batch_applies_the_inbox_floor_per_delivery(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_admission_floor(wide_floor());
        let (stale, far_ahead, fresh, plain) = (
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
            Uuid::new_v4(),
        );
        let batch = [
            Delivery::new(stale).sent_at(ago(WIDE_WINDOW * 2)),
            Delivery::new(far_ahead).sent_at(ahead(WIDE_MARGIN * 2)),
            Delivery::new(fresh).sent_at(Utc::now()),
            Delivery::new(plain),
        ];
        for delivery in batch {
            let alone = Inbox::new("floor.reference")
                .expect("valid name")
                .with_admission_floor(wide_floor());
            let verdict = deliver(&alone, &conn, delivery).await;
            let expected_refused = [stale, far_ahead].contains(&delivery.message_id().as_uuid());
            assert_eq!(
                matches!(verdict, Ok(Outcome::Refused(_))),
                expected_refused,
                "process on {delivery:?}: {verdict:?}"
            );
        }
        let (markers_before, balance_before) = (markers(&conn).await, balance(&conn).await);

        let outcome = inbox
            .process_batch(&conn, batch, |txn, claimed| {
                Box::pin(async move {
                    for _ in claimed {
                        credit(txn, 1).await?;
                    }
                    Ok::<_, DbErr>(claimed.to_vec())
                })
            })
            .await
            .expect("the batch settles");
        let mut admitted = vec![MessageId::from(fresh), MessageId::from(plain)];
        admitted.sort();
        assert_eq!(outcome.value, Some(admitted.clone()), "the handler's ids");
        assert_eq!(outcome.processed, admitted);
        assert!(outcome.duplicates.is_empty(), "{outcome:?}");
        let refused: Vec<_> = outcome.refused.iter().map(|(id, _)| id.as_uuid()).collect();
        let mut expected = vec![stale, far_ahead];
        expected.sort_by_key(|id| MessageId::from(*id));
        assert_eq!(refused, expected, "{outcome:?}");
        for (id, refusal) in &outcome.refused {
            let before = id.as_uuid() == stale;
            assert_eq!(
                matches!(refusal, Refusal::BeforeFloor { .. }),
                before,
                "{refusal:?}"
            );
            assert_eq!(matches!(refusal, Refusal::AheadOfClock { .. }), !before);
        }
        assert_eq!(
            (
                markers(&conn).await - markers_before,
                balance(&conn).await - balance_before
            ),
            (2, 2),
            "markers and credits of the admitted deliveries only"
        );
        assert_eq!(inbox.metrics().snapshot().refused, 2);

        let mut calls = 0;
        let only_refused = inbox
            .process_batch(&conn, [batch[0], batch[1]], |_, _| {
                calls += 1;
                Box::pin(async move { Ok::<_, DbErr>(()) })
            })
            .await
            .expect("a refused batch settles");
        assert_eq!((only_refused.value, calls), (None, 0), "the handler ran");
        assert!(only_refused.processed.is_empty() && only_refused.duplicates.is_empty());
        assert_eq!(only_refused.refused.len(), 2);
        assert_eq!(markers(&conn).await - markers_before, 2);
    })
    .await;
}

on_every_backend!(
    redelivery_after_the_purge_is_refused_not_applied_twice,
    deliveries_inside_the_window_are_processed,
    claim_functions_refuse_before_the_floor,
    process_batch_applies_the_inbox_floor_per_delivery,
);
