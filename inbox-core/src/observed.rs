//! The transaction [`Inbox::process`](crate::Inbox::process) hands to its handler: SeaORM's
//! transaction, with every statement's result seen on its way back.
//!
//! What it sees decides how the attempt ends. No statement failed: COMMIT without a proof
//! query. A statement failed and the database ended the transaction: every later statement
//! is refused (so none runs outside it, in autocommit) and nothing is committed. A statement
//! failed and the transaction went on, or a statement the wrapper cannot see through ran
//! (transaction control, several statements in one string): the marker is proven before
//! COMMIT, as on the manual path.
//!
//! Each statement runs to completion, on a task of its own from the moment its caller is
//! dropped, so that a handler (or the `process` around it) dropped while a statement is in
//! flight cannot leave its connection halfway through an exchange with the server (see
//! `ObservedTransaction::observe`).

use crate::backend::{
    AfterFailure, after_failure, drain_queued_rollbacks, roll_back_stranded, to_completion,
    transaction_ended,
};
use sea_orm::{
    AccessMode, ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, ExecResult, IsolationLevel,
    QueryResult, Statement, TransactionError, TransactionOptions, TransactionSession,
    TransactionTrait,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::RwLock;

/// A SeaORM transaction whose statements [`Inbox::process`](crate::Inbox::process) sees.
///
/// It implements [`ConnectionTrait`], [`TransactionTrait`] (a nested `begin` is a
/// savepoint, observed too) and, with the `stream` feature, `StreamTrait`: entity calls,
/// `find().all(txn)`, raw statements and streams work on it as on a
/// [`DatabaseTransaction`]. Write handler helpers over `&impl ConnectionTrait` (or
/// `C: ConnectionTrait`) and they take either.
///
/// Once a failed statement has made the database end the transaction (any error outside a
/// savepoint on PostgreSQL; a deadlock, lock wait timeout or lost connection on
/// MySQL/MariaDB; a trigger's `RAISE(ROLLBACK)` on SQLite), every later statement fails
/// with [`DbErr::Custom`] naming that failure, instead of running on its own in autocommit,
/// and `process` commits nothing: return the error from the handler.
///
/// ```
/// use sea_orm::{ConnectionTrait, DbErr};
/// use sea_orm_inbox::{Inbox, ObservedTransaction, Outcome};
///
/// async fn credit(txn: &impl ConnectionTrait, amount: i64) -> Result<(), DbErr> {
///     txn.execute_unprepared(&format!("UPDATE account SET balance = balance + {amount}"))
///         .await?;
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_inbox_migration::{Migrator, MigratorTrait};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # Migrator::up(&db, None).await?;
/// # db.execute_unprepared("CREATE TABLE account (balance INTEGER NOT NULL)").await?;
/// # db.execute_unprepared("INSERT INTO account VALUES (0)").await?;
/// let inbox = Inbox::new("billing.credit")?;
/// let outcome = inbox
///     .process(&db, uuid::Uuid::new_v4(), |txn: &ObservedTransaction| {
///         Box::pin(credit(txn, 10))
///     })
///     .await?;
/// assert!(matches!(outcome, Outcome::Processed(())));
/// # Ok(()) }
/// ```
pub struct ObservedTransaction {
    inner: Level,
    watch: Arc<Watch>,
    savepoint_depth: u32,
    backend: DbBackend,
    /// What a claim on this level binds to without a statement: set on the outermost level
    /// of a transaction begun for the manual path ([`ObservedTransaction::begin_on`]).
    binding: Option<Binding>,
}

/// The identity of one transaction begun for the manual path, unique in the process, with
/// what was read of its pool before BEGIN: a claim made on it remembers this, and its
/// commit takes no proof query when it is given back the same transaction and every
/// statement succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Binding {
    id: u64,
    /// Whether the server can end the transaction without failing a statement (Galera).
    pub(crate) silent_end: bool,
    /// Whether the connection carries the inbox's bounds for its whole life, so that the
    /// marker INSERT sets none.
    pub(crate) bounded_connection: bool,
}

impl Binding {
    pub(crate) fn new(silent_end: bool, bounded_connection: bool) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            silent_end,
            bounded_connection,
        }
    }
}

