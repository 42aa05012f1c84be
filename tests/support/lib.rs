//! Test support: one isolated database per test on SQLite, PostgreSQL and MariaDB/MySQL.
//!
//! SQLite always runs, on a file in a fresh temporary directory. The server suites run when
//! their URL is set (the URL of an existing database the test user may create databases
//! from): `INBOX_TEST_POSTGRES_URL`, e.g. `postgres://postgres@127.0.0.1:5432/test`, and
//! `INBOX_TEST_MYSQL_URL`, e.g. `mysql://root@127.0.0.1:3306/test`, and
//! `INBOX_TEST_PGBOUNCER_URL`, PostgreSQL through PgBouncer in transaction pooling mode
//! (`tests/cluster/pgbouncer.sh start` prints it). A set URL that cannot be reached fails
//! the test; it never skips. Each test creates its own database with a
//! unique name, so tests run in parallel and on servers that earlier runs left dirty.
//! A test runs its body in [`with_migrated_db`] (or [`with_fresh_db`],
//! [`with_migrated_outbox_db`], [`with_db`]), which drops that database afterwards, also
//! when the body fails.
//!
//! # Tests that cannot run are ignored, never passed
//!
//! `tests/build.rs` turns each suite's variable into a cfg at build time
//! (`INBOX_TEST_POSTGRES_URL` -> `inbox_postgres`, `INBOX_TEST_MYSQL_URL` -> `inbox_mysql`,
//! `INBOX_TEST_AMQP_URL` -> `inbox_amqp`, `INBOX_TEST_NATS_URL` -> `inbox_nats`), and a test
//! whose cfg is missing is compiled `#[ignore = "set ..."]`: `cargo test` lists it as
//! `ignored, set INBOX_TEST_...` and counts it apart. [`on_every_backend!`] and
//! [`on_server_backends!`] do this for the database suites. To gate a new suite on a new
//! variable:
//!
//! 1. add a `Gate` row (variable, cfg) to `tests/build.rs`; it declares the cfg for
//!    `unexpected_cfgs` and makes cargo rebuild the tests when the variable changes;
//! 2. mark the tests `#[cfg_attr(not(inbox_x), ignore = "set INBOX_TEST_X")]`,
//!    or pass `needs(inbox_x, "set INBOX_TEST_X")` to the macros;
//! 3. in the test, read the variable and panic if it is missing (that happens only under
//!    `--ignored`): never return early, which would report a test that ran nothing as ok.
//!
//! The cluster suites (Galera, PgBouncer, failover, Patroni) and the PostgreSQL restart are
//! always `#[ignore]`d, with the script that runs them as the reason; their CI scripts run
//! them with `--ignored`, and each reads its variable at run time and fails without it.
//! The Galera suite reads `INBOX_TEST_GALERA_URLS` (see [`migrated_galera_db`]).

use futures_util::FutureExt;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend,
    Statement, TransactionSession, TransactionTrait, TryGetable,
};
use sea_orm_inbox::{
    CLAIM_TRANSACTION, Claim, ClaimedMessage, InboxTransactionExt, for_transaction_pooler,
};
use sea_orm_inbox_migration::Migrator;
use sea_orm_migration::MigratorTrait;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

mod child_relay;
mod cut_proxy;
mod galera;
pub mod kafka;
mod outbox;
mod proxy;
pub mod scenario;
mod stream;
pub use child_relay::{StopsAfterConfirms, run_and_kill_child_relay};
pub use cut_proxy::CutProxy;
pub use galera::{GALERA_URLS_VAR, GaleraDb, galera_script, migrated_galera_db, with_galera_db};
pub use outbox::RecordingPublisher;
pub use proxy::{LostReplyProxy, ProxiedDb, SentStatement, with_proxied_db};
pub use stream::{
    Broker, BrokerStats, HandlerError, Plan, Report, STREAM_CONSUMER, XorShift,
    assert_exactly_once, create_effects, run_replicas, run_replicas_on,
};

