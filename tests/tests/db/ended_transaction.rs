//! The database ends the handler's transaction itself (a trigger's `RAISE(ROLLBACK, ..)` on
//! SQLite, a raw `ROLLBACK` the handler sends), and the library's rollback then has no
//! transaction to end. The pooled connection must come back clean: on a pool of one
//! connection, the deliveries after it commit for real, seen from another pool and after
//! the first pool is closed. A transaction the database ended never settles as `Processed`.
//!
//! On PostgreSQL each savepoint dropped after a raw `ROLLBACK` leaves a failing `ROLLBACK
//! TO SAVEPOINT` queued on the connection; unless `process` takes their replies, sqlx's
//! ping fails on the way back to the pool and its close of the connection can wait
//! forever over TLS, holding the pool's only slot (`raw_rollback_in_savepoints_2_deep`
//! and `_3_deep` timed out acquiring it about 1 run in 12).

use inbox_tests::{
    Backend, TestDb, begin_and_claim, committed, create_accounts, credit, credit_once,
    on_every_backend, on_server_backends, run, scalar_i64, with_migrated_db,
};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbErr, Statement, TransactionSession, TransactionTrait,
};
use sea_orm_inbox::prelude::*;
use std::time::{Duration, Instant};
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// A migrated database with account 1 (balance 0) whose balance may not go negative, and
/// a pool of one connection to it.
async fn one_connection_with_overdraft_trigger(db: &TestDb) -> DatabaseConnection {
    let conn = db.connect_with(1).await;
    create_accounts(&conn).await;
    let trigger: &[&str] = match db.backend {
        // RAISE(ROLLBACK) ends the whole transaction, not just the statement.
        Backend::Sqlite => &["CREATE TRIGGER overdraft BEFORE UPDATE ON account \
             WHEN NEW.balance < 0 BEGIN SELECT RAISE(ROLLBACK, 'overdraft'); END"],
        Backend::Postgres | Backend::PgBouncer => &[
            "CREATE FUNCTION no_overdraft() RETURNS trigger AS $$ BEGIN \
             IF NEW.balance < 0 THEN RAISE EXCEPTION 'overdraft'; END IF; RETURN NEW; \
             END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER overdraft BEFORE UPDATE ON account FOR EACH ROW \
             EXECUTE FUNCTION no_overdraft()",
        ],
        Backend::MySql => &[
            "CREATE TRIGGER overdraft BEFORE UPDATE ON account FOR EACH ROW \
             BEGIN IF NEW.balance < 0 THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'overdraft'; END IF; END",
        ],
    };
    for sql in trigger {
        run(&conn, sql).await;
    }
    conn
}

/// Ordinary traffic on the one-connection pool `conn` after a fault: a new message, its
/// duplicate, then `redelivered` (`Processed` if `redelivered_is_new`, else `Duplicate`),
/// then another new message. `Processed, Duplicate, Processed` in a row is what a connection
/// stranded inside a transaction acked and lost. All of it must be committed: `expected`
/// markers and balance, seen from another pool and again after `conn` is closed.
async fn traffic_commits(
    db: &TestDb,
    conn: DatabaseConnection,
    redelivered: Uuid,
    redelivered_is_new: bool,
    expected: (i64, i64),
) {
    // No retry: a connection lent again in a bad state would fail the first attempt.
    let inbox = Inbox::new(CONSUMER)
        .expect("valid name")
        .with_retry(RetryPolicy::no_retry());
    let fresh = Uuid::new_v4();
    let settled = [
        credit_once(&inbox, &conn, fresh).await,
        credit_once(&inbox, &conn, fresh).await,
        credit_once(&inbox, &conn, redelivered).await,
        credit_once(&inbox, &conn, Uuid::new_v4()).await,
    ];
    let redelivery_ok = match &settled[2] {
        Ok(Outcome::Processed(())) => redelivered_is_new,
        Ok(Outcome::Duplicate) => !redelivered_is_new,
        Ok(Outcome::Refused(_)) | Err(_) => false,
    };
    assert!(
        redelivery_ok
            && matches!(
                settled,
                [
                    Ok(Outcome::Processed(())),
                    Ok(Outcome::Duplicate),
                    Ok(_),
                    Ok(Outcome::Processed(()))
                ]
            ),
        "{settled:?}"
    );
    let other = db.connect().await;
    assert_eq!(committed(&other).await, expected, "seen from another pool");
    other.close().await.ok();
    conn.close().await.expect("close the pool of one");
    let reopened = db.connect().await;
    assert_eq!(
        committed(&reopened).await,
        expected,
        "still committed after the pool of one is closed"
    );
    reopened.close().await.ok();
}

