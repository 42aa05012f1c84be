//! What the crate learns about the server behind a pool at run time, rather than from its
//! backend alone: whether it can end a transaction without failing a statement (a Galera
//! node), so that [`Inbox::process`](crate::Inbox::process) proves its marker before
//! COMMIT only where that can happen.

use super::dialect;
use crate::silence::within_bound;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Whether the server behind a pool can end a transaction silently, read from the server
/// and remembered for [`SilentEnds::REREAD_AFTER`] for the pool last used: one read every
/// ten seconds instead of a proof query per message (an inbox used on two MySQL pools in
/// turn reads again whenever the pool changes). A pool the crate cannot tell apart from another
/// (a mock or proxy connection) is never remembered, and a failed read counts as "can":
/// the proof then runs, as it always did.
#[derive(Debug, Default)]
pub(crate) struct SilentEnds {
    known: Mutex<Option<Known>>,
}

#[derive(Debug)]
struct Known {
    pool: PoolIdentity,
    possible: bool,
    read_at: Instant,
}

impl SilentEnds {
    /// How long an answer is trusted: a server that became a Galera node since (a restart
    /// with a cluster address) is proven again at most this long after it did.
    pub(crate) const REREAD_AFTER: Duration = Duration::from_secs(10);

    /// Whether a transaction on `db` whose statements all succeeded may still have been
    /// ended by the server before its COMMIT. Ask before the transaction's BEGIN: a read
    /// takes a connection of the pool, which must never wait for the one the transaction
    /// holds. A read waits at most `bound`; unanswered, it counts as "can". Without a read
    /// (another backend, or an answer remembered) no timer is armed.
    pub(crate) async fn possible(&self, db: &DatabaseConnection, bound: Option<Duration>) -> bool {
        let probe = dialect(db.get_database_backend())
            .ok()
            .and_then(|dialect| dialect.silent_end_capability_probe());
        let Some(probe) = probe else {
            return false;
        };
        let Some(pool) = PoolIdentity::of(db) else {
            return true;
        };
        if let Some(possible) = self.remembered(&pool) {
            return possible;
        }
        let statement = Statement::from_string(db.get_database_backend(), probe);
        let read = within_bound(bound, db.query_one_raw(statement))
            .await
            .ok()
            .and_then(Result::ok)
            .flatten();
        let Some(possible) = read.and_then(|row| row.try_get_by_index::<i64>(0).ok()) else {
            return true;
        };
        let possible = possible != 0;
        if let Ok(mut known) = self.known.lock() {
            *known = Some(Known {
                pool,
                possible,
                read_at: Instant::now(),
            });
        }
        possible
    }

    fn remembered(&self, pool: &PoolIdentity) -> Option<bool> {
        let known = self.known.lock().ok()?;
        let known = known.as_ref()?;
        (known.pool.is(pool) && known.read_at.elapsed() < Self::REREAD_AFTER)
            .then_some(known.possible)
    }
}

/// One pool, told apart by its connect options, which sqlx shares behind one `Arc` for the
/// life of the pool (and replaces when they change). A weak reference keeps the allocation
/// from being reused by another pool while it is remembered.
#[derive(Debug)]
enum PoolIdentity {
    #[cfg(feature = "mysql")]
    MySql(std::sync::Weak<sea_orm::sqlx::mysql::MySqlConnectOptions>),
}

impl PoolIdentity {
    #[cfg_attr(not(feature = "mysql"), allow(unused_variables))]
    fn of(db: &DatabaseConnection) -> Option<Self> {
        match &db.inner {
            #[cfg(feature = "mysql")]
            sea_orm::DatabaseConnectionType::SqlxMySqlPoolConnection(_) => Some(Self::MySql(
                std::sync::Arc::downgrade(&db.get_mysql_connection_pool().connect_options()),
            )),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    fn is(&self, other: &Self) -> bool {
        match (self, other) {
            #[cfg(feature = "mysql")]
            (Self::MySql(this), Self::MySql(that)) => this.ptr_eq(that),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}
