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
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Processed,
    Duplicate,
    TransientRetry,
    HandlerError,
    Failure,
}

impl InboxMetrics {
    pub(crate) fn count(&self, counter: Counter) {
        let cell = match counter {
            Counter::Processed => &self.processed,
            Counter::Duplicate => &self.duplicates,
            Counter::TransientRetry => &self.transient_retries,
            Counter::HandlerError => &self.handler_errors,
            Counter::Failure => &self.failures,
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
        }
    }
}