/// [`traffic_commits`] after a delivery of `failed` that committed nothing.
async fn ordinary_traffic_commits(db: &TestDb, conn: DatabaseConnection, failed: Uuid) {
    traffic_commits(db, conn, failed, true, (3, 3)).await;
}

/// The handler credits, then overdraws: the trigger refuses (on SQLite by ending the
/// transaction), and the handler returns that error as it should.
async fn trigger_ends_the_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();
        let result = inbox
            .process(&conn, id, |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    credit(txn, -100).await
                })
            })
            .await;
        assert!(
            matches!(&result, Err(ProcessError::Handler(err)) if err.to_string().contains("overdraft")),
            "{result:?}"
        );
        assert_eq!(committed(&conn).await, (0, 0), "nothing committed");
        ordinary_traffic_commits(db, conn, id).await;
    })
    .await;
}

/// The handler sends `ROLLBACK` itself and returns an error.
async fn handler_rolls_back_then_fails(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();
        let result = inbox
            .process(&conn, id, |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    txn.execute_unprepared("ROLLBACK").await?;
                    Err::<(), _>(DbErr::Custom("gave up".into()))
                })
            })
            .await;
        assert!(
            matches!(&result, Err(ProcessError::Handler(DbErr::Custom(_)))),
            "{result:?}"
        );
        ordinary_traffic_commits(db, conn, id).await;
    })
    .await;
}

/// The handler sends `ROLLBACK` itself and returns `Ok`: its work did not commit, so the
/// outcome is `ClaimLost` (nack), never `Processed`.
async fn handler_rolls_back_then_returns_ok(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();
        let result = inbox
            .process(&conn, id, |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    txn.execute_unprepared("ROLLBACK").await?;
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        assert!(
            matches!(
                &result,
                Err(ProcessError::Inbox(InboxError::ClaimLost { .. }))
            ),
            "{result:?}"
        );
        assert_eq!(committed(&conn).await, (0, 0), "nothing committed");
        ordinary_traffic_commits(db, conn, id).await;
    })
    .await;
}

