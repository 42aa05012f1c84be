//! Shared pieces of the runnable demos: connecting to the demo database and the toy
//! "account" the quickstart and the broker examples credit.

pub mod consumers;
pub mod metrics_demo;

use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbErr, Statement};
use std::time::Duration;

/// The database the demos use when `DATABASE_URL` is not set: a SQLite file in the
/// current directory, created on first use.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://inbox-demo.sqlite?mode=rwc";

/// `DATABASE_URL` from the environment, or the embedded SQLite default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// Opens one replica's own connection pool.
pub async fn connect_replica(url: &str) -> Result<DatabaseConnection, DbErr> {
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    let db = Database::connect(options).await?;
    if url.starts_with("sqlite:") {
        // Replicas share one file: let a writer wait for the lock instead of failing.
        db.execute_unprepared("PRAGMA busy_timeout = 30000").await?;
    }
    Ok(db)
}

/// Creates (or empties) the demo's `demo_account` table with one account at balance 0.
pub async fn reset_account(db: &DatabaseConnection) -> Result<(), DbErr> {
    db.execute_unprepared("DROP TABLE IF EXISTS demo_account")
        .await?;
    db.execute_unprepared(
        "CREATE TABLE demo_account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
    )
    .await?;
    db.execute_unprepared("INSERT INTO demo_account (id, balance) VALUES (1, 0)")
        .await?;
    Ok(())
}

/// Adds `amount` to the demo account through `conn` (a transaction, in a correct handler).
pub async fn credit_account(conn: &impl ConnectionTrait, amount: i64) -> Result<(), DbErr> {
    let balance = Alias::new("balance");
    let update = Query::update()
        .table(Alias::new("demo_account"))
        .value(balance.clone(), Expr::col(balance).add(amount))
        .and_where(Expr::col(Alias::new("id")).eq(1))
        .to_owned();
    conn.execute(&update).await.map(|_| ())
}

/// The demo account's balance.
pub async fn balance(conn: &impl ConnectionTrait) -> Result<i64, DbErr> {
    let statement = Statement::from_string(
        conn.get_database_backend(),
        "SELECT balance FROM demo_account WHERE id = 1",
    );
    let row = conn
        .query_one_raw(statement)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("demo_account 1".into()))?;
    row.try_get_by_index(0)
}
