//! The client-side bound on a database that stops answering, for the calls that are not
//! about one message (a purge, a listing, the schema check), and for the claims on a
//! caller's transaction.

use crate::backend::over_network;
use crate::{Inbox, InboxError};
use sea_orm::{DatabaseConnection, DbBackend};
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
    within(db.get_database_backend(), timeout, future)
        .await
        .map_err(|waited| InboxError::DatabaseSilent { operation, waited })
}

/// [`answered_within`] with [`Inbox::DEFAULT_PARTITION_TIMEOUT`], for a call on a
/// connection of `backend` that has no option to change it (a batch claim on the caller's
/// transaction).
pub(crate) async fn answered_on<F: Future>(
    backend: DbBackend,
    operation: &'static str,
    future: F,
) -> Result<F::Output, InboxError> {
    within(backend, Inbox::DEFAULT_PARTITION_TIMEOUT, future)
        .await
        .map_err(|waited| InboxError::DatabaseSilent { operation, waited })
}

/// The bound on one call to `backend`: `timeout` over a network, none for an embedded
/// database, whose waits its busy timeout already ends.
pub(crate) fn bound_for(backend: DbBackend, timeout: Duration) -> Option<Duration> {
    over_network(backend).then_some(timeout)
}

/// Waits for `future` at most `bound` (without one, as long as it takes); past it the
/// future is dropped and the error is the bound waited.
pub(crate) async fn within_bound<F: Future>(
    bound: Option<Duration>,
    future: F,
) -> Result<F::Output, Duration> {
    match bound {
        Some(bound) => tokio::time::timeout(bound, future).await.map_err(|_| bound),
        None => Ok(future.await),
    }
}

/// [`answered_within`] for a call whose error names more than the operation (a claim's
/// message): `Err` carries how long it waited, for the caller to build its error.
pub(crate) async fn within<F: Future>(
    backend: DbBackend,
    timeout: Duration,
    future: F,
) -> Result<F::Output, Duration> {
    within_bound(bound_for(backend, timeout), future).await
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