/// The handler sends `ROLLBACK`; before it returns `Ok`, another replica processes the
/// same message, and on SQLite its marker gets the id the rolled-back one had. The proof
/// must still see that the marker is not this call's: `ClaimLost`, never a COMMIT that
/// finds no transaction (which would strand the connection).
async fn handler_rolls_back_and_another_replica_takes_the_marker_id(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let replica = std::sync::Arc::new(db.connect().await);
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();
        let result = inbox
            .process(&conn, id, |txn| {
                let replica = std::sync::Arc::clone(&replica);
                Box::pin(async move {
                    credit(txn, 1).await?;
                    txn.execute_unprepared("ROLLBACK").await?;
                    let other = Inbox::new(CONSUMER).expect("valid name");
                    let theirs = credit_once(&other, &replica, id).await;
                    assert!(matches!(theirs, Ok(Outcome::Processed(()))), "{theirs:?}");
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        assert!(
            matches!(
                &result,
                Err(ProcessError::Inbox(InboxError::ClaimLost { .. }))
            ),
            "{result:?}"
        );
        drop(replica);
        // The replica's delivery of `id` is committed: its redelivery is a duplicate.
        traffic_commits(db, conn, id, false, (3, 3)).await;
    })
    .await;
}

/// The same with `claim_message`, whose marker carries no token: `ClaimedMessage::commit`
/// must refuse, and hand the connection back clean.
async fn claimed_message_rolled_back_and_another_replica_takes_the_marker_id(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let replica = db.connect().await;
        let id = Uuid::new_v4();
        let (txn, claimed) = begin_and_claim(&conn, id, CONSUMER).await;
        credit(&txn, 1).await.expect("credit");
        txn.execute_unprepared("ROLLBACK").await.expect("ROLLBACK");
        let other = Inbox::new(CONSUMER).expect("valid name");
        let theirs = credit_once(&other, &replica, id).await;
        assert!(matches!(theirs, Ok(Outcome::Processed(()))), "{theirs:?}");
        let result = claimed.commit(txn).await;
        assert!(
            matches!(result, Err(InboxError::ClaimLost { .. })),
            "{result:?}"
        );
        replica.close().await.ok();
        traffic_commits(db, conn, id, false, (3, 3)).await;
    })
    .await;
}

/// `ClaimedMessage::commit` after the database ended the transaction: `ClaimLost`, and
/// the connection goes back to the pool clean.
async fn claimed_message_commit_after_rollback(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let id = Uuid::new_v4();
        let (txn, claimed) = begin_and_claim(&conn, id, CONSUMER).await;
        credit(&txn, 1).await.expect("credit");
        txn.execute_unprepared("ROLLBACK").await.expect("ROLLBACK");
        let result = claimed.commit(txn).await;
        assert!(
            matches!(result, Err(InboxError::ClaimLost { .. })),
            "{result:?}"
        );
        ordinary_traffic_commits(db, conn, id).await;
    })
    .await;
}

/// `BatchClaim::commit` after the database ended the transaction: `ClaimLost`, and
/// the connection goes back to the pool clean.
async fn batch_commit_after_rollback(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let id = Uuid::new_v4();
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let batch = txn.claim_batch([id], CONSUMER).await.expect("claim");
        assert!(batch.is_claimed(MessageId::from(id)));
        credit(&txn, 1).await.expect("credit");
        txn.execute_unprepared("ROLLBACK").await.expect("ROLLBACK");
        let result = batch.commit(txn).await;
        assert!(
            matches!(result, Err(InboxError::ClaimLost { .. })),
            "{result:?}"
        );
        ordinary_traffic_commits(db, conn, id).await;
    })
    .await;
}

/// A batch that claimed nothing new commits without a proof; after the database ended its
/// transaction that COMMIT has none to end on SQLite. It must fail there (the transaction
/// is gone) and leave the connection clean; PostgreSQL and MySQL commit nothing and say
/// `Ok`, as for any plain COMMIT after the server ended the transaction.
async fn batch_without_new_claims_commit_after_rollback(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let done = Uuid::new_v4();
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        assert!(matches!(
            credit_once(&inbox, &conn, done).await,
            Ok(Outcome::Processed(()))
        ));
        let txn = conn
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .expect("begin");
        let batch = txn.claim_batch([done], CONSUMER).await.expect("claim");
        assert!(batch.claimed.is_empty());
        txn.execute_unprepared("ROLLBACK").await.expect("ROLLBACK");
        let result = batch.commit(txn).await;
        if backend == Backend::Sqlite {
            assert!(
                matches!(result, Err(InboxError::ClaimLost { ref message_ids, .. }) if message_ids.is_empty()),
                "{result:?}"
            );
        }
        // `done` was processed before the batch: its redelivery is a duplicate.
        traffic_commits(db, conn, done, false, (3, 3)).await;
    })
    .await;
}

