//! The fault-injection harness of the real-broker tests (`tests/brokers.rs`): what gets
//! published, the handler's business write, the bookkeeping and the final verdict. The
//! broker halves ([`rabbitmq`], [`nats`]) only move deliveries and settle them through the
//! library's adapters (`sea_orm_inbox::rabbitmq`, `sea_orm_inbox::jetstream`).
//!
//! The story both tell: a publisher sends every message once and re-sends some of them
//! (a retry after a lost publish confirmation); two replicas, each with its own database
//! pool, consume with manual acks; one replica commits a few messages and dies before
//! acking them, so the broker redelivers them to the other; some handlers fail on their
//! first try and are nacked. Every delivery goes through [`Inbox::process`] and
//! [`Settlement::of`]. At the end each distinct message must have exactly one effect and
//! every published copy must have been acked.

pub mod nats;
pub mod rabbitmq;

use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
use sea_orm_inbox::prelude::*;
use std::collections::HashSet;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// The error type of the demos: any error, with its context in the message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inbox consumer name of the demo handler.
pub const CONSUMER: &str = "demo.ledger";

/// The business table: one row per applied message, tagged with the run.
const LEDGER: &str = "demo_ledger";

/// The brokers the scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broker {
    /// RabbitMQ, through `lapin` ([`rabbitmq`]).
    RabbitMq,
    /// NATS JetStream, through `async-nats` ([`nats`]).
    Nats,
}

impl Broker {
    /// Runs the scenario on this broker at `url`; `replicas` are the two replicas' own
    /// database pools (the first one dies). Check the result with [`Report::check`].
    pub async fn run(
        self,
        url: &str,
        replicas: [&DatabaseConnection; 2],
        plan: &Plan,
    ) -> Result<Report, BoxError> {
        match self {
            Broker::RabbitMq => rabbitmq::run(url, replicas, plan).await,
            Broker::Nats => nats::run(url, replicas, plan).await,
        }
    }
}

/// The shape of one run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Distinct messages (distinct message ids).
    pub messages: usize,
    /// Every n-th message is published a second time, right after the first.
    pub resend_every: usize,
    /// Every n-th message's handler fails on its first run, so it is nacked.
    pub fail_first_every: usize,
    /// The dying replica acks this many deliveries normally...
    pub acks_before_crash: usize,
    /// ...then commits this many without acking them, and dies.
    pub unacked_at_crash: usize,
    /// How long the whole run may take before it fails.
    pub deadline: Duration,
}

impl Default for Plan {
    fn default() -> Self {
        Self {
            messages: 100,
            resend_every: 4,
            fail_first_every: 10,
            acks_before_crash: 10,
            unacked_at_crash: 5,
            deadline: Duration::from_secs(60),
        }
    }
}

/// One published copy of a message. `attempt` tells the publisher's copies of one message
/// apart (0: the original, 1: the re-send); the demo's bookkeeping uses it to check that
/// every copy is acked. It is never the dedup key: that is `id`, which the producer sets
/// once and which every copy and every redelivery carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Publication {
    pub id: Uuid,
    pub attempt: u32,
}

impl Publication {
    /// The message body: the attempt number, as text.
    pub fn payload(&self) -> Vec<u8> {
        self.attempt.to_string().into_bytes()
    }

    /// The copy a delivery carries: the message id from the broker's metadata, the attempt
    /// from the body.
    pub fn read(id: &str, payload: &[u8]) -> Result<Self, BoxError> {
        let id = Uuid::parse_str(id).map_err(|e| format!("message id {id:?}: {e}"))?;
        let attempt = std::str::from_utf8(payload)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| format!("message {id}: the body is not an attempt number"))?;
        Ok(Self { id, attempt })
    }
}

/// Whether a replica acks what it processes, or is about to crash between commit and ack.
#[derive(Clone, Copy, Debug)]
pub struct Fate {
    acks_left: Option<usize>,
    unacked_left: usize,
}

impl Fate {
    /// A replica that stays up.
    pub fn healthy() -> Self {
        Self {
            acks_left: None,
            unacked_left: 0,
        }
    }

    /// The replica that dies, as the plan says.
    pub fn dying(plan: &Plan) -> Self {
        Self {
            acks_left: Some(plan.acks_before_crash),
            unacked_left: plan.unacked_at_crash.max(1),
        }
    }

