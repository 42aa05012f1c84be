//! A simulated at-least-once broker and replicas consuming it through `Inbox::process`:
//! the harness of the soak and the server-restart tests.
//!
//! Every delivery is settled with [`Settlement::of`]: an ack retires it, a nack puts it back
//! at the end of the queue, as a broker redelivers an abandoned message. Handlers record
//! their effect as one row per application in `effect` (no unique key, so a double
//! application shows up instead of failing), and [`assert_exactly_once`] compares it with
//! the plan.

use crate::{TestDb, run, scalar_i64, stmt};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
use sea_orm_inbox::{Inbox, Outcome, ProcessError, RetryPolicy, Settlement};
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The consumer every replica of the stream runs as.
pub const STREAM_CONSUMER: &str = "soak.effect";

/// Which messages a run delivers, which twice, and which fail on their first handling.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The distinct messages.
    pub ids: Vec<Uuid>,
    /// Messages delivered a second time (a publisher retry or a broker redelivery).
    pub duplicated: HashSet<Uuid>,
    /// Messages whose handler fails the first time it runs (nacked, then redelivered).
    pub failing: HashSet<Uuid>,
    /// The deliveries in broker order: duplicates land a few positions after their
    /// original, so replicas race for them.
    pub deliveries: Vec<Uuid>,
}

impl Plan {
    /// `messages` ids from `seed`; a message is delivered twice when its index modulo 100
    /// is below `duplicate_percent`, and fails once when its index times 7 modulo 100 is
    /// below `failure_percent` (a bijection of the residues, so some failing messages are
    /// duplicated too). Exact percentages per 100 messages, deterministic order.
    pub fn new(
        messages: usize,
        duplicate_percent: usize,
        failure_percent: usize,
        seed: u64,
    ) -> Self {
        let mut rng = XorShift::new(seed);
        let ids: Vec<Uuid> = (0..messages)
            .map(|_| uuid::Builder::from_random_bytes(rng.bytes16()).into_uuid())
            .collect();
        let duplicated: HashSet<Uuid> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 100 < duplicate_percent)
            .map(|(_, id)| *id)
            .collect();
        let failing: HashSet<Uuid> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| (i * 7) % 100 < failure_percent)
            .map(|(_, id)| *id)
            .collect();
        // Positions: the original at 32 i, its duplicate 1 to 16 messages later.
        let mut keyed: Vec<(u64, Uuid)> = Vec::with_capacity(messages + duplicated.len());
        for (i, id) in ids.iter().enumerate() {
            keyed.push((i as u64 * 32, *id));
            if duplicated.contains(id) {
                keyed.push(((i as u64 + 1 + rng.next_u64() % 16) * 32 + 16, *id));
            }
        }
        keyed.sort_by_key(|(key, _)| *key);
        let deliveries = keyed.into_iter().map(|(_, id)| id).collect();
        Self {
            ids,
            duplicated,
            failing,
            deliveries,
        }
    }

    /// The plan of a run that published only the first `deliveries` deliveries: the
    /// messages they carry, and the failures among those. A duplicate whose second copy
    /// was not published is delivered once.
    pub fn truncated(&self, deliveries: usize) -> Self {
        let deliveries: Vec<Uuid> = self.deliveries.iter().take(deliveries).copied().collect();
        let published: HashSet<Uuid> = deliveries.iter().copied().collect();
        let keep = |set: &HashSet<Uuid>| set.intersection(&published).copied().collect();
        Self {
            ids: self
                .ids
                .iter()
                .filter(|id| published.contains(id))
                .copied()
                .collect(),
            duplicated: keep(&self.duplicated),
            failing: keep(&self.failing),
            deliveries,
        }
    }
}

/// A seeded xorshift64: reproducible runs without a dependency.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn bytes16(&mut self) -> [u8; 16] {
        let mut out = [0; 16];
        out[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        out[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        out
    }
}

/// An in-memory broker with at-least-once delivery and nack-to-requeue.
pub struct Broker {
    state: Mutex<BrokerState>,
}

#[derive(Default)]
struct BrokerState {
    /// No more deliveries will be published: once the queue is empty and nothing is in
    /// flight, the stream has ended.
    closed: bool,
    queue: VecDeque<Uuid>,
    in_flight: usize,
    deliveries: u64,
    acks: u64,
    nacks: u64,
    acked: HashSet<Uuid>,
}

/// What the broker saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BrokerStats {
    pub deliveries: u64,
    pub acks: u64,
    pub nacks: u64,
    pub acked_messages: u64,
    pub pending: u64,
}