/// The database servers a test can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    MySql,
    /// PostgreSQL behind PgBouncer in transaction pooling mode: every pool is configured
    /// with [`for_transaction_pooler`], and migrations run in one transaction.
    PgBouncer,
}

impl Backend {
    fn server_url_var(self) -> Option<&'static str> {
        match self {
            Backend::Sqlite => None,
            Backend::Postgres => Some("INBOX_TEST_POSTGRES_URL"),
            Backend::MySql => Some("INBOX_TEST_MYSQL_URL"),
            Backend::PgBouncer => Some("INBOX_TEST_PGBOUNCER_URL"),
        }
    }

    /// PostgreSQL, directly or through a pooler: the same server behaviour.
    pub fn is_postgres(self) -> bool {
        matches!(self, Backend::Postgres | Backend::PgBouncer)
    }
}

/// A database of the test's own, dropped by [`TestDb::cleanup`].
pub struct TestDb {
    pub backend: Backend,
    url: String,
    server: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

/// Creates a fresh, empty database for one test.
///
/// Panics when the backend's server URL is not set: the test should have been compiled
/// `#[ignore]`d (see [`on_every_backend!`]); this is reached only with `--ignored`.
pub async fn fresh_db(backend: Backend) -> TestDb {
    match backend.server_url_var() {
        None => {
            let dir = tempfile::tempdir().expect("create a temporary directory");
            let url = format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("test.sqlite").display()
            );
            TestDb {
                backend,
                url,
                server: None,
                _dir: Some(dir),
            }
        }
        Some(var) => {
            let admin_url = std::env::var(var)
                .unwrap_or_else(|_| panic!("set {var} to run the {backend:?} suite"));
            fresh_db_at(backend, &admin_url).await
        }
    }
}

/// Creates a fresh, empty database on the server `admin_url` points at (a server of the
/// test's own, e.g. a cluster it started), failing when the server cannot be reached.
pub async fn fresh_db_at(backend: Backend, admin_url: &str) -> TestDb {
    let name = format!("inbox_t_{}", uuid::Uuid::new_v4().simple());
    let admin = Database::connect(admin_url)
        .await
        .unwrap_or_else(|e| panic!("{admin_url} is set but unreachable: {e}"));
    run(&admin, &format!("CREATE DATABASE {name}")).await;
    admin.close().await.ok();
    TestDb {
        backend,
        url: replace_database(admin_url, &name),
        server: Some((admin_url.to_owned(), name)),
        _dir: None,
    }
}

/// A fresh database with the inbox migration applied.
pub async fn migrated_db(backend: Backend) -> TestDb {
    let db = fresh_db(backend).await;
    db.migrate().await;
    db
}

/// A fresh database with the inbox migrations and then `CreateOutbox`
/// (`MigratorWithOutbox`).
pub async fn migrated_outbox_db(backend: Backend) -> TestDb {
    let db = migrated_db(backend).await;
    let conn = db.connect().await;
    // Behind a transaction pooler the migrator needs a transaction (see `migrate`).
    let txn = conn.begin().await.expect("begin CreateOutbox");
    sea_orm_inbox_migration::MigratorWithOutbox::up(&txn, None)
        .await
        .expect("run CreateOutbox");
    txn.commit().await.expect("commit CreateOutbox");
    conn.close().await.ok();
    db
}

