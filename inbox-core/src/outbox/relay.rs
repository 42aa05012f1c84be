use super::OutboxError;
use super::message::{ClaimedRow, OutboxMessage};
use super::wake::OutboxWaker;
use crate::Inbox;
use crate::backend::outbox::{
    ClaimPlan, Failure, UNSTORABLE_ERROR, claim_plan, mark_failed_statement, mark_sent_statement,
    release_statement, settle_alone,
};
use crate::backend::{lost_a_conflict, refused_by_the_database, silence_statement, to_completion};
use crate::brokers::{PublishError, Publisher};
use crate::clock::now_micros;
use crate::metrics::facade;
use crate::silence::within;
use chrono::{DateTime, Utc};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, Statement,
    TransactionTrait,
};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use uuid::Uuid;

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
    /// The longest one publish (one [`Publisher::publish_batch`] call, for a publisher
    /// that batches) may wait for the broker (default 10 s); past it the publish counts as
    /// failed. Shorter than `lease`.
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

/// What one [`Relay::relay_once`] (or, summed, one [`Relay::drain`]) did.
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

impl RelayReport {
    /// Adds what a settle's statements touched.
    fn count(&mut self, counts: Vec<(Counted, u64)>) {
        for (counted, rows) in counts {
            match counted {
                Counted::Sent(expected) => {
                    self.published += rows;
                    self.lost_leases += expected.saturating_sub(rows);
                }
                Counted::Failed => self.failed += 1,
                Counted::Dead => {
                    self.failed += 1;
                    self.dead += rows;
                }
                Counted::Released => self.released += rows,
            }
        }
    }

    /// Adds another batch's report to this one.
    fn add(&mut self, other: &RelayReport) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.failed += other.failed;
        self.dead += other.dead;
        self.lost_leases += other.lost_leases;
        self.released += other.released;
    }
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
/// skips rows another relay's claim holds (`FOR UPDATE SKIP LOCKED` on PostgreSQL; on
/// MySQL/MariaDB a lease by primary key that takes only rows still due; SQLite's single
/// writer), so in normal operation every row is published once. A relay that dies between the broker's confirmation and the mark
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
    /// See [`Relay::with_partition_timeout`].
    partition_timeout: Duration,
    /// The server [`run`](Relay::run) listens on for other processes' wake-ups.
    #[cfg(feature = "postgres")]
    listen_url: Option<String>,
}

/// The fencing token of one claim, and when its lease began and ends.
#[derive(Clone, Copy)]
struct Lease {
    token: Uuid,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
}

/// The rows of one claim, in `id` order, and the lease that fences them.
struct ClaimedBatch {
    lease: Lease,
    rows: Vec<(i64, OutboxMessage)>,
    /// Rows whose stored form could not be read back (hand-written headers): parked.
    unreadable: Vec<(i64, String)>,
}

impl ClaimedBatch {
    fn new(lease: Lease, rows: Vec<ClaimedRow>) -> Self {
        let mut batch = Self {
            lease,
            rows: Vec::with_capacity(rows.len()),
            unreadable: Vec::new(),
        };
        for row in rows {
            let id = row.id();
            match OutboxMessage::from_row(row, lease.since) {
                Ok(message) => batch.rows.push(message),
                Err(error) => batch.unreadable.push((id, error)),
            }
        }
        batch
    }

    /// A report of this batch with its rows claimed and nothing done yet.
    fn report(&self) -> RelayReport {
        RelayReport {
            claimed: (self.rows.len() + self.unreadable.len()) as u64,
            ..RelayReport::default()
        }
    }
}

/// How the publishes of one batch went: what its settle writes.
struct Settlement {
    /// Each published row's id, its attempt and how the publish ended.
    outcomes: Vec<(i64, u32, Published)>,
    /// Rows handed back unpublished: their lease was running out.
    unpublished: Vec<i64>,
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
            partition_timeout: Inbox::DEFAULT_PARTITION_TIMEOUT,
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

