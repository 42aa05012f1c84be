use super::OutboxError;
use super::message::OutboxMessage;
use super::wake::OutboxWaker;
use crate::Inbox;
use crate::backend::outbox::{
    ClaimPlan, Failure, claim_plan, lease_statement, mark_failed_statement, mark_sent_statement,
    release_statement, settle_alone,
};
use crate::backend::{lost_a_conflict, to_completion};
use crate::clock::now_micros;
use crate::metrics::facade;
use crate::silence::within;
use chrono::{DateTime, Utc};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbErr, EntityTrait, Statement, TransactionTrait,
};
use sea_orm_inbox_entity::outbox;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use uuid::Uuid;

/// A boxed error from a broker client.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a publish failed, split by what the relay does next.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker did not confirm the message (a lost connection, a negative
    /// acknowledgement, a timeout): the relay retries it after a backoff, up to
    /// [`RelayOptions::max_attempts`].
    #[error("the broker did not confirm the message: {0}")]
    Transient(#[source] BoxError),
    /// The message can never be published (larger than the broker accepts, for a
    /// destination the publisher knows cannot exist): the relay parks it as dead at once.
    /// For publishers that can tell; the shipped RabbitMQ and JetStream publishers never
    /// return it, as every refusal they see may heal (a queue bound later, a full queue
    /// drained, a connection reopened), and a message that keeps failing is parked after
    /// [`RelayOptions::max_attempts`].
    #[error("the broker refused the message: {0}")]
    Rejected(#[source] BoxError),
}

/// Sends a claimed [`OutboxMessage`] to a broker and returns once the broker has taken
/// responsibility for it (RabbitMQ's publisher confirm, JetStream's publish ack, Kafka's
/// acks).
///
/// The relay calls it at least once per message: again after a failure, and again when a
/// relay died between the broker's confirmation and marking the row sent. Send
/// [`OutboxMessage::message_id`] as the broker's message id every time, so the broker
/// (JetStream's `Nats-Msg-Id` window) or the consumer's inbox drops the repeat.
///
/// Ready implementations: `rabbitmq::RabbitMqPublisher` (feature `lapin`) and
/// `jetstream::JetStreamPublisher` (feature `async-nats`). A Kafka producer fits the same shape: `destination` is the
/// topic, `key` the record key (which picks the partition), `headers` the record headers.
///
/// ```
/// use sea_orm_inbox::{OutboxMessage, PublishError, Publisher};
/// use std::sync::Mutex;
///
/// /// Keeps what it is given: a stand-in broker for tests.
/// #[derive(Default)]
/// struct Recorder(Mutex<Vec<OutboxMessage>>);
///
/// impl Publisher for Recorder {
///     async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
///         self.0
///             .lock()
///             .map_err(|_| PublishError::Transient("the recorder's lock is poisoned".into()))?
///             .push(message.clone());
///         Ok(())
///     }
/// }
/// ```
pub trait Publisher: Send + Sync {
    /// Publishes `message` and waits for the broker's confirmation.
    ///
    /// # Errors
    /// [`PublishError::Transient`] to retry later, [`PublishError::Rejected`] to park the
    /// message as dead.
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;
}

/// A publisher shared by several relays (or kept by the caller to inspect) publishes as
/// itself.
impl<P: Publisher> Publisher for Arc<P> {
    fn publish(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        P::publish(self, message)
    }
}

/// How a [`Relay`] claims, publishes and retries.
///
/// ```
/// use sea_orm_inbox::RelayOptions;
/// use std::time::Duration;
///
/// let options = RelayOptions {
///     batch_size: 50,
///     lease: Duration::from_secs(30),
///     ..RelayOptions::default()
/// };
/// assert!(options.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayOptions {
    /// The most rows one claim takes (default 100).
    pub batch_size: u32,
    /// How long a claim holds its rows (default 60 s). Another relay republishes a row
    /// whose lease ended unmarked, so it must outlast a batch's publishing; the relay
    /// stops publishing a batch when less than [`publish_timeout`](Self::publish_timeout)
    /// of its lease is left and hands the rest back. Relays' clocks must agree to well
    /// within it.
    pub lease: Duration,
    /// The longest one publish may wait for the broker (default 10 s); past it the publish
    /// counts as failed. Shorter than `lease`.
    pub publish_timeout: Duration,
    /// How many attempts a message gets before it is parked as dead (default 10).
    pub max_attempts: u32,
    /// The wait after the first failed attempt of a message, doubled after each further
    /// one (default 1 s).
    pub backoff: Duration,
    /// The longest wait between attempts (default 5 minutes).
    pub max_backoff: Duration,
    /// How often [`Relay::run`] looks for due rows when nothing wakes it (default 1 s):
    /// what catches messages enqueued by other processes, delayed messages and retries.
    pub poll_interval: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease: Duration::from_secs(60),
            publish_timeout: Duration::from_secs(10),
            max_attempts: 10,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            poll_interval: Duration::from_secs(1),
        }
    }
}

