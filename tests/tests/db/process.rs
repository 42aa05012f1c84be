//! `Inbox::process`: exactly once under racing replicas, handler errors roll back and are
//! not retried (unless they are transient database errors), transient lock failures are
//! retried in a fresh transaction, exhaustion names its cause, and the metrics count it all.

use inbox_tests::{
    Backend, create_accounts, credit, credit_once, hold_claim_then_roll_back, impatient_replica,
    on_every_backend, on_pgbouncer, poll_then_drop, run, scalar_i64, with_fresh_db,
    with_migrated_db,
};
use sea_orm::{ConnAcquireErr, ConnectionTrait, DatabaseConnection, DbErr};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify};
use sea_orm_inbox_migration::Migrator;
use sea_orm_migration::MigratorTrait;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use uuid::Uuid;

async fn replicas_process_each_message_once(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let replicas = [Arc::new(db.connect().await), Arc::new(db.connect().await)];
        create_accounts(replicas[0].as_ref()).await;
        let inbox = Inbox::new("billing.credit").expect("valid name");
        let ids: Vec<Uuid> = (0..40).map(|_| Uuid::new_v4()).collect();

        let mut tasks = Vec::new();
        for replica in &replicas {
            for id in ids.iter().copied() {
                let (replica, inbox) = (Arc::clone(replica), inbox.clone());
                tasks.push(tokio::spawn(async move {
                    credit_once(&inbox, &replica, id).await
                }));
            }
        }
        for task in tasks {
            let result = task.await.expect("task");
            assert_eq!(
                Settlement::of(&result),
                Settlement::Ack,
                "{:?}",
                result.err()
            );
        }
        let counts = inbox.metrics().snapshot();
        assert_eq!(
            (counts.processed, counts.duplicates),
            (40, 40),
            "{counts:?}"
        );
        let conn = replicas[0].as_ref();
        assert_eq!(
            scalar_i64(conn, "SELECT balance FROM account WHERE id = 1").await,
            40
        );
        assert_eq!(scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await, 40);
    })
    .await;
}

async fn handler_error_rolls_back_and_is_not_retried(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new("billing.credit").expect("valid name");
        let id = Uuid::new_v4();
        let runs = AtomicU32::new(0);

        let failed = inbox
            .process(&conn, id, |txn| {
                runs.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    credit(txn, 1).await.map_err(|e| e.to_string())?;
                    Err::<(), _>("card declined".to_string())
                })
            })
            .await;
        assert!(
            matches!(&failed, Err(ProcessError::Handler(msg)) if msg == "card declined"),
            "{failed:?}"
        );
        assert_eq!(Settlement::of(&failed), Settlement::Nack(None));
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "handler errors are not retried"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            0,
            "claim rolled back"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            0
        );

        let redelivered = credit_once(&inbox, &conn, id).await;
        assert!(
            matches!(redelivered, Ok(Outcome::Processed(()))),
            "{redelivered:?}"
        );
        let counts = inbox.metrics().snapshot();
        assert_eq!(
            (counts.handler_errors, counts.processed),
            (1, 1),
            "{counts:?}"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
    })
    .await;
}

async fn transient_lock_failures_are_retried_in_a_fresh_transaction(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let replica = impatient_replica(db).await;
        create_accounts(&replica).await;
        let id = Uuid::new_v4();
        let hold = if backend == Backend::MySql {
            Duration::from_millis(2500)
        } else {
            Duration::from_millis(600)
        };
        let holder = hold_claim_then_roll_back(db, id, "billing.credit", hold).await;

        let inbox = Inbox::new("billing.credit")
            .expect("valid name")
            .with_retry(
                RetryPolicy::default()
                    .max_attempts(20)
                    .backoff(Duration::from_millis(50), Duration::from_millis(300))
                    .expect("a short backoff"),
            );
        let runs = AtomicU32::new(0);
        let result = inbox
            .process(&replica, id, |txn| {
                runs.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move { credit(txn, 1).await })
            })
            .await;
        holder.await.expect("holder");
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        let counts = inbox.metrics().snapshot();
        assert!(
            counts.transient_retries >= 1,
            "the first attempt met the lock: {counts:?}"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the handler ran only in the attempt that claimed"
        );
        assert_eq!(
            scalar_i64(&replica, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
    })
    .await;
}