/// Triggers on the inbox table that refuse, with "trigger says no", an INSERT for the
/// consumer `refused.insert` and an UPDATE for `refused.update`; on SQLite by ending the
/// transaction.
async fn refusing_inbox_triggers(conn: &DatabaseConnection, backend: Backend) {
    let triggers: &[&str] = match backend {
        Backend::Sqlite => &[
            "CREATE TRIGGER refuse_insert BEFORE INSERT ON inbox \
             WHEN NEW.consumer = 'refused.insert' \
             BEGIN SELECT RAISE(ROLLBACK, 'trigger says no'); END",
            "CREATE TRIGGER refuse_update BEFORE UPDATE ON inbox \
             WHEN NEW.consumer = 'refused.update' \
             BEGIN SELECT RAISE(ROLLBACK, 'trigger says no'); END",
        ],
        Backend::Postgres | Backend::PgBouncer => &[
            "CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN \
             IF NEW.consumer = 'refused.' || lower(TG_OP) THEN \
             RAISE EXCEPTION 'trigger says no'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON inbox FOR EACH ROW \
             EXECUTE FUNCTION refuse()",
        ],
        Backend::MySql => &[
            "CREATE TRIGGER refuse_insert BEFORE INSERT ON inbox FOR EACH ROW \
             BEGIN IF NEW.consumer = 'refused.insert' THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'trigger says no'; END IF; END",
            "CREATE TRIGGER refuse_update BEFORE UPDATE ON inbox FOR EACH ROW \
             BEGIN IF NEW.consumer = 'refused.update' THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'trigger says no'; END IF; END",
        ],
    };
    for sql in triggers {
        run(conn, sql).await;
    }
}

/// Whether a failure came from the refusing triggers.
fn refused<T: std::fmt::Debug>(result: &T) -> bool {
    format!("{result:?}").contains("trigger says no")
}

/// A trigger refuses `process`'s claim INSERT: it fails before any handler runs and must
/// still hand the connection back clean.
async fn refused_claim_ends_the_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        refusing_inbox_triggers(&conn, backend).await;
        let inbox = Inbox::new("refused.insert")
            .expect("valid name")
            .with_retry(RetryPolicy::no_retry());
        let result = credit_once(&inbox, &conn, Uuid::new_v4()).await;
        assert!(result.is_err() && refused(&result), "{result:?}");
        ordinary_traffic_commits(db, conn, Uuid::new_v4()).await;
    })
    .await;
}

/// A trigger refuses the lease INSERT of `claim_lease`.
async fn refused_lease_claim_ends_the_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        refusing_inbox_triggers(&conn, backend).await;
        let options = LeaseOptions::new(Duration::from_secs(30)).expect("valid lease");
        let result = claim_lease(&conn, Uuid::new_v4(), "refused.insert", &options).await;
        assert!(result.is_err() && refused(&result), "{result:?}");
        ordinary_traffic_commits(db, conn, Uuid::new_v4()).await;
    })
    .await;
}

/// A trigger refuses the UPDATE of `Lease::complete` (a statement in a transaction of its
/// own).
async fn refused_lease_completion_ends_the_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        refusing_inbox_triggers(&conn, backend).await;
        let options = LeaseOptions::new(Duration::from_secs(30)).expect("valid lease");
        let claim = claim_lease(&conn, Uuid::new_v4(), "refused.update", &options).await;
        let Ok(LeaseClaim::Claimed(lease)) = claim else {
            panic!("a fresh lease is claimed: {claim:?}");
        };
        let result = lease.complete(&conn).await;
        assert!(result.is_err() && refused(&result), "{result:?}");
        // The unfinished lease is one more row in the inbox, with no credit.
        traffic_commits(db, conn, Uuid::new_v4(), true, (4, 3)).await;
    })
    .await;
}