    /// Bounds how long the relay waits for a database that stops answering, and how long
    /// the server keeps a relay transaction whose client went silent (default
    /// [`Inbox::DEFAULT_PARTITION_TIMEOUT`], between [`Inbox::MIN_PARTITION_TIMEOUT`] and
    /// [`Inbox::MAX_PARTITION_TIMEOUT`]), as [`Inbox::with_partition_timeout`] does for a
    /// claim.
    ///
    /// A relay cut off from the database in the middle of a claim (a NAT or load balancer
    /// drops its flow: no reset, the packets just stop) would otherwise leave an open
    /// transaction on the server holding the rows it claimed, for hours: no other relay
    /// publishes them meanwhile. With this bound the relay's call returns
    /// [`OutboxError::DatabaseSilent`] after it, and the server ends the abandoned
    /// transaction after it (PostgreSQL: `idle_in_transaction_session_timeout` and
    /// `tcp_user_timeout`; MariaDB: `idle_transaction_timeout` and `net_write_timeout`,
    /// whole seconds, rounded up; MySQL 8 has only the latter, so there an idle
    /// transaction lasts until `wait_timeout`), releasing the rows. SQLite is embedded:
    /// nothing to bound.
    ///
    /// ```
    /// use sea_orm_inbox::{Publisher, Relay};
    /// use std::time::Duration;
    ///
    /// # fn build<P: Publisher>(publisher: P) -> Result<(), sea_orm_inbox::OutboxError> {
    /// let relay = Relay::new(publisher).with_partition_timeout(Duration::from_secs(5))?;
    /// assert_eq!(relay.partition_timeout(), Duration::from_secs(5));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`OutboxError::InvalidOptions`] outside the accepted range.
    pub fn with_partition_timeout(mut self, timeout: Duration) -> Result<Self, OutboxError> {
        if !(Inbox::MIN_PARTITION_TIMEOUT..=Inbox::MAX_PARTITION_TIMEOUT).contains(&timeout) {
            return Err(OutboxError::InvalidOptions {
                what: "the partition timeout is outside 1 s ..= 30 min",
                advice: "choose one well below the lease and above the database's slowest claim",
            });
        }
        self.partition_timeout = timeout;
        Ok(self)
    }

    /// See [`with_partition_timeout`](Self::with_partition_timeout).
    pub fn partition_timeout(&self) -> Duration {
        self.partition_timeout
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
        let mut report = batch.report();
        if report.claimed == 0 {
            return Ok(report);
        }
        let settlement = self.publish(&batch).await;
        self.settle(db, &batch, &settlement, &mut report).await?;
        self.metrics.add(&report);
        Ok(report)
    }

