//! Fault tests: the server kills the connection between the claim and the commit, and the
//! broker's ack is lost after the commit. Every path ends with the effect applied exactly
//! once and the message acked.
//!
//! (A handler that fails on its first attempt and succeeds on redelivery is
//! `process.rs::handler_error_rolls_back_and_is_not_retried`, on every backend.)

use inbox_tests::{
    Backend, TestDb, create_accounts, credit, on_every_backend, scalar_i64, with_migrated_db,
};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox::{DbErrorKind, classify};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use uuid::Uuid;

const CONSUMER: &str = "billing.credit";

/// Kills server connections from a pool of its own, the way a failover, an idle-session
/// reaper or an operator does.
struct Killer {
    admin: DatabaseConnection,
    backend: Backend,
}

impl Killer {
    /// Server backends only (see [`on_server_backends!`]): an embedded database has no
    /// server to drop a connection.
    async fn new(db: &TestDb) -> Arc<Self> {
        Arc::new(Self {
            admin: db.connect_with(1).await,
            backend: db.backend,
        })
    }

    /// The server's id of the connection `txn` runs on.
    async fn connection_id(txn: &impl ConnectionTrait) -> Result<i64, DbErr> {
        let sql = match txn.get_database_backend() {
            sea_orm::DbBackend::Postgres => "SELECT pg_backend_pid()::bigint",
            _ => "SELECT CAST(CONNECTION_ID() AS SIGNED)",
        };
        let row = txn
            .query_one_raw(sea_orm::Statement::from_string(
                txn.get_database_backend(),
                sql,
            ))
            .await?
            .ok_or_else(|| DbErr::Custom(format!("{sql}: no row")))?;
        row.try_get_by_index::<i64>(0)
    }

