//! A SQLite-only application: claims one message twice in an in-memory database and
//! expects the second claim to be a duplicate (which needs the SQLite classifier, the only
//! one compiled in).

use sea_orm::{Database, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_migration::MigratorTrait;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = Database::connect("sqlite::memory:").await?;
    sea_orm_inbox_migration::Migrator::up(&db, None).await?;
    let id = uuid::Uuid::new_v4();
    let mut claims = Vec::new();
    for _ in 0..2 {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
        match txn.claim_message(id, "sqlite-only").await? {
            Claim::Claimed(claimed) => {
                claimed.commit(txn).await?;
                claims.push("Claimed");
            }
            Claim::Duplicate => {
                txn.rollback().await?;
                claims.push("Duplicate");
            }
            Claim::Refused(_) => {
                txn.rollback().await?;
                claims.push("Refused");
            }
        }
    }
    println!("sqlite-only: claims {claims:?}");
    if claims != ["Claimed", "Duplicate"] {
        return Err("expected Claimed, then Duplicate".into());
    }
    Ok(())
}
