//! A claim held open by a hung replica does not hold up the others for long: on PostgreSQL
//! `Inbox::process` bounds the claim transaction's lock waits (`Inbox::with_lock_timeout`,
//! transaction-scoped), so a redelivery ends as a transient failure (retried, then nack)
//! within the bound, and its pooled connection is free and clean afterwards.
//!
//! MySQL/MariaDB bound the wait with the session's `innodb_lock_wait_timeout`, which
//! `bound_mysql_lock_waits` sets on every connection of a pool
//! (`mysql_pool_bound_by_the_helper_ends_a_held_claim_within_the_bound`), and SQLite with
//! the busy timeout; `process.rs` covers both
//! (`transient_lock_failures_are_retried_in_a_fresh_transaction`). What MariaDB's timeout
//! leaves of the transaction: `mysql_lock_wait_timeout_rolls_back_the_statement_only`.

use inbox_tests::{
    Backend, create_accounts, credit_once, hold_claim_then_roll_back, impatient_replica,
    on_pgbouncer, run, scalar, scalar_i64, stmt, with_migrated_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Two attempts with a short backoff between them.
fn two_quick_attempts() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(2)
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .expect("a short backoff")
}

/// A delivery of `id` through `inbox` (two attempts, each bounded to 1 s of lock wait) on
/// `replica` while another replica holds the claim: both attempts end in a transient lock
/// timeout whose message holds `needle`, and the delivery is nacked well within the time
/// the holder (or the server's default bound) would take.
async fn gives_up_after_two_lock_waits(
    inbox: &Inbox,
    replica: &DatabaseConnection,
    id: Uuid,
    needle: &str,
) {
    let started = Instant::now();
    let result = credit_once(inbox, replica, id).await;
    let waited = started.elapsed();
    match &result {
        Err(ProcessError::RetriesExhausted {
            attempts: 2,
            source,
        }) => {
            let cause = source.db_err().expect("a database cause");
            assert_eq!(classify(cause), DbErrorKind::Transient, "{cause}");
            assert!(cause.to_string().contains(needle), "{cause}");
        }
        other => panic!("expected RetriesExhausted after two 1 s lock waits, got {other:?}"),
    }
    assert_eq!(Settlement::of(&result), Settlement::Nack(None));
    // Two attempts of 1 s each; generous for a loaded machine.
    assert!(
        waited < Duration::from_secs(30),
        "the claim waited {waited:?}"
    );
}

async fn held_claim_ends_as_transient_within_the_lock_timeout(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let replica = db.connect_with(1).await;
        create_accounts(&replica).await;
        let id = Uuid::new_v4();
        // The holder hangs far longer than the test may wait.
        let holder =
            hold_claim_then_roll_back(db, id, "billing.credit", Duration::from_secs(120)).await;

        let inbox = Inbox::new("billing.credit")
            .expect("valid name")
            .with_lock_timeout(Duration::from_secs(1))
            .expect("within bounds")
            .with_retry(two_quick_attempts());
        gives_up_after_two_lock_waits(&inbox, &replica, id, "lock timeout").await;

        // The pool's only connection is back, usable, and its session setting untouched:
        // the bound was SET LOCAL, so it ended with the claim transaction (through PgBouncer:
        // no server connection it lends out keeps it).
        let setting: String = tokio::time::timeout(
            Duration::from_secs(10),
            scalar(&replica, "SHOW lock_timeout"),
        )
        .await
        .expect("the pooled connection is free");
        assert_eq!(setting, "0", "the session keeps its own lock_timeout");
        holder.abort();
    })
    .await;
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
    async fn held_claim_ends_as_transient_within_the_lock_timeout() {
        super::held_claim_ends_as_transient_within_the_lock_timeout(inbox_tests::Backend::Postgres)
            .await
    }
}

on_pgbouncer!(held_claim_ends_as_transient_within_the_lock_timeout);

#[test]
fn lock_timeouts_outside_the_bounds_are_refused() {
    let inbox = Inbox::new("billing.credit").expect("valid name");
    assert_eq!(inbox.lock_timeout(), Inbox::DEFAULT_LOCK_TIMEOUT);
    assert!(Inbox::DEFAULT_LOCK_TIMEOUT <= Inbox::MAX_LOCK_TIMEOUT);
    for refused in [Duration::ZERO, Duration::from_millis(10_001)] {
        assert!(
            matches!(
                inbox.clone().with_lock_timeout(refused),
                Err(InboxError::OutOfRange { .. })
            ),
            "{refused:?}"
        );
    }
    let message = inbox
        .clone()
        .with_lock_timeout(Duration::from_secs(60))
        .expect_err("too long")
        .to_string();
    assert!(message.contains("let the broker redeliver"), "{message}");
    assert_eq!(
        inbox
            .with_lock_timeout(Inbox::MAX_LOCK_TIMEOUT)
            .expect("the maximum is accepted")
            .lock_timeout(),
        Duration::from_secs(10)
    );
}

