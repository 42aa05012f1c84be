//! The application's consumer. For now it feeds itself a few in-process messages, each
//! delivered twice as a broker redelivering it would, through `Inbox::process`, and checks
//! that every message was applied once. A broker adapter (lapin) replaces the in-process
//! source later; the handler and the settlement stay as they are.

use entity::ledger;
use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, Database, DatabaseTransaction, DbErr, EntityTrait,
    PaginatorTrait,
};
use sea_orm_inbox::{Inbox, Outcome, Settlement};
use std::process::ExitCode;
use uuid::Uuid;

/// The consumer name: the inbox key is (message id, consumer).
const CONSUMER: &str = "seaorm-app.ledger";
/// Distinct messages in the in-process stream; each is delivered twice.
const MESSAGES: usize = 5;

/// Runs the consumer against `DATABASE_URL`; a failed check is a failed exit.
pub fn main() -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("seaorm-app: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(summary) => {
            println!("seaorm-app: {summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("seaorm-app: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<String, Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let db = Database::connect(&url).await?;
    // As SeaORM's examples do: the application's own migrator, the inbox's among its
    // migrations, brings the schema up at start-up (a no-op after `sea-orm-cli migrate up`).
    use migration::MigratorTrait;
    migration::Migrator::up(&db, None).await?;

    let inbox = Inbox::new(CONSUMER)?;
    let ids: Vec<Uuid> = (0..MESSAGES).map(|_| Uuid::new_v4()).collect();
    let (mut acks, mut processed, mut duplicates) = (0, 0, 0);
    for &message_id in ids.iter().chain(&ids) {
        let amount = 10;
        let result = inbox
            .process(&db, message_id, |txn| {
                Box::pin(credit(txn, message_id, amount))
            })
            .await;
        match &result {
            Ok(Outcome::Processed(())) => processed += 1,
            Ok(Outcome::Duplicate) => duplicates += 1,
            other => return Err(format!("message {message_id}: {other:?}").into()),
        }
        if Settlement::of(&result) == Settlement::Ack {
            acks += 1;
        }
    }
    let rows = ledger::Entity::find().count(&db).await?;
    db.close().await?;
    if (processed, duplicates, rows) != (MESSAGES, MESSAGES, MESSAGES as u64) {
        return Err(format!(
            "expected {MESSAGES} processed, {MESSAGES} duplicates and {MESSAGES} ledger rows; \
             got {processed}, {duplicates} and {rows}"
        )
        .into());
    }
    Ok(format!(
        "{} deliveries, {acks} acked: {processed} processed, {duplicates} duplicates, {rows} ledger rows",
        2 * MESSAGES
    ))
}

/// The business write, through the inbox's transaction only.
async fn credit(txn: &DatabaseTransaction, message_id: Uuid, amount: i64) -> Result<(), DbErr> {
    ledger::ActiveModel {
        message_id: Set(message_id),
        amount: Set(amount),
        ..Default::default()
    }
    .insert(txn)
    .await
    .map(|_| ())
}