/// One level of the observed transaction, SeaORM's transaction or savepoint, with the
/// statements in flight on it.
///
/// Dropped after the database ended the transaction, it is kept in the [`Watch`] instead:
/// SeaORM's rollback on drop would fail with the transaction gone and leave the driver
/// counting the level (see [`roll_back_stranded`]), so `process` rolls it back itself,
/// after recreating what it rolls back to.
struct Level {
    /// Shared with the task of each statement in flight; `None` once ended.
    txn: Option<Arc<DatabaseTransaction>>,
    /// Read-held by each statement in flight, write-taken by [`Level::when_idle`] to wait
    /// for them before the level ends.
    in_flight: Arc<RwLock<()>>,
    watch: Arc<Watch>,
}

impl Level {
    fn new(txn: DatabaseTransaction, watch: &Arc<Watch>) -> Self {
        Self {
            txn: Some(Arc::new(txn)),
            in_flight: Arc::default(),
            watch: Arc::clone(watch),
        }
    }

    fn get(&self) -> Result<&Arc<DatabaseTransaction>, DbErr> {
        self.txn
            .as_ref()
            .ok_or_else(|| DbErr::Custom("this transaction has already ended".into()))
    }

    /// The level's transaction, once no statement is in flight on it (one the handler
    /// stopped awaiting still runs to its end, and its failure counts).
    async fn when_idle(&mut self) -> Result<DatabaseTransaction, DbErr> {
        let txn = self.txn.take();
        let txn = txn.ok_or_else(|| DbErr::Custom("this transaction has already ended".into()))?;
        idle(txn, &self.in_flight).await
    }
}

/// `txn`, once no statement holds `in_flight`.
async fn idle(
    txn: Arc<DatabaseTransaction>,
    in_flight: &RwLock<()>,
) -> Result<DatabaseTransaction, DbErr> {
    let idle = in_flight.write().await;
    let txn = Arc::try_unwrap(txn).map_err(|_| {
        DbErr::Custom(
            "a statement of the handler still holds the inbox's transaction; it is \
             rolled back when that statement ends, and the delivery is retried"
                .to_string(),
        )
    })?;
    drop(idle);
    Ok(txn)
}

impl Drop for Level {
    fn drop(&mut self) {
        if let Some(txn) = self.txn.take()
            && self.watch.ended().is_some()
        {
            self.watch.strand(txn, Arc::clone(&self.in_flight));
        }
    }
}

impl std::fmt::Debug for ObservedTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObservedTransaction")
            .field("savepoint_depth", &self.savepoint_depth)
            .field("verdict", &self.watch.verdict())
            .finish_non_exhaustive()
    }
}

/// A level kept after the database ended its transaction, with its statements in flight.
type Stranded = (Arc<DatabaseTransaction>, Arc<RwLock<()>>);

/// What the statements of one observed transaction showed, shared by its savepoints.
#[derive(Debug, Default)]
struct Watch {
    state: Mutex<Verdict>,
    /// The savepoints dropped or ended after the database ended the transaction, outermost
    /// first, with their statements in flight: see [`Level`].
    stranded: Mutex<Vec<Stranded>>,
    /// Whether the handler sent a `SAVEPOINT` of its own as SQL: a failure may then be
    /// undone by its `ROLLBACK TO SAVEPOINT`, which the wrapper cannot follow.
    handler_savepoint: AtomicBool,
    /// Whether a statement the wrapper cannot see through succeeded: it may have ended the
    /// transaction (a raw `ROLLBACK`) where the database cannot tell at no cost.
    opaque: AtomicBool,
    /// How many savepoints the handler opened.
    levels: AtomicU32,
}

/// What an attempt may do at its end, from what its statements showed.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) enum Verdict {
    /// Every statement succeeded and each was plain SQL: the transaction holds the marker.
    #[default]
    Clean,
    /// A statement failed and the transaction went on, or one ran that the wrapper cannot
    /// see through: prove the marker before COMMIT.
    ProofNeeded,
    /// The database ended the transaction when this statement failed.
    Ended(DbErr),
}

impl Watch {
    fn verdict(&self) -> Verdict {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn ended(&self) -> Option<DbErr> {
        match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            Verdict::Ended(err) => Some(err.clone()),
            _ => None,
        }
    }

    fn strand(&self, txn: Arc<DatabaseTransaction>, in_flight: Arc<RwLock<()>>) {
        self.stranded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((txn, in_flight));
    }

    fn take_stranded(&self) -> Vec<Stranded> {
        std::mem::take(&mut *self.stranded.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Records `next` unless the transaction already ended: nothing undoes an end.
    fn record(&self, next: Verdict) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match (&*state, &next) {
            (Verdict::Ended(_), _) | (Verdict::ProofNeeded, Verdict::Clean) => {}
            _ => *state = next,
        }
    }
}

impl ObservedTransaction {
    pub(crate) fn new(inner: DatabaseTransaction) -> Self {
        Self::bound(inner, None)
    }

