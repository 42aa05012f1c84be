//! One transaction of each benchmark mode. Every mode does the same business write
//! (credit the worker's own account) and differs only in how the message is claimed.

use crate::BoxError;
use crate::db::{CONSUMER, Sql, timestamp};
use crate::peers::{Handled, Mixer};
use chrono::Utc;
use sea_orm::sqlx;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, Statement,
    TransactionTrait, Value,
};
use sea_orm_inbox::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use uuid::Uuid;

/// Whether `raw`, `claim` and the delivering modes take time-ordered message ids (the
/// layout of UUIDv7: milliseconds since the epoch first) instead of random ones (v4). The
/// cost curve flips it between its measurements; every other run leaves it off.
pub static TIME_ORDERED_IDS: AtomicBool = AtomicBool::new(false);

/// A fresh message id in the layout [`TIME_ORDERED_IDS`] says.
pub fn fresh_id() -> Uuid {
    let random = Uuid::new_v4();
    if !TIME_ORDERED_IDS.load(Ordering::Relaxed) {
        return random;
    }
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        });
    let mut tail = [0_u8; 10];
    tail.copy_from_slice(&random.as_bytes()[..10]);
    uuid::Builder::from_unix_timestamp_millis(millis, &tail).into_uuid()
}

/// What the benchmark measures, in the order the table prints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// The business transaction alone, through SeaORM.
    Base,
    /// Plus the marker INSERT written by hand, through the same SeaORM transaction: the
    /// floor the targets compare against.
    Raw,
    /// `raw` in plain sqlx, without SeaORM: shows SeaORM's own cost, not ours.
    Sqlx,
    /// Through `txn.claim_message` on an `ObservedTransaction::begin_on`, committed with
    /// `ClaimedMessage::commit` (which proves the marker is still held before COMMIT
    /// only when a statement failed).
    Claim,
    /// `claim_message` on a plain transaction (its savepoint), then a plain
    /// `txn.commit()` without the proof: counted by `--instructions` only.
    ClaimUnchecked,
    /// Through the high-level `Inbox::process`.
    Process,
    /// The marker INSERT inside a SAVEPOINT (a nested SeaORM transaction).
    Savepoint,
    /// The marker INSERT with ON CONFLICT DO NOTHING (MySQL: ON DUPLICATE KEY UPDATE).
    OnConflict,
    /// `claim_message` of an already processed message, then the rollback.
    Duplicate,
    /// `txn.claim_batch` of fresh ids on an `ObservedTransaction::begin_on`, counted per
    /// id.
    Batch,
    /// The ON CONFLICT marker of an already processed message, then the rollback: what
    /// the duplicate path would cost if the claim skipped conflicts instead of failing.
    DuplicateOnConflict,
    /// The best hand-written multi-row marker INSERT (ON CONFLICT DO NOTHING RETURNING)
    /// of the same fresh ids as `batch`: the batch's floor.
    BatchRaw,
    /// MassTransit's EF Core inbox, by hand: lock-insert-commit, then lock, count the
    /// receive, do the work, mark consumed, commit.
    MassTransit,
    /// NServiceBus's optimistic outbox, by hand: look up, do the work, insert the record
    /// at the end of the same transaction.
    NServiceBus,
    /// Wolverine's durable inbox, by hand: persist the envelope and commit, then do the
    /// work and mark it handled in a second transaction.
    Wolverine,
    /// The seed article's EF Core shape: the work first, the marker added at the end of
    /// the same transaction.
    Seed,
}

impl Mode {
    /// Every mode of the main phase.
    pub const ALL: [Mode; 15] = [
        Mode::Base,
        Mode::Raw,
        Mode::Sqlx,
        Mode::Claim,
        Mode::Process,
        Mode::Savepoint,
        Mode::OnConflict,
        Mode::Duplicate,
        Mode::DuplicateOnConflict,
        Mode::Batch,
        Mode::BatchRaw,
        Mode::MassTransit,
        Mode::NServiceBus,
        Mode::Wolverine,
        Mode::Seed,
    ];

    /// The peers' protocols, written by hand over the same schema and business write.
    pub const PEERS: [Mode; 4] = [
        Mode::MassTransit,
        Mode::NServiceBus,
        Mode::Wolverine,
        Mode::Seed,
    ];

