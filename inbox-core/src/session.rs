//! Session settings a SeaORM pool must carry on every connection it opens, where the
//! database has no per-transaction form the claim could set itself.

use crate::InboxError;
use crate::inbox::checked_lock_timeout;
use sea_orm::ConnectOptions;
use sea_orm::sqlx::{AssertSqlSafe, Executor, raw_sql};
use std::sync::Arc;
use std::time::Duration;

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
pub fn bound_mysql_lock_waits(
    options: &mut ConnectOptions,
    timeout: Duration,
) -> Result<&mut ConnectOptions, InboxError> {
    let timeout = checked_lock_timeout(timeout)?;
    let seconds = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
    // The value is a number this function computed: no input reaches the SQL text.
    let set: Arc<str> = format!("SET SESSION innodb_lock_wait_timeout = {seconds}").into();
    Ok(options.map_sqlx_mysql_pool_opts(move |pool| {
        let set = Arc::clone(&set);
        pool.after_connect(move |conn, _meta| {
            let set = Arc::clone(&set);
            Box::pin(async move {
                conn.execute(raw_sql(AssertSqlSafe(set))).await?;
                Ok(())
            })
        })
    }))
}
