//! One transaction of each benchmark mode. Every mode does the same business write
//! (credit the worker's own account) and differs only in how the message is claimed.

use crate::BoxError;
use crate::db::{CONSUMER, Sql, timestamp};
use chrono::Utc;
use sea_orm::sqlx;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, Statement,
    TransactionTrait, Value,
};
use sea_orm_inbox::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use uuid::Uuid;

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
    /// Through `txn.claim_message`.
    Claim,
    /// Through the high-level `Inbox::process`.
    Process,
    /// The marker INSERT inside a SAVEPOINT (a nested SeaORM transaction).
    Savepoint,
    /// The marker INSERT with ON CONFLICT DO NOTHING (MySQL: ON DUPLICATE KEY UPDATE).
    OnConflict,
    /// `claim_message` of an already processed message, then the rollback.
    Duplicate,
    /// `txn.claim_batch` of fresh ids, counted per id.
    Batch,
    /// The ON CONFLICT marker of an already processed message, then the rollback: what
    /// the duplicate path would cost if the claim skipped conflicts instead of failing.
    DuplicateOnConflict,
}

impl Mode {
    /// Every mode of the main phase.
    pub const ALL: [Mode; 10] = [
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
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Base => "base",
            Mode::Raw => "raw",
            Mode::Sqlx => "sqlx",
            Mode::Claim => "claim",
            Mode::Process => "process",
            Mode::Savepoint => "savepoint",
            Mode::OnConflict => "on_conflict",
            Mode::Duplicate => "duplicate",
            Mode::DuplicateOnConflict => "dup_on_conflict",
            Mode::Batch => "batch",
        }
    }
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
    const CLAIMED_ONE: Done = Done {
        messages: 1,
        claimed: 1,
        credited: 1,
        duplicates: 0,
    };
    const DUPLICATE: Done = Done {
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
    inbox: Inbox,
    /// Messages this worker already processed, replayed by `duplicate`.
    processed: Vec<Uuid>,
    next_processed: AtomicUsize,
}

impl Worker {
    /// A worker whose `duplicate` mode replays `processed`, which must be claimed and
    /// committed already.
    pub fn new(
        db: DatabaseConnection,
        account: i64,
        sql: &'static Sql,
        processed: Vec<Uuid>,
    ) -> Result<Self, BoxError> {
        Ok(Self {
            db,
            account,
            sql,
            inbox: Inbox::new(CONSUMER)?,
            processed,
            next_processed: AtomicUsize::new(0),
        })
    }

    fn backend(&self) -> DbBackend {
        self.db.get_database_backend()
    }

    /// Runs one transaction of `mode`.
    pub async fn run(&self, mode: Mode) -> Result<Done, BoxError> {
        match mode {
            Mode::Base => self.base().await,
            Mode::Raw => self.raw().await,
            Mode::Sqlx => self.sqlx().await,
            Mode::Claim => self.claim().await,
            Mode::Process => self.process().await,
            Mode::Savepoint => self.savepoint().await,
            Mode::OnConflict => self.on_conflict().await,
            Mode::Duplicate => self.duplicate().await,
            Mode::DuplicateOnConflict => self.duplicate_on_conflict().await,
            Mode::Batch => self.batch().await,
        }
    }

    /// Every mode begins the same way: IMMEDIATE on SQLite, so concurrent claimers wait
    /// for the write lock instead of failing; a plain BEGIN elsewhere.
    async fn begin(&self) -> Result<DatabaseTransaction, BoxError> {
        Ok(self.db.begin_with_options(CLAIM_TRANSACTION).await?)
    }

    async fn credit(&self, txn: &DatabaseTransaction, amount: i64) -> Result<(), BoxError> {
        credit(txn, self.sql, self.account, amount).await?;
        Ok(())
    }

    /// The marker INSERT by hand: `sql` with the id, the consumer and the time bound.
    fn marker(&self, sql: &'static str, id: Uuid) -> Statement {
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
        txn.execute_raw(self.marker(self.sql.marker, Uuid::new_v4()))
            .await?;
        self.credit(&txn, 1).await?;
        txn.commit().await?;
        Ok(Done::CLAIMED_ONE)
    }

    async fn claim(&self) -> Result<Done, BoxError> {
        let txn = self.begin().await?;
        match txn.claim_message(Uuid::new_v4(), CONSUMER).await? {
            Claim::Claimed => {
                self.credit(&txn, 1).await?;
                txn.commit().await?;
                Ok(Done::CLAIMED_ONE)
            }
            Claim::Duplicate => Err("a fresh message id was reported as a duplicate".into()),
        }
    }

    async fn process(&self) -> Result<Done, BoxError> {
        let (sql, account) = (self.sql, self.account);
        let outcome = self
            .inbox
            .process(&self.db, Uuid::new_v4(), |txn| {
                Box::pin(async move { credit(txn, sql, account, 1).await })
            })
            .await?;
        match outcome {
            Outcome::Processed(()) => Ok(Done::CLAIMED_ONE),
            Outcome::Duplicate => Err("a fresh message id was reported as a duplicate".into()),
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
        txn: &DatabaseTransaction,
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
        let txn = self.begin().await?;
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
            Claim::Claimed => Err("a processed message was claimed again".into()),
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
async fn credit(
    txn: &DatabaseTransaction,
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