    /// Kills connection `id` and waits until the server has let it go, so the victim's
    /// next statement cannot slip in first.
    async fn kill(&self, id: i64) {
        let (kill, alive) = match self.backend {
            Backend::Postgres => (
                format!("SELECT pg_terminate_backend({id})"),
                format!("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = {id}"),
            ),
            _ => (
                format!("KILL CONNECTION {id}"),
                format!("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {id}"),
            ),
        };
        inbox_tests::run(&self.admin, &kill).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while scalar_i64(&self.admin, &alive).await > 0 {
            assert!(
                Instant::now() < deadline,
                "connection {id} still alive 30 s after {kill}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// When the killer strikes inside the handler's first run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kill {
    /// Before the handler's business write: the write itself meets the dead connection.
    BeforeWrite,
    /// After the business write, before `process` commits: the COMMIT meets it.
    BeforeCommit,
}

/// A handler crediting account 1 whose first run has its connection killed at `kill`
/// (`None`: a delivery without fault). Returns the result and how many times the handler
/// ran.
async fn credit_with_kill(
    inbox: &Inbox,
    conn: &DatabaseConnection,
    killer: &Arc<Killer>,
    id: Uuid,
    kill: Option<Kill>,
) -> (Result<Outcome<()>, ProcessError<DbErr>>, u32) {
    let runs = Arc::new(AtomicU32::new(0));
    let result = inbox
        .process(conn, id, |txn| {
            let first_run = runs.fetch_add(1, Ordering::SeqCst) == 0;
            let killer = Arc::clone(killer);
            Box::pin(async move {
                let victim = Killer::connection_id(txn).await?;
                if first_run && kill == Some(Kill::BeforeWrite) {
                    killer.kill(victim).await;
                }
                credit(txn, 1).await?;
                if first_run && kill == Some(Kill::BeforeCommit) {
                    killer.kill(victim).await;
                }
                Ok(())
            })
        })
        .await;
    (result, runs.load(Ordering::SeqCst))
}

async fn assert_applied(conn: &DatabaseConnection, times: i64, context: &str) {
    assert_eq!(
        scalar_i64(conn, "SELECT balance FROM account WHERE id = 1").await,
        times,
        "credits {context}"
    );
    assert_eq!(
        scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await,
        times,
        "markers {context}"
    );
}

/// Without retries, a kill before the commit fails the delivery with a transient cause,
/// leaves no marker, and the broker's redelivery applies the effect exactly once.
async fn killed_without_retry_then_redelivered(backend: Backend, kill: Kill) {
    with_migrated_db(backend, async |db| {
        let killer = Killer::new(db).await;
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_retry(RetryPolicy::no_retry());
        let id = Uuid::new_v4();

        let started = Instant::now();
        let (first, runs) = credit_with_kill(&inbox, &conn, &killer, id, Some(kill)).await;
        eprintln!(
            "{backend:?} {kill:?}, no retry: first delivery -> {first:?} ({runs} run, {:?})",
            started.elapsed()
        );
        assert_eq!(Settlement::of(&first), Settlement::Nack(None), "{first:?}");
        let cause = match (&first, kill) {
            // The handler's own statement failed: the handler's error, not retried here.
            (Err(ProcessError::Handler(err)), Kill::BeforeWrite) => err,
            (
                Err(ProcessError::RetriesExhausted {
                    attempts: 1,
                    source,
                }),
                Kill::BeforeCommit,
            ) => source.db_err().expect("a database cause"),
            other => panic!("{backend:?} {kill:?}: unexpected result {other:?}"),
        };
        assert_eq!(
            classify(cause),
            DbErrorKind::Transient,
            "a killed connection is transient on {backend:?}: {cause:?}"
        );
        assert_applied(&conn, 0, "after the killed attempt: nothing survives").await;

        let redelivered = credit_with_kill(&inbox, &conn, &killer, id, None).await;
        assert!(
            matches!(redelivered, (Ok(Outcome::Processed(())), 1)),
            "{redelivered:?}"
        );
        let again = credit_with_kill(&inbox, &conn, &killer, id, None).await;
        assert!(matches!(again, (Ok(Outcome::Duplicate), 0)), "{again:?}");
        assert_applied(&conn, 1, "after redeliveries").await;
    })
    .await;
}

/// With the default retry policy, `process` itself restarts the attempt in a fresh
/// transaction on a fresh connection, whether the kill meets the COMMIT or the handler's
/// own statement (a `DbErr` the handler returns with `?`); the handler runs twice, the
/// effect lands once.
async fn killed_connection_is_retried_by_process(backend: Backend, kill: Kill) {
    with_migrated_db(backend, async |db| {
        let killer = Killer::new(db).await;
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let id = Uuid::new_v4();

        let started = Instant::now();
        let (result, runs) = credit_with_kill(&inbox, &conn, &killer, id, Some(kill)).await;
        let counts = inbox.metrics().snapshot();
        eprintln!(
            "{backend:?} {kill:?}, default retry: {result:?}, {runs} runs, {counts:?}, {:?}",
            started.elapsed()
        );
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!(runs, 2, "the handler re-ran in the fresh transaction");
        assert_eq!(
            (counts.transient_retries, counts.processed),
            (1, 1),
            "{counts:?}"
        );
        assert_applied(&conn, 1, "after the retried delivery").await;
    })
    .await;
}

async fn killed_before_commit_is_retried_by_process(backend: Backend) {
    killed_connection_is_retried_by_process(backend, Kill::BeforeCommit).await;
}

async fn killed_before_write_is_retried_by_process(backend: Backend) {
    killed_connection_is_retried_by_process(backend, Kill::BeforeWrite).await;
}

async fn killed_before_write_then_redelivered(backend: Backend) {
    killed_without_retry_then_redelivered(backend, Kill::BeforeWrite).await;
}

async fn killed_before_commit_then_redelivered(backend: Backend) {
    killed_without_retry_then_redelivered(backend, Kill::BeforeCommit).await;
}

/// The error types applications use: a handler returning `anyhow::Error` or
/// `eyre::Report`, with context added to the `DbErr` of its killed statement, is retried in
/// place like one returning `DbErr` (before, the killed connection came back as the
/// handler's error and the message was nacked).
macro_rules! killed_in_a_handler_of_the_applications_error_type {
    ($name:ident, $report:ty, $wrap:path) => {
        async fn $name(backend: Backend) {
            with_migrated_db(backend, async |db| {
                let killer = Killer::new(&db).await;
                let conn = db.connect().await;
                create_accounts(&conn).await;
                let inbox = Inbox::new(CONSUMER).expect("valid name");
                let runs = Arc::new(AtomicU32::new(0));
                let result = inbox
                    .process(&conn, Uuid::new_v4(), |txn| {
                        let first_run = runs.fetch_add(1, Ordering::SeqCst) == 0;
                        let killer = Arc::clone(&killer);
                        Box::pin(async move {
                            let victim = Killer::connection_id(txn).await?;
                            if first_run {
                                killer.kill(victim).await;
                            }
                            $wrap(credit(txn, 1).await, "crediting account 1")?;
                            Ok::<_, $report>(())
                        })
                    })
                    .await;
                assert!(
                    matches!(result, Ok(Outcome::Processed(()))),
                    "{backend:?}: {result:?}"
                );
                assert_eq!(
                    runs.load(Ordering::SeqCst),
                    2,
                    "retried in a fresh transaction"
                );
                assert_eq!(inbox.metrics().snapshot().transient_retries, 1);
                assert_applied(&conn, 1, "after the retried delivery").await;
            })
            .await;
        }
    };
}

killed_in_a_handler_of_the_applications_error_type!(
    killed_in_an_anyhow_handler_is_retried_by_process,
    anyhow::Error,
    anyhow::Context::context
);
killed_in_a_handler_of_the_applications_error_type!(
    killed_in_an_eyre_handler_is_retried_by_process,
    eyre::Report,
    eyre::WrapErr::wrap_err
);

/// The commit succeeds but the ack never reaches the broker (the consumer crashed, the
/// channel closed): the broker redelivers, to another replica, and that gets `Duplicate`,
/// which settles as Ack without running the handler.
async fn lost_ack_redelivery_is_a_duplicate_and_acks(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let (first_replica, second_replica) = (db.connect().await, db.connect().await);
        create_accounts(&first_replica).await;
        let (inbox_a, inbox_b) = (
            Inbox::new(CONSUMER).expect("valid name"),
            Inbox::new(CONSUMER).expect("valid name"),
        );
        let id = Uuid::new_v4();
        let runs = AtomicU32::new(0);
        let handle = |inbox: &Inbox, conn: &DatabaseConnection| {
            let runs = &runs;
            let (inbox, conn) = (inbox.clone(), conn.clone());
            async move {
                inbox
                    .process(&conn, id, |txn| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Box::pin(async move { credit(txn, 1).await })
                    })
                    .await
            }
        };

        let committed = handle(&inbox_a, &first_replica).await;
        assert!(
            matches!(committed, Ok(Outcome::Processed(()))),
            "{committed:?}"
        );
        // The ack is lost: drop the first replica as a crash would, and redeliver.
        first_replica.close().await.ok();
        for delivery in 0..2 {
            let redelivered = handle(&inbox_b, &second_replica).await;
            assert!(
                matches!(redelivered, Ok(Outcome::Duplicate)),
                "redelivery {delivery}: {redelivered:?}"
            );
            assert_eq!(Settlement::of(&redelivered), Settlement::Ack);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
        let counts = inbox_b.metrics().snapshot();
        assert_eq!((counts.duplicates, counts.processed), (2, 0), "{counts:?}");
        assert_applied(&second_replica, 1, "after the lost ack").await;
    })
    .await;
}

on_every_backend!(lost_ack_redelivery_is_a_duplicate_and_acks);

/// No SQLite here: an embedded database has no server to kill the connection (a process
/// crash before commit is the handler-error rollback of process.rs).
mod server_kills {
    use super::*;