    /// The observed transaction `inner`, whose claims bind to `binding` (see [`Binding`]).
    pub(crate) fn bound(inner: DatabaseTransaction, binding: Option<Binding>) -> Self {
        let watch = Arc::<Watch>::default();
        Self {
            backend: inner.get_database_backend(),
            inner: Level::new(inner, &watch),
            watch,
            savepoint_depth: 0,
            binding,
        }
    }

    /// What a claim on this level binds to, if it binds without a statement.
    pub(crate) fn binding(&self) -> Option<Binding> {
        self.binding
    }

    /// The transaction itself, for the commit or the rollback of the attempt, with what
    /// its statements showed, once no statement is in flight (one the handler stopped
    /// awaiting still runs to its end, and its failure counts) and the savepoints the
    /// handler left in a transaction the database ended are rolled back.
    pub(crate) async fn settle(mut self) -> Result<(DatabaseTransaction, Verdict), DbErr> {
        let inner = self.inner.when_idle().await?;
        let mut stranded = Vec::new();
        for (txn, in_flight) in self.watch.take_stranded() {
            match idle(txn, &in_flight).await {
                Ok(level) => stranded.push(level),
                Err(error) => {
                    tracing::warn!(%error, "a savepoint of an ended transaction stays open")
                }
            }
        }
        roll_back_stranded(&inner, stranded).await;
        self.drain_queued_rollbacks(&inner).await;
        Ok((inner, self.watch.verdict()))
    }

    /// After savepoints of a transaction that may have ended under them (a statement the
    /// wrapper cannot see through ran, or the database ended it), takes the replies of
    /// the rollbacks the driver queued for them (see [`drain_queued_rollbacks`]): a
    /// failed one means the transaction is gone or aborted, never committed.
    async fn drain_queued_rollbacks(&self, txn: &DatabaseTransaction) {
        let levels = self.watch.levels.load(Ordering::Acquire);
        let unsure = self.watch.opaque.load(Ordering::Acquire) || self.watch.ended().is_some();
        if levels == 0 || !unsure {
            return;
        }
        // Each level queues at most two rollbacks: one when it is dropped or its own end
        // fails, one when `process` rolls it back stranded; the last send succeeds.
        if drain_queued_rollbacks(txn, 2 * levels + 1).await {
            self.watch.record(Verdict::Ended(opaque_ending()));
        }
    }

    /// The error every statement gets once the database ended the transaction.
    fn refusal(ending: &DbErr) -> DbErr {
        DbErr::Custom(format!(
            "the database ended this transaction when an earlier statement failed ({ending}); \
             sea-orm-inbox refuses every later statement so that none runs outside it: \
             return the error from the handler, and the delivery is retried"
        ))
    }

    /// Whether a statement may run: not once the transaction ended. `plain`: see
    /// [`is_plain_statement`] (SeaORM's own savepoint statements count as plain: their
    /// ends are observed apart).
    fn admit(&self, plain: bool) -> Result<(), DbErr> {
        if let Some(ending) = self.watch.ended() {
            return Err(Self::refusal(&ending));
        }
        if !plain {
            self.watch.record(Verdict::ProofNeeded);
        }
        Ok(())
    }

    /// Runs one statement (`statement` makes it on the shared transaction) unless the
    /// transaction already ended, and records what its result shows.
    ///
    /// The statement runs to completion ([`to_completion`]): sqlx's MySQL connection
    /// counts the replies it owes only for the request it is sending, not for the
    /// PREPARE a statement with bound values sends first, so a statement dropped between
    /// PREPARE and its reply leaves the connection waiting, when the pool tests it on its
    /// way back, for a reply the server never sends: the pool's connection is lost, and a
    /// one-connection pool hangs. Handed to a task of its own when its caller is dropped,
    /// the statement always finishes, and the connection goes back whole once nobody holds
    /// the transaction.
    async fn observe<T, F>(
        &self,
        kind: StatementKind,
        statement: impl FnOnce(Arc<DatabaseTransaction>) -> F,
    ) -> Result<T, DbErr>
    where
        F: Future<Output = Result<T, DbErr>> + Send + 'static,
        T: Send + 'static,
    {
        self.admit(kind == StatementKind::Plain)?;
        let running = Arc::clone(&self.inner.in_flight).read_owned().await;
        let txn = Arc::clone(self.inner.get()?);
        let watch = Arc::clone(&self.watch);
        let depth = self.savepoint_depth;
        let statement = statement(Arc::clone(&txn));
        to_completion(async move {
            let result = statement.await;
            match &result {
                Err(err) => record_failure(&txn, &watch, depth, err).await,
                Ok(_) if kind != StatementKind::Plain => record_opaque(&txn, &watch, kind).await,
                Ok(_) => {}
            }
            // The transaction before the read guard: `settle` unwraps it once it takes
            // the write lock.
            drop(txn);
            drop(running);
            result
        })
        .await
    }

