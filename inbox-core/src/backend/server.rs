//! What the crate learns about the server behind a pool at run time, rather than from its
//! backend alone: whether it can end a transaction without failing a statement (a Galera
//! node), so that [`Inbox::process`](crate::Inbox::process) proves its marker before
//! COMMIT only where that can happen; and whether the pool's connections carry
//! `process`'s bounds, so that its marker sets them per transaction only where they do
//! not.

use super::dialect;
use super::dialect::BoundsProbe;
use crate::silence::within_bound;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Whether the server behind a pool can end a transaction silently, read from the server
/// and remembered per pool for [`REREAD_AFTER`]: one read every ten seconds instead of
/// a proof query per message. A pool the crate cannot tell apart from another
/// (a mock or proxy connection) is never remembered, and a failed read counts as "can":
/// the proof then runs, as it always did.
#[derive(Debug, Default)]
pub(crate) struct SilentEnds {
    known: PoolFact<()>,
}

impl SilentEnds {
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
        if let Some(possible) = self.known.remembered(&pool, &()) {
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
        self.known.remember(pool, (), possible);
        possible
    }
}

/// Whether the connections of a pool carry [`Inbox::process`]'s bounds for
/// their whole life (see [`bound_connections`]), read from the server for that pool and
/// those bounds and remembered for [`REREAD_AFTER`]: the one place that
/// chooses between bounds per connection and bounds set by each marker INSERT. Every
/// doubt chooses the marker's (a pool the crate cannot tell apart from another, a failed
/// or unanswered read, remembered as long as an answer), which is always right; a transaction pooler never shows the
/// startup options a pool sets (PgBouncer refuses or drops them), so behind one the
/// marker keeps setting them.
///
/// [`Inbox::process`]: crate::Inbox::process
/// [`bound_connections`]: crate::bound_connections
#[derive(Debug, Default)]
pub(crate) struct ConnectionBoundsKnown {
    known: PoolFact<(Duration, Duration)>,
}

impl ConnectionBoundsKnown {
    /// Whether a transaction on `db` runs on a connection that already bounds its lock
    /// waits at `lock_wait` (or less) and its silent client at `silence`. Ask before the
    /// transaction's BEGIN (a read takes a connection of the pool); a read waits at most
    /// `bound`. The read runs on its own, outside any transaction (a COMMIT of its own
    /// would be one more per pool and reread); on PostgreSQL as a simple query, which a
    /// transaction pooler passes whole to one server connection (see `pooler.rs`). A
    /// failed read counts as "not carried" until the next read.
    pub(crate) async fn carried(
        &self,
        db: &DatabaseConnection,
        lock_wait: Duration,
        silence: Duration,
        bound: Option<Duration>,
    ) -> bool {
        let backend = db.get_database_backend();
        let Some(pool) = PoolIdentity::of(db) else {
            return false;
        };
        let bounds = (lock_wait, silence);
        // Before the probe is made: its text is formatted, and a pool is remembered only
        // after a probe of its backend ran.
        if let Some(carried) = self.known.remembered(&pool, &bounds) {
            return carried;
        }
        let probe = dialect(backend)
            .ok()
            .and_then(|dialect| dialect.connection_bounds_probe(lock_wait, silence));
        let Some(probe) = probe else {
            return false;
        };
        let carried = match probe {
            BoundsProbe::RowCount { sql, carried } => {
                let read = within_bound(bound, db.execute_unprepared(&sql)).await;
                let rows = read
                    .ok()
                    .and_then(Result::ok)
                    .map(|done| done.rows_affected());
                rows == Some(carried)
            }
            BoundsProbe::Flag(sql) => {
                let read = db.query_one_raw(Statement::from_string(backend, sql));
                let answer = within_bound(bound, read)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .flatten()
                    .and_then(|row| row.try_get_by_index::<i64>(0).ok());
                answer == Some(1)
            }
        };
        // A failed read is remembered as "not carried" too: it must not cost every attempt
        // a statement.
        self.known.remember(pool, bounds, carried);
        carried
    }
}

