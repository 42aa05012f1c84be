//! Two replicas consume a stream in which every message is delivered twice, to both
//! replicas at once (a redelivery after a lost ack), first with the naive
//! check-then-insert handler, then with `claim_message`.
//!
//! ```text
//! cargo run --example quickstart                                  # SQLite file, no setup
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example quickstart
//! DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --example quickstart
//! ```

use inbox_examples::{balance, connect_replica, credit_account, database_url, reset_account};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const MESSAGES: usize = 100;
const WORKERS_PER_REPLICA: usize = 4;
/// The handler's own work between reading and writing (a call, a computation).
const WORK: Duration = Duration::from_millis(5);

/// The racy handler many codebases start with: look for a marker, then do the work.
/// Both replicas can see "no marker" before either writes one.
async fn naive_handler(db: &DatabaseConnection, id: Uuid) -> Result<(), BoxError> {
    let seen = Query::select()
        .expr(Expr::val(1))
        .from(Alias::new("demo_naive_marker"))
        .and_where(Expr::col(Alias::new("message_id")).eq(id.to_string()))
        .to_owned();
    if db.query_one(&seen).await?.is_some() {
        return Ok(()); // "already processed"
    }
    tokio::time::sleep(WORK).await;
    let txn = db.begin().await?;
    credit_account(&txn, 1).await?;
    let mark = Query::insert()
        .into_table(Alias::new("demo_naive_marker"))
        .columns([Alias::new("message_id")])
        .values_panic([id.to_string().into()])
        .to_owned();
    txn.execute(&mark).await?;
    txn.commit().await?;
    Ok(())
}

/// The same handler with the inbox: claim first, in the transaction that does the work.
async fn inbox_handler(db: &DatabaseConnection, id: Uuid) -> Result<(), BoxError> {
    let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
    match txn.claim_message(id, "demo.credit").await? {
        Claim::Claimed(claimed) => {
            tokio::time::sleep(WORK).await;
            credit_account(&txn, 1).await?;
            claimed.commit(txn).await?; // proves the marker is still held, then commits
        }
        Claim::Duplicate => txn.rollback().await?, // already done: ack and move on
        // Only a `Delivery` with a send time and an admission floor is refused.
        Claim::Refused(_) => txn.rollback().await?, // dead-letter it
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Handler {
    Naive,
    Inbox,
}

/// Runs both replicas over the same stream; each replica has its own pool and workers.
async fn consume(
    replicas: &[Arc<DatabaseConnection>],
    ids: &[Uuid],
    handler: Handler,
) -> Result<(), BoxError> {
    let mut workers = tokio::task::JoinSet::new();
    for replica in replicas {
        let queue = Arc::new(Mutex::new(ids.iter().copied().collect::<VecDeque<_>>()));
        for _ in 0..WORKERS_PER_REPLICA {
            let (replica, queue) = (Arc::clone(replica), Arc::clone(&queue));
            workers.spawn(async move {
                loop {
                    let Some(id) = queue.lock().await.pop_front() else {
                        return Ok::<(), BoxError>(());
                    };
                    match handler {
                        Handler::Naive => naive_handler(&replica, id).await?,
                        Handler::Inbox => inbox_handler(&replica, id).await?,
                    }
                }
            });
        }
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    Ok(())
}

async fn count(db: &DatabaseConnection, table: &str) -> Result<i64, DbErr> {
    let query = Query::select()
        .expr(Expr::col(sea_orm::sea_query::Asterisk).count())
        .from(Alias::new(table))
        .to_owned();
    let row = db
        .query_one(&query)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound(table.into()))?;
    row.try_get_by_index(0)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = database_url();
    let setup = connect_replica(&url).await?;
    Migrator::up(&setup, None).await?;
    setup
        .execute_unprepared("DROP TABLE IF EXISTS demo_naive_marker")
        .await?;
    setup
        .execute_unprepared("CREATE TABLE demo_naive_marker (message_id CHAR(36) NOT NULL)")
        .await?;
    let replicas = [
        Arc::new(connect_replica(&url).await?),
        Arc::new(connect_replica(&url).await?),
    ];
    let ids: Vec<Uuid> = (0..MESSAGES).map(|_| Uuid::new_v4()).collect();

    println!("database: {url}");
    println!(
        "stream: {MESSAGES} messages, each delivered to both replicas at once ({} deliveries)\n",
        MESSAGES * replicas.len()
    );

    reset_account(&setup).await?;
    consume(&replicas, &ids, Handler::Naive).await?;
    let naive_balance = balance(&setup).await?;
    println!(
        "naive check-then-insert: balance {naive_balance} for {MESSAGES} messages, {} markers -> {} messages applied twice",
        count(&setup, "demo_naive_marker").await?,
        naive_balance - MESSAGES as i64
    );

    reset_account(&setup).await?;
    let markers_before = count(&setup, "inbox").await?;
    consume(&replicas, &ids, Handler::Inbox).await?;
    let inbox_balance = balance(&setup).await?;
    let markers = count(&setup, "inbox").await? - markers_before;
    println!(
        "txn.claim_message:       balance {inbox_balance} for {MESSAGES} messages, {markers} markers -> exactly once"
    );

    if inbox_balance != MESSAGES as i64 || markers != MESSAGES as i64 {
        return Err(
            format!("the inbox applied {inbox_balance} credits for {MESSAGES} messages").into(),
        );
    }
    Ok(())
}