    /// A savepoint's end: a failure there leaves the enclosing transaction in a state
    /// nothing can restore (PostgreSQL keeps it aborted), so it ends the observation.
    async fn end_savepoint(
        mut self,
        end: impl FnOnce(DatabaseTransaction) -> Pin<Box<dyn Future<Output = Result<(), DbErr>> + Send>>,
    ) -> Result<(), DbErr> {
        let watch = Arc::clone(&self.watch);
        if let Some(ending) = watch.ended() {
            // Dropping the level strands it for `process` to roll back.
            return Err(Self::refusal(&ending));
        }
        let inner = match self.inner.when_idle().await {
            Ok(inner) => inner,
            Err(err) => {
                watch.record(Verdict::Ended(err.clone()));
                return Err(err);
            }
        };
        if let Some(ending) = watch.ended() {
            // A statement in flight ended the transaction meanwhile.
            watch.strand(Arc::new(inner), Arc::default());
            return Err(Self::refusal(&ending));
        }
        let result = end(inner).await;
        if let Err(err) = &result {
            watch.record(Verdict::Ended(err.clone()));
        }
        result
    }

    fn nested(&self, inner: DatabaseTransaction) -> Self {
        self.watch.levels.fetch_add(1, Ordering::AcqRel);
        Self {
            inner: Level::new(inner, &self.watch),
            watch: Arc::clone(&self.watch),
            savepoint_depth: self.savepoint_depth + 1,
            backend: self.backend,
            binding: None,
        }
    }
}

/// What the wrapper knows of a statement before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StatementKind {
    /// One statement that reads or writes rows: see [`is_plain_statement`] (SeaORM's own
    /// savepoint statements count as plain: their ends are observed apart).
    Plain,
    /// Anything else; `savepoint` when its first word is `SAVEPOINT`.
    Opaque { savepoint: bool },
}

impl StatementKind {
    fn of(sql: &str) -> Self {
        if is_plain_statement(sql) {
            Self::Plain
        } else {
            Self::Opaque {
                savepoint: first_word(sql).eq_ignore_ascii_case("SAVEPOINT"),
            }
        }
    }
}

/// After a statement the wrapper cannot see through succeeded: a `SAVEPOINT` of the
/// handler's own is remembered; and where the database can tell at no network cost
/// (SQLite), whether the statement ended the transaction (a raw `ROLLBACK` or `COMMIT`)
/// is asked at once, before the handler drops a savepoint of the ended transaction.
async fn record_opaque(txn: &DatabaseTransaction, watch: &Watch, kind: StatementKind) {
    if kind == (StatementKind::Opaque { savepoint: true }) {
        watch.handler_savepoint.store(true, Ordering::Release);
    }
    watch.opaque.store(true, Ordering::Release);
    if let Ok(true) = transaction_ended(txn).await {
        watch.record(Verdict::Ended(opaque_ending()));
    }
}

/// How a transaction ended by a statement the wrapper cannot see through is told.
fn opaque_ending() -> DbErr {
    DbErr::Custom(
        "a statement of the handler that the inbox cannot see through (transaction control \
         such as ROLLBACK or COMMIT) ended the transaction"
            .into(),
    )
}

/// Records in `watch` what the failure `err` of a statement on `txn` did to it.
async fn record_failure(
    txn: &DatabaseTransaction,
    watch: &Watch,
    savepoint_depth: u32,
    err: &DbErr,
) {
    // A savepoint the handler named in SQL may be rolled back to: count it as a level.
    let handler_savepoint = u32::from(watch.handler_savepoint.load(Ordering::Acquire));
    let depth = savepoint_depth + handler_savepoint;
    let verdict = match after_failure(txn.get_database_backend(), err, depth) {
        AfterFailure::Ended => Verdict::Ended(err.clone()),
        AfterFailure::WentOn => Verdict::ProofNeeded,
        AfterFailure::Ask => match transaction_ended(txn).await {
            Ok(false) => Verdict::ProofNeeded,
            Ok(true) | Err(_) => Verdict::Ended(err.clone()),
        },
    };
    watch.record(verdict);
}