async fn exhausted_retries_name_the_last_transient_cause(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let replica = impatient_replica(db).await;
        let id = Uuid::new_v4();
        let holder =
            hold_claim_then_roll_back(db, id, "billing.credit", Duration::from_secs(4)).await;

        let inbox = Inbox::new("billing.credit")
            .expect("valid name")
            .with_retry(
                RetryPolicy::default()
                    .max_attempts(2)
                    .backoff(Duration::from_millis(1), Duration::from_millis(1))
                    .expect("a short backoff"),
            );
        let result = credit_once(&inbox, &replica, id).await;
        match &result {
            Err(ProcessError::RetriesExhausted {
                attempts: 2,
                source,
            }) => {
                let cause = source.db_err().expect("a database cause");
                assert_eq!(classify(cause), DbErrorKind::Transient, "{cause}");
                assert!(
                    result
                        .as_ref()
                        .unwrap_err()
                        .to_string()
                        .contains("gave up after 2 attempts")
                );
            }
            other => panic!("expected RetriesExhausted on {backend:?}, got {other:?}"),
        }
        assert_eq!(Settlement::of(&result), Settlement::Nack(None));
        let counts = inbox.metrics().snapshot();
        assert_eq!(
            (counts.transient_retries, counts.failures),
            (1, 1),
            "{counts:?}"
        );
        holder.await.expect("holder");
    })
    .await;
}

/// Runs a handler that credits, then fails its first `failing_runs` runs with `error()`;
/// returns the result, the handler's runs and the balance.
async fn credit_failing_first<E: Send + 'static>(
    conn: &DatabaseConnection,
    failing_runs: u32,
    error: fn() -> E,
) -> (Result<Outcome<()>, ProcessError<E>>, u32, i64) {
    run(conn, "UPDATE account SET balance = 0 WHERE id = 1").await;
    let inbox = Inbox::new("billing.credit")
        .expect("valid name")
        .with_retry(
            RetryPolicy::default()
                .max_attempts(3)
                .backoff(Duration::from_millis(1), Duration::from_millis(5))
                .expect("a short backoff"),
        );
    let runs = AtomicU32::new(0);
    let result = inbox
        .process(conn, Uuid::new_v4(), |txn| {
            let fail = runs.fetch_add(1, Ordering::SeqCst) < failing_runs;
            Box::pin(async move {
                credit(txn, 1).await.map_err(|_| error())?;
                if fail { Err(error()) } else { Ok(()) }
            })
        })
        .await;
    let balance = scalar_i64(conn, "SELECT balance FROM account WHERE id = 1").await;
    (result, runs.load(Ordering::SeqCst), balance)
}

fn lost_connection() -> DbErr {
    DbErr::ConnectionAcquire(ConnAcquireErr::ConnectionClosed)
}

/// A transient `DbErr` returned by the handler itself (its statement met a deadlock or a
/// dropped connection) restarts the attempt in a fresh transaction; so does one inside a
/// boxed error. Other handler errors are not retried, and a transient one that outlasts
/// the attempts comes back as the handler's error.
async fn transient_handler_db_errors_are_retried(backend: Backend) {
    type Boxed = Box<dyn std::error::Error + Send + Sync>;
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;

        let (result, runs, balance) = credit_failing_first(&conn, 1, lost_connection).await;
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!((runs, balance), (2, 1), "retried once, applied once");

        let boxed = || -> Boxed { Box::new(lost_connection()) };
        let (result, runs, balance) = credit_failing_first(&conn, 1, boxed).await;
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!((runs, balance), (2, 1));

        let not_transient = || DbErr::Custom("constraint the handler broke".into());
        let (result, runs, balance) = credit_failing_first(&conn, 1, not_transient).await;
        assert!(
            matches!(result, Err(ProcessError::Handler(DbErr::Custom(_)))),
            "{result:?}"
        );
        assert_eq!((runs, balance), (1, 0), "not retried, rolled back");

        let (result, runs, balance) = credit_failing_first(&conn, 10, lost_connection).await;
        assert!(
            matches!(
                result,
                Err(ProcessError::Handler(DbErr::ConnectionAcquire(_)))
            ),
            "{result:?}"
        );
        assert_eq!((runs, balance), (3, 0), "every attempt rolled back");
    })
    .await;
}

async fn missing_table_is_reported_not_retried(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        let inbox = Inbox::new("billing.credit").expect("valid name");
        let result = credit_once(&inbox, &conn, Uuid::new_v4()).await;
        assert!(
            matches!(
                &result,
                Err(ProcessError::Inbox(InboxError::MissingTable { .. }))
            ),
            "{result:?}"
        );
        assert_eq!(Settlement::for_delivery(&result, 1), Settlement::DeadLetter);
        assert!(result.unwrap_err().to_string().contains("CreateInbox"));
        assert_eq!(inbox.metrics().snapshot().transient_retries, 0);
        conn.execute_unprepared("SELECT 1")
            .await
            .expect("connection still usable");
    })
    .await;
}