impl RelayOptions {
    /// Checks the options.
    ///
    /// # Errors
    /// [`OutboxError::InvalidOptions`] for a zero batch size, attempt cap, publish timeout
    /// or poll interval, or a publish timeout not shorter than the lease.
    pub fn validate(&self) -> Result<(), OutboxError> {
        let invalid = |what, advice| Err(OutboxError::InvalidOptions { what, advice });
        if self.batch_size == 0 {
            return invalid("batch_size is 0", "claim at least 1 row per batch");
        }
        if self.max_attempts == 0 {
            return invalid("max_attempts is 0", "give every message at least 1 attempt");
        }
        if self.publish_timeout.is_zero() || self.poll_interval.is_zero() {
            return invalid(
                "publish_timeout or poll_interval is 0",
                "give the broker time to confirm, and poll at a non-zero interval",
            );
        }
        if self.publish_timeout >= self.lease {
            return invalid(
                "publish_timeout is not shorter than lease",
                "make the lease several publish timeouts long",
            );
        }
        if chrono::Duration::from_std(self.lease + self.max_backoff).is_err() {
            return invalid(
                "lease or max_backoff is too long",
                "use hours, not centuries",
            );
        }
        Ok(())
    }

    /// The wait before attempt `attempts + 1` of a message that failed `attempts` times.
    fn backoff_after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(31);
        self.backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff)
    }
}

/// What one [`Relay::relay_once`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayReport {
    /// Rows claimed.
    pub claimed: u64,
    /// Rows published and marked sent.
    pub published: u64,
    /// Publishes that failed and will be retried.
    pub failed: u64,
    /// Rows parked as dead.
    pub dead: u64,
    /// Rows published whose lease had passed to another relay before they were marked:
    /// that relay publishes them again (same message id).
    pub lost_leases: u64,
    /// Rows handed back unpublished because the lease was running out.
    pub released: u64,
}

/// Counters of a relay since it was created, shared by its clones.
#[derive(Debug, Default)]
pub struct OutboxMetrics {
    published: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
    lost_leases: AtomicU64,
}

/// A copy of [`OutboxMetrics`]' counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutboxMetricsSnapshot {
    /// Messages published and marked sent.
    pub published: u64,
    /// Failed publishes (each retried later, or parked).
    pub failed: u64,
    /// Messages parked as dead.
    pub dead: u64,
    /// Published messages whose lease another relay had taken before they were marked.
    pub lost_leases: u64,
}

impl OutboxMetrics {
    /// The counters now.
    pub fn snapshot(&self) -> OutboxMetricsSnapshot {
        OutboxMetricsSnapshot {
            published: self.published.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            lost_leases: self.lost_leases.load(Ordering::Relaxed),
        }
    }

    fn add(&self, report: &RelayReport) {
        self.published
            .fetch_add(report.published, Ordering::Relaxed);
        self.failed.fetch_add(report.failed, Ordering::Relaxed);
        self.dead.fetch_add(report.dead, Ordering::Relaxed);
        self.lost_leases
            .fetch_add(report.lost_leases, Ordering::Relaxed);
        facade::outbox_relayed(report.published, report.failed, report.dead);
    }
}

