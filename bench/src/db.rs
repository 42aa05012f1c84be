//! The benchmark's own database on each backend, its connections and the SQL it writes by
//! hand, one string per dialect.

use crate::BoxError;
use chrono::{DateTime, Utc};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement, Value,
};
use sea_orm_inbox_migration::{Migrator, MigratorTrait};
use std::time::Duration;

/// The consumer every benchmark message is claimed for.
pub const CONSUMER: &str = "bench.credit";

/// The database the benchmark creates (and drops afterwards) on a server, unless
/// `--database` names another.
pub const BENCH_DATABASE: &str = "inbox_bench";

/// A backend to run on, as the flags name it.
#[derive(Clone, Debug)]
pub struct Target {
    pub name: &'static str,
    /// For servers: the URL of a database the user may create databases from.
    pub admin_url: Option<String>,
    /// The database to create on a server (dropped first if it exists, and afterwards).
    pub database: String,
}

/// The benchmark's database: a fresh SQLite file, or `inbox_bench` on a server.
pub struct BenchDb {
    pub backend: DbBackend,
    pub url: String,
    admin_url: Option<String>,
    database: String,
    _dir: Option<tempfile::TempDir>,
}

impl BenchDb {
    /// Creates an empty database for `target` and runs the inbox migrations in it.
    pub async fn create(target: &Target) -> Result<Self, BoxError> {
        let db = match &target.admin_url {
            None => Self::sqlite()?,
            Some(admin_url) => Self::server(admin_url, &target.database).await?,
        };
        let setup = db.connect().await?;
        if db.backend == DbBackend::Sqlite {
            // WAL is what a SQLite app with concurrent writers runs; it persists in the file.
            setup
                .execute_unprepared("PRAGMA journal_mode = WAL")
                .await?;
        }
        Migrator::up(&setup, None).await?;
        setup.close().await?;
        Ok(db)
    }

    fn sqlite() -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("bench.sqlite").display()
        );
        Ok(Self {
            backend: DbBackend::Sqlite,
            url,
            admin_url: None,
            database: String::new(),
            _dir: Some(dir),
        })
    }

    async fn server(admin_url: &str, database: &str) -> Result<Self, BoxError> {
        let admin = Database::connect(admin_url)
            .await
            .map_err(|e| format!("cannot connect to {admin_url}: {e}"))?;
        let backend = admin.get_database_backend();
        admin
            .execute_unprepared(&format!("DROP DATABASE IF EXISTS {database}"))
            .await?;
        admin
            .execute_unprepared(&format!("CREATE DATABASE {database}"))
            .await?;
        admin.close().await?;
        Ok(Self {
            backend,
            url: with_database(admin_url, database),
            admin_url: Some(admin_url.to_owned()),
            database: database.to_owned(),
            _dir: None,
        })
    }

    /// A pool of exactly one connection: one per worker, like one replica each.
    ///
    /// Pings before each checkout are off: they would add a round trip to every
    /// transaction of every mode and flatter the ratios. Every connection carries the
    /// inbox's bounds ([`sea_orm_inbox::bound_connections`], as the README advises for a
    /// direct connection), so `process` sets none per transaction; the other modes set none
    /// either.
    pub async fn connect(&self) -> Result<DatabaseConnection, BoxError> {
        let mut options = ConnectOptions::new(self.url.clone());
        sea_orm_inbox::bound_connections(&mut options, &sea_orm_inbox::Inbox::new(CONSUMER)?);
        options
            .max_connections(1)
            .min_connections(1)
            .test_before_acquire(false)
            .idle_timeout(None::<Duration>)
            .max_lifetime(None::<Duration>)
            .acquire_timeout(Duration::from_secs(120))
            .sqlx_logging(false)
            // SQLite writers queue on the file lock; at 32 workers the wait can be long.
            .map_sqlx_sqlite_opts(|opts| opts.busy_timeout(Duration::from_secs(120)));
        Ok(Database::connect(options).await?)
    }

    /// Drops the server database (the SQLite file goes with its temporary directory).
    pub async fn drop_database(self) -> Result<(), BoxError> {
        if let Some(admin_url) = &self.admin_url {
            let admin = Database::connect(admin_url).await?;
            admin
                .execute_unprepared(&format!("DROP DATABASE IF EXISTS {}", self.database))
                .await?;
            admin.close().await?;
        }
        Ok(())
    }
}

/// `url` with its database path replaced by `name`, query string kept.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority..].find('/') {
        Some(slash) => &base[..authority + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{name}?{query}"),
        None => format!("{base}/{name}"),
    }
}

