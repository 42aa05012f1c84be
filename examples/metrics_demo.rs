//! The Prometheus demo: one consumer with the `metrics` feature consumes a stream in which
//! every message arrives twice and some handlers fail once, under the Prometheus recorder;
//! the `prometheus` example prints the scrape and the metrics test checks its counts.

use crate::{credit_account, reset_account};
use metrics_exporter_prometheus::{BuildError, PrometheusBuilder, PrometheusHandle};
use sea_orm::{DatabaseConnection, DbErr};
use sea_orm_inbox::{Inbox, Outcome, ProcessError};

/// Installs the Prometheus recorder as the process's global `metrics` recorder, without
/// an HTTP listener: serve [`PrometheusHandle::render`] from your own `/metrics` route.
/// Fails when a recorder is already installed.
pub fn install_prometheus() -> Result<PrometheusHandle, BuildError> {
    PrometheusBuilder::new().install_recorder()
}

/// What [`consume_stream`] delivered, so a reader of the scrape knows what to expect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamCounts {
    /// Distinct messages, each processed once.
    pub messages: u64,
    /// Redeliveries of processed messages: duplicates.
    pub duplicates: u64,
    /// First deliveries whose handler failed (nacked, then redelivered and processed).
    pub handler_errors: u64,
}

/// Consumes `messages` messages for `consumer` on `db` (migrated, with the demo account):
/// every fifth fails in its handler on the first delivery and is redelivered, and every
/// message is delivered once more after it was processed.
pub async fn consume_stream(
    db: &DatabaseConnection,
    consumer: &str,
    messages: u64,
) -> Result<StreamCounts, Box<dyn std::error::Error + Send + Sync>> {
    reset_account(db).await?;
    let inbox = Inbox::new(consumer)?;
    let mut counts = StreamCounts::default();
    for n in 0..messages {
        let id = uuid::Uuid::new_v4();
        if n % 5 == 0 {
            let failed = inbox
                .process(db, id, |_txn| {
                    Box::pin(async { Err::<(), _>(DbErr::Custom("injected failure".into())) })
                })
                .await;
            if !matches!(failed, Err(ProcessError::Handler(_))) {
                return Err(
                    format!("message {n}: expected a handler error, got {failed:?}").into(),
                );
            }
            counts.handler_errors += 1;
        }
        for expected in [Outcome::Processed(()), Outcome::Duplicate] {
            let outcome = inbox
                .process(db, id, |txn| Box::pin(credit_account(txn, 1)))
                .await
                .map_err(|err| format!("message {n}: {err}"))?;
            if outcome != expected {
                return Err(format!("message {n}: expected {expected:?}, got {outcome:?}").into());
            }
        }
        counts.messages += 1;
        counts.duplicates += 1;
    }
    Ok(counts)
}
