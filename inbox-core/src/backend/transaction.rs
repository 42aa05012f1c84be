//! What a failed statement did to its transaction, how to end a transaction clean
//! whatever the database already did to it, and how to run one that a dropped caller
//! cannot cut off halfway.

use super::dialect;
use sea_orm::sqlx;
use sea_orm::sqlx::error::DatabaseError;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, RuntimeErr,
    Statement, TransactionOptions, TransactionTrait,
};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

/// Runs `work` to its end even if the caller stops awaiting it, so that a caller dropped
/// meanwhile (an aborted consumer task, a `select!` that picked shutdown, a step's
/// partition bound) cannot cut a transaction off halfway. sqlx counts a transaction only
/// once BEGIN's reply is read, so a BEGIN cut off before then is never rolled back and its
/// connection goes back to the pool inside the transaction (MySQL/MariaDB then fail the
/// next BEGIN on it with 1568).
///
/// The work is polled inline, in the caller's task, for as long as the caller awaits it: a
/// task of its own per statement cost the runtime's scheduling of it on every message,
/// where it is needed only when the caller goes away. A caller dropped before the work
/// finished hands it to a task of its own then ([`Unfinished`]), where it finishes, and a
/// transaction nobody awaits any more is dropped, which rolls it back.
pub(crate) fn to_completion<T: Send + 'static>(
    work: impl Future<Output = Result<T, DbErr>> + Send + 'static,
) -> impl Future<Output = Result<T, DbErr>> + Send {
    Unfinished(Some(Box::pin(work)))
}

/// Work [`to_completion`] polls, until it finished. Dropped before then, it hands the work
/// to a task of its own on the current runtime. Without one (the runtime shutting down, a
/// drop outside it) the work is dropped, as the runtime drops its tasks when it shuts down.
struct Unfinished<F: Future + Send + 'static>(Option<Pin<Box<F>>>);

impl<F: Future + Send + 'static> Future for Unfinished<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(work) = self.0.as_mut() else {
            // Polled again after `Ready`, which the `Future` contract leaves to the
            // implementation: it never finishes twice.
            return Poll::Pending;
        };
        let done = ready!(work.as_mut().poll(cx));
        // Finished: nothing left to hand on when it is dropped.
        self.0 = None;
        Poll::Ready(done)
    }
}

impl<F: Future + Send + 'static> Drop for Unfinished<F> {
    fn drop(&mut self) {
        if let Some(work) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            drop(runtime.spawn(async move {
                work.await;
            }));
        }
    }
}

/// Begins a transaction on `db` through [`to_completion`], so that a BEGIN in flight
/// always finishes.
pub(crate) async fn begin_to_completion(
    db: &DatabaseConnection,
    options: TransactionOptions,
) -> Result<DatabaseTransaction, DbErr> {
    let db = db.clone();
    to_completion(async move { db.begin_with_options(options).await }).await
}

/// Rolls `txn` back and hands its connection back to the pool clean, also when the
/// database itself ended the transaction before (a trigger's `RAISE(ROLLBACK, ..)`, a
/// `ROLLBACK` the handler sent as SQL, InnoDB's deadlock rollback).
///
/// sqlx counts transaction depth itself and lowers it only when its ROLLBACK succeeds. On
/// SQLite a ROLLBACK with no transaction open fails ("no transaction is active"), the
/// connection would return to the pool at depth 1, and every later `begin` on it would be
/// a SAVEPOINT whose "commit" commits nothing. The backend's
/// [`before_rollback`](super::dialect::Dialect::before_rollback) reopens a transaction
/// first where that is needed, so the ROLLBACK cannot fail for that reason.
///
/// A rollback that fails all the same means the connection itself is broken (the server
/// went away, SQLite's worker died): sqlx's ping on release then fails and the pool
/// closes the connection instead of lending it again. The failure changes nothing for the
/// caller, who rolls back because it already nacks (or acks a duplicate), so it is logged,
/// not returned.
pub(crate) async fn roll_back(txn: DatabaseTransaction) {
    let before = dialect(txn.get_database_backend()).map(|dialect| dialect.before_rollback());
    if let Ok(Some(sql)) = before
        && let Err(error) = txn.execute_unprepared(sql).await
    {
        tracing::warn!(%error, "re-opening the transaction before its rollback failed");
    }
    if let Err(error) = txn.rollback().await {
        tracing::warn!(%error, "rollback failed; the pool closes the connection if it is broken");
    }
}