/// Runs `body` on `db`, then drops the database, also when `body` panics (a failed
/// assertion): the panic resumes after the cleanup, so the test still fails with its own
/// message and the server keeps no database of a failed run.
pub async fn with_db<T>(db: TestDb, body: impl AsyncFnOnce(&TestDb) -> T) -> T {
    let outcome = AssertUnwindSafe(body(&db)).catch_unwind().await;
    db.cleanup().await;
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Runs `body` on a fresh, empty database of `backend` and drops it afterwards (see
/// [`with_db`]).
pub async fn with_fresh_db<T>(backend: Backend, body: impl AsyncFnOnce(&TestDb) -> T) -> T {
    with_db(fresh_db(backend).await, body).await
}

/// Runs `body` on a fresh database with the inbox migration applied and drops it
/// afterwards (see [`with_db`]).
pub async fn with_migrated_db<T>(backend: Backend, body: impl AsyncFnOnce(&TestDb) -> T) -> T {
    with_db(migrated_db(backend).await, body).await
}

/// Runs `body` on a fresh database with the inbox and outbox migrations applied and
/// drops it afterwards (see [`with_db`]).
pub async fn with_migrated_outbox_db<T>(
    backend: Backend,
    body: impl AsyncFnOnce(&TestDb) -> T,
) -> T {
    with_db(migrated_outbox_db(backend).await, body).await
}

fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match base[authority_end..].find('/') {
        Some(slash) => &base[..authority_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{name}?{query}"),
        None => format!("{base}/{name}"),
    }
}

impl TestDb {
    /// The database's URL: for another process (a child relay the test kills) to connect
    /// with [`connect_url`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A new connection pool to this database: one per replica in race tests.
    pub async fn connect(&self) -> DatabaseConnection {
        self.connect_with(5).await
    }

    /// A new pool with at most `max_connections` connections (SQLite: always 1 writer).
    pub async fn connect_with(&self, max_connections: u32) -> DatabaseConnection {
        connect_pool(&self.url, self.backend, max_connections).await
    }

    /// A pool of at most `max_connections` whose options `configure` adjusts last (a
    /// helper of the library under test, say).
    pub async fn connect_configured(
        &self,
        max_connections: u32,
        configure: impl FnOnce(&mut ConnectOptions),
    ) -> DatabaseConnection {
        connect_pool_with(&self.url, self.backend, max_connections, configure).await
    }

    /// This database's URL at another address of the same server or cluster, e.g. the
    /// server itself behind the pooler the test's pools go through.
    pub fn url_at(&self, server_url: &str) -> String {
        match &self.server {
            Some((_, name)) => replace_database(server_url, name),
            None => self.url.clone(),
        }
    }

    /// A pool to this database through another address of the same server or cluster,
    /// e.g. one node's own port instead of the proxy in front of the nodes.
    pub async fn connect_at(&self, server_url: &str, max_connections: u32) -> DatabaseConnection {
        connect_pool(&self.url_at(server_url), self.backend, max_connections).await
    }

    /// Applies the inbox migration.
    pub async fn migrate(&self) {
        let conn = self.connect().await;
        if self.backend == Backend::PgBouncer {
            // The migrator's own bookkeeping reads run outside a transaction, which a
            // transaction pooler does not support for prepared statements: give it one.
            let txn = conn.begin().await.expect("begin the migration");
            Migrator::up(&txn, None)
                .await
                .expect("run the inbox migration");
            txn.commit().await.expect("commit the migration");
        } else {
            Migrator::up(&conn, None)
                .await
                .expect("run the inbox migration");
        }
        conn.close().await.ok();
    }

    /// Drops the test's database (SQLite: its directory goes with `self`).
    pub async fn cleanup(self) {
        if let Some((admin_url, name)) = &self.server {
            let admin = Database::connect(admin_url)
                .await
                .expect("reconnect to drop the test database");
            let drop = match self.backend {
                Backend::Postgres | Backend::PgBouncer => {
                    format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                }
                _ => format!("DROP DATABASE IF EXISTS {name}"),
            };
            // A loaded MariaDB now and then fails the DROP with 1010 (errno 39, "Directory
            // not empty") and leaves the database half dropped; dropping it again finishes.
            let mut attempt = 1;
            while let Err(err) = admin.execute_unprepared(&drop).await {
                let retry = self.backend == Backend::MySql && err.to_string().contains("1010");
                assert!(retry && attempt < 5, "{drop}: {err}");
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            admin.close().await.ok();
        }
    }
}

/// A pool of at most `max_connections` to a test database's [`TestDb::url`], from another
/// process (a child the test runs); the backend is read from the URL's scheme.
pub async fn connect_url(url: &str, max_connections: u32) -> DatabaseConnection {
    let backend = match url.split_once("://").map(|(scheme, _)| scheme) {
        Some("sqlite") => Backend::Sqlite,
        Some("postgres" | "postgresql") => Backend::Postgres,
        Some("mysql" | "mariadb") => Backend::MySql,
        _ => panic!("{url}: not a test database URL (sqlite, postgres or mysql)"),
    };
    connect_pool(url, backend, max_connections).await
}

/// How many times SQLite prepared again, at a run, the statements of `conn`'s connection
/// whose SQL contains `sql` (SQLite's `SQLITE_STMTSTATUS_REPREPARE`, summed). `conn` must be
/// a SQLite pool of one connection ([`TestDb::connect_with`]`(1)`), so the statements the
/// library ran are the ones counted. SQLite prepares a statement again at each run after a
/// parameter whose value may change the plan was bound (a bare `LIMIT ?`): sqlx keeps the
/// statement, so a statement the library runs repeatedly should count 0.
pub async fn sqlite_reprepares(conn: &DatabaseConnection, sql: &str) -> u32 {
    use libsqlite3_sys::{
        SQLITE_STMTSTATUS_REPREPARE, sqlite3_next_stmt, sqlite3_sql, sqlite3_stmt_status,
    };
    let mut pooled = conn
        .get_sqlite_connection_pool()
        .acquire()
        .await
        .expect("the pool's connection");
    let mut handle = pooled.lock_handle().await.expect("lock the SQLite handle");
    let db = handle.as_raw_handle().as_ptr();
    let mut reprepares = 0;
    // SAFETY: `db` is the open connection `handle` keeps locked for this block, so sqlx's
    // worker cannot prepare or finalize a statement meanwhile: the statements
    // `sqlite3_next_stmt` lists stay alive, and `sqlite3_sql` returns their text as a
    // NUL-terminated string each owns, read before the next call.
    unsafe {
        let mut stmt = sqlite3_next_stmt(db, std::ptr::null_mut());
        while !stmt.is_null() {
            let text = sqlite3_sql(stmt);
            if !text.is_null()
                && std::ffi::CStr::from_ptr(text)
                    .to_string_lossy()
                    .contains(sql)
            {
                let count = sqlite3_stmt_status(stmt, SQLITE_STMTSTATUS_REPREPARE, 0);
                reprepares += u32::try_from(count).expect("a count");
            }
            stmt = sqlite3_next_stmt(db, stmt);
        }
    }
    reprepares
}

/// Appends `line` to the file `INBOX_SOAK_REPORT` names, if set: CI sets it so a soak's
/// counts reach its log without `--nocapture`.
pub fn append_to_soak_report(line: &str) {
    use std::io::Write;
    let Ok(path) = std::env::var("INBOX_SOAK_REPORT") else {
        return;
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("open {path}: {e}"));
    writeln!(file, "{line}").unwrap_or_else(|e| panic!("write {path}: {e}"));
}

/// A new pool to `url` with at most `max_connections` connections (SQLite: always 1
/// writer).
async fn connect_pool(url: &str, backend: Backend, max_connections: u32) -> DatabaseConnection {
    connect_pool_with(url, backend, max_connections, |_| {}).await
}

async fn connect_pool_with(
    url: &str,
    backend: Backend,
    max_connections: u32,
    configure: impl FnOnce(&mut ConnectOptions),
) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url.to_owned());
    let max = if backend == Backend::Sqlite {
        1
    } else {
        max_connections
    };
    options
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if backend == Backend::PgBouncer {
        for_transaction_pooler(&mut options);
    }
    configure(&mut options);
    let conn = Database::connect(options)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    if backend == Backend::Sqlite {
        // Many replicas share one file: let writers queue instead of failing at once.
        run(&conn, "PRAGMA busy_timeout = 60000").await;
    }
    conn
}

/// Runs one SQL statement, panicking with the statement on failure.
pub async fn run(conn: &impl ConnectionTrait, sql: &str) {
    conn.execute_unprepared(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Reads one value (`COUNT(*)`, a balance, a setting as text) from the first column of the
/// first row, in a transaction of its own (a savepoint inside one), as a transaction pooler
/// needs.
pub async fn scalar<T: TryGetable>(
    conn: &(impl ConnectionTrait + TransactionTrait),
    sql: &str,
) -> T {
    let txn = conn
        .begin()
        .await
        .unwrap_or_else(|e| panic!("{sql}: begin: {e}"));
    let row = txn
        .query_one_raw(Statement::from_string(conn.get_database_backend(), sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or_else(|| panic!("{sql}: no row"));
    txn.commit()
        .await
        .unwrap_or_else(|e| panic!("{sql}: commit: {e}"));
    row.try_get_by_index::<T>(0)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// [`scalar`] for the integers most tests count.
pub async fn scalar_i64(conn: &(impl ConnectionTrait + TransactionTrait), sql: &str) -> i64 {
    scalar(conn, sql).await
}

/// Builds a statement with `?` placeholders rewritten to `$n` on PostgreSQL.
pub fn stmt(backend: DbBackend, sql: &str, values: Vec<sea_orm::Value>) -> Statement {
    let sql = if backend == DbBackend::Postgres {
        let mut out = String::with_capacity(sql.len() + 8);
        let mut n = 0;
        for ch in sql.chars() {
            if ch == '?' {
                n += 1;
                out.push_str(&format!("${n}"));
            } else {
                out.push(ch);
            }
        }
        out
    } else {
        sql.to_owned()
    };
    Statement::from_sql_and_values(backend, sql, values)
}

/// A table of accounts for handlers to credit, with one account (id 1, balance 0).
pub async fn create_accounts(conn: &impl ConnectionTrait) {
    run(
        conn,
        "CREATE TABLE account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
    )
    .await;
    run(conn, "INSERT INTO account (id, balance) VALUES (1, 0)").await;
}

/// A pool to `db` with account 1 (balance 0) and an audit table already holding row 1,
/// which a handler's audit INSERT of 1 then violates.
pub async fn accounts_and_audit_row(db: &TestDb) -> DatabaseConnection {
    let conn = db.connect().await;
    create_accounts(&conn).await;
    run(&conn, "CREATE TABLE audit (ref BIGINT PRIMARY KEY)").await;
    run(&conn, "INSERT INTO audit (ref) VALUES (1)").await;
    conn
}

/// The markers in the inbox and the balance of account 1, read through `conn`.
pub async fn committed(conn: &(impl ConnectionTrait + TransactionTrait)) -> (i64, i64) {
    (
        scalar_i64(conn, "SELECT COUNT(*) FROM inbox").await,
        scalar_i64(conn, "SELECT balance FROM account WHERE id = 1").await,
    )
}

/// Adds `amount` to account 1 through `conn` (pass the transaction, not the pool).
pub async fn credit(conn: &impl ConnectionTrait, amount: i64) -> Result<(), sea_orm::DbErr> {
    let backend = conn.get_database_backend();
    conn.execute_raw(stmt(
        backend,
        "UPDATE account SET balance = balance + ? WHERE id = 1",
        vec![amount.into()],
    ))
    .await
    .map(|_| ())
}

/// One delivery of `id` through `inbox.process` whose handler credits account 1 by one.
pub async fn credit_once(
    inbox: &sea_orm_inbox::Inbox,
    db: &DatabaseConnection,
    id: uuid::Uuid,
) -> Result<sea_orm_inbox::Outcome<()>, sea_orm_inbox::ProcessError<sea_orm::DbErr>> {
    inbox
        .process(db, id, |txn| Box::pin(async move { credit(txn, 1).await }))
        .await
}

/// A pool of one connection whose lock waits give up quickly, so a claim blocked by
/// another transaction fails with the backend's transient lock error.
pub async fn impatient_replica(db: &TestDb) -> DatabaseConnection {
    let conn = db.connect_with(1).await;
    let setting = match db.backend {
        Backend::Postgres => "SET lock_timeout = '150ms'",
        Backend::MySql => "SET SESSION innodb_lock_wait_timeout = 1",
        Backend::Sqlite => "PRAGMA busy_timeout = 150",
        Backend::PgBouncer => panic!(
            "a session SET reaches whichever server connection PgBouncer lends next, not \
             this client's later transactions: set the timeout per transaction instead"
        ),
    };
    run(&conn, setting).await;
    conn
}

/// Another replica claims `id` for `consumer` and holds its transaction open for `hold`,
/// then rolls back.
pub async fn hold_claim_then_roll_back(
    db: &TestDb,
    id: uuid::Uuid,
    consumer: &str,
    hold: Duration,
) -> tokio::task::JoinHandle<()> {
    let holder = db.connect().await;
    let txn = holder
        .begin_with_options(CLAIM_TRANSACTION)
        .await
        .expect("begin holder");
    assert!(
        txn.claim_message(id, consumer)
            .await
            .expect("holder claim")
            .is_claimed()
    );
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        txn.rollback().await.expect("holder rollback");
        holder.close().await.ok();
    })
}

/// Begins a claim transaction on `conn` and claims the new message `id` for `consumer`
/// in it, panicking when the claim is not `Claimed`.
pub async fn begin_and_claim(
    conn: &DatabaseConnection,
    id: uuid::Uuid,
    consumer: &str,
) -> (DatabaseTransaction, ClaimedMessage) {
    let txn = conn
        .begin_with_options(CLAIM_TRANSACTION)
        .await
        .expect("begin");
    let Claim::Claimed(claimed) = txn.claim_message(id, consumer).await.expect("claim") else {
        panic!("a fresh message is claimed");
    };
    (txn, claimed)
}

/// Runs the fixture script `script` (a cluster's start, stop or fault) with `args` under
/// `bash`, off the async workers, failing the test when it fails; returns its stdout.
pub async fn cluster_script(script: &'static str, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let shown = args.join(" ");
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .arg(script)
            .args(&args)
            .output()
    })
    .await
    .expect("script task")
    .unwrap_or_else(|e| panic!("run {script} {shown}: {e}"));
    assert!(
        output.status.success(),
        "{script} {shown} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Defines one `#[tokio::test]` per backend calling `$body(Backend)`, in modules named
/// after the backend, so `cargo test sqlite::` or `postgres::` selects a suite.
///
/// The Postgres and MySQL tests are compiled `#[ignore]`d, with the variable to set as the
/// reason, when their URL was not set at build time (the cfgs `inbox_postgres` and
/// `inbox_mysql` come from `tests/build.rs`), so the summary counts them as ignored, not
/// passed. A suite that needs more than a database, a broker say, names the cfg and the
/// reason first: `on_every_backend!(needs(inbox_amqp, "set INBOX_TEST_AMQP_URL"); rabbitmq)`.
/// Two invocations in one file go into modules of their own (the backend modules would
/// collide).
#[macro_export]
macro_rules! on_every_backend {
    (needs($gate:ident, $reason:literal); $($name:ident),+ $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[cfg_attr(not($gate), ignore = $reason)]
            async fn $name() { super::$name($crate::Backend::Sqlite).await }
            )+
        }
        $crate::on_server_backends!(needs($gate, $reason); $($name),+);
    };
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name($crate::Backend::Sqlite).await }
            )+
        }
        $crate::on_server_backends!($($name),+);
    };
}

