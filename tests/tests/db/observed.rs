//! The handler's transaction, observed: `Inbox::process` sees every statement its handler
//! runs through the `ObservedTransaction`. Every statement succeeded: COMMIT without the
//! pre-commit proof (on every backend but a Galera node, where a brute-force abort can end
//! a transaction without failing a statement: `galera.rs` shows it kept there). A
//! statement failed and the
//! database ended the transaction: later statements are refused, never sent, and nothing
//! is committed. A savepoint rolled back after a failure inside it still commits the rest.
//!
//! Statements are counted with SeaORM's metric callback on the handler's pool, which sees
//! every prepared statement sent (the proof is one).

use futures_util::TryStreamExt;
use inbox_tests::{
    Backend, TestDb, accounts_and_audit_row, committed, credit, on_every_backend, run, scalar_i64,
    sql_state, with_migrated_db,
};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbErr, Statement, StreamTrait, TransactionSession,
    TransactionTrait,
};
use sea_orm_inbox::prelude::*;
use std::sync::{Arc, Mutex};
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";
/// The pre-commit proof's read of the marker by its id.
const PROOF: &str = "SELECT 1 FROM inbox WHERE id =";

/// The SQL of every statement sent through `conn` from now on.
fn record_statements(conn: &mut DatabaseConnection) -> Arc<Mutex<Vec<String>>> {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&sent);
    conn.set_metric_callback(move |info| {
        sink.lock()
            .expect("statement log")
            .push(info.statement.sql.clone());
    });
    sent
}

fn count(sent: &Mutex<Vec<String>>, prefix: &str) -> usize {
    sent.lock()
        .expect("statement log")
        .iter()
        .filter(|sql| sql.trim_start().starts_with(prefix))
        .count()
}

/// A migrated database with account 1 and an audit table holding row 1, which an audit
/// INSERT of 1 then violates; and a separate handler pool whose statements are recorded.
async fn setup(db: &TestDb) -> (DatabaseConnection, DatabaseConnection) {
    let conn = accounts_and_audit_row(db).await;
    let handler_pool = db.connect().await;
    (conn, handler_pool)
}

/// A handler whose statements all succeed commits without the proof query, MariaDB
/// included: the server is no Galera node, so nothing ends its transactions silently.
async fn clean_handler_commits_without_the_proof(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, mut handler_pool) = setup(db).await;
        let sent = record_statements(&mut handler_pool);
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        for _ in 0..3 {
            let outcome = inbox
                .process(&handler_pool, Uuid::new_v4(), |txn| {
                    Box::pin(credit(txn, 1))
                })
                .await;
            assert!(matches!(outcome, Ok(Outcome::Processed(()))), "{outcome:?}");
        }
        assert_eq!(
            count(&sent, PROOF),
            0,
            "{backend:?}: proof queries for 3 clean calls"
        );
        assert_eq!(committed(&conn).await, (3, 3));
    })
    .await;
}

/// PostgreSQL: a handler that swallows a failed statement gets `ClaimLost` naming that
/// failure, with no proof query sent and the statement after the failure never sent.
/// Elsewhere the failed statement alone is undone: `Processed`, after one proof.
async fn swallowed_failure_is_seen_without_a_proof(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, mut handler_pool) = setup(db).await;
        let sent = record_statements(&mut handler_pool);
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let result = inbox
            .process(&handler_pool, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    txn.execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
                        .await
                        .expect_err("the audit row exists");
                    let after = credit(txn, 1).await;
                    Ok::<_, DbErr>(after.map_err(|err| err.to_string()))
                })
            })
            .await;
        match backend {
            Backend::Postgres | Backend::PgBouncer => {
                let Err(ProcessError::Inbox(InboxError::ClaimLost {
                    source: Some(swallowed),
                    ..
                })) = &result
                else {
                    panic!("{result:?}");
                };
                assert_eq!(sql_state(swallowed).as_deref(), Some("23505"));
                assert_eq!(count(&sent, PROOF), 0, "no proof query");
                assert_eq!(
                    count(&sent, "UPDATE account"),
                    0,
                    "the credit was never sent"
                );
                assert_eq!(committed(&conn).await, (0, 0));
            }
            Backend::MySql | Backend::Sqlite => {
                assert!(
                    matches!(&result, Ok(Outcome::Processed(Ok(())))),
                    "{result:?}"
                );
                assert_eq!(count(&sent, PROOF), 1, "one proof after the failure");
                assert_eq!(committed(&conn).await, (1, 1));
            }
        }
    })
    .await;
}