    inbox_tests::on_server_backends!(
        killed_before_write_then_redelivered,
        killed_before_commit_then_redelivered,
        killed_before_commit_is_retried_by_process,
        killed_before_write_is_retried_by_process,
        killed_in_an_anyhow_handler_is_retried_by_process,
        killed_in_an_eyre_handler_is_retried_by_process,
    );
}

/// A connection that reaches a read-only server (a demoted primary behind HAProxy during a
/// failover, a MariaDB node set read-only) fails writes with 25006 (PostgreSQL; MariaDB
/// 1792 in a READ ONLY transaction). Made here on a pool of one connection whose session
/// is read-only: the failure is transient, and `process` retries it in a fresh
/// transaction until its attempts run out, then nacks.
async fn read_only_session_is_transient_and_retried(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect_with(1).await;
        create_accounts(&conn).await;
        let read_only = match backend {
            Backend::MySql => "SET SESSION TRANSACTION READ ONLY",
            _ => "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
        };
        conn.execute_unprepared(read_only)
            .await
            .expect("a read-only session");
        let inbox = Inbox::new(CONSUMER)
            .expect("valid name")
            .with_retry(RetryPolicy::default().max_attempts(3));
        let calls = AtomicU32::new(0);
        let id = Uuid::new_v4();
        let result = inbox
            .process(&conn, id, |txn| {
                calls.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move { credit(txn, 1).await })
            })
            .await;
        match &result {
            Err(ProcessError::RetriesExhausted { attempts, source }) => {
                assert_eq!(*attempts, 3, "{result:?}");
                let cause = source.db_err().expect("a database error");
                assert_eq!(
                    inbox_tests::sql_state(cause).as_deref(),
                    Some("25006"),
                    "{cause}"
                );
                assert_eq!(classify(cause), DbErrorKind::Transient, "{cause}");
            }
            other => panic!("a read-only server is transient, retried: {other:?}"),
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the claim failed first");
        assert!(
            matches!(Settlement::of(&result), Settlement::Nack(_)),
            "{result:?}"
        );

        let read_write = match backend {
            Backend::MySql => "SET SESSION TRANSACTION READ WRITE",
            _ => "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
        };
        conn.execute_unprepared(read_write)
            .await
            .expect("a read-write session");
        let again = inbox
            .process(&conn, id, |txn| {
                Box::pin(async move { credit(txn, 1).await })
            })
            .await;
        assert!(matches!(again, Ok(Outcome::Processed(()))), "{again:?}");
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
    })
    .await;
}