/// How the database ends the transaction inside the handler's savepoints.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// The overdraft trigger (`RAISE(ROLLBACK)` on SQLite; an error elsewhere).
    Trigger,
    /// A raw `ROLLBACK` sent through the innermost savepoint.
    RawRollback,
}

/// How the handler leaves its savepoints after the failure.
#[derive(Clone, Copy, Debug)]
enum Leaving {
    /// Drops them (SeaORM queues a rollback for each).
    Dropped,
    /// Rolls each back explicitly, innermost first, ignoring their errors.
    RolledBack,
}

/// The handler opens `depth` savepoints (`txn.begin()` inside `txn.begin()`), credits,
/// and the database ends the whole transaction in the innermost one; the handler returns
/// the error. Whatever the depth, the connection must come back clean: on SQLite it went
/// back to the pool still inside a transaction, and the next deliveries settled as
/// `Processed` with nothing committed. On PostgreSQL it must come back whole, not closed
/// by the pool: it was, after a raw `ROLLBACK` two savepoints deep or more, and that close
/// could wait forever over TLS (see the module documentation).
async fn ended_inside_savepoints(backend: Backend, depth: usize, ending: Ending, leaving: Leaving) {
    with_migrated_db(backend, async |db| {
        let conn = one_connection_with_overdraft_trigger(db).await;
        let backend_pid = "SELECT pg_backend_pid()::bigint";
        let pid_before = match backend {
            Backend::Postgres => Some(scalar_i64(&conn, backend_pid).await),
            _ => None,
        };
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_retry(RetryPolicy::no_retry());
        let id = Uuid::new_v4();
        let result = inbox
            .process(&conn, id, |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    let mut levels: Vec<ObservedTransaction> = Vec::new();
                    for _ in 0..depth {
                        let next = levels.last().unwrap_or(txn).begin().await?;
                        levels.push(next);
                    }
                    let innermost = levels.last().unwrap_or(txn);
                    credit(innermost, 1).await?;
                    let failure = match ending {
                        Ending::Trigger => credit(innermost, -100).await.err(),
                        Ending::RawRollback => innermost.execute_unprepared("ROLLBACK").await.err(),
                    };
                    if let Leaving::RolledBack = leaving {
                        while let Some(level) = levels.pop() {
                            level.rollback().await.ok();
                        }
                    }
                    Err::<(), _>(failure.unwrap_or_else(|| DbErr::Custom("gave up".into())))
                })
            })
            .await;
        assert!(
            matches!(&result, Err(ProcessError::Handler(_))),
            "depth {depth}, {ending:?}, {leaving:?}: {result:?}"
        );
        if let Some(pid_before) = pid_before {
            assert_eq!(
                scalar_i64(&conn, backend_pid).await,
                pid_before,
                "depth {depth}, {ending:?}, {leaving:?}: the pool closed the connection"
            );
        }
        assert_eq!(committed(&conn).await, (0, 0), "nothing committed");
        ordinary_traffic_commits(db, conn, id).await;
    })
    .await;
}

async fn trigger_in_savepoints_1_deep(backend: Backend) {
    ended_inside_savepoints(backend, 1, Ending::Trigger, Leaving::Dropped).await;
}

async fn trigger_in_savepoints_2_deep(backend: Backend) {
    ended_inside_savepoints(backend, 2, Ending::Trigger, Leaving::Dropped).await;
}

async fn trigger_in_savepoints_3_deep(backend: Backend) {
    ended_inside_savepoints(backend, 3, Ending::Trigger, Leaving::Dropped).await;
}

async fn trigger_in_savepoints_2_deep_rolled_back(backend: Backend) {
    ended_inside_savepoints(backend, 2, Ending::Trigger, Leaving::RolledBack).await;
}

async fn raw_rollback_in_savepoints_1_deep(backend: Backend) {
    ended_inside_savepoints(backend, 1, Ending::RawRollback, Leaving::Dropped).await;
}

