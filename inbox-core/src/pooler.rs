//! Running behind a transaction-pooling PgBouncer: the client settings it needs, and the
//! rule the library follows so that every one of its statements survives it.
//!
//! In transaction pooling, PgBouncer lends a server connection to a client for one
//! transaction and takes it back at the next idle `ReadyForQuery`. sqlx (0.9) sends a
//! statement with bound values in two round trips, `Parse`/`Describe`/`Sync`, then
//! `Bind`/`Execute`/`Sync`, under a name of its own (`sqlx_s_1`, `sqlx_s_2`, ... per client
//! connection, even with its statement cache off). Outside a transaction the two halves
//! can land on two server connections; inside one they stay on the same. So the library
//! runs every statement it sends on a PostgreSQL pool, not only its claims, in a short
//! transaction of its own ([`in_own_transaction`]), and [`for_transaction_pooler`] turns
//! off the statement cache, whose names would outlive the transaction that created them.
//! The outbox relay is the one exception, and only off PostgreSQL: on SQLite and
//! MySQL/MariaDB, where no pooler of this kind stands in between, a claim or a settle that
//! is one statement goes on its own, saving BEGIN and COMMIT (the backend's `Dialect`
//! decides; `outbox::pgbouncer::` runs the relay through PgBouncer).

use crate::backend::roll_back;
#[cfg(feature = "postgres")]
use sea_orm::ConnectOptions;
use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, TransactionOptions, TransactionTrait,
};

/// Configures a SeaORM pool for PostgreSQL behind a pooler in transaction mode (PgBouncer
/// `pool_mode = transaction`): it turns off sqlx's prepared-statement cache, so no client
/// reuses a statement name on a server connection it no longer holds.
///
/// It sets [`ConnectOptions::map_sqlx_postgres_opts`]; if you need that hook for something
/// else too, call `statement_cache_capacity(0)` in yours instead. The pooler needs two
/// settings of its own (PgBouncer 1.18; see the README's "PgBouncer" section):
/// `server_reset_query = DEALLOCATE ALL` and `server_reset_query_always = 1`, which drop
/// a transaction's statement names when its server connection goes back to the pool. Then
/// every statement with bound values must run inside a transaction (outside one it fails
/// with `26000 prepared statement "sqlx_s_N" does not exist`, never silently): the
/// inbox's own functions do; run migrations in one transaction (as below) or on a direct
/// connection. Other backends ignore the setting. Needs the crate's `postgres` feature.
///
/// ```no_run
/// use sea_orm::{ConnectOptions, Database, TransactionTrait};
/// use sea_orm_migration::MigratorTrait;
///
/// # async fn connect() -> Result<(), sea_orm::DbErr> {
/// let mut options = ConnectOptions::new("postgres://app@pgbouncer:6432/app");
/// sea_orm_inbox::for_transaction_pooler(&mut options).max_connections(20);
/// let db = Database::connect(options).await?;
///
/// // The migrator reads its bookkeeping outside a transaction: give it one.
/// let txn = db.begin().await?;
/// sea_orm_inbox_migration::Migrator::up(&txn, None).await?;
/// txn.commit().await?;
/// # Ok(()) }
/// ```
#[cfg(feature = "postgres")]
pub fn for_transaction_pooler(options: &mut ConnectOptions) -> &mut ConnectOptions {
    options.map_sqlx_postgres_opts(|postgres| postgres.statement_cache_capacity(0))
}

/// Runs `work` in a transaction of its own and commits it: what a lone statement sent on a
/// pool needs behind a transaction pooler (see the module documentation). A failed `work`
/// rolls it back with [`roll_back`], which also hands back clean a connection whose
/// transaction the database already ended.
pub(crate) async fn in_own_transaction<T>(
    db: &DatabaseConnection,
    work: impl AsyncFnOnce(&DatabaseTransaction) -> Result<T, DbErr>,
) -> Result<T, DbErr> {
    in_own_transaction_with(db, TransactionOptions::default(), work).await
}

/// [`in_own_transaction`] begun with `options` (e.g. IMMEDIATE on SQLite).
pub(crate) async fn in_own_transaction_with<T>(
    db: &DatabaseConnection,
    options: TransactionOptions,
    work: impl AsyncFnOnce(&DatabaseTransaction) -> Result<T, DbErr>,
) -> Result<T, DbErr> {
    let txn = db.begin_with_options(options).await?;
    match work(&txn).await {
        Ok(value) => {
            txn.commit().await?;
            Ok(value)
        }
        Err(err) => {
            roll_back(txn).await;
            Err(err)
        }
    }
}
