//! Prometheus: with the `metrics` feature, a consumer's outcomes, process
//! durations and claim waits reach a Prometheus scrape with no glue. One test in this
//! binary: the recorder is process-global.

use inbox_examples::metrics_demo::{StreamCounts, consume_stream, install_prometheus};
use inbox_tests::{Backend, with_migrated_db};

const CONSUMER: &str = "billing.credit";

/// The value of the sample `name{labels}` in a Prometheus text scrape.
fn sample(scrape: &str, name: &str, labels: &str) -> Option<f64> {
    let key = format!("{name}{{{labels}}} ");
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(&key))
        .and_then(|value| value.trim().parse().ok())
}

#[tokio::test]
async fn a_prometheus_scrape_counts_every_outcome() {
    let prometheus = install_prometheus().expect("no other recorder in this test binary");
    with_migrated_db(Backend::Sqlite, async |db| {
        let conn = db.connect().await;
        let counts = consume_stream(&conn, CONSUMER, 20)
            .await
            .expect("the stream");
        assert_eq!(
            counts,
            StreamCounts {
                messages: 20,
                duplicates: 20,
                handler_errors: 4
            }
        );
        let scrape = prometheus.render();
        let consumer = format!("messaging_consumer_group_name=\"{CONSUMER}\"");
        for (outcome, expected) in [
            ("processed", counts.messages),
            ("duplicate", counts.duplicates),
            ("handler_error", counts.handler_errors),
        ] {
            let labels = format!("{consumer},inbox_outcome=\"{outcome}\"");
            assert_eq!(
                sample(&scrape, "messaging_client_consumed_messages", &labels),
                Some(expected as f64),
                "{outcome} in\n{scrape}"
            );
            assert_eq!(
                sample(&scrape, "messaging_process_duration_count", &labels),
                Some(expected as f64),
                "{outcome} durations in\n{scrape}"
            );
        }
        // Every attempt claims once: processed + duplicate + failed first deliveries.
        let claims = counts.messages + counts.duplicates + counts.handler_errors;
        assert_eq!(
            sample(&scrape, "inbox_claim_wait_duration_count", &consumer),
            Some(claims as f64),
            "claim waits in\n{scrape}"
        );
        assert_eq!(
            sample(&scrape, "inbox_transient_retries", &consumer),
            None,
            "nothing was retried:\n{scrape}"
        );
    })
    .await;
}