    /// Called once per processed delivery: `true` to settle it with the broker, `false`
    /// when the replica is crashing and leaves it unacked.
    pub fn settles_next(&mut self) -> bool {
        match &mut self.acks_left {
            None => true,
            Some(0) => {
                self.unacked_left = self.unacked_left.saturating_sub(1);
                false
            }
            Some(left) => {
                *left -= 1;
                true
            }
        }
    }

    /// Whether the replica has begun crashing: it settles nothing from now on. A crashing
    /// replica that receives no further delivery must still die, or what it withheld is
    /// never redelivered (see [`CRASH_WHEN_IDLE`]).
    pub fn is_crashing(&self) -> bool {
        self.acks_left == Some(0)
    }

    /// Whether the replica has crashed: it must drop its connection now.
    pub fn is_dead(&self) -> bool {
        self.acks_left == Some(0) && self.unacked_left == 0
    }
}

/// How long a crashing replica waits for its next delivery before it dies with fewer
/// withheld deliveries than the plan asked for. A broker that redelivers only when the
/// connection goes away (RabbitMQ) sends nothing more to a replica that holds its whole
/// prefetch window unacked, or once the other replica has taken every other copy; waiting
/// for more would leave the withheld copies unacked for good.
pub const CRASH_WHEN_IDLE: Duration = Duration::from_millis(500);

/// The state of one run, shared by the publisher and both replicas.
pub struct Demo {
    /// The inbox every replica's handler goes through.
    pub inbox: Inbox,
    run_id: String,
    publications: Vec<Publication>,
    fail_once: Mutex<HashSet<Uuid>>,
    acked: Mutex<HashSet<Publication>>,
    deliveries: AtomicU64,
    redeliveries: AtomicU64,
    ack_calls: AtomicU64,
    nacks: AtomicU64,
    dead_letters: AtomicU64,
    withheld: AtomicU64,
    done: watch::Sender<bool>,
}

