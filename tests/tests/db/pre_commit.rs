//! `Inbox::process` never acks work that did not commit: a handler that swallows a failed
//! statement which ended its transaction (PostgreSQL aborts it on any error; InnoDB rolls
//! it back on a deadlock) gets every later statement refused, and returning `Ok` anyway
//! gets `InboxError::ClaimLost` (nack), without a COMMIT. Nothing is committed, and the
//! redelivery processes the message once. `ClaimedMessage::commit` gives callers of
//! `claim_message` the proof before COMMIT.

use inbox_tests::{
    Backend, accounts_and_audit_row, begin_and_claim, committed, create_accounts, credit,
    credit_once, on_every_backend, run, scalar_i64, sql_state, with_migrated_db,
};
use sea_orm::{ConnectionTrait, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// The handler credits, then writes an audit row that violates the audit table's primary
/// key, ignores the error and returns `Ok`. PostgreSQL aborted the transaction: `process`
/// must say so instead of `Processed`, naming the swallowed failure (it saw it; no check
/// query needed). MySQL/MariaDB and SQLite undo only the failed
/// statement, so the credit and the marker commit together there: `Processed` is the
/// truth. Either way: `Ok` if and only if the marker and the credit committed.
async fn swallowed_failed_statement_never_acks_uncommitted_work(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = accounts_and_audit_row(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();

        let result = inbox
            .process(&conn, id, |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    let swallowed = txn
                        .execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
                        .await;
                    assert_eq!(
                        classify(&swallowed.expect_err("the audit row exists")),
                        DbErrorKind::OtherUniqueViolation
                    );
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        let after = committed(&conn).await;
        match (&result, backend) {
            (Err(ProcessError::Inbox(InboxError::ClaimLost { source, .. })), Backend::Postgres) => {
                assert_eq!(after, (0, 0), "nothing committed");
                let swallowed = source
                    .as_ref()
                    .expect("the failure that ended the transaction");
                assert_eq!(
                    sql_state(swallowed).as_deref(),
                    Some("23505"),
                    "{swallowed}"
                );
            }
            (Ok(Outcome::Processed(())), Backend::MySql | Backend::Sqlite) => {
                assert_eq!(after, (1, 1), "marker and credit committed together");
            }
            (other, _) => {
                panic!(
                    "{backend:?}: expected ClaimLost on PostgreSQL, Processed elsewhere; got {other:?} with (markers, balance) {after:?}"
                )
            }
        }
        assert_eq!(
            result.is_ok(),
            after == (1, 1),
            "Ok if and only if committed"
        );
        let message = result.as_ref().err().map(ToString::to_string);
        if let Some(message) = message {
            assert_eq!(Settlement::of(&result), Settlement::Nack(None));
            assert!(message.contains("nack the message"), "{message}");
        }

        let redelivered = credit_once(&inbox, &conn, id).await;
        match backend {
            Backend::Postgres => assert!(
                matches!(redelivered, Ok(Outcome::Processed(()))),
                "{redelivered:?}"
            ),
            _ => assert!(
                matches!(redelivered, Ok(Outcome::Duplicate)),
                "{redelivered:?}"
            ),
        }
        let again = credit_once(&inbox, &conn, id).await;
        assert!(matches!(again, Ok(Outcome::Duplicate)), "{again:?}");
        assert_eq!(committed(&conn).await, (1, 1), "applied exactly once");
    })
    .await;
}

/// A caller of `claim_message` gets the same proof from `ClaimedMessage::commit`.
async fn claimed_message_commit_refuses_a_lost_marker(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = accounts_and_audit_row(db).await;
        let id = Uuid::new_v4();

        let (txn, claimed) = begin_and_claim(&conn, id, CONSUMER).await;
        assert_eq!(claimed.message_id(), MessageId::from(id));
        credit(&txn, 1).await.expect("credit");
        txn.execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
            .await
            .expect_err("the audit row exists");
        let committed_or_not = claimed.commit(txn).await;
        match backend {
            Backend::Postgres => {
                assert!(
                    matches!(committed_or_not, Err(InboxError::ClaimLost { .. })),
                    "{committed_or_not:?}"
                );
                assert_eq!(committed(&conn).await, (0, 0));
            }
            _ => {
                committed_or_not.expect("only the failed statement was undone");
                assert_eq!(committed(&conn).await, (1, 1));
            }
        }
    })
    .await;
}

on_every_backend!(
    swallowed_failed_statement_never_acks_uncommitted_work,
    claimed_message_commit_refuses_a_lost_marker,
);

/// MariaDB: the handler's UPDATE meets a real deadlock (1213) with another connection,
/// InnoDB rolls the handler's transaction back (marker included) and the handler swallows
/// the error and writes on. `process` must not report `Processed`; nothing of the claim
/// stays, not even the write after the deadlock, which the observed transaction refuses
/// instead of letting it run on its own in autocommit (before it, that write committed);
/// the redelivery applies the credit once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_swallowed_deadlock_is_not_processed() {
    let after_deadlock = swallowed_deadlock(false).await;
    assert_eq!(
        after_deadlock, 0,
        "with autocommit on, the write after the deadlock was refused, never committed on its own"
    );
}

