//! A PostgreSQL-only application: claims one message twice in a database of its own on the
//! server at `INBOX_TEST_POSTGRES_URL`, and expects the second claim to be a duplicate
//! (which needs the PostgreSQL classifier, the only one compiled in).

use sea_orm::{ConnectionTrait, Database, TransactionTrait};
use sea_orm_inbox::prelude::*;
use sea_orm_migration::MigratorTrait;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let admin_url = std::env::var("INBOX_TEST_POSTGRES_URL")
        .map_err(|_| "set INBOX_TEST_POSTGRES_URL, e.g. postgres://postgres@127.0.0.1:5432/test")?;
    let name = format!("inbox_app_{}", uuid::Uuid::new_v4().simple());
    let admin = Database::connect(&admin_url).await?;
    admin
        .execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await?;
    let base = admin_url
        .rsplit_once('/')
        .map_or(admin_url.as_str(), |(base, _)| base);
    let db = Database::connect(format!("{base}/{name}")).await?;
    let outcome = claim_twice(&db).await;
    db.close().await?;
    admin
        .execute_unprepared(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await?;
    let (first, second) = outcome?;
    println!("postgres-only: first claim {first:?}, second claim {second:?}");
    if (first, second) != ("Claimed", "Duplicate") {
        return Err("expected Claimed, then Duplicate".into());
    }
    Ok(())
}

async fn claim_twice(
    db: &sea_orm::DatabaseConnection,
) -> Result<(&'static str, &'static str), Box<dyn std::error::Error>> {
    sea_orm_inbox_migration::Migrator::up(db, None).await?;
    let id = uuid::Uuid::new_v4();
    let mut claims = Vec::new();
    for _ in 0..2 {
        let txn = db.begin_with_options(CLAIM_TRANSACTION).await?;
        match txn.claim_message(id, "postgres-only").await? {
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
    Ok((claims[0], claims[1]))
}
