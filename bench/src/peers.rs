//! The peers' inbox protocols, written by hand in SQL over the same `inbox` table and the
//! same business write as ours, and the duplicate-heavy mix they all run through.
//!
//! Each protocol follows the shape its project documents (BENCHMARKS.md cites the
//! sources); where a peer relies on its message retry policy after a deadlock or a lost
//! race, the benchmark retries the whole delivery the same way, up to [`ATTEMPTS`] times.

use crate::BoxError;
use crate::db::{CONSUMER, timestamp};
use crate::modes::Worker;
use chrono::Utc;
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbErr, Statement, Value};
use sea_orm_inbox::{DbErrorKind, HandlerFuture, classify};
use std::collections::VecDeque;
use std::sync::Mutex;
use uuid::Uuid;

/// Deliveries of one message a peer tries before giving up (its retry policy).
const ATTEMPTS: usize = 10;

/// What a delivery came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    /// The business write committed with the marker.
    Applied,
    /// The message had been handled already; nothing was written.
    Duplicate,
}

/// One attempt's end: done, or a transient failure (deadlock, lost race) to retry.
enum Attempt {
    Done(Handled),
    Retry(DbErr),
}

/// Sorts a failed statement: an inbox-index violation is the protocol's duplicate signal,
/// a deadlock or serialization failure is retried, anything else fails the run.
///
/// The benchmark's schema has no namesake of the inbox index, so MariaDB's unproven
/// violation of it (its error names no table) is the inbox's.
fn sort(err: DbErr) -> Result<Attempt, BoxError> {
    match classify(&err) {
        DbErrorKind::InboxDuplicate | DbErrorKind::PossibleInboxDuplicate => {
            Ok(Attempt::Done(Handled::Duplicate))
        }
        DbErrorKind::Transient => Ok(Attempt::Retry(err)),
        _ => Err(err.into()),
    }
}

/// Like [`sort`], for the statements whose inbox-index violation means "lost the race,
/// deliver again": MassTransit's first transaction.
fn retry_on_conflict(err: DbErr) -> Result<Attempt, BoxError> {
    match classify(&err) {
        DbErrorKind::InboxDuplicate
        | DbErrorKind::PossibleInboxDuplicate
        | DbErrorKind::Transient => Ok(Attempt::Retry(err)),
        _ => Err(err.into()),
    }
}

/// A marker row as MassTransit reads it under its lock.
struct LockedMarker {
    id: i64,
    consumed: bool,
}

impl Worker {
    /// Retries `attempt` on transient failures, as each peer's retry policy would.
    async fn with_retries<F, Fut>(&self, name: &str, mut attempt: F) -> Result<Handled, BoxError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Attempt, BoxError>>,
    {
        let mut last = None;
        for _ in 0..ATTEMPTS {
            match attempt().await? {
                Attempt::Done(handled) => return Ok(handled),
                Attempt::Retry(err) => last = Some(err),
            }
        }
        Err(format!("{name}: {ATTEMPTS} attempts failed, the last with {last:?}").into())
    }

    fn now(&self) -> Value {
        timestamp(self.backend(), Utc::now())
    }

    fn statement(&self, sql: &'static str, values: Vec<Value>) -> Statement {
        Statement::from_sql_and_values(self.backend(), sql, values)
    }

    /// `SELECT ... FOR UPDATE` of the message's marker (SQLite: the IMMEDIATE transaction
    /// holds the write lock already).
    async fn lock_marker(
        &self,
        txn: &impl ConnectionTrait,
        id: Uuid,
    ) -> Result<Option<LockedMarker>, DbErr> {
        let row = txn
            .query_one_raw(self.statement(
                self.sql.lock_marker,
                vec![Value::from(id), Value::from(CONSUMER)],
            ))
            .await?;
        row.map(|row| {
            Ok(LockedMarker {
                id: row.try_get_by_index(0)?,
                consumed: row.try_get_by_index::<i64>(1)? != 0,
            })
        })
        .transpose()
    }