/// The same on a handler pool whose connections run with `autocommit = 0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
async fn mysql_swallowed_deadlock_with_autocommit_off_leaves_nothing() {
    let after_deadlock = swallowed_deadlock(true).await;
    assert_eq!(
        after_deadlock, 0,
        "with autocommit off, the rollback undid the write after the deadlock"
    );
}

/// Runs the deadlock scenario; returns how many audit rows the handler wrote after the
/// swallowed deadlock stayed (`None` without a MySQL URL).
async fn swallowed_deadlock(autocommit_off: bool) -> i64 {
    with_migrated_db(Backend::MySql, async |db| {
        let conn = db.connect().await;
        let handler_pool = db.connect_with(1).await;
        if autocommit_off {
            run(&handler_pool, "SET SESSION autocommit = 0").await;
        }
        create_accounts(&conn).await;
        run(&conn, "INSERT INTO account (id, balance) VALUES (2, 0)").await;
        run(&conn, "CREATE TABLE audit (ref BIGINT PRIMARY KEY)").await;
        run(&conn, "CREATE TABLE filler (n BIGINT PRIMARY KEY)").await;
        // The other transaction writes many rows first, so InnoDB, which rolls back the
        // transaction that changed fewer rows, picks the handler's as the deadlock victim.
        let other = Arc::new(db.connect_with(1).await);
        let watcher = Arc::new(db.connect_with(1).await);
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_retry(RetryPolicy::no_retry());
        let id = Uuid::new_v4();

        let result = inbox
            .process(&handler_pool, id, |txn| {
                let other = Arc::clone(&other);
                let watcher = Arc::clone(&watcher);
                Box::pin(async move {
                    credit(txn, 1).await?; // locks account 1
                    let other_txn = other.begin().await?;
                    let filler: Vec<String> = (0..200).map(|n| format!("({n})")).collect();
                    other_txn
                        .execute_unprepared(&format!(
                            "INSERT INTO filler (n) VALUES {}",
                            filler.join(", ")
                        ))
                        .await?;
                    other_txn
                        .execute_unprepared(
                            "UPDATE account SET balance = balance + 100 WHERE id = 2",
                        )
                        .await?;
                    let other_id =
                        scalar_i64(&other_txn, "SELECT CAST(CONNECTION_ID() AS SIGNED)").await;
                    let blocked = tokio::spawn(async move {
                        let waited = other_txn
                            .execute_unprepared(
                                "UPDATE account SET balance = balance + 100 WHERE id = 1",
                            )
                            .await;
                        other_txn.rollback().await.ok();
                        waited
                    });
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let waiting = format!(
                        "SELECT COUNT(*) FROM information_schema.INNODB_TRX \
                     WHERE trx_mysql_thread_id = {other_id} AND trx_state = 'LOCK WAIT'"
                    );
                    while scalar_i64(watcher.as_ref(), &waiting).await == 0 {
                        assert!(
                            Instant::now() < deadline,
                            "the other transaction never blocked"
                        );
                        // InnoDB refreshes INNODB_TRX at most every 100 ms, and not at all
                        // while it is read more often than that.
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    let deadlock = txn
                        .execute_unprepared("UPDATE account SET balance = balance + 1 WHERE id = 2")
                        .await
                        .expect_err("the handler's transaction is the deadlock victim");
                    assert!(deadlock.to_string().contains("1213"), "{deadlock}");
                    blocked
                        .await
                        .expect("other task")
                        .expect("the other transaction got its lock");
                    // The handler swallows the deadlock and writes on.
                    let refused = txn
                        .execute_unprepared("INSERT INTO audit (ref) VALUES (2)")
                        .await
                        .expect_err("a write after the end is refused");
                    assert!(
                        refused.to_string().contains("1213")
                            && refused.to_string().contains("refuses"),
                        "{refused}"
                    );
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        // The deadlock is transient: `process` would retry the attempt; without retries the
        // handler's `Ok` after it is the claim lost to the deadlock. Never COMMITted.
        match &result {
            Err(ProcessError::RetriesExhausted {
                source: InboxError::ClaimLost { source, .. },
                ..
            }) => assert!(
                source
                    .as_ref()
                    .is_some_and(|err| err.to_string().contains("1213")),
                "{source:?}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(Settlement::of(&result), Settlement::Nack(None));
        assert_eq!(committed(&conn).await, (0, 0), "no marker, no credit");
        let after_deadlock = scalar_i64(&conn, "SELECT COUNT(*) FROM audit").await;

        let redelivered = credit_once(&inbox, &handler_pool, id).await;
        assert!(
            matches!(redelivered, Ok(Outcome::Processed(()))),
            "{redelivered:?}"
        );
        assert_eq!(committed(&conn).await, (1, 1), "applied exactly once");
        after_deadlock
    })
    .await
}