/// How long a fact about a pool is trusted before it is read again: a server that became a
/// Galera node since (a restart with a cluster address) is proven again at most this long
/// after it did.
const REREAD_AFTER: Duration = Duration::from_secs(10);

/// How many pools a fact is remembered for at once: enough for every pool of a process
/// (replicas in one test, a pool per tenant), few enough that a lookup stays a short scan.
const POOLS_REMEMBERED: usize = 64;

/// One yes-or-no fact per pool (and `key`, the values it was read for), each remembered
/// for [`REREAD_AFTER`]. Per pool, not for the pool last used: a process that alternates
/// pools (a worker per pool, an inbox shared by two) would otherwise read again at every
/// switch, two statements per message.
#[derive(Debug)]
struct PoolFact<K> {
    known: Mutex<Vec<Known<K>>>,
}

impl<K> Default for PoolFact<K> {
    fn default() -> Self {
        Self {
            known: Mutex::new(Vec::new()),
        }
    }
}

#[derive(Debug)]
struct Known<K> {
    pool: PoolIdentity,
    key: K,
    value: bool,
    read_at: Instant,
}

impl<K> Known<K> {
    fn fresh(&self) -> bool {
        self.read_at.elapsed() < REREAD_AFTER
    }
}

impl<K: PartialEq> PoolFact<K> {
    fn remembered(&self, pool: &PoolIdentity, key: &K) -> Option<bool> {
        let known = self.known.lock().ok()?;
        known
            .iter()
            .find(|known| known.pool.is(pool) && known.key == *key && known.fresh())
            .map(|known| known.value)
    }

    fn remember(&self, pool: PoolIdentity, key: K, value: bool) {
        let Ok(mut known) = self.known.lock() else {
            return;
        };
        known.retain(|old| {
            old.fresh() && !old.pool.is_closed() && !(old.pool.is(&pool) && old.key == key)
        });
        if known.len() >= POOLS_REMEMBERED
            && let Some(oldest) = known.iter().map(|old| old.read_at).min()
        {
            known.retain(|old| old.read_at != oldest);
        }
        known.push(Known {
            pool,
            key,
            value,
            read_at: Instant::now(),
        });
    }
}

/// One pool, told apart by its connect options, which sqlx shares behind one `Arc` for the
/// life of the pool (and replaces when they change). A weak reference keeps the allocation
/// from being reused by another pool while it is remembered.
#[derive(Debug)]
enum PoolIdentity {
    #[cfg(feature = "mysql")]
    MySql(std::sync::Weak<sea_orm::sqlx::mysql::MySqlConnectOptions>),
    #[cfg(feature = "postgres")]
    Postgres(std::sync::Weak<sea_orm::sqlx::postgres::PgConnectOptions>),
}

impl PoolIdentity {
    #[cfg_attr(
        not(any(feature = "mysql", feature = "postgres")),
        allow(unused_variables)
    )]
    fn of(db: &DatabaseConnection) -> Option<Self> {
        match &db.inner {
            #[cfg(feature = "mysql")]
            sea_orm::DatabaseConnectionType::SqlxMySqlPoolConnection(_) => Some(Self::MySql(
                std::sync::Arc::downgrade(&db.get_mysql_connection_pool().connect_options()),
            )),
            #[cfg(feature = "postgres")]
            sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_) => Some(Self::Postgres(
                std::sync::Arc::downgrade(&db.get_postgres_connection_pool().connect_options()),
            )),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Whether the pool is gone (its options dropped), so its facts can be forgotten.
    fn is_closed(&self) -> bool {
        match self {
            #[cfg(feature = "mysql")]
            Self::MySql(options) => options.strong_count() == 0,
            #[cfg(feature = "postgres")]
            Self::Postgres(options) => options.strong_count() == 0,
            #[allow(unreachable_patterns)]
            _ => true,
        }
    }

    fn is(&self, other: &Self) -> bool {
        match (self, other) {
            #[cfg(feature = "mysql")]
            (Self::MySql(this), Self::MySql(that)) => this.ptr_eq(that),
            #[cfg(feature = "postgres")]
            (Self::Postgres(this), Self::Postgres(that)) => this.ptr_eq(that),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}