impl Broker {
    /// A broker holding every delivery of a run from the start.
    pub fn new(deliveries: &[Uuid]) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(BrokerState {
                closed: true,
                queue: deliveries.iter().copied().collect(),
                ..BrokerState::default()
            }),
        })
    }

    /// A broker whose deliveries arrive later ([`Broker::publish`]): the replicas wait
    /// for more until [`Broker::close`], so a test can keep traffic flowing for as long
    /// as something it waits for takes.
    pub fn open() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(BrokerState::default()),
        })
    }

    /// Appends deliveries to the queue of an open broker.
    pub fn publish(&self, deliveries: &[Uuid]) {
        let mut state = self.lock();
        assert!(!state.closed, "publish after close");
        state.queue.extend(deliveries.iter().copied());
    }

    /// Publishes nothing more: the stream ends once every delivery is settled.
    pub fn close(&self) {
        self.lock().closed = true;
    }

    fn lock(&self) -> MutexGuard<'_, BrokerState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next delivery, waiting while others are in flight (they may be nacked back) or
    /// while the broker is open; `None` once it is closed and everything is settled.
    pub async fn next(&self) -> Option<Uuid> {
        loop {
            {
                let mut state = self.lock();
                if let Some(id) = state.queue.pop_front() {
                    state.in_flight += 1;
                    state.deliveries += 1;
                    return Some(id);
                }
                if state.in_flight == 0 && state.closed {
                    return None;
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Acks or nacks (requeues) a delivery.
    pub fn settle(&self, id: Uuid, settlement: Settlement) {
        let mut state = self.lock();
        state.in_flight -= 1;
        match settlement {
            Settlement::Ack => {
                state.acks += 1;
                state.acked.insert(id);
            }
            Settlement::Nack(_) => {
                state.nacks += 1;
                state.queue.push_back(id);
            }
            Settlement::DeadLetter => panic!(
                "{id} was dead-lettered, but the stream gives no send times: nothing should be refused"
            ),
        }
    }

    /// Waits until `acks` deliveries are acked, failing the test after `timeout`.
    pub async fn wait_for_acks(&self, acks: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.stats().acks < acks {
            assert!(
                Instant::now() < deadline,
                "the run never got going: {:?}",
                self.stats()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub fn stats(&self) -> BrokerStats {
        let state = self.lock();
        BrokerStats {
            deliveries: state.deliveries,
            acks: state.acks,
            nacks: state.nacks,
            acked_messages: state.acked.len() as u64,
            pending: (state.queue.len() + state.in_flight) as u64,
        }
    }
}

/// Why a handler failed.
#[derive(Debug)]
pub enum HandlerError {
    /// The plan's injected failure.
    Injected,
    /// A database error inside the handler (e.g. its connection dropped).
    Db(DbErr),
}

impl From<DbErr> for HandlerError {
    fn from(err: DbErr) -> Self {
        HandlerError::Db(err)
    }
}

/// How every delivery of a run ended, summed over the replicas.
#[derive(Debug, Default)]
pub struct Tally {
    pub processed: AtomicU64,
    pub duplicates: AtomicU64,
    pub injected_failures: AtomicU64,
    pub handler_db_errors: AtomicU64,
    pub retries_exhausted: AtomicU64,
    pub inbox_errors: AtomicU64,
    pub transient_retries: AtomicU64,
}

/// The counts a run prints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub messages: u64,
    pub broker: BrokerStats,
    pub processed: u64,
    pub duplicates: u64,
    pub injected_failures: u64,
    pub handler_db_errors: u64,
    pub retries_exhausted: u64,
    pub inbox_errors: u64,
    pub transient_retries: u64,
    pub duration: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "messages {}, deliveries {} (acks {}, nacks {}), processed {}, duplicates {}, \
             handler failures {} injected + {} database, retries exhausted {}, inbox errors {}, \
             transient retries {}, duration {:.1?}",
            self.messages,
            self.broker.deliveries,
            self.broker.acks,
            self.broker.nacks,
            self.processed,
            self.duplicates,
            self.injected_failures,
            self.handler_db_errors,
            self.retries_exhausted,
            self.inbox_errors,
            self.transient_retries,
            self.duration,
        )
    }
}

/// The effects table: one row per application of a message's effect.
pub async fn create_effects(conn: &impl ConnectionTrait) {
    run(
        conn,
        "CREATE TABLE effect (message_id VARCHAR(36) NOT NULL, replica INT NOT NULL)",
    )
    .await;
}

async fn apply_effect(conn: &impl ConnectionTrait, id: Uuid, replica: usize) -> Result<(), DbErr> {
    conn.execute_raw(stmt(
        conn.get_database_backend(),
        "INSERT INTO effect (message_id, replica) VALUES (?, ?)",
        vec![id.to_string().into(), (replica as i32).into()],
    ))
    .await
    .map(|_| ())
}

/// Runs `replicas` replicas, each with a pool and an `Inbox` of its own, until the broker
/// has settled every delivery or `timeout` passes (which fails loudly).
///
/// Each inbox retries transient failures up to 10 attempts with backoff from 10 ms to 2 s:
/// patient enough to ride out most of a server restart, after which the broker's
/// redelivery takes over.
pub async fn run_replicas(
    db: &TestDb,
    broker: &Arc<Broker>,
    plan: &Plan,
    replicas: usize,
    timeout: Duration,
) -> Report {
    let mut pools = Vec::with_capacity(replicas);
    for _ in 0..replicas {
        pools.push(db.connect().await);
    }
    run_replicas_on(pools, broker, plan, timeout).await
}

/// [`run_replicas`] with one replica per given pool (e.g. one per cluster node).
pub async fn run_replicas_on(
    pools: Vec<DatabaseConnection>,
    broker: &Arc<Broker>,
    plan: &Plan,
    timeout: Duration,
) -> Report {
    let retry = RetryPolicy::default()
        .max_attempts(10)
        .backoff(Duration::from_millis(10), Duration::from_secs(2))
        .expect("a short backoff");
    let started = Instant::now();
    let tally = Arc::new(Tally::default());
    let failing = Arc::new(plan.failing.clone());
    let failed_once = Arc::new(Mutex::new(HashSet::new()));
    let mut tasks = Vec::new();
    for (replica, conn) in pools.into_iter().enumerate() {
        let inbox = Inbox::new(STREAM_CONSUMER)
            .expect("valid consumer")
            .with_retry(retry);
        let (broker, tally) = (Arc::clone(broker), Arc::clone(&tally));
        let (failing, failed_once) = (Arc::clone(&failing), Arc::clone(&failed_once));
        tasks.push(tokio::spawn(async move {
            while let Some(id) = broker.next().await {
                let result = inbox
                    .process(&conn, id, |txn| {
                        let (failing, failed_once) =
                            (Arc::clone(&failing), Arc::clone(&failed_once));
                        Box::pin(async move {
                            apply_effect(txn, id, replica).await?;
                            // Fails the first run that got this far, after the write, so
                            // the rollback has something to undo.
                            if failing.contains(&id)
                                && failed_once
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .insert(id)
                            {
                                return Err(HandlerError::Injected);
                            }
                            Ok(())
                        })
                    })
                    .await;
                tally_result(&tally, &result, id);
                broker.settle(id, Settlement::of(&result));
            }
            let retries = inbox.metrics().snapshot().transient_retries;
            tally
                .transient_retries
                .fetch_add(retries, Ordering::Relaxed);
            conn.close().await.ok();
        }));
    }
    let all = async {
        for task in tasks {
            task.await.expect("replica task");
        }
    };
    if tokio::time::timeout(timeout, all).await.is_err() {
        panic!(
            "the replicas did not settle every delivery within {timeout:?}: {:?}",
            broker.stats()
        );
    }
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    Report {
        messages: plan.ids.len() as u64,
        broker: broker.stats(),
        processed: load(&tally.processed),
        duplicates: load(&tally.duplicates),
        injected_failures: load(&tally.injected_failures),
        handler_db_errors: load(&tally.handler_db_errors),
        retries_exhausted: load(&tally.retries_exhausted),
        inbox_errors: load(&tally.inbox_errors),
        transient_retries: load(&tally.transient_retries),
        duration: started.elapsed(),
    }
}

fn tally_result(tally: &Tally, result: &Result<Outcome<()>, ProcessError<HandlerError>>, id: Uuid) {
    let counter = match result {
        Ok(Outcome::Processed(())) => &tally.processed,
        Ok(Outcome::Duplicate) => &tally.duplicates,
        Ok(Outcome::Refused(refusal)) => {
            eprintln!("refused {id}: {refusal}");
            &tally.inbox_errors
        }
        Err(ProcessError::Handler(HandlerError::Injected)) => &tally.injected_failures,
        Err(ProcessError::Handler(HandlerError::Db(err))) => {
            eprintln!("handler database error on {id}: {err}");
            &tally.handler_db_errors
        }
        Err(ProcessError::RetriesExhausted { .. }) => &tally.retries_exhausted,
        Err(err) => {
            eprintln!("inbox error on {id}: {err:?}");
            &tally.inbox_errors
        }
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The invariant: every message of the plan applied exactly once, one marker each, every
/// message acked, nothing left at the broker.
pub async fn assert_exactly_once(conn: &DatabaseConnection, plan: &Plan, report: &Report) {
    let messages = plan.ids.len() as i64;
    let effects = scalar_i64(conn, "SELECT COUNT(*) FROM effect").await;
    let distinct = scalar_i64(conn, "SELECT COUNT(DISTINCT message_id) FROM effect").await;
    let markers = scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await;
    assert_eq!(
        (effects, distinct, markers),
        (messages, messages, messages),
        "(effects, distinct messages with an effect, markers) for {messages} messages: {report}"
    );
    // A commit whose reply was lost is retried and meets its own marker: Duplicate.
    assert!(report.processed <= messages as u64, "{report}");
    assert_eq!(
        report.broker.acked_messages, messages as u64,
        "zero lost: {report}"
    );
    assert_eq!(report.broker.pending, 0, "{report}");
    assert_eq!(
        report.broker.acks + report.broker.nacks,
        report.broker.deliveries,
        "every delivery settled once: {report}"
    );
    assert_eq!(
        report.processed + report.duplicates,
        report.broker.acks,
        "acks are exactly the Processed and Duplicate outcomes: {report}"
    );
    assert_eq!(
        report.injected_failures,
        plan.failing.len() as u64,
        "each planned failure happened once and was redelivered: {report}"
    );
}