impl Demo {
    /// A new run: fresh message ids, and the demo's ledger table created if missing.
    pub async fn prepare(db: &DatabaseConnection, plan: &Plan) -> Result<Self, BoxError> {
        create_ledger(db)
            .await
            .map_err(|e| format!("create the demo_ledger table: {e}"))?;
        let ids: Vec<Uuid> = (0..plan.messages).map(|_| Uuid::new_v4()).collect();
        let every = |n: usize, i: usize| n > 0 && i % n == n - 1;
        let mut publications = Vec::new();
        for (i, id) in ids.iter().copied().enumerate() {
            publications.push(Publication { id, attempt: 0 });
            if every(plan.resend_every, i) {
                publications.push(Publication { id, attempt: 1 });
            }
        }
        let fail_once = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| every(plan.fail_first_every, *i))
            .map(|(_, id)| *id)
            .collect();
        Ok(Self {
            inbox: Inbox::new(CONSUMER)?,
            run_id: Uuid::new_v4().simple().to_string(),
            publications,
            fail_once: Mutex::new(fail_once),
            acked: Mutex::new(HashSet::new()),
            deliveries: AtomicU64::default(),
            redeliveries: AtomicU64::default(),
            ack_calls: AtomicU64::default(),
            nacks: AtomicU64::default(),
            dead_letters: AtomicU64::default(),
            withheld: AtomicU64::default(),
            done: watch::Sender::new(false),
        })
    }

    /// A short unique name for the run's broker objects (queues, streams), so runs can
    /// share a broker and leave nothing that a later run would trip over.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Every copy the publisher sends, in order.
    pub fn publications(&self) -> &[Publication] {
        &self.publications
    }

    /// Handles one delivery: counts it, then runs the business write through
    /// [`Inbox::process`]. The caller settles it with [`Settlement::of`] on the result.
    pub async fn handle(
        &self,
        db: &DatabaseConnection,
        copy: Publication,
        redelivered: bool,
    ) -> Result<Outcome<()>, ProcessError<DbErr>> {
        self.deliveries.fetch_add(1, Ordering::Relaxed);
        if redelivered {
            self.redeliveries.fetch_add(1, Ordering::Relaxed);
        }
        self.inbox
            .process(db, copy.id, |txn| {
                // The handler's future may borrow only the transaction, so it gets owned
                // copies of what it needs; this closure runs again on every retry.
                let fail = self.take_injected_failure(copy.id);
                Box::pin(record(txn, self.run_id.clone(), copy.id, fail))
            })
            .await
    }

    /// Whether the handler of `id` must fail this time (only the first run of the
    /// messages the plan picked), to exercise the nack path.
    fn take_injected_failure(&self, id: Uuid) -> bool {
        match self.fail_once.lock() {
            Ok(mut pending) => pending.remove(&id),
            Err(poisoned) => poisoned.into_inner().remove(&id),
        }
    }

    /// Records that the broker took the settlement of `copy`; the run is done once every
    /// published copy has been acked.
    pub fn settled(&self, copy: Publication, settlement: Settlement) {
        match settlement {
            Settlement::Nack(_) => {
                self.nacks.fetch_add(1, Ordering::Relaxed);
            }
            Settlement::DeadLetter => {
                self.dead_letters.fetch_add(1, Ordering::Relaxed);
            }
            Settlement::Ack => {
                self.ack_calls.fetch_add(1, Ordering::Relaxed);
                let all_acked = {
                    let mut acked = self.acked.lock().unwrap_or_else(|p| p.into_inner());
                    acked.insert(copy);
                    acked.len() == self.publications.len()
                };
                if all_acked {
                    self.done.send_replace(true);
                }
            }
        }
    }

    /// Records a delivery the dying replica committed but never acked.
    pub fn withheld(&self) {
        self.withheld.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether every published copy has been acked.
    pub fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// Resolves once every published copy has been acked.
    pub async fn finished(&self) {
        // The sender lives in `self`, so the wait cannot fail for a closed channel.
        let _ = self.done.subscribe().wait_for(|done| *done).await;
    }

    /// Runs the publisher and the replicas (`work`) within the plan's deadline; past it,
    /// fails with the progress so far.
    pub async fn within_deadline<T>(
        &self,
        plan: &Plan,
        work: impl Future<Output = Result<T, BoxError>>,
    ) -> Result<T, BoxError> {
        match tokio::time::timeout(plan.deadline, work).await {
            Ok(result) => result,
            Err(_) => Err(self.overran(plan)),
        }
    }

    fn overran(&self, plan: &Plan) -> BoxError {
        let acked = self.acked.lock().map(|a| a.len()).unwrap_or_default();
        format!(
            "the run did not finish within {:?}: {acked} of {} published copies acked, {} deliveries",
            plan.deadline,
            self.publications.len(),
            self.deliveries.load(Ordering::Relaxed)
        )
        .into()
    }

    /// The counts of the run, read back from the database; `broker_pending` is what the
    /// broker still holds for the run (ready or unacked messages).
    pub async fn report(
        &self,
        db: &DatabaseConnection,
        broker_pending: u64,
    ) -> Result<Report, BoxError> {
        let metrics = self.inbox.metrics().snapshot();
        let distinct: HashSet<Uuid> = self.publications.iter().map(|p| p.id).collect();
        let (effects, distinct_effects) = ledger_counts(db, &self.run_id)
            .await
            .map_err(|e| format!("count the demo_ledger rows: {e}"))?;
        Ok(Report {
            messages: distinct.len() as u64,
            published: self.publications.len() as u64,
            deliveries: self.deliveries.load(Ordering::Relaxed),
            redeliveries: self.redeliveries.load(Ordering::Relaxed),
            processed: metrics.processed,
            duplicates: metrics.duplicates,
            handler_errors: metrics.handler_errors,
            nacks: self.nacks.load(Ordering::Relaxed),
            dead_letters: self.dead_letters.load(Ordering::Relaxed),
            acked_copies: self.acked.lock().map(|a| a.len()).unwrap_or_default() as u64,
            ack_calls: self.ack_calls.load(Ordering::Relaxed),
            withheld: self.withheld.load(Ordering::Relaxed),
            effects,
            distinct_effects,
            broker_pending,
        })
    }
}

/// What a run did, and the verdict in [`Report::check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report {
    /// Distinct messages published.
    pub messages: u64,
    /// Copies published (messages plus publisher re-sends).
    pub published: u64,
    /// Deliveries the replicas handled.
    pub deliveries: u64,
    /// Of those, deliveries the broker marked as redelivered.
    pub redeliveries: u64,
    /// Deliveries whose handler ran and committed (`Outcome::Processed`).
    pub processed: u64,
    /// Deliveries found already processed (`Outcome::Duplicate`).
    pub duplicates: u64,
    /// Handler failures (rolled back).
    pub handler_errors: u64,
    /// Deliveries nacked back to the broker.
    pub nacks: u64,
    /// Deliveries dead-lettered (`Outcome::Refused`: none, as the demo's inbox has no
    /// admission floor).
    pub dead_letters: u64,
    /// Distinct published copies acked.
    pub acked_copies: u64,
    /// Acks sent (a copy the broker redelivered while its first delivery was still being
    /// handled can be acked twice).
    pub ack_calls: u64,
    /// Deliveries the dying replica committed and never acked.
    pub withheld: u64,
    /// Business effects: ledger rows of this run.
    pub effects: u64,
    /// Distinct messages among the ledger rows.
    pub distinct_effects: u64,
    /// Messages the broker still holds for the run after it ended.
    pub broker_pending: u64,
}