    /// The modes of the duplicate-heavy mix: ours, then the peers'.
    pub const MIX: [Mode; 5] = [
        Mode::Process,
        Mode::MassTransit,
        Mode::NServiceBus,
        Mode::Wolverine,
        Mode::Seed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Base => "base",
            Mode::Raw => "raw",
            Mode::Sqlx => "sqlx",
            Mode::Claim => "claim",
            Mode::ClaimUnchecked => "claim_unchecked",
            Mode::Process => "process",
            Mode::Savepoint => "savepoint",
            Mode::OnConflict => "on_conflict",
            Mode::Duplicate => "duplicate",
            Mode::DuplicateOnConflict => "dup_on_conflict",
            Mode::Batch => "batch",
            Mode::BatchRaw => "batch_raw",
            Mode::MassTransit => "masstransit",
            Mode::NServiceBus => "nservicebus",
            Mode::Wolverine => "wolverine",
            Mode::Seed => "seed",
        }
    }

    /// Whether the protocol commits twice per message: MassTransit's and Wolverine's
    /// persist the message in a transaction of its own before the work.
    pub fn commits_twice(self) -> bool {
        matches!(self, Mode::MassTransit | Mode::Wolverine)
    }
}

/// Which message ids the delivering modes see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deliveries {
    /// A fresh id every time: a duplicate is a correctness failure.
    Fresh,
    /// The duplicate-heavy mix: 30 % of deliveries are duplicates, a third of them racing
    /// the original on another worker (see [`Mixer`]).
    Mixed,
}

/// Message ids per `batch` transaction.
pub const BATCH_IDS: usize = 100;

/// What one transaction did, for throughput and for the correctness check.
#[derive(Clone, Copy, Debug, Default)]
pub struct Done {
    /// Messages handled (claimed or found duplicate): the throughput unit.
    pub messages: u64,
    /// Markers this transaction committed.
    pub claimed: u64,
    /// Amount credited to the worker's account (committed).
    pub credited: i64,
    /// Messages recognised as already processed.
    pub duplicates: u64,
}

impl Done {
    const CREDIT_ONLY: Done = Done {
        messages: 1,
        claimed: 0,
        credited: 1,
        duplicates: 0,
    };
    pub(crate) const CLAIMED_ONE: Done = Done {
        messages: 1,
        claimed: 1,
        credited: 1,
        duplicates: 0,
    };
    pub(crate) const DUPLICATE: Done = Done {
        messages: 1,
        claimed: 0,
        credited: 0,
        duplicates: 1,
    };
}

/// One worker: its own single-connection pool (a replica) and its own account.
pub struct Worker {
    pub db: DatabaseConnection,
    pub account: i64,
    pub sql: &'static Sql,
    /// The worker's own `Inbox`, as each replica would configure one.
    pub(crate) inbox: Inbox,
    /// Messages this worker already processed, replayed by `duplicate`.
    processed: Vec<Uuid>,
    next_processed: AtomicUsize,
    /// The hand-written multi-row INSERT of `batch_raw`, built once.
    batch_insert: String,
    /// The duplicate-heavy mix, shared by all workers.
    pub(crate) mixer: Arc<Mixer>,
    /// Ids this worker applied in the current mix run, replayed as duplicates.
    pub(crate) applied: Mutex<Vec<Uuid>>,
}