    /// Relays batch after batch until a claim finds less than a full batch, and reports
    /// the sum: what [`run`](Self::run) does each time it wakes.
    ///
    /// Unlike [`relay_once`](Self::relay_once) in a loop, the marks of a full batch commit
    /// in one transaction with the claim of the next, so a backlog costs one commit per
    /// batch instead of two (the claim's lease still commits before anything of its batch
    /// is published). On MySQL/MariaDB, where every commit waits for the redo log's flush
    /// (`innodb_flush_log_at_trx_commit = 1`, about 3.4 ms a flush on the benchmark's
    /// disk), that transaction's BEGIN, silence bound and COMMIT cost three round trips
    /// more than the claim's three statements and the mark in autocommit, and one flush
    /// less. When that transaction fails (a conflict with another relay: a deadlock, or
    /// Galera's certification), the marks are written again on their own before the next
    /// claim, so a lost conflict costs no batch its marks.
    ///
    /// ```
    /// use sea_orm::TransactionTrait;
    /// use sea_orm_inbox::{OutboxExt, OutboxMessage, OutgoingMessage, PublishError, Publisher, Relay, RelayOptions};
    ///
    /// struct Discard;
    /// impl Publisher for Discard {
    ///     async fn publish(&self, _: &OutboxMessage) -> Result<(), PublishError> {
    ///         Ok(())
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # use sea_orm_inbox_migration::{MigratorWithOutbox, MigratorTrait};
    /// # let db = sea_orm::Database::connect("sqlite::memory:").await?;
    /// # MigratorWithOutbox::up(&db, None).await?;
    /// let txn = db.begin().await?;
    /// for n in 0..25 {
    ///     txn.enqueue(OutgoingMessage::new("orders.placed", format!("{n}"))).await?;
    /// }
    /// txn.commit().await?;
    ///
    /// let relay = Relay::new(Discard).with_options(RelayOptions {
    ///     batch_size: 10,
    ///     ..RelayOptions::default()
    /// })?;
    /// let report = relay.drain(&db).await?; // batches of 10, 10 and 5
    /// assert_eq!((report.claimed, report.published), (25, 25));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`relay_once`](Self::relay_once). Batches relayed before the failure stay
    /// marked (and counted in [`metrics`](Self::metrics)); the failed batch's rows keep
    /// their lease until it ends, and are then published again (same message id).
    pub async fn drain(&self, db: &DatabaseConnection) -> Result<RelayReport, OutboxError> {
        let mut drained = RelayReport::default();
        let mut batch = self.claim(db).await?;
        loop {
            let mut report = batch.report();
            if report.claimed == 0 {
                return Ok(drained);
            }
            let settlement = self.publish(&batch).await;
            let full = report.claimed >= u64::from(self.options.batch_size);
            let next = if full {
                match self
                    .settle_then_claim(db, &batch, &settlement, &mut report)
                    .await
                {
                    Ok(next) => Some(next),
                    Err(error) => {
                        tracing::debug!(%error, "outbox relay's marks with the next claim failed; marking alone");
                        self.settle(db, &batch, &settlement, &mut report).await?;
                        None
                    }
                }
            } else {
                self.settle(db, &batch, &settlement, &mut report).await?;
                None
            };
            self.metrics.add(&report);
            drained.add(&report);
            if !full {
                return Ok(drained);
            }
            batch = match next {
                Some(next) => next,
                None => self.claim(db).await?,
            };
        }
    }

