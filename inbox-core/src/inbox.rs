use crate::backend::{CLAIM_TRANSACTION, DbErrorKind, ProcessMarker, classify, roll_back};
use crate::claim::{ensure_marker_held, insert_marker, marker_token};
use crate::consumer::{validate_claim, validate_consumer};
use crate::metrics::{Counter, InboxMetrics, facade};
use crate::pooler::in_own_transaction;
use crate::{
    AdmissionFloor, Claim, Delivery, InboxError, MessageId, Outcome, ProcessError, RetryPolicy,
};
use chrono::Utc;
use sea_orm::{DatabaseConnection, DatabaseTransaction, DbErr, TransactionTrait};
use std::any::Any;
use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;
use uuid::Uuid;

/// The future a handler returns: it borrows the transaction and must be `Send`.
pub type HandlerFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// The whole inbox protocol for one consumer, configured once and shared by every handler
/// call (cloning is cheap and shares the metrics).
///
/// [`process`](Self::process) begins a transaction (IMMEDIATE on SQLite), claims the
/// message *first*, runs the handler with the transaction only when the claim is new,
/// commits, and tells you [`Outcome::Processed`] or [`Outcome::Duplicate`]; both mean ack.
/// Transient database failures restart the whole attempt in a fresh transaction, so the
/// handler may run more than once per delivery: it must do its work through the
/// transaction it is given (which rolls back on every failed attempt) and nothing else
/// that cannot be repeated.
///
/// ```
/// use sea_orm_inbox::{Inbox, Outcome, Settlement};
/// use sea_orm::{ConnectionTrait, DbErr};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_inbox_migration::{Migrator, MigratorTrait};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # Migrator::up(&db, None).await?;
/// # db.execute_unprepared("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)").await?;
/// # db.execute_unprepared("INSERT INTO account VALUES (1, 0)").await?;
/// let inbox = Inbox::new("billing.credit")?;
/// let message_id = uuid::Uuid::new_v4(); // from the broker message: stable across redeliveries
///
/// for _delivery in 0..2 {
///     let result = inbox
///         .process(&db, message_id, |txn| {
///             Box::pin(async move {
///                 txn.execute_unprepared("UPDATE account SET balance = balance + 10 WHERE id = 1")
///                     .await?;
///                 Ok::<_, DbErr>("credited")
///             })
///         })
///         .await;
///     match Settlement::of(&result) {
///         Settlement::Ack => { /* delivery.ack().await */ }
///         Settlement::Nack => { /* delivery.nack().await */ }
///         Settlement::DeadLetter => { /* delivery.reject(requeue: false).await */ }
///     }
/// }
/// assert_eq!(inbox.metrics().snapshot().processed, 1);
/// assert_eq!(inbox.metrics().snapshot().duplicates, 1);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Inbox {
    consumer: Arc<str>,
    retry: RetryPolicy,
    lock_timeout: Duration,
    floor: Option<AdmissionFloor>,
    metrics: Arc<InboxMetrics>,
}

/// What the attempts of one `process` call share.
struct Call<T> {
    /// Written into the marker's `claim_token` by every attempt of this call, so a retry
    /// can tell the marker of an attempt whose COMMIT reply was lost from another
    /// delivery's.
    token: Uuid,
    /// The handler's value of an attempt whose COMMIT failed: the work may have committed.
    in_doubt: Option<T>,
}

impl<T> Call<T> {
    fn new() -> Self {
        Self {
            token: Uuid::new_v4(),
            in_doubt: None,
        }
    }
}

/// How one attempt ended short of an outcome.
enum AttemptError<E> {
    Handler(E),
    /// The handler returned a transient database error (its own statement met a deadlock,
    /// a lock timeout or a lost connection): retried like [`Self::Transient`], and returned
    /// as the handler's error once the attempts run out.
    HandlerTransient {
        err: E,
        cause: String,
    },
    Transient(InboxError),
    Fatal(InboxError),
}