impl Worker {
    /// A worker whose `duplicate` mode replays `processed`, which must be claimed and
    /// committed already.
    pub fn new(
        db: DatabaseConnection,
        account: i64,
        sql: &'static Sql,
        processed: Vec<Uuid>,
        mixer: Arc<Mixer>,
    ) -> Result<Self, BoxError> {
        let batch_insert = crate::db::batch_insert_sql(db.get_database_backend(), BATCH_IDS)?;
        Ok(Self {
            db,
            account,
            sql,
            inbox: Inbox::new(CONSUMER)?,
            processed,
            next_processed: AtomicUsize::new(0),
            batch_insert,
            mixer,
            applied: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn backend(&self) -> DbBackend {
        self.db.get_database_backend()
    }

    /// Runs one transaction of `mode` (one delivery, for the delivering modes).
    pub async fn run(&self, mode: Mode, deliveries: Deliveries) -> Result<Done, BoxError> {
        match mode {
            Mode::Base => self.base().await,
            Mode::Raw => self.raw().await,
            Mode::Sqlx => self.sqlx().await,
            Mode::Claim => self.claim(true).await,
            Mode::ClaimUnchecked => self.claim(false).await,
            Mode::Savepoint => self.savepoint().await,
            Mode::OnConflict => self.on_conflict().await,
            Mode::Duplicate => self.duplicate().await,
            Mode::DuplicateOnConflict => self.duplicate_on_conflict().await,
            Mode::Batch => self.batch().await,
            Mode::BatchRaw => self.batch_raw().await,
            Mode::Process
            | Mode::MassTransit
            | Mode::NServiceBus
            | Mode::Wolverine
            | Mode::Seed => self.deliver(mode, deliveries).await,
        }
    }

    /// One delivery of a message id chosen by `deliveries` through `mode`'s protocol.
    async fn deliver(&self, mode: Mode, deliveries: Deliveries) -> Result<Done, BoxError> {
        let id = match deliveries {
            Deliveries::Fresh => fresh_id(),
            Deliveries::Mixed => self.mixer.next_delivery(self)?,
        };
        let handled = match mode {
            Mode::Process => self.process(id).await?,
            Mode::MassTransit => self.masstransit(id).await?,
            Mode::NServiceBus => self.nservicebus(id).await?,
            Mode::Wolverine => self.wolverine(id).await?,
            Mode::Seed => self.seed(id).await?,
            other => return Err(format!("{} does not deliver messages", other.name()).into()),
        };
        match (handled, deliveries) {
            (Handled::Applied, Deliveries::Mixed) => {
                self.applied
                    .lock()
                    .map_err(|_| "a worker panicked holding the applied ids")?
                    .push(id);
                Ok(Done::CLAIMED_ONE)
            }
            (Handled::Applied, Deliveries::Fresh) => Ok(Done::CLAIMED_ONE),
            (Handled::Duplicate, Deliveries::Mixed) => Ok(Done::DUPLICATE),
            (Handled::Duplicate, Deliveries::Fresh) => Err(format!(
                "{}: a fresh message id was reported as a duplicate",
                mode.name()
            )
            .into()),
        }
    }

    /// Every mode begins the same way: IMMEDIATE on SQLite, so concurrent claimers wait
    /// for the write lock instead of failing; a plain BEGIN elsewhere.
    pub(crate) async fn begin(&self) -> Result<DatabaseTransaction, BoxError> {
        Ok(self.db.begin_with_options(CLAIM_TRANSACTION).await?)
    }

    /// The business write on this worker's account.
    pub(crate) async fn credit(
        &self,
        txn: &impl ConnectionTrait,
        amount: i64,
    ) -> Result<(), DbErr> {
        credit(txn, self.sql, self.account, amount).await
    }

    /// The marker INSERT by hand: `sql` with the id, the consumer and the time bound.
    pub(crate) fn marker(&self, sql: &'static str, id: Uuid) -> Statement {
        let backend = self.backend();
        Statement::from_sql_and_values(
            backend,
            sql,
            [
                Value::from(id),
                Value::from(CONSUMER),
                timestamp(backend, Utc::now()),
            ],
        )
    }

    async fn base(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        self.credit(&txn, 1).await?;
        txn.commit().await?;
        Ok(Done::CREDIT_ONLY)
    }

    async fn raw(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        txn.execute_raw(self.marker(self.sql.marker, fresh_id()))
            .await?;
        self.credit(&txn, 1).await?;
        txn.commit().await?;
        Ok(Done::CLAIMED_ONE)
    }

    /// A fresh id through `claim_message`: on an `ObservedTransaction` committed with
    /// `ClaimedMessage::commit` (`prove`; no proof query after a clean handler), or on a
    /// plain transaction committed with a plain `txn.commit()`, which `--instructions`
    /// counts to price the observed path.
    async fn claim(&self, prove: bool) -> Result<Done, BoxError> {
        if !prove {
            let txn = self.begin().await?;
            let unchecked = fresh(txn.claim_message(fresh_id(), CONSUMER).await?)?;
            self.credit(&txn, 1).await?;
            drop(unchecked);
            txn.commit().await?;
            return Ok(Done::CLAIMED_ONE);
        }
        let txn = ObservedTransaction::begin_on(&self.db).await?;
        let claimed = fresh(txn.claim_message(fresh_id(), CONSUMER).await?)?;
        self.credit(&txn, 1).await?;
        claimed.commit(txn).await?;
        Ok(Done::CLAIMED_ONE)
    }

    async fn process(&self, id: Uuid) -> Result<Handled, BoxError> {
        let (sql, account) = (self.sql, self.account);
        let outcome = self
            .inbox
            .process(&self.db, id, |txn| {
                Box::pin(async move { credit(txn, sql, account, 1).await })
            })
            .await?;
        match outcome {
            Outcome::Processed(()) => Ok(Handled::Applied),
            Outcome::Duplicate => Ok(Handled::Duplicate),
            Outcome::Refused(refusal) => Err(refused(refusal)),
        }
    }

    async fn savepoint(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        let savepoint = txn.begin().await?;
        savepoint
            .execute_raw(self.marker(self.sql.marker, Uuid::new_v4()))
            .await?;
        savepoint.commit().await?;
        self.credit(&txn, 1).await?;
        txn.commit().await?;
        Ok(Done::CLAIMED_ONE)
    }

    async fn on_conflict(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        if !self.insert_on_conflict(&txn, Uuid::new_v4()).await? {
            return Err("a fresh message id conflicted".into());
        }
        self.credit(&txn, 1).await?;
        txn.commit().await?;
        Ok(Done::CLAIMED_ONE)
    }

    /// The ON CONFLICT marker; whether it inserted a row.
    async fn insert_on_conflict(
        &self,
        txn: &impl ConnectionTrait,
        id: Uuid,
    ) -> Result<bool, BoxError> {
        let result = txn
            .execute_raw(self.marker(self.sql.marker_on_conflict, id))
            .await?;
        // MySQL counts found rows as affected (sqlx sets CLIENT_FOUND_ROWS): only the
        // insert id tells a new row from a skipped one there.
        Ok(match self.backend() {
            DbBackend::MySql => result.last_insert_id() != 0,
            _ => result.rows_affected() == 1,
        })
    }

    /// The next message this worker already processed.
    fn replay(&self) -> Result<Uuid, BoxError> {
        let next = self.next_processed.fetch_add(1, Ordering::Relaxed);
        let id = self
            .processed
            .get(next % self.processed.len().max(1))
            .ok_or("this worker has no processed messages to replay")?;
        Ok(*id)
    }

    /// One batch of fresh ids, and one credit for all the claimed ones: the set-based
    /// business write a Kafka-style batch handler does.
    async fn batch(&self) -> Result<Done, BoxError> {
        let ids: Vec<Uuid> = (0..BATCH_IDS).map(|_| Uuid::new_v4()).collect();
        let txn = ObservedTransaction::begin_on(&self.db).await?;
        let claim = txn.claim_batch(ids, CONSUMER).await?;
        if claim.claimed.len() != BATCH_IDS {
            return Err(format!(
                "{} of {BATCH_IDS} fresh ids were claimed",
                claim.claimed.len()
            )
            .into());
        }
        let claimed = i64::try_from(claim.claimed.len())?;
        self.credit(&txn, claimed).await?;
        claim.commit(txn).await?;
        Ok(Done {
            messages: BATCH_IDS as u64,
            claimed: BATCH_IDS as u64,
            credited: claimed,
            duplicates: 0,
        })
    }

    /// The same fresh ids as `batch`, claimed by the best hand-written statement: one
    /// multi-row INSERT ... ON CONFLICT DO NOTHING RETURNING (MariaDB: ON DUPLICATE KEY
    /// UPDATE consumer = consumer, tagged, since it returns conflicting rows too).
    async fn batch_raw(&self) -> Result<Done, BoxError> {
        let backend = self.backend();
        let now = timestamp(backend, Utc::now());
        let tag = Uuid::new_v4();
        let tagged = backend == DbBackend::MySql;
        let mut values = Vec::with_capacity(BATCH_IDS * 4);
        for _ in 0..BATCH_IDS {
            values.extend([
                Value::from(Uuid::new_v4()),
                Value::from(CONSUMER),
                now.clone(),
            ]);
            if tagged {
                values.push(Value::from(tag));
            }
        }
        let txn = self.begin().await?;
        let rows = txn
            .query_all_raw(Statement::from_sql_and_values(
                backend,
                self.batch_insert.as_str(),
                values,
            ))
            .await?;
        let mut claimed = 0_u64;
        for row in &rows {
            if !tagged || row.try_get_by_index::<Uuid>(1)? == tag {
                claimed += 1;
            }
        }
        if claimed != BATCH_IDS as u64 {
            return Err(format!("{claimed} of {BATCH_IDS} fresh ids were inserted").into());
        }
        let credited = i64::try_from(claimed)?;
        self.credit(&txn, credited).await?;
        txn.commit().await?;
        Ok(Done {
            messages: claimed,
            claimed,
            credited,
            duplicates: 0,
        })
    }

    async fn duplicate_on_conflict(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        if self.insert_on_conflict(&txn, self.replay()?).await? {
            return Err("a processed message was inserted again".into());
        }
        txn.rollback().await?;
        Ok(Done::DUPLICATE)
    }

    async fn duplicate(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        match txn.claim_message(self.replay()?, CONSUMER).await? {
            Claim::Duplicate => {
                txn.rollback().await?;
                Ok(Done::DUPLICATE)
            }
            Claim::Claimed(_) => Err("a processed message was claimed again".into()),
            Claim::Refused(refusal) => Err(refused(refusal)),
        }
    }

    /// `raw` in plain sqlx on the connection SeaORM opened: the same statements, with
    /// neither SeaORM's transaction wrapper nor its value conversion.
    async fn sqlx(&self) -> Result<Done, BoxError> {
        let id = Uuid::new_v4();
        let now = Utc::now();
        let (marker, credit, account) = (self.sql.marker, self.sql.credit, self.account);
        // One body for three driver types; only the BEGIN and the timestamp type differ.
        macro_rules! transaction {
            ($pool:expr, $begin:expr, $at:expr) => {{
                let mut tx = $pool.begin_with($begin).await?;
                sqlx::query(marker)
                    .bind(id)
                    .bind(CONSUMER)
                    .bind($at)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(credit)
                    .bind(1_i64)
                    .bind(account)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }};
        }
        match self.backend() {
            DbBackend::Postgres => {
                transaction!(self.db.get_postgres_connection_pool(), "BEGIN", now)
            }
            DbBackend::MySql => {
                transaction!(
                    self.db.get_mysql_connection_pool(),
                    "BEGIN",
                    now.naive_utc()
                )
            }
            DbBackend::Sqlite => {
                transaction!(self.db.get_sqlite_connection_pool(), "BEGIN IMMEDIATE", now)
            }
            other => return Err(format!("no sqlx mode for {other:?}").into()),
        }
        Ok(Done::CLAIMED_ONE)
    }
}

/// The business write of every mode: credit `account` by `amount` through `txn`.
pub(crate) async fn credit(
    txn: &impl ConnectionTrait,
    sql: &Sql,
    account: i64,
    amount: i64,
) -> Result<(), DbErr> {
    let statement = Statement::from_sql_and_values(
        txn.get_database_backend(),
        sql.credit,
        [Value::from(amount), Value::from(account)],
    );
    txn.execute_raw(statement).await.map(|_| ())
}

/// A refusal by the admission floor: the benchmark sets none, so the run fails.
/// The claim of a fresh id, which must be claimed.
fn fresh(claim: Claim) -> Result<ClaimedMessage, BoxError> {
    match claim {
        Claim::Claimed(claimed) => Ok(claimed),
        Claim::Duplicate => Err("a fresh message id was reported as a duplicate".into()),
        Claim::Refused(refusal) => Err(refused(refusal)),
    }
}

fn refused(refusal: impl std::fmt::Display) -> BoxError {
    format!("a delivery without a send time was refused: {refusal}").into()
}