/// Rolls back `levels`, nested SeaORM transactions (savepoints) of `txn` left open when
/// the database ended the whole transaction under them, innermost last in the list, so
/// that the driver counts no level of them any more. sqlx lowers its count only when its
/// `ROLLBACK TO SAVEPOINT` succeeds, and with the transaction gone none can: the
/// connection would go back to the pool counted inside a transaction, and every later
/// `begin` on it would be a savepoint whose "commit" commits nothing (SQLite). The
/// backend's [`restore_driver_savepoint`](super::dialect::Dialect::restore_driver_savepoint)
/// recreates each level first; [`roll_back`] then ends `txn` itself. Failures are logged:
/// the caller already rolls back.
pub(crate) async fn roll_back_stranded(
    txn: &DatabaseTransaction,
    levels: Vec<DatabaseTransaction>,
) {
    if levels.is_empty() {
        return;
    }
    if let Ok(dialect) = dialect(txn.get_database_backend()) {
        for level in 1..=levels.len() {
            let Some(sql) = dialect.restore_driver_savepoint(level) else {
                break;
            };
            if let Err(error) = txn.execute_unprepared(&sql).await {
                tracing::warn!(%error, "recreating a savepoint of an ended transaction failed");
            }
        }
    }
    for level in levels.into_iter().rev() {
        if let Err(error) = level.rollback().await {
            tracing::warn!(%error, "rolling back a savepoint of an ended transaction failed");
        }
    }
}

/// Takes the replies of the savepoint rollbacks the driver queued on `txn`'s connection
/// (each SeaORM savepoint dropped open queues one, unsent) when the transaction may have
/// ended under them, before the connection's own ROLLBACK: sends the backend's
/// [`queued_rollbacks_drain`](super::dialect::Dialect::queued_rollbacks_drain) until it
/// succeeds, at most `most` times. Whether one of them failed is returned: then the
/// transaction had ended, or is aborted, and must not be committed.
///
/// A queued rollback that fails makes the connection fail sqlx's ping on its way back to
/// the pool, which then closes it with `close_hard`, and over TLS that close can wait
/// forever: sqlx-core 0.9.0 `src/net/socket/buffered.rs:137` (`shutdown` flushes first),
/// `src/net/tls/tls_rustls.rs:69` (`poll_flush` is `poll_complete_io`, line 32), and
/// rustls 0.23 `ConnectionCommon::complete_io` (`src/conn.rs:674`), which, with nothing to
/// write, reads and waits for the server to send something. The server has sent every
/// reply already, so the closing task hangs holding the pool's slot, and a pool of one
/// times out every acquire after it. Taken here, no rollback fails later and the
/// connection goes back whole.
pub(crate) async fn drain_queued_rollbacks(txn: &DatabaseTransaction, most: u32) -> bool {
    let Some(drain) = dialect(txn.get_database_backend())
        .ok()
        .and_then(|dialect| dialect.queued_rollbacks_drain())
    else {
        return false;
    };
    let mut failed = false;
    for _ in 0..most {
        match txn.execute_unprepared(drain).await {
            Ok(_) => break,
            Err(_) => failed = true,
        }
    }
    failed
}

/// Whether `err`, the failure of `RELEASE SAVEPOINT`, says for certain that the
/// transaction is open but did not make the savepoint.
pub(crate) fn savepoint_missing_in_open_transaction(backend: DbBackend, err: &DbErr) -> bool {
    match (dialect(backend), database_error(err)) {
        (Ok(dialect), Some(db)) => dialect.savepoint_missing_in_open_transaction(db),
        _ => false,
    }
}

/// What a failed statement did to the transaction it ran in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterFailure {
    /// The database ended the transaction: nothing later may run in it.
    Ended,
    /// Only the statement (or the savepoint around it) failed; the transaction goes on.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    WentOn,
    /// The error does not tell: ask with [`transaction_ended`].
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Ask,
}

/// What the failed statement `err` did to its transaction on `backend`, `savepoint_depth`
/// savepoints deep. A failure the driver reports without a database error (a lost
/// connection, a protocol error) ends it: nothing more can be known or sent.
pub(crate) fn after_failure(backend: DbBackend, err: &DbErr, savepoint_depth: u32) -> AfterFailure {
    if database_error(err).is_none() {
        return AfterFailure::Ended;
    }
    dialect(backend).map_or(AfterFailure::Ended, |dialect| {
        dialect.after_failure(err, savepoint_depth)
    })
}

/// Whether the server already ended `txn` without failing the statement that followed
/// (Galera's brute-force abort between two statements: the next one runs on its own,
/// in autocommit). Asked only after a batch's read-back missed a row; `false` without a
/// round trip where the backend has no such end.
pub(crate) async fn silently_ended<C: ConnectionTrait>(txn: &C) -> Result<bool, DbErr> {
    let Some(probe) = dialect(txn.get_database_backend())
        .ok()
        .and_then(|dialect| dialect.silently_ended_probe())
    else {
        return Ok(false);
    };
    let row = txn
        .query_one_raw(Statement::from_string(txn.get_database_backend(), probe))
        .await?;
    Ok(row
        .map(|row| row.try_get_by_index::<i64>(0))
        .transpose()?
        .is_some_and(|ended| ended == 1))
}

