//! A test database on a MariaDB Galera cluster: one database, reached through every node.
//!
//! The suite runs when `INBOX_TEST_GALERA_URLS` holds the nodes' URLs, comma-separated
//! (`tests/cluster/galera.sh urls` prints them). A set variable whose nodes cannot be
//! reached fails the test; it never skips.

use crate::{Backend, TestDb, replace_database, run};
use futures_util::FutureExt;
use sea_orm::{ConnectOptions, Database, DatabaseConnection};
use sea_orm_inbox_migration::Migrator;
use sea_orm_migration::MigratorTrait;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The variable naming the cluster's node URLs.
pub const GALERA_URLS_VAR: &str = "INBOX_TEST_GALERA_URLS";

/// A database of the test's own on the cluster, created through node 0 and reachable
/// through each node; dropped by [`GaleraDb::cleanup`].
pub struct GaleraDb {
    db: TestDb,
    node_urls: Vec<String>,
}

/// A migrated database on the cluster. Panics when `INBOX_TEST_GALERA_URLS` is not set:
/// the Galera tests are compiled `#[ignore]`d then, so this is reached only with
/// `--ignored`. Nodes 0 and 1 have the inbox table when it
/// returns; a test using node 2 waits for it with [`GaleraDb::wait_for_replication`]
/// (node 2 is the one the soak kills, so the other tests leave it alone).
pub async fn migrated_galera_db() -> GaleraDb {
    let urls = std::env::var(GALERA_URLS_VAR)
        .unwrap_or_else(|_| panic!("set {GALERA_URLS_VAR} to run the Galera suite"));
    let admin_urls: Vec<String> = urls
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(str::to_owned)
        .collect();
    assert!(
        admin_urls.len() >= 2,
        "{GALERA_URLS_VAR}={urls} must name at least two nodes"
    );
    let name = format!("inbox_g_{}", uuid::Uuid::new_v4().simple());
    let admin = connect_admin(&admin_urls[0]).await;
    run(&admin, &format!("CREATE DATABASE {name}")).await;
    admin.close().await.ok();
    let node_urls: Vec<String> = admin_urls
        .iter()
        .map(|url| replace_database(url, &name))
        .collect();
    let galera = GaleraDb {
        db: TestDb {
            backend: Backend::MySql,
            url: node_urls[0].clone(),
            server: Some((admin_urls[0].clone(), name)),
            _dir: None,
        },
        node_urls,
    };
    let conn = galera.connect(0).await;
    Migrator::up(&conn, None)
        .await
        .expect("run the inbox migration on node 0");
    conn.close().await.ok();
    galera.wait_for_replication(&[0, 1]).await;
    galera
}

/// Runs `body` on a [`migrated_galera_db`], then drops the database, also when `body`
/// panics (the panic resumes after the cleanup).
pub async fn with_galera_db<T>(body: impl AsyncFnOnce(&GaleraDb) -> T) -> T {
    let galera = migrated_galera_db().await;
    let outcome = AssertUnwindSafe(body(&galera)).catch_unwind().await;
    galera.cleanup().await;
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

async fn connect_admin(url: &str) -> DatabaseConnection {
    Database::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{GALERA_URLS_VAR} names {url}, which is unreachable: {e}"))
}

impl GaleraDb {
    /// How many nodes the cluster has.
    pub fn nodes(&self) -> usize {
        self.node_urls.len()
    }

    /// A new pool of at most 5 connections to `node` (0-based), with the server's default
    /// `wsrep_sync_wait` (0: reads may be stale).
    pub async fn connect(&self, node: usize) -> DatabaseConnection {
        self.connect_with(node, 5).await
    }

    /// A new pool of at most `max_connections` connections to `node` (0-based).
    pub async fn connect_with(&self, node: usize, max_connections: u32) -> DatabaseConnection {
        let url = &self.node_urls[node];
        let mut options = ConnectOptions::new(url.clone());
        options
            .max_connections(max_connections)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(30))
            .sqlx_logging(false);
        Database::connect(options)
            .await
            .unwrap_or_else(|e| panic!("connect to Galera node {node} at {url}: {e}"))
    }

    /// Waits until each of `nodes` has applied everything committed before the call (a
    /// causal read on each), so a table created through one node exists on the others.
    pub async fn wait_for_replication(&self, nodes: &[usize]) {
        for &node in nodes {
            let conn = self.connect_with(node, 1).await;
            run(&conn, "SET SESSION wsrep_sync_wait = 15").await;
            run(&conn, "SELECT COUNT(*) FROM inbox").await;
            conn.close().await.ok();
        }
    }

    /// Runs `CreateOutbox` (the inbox migrations are in) through node 0 and waits until
    /// nodes 0 and 1 have the outbox table.
    pub async fn migrate_outbox(&self) {
        let conn = self.connect(0).await;
        sea_orm_inbox_migration::MigratorWithOutbox::up(&conn, None)
            .await
            .expect("run CreateOutbox on node 0");
        conn.close().await.ok();
        for node in [0, 1] {
            let conn = self.connect_with(node, 1).await;
            run(&conn, "SET SESSION wsrep_sync_wait = 15").await;
            run(&conn, "SELECT COUNT(*) FROM outbox").await;
            conn.close().await.ok();
        }
    }

    /// Drops the test's database.
    pub async fn cleanup(self) {
        self.db.cleanup().await;
    }
}

/// Runs `tests/cluster/galera.sh` with `args` (e.g. `["kill", "3"]`), failing the test
/// when it fails. Node numbers there are 1-based.
pub fn galera_script(args: &[&str]) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster/galera.sh");
    let output = Command::new("bash")
        .arg(&script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{} {args:?} failed: {stdout}{}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}
