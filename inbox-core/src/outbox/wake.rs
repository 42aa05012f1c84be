//! Waking relays after a commit: in this process through a [`Notify`], and in other
//! processes, on PostgreSQL, through `LISTEN`/`NOTIFY`, debounced.

use super::OutboxError;
use crate::backend::outbox::notify_sql;
use sea_orm::{ConnectionTrait, DatabaseConnection};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, mpsc};

/// The notification channel the relays of every process listen on.
pub const OUTBOX_CHANNEL: &str = "sea_orm_inbox_outbox";

/// Wakes a [`Relay::run`](crate::Relay::run) loop at once, instead of at its next poll:
/// call [`wake`](Self::wake) after committing a transaction that enqueued messages. Cheap
/// to clone; a wake while the relay is busy is kept for its next wait.
///
/// By itself it reaches the relays of this process only; relays of other processes find
/// the rows at their next poll ([`RelayOptions::poll_interval`](crate::RelayOptions)).
/// On PostgreSQL, [`notifying`](Self::notifying) makes it reach them too.
#[derive(Clone, Debug, Default)]
pub struct OutboxWaker {
    local: Arc<Notify>,
    remote: Option<mpsc::Sender<()>>,
}

impl OutboxWaker {
    /// The default window of [`notifying`](Self::notifying), and so the longest a wake
    /// waits for its `NOTIFY`: a process sends at most one per window, at once for the
    /// first wake and at the window's end for the wakes inside it. 5 ms caps a process at
    /// 200 `NOTIFY`s a second, each a transaction of its own, whatever its commit rate.
    pub const NOTIFY_DEBOUNCE: Duration = Duration::from_millis(5);

    /// Wakes the relay (and, when [`notifying`](Self::notifying), the relays of other
    /// processes).
    pub fn wake(&self) {
        self.local.notify_one();
        if let Some(remote) = &self.remote {
            // Full means a NOTIFY is already due: it covers this wake too.
            let _ = remote.try_send(());
        }
    }

    pub(crate) async fn woken(&self) {
        self.local.notified().await;
    }

    /// This waker, also waking relays that listen in other processes
    /// ([`Relay::listening`](crate::Relay::listening)): each wake sends
    /// `pg_notify('sea_orm_inbox_outbox', '')` through `db`, outside any transaction,
    /// debounced to one statement per [`NOTIFY_DEBOUNCE`](Self::NOTIFY_DEBOUNCE)
    /// ([`notifying_debounced`](Self::notifying_debounced) sets another window).
    ///
    /// The `NOTIFY` never runs in the business transaction: a transaction that notifies
    /// takes a database-wide lock at its commit, which would serialize every enqueuing
    /// commit. `db` may be a pool behind a transaction pooler (PgBouncer, transaction
    /// mode): the statement is one, sent as text with the channel written in, without the
    /// bound value that fails there outside a transaction. A failed `NOTIFY` is logged
    /// (`tracing` warning); the relays still find the rows at their next poll.
    ///
    /// ```no_run
    /// # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), sea_orm_inbox::OutboxError> {
    /// use sea_orm_inbox::OutboxWaker;
    ///
    /// let waker = OutboxWaker::default().notifying(db.clone())?;
    /// // ... commit a transaction that enqueued messages, then:
    /// waker.wake();
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`OutboxError::InvalidOptions`] when `db` is not PostgreSQL (the others have no
    /// notification channel: their relays poll) or when called outside a Tokio runtime;
    /// [`OutboxError::Backend`] when this build lacks the connection's backend feature.
    pub fn notifying(self, db: DatabaseConnection) -> Result<Self, OutboxError> {
        self.notifying_debounced(db, Self::NOTIFY_DEBOUNCE)
    }

    /// [`notifying`](Self::notifying) with at most one `NOTIFY` per `window` instead of
    /// per [`NOTIFY_DEBOUNCE`](Self::NOTIFY_DEBOUNCE): a longer window sends fewer
    /// statements (many enqueuing processes, one listening relay) and makes a wake wait up
    /// to `window` for its `NOTIFY`; `Duration::ZERO` sends one per wake that finds no
    /// `NOTIFY` already due.
    ///
    /// ```no_run
    /// # async fn run(db: sea_orm::DatabaseConnection) -> Result<(), sea_orm_inbox::OutboxError> {
    /// use sea_orm_inbox::OutboxWaker;
    /// use std::time::Duration;
    ///
    /// let waker = OutboxWaker::default().notifying_debounced(db.clone(), Duration::from_millis(50))?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`notifying`](Self::notifying).
    pub fn notifying_debounced(
        mut self,
        db: DatabaseConnection,
        window: Duration,
    ) -> Result<Self, OutboxError> {
        let sql = notify_sql(db.get_database_backend(), OUTBOX_CHANNEL)
            .map_err(OutboxError::Backend)?
            .ok_or(OutboxError::InvalidOptions {
                what: "cross-process wake-ups need PostgreSQL's NOTIFY",
                advice: "on MySQL/MariaDB and SQLite, wake the relays of this process and let the others poll",
            })?;
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| OutboxError::InvalidOptions {
                what: "OutboxWaker::notifying was called outside a Tokio runtime",
                advice: "call it from async code running on Tokio",
            })?;
        let (sender, mut wakes) = mpsc::channel(1);
        runtime.spawn(async move {
            while wakes.recv().await.is_some() {
                if let Err(error) = db.execute_unprepared(&sql).await {
                    tracing::warn!(%error, "outbox NOTIFY failed; relays elsewhere find the rows at their next poll");
                }
                tokio::time::sleep(window).await;
            }
        });
        self.remote = Some(sender);
        Ok(self)
    }
}

/// Listens on [`OUTBOX_CHANNEL`] on its own connection to `url`, and wakes `waker` on
/// every notification, and whenever the connection was re-established (a notification may
/// have been missed meanwhile). Runs until dropped; a failed connection is retried after
/// `retry`, and the relay polls meanwhile.
#[cfg(feature = "postgres")]
pub(super) async fn listen(url: String, waker: OutboxWaker, retry: Duration) {
    use sea_orm::sqlx::postgres::PgListener;
    loop {
        let listening = async {
            let mut listener = PgListener::connect(&url).await?;
            listener.listen(OUTBOX_CHANNEL).await?;
            // Rows committed while no one listened are found at once.
            waker.local.notify_one();
            loop {
                // `None`: the connection was lost and re-established.
                let _notification = listener.try_recv().await?;
                waker.local.notify_one();
            }
        };
        let result: Result<(), sea_orm::sqlx::Error> = listening.await;
        if let Err(error) = result {
            tracing::warn!(%error, "outbox LISTEN connection failed; polling until it is back");
        }
        tokio::time::sleep(retry).await;
    }
}
