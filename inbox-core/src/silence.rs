//! The client-side bound on a database that stops answering, for the calls that are not
//! about one message (a purge, a listing, the schema check).

use crate::InboxError;
use crate::backend::over_network;
use sea_orm::DatabaseConnection;
use std::future::Future;
use std::time::Duration;

/// Awaits `future`, a database call on `db`, at most `timeout`, and reports
/// [`InboxError::DatabaseSilent`] for `operation` past it. Dropping the future gives up
/// its connection: sqlx pings such a connection before the pool hands it out again, and
/// closes it when the ping fails. Unbounded where no network can go silent (SQLite, whose
/// waits end in its busy timeout).
pub(crate) async fn answered_within<F: Future>(
    db: &DatabaseConnection,
    timeout: Duration,
    operation: &'static str,
    future: F,
) -> Result<F::Output, InboxError> {
    if !over_network(db.get_database_backend()) {
        return Ok(future.await);
    }
    tokio::time::timeout(timeout, future)
        .await
        .map_err(|_| InboxError::DatabaseSilent {
            operation,
            waited: timeout,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite is embedded: a call slower than the bound is awaited to its end, as the
    /// backend decides for `Inbox::process` too.
    #[tokio::test]
    async fn sqlite_calls_are_not_bounded() {
        let db = sea_orm::Database::connect("sqlite::memory:")
            .await
            .expect("an in-memory database");
        let slow = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            "answered"
        };
        let answer = answered_within(&db, Duration::from_millis(1), "a slow read", slow).await;
        assert_eq!(answer.ok(), Some("answered"));
    }
}
