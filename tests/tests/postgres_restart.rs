//! The PostgreSQL server restarts while 4 replicas consume a stream with duplicates and
//! injected failures. Nobody intervenes: the pools reconnect, `Inbox::process` retries
//! transient failures in fresh transactions, and deliveries that still fail are nacked and
//! redelivered by the broker. Afterwards every message is applied exactly once and acked.
//!
//! Restarting the server disrupts every client of it, so this test runs only when
//! `INBOX_TEST_RESTART_POSTGRES=1` (CI runs it in a step of its own after the other tests):
//!
//! ```sh
//! INBOX_TEST_RESTART_POSTGRES=1 INBOX_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo test -p inbox-tests --test postgres_restart -- --ignored --nocapture
//! ```
//!
//! The restart command defaults to `pg_ctlcluster --skip-systemctl-redirect <version> main
//! restart`; set `INBOX_TEST_RESTART_POSTGRES_COMMAND` (run by `sh -c`) for another setup.

use inbox_tests::{
    Backend, Broker, Plan, assert_exactly_once, create_effects, run_replicas, with_migrated_db,
};
use std::time::{Duration, Instant};

const REPLICAS: usize = 4;
const MESSAGES: usize = 4_000;
const DEFAULT_RESTART: &str =
    "pg_ctlcluster --skip-systemctl-redirect \"$(ls /etc/postgresql)\" main restart";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "restarts the PostgreSQL server, disrupting its every client: .ci/run runs it alone (--ignored, with INBOX_TEST_RESTART_POSTGRES=1)"]
async fn replicas_recover_from_a_postgres_restart() {
    assert_eq!(
        std::env::var("INBOX_TEST_RESTART_POSTGRES").as_deref(),
        Ok("1"),
        "this test restarts the PostgreSQL server: set INBOX_TEST_RESTART_POSTGRES=1 to allow it"
    );
    with_migrated_db(Backend::Postgres, async |db| {
        let conn = db.connect().await;
        create_effects(&conn).await;
        conn.close().await.ok();
        let plan = Plan::new(MESSAGES, 30, 5, 0xfa11);
        let broker = Broker::new(&plan.deliveries);
        let command =
            std::env::var("INBOX_TEST_RESTART_POSTGRES_COMMAND").unwrap_or(DEFAULT_RESTART.into());

        let restart = {
            let broker = broker.clone();
            tokio::spawn(async move {
                broker
                    .wait_for_acks(MESSAGES as u64 / 4, Duration::from_secs(300))
                    .await;
                let before = broker.stats();
                let started = Instant::now();
                let status = tokio::task::spawn_blocking(move || {
                    std::process::Command::new("sh")
                        .arg("-c")
                        .arg(&command)
                        .status()
                })
                .await
                .expect("restart task")
                .expect("run the restart command");
                assert!(status.success(), "the restart command failed: {status}");
                (before, started.elapsed(), broker.stats())
            })
        };

        let report = run_replicas(db, &broker, &plan, REPLICAS, Duration::from_secs(600)).await;
        let (before, took, after) = restart.await.expect("the restart ran");
        println!(
            "postgres restart after {} acks (took {took:.1?}; {} pending when it was back); \
             {REPLICAS} replicas: {report}",
            before.acks, after.pending
        );
        // The restart must begin mid-run. Whether work is still pending when the command
        // returns measures nothing: it returns once the server accepts connections again,
        // and on a quiet machine the replicas finished the last 3,000 messages in that
        // window (2.8 s for the whole run). The disruption itself is asserted below.
        assert!(
            before.pending > 0 && before.acked_messages < MESSAGES as u64,
            "the restart must begin in the middle of the run: {before:?}"
        );
        assert!(
            report.broker.nacks + report.transient_retries > plan.failing.len() as u64,
            "the restart disrupted some deliveries: {report}"
        );
        assert_eq!(
            report.inbox_errors, 0,
            "every failure the restart caused is classified transient (retried or nacked as such): {report}"
        );
        let conn = db.connect().await;
        assert_exactly_once(&conn, &plan, &report).await;
    })
    .await;
}