/// Whether `sql` is one statement that reads or writes rows and cannot end the
/// transaction: its first word is SELECT, INSERT, UPDATE, DELETE, WITH, VALUES, REPLACE
/// or TABLE, and no `;` but a trailing one splits it. Anything else (transaction control,
/// DDL, which commits implicitly on MySQL, a procedure CALL, a leading comment, which may
/// be a MariaDB executable one) is not seen through.
fn is_plain_statement(sql: &str) -> bool {
    const PLAIN: [&str; 8] = [
        "SELECT", "INSERT", "UPDATE", "DELETE", "WITH", "VALUES", "REPLACE", "TABLE",
    ];
    let sql = sql.trim();
    let body = sql.strip_suffix(';').unwrap_or(sql);
    if body.contains(';') {
        return false;
    }
    let first_word = first_word(body);
    PLAIN
        .iter()
        .any(|plain| first_word.eq_ignore_ascii_case(plain))
}

/// The leading ASCII letters of `sql`, after its leading whitespace.
fn first_word(sql: &str) -> &str {
    let sql = sql.trim_start();
    let word_end = sql
        .bytes()
        .position(|byte| !byte.is_ascii_alphabetic())
        .unwrap_or(sql.len());
    // ASCII letters end on a character boundary.
    &sql[..word_end]
}

#[async_trait::async_trait]
impl ConnectionTrait for ObservedTransaction {
    fn get_database_backend(&self) -> DbBackend {
        self.backend
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        let kind = StatementKind::of(&stmt.sql);
        self.observe(kind, |txn| async move { txn.execute_raw(stmt).await })
            .await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        let sql = sql.to_owned();
        self.observe(StatementKind::of(&sql), |txn| async move {
            txn.execute_unprepared(&sql).await
        })
        .await
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        let kind = StatementKind::of(&stmt.sql);
        self.observe(kind, |txn| async move { txn.query_one_raw(stmt).await })
            .await
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let kind = StatementKind::of(&stmt.sql);
        self.observe(kind, |txn| async move { txn.query_all_raw(stmt).await })
            .await
    }

    fn support_returning(&self) -> bool {
        self.backend.support_returning()
    }
}

#[async_trait::async_trait]
impl TransactionTrait for ObservedTransaction {
    type Transaction = ObservedTransaction;

    async fn begin(&self) -> Result<ObservedTransaction, DbErr> {
        let inner = self
            .observe(StatementKind::Plain, |txn| async move { txn.begin().await })
            .await?;
        Ok(self.nested(inner))
    }