impl Report {
    /// Exactly one effect per distinct message, and every copy acked and gone from the
    /// broker.
    pub fn check(&self) -> Result<(), BoxError> {
        let mut failures = Vec::new();
        if self.effects != self.messages || self.distinct_effects != self.messages {
            failures.push(format!(
                "{} effects ({} distinct) for {} messages",
                self.effects, self.distinct_effects, self.messages
            ));
        }
        if self.processed != self.messages {
            failures.push(format!(
                "{} processed for {} messages",
                self.processed, self.messages
            ));
        }
        if self.dead_letters != 0 {
            failures.push(format!("{} copies dead-lettered", self.dead_letters));
        }
        if self.acked_copies != self.published {
            failures.push(format!(
                "{} of {} published copies acked",
                self.acked_copies, self.published
            ));
        }
        if self.broker_pending != 0 {
            failures.push(format!(
                "the broker still holds {} messages",
                self.broker_pending
            ));
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(format!("exactly-once check failed: {}", failures.join("; ")).into())
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "messages    {} distinct, {} published ({} publisher re-sends)",
            self.messages,
            self.published,
            self.published - self.messages
        )?;
        writeln!(
            f,
            "deliveries  {} ({} marked redelivered by the broker)",
            self.deliveries, self.redeliveries
        )?;
        writeln!(
            f,
            "processed   {}, duplicates {}, handler failures {} ({} nacked), {} dead-lettered",
            self.processed, self.duplicates, self.handler_errors, self.nacks, self.dead_letters
        )?;
        writeln!(
            f,
            "acked       {} of {} copies ({} acks sent); {} committed but left unacked by the replica that died",
            self.acked_copies, self.published, self.ack_calls, self.withheld
        )?;
        write!(
            f,
            "effects     {} ledger rows for {} distinct messages; {} left on the broker",
            self.effects, self.messages, self.broker_pending
        )
    }
}

/// The business write: one ledger row per message, through the transaction. `fail` makes
/// it fail instead, to exercise the nack path.
async fn record(
    txn: &impl ConnectionTrait,
    run_id: String,
    id: Uuid,
    fail: bool,
) -> Result<(), DbErr> {
    if fail {
        return Err(DbErr::Custom(format!(
            "injected failure on the first run of {id}"
        )));
    }
    let insert = Query::insert()
        .into_table(Alias::new(LEDGER))
        .columns([Alias::new("run_id"), Alias::new("message_id")])
        .values_panic([run_id.into(), id.to_string().into()])
        .to_owned();
    txn.execute(&insert).await.map(|_| ())
}

async fn create_ledger(db: &DatabaseConnection) -> Result<(), DbErr> {
    // No key on purpose: a second row for a message must be possible, so that applying a
    // message twice shows up in the counts instead of failing on a constraint.
    db.execute_unprepared(
        "CREATE TABLE IF NOT EXISTS demo_ledger (run_id VARCHAR(32) NOT NULL, message_id VARCHAR(36) NOT NULL)",
    )
    .await
    .map(|_| ())
}

async fn ledger_counts(db: &DatabaseConnection, run_id: &str) -> Result<(u64, u64), DbErr> {
    let message_id = Alias::new("message_id");
    let query = Query::select()
        .expr(Expr::col(message_id.clone()).count())
        .expr(Expr::col(message_id).count_distinct())
        .from(Alias::new(LEDGER))
        .and_where(Expr::col(Alias::new("run_id")).eq(run_id))
        .to_owned();
    let row = db
        .query_one(&query)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("demo_ledger counts".into()))?;
    let rows: i64 = row.try_get_by_index(0)?;
    let distinct: i64 = row.try_get_by_index(1)?;
    Ok((
        u64::try_from(rows).unwrap_or_default(),
        u64::try_from(distinct).unwrap_or_default(),
    ))
}