/// What no redelivery can fix is dead-lettered on the first delivery, with the database's
/// own verdict: the inbox's second migration not run (a missing column), a handler writing
/// a column that does not exist, a handler's unique violation on its own index. Before,
/// each was nacked and redelivered at once, forever. A failure worth a retry is nacked with
/// a delay that grows with the delivery count.
async fn permanent_failures_are_dead_lettered_transient_ones_delayed(backend: Backend) {
    with_fresh_db(backend, async |db| {
        let conn = db.connect().await;
        Migrator::up(&conn, Some(1))
            .await
            .expect("CreateInbox only");
        create_accounts(&conn).await;
        run(&conn, "CREATE TABLE orders (number BIGINT PRIMARY KEY)").await;
        let inbox = Inbox::new("billing.credit").expect("valid name");
        let unmigrated = credit_once(&inbox, &conn, Uuid::new_v4()).await;
        let kind = unmigrated
            .as_ref()
            .err()
            .and_then(ProcessError::inbox_error)
            .and_then(InboxError::db_err)
            .map(classify);
        assert_eq!(kind, Some(DbErrorKind::MissingColumn), "{unmigrated:?}");
        assert_eq!(
            Settlement::for_delivery(&unmigrated, 1),
            Settlement::DeadLetter
        );
        Migrator::up(&conn, None).await.expect("the rest");

        let handle = |sql: &'static str| {
            inbox.process(&conn, Uuid::new_v4(), move |txn| {
                Box::pin(async move { txn.execute_unprepared(sql).await.map(drop) })
            })
        };
        let first = handle("INSERT INTO orders (number) VALUES (42)").await;
        assert!(matches!(first, Ok(Outcome::Processed(()))), "{first:?}");
        for (sql, expected) in [
            (
                "INSERT INTO orders (number) VALUES (42)",
                DbErrorKind::OtherUniqueViolation,
            ),
            (
                "UPDATE account SET no_such_column = 1 WHERE id = 1",
                DbErrorKind::MissingColumn,
            ),
        ] {
            let result = handle(sql).await;
            let kind = result
                .as_ref()
                .err()
                .and_then(ProcessError::handler_error)
                .map(classify);
            assert_eq!(kind, Some(expected), "{sql}: {result:?}");
            assert_eq!(
                Settlement::for_delivery(&result, 1),
                Settlement::DeadLetter,
                "{sql}"
            );
        }

        let declined = inbox
            .process(&conn, Uuid::new_v4(), |_| {
                Box::pin(async { Err::<(), _>("card declined".to_string()) })
            })
            .await;
        let delays: Vec<_> = (1..=3)
            .map(|delivery| Settlement::for_delivery(&declined, delivery))
            .collect();
        let secs = |s| Settlement::Nack(Some(Duration::from_secs(s)));
        assert_eq!(delays, [secs(1), secs(2), secs(4)]);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM orders").await, 1);
        assert_eq!(scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await, 1);
    })
    .await;
}

/// `process` dropped at any of its await points (an aborted consumer task, a `select!`
/// that picked shutdown) leaves its pool's one connection usable: the next delivery on it
/// is processed. Dropped after 1, 2, ... polls until the handler had started.
async fn a_process_dropped_at_any_await_point_leaves_its_pool_usable(backend: Backend) {
    let mut polls = 1;
    loop {
        let handler_started = with_migrated_db(backend, async |db| {
            let conn = db.connect_with(1).await;
            create_accounts(&conn).await;
            let inbox = Inbox::new("billing.credit").expect("valid name");
            let started = Arc::new(AtomicU32::new(0));
            let hanging = inbox.process(&conn, Uuid::new_v4(), |_txn| {
                started.fetch_add(1, Ordering::SeqCst);
                Box::pin(std::future::pending::<Result<(), DbErr>>())
            });
            assert!(!poll_then_drop(hanging, polls).await, "the handler hangs");

            let next = tokio::time::timeout(
                Duration::from_secs(10),
                credit_once(&inbox, &conn, Uuid::new_v4()),
            )
            .await
            .unwrap_or_else(|_| panic!("dropped after {polls} polls: the next delivery hangs"));
            assert!(
                matches!(next, Ok(Outcome::Processed(()))),
                "dropped after {polls} polls: the next delivery {next:?}"
            );
            assert_eq!(
                scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
                1,
                "dropped after {polls} polls"
            );
            started.load(Ordering::SeqCst) > 0
        })
        .await;
        if handler_started {
            break;
        }
        polls += 1;
        assert!(polls < 100, "the handler never started");
    }
}