    /// Publishes each row of `batch` with the broker's confirmation, handing back the rows
    /// its lease no longer covers.
    async fn publish(&self, batch: &ClaimedBatch) -> Settlement {
        let mut outcomes = Vec::with_capacity(batch.rows.len() + batch.unreadable.len());
        let mut unpublished = Vec::new();
        // One message at a time, or as many as the publisher takes in one call.
        for chunk in batch.rows.chunks(self.publisher.batch_limit().max(1)) {
            let lease_left = batch.lease.until - Utc::now();
            if lease_left.to_std().unwrap_or_default() <= self.options.publish_timeout {
                unpublished.extend(chunk.iter().map(|(id, _)| *id));
                continue;
            }
            let messages: Vec<&OutboxMessage> = chunk.iter().map(|(_, message)| message).collect();
            let failed_alike = |error: String| -> Vec<Published> {
                chunk
                    .iter()
                    .map(|_| Published::Failed {
                        error: error.clone(),
                        permanent: false,
                    })
                    .collect()
            };
            let published = match tokio::time::timeout(
                self.options.publish_timeout,
                PanicCaught(Box::pin(self.publisher.publish_batch(&messages))),
            )
            .await
            {
                Ok(Ok(results)) if results.len() == chunk.len() => results
                    .into_iter()
                    .map(|result| match result {
                        Ok(()) => Published::Confirmed,
                        Err(err) => Published::Failed {
                            permanent: matches!(err, PublishError::Rejected(_)),
                            error: err.to_string(),
                        },
                    })
                    .collect(),
                Ok(Ok(results)) => failed_alike(format!(
                    "the publisher returned {} results for {} messages",
                    results.len(),
                    chunk.len()
                )),
                Ok(Err(panic)) => failed_alike(format!("the publisher panicked: {panic}")),
                Err(_) => failed_alike(format!(
                    "the broker did not confirm within {:?}",
                    self.options.publish_timeout
                )),
            };
            for ((id, message), outcome) in chunk.iter().zip(published) {
                outcomes.push((*id, message.attempt, outcome));
            }
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
        Settlement {
            outcomes,
            unpublished,
        }
    }

    /// Relays until `stop` completes: [`drain`](Self::drain)s the due rows, then waits for
    /// a [`wake`](OutboxWaker::wake) or [`RelayOptions::poll_interval`]. A failed
    /// batch is logged (`tracing` warning) and retried at the next poll: the relay
    /// outlives database and broker outages. A batch that lost a conflict to another
    /// transaction (a deadlock, a serialization failure, a claim that failed Galera's
    /// certification against another node's relay) is retried at once, logged at debug:
    /// the winner took its rows, and more may be due.
    pub async fn run(&self, db: &DatabaseConnection, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let _listener = self.spawn_listener();
        loop {
            let again = match self.drain(db).await {
                Ok(_) => false,
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

    /// A new lease from now, and the backend's claim of the due rows under it.
    fn new_claim(&self, backend: DbBackend) -> Result<(Lease, ClaimPlan), OutboxError> {
        let now = now_micros();
        let length = chrono::Duration::from_std(self.options.lease).map_err(|_| {
            OutboxError::InvalidOptions {
                what: "lease is too long",
                advice: "use hours, not centuries",
            }
        })?;
        let lease = Lease {
            token: Uuid::new_v4(),
            since: now,
            until: now + length,
        };
        let plan = claim_plan(
            backend,
            now,
            lease.until,
            lease.token,
            i64::from(self.options.batch_size),
            self.partition_timeout,
        )?;
        Ok((lease, plan))
    }

    /// Claims due rows, leasing them to a new token: in one statement on its own or in a
    /// short transaction of its own, as the backend's [`ClaimPlan`] says.
    async fn claim(&self, db: &DatabaseConnection) -> Result<ClaimedBatch, OutboxError> {
        let backend = db.get_database_backend();
        let (lease, plan) = self.new_claim(backend)?;
        let claimer = db.clone();
        let claim = async move {
            let Some(options) = plan.transaction_options() else {
                return claim_rows(&claimer, plan).await;
            };
            let txn = claimer.begin_with_options(options).await?;
            let rows = claim_rows(&txn, plan).await?;
            txn.commit().await?;
            Ok(rows)
        };
        let rows = bounded_by(
            backend,
            self.partition_timeout,
            "the relay's claim",
            to_completion(claim),
        )
        .await?;
        Ok(ClaimedBatch::new(lease, rows))
    }

    /// The settle of `batch` and the claim of the next batch, in one transaction, bounded
    /// against a silent client from its start where the claim does not bound itself.
    async fn settle_then_claim(
        &self,
        db: &DatabaseConnection,
        batch: &ClaimedBatch,
        settlement: &Settlement,
        report: &mut RelayReport,
    ) -> Result<ClaimedBatch, OutboxError> {
        let backend = db.get_database_backend();
        let statements = self.settle_statements(backend, batch, settlement)?;
        let (lease, plan) = self.new_claim(backend)?;
        let options = plan.transaction_options().unwrap_or_default();
        let silence = if plan.bounds_its_silence() {
            None
        } else {
            silence_statement(backend, self.partition_timeout)?
        };
        let writer = db.clone();
        let work = async move {
            let txn = writer.begin_with_options(options).await?;
            bound_silence(&txn, silence.as_deref()).await?;
            let counts = execute_counted(&txn, statements).await?;
            let rows = claim_rows(&txn, plan).await?;
            txn.commit().await?;
            Ok((counts, rows))
        };
        let (counts, rows) = bounded_by(
            backend,
            self.partition_timeout,
            "marking the relayed rows and claiming the next",
            to_completion(work),
        )
        .await?;
        report.count(counts);
        Ok(ClaimedBatch::new(lease, rows))
    }

    /// The statements that write the outcomes of one batch, each row fenced by the batch's
    /// token.
    fn settle_statements(
        &self,
        backend: DbBackend,
        batch: &ClaimedBatch,
        settlement: &Settlement,
    ) -> Result<Vec<Mark>, OutboxError> {
        let now = now_micros();
        let token = batch.lease.token;
        let confirmed: Vec<i64> = settlement
            .outcomes
            .iter()
            .filter(|(_, _, outcome)| matches!(outcome, Published::Confirmed))
            .map(|(id, _, _)| *id)
            .collect();
        let mut marks: Vec<Mark> = Vec::new();
        if !confirmed.is_empty() {
            marks.push(Mark {
                statement: mark_sent_statement(backend, &confirmed, now, token)?,
                counted: Counted::Sent(confirmed.len() as u64),
                safe: None,
            });
        }
        for (id, attempt, outcome) in &settlement.outcomes {
            let Published::Failed { error, permanent } = outcome else {
                continue;
            };
            let dead = *permanent || *attempt >= self.options.max_attempts;
            let retry_after = chrono::Duration::from_std(self.options.backoff_after(*attempt))
                .unwrap_or(chrono::Duration::MAX);
            let failure = Failure {
                id: *id,
                token,
                retry_at: now.checked_add_signed(retry_after).unwrap_or(now),
                error,
                dead_at: dead.then_some(now),
            };
            marks.push(Mark {
                statement: mark_failed_statement(backend, failure)?,
                counted: if dead { Counted::Dead } else { Counted::Failed },
                safe: Some(mark_failed_statement(
                    backend,
                    Failure {
                        error: UNSTORABLE_ERROR,
                        ..failure
                    },
                )?),
            });
        }
        if !settlement.unpublished.is_empty() {
            marks.push(Mark {
                statement: release_statement(backend, &settlement.unpublished, token)?,
                counted: Counted::Released,
                safe: None,
            });
        }
        Ok(marks)
    }

    /// Writes the outcomes of one batch: in one short transaction, or, when they are one
    /// statement and the backend allows it, that statement on its own. When the database
    /// refuses one of its statements, writes them again one by one (see
    /// [`settle_one_by_one`](Self::settle_one_by_one)).
    async fn settle(
        &self,
        db: &DatabaseConnection,
        batch: &ClaimedBatch,
        settlement: &Settlement,
        report: &mut RelayReport,
    ) -> Result<(), OutboxError> {
        let backend = db.get_database_backend();
        let marks = self.settle_statements(backend, batch, settlement)?;
        let alone = marks.len() == 1 && settle_alone(backend)?;
        match self
            .write_marks(db, alone, marks.clone(), "marking the relayed rows")
            .await?
        {
            Ok(counts) => {
                report.count(counts);
                Ok(())
            }
            Err(refused) => {
                tracing::warn!(error = %refused, "outbox relay's marks of a batch were refused together; marking its rows one by one");
                self.settle_one_by_one(db, marks, report).await
            }
        }
    }

    /// Writes each mark on its own, so that one the database refuses (an error text it
    /// cannot store, a trigger) does not keep the others unwritten and the whole batch
    /// published again at every lease. A refused failure mark is written again with
    /// [`UNSTORABLE_ERROR`] for its text, so the attempt still counts and the row is
    /// parked in time.
    ///
    /// # Errors
    /// The first mark refused even so (the others are written and counted); or, at once,
    /// a failure that is not a refused statement (a lost connection, a failed COMMIT, a
    /// silent database), which every further mark would meet too.
    async fn settle_one_by_one(
        &self,
        db: &DatabaseConnection,
        marks: Vec<Mark>,
        report: &mut RelayReport,
    ) -> Result<(), OutboxError> {
        let operation = "marking a relayed row";
        let alone = settle_alone(db.get_database_backend())?;
        let mut first_refusal = None;
        for mark in marks {
            let Mark {
                statement,
                counted,
                safe,
            } = mark;
            let mut written = self
                .write_marks(db, alone, vec![Mark::plain(statement, counted)], operation)
                .await?;
            if let (Err(refused), Some(safe)) = (&written, safe) {
                tracing::warn!(error = %refused, "outbox relay could not store a publish error; storing a fixed text instead");
                written = self
                    .write_marks(db, alone, vec![Mark::plain(safe, counted)], operation)
                    .await?;
            }
            match written {
                Ok(counts) => report.count(counts),
                Err(source) => {
                    tracing::warn!(error = %source, "outbox relay could not mark a row; it is published again when its lease ends");
                    first_refusal.get_or_insert(OutboxError::Database { operation, source });
                }
            }
        }
        first_refusal.map_or(Ok(()), Err)
    }
}

impl<P: Publisher> Relay<P> {
    /// Writes `marks` on their own when `alone`, else in a transaction of their own, which
    /// the server ends once the relay has been silent for its partition timeout. The inner
    /// error is a mark the database refused, after which nothing of them is written; the
    /// outer one any other failure (a lost connection, BEGIN, COMMIT, whose reply may be
    /// lost after the marks committed, or a silent database), which writing them again
    /// would not mend.
    async fn write_marks(
        &self,
        db: &DatabaseConnection,
        alone: bool,
        marks: Vec<Mark>,
        operation: &'static str,
    ) -> Result<Result<Vec<(Counted, u64)>, DbErr>, OutboxError> {
        let backend = db.get_database_backend();
        let silence = silence_statement(backend, self.partition_timeout)?;
        let refused_or_failed = |err: DbErr| {
            if refused_by_the_database(&err) {
                Ok(Err(err))
            } else {
                Err(err)
            }
        };
        let writer = db.clone();
        let write = async move {
            if alone {
                return execute_counted(&writer, marks)
                    .await
                    .map_or_else(refused_or_failed, |counts| Ok(Ok(counts)));
            }
            let txn = writer.begin().await?;
            bound_silence(&txn, silence.as_deref()).await?;
            let counts = match execute_counted(&txn, marks).await {
                Ok(counts) => counts,
                // Dropping `txn` rolls back whatever of the marks ran.
                Err(err) => return refused_or_failed(err),
            };
            txn.commit().await?;
            Ok(Ok(counts))
        };
        bounded_by(
            backend,
            self.partition_timeout,
            operation,
            to_completion(write),
        )
        .await
    }
}

/// Runs the claim `plan` on `conn` (a transaction, when the plan needs one), leasing the
/// rows it finds: the rows as leased, in `id` order.
async fn claim_rows<C: ConnectionTrait>(
    conn: &C,
    plan: ClaimPlan,
) -> Result<Vec<ClaimedRow>, DbErr> {
    let mut rows = match plan {
        ClaimPlan::InTransaction(update, _) => {
            ClaimedRow::decode_all(&conn.query_all_raw(update).await?)?
        }
        ClaimPlan::ReadThenLease(plan) => {
            let rows = ClaimedRow::decode_all(&conn.query_all_raw(plan.read.clone()).await?)?;
            if rows.is_empty() {
                return Ok(rows);
            }
            let ids: Vec<i64> = rows.iter().map(ClaimedRow::id).collect();
            let leased = conn.execute_raw(plan.lease(&ids)).await?.rows_affected();
            // Only a trigger that skips rows could take fewer under the write lock: none
            // of the batch is published unleased (the error rolls the claim back).
            if leased != ids.len() as u64 {
                return Err(DbErr::Custom(format!(
                    "the relay's lease took {leased} of the {} rows it read",
                    ids.len()
                )));
            }
            rows
        }
        ClaimPlan::ReadLeaseReadBack(plan) => {
            let candidates: Vec<i64> = conn
                .query_all_raw(plan.candidates.clone())
                .await?
                .iter()
                .map(|row| row.try_get_by_index::<i64>(0))
                .collect::<Result<_, _>>()?;
            if candidates.is_empty() {
                return Ok(Vec::new());
            }
            let took = conn
                .execute_raw(plan.lease(&candidates))
                .await?
                .rows_affected();
            // A lease that took no row (another relay's took them all) needs no read.
            if took == 0 {
                return Ok(Vec::new());
            }
            ClaimedRow::decode_all(&conn.query_all_raw(plan.leased(&candidates, took)).await?)?
        }
    };
    // `UPDATE ... RETURNING` returns its rows in no promised order.
    rows.sort_unstable_by_key(ClaimedRow::id);
    Ok(rows)
}

/// Runs `silence` (see [`ClaimPlan::silence`]) in `txn` before the transaction takes a row
/// lock, which a relay cut off by a partition would otherwise keep for hours.
async fn bound_silence(txn: &DatabaseTransaction, silence: Option<&str>) -> Result<(), DbErr> {
    if let Some(sql) = silence {
        txn.execute_unprepared(sql).await?;
    }
    Ok(())
}

/// Runs a settle's statements on `conn` in order, with the rows each touched.
async fn execute_counted<C: ConnectionTrait>(
    conn: &C,
    marks: Vec<Mark>,
) -> Result<Vec<(Counted, u64)>, DbErr> {
    let mut counts = Vec::with_capacity(marks.len());
    for mark in marks {
        let done = conn.execute_raw(mark.statement).await?;
        counts.push((mark.counted, done.rows_affected()));
    }
    Ok(counts)
}

/// One statement of a settle.
#[derive(Clone)]
struct Mark {
    statement: Statement,
    counted: Counted,
    /// For a failed publish: the same mark with [`UNSTORABLE_ERROR`] for its error text.
    safe: Option<Statement>,
}

impl Mark {
    fn plain(statement: Statement, counted: Counted) -> Self {
        Self {
            statement,
            counted,
            safe: None,
        }
    }
}

/// What a settle statement's row count adds to the report.
#[derive(Clone, Copy)]
enum Counted {
    Sent(u64),
    Failed,
    Dead,
    Released,
}

/// Awaits a database call of the outbox within [`Inbox::DEFAULT_PARTITION_TIMEOUT`].
pub(crate) async fn bounded<T, F: Future<Output = Result<T, DbErr>>>(
    backend: sea_orm::DbBackend,
    operation: &'static str,
    future: F,
) -> Result<T, OutboxError> {
    bounded_by(backend, Inbox::DEFAULT_PARTITION_TIMEOUT, operation, future).await
}

/// Awaits a database call of the relay within `timeout` (its partition timeout).
async fn bounded_by<T, F: Future<Output = Result<T, DbErr>>>(
    backend: sea_orm::DbBackend,
    timeout: Duration,
    operation: &'static str,
    future: F,
) -> Result<T, OutboxError> {
    within(backend, timeout, future)
        .await
        .map_err(|waited| OutboxError::DatabaseSilent { operation, waited })?
        .map_err(|source| OutboxError::Database { operation, source })
}

/// A publish whose panic is caught and returned as its message: a publisher that panics
/// on one message (a bug in a broker client, a payload it cannot encode) fails that
/// attempt like any other failure, counted against `max_attempts`, instead of unwinding
/// through the relay, whose task would end with the row leased, and which would meet the
/// same row first again after a restart, every time.
struct PanicCaught<'a, T>(Pin<Box<dyn Future<Output = T> + Send + 'a>>);

impl<T> Future for PanicCaught<'_, T> {
    type Output = Result<T, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let publish = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| publish.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(published)) => Poll::Ready(Ok(published)),
            Err(panic) => Poll::Ready(Err(panic
                .downcast_ref::<&str>()
                .map(|message| (*message).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned()))),
        }
    }
}

/// Aborts a spawned task when dropped, so a task serving [`Relay::run`] ends with it, also
/// when `run`'s future is dropped rather than stopped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