    /// MassTransit's EF Core inbox: lock the InboxState row, insert it if missing and
    /// commit; then lock it again, count the receive under a new lock id, run the
    /// consumer, mark it consumed, commit. Two commits per message.
    pub(crate) async fn masstransit(&self, id: Uuid) -> Result<Handled, BoxError> {
        self.with_retries("masstransit", || async {
            let txn = self.begin().await?;
            let found = match self.lock_marker(&txn, id).await {
                Ok(found) => found,
                Err(err) => return retry_on_conflict(err),
            };
            match found {
                Some(marker) if marker.consumed => {
                    txn.rollback().await?;
                    return Ok(Attempt::Done(Handled::Duplicate));
                }
                Some(_) => txn.rollback().await?,
                None => {
                    let insert = txn.execute_raw(self.marker(self.sql.marker, id)).await;
                    if let Err(err) = insert {
                        txn.rollback().await?;
                        return retry_on_conflict(err);
                    }
                    if let Err(err) = txn.commit().await {
                        return retry_on_conflict(err);
                    }
                }
            }
            self.attempt(|worker, txn| {
                Box::pin(async move {
                    let marker = worker
                        .lock_marker(txn, id)
                        .await?
                        .ok_or_else(|| DbErr::Custom("the InboxState row vanished".into()))?;
                    if marker.consumed {
                        return Ok(Handled::Duplicate);
                    }
                    txn.execute_raw(worker.statement(
                        worker.sql.take_lock,
                        vec![Value::from(Uuid::new_v4()), Value::from(marker.id)],
                    ))
                    .await?;
                    worker.credit(txn, 1).await?;
                    txn.execute_raw(worker.statement(
                        worker.sql.mark_consumed,
                        vec![worker.now(), Value::from(marker.id)],
                    ))
                    .await?;
                    Ok(Handled::Applied)
                })
            })
            .await
        })
        .await
    }

    /// NServiceBus's optimistic outbox: look the record up, run the handler, store the
    /// record at the end of the same transaction ([`Self::seed`]'s shape). A racing
    /// duplicate runs the handler too and fails at the insert.
    pub(crate) async fn nservicebus(&self, id: Uuid) -> Result<Handled, BoxError> {
        self.with_retries("nservicebus", || {
            self.attempt(|worker, txn| {
                Box::pin(async move {
                    let found = txn
                        .query_one_raw(worker.statement(
                            worker.sql.find_marker,
                            vec![Value::from(id), Value::from(CONSUMER)],
                        ))
                        .await?;
                    if found.is_some() {
                        return Ok(Handled::Duplicate);
                    }
                    worker.credit_then_mark(txn, id).await
                })
            })
        })
        .await
    }

    /// Wolverine's durable inbox: persist the incoming envelope and commit (a duplicate
    /// fails on the key there), then run the handler and mark the envelope handled in a
    /// second transaction. Two commits per message.
    pub(crate) async fn wolverine(&self, id: Uuid) -> Result<Handled, BoxError> {
        let envelope = self
            .with_retries("wolverine envelope", || {
                self.attempt(|worker, txn| {
                    Box::pin(async move {
                        txn.execute_raw(worker.marker(worker.sql.marker, id))
                            .await?;
                        Ok(Handled::Applied)
                    })
                })
            })
            .await?;
        if envelope == Handled::Duplicate {
            return Ok(Handled::Duplicate);
        }
        // The envelope is persisted: from here on only the handler is retried.
        self.with_retries("wolverine handler", || {
            self.attempt(|worker, txn| {
                Box::pin(async move {
                    worker.credit(txn, 1).await?;
                    txn.execute_raw(worker.statement(
                        worker.sql.mark_handled,
                        vec![worker.now(), Value::from(id), Value::from(CONSUMER)],
                    ))
                    .await?;
                    Ok(Handled::Applied)
                })
            })
        })
        .await
    }

    /// The seed article's EF Core shape: the business write first, the marker added at
    /// the end of the same transaction; the unique index rejects a duplicate at commit
    /// time (here at the INSERT).
    pub(crate) async fn seed(&self, id: Uuid) -> Result<Handled, BoxError> {
        self.with_retries("seed", || {
            self.attempt(|worker, txn| Box::pin(worker.credit_then_mark(txn, id)))
        })
        .await
    }