/// Publishes the outbox's due rows and marks them sent: claim a batch in a short
/// transaction (a lease and a fencing token per claim), publish each message with the
/// broker's confirmation, then mark the published rows sent, fenced by the token.
///
/// Any number of relays may run against one database, in one process or many. Each claim
/// skips rows another relay's claim holds (`FOR UPDATE SKIP LOCKED` on PostgreSQL and
/// MySQL 8 / MariaDB 10.6+; SQLite's single writer), so in normal operation every row is
/// published once. A relay that dies between the broker's confirmation and the mark
/// leaves a lease that ends, and the row is published again with the same message id:
/// delivery is at least once, and consumers deduplicate by that id (an [`Inbox`]).
///
/// ```
/// use sea_orm::TransactionTrait;
/// use sea_orm_inbox::{OutboxExt, OutboxMessage, OutgoingMessage, PublishError, Publisher, Relay};
///
/// struct Stdout;
/// impl Publisher for Stdout {
///     async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
///         println!("{} -> {}", message.message_id, message.destination);
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # use sea_orm_inbox_migration::{MigratorWithOutbox, MigratorTrait};
/// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
/// # MigratorWithOutbox::up(&db, None).await?;
/// let relay = Relay::new(Stdout);
/// let txn = db.begin().await?;
/// txn.enqueue(OutgoingMessage::new("orders.placed", b"42".to_vec())).await?;
/// txn.commit().await?;
///
/// let report = relay.relay_once(&db).await?;
/// assert_eq!(report.published, 1);
/// # Ok(()) }
/// ```
pub struct Relay<P> {
    publisher: P,
    options: RelayOptions,
    waker: OutboxWaker,
    metrics: Arc<OutboxMetrics>,
    /// The server [`run`](Relay::run) listens on for other processes' wake-ups.
    #[cfg(feature = "postgres")]
    listen_url: Option<String>,
}

/// The rows of one claim, in `id` order, and the token that fences them.
struct ClaimedBatch {
    token: Uuid,
    leased_until: DateTime<Utc>,
    rows: Vec<(i64, OutboxMessage)>,
    /// Rows whose stored form could not be read back (hand-written headers): parked.
    unreadable: Vec<(i64, String)>,
}

/// How the publish of one row ended.
enum Published {
    Confirmed,
    Failed { error: String, permanent: bool },
}

impl<P: Publisher> Relay<P> {
    /// A relay publishing through `publisher`, with [`RelayOptions::default`].
    pub fn new(publisher: P) -> Self {
        Self {
            publisher,
            options: RelayOptions::default(),
            waker: OutboxWaker::default(),
            metrics: Arc::default(),
            #[cfg(feature = "postgres")]
            listen_url: None,
        }
    }

    /// Makes [`run`](Self::run) also wake when a process whose waker is
    /// [`notifying`](OutboxWaker::notifying) commits messages: it listens on
    /// [`OUTBOX_CHANNEL`](crate::OUTBOX_CHANNEL) on a connection of its own to `url`
    /// (PostgreSQL `LISTEN`). Without it, rows enqueued by other processes wait for the
    /// relay's next poll.
    ///
    /// `url` must reach the server itself, not a transaction pooler: `LISTEN` holds a
    /// session, which PgBouncer's transaction mode does not keep (the notifications would
    /// never arrive). The relay's own statements may still go through the pooler. While
    /// the connection is down the relay polls, and it wakes once when the connection is
    /// back, in case a notification was missed.
    ///
    /// ```no_run
    /// # fn run<P: sea_orm_inbox::Publisher>(publisher: P) -> Result<(), sea_orm_inbox::OutboxError> {
    /// use sea_orm_inbox::Relay;
    ///
    /// let relay = Relay::new(publisher).listening("postgres://app@db-primary:5432/app")?;
    /// # let _ = relay; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`OutboxError::InvalidOptions`] when `url` is not a PostgreSQL URL.
    #[cfg(feature = "postgres")]
    pub fn listening(mut self, url: impl Into<String>) -> Result<Self, OutboxError> {
        let url = url.into();
        // sqlx parses any scheme as PostgreSQL options; the scheme is the user's intent.
        let postgres_scheme = ["postgres://", "postgresql://"]
            .iter()
            .any(|scheme| url.starts_with(scheme));
        if !postgres_scheme
            || url
                .parse::<sea_orm::sqlx::postgres::PgConnectOptions>()
                .is_err()
        {
            return Err(OutboxError::InvalidOptions {
                what: "the LISTEN url is not a PostgreSQL URL",
                advice: "pass the server's postgres:// URL (not a transaction pooler's)",
            });
        }
        self.listen_url = Some(url);
        Ok(self)
    }