/// The transient [`DbErr`] behind a handler error, if there is one: the error itself is a
/// `DbErr` (the handler used `?` on a statement), or a boxed error whose source chain
/// holds one.
fn transient_db_cause<E: 'static>(err: &E) -> Option<&DbErr> {
    let any = err as &dyn Any;
    let db_err = any.downcast_ref::<DbErr>().or_else(|| {
        let boxed = any.downcast_ref::<Box<dyn std::error::Error + Send + Sync>>()?;
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(boxed.as_ref());
        while let Some(err) = cause {
            if let Some(db_err) = err.downcast_ref::<DbErr>() {
                return Some(db_err);
            }
            cause = err.source();
        }
        None
    })?;
    (classify(db_err) == DbErrorKind::Transient).then_some(db_err)
}

impl Inbox {
    /// An inbox for `consumer`, the stable name of one handler (part of the dedup key:
    /// two consumers of the same message each process it once).
    ///
    /// # Errors
    /// A name no backend can claim under: [`InboxError::EmptyConsumer`],
    /// [`InboxError::ConsumerNotTrimmed`], [`InboxError::ConsumerContainsNul`] or
    /// [`InboxError::ConsumerTooLong`].
    pub fn new(consumer: impl Into<String>) -> Result<Self, InboxError> {
        let consumer = consumer.into();
        validate_consumer(&consumer)?;
        Ok(Self {
            consumer: consumer.into(),
            retry: RetryPolicy::default(),
            lock_timeout: Self::DEFAULT_LOCK_TIMEOUT,
            floor: None,
            metrics: Arc::default(),
        })
    }

    /// The default [`with_lock_timeout`](Self::with_lock_timeout): 5 s.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

    /// The longest lock timeout accepted: 10 s.
    pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

    /// The shortest lock timeout accepted: 1 ms.
    pub const MIN_LOCK_TIMEOUT: Duration = Duration::from_millis(1);

