//! Session settings a SeaORM pool carries on every connection it opens: where the
//! database has no per-transaction form the claim could set itself, and where setting them
//! once per connection saves every transaction from setting them again.

use crate::Inbox;
use crate::backend::{ConnectionBounds, connection_bounds};
use sea_orm::{ConnectOptions, DbBackend};
#[cfg(feature = "mysql")]
use {
    crate::InboxError,
    crate::inbox::checked_lock_timeout,
    sea_orm::sqlx::{AssertSqlSafe, Executor, raw_sql},
    std::sync::Arc,
    std::time::Duration,
};

/// Gives every connection of a SeaORM pool the bounds of `inbox` for its whole life (its
/// [lock timeout](Inbox::with_lock_timeout) and [partition
/// timeout](Inbox::with_partition_timeout)), so that [`Inbox::process`] on that pool sends
/// BEGIN, the marker INSERT, the handler's statements and COMMIT, and nothing else: its
/// marker INSERT then sets no bound of its own.
///
/// - PostgreSQL: `lock_timeout`, `idle_in_transaction_session_timeout` and
///   `tcp_user_timeout` as startup options of each connection (no statement), through
///   [`ConnectOptions::map_sqlx_postgres_opts`].
/// - MySQL/MariaDB: `innodb_lock_wait_timeout`, `net_write_timeout` and (MariaDB)
///   `idle_transaction_timeout`, set by each new connection before the pool hands it out,
///   through [`ConnectOptions::map_sqlx_mysql_pool_opts`]'s `after_connect` (it replaces
///   [`bound_mysql_lock_waits`], whose setting it includes).
/// - SQLite: nothing (no network to go silent).
///
/// `process` checks that the pool's connections carry exactly these bounds (a read on one
/// connection, every ten seconds per pool) and otherwise sets them in each marker INSERT,
/// as without this function: an inbox with other timeouts, a pool configured without it,
/// or one behind a transaction pooler still gets its bounds. Behind PgBouncer in
/// transaction pooling, do not call it: a pooler refuses (or drops) startup options, and
/// a session setting would reach whichever server connection it lends; use
/// [`for_transaction_pooler`](crate::for_transaction_pooler), which sets the same
/// PostgreSQL hook (the last call wins). If you need these hooks for something else too,
/// set the same settings in yours: `process` reads the session's values (on MySQL/MariaDB
/// also `@sea_orm_inbox_bounded = 1`, which says the pool set them on every connection).
/// A handler that changes them for its session changes them for the later transactions of
/// that connection; `SET LOCAL` (PostgreSQL) changes them for its own only.
///
/// ```no_run
/// use sea_orm::{ConnectOptions, Database};
/// use sea_orm_inbox::Inbox;
/// use std::time::Duration;
///
/// # async fn connect() -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = Inbox::new("billing.credit")?.with_lock_timeout(Duration::from_secs(2))?;
/// let mut options = ConnectOptions::new("postgres://app@db:5432/app");
/// sea_orm_inbox::bound_connections(&mut options, &inbox).max_connections(20);
/// let db = Database::connect(options).await?;
/// # let _ = db;
/// # Ok(()) }
/// ```
pub fn bound_connections<'o>(
    options: &'o mut ConnectOptions,
    inbox: &Inbox,
) -> &'o mut ConnectOptions {
    let (lock_wait, silence) = (inbox.lock_timeout(), inbox.partition_timeout());
    for backend in [DbBackend::Postgres, DbBackend::MySql] {
        if let Ok(bounds) = connection_bounds(backend, lock_wait, silence) {
            install(options, bounds);
        }
    }
    options
}

/// Installs `bounds` in the pool's hook for its backend (a SQLite-only build has none).
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_variables)
)]
fn install(options: &mut ConnectOptions, bounds: ConnectionBounds) {
    match bounds {
        #[cfg(feature = "postgres")]
        ConnectionBounds::StartupOptions(settings) => {
            options.map_sqlx_postgres_opts(move |postgres| {
                postgres.options(settings.iter().map(|(name, value)| (*name, value.as_str())))
            });
        }
        #[cfg(feature = "mysql")]
        ConnectionBounds::AfterConnect(set) => {
            set_after_connect(options, Arc::from(set));
        }
        #[allow(unreachable_patterns)]
        _ => {}
    }
}

/// Makes each new MySQL/MariaDB connection of the pool run `set` before the pool hands it
/// out.
#[cfg(feature = "mysql")]
fn set_after_connect(options: &mut ConnectOptions, set: Arc<str>) -> &mut ConnectOptions {
    options.map_sqlx_mysql_pool_opts(move |pool| {
        let set = Arc::clone(&set);
        pool.after_connect(move |conn, _meta| {
            let set = Arc::clone(&set);
            Box::pin(async move {
                conn.execute(raw_sql(AssertSqlSafe(set))).await?;
                Ok(())
            })
        })
    })
}

/// Bounds every lock wait on the pool's MySQL/MariaDB connections at `timeout`: each new
/// connection runs `SET SESSION innodb_lock_wait_timeout = N` (whole seconds, rounded up;
/// the server's default is 50 s) before the pool hands it out. A claim held by another
/// replica's open transaction then fails after that wait with a transient 1205 that
/// `Inbox::process` retries and nacks, as `Inbox::with_lock_timeout` does on PostgreSQL,
/// where the claim sets the bound for its own transaction. Pass the same duration to
/// both.
///
/// It sets the sqlx pool's `after_connect` through
/// [`ConnectOptions::map_sqlx_mysql_pool_opts`]; if you need that hook for something else
/// too, run the same `SET SESSION` in yours instead. Other backends ignore the setting.
/// Needs the crate's `mysql` feature.
///
/// # Errors
/// [`InboxError::OutOfRange`] outside
/// [`Inbox::MIN_LOCK_TIMEOUT`](crate::Inbox::MIN_LOCK_TIMEOUT)..=
/// [`Inbox::MAX_LOCK_TIMEOUT`](crate::Inbox::MAX_LOCK_TIMEOUT).
///
/// ```no_run
/// use sea_orm::{ConnectOptions, Database};
/// use sea_orm_inbox::Inbox;
/// use std::time::Duration;
///
/// # async fn connect() -> Result<(), Box<dyn std::error::Error>> {
/// let lock_wait = Duration::from_secs(5);
/// let mut options = ConnectOptions::new("mysql://app@db:3306/app");
/// sea_orm_inbox::bound_mysql_lock_waits(&mut options, lock_wait)?.max_connections(20);
/// let db = Database::connect(options).await?;
/// let inbox = Inbox::new("billing.credit")?.with_lock_timeout(lock_wait)?;
/// # let _ = (db, inbox);
/// # Ok(()) }
/// ```
#[cfg(feature = "mysql")]
pub fn bound_mysql_lock_waits(
    options: &mut ConnectOptions,
    timeout: Duration,
) -> Result<&mut ConnectOptions, InboxError> {
    let timeout = checked_lock_timeout(timeout)?;
    let seconds = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
    // The value is a number this function computed: no input reaches the SQL text.
    let set: Arc<str> = format!("SET SESSION innodb_lock_wait_timeout = {seconds}").into();
    Ok(set_after_connect(options, set))
}