    /// Replaces the options.
    ///
    /// # Errors
    /// [`OutboxError::InvalidOptions`] (see [`RelayOptions::validate`]).
    pub fn with_options(mut self, options: RelayOptions) -> Result<Self, OutboxError> {
        options.validate()?;
        self.options = options;
        Ok(self)
    }

    /// The handle that wakes this relay's [`run`](Self::run) loop.
    pub fn waker(&self) -> OutboxWaker {
        self.waker.clone()
    }

    /// The relay's counters.
    pub fn metrics(&self) -> &OutboxMetrics {
        &self.metrics
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// Claims one batch of due rows, publishes them, and marks each sent, failed (retried
    /// after a backoff) or dead.
    ///
    /// # Errors
    /// [`OutboxError::Database`] or [`OutboxError::DatabaseSilent`] when the claim or the
    /// marking failed. Rows published before a failed marking keep their lease until it
    /// ends, and are then published again (same message id).
    pub async fn relay_once(&self, db: &DatabaseConnection) -> Result<RelayReport, OutboxError> {
        let batch = self.claim(db).await?;
        let mut report = RelayReport {
            claimed: (batch.rows.len() + batch.unreadable.len()) as u64,
            ..RelayReport::default()
        };
        if report.claimed == 0 {
            return Ok(report);
        }
        let mut outcomes = Vec::with_capacity(batch.rows.len());
        let mut unpublished = Vec::new();
        for (id, message) in &batch.rows {
            let lease_left = batch.leased_until - Utc::now();
            if lease_left.to_std().unwrap_or_default() <= self.options.publish_timeout {
                unpublished.push(*id);
                continue;
            }
            let outcome = match tokio::time::timeout(
                self.options.publish_timeout,
                self.publisher.publish(message),
            )
            .await
            {
                Ok(Ok(())) => Published::Confirmed,
                Ok(Err(err)) => Published::Failed {
                    permanent: matches!(err, PublishError::Rejected(_)),
                    error: err.to_string(),
                },
                Err(_) => Published::Failed {
                    error: format!(
                        "the broker did not confirm within {:?}",
                        self.options.publish_timeout
                    ),
                    permanent: false,
                },
            };
            outcomes.push((*id, message.attempt, outcome));
        }
        for (id, error) in &batch.unreadable {
            outcomes.push((
                *id,
                self.options.max_attempts,
                Published::Failed {
                    error: error.clone(),
                    permanent: true,
                },
            ));
        }
        self.settle(db, &batch, &outcomes, &unpublished, &mut report)
            .await?;
        self.metrics.add(&report);
        Ok(report)
    }

    /// Relays until `stop` completes: a batch at once when the last one was full, else
    /// after a [`wake`](OutboxWaker::wake) or [`RelayOptions::poll_interval`]. A failed
    /// batch is logged (`tracing` warning) and retried at the next poll: the relay
    /// outlives database and broker outages. A batch that lost a conflict to another
    /// transaction (a deadlock, a serialization failure, a claim that failed Galera's
    /// certification against another node's relay) is retried at once, logged at debug:
    /// the winner took its rows, and more may be due.
    pub async fn run(&self, db: &DatabaseConnection, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let _listener = self.spawn_listener();
        loop {
            let again = match self.relay_once(db).await {
                Ok(report) => report.claimed >= u64::from(self.options.batch_size),
                // Waiting a poll interval here would leave the drain to the winner: two
                // relays on two Galera nodes see the same due rows and lose to each other
                // all the time, and the loser sat out the rest of the backlog.
                Err(OutboxError::Database { source, operation }) if lost_a_conflict(&source) => {
                    tracing::debug!(error = %source, operation, "outbox relay batch lost a conflict; retrying at once");
                    true
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox relay batch failed; retrying at the next poll");
                    false
                }
            };
            if again {
                continue;
            }
            tokio::select! {
                () = &mut stop => return,
                () = self.waker.woken() => {}
                () = tokio::time::sleep(self.options.poll_interval) => {}
            }
        }
    }

    /// The task listening for other processes' wake-ups, when [`listening`](Self::listening);
    /// it ends when the returned guard is dropped, with [`run`](Self::run).
    fn spawn_listener(&self) -> Option<AbortOnDrop> {
        #[cfg(feature = "postgres")]
        if let Some(url) = &self.listen_url {
            let task =
                super::wake::listen(url.clone(), self.waker.clone(), self.options.poll_interval);
            return Some(AbortOnDrop(tokio::spawn(task)));
        }
        None
    }

    /// Claims due rows, leasing them to a new token: in one statement on its own or in a
    /// short transaction of its own, as the backend's [`ClaimPlan`] says.
    async fn claim(&self, db: &DatabaseConnection) -> Result<ClaimedBatch, OutboxError> {
        let backend = db.get_database_backend();
        let now = now_micros();
        let token = Uuid::new_v4();
        let lease = chrono::Duration::from_std(self.options.lease).map_err(|_| {
            OutboxError::InvalidOptions {
                what: "lease is too long",
                advice: "use hours, not centuries",
            }
        })?;
        let leased_until = now + lease;
        let plan = claim_plan(
            backend,
            now,
            leased_until,
            token,
            i64::from(self.options.batch_size),
        )?;
        let claimer = db.clone();
        let claim = async move {
            match plan {
                ClaimPlan::Alone(update) => {
                    outbox::Entity::find()
                        .from_raw_sql(update)
                        .all(&claimer)
                        .await
                }
                ClaimPlan::InTransaction(update, options) => {
                    let txn = claimer.begin_with_options(options).await?;
                    let rows = outbox::Entity::find()
                        .from_raw_sql(update)
                        .all(&txn)
                        .await?;
                    txn.commit().await?;
                    Ok(rows)
                }
                ClaimPlan::LockThenLease(select, options) => {
                    let txn = claimer.begin_with_options(options).await?;
                    let mut rows = outbox::Entity::find()
                        .from_raw_sql(select)
                        .all(&txn)
                        .await?;
                    if rows.is_empty() {
                        txn.rollback().await?;
                        return Ok(rows);
                    }
                    let ids: Vec<i64> = rows.iter().map(|row| row.id).collect();
                    let lease = lease_statement(backend, &ids, leased_until, token)
                        .map_err(|err| DbErr::Custom(err.to_string()))?;
                    txn.execute_raw(lease).await?;
                    txn.commit().await?;
                    // The read saw the rows before the lease; make them read as leased.
                    for row in &mut rows {
                        row.attempts = row.attempts.saturating_add(1);
                    }
                    Ok(rows)
                }
            }
        };
        let mut rows = bounded(backend, "the relay's claim", to_completion(claim)).await?;
        // `UPDATE ... RETURNING` returns its rows in no promised order.
        rows.sort_unstable_by_key(|row| row.id);
        let mut batch = ClaimedBatch {
            token,
            leased_until,
            rows: Vec::with_capacity(rows.len()),
            unreadable: Vec::new(),
        };
        for row in rows {
            let id = row.id;
            match OutboxMessage::from_row(row) {
                Ok(message) => batch.rows.push(message),
                Err(error) => batch.unreadable.push((id, error)),
            }
        }
        Ok(batch)
    }

    /// Writes the outcomes of one batch, each row fenced by the batch's token: in one short
    /// transaction, or, when they are one statement and the backend allows it, that
    /// statement on its own.
    async fn settle(
        &self,
        db: &DatabaseConnection,
        batch: &ClaimedBatch,
        outcomes: &[(i64, u32, Published)],
        unpublished: &[i64],
        report: &mut RelayReport,
    ) -> Result<(), OutboxError> {
        let backend = db.get_database_backend();
        let now = now_micros();
        let confirmed: Vec<i64> = outcomes
            .iter()
            .filter(|(_, _, outcome)| matches!(outcome, Published::Confirmed))
            .map(|(id, _, _)| *id)
            .collect();
        let mut statements: Vec<(Statement, Counted)> = Vec::new();
        if !confirmed.is_empty() {
            statements.push((
                mark_sent_statement(backend, &confirmed, now, batch.token)?,
                Counted::Sent(confirmed.len() as u64),
            ));
        }
        for (id, attempt, outcome) in outcomes {
            let Published::Failed { error, permanent } = outcome else {
                continue;
            };
            let dead = *permanent || *attempt >= self.options.max_attempts;
            let retry_after = chrono::Duration::from_std(self.options.backoff_after(*attempt))
                .unwrap_or(chrono::Duration::MAX);
            let failure = Failure {
                id: *id,
                token: batch.token,
                retry_at: now.checked_add_signed(retry_after).unwrap_or(now),
                error,
                dead_at: dead.then_some(now),
            };
            statements.push((
                mark_failed_statement(backend, failure)?,
                if dead { Counted::Dead } else { Counted::Failed },
            ));
        }
        if !unpublished.is_empty() {
            statements.push((
                release_statement(backend, unpublished, batch.token)?,
                Counted::Released,
            ));
        }
        let alone = statements.len() == 1 && settle_alone(backend)?;
        let writer = db.clone();
        let write = async move {
            if alone {
                return execute_counted(&writer, statements).await;
            }
            let txn = writer.begin().await?;
            let counts = execute_counted(&txn, statements).await?;
            txn.commit().await?;
            Ok(counts)
        };
        let counts = bounded(backend, "marking the relayed rows", to_completion(write)).await?;
        for (counted, rows) in counts {
            match counted {
                Counted::Sent(expected) => {
                    report.published += rows;
                    report.lost_leases += expected.saturating_sub(rows);
                }
                Counted::Failed => report.failed += 1,
                Counted::Dead => {
                    report.failed += 1;
                    report.dead += rows;
                }
                Counted::Released => report.released += rows,
            }
        }
        Ok(())
    }
}

/// Runs a settle's statements on `conn` in order, with the rows each touched.
async fn execute_counted<C: ConnectionTrait>(
    conn: &C,
    statements: Vec<(Statement, Counted)>,
) -> Result<Vec<(Counted, u64)>, DbErr> {
    let mut counts = Vec::with_capacity(statements.len());
    for (statement, counted) in statements {
        let done = conn.execute_raw(statement).await?;
        counts.push((counted, done.rows_affected()));
    }
    Ok(counts)
}

/// What a settle statement's row count adds to the report.
enum Counted {
    Sent(u64),
    Failed,
    Dead,
    Released,
}

/// Awaits a database call of the relay within [`Inbox::DEFAULT_PARTITION_TIMEOUT`].
pub(crate) async fn bounded<T, F: Future<Output = Result<T, DbErr>>>(
    backend: sea_orm::DbBackend,
    operation: &'static str,
    future: F,
) -> Result<T, OutboxError> {
    within(backend, Inbox::DEFAULT_PARTITION_TIMEOUT, future)
        .await
        .map_err(|waited| OutboxError::DatabaseSilent { operation, waited })?
        .map_err(|source| OutboxError::Database { operation, source })
}

/// Aborts a spawned task when dropped, so a task serving [`Relay::run`] ends with it, also
/// when `run`'s future is dropped rather than stopped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
