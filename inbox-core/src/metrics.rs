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

/// How a delivery was settled, as the `inbox.outcome` label and the span's `outcome`
/// field name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    Processed,
    Duplicate,
    Refused,
    HandlerError,
    Failed,
    RetriesExhausted,
}

impl Settled {
    /// Every outcome, in the order [`facade::ConsumerKeys`] keeps their keys.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: [Settled; 6] = [
        Settled::Processed,
        Settled::Duplicate,
        Settled::Refused,
        Settled::HandlerError,
        Settled::Failed,
        Settled::RetriesExhausted,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Settled::Processed => "processed",
            Settled::Duplicate => "duplicate",
            Settled::Refused => "refused",
            Settled::HandlerError => "handler_error",
            Settled::Failed => "failed",
            Settled::RetriesExhausted => "retries_exhausted",
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
    use super::Settled;
    use super::metric_names::*;
    use metrics::{Key, Level, Metadata};
    use std::time::Duration;

    /// What the facade's macros pass with each call (this module and INFO).
    static METADATA: Metadata<'static> =
        Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

    /// The keys of one consumer's metrics, labels included, built once per `Inbox` rather
    /// than per message (two labels, their strings and the key's hash each time). Each
    /// call still asks the recorder installed at that moment, as the macros do.
    #[derive(Debug)]
    pub(crate) struct ConsumerKeys {
        /// Per outcome, in [`Settled::ALL`]'s order: the consumed counter and the
        /// duration histogram.
        settled: [(Key, Key); 6],
        claim_wait: Key,
        transient_retries: Key,
    }

    impl ConsumerKeys {
        pub(crate) fn new(consumer: &str) -> Self {
            let by_consumer = |name: &'static str| {
                Key::from_parts(name, &[(CONSUMER_LABEL, consumer.to_owned())])
            };
            Self {
                settled: Settled::ALL.map(|outcome| {
                    let labels = [
                        (CONSUMER_LABEL, consumer.to_owned()),
                        (OUTCOME_LABEL, outcome.label().to_owned()),
                    ];
                    (
                        Key::from_parts(CONSUMED_MESSAGES, &labels),
                        Key::from_parts(PROCESS_DURATION, &labels),
                    )
                }),
                claim_wait: by_consumer(CLAIM_WAIT),
                transient_retries: by_consumer(TRANSIENT_RETRIES),
            }
        }

        /// The consumed counter's and the duration histogram's keys of `outcome`.
        pub(super) fn settled(&self, outcome: Settled) -> (&Key, &Key) {
            let [
                processed,
                duplicate,
                refused,
                handler_error,
                failed,
                exhausted,
            ] = &self.settled;
            let (consumed, duration) = match outcome {
                Settled::Processed => processed,
                Settled::Duplicate => duplicate,
                Settled::Refused => refused,
                Settled::HandlerError => handler_error,
                Settled::Failed => failed,
                Settled::RetriesExhausted => exhausted,
            };
            (consumed, duration)
        }

        pub(super) fn claim_wait(&self) -> &Key {
            &self.claim_wait
        }
    }

    pub(crate) fn settled(keys: &ConsumerKeys, outcome: Settled, took: Duration) {
        let (consumed, duration) = keys.settled(outcome);
        metrics::with_recorder(|recorder| {
            recorder.register_counter(consumed, &METADATA).increment(1);
            recorder
                .register_histogram(duration, &METADATA)
                .record(took.as_secs_f64());
        });
    }

    pub(crate) fn claim_wait(keys: &ConsumerKeys, took: Duration) {
        metrics::with_recorder(|recorder| {
            recorder
                .register_histogram(keys.claim_wait(), &METADATA)
                .record(took.as_secs_f64());
        });
    }

    pub(crate) fn transient_retry(keys: &ConsumerKeys) {
        metrics::with_recorder(|recorder| {
            recorder
                .register_counter(&keys.transient_retries, &METADATA)
                .increment(1);
        });
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
    use super::Settled;
    use std::time::Duration;

    #[derive(Debug)]
    pub(crate) struct ConsumerKeys;

    impl ConsumerKeys {
        pub(crate) fn new(_consumer: &str) -> Self {
            Self
        }
    }

    pub(crate) fn settled(_keys: &ConsumerKeys, _outcome: Settled, _took: Duration) {}

    pub(crate) fn claim_wait(_keys: &ConsumerKeys, _took: Duration) {}

    pub(crate) fn transient_retry(_keys: &ConsumerKeys) {}

    pub(crate) fn purged(_rows: u64) {}

    pub(crate) fn outbox_relayed(_published: u64, _failed: u64, _dead: u64) {}
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::Settled;
    use super::facade::ConsumerKeys;
    use super::metric_names::*;

    /// The keys built once per inbox name what the macros named per message: each metric
    /// with the consumer's label and, for a settlement, its outcome.
    #[test]
    fn keys_built_once_carry_the_labels_of_each_call() {
        let keys = ConsumerKeys::new("billing");
        let labels = |key: &metrics::Key| {
            key.labels()
                .map(|label| (label.key().to_owned(), label.value().to_owned()))
                .collect::<Vec<_>>()
        };
        for outcome in [Settled::Processed, Settled::RetriesExhausted] {
            let (consumed, duration) = keys.settled(outcome);
            let expected = vec![
                (CONSUMER_LABEL.to_owned(), "billing".to_owned()),
                (OUTCOME_LABEL.to_owned(), outcome.label().to_owned()),
            ];
            assert_eq!(consumed.name(), CONSUMED_MESSAGES);
            assert_eq!(duration.name(), PROCESS_DURATION);
            assert_eq!(labels(consumed), expected);
            assert_eq!(labels(duration), expected);
        }
        assert_eq!(
            labels(keys.claim_wait()),
            vec![(CONSUMER_LABEL.to_owned(), "billing".to_owned())]
        );
        assert_eq!(keys.claim_wait().name(), CLAIM_WAIT);
    }
}