/// A failure inside a savepoint the handler rolls back leaves the transaction going on
/// everywhere (PostgreSQL included): the credit and the marker commit.
async fn savepoint_rolled_back_after_a_failure_still_commits(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, handler_pool) = setup(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let result = inbox
            .process(&handler_pool, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    let savepoint = txn.begin().await?;
                    savepoint
                        .execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
                        .await
                        .expect_err("the audit row exists");
                    savepoint.rollback().await?;
                    let nested = txn
                        .transaction::<_, (), DbErr>(|inner| {
                            Box::pin(async move {
                                inner
                                    .execute_unprepared("INSERT INTO audit (ref) VALUES (2)")
                                    .await
                                    .map(|_| ())
                            })
                        })
                        .await;
                    nested.map_err(|err| DbErr::Custom(err.to_string()))?;
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!(committed(&conn).await, (1, 1));
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM audit").await, 2);
    })
    .await;
}

/// The handler names its own savepoint in SQL (as a library it calls may), meets a failed
/// statement inside it and rolls back to it: the transaction goes on, as it does on a
/// plain `DatabaseTransaction`, and commits. On PostgreSQL the wrapper took the failure
/// for the end of the transaction and refused the `ROLLBACK TO SAVEPOINT`: every
/// redelivery failed the same way.
async fn handler_rolls_back_to_its_own_named_savepoint(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, handler_pool) = setup(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let result = inbox
            .process(&handler_pool, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    txn.execute_unprepared("SAVEPOINT own_savepoint").await?;
                    txn.execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
                        .await
                        .expect_err("the audit row exists");
                    txn.execute_unprepared("ROLLBACK TO SAVEPOINT own_savepoint")
                        .await?;
                    txn.execute_unprepared("RELEASE SAVEPOINT own_savepoint")
                        .await?;
                    txn.execute_unprepared("INSERT INTO audit (ref) VALUES (2)")
                        .await?;
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!(committed(&conn).await, (1, 1));
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM audit").await, 2);
    })
    .await;
}

/// The same failure after the handler released its savepoint: nothing can restore the
/// transaction, and nothing of it commits (PostgreSQL: `ClaimLost`, the proof meets the
/// aborted transaction; elsewhere the statement alone failed and the rest commits).
async fn failure_after_the_handlers_savepoint_was_released(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, handler_pool) = setup(db).await;
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_retry(RetryPolicy::no_retry());
        let result = inbox
            .process(&handler_pool, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    txn.execute_unprepared("SAVEPOINT own_savepoint").await?;
                    txn.execute_unprepared("RELEASE SAVEPOINT own_savepoint")
                        .await?;
                    txn.execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
                        .await
                        .ok();
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        match backend {
            Backend::Postgres | Backend::PgBouncer => {
                assert!(
                    matches!(
                        result,
                        Err(ProcessError::Inbox(InboxError::ClaimLost { .. }))
                    ),
                    "{result:?}"
                );
                assert_eq!(committed(&conn).await, (0, 0));
            }
            Backend::MySql | Backend::Sqlite => {
                assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
                assert_eq!(committed(&conn).await, (1, 1));
            }
        }
    })
    .await;
}

/// Entity-style reads through the observed transaction: a stream of rows, and a statement
/// built by SeaORM; a failing statement inside a stream is seen like any other.
async fn streams_and_built_statements_go_through(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, handler_pool) = setup(db).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let result = inbox
            .process(&handler_pool, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    let rows: Vec<_> = txn
                        .stream_raw(Statement::from_string(
                            ConnectionTrait::get_database_backend(txn),
                            "SELECT ref FROM audit",
                        ))
                        .await?
                        .try_collect()
                        .await?;
                    credit(txn, i64::try_from(rows.len()).unwrap_or(0)).await?;
                    Ok::<_, DbErr>(rows.len())
                })
            })
            .await;
        assert!(matches!(result, Ok(Outcome::Processed(1))), "{result:?}");
        assert_eq!(committed(&conn).await, (1, 1));
    })
    .await;
}

/// A raw transaction-control statement is not seen through: the proof runs, and a handler
/// that rolled the transaction back itself gets `ClaimLost`, as before. SQLite says at no
/// network cost whether the statement ended the transaction, and is asked at once (so a
/// savepoint the handler drops afterwards is not rolled back into nothing): the end is
/// known without the proof there.
async fn raw_rollback_in_the_handler_is_proven(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, mut handler_pool) = setup(db).await;
        let sent = record_statements(&mut handler_pool);
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let result = inbox
            .process(&handler_pool, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    txn.execute_unprepared("ROLLBACK").await?;
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        assert!(
            matches!(
                result,
                Err(ProcessError::Inbox(InboxError::ClaimLost { .. }))
            ),
            "{result:?}"
        );
        let proofs = if backend == Backend::Sqlite { 0 } else { 1 };
        assert_eq!(count(&sent, PROOF), proofs, "the proof ran where needed");
        assert_eq!(committed(&conn).await.0, 0);
    })
    .await;
}

