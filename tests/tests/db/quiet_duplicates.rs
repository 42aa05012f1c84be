//! A duplicate delivery is normal traffic, so on PostgreSQL no claim path makes the
//! server raise an error for it: every raised unique violation lands in the server log as
//! `ERROR` + `DETAIL` + `STATEMENT`, and log-based alerting fires on it. The proxy counts
//! the server's `ErrorResponse` messages on the wire. Duplicates are still told apart by
//! the inbox's constraint alone: a violation of any other unique index stays an error.
//!
//! MariaDB writes no 1062 into its error log with default settings (`log_warnings = 2`),
//! so its claims keep their statements and are not counted here.

use inbox_tests::{
    Backend, LostReplyProxy, TestDb, create_accounts, credit_once, run, scalar_i64,
    with_migrated_db,
};
use sea_orm::{ConnectionTrait, DbErr, IsolationLevel, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, LeaseClaim, LeaseOptions, claim_lease, classify};
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::time::Duration;
use uuid::Uuid;

/// How [`claim_and_commit`] settled (a claim is consumed by its commit).
#[derive(Debug, PartialEq, Eq)]
enum Settled {
    Claimed,
    Duplicate,
}

impl Settled {
    fn is_claimed(&self) -> bool {
        *self == Settled::Claimed
    }

    fn is_duplicate(&self) -> bool {
        *self == Settled::Duplicate
    }
}

/// Claims `id` for `consumer` in a transaction of its own and commits when claimed.
async fn claim_and_commit(conn: &sea_orm::DatabaseConnection, id: Uuid, consumer: &str) -> Settled {
    let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    match txn.claim_message(id, consumer).await.unwrap() {
        Claim::Claimed(claimed) => {
            claimed.commit(txn).await.unwrap();
            Settled::Claimed
        }
        Claim::Duplicate => {
            txn.rollback().await.unwrap();
            Settled::Duplicate
        }
        Claim::Refused(refusal) => panic!("no floor is set, yet the claim was refused: {refusal}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn duplicates_make_postgres_raise_no_error() {
    with_migrated_db(Backend::Postgres, no_claim_path_raises_an_error).await;
}

/// The same on the unique index `CreateInbox` made, without the constraint of the third
/// migration: the claims infer their arbiter from the columns, index or constraint alike.
/// Before (claims naming the constraint): every claim failed with `MissingMigration`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn duplicates_on_the_first_migrations_index_raise_no_error() {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        Migrator::down(&conn, Some(1))
            .await
            .expect("the constraint back to the first migration's index");
        conn.close().await.ok();
        no_claim_path_raises_an_error(db).await;
    })
    .await;
}

