use crate::backend::{
    CLAIM_TRANSACTION, ConnectionBoundsKnown, DbErrorKind, ProcessMarker, SilentEnds,
    begin_to_completion, classify, roll_back,
};
use crate::cause::{db_cause, reported_text};
use crate::claim::{Held, insert_marker, marker_token};
use crate::consumer::{validate_consumer, validate_message_id};
use crate::metrics::{Counter, InboxMetrics, Settled, facade};
use crate::observed::{ObservedTransaction, Verdict};
use crate::pooler::in_own_transaction;
use crate::silence::{StepTimer, bound_for};
use crate::{
    AdmissionFloor, Claim, Delivery, InboxError, MessageId, Outcome, ProcessError, RetryPolicy,
};
use chrono::Utc;
use sea_orm::{DatabaseConnection, DatabaseTransaction, DbErr};
use sea_orm_inbox_entity::InboxTable;
use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;
use uuid::Uuid;

mod batch;
pub use batch::BatchOutcome;

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
///         Settlement::Nack(_delay) => { /* delivery.nack().await, after the delay */ }
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
    table: InboxTable,
    retry: RetryPolicy,
    lock_timeout: Duration,
    floor: Option<AdmissionFloor>,
    partition_timeout: Duration,
    metrics: Arc<InboxMetrics>,
    /// The keys this consumer reports under to the `metrics` facade, built once.
    metric_keys: Arc<facade::ConsumerKeys>,
    /// Whether the server of a pool can end a transaction silently: shared by
    /// the clones of an inbox, so that the replicas' tasks read it once.
    silent_ends: Arc<SilentEnds>,
    /// Whether the connections of a pool carry this inbox's bounds, so that
    /// its marker INSERT need not set them: shared by the clones like `silent_ends`.
    connection_bounds: Arc<ConnectionBoundsKnown>,
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