/// MariaDB's lock wait timeout (1205) rolls back the statement that waited, not the
/// transaction (`innodb_rollback_on_timeout = OFF`, the default): the claim's marker and
/// the writes before the timed-out statement are still in the transaction and commit with
/// it. A deadlock (1213) is different: it rolls back the whole transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_lock_wait_timeout_rolls_back_the_statement_only() {
    with_migrated_db(Backend::MySql, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        run(&conn, "INSERT INTO account (id, balance) VALUES (2, 0)").await;
        let handler_pool = impatient_replica(db).await;
        let rollback_on_timeout =
            scalar_i64(&handler_pool, "SELECT @@innodb_rollback_on_timeout").await;
        assert_eq!(rollback_on_timeout, 0, "the server's default");
        let blocker = db.connect_with(1).await;
        let blocking = blocker.begin().await.expect("begin the blocker");
        run(
            &blocking,
            "UPDATE account SET balance = balance WHERE id = 1",
        )
        .await;

        let id = Uuid::new_v4();
        let txn = handler_pool
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let Claim::Claimed(claimed) = txn
            .claim_message(id, "billing.credit")
            .await
            .expect("claim")
        else {
            panic!("a new message is claimed")
        };
        credit_account(&txn, 2).await.expect("account 2 is free");
        let timed_out = credit_account(&txn, 1)
            .await
            .expect_err("account 1 is locked by the blocker");
        assert!(timed_out.to_string().contains("1205"), "{timed_out}");
        assert_eq!(classify(&timed_out), DbErrorKind::Transient);
        claimed
            .ensure_held(&txn)
            .await
            .expect("the marker survived the timeout");
        claimed
            .commit(txn)
            .await
            .expect("the transaction commits what it still holds");
        blocking.rollback().await.expect("release the blocker");

        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            1,
            "the marker committed"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 2").await,
            1,
            "the write before the timeout committed"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            0,
            "the timed-out statement did not"
        );
    })
    .await;
}

/// Adds 1 to account `id` through `txn`.
async fn credit_account(txn: &impl ConnectionTrait, id: i64) -> Result<(), DbErr> {
    txn.execute_raw(stmt(
        txn.get_database_backend(),
        "UPDATE account SET balance = balance + 1 WHERE id = ?",
        vec![id.into()],
    ))
    .await
    .map(|_| ())
}

/// `bound_mysql_lock_waits` sets `innodb_lock_wait_timeout` on every connection the pool
/// opens (both of a two-connection pool read 1), and a claim held by another replica then
/// ends as a transient 1205 after about that bound, not the server's 50 s default: retried,
/// then nacked. Out-of-range bounds are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_pool_bound_by_the_helper_ends_a_held_claim_within_the_bound() {
    let mut refused = sea_orm::ConnectOptions::new("mysql://unused");
    assert!(matches!(
        sea_orm_inbox::bound_mysql_lock_waits(&mut refused, Duration::ZERO),
        Err(InboxError::OutOfRange { .. })
    ));
    with_migrated_db(Backend::MySql, async |db| {
        let replica = db
            .connect_configured(2, |options| {
                sea_orm_inbox::bound_mysql_lock_waits(options, Duration::from_secs(1))
                    .expect("within bounds");
            })
            .await;
        create_accounts(&replica).await;
        // Two transactions at once hold the pool's two connections.
        let (first, second) = (
            replica.begin().await.unwrap(),
            replica.begin().await.unwrap(),
        );
        for txn in [&first, &second] {
            let bound = scalar_i64(
                txn,
                "SELECT CAST(@@session.innodb_lock_wait_timeout AS SIGNED)",
            )
            .await;
            assert_eq!(bound, 1, "every connection of the pool");
        }
        drop((first, second));

        let id = Uuid::new_v4();
        let holder =
            hold_claim_then_roll_back(db, id, "billing.credit", Duration::from_secs(120)).await;
        let inbox = Inbox::new("billing.credit")
            .expect("valid name")
            .with_retry(two_quick_attempts());
        gives_up_after_two_lock_waits(&inbox, &replica, id, "1205").await;
        holder.abort();
    })
    .await;
}