/// [`on_every_backend!`] without SQLite, for tests of what only a server does (a killed
/// connection, a restart, a reply lost on the network): one `#[tokio::test]` per server backend, ignored with the
/// reason when its URL (or the extra `needs` cfg) was not set at build time.
#[macro_export]
macro_rules! on_server_backends {
    (needs($gate:ident, $reason:literal); $($name:ident),+ $(,)?) => {
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[cfg_attr(not($gate), ignore = $reason)]
            #[cfg_attr(all($gate, not(inbox_postgres)), ignore = "set INBOX_TEST_POSTGRES_URL")]
            async fn $name() { super::$name($crate::Backend::Postgres).await }
            )+
        }
        mod mysql {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[cfg_attr(not($gate), ignore = $reason)]
            #[cfg_attr(all($gate, not(inbox_mysql)), ignore = "set INBOX_TEST_MYSQL_URL")]
            async fn $name() { super::$name($crate::Backend::MySql).await }
            )+
        }
    };
    ($($name:ident),+ $(,)?) => {
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[cfg_attr(not(inbox_postgres), ignore = "set INBOX_TEST_POSTGRES_URL")]
            async fn $name() { super::$name($crate::Backend::Postgres).await }
            )+
        }
        mod mysql {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[cfg_attr(not(inbox_mysql), ignore = "set INBOX_TEST_MYSQL_URL")]
            async fn $name() { super::$name($crate::Backend::MySql).await }
            )+
        }
    };
}

