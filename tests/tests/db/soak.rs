//! The soak: 8 replicas (a pool and an `Inbox` each) consume 20,000 messages from an
//! at-least-once broker that delivers 30 % of them twice (the duplicate lands a few
//! messages after the original, so replicas race for it) and whose handler fails once for
//! 5 % of them (nacked and redelivered). Effects == distinct messages, zero lost, zero
//! applied twice; the counts are printed (`--nocapture`, or to the file named by
//! `INBOX_SOAK_REPORT`).

use inbox_tests::{
    Backend, Broker, Plan, append_to_soak_report, assert_exactly_once, create_effects,
    on_every_backend, run_replicas, with_migrated_db,
};
use std::time::Duration;

const REPLICAS: usize = 8;
const MESSAGES: usize = 20_000;
const DUPLICATE_PERCENT: usize = 30;
const FAILURE_PERCENT: usize = 5;

async fn soak_8_replicas_20000_messages(backend: Backend) {
    with_migrated_db(backend, async |db| {
        let messages = std::env::var("INBOX_SOAK_MESSAGES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(MESSAGES);
        let conn = db.connect().await;
        create_effects(&conn).await;
        let plan = Plan::new(messages, DUPLICATE_PERCENT, FAILURE_PERCENT, 0x5eed);
        let broker = Broker::new(&plan.deliveries);

        let report = run_replicas(db, &broker, &plan, REPLICAS, Duration::from_secs(900)).await;
        let line = format!("soak on {backend:?}, {REPLICAS} replicas: {report}");
        println!("{line}");
        append_to_soak_report(&line);
        assert_exactly_once(&conn, &plan, &report).await;
        assert_eq!(report.processed, messages as u64, "{report}");
        assert_eq!(
            report.broker.deliveries,
            (messages + plan.duplicated.len() + plan.failing.len()) as u64,
            "one extra delivery per duplicate and per injected failure, none for anything else: {report}"
        );
    })
    .await;
}

on_every_backend!(soak_8_replicas_20000_messages);