/// The hand-written SQL of the benchmark in one dialect. Static strings with bound values,
/// so every statement is prepared once per connection and reused, like the library's.
pub struct Sql {
    /// `balance += $1` on account `$2`: the business write of every mode.
    pub credit: &'static str,
    /// The marker INSERT written by hand: the `raw` floor.
    pub marker: &'static str,
    /// The marker INSERT that skips a conflict on the inbox index instead of failing.
    pub marker_on_conflict: &'static str,
    /// One batch of the hand-written purge: at most `$2` rows received before `$1`, oldest
    /// first along `ix_inbox_received_at`. Unlike the library's, it does not spare
    /// unfinished two-phase claims: the floor does the least work a purge can.
    pub delete_batch: &'static str,
    /// Inbox rows with an id above `$1`, and their distinct message ids.
    pub rows_since: &'static str,
    /// MassTransit: the marker of (`$1`, `$2`) under a row lock: its id and 1 if consumed.
    pub lock_marker: &'static str,
    /// NServiceBus: the outbox record of (`$1`, `$2`), read without a lock.
    pub find_marker: &'static str,
    /// MassTransit: a new lock id `$1` and one more receive on marker `$2`.
    pub take_lock: &'static str,
    /// MassTransit: marker `$2` consumed at `$1`.
    pub mark_consumed: &'static str,
    /// Wolverine: the envelope (`$2`, `$3`) handled at `$1`.
    pub mark_handled: &'static str,
}

const POSTGRES: Sql = Sql {
    credit: "UPDATE bench_account SET balance = balance + $1 WHERE id = $2",
    marker: r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES ($1, $2, $3)"#,
    marker_on_conflict: r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES ($1, $2, $3) ON CONFLICT ("message_id", "consumer") DO NOTHING"#,
    // `id = ANY(ARRAY(...))`: `id IN (subquery)` plans a sequential scan here.
    delete_batch: r#"DELETE FROM "inbox" WHERE "id" = ANY(ARRAY(SELECT "id" FROM "inbox" WHERE "received_at" < $1 ORDER BY "received_at" LIMIT $2))"#,
    rows_since: "SELECT COUNT(*), COUNT(DISTINCT message_id) FROM inbox WHERE id > $1",
    lock_marker: "SELECT id, CAST(CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END AS BIGINT) FROM inbox WHERE message_id = $1 AND consumer = $2 FOR UPDATE",
    find_marker: "SELECT id FROM inbox WHERE message_id = $1 AND consumer = $2",
    take_lock: "UPDATE inbox SET claim_token = $1, attempts = attempts + 1 WHERE id = $2",
    mark_consumed: "UPDATE inbox SET processed_at = $1 WHERE id = $2",
    mark_handled: "UPDATE inbox SET processed_at = $1 WHERE message_id = $2 AND consumer = $3",
};

const MYSQL: Sql = Sql {
    credit: "UPDATE bench_account SET balance = balance + ? WHERE id = ?",
    marker: "INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`) VALUES (?, ?, ?)",
    // The library's no-op clause: `id = id` let MariaDB merge concurrent rows. It changes
    // nothing; sqlx then reports last_insert_id 0 for the skipped row.
    marker_on_conflict: "INSERT INTO `inbox` (`message_id`, `consumer`, `received_at`) VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE `consumer` = `consumer`",
    delete_batch: "DELETE FROM `inbox` WHERE `received_at` < ? ORDER BY `received_at` LIMIT ?",
    rows_since: "SELECT COUNT(*), COUNT(DISTINCT message_id) FROM inbox WHERE id > ?",
    lock_marker: "SELECT id, CAST(CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END AS SIGNED) FROM inbox WHERE message_id = ? AND consumer = ? FOR UPDATE",
    find_marker: "SELECT id FROM inbox WHERE message_id = ? AND consumer = ?",
    take_lock: "UPDATE inbox SET claim_token = ?, attempts = attempts + 1 WHERE id = ?",
    mark_consumed: "UPDATE inbox SET processed_at = ? WHERE id = ?",
    mark_handled: "UPDATE inbox SET processed_at = ? WHERE message_id = ? AND consumer = ?",
};