/// Defines `#[tokio::test]`s calling `$body(Backend::PgBouncer)` in a module `pgbouncer`:
/// the scenarios of a suite that also run through PgBouncer in transaction pooling mode
/// (when `INBOX_TEST_PGBOUNCER_URL` is set). A suite lists those of its
/// [`on_every_backend!`] scenarios that do not rely on session state or on prepared
/// statements outside a transaction, which a transaction pooler does not carry.
#[macro_export]
macro_rules! on_pgbouncer {
    ($($name:ident),+ $(,)?) => {
        mod pgbouncer {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[ignore = "cluster suite: bash tests/cluster/ci-pg.sh runs it (--ignored, with INBOX_TEST_PGBOUNCER_URL)"]
            async fn $name() { super::$name($crate::Backend::PgBouncer).await }
            )+
        }
    };
}

/// Every id `copies` times, in an order shuffled by a fixed seed (reproducible runs).
pub fn shuffled_deliveries(ids: &[uuid::Uuid], copies: usize, seed: u64) -> Vec<uuid::Uuid> {
    let mut deliveries: Vec<uuid::Uuid> = ids
        .iter()
        .flat_map(|id| std::iter::repeat_n(*id, copies))
        .collect();
    let mut rng = XorShift::new(seed);
    for i in (1..deliveries.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        deliveries.swap(i, j);
    }
    deliveries
}