/// The bound on each step of one attempt, and the timer its steps share.
struct Steps {
    bound: Option<Duration>,
    timer: StepTimer,
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

/// Why an attempt proves its marker before COMMIT.
#[derive(Clone, Copy)]
enum Proof {
    /// A handler statement failed and the transaction went on, or one ran that the
    /// observed transaction cannot see through.
    AfterHandlerFailure,
    /// Every statement succeeded, but the server can end a transaction silently.
    AgainstSilentEnd,
}

/// The transient [`DbErr`] behind a handler error, if there is one (see
/// [`db_cause`] for the error types looked into).
fn transient_db_cause<E: 'static>(err: &E) -> Option<&DbErr> {
    db_cause(err).filter(|db_err| classify(db_err) == DbErrorKind::Transient)
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
            metric_keys: Arc::new(facade::ConsumerKeys::new(&consumer)),
            consumer: consumer.into(),
            table: InboxTable::default(),
            retry: RetryPolicy::default(),
            lock_timeout: Self::DEFAULT_LOCK_TIMEOUT,
            floor: None,
            partition_timeout: Self::DEFAULT_PARTITION_TIMEOUT,
            metrics: Arc::default(),
            silent_ends: Arc::default(),
            connection_bounds: Arc::default(),
        })
    }

    /// The default [`with_lock_timeout`](Self::with_lock_timeout): 5 s.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

    /// The longest lock timeout accepted: 10 s.
    pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

    /// The shortest lock timeout accepted: 1 ms.
    pub const MIN_LOCK_TIMEOUT: Duration = Duration::from_millis(1);

    /// Keeps this inbox's markers in `table` instead of the default `inbox`: for an
    /// application that has a table called `inbox` already, or runs several inboxes in one
    /// database. Migrate the table first
    /// (`sea_orm_inbox_migration::inbox_migrations(&table)`).
    ///
    /// ```
    /// use sea_orm_inbox::{Inbox, InboxTable};
    ///
    /// let table = InboxTable::named("app_inbox")?.in_schema("messaging")?;
    /// let inbox = Inbox::new("billing")?.with_table(table.clone());
    /// assert_eq!(inbox.table(), &table);
    /// # Ok::<(), sea_orm_inbox::InboxError>(())
    /// ```
    pub fn with_table(mut self, table: InboxTable) -> Self {
        self.table = table;
        self
    }

    /// The table this inbox keeps its markers in.
    pub fn table(&self) -> &InboxTable {
        &self.table
    }

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
    ///   `lock_timeout` the session already has is kept. On a pool configured with
    ///   [`bound_connections`](crate::bound_connections) every connection carries it
    ///   instead, and the INSERT sets nothing.
    /// - MySQL/MariaDB: not applied; the wait is bounded by the session's
    ///   `innodb_lock_wait_timeout` (50 s by default). Set it on the pool's connections
    ///   ([`bound_connections`](crate::bound_connections), or
    ///   `SET SESSION innodb_lock_wait_timeout = 5` in an after-connect hook) to bound it
    ///   as tightly.
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
    ///     Err(InboxError::OutOfRange { .. })
    /// ));
    /// # Ok::<(), InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] outside
    /// [`MIN_LOCK_TIMEOUT`](Self::MIN_LOCK_TIMEOUT)..=[`MAX_LOCK_TIMEOUT`](Self::MAX_LOCK_TIMEOUT).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Result<Self, InboxError> {
        self.lock_timeout = checked_lock_timeout(timeout)?;
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

    /// The default [`with_partition_timeout`](Self::with_partition_timeout): 20 s, below
    /// the shortest common default redelivery timeout (NATS JetStream's `AckWait` and
    /// SQS's visibility timeout, 30 s).
    pub const DEFAULT_PARTITION_TIMEOUT: Duration = Duration::from_secs(20);

    /// The shortest partition timeout accepted: 1 s (MariaDB counts it in whole seconds).
    pub const MIN_PARTITION_TIMEOUT: Duration = Duration::from_secs(1);

    /// The longest partition timeout accepted: 30 min, RabbitMQ's default consumer
    /// timeout; a claim held hostage longer outlives every broker's redelivery.
    pub const MAX_PARTITION_TIMEOUT: Duration = Duration::from_secs(30 * 60);

    /// Bounds how long either side of a claim waits for the other when the network between
    /// them goes silent (default [`DEFAULT_PARTITION_TIMEOUT`](Self::DEFAULT_PARTITION_TIMEOUT)).
    ///
    /// A replica cut off from the database mid-transaction (a NAT or load balancer drops
    /// its flow: no reset, the packets just stop) leaves an open transaction on the server
    /// that holds the message's marker, so every redelivery on another replica waits for
    /// it and fails; with the servers' defaults it stays for hours. With this bound:
    ///
    /// - the server ends the claim transaction, rolling back its work and releasing the
    ///   marker, once its client has sent nothing for this long (PostgreSQL:
    ///   `idle_in_transaction_session_timeout` and `tcp_user_timeout`, set for the
    ///   transaction by the claim INSERT itself, no extra round trip; MariaDB:
    ///   `idle_transaction_timeout` and `net_write_timeout`, session variables set in the
    ///   claim INSERT's own text query, no extra round trip, which the pooled connection
    ///   keeps; MySQL 8 has only the latter); on a pool configured with
    ///   [`bound_connections`](crate::bound_connections), every connection carries them
    ///   from the start instead, and the claim INSERT sets nothing;
    /// - `process` waits at most this long for each step of an attempt (BEGIN, the claim,
    ///   which may first wait for a lock as long as the
    ///   [lock timeout](Self::with_lock_timeout) allows, the handler, the pre-commit check,
    ///   COMMIT, ROLLBACK) and then fails with
    ///   [`InboxError::DatabaseUnresponsive`] (nack). The timed-out connection is not
    ///   handed out again: sqlx pings it before it goes back to the pool and closes it
    ///   when the ping fails (behind a partition the ping waits until the kernel gives up
    ///   or the network comes back, holding a pool slot meanwhile). A COMMIT that timed
    ///   out is in doubt and is retried like a lost COMMIT reply (see
    ///   [`process`](Self::process)); any other step is not retried, since the abandoned
    ///   transaction may hold the marker until the server ends it.
    ///
    /// SQLite is embedded: no network can go silent, so neither side applies there (its
    /// waits end in its busy timeout).
    ///
    /// So a partitioned replica's `process` returns within about this bound (twice it when
    /// the COMMIT was cut), and the claim is free again this long after the replica went
    /// silent. Choose it below the broker's redelivery timeout (JetStream `AckWait`, SQS
    /// visibility timeout, Azure Service Bus lock duration, RabbitMQ `consumer_timeout`)
    /// minus the claim's [lock timeout](Self::with_lock_timeout), so the redelivery finds
    /// the claim released; and above the slowest handler, which it also bounds, and the
    /// longest pause between two of its statements, after which the server ends its
    /// transaction.
    ///
    /// ```
    /// use sea_orm_inbox::{Inbox, InboxError};
    /// use std::time::Duration;
    ///
    /// let inbox = Inbox::new("billing.credit")?.with_partition_timeout(Duration::from_secs(10))?;
    /// assert_eq!(inbox.partition_timeout(), Duration::from_secs(10));
    /// assert!(matches!(
    ///     Inbox::new("billing.credit")?.with_partition_timeout(Duration::ZERO),
    ///     Err(InboxError::OutOfRange { .. })
    /// ));
    /// # Ok::<(), InboxError>(())
    /// ```
    ///
    /// # Errors
    /// [`InboxError::OutOfRange`] outside
    /// [`MIN_PARTITION_TIMEOUT`](Self::MIN_PARTITION_TIMEOUT)..=[`MAX_PARTITION_TIMEOUT`](Self::MAX_PARTITION_TIMEOUT).
    pub fn with_partition_timeout(mut self, timeout: Duration) -> Result<Self, InboxError> {
        self.partition_timeout = checked_partition_timeout(timeout)?;
        Ok(self)
    }

    /// The bound on a silent database or client (see
    /// [`with_partition_timeout`](Self::with_partition_timeout)).
    pub fn partition_timeout(&self) -> Duration {
        self.partition_timeout
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
    /// is a [`DbErr`], or a `Box<dyn Error + Send + Sync>`, an `anyhow::Error` (feature
    /// `anyhow`) or an `eyre::Report` (feature `eyre`) whose source chain holds one, that
    /// [`classify`](crate::classify) calls transient, such as a deadlock in the handler's
    /// own UPDATE or a dropped connection, the attempt restarts in a fresh transaction like
    /// any other transient failure. A `DbErr` inside an error type of your own is not
    /// looked into (box it, or use one of those): that error is returned, and the
    /// redelivery retries it.
    ///
    /// Before COMMIT, `process` proves that the transaction still holds the marker (one
    /// primary-key read): a handler that swallowed a failed statement which ended the
    /// transaction (PostgreSQL aborts it on any error; InnoDB rolls it back on a deadlock)
    /// and returned `Ok` gets [`InboxError::ClaimLost`], never an `Ok` outcome for work that
    /// did not commit.
    ///
    /// The claim's lock wait is bounded by [`with_lock_timeout`](Self::with_lock_timeout).
    ///
    /// A network partition cannot hold the call or the message: every step of an attempt
    /// is bounded by [`with_partition_timeout`](Self::with_partition_timeout), past which
    /// the call gives up the connection and returns [`InboxError::DatabaseUnresponsive`]
    /// (nack), and the claim transaction tells the server to end itself once this replica
    /// has been silent that long, so another replica's redelivery gets the claim.
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
    /// ([`InboxError::NilMessageId`], before any SQL runs, [`InboxError::ClaimLost`],
    /// [`InboxError::DatabaseUnresponsive`] when a step got no answer within the partition
    /// timeout, and [`InboxError::MissingMigration`] when an inbox migration has not run:
    /// call [`crate::verify_schema`] at startup to find that once),
    /// [`ProcessError::RetriesExhausted`] when every attempt met a transient failure.
    /// [`Settlement::for_delivery`](crate::Settlement::for_delivery) says what to tell the
    /// broker: dead-letter what no retry can fix ([`ProcessError::is_permanent`]), nack the
    /// rest with a delay. If a COMMIT of the call failed and no later attempt found out
    /// whether it landed (the last failure was the COMMIT, or a step after an unanswered
    /// COMMIT: `DatabaseUnresponsive { commit_in_doubt: true, .. }`), the work may have
    /// committed; the redelivery then reports `Duplicate` (see [`ProcessError`]).
    pub async fn process<T, E, F>(
        &self,
        db: &DatabaseConnection,
        delivery: impl Into<Delivery>,
        mut handler: F,
    ) -> Result<Outcome<T>, ProcessError<E>>
    where
        F: for<'t> FnMut(&'t ObservedTransaction) -> HandlerFuture<'t, T, E> + Send,
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
        let run = async {
            // Before any transaction: with the database down, a nil id must still come
            // back as the input error it is, not as exhausted retries of BEGIN. The
            // consumer was checked when the inbox was made.
            if let Err(err) = validate_message_id(message_id) {
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
                // Boxed: the attempt's state is most of the call's, which its caller would
                // otherwise move whole (a copy of every step's future) when it awaits it.
                let attempt_once = Box::pin(self.attempt(db, message_id, &mut call, &mut handler));
                match attempt_once.await {
                    Ok(outcome) => break Ok(outcome),
                    Err(err) => {
                        let in_doubt = call.in_doubt.is_some();
                        // Boxed: its pause before the retry (a timer) would otherwise be
                        // part of the call's future, which its caller moves whole, on the
                        // path that needs no retry too.
                        let after = Box::pin(self.after_failed_attempt(err, attempt, in_doubt));
                        if let Err(failed) = after.await {
                            break Err(failed);
                        }
                        attempt += 1;
                    }
                }
            };
            self.record(&result, attempt, started);
            result
        };
        // A span no subscriber wants is not entered at each poll of the call.
        if span.is_disabled() {
            run.await
        } else {
            run.instrument(span).await
        }
    }

    /// After the failed attempt number `attempt`: `Ok` once the pause before the next one
    /// is over, or the call's error when no retry may follow. `in_doubt`: a COMMIT of the
    /// call failed and no later attempt found out whether it landed.
    async fn after_failed_attempt<E>(
        &self,
        err: AttemptError<E>,
        attempt: u32,
        in_doubt: bool,
    ) -> Result<(), ProcessError<E>> {
        let retries_left = attempt < self.retry.attempts();
        match err {
            AttemptError::Handler(err) => Err(ProcessError::Handler(err)),
            AttemptError::Fatal(err) => Err(ProcessError::Inbox(if in_doubt {
                commit_in_doubt(err)
            } else {
                err
            })),
            AttemptError::Transient(err) if retries_left => {
                self.before_retry(attempt, &err).await;
                Ok(())
            }
            AttemptError::HandlerTransient { cause, .. } if retries_left => {
                self.before_retry(attempt, &cause).await;
                Ok(())
            }
            AttemptError::Transient(err) => Err(ProcessError::RetriesExhausted {
                attempts: attempt,
                source: err,
            }),
            AttemptError::HandlerTransient { err, .. } => Err(ProcessError::Handler(err)),
        }
    }

    async fn before_retry(&self, attempt: u32, cause: &(dyn Display + Sync)) {
        self.metrics.count(Counter::TransientRetry);
        facade::transient_retry(&self.metric_keys);
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
        F: for<'t> FnMut(&'t ObservedTransaction) -> HandlerFuture<'t, T, E> + Send,
        E: 'static,
    {
        let mut steps = self.steps(db);
        let silent_end = self.silent_ends.possible(db, steps.bound).await;
        let bounded_connection = self
            .connection_bounds
            .carried(db, self.lock_timeout, self.partition_timeout, steps.bound)
            .await;
        let txn = self
            .bounded(
                &mut steps,
                message_id,
                "BEGIN",
                begin_to_completion(db, CLAIM_TRANSACTION),
            )
            .await?
            .map_err(|err| self.database_failure(message_id, err))?;
        let process = ProcessMarker {
            token: call.token,
            lock_wait: self.lock_timeout,
            silence: self.partition_timeout,
            bounded_connection,
        };
        let claim_started = Instant::now();
        // The claim may wait for another transaction's lock first, as long as the lock
        // timeout allows: only silence beyond that is a partition.
        let claim_bound = steps.bound.map(|bound| bound + self.lock_timeout);
        let claim = self
            .bounded_by(
                &mut steps.timer,
                claim_bound,
                message_id,
                "the claim",
                insert_marker(&txn, &self.table, message_id, &self.consumer, Some(process)),
            )
            .await?;
        facade::claim_wait(&self.metric_keys, claim_started.elapsed());
        let claimed = match claim {
            Ok(Claim::Claimed(claimed)) => {
                // An earlier attempt's COMMIT did not land after all (or there was none).
                call.in_doubt = None;
                claimed
            }
            Ok(Claim::Duplicate) => {
                self.roll_back(&mut steps, message_id, txn).await;
                return self.settle_duplicate(db, message_id, call).await;
            }
            // The marker insert itself refuses nothing (`process` admitted the delivery
            // before the first attempt); kept total rather than unreachable.
            Ok(Claim::Refused(refusal)) => {
                self.roll_back(&mut steps, message_id, txn).await;
                return Ok(Outcome::Refused(refusal));
            }
            Err(err) => {
                // The failed INSERT may have ended the transaction (SQLite ends it on a
                // trigger's RAISE(ROLLBACK), on SQLITE_FULL or IOERR): a dropped one would
                // go back to the pool still counted as open.
                self.roll_back(&mut steps, message_id, txn).await;
                return Err(sort_inbox_error(err));
            }
        };
        let observed = ObservedTransaction::new(txn);
        let returned = self
            .bounded(&mut steps, message_id, "the handler", handler(&observed))
            .await?;
        let held = claimed.held();
        let (value, txn) = self
            .conclude(
                &mut steps, message_id, observed, returned, &held, silent_end,
            )
            .await?;
        if let Err(err) = self.commit_attempt(&mut steps, message_id, txn).await {
            // The COMMIT may have landed with its reply lost, or be lost in a partition:
            // keep the value for the retry that finds out.
            call.in_doubt = Some(value);
            return Err(match err {
                AttemptError::Fatal(err @ InboxError::DatabaseUnresponsive { .. }) => {
                    AttemptError::Transient(err)
                }
                err => err,
            });
        }
        Ok(Outcome::Processed(value))
    }

    /// The end of an attempt whose handler returned `returned` through `observed`, the
    /// claim's transaction, before its COMMIT: a failed handler or a transaction the
    /// database ended is rolled back; a claim whose transaction may have lost its marker
    /// (a statement failed, or `silent_end`: the server can end a transaction without
    /// failing one) is proven (`held`). Gives back the handler's value and the transaction
    /// to commit.
    async fn conclude<T, E: 'static>(
        &self,
        steps: &mut Steps,
        named: MessageId,
        observed: ObservedTransaction,
        returned: Result<T, E>,
        held: &Held<'_>,
        silent_end: bool,
    ) -> Result<(T, DatabaseTransaction), AttemptError<E>> {
        let (txn, verdict) = self
            .bounded(steps, named, "the handler's statements", observed.settle())
            .await?
            .map_err(|err| self.database_failure(named, err))?;
        let value = match returned {
            Ok(value) => value,
            Err(err) => {
                self.roll_back(steps, named, txn).await;
                return Err(Self::handler_failure(err, &verdict));
            }
        };
        let proof = match verdict {
            // The handler returned `Ok` after a statement on which the database ended the
            // transaction: retried when that failure was transient (a deadlock, a lost
            // connection), `ClaimLost` (the handler went on after it) otherwise.
            Verdict::Ended(ending) => {
                self.roll_back(steps, named, txn).await;
                return Err(sort_inbox_error(held.lost(Some(ending))));
            }
            // Every statement succeeded in the transaction: it holds the marker, unless the
            // server can end a transaction without failing a statement.
            Verdict::Clean if silent_end => Proof::AgainstSilentEnd,
            Verdict::Clean => return Ok((value, txn)),
            Verdict::ProofNeeded => Proof::AfterHandlerFailure,
        };
        let proven = self
            .bounded(steps, named, "the pre-commit check", held.prove(&txn))
            .await?;
        match proven {
            Ok(()) => Ok((value, txn)),
            Err(err) => {
                self.roll_back(steps, named, txn).await;
                Err(match (proof, err) {
                    // No statement failed: the database ended the transaction on its own.
                    (Proof::AgainstSilentEnd, InboxError::ClaimLost { source: None, .. }) => {
                        AttemptError::Transient(InboxError::EndedByDatabase {
                            message_id: named,
                            consumer: self.consumer.to_string(),
                        })
                    }
                    (_, err) => sort_inbox_error(err),
                })
            }
        }
    }

    /// Commits an attempt's transaction within `bound`. An unanswered COMMIT may have
    /// landed: its error says so.
    async fn commit_attempt<E>(
        &self,
        steps: &mut Steps,
        named: MessageId,
        txn: DatabaseTransaction,
    ) -> Result<(), AttemptError<E>> {
        match self.bounded(steps, named, "COMMIT", txn.commit()).await {
            Ok(committed) => committed.map_err(|err| self.database_failure(named, err)),
            Err(AttemptError::Fatal(err)) => Err(AttemptError::Fatal(commit_in_doubt(err))),
            Err(err) => Err(err),
        }
    }

    /// The bound on each step of an attempt on `db` (the partition timeout, or none where
    /// no network can go silent: SQLite, whose waits its busy timeout bounds), and the one
    /// timer the steps share.
    fn steps(&self, db: &DatabaseConnection) -> Steps {
        Steps {
            bound: bound_for(db.get_database_backend(), self.partition_timeout),
            timer: StepTimer::default(),
        }
    }

    /// Waits for one step of an attempt at most `steps.bound`. Past it the step's future
    /// is dropped, which gives up its connection; the attempt then drops its transaction
    /// without awaiting a ROLLBACK the silent database would not answer.
    fn bounded<F: Future, E>(
        &self,
        steps: &mut Steps,
        message_id: MessageId,
        step: &'static str,
        future: F,
    ) -> impl Future<Output = Result<F::Output, AttemptError<E>>> {
        self.bounded_by(&mut steps.timer, steps.bound, message_id, step, future)
    }

    /// [`bounded`](Self::bounded) by `bound` instead of the attempt's own. Not an `async
    /// fn`: the step's future is held once, in the timer's own future.
    fn bounded_by<F: Future, E>(
        &self,
        timer: &mut StepTimer,
        bound: Option<Duration>,
        message_id: MessageId,
        step: &'static str,
        future: F,
    ) -> impl Future<Output = Result<F::Output, AttemptError<E>>> {
        timer.within_or(bound, future, move |waited| {
            AttemptError::Fatal(InboxError::DatabaseUnresponsive {
                message_id,
                consumer: self.consumer.to_string(),
                step,
                waited,
                commit_in_doubt: false,
            })
        })
    }

    /// Rolls `txn` back, within the attempt's bound. A failed or unanswered rollback
    /// changes nothing: the transaction is gone with its connection, or the server ends it.
    async fn roll_back(&self, steps: &mut Steps, message_id: MessageId, txn: DatabaseTransaction) {
        self.bounded::<_, ()>(steps, message_id, "ROLLBACK", roll_back(txn))
            .await
            .ok();
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
            marker_token(txn, &self.table, message_id, &self.consumer).await
        });
        let mut steps = self.steps(db);
        let token = self.bounded(&mut steps, message_id, "the lost-reply check", read);
        let token = match token.await {
            Ok(token) => token,
            Err(err) => {
                call.in_doubt = Some(value);
                return Err(err);
            }
        };
        match token {
            Ok(Some(token)) if token == call.token => Ok(Outcome::Processed(value)),
            Ok(_) => Ok(Outcome::Duplicate),
            Err(err) => {
                call.in_doubt = Some(value);
                Err(self.database_failure(message_id, err))
            }
        }
    }

    /// The attempt whose handler failed: retried when the cause is transient, either a
    /// statement on which the database ended the transaction (even when the handler
    /// returned the refusal of a later one) or a transient `DbErr` the error holds.
    fn handler_failure<E: 'static>(err: E, verdict: &Verdict) -> AttemptError<E> {
        let transient = match verdict {
            Verdict::Ended(ending) if classify(ending) == DbErrorKind::Transient => Some(ending),
            _ => transient_db_cause(&err),
        };
        match transient.map(ToString::to_string) {
            Some(cause) => AttemptError::HandlerTransient { err, cause },
            None => AttemptError::Handler(err),
        }
    }

    fn database_failure<E>(&self, message_id: MessageId, err: DbErr) -> AttemptError<E> {
        sort_inbox_error(InboxError::Database {
            message_id,
            consumer: self.consumer.to_string(),
            source: err,
        })
    }

    fn record<T, E: 'static>(
        &self,
        result: &Result<Outcome<T>, ProcessError<E>>,
        attempts: u32,
        started: Instant,
    ) {
        let (counter, settled) = match result {
            Ok(Outcome::Processed(_)) => (Counter::Processed, Settled::Processed),
            Ok(Outcome::Duplicate) => (Counter::Duplicate, Settled::Duplicate),
            Ok(Outcome::Refused(_)) => (Counter::Refused, Settled::Refused),
            Err(ProcessError::Handler(_)) => (Counter::HandlerError, Settled::HandlerError),
            Err(ProcessError::Inbox(_)) => (Counter::Failure, Settled::Failed),
            Err(ProcessError::RetriesExhausted { .. }) => {
                (Counter::Failure, Settled::RetriesExhausted)
            }
        };
        self.metrics.count(counter);
        let took = started.elapsed();
        facade::settled(&self.metric_keys, settled, took);
        let outcome = settled.label();
        let span = tracing::Span::current();
        // A span no subscriber wants records nothing.
        if !span.is_disabled() {
            span.record("outcome", outcome);
            span.record("attempts", attempts);
            span.record("duration_ms", took.as_secs_f64() * 1e3);
        }
        match result {
            Ok(Outcome::Refused(refusal)) => {
                tracing::warn!(outcome, %refusal, "delivery refused by the admission floor: dead-letter")
            }
            Ok(_) => tracing::debug!(outcome, attempts, "delivery settled: ack"),
            Err(err) => match (err.inbox_error(), err.is_permanent()) {
                (Some(cause), true) => {
                    tracing::warn!(outcome, attempts, error = %cause, "delivery failed for good: dead-letter")
                }
                (Some(cause), false) => {
                    tracing::warn!(outcome, attempts, error = %cause, "delivery failed: nack")
                }
                (None, permanent) => {
                    let error = err.handler_error().map(reported_text).unwrap_or_default();
                    if permanent {
                        tracing::warn!(outcome, attempts, %error, "handler failed for good: dead-letter")
                    } else {
                        tracing::info!(outcome, attempts, %error, "handler failed: nack")
                    }
                }
            },
        }
    }
}