/// PostgreSQL: the handler's own transaction turns read-only (`SET TRANSACTION READ ONLY`
/// is allowed after queries) and its UPDATE fails with 25006 on the first attempt only:
/// `process` retries in a fresh transaction and the second attempt commits.
async fn postgres_read_only_failure_in_the_handler_is_retried(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let conn = db.connect().await;
        create_accounts(&conn).await;
        let inbox = Inbox::new(CONSUMER).expect("valid name");
        let calls = AtomicU32::new(0);
        let result = inbox
            .process(&conn, Uuid::new_v4(), |txn| {
                let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                Box::pin(async move {
                    if first {
                        txn.execute_unprepared("SET TRANSACTION READ ONLY").await?;
                    }
                    credit(txn, 1).await
                })
            })
            .await;
        assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2, "retried once");
        assert_eq!(
            scalar_i64(&conn, "SELECT balance FROM account WHERE id = 1").await,
            1
        );
        assert_eq!(inbox.metrics().snapshot().transient_retries, 1);
    })
    .await;
}

/// Server backends: SQLite has no read-only server to meet.
mod read_only {
    use super::*;

    inbox_tests::on_server_backends!(read_only_session_is_transient_and_retried);

    mod handler {
        use super::super::*;

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        #[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
        async fn postgres_read_only_failure_in_the_handler_is_retried() {
            super::super::postgres_read_only_failure_in_the_handler_is_retried(Backend::Postgres)
                .await
        }
    }
}