async fn raw_rollback_in_savepoints_2_deep(backend: Backend) {
    ended_inside_savepoints(backend, 2, Ending::RawRollback, Leaving::Dropped).await;
}

async fn raw_rollback_in_savepoints_3_deep(backend: Backend) {
    ended_inside_savepoints(backend, 3, Ending::RawRollback, Leaving::Dropped).await;
}

async fn raw_rollback_in_savepoints_3_deep_rolled_back(backend: Backend) {
    ended_inside_savepoints(backend, 3, Ending::RawRollback, Leaving::RolledBack).await;
}

on_every_backend!(
    handler_rolls_back_and_another_replica_takes_the_marker_id,
    trigger_in_savepoints_1_deep,
    trigger_in_savepoints_2_deep,
    trigger_in_savepoints_3_deep,
    trigger_in_savepoints_2_deep_rolled_back,
    raw_rollback_in_savepoints_1_deep,
    raw_rollback_in_savepoints_2_deep,
    raw_rollback_in_savepoints_3_deep,
    raw_rollback_in_savepoints_3_deep_rolled_back,
    claimed_message_rolled_back_and_another_replica_takes_the_marker_id,
    refused_claim_ends_the_transaction,
    refused_lease_claim_ends_the_transaction,
    refused_lease_completion_ends_the_transaction,
    batch_without_new_claims_commit_after_rollback,
    trigger_ends_the_transaction,
    handler_rolls_back_then_fails,
    handler_rolls_back_then_returns_ok,
    claimed_message_commit_after_rollback,
    batch_commit_after_rollback,
);

/// Server backends only: an embedded database has no server to kill a connection.
mod killed {
    use super::*;
    use std::sync::Arc;

    /// The server kills the handler's connection, the handler returns an error, and the
    /// rollback fails on the dead socket: sqlx's ping on release must close that connection,
    /// so the pool of one lends a new one and the next deliveries commit at the first try.
    async fn rollback_on_a_killed_connection(backend: Backend) {
        with_migrated_db(backend, async |db| {
            let conn = one_connection_with_overdraft_trigger(db).await;
            let admin = Arc::new(db.connect_with(1).await);
            let inbox = Inbox::new(CONSUMER).expect("valid name");
            let id = Uuid::new_v4();
            let result = inbox
                .process(&conn, id, |txn| {
                    let admin = Arc::clone(&admin);
                    Box::pin(async move {
                        credit(txn, 1).await?;
                        let own_id = match backend {
                            Backend::Postgres | Backend::PgBouncer => "SELECT pg_backend_pid()::bigint",
                            _ => "SELECT CAST(CONNECTION_ID() AS SIGNED)",
                        };
                        let own_id = txn
                            .query_one_raw(Statement::from_string(txn.get_database_backend(), own_id))
                            .await?
                            .ok_or_else(|| DbErr::Custom("no connection id".into()))?
                            .try_get_by_index::<i64>(0)?;
                        let (kill, alive) = match backend {
                            Backend::Postgres | Backend::PgBouncer => (
                                format!("SELECT pg_terminate_backend({own_id})"),
                                format!("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = {own_id}"),
                            ),
                            _ => (
                                format!("KILL CONNECTION {own_id}"),
                                format!(
                                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {own_id}"
                                ),
                            ),
                        };
                        run(admin.as_ref(), &kill).await;
                        let deadline = Instant::now() + Duration::from_secs(30);
                        while scalar_i64(admin.as_ref(), &alive).await > 0 {
                            assert!(Instant::now() < deadline, "{kill} did not end the connection");
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err::<(), _>(DbErr::Custom("gave up".into()))
                    })
                })
                .await;
            assert!(
                matches!(&result, Err(ProcessError::Handler(DbErr::Custom(_)))),
                "{result:?}"
            );
            ordinary_traffic_commits(db, conn, id).await;
        })
        .await;
    }

    on_server_backends!(rollback_on_a_killed_connection);
}
