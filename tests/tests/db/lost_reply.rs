//! Lost replies: the server commits but the reply never reaches the client
//! (a proxy swallows it and cuts the connection). The client cannot tell whether it
//! committed; a retry must recognise its own row and report what really happened.
//!
//! PostgreSQL and MariaDB only, and PostgreSQL behind PgBouncer in transaction pooling
//! mode (`pgbouncer::`, the proxy in front of PgBouncer), where every statement of the
//! retry that reads back its own row must run in a transaction. SQLite is embedded, with no
//! network to lose a reply on.

use inbox_tests::{
    Backend, LostReplyProxy, ProxiedDb, credit, on_pgbouncer, on_server_backends, scalar_i64,
    with_proxied_db,
};
use sea_orm::{ColumnTrait, DatabaseConnection, DbErr, EntityTrait, QueryFilter, TransactionTrait};
use sea_orm_inbox::{
    Inbox, InboxError, Lease, LeaseClaim, LeaseOptions, Outcome, ProcessError, Settlement,
    claim_lease,
};
use sea_orm_inbox_entity::inbox;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// Reads the row in a transaction of its own, as a transaction pooler needs.
async fn inbox_row(db: &DatabaseConnection, id: Uuid) -> inbox::Model {
    let txn = db.begin().await.expect("begin the read");
    let row = inbox::Entity::find()
        .filter(inbox::Column::MessageId.eq(id))
        .filter(inbox::Column::Consumer.eq(CONSUMER))
        .one(&txn)
        .await
        .expect("read the inbox row")
        .expect("the lost reply's COMMIT landed: the row exists");
    txn.commit().await.expect("end the read");
    row
}

/// A new message's lease, claimed through `conn`.
async fn new_lease(conn: &DatabaseConnection, id: Uuid, options: &LeaseOptions) -> Lease {
    match claim_lease(conn, id, CONSUMER, options).await {
        Ok(LeaseClaim::Claimed(lease)) => lease,
        other => panic!("a new message: {other:?}"),
    }
}

/// Claims `id` through the proxy, which loses the reply to the claim's COMMIT; returns
/// what the call answered and the row it wrote.
async fn claim_losing_the_commit_reply(
    fixture: &ProxiedDb,
    id: Uuid,
    options: &LeaseOptions,
    backend: Backend,
) -> (Result<LeaseClaim, InboxError>, inbox::Model) {
    fixture.proxy.arm();
    let claim = claim_lease(&fixture.through_proxy, id, CONSUMER, options).await;
    fixture.proxy.expect_reply_dropped();
    eprintln!("{backend:?}: {claim:?}");
    (claim, inbox_row(&fixture.direct, id).await)
}

/// The lease the call handed out is the one the row holds: its token and expiry.
fn assert_lease_is_the_row(lease: &Lease, row: &inbox::Model) {
    assert_eq!(Some(lease.fencing_token()), row.claim_token);
    assert_eq!(Some(lease.lease_until()), row.lease_until);
}

/// Claims a new message through the proxy, arms the proxy with `arm`, and completes the
/// lease through it: the reply is lost, and the call's retry must report the completion
/// it made. Returns the message and the lease options.
async fn complete_losing_a_reply(
    fixture: &ProxiedDb,
    arm: fn(&LostReplyProxy),
    backend: Backend,
) -> (Uuid, LeaseOptions) {
    let options = LeaseOptions::new(Duration::from_secs(30)).expect("valid lease");
    let id = Uuid::new_v4();
    let lease = new_lease(&fixture.through_proxy, id, &options).await;
    arm(&fixture.proxy);
    let completed = lease.complete(&fixture.through_proxy).await;
    fixture.proxy.expect_reply_dropped();
    eprintln!("{backend:?}: {completed:?}");
    assert!(
        completed.is_ok(),
        "the completion committed; its retry must say so: {completed:?}"
    );
    assert!(inbox_row(&fixture.direct, id).await.processed_at.is_some());
    (id, options)
}

/// `process` meets a lost COMMIT reply, retries, and meets its own marker. It
/// must report `Processed` with the value of the attempt that committed, count it as
/// processed (not as a duplicate), and the effect must be applied once.
async fn process_after_a_lost_commit_reply_reports_processed(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();
        let runs = AtomicU32::new(0);

        fixture.proxy.arm();
        let result = inbox
            .process(&fixture.through_proxy, id, |txn| {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                Box::pin(async move {
                    credit(txn, 5).await?;
                    Ok::<_, DbErr>(format!("credited by run {run}"))
                })
            })
            .await;
        fixture.proxy.expect_reply_dropped();
        let counts = inbox.metrics().snapshot();
        eprintln!("{backend:?}: {result:?}, {counts:?}");

        assert_eq!(
            result.as_ref().ok(),
            Some(&Outcome::Processed("credited by run 1".to_owned())),
            "the first run committed; its value is the outcome: {result:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(
            (
                counts.processed,
                counts.duplicates,
                counts.transient_retries
            ),
            (1, 0, 1),
            "{counts:?}"
        );
        assert_eq!(
            scalar_i64(&fixture.direct, "SELECT balance FROM account WHERE id = 1").await,
            5
        );
        assert_eq!(
            scalar_i64(&fixture.direct, "SELECT COUNT(*) FROM inbox").await,
            1
        );

        // A real redelivery, another call, still is a duplicate.
        let again = inbox
            .process(&fixture.through_proxy, id, |txn| {
                Box::pin(async move { credit(txn, 5).await.map(|()| String::new()) })
            })
            .await;
        assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
    })
    .await;
}