/// Duplicates through every claim path, sequential and racing, counted on the wire.
async fn no_claim_path_raises_an_error(db: &TestDb) {
    let proxy = LostReplyProxy::start(db).await;
    let conn = proxy.connect().await;
    create_accounts(&conn).await;
    let id = Uuid::new_v4();

    // claim_message, sequential duplicate.
    assert!(
        claim_and_commit(&conn, id, "quiet.claim")
            .await
            .is_claimed()
    );
    assert!(
        claim_and_commit(&conn, id, "quiet.claim")
            .await
            .is_duplicate()
    );

    // Inbox::process, whose marker also bounds the lock wait.
    let inbox = Inbox::new("quiet.process").unwrap();
    assert_eq!(
        credit_once(&inbox, &conn, id).await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        credit_once(&inbox, &conn, id).await.unwrap(),
        Outcome::Duplicate
    );

    // claim_batch over a claimed id, and claim_lease over a processed one.
    let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    let batch = txn
        .claim_batch([id, Uuid::new_v4()], "quiet.claim")
        .await
        .unwrap();
    assert_eq!(batch.duplicates, vec![MessageId::from(id)]);
    batch.commit(txn).await.unwrap();
    let options = LeaseOptions::new(Duration::from_secs(30)).unwrap();
    assert_eq!(
        claim_lease(&conn, id, "quiet.claim", &options)
            .await
            .unwrap(),
        LeaseClaim::Duplicate
    );

    // A racing duplicate waits for the holder and learns its outcome: committed...
    let holder = db.connect().await;
    let raced = Uuid::new_v4();
    let txn = holder.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    let Claim::Claimed(claimed) = txn.claim_message(raced, "quiet.race").await.unwrap() else {
        panic!("the holder claims a new message")
    };
    let waiter = tokio::spawn({
        let conn = conn.clone();
        async move { claim_and_commit(&conn, raced, "quiet.race").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "the racing claim waits for the holder"
    );
    claimed.commit(txn).await.unwrap();
    assert!(waiter.await.unwrap().is_duplicate());
    // ...or rolled back, and the waiter wins.
    let raced = Uuid::new_v4();
    let txn = holder.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    assert!(
        txn.claim_message(raced, "quiet.race")
            .await
            .unwrap()
            .is_claimed()
    );
    let waiter = tokio::spawn({
        let conn = conn.clone();
        async move { claim_and_commit(&conn, raced, "quiet.race").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    txn.rollback().await.unwrap();
    assert!(waiter.await.unwrap().is_claimed());

    assert_eq!(
        proxy.error_replies(),
        0,
        "every duplicate above made the server raise (and log) an error"
    );
    assert_eq!(scalar_i64(&conn, "SELECT balance FROM account").await, 1);
    holder.close().await.ok();
    conn.close().await.ok();
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn another_unique_violation_is_still_an_error_on_postgres() {
    for first_migrations_index in [false, true] {
        with_migrated_db(Backend::Postgres, async |db| {
            another_unique_violation_is_an_error(db, first_migrations_index).await
        })
        .await;
    }
}

/// A unique index on other columns is no arbiter of the claims' conflict clause, on the
/// third migration's constraint or on the first migration's index (`Migrator::down` of
/// one step turns the one back into the other).
async fn another_unique_violation_is_an_error(db: &TestDb, first_migrations_index: bool) {
    let conn = db.connect().await;
    if first_migrations_index {
        Migrator::down(&conn, Some(1)).await.expect("down one step");
    }
    run(
        &conn,
        "CREATE UNIQUE INDEX uq_inbox_message ON inbox (message_id)",
    )
    .await;
    let id = Uuid::new_v4();
    assert!(claim_and_commit(&conn, id, "first").await.is_claimed());

    let txn = conn.begin_with_options(CLAIM_TRANSACTION).await.unwrap();
    let err = txn
        .claim_message(id, "second")
        .await
        .expect_err("a violation of uq_inbox_message is no duplicate");
    txn.rollback().await.unwrap();
    let source = err.db_err().expect("the database's error");
    assert_eq!(classify(source), DbErrorKind::OtherUniqueViolation, "{err}");

    let outcome = Inbox::new("second")
        .unwrap()
        .process(&conn, id, |_txn| Box::pin(async { Ok::<_, DbErr>(()) }))
        .await;
    assert!(outcome.is_err(), "process must not ack it: {outcome:?}");
}

/// Under REPEATABLE READ, PostgreSQL's `ON CONFLICT` answers a marker committed after the
/// snapshot with a serialization failure: transient, and the retry in a new transaction is
/// `Duplicate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
async fn a_marker_newer_than_a_repeatable_read_snapshot_is_transient() {
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        let other = db.connect().await;
        let id = Uuid::new_v4();
        let txn = conn
            .begin_with_config(Some(IsolationLevel::RepeatableRead), None)
            .await
            .unwrap();
        txn.execute_unprepared("SELECT 1")
            .await
            .expect("the first statement takes the snapshot");
        assert!(claim_and_commit(&other, id, "quiet.rr").await.is_claimed());
        let err = txn
            .claim_message(id, "quiet.rr")
            .await
            .expect_err("the snapshot cannot see the marker");
        txn.rollback().await.unwrap();
        let source = err.db_err().expect("the database's error");
        assert_eq!(classify(source), DbErrorKind::Transient, "{err}");
        assert!(claim_and_commit(&conn, id, "quiet.rr").await.is_duplicate());
    })
    .await;
}