    async fn begin_with_config(
        &self,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<ObservedTransaction, DbErr> {
        let inner = self
            .observe(StatementKind::Plain, move |txn| async move {
                txn.begin_with_config(isolation_level, access_mode).await
            })
            .await?;
        Ok(self.nested(inner))
    }

    async fn begin_with_options(
        &self,
        options: TransactionOptions,
    ) -> Result<ObservedTransaction, DbErr> {
        let inner = self
            .observe(StatementKind::Plain, move |txn| async move {
                txn.begin_with_options(options).await
            })
            .await?;
        Ok(self.nested(inner))
    }

    async fn transaction<F, T, E>(&self, callback: F) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(
                &'c ObservedTransaction,
            ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        let savepoint = self.begin().await.map_err(TransactionError::Connection)?;
        run_in_savepoint(savepoint, callback).await
    }

    async fn transaction_with_config<F, T, E>(
        &self,
        callback: F,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(
                &'c ObservedTransaction,
            ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        let savepoint = self
            .begin_with_config(isolation_level, access_mode)
            .await
            .map_err(TransactionError::Connection)?;
        run_in_savepoint(savepoint, callback).await
    }
}

/// SeaORM's `transaction` closure contract on a savepoint: released when `callback`
/// succeeds, rolled back when it fails.
async fn run_in_savepoint<F, T, E>(
    savepoint: ObservedTransaction,
    callback: F,
) -> Result<T, TransactionError<E>>
where
    F: for<'c> FnOnce(
            &'c ObservedTransaction,
        ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
        + Send,
    T: Send,
    E: std::fmt::Display + std::fmt::Debug + Send,
{
    match callback(&savepoint).await {
        Ok(value) => {
            savepoint
                .commit()
                .await
                .map_err(TransactionError::Connection)?;
            Ok(value)
        }
        Err(err) => {
            savepoint
                .rollback()
                .await
                .map_err(TransactionError::Connection)?;
            Err(TransactionError::Transaction(err))
        }
    }
}

/// Ends a savepoint (`RELEASE` or `ROLLBACK TO`), or the transaction itself when it was
/// begun with [`ObservedTransaction::begin_on`] (`process` never hands out its own by
/// value): commit a claim's transaction through the claim's `commit` instead.
#[async_trait::async_trait]
impl TransactionSession for ObservedTransaction {
    async fn commit(self) -> Result<(), DbErr> {
        self.end_savepoint(|inner| Box::pin(inner.commit())).await
    }

    async fn rollback(self) -> Result<(), DbErr> {
        self.end_savepoint(|inner| Box::pin(inner.rollback())).await
    }
}

#[cfg(feature = "stream")]
mod stream {
    use super::{ObservedTransaction, Verdict, Watch, is_plain_statement, record_failure};
    use crate::backend::{AfterFailure, after_failure};
    use futures_util::Stream;
    use sea_orm::{DbBackend, DbErr, QueryResult, Statement, StreamTrait, TransactionStream};
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    /// The rows of a query streamed through an [`ObservedTransaction`], each failure seen.
    pub struct ObservedStream<'a> {
        rows: Pin<Box<TransactionStream<'a>>>,
        watch: Arc<Watch>,
        backend: DbBackend,
        savepoint_depth: u32,
    }

    impl std::fmt::Debug for ObservedStream<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ObservedStream").finish_non_exhaustive()
        }
    }

    impl Stream for ObservedStream<'_> {
        type Item = Result<QueryResult, DbErr>;

        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let next = self.rows.as_mut().poll_next(cx);
            if let Poll::Ready(Some(Err(err))) = &next {
                // A stream cannot stop to ask SQLite whether its transaction survived:
                // count a failure that might have ended it as one that did.
                let verdict = match after_failure(self.backend, err, self.savepoint_depth) {
                    AfterFailure::WentOn => Verdict::ProofNeeded,
                    AfterFailure::Ended | AfterFailure::Ask => Verdict::Ended(err.clone()),
                };
                self.watch.record(verdict);
            }
            next
        }
    }

    impl StreamTrait for ObservedTransaction {
        type Stream<'a> = ObservedStream<'a>;

        fn get_database_backend(&self) -> DbBackend {
            self.backend
        }

        fn stream_raw<'a>(
            &'a self,
            stmt: Statement,
        ) -> Pin<Box<dyn Future<Output = Result<ObservedStream<'a>, DbErr>> + 'a + Send>> {
            Box::pin(async move {
                // Not on a task of its own: the rows borrow the transaction.
                self.admit(is_plain_statement(&stmt.sql))?;
                let txn = self.inner.get()?;
                let rows = match txn.stream_raw(stmt).await {
                    Ok(rows) => rows,
                    Err(err) => {
                        record_failure(txn, &self.watch, self.savepoint_depth, &err).await;
                        return Err(err);
                    }
                };
                Ok(ObservedStream {
                    rows: Box::pin(rows),
                    watch: Arc::clone(&self.watch),
                    backend: self.backend,
                    savepoint_depth: self.savepoint_depth,
                })
            })
        }
    }
}

#[cfg(feature = "stream")]
pub use stream::ObservedStream;

#[cfg(test)]
mod tests {
    use super::is_plain_statement;

    #[test]
    fn plain_statements_are_row_reads_and_writes_only() {
        for plain in [
            "SELECT 1",
            "  insert into t values (1);",
            "UPDATE t SET a = 1 WHERE b = ';' ",
            "with x as (select 1) select * from x",
        ] {
            let expected = !plain.trim().trim_end_matches(';').contains(';');
            assert_eq!(is_plain_statement(plain), expected, "{plain}");
        }
        for opaque in [
            "ROLLBACK",
            "commit",
            "SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "SET autocommit = 1",
            "CREATE TABLE t (a int)",
            "CALL p()",
            "/*M!100300 ROLLBACK */",
            "-- c\nSELECT 1",
            "UPDATE t SET a = 1; ROLLBACK",
            "(SELECT 1)",
            "",
        ] {
            assert!(!is_plain_statement(opaque), "{opaque}");
        }
    }
}