/// `process` without retries: the lost reply ends the call as a transient failure (nack);
/// the transaction did commit, so the redelivery is a duplicate and the effect stays once.
async fn process_without_retry_nacks_a_lost_reply_and_the_redelivery_is_a_duplicate(
    backend: Backend,
) {
    with_proxied_db(backend, async |fixture| {
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_retry(sea_orm_inbox::RetryPolicy::no_retry());
        let id = Uuid::new_v4();

        fixture.proxy.arm();
        let first = inbox
            .process(&fixture.through_proxy, id, |txn| Box::pin(credit(txn, 5)))
            .await;
        fixture.proxy.expect_reply_dropped();
        assert!(
            matches!(
                first,
                Err(ProcessError::RetriesExhausted { attempts: 1, .. })
            ),
            "{first:?}"
        );
        assert_eq!(Settlement::of(&first), Settlement::Nack(None));
        let redelivered = inbox
            .process(&fixture.through_proxy, id, |txn| Box::pin(credit(txn, 5)))
            .await;
        assert!(
            matches!(redelivered, Ok(Outcome::Duplicate)),
            "{redelivered:?}"
        );
        assert_eq!(
            scalar_i64(&fixture.direct, "SELECT balance FROM account WHERE id = 1").await,
            5,
            "the first delivery committed once"
        );
    })
    .await;
}

/// `claim_lease`'s COMMIT lands but its reply is lost; the retry inside the call
/// must recognise the row it wrote and hand out that lease (attempt 1, the row's token and
/// expiry), not report it `Held` by a stranger.
async fn claim_lease_after_a_lost_commit_reply_is_claimed(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let options = LeaseOptions::new(Duration::from_secs(30)).expect("valid lease");
        let id = Uuid::new_v4();

        let (claim, row) = claim_losing_the_commit_reply(fixture, id, &options, backend).await;
        let lease = match claim {
            Ok(LeaseClaim::Claimed(lease)) => lease,
            other => panic!("the call's own committed claim must come back as Claimed: {other:?}"),
        };
        assert_eq!(lease.attempt(), 1);
        assert_lease_is_the_row(&lease, &row);
        assert_eq!(row.attempts, 1, "the retry did not count an attempt");

        lease
            .complete(&fixture.through_proxy)
            .await
            .expect("the lease handed out completes");
        assert_eq!(
            claim_lease(&fixture.through_proxy, id, CONSUMER, &options)
                .await
                .expect("claim again"),
            LeaseClaim::Duplicate
        );
    })
    .await;
}

/// A lease takeover's COMMIT lands but its reply is lost; the retry must answer `TakenOver`
/// with attempt 2, not `Held` (and later `Dead`).
async fn takeover_after_a_lost_commit_reply_is_taken_over(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let options = LeaseOptions::new(Duration::from_secs(30))
            .and_then(|options| options.with_max_attempts(2))
            .expect("valid lease");
        let id = Uuid::new_v4();
        let first = new_lease(&fixture.direct, id, &options).await;
        first.release(&fixture.direct).await.expect("give it back");

        let (claim, row) = claim_losing_the_commit_reply(fixture, id, &options, backend).await;
        let lease = match claim {
            Ok(LeaseClaim::TakenOver(lease)) => lease,
            other => panic!("the call's own committed takeover must come back: {other:?}"),
        };
        assert_eq!((lease.attempt(), row.attempts), (2, 2));
        assert_lease_is_the_row(&lease, &row);
        lease
            .complete(&fixture.through_proxy)
            .await
            .expect("the takeover completes");
    })
    .await;
}

/// The reply to `Lease::complete`'s UPDATE is lost (the connection
/// dies before its transaction commits); the call's own transient retry runs it again and
/// must report success, not `StaleLease`.
async fn lease_completion_after_a_lost_reply_is_ok(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        let (id, options) =
            complete_losing_a_reply(fixture, LostReplyProxy::arm_next_execute, backend).await;
        assert_eq!(
            claim_lease(&fixture.through_proxy, id, CONSUMER, &options)
                .await
                .expect("claim again"),
            LeaseClaim::Duplicate
        );
    })
    .await;
}

/// `Lease::complete` runs its UPDATE in a transaction of its own (a transaction pooler
/// needs one); that COMMIT lands and its reply is lost. The retry finds the row it already
/// completed (keeping the first `processed_at`) and must report success.
async fn lease_completion_after_a_lost_commit_reply_is_ok(backend: Backend) {
    with_proxied_db(backend, async |fixture| {
        complete_losing_a_reply(fixture, LostReplyProxy::arm, backend).await;
    })
    .await;
}

on_server_backends!(
    lease_completion_after_a_lost_reply_is_ok,
    lease_completion_after_a_lost_commit_reply_is_ok,
    process_after_a_lost_commit_reply_reports_processed,
    process_without_retry_nacks_a_lost_reply_and_the_redelivery_is_a_duplicate,
    claim_lease_after_a_lost_commit_reply_is_claimed,
    takeover_after_a_lost_commit_reply_is_taken_over,
);

// The same faults with PgBouncer (transaction pooling) between the proxy and the server:
// every statement the retry sends to tell its own row from another's runs in a transaction.
on_pgbouncer!(
    lease_completion_after_a_lost_reply_is_ok,
    lease_completion_after_a_lost_commit_reply_is_ok,
    process_after_a_lost_commit_reply_reports_processed,
    process_without_retry_nacks_a_lost_reply_and_the_redelivery_is_a_duplicate,
    claim_lease_after_a_lost_commit_reply_is_claimed,
    takeover_after_a_lost_commit_reply_is_taken_over,
);
