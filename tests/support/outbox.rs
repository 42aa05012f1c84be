//! A stand-in broker for the outbox's cluster suites: it confirms every publish (after a
//! set latency) and counts the publishes of each message id, so a test can tell
//! "published once" from "published again with the same id" after the run.

use sea_orm_inbox::{MessageId, OutboxMessage, PublishError, Publisher};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Records the message id of every confirmed publish, in order.
#[derive(Default)]
pub struct RecordingPublisher {
    published: Mutex<Vec<MessageId>>,
    latency: Duration,
    /// A payload the broker refuses (a transient failure, recorded nowhere) until `cured`.
    poison: Option<Vec<u8>>,
    cured: AtomicBool,
}

impl RecordingPublisher {
    /// A publisher whose every confirmation takes `latency`, as a broker's round trip does.
    pub fn with_latency(latency: Duration) -> Self {
        Self {
            latency,
            ..Self::default()
        }
    }

    /// A publisher that fails every publish of `payload` as transient until [`cure`](Self::cure):
    /// a poison message, parked as dead after the relay's attempts.
    pub fn refusing(payload: &[u8]) -> Self {
        Self {
            poison: Some(payload.to_vec()),
            ..Self::default()
        }
    }

    /// Accepts the poison payload from now on (the operator fixed its cause).
    pub fn cure(&self) {
        self.cured.store(true, Ordering::SeqCst);
    }

    /// Every publish so far, in order (repeats included).
    pub fn published(&self) -> Vec<MessageId> {
        self.published.lock().expect("recorder lock").clone()
    }

    /// How many times each message id was published.
    pub fn counts(&self) -> HashMap<MessageId, u32> {
        let mut counts = HashMap::new();
        for id in self.published() {
            *counts.entry(id).or_default() += 1;
        }
        counts
    }
}

impl Publisher for RecordingPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        if self.poison.as_ref() == Some(&message.payload) && !self.cured.load(Ordering::SeqCst) {
            return Err(PublishError::Transient(
                "the broker refused the poison".into(),
            ));
        }
        self.published
            .lock()
            .map_err(|_| PublishError::Transient("the recorder's lock is poisoned".into()))?
            .push(message.message_id);
        tokio::time::sleep(self.latency).await;
        Ok(())
    }
}
