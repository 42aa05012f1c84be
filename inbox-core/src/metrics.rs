use std::sync::atomic::{AtomicU64, Ordering};

/// In-process counters of one [`Inbox`](crate::Inbox) (shared by its clones).
///
/// Read them with [`snapshot`](Self::snapshot) and export them to your metrics system.
///
/// ```
/// let inbox = sea_orm_inbox::Inbox::new("billing").unwrap();
/// let counts = inbox.metrics().snapshot();
/// assert_eq!(counts.processed, 0);
/// ```
#[derive(Debug, Default)]
pub struct InboxMetrics {
    processed: AtomicU64,
    duplicates: AtomicU64,
    transient_retries: AtomicU64,
    handler_errors: AtomicU64,
    failures: AtomicU64,
    refused: AtomicU64,
}

/// A point-in-time copy of [`InboxMetrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Messages claimed, handled and committed.
    pub processed: u64,
    /// Deliveries recognised as already processed.
    pub duplicates: u64,
    /// Attempts restarted after a transient database failure.
    pub transient_retries: u64,
    /// Handler errors (the transaction rolled back; the message should be nacked).
    pub handler_errors: u64,
    /// Calls that ended in a database or input error, retries exhausted included.
    pub failures: u64,
    /// Deliveries the admission floor refused (to dead-letter).
    pub refused: u64,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Processed,
    Duplicate,
    TransientRetry,
    HandlerError,
    Failure,
    Refused,
}

impl InboxMetrics {
    pub(crate) fn count(&self, counter: Counter) {
        let cell = match counter {
            Counter::Processed => &self.processed,
            Counter::Duplicate => &self.duplicates,
            Counter::TransientRetry => &self.transient_retries,
            Counter::HandlerError => &self.handler_errors,
            Counter::Failure => &self.failures,
            Counter::Refused => &self.refused,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }

    /// The current counts.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            transient_retries: self.transient_retries.load(Ordering::Relaxed),
            handler_errors: self.handler_errors.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

/// The names under which the crate reports through the [`metrics`](https://docs.rs/metrics)
/// facade when its `metrics` feature is on, after OpenTelemetry's messaging conventions
/// where one fits. A Prometheus exporter writes the dots as underscores
/// (`messaging_process_duration`).
///
/// ```
/// use sea_orm_inbox::metric_names;
///
/// assert_eq!(metric_names::CONSUMED_MESSAGES, "messaging.client.consumed.messages");
/// ```
pub mod metric_names {
    /// Counter: deliveries that `Inbox::process` settled, labelled by
    /// [`CONSUMER_LABEL`] and [`OUTCOME_LABEL`] (`processed`, `duplicate`,
    /// `handler_error`, `failed`, `retries_exhausted`, `refused`).
    pub const CONSUMED_MESSAGES: &str = "messaging.client.consumed.messages";
    /// Histogram, seconds: one `Inbox::process` call from start to settlement, retries
    /// included, labelled by [`CONSUMER_LABEL`] and [`OUTCOME_LABEL`].
    pub const PROCESS_DURATION: &str = "messaging.process.duration";
    /// Histogram, seconds: how long the claim (the marker INSERT) of one attempt took,
    /// which is mostly the wait behind another replica holding the same message. Labelled
    /// by [`CONSUMER_LABEL`].
    pub const CLAIM_WAIT: &str = "inbox.claim.wait.duration";
    /// Counter: attempts restarted after a transient database failure, labelled by
    /// [`CONSUMER_LABEL`].
    pub const TRANSIENT_RETRIES: &str = "inbox.transient_retries";
    /// Counter: inbox rows deleted by the retention purge.
    pub const PURGED_ROWS: &str = "inbox.purge.deleted_rows";
    /// Label: the consumer name (OpenTelemetry's consumer group).
    pub const CONSUMER_LABEL: &str = "messaging.consumer.group.name";
    /// Label: how the delivery was settled.
    pub const OUTCOME_LABEL: &str = "inbox.outcome";
    /// Counter: outbox messages a relay published and marked sent.
    pub const OUTBOX_PUBLISHED: &str = "outbox.published";
    /// Counter: failed outbox publishes (each retried later, or parked as dead).
    pub const OUTBOX_FAILED: &str = "outbox.failed";
    /// Counter: outbox messages parked as dead.
    pub const OUTBOX_DEAD: &str = "outbox.dead";
}

/// Reports to the `metrics` facade; without the `metrics` feature every call is a no-op the
/// compiler removes, so callers never look at the feature.
#[cfg(feature = "metrics")]
pub(crate) mod facade {
    use super::metric_names::*;
    use std::time::Duration;

    pub(crate) fn settled(consumer: &str, outcome: &'static str, took: Duration) {
        let labels = [
            (CONSUMER_LABEL, consumer.to_owned()),
            (OUTCOME_LABEL, outcome.to_owned()),
        ];
        metrics::counter!(CONSUMED_MESSAGES, &labels).increment(1);
        metrics::histogram!(PROCESS_DURATION, &labels).record(took.as_secs_f64());
    }

    pub(crate) fn claim_wait(consumer: &str, took: Duration) {
        metrics::histogram!(CLAIM_WAIT, CONSUMER_LABEL => consumer.to_owned())
            .record(took.as_secs_f64());
    }

    pub(crate) fn transient_retry(consumer: &str) {
        metrics::counter!(TRANSIENT_RETRIES, CONSUMER_LABEL => consumer.to_owned()).increment(1);
    }

    pub(crate) fn purged(rows: u64) {
        metrics::counter!(PURGED_ROWS).increment(rows);
    }

    pub(crate) fn outbox_relayed(published: u64, failed: u64, dead: u64) {
        metrics::counter!(OUTBOX_PUBLISHED).increment(published);
        metrics::counter!(OUTBOX_FAILED).increment(failed);
        metrics::counter!(OUTBOX_DEAD).increment(dead);
    }
}

#[cfg(not(feature = "metrics"))]
pub(crate) mod facade {
    use std::time::Duration;

    pub(crate) fn settled(_consumer: &str, _outcome: &'static str, _took: Duration) {}

    pub(crate) fn claim_wait(_consumer: &str, _took: Duration) {}

    pub(crate) fn transient_retry(_consumer: &str) {}

    pub(crate) fn purged(_rows: u64) {}

    pub(crate) fn outbox_relayed(_published: u64, _failed: u64, _dead: u64) {}
}