/// The SQLSTATE of a database error, if it is one.
pub fn sql_state(err: &sea_orm::DbErr) -> Option<String> {
    use sea_orm::{DbErr, RuntimeErr, sqlx};
    match err {
        DbErr::Exec(RuntimeErr::SqlxError(sqlx_err))
        | DbErr::Query(RuntimeErr::SqlxError(sqlx_err)) => match sqlx_err.as_ref() {
            sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
            _ => None,
        },
        _ => None,
    }
}

/// Polls `future` `polls` times, a few milliseconds apart so the database can answer in
/// between, then drops it: whether it finished.
pub async fn poll_then_drop<F: std::future::Future>(future: F, polls: u32) -> bool {
    let mut future = std::pin::pin!(future);
    for _ in 0..polls {
        let ready =
            std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx).is_ready()))
                .await;
        if ready {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::replace_database;

    #[test]
    fn replaces_the_database_in_server_urls() {
        assert_eq!(
            replace_database("postgres://u@h:5432/test", "x"),
            "postgres://u@h:5432/x"
        );
        assert_eq!(
            replace_database("mysql://root@h:3306/test?ssl-mode=disabled", "x"),
            "mysql://root@h:3306/x?ssl-mode=disabled"
        );
        assert_eq!(
            replace_database("mysql://root@h:3306", "x"),
            "mysql://root@h:3306/x"
        );
    }
}