const SQLITE: Sql = Sql {
    credit: "UPDATE bench_account SET balance = balance + ? WHERE id = ?",
    marker: r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (?, ?, ?)"#,
    marker_on_conflict: r#"INSERT INTO "inbox" ("message_id", "consumer", "received_at") VALUES (?, ?, ?) ON CONFLICT ("message_id", "consumer") DO NOTHING"#,
    delete_batch: r#"DELETE FROM "inbox" WHERE "id" IN (SELECT "id" FROM "inbox" WHERE "received_at" < ? ORDER BY "received_at" LIMIT ?)"#,
    rows_since: "SELECT COUNT(*), COUNT(DISTINCT message_id) FROM inbox WHERE id > ?",
    // No FOR UPDATE: the IMMEDIATE transaction already holds the only write lock.
    lock_marker: "SELECT id, CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END FROM inbox WHERE message_id = ? AND consumer = ?",
    find_marker: "SELECT id FROM inbox WHERE message_id = ? AND consumer = ?",
    take_lock: "UPDATE inbox SET claim_token = ?, attempts = attempts + 1 WHERE id = ?",
    mark_consumed: "UPDATE inbox SET processed_at = ? WHERE id = ?",
    mark_handled: "UPDATE inbox SET processed_at = ? WHERE message_id = ? AND consumer = ?",
};

/// The benchmark's SQL for `backend`.
pub fn sql(backend: DbBackend) -> Result<&'static Sql, BoxError> {
    match backend {
        DbBackend::Postgres => Ok(&POSTGRES),
        DbBackend::MySql => Ok(&MYSQL),
        DbBackend::Sqlite => Ok(&SQLITE),
        other => Err(format!("no benchmark SQL for {other:?}").into()),
    }
}

/// The best hand-written multi-row marker INSERT of `rows` ids, returning what it
/// inserted: `ON CONFLICT DO NOTHING RETURNING` on PostgreSQL and SQLite; on MariaDB
/// `ON DUPLICATE KEY UPDATE consumer = consumer ... RETURNING`, which returns conflicting
/// rows too, so each row also carries a tag (`claim_token`) that tells the new ones.
pub fn batch_insert_sql(backend: DbBackend, rows: usize) -> Result<String, BoxError> {
    let (columns, tuple, tail) = match backend {
        DbBackend::Postgres | DbBackend::Sqlite => (
            "message_id, consumer, received_at",
            3,
            " ON CONFLICT (message_id, consumer) DO NOTHING RETURNING message_id",
        ),
        DbBackend::MySql => (
            "message_id, consumer, received_at, claim_token",
            4,
            " ON DUPLICATE KEY UPDATE consumer = consumer RETURNING message_id, claim_token",
        ),
        other => return Err(format!("no batch SQL for {other:?}").into()),
    };
    let mut sql = format!("INSERT INTO inbox ({columns}) VALUES ");
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        let placeholders: Vec<String> = (1..=tuple)
            .map(|col| match backend {
                DbBackend::Postgres => format!("${}", row * tuple + col),
                _ => "?".to_owned(),
            })
            .collect();
        sql.push_str(&format!("({})", placeholders.join(", ")));
    }
    sql.push_str(tail);
    Ok(sql)
}

/// A UTC timestamp as the inbox column takes it, written by hand for the floor modes:
/// MySQL/MariaDB get the naive UTC value for their `datetime(6)` column.
pub fn timestamp(backend: DbBackend, at: DateTime<Utc>) -> Value {
    match backend {
        DbBackend::MySql => Value::from(at.naive_utc()),
        _ => Value::from(at),
    }
}

/// Runs `sql` with `values` and returns the first column of its one row as an i64.
pub async fn scalar(
    conn: &impl ConnectionTrait,
    sql: &str,
    values: Vec<Value>,
) -> Result<i64, BoxError> {
    let backend = conn.get_database_backend();
    let row = conn
        .query_one_raw(Statement::from_sql_and_values(backend, sql, values))
        .await?
        .ok_or_else(|| format!("no row from {sql}"))?;
    Ok(row.try_get_by_index::<i64>(0)?)
}

/// Creates one account per worker, so no two workers credit the same row: `base` then
/// measures the database, not a lock queue on a single account.
pub async fn create_accounts(conn: &impl ConnectionTrait, accounts: usize) -> Result<(), BoxError> {
    conn.execute_unprepared(
        "CREATE TABLE bench_account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
    )
    .await?;
    let rows = (1..=accounts)
        .map(|id| format!("({id}, 0)"))
        .collect::<Vec<_>>()
        .join(", ");
    conn.execute_unprepared(&format!(
        "INSERT INTO bench_account (id, balance) VALUES {rows}"
    ))
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database_and_keeps_the_query() {
        assert_eq!(
            with_database("postgres://u@h:5432/test?sslmode=disable", "b"),
            "postgres://u@h:5432/b?sslmode=disable"
        );
        assert_eq!(
            with_database("mysql://root@h:3306", "b"),
            "mysql://root@h:3306/b"
        );
    }
}