/// Whether the database already ended `txn` although sqlx still counts it open, asked
/// before a COMMIT that no marker bound to this transaction precedes. Only SQLite needs to
/// know (its COMMIT outside a transaction fails, stranding the connection at sqlx's depth
/// 1); elsewhere `false` without a round trip. When it answers `true`, the probe opened a
/// transaction: end it with [`roll_back`].
pub(crate) async fn transaction_ended<C: ConnectionTrait>(txn: &C) -> Result<bool, DbErr> {
    let Ok(dialect) = dialect(txn.get_database_backend()) else {
        return Ok(false);
    };
    let Some(probe) = dialect.ended_transaction_probe() else {
        return Ok(false);
    };
    match txn.execute_unprepared(probe).await {
        Ok(_) => Ok(true),
        Err(err) => match database_error(&err).and_then(|db| dialect.refuses_probe(db)) {
            Some(true) => Ok(false),
            _ => Err(err),
        },
    }
}

/// Whether `err` is the database choosing this transaction as the loser of a conflict
/// with another one that went on: a serialization failure or a deadlock (SQLSTATE 40001
/// or 40P01; on MySQL/MariaDB 1213, which is also a Galera certification failure and
/// brute-force abort). Not a lock wait timeout or a lost connection, which say nothing
/// about another transaction's progress.
pub(crate) fn lost_a_conflict(err: &DbErr) -> bool {
    database_error(err)
        .and_then(|db| db.code())
        .is_some_and(|code| matches!(code.as_ref(), "40001" | "40P01"))
}

/// Whether the database itself answered `err` (a constraint, a value it cannot store, a
/// trigger), as opposed to a connection, pool or driver failure.
pub(crate) fn refused_by_the_database(err: &DbErr) -> bool {
    database_error(err).is_some()
}

/// The driver's database error inside `err`, if there is one.
fn database_error(err: &DbErr) -> Option<&dyn DatabaseError> {
    match err {
        DbErr::Conn(RuntimeErr::SqlxError(sqlx_err))
        | DbErr::Exec(RuntimeErr::SqlxError(sqlx_err))
        | DbErr::Query(RuntimeErr::SqlxError(sqlx_err)) => match sqlx_err.as_ref() {
            sqlx::Error::Database(db) => Some(db.as_ref()),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::Database;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Waker};
    use std::time::Duration;

    /// A caller dropped after the work began (here between its INSERT and its COMMIT, the
    /// COMMIT waiting on a gate) does not cut it off: the work, COMMIT included, finishes
    /// on a task of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_dropped_by_its_caller_still_commits() {
        let path = std::env::temp_dir().join(format!("to-completion-{}.db", std::process::id()));
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let db = Database::connect(&url).await.expect("a SQLite file");
        db.execute_unprepared("CREATE TABLE IF NOT EXISTS t (x INTEGER); DELETE FROM t")
            .await
            .expect("a table");
        let gate = Arc::new(tokio::sync::Notify::new());
        let inserted = Arc::new(AtomicBool::new(false));
        let work = {
            let (db, gate, inserted) = (db.clone(), Arc::clone(&gate), Arc::clone(&inserted));
            async move {
                let txn = db.begin().await?;
                txn.execute_unprepared("INSERT INTO t VALUES (1)").await?;
                inserted.store(true, Ordering::SeqCst);
                gate.notified().await;
                txn.commit().await
            }
        };
        let mut caller = Box::pin(to_completion(work));
        let mut cx = Context::from_waker(Waker::noop());
        // Bounded by time, not by a count of polls: SQLite runs the INSERT on a thread of
        // its own, which a loaded machine may not schedule within any number of yields.
        let started = std::time::Instant::now();
        while !inserted.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(30) {
            assert!(
                caller.as_mut().poll(&mut cx).is_pending(),
                "the gate is shut"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(inserted.load(Ordering::SeqCst), "the INSERT never ran");
        drop(caller);
        gate.notify_one();

        let mut committed = 0;
        for _ in 0..500 {
            let row = db
                .query_one_raw(Statement::from_string(
                    DbBackend::Sqlite,
                    "SELECT COUNT(*) FROM t",
                ))
                .await
                .expect("a count");
            committed = row.map_or(0, |row| row.try_get_by_index::<i64>(0).unwrap_or(0));
            if committed == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::fs::remove_file(&path).ok();
        assert_eq!(committed, 1, "the dropped caller's COMMIT never landed");
    }

    /// The work's value comes back to a caller that awaited it to the end.
    #[tokio::test]
    async fn awaited_work_returns_its_value() {
        assert_eq!(to_completion(async { Ok(7) }).await.ok(), Some(7));
    }
}