/// `process` dropped while its handler's statement with a bound value is in flight (on
/// MySQL/MariaDB a prepared statement: PREPARE, then EXECUTE, two exchanges) leaves its
/// pool's one connection usable: the next delivery on it is processed and the dropped
/// credit is not applied. Dropped after 1, 2, ... polls until the statement had finished.
async fn a_process_dropped_inside_its_handlers_statement_leaves_its_pool_usable(backend: Backend) {
    let mut polls = 1;
    loop {
        let statement_done = with_migrated_db(backend, async |db| {
            let conn = db.connect_with(1).await;
            create_accounts(&conn).await;
            let inbox = Inbox::new("billing.credit").expect("valid name");
            let done = Arc::new(AtomicU32::new(0));
            let hanging = inbox.process(&conn, Uuid::new_v4(), |txn| {
                let done = Arc::clone(&done);
                Box::pin(async move {
                    credit(txn, 100).await?;
                    done.fetch_add(1, Ordering::SeqCst);
                    std::future::pending::<Result<(), DbErr>>().await
                })
            });
            assert!(!poll_then_drop(hanging, polls).await, "the handler hangs");

            let next = tokio::time::timeout(
                Duration::from_secs(10),
                credit_once(&inbox, &conn, Uuid::new_v4()),
            )
            .await
            .unwrap_or_else(|_| panic!("dropped after {polls} polls: the next delivery hangs"));
            assert!(
                matches!(next, Ok(Outcome::Processed(()))),
                "dropped after {polls} polls: the next delivery {next:?}"
            );
            assert_eq!(
                scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
                1,
                "dropped after {polls} polls"
            );
            done.load(Ordering::SeqCst) > 0
        })
        .await;
        if statement_done {
            break;
        }
        polls += 1;
        assert!(polls < 100, "the handler's statement never finished");
    }
}

mod dropped_inside_the_handlers_statement {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite() {
        a_process_dropped_inside_its_handlers_statement_leaves_its_pool_usable(Backend::Sqlite)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
    async fn postgres() {
        a_process_dropped_inside_its_handlers_statement_leaves_its_pool_usable(Backend::Postgres)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
    async fn mysql() {
        a_process_dropped_inside_its_handlers_statement_leaves_its_pool_usable(Backend::MySql)
            .await;
    }
}

mod dropped_at_any_await_point {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite() {
        a_process_dropped_at_any_await_point_leaves_its_pool_usable(Backend::Sqlite).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
    async fn postgres() {
        a_process_dropped_at_any_await_point_leaves_its_pool_usable(Backend::Postgres).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
    async fn mysql() {
        a_process_dropped_at_any_await_point_leaves_its_pool_usable(Backend::MySql).await;
    }
}

on_every_backend!(
    permanent_failures_are_dead_lettered_transient_ones_delayed,
    replicas_process_each_message_once,
    handler_error_rolls_back_and_is_not_retried,
    transient_lock_failures_are_retried_in_a_fresh_transaction,
    exhausted_retries_name_the_last_transient_cause,
    missing_table_is_reported_not_retried,
    transient_handler_db_errors_are_retried,
    the_applications_own_verdict_settles_handler_errors,
);

/// The application names its own errors: a `Permanent` business error is dead-lettered on
/// its first delivery (before: nacked until the broker's limit, 10 deliveries over 31 s on
/// a quorum queue with limit 4), also inside `anyhow` with context; a `Transient` one is
/// nacked with the delay although it wraps what the database calls permanent; neither
/// commits anything.
async fn the_applications_own_verdict_settles_handler_errors(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new("billing.credit").expect("valid name");
        let permanent = inbox
            .process(&conn, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    credit(txn, 1).await?;
                    Err::<(), _>(
                        anyhow::Error::new(Permanent::new("no product 42")).context("order 7"),
                    )
                })
            })
            .await;
        assert_eq!(
            Settlement::for_delivery(&permanent, 1),
            Settlement::DeadLetter,
            "{permanent:?}"
        );
        let transient = inbox
            .process(&conn, Uuid::new_v4(), |txn| {
                Box::pin(async move {
                    let missing = txn
                        .execute_unprepared("UPDATE account SET no_such_column = 1")
                        .await
                        .expect_err("no such column");
                    Err::<(), _>(Transient::new(missing))
                })
            })
            .await;
        assert!(
            matches!(
                Settlement::for_delivery(&transient, 1),
                Settlement::Nack(Some(_))
            ),
            "{transient:?}"
        );
        assert_eq!(
            scalar_i64(&conn, "SELECT COUNT(*) FROM inbox").await,
            0,
            "nothing committed"
        );
    })
    .await;
}

#[test]
fn invalid_consumer_names_are_refused_at_construction() {
    assert!(matches!(Inbox::new(""), Err(InboxError::EmptyConsumer)));
    assert!(matches!(
        Inbox::new("x".repeat(201)),
        Err(InboxError::ConsumerTooLong { chars: 201 })
    ));
}

on_pgbouncer!(
    replicas_process_each_message_once,
    handler_error_rolls_back_and_is_not_retried,
    missing_table_is_reported_not_retried,
    transient_handler_db_errors_are_retried,
);