on_every_backend!(
    clean_handler_commits_without_the_proof,
    swallowed_failure_is_seen_without_a_proof,
    savepoint_rolled_back_after_a_failure_still_commits,
    streams_and_built_statements_go_through,
    raw_rollback_in_the_handler_is_proven,
    handler_rolls_back_to_its_own_named_savepoint,
    failure_after_the_handlers_savepoint_was_released,
    overlapping_batches_apply_each_id_once,
    batch_handler_going_on_after_a_failure,
);

/// `process_batch` by two replicas (separate pools) on overlapping batches at once, the
/// handler going on after any failed statement (swallowing it): every id is applied
/// exactly once, every applied id has its marker, and each call's lists partition its ids.
async fn overlapping_batches_apply_each_id_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        run(&conn, "CREATE TABLE applied (id VARCHAR(36) PRIMARY KEY)").await;
        let ids: Vec<Uuid> = (0..60).map(|_| Uuid::new_v4()).collect();
        let inbox = Inbox::new("projector").expect("valid name");
        let mut replicas = Vec::new();
        for replica in 0..2 {
            let pool = db.connect().await;
            let inbox = inbox.clone();
            // Replica 0 takes ids 0..40, replica 1 takes 20..60, each in batches of 10.
            let mine: Vec<Uuid> = ids[replica * 20..replica * 20 + 40].to_vec();
            replicas.push(tokio::spawn(async move {
                let mut seen = 0;
                for chunk in mine.chunks(10) {
                    let outcome = inbox
                        .process_batch(&pool, chunk.iter().copied(), |txn, claimed| {
                            Box::pin(async move {
                                for id in claimed {
                                    let sql = format!("INSERT INTO applied (id) VALUES ('{id}')");
                                    // Swallowed on purpose: the observed transaction keeps
                                    // anything after an ended transaction from committing.
                                    let _ = txn.execute_unprepared(&sql).await;
                                }
                                Ok::<_, DbErr>(())
                            })
                        })
                        .await
                        .expect("the batch settles");
                    assert_eq!(
                        outcome.processed.len() + outcome.duplicates.len(),
                        chunk.len(),
                        "{outcome:?}"
                    );
                    seen += outcome.processed.len();
                }
                pool.close().await.ok();
                seen
            }));
        }
        let mut processed = 0;
        for replica in replicas {
            processed += replica.await.expect("replica task");
        }
        assert_eq!(
            processed,
            ids.len(),
            "each id processed by exactly one call"
        );
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM applied").await, 60);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 60);
    })
    .await;
}

/// PostgreSQL: a batch handler that swallows a failed statement and goes on gets
/// `ClaimLost` naming it, its later writes never sent and nothing committed; on the
/// other backends the failed statement alone is undone and the batch commits.
async fn batch_handler_going_on_after_a_failure(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (conn, mut handler_pool) = setup(db).await;
        let sent = record_statements(&mut handler_pool);
        let inbox = Inbox::new("projector").expect("valid name");
        let ids = [Uuid::new_v4(), Uuid::new_v4()];
        let result = inbox
            .process_batch(&handler_pool, ids, |txn, claimed| {
                Box::pin(async move {
                    let _ = txn
                        .execute_unprepared("INSERT INTO audit (ref) VALUES (1)")
                        .await;
                    for _ in claimed {
                        let _ = credit(txn, 1).await;
                    }
                    Ok::<_, DbErr>(())
                })
            })
            .await;
        match backend {
            Backend::Postgres | Backend::PgBouncer => {
                assert!(
                    matches!(
                        &result,
                        Err(ProcessError::Inbox(InboxError::ClaimLost {
                            source: Some(_),
                            ..
                        }))
                    ),
                    "{result:?}"
                );
                assert_eq!(count(&sent, "UPDATE account"), 0, "no credit was sent");
                assert_eq!(committed(&conn).await, (0, 0));
            }
            Backend::MySql | Backend::Sqlite => {
                let outcome = result.expect("committed");
                assert_eq!(outcome.processed.len(), 2);
                assert_eq!(committed(&conn).await, (2, 2));
            }
        }
    })
    .await;
}