/// `err`, noting when it is [`InboxError::DatabaseUnresponsive`] that an unanswered
/// COMMIT of the call may have landed.
fn commit_in_doubt(mut err: InboxError) -> InboxError {
    if let InboxError::DatabaseUnresponsive {
        commit_in_doubt, ..
    } = &mut err
    {
        *commit_in_doubt = true;
    }
    err
}

/// `timeout` if it lies in the accepted range of claim lock timeouts.
pub(crate) fn checked_lock_timeout(timeout: Duration) -> Result<Duration, InboxError> {
    if !(Inbox::MIN_LOCK_TIMEOUT..=Inbox::MAX_LOCK_TIMEOUT).contains(&timeout) {
        return Err(InboxError::out_of_range(
            "a claim lock timeout",
            timeout,
            Inbox::MIN_LOCK_TIMEOUT..=Inbox::MAX_LOCK_TIMEOUT,
            "a claim another replica holds means that replica is on the message, so wait briefly and let the broker redeliver",
        ));
    }
    Ok(timeout)
}

/// `timeout` if it lies in the accepted range of partition timeouts.
pub(crate) fn checked_partition_timeout(timeout: Duration) -> Result<Duration, InboxError> {
    if !(Inbox::MIN_PARTITION_TIMEOUT..=Inbox::MAX_PARTITION_TIMEOUT).contains(&timeout) {
        return Err(InboxError::out_of_range(
            "a partition timeout",
            timeout,
            Inbox::MIN_PARTITION_TIMEOUT..=Inbox::MAX_PARTITION_TIMEOUT,
            "choose one well below the broker's redelivery timeout (JetStream AckWait, SQS visibility timeout, RabbitMQ consumer timeout) and above your slowest handler",
        ));
    }
    Ok(timeout)
}

fn sort_inbox_error<E>(err: InboxError) -> AttemptError<E> {
    match err.db_err().map(classify) {
        Some(DbErrorKind::Transient) => AttemptError::Transient(err),
        _ => AttemptError::Fatal(err),
    }
}