    /// The business write, then the marker: the end of every optimistic protocol.
    async fn credit_then_mark(
        &self,
        txn: &impl ConnectionTrait,
        id: Uuid,
    ) -> Result<Handled, DbErr> {
        self.credit(txn, 1).await?;
        txn.execute_raw(self.marker(self.sql.marker, id)).await?;
        Ok(Handled::Applied)
    }

    /// One attempt in a transaction of its own: `body` runs in it with this worker, then
    /// [`Self::finish`] settles the transaction and sorts a failure. `body` is boxed like
    /// an `Inbox::process` handler.
    async fn attempt<F>(&self, body: F) -> Result<Attempt, BoxError>
    where
        F: for<'t> FnOnce(&'t Worker, &'t DatabaseTransaction) -> HandlerFuture<'t, Handled, DbErr>,
    {
        let txn = self.begin().await?;
        let result = body(self, &txn).await;
        self.finish(txn, result).await
    }

    /// Commits an applied delivery, rolls back anything else, and sorts a failure.
    async fn finish(
        &self,
        txn: DatabaseTransaction,
        result: Result<Handled, DbErr>,
    ) -> Result<Attempt, BoxError> {
        match result {
            Ok(Handled::Applied) => match txn.commit().await {
                Ok(()) => Ok(Attempt::Done(Handled::Applied)),
                Err(err) => sort(err),
            },
            Ok(Handled::Duplicate) => {
                txn.rollback().await?;
                Ok(Attempt::Done(Handled::Duplicate))
            }
            Err(err) => {
                txn.rollback().await?;
                sort(err)
            }
        }
    }
}

/// The duplicate-heavy mix: of every 100 deliveries, 20 replay a message this worker
/// applied earlier in the run, 10 take a message another worker has just started (a
/// race), and 70 are fresh, 10 of which are offered to the racers. A replay with nothing
/// to replay is fresh; a race with nothing offered is a replay.
#[derive(Default)]
pub struct Mixer {
    offered: Mutex<VecDeque<Uuid>>,
}

impl Mixer {
    /// Percent of deliveries that replay an applied message.
    const REPLAY: u32 = 20;
    /// Percent that race a message another worker has just started.
    const RACE: u32 = 10;

    /// Forgets the previous run's messages: a protocol's duplicates must be its own.
    pub fn reset(&self, workers: &[std::sync::Arc<Worker>]) -> Result<(), BoxError> {
        self.offered
            .lock()
            .map_err(|_| "a worker panicked holding the mix")?
            .clear();
        for worker in workers {
            worker
                .applied
                .lock()
                .map_err(|_| "a worker panicked holding the applied ids")?
                .clear();
        }
        Ok(())
    }

    /// The message id of `worker`'s next delivery.
    pub fn next_delivery(&self, worker: &Worker) -> Result<Uuid, BoxError> {
        let draw = Uuid::new_v4().as_u128();
        let roll = (draw % 100) as u32;
        let pick = (draw >> 64) as usize;
        let replay = || -> Result<Option<Uuid>, BoxError> {
            let applied = worker
                .applied
                .lock()
                .map_err(|_| "a worker panicked holding the applied ids")?;
            Ok((!applied.is_empty()).then(|| applied[pick % applied.len()]))
        };
        let mut offered = self
            .offered
            .lock()
            .map_err(|_| "a worker panicked holding the mix")?;
        if roll < Self::REPLAY {
            return Ok(replay()?.unwrap_or_else(Uuid::new_v4));
        }
        if roll < Self::REPLAY + Self::RACE {
            if let Some(id) = offered.pop_front() {
                return Ok(id);
            }
            return Ok(replay()?.unwrap_or_else(Uuid::new_v4));
        }
        let id = Uuid::new_v4();
        if roll < Self::REPLAY + 2 * Self::RACE {
            offered.push_back(id);
        }
        Ok(id)
    }
}