    /// Replaces the retry policy for transient database failures.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Bounds how long a claim transaction waits for another transaction's lock, such as
    /// another replica's open claim on the same message (default
    /// [`DEFAULT_LOCK_TIMEOUT`](Self::DEFAULT_LOCK_TIMEOUT)). A held claim means another
    /// replica is on the message, so waiting longer only ties up a pooled connection; when
    /// the bound runs out the attempt ends as a transient error, which `process` retries
    /// per its [`RetryPolicy`] and then returns (nack).
    ///
    /// - PostgreSQL: `lock_timeout` for the claim transaction only (`SET LOCAL`, set by the
    ///   claim INSERT itself: no extra round trip, and safe behind PgBouncer's transaction
    ///   pooling). It covers the handler's statements in that transaction too; a shorter
    ///   `lock_timeout` the session already has is kept.
    /// - MySQL/MariaDB: not applied; the wait is bounded by the session's
    ///   `innodb_lock_wait_timeout` (50 s by default). Set it on the pool's connections
    ///   (e.g. `SET SESSION innodb_lock_wait_timeout = 5` in an after-connect hook) to
    ///   bound it as tightly.
    /// - SQLite: not applied; a claim waits for the write lock in the connection's busy
    ///   handler (`PRAGMA busy_timeout`; sqlx sets 5 s), then fails with SQLITE_BUSY, also
    ///   transient.
    ///
    /// ```
    /// use sea_orm_inbox::{Inbox, InboxError};
    /// use std::time::Duration;
    ///
    /// let inbox = Inbox::new("billing.credit")?.with_lock_timeout(Duration::from_secs(2))?;
    /// assert_eq!(inbox.lock_timeout(), Duration::from_secs(2));
    /// assert!(matches!(
    ///     Inbox::new("billing.credit")?.with_lock_timeout(Duration::from_secs(60)),
    ///     Err(InboxError::LockTimeoutOutOfRange { .. })
    /// ));
    /// # Ok::<(), InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`InboxError::LockTimeoutOutOfRange`] outside
    /// [`MIN_LOCK_TIMEOUT`](Self::MIN_LOCK_TIMEOUT)..=[`MAX_LOCK_TIMEOUT`](Self::MAX_LOCK_TIMEOUT).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Result<Self, InboxError> {
        if !(Self::MIN_LOCK_TIMEOUT..=Self::MAX_LOCK_TIMEOUT).contains(&timeout) {
            return Err(InboxError::LockTimeoutOutOfRange {
                timeout,
                min: Self::MIN_LOCK_TIMEOUT,
                max: Self::MAX_LOCK_TIMEOUT,
            });
        }
        self.lock_timeout = timeout;
        Ok(self)
    }

    /// The bound on a claim transaction's lock waits (see
    /// [`with_lock_timeout`](Self::with_lock_timeout)).
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// Refuses deliveries sent before `floor` ([`Outcome::Refused`]: dead-letter them), so
    /// a redelivery whose marker the retention purge may have deleted never runs the
    /// handler again. Applies to deliveries given a send time
    /// ([`Delivery::sent_at`]); one without is admitted as before. Off unless set: only
    /// you know the retention window (see [`AdmissionFloor`]).
    pub fn with_admission_floor(mut self, floor: AdmissionFloor) -> Self {
        self.floor = Some(floor);
        self
    }

    /// The admission floor, if one is set (see
    /// [`with_admission_floor`](Self::with_admission_floor)).
    pub fn admission_floor(&self) -> Option<AdmissionFloor> {
        self.floor
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// This inbox's counters (shared by its clones).
    pub fn metrics(&self) -> &InboxMetrics {
        &self.metrics
    }

    /// Handles one delivery of a message exactly once for this consumer.
    ///
    /// `delivery` is the message's [`MessageId`] (or a `Uuid`), or a [`Delivery`] that also
    /// carries the time the message was first sent. With a send time and an
    /// [admission floor](Self::with_admission_floor), a delivery sent before the floor is
    /// [`Outcome::Refused`] before any SQL runs: the handler does not run, nothing is
    /// written, and the message goes to the dead-letter queue.
    ///
    /// `handler` gets the transaction and must do all its database work through it. It runs
    /// only when this delivery wins the claim, and again on each retry after a transient
    /// failure (the previous attempt's writes rolled back).
    ///
    /// A handler error is not retried, except a transient database error: when the error
    /// is a [`DbErr`] (or a `Box<dyn Error + Send + Sync>` whose source chain holds one)
    /// that [`classify`](crate::classify) calls transient, such as a deadlock in the
    /// handler's own UPDATE or a dropped connection, the attempt restarts in a fresh
    /// transaction like any other transient failure. A `DbErr` wrapped in an error type of
    /// your own is not looked into: that error is returned, and the redelivery retries it.
    ///
    /// Before COMMIT, `process` proves that the transaction still holds the marker (one
    /// primary-key read): a handler that swallowed a failed statement which ended the
    /// transaction (PostgreSQL aborts it on any error; InnoDB rolls it back on a deadlock)
    /// and returned `Ok` gets [`InboxError::ClaimLost`], never an `Ok` outcome for work that
    /// did not commit.
    ///
    /// The claim's lock wait is bounded by [`with_lock_timeout`](Self::with_lock_timeout).
    ///
    /// A COMMIT whose reply is lost (the connection dies in the middle of it) may have
    /// committed. Every attempt of one call writes the same token into the marker's
    /// `claim_token`, so the retry that meets the marker knows whether it is its own: then
    /// the work committed, and the call returns [`Outcome::Processed`] with the value of
    /// that attempt (counted as processed, the handler not run again); a marker of another
    /// delivery is [`Outcome::Duplicate`]. The check costs one query, only after a failed
    /// COMMIT. The marker's token needs the second migration (`AddInboxLeases`, which adds
    /// `claim_token`).
    ///
    /// # Errors
    /// [`ProcessError::Handler`] when the handler fails (rolled back; not retried unless
    /// transient, as above, and then returned when the attempts run out),
    /// [`ProcessError::Inbox`] for failures a retry would not fix
    /// ([`InboxError::NilMessageId`], before any SQL runs, and [`InboxError::ClaimLost`]),
    /// [`ProcessError::RetriesExhausted`] when every attempt met a transient failure. All
    /// of them mean: nack the message. If the last failure was the COMMIT itself, the work
    /// may have committed; the redelivery then reports `Duplicate` (see [`ProcessError`]).
    pub async fn process<T, E, F>(
        &self,
        db: &DatabaseConnection,
        delivery: impl Into<Delivery>,
        mut handler: F,
    ) -> Result<Outcome<T>, ProcessError<E>>
    where
        F: for<'t> FnMut(&'t DatabaseTransaction) -> HandlerFuture<'t, T, E> + Send,
        T: Send,
        E: Send + 'static,
    {
        let delivery = delivery.into();
        let message_id = delivery.message_id();
        let span = tracing::info_span!(
            "inbox.process",
            message_id = %message_id,
            consumer = %self.consumer,
            outcome = tracing::field::Empty,
            attempts = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
        );
        let started = Instant::now();
        async {
            // Before any transaction: with the database down, a nil id must still come
            // back as the input error it is, not as exhausted retries of BEGIN.
            if let Err(err) = validate_claim(message_id, &self.consumer) {
                let result = Err(ProcessError::Inbox(err));
                self.record(&result, 0, started);
                return result;
            }
            if let Err(refusal) = delivery.admit(self.floor, Utc::now()) {
                let result = Ok(Outcome::Refused(refusal));
                self.record(&result, 0, started);
                return result;
            }
            let mut attempt = 1;
            let mut call = Call::new();
            let result = loop {
                match self.attempt(db, message_id, &mut call, &mut handler).await {
                    Ok(outcome) => break Ok(outcome),
                    Err(AttemptError::Handler(err)) => break Err(ProcessError::Handler(err)),
                    Err(AttemptError::Fatal(err)) => break Err(ProcessError::Inbox(err)),
                    Err(AttemptError::Transient(err)) if attempt < self.retry.attempts() => {
                        self.before_retry(attempt, &err).await;
                        attempt += 1;
                    }
                    Err(AttemptError::HandlerTransient { cause, .. })
                        if attempt < self.retry.attempts() =>
                    {
                        self.before_retry(attempt, &cause).await;
                        attempt += 1;
                    }
                    Err(AttemptError::Transient(err)) => {
                        break Err(ProcessError::RetriesExhausted {
                            attempts: attempt,
                            source: err,
                        });
                    }
                    Err(AttemptError::HandlerTransient { err, .. }) => {
                        break Err(ProcessError::Handler(err));
                    }
                }
            };
            self.record(&result, attempt, started);
            result
        }
        .instrument(span)
        .await
    }

    async fn before_retry(&self, attempt: u32, cause: &(dyn Display + Sync)) {
        self.metrics.count(Counter::TransientRetry);
        facade::transient_retry(&self.consumer);
        // INFO, not DEBUG: a retry is the first sign of contention or a failing server,
        // and operators filter at INFO.
        tracing::info!(attempt, error = %cause, "transient database failure; retrying in a fresh transaction");
        tokio::time::sleep(self.retry.delay_before(attempt + 1)).await;
    }

    async fn attempt<T, E, F>(
        &self,
        db: &DatabaseConnection,
        message_id: MessageId,
        call: &mut Call<T>,
        handler: &mut F,
    ) -> Result<Outcome<T>, AttemptError<E>>
    where
        F: for<'t> FnMut(&'t DatabaseTransaction) -> HandlerFuture<'t, T, E> + Send,
        E: 'static,
    {
        let txn = db
            .begin_with_options(CLAIM_TRANSACTION)
            .await
            .map_err(|err| self.database_failure(message_id, err))?;
        let process = ProcessMarker {
            token: call.token,
            lock_wait: self.lock_timeout,
        };
        let claim_started = Instant::now();
        let claim = insert_marker(&txn, message_id, &self.consumer, Some(process)).await;
        facade::claim_wait(&self.consumer, claim_started.elapsed());
        let claimed = match claim {
            Ok(Claim::Claimed(claimed)) => {
                // An earlier attempt's COMMIT did not land after all (or there was none).
                call.in_doubt = None;
                claimed
            }
            Ok(Claim::Duplicate) => {
                roll_back(txn).await;
                return self.settle_duplicate(db, message_id, call).await;
            }
            // The marker insert itself refuses nothing (`process` admitted the delivery
            // before the first attempt); kept total rather than unreachable.
            Ok(Claim::Refused(refusal)) => {
                roll_back(txn).await;
                return Ok(Outcome::Refused(refusal));
            }
            Err(err) => {
                // The failed INSERT may have ended the transaction (SQLite ends it on a
                // trigger's RAISE(ROLLBACK), on SQLITE_FULL or IOERR): a dropped one would
                // go back to the pool still counted as open.
                roll_back(txn).await;
                return Err(sort_inbox_error(err));
            }
        };
        let value = match handler(&txn).await {
            Ok(value) => value,
            Err(err) => {
                roll_back(txn).await;
                return Err(match transient_db_cause(&err).map(ToString::to_string) {
                    Some(cause) => AttemptError::HandlerTransient { err, cause },
                    None => AttemptError::Handler(err),
                });
            }
        };
        // The handler may have swallowed a failed statement that ended the transaction
        // (PostgreSQL would then answer COMMIT with ROLLBACK and no error): never report
        // Processed unless the marker is still there to commit with the work.
        if let Err(err) = ensure_marker_held(&txn, &claimed).await {
            roll_back(txn).await;
            return Err(sort_inbox_error(err));
        }
        if let Err(err) = txn.commit().await {
            // The COMMIT may have landed with its reply lost: keep the value for the retry
            // that finds out.
            call.in_doubt = Some(value);
            return Err(self.database_failure(message_id, err));
        }
        Ok(Outcome::Processed(value))
    }

    /// The outcome when the marker exists. After a failed COMMIT of this call, the marker
    /// may be that attempt's own: its token says so (one extra query, on this path only,
    /// in a transaction of its own like every statement sent on the pool, so it survives a
    /// transaction pooler), and then the work committed and the outcome is `Processed`
    /// with that attempt's value.
    async fn settle_duplicate<T, E>(
        &self,
        db: &DatabaseConnection,
        message_id: MessageId,
        call: &mut Call<T>,
    ) -> Result<Outcome<T>, AttemptError<E>> {
        let Some(value) = call.in_doubt.take() else {
            return Ok(Outcome::Duplicate);
        };
        let read = in_own_transaction(db, async |txn| {
            marker_token(txn, message_id, &self.consumer).await
        });
        match read.await {
            Ok(Some(token)) if token == call.token => Ok(Outcome::Processed(value)),
            Ok(_) => Ok(Outcome::Duplicate),
            Err(err) => {
                call.in_doubt = Some(value);
                Err(self.database_failure(message_id, err))
            }
        }
    }

    fn database_failure<E>(&self, message_id: MessageId, err: DbErr) -> AttemptError<E> {
        sort_inbox_error(InboxError::Database {
            message_id,
            consumer: self.consumer.to_string(),
            source: err,
        })
    }

    fn record<T, E>(
        &self,
        result: &Result<Outcome<T>, ProcessError<E>>,
        attempts: u32,
        started: Instant,
    ) {
        let (counter, outcome) = match result {
            Ok(Outcome::Processed(_)) => (Counter::Processed, "processed"),
            Ok(Outcome::Duplicate) => (Counter::Duplicate, "duplicate"),
            Ok(Outcome::Refused(_)) => (Counter::Refused, "refused"),
            Err(ProcessError::Handler(_)) => (Counter::HandlerError, "handler_error"),
            Err(ProcessError::Inbox(_)) => (Counter::Failure, "failed"),
            Err(ProcessError::RetriesExhausted { .. }) => (Counter::Failure, "retries_exhausted"),
        };
        self.metrics.count(counter);
        facade::settled(&self.consumer, outcome, started.elapsed());
        let span = tracing::Span::current();
        span.record("outcome", outcome);
        span.record("attempts", attempts);
        span.record("duration_ms", started.elapsed().as_secs_f64() * 1e3);
        match result {
            Ok(Outcome::Refused(refusal)) => {
                tracing::warn!(outcome, %refusal, "delivery refused by the admission floor: dead-letter")
            }
            Ok(_) => tracing::debug!(outcome, attempts, "delivery settled: ack"),
            Err(err) => match err.inbox_error() {
                Some(cause) => {
                    tracing::warn!(outcome, attempts, error = %cause, "delivery failed: nack")
                }
                None => tracing::info!(outcome, attempts, "handler failed: nack"),
            },
        }
    }
}

fn sort_inbox_error<E>(err: InboxError) -> AttemptError<E> {
    match err.db_err().map(classify) {
        Some(DbErrorKind::Transient) => AttemptError::Transient(err),
        _ => AttemptError::Fatal(err),
    }
}
